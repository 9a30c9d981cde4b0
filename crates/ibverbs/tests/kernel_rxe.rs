//! Against the kernel: rdma-core's pingpongs between kernel Soft-RoCE (`rdma_rxe` in a QEMU
//! guest booted by `scripts/rxe-vm`, running the system's libibverbs) and softverbs (the same
//! programs over our `libibverbs.so.1`, on the host side of the guest's tap device), with each
//! side as server and as client. Everything runs in a network namespace the test creates.
//!
//! The test runs wherever a guest can boot (root, qemu-system-x86, linux-image-amd64 and
//! busybox-static, which scripts/setup-deps installs); elsewhere it says why and passes.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::rxe_vm::{vm_possible, Vm, BOOT, GUEST, HOST, TAP};
use common::*;

/// One pingpong run.
const RUN: Duration = Duration::from_secs(60);

/// A pingpong over our library in the namespace, on the tap's device.
fn ours(ns: &Netns, program: &str, args: &[&str]) -> Command {
    let mut c = command("ip");
    c.args([
        "netns",
        "exec",
        &ns.0,
        program,
        "-d",
        &format!("sv_{TAP}"),
        "-g",
        "1",
    ])
    .args(args)
    .env("SOFTVERBS_INTERFACES", TAP);
    c
}

/// Runs a client of ours until the guest's server accepts it (it may not listen yet).
fn client_until_accepted(ns: &Netns, program: &str, args: &[&str]) {
    let start = Instant::now();
    loop {
        let mut c = ours(ns, program, args);
        c.arg(GUEST);
        let o = run_bounded(c, RUN);
        if o.status.success() {
            return;
        }
        let (out, err) = text(&o);
        assert!(
            start.elapsed() < RUN && err.contains("Couldn't connect"),
            "{program} {args:?} against kernel rxe failed:\n{out}\n{err}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn rdma_core_pingpongs_between_kernel_rxe_and_softverbs() {
    if let Err(why) = vm_possible() {
        eprintln!("kernel rxe guest cannot run here, not tested: {why}");
        return;
    }
    require("/usr/bin/ibv_rc_pingpong");
    let ns = Netns::new("rxe");
    // The guest serves the RC, UD and SRQ pingpongs, then is the RC and UD client of ours.
    let guest = format!(
        "set -e
         echo STEP rc-server; ibv_rc_pingpong -d rxe0 -g 1 -n 200 -s 8192
         echo STEP ud-server; ibv_ud_pingpong -d rxe0 -g 1 -n 200 -s 1024
         echo STEP srq-server; ibv_srq_pingpong -d rxe0 -g 1 -n 200
         for step in rc ud; do
           echo STEP $step-client
           ok=; i=0
           while [ $i -lt 60 ]; do
             if ibv_${{step}}_pingpong -d rxe0 -g 1 -n 200 {HOST}; then ok=1; break; fi
             i=$((i + 1)); sleep 1
           done
           [ -n \"$ok\" ]
         done"
    );
    let mut vm = Vm::boot(&ns, &["sh", "-c", &guest], Duration::from_secs(600));
    let mut wait_for = |what: &str, limit: Duration| vm.wait_for(what, limit);
    wait_for("RXE-VM-READY", BOOT);
    wait_for("STEP rc-server", RUN);
    client_until_accepted(&ns, "/usr/bin/ibv_rc_pingpong", &["-n", "200", "-s", "8192"]);
    wait_for("STEP ud-server", RUN);
    client_until_accepted(&ns, "/usr/bin/ibv_ud_pingpong", &["-n", "200", "-s", "1024"]);
    wait_for("STEP srq-server", RUN);
    client_until_accepted(&ns, "/usr/bin/ibv_srq_pingpong", &["-n", "200"]);
    for step in ["rc", "ud"] {
        wait_for(&format!("STEP {step}-client"), RUN);
        let program = format!("/usr/bin/ibv_{step}_pingpong");
        let o = run_bounded(ours(&ns, &program, &["-n", "200"]), RUN);
        let (out, err) = text(&o);
        assert!(
            o.status.success(),
            "{program} server of ours, kernel rxe client:\n{out}\n{err}"
        );
        assert!(out.contains("200 iters"), "{out}");
    }
    wait_for("RXE-VM-EXIT 0", RUN);
    let status = vm.wait_exit(RUN);
    assert!(status.success(), "scripts/rxe-vm: {status}\n{}", vm.log);
}
