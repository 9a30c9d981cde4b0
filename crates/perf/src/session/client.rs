//! The client: drives the run phase by phase and reports.

use std::time::Duration;

use super::{format_of, handshake, idle, PeerKind, PROTOCOL};
use crate::bw;
use crate::cli::{Args, Format, Metric, Params, TestKind};
use crate::endpoint::{Endpoint, Info, Side};
use crate::error::{bail, Result};
use crate::lat::{counter, Pinger};
use crate::oob::Oob;
use crate::stats::{bw_row, lat_row, IdleRow, Reporter, Row};

/// Warm-up runs move at most this many bytes per QP.
const WARMUP_BYTES: usize = 64 << 20;

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

pub(super) fn print_header(ep: &Endpoint, remote: &Info, p: &Params, peer: PeerKind) {
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
                (row.retransmits, row.timeouts, row.tail_probes) =
                    (after.0 - before.0, after.1 - before.1, after.2 - before.2);
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
