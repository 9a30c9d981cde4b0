//! The fabric's threads: receive threads waiting on a driver, and the progress thread
//! that runs transport timers.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use softverbs_engine::time::Instant;

use super::{Endpoint, Fabric, ReceivePass};
use crate::driver::Driver;

/// How recently an application thread must have polled for the receive thread to leave the
/// socket to it, and how long that thread then naps before it looks again. Every nap's end is
/// a wake-up that takes a core from a spinning poller (at 200 us, two processes ping-ponging
/// over shared memory saw 17,000 context switches a second and a quarter more latency).
const APP_POLLING: Duration = Duration::from_millis(1);
/// The nap instead while posted packets wait in the outbox: its end sends them if the
/// application stopped polling right after it posted.
const HELD_NAP: Duration = Duration::from_micros(200);

/// Waits on a receiving driver (UDP or shared memory) and hands what arrives to the nodes with
/// `pump`; ends once the fabric is gone.
pub(super) fn receive_thread<E: Endpoint, D: Driver>(
    fabric: Weak<Fabric<E>>,
    driver: Arc<D>,
    pump: fn(&Fabric<E>, bool) -> usize,
) {
    loop {
        let Some(f) = fabric.upgrade() else { return };
        // Also while an application polls (below): a busy poller never lets this thread wait
        // on the driver, and the upkeep (taking the standard port over, letting go of peers
        // that are gone) must not depend on that.
        driver.tick();
        // What a polling application posted goes out by now at the latest.
        f.flush_outbox();
        // While an application thread polls a CQ, it reads the driver itself with no thread
        // hand-off: do not even wait on it, since every wake-up would take a core from a
        // spinning thread (and senders to a mailbox ring its doorbell only while this thread
        // sleeps on it).
        let since = f
            .now()
            .as_nanos()
            .saturating_sub(f.app_poll_at.load(Ordering::Relaxed));
        if since < APP_POLLING.as_nanos() as u64 {
            let nap = if f.outbox_busy.load(Ordering::Acquire) {
                HELD_NAP
            } else {
                APP_POLLING
            };
            drop(f);
            std::thread::sleep(nap);
            continue;
        }
        // From here on a thread that holds posted packets back wakes this one: see
        // `send_then_release`.
        f.rx_waiting.fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        f.flush_outbox();
        drop(f);
        // Wakes at least once a second, for the upkeep above.
        let readable = driver.wait(Duration::from_secs(1));
        let Some(f) = fabric.upgrade() else { return };
        f.rx_waiting.fetch_sub(1, Ordering::SeqCst);
        if readable {
            // A burst usually goes on: look again for a moment before sleeping, since each
            // sleep costs the sender a wake-up call and this thread a few microseconds.
            let mut last = std::time::Instant::now();
            loop {
                let mut pass = ReceivePass::new(&f);
                loop {
                    let got = pump(&f, true);
                    f.drive(f.now());
                    if pass.done(got) {
                        break;
                    }
                }
                if pass.received > 0 {
                    last = std::time::Instant::now();
                }
                drop(pass);
                if last.elapsed() >= RX_LINGER {
                    break;
                }
                std::thread::yield_now();
            }
        }
    }
}

/// How long a receive thread keeps looking after its last packet before it sleeps.
const RX_LINGER: Duration = Duration::from_micros(50);

/// Runs transport timers when they are due; ends once the fabric is gone.
pub(super) fn progress_thread<E: Endpoint>(fabric: Weak<Fabric<E>>, wake: Arc<WakeUp>) {
    loop {
        let Some(f) = fabric.upgrade() else { return };
        wake.begin_pass();
        f.drive(f.now());
        // Read after the drive, which may take a while under load.
        let now = f.now();
        let mut next = None;
        for node in f.live_nodes().iter() {
            if let Some(d) = node.run_timers(now) {
                next = Some(next.map_or(d, |n: Instant| n.min(d)));
            }
        }
        f.drive(f.now());
        let wait_from = f.now().as_nanos();
        // Not kept across the wait: the fabric ends when its last owner lets go.
        drop(f);
        let (mut guard, target) = wake.end_pass(next.map_or(u64::MAX, |d| d.as_nanos()));
        if wake.closed.load(Ordering::Acquire) {
            return;
        }
        if target == u64::MAX {
            wake.cv.wait(&mut guard);
        } else {
            let wait = Duration::from_nanos(target.saturating_sub(wait_from));
            if !wait.is_zero() {
                wake.cv.wait_for(&mut guard, wait);
            }
        }
    }
}

/// The progress thread's next wake-up, lowered by the threads that set transport deadlines.
#[derive(Debug)]
pub(super) struct WakeUp {
    /// Nanoseconds since the fabric's epoch; MAX: none.
    at: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
    /// The fabric is gone: the progress thread ends.
    pub(super) closed: AtomicBool,
}

impl WakeUp {
    pub(super) fn new() -> Self {
        Self {
            at: AtomicU64::new(u64::MAX),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            closed: AtomicBool::new(false),
        }
    }

    pub(super) fn load(&self) -> u64 {
        self.at.load(Ordering::Acquire)
    }

    /// Starts a pass of the progress thread over the timers. From here on `schedule` merges
    /// each new deadline into `at`, and `end_pass` merges the earliest node timer into it too,
    /// never storing over it. A deadline set before this is already in its QP, which the pass
    /// reads after it; one set later lowers `at` and is kept. (Storing the pass's result, as an
    /// earlier version did, lost any deadline scheduled while the timers were being run.)
    pub(super) fn begin_pass(&self) {
        self.at.store(u64::MAX, Ordering::Release);
        // Pairs with the fence in `schedule`: either it sees this store, or the pass sees the
        // QP's deadline stored before it.
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Ends a pass whose earliest node timer is `found`: the time to wake at, with the lock
    /// held so that a `schedule` from here on notifies the waiting thread.
    pub(super) fn end_pass(&self, found: u64) -> (parking_lot::MutexGuard<'_, ()>, u64) {
        let guard = self.lock.lock();
        let target = self.at.fetch_min(found, Ordering::AcqRel).min(found);
        (guard, target)
    }

    /// Ends the progress thread.
    pub(super) fn close(&self) {
        let _guard = self.lock.lock();
        self.closed.store(true, Ordering::Release);
        self.cv.notify_one();
    }

    /// Makes the thread wake by `at`. A deadline at or after `at` needs nothing: the thread
    /// wakes by then, or is in a pass, which only lowers `at`.
    pub(super) fn schedule(&self, at: u64) {
        // The caller stored the deadline in its QP first; see `begin_pass`.
        std::sync::atomic::fence(Ordering::SeqCst);
        if at < self.load() {
            let _guard = self.lock.lock();
            // The minimum: a concurrent, later deadline must not replace an earlier one.
            self.at.fetch_min(at, Ordering::AcqRel);
            self.cv.notify_one();
        }
    }
}
