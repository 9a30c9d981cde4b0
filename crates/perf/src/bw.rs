//! Bandwidth and message-rate runs: many work requests in flight on every QP.

use std::time::{Duration, Instant};

use softverbs::{SendRequest, WcOpcode, WcStatus, WorkCompletion};

use crate::cli::Connection;
use crate::endpoint::{split_wr_id, Endpoint, Info};
use crate::error::{bail, Result};
use crate::oob::Oob;

/// Send-queue bookkeeping of one QP with selective signaling: a completion of WR `k` means
/// every WR up to `k` is done.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SqTrack {
    pub(crate) posted: u64,
    pub(crate) done: u64,
    /// Whether the last WR posted asked for a completion.
    pub(crate) last_signaled: bool,
}

impl SqTrack {
    pub(crate) fn outstanding(&self) -> u64 {
        self.posted - self.done
    }
}

/// How long a run may go without any progress before it is declared stuck.
pub(crate) const STALL: Duration = Duration::from_secs(10);

/// Notices a run that stopped making progress (a lost UC message, a dead peer).
pub(crate) struct Watchdog {
    last: Instant,
    limit: Duration,
    /// Spins since the clock was last read.
    spins: u32,
}

impl Watchdog {
    pub(crate) fn new(limit: Duration) -> Self {
        Self {
            last: Instant::now(),
            limit,
            spins: 0,
        }
    }

    /// Something happened.
    pub(crate) fn progress(&mut self) {
        self.last = Instant::now();
        self.spins = 0;
    }

    /// Whether nothing happened for `d`.
    pub(crate) fn idle_for(&self, d: Duration) -> bool {
        self.last.elapsed() >= d
    }

    /// Fails if nothing happened for the limit (the clock is read every 64 calls).
    pub(crate) fn check(&mut self, what: &str) -> Result<()> {
        self.spins = self.spins.wrapping_add(1);
        if self.spins % 64 == 0 && self.idle_for(self.limit) {
            bail!("no progress for {:?} while {what}", self.limit);
        }
        Ok(())
    }
}

/// Fails on an unsuccessful completion, naming the QP's transport counters (what it resent,
/// how often its timer fired, the NAKs it got).
pub(crate) fn check_wc(ep: &Endpoint, wc: &WorkCompletion) -> Result<()> {
    if wc.status != WcStatus::Success {
        let (q, k) = split_wr_id(wc.wr_id);
        let counters = ep.qps.get(q).map(|qp| qp.counters());
        bail!(
            "work request {k} on QP index {q} failed: {} ({:?}); QP counters {counters:?}",
            wc.status.as_str(),
            wc.opcode
        );
    }
    Ok(())
}

/// What the client measured.
pub(crate) struct BwRun {
    /// Seconds from the first post to the last completion.
    pub(crate) secs: f64,
    /// (seconds, messages completed) at each poll that found completions.
    pub(crate) points: Vec<(f64, u64)>,
    /// Messages completed per QP.
    pub(crate) per_qp: Vec<u64>,
}

impl BwRun {
    pub(crate) fn total(&self) -> u64 {
        self.per_qp.iter().sum()
    }
}

/// The client side: posts `iters` messages per QP (or as many as fit in `duration`),
/// round-robin over the QPs, keeping up to `tx_depth` in flight on each.
pub(crate) fn client(
    ep: &Endpoint,
    remote: &Info,
    size: usize,
    iters: Option<u64>,
    duration: Option<Duration>,
) -> Result<BwRun> {
    let p = &ep.params;
    let nq = ep.qps.len();
    let total = iters.unwrap_or(u64::MAX);
    let depth = u64::from(p.tx_depth);
    let cq_mod = u64::from(p.cq_mod.max(1));
    let list = u64::from(p.post_list.max(1));
    let mut sq = vec![SqTrack::default(); nq];
    let mut wcs = vec![WorkCompletion::default(); 64];
    let mut batch: Vec<SendRequest> = Vec::with_capacity(list as usize);
    let mut points = Vec::with_capacity(1024);
    let mut completed = 0u64;
    let mut last_completion = 0.0;
    let mut stopping = false;
    let mut dog = Watchdog::new(STALL);
    let start = Instant::now();
    loop {
        if !stopping {
            for (q, s) in sq.iter_mut().enumerate() {
                // Post lists until the window or the run is full.
                loop {
                    let n = (depth - s.outstanding()).min(total - s.posted).min(list);
                    if n == 0 {
                        break;
                    }
                    for (i, k) in (s.posted..s.posted + n).enumerate() {
                        let signaled = (k + 1) % cq_mod == 0 || k + 1 == total;
                        match batch.get_mut(i) {
                            Some(wr) => ep.refill(wr, remote, q, k, size, signaled, None)?,
                            None => batch.push(ep.request(remote, q, k, size, signaled, None)?),
                        }
                        s.last_signaled = signaled;
                    }
                    ep.qps[q].post_send(&batch[..n as usize])?;
                    s.posted += n;
                    if n < list {
                        break;
                    }
                }
            }
        }
        let k = ep.poll(&mut wcs)?;
        for wc in &wcs[..k] {
            check_wc(ep, wc)?;
            let (q, idx) = split_wr_id(wc.wr_id);
            let s = &mut sq[q];
            if idx + 1 > s.done {
                completed += idx + 1 - s.done;
                s.done = idx + 1;
            }
        }
        if k > 0 {
            last_completion = start.elapsed().as_secs_f64();
            points.push((last_completion, completed));
            dog.progress();
        } else {
            dog.check("waiting for send completions")?;
        }
        if let Some(d) = duration {
            if !stopping && start.elapsed() >= d {
                stopping = true;
                // Unsignaled WRs at the tail would never be reported: end each QP with a
                // signaled one (there is always room: the send queue has one spare slot).
                for (q, s) in sq.iter_mut().enumerate() {
                    if s.posted > 0 && !s.last_signaled {
                        let wr = ep.request(remote, q, s.posted, size, true, None)?;
                        ep.qps[q].post_send(&[wr])?;
                        s.posted += 1;
                        s.last_signaled = true;
                    }
                }
            }
        }
        let finished = if stopping {
            sq.iter().all(|s| s.done == s.posted)
        } else {
            sq.iter().all(|s| s.done == total)
        };
        if finished {
            break;
        }
    }
    Ok(BwRun {
        secs: last_completion,
        points,
        per_qp: sq.iter().map(|s| s.done).collect(),
    })
}

/// Parses `END c0,c1,...` (messages per QP).
pub(crate) fn parse_end(rest: &str) -> Result<Vec<u64>> {
    rest.split(',')
        .map(|c| {
            c.trim()
                .parse::<u64>()
                .map_err(|_| crate::error::Error::msg(format!("bad END {rest:?}")))
        })
        .collect()
}

/// Waits until no packet has arrived for a while (at most a few seconds): over UC the sender
/// completes its work requests before the data lands, so the receiver settles before checking.
pub(crate) fn settle(ep: &Endpoint) {
    let mut last = ep.ctx.counters().rx_packets;
    let mut quiet = 0;
    let start = Instant::now();
    while quiet < 5 && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
        let now = ep.ctx.counters().rx_packets;
        quiet = if now == last { quiet + 1 } else { 0 };
        last = now;
    }
}

/// What the server saw of a SEND bandwidth run.
pub(crate) struct Received {
    /// Messages per QP, as the client's `END` reports them.
    pub(crate) counts: Vec<u64>,
    /// Messages that never arrived (UC only: RC retransmits).
    pub(crate) lost: u64,
    /// A message whose length was not the size.
    pub(crate) bad_len: Option<String>,
}

/// The server side of a SEND bandwidth run: keeps receive WRs posted until the client's `END`
/// says how many messages came and all of them are in. Over UC, messages lost on the way are
/// counted once nothing more arrives for a while.
pub(crate) fn server_send(
    ep: &mut Endpoint,
    oob: &mut Oob,
    size: usize,
    iters: Option<u64>,
) -> Result<Received> {
    const UC_GRACE: Duration = Duration::from_millis(300);
    let nq = ep.qps.len();
    let depth = ep.params.rx_depth;
    let uc = ep.params.connection == Connection::Uc;
    let mut wcs = vec![WorkCompletion::default(); 64];
    let mut repost = vec![0u32; nq];
    let mut received = 0u64;
    let mut bad_len = None;
    let mut end: Option<Vec<u64>> = None;
    let mut expected = iters.map(|n| n * nq as u64);
    let mut last_check = Instant::now();
    let mut dog = Watchdog::new(STALL);
    loop {
        let k = ep.poll(&mut wcs)?;
        for wc in &wcs[..k] {
            check_wc(ep, wc)?;
            if wc.opcode == WcOpcode::Recv {
                let q = wc.wr_id as usize;
                repost[q] += 1;
                ep.recvs_posted[q] -= 1;
                received += 1;
                if wc.byte_len as usize != size && bad_len.is_none() {
                    bad_len = Some(format!(
                        "a message of {} bytes arrived, expected {size}",
                        wc.byte_len
                    ));
                }
            }
        }
        if k > 0 {
            dog.progress();
        }
        for (q, r) in repost.iter_mut().enumerate() {
            if *r > 0 {
                ep.fill_recvs(q, depth)?;
                *r = 0;
            }
        }
        // Reading the socket is a system call: not on every empty poll, which would slow the
        // very loop being measured.
        if end.is_none() && last_check.elapsed() > Duration::from_millis(1) {
            last_check = Instant::now();
            if let Some(line) = oob.try_recv()? {
                let Some(rest) = line.strip_prefix("END ") else {
                    bail!("protocol error: expected END, got {line:?}")
                };
                let counts = parse_end(rest)?;
                expected = Some(counts.iter().sum());
                end = Some(counts);
            }
        }
        if let Some(e) = expected {
            let lost_for_good = uc && end.is_some() && k == 0 && dog.idle_for(UC_GRACE);
            if received >= e || lost_for_good {
                let counts = match end {
                    Some(c) => c,
                    // Everything is in; the END message is on its way.
                    None => parse_end(&oob.expect("END")?)?,
                };
                return Ok(Received {
                    counts,
                    lost: e.saturating_sub(received),
                    bad_len,
                });
            }
        }
        if k == 0 && end.is_some() && !uc {
            dog.check("waiting for the last messages")?;
        }
    }
}
