//! Against the kernel: rdma-core's pingpongs between kernel Soft-RoCE (`rdma_rxe` in a QEMU
//! guest booted by `scripts/rxe-vm`, running the system's libibverbs) and softverbs (the same
//! programs over our `libibverbs.so.1`, on the host side of the guest's tap device), with each
//! side as server and as client. Everything runs in a network namespace the test creates.
//!
//! The test runs wherever a guest can boot (root, qemu-system-x86, linux-image-amd64 and
//! busybox-static, which scripts/setup-deps installs); elsewhere it says why and passes.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

/// The guest's and the tap's addresses (private to the test's namespace).
const GUEST: &str = "10.77.0.2";
const HOST: &str = "10.77.0.1";
const TAP: &str = "rxetap0";
/// Booting under software emulation takes 10-60 s depending on the machine's load.
const BOOT: Duration = Duration::from_secs(180);
/// One pingpong run.
const RUN: Duration = Duration::from_secs(60);

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/rxe-vm")
}

/// Whether a guest can boot here; if not, why.
fn vm_possible() -> Result<(), String> {
    let o = Command::new(script())
        .arg("check")
        .output()
        .map_err(|e| e.to_string())?;
    if o.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

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
    let mut vm = Vm(Command::new(script())
        .args(["run", "--netns", &ns.0, "--tap", TAP])
        .args([
            "--host-ip",
            &format!("{HOST}/24"),
            "--guest-ip",
            &format!("{GUEST}/24"),
        ])
        .args(["--timeout", "600", "--", "sh", "-c", &guest])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("start scripts/rxe-vm"));
    let (tx, rx) = mpsc::channel();
    let stdout = vm.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut log = String::new();
    let mut wait_for = |what: &str, limit: Duration| {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    log.push_str(&line);
                    log.push('\n');
                    // The console may put terminal escapes before a line.
                    if line.trim_end().ends_with(what) {
                        return;
                    }
                    assert!(
                        !line.contains("RXE-VM-EXIT"),
                        "the guest stopped before {what}:\n{log}"
                    );
                }
                Err(_) => panic!("no {what} from the guest within {limit:?}:\n{log}"),
            }
        }
    };
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
    let deadline = Instant::now() + RUN;
    let status = loop {
        if let Some(s) = vm.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "scripts/rxe-vm did not end:\n{log}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "scripts/rxe-vm: {status}\n{log}");
}

/// The guest's process group (the script, `timeout`, QEMU): killed whatever happens, so a
/// failed test leaves no emulator running.
struct Vm(std::process::Child);

impl Drop for Vm {
    fn drop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.0.wait();
    }
}
