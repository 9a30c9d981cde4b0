//! Every tool's `--help` is a man page (NAME, SYNOPSIS, DESCRIPTION, OPTIONS, ENVIRONMENT
//! where the tool opens a device, EXAMPLES, EXIT STATUS), and `-h` is its short form.

use std::process::Command;

use softverbs_tools::man::check_page;

/// Each tool, and whether it opens a device (and so documents the environment).
const TOOLS: [(&str, &str, bool); 10] = [
    ("ibv_devices", env!("CARGO_BIN_EXE_ibv_devices"), true),
    ("ibv_devinfo", env!("CARGO_BIN_EXE_ibv_devinfo"), true),
    ("ibv_asyncwatch", env!("CARGO_BIN_EXE_ibv_asyncwatch"), true),
    ("ibv_rc_pingpong", env!("CARGO_BIN_EXE_ibv_rc_pingpong"), true),
    ("ibv_uc_pingpong", env!("CARGO_BIN_EXE_ibv_uc_pingpong"), true),
    ("ibv_ud_pingpong", env!("CARGO_BIN_EXE_ibv_ud_pingpong"), true),
    ("ibv_srq_pingpong", env!("CARGO_BIN_EXE_ibv_srq_pingpong"), true),
    ("ibv_xsrq_pingpong", env!("CARGO_BIN_EXE_ibv_xsrq_pingpong"), true),
    ("softverbs-demo", env!("CARGO_BIN_EXE_softverbs-demo"), true),
    ("softverbs-stat", env!("CARGO_BIN_EXE_softverbs-stat"), false),
];

fn help(bin: &str, flag: &str) -> String {
    let o = Command::new(bin).arg(flag).output().expect("run the tool");
    assert!(o.status.success(), "{bin} {flag}: {o:?}");
    assert!(
        o.stderr.is_empty(),
        "{bin} {flag}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).expect("UTF-8")
}

#[test]
fn every_tool_has_a_man_page_help() {
    for (tool, bin, opens_device) in TOOLS {
        let page = help(bin, "--help");
        let headings = check_page(tool, &page).unwrap_or_else(|e| panic!("{tool} --help: {e}\n{page}"));
        assert_eq!(
            headings.contains(&"ENVIRONMENT"),
            opens_device,
            "{tool}: {headings:?}"
        );
        if opens_device {
            assert!(page.contains("    SOFTVERBS_INTERFACES\n"), "{tool}:\n{page}");
        }
        // The ping-pongs' HOST is described on its own, before the options.
        let synopsis = page.lines().nth(4).unwrap_or_default();
        assert_eq!(
            headings.contains(&"ARGUMENTS"),
            synopsis.contains("[HOST]"),
            "{tool}: {synopsis}"
        );
        assert!(
            page.contains("  -h, --help") && page.contains("  -V, --version"),
            "{tool}"
        );
    }
}

#[test]
fn dash_h_is_the_short_form() {
    for (tool, bin, _) in TOOLS {
        let short = help(bin, "-h");
        for heading in ["NAME\n", "SYNOPSIS\n", "DESCRIPTION\n", "OPTIONS\n"] {
            assert!(short.contains(heading), "{tool} -h lacks {heading}{short}");
        }
        assert!(!short.contains("EXAMPLES\n"), "{tool} -h:\n{short}");
        assert!(short.contains("Run with --help"), "{tool} -h:\n{short}");
        assert!(
            short.lines().count() < help(bin, "--help").lines().count(),
            "{tool}"
        );
    }
}
