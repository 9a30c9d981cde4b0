//! The two roles and how they talk: the client drives the run phase by phase, the server
//! follows; plus the loopback modes that start both from one command.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::bw;
use crate::cli::{Args, Connection, Format, Metric, Params, TestKind};
use crate::endpoint::{Endpoint, Info, Side};
use crate::error::{bail, Error, Result};
use crate::lat::{counter, Pinger};
use crate::oob::Oob;
use crate::stats::{bw_row, lat_row, IdleRow, Reporter, Row};

/// Protocol identifier in the client's `HELLO`.
const PROTOCOL: &str = "softverbs-perf/1";

/// Warm-up runs move at most this many bytes per QP.
const WARMUP_BYTES: usize = 64 << 20;

/// Where the server process or thread is, for the header.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PeerKind {
    /// Another process (possibly another host): RoCEv2 over UDP.
    Process,
    /// A thread of this process: the device's in-memory path.
    Thread,
}

impl PeerKind {
    fn describe(self) -> &'static str {
        match self {
            Self::Process => "other process (RoCEv2 over UDP)",
            Self::Thread => "thread of this process (in-memory path)",
        }
    }
}

fn format_of(args: &Args) -> Format {
    if args.json {
        Format::Json
    } else if args.csv {
        Format::Csv
    } else {
        Format::Table
    }
}

/// CPU time (user + system) of this process so far, in seconds.
fn cpu_seconds() -> Result<f64> {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_SELF)?;
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    Ok(secs(u.user_time()) + secs(u.system_time()))
}

/// Stays idle for `secs`; returns (CPU seconds used, wall seconds).
fn idle(secs: f64) -> Result<(f64, f64)> {
    let (c0, t0) = (cpu_seconds()?, Instant::now());
    std::thread::sleep(Duration::from_secs_f64(secs));
    Ok((cpu_seconds()? - c0, t0.elapsed().as_secs_f64()))
}

/// The connection setup both roles share: resources, endpoint exchange, QPs to RTS.
fn handshake(oob: &mut Oob, side: Side, params: &Params, args: &Args) -> Result<(Endpoint, Info)> {
    let mut ep = Endpoint::create(
        side,
        params,
        args.device.as_deref(),
        args.gid_index,
        oob.local_ip()?,
    )?;
    let remote = match side {
        Side::Client => {
            oob.send(&format!("EP {}", ep.info().encode()))?;
            Info::decode(&oob.expect("EP")?)?
        }
        Side::Server => {
            let r = Info::decode(&oob.expect("EP")?)?;
            oob.send(&format!("EP {}", ep.info().encode()))?;
            r
        }
    };
    ep.connect(&remote)?;
    // Both sides are at RTS before the client sends anything.
    match side {
        Side::Client => {
            oob.send("READY")?;
            oob.expect("READY")?;
        }
        Side::Server => {
            oob.expect("READY")?;
            oob.send("READY")?;
        }
    }
    Ok((ep, remote))
}

// ---------------------------------------------------------------------------------------------
// Client

/// What a phase of the run gave the client.
struct PhaseOut {
    bw: Option<bw::BwRun>,
    samples: Vec<f64>,
}

/// Runs one phase: announces it, runs the client's part, collects the server's check.
fn client_phase(
    ep: &mut Endpoint,
    remote: &Info,
    oob: &mut Oob,
    size: usize,
    iters: Option<u64>,
    duration: Option<Duration>,
) -> Result<PhaseOut> {
    let p = ep.params.clone();
    ep.clear_targets(size)?;
    if p.metric == Metric::Lat && p.test == TestKind::Send {
        ep.fill_recvs(0, 1)?;
    }
    oob.send(&format!("PHASE {size} {}", iters.unwrap_or(0)))?;
    oob.expect("GO")?;
    let (out, counts, bad_len) = match p.metric {
        Metric::Bw => {
            let run = bw::client(ep, remote, size, iters, duration)?;
            let counts = run.per_qp.clone();
            (
                PhaseOut {
                    bw: Some(run),
                    samples: Vec::new(),
                },
                counts,
                None,
            )
        }
        Metric::Lat => {
            let n = iters.unwrap_or(1);
            let mut pinger = Pinger::new(ep, remote, size);
            let samples = pinger.client(n)?;
            let bad = pinger.bad_len;
            (PhaseOut { bw: None, samples }, vec![n], bad)
        }
        Metric::Idle => bail!("no phases in an idle run"),
    };
    let c: Vec<String> = counts.iter().map(ToString::to_string).collect();
    oob.send(&format!("END {}", c.join(",")))?;
    let done = oob.expect("DONE")?;
    let mut parts = done.splitn(4, ' ');
    let mut field = |key: &str| {
        parts
            .next()
            .and_then(|t| t.strip_prefix(key))
            .unwrap_or("")
            .to_string()
    };
    let (words, lost, check) = (field("words="), field("lost="), field("check="));
    let why = parts.next().unwrap_or("");
    let lost: u64 = lost.parse().unwrap_or(0);
    if lost > 0 {
        eprintln!(
            "softverbs-perf: {lost} of {} messages of {size} bytes were lost (UC)",
            counts.iter().sum::<u64>()
        );
    }
    if check == "bad" {
        bail!("data check failed on the server at {size} bytes: {why}");
    }
    if p.check {
        if let Some(l) = bad_len {
            bail!("data check failed at {size} bytes: a message of {l} bytes arrived");
        }
        let last = match (p.metric, p.test) {
            (Metric::Lat, TestKind::Write) => Some(counter(counts[0] - 1)),
            _ => None,
        };
        let mine = match (p.metric, p.test) {
            (_, TestKind::Read) | (Metric::Lat, TestKind::Send | TestKind::Write) => {
                ep.verify_dst(size, last)
            }
            (_, TestKind::Atomic) => {
                let words: Vec<u64> = words.split(',').map(|w| w.parse().unwrap_or(u64::MAX)).collect();
                (words != counts).then(|| format!("the atomic words are {words:?}, expected {counts:?}"))
            }
            _ => None,
        };
        if let Some(why) = mine {
            bail!("data check failed at {size} bytes: {why}");
        }
    }
    Ok(out)
}

fn cap_warmup(warmup: u64, size: usize) -> u64 {
    warmup.min((WARMUP_BYTES / size).max(2) as u64)
}

fn print_header(ep: &Endpoint, remote: &Info, p: &Params, peer: PeerKind) {
    const RULE: &str =
        "---------------------------------------------------------------------------------------";
    println!("{RULE}");
    println!("                    {}", p.title());
    let pairs = [
        ("Device", ep.device.clone()),
        ("Peer", peer.describe().to_string()),
        ("Number of qps", p.qps.to_string()),
        ("Transport type", format!("{} (RoCEv2)", p.connection.name())),
        (
            "TX depth",
            if p.metric == Metric::Lat {
                "1".to_string()
            } else {
                p.tx_depth.to_string()
            },
        ),
        ("CQ Moderation", p.cq_mod.to_string()),
        ("Post list", p.post_list.to_string()),
        ("Mtu", format!("{}[B]", ep.mtu.bytes())),
        ("Max inline data", format!("{}[B]", p.inline)),
        ("Data check", if p.check { "ON" } else { "OFF" }.to_string()),
        (
            "Memory",
            if p.zero_copy {
                "owned, zero copy"
            } else {
                "atomic words"
            }
            .to_string(),
        ),
        (
            "Run length",
            match (p.iters, p.duration) {
                (Some(n), _) => format!("{n} iterations"),
                (None, Some(d)) => format!("{d} s per size"),
                _ => "-".to_string(),
            },
        ),
        ("Outstand reads", ep.max_rd_atomic.to_string()),
    ];
    for pair in pairs.chunks(2) {
        let (k1, v1) = &pair[0];
        let mut line = format!(" {k1:<15}: {v1:<32}");
        if let Some((k2, v2)) = pair.get(1) {
            line.push_str(&format!("{k2:<15}: {v2}"));
        }
        println!("{}", line.trim_end());
    }
    println!("{RULE}");
    for (i, (qp, psn)) in ep.qps.iter().zip(&ep.psns).enumerate().take(8) {
        println!(
            " local address:  QPN {:#08x} PSN {psn:#08x} RKey {:#010x} VAddr {:#018x}",
            qp.qp_num(),
            ep.mr.rkey(),
            ep.mr.addr()
        );
        if i == 0 {
            println!(" GID: {} ({})", ep.gid, ep.gid.to_ip());
        }
    }
    for (i, (qpn, psn)) in remote.qps.iter().enumerate().take(8) {
        println!(
            " remote address: QPN {qpn:#08x} PSN {psn:#08x} RKey {:#010x} VAddr {:#018x}",
            remote.rkey, remote.addr
        );
        if i == 0 {
            println!(" GID: {} ({})", remote.gid, remote.gid.to_ip());
        }
    }
    if ep.qps.len() > 8 {
        println!(" ... {} QPs in all", ep.qps.len());
    }
}

fn meta(ep: &Endpoint, p: &Params, peer: PeerKind) -> Vec<(String, String)> {
    let mut m = vec![
        ("title", p.title()),
        ("test", p.test.name().to_string()),
        ("connection", p.connection.name().to_string()),
        ("metric", p.metric.name().to_string()),
        ("device", ep.device.clone()),
        ("peer", peer.describe().to_string()),
        ("qps", p.qps.to_string()),
        ("tx_depth", p.tx_depth.to_string()),
        ("cq_mod", p.cq_mod.to_string()),
        ("post_list", p.post_list.to_string()),
        ("inline", p.inline.to_string()),
        ("mtu", ep.mtu.bytes().to_string()),
        ("check", p.check.to_string()),
        ("zero_copy", p.zero_copy.to_string()),
    ];
    if p.test == TestKind::Atomic {
        m.push(("atomic", p.atomic.name().to_string()));
    }
    if let Some(d) = p.duration {
        m.push(("duration_s", format!("{d}")));
    }
    if p.metric == Metric::Lat {
        let one_way = matches!(p.test, TestKind::Send | TestKind::Write);
        m.push((
            "latency",
            if one_way { "one-way (RTT/2)" } else { "round trip" }.to_string(),
        ));
    }
    m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// The client: connects to `host:port`, runs the test and prints the results.
pub(crate) fn client(args: &Args, host: &str, port: u16, peer: PeerKind) -> Result<Vec<Row>> {
    let params = Params::from_args(args)?;
    let mut oob = Oob::connect(host, port, Duration::from_secs(10))?;
    oob.send(&format!("HELLO {PROTOCOL} {}", params.encode()))?;
    let result = client_session(args, &params, &mut oob, peer);
    if let Err(e) = &result {
        oob.send_error(e);
    }
    result
}

fn client_session(args: &Args, params: &Params, oob: &mut Oob, peer: PeerKind) -> Result<Vec<Row>> {
    let (mut ep, remote) = handshake(oob, Side::Client, params, args)?;
    let format = format_of(args);
    if format == Format::Table {
        print_header(&ep, &remote, params, peer);
    }
    let mut rep = Reporter::new(format, meta(&ep, params, peer));
    let p = params;
    match p.metric {
        Metric::Idle => {
            oob.send(&format!("IDLE {}", p.idle_secs))?;
            oob.expect("GO")?;
            let (cpu, wall) = idle(p.idle_secs)?;
            let theirs = oob.expect("IDLE")?;
            let v: Vec<f64> = theirs.split_whitespace().filter_map(|x| x.parse().ok()).collect();
            let [scpu, swall] = v[..] else {
                bail!("bad IDLE reply {theirs:?}")
            };
            rep.add(Row::Idle(IdleRow {
                seconds: wall,
                client_cpu_pct: 100.0 * cpu / wall,
                server_cpu_pct: 100.0 * scpu / swall,
            }));
        }
        Metric::Bw => {
            for &size in &p.sizes {
                let warm = cap_warmup(p.warmup, size);
                if warm > 0 {
                    client_phase(&mut ep, &remote, oob, size, Some(warm), None)?;
                }
                let before = ep.resends();
                let out = client_phase(&mut ep, &remote, oob, size, p.iters, p.duration())?;
                let run = out.bw.expect("bandwidth phase");
                let total = run.total();
                let iterations = p.iters.unwrap_or(total / u64::from(p.qps));
                let mut row = bw_row(size, iterations, total, run.secs, &run.points);
                let after = ep.resends();
                (row.retransmits, row.timeouts) = (after.0 - before.0, after.1 - before.1);
                rep.add(Row::Bw(row));
            }
        }
        Metric::Lat => {
            let divisor = if matches!(p.test, TestKind::Send | TestKind::Write) {
                2.0
            } else {
                1.0
            };
            for &size in &p.sizes {
                // A timed run needs a calibration: the warm-up's mean round trip.
                let warm = if p.duration.is_some() {
                    cap_warmup(p.warmup.max(100), size)
                } else {
                    cap_warmup(p.warmup, size)
                };
                let mut mean_ns = 0.0;
                if warm > 0 {
                    let out = client_phase(&mut ep, &remote, oob, size, Some(warm), None)?;
                    mean_ns = out.samples.iter().sum::<f64>() / out.samples.len().max(1) as f64;
                }
                let iters = match (p.iters, p.duration) {
                    (Some(n), _) => n,
                    (None, Some(d)) => ((d * 1e9 / mean_ns.max(1.0)).ceil() as u64).max(1),
                    (None, None) => 1000,
                };
                let out = client_phase(&mut ep, &remote, oob, size, Some(iters), None)?;
                rep.add(Row::Lat(lat_row(size, &out.samples, divisor)));
            }
        }
    }
    oob.send("BYE")?;
    rep.finish();
    if format == Format::Table && p.check && p.metric != Metric::Idle {
        println!(" Data check: passed for {} size(s)", p.sizes.len());
    }
    Ok(rep.rows().to_vec())
}

// ---------------------------------------------------------------------------------------------
// Server

/// Listens on `port` (every address, IPv6 and IPv4 where possible).
pub(crate) fn listen(port: u16) -> Result<TcpListener> {
    let v6 = SocketAddr::from((Ipv6Addr::UNSPECIFIED, port));
    match TcpListener::bind(v6) {
        Ok(l) => Ok(l),
        Err(_) => TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
            .map_err(|e| Error::msg(format!("cannot listen on TCP port {port}: {e}"))),
    }
}

/// The server: serves one client on `listener`. `quiet` prints nothing.
pub(crate) fn server(args: &Args, listener: &TcpListener, quiet: bool) -> Result<()> {
    if !quiet {
        println!(
            " Waiting for a client on TCP port {} ...",
            listener.local_addr()?.port()
        );
    }
    let (stream, _) = listener.accept()?;
    let mut oob = Oob::new(stream)?;
    let result = server_session(args, &mut oob, quiet);
    if let Err(e) = &result {
        oob.send_error(e);
    }
    result
}

fn server_session(args: &Args, oob: &mut Oob, quiet: bool) -> Result<()> {
    let hello = oob.expect("HELLO")?;
    let Some((proto, rest)) = hello.split_once(' ') else {
        bail!("bad HELLO {hello:?}")
    };
    if proto != PROTOCOL {
        bail!("the client speaks {proto}, this server {PROTOCOL}");
    }
    let params = Params::decode(rest)?;
    let (mut ep, remote) = handshake(oob, Side::Server, &params, args)?;
    if !quiet {
        println!(" Client {} connected: {}", oob.peer_ip()?, params.title());
        print_header(&ep, &remote, &params, PeerKind::Process);
    }
    loop {
        let line = oob.recv()?;
        let mut words = line.split_whitespace();
        match words.next() {
            Some("PHASE") => {
                let mut num = || words.next().and_then(|w| w.parse::<u64>().ok());
                let (Some(size), Some(iters)) = (num(), num()) else {
                    bail!("bad PHASE {line:?}")
                };
                server_phase(
                    &mut ep,
                    &remote,
                    oob,
                    size as usize,
                    Some(iters).filter(|&n| n > 0),
                )?;
            }
            Some("IDLE") => {
                let secs: f64 = words.next().and_then(|w| w.parse().ok()).unwrap_or(1.0);
                oob.send("GO")?;
                let (cpu, wall) = idle(secs)?;
                oob.send(&format!("IDLE {cpu} {wall}"))?;
            }
            Some("BYE") => break,
            _ => bail!("protocol error: unexpected {line:?}"),
        }
    }
    if !quiet {
        println!(" Client done.");
    }
    Ok(())
}

fn server_phase(
    ep: &mut Endpoint,
    remote: &Info,
    oob: &mut Oob,
    size: usize,
    iters: Option<u64>,
) -> Result<()> {
    let p = ep.params.clone();
    if size == 0 || size > ep.layout.max {
        bail!("size {size} is outside 1..={}", ep.layout.max);
    }
    ep.clear_targets(size)?;
    match (p.metric, p.test) {
        (Metric::Bw, TestKind::Send) => {
            for q in 0..ep.qps.len() {
                ep.fill_recvs(q, p.rx_depth)?;
            }
        }
        (Metric::Lat, TestKind::Send) => ep.fill_recvs(0, 1)?,
        _ => {}
    }
    oob.send("GO")?;
    let mut lost = 0;
    let (counts, bad_len) = match (p.metric, p.test) {
        (Metric::Bw, TestKind::Send) => {
            let r = bw::server_send(ep, oob, size, iters)?;
            lost = r.lost;
            (r.counts, r.bad_len)
        }
        (Metric::Lat, TestKind::Send | TestKind::Write) => {
            let n = iters.unwrap_or(0);
            let mut pinger = Pinger::new(ep, remote, size);
            pinger.server(n)?;
            let bad = pinger
                .bad_len
                .map(|l| format!("a message of {l} bytes arrived, expected {size}"));
            (bw::parse_end(&oob.expect("END")?)?, bad)
        }
        // READ, atomics and WRITE bandwidth: the device answers without this thread.
        _ => {
            let counts = bw::parse_end(&oob.expect("END")?)?;
            if p.connection == Connection::Uc {
                bw::settle(ep);
            }
            (counts, None)
        }
    };
    let words = if p.test == TestKind::Atomic {
        let w: Vec<String> = (0..ep.qps.len())
            .map(|q| ep.atomic_word(q).map(|v| v.to_string()))
            .collect::<Result<_>>()?;
        w.join(",")
    } else {
        "-".to_string()
    };
    let problem = if !p.check {
        None
    } else if let Some(b) = bad_len {
        Some(b)
    } else {
        match (p.metric, p.test) {
            (_, TestKind::Send) | (Metric::Bw, TestKind::Write) => ep.verify_dst(size, None),
            (Metric::Lat, TestKind::Write) => ep.verify_dst(
                size,
                Some(counter(counts.first().copied().unwrap_or(1).max(1) - 1)),
            ),
            _ => None,
        }
    };
    let check = match (&problem, p.check) {
        (Some(_), _) => "bad",
        (None, true) => "ok",
        (None, false) => "skip",
    };
    oob.send(&format!(
        "DONE words={words} lost={lost} check={check} {}",
        problem.unwrap_or_default()
    ))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Loopback

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
