//! The benchmark tools' `--help` is a man page, as every tool's is (see
//! `softverbs_tools::man`).

use std::process::Command;

use softverbs_tools::man::check_page;

#[test]
fn every_benchmark_tool_has_a_man_page_help() {
    for (tool, bin, opens_device) in [
        ("softverbs-perf", env!("CARGO_BIN_EXE_softverbs-perf"), true),
        ("softverbs-scale", env!("CARGO_BIN_EXE_softverbs-scale"), true),
        (
            "softverbs-baseline",
            env!("CARGO_BIN_EXE_softverbs-baseline"),
            false,
        ),
    ] {
        let o = Command::new(bin).arg("--help").output().expect("run the tool");
        assert!(o.status.success(), "{tool}: {o:?}");
        let page = String::from_utf8(o.stdout).expect("UTF-8");
        let headings = check_page(tool, &page).unwrap_or_else(|e| panic!("{tool} --help: {e}\n{page}"));
        assert_eq!(
            headings.contains(&"ENVIRONMENT"),
            opens_device,
            "{tool}: {headings:?}"
        );
    }
    let o = Command::new(env!("CARGO_BIN_EXE_softverbs-baseline"))
        .arg("--help")
        .output()
        .expect("run softverbs-baseline");
    let page = String::from_utf8_lossy(&o.stdout);
    assert!(page.contains("COMMANDS\n  udp-lat"), "{page}");
    for command in ["udp-lat", "udp-gso", "vm-writev"] {
        let o = Command::new(env!("CARGO_BIN_EXE_softverbs-baseline"))
            .args([command, "--help"])
            .output()
            .expect("run softverbs-baseline");
        assert!(o.status.success(), "{command}: {o:?}");
        let page = String::from_utf8(o.stdout).expect("UTF-8");
        let tool = format!("softverbs-baseline {command}");
        check_page(&tool, &page).unwrap_or_else(|e| panic!("{tool} --help: {e}\n{page}"));
    }
}
