//! Every tool's `--help` is a man page: NAME, SYNOPSIS, DESCRIPTION, OPTIONS (with ARGUMENTS
//! before them where the tool takes operands), then ENVIRONMENT, EXAMPLES and EXIT STATUS.
//!
//! A tool sets, in its `#[command(...)]`: `about` (the NAME line, lower case, no full stop),
//! `long_about = None` (so that NAME stays that one line in `--help` too), `before_help` (the
//! DESCRIPTION, indented by four spaces), `after_help` ([`SEE_LONG_HELP`]), `after_long_help`
//! ([`sections`]) and `help_template` ([`PAGE`] or [`PAGE_WITH_OPERANDS`]). `-h` shows the
//! short form: NAME, SYNOPSIS, DESCRIPTION and one line per option.

/// The help template of a tool without operands.
pub const PAGE: &str = "\
NAME
    {name} - {about}

SYNOPSIS
    {usage}

DESCRIPTION
{before-help}OPTIONS
{options}{after-help}";

/// The help template of a tool with operands (such as a ping-pong's HOST).
pub const PAGE_WITH_OPERANDS: &str = "\
NAME
    {name} - {about}

SYNOPSIS
    {usage}

DESCRIPTION
{before-help}ARGUMENTS
{positionals}

OPTIONS
{options}{after-help}";

/// What `-h` says after the options.
pub const SEE_LONG_HELP: &str = "Run with --help for the environment, examples and exit status.";

/// The variables that decide which devices exist and how they reach peers: every tool that
/// opens a device reads them (as every program on softverbs does).
pub const DEVICE_ENVIRONMENT: &[(&str, &str)] = &[
    (
        "SOFTVERBS_INTERFACES",
        "Comma-separated network interfaces that become devices (sv_<interface>);\n\
         default: every interface with an IP address, loopback included.",
    ),
    (
        "SOFTVERBS_UDP_PORT",
        "The RoCEv2 UDP port (default 4791). Each process takes a slot above it.",
    ),
    (
        "SOFTVERBS_UDP_SLOTS",
        "How many ports above SOFTVERBS_UDP_PORT processes may take (1..=255, default 255).",
    ),
    (
        "SOFTVERBS_LIMITS",
        "Comma-separated name=value overrides of device limits, e.g. max_qp=64,max_cqe=1024.",
    ),
    (
        "SOFTVERBS_SHM",
        "0 turns off the shared-memory path between processes of one user on one host\n\
         (they then talk over UDP, as processes on different hosts do).",
    ),
];

/// The exit status of the ping-pong tests, as rdma-core's.
pub const PINGPONG_EXIT_STATUS: &str = "\
0 when every exchange completed; 1 when an argument is invalid, the device cannot be opened,
the peer cannot be reached, a completion fails or (with --timeout) does not arrive in time.";

/// Formats what follows OPTIONS (clap puts a blank line before it): ENVIRONMENT (left out when `environment` is empty), EXAMPLES
/// (`(command, what it does)` pairs) and EXIT STATUS. Texts may span several lines; each is
/// indented under its heading.
pub fn sections(environment: &[(&str, &str)], examples: &[(&str, &str)], exit_status: &str) -> String {
    fn indented(out: &mut String, text: &str, by: usize) {
        for line in text.lines() {
            out.push_str(&" ".repeat(by));
            out.push_str(line.trim_start());
            out.push('\n');
        }
    }
    let mut out = String::new();
    if !environment.is_empty() {
        out.push_str("ENVIRONMENT\n");
        for (i, (name, text)) in environment.iter().enumerate() {
            if i > 0 {
                out.push('\n');
            }
            indented(&mut out, name, 4);
            indented(&mut out, text, 8);
        }
    }
    if !environment.is_empty() {
        out.push('\n');
    }
    out.push_str("EXAMPLES\n");
    for (i, (command, what)) in examples.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        indented(&mut out, command, 4);
        indented(&mut out, what, 8);
    }
    out.push_str("\nEXIT STATUS\n");
    indented(&mut out, exit_status, 4);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_indent_every_line_under_its_heading() {
        let s = sections(
            &[("VAR", "first line\n   second line")],
            &[("tool -x", "does x"), ("tool -y", "does y")],
            "0 on success",
        );
        assert_eq!(
            s,
            "ENVIRONMENT\n    VAR\n        first line\n        second line\n\
             \nEXAMPLES\n    tool -x\n        does x\n\n    tool -y\n        does y\n\
             \nEXIT STATUS\n    0 on success\n"
        );
        assert!(!sections(&[], &[("t", "u")], "0").contains("ENVIRONMENT"));
    }
}
