//! CQ moderation (`ibv_modify_cq` with `IBV_CQ_MODERATE`): an armed CQ holds its completion
//! event back until `cq_count` matching completions are queued or `cq_period` microseconds
//! passed since the first of them, whichever comes first.
//!
//! The period is enforced by one timer thread per process, so an event that is held back is
//! raised within the period even when no further completion and no poll ever comes.

use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use softverbs_engine::{Error, Result};

use super::cq::Cq;

/// `cq_mod_caps.max_cq_count`: the whole `uint16_t` range.
pub const MAX_CQ_COUNT: u16 = u16::MAX;
/// `cq_mod_caps.max_cq_period` in microseconds (as ConnectX: a 12-bit field).
pub const MAX_CQ_PERIOD: u16 = 4095;

/// The moderation of one CQ (`struct ibv_moderate_cq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Moderation {
    /// Completions per event; 0 or 1 raise the event at the first completion unless a period
    /// is set (0 with a period: only the period raises it).
    pub cq_count: u16,
    /// Microseconds from the first held-back completion to the event; 0: no time bound (as on
    /// a ConnectX HCA, the count alone then decides).
    pub cq_period: u16,
}

impl Moderation {
    /// Whether an event is raised at the first matching completion.
    pub(crate) fn immediate(&self) -> bool {
        (self.cq_period == 0 && self.cq_count <= 1) || self.cq_count == 1
    }

    /// Whether `n` held-back completions reach the count.
    pub(crate) fn count_reached(&self, n: u32) -> bool {
        self.cq_count != 0 && n >= u32::from(self.cq_count)
    }

    /// When the event of completions held back from `first` is due, if the period bounds it.
    pub(crate) fn deadline(&self, first: Instant) -> Option<Instant> {
        (self.cq_period != 0).then(|| first + Duration::from_micros(u64::from(self.cq_period)))
    }
}

/// Deadlines of held-back events: (due, CQ, the CQ's moderation round at scheduling).
type Pending = Vec<(Instant, Weak<Cq>, u64)>;

struct Timer {
    pending: Mutex<Pending>,
    wake: Condvar,
}

static TIMER: OnceLock<Arc<Timer>> = OnceLock::new();

/// Starts the process's moderation timer thread unless it runs: `ibv_modify_cq` calls this
/// before it sets a period, so that the verb, not a later completion, fails with ENOMEM when the
/// thread limit is reached.
pub(crate) fn start() -> Result<()> {
    static STARTING: Mutex<()> = Mutex::new(());
    if TIMER.get().is_some() {
        return Ok(());
    }
    let _starting = STARTING.lock();
    if TIMER.get().is_some() {
        return Ok(());
    }
    let t = Arc::new(Timer {
        pending: Mutex::new(Vec::new()),
        wake: Condvar::new(),
    });
    let run = t.clone();
    std::thread::Builder::new()
        .name("softverbs-cq-moderation".into())
        .spawn(move || run.run())
        .map_err(|e| Error::no_resources(format!("cannot start the CQ moderation timer thread: {e}")))?;
    // Under `STARTING`, after the check above: nothing else sets it.
    TIMER.get_or_init(|| t);
    Ok(())
}

impl Timer {
    fn run(&self) {
        let mut pending = self.pending.lock();
        loop {
            let now = Instant::now();
            let mut due = Vec::new();
            pending.retain(|(at, cq, round)| {
                if *at <= now {
                    due.push((cq.clone(), *round));
                    false
                } else {
                    true
                }
            });
            if !due.is_empty() {
                // Raising takes the CQ's lock: never while holding the timer's.
                drop(pending);
                for (cq, round) in due {
                    if let Some(cq) = cq.upgrade() {
                        cq.moderation_expired(round);
                    }
                }
                pending = self.pending.lock();
                continue;
            }
            let next = pending.iter().map(|(at, _, _)| *at).min();
            match next {
                Some(at) => {
                    self.wake.wait_until(&mut pending, at);
                }
                None => self.wake.wait(&mut pending),
            }
        }
    }
}

/// Calls [`Cq::moderation_expired`] with `round` at `at`.
pub(crate) fn schedule(at: Instant, cq: Weak<Cq>, round: u64) {
    match TIMER.get() {
        Some(t) => {
            t.pending.lock().push((at, cq, round));
            t.wake.notify_one();
        }
        // A period is set only after `start` succeeded; should that ever not hold, an early
        // event is what moderation allows, a lost one is not.
        None => {
            if let Some(cq) = cq.upgrade() {
                cq.moderation_expired(round);
            }
        }
    }
}
