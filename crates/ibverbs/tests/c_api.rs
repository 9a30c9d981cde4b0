//! The man-page conventions through the real `<infiniband/verbs.h>`: each program in `tests/c`
//! is compiled with gcc against the system header and linked against our library, then run; it
//! prints one line per check (see each file for the list) and fails if any check fails.
//!
//! - `verbs_api.c`: the verbs of rdma-core 44 and their return/errno conventions;
//! - `extensions.c`: ATOMIC WRITE, completion timestamps and on-demand paging;
//! - `misc_verbs.c`: CQ moderation, null MRs, flow counters, rate limits and the verbs that stay
//!   EOPNOTSUPP (ECE, ESP flow actions);
//! - `raw_packet.c`: raw packet QPs, flows, WQs and RSS;
//! - `ud_flow.c`: flow rules on UD QPs, with RoCEv2 UD traffic on the loopback device;
//! - `limits.c`: every limit is an errno from the verb (objects, queue depths, QP numbers,
//!   descriptors), and repeated device listing does not grow memory.
//!
//! `check.h` holds the CHECK/REQUIRE reporting they share.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// Compiles `tests/c/<name>.c` against the system header and our library; returns the program.
fn compile(name: &str) -> std::path::PathBuf {
    require("gcc");
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let exe = lib_dir().join(name);
    let out = Command::new("gcc")
        .args(["-Wall", "-Werror", "-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-L")
        .arg(lib_dir())
        .arg("-libverbs")
        .output()
        .expect("gcc runs");
    assert!(
        out.status.success(),
        "gcc failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// Runs a compiled program and checks that none of its checks failed and at least
/// `min_checks` ran; returns its output.
fn expect_passes(cmd: Command, min_checks: usize) -> String {
    let o = run_bounded(cmd, Duration::from_secs(120));
    let (stdout, stderr) = text(&o);
    println!("{stdout}");
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("\n0 failed"), "{stdout}");
    let checks = stdout.lines().filter(|l| l.starts_with("ok - ")).count();
    assert!(checks >= min_checks, "only {checks} checks ran:\n{stdout}");
    stdout
}

/// `exe` in a network namespace of its own, whose loopback carries only this program's frames
/// (the host's is shared with everything else that runs).
fn isolated(exe: &std::path::Path) -> Command {
    require("unshare");
    let mut c = command("unshare");
    c.args(["-n", "sh", "-c", "ip link set lo up && exec \"$0\""])
        .arg(exe);
    c
}

#[test]
fn verbs_api_conformance() {
    let exe = compile("verbs_api");
    expect_passes(command(exe.to_str().unwrap()), 80);
}

#[test]
fn atomic_write_timestamps_and_odp() {
    let exe = compile("extensions");
    expect_passes(command(exe.to_str().unwrap()), 55);
}

/// `tests/c/misc_verbs.c`, in a network namespace of its own so that the loopback carries only
/// its counted frames.
#[test]
fn cq_moderation_null_mr_counters_and_unoffered_verbs() {
    let exe = compile("misc_verbs");
    expect_passes(isolated(&exe), 60);
}

/// Raw packet QPs, flows, WQs and RSS through the header's inline wrappers
/// (`tests/c/raw_packet.c`), then the same program without CAP_NET_RAW (`setpriv`), where raw
/// and RSS QPs are EPERM.
#[test]
fn raw_packet_conformance() {
    require("setpriv");
    let exe = compile("raw_packet");
    expect_passes(isolated(&exe), 40);

    let mut noperm = command("setpriv");
    noperm
        .args(["--inh-caps=-all", "--bounding-set=-net_raw"])
        .arg(&exe)
        .arg("noperm");
    let stdout = expect_passes(noperm, 2);
    for check in [
        "raw QP without CAP_NET_RAW: NULL, EPERM",
        "RSS QP without CAP_NET_RAW: NULL, EPERM",
    ] {
        assert!(stdout.contains(&format!("ok - {check}")), "{stdout}");
    }
}

/// Flow rules on UD QPs (`tests/c/ud_flow.c`), in a network namespace of its own so that the
/// sniffer sees only this program's datagrams.
#[test]
fn ud_flow_conformance() {
    let exe = compile("ud_flow");
    expect_passes(isolated(&exe), 27);
}

/// `tests/c/limits.c` in its three modes, each with the limits it needs (see the file). The
/// program guards itself with an alarm, so a verb that hangs fails the check instead of the
/// whole test run.
#[test]
fn every_limit_is_an_errno_and_listing_does_not_grow() {
    let exe = compile("limits");
    let modes = [
        (
            "objects",
            Some(
                "max_pd=2,max_cq=2,max_qp=2,max_mr=2,max_mw=1,max_srq=1,max_ah=1,max_cqe=64,\
             max_qp_wr=32,max_sge=2,max_mcast_grp=1,max_mcast_qp_attach=1",
            ),
            45,
        ),
        ("qpn", Some("max_qp=70000"), 11),
        ("listing", None, 1),
    ];
    for (mode, limits, min_checks) in modes {
        let mut cmd = command(exe.to_str().unwrap());
        cmd.arg(mode).env("SOFTVERBS_INTERFACES", "lo");
        match limits {
            Some(l) => cmd.env("SOFTVERBS_LIMITS", l),
            None => cmd.env_remove("SOFTVERBS_LIMITS"),
        };
        expect_passes(cmd, min_checks);
    }
}
