//! The async echo example (`examples/async_echo.rs`) as two processes: this test runs copies of
//! its own executable as the server and the clients (`--echo ...` runs the example's command
//! line), over shared memory (large payloads copied once between the registered `Vec`s) and
//! over UDP, with clients that drop send and receive futures mid-flight.

mod common;

#[path = "../examples/async_echo.rs"]
mod echo;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Every process of one run shares a private range of UDP ports (and so of mailboxes).
fn spawn(args: &[&str], base_port: u16, shm: bool) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.arg("--echo")
        .args(args)
        .env("SOFTVERBS_UDP_PORT", base_port.to_string())
        .env("SOFTVERBS_INTERFACES", "lo")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if !shm {
        cmd.env("SOFTVERBS_SHM", "0");
    }
    cmd.spawn().unwrap()
}

/// Waits for `child` at most until `deadline`; its status and output.
fn finish(mut child: Child, deadline: Instant) -> (bool, String, String) {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut out = String::new();
            let mut err = String::new();
            child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            return (status.success(), out, err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            return (false, "timed out".into(), err);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether processes of this user may copy payloads out of each other (Yama's `ptrace_scope`
/// absent or 0), which the device needs to move large payloads once (ARCHITECTURE.md).
fn payloads_move_once() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").map_or(true, |s| s.trim() == "0")
}

/// One server, two concurrent clients (one of them cancelling futures); every echo checked.
fn echo(shm: bool) {
    let base = common::free_base_port();
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut server = spawn(&["server", "--port", "0", "--connections", "2"], base, shm);
    let mut first = String::new();
    BufReader::new(server.stdout.as_mut().unwrap())
        .read_line(&mut first)
        .unwrap();
    let port = first
        .trim()
        .strip_prefix("listening ")
        .unwrap_or_else(|| panic!("server said {first:?}"))
        .to_string();
    let addr = format!("127.0.0.1:{port}");
    let plain = spawn(
        &["client", &addr, "--messages", "300", "--window", "4"],
        base,
        shm,
    );
    let cancelling = spawn(
        &[
            "client",
            &addr,
            "--messages",
            "200",
            "--window",
            "3",
            "--cancel-every",
            "7",
        ],
        base,
        shm,
    );
    let results = [finish(plain, deadline), finish(cancelling, deadline)];
    let (server_ok, _, server_err) = finish(server, deadline);
    for (i, (ok, out, err)) in results.iter().enumerate() {
        assert!(ok, "client {i} failed: {out}\n{err}\nserver: {server_err}");
        let f: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(f.first(), Some(&"ok"), "client {i}: {out}");
        let copies: u64 = f[5].parse().unwrap();
        let checked: u64 = f[7].parse().unwrap();
        if i == 0 {
            assert_eq!((f[1], checked), ("300", 300), "every echo checked: {out}");
        } else {
            // Every 7th message from the 4th on had its receive future dropped.
            assert_eq!(checked, 200 - (3..200).step_by(7).count() as u64, "{out}");
        }
        if shm && payloads_move_once() {
            assert!(
                copies > 0,
                "large echoes were copied straight between the buffers: {out}"
            );
        }
        if !shm {
            assert_eq!(copies, 0, "nothing moves through shared memory over UDP: {out}");
        }
    }
    assert!(server_ok, "server: {server_err}");
}

fn echo_over_shared_memory() {
    echo(true);
}

fn echo_over_udp() {
    echo(false);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--echo") {
        let r = echo::run(args[1..].to_vec());
        use std::io::Write;
        let _ = std::io::stdout().flush();
        if let Err(e) = r {
            eprintln!("async_echo: {e}");
            std::process::exit(1);
        }
        return;
    }
    let tests: [(&str, fn()); 2] = [
        ("echo_over_shared_memory", echo_over_shared_memory),
        ("echo_over_udp", echo_over_udp),
    ];
    let mut failed = 0;
    for (name, t) in tests {
        let ok = std::panic::catch_unwind(t).is_ok();
        println!("test async_echo::{name} ... {}", if ok { "ok" } else { "FAILED" });
        failed += usize::from(!ok);
    }
    println!("{} passed, {} failed", tests.len() - failed, failed);
    std::process::exit(i32::from(failed > 0));
}
