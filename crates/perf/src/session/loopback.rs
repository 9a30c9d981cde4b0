//! The loopback modes: the server as a child process or a thread, the client here.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{client, server, PeerKind};
use crate::cli::Args;
use crate::error::{bail, Error, Result};
use crate::stats::Row;

/// Kills the server child if the client gives up early.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `--loopback`: a server child process (or thread with `--threads`) and the client here.
pub(crate) fn loopback(args: &Args) -> Result<Vec<Row>> {
    if args.threads {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let port = listener.local_addr()?.port();
        let server_args = args.clone();
        let handle = std::thread::Builder::new()
            .name("perf-server".into())
            .spawn(move || server(&server_args, &listener, true).map_err(|e| e.to_string()))?;
        let rows = client(args, "127.0.0.1", port, PeerKind::Thread);
        let served = handle
            .join()
            .map_err(|_| Error::msg("the server thread panicked"))?;
        let rows = rows?;
        served.map_err(|e| Error::msg(format!("server: {e}")))?;
        return Ok(rows);
    }
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(["--announce", "--port", "0"]);
    if let Some(d) = &args.device {
        cmd.args(["--device", d]);
    }
    if let Some(g) = args.gid_index {
        cmd.args(["--gid-index", &g.to_string()]);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut guard = ChildGuard(Some(cmd.spawn()?));
    let child = guard.0.as_mut().expect("spawned");
    let mut out = BufReader::new(child.stdout.take().expect("piped stdout"));
    let mut line = String::new();
    out.read_line(&mut line)?;
    let Some(port) = line
        .trim()
        .strip_prefix("PORT ")
        .and_then(|p| p.parse::<u16>().ok())
    else {
        bail!("the server child did not start (it said {:?})", line.trim());
    };
    let rows = client(args, "127.0.0.1", port, PeerKind::Process)?;
    // The server exits after BYE; give it a moment, then make sure it is gone.
    let mut child = guard.0.take().expect("child");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                bail!("the server child failed: {status}");
            }
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the server child did not exit");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(rows)
}

/// The server child of `--loopback`: announces its port on stdout, then serves silently.
pub(crate) fn announced_server(args: &Args) -> Result<()> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, args.port))?;
    println!("PORT {}", listener.local_addr()?.port());
    use std::io::Write as _;
    std::io::stdout().flush()?;
    server(args, &listener, true)
}
