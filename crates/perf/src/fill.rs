//! `softverbs-scale --fill-slots`: processes on one host, each holding one RC QP, started until
//! the device refuses one (or a maximum is reached). A process's QP numbers carry its UDP slot
//! (bits 16..24), so a host has room for `SOFTVERBS_UDP_SLOTS` (at most 255) processes with QPs;
//! the next one must get an errno from the verb that creates its QP, not QPs whose traffic goes
//! astray, and a process that exits must give its slot to the next.
//!
//! Reports how many processes held QPs, whether their slots were all distinct, the errno and
//! message of the first refusal, whether a slot freed by one holder's exit served a new process,
//! and the resident set of the holders.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use softverbs::{QpInit, QpType};

use crate::error::{bail, Error, Result};
use crate::procs::{free_base_port, open_device, Children, Pipe};
use crate::scale::{fig, rss_bytes, Figure, Role, ScaleArgs};

/// Holders started at once: enough to fill 255 slots in a few rounds, few enough that a small
/// host is not swamped by processes starting together.
const BATCH: usize = 16;

/// What one holder said: its QP number and resident set, or the errno and message of the
/// refusal.
enum Held {
    Qp { qpn: u32, rss: f64 },
    Refused { errno: i32, message: String },
}

fn parse(line: &str) -> Result<Held> {
    let bad = || Error::msg(format!("bad holder report {line:?}"));
    if let Some(rest) = line.strip_prefix("held ") {
        let mut w = rest.split_whitespace();
        let qpn =
            u32::from_str_radix(w.next().ok_or_else(bad)?.trim_start_matches("0x"), 16).map_err(|_| bad())?;
        let rss = w.next().and_then(|v| v.parse().ok()).ok_or_else(bad)?;
        Ok(Held::Qp { qpn, rss })
    } else if let Some(rest) = line.strip_prefix("refused ") {
        let (errno, message) = rest.split_once(' ').unwrap_or((rest, ""));
        Ok(Held::Refused {
            errno: errno.parse().map_err(|_| bad())?,
            message: message.to_string(),
        })
    } else {
        Err(bad())
    }
}

/// The parent: starts holders in batches until one is refused or `max` were started.
pub(crate) fn fill(args: &ScaleArgs, max: u32) -> Result<Vec<Figure>> {
    if max < 2 {
        bail!("--fill-slots needs --processes of at least 2");
    }
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout);
    let mut env: Vec<(String, String)> = Vec::new();
    if std::env::var_os("SOFTVERBS_UDP_PORT").is_none() {
        // A private range of the default 255 slots, so that no other run takes one of them.
        env.push(("SOFTVERBS_UDP_PORT".into(), free_base_port(255)?.to_string()));
    }
    let exe = std::env::current_exe()?;
    let holder = || {
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--role",
            "holder",
            "--device",
            &args.device,
            "--timeout",
            &args.timeout.to_string(),
        ])
        .envs(env.iter().map(|(k, v)| (k, v)));
        cmd
    };
    let t0 = Instant::now();
    // Every holder started, by batch; what each said.
    let mut batches: Vec<Children> = Vec::new();
    let mut held: Vec<(usize, usize, u32, f64)> = Vec::new();
    let mut refused: Vec<(i32, String)> = Vec::new();
    let mut started = 0u32;
    while started < max && refused.is_empty() {
        let n = BATCH.min((max - started) as usize);
        let mut ch = Children::spawn((0..n).map(|_| holder()), deadline)?;
        for (i, line) in ch.gather("QP")?.iter().enumerate() {
            match parse(line)? {
                Held::Qp { qpn, rss } => held.push((batches.len(), i, qpn, rss)),
                Held::Refused { errno, message } => refused.push((errno, message)),
            }
        }
        started += n as u32;
        batches.push(ch);
    }
    let fill_s = t0.elapsed().as_secs_f64();
    let slots: BTreeSet<u32> = held.iter().map(|h| h.2 >> 16).collect();
    if slots.len() != held.len() {
        bail!(
            "{} processes held QPs in only {} distinct slots",
            held.len(),
            slots.len()
        );
    }
    // A holder exits; its slot must serve the next process.
    let mut reused = f64::NAN;
    let mut after_exit = String::new();
    if let (Some(&(b, i, qpn, _)), false) = (held.first(), refused.is_empty()) {
        batches[b].end(i, "EXIT")?;
        let mut ch = Children::spawn([holder()], deadline)?;
        after_exit = ch.gather("QP")?.remove(0);
        reused = match parse(&after_exit)? {
            Held::Qp { qpn: new, .. } if new >> 16 == qpn >> 16 => 1.0,
            _ => 0.0,
        };
        batches.push(ch);
    }
    for ch in &mut batches {
        ch.send_to_live("EXIT");
    }
    drop(batches);
    let rss: Vec<f64> = held.iter().map(|h| h.3).collect();
    let mean = if rss.is_empty() {
        f64::NAN
    } else {
        rss.iter().sum::<f64>() / rss.len() as f64
    };
    let max_rss = rss.iter().copied().fold(f64::NAN, f64::max);
    let (errno, message) = refused
        .first()
        .cloned()
        .unwrap_or((0, "none: every process got its QP".into()));
    println!("first_refusal {message}");
    if !after_exit.is_empty() {
        println!("after_one_exit {after_exit}");
    }
    Ok(vec![
        fig("processes_started", f64::from(started), ""),
        fig("processes_holding_qps", held.len() as f64, ""),
        fig("distinct_slots", slots.len() as f64, ""),
        fig("processes_refused", refused.len() as f64, ""),
        fig("refused_errno", f64::from(errno), ""),
        fig("slot_reused_after_exit", reused, ""),
        fig("fill_s", fill_s, "s"),
        fig("rss_per_process_mean", mean, "B"),
        fig("rss_per_process_max", max_rss, "B"),
    ])
}

/// A holder: opens the device, creates one RC QP (or reports why not) and keeps it until the
/// parent says EXIT.
pub(crate) fn holder(args: &ScaleArgs) -> Result<()> {
    debug_assert_eq!(args.role, Some(Role::Holder));
    let (ctx, _, _) = open_device(&args.device)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(4, None, 0)?;
    let mut io = Pipe::stdio();
    let qp = match pd.create_qp(&QpInit::new(QpType::Rc, &cq)) {
        Ok(qp) => {
            io.say(&format!("QP held {:#x} {}", qp.qp_num(), rss_bytes()?))?;
            Some(qp)
        }
        Err(e) => {
            io.say(&format!("QP refused {} {e}", e.errno()))?;
            None
        }
    };
    io.expect("EXIT")?;
    drop(qp);
    io.say("BYE")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_parse() {
        match parse("held 0x3f0011 4096").unwrap() {
            Held::Qp { qpn, rss } => assert_eq!((qpn, rss), (0x3f0011, 4096.0)),
            Held::Refused { .. } => panic!("held"),
        }
        match parse("refused 12 no free UDP slot").unwrap() {
            Held::Refused { errno, message } => {
                assert_eq!((errno, message.as_str()), (12, "no free UDP slot"));
            }
            Held::Qp { .. } => panic!("refused"),
        }
        assert!(parse("held zz").is_err());
        assert!(parse("what").is_err());
    }
}
