//! Two network namespaces joined by a veth pair (the "hosts" of the multi-host tests), and the
//! child processes the tests run inside them.

use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

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

/// Two namespaces and a veth pair between them, with `ips` on the two ends; removed on drop.
pub(crate) struct Hosts {
    pub(crate) ns: [String; 2],
    pub(crate) ifs: [String; 2],
    pub(crate) ips: [Ipv4Addr; 2],
}

impl Hosts {
    /// Names carry `prefix`, `tag` and this process's id, so concurrent runs do not collide.
    /// With `ipv6` false, IPv6 is off in both namespaces (no neighbour discovery or MLD
    /// traffic on the link).
    pub(crate) fn new(prefix: &str, tag: &str, ips: [Ipv4Addr; 2], ipv6: bool) -> Self {
        let id = std::process::id() % 100_000;
        let h = Self {
            ns: [format!("{prefix}{tag}{id}a"), format!("{prefix}{tag}{id}b")],
            ifs: [format!("{prefix}{id}{tag}a"), format!("{prefix}{id}{tag}b")],
            ips,
        };
        for ns in &h.ns {
            run("ip", &["netns", "add", ns]);
            if !ipv6 {
                for key in ["all", "default"] {
                    let knob = format!("net.ipv6.conf.{key}.disable_ipv6=1");
                    run("ip", &["netns", "exec", ns, "sysctl", "-qw", &knob]);
                }
            }
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
            let addr = format!("{}/24", h.ips[i]);
            run("ip", &["-n", ns, "addr", "add", &addr, "dev", ifname]);
            run("ip", &["-n", ns, "link", "set", ifname, "up"]);
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
        }
        h
    }

    /// Makes both ends of the veth pair cut GSO batches into datagrams before they cross it, as
    /// the kernel does for a NIC without segmentation offload, so that a capture on the link
    /// shows the datagrams (with the IPv4 IDs the kernel gave them) rather than the batches.
    pub(crate) fn segment_on_the_link(&self) {
        for i in 0..2 {
            let (ns, ifname) = (&self.ns[i], &self.ifs[i]);
            run("ip", &["-n", ns, "link", "set", ifname, "gso_max_segs", "1"]);
        }
    }

    /// Drops `percent` % of the UDP datagrams host `i` receives on `ports` (an nftables
    /// `numgen random` rule with a counter in table `inet svloss`).
    pub(crate) fn drop_incoming(&self, i: usize, percent: u32, ports: (u16, u16)) {
        let ns = &self.ns[i];
        let nft = |rule: &str| run("ip", &["netns", "exec", ns, "nft", rule]);
        nft("add table inet svloss");
        nft("add chain inet svloss input { type filter hook input priority 0 ; }");
        nft(&format!(
            "add rule inet svloss input udp dport {}-{} numgen random mod 100 < {percent} counter drop",
            ports.0, ports.1
        ));
    }

    /// How many datagrams the rule of [`Self::drop_incoming`] dropped in host `i`.
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
        let n = text
            .split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|n| n.parse().ok());
        n.unwrap_or_else(|| panic!("no counter in:\n{text}"))
    }

    /// Runs this test executable with `args` in host `i`, on the veth's device only.
    pub(crate) fn spawn(&self, i: usize, args: &[&str]) -> Peer {
        self.spawn_with(i, args, &[])
    }

    /// [`Hosts::spawn`] with more environment variables.
    pub(crate) fn spawn_with(&self, i: usize, args: &[&str], env: &[(&str, &str)]) -> Peer {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns[i]])
            .arg(std::env::current_exe().unwrap())
            .args(args)
            .env("SOFTVERBS_INTERFACES", &self.ifs[i])
            .envs(env.iter().copied());
        Peer::spawn(cmd)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting the namespaces also removes the veth pair.
        for ns in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// One network namespace with only its loopback up; removed on drop.
pub(crate) struct Namespace(pub(crate) String);

impl Namespace {
    /// A namespace named after `prefix` and this process.
    pub(crate) fn new(prefix: &str) -> Self {
        let name = format!("{prefix}{}", std::process::id() % 100_000);
        run("ip", &["netns", "add", &name]);
        run("ip", &["-n", &name, "link", "set", "lo", "up"]);
        Self(name)
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// A child process spoken to line by line over its stdin and stdout; killed on drop.
pub(crate) struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    /// Starts `cmd` with piped stdin and stdout.
    pub(crate) fn spawn(mut cmd: Command) -> Self {
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        // A reader thread, so that every wait for a line is bounded.
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines() {
                if tx.send(l.unwrap_or_default()).is_err() {
                    return;
                }
            }
        });
        Self { child, stdin, lines }
    }

    /// The next line, waiting at most `limit`.
    pub(crate) fn line(&mut self, limit: Duration) -> String {
        self.lines
            .recv_timeout(limit)
            .unwrap_or_else(|_| panic!("no answer from the peer within {limit:?}"))
    }

    /// The next line if one comes within `limit`; `None` if none does or the peer closed its
    /// output (it exited).
    pub(crate) fn try_line(&mut self, limit: Duration) -> Option<String> {
        self.lines.recv_timeout(limit).ok()
    }

    /// Sends one line.
    pub(crate) fn say(&mut self, s: &str) {
        writeln!(self.stdin, "{s}").unwrap();
    }

    /// The child's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `sig` to the child.
    pub(crate) fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    /// Waits (at most `limit`) for the child to exit; its exit status, if it did.
    pub(crate) fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
