//! The man-page conventions through the real `<infiniband/verbs.h>`: each program in `tests/c`
//! is compiled with gcc against the system header and linked against our library, then run; it
//! prints one line per check (see each file for the list) and fails if any check fails.
//!
//! - `verbs_api.c`: the verbs of rdma-core 44 and their return/errno conventions;
//! - `extensions.c`: ATOMIC WRITE, completion timestamps and on-demand paging.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// Compiles `tests/c/<name>.c`, runs it, and checks that at least `min_checks` checks ran and
/// none failed.
fn run_c_program(name: &str, min_checks: usize) {
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
    let o = run_bounded(command(exe.to_str().unwrap()), Duration::from_secs(120));
    let (stdout, stderr) = text(&o);
    println!("{stdout}");
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("\n0 failed"), "{stdout}");
    let checks = stdout.lines().filter(|l| l.starts_with("ok - ")).count();
    assert!(checks >= min_checks, "only {checks} checks ran:\n{stdout}");
}

#[test]
fn verbs_api_conformance() {
    run_c_program("verbs_api", 80);
}

#[test]
fn atomic_write_timestamps_and_odp() {
    run_c_program("extensions", 55);
}

/// Raw packet QPs, flows, WQs and RSS through the header's inline wrappers
/// (`tests/c/raw_packet.c`), then the same program without CAP_NET_RAW (`setpriv`), where raw
/// and RSS QPs are EPERM.
#[test]
fn raw_packet_conformance() {
    require("gcc");
    require("setpriv");
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/raw_packet.c");
    let exe = lib_dir().join("raw_packet");
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
    // In a network namespace of its own, whose loopback carries only this program's frames
    // (the host's is shared with everything else that runs).
    require("unshare");
    let mut isolated = command("unshare");
    isolated
        .args(["-n", "sh", "-c", "ip link set lo up && exec \"$0\""])
        .arg(&exe);
    let o = run_bounded(isolated, Duration::from_secs(120));
    let (stdout, stderr) = text(&o);
    println!("{stdout}");
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("\n0 failed"), "{stdout}");
    let checks = stdout.lines().filter(|l| l.starts_with("ok - ")).count();
    assert!(checks >= 40, "only {checks} checks ran:\n{stdout}");

    let mut noperm = command("setpriv");
    noperm
        .args(["--inh-caps=-all", "--bounding-set=-net_raw"])
        .arg(&exe)
        .arg("noperm");
    let o = run_bounded(noperm, Duration::from_secs(60));
    let (stdout, stderr) = text(&o);
    println!("{stdout}");
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("\n0 failed"), "{stdout}");
    for check in [
        "raw QP without CAP_NET_RAW: NULL, EPERM",
        "RSS QP without CAP_NET_RAW: NULL, EPERM",
    ] {
        assert!(stdout.contains(&format!("ok - {check}")), "{stdout}");
    }
}
