//! Faults under the drop-in library: rdma-core's and perftest's programs, unmodified, over our
//! `libibverbs.so.1`, with the server killed (`SIGKILL`) or frozen (`SIGSTOP`) in the middle of
//! the traffic. Over RC the client gets `IBV_WC_RETRY_EXC_ERR` (status 12) within the QP's retry
//! budget (perftest and the pingpongs use an ACK timeout of 14, 67 ms, and 7 retries: 0.54 s)
//! plus slack, says so and exits; over UC and UD (`ib_send_bw -c UC|UD`) the client's sends
//! keep completing and it reports all its iterations. Nothing hangs: every run is bounded.
//!
//! (rdma-core's UC and UD pingpongs are not here: they wait for the peer's answer to every
//! message with no time limit, by design, so a dead peer leaves them waiting whatever the
//! library does.)

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// The retry budget of the programs' QPs: (7 + 1) x 4.096 us x 2^14.
const BUDGET: Duration = Duration::from_nanos(8 * (4096 << 14));
/// How much later than the budget an error may come on a loaded host.
const SLACK: Duration = Duration::from_secs(10);
const LIMIT: Duration = Duration::from_secs(120);
const STDBUF: &str = "/usr/bin/stdbuf";

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A base UDP port whose first slots are free now, so that the two programs meet no other
/// softverbs process.
fn free_base_port() -> u16 {
    let free = |port: u16| {
        std::net::UdpSocket::bind(("0.0.0.0", port)).is_ok()
            && std::net::UdpSocket::bind(("::", port)).is_ok()
    };
    let seed = std::process::id() as u16;
    (0..1000u16)
        .map(|i| 20_000 + (seed.wrapping_add(i.wrapping_mul(101)) % 40_000))
        .find(|&base| (base..base + 4).all(free))
        .expect("a free range of UDP ports")
}

/// A running program whose output (stdout and stderr together) is collected as it comes.
struct Program {
    child: Child,
    output: Arc<Mutex<Vec<u8>>>,
}

impl Program {
    fn start(program: &str, args: &[String], base: u16) -> Self {
        require(program);
        let mut c = if Path::new(STDBUF).exists() {
            let mut c = command(STDBUF);
            c.arg("-oL").arg(program);
            c
        } else {
            command(program)
        };
        c.args(args)
            .env("SOFTVERBS_UDP_PORT", base.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().unwrap_or_else(|e| panic!("spawn {program}: {e}"));
        let output = Arc::new(Mutex::new(Vec::new()));
        for pipe in [
            child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
            child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let out = output.clone();
            std::thread::spawn(move || {
                let mut pipe = pipe;
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = pipe.read(&mut buf) {
                    out.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            });
        }
        Self { child, output }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    fn signal(&self, sig: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    /// Waits until the output contains `needle` (bounded); false if the program ended first
    /// because perftest's own clock calibration failed (see [`Program::clock_failed`]).
    fn wait_for(&mut self, needle: &str, what: &str) -> bool {
        let deadline = Instant::now() + LIMIT;
        while !self.text().contains(needle) {
            if self.clock_failed() {
                return false;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: no {needle:?} in:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// Whether the program exited because perftest could not calibrate its cycle counter (a
    /// preemption on a loaded machine): then the run says nothing about us and is made again.
    fn clock_failed(&mut self) -> bool {
        let ended = self.child.try_wait().unwrap().is_some();
        ended && self.text().contains(PERFTEST_CLOCK_FAILURE)
    }

    /// Waits (bounded) for the program to exit; its exit status.
    fn wait(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the client must show after the fault.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Exits unsuccessfully within the retry budget, naming status 12 with `text`.
    RetryExceeded(&'static str),
    /// As `RetryExceeded`, unless the client had no send outstanding when the server went:
    /// a pingpong client that sent its message (and had it acknowledged) waits for the answer
    /// with nothing to time out, as on any RC device. Such a run is inconclusive and the
    /// scenario is run again (up to `attempts` times).
    RetryExceededIfSending(&'static str, usize),
    /// Completes and reports all `n` iterations (perftest's results row).
    Completes(u64),
}

/// Runs `program args` as server and client on sv_lo and sends `sig` to the server once the
/// client printed `started` (and a little more traffic went).
fn fault(program: &str, args: &[String], started: &str, sig: Signal, expect: Expect) {
    let _serial = serial();
    let (expect, may_retry, attempts) = match expect {
        Expect::RetryExceededIfSending(text, attempts) => (Expect::RetryExceeded(text), true, attempts),
        other => (other, false, 1),
    };
    let (mut inconclusive, mut clock_failures) = (0, 0);
    while inconclusive < attempts && clock_failures < PERFTEST_ATTEMPTS {
        match attempt(program, args, started, sig, expect, may_retry) {
            Run::Done => return,
            Run::Inconclusive => inconclusive += 1,
            Run::ClockFailed => {
                println!("{program}: perftest's clock calibration failed; again");
                clock_failures += 1;
            }
        }
    }
    panic!(
        "{program}: no conclusive run after the server's {sig:?} ({inconclusive} inconclusive, \
         {clock_failures} with a failed clock calibration)"
    );
}

/// How one run of [`fault`] ended.
enum Run {
    /// It showed what was expected.
    Done,
    /// See [`Expect::RetryExceededIfSending`]: a client that does not exit within the budget
    /// plus 5 s while the test may retry.
    Inconclusive,
    /// perftest's own clock calibration failed before the fault ([`Program::clock_failed`]).
    ClockFailed,
}

/// One run of [`fault`].
fn attempt(
    program: &str,
    args: &[String],
    started: &str,
    sig: Signal,
    expect: Expect,
    may_retry: bool,
) -> Run {
    let base = free_base_port();
    let port = free_port();
    let gid = gid_index();
    let mut args: Vec<String> = args.iter().map(|s| s.replace("GID", &gid)).collect();
    args.extend(["-p".into(), port.to_string()]);
    let mut server = Program::start(program, &args, base);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !listening(port) {
        if server.clock_failed() {
            return Run::ClockFailed;
        }
        assert!(
            Instant::now() < deadline,
            "{program} server never listened on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    args.push("127.0.0.1".into());
    let mut client = Program::start(program, &args, base);
    if !client.wait_for(started, "the client started") {
        return Run::ClockFailed;
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        client.child.try_wait().unwrap().is_none(),
        "the client finished before the fault:\n{}",
        client.text()
    );
    server.signal(sig);
    let at = Instant::now();
    match expect {
        Expect::RetryExceededIfSending(..) => unreachable!("handled by fault"),
        Expect::RetryExceeded(text) => {
            if may_retry && client.wait(BUDGET + Duration::from_secs(5)).is_none() {
                println!("{program}: the client waits for an answer (no send outstanding); again");
                return Run::Inconclusive;
            }
            let status = client.wait(BUDGET + SLACK + Duration::from_secs(30));
            let took = at.elapsed();
            let out = client.text();
            assert!(
                status.is_some(),
                "the client hangs after the server's {sig:?}:\n{out}"
            );
            assert!(!status.unwrap().success(), "{out}");
            assert!(out.contains(text), "no {text:?} in:\n{out}");
            assert!(
                took <= BUDGET + SLACK,
                "the error came after {took:?} (budget {BUDGET:?}):\n{out}"
            );
            println!("{program} {args:?}, server {sig:?}: exited after {took:?}");
        }
        Expect::Completes(n) => {
            // perftest's results row: `#bytes #iterations ...`. (After it, the client's last
            // exchange with the server over TCP fails or, with a frozen server, waits.)
            let deadline = Instant::now() + LIMIT;
            // Only whole lines count (the output may be read mid-line), and only one that
            // starts with two numbers (stderr shares the buffer).
            let numbers = |l: &str| {
                let mut w = l.split_whitespace().map(str::parse::<u64>);
                matches!((w.next(), w.next()), (Some(Ok(_)), Some(Ok(_))))
            };
            let row = loop {
                let out = client.text();
                let row = out
                    .split_inclusive('\n')
                    .filter(|l| l.ends_with('\n'))
                    .skip_while(|l| !l.trim_start().starts_with("#bytes"))
                    .skip(1)
                    .find(|l| numbers(l))
                    .map(|l| l.trim().to_string());
                if let Some(r) = row {
                    break r;
                }
                assert!(
                    client.child.try_wait().unwrap().is_none() && Instant::now() < deadline,
                    "no results after the server's {sig:?}:\n{out}"
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            let iters: u64 = row.split_whitespace().nth(1).unwrap().parse().unwrap();
            assert_eq!(iters, n, "every send completed: {row}");
            println!(
                "{program} {args:?}, server {sig:?}: {n} sends completed in {:?}",
                at.elapsed()
            );
        }
    }
    drop(client);
    drop(server);
    Run::Done
}

/// perftest's options (`GID` is replaced by the GID index) and `extra`.
fn perf(extra: &[&str]) -> Vec<String> {
    ["-d", "sv_lo", "-x", "GID", "-F"]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

const STARTED: &str = "#bytes";
const PERF_ERR: &str = "Failed status 12";

/// Enough iterations that the client is still sending when the server goes: a release build
/// sends about 400,000 one-packet messages a second here, so this lasts over a second (and a
/// debug build, at some 10,000 a second after the kill, about a minute, within [`LIMIT`]).
const ITERS: u64 = 500_000;
/// The message size of the UC runs: one packet, as UD's (the MTU). After a kill, the rest of
/// the run goes over UDP to a port nobody holds, and a debug build on a loaded 2-core host
/// moves only about 10,000 packets a second there: 64 KiB messages (16 packets each) would
/// keep the client busy for minutes.
const UC_SIZE: &str = "4096";

/// The pingpongs' options, and `extra`.
fn pingpong(extra: &[&str]) -> Vec<String> {
    ["-d", "sv_lo", "-g", "GID", "-n", "10000000"]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}
const PINGPONG_ERR: &str = "transport retry counter exceeded (12)";

/// The program and transport a fault is tried on.
#[derive(Debug, Clone, Copy)]
enum Scenario {
    /// `ib_write_bw` over RC.
    WriteBw,
    /// `ib_send_bw` over RC.
    SendBw,
    /// `ib_send_bw -c UC`.
    SendBwUc,
    /// `ib_send_bw -c UD`.
    SendBwUd,
    /// `ibv_rc_pingpong`.
    RcPingpong,
    /// `ibv_rc_pingpong -e` (completion events).
    RcPingpongEvents,
}

/// Runs `scenario` with `sig` sent to its server: [`fault`] with that scenario's program,
/// options, start marker and expectation.
fn scenario(scenario: Scenario, sig: Signal) {
    let iters = ITERS.to_string();
    let pingpong_err = Expect::RetryExceededIfSending(PINGPONG_ERR, 12);
    let (program, args, started, expect) = match scenario {
        Scenario::WriteBw => (
            "/usr/bin/ib_write_bw",
            perf(&["-D", "60"]),
            STARTED,
            Expect::RetryExceeded(PERF_ERR),
        ),
        Scenario::SendBw => (
            "/usr/bin/ib_send_bw",
            perf(&["-D", "60"]),
            STARTED,
            Expect::RetryExceeded(PERF_ERR),
        ),
        Scenario::SendBwUc => (
            "/usr/bin/ib_send_bw",
            perf(&["-c", "UC", "-s", UC_SIZE, "-n", &iters]),
            STARTED,
            Expect::Completes(ITERS),
        ),
        Scenario::SendBwUd => (
            "/usr/bin/ib_send_bw",
            perf(&["-c", "UD", "-n", &iters]),
            STARTED,
            Expect::Completes(ITERS),
        ),
        Scenario::RcPingpong => (
            "/usr/bin/ibv_rc_pingpong",
            pingpong(&[]),
            "remote address",
            pingpong_err,
        ),
        Scenario::RcPingpongEvents => (
            "/usr/bin/ibv_rc_pingpong",
            pingpong(&["-e"]),
            "remote address",
            pingpong_err,
        ),
    };
    fault(program, &args, started, sig, expect);
}

#[test]
fn ib_write_bw_server_killed() {
    scenario(Scenario::WriteBw, Signal::SIGKILL);
}

#[test]
fn ib_write_bw_server_frozen() {
    scenario(Scenario::WriteBw, Signal::SIGSTOP);
}

#[test]
fn ib_send_bw_server_killed() {
    scenario(Scenario::SendBw, Signal::SIGKILL);
}

#[test]
fn ib_send_bw_server_frozen() {
    scenario(Scenario::SendBw, Signal::SIGSTOP);
}

#[test]
fn ib_send_bw_uc_server_killed() {
    scenario(Scenario::SendBwUc, Signal::SIGKILL);
}

#[test]
fn ib_send_bw_uc_server_frozen() {
    scenario(Scenario::SendBwUc, Signal::SIGSTOP);
}

#[test]
fn ib_send_bw_ud_server_killed() {
    scenario(Scenario::SendBwUd, Signal::SIGKILL);
}

#[test]
fn ib_send_bw_ud_server_frozen() {
    scenario(Scenario::SendBwUd, Signal::SIGSTOP);
}

#[test]
fn ibv_rc_pingpong_server_killed() {
    scenario(Scenario::RcPingpong, Signal::SIGKILL);
}

#[test]
fn ibv_rc_pingpong_server_frozen() {
    scenario(Scenario::RcPingpong, Signal::SIGSTOP);
}

#[test]
fn ibv_rc_pingpong_events_server_killed() {
    scenario(Scenario::RcPingpongEvents, Signal::SIGKILL);
}

#[test]
fn a_run_whose_perftest_clock_calibration_failed_is_told_apart() {
    let script = |s: &str| vec!["-c".to_string(), s.to_string()];
    let mut failed = Program::start(
        "/bin/sh",
        &script("echo 'Correlation coefficient r^2: 0.859 < 0.9'; echo \"Can't produce a report\"; exit 1"),
        free_base_port(),
    );
    assert!(!failed.wait_for(STARTED, "a calibration failure"));
    assert!(failed.clock_failed());
    // Any other early exit is not mistaken for one (and one still running never is).
    let mut other = Program::start(
        "/bin/sh",
        &script("echo 'Couldn'\\''t connect'; exit 1"),
        free_base_port(),
    );
    other.wait(LIMIT);
    assert!(!other.clock_failed());
    let mut running = Program::start("/bin/sh", &script("echo '#bytes'; sleep 5"), free_base_port());
    assert!(running.wait_for(STARTED, "a started run"));
    assert!(!running.clock_failed());
}
