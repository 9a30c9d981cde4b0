//! Helpers shared by the perf crate's integration tests.
#![allow(dead_code)]

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Runs `cmd` with its output captured, killing it (and failing the test) after `timeout`.
/// Returns its exit status, standard output and standard error.
pub(crate) fn run_bounded(mut cmd: Command, timeout: Duration) -> (ExitStatus, String, String) {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    // Reader threads, so that a chatty child never blocks on a full pipe.
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        stdout.read_to_string(&mut s).expect("read stdout");
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        stderr.read_to_string(&mut s).expect("read stderr");
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} timed out after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (
        status,
        out.join().expect("stdout thread"),
        err.join().expect("stderr thread"),
    )
}
