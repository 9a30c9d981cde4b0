//! Against the kernel: rdma-core's pingpongs between kernel Soft-RoCE (`rdma_rxe` in a QEMU
//! guest booted by `scripts/rxe-vm`, running the system's libibverbs) and softverbs (the same
//! programs over our `libibverbs.so.1`, on the host side of the guest's tap device), with each
//! side as server and as client. Everything runs in a network namespace the test creates.
//!
//! The last steps move 64 KiB messages at MTU 1024 both ways while another process of ours
//! holds the standard port, so every packet from the kernel reaches the pingpong through the
//! holder's forwarding: none may be lost on the host (no sequence NAK from us, no socket
//! overflow in the namespace, nothing the holder failed to forward).
//!
//! The test runs wherever a guest can boot (root, qemu-system-x86, linux-image-amd64 and
//! busybox-static, which scripts/setup-deps installs); elsewhere it says why and passes.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::rxe_vm::{vm_possible, Vm, BOOT, GUEST, HOST, TAP};
use common::*;

/// One pingpong run.
const RUN: Duration = Duration::from_secs(60);

/// The 64 KiB steps send runs of packets to the guest as GSO batches (the default), whose
/// segments' ICRCs the kernel checks against the IPv4 IDs it numbers them with; the earlier
/// steps send one datagram per packet (`sendmmsg`), so that both paths meet kernel rxe.
const GSO: &[(&str, &str)] = &[];
const NO_GSO: &[(&str, &str)] = &[("SOFTVERBS_GSO", "0")];

/// A pingpong over our library in the namespace, on the tap's device, with `env` added.
fn ours(ns: &Netns, program: &str, args: &[&str], env: &[(&str, &str)]) -> Command {
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
    .env("SOFTVERBS_INTERFACES", TAP)
    .envs(env.iter().copied());
    c
}

/// Iterations of the 64 KiB pingpongs (64 packets a message each way).
const BIG_ITERS: &str = "100";

/// A process killed (and reaped) on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A counter of `rdma statistic show link rxe0/1` as the guest printed it on the line that
/// starts with `tag`.
fn rxe_counter(log: &str, tag: &str, name: &str) -> u64 {
    let line = log
        .lines()
        .rev()
        .find_map(|l| l.split_once(tag).map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no {tag} line from the guest:\n{log}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .windows(2)
        .find(|w| w[0] == name)
        .and_then(|w| w[1].parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {line:?}"))
}

/// The namespace's UDP counters `InErrors` and `RcvbufErrors` (`/proc/net/snmp`).
fn udp_errors(ns: &Netns) -> (u64, u64) {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &ns.0, "cat", "/proc/net/snmp"]);
    let o = run_bounded(c, Duration::from_secs(30));
    let (out, _) = text(&o);
    let mut udp = out.lines().filter(|l| l.starts_with("Udp: "));
    let (names, values) = (udp.next().expect("Udp header"), udp.next().expect("Udp values"));
    let get = |name: &str| {
        let i = names.split_whitespace().position(|n| n == name).unwrap();
        values.split_whitespace().nth(i).unwrap().parse::<u64>().unwrap()
    };
    (get("InErrors"), get("RcvbufErrors"))
}

/// The counters of the UDP driver of process `pid` (its `udp` block).
fn udp_block(pid: u32) -> softverbs_device::CounterSnapshot {
    softverbs_device::host_counters()
        .into_iter()
        .find(|p| p.pid == pid)
        .and_then(|p| {
            p.devices
                .into_iter()
                .find(|(n, _)| n == softverbs_device::stats::UDP_BLOCK)
        })
        .map(|(_, c)| c)
        .unwrap_or_else(|| panic!("no counters of process {pid}"))
}

/// Runs a client of ours until the guest's server accepts it (it may not listen yet).
fn client_until_accepted(ns: &Netns, program: &str, args: &[&str], env: &[(&str, &str)]) {
    let start = Instant::now();
    loop {
        let mut c = ours(ns, program, args, env);
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
         done
         echo STATS-BEFORE $(rdma statistic show link rxe0/1)
         echo STEP rc64-server; ibv_rc_pingpong -d rxe0 -g 1 -n {BIG_ITERS} -s 65536 -m 1024
         echo STEP rc64-client
         ok=; i=0
         while [ $i -lt 60 ]; do
           if ibv_rc_pingpong -d rxe0 -g 1 -n {BIG_ITERS} -s 65536 -m 1024 {HOST}; then ok=1; break; fi
           i=$((i + 1)); sleep 1
         done
         [ -n \"$ok\" ]
         echo STATS-AFTER $(rdma statistic show link rxe0/1)"
    );
    let mut vm = Vm::boot(&ns, &["sh", "-c", &guest], Duration::from_secs(600));
    let mut wait_for = |what: &str, limit: Duration| vm.wait_for(what, limit);
    wait_for("RXE-VM-READY", BOOT);
    wait_for("STEP rc-server", RUN);
    client_until_accepted(
        &ns,
        "/usr/bin/ibv_rc_pingpong",
        &["-n", "200", "-s", "8192"],
        NO_GSO,
    );
    wait_for("STEP ud-server", RUN);
    client_until_accepted(
        &ns,
        "/usr/bin/ibv_ud_pingpong",
        &["-n", "200", "-s", "1024"],
        NO_GSO,
    );
    wait_for("STEP srq-server", RUN);
    client_until_accepted(&ns, "/usr/bin/ibv_srq_pingpong", &["-n", "200"], NO_GSO);
    for step in ["rc", "ud"] {
        wait_for(&format!("STEP {step}-client"), RUN);
        let program = format!("/usr/bin/ibv_{step}_pingpong");
        let o = run_bounded(ours(&ns, &program, &["-n", "200"], NO_GSO), RUN);
        let (out, err) = text(&o);
        assert!(
            o.status.success(),
            "{program} server of ours, kernel rxe client:\n{out}\n{err}"
        );
        assert!(out.contains("200 iters"), "{out}");
    }

    // Another process of ours takes the standard port (it waits for a pingpong client that
    // never comes); the pingpongs get the next slot and their packets from the kernel are
    // forwarded to them.
    let mut holder = ours(&ns, "/usr/bin/ibv_rc_pingpong", &["-p", "18600"], &[]);
    holder.stdout(Stdio::null()).stderr(Stdio::null());
    let holder = Killed(holder.spawn().expect("start the port holder"));
    let start = Instant::now();
    // It listens once its QP (and so its UDP driver) exists.
    while !pid_listening(holder.0.id(), 18600) {
        assert!(start.elapsed() < RUN, "the port holder did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let udp_before = udp_errors(&ns);
    let big = ["-n", BIG_ITERS, "-s", "65536", "-m", "1024"];
    vm.wait_for("STEP rc64-server", RUN);
    client_until_accepted(&ns, "/usr/bin/ibv_rc_pingpong", &big, GSO);
    vm.wait_for("STEP rc64-client", RUN);
    let o = run_bounded(ours(&ns, "/usr/bin/ibv_rc_pingpong", &big, GSO), RUN);
    let (out, err) = text(&o);
    assert!(
        o.status.success() && out.contains(&format!("{BIG_ITERS} iters")),
        "64 KiB pingpong server of ours, kernel rxe client:\n{out}\n{err}"
    );
    let forwarding = udp_block(holder.0.id());
    drop(holder);
    let udp_after = udp_errors(&ns);
    vm.wait_for("RXE-VM-EXIT 0", RUN);
    // What the kernel counted during the 64 KiB steps: sequence NAKs it received are ours.
    let rxe =
        |name: &str| rxe_counter(&vm.log, "STATS-AFTER", name) - rxe_counter(&vm.log, "STATS-BEFORE", name);
    let (naks_from_us, rxe_sent) = (rxe("rcvd_seq_err"), rxe("sent_pkts"));
    // Our 64-packet messages leave as GSO batches (`GSO`), whose segments carry IPv4 IDs
    // 1, 2, ...: a
    // segment whose ICRC did not cover its ID would be dropped by the kernel, and the next one
    // would arrive out of sequence.
    let (rxe_received, out_of_seq) = (rxe("rcvd_pkts"), rxe("out_of_seq_request"));
    eprintln!(
        "64 KiB pingpongs: kernel sent {rxe_sent} packets, the holder forwarded {} ({} through \
         mailboxes, {} lost), its sockets dropped {}; our sequence NAKs {naks_from_us}; \
         namespace UDP InErrors/RcvbufErrors {udp_before:?} -> {udp_after:?}; kernel received \
         {rxe_received} packets, {out_of_seq} out of sequence",
        forwarding.forwarded, forwarding.forwarded_shm, forwarding.forward_drops, forwarding.rx_socket_drops,
    );
    assert!(
        rxe_received >= 2 * 64 * BIG_ITERS.parse::<u64>().unwrap(),
        "the kernel received our messages: {rxe_received} packets"
    );
    assert_eq!(out_of_seq, 0, "the kernel dropped packets of ours:\n{}", vm.log);
    assert!(
        forwarding.forwarded >= 2 * 64 * BIG_ITERS.parse::<u64>().unwrap(),
        "the kernel's data went through the holder: {forwarding:?}"
    );
    assert_eq!(forwarding.forwarded_shm, forwarding.forwarded, "{forwarding:?}");
    assert_eq!(
        (forwarding.forward_drops, forwarding.rx_socket_drops),
        (0, 0),
        "{forwarding:?}"
    );
    assert_eq!(udp_after, udp_before, "no UDP datagram was dropped on the host");
    assert_eq!(
        naks_from_us, 0,
        "a packet that reached the host was lost:\n{}",
        vm.log
    );
    let status = vm.wait_exit(RUN);
    assert!(status.success(), "scripts/rxe-vm: {status}\n{}", vm.log);
}
