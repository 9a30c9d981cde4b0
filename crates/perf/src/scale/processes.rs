//! Several processes: client/server pairs, each the same binary started again with `--role`.

use std::process::Command;
use std::time::{Duration, Instant};

use softverbs::Mtu;

use super::rig::{ack_timeout, psns, recv_depth, Rig, Target};
use super::usage::{idle_percent, rss_bytes};
use super::{fig, Figure, Role, ScaleArgs, ScaleOp};
use crate::endpoint::Info;
use crate::error::{bail, Error, Result};
use crate::procs::{free_base_port, num, Children, Pipe};

pub(super) fn processes(args: &ScaleArgs, p: u32) -> Result<Vec<Figure>> {
    if p < 2 || p % 2 != 0 || p > 254 {
        bail!("--processes must be an even number from 2 to 254");
    }
    let qps = args.qps.unwrap_or(1);
    if qps == 0 {
        bail!("--qps must be at least 1");
    }
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout);
    let mut env: Vec<(String, String)> = Vec::new();
    if std::env::var_os("SOFTVERBS_UDP_PORT").is_none() {
        // A private range: every child takes a slot above it, none meets another run.
        let slots = p as u16 + 1;
        env.push(("SOFTVERBS_UDP_PORT".into(), free_base_port(slots)?.to_string()));
        env.push(("SOFTVERBS_UDP_SLOTS".into(), slots.to_string()));
    }
    let exe = std::env::current_exe()?;
    let t_spawn = Instant::now();
    let cmds = (0..p as usize).map(|i| {
        let role = if i % 2 == 0 { "server" } else { "client" };
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--role",
            role,
            "--qps",
            &qps.to_string(),
            "--iters",
            &args.iters.to_string(),
            "--size",
            &args.size.to_string(),
            "--depth",
            &args.depth.to_string(),
            "--device",
            &args.device,
            "--timeout",
            &args.timeout.to_string(),
            "--ack-timeout",
            &ack_timeout(args, u64::from(p) * u64::from(qps)).to_string(),
            "--test",
            match args.test {
                ScaleOp::Write => "write",
                ScaleOp::Send => "send",
            },
        ])
        .envs(env.iter().map(|(k, v)| (k, v)));
        cmd
    });
    let mut ch = Children::spawn(cmds, deadline)?;
    // Each pair learns the other's endpoint; all connect.
    let eps = ch.gather("EP")?;
    for pair in 0..p as usize / 2 {
        let (s, c) = (2 * pair, 2 * pair + 1);
        let (es, ec) = (eps[s].clone(), eps[c].clone());
        ch.send(s, &format!("PEER {ec}"))?;
        ch.send(c, &format!("PEER {es}"))?;
    }
    let ready = ch.gather("READY")?;
    let setup_s = t_spawn.elapsed().as_secs_f64();
    let rss: Vec<f64> = ready.iter().map(|r| num(r, 0)).collect::<Result<_>>()?;
    // Idle: every process connected, none sending.
    let (idle, wakeups): (Vec<f64>, Vec<f64>) = if args.idle > 0.0 {
        ch.send_all(&format!("IDLE {}", args.idle))?;
        let r = ch.gather("IDLECPU")?;
        (
            r.iter().map(|r| num(r, 0)).collect::<Result<_>>()?,
            r.iter().map(|r| num(r, 1)).collect::<Result<_>>()?,
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let t_go = Instant::now();
    ch.send_all("GO")?;
    let done = ch.gather("SENT")?;
    let wall = t_go.elapsed().as_secs_f64();
    let msgs: f64 = done.iter().map(|r| num(r, 0)).sum::<Result<f64>>()?;
    let retransmits: f64 = done.iter().map(|r| num(r, 2)).sum::<Result<f64>>()?;
    let timeouts: f64 = done.iter().map(|r| num(r, 3)).sum::<Result<f64>>()?;
    let per_proc_rate: f64 = done
        .iter()
        .map(|r| Ok(num(r, 0)? / num(r, 1)?))
        .sum::<Result<f64>>()?;
    // Every sender's messages are acknowledged, so every receiver can check its memory.
    ch.send_all("VERIFY")?;
    let verified: f64 = ch
        .gather("VERIFIED")?
        .iter()
        .map(|r| num(r, 0))
        .sum::<Result<f64>>()?;
    ch.send_all("EXIT")?;
    ch.gather("BYE")?;
    let max = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::max);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let expected = f64::from(p) * f64::from(qps) * f64::from(args.iters);
    if msgs != expected {
        bail!("{msgs} messages completed, expected {expected}");
    }
    Ok(vec![
        fig("processes", f64::from(p), ""),
        fig("qps_per_process", f64::from(qps), ""),
        fig("setup_s", setup_s, "s"),
        fig("rss_per_process_mean", mean(&rss), "B"),
        fig("rss_per_process_max", max(&rss), "B"),
        fig(
            "idle_cpu_per_process_mean",
            if idle.is_empty() { f64::NAN } else { mean(&idle) },
            "% of a core",
        ),
        fig(
            "idle_cpu_per_process_max",
            if idle.is_empty() { f64::NAN } else { max(&idle) },
            "% of a core",
        ),
        fig(
            "idle_wakeups_per_process_max",
            if wakeups.is_empty() {
                f64::NAN
            } else {
                max(&wakeups)
            },
            "/s",
        ),
        fig("messages", msgs, ""),
        fig("message_size", f64::from(args.size), "B"),
        fig("burst_wall_s", wall, "s"),
        fig("msg_rate", msgs / wall, "msg/s"),
        fig("msg_rate_sum_of_processes", per_proc_rate, "msg/s"),
        fig("completions_ok", msgs, ""),
        fig("qps_verified", verified, ""),
        fig(
            "ack_timeout_exp",
            f64::from(ack_timeout(args, u64::from(p) * u64::from(qps))),
            "",
        ),
        fig("retransmits", retransmits, ""),
        fig("ack_timeouts", timeouts, ""),
    ])
}

/// One side of a pair: reads the parent's commands on stdin, answers on stdout.
pub(super) fn child(args: &ScaleArgs, role: Role) -> Result<()> {
    let n = args.qps.unwrap_or(1) as usize;
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout);
    let seed = match role {
        Role::Server => 0x3C,
        Role::Client => 0xA5,
        Role::Holder => bail!("a holder is not one side of a pair"),
    };
    let peer_seed = 0x3C ^ 0xA5 ^ seed;
    let mut rig = Rig::new(args, n, seed)?;
    rig.create_qps(n, recv_depth(args))?;
    let psn = psns(n);
    let mut io = Pipe::stdio();
    io.say(&format!("EP {}", rig.info(&psn).encode()))?;
    let peer = Info::decode(&io.expect("PEER")?)?;
    if peer.qps.len() != n || peer.len < rig.mr.len() as u64 {
        bail!("the peer's endpoint does not match this one's");
    }
    let mtu = Mtu::largest_within(rig.mtu.bytes().min(peer.mtu)).unwrap_or(Mtu::Mtu256);
    for (q, &dest) in peer.qps.iter().enumerate() {
        rig.connect(q, psn[q], dest, peer.gid, mtu)?;
    }
    rig.post_initial_recvs()?;
    io.say(&format!("READY {}", rss_bytes()?))?;
    loop {
        let cmd = io.line()?;
        if let Some(secs) = cmd.strip_prefix("IDLE ") {
            let secs: f64 = secs.parse().map_err(|_| Error::msg("bad IDLE"))?;
            let (cpu, wakeups) = idle_percent(secs)?;
            io.say(&format!("IDLECPU {cpu} {wakeups}"))?;
        } else if cmd == "GO" {
            break;
        } else {
            bail!("unexpected command {cmd:?}");
        }
    }
    let targets: Vec<Target> = (0..n)
        .map(|q| Target {
            addr: peer.addr,
            rkey: peer.rkey,
            slot: q,
        })
        .collect();
    let (msgs, secs) = rig.burst_explained(&targets, deadline)?;
    let c = rig.counters();
    io.say(&format!("SENT {msgs} {secs} {} {}", c[1], c[2]))?;
    io.expect("VERIFY")?;
    let verified = rig.verify(peer_seed, |r| r)?;
    io.say(&format!("VERIFIED {verified}"))?;
    io.expect("EXIT")?;
    drop(std::mem::take(&mut rig.qps));
    io.say("BYE")?;
    Ok(())
}
