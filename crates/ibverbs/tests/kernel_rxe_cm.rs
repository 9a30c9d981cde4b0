//! Against the kernel's connection manager: rdmacm-utils between the `scripts/rxe-vm` guest
//! (kernel Soft-RoCE with the kernel's `ib_cm`/`rdma_cm`, rdma-core's librdmacm, libibverbs and
//! rxe provider) and softverbs on the host side of the guest's tap (the same programs over our
//! `librdmacm.so.1` and `libibverbs.so.1`), each side as server and as client:
//!
//! * `rping -v -V` (RDMA READ and WRITE, data checked; the client disconnects first), also
//!   with `-q` (the programs move their own QPs: CONNECT_RESPONSE and `rdma_establish`);
//! * `ucmatose` with several connections and messages each way (the server disconnects
//!   first);
//! * `udaddy` with several UD connections through SIDR;
//! * requests to ports nobody listens on: REJECTED with reason 8 (RC) or UNREACHABLE with SIDR
//!   status 1 (UD), answered by the kernel's CM for our clients and by ours for the kernel's.
//!
//! One guest boot serves every scenario: the guest runs a shell on a TCP port that the test
//! drives, waiting for the kernel's listeners with `rdma res show cm_id`. tcpdump captures the
//! tap throughout, and tshark checks that every CM request and disconnect request was
//! answered in its transaction, from both sides, with QP1's P_Key, Q_Key and source QP.
//!
//! The test runs wherever a guest can boot (root, qemu-system-x86, linux-image-amd64 and
//! busybox-static, which scripts/setup-deps installs); elsewhere it says why and passes.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::rxe_vm::{vm_possible, Vm, BOOT, GUEST, HOST, TAP};
use common::*;

/// The port of the guest's shell.
const SHELL: u16 = 5000;
/// One program run, on either side.
const RUN: Duration = Duration::from_secs(90);
/// The ports rdmacm-utils use by default, and one nobody listens on.
const RPING_PORT: u16 = 7174;
const UCMATOSE_PORT: u16 = 7471;
const UDADDY_PORT: u16 = 7174;
const NOBODY: u16 = 7999;

/// A directory with our `librdmacm.so.1` and `libibverbs.so.1` (cargo builds both for this
/// test run: the rdmacm crate is a dev-dependency).
fn libs() -> PathBuf {
    let dir = lib_dir().to_path_buf();
    let built = built_library().with_file_name("librdmacm.so");
    assert!(built.exists(), "{} not built", built.display());
    let link = dir.join("librdmacm.so.1");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&built, &link).unwrap();
    dir
}

/// `program args` over our libraries, in the namespace, on the tap's device.
fn our_program(ns: &Netns, libs: &Path, program: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &ns.0, "env"])
        .arg(format!("LD_LIBRARY_PATH={}", libs.display()))
        .arg(format!("SOFTVERBS_INTERFACES={TAP}"))
        .args(["stdbuf", "-oL", program])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn both(o: &Output) -> String {
    let (out, err) = text(o);
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        brief(&out),
        brief(&err)
    )
}

/// `out` with long lines (rping's pings) cut, for messages.
fn brief(out: &str) -> String {
    out.lines()
        .map(|l| {
            if l.len() > 100 {
                format!("{}...", &l[..100])
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The guest's shell: each command is one TCP connection to `busybox nc -ll -e /bin/sh`, made
/// from a thread inside the test's namespace.
struct Guest<'a> {
    ns: &'a Netns,
}

impl Guest<'_> {
    fn connect(&self) -> std::io::Result<TcpStream> {
        let path = format!("/run/netns/{}", self.ns.0);
        let addr = SocketAddr::new(GUEST.parse().unwrap(), SHELL);
        std::thread::scope(|s| {
            s.spawn(|| {
                let f = std::fs::File::open(&path)?;
                nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)?;
                TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            })
            .join()
            .unwrap()
        })
    }

    /// Runs `script` in a guest shell and returns what it printed (stdout and stderr).
    fn sh(&self, script: &str, limit: Duration) -> String {
        let mut c = self.connect().expect("connect to the guest's shell");
        c.set_read_timeout(Some(limit)).unwrap();
        c.write_all(format!("exec 2>&1\n{script}\n").as_bytes()).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        let mut out = Vec::new();
        if let Err(e) = c.read_to_end(&mut out) {
            panic!(
                "guest command {script:?}: {e} after {limit:?}; so far:\n{}",
                String::from_utf8_lossy(&out)
            );
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Waits until the shell answers.
    fn wait_shell(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.connect().is_err() {
            assert!(Instant::now() < deadline, "the guest's shell did not come up");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Starts `cmd` in the background; its stdout and stderr go to `/tmp/<name>.out` and
    /// `.err` (one file for both loses lines of rping's), then `exit <status>` to `.err`.
    fn spawn(&self, name: &str, cmd: &str) {
        let secs = RUN.as_secs();
        self.sh(
            &format!(
                "( timeout {secs} {cmd} > /tmp/{name}.out 2> /tmp/{name}.err; echo \"exit $?\" >> /tmp/{name}.err ) \
                 < /dev/null > /dev/null 2>&1 &"
            ),
            Duration::from_secs(30),
        );
    }

    /// What the background command `name` printed so far.
    fn log(&self, name: &str) -> String {
        self.sh(
            &format!("cat /tmp/{name}.out /tmp/{name}.err"),
            Duration::from_secs(30),
        )
    }

    /// Waits for the end of the background command `name`; its status and output.
    fn finish(&self, name: &str) -> (i32, String) {
        let deadline = Instant::now() + RUN;
        loop {
            let log = self.log(name);
            if let Some(status) = log.lines().rev().find_map(|l| l.strip_prefix("exit ")) {
                return (status.trim().parse().unwrap(), brief(&log));
            }
            assert!(Instant::now() < deadline, "guest {name} did not end:\n{log}");
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Waits until a kernel rdma_cm id listens on `port` of port space `ps` ("TCP", "UDP").
    fn wait_listening(&self, ps: &str, port: u16, name: &str) {
        let deadline = Instant::now() + RUN;
        loop {
            let ids = self.sh("rdma res show cm_id", Duration::from_secs(30));
            let listening = ids.lines().any(|l| {
                l.contains("state LISTEN")
                    && l.contains(&format!("ps {ps} "))
                    && l.contains(&format!(":{port} "))
            });
            if listening {
                return;
            }
            let log = self.log(name);
            assert!(
                Instant::now() < deadline && !log.contains("exit "),
                "the guest's {name} does not listen on {ps} {port}:\n{ids}\n{log}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Runs a client in the guest, again while our server refuses it for not listening yet
    /// (it fails at once then); its status and output.
    fn client(&self, cmd: &str) -> (i32, String) {
        let secs = RUN.as_secs();
        let out = self.sh(
            &format!(
                "i=0
                 while :; do
                   timeout {secs} {cmd} > /tmp/client.out 2> /tmp/client.err; s=$?
                   if [ $s = 0 ] || ! grep -Eq 'REJECTED, error:? 8|UNREACHABLE, error:? 1' /tmp/client.out /tmp/client.err || [ $i -ge 60 ]; then
                     break
                   fi
                   i=$((i + 1)); sleep 0.5
                 done
                 cat /tmp/client.out /tmp/client.err; echo \"exit $s\""
            ),
            RUN * 2,
        );
        let status = out
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("exit "))
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(-1);
        (status, brief(&out))
    }
}

/// A process of ours that serves one scenario; killed if the test fails first.
struct Server(Option<Child>);

impl Server {
    fn start(mut c: Command) -> Self {
        Self(Some(c.spawn().expect("spawn our server")))
    }

    fn finish(mut self) -> Output {
        wait_bounded(self.0.take().unwrap(), RUN)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Whether a process of this namespace holds the standard RoCE port (ours: it answers the
/// kernel's requests for this host).
fn roce_port_held(ns: &Netns) -> bool {
    let o = Command::new("ip")
        .args(["netns", "exec", &ns.0, "cat", "/proc/net/udp"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .any(|l| l.split_whitespace().nth(1).is_some_and(|a| a.ends_with(":12B7")))
}

/// tcpdump on the tap, stopped on drop.
struct Capture {
    child: Child,
    file: PathBuf,
}

impl Capture {
    fn start(ns: &Netns, file: PathBuf) -> Self {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns.0,
                "tcpdump",
                "-i",
                TAP,
                "--immediate-mode",
                "-U",
                "-w",
            ])
            .arg(&file)
            .args(["udp", "port", "4791"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tcpdump runs (scripts/setup-deps installs it)");
        // tcpdump says "listening on" once it captures.
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut capture = Self { child, file };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.contains("listening on") => return capture,
                Ok(_) => {}
                Err(_) => {
                    capture.stop();
                    panic!("tcpdump did not start capturing on {TAP}");
                }
            }
        }
    }

    /// Stops once the file has not grown for a second (the last replies may still be on
    /// their way; with `--immediate-mode` each packet is written as it comes).
    fn stop(&mut self) {
        let size = || std::fs::metadata(&self.file).map_or(0, |m| m.len());
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut last = size();
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let now = size();
            if now == last || Instant::now() > deadline {
                break;
            }
            last = now;
        }
        // ip netns exec becomes tcpdump; SIGINT makes it flush and exit.
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let _ = wait_bounded_child(&mut self.child, Duration::from_secs(10));
    }
}

fn wait_bounded_child(c: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(s) = c.try_wait().ok().flatten() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    c.wait().ok()
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.file);
    }
}

/// One CM MAD of the capture, as tshark decodes it.
#[derive(Debug)]
struct Mad {
    src: String,
    attr: u16,
    tid: u64,
    pkey: u16,
    qkey: u32,
    src_qp: u32,
}

const REQ: u16 = 0x10;
const REJ: u16 = 0x12;
const REP: u16 = 0x13;
const RTU: u16 = 0x14;
const DREQ: u16 = 0x15;
const DREP: u16 = 0x16;
const SIDR_REQ: u16 = 0x17;
const SIDR_REP: u16 = 0x18;

fn mads(pcap: &Path) -> Vec<Mad> {
    let o = Command::new("tshark")
        .arg("-r")
        .arg(pcap)
        .args([
            "-Y",
            "infiniband.bth.destqp == 1",
            "-T",
            "fields",
            "-E",
            "separator=,",
        ])
        .args(["-e", "ip.src", "-e", "infiniband.mad.attributeid"])
        .args(["-e", "infiniband.mad.transactionid", "-e", "infiniband.bth.p_key"])
        .args(["-e", "infiniband.deth.q_key", "-e", "infiniband.deth.srcqp"])
        .output()
        .expect("tshark runs (scripts/setup-deps installs it)");
    assert!(
        o.status.success(),
        "tshark: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            assert_eq!(f.len(), 6, "{l}");
            Mad {
                src: f[0].to_string(),
                attr: number(f[1]) as u16,
                tid: number(f[2]),
                pkey: number(f[3]) as u16,
                qkey: number(f[4]) as u32,
                src_qp: number(f[5]) as u32,
            }
        })
        .collect()
}

/// A number as tshark prints a field: decimal, or hexadecimal after `0x`.
fn number(s: &str) -> u64 {
    let s = s.trim();
    s.strip_prefix("0x").map_or_else(
        || s.parse().expect("a decimal field"),
        |h| u64::from_str_radix(h, 16).expect("a hexadecimal field"),
    )
}

/// The UDP slots (QPN bits 16..24) of the QPs of ours the kernel sent to, QP1 aside.
fn dest_slots(pcap: &Path) -> BTreeSet<u32> {
    let o = Command::new("tshark")
        .arg("-r")
        .arg(pcap)
        .args(["-Y", &format!("ip.src == {GUEST} && infiniband.bth.destqp != 1")])
        .args(["-T", "fields", "-e", "infiniband.bth.destqp"])
        .output()
        .expect("tshark runs");
    assert!(
        o.status.success(),
        "tshark: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| (number(l) >> 16) as u32)
        .collect()
}

/// Every REQ answered (REP or REJ) and every REP acknowledged (RTU) or refused in the REQ's
/// transaction, every DREQ answered by a DREP in its own, every SIDR_REQ by a SIDR_REP, each by
/// the other side; every MAD from QP1 with the default P_Key and QP1's Q_Key. Returns the
/// number of DREQs each side sent.
fn check_exchanges(all: &[Mad]) -> BTreeMap<String, usize> {
    let mut summary = String::new();
    for m in all {
        summary.push_str(&format!("{m:?}\n"));
    }
    let mut dreqs = BTreeMap::new();
    for m in all {
        assert_eq!(
            (m.pkey, m.qkey, m.src_qp),
            (0xFFFF, 0x8001_0000, 1),
            "{m:?}\n{summary}"
        );
        let answered = |replies: &[u16]| {
            all.iter()
                .any(|r| r.tid == m.tid && r.src != m.src && replies.contains(&r.attr))
        };
        let ok = match m.attr {
            REQ => answered(&[REP, REJ]),
            REP => answered(&[RTU, REJ]),
            DREQ => {
                *dreqs.entry(m.src.clone()).or_insert(0) += 1;
                answered(&[DREP])
            }
            SIDR_REQ => answered(&[SIDR_REP]),
            _ => true,
        };
        assert!(ok, "unanswered in its transaction: {m:?}\n{summary}");
    }
    let sent: BTreeSet<(&str, u16)> = all.iter().map(|m| (m.src.as_str(), m.attr)).collect();
    for side in [HOST, GUEST] {
        for attr in [REQ, REP, RTU, DREQ, DREP, SIDR_REQ, SIDR_REP, REJ] {
            assert!(
                sent.contains(&(side, attr)),
                "{side} never sent attribute {attr:#x}:\n{summary}"
            );
        }
    }
    dreqs
}

#[test]
fn rdmacm_utils_between_the_kernels_cm_and_softverbs() {
    if let Err(why) = vm_possible() {
        eprintln!("kernel rxe guest cannot run here, not tested: {why}");
        return;
    }
    for p in [
        "/usr/bin/rping",
        "/usr/bin/ucmatose",
        "/usr/bin/udaddy",
        "/usr/bin/tshark",
    ] {
        require(p);
    }
    let libs = libs();
    let ns = Netns::new("rxecm");
    // The shell serves until the test touches /tmp/done; then the guest powers off.
    let shell = format!(
        "modprobe rdma_ucm || exit 1
         busybox nc -ll -p {SHELL} -e /bin/sh &
         while [ ! -e /tmp/done ]; do sleep 0.2; done"
    );
    let mut vm = Vm::boot(&ns, &["sh", "-c", &shell], Duration::from_secs(900));
    vm.wait_for("RXE-VM-READY", BOOT);
    let guest = Guest { ns: &ns };
    guest.wait_shell(RUN);
    let mut capture = Capture::start(
        &ns,
        std::env::temp_dir().join(format!("rxecm-{}.pcap", std::process::id())),
    );
    let ours = |program: &str, args: &[&str]| our_program(&ns, &libs, program, args);

    // Requests for ports nobody listens on, answered by the kernel's CM.
    let o = run_bounded(ours("/usr/bin/udaddy", &["-s", GUEST, "-c", "1", "-C", "1"]), RUN);
    assert!(
        !o.status.success() && both(&o).contains("RDMA_CM_EVENT_UNREACHABLE, error: 1"),
        "udaddy to a guest nobody serves: SIDR status 1\n{}",
        both(&o)
    );
    let p = NOBODY.to_string();
    let o = run_bounded(
        ours("/usr/bin/rping", &["-c", "-a", GUEST, "-p", &p, "-C", "1"]),
        RUN,
    );
    assert!(
        !o.status.success() && both(&o).contains("RDMA_CM_EVENT_REJECTED, error 8"),
        "rping to a port nobody listens on: REJ 8\n{}",
        both(&o)
    );

    // rping: the kernel serves, then we do (the client disconnects first).
    for own_qp in [false, true] {
        let q: &[&str] = if own_qp { &["-q"] } else { &[] };
        let flags = |side: &str, addr: &str| -> Vec<String> {
            let mut v: Vec<String> = [side, "-a", addr, "-C", "10", "-v", "-V", "-S", "1500"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            v.extend(q.iter().map(|s| s.to_string()));
            v
        };
        guest.spawn("rping", &format!("rping {}", flags("-s", GUEST).join(" ")));
        guest.wait_listening("TCP", RPING_PORT, "rping");
        let args = flags("-c", GUEST);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = run_bounded(ours("/usr/bin/rping", &args), RUN);
        let (status, log) = guest.finish("rping");
        assert!(
            o.status.success(),
            "our rping client {q:?}:\n{}\nkernel server:\n{log}",
            both(&o)
        );
        let (out, _) = text(&o);
        assert_eq!(out.matches("ping data: rdma-ping-").count(), 10, "{}", both(&o));
        assert_eq!(status, 0, "kernel rping server {q:?}:\n{log}");
        assert_eq!(log.matches("server ping data: rdma-ping-").count(), 10, "{log}");
        assert!(log.contains("server DISCONNECT EVENT"), "{log}");

        let args = flags("-s", HOST);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let server = Server::start(ours("/usr/bin/rping", &args));
        let (status, out) = guest.client(&format!("rping {}", flags("-c", HOST).join(" ")));
        let s = server.finish();
        assert_eq!(
            status,
            0,
            "kernel rping client {q:?}:\n{out}\nour server:\n{}",
            both(&s)
        );
        assert_eq!(out.matches("ping data: rdma-ping-").count(), 10, "{out}");
        assert!(s.status.success(), "our rping server {q:?}:\n{}", both(&s));
        let (sout, _) = text(&s);
        assert_eq!(
            sout.matches("server ping data: rdma-ping-").count(),
            10,
            "{}",
            both(&s)
        );
        assert!(both(&s).contains("server DISCONNECT EVENT"), "{}", both(&s));
    }

    // From here on a process of ours holds the RoCE port. A request of the kernel's for a
    // port of this host nobody listens on: its CM answers as the host's would.
    let holder = Server::start(ours(
        "/usr/bin/rping",
        &["-s", "-a", HOST, "-p", "7175", "-C", "1"],
    ));
    let deadline = Instant::now() + RUN;
    while !roce_port_held(&ns) {
        assert!(Instant::now() < deadline, "our rping does not hold UDP 4791");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = guest.sh(&format!("timeout 60 rping -c -a {HOST} -p {NOBODY} -C 1"), RUN);
    assert!(out.contains("RDMA_CM_EVENT_REJECTED, error 8"), "{out}");
    let out = guest.sh(&format!("timeout 60 udaddy -s {HOST} -c 1 -C 1"), RUN);
    assert!(out.contains("RDMA_CM_EVENT_UNREACHABLE, error: 1"), "{out}");

    // ucmatose and udaddy: ten connections of twenty messages each way, both ways (ucmatose's
    // server disconnects first). The kernel's MADs and packets for them reach the holder, which
    // forwards them to their process.
    for (program, ps, port) in [("ucmatose", "TCP", UCMATOSE_PORT), ("udaddy", "UDP", UDADDY_PORT)] {
        let path = format!("/usr/bin/{program}");
        let done = |out: &str| out.contains("data transfers complete") && out.contains("return status 0");
        guest.spawn(program, &format!("{program} -c 10 -C 20"));
        guest.wait_listening(ps, port, program);
        let o = run_bounded(ours(&path, &["-s", GUEST, "-c", "10", "-C", "20"]), RUN);
        let (status, log) = guest.finish(program);
        assert!(
            o.status.success() && done(&both(&o)),
            "our {program} client:\n{}\nkernel:\n{log}",
            both(&o)
        );
        assert!(status == 0 && done(&log), "kernel {program} server:\n{log}");

        let server = Server::start(ours(&path, &["-c", "10", "-C", "20"]));
        let (status, out) = guest.client(&format!("{program} -s {HOST} -c 10 -C 20"));
        let s = server.finish();
        assert!(
            status == 0 && done(&out),
            "kernel {program} client:\n{out}\nours:\n{}",
            both(&s)
        );
        assert!(
            s.status.success() && done(&both(&s)),
            "our {program} server:\n{}",
            both(&s)
        );
    }

    drop(holder);

    capture.stop();
    let slots = dest_slots(&capture.file);
    assert!(
        slots.len() >= 2,
        "the kernel reached processes of ours other than the holder: slots {slots:?}"
    );
    let all = mads(&capture.file);
    let dreqs = check_exchanges(&all);
    assert!(
        dreqs.get(HOST).is_some_and(|&n| n >= 2) && dreqs.get(GUEST).is_some_and(|&n| n >= 2),
        "disconnects from both sides: {dreqs:?}"
    );
    let counters = guest.sh(
        "cd /sys/class/infiniband/rxe0/ports/1 && for g in cm_rx_duplicates cm_tx_retries; do echo $g: $(cd $g && grep -H . *); done",
        Duration::from_secs(30),
    );
    eprintln!("kernel CM counters:\n{counters}");
    guest.sh("touch /tmp/done", Duration::from_secs(30));
    vm.wait_for("RXE-VM-EXIT 0", RUN);
    let status = vm.wait_exit(RUN);
    assert!(status.success(), "scripts/rxe-vm: {status}\n{}", vm.log);
}
