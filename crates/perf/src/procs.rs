//! What the multi-process tools share: child processes spoken to line by line (the parent's
//! side and the child's), a private range of UDP ports, the device a side uses, and what a
//! process holds (threads, descriptors).

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, UdpSocket};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use softverbs::{devices, Context, Gid};

use crate::error::{bail, Error, Result};

/// The device named `name` (device or interface name) and its GID for 127.0.0.1 (or its first
/// IPv4 GID, or its first GID).
pub(crate) fn open_device(name: &str) -> Result<(Context, Gid, u8)> {
    let dev = devices()?
        .into_iter()
        .find(|d| d.name() == name || d.netdev() == name)
        .ok_or_else(|| Error::msg(format!("no device {name:?} (see SOFTVERBS_INTERFACES)")))?;
    let ctx = dev.open()?;
    let port = ctx.query_port(1)?;
    let gids: Vec<(u8, Gid)> = (0..port.gid_tbl_len.min(256))
        .filter_map(|i| ctx.query_gid(1, i as i32).ok().map(|g| (i as u8, g)))
        .filter(|(_, g)| !g.is_zero())
        .collect();
    let lo = Gid::from_ip(IpAddr::from([127, 0, 0, 1]));
    let (gid_index, gid) = gids
        .iter()
        .find(|(_, g)| *g == lo)
        .or_else(|| gids.iter().find(|(_, g)| matches!(g.to_ip(), IpAddr::V4(_))))
        .or(gids.first())
        .copied()
        .ok_or_else(|| Error::msg(format!("device {name} has no GID")))?;
    Ok((ctx, gid, gid_index))
}

/// A base UDP port whose `slots + 1` ports are free now, away from the standard one.
pub(crate) fn free_base_port(slots: u16) -> Result<u16> {
    let free =
        |port: u16| UdpSocket::bind(("0.0.0.0", port)).is_ok() && UdpSocket::bind(("::", port)).is_ok();
    let seed = std::process::id() as u16;
    (0..2000u16)
        .map(|i| 20_000 + (seed.wrapping_add(i.wrapping_mul(397)) % 40_000))
        .find(|&base| (base..=base + slots).all(free))
        .ok_or_else(|| Error::msg("no free range of UDP ports for the slots"))
}

/// A line from child `idx`, or its end (`None`).
type Line = (usize, Option<String>);

pub(crate) struct Children {
    procs: Vec<Child>,
    stdins: Vec<ChildStdin>,
    rx: mpsc::Receiver<Line>,
    deadline: Instant,
}

impl Children {
    /// Starts `cmds` with piped stdin and stdout (stderr inherited); a thread per child
    /// relays its lines. Every wait for them ends at `deadline`.
    pub(crate) fn spawn(cmds: impl IntoIterator<Item = Command>, deadline: Instant) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Line>();
        let mut procs = Vec::new();
        let mut stdins = Vec::new();
        for (i, mut cmd) in cmds.into_iter().enumerate() {
            cmd.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            let mut c = cmd.spawn()?;
            stdins.push(c.stdin.take().ok_or_else(|| Error::msg("no stdin"))?);
            let out = c.stdout.take().ok_or_else(|| Error::msg("no stdout"))?;
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    match line {
                        Ok(l) => {
                            if tx.send((i, Some(l))).is_err() {
                                return;
                            }
                        }
                        Err(_) => break,
                    }
                }
                let _ = tx.send((i, None));
            });
            procs.push(c);
        }
        Ok(Self {
            procs,
            stdins,
            rx,
            deadline,
        })
    }

    pub(crate) fn send(&mut self, i: usize, line: &str) -> Result<()> {
        writeln!(self.stdins[i], "{line}")
            .and_then(|_| self.stdins[i].flush())
            .map_err(|e| Error::msg(format!("process {i} ({}): {e}", self.procs[i].id())))
    }

    pub(crate) fn send_all(&mut self, line: &str) -> Result<()> {
        (0..self.procs.len()).try_for_each(|i| self.send(i, line))
    }

    /// Sends `line` to every child that still reads its input (ignoring those that exited).
    pub(crate) fn send_to_live(&mut self, line: &str) {
        for i in 0..self.procs.len() {
            if matches!(self.procs[i].try_wait(), Ok(None)) {
                let _ = self.send(i, line);
            }
        }
    }

    /// Sends `line` to child `i` and waits (until the deadline) for it to exit successfully.
    pub(crate) fn end(&mut self, i: usize, line: &str) -> Result<()> {
        self.send(i, line)?;
        loop {
            if let Some(status) = self.procs[i].try_wait()? {
                if !status.success() {
                    bail!("process {i} exited with {status}");
                }
                return Ok(());
            }
            if Instant::now() > self.deadline {
                bail!("process {i} did not exit");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// One line starting with `tag` from every child, in child order (the rest of each line).
    pub(crate) fn gather(&mut self, tag: &str) -> Result<Vec<String>> {
        let mut out: Vec<Option<String>> = vec![None; self.procs.len()];
        let mut missing = out.len();
        while missing > 0 {
            let left = self.deadline.saturating_duration_since(Instant::now());
            let (i, line) = self
                .rx
                .recv_timeout(left)
                .map_err(|_| Error::msg(format!("timed out waiting for {missing} processes to say {tag}")))?;
            let Some(line) = line else {
                if out[i].is_some() {
                    // It answered, then exited (after BYE).
                    continue;
                }
                let status = self.procs[i].wait().ok();
                bail!("process {i} ended before {tag} (status {status:?})");
            };
            let rest = line
                .strip_prefix(tag)
                .ok_or_else(|| Error::msg(format!("process {i} said {line:?}, expected {tag}")))?;
            if out[i].replace(rest.trim().to_string()).is_some() {
                bail!("process {i} said {tag} twice");
            }
            missing -= 1;
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        // Closing stdin ends a child that waits for its next line; kill any that does not.
        self.stdins.clear();
        let end = Instant::now() + Duration::from_secs(5);
        for c in &mut self.procs {
            while Instant::now() < end && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(10));
            }
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

pub(crate) fn num(s: &str, i: usize) -> Result<f64> {
    s.split_whitespace()
        .nth(i)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::msg(format!("bad report {s:?}")))
}

/// A child's line protocol with its parent: commands on stdin, answers on stdout.
pub(crate) struct Pipe<W: Write, R: BufRead> {
    out: W,
    input: R,
}

impl Pipe<std::io::StdoutLock<'static>, std::io::StdinLock<'static>> {
    /// This process's stdout and stdin.
    pub(crate) fn stdio() -> Self {
        Self {
            out: std::io::stdout().lock(),
            input: std::io::stdin().lock(),
        }
    }
}

impl<W: Write, R: BufRead> Pipe<W, R> {
    pub(crate) fn say(&mut self, s: &str) -> Result<()> {
        writeln!(self.out, "{s}")?;
        self.out.flush()?;
        Ok(())
    }

    /// The next line, trimmed; the parent's end of stdin is an error (it went away).
    pub(crate) fn line(&mut self) -> Result<String> {
        let mut line = String::new();
        if self.input.read_line(&mut line)? == 0 {
            bail!("the parent went away");
        }
        Ok(line.trim().to_string())
    }

    /// The rest of the next line, which must start with `tag`.
    pub(crate) fn expect(&mut self, tag: &str) -> Result<String> {
        let line = self.line()?;
        match line.strip_prefix(tag) {
            Some(rest) => Ok(rest.trim().to_string()),
            None => bail!("expected {tag}, got {line:?}"),
        }
    }
}

/// Threads of this process (`/proc/self/status`).
pub(crate) fn thread_count() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:").and_then(|v| v.trim().parse().ok()))
        })
        .unwrap_or(f64::NAN)
}

/// Open file descriptors of this process (`/proc/self/fd`, less the listing's own).
pub(crate) fn fd_count() -> f64 {
    std::fs::read_dir("/proc/self/fd").map_or(f64::NAN, |d| d.count().saturating_sub(1) as f64)
}
