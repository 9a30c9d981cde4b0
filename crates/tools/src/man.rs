//! Every tool's `--help` is a man page: NAME, SYNOPSIS, DESCRIPTION, OPTIONS (with ARGUMENTS
//! before them where the tool takes operands), then ENVIRONMENT, EXAMPLES and EXIT STATUS.
//!
//! A tool sets, in its `#[command(...)]`: `about` (the NAME line, lower case, no full stop),
//! `long_about = None` (so that NAME stays that one line in `--help` too), `before_help` (the
//! DESCRIPTION, indented by four spaces), `after_help` ([`SEE_LONG_HELP`]), `after_long_help`
//! ([`sections`]) and `help_template` ([`PAGE`], [`PAGE_WITH_OPERANDS`] or [`PAGE_WITH_COMMANDS`]). `-h` shows the
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

/// The help template of a tool with subcommands.
pub const PAGE_WITH_COMMANDS: &str = "\
NAME
    {name} - {about}

SYNOPSIS
    {usage}

DESCRIPTION
{before-help}COMMANDS
{subcommands}

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

/// The headings a page may have, in the order they come.
const HEADINGS: [&str; 12] = [
    "NAME",
    "SYNOPSIS",
    "DESCRIPTION",
    "ARGUMENTS",
    "COMMANDS",
    "OPTIONS",
    "ENVIRONMENT",
    "EXAMPLES",
    "EXIT STATUS",
    "NOTES",
    "SEE ALSO",
    "",
];

/// Checks that `text`, the `--help` of `tool` (or of `"tool command"`), is laid out as a man
/// page: headings at the start of their lines, in the order of the pages here, each with text
/// under it; NAME naming the tool (`tool-command`); SYNOPSIS and every EXAMPLES command running
/// it (after any `VAR=value` assignments).
/// Returns the headings, in order.
pub fn check_page(tool: &str, text: &str) -> Result<Vec<&'static str>, String> {
    let mut found: Vec<&'static str> = Vec::new();
    let mut body: Vec<Vec<&str>> = Vec::new();
    for line in text.lines() {
        if !line.starts_with(' ') && !line.is_empty() {
            let Some(h) = HEADINGS.iter().find(|h| **h == line && !h.is_empty()) else {
                return Err(format!("{line:?} is neither a heading nor indented"));
            };
            found.push(h);
            body.push(Vec::new());
        } else if let Some(b) = body.last_mut() {
            if !line.trim().is_empty() {
                b.push(line);
            }
        } else {
            return Err(format!("{line:?} comes before NAME"));
        }
    }
    let order = |h: &str| HEADINGS.iter().position(|x| *x == h);
    if !found.windows(2).all(|w| order(w[0]) < order(w[1])) {
        return Err(format!("headings out of order: {found:?}"));
    }
    for required in [
        "NAME",
        "SYNOPSIS",
        "DESCRIPTION",
        "OPTIONS",
        "EXAMPLES",
        "EXIT STATUS",
    ] {
        if !found.contains(&required) {
            return Err(format!("no {required} in {found:?}"));
        }
    }
    if let Some(empty) = found.iter().zip(&body).find(|(_, b)| b.is_empty()) {
        return Err(format!("{} is empty", empty.0));
    }
    let section = |h: &str| &body[found.iter().position(|x| *x == h).unwrap()];
    // A subcommand ("tool command") is named "tool-command", as clap and git name them.
    let page_name = tool.replace(' ', "-");
    let name = section("NAME");
    if name.len() != 1 || !name[0].trim_start().starts_with(&format!("{page_name} - ")) {
        return Err(format!("NAME is not \"{page_name} - ...\": {name:?}"));
    }
    if !section("SYNOPSIS")
        .iter()
        .all(|l| l.trim_start().starts_with(tool))
    {
        return Err(format!("SYNOPSIS does not start with {tool}"));
    }
    let tool_words: Vec<&str> = tool.split(' ').collect();
    for command in section("EXAMPLES").iter().filter(|l| !l.starts_with("     ")) {
        let words: Vec<&str> = command
            .split_whitespace()
            .skip_while(|w| w.contains('='))
            .collect();
        if !words.starts_with(&tool_words) {
            return Err(format!("the example {command:?} does not run {tool}"));
        }
    }
    Ok(found)
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

    #[test]
    fn check_page_finds_what_a_page_lacks() {
        let good = "NAME\n    t - a tool\n\nSYNOPSIS\n    t [OPTIONS]\n\nDESCRIPTION\n    Does.\n\n\
                    OPTIONS\n  -h, --help\n\nEXAMPLES\n    X=1 t -h\n        Helps.\n\nEXIT STATUS\n    0\n";
        assert_eq!(
            check_page("t", good),
            Ok(vec![
                "NAME",
                "SYNOPSIS",
                "DESCRIPTION",
                "OPTIONS",
                "EXAMPLES",
                "EXIT STATUS"
            ])
        );
        let bad = [
            (good.replace("EXIT STATUS\n    0\n", ""), "no EXIT STATUS"),
            (good.replace("    t - a tool", "    u - a tool"), "NAME is not"),
            (good.replace("X=1 t -h", "u -h"), "does not run t"),
            (good.replace("    Does.\n", ""), "DESCRIPTION is empty"),
            (good.replace("NAME\n    t - a tool\n\n", ""), "no NAME"),
            (
                good.replace("SYNOPSIS\n    t [OPTIONS]\n\n", "")
                    .replace("OPTIONS\n", "SYNOPSIS\n    t\n\nOPTIONS\n"),
                "out of order",
            ),
            (good.replace("OPTIONS\n", "Options:\n"), "neither a heading"),
        ];
        let sub = good
            .replace("    t - a tool", "    t-sub - a command")
            .replace("    t [OPTIONS]", "    t sub [OPTIONS]")
            .replace("X=1 t -h", "t sub -h");
        assert!(
            check_page("t sub", &sub).is_ok(),
            "{:?}",
            check_page("t sub", &sub)
        );
        assert!(
            check_page("t sub", good).is_err(),
            "the tool's page is not the command's"
        );
        for (page, why) in bad {
            let e = check_page("t", &page).unwrap_err();
            assert!(e.contains(why), "{e} (wanted {why})");
        }
    }
}
