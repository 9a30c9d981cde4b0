//! Completion queues and completion channels.

use std::collections::VecDeque;
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use softverbs_engine::types::{EventType, WorkCompletion};
use softverbs_engine::{Error, Result};

use crate::context::{Context, EventElement};
use crate::cq_moderation::{self, Moderation, MAX_CQ_PERIOD};
use crate::device::Resource;
use crate::sync::{AckCounter, EventQueue, UseCount};

/// Number of completion vectors (`ibv_context.num_comp_vectors`).
pub const NUM_COMP_VECTORS: u32 = 1;

/// A completion event channel (`ibv_create_comp_channel`): a file descriptor that becomes
/// readable when a CQ attached to it has an event.
#[derive(Debug)]
pub struct CompChannel {
    ctx: Arc<Context>,
    events: EventQueue<Arc<Cq>>,
    uses: UseCount,
}

impl CompChannel {
    /// `ibv_create_comp_channel`.
    pub fn create(ctx: &Arc<Context>) -> Result<Arc<Self>> {
        Ok(Arc::new(Self {
            ctx: ctx.clone(),
            events: EventQueue::new()?,
            uses: UseCount::default(),
        }))
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The channel's file descriptor (`ibv_comp_channel.fd`).
    pub fn fd(&self) -> RawFd {
        self.events.raw_fd()
    }

    /// The channel's file descriptor, borrowed.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.events.as_fd()
    }

    /// `ibv_get_cq_event`: waits for the next CQ event (`None` waits forever; EAGAIN at once if
    /// the fd was made non-blocking). Each event must be acknowledged with [`Cq::ack_events`].
    pub fn get_cq_event(&self, timeout: Option<Duration>) -> Result<Arc<Cq>> {
        // Posts held back for the next poll leave before this thread may sleep.
        self.ctx.device().node().fabric().flush_outbox();
        let cq = self.events.pop(timeout)?;
        cq.comp_acks.delivered();
        Ok(cq)
    }

    /// Events waiting to be taken with [`CompChannel::get_cq_event`].
    pub fn pending(&self) -> usize {
        self.events.len()
    }

    /// `ibv_destroy_comp_channel`: EBUSY while a CQ uses the channel.
    pub fn destroy(&self) -> Result<()> {
        self.uses.retire("completion channel")
    }
}

/// How a thread that keeps finding its CQs empty waits between polls.
///
/// A peer on another core answers within microseconds, and a system call per empty poll only
/// delays seeing the answer, so the thread spins first. A peer that shares this core (the
/// other end of a loopback exchange on a loaded machine, or this process's receive thread)
/// can answer only once this thread lets it run, so the thread then yields on every empty
/// poll. Which case holds shows in how long a yield takes: one that returns at once gave the
/// core to nobody, so spinning longer costs nobody anything; one that took a while ran
/// someone else, so the thread spins less before yielding next time.
#[derive(Debug, Clone, Copy)]
struct Backoff {
    /// Empty polls in a row.
    empty: u32,
    /// Empty polls to spin through before yielding.
    spin: u32,
}

/// The most empty polls spun through before a yield (some tens of microseconds).
const MAX_SPIN: u32 = 256;
/// A yield that took longer than this let another thread run.
const YIELD_RAN_OTHERS: Duration = Duration::from_micros(3);

thread_local! {
    static BACKOFF: std::cell::Cell<Backoff> = const {
        std::cell::Cell::new(Backoff { empty: 0, spin: MAX_SPIN / 4 })
    };
}

impl Backoff {
    /// A poll found completions.
    fn found() {
        BACKOFF.with(|b| {
            let mut v = b.get();
            if v.empty != 0 {
                v.empty = 0;
                b.set(v);
            }
        });
    }

    /// A poll found nothing: spin or yield. Returns whether the thread yielded (other threads
    /// may have run meanwhile).
    fn nothing() -> bool {
        BACKOFF.with(|b| {
            let mut v = b.get();
            v.empty = v.empty.saturating_add(1);
            if v.empty <= v.spin {
                b.set(v);
                std::hint::spin_loop();
                return false;
            }
            let start = Instant::now();
            std::thread::yield_now();
            v.spin = Self::after_yield(v.spin, start.elapsed());
            b.set(v);
            true
        })
    }

    /// The spin budget after a yield that took `took`.
    fn after_yield(spin: u32, took: Duration) -> u32 {
        if took > YIELD_RAN_OTHERS {
            spin / 2
        } else {
            (spin * 2 + 1).min(MAX_SPIN)
        }
    }
}

/// Why a completion could not be queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("completion queue overrun")]
pub struct CqOverrun;

#[derive(Debug)]
struct CqState {
    entries: VecDeque<WorkCompletion>,
    cqe: u32,
    /// `Some(solicited_only)` while a notification is requested.
    armed: Option<bool>,
    overrun: bool,
    /// Completions ever queued and ever polled.
    pushed: u64,
    polled: u64,
    /// Counters to raise when the completion with the given number is polled (see
    /// [`Cq::push_with_release`]), oldest first.
    releases: VecDeque<(u64, Arc<AtomicU64>, u64)>,
    moderation: Moderation,
    /// Matching completions queued while armed whose event moderation holds back.
    held: u32,
    /// Counts raised (or cancelled) held-back events, so a stale period timer does nothing.
    round: u64,
    /// The request (`Some(solicited_only)`) that events raised since the CQ was last empty
    /// fired under; they may still wait in the channel (see [`Cq::withdraw_spent_events`]).
    raised: Option<bool>,
}

/// Two notification requests in one: a pending "any completion" request is not narrowed by a
/// solicited-only one.
fn merge_request(pending: Option<bool>, solicited_only: bool) -> bool {
    pending != Some(false) && solicited_only
}

/// What a queued completion does about the completion event.
enum Notify {
    No,
    /// Raise it at the instant unless the round has ended by then.
    At(Instant, u64),
}

/// A completion queue (`ibv_create_cq`).
#[derive(Debug)]
pub struct Cq {
    me: Weak<Self>,
    ctx: Arc<Context>,
    channel: Option<Arc<CompChannel>>,
    comp_vector: u32,
    handle: u32,
    state: Mutex<CqState>,
    uses: UseCount,
    comp_acks: AckCounter,
    async_acks: AckCounter,
    user_data: AtomicU64,
    /// Which clocks stamp each completion ([`Timestamps`] bits).
    stamps: AtomicU8,
    /// The number of unpolled completions, stored under the state lock whenever it changes.
    queued: AtomicUsize,
}

/// Which clocks a CQ records in its completions (`IBV_WC_EX_WITH_COMPLETION_TIMESTAMP` and
/// `_WALLCLOCK`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timestamps {
    /// The device's free-running completion clock ([`crate::attr_ex::raw_clock`]).
    pub raw: bool,
    /// The wall clock, in nanoseconds.
    pub wallclock: bool,
}

/// The size a CQ of `cqe` entries gets: the next 2^n - 1 (as ring buffers round), capped by the
/// device maximum.
fn round_cqe(cqe: u32, max: u32) -> u32 {
    let rounded = (u64::from(cqe) + 1).next_power_of_two() - 1;
    u32::try_from(rounded).unwrap_or(u32::MAX).min(max).max(cqe)
}

impl Cq {
    /// `ibv_create_cq`: a CQ with at least `cqe` entries; [`Cq::cqe`] tells the actual size.
    pub fn create(
        ctx: &Arc<Context>,
        cqe: i32,
        channel: Option<&Arc<CompChannel>>,
        comp_vector: i32,
    ) -> Result<Arc<Self>> {
        let max = ctx.device().limits().max_cqe;
        let cqe = u32::try_from(cqe)
            .ok()
            .filter(|c| (1..=max).contains(c))
            .ok_or_else(|| Error::invalid(format!("cqe {cqe} is outside 1..={max}")))?;
        let comp_vector = u32::try_from(comp_vector)
            .ok()
            .filter(|v| *v < NUM_COMP_VECTORS)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "comp_vector {comp_vector} is not below num_comp_vectors ({NUM_COMP_VECTORS})"
                ))
            })?;
        if let Some(ch) = channel {
            if !ch.context().shares_objects_with(ctx) {
                return Err(Error::invalid(
                    "the completion channel belongs to another context",
                ));
            }
        }
        ctx.device().acquire(Resource::Cq)?;
        if let Some(ch) = channel {
            if let Err(e) = ch.uses.acquire("completion channel") {
                ctx.device().release(Resource::Cq);
                return Err(e);
            }
        }
        Ok(Arc::new_cyclic(|me| Self {
            me: me.clone(),
            ctx: ctx.clone(),
            channel: channel.cloned(),
            comp_vector,
            handle: ctx.next_handle(),
            state: Mutex::new(CqState {
                entries: VecDeque::new(),
                cqe: round_cqe(cqe, max),
                armed: None,
                overrun: false,
                pushed: 0,
                polled: 0,
                releases: VecDeque::new(),
                moderation: Moderation::default(),
                held: 0,
                round: 0,
                raised: None,
            }),
            uses: UseCount::default(),
            comp_acks: AckCounter::default(),
            async_acks: AckCounter::default(),
            user_data: AtomicU64::new(0),
            stamps: AtomicU8::new(0),
            queued: AtomicUsize::new(0),
        }))
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The completion channel, if any.
    pub fn channel(&self) -> Option<&Arc<CompChannel>> {
        self.channel.as_ref()
    }

    /// The completion vector.
    pub fn comp_vector(&self) -> u32 {
        self.comp_vector
    }

    /// Handle (`ibv_cq.handle`).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// The number of entries (`ibv_cq.cqe`).
    pub fn cqe(&self) -> u32 {
        self.state.lock().cqe
    }

    /// Unpolled completions.
    pub fn len(&self) -> usize {
        self.state.lock().entries.len()
    }

    /// Whether there are no unpolled completions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A value the front end may associate with the CQ (e.g. `cq_context`).
    pub fn user_data(&self) -> u64 {
        self.user_data.load(Ordering::Relaxed)
    }

    /// Sets [`Cq::user_data`].
    pub fn set_user_data(&self, v: u64) {
        self.user_data.store(v, Ordering::Relaxed);
    }

    /// Makes every later completion carry the clocks in `ts` (set when the CQ is created with
    /// timestamp fields, before it has completions).
    pub fn set_timestamps(&self, ts: Timestamps) {
        self.stamps.store(
            u8::from(ts.raw) | (u8::from(ts.wallclock) << 1),
            Ordering::Relaxed,
        );
    }

    /// The clocks completions carry.
    pub fn timestamps(&self) -> Timestamps {
        let bits = self.stamps.load(Ordering::Relaxed);
        Timestamps {
            raw: bits & 1 != 0,
            wallclock: bits & 2 != 0,
        }
    }

    pub(crate) fn uses(&self) -> &UseCount {
        &self.uses
    }

    pub(crate) fn async_acks(&self) -> &AckCounter {
        &self.async_acks
    }

    /// Whether the CQ overran and lost a completion (`IBV_EVENT_CQ_ERR`).
    pub fn is_overrun(&self) -> bool {
        self.state.lock().overrun
    }

    /// `ibv_poll_cq`: moves up to `out.len()` completions into `out`, oldest first; returns how
    /// many.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        self.poll_each(out.len(), |i, wc| out[i] = wc)
    }

    /// `ibv_poll_cq` into storage of the caller's own: hands up to `max` completions to `emit`
    /// with their index, oldest first; returns how many. A front end that translates each
    /// completion needs no buffer of its own (nor to initialise one on every empty poll).
    pub fn poll_each(&self, max: usize, mut emit: impl FnMut(usize, WorkCompletion)) -> usize {
        let n = self.take(max, &mut emit);
        if n > 0 {
            // Still a busy poller: what it posted since its last poll leaves now, in one batch.
            let f = self.ctx.device().node().fabric();
            f.polled(f.now());
        }
        if n > 0 || max == 0 {
            if n > 0 {
                Backoff::found();
            }
            return n;
        }
        // Nothing yet: make progress ourselves, so a program that only polls never waits on
        // another thread.
        let f = self.ctx.device().node().fabric();
        f.progress(f.now());
        let mut n = self.take(max, &mut emit);
        // An empty answer must be as fresh as a hardware CQ's: a caller told "empty" goes on
        // to its other queues (an rdma_cm channel, say), and a yield can let a whole timeslice
        // of other threads run, delivering completions and then events that follow them (a
        // peer's last message, then its DISCONNECTED). So after a yield, look again: what the
        // caller reads next is never newer than what this poll reported. (libfabric 1.17's
        // ofi_rxm reads its event queue right after an empty poll and crashes on a completion
        // of a connection it has already torn down.)
        if n == 0 && Backoff::nothing() {
            n = self.take(max, &mut emit);
        }
        if n > 0 {
            Backoff::found();
        }
        n
    }

    /// Moves up to `max` completions to `emit`.
    fn take(&self, max: usize, emit: &mut impl FnMut(usize, WorkCompletion)) -> usize {
        // An empty CQ is seen without its lock (busy pollers look many times per completion).
        if self.queued.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut st = self.state.lock();
        let n = max.min(st.entries.len());
        for (i, wc) in st.entries.drain(..n).enumerate() {
            emit(i, wc);
        }
        self.queued.store(st.entries.len(), Ordering::Release);
        st.polled += n as u64;
        while st.releases.front().is_some_and(|r| r.0 < st.polled) {
            let (_, counter, value) = st.releases.pop_front().expect("checked");
            counter.fetch_max(value, Ordering::AcqRel);
        }
        if n > 0 && st.entries.is_empty() {
            self.withdraw_spent_events(&mut st);
        }
        n
    }

    /// Called when polling has just emptied the CQ: every completion an event still waiting in
    /// the channel announced is consumed, so that event is withdrawn and the request that fired
    /// it is restored (the next completion raises it again, so none is lost and a waiter cannot
    /// hang). `ibv_get_cq_event(3)` allows such an event to be delivered with nothing behind
    /// it, but programs that poll once per event and treat an empty CQ as an error
    /// (`ibv_rc_pingpong -t -e`) fail on it. Events already delivered are not touched.
    fn withdraw_spent_events(&self, st: &mut CqState) {
        let Some(mode) = st.raised.take() else {
            return;
        };
        let Some(ch) = &self.channel else {
            return;
        };
        if ch.events.remove_where(|cq| std::ptr::eq(Arc::as_ptr(cq), self)) > 0 {
            // A fresh request: moderation counts from zero again.
            st.armed = Some(merge_request(st.armed, mode));
            st.held = 0;
            st.round += 1;
        }
    }

    /// `ibv_req_notify_cq`: requests one completion event for the next completion (or the next
    /// solicited or error completion if `solicited_only`). Completions already queued do not
    /// fire it.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        let mut st = self.state.lock();
        st.armed = Some(merge_request(st.armed, solicited_only));
        Ok(())
    }

    /// `ibv_resize_cq`: at least `cqe` entries, and never fewer than the unpolled ones.
    pub fn resize(&self, cqe: i32) -> Result<u32> {
        let max = self.ctx.device().limits().max_cqe;
        let cqe = u32::try_from(cqe)
            .ok()
            .filter(|c| (1..=max).contains(c))
            .ok_or_else(|| Error::invalid(format!("cqe {cqe} is outside 1..={max}")))?;
        let mut st = self.state.lock();
        // ibv_resize_cq(3): the request itself must cover the unpolled entries.
        if (cqe as usize) < st.entries.len() {
            return Err(Error::invalid(format!(
                "cqe {cqe} is below the {} unpolled completions",
                st.entries.len()
            )));
        }
        let size = round_cqe(cqe, max);
        st.cqe = size;
        Ok(size)
    }

    /// `ibv_ack_cq_events`: acknowledges `n` events returned by [`CompChannel::get_cq_event`].
    pub fn ack_events(&self, n: u32) {
        self.comp_acks.ack(u64::from(n));
    }

    /// (events delivered, events acknowledged) on the completion channel.
    pub fn comp_event_counts(&self) -> (u64, u64) {
        self.comp_acks.counts()
    }

    /// Queues a completion. On overrun the completion is lost, the CQ is in error and
    /// `IBV_EVENT_CQ_ERR` is raised; the caller must move the QP to the error state.
    pub fn push(&self, wc: WorkCompletion) -> Result<(), CqOverrun> {
        self.push_inner(wc, None)
    }

    /// Queues a completion; once the application polls it, `counter` is raised to at least
    /// `value`. This is how work that stays outstanding until its completion is reaped (the
    /// tag-list operations of a tag-matching SRQ) learns that it was.
    pub fn push_with_release(
        &self,
        wc: WorkCompletion,
        counter: &Arc<AtomicU64>,
        value: u64,
    ) -> Result<(), CqOverrun> {
        self.push_inner(wc, Some((counter.clone(), value)))
    }

    fn push_inner(
        &self,
        mut wc: WorkCompletion,
        release: Option<(Arc<AtomicU64>, u64)>,
    ) -> Result<(), CqOverrun> {
        let stamps = self.stamps.load(Ordering::Relaxed);
        if stamps & 1 != 0 {
            wc.timestamp = crate::attr_ex::raw_clock();
        }
        if stamps & 2 != 0 {
            wc.wallclock_ns = crate::attr_ex::wall_clock();
        }
        let notify = {
            let mut st = self.state.lock();
            if st.overrun || st.entries.len() >= st.cqe as usize {
                let first = !st.overrun;
                st.overrun = true;
                drop(st);
                if first {
                    if let Some(me) = self.me.upgrade() {
                        self.ctx.raise(EventElement::Cq(me), EventType::CqErr);
                    }
                }
                return Err(CqOverrun);
            }
            st.entries.push_back(wc);
            self.queued.store(st.entries.len(), Ordering::Release);
            if let Some((counter, value)) = release {
                let index = st.pushed;
                st.releases.push_back((index, counter, value));
            }
            st.pushed += 1;
            match st.armed {
                Some(solicited_only) if !solicited_only || wc.is_solicited() => {
                    let m = st.moderation;
                    st.held += 1;
                    if m.immediate() || m.count_reached(st.held) {
                        self.raise_locked(&mut st);
                        Notify::No
                    } else if st.held == 1 {
                        m.deadline(Instant::now())
                            .map_or(Notify::No, |at| Notify::At(at, st.round))
                    } else {
                        Notify::No
                    }
                }
                _ => Notify::No,
            }
        };
        match notify {
            Notify::At(at, round) => cq_moderation::schedule(at, self.me.clone(), round),
            Notify::No => {}
        }
        Ok(())
    }

    /// Ends the current notification request by raising its event. The event is queued under
    /// the CQ's lock, so a poll that empties the CQ sees every event its completions raised
    /// (lock order: CQ, then channel).
    fn raise_locked(&self, st: &mut CqState) {
        let mode = st.armed.unwrap_or(false);
        Self::disarm(st);
        if let (Some(ch), Some(me)) = (&self.channel, self.me.upgrade()) {
            ch.events.push(me);
            st.raised = Some(merge_request(st.raised, mode));
        }
    }

    /// Ends the current notification request (its event is raised or cancelled).
    fn disarm(st: &mut CqState) {
        st.armed = None;
        st.held = 0;
        st.round += 1;
    }

    /// The moderation period of round `round` ended: raises its held-back event unless it was
    /// raised already.
    pub(crate) fn moderation_expired(&self, round: u64) {
        let mut st = self.state.lock();
        if st.round == round && st.armed.is_some() && st.held > 0 {
            self.raise_locked(&mut st);
        }
    }

    /// The current moderation (`IBV_CQ_MODERATE`).
    pub fn moderation(&self) -> Moderation {
        self.state.lock().moderation
    }

    /// `ibv_modify_cq` with `IBV_CQ_MODERATE`: EINVAL if `cq_period` exceeds
    /// [`MAX_CQ_PERIOD`] (every `cq_count` fits). An event already held back is judged by the
    /// new moderation: raised now if it is due under it, else within the new period from now.
    pub fn modify_moderation(&self, m: Moderation) -> Result<()> {
        if m.cq_period > MAX_CQ_PERIOD {
            return Err(Error::invalid(format!(
                "cq_period {} exceeds max_cq_period {MAX_CQ_PERIOD}",
                m.cq_period
            )));
        }
        if m.cq_period != 0 {
            cq_moderation::start()?;
        }
        let notify = {
            let mut st = self.state.lock();
            st.moderation = m;
            if st.armed.is_none() || st.held == 0 {
                Notify::No
            } else if m.immediate() || m.count_reached(st.held) {
                self.raise_locked(&mut st);
                Notify::No
            } else {
                m.deadline(Instant::now())
                    .map_or(Notify::No, |at| Notify::At(at, st.round))
            }
        };
        match notify {
            Notify::At(at, round) => cq_moderation::schedule(at, self.me.clone(), round),
            Notify::No => {}
        }
        Ok(())
    }

    fn teardown(&self) {
        self.ctx.device().release(Resource::Cq);
        if let Some(ch) = &self.channel {
            ch.uses.release();
        }
    }

    /// `ibv_destroy_cq`: EBUSY while a QP uses the CQ. Otherwise drops its undelivered events and
    /// waits until every delivered completion and async event was acknowledged.
    pub fn destroy(&self) -> Result<()> {
        self.uses.retire("completion queue")?;
        Self::disarm(&mut self.state.lock());
        if let Some(ch) = &self.channel {
            ch.events.remove_where(|cq| std::ptr::eq(Arc::as_ptr(cq), self));
        }
        self.ctx.forget_events(
            |e| matches!(&e.element, EventElement::Cq(cq) if std::ptr::eq(Arc::as_ptr(cq), self)),
        );
        self.comp_acks.wait_all_acked();
        self.async_acks.wait_all_acked();
        self.teardown();
        Ok(())
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.teardown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{round_cqe, Backoff, MAX_SPIN, YIELD_RAN_OTHERS};
    use std::time::Duration;

    #[test]
    fn spinning_adapts_to_whether_yields_run_others() {
        let slow = YIELD_RAN_OTHERS * 10;
        let fast = Duration::ZERO;
        // A core shared with the peer: within a few yields the thread yields at once.
        let mut spin = MAX_SPIN;
        let mut yields = 0;
        while spin > 0 {
            spin = Backoff::after_yield(spin, slow);
            yields += 1;
        }
        assert_eq!(yields, MAX_SPIN.ilog2() + 1);
        assert_eq!(Backoff::after_yield(0, slow), 0);
        // A core of its own again: back to spinning, and never beyond the bound.
        let mut yields = 0;
        while spin < MAX_SPIN {
            spin = Backoff::after_yield(spin, fast);
            yields += 1;
        }
        assert_eq!(spin, MAX_SPIN);
        assert!(yields <= MAX_SPIN.ilog2() + 1, "{yields} yields to recover");
        assert_eq!(Backoff::after_yield(MAX_SPIN, fast), MAX_SPIN);
    }

    #[test]
    fn cqe_rounding() {
        assert_eq!(round_cqe(1, 1000), 1);
        assert_eq!(round_cqe(2, 1000), 3);
        assert_eq!(round_cqe(100, 1000), 127);
        assert_eq!(round_cqe(127, 1000), 127);
        assert_eq!(round_cqe(128, 1000), 255);
        assert_eq!(round_cqe(900, 1000), 1000);
        assert_eq!(round_cqe(1000, 1000), 1000);
    }
}
