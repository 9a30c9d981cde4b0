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

/// Runs a set-up command, failing the test if it fails.
pub(crate) fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two network namespaces joined by a veth pair (10.79.0.1 and .2), each dropping `loss` per
/// mille of the RoCEv2 datagrams it receives; removed on drop. Needs root.
pub(crate) struct LossyHosts {
    pub(crate) ns: [String; 2],
    pub(crate) ifs: [String; 2],
}

impl LossyHosts {
    pub(crate) fn new(tag: &str, loss_per_mille: u32) -> Self {
        let id = std::process::id() % 100_000;
        let h = Self {
            ns: [format!("sv{tag}{id}a"), format!("sv{tag}{id}b")],
            ifs: [format!("sv{id}{tag}a"), format!("sv{id}{tag}b")],
        };
        for ns in &h.ns {
            run("ip", &["netns", "add", ns]);
        }
        run(
            "ip",
            &[
                "link", "add", &h.ifs[0], "netns", &h.ns[0], "type", "veth", "peer", "name", &h.ifs[1],
                "netns", &h.ns[1],
            ],
        );
        for i in 0..2 {
            let (ns, ifname) = (&h.ns[i], &h.ifs[i]);
            let addr = format!("10.79.0.{}/24", i + 1);
            run("ip", &["-n", ns, "addr", "add", &addr, "dev", ifname]);
            run("ip", &["-n", ns, "link", "set", ifname, "up"]);
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
            let nft = |rule: &str| run("ip", &["netns", "exec", ns, "nft", rule]);
            nft("add table inet svloss");
            nft("add chain inet svloss input { type filter hook input priority 0 ; }");
            nft(&format!(
                "add rule inet svloss input udp dport 4791-5046 numgen random mod 1000 < {loss_per_mille} counter drop"
            ));
        }
        h
    }

    /// How many datagrams the loss rule of host `i` dropped.
    pub(crate) fn dropped(&self, i: usize) -> u64 {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns[i],
                "nft",
                "list",
                "table",
                "inet",
                "svloss",
            ])
            .output()
            .expect("nft");
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no counter in:\n{text}"))
    }
}

impl Drop for LossyHosts {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}
