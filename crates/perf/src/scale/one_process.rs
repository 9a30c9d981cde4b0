//! One process: N QPs connected in pairs to each other.

use std::time::{Duration, Instant};

use super::rig::{psns, recv_depth, Rig, Target};
use super::usage::{idle_percent, rss_bytes, status_bytes};
use super::{fig, Figure, ScaleArgs};
use crate::error::{bail, Result};
use crate::procs;

pub(super) fn one_process(args: &ScaleArgs) -> Result<Vec<Figure>> {
    let n = args.qps.unwrap_or(10_000) as usize;
    if n < 2 || n % 2 != 0 {
        bail!("--qps must be an even number of at least 2 (the QPs are connected in pairs)");
    }
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout);
    let mut rig = Rig::new(args, n, 0x5A)?;
    let rss0 = rss_bytes()?;
    let anon0 = status_bytes("RssAnon");
    let t0 = Instant::now();
    rig.create_qps(n, recv_depth(args))?;
    let create_s = t0.elapsed().as_secs_f64();
    let psn = psns(n);
    let (gid, mtu) = (rig.gid, rig.mtu);
    for q in 0..n {
        let p = q ^ 1;
        rig.connect(q, psn[q], (rig.qps[p].qp_num(), psn[p]), gid, mtu)?;
    }
    let create_connect_s = t0.elapsed().as_secs_f64();
    let rss1 = rss_bytes()?;
    let anon1 = status_bytes("RssAnon");
    let per_qp = rss1.saturating_sub(rss0) as f64 / n as f64;
    let anon_per_qp = match (anon0, anon1) {
        (Some(a), Some(b)) => b.saturating_sub(a) as f64 / n as f64,
        _ => f64::NAN,
    };
    let (idle_connected, wakeups_connected) = if args.idle > 0.0 {
        idle_percent(args.idle)?
    } else {
        (f64::NAN, f64::NAN)
    };
    rig.post_initial_recvs()?;
    let (addr, rkey) = (rig.mr.addr(), rig.mr.rkey());
    let targets: Vec<Target> = (0..n)
        .map(|q| Target {
            addr,
            rkey,
            slot: q ^ 1,
        })
        .collect();
    let (msgs, secs) = rig.burst_explained(&targets, deadline)?;
    let c = rig.counters();
    // QP q's messages land in slot q ^ 1, so slot r holds what QP r ^ 1 sent.
    let verified = rig.verify(rig.seed, |r| r ^ 1)?;
    let (idle_after, wakeups_after) = if args.idle > 0.0 {
        idle_percent(args.idle)?
    } else {
        (f64::NAN, f64::NAN)
    };
    let threads = procs::thread_count();
    let hwm = status_bytes("VmHWM").map_or(f64::NAN, |b| b as f64);
    let rss_connected = rss_bytes()?;
    let t1 = Instant::now();
    let qps = std::mem::take(&mut rig.qps);
    drop(qps);
    let destroy_s = t1.elapsed().as_secs_f64();
    let rss_destroyed = rss_bytes()?;
    Ok(vec![
        fig("qps", n as f64, ""),
        fig("create_s", create_s, "s"),
        fig("create_connect_s", create_connect_s, "s"),
        fig("bytes_per_qp", per_qp, "B"),
        fig("anon_bytes_per_qp", anon_per_qp, "B"),
        fig("rss_before_qps", rss0 as f64, "B"),
        fig("rss_connected", rss1 as f64, "B"),
        fig("idle_cpu_connected", idle_connected, "% of a core"),
        fig("idle_wakeups_connected", wakeups_connected, "/s"),
        fig("messages", msgs as f64, ""),
        fig("message_size", args.size as f64, "B"),
        fig("burst_s", secs, "s"),
        fig("msg_rate", msgs as f64 / secs, "msg/s"),
        fig("completions_ok", msgs as f64, ""),
        fig("qps_verified", verified as f64, ""),
        fig("packets_sent", c[0] as f64, ""),
        fig("ack_timeout_exp", f64::from(rig.ack_timeout), ""),
        fig("retransmits", c[1] as f64, ""),
        fig("ack_timeouts", c[2] as f64, ""),
        fig("rnr_naks", c[3] as f64, ""),
        fig("seq_naks", c[4] as f64, ""),
        fig("idle_cpu_after_traffic", idle_after, "% of a core"),
        fig("idle_wakeups_after_traffic", wakeups_after, "/s"),
        fig("threads", threads, ""),
        fig("rss_after_traffic", rss_connected as f64, "B"),
        fig("vm_hwm", hwm, "B"),
        fig("destroy_s", destroy_s, "s"),
        fig("rss_destroyed", rss_destroyed as f64, "B"),
    ])
}
