//! How an RC requester paces itself and when it gives up waiting: a round-trip estimate
//! (RFC 6298) that sets the retransmission timer well below the configured local ACK timeout,
//! and a congestion window (additive increase, multiplicative decrease) that keeps go-back-N
//! from resending a whole window for every lost packet.
//!
//! Neither changes what goes on the wire: a packet resent early is a duplicate the responder
//! acknowledges again, and a smaller window only sends fewer packets at a time. The configured
//! timeout keeps its IBTA meaning for the retry budget: a retry is spent for each full
//! configured timeout that passes without progress (and, as before, for each sequence NAK), so
//! a vanished peer still fails the QP with `IBV_WC_RETRY_EXC_ERR` after `retry_cnt + 1`
//! timeouts.

use std::time::Duration;

use softverbs_wire::Psn;

use super::WINDOW;
use crate::time::Instant;

/// The retransmission timer never fires sooner than this after the last send or progress.
pub(crate) const RTO_MIN: Duration = Duration::from_millis(1);

/// Where the timer's floor starts: longer than a busy host keeps a runnable receiver waiting
/// for a core (a few scheduler slices), so that a lossless path draws no resends. Timeouts that
/// prove genuine halve it towards [`RTO_MIN`] (a lossy path recovers sooner), spurious ones
/// double it.
pub(crate) const FLOOR_START: Duration = Duration::from_millis(10);

/// The congestion window never shrinks below this many PSNs.
pub(crate) const CWND_MIN: u32 = 2;

/// The retransmission timeout's floor never grows past this.
const FLOOR_MAX: Duration = Duration::from_millis(256);

/// The shortest wait before the tail of a flight nothing acknowledged is probed.
const PROBE_MIN: Duration = Duration::from_millis(4);

/// The shortest wait of a NAK that may answer a tail probe (see `reorder_window`).
const PROBE_REORDER_MIN: Duration = Duration::from_millis(1);

/// The shortest wait before a NAKed hole is resent again.
const HOLE_MIN: Duration = Duration::from_micros(20);

/// Congestion avoidance grows the window by this many PSNs per window acknowledged.
const AI_PER_WINDOW: u32 = 4;

/// A sequence NAK repeated for the PSN already being resent counts as new evidence (the resent
/// packet was lost too) only once this fraction of the shortest round trip passed since the
/// resend began: earlier, it is a late copy of the first one.
const RENAK_MIN_FRACTION: u32 = 2;

/// Round-trip estimate, retransmission timer and congestion window of one requester.
#[derive(Debug, Clone)]
pub(crate) struct Recovery {
    /// Smoothed round-trip time and its mean deviation, once measured.
    srtt: Option<Duration>,
    rttvar: Duration,
    /// The shortest round trip measured: the path without queues.
    min_rtt: Duration,
    /// The packet being timed and when it was sent, one at a time. A resent packet may be
    /// timed too: a go-back-N drops the timing of everything sent before it, and the responder
    /// discarded every packet after the hole, so only the resend can be acknowledged (Karn's
    /// ambiguity does not arise), except after a timer that fired while the ACK was on its way.
    probe: Option<(Psn, Instant)>,
    /// Congestion window and slow-start threshold, in PSNs.
    pub(crate) cwnd: u32,
    ssthresh: u32,
    /// PSNs acknowledged towards the next additive increase.
    acked_acc: u32,
    /// The window was cut for a loss before this PSN: later losses of the same window do not
    /// cut it again.
    recover: Option<Psn>,
    /// Timer expiries in a row without progress (each doubles the timer).
    backoff: u32,
    /// When progress was last made: the start of the current stall.
    pub(crate) progress_at: Instant,
    /// Configured timeouts of the current stall already charged to the retry budget.
    pub(crate) charged: u32,
    /// When the go-back-N now under way began.
    retry_started: Option<Instant>,
    /// The timers follow the measured round trip (off: always the configured timeout, for a
    /// carrier that loses nothing).
    pub(crate) adaptive: bool,
    /// The shortest retransmission timeout: [`FLOOR_START`] at first, doubled each time a timer
    /// turned out to have fired for nothing (the host's scheduling delays exceed it) and halved,
    /// down to [`RTO_MIN`], each time one was right to fire.
    floor: Duration,
    /// After a timeout, until an acknowledgement tells: the window before it, and one past the
    /// highest PSN resent since. An acknowledgement beyond what was resent shows that the
    /// original packets had got through (as F-RTO, RFC 5682, tells): the window is restored and
    /// the floor doubled; one of resent packets only halves the floor again.
    after_timeout: Option<AfterTimeout>,
}

/// See [`Recovery::after_timeout`].
#[derive(Debug, Clone, Copy)]
struct AfterTimeout {
    cwnd: u32,
    ssthresh: u32,
    resent_high: Psn,
}

impl Default for Recovery {
    fn default() -> Self {
        Self {
            srtt: None,
            rttvar: Duration::ZERO,
            min_rtt: Duration::MAX,
            probe: None,
            cwnd: WINDOW,
            ssthresh: WINDOW,
            acked_acc: 0,
            recover: None,
            backoff: 0,
            progress_at: Instant(0),
            charged: 0,
            retry_started: None,
            adaptive: true,
            floor: FLOOR_START,
            after_timeout: None,
        }
    }
}

impl Recovery {
    /// The retransmission timeout: the round-trip estimate plus four deviations, at least
    /// [`RTO_MIN`], doubled per expiry in a row, and never more than `configured`. Before any
    /// measurement it is `configured`.
    pub(crate) fn rto(&self, configured: Duration) -> Duration {
        let Some(srtt) = self.srtt.filter(|_| self.adaptive) else {
            return configured;
        };
        let base = (srtt + 4 * self.rttvar).max(self.floor);
        base.saturating_mul(1 << self.backoff.min(16)).min(configured)
    }

    /// PSNs the requester may have unacknowledged now.
    pub(crate) fn window(&self) -> u32 {
        self.cwnd.clamp(CWND_MIN, WINDOW)
    }

    /// Whether no packet is being timed and no round trip was measured yet: the next packet
    /// should ask for an acknowledgement, to be timed.
    pub(crate) fn wants_sample(&self) -> bool {
        self.srtt.is_none() && self.probe.is_none()
    }

    /// Packet `psn`, with AckReq, left at `now`: timed if nothing is.
    pub(crate) fn on_send(&mut self, now: Instant, psn: Psn) {
        if self.probe.is_none() {
            self.probe = Some((psn, now));
        }
    }

    /// Everything before `unacked` was acknowledged at `now`, `n` PSNs of it newly: a round-trip
    /// sample if the timed packet is among them, and the window grows (by `n` in slow start,
    /// by about four per window after). True if this shows the last timer expiry was spurious.
    pub(crate) fn on_ack(&mut self, now: Instant, unacked: Psn, n: u32) -> bool {
        let mut spurious = false;
        if let Some(t) = self.after_timeout {
            if !unacked.is_before(t.resent_high + 1) {
                // Acknowledged past anything resent: the originals had arrived. Undo the cut.
                self.after_timeout = None;
                self.cwnd = t.cwnd;
                self.ssthresh = t.ssthresh;
                self.backoff = 0;
                if !self.answers_resend(now) {
                    // Their acknowledgement was on its way: be slower to fire next time.
                    self.floor = (self.floor * 2).min(FLOOR_MAX);
                    spurious = true;
                }
            } else if n > 0 {
                // Only resent packets were acknowledged: the timer was right to fire.
                self.after_timeout = None;
                self.floor = (self.floor / 2).max(RTO_MIN);
            }
        }
        if let Some((psn, sent)) = self.probe {
            if psn.is_before(unacked) {
                self.probe = None;
                self.sample(Duration::from_nanos(now.0.saturating_sub(sent.0)));
            }
        }
        if n == 0 {
            return spurious;
        }
        self.backoff = 0;
        if self.cwnd < self.ssthresh {
            self.cwnd = (self.cwnd + n).min(self.ssthresh);
        } else {
            // Four more per window acknowledged: a go-back-N link recovers its window in a
            // few round trips (one per window, as Reno, keeps it far below the path's capacity
            // at 1 % loss).
            self.acked_acc += n * AI_PER_WINDOW;
            while self.acked_acc >= self.cwnd {
                self.acked_acc -= self.cwnd;
                self.cwnd += 1;
            }
        }
        self.cwnd = self.cwnd.min(WINDOW);
        spurious
    }

    /// Whether an acknowledgement arriving at `now` is the answer to the go-back-N under way
    /// (it came a round trip after the resend began) rather than one sent before the resend
    /// could arrive. Past what was resent, such an answer means the originals had arrived but
    /// their acknowledgement was lost: only the timer could recover that, so it was right to
    /// fire. An answer much later than a round trip is put down to a host that kept the
    /// receiver from running (the spurious case).
    fn answers_resend(&self, now: Instant) -> bool {
        let (Some(started), Some(srtt)) = (self.retry_started, self.srtt) else {
            return false;
        };
        let since = Duration::from_nanos(now.0.saturating_sub(started.0));
        since >= self.min_rtt / RENAK_MIN_FRACTION && since <= 2 * (srtt + 4 * self.rttvar)
    }

    fn sample(&mut self, rtt: Duration) {
        self.min_rtt = self.min_rtt.min(rtt);
        match self.srtt {
            None => {
                self.srtt = Some(rtt);
                self.rttvar = rtt / 2;
            }
            Some(srtt) => {
                let err = srtt.abs_diff(rtt);
                self.rttvar = (self.rttvar * 3 + err) / 4;
                self.srtt = Some((srtt * 7 + rtt) / 8);
            }
        }
    }

    /// Progress at `now` (a PSN acknowledged for the first time, a response placed): the stall
    /// is over.
    pub(crate) fn on_progress(&mut self, now: Instant) {
        self.progress_at = now;
        self.charged = 0;
        self.retry_started = None;
    }

    /// A go-back-N begins at `now` because `lost` is missing; `sent_high` is one past the
    /// highest PSN sent so far. Halves the window once per window of packets (`timeout`: down
    /// to the minimum, as the pipe is presumed empty).
    pub(crate) fn on_loss(&mut self, now: Instant, lost: Psn, sent_high: Psn, timeout: bool) {
        // Nothing sent before the go-back-N is timed: its acknowledgement may never come.
        self.probe = None;
        self.retry_started = Some(now);
        if timeout {
            if self.after_timeout.is_none() {
                self.after_timeout = Some(AfterTimeout {
                    cwnd: self.cwnd,
                    ssthresh: self.ssthresh,
                    resent_high: lost,
                });
            }
            self.backoff += 1;
            self.ssthresh = (self.cwnd / 2).max(CWND_MIN);
            self.cwnd = CWND_MIN;
            self.recover = Some(sent_high);
            return;
        }
        if self.recover.is_some_and(|r| lost.is_before(r)) {
            return;
        }
        // Cut by 30 % rather than half (as CUBIC does): most loss on these links is not a
        // full queue, and a window far below the path's capacity idles it.
        self.ssthresh = (self.cwnd * 7 / 10).max(CWND_MIN);
        self.cwnd = self.ssthresh;
        self.acked_acc = 0;
        self.recover = Some(sent_high);
    }

    /// Packet `psn` was resent: after a timeout, acknowledgements up to it prove nothing.
    pub(crate) fn on_resend(&mut self, psn: Psn) {
        if let Some(t) = &mut self.after_timeout {
            if !psn.is_before(t.resent_high) {
                t.resent_high = psn + 1;
            }
        }
    }

    /// Whether a sequence NAK for the PSN the go-back-N under way resends, arriving at `now`,
    /// answers the resend (the resent packet was lost too) rather than being a late copy of
    /// the NAK that started it.
    pub(crate) fn renak_is_new(&self, now: Instant) -> bool {
        let Some(started) = self.retry_started.filter(|_| self.srtt.is_some()) else {
            return false;
        };
        // The answer to the resend needs at least the path's round trip, queues aside.
        now.0.saturating_sub(started.0) >= (self.min_rtt / RENAK_MIN_FRACTION).as_nanos() as u64
    }

    /// The hole of the go-back-N under way was resent on its own at `now`: the next NAK for
    /// it counts from here.
    pub(crate) fn on_resend_hole(&mut self, now: Instant) {
        self.retry_started = Some(now);
    }

    /// How long after the last progress to probe the tail of the flight (TLP, RFC 8985): two
    /// smoothed round trips plus four deviations, at least [`PROBE_MIN`]; none before a round
    /// trip was measured, or with fixed timers.
    pub(crate) fn probe_timeout(&self) -> Option<Duration> {
        let srtt = self.srtt.filter(|_| self.adaptive)?;
        Some((srtt * 2 + 4 * self.rttvar).max(PROBE_MIN))
    }

    /// How long a sequence NAK that may answer a tail probe waits for the packets the probe
    /// may have overtaken: a smoothed round trip, at least [`PROBE_REORDER_MIN`].
    pub(crate) fn reorder_window(&self) -> Duration {
        self.srtt.unwrap_or(PROBE_REORDER_MIN).max(PROBE_REORDER_MIN)
    }

    /// How long after a go-back-N or a resend of its hole to resend the hole again if nothing
    /// acknowledged it: two smoothed round trips (`attempt` doubles it), at most `rto`.
    pub(crate) fn hole_timeout(&self, attempt: u32, rto: Duration) -> Option<Duration> {
        let srtt = self.srtt.filter(|_| self.adaptive)?;
        Some(
            (srtt * 2)
                .max(HOLE_MIN)
                .saturating_mul(1 << attempt.min(16))
                .min(rto),
        )
    }

    /// Configured timeouts (of `configured`) that passed at `now` in the current stall and
    /// were not yet charged to the retry budget; they are charged now.
    pub(crate) fn charge(&mut self, now: Instant, configured: Duration) -> u32 {
        let stalled = now.0.saturating_sub(self.progress_at.0);
        let periods = (stalled / configured.as_nanos().max(1) as u64) as u32;
        let due = periods.saturating_sub(self.charged);
        self.charged = self.charged.max(periods);
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn the_timer_follows_the_round_trip_within_its_bounds() {
        let configured = Duration::from_millis(67);
        let mut r = Recovery::default();
        assert_eq!(
            r.rto(configured),
            configured,
            "unmeasured: the configured timeout"
        );
        r.on_send(Instant(0), Psn::new(10));
        r.on_ack(Instant(5 * MS), Psn::new(11), 1);
        // 5 ms + 4 x 2.5 ms.
        assert_eq!(r.rto(configured), Duration::from_millis(15));
        for i in 0..50 {
            r.on_send(Instant(10 * MS * i), Psn::new(20 + i as u32));
            r.on_ack(Instant(10 * MS * i + 100_000), Psn::new(21 + i as u32), 1);
        }
        assert_eq!(r.rto(configured), FLOOR_START, "a 0.1 ms round trip: the floor");
        r.on_loss(Instant(0), Psn::new(100), Psn::new(110), true);
        r.on_loss(Instant(0), Psn::new(100), Psn::new(110), true);
        assert_eq!(r.rto(configured), 4 * FLOOR_START, "doubled per expiry");
        for _ in 0..10 {
            r.on_loss(Instant(0), Psn::new(100), Psn::new(110), true);
        }
        assert_eq!(r.rto(configured), configured, "never past the configured timeout");
        r.on_resend(Psn::new(100));
        assert!(
            !r.on_ack(Instant(0), Psn::new(101), 1),
            "the resent packet: not spurious"
        );
        assert_eq!(
            r.rto(configured),
            FLOOR_START / 2,
            "progress ends the backoff, and a timeout that was right lowers the floor"
        );
    }

    #[test]
    fn a_timer_that_fired_for_nothing_is_undone_and_made_slower() {
        let configured = Duration::from_millis(67);
        let mut r = Recovery::default();
        r.on_send(Instant(0), Psn::new(1));
        r.on_ack(Instant(100_000), Psn::new(2), 1);
        assert_eq!(r.rto(configured), FLOOR_START);
        r.on_loss(Instant(0), Psn::new(10), Psn::new(60), false);
        let window = r.window();
        r.on_loss(Instant(MS), Psn::new(10), Psn::new(60), true);
        assert_eq!(r.window(), CWND_MIN);
        r.on_resend(Psn::new(10));
        r.on_resend(Psn::new(11));
        // Acknowledged through 40: the originals had arrived.
        assert!(r.on_ack(Instant(MS), Psn::new(41), 31));
        assert!(r.window() >= window, "the cut is undone");
        assert_eq!(r.rto(configured), 2 * FLOOR_START, "the floor doubles");
        // A timeout whose resend alone is acknowledged halves it again.
        r.on_loss(Instant(2 * MS), Psn::new(41), Psn::new(60), true);
        r.on_resend(Psn::new(41));
        assert!(!r.on_ack(Instant(2 * MS), Psn::new(42), 1));
        assert_eq!(r.rto(configured), FLOOR_START);
    }

    #[test]
    fn an_acknowledgement_that_answers_the_resend_does_not_make_the_timer_slower() {
        let configured = Duration::from_millis(67);
        let mut r = Recovery::default();
        for i in 0..20u32 {
            let t = u64::from(i) * MS;
            r.on_send(Instant(t), Psn::new(i));
            r.on_ack(Instant(t + 100_000), Psn::new(i + 1), 1);
        }
        assert_eq!(r.rto(configured), FLOOR_START);
        let window = r.window();
        // The ACK of a full window was lost: the timer fires, the first packet is resent, and
        // the responder's answer to it, a round trip later, covers the whole window.
        let at = 100 * MS;
        r.on_loss(Instant(at), Psn::new(20), Psn::new(60), true);
        r.on_resend(Psn::new(20));
        assert!(
            !r.on_ack(Instant(at + 100_000), Psn::new(60), 40),
            "the answer to the resend: the timer was needed"
        );
        assert!(r.window() >= window, "the originals arrived: the cut is undone");
        assert_eq!(r.rto(configured), FLOOR_START, "the floor stays");
        // Acknowledged before the resend could have arrived: spurious after all.
        r.on_loss(Instant(2 * at), Psn::new(60), Psn::new(90), true);
        r.on_resend(Psn::new(60));
        assert!(r.on_ack(Instant(2 * at + 10_000), Psn::new(90), 30));
        assert_eq!(r.rto(configured), 2 * FLOOR_START, "the floor doubles");
    }

    #[test]
    fn the_tail_probe_waits_a_few_round_trips_and_never_less_than_its_minimum() {
        let mut r = Recovery::default();
        assert_eq!(r.probe_timeout(), None, "no round trip measured");
        r.on_send(Instant(0), Psn::new(1));
        r.on_ack(Instant(100_000), Psn::new(2), 1);
        assert_eq!(r.probe_timeout(), Some(PROBE_MIN), "a 0.1 ms round trip");
        r.on_send(Instant(MS), Psn::new(2));
        r.on_ack(Instant(MS + 20 * MS), Psn::new(3), 1);
        let p = r.probe_timeout().unwrap();
        assert!(p > PROBE_MIN && p >= 2 * r.srtt.unwrap(), "{p:?}");
        r.adaptive = false;
        assert_eq!(r.probe_timeout(), None, "fixed timers: no probe");
    }

    #[test]
    fn timeouts_that_were_right_bring_the_floor_down_to_its_minimum() {
        let configured = Duration::from_millis(67);
        let mut r = Recovery::default();
        r.on_send(Instant(0), Psn::new(1));
        r.on_ack(Instant(100_000), Psn::new(2), 1);
        let mut last = r.rto(configured);
        for k in 0..10 {
            let psn = Psn::new(10 + k);
            // The timer fires, the resend alone is acknowledged: the packet was lost.
            r.on_loss(Instant(MS), psn, psn + 20, true);
            r.on_resend(psn);
            assert!(!r.on_ack(Instant(MS), psn + 1, 1));
            let rto = r.rto(configured);
            assert!(rto <= last && rto >= RTO_MIN, "{rto:?} after {last:?}");
            last = rto;
        }
        assert_eq!(last, RTO_MIN, "a lossy path: the shortest timer");
    }

    #[test]
    fn a_loss_cuts_the_window_once_per_window() {
        let mut r = Recovery::default();
        assert_eq!(r.window(), WINDOW);
        r.on_loss(Instant(0), Psn::new(5), Psn::new(100), false);
        let cut = WINDOW * 7 / 10;
        assert_eq!(r.window(), cut);
        r.on_loss(Instant(0), Psn::new(50), Psn::new(100), false);
        assert_eq!(r.window(), cut, "the same window: not cut again");
        r.on_loss(Instant(0), Psn::new(100), Psn::new(200), false);
        let cut = cut * 7 / 10;
        assert_eq!(r.window(), cut);
        // Congestion avoidance: about four more per window acknowledged.
        r.on_ack(Instant(0), Psn::new(200 + cut), cut);
        assert!((cut + 3..=cut + 4).contains(&r.window()), "{}", r.window());
        let before = r.window();
        r.on_loss(Instant(0), Psn::new(300), Psn::new(400), true);
        assert_eq!(r.window(), CWND_MIN, "a timeout empties the pipe");
        r.on_resend(Psn::new(300));
        r.on_resend(Psn::new(301));
        // Slow start back to half the window before the timeout.
        r.on_ack(Instant(0), Psn::new(302), 2);
        r.on_ack(Instant(0), Psn::new(402), 100);
        assert_eq!(r.window(), before / 2);
    }

    #[test]
    fn retries_are_charged_per_configured_timeout_of_stall() {
        let configured = Duration::from_millis(10);
        let mut r = Recovery::default();
        r.on_progress(Instant(5 * MS));
        assert_eq!(r.charge(Instant(9 * MS), configured), 0);
        assert_eq!(r.charge(Instant(15 * MS), configured), 1);
        assert_eq!(r.charge(Instant(16 * MS), configured), 0, "charged once");
        assert_eq!(r.charge(Instant(36 * MS), configured), 2);
        r.on_progress(Instant(40 * MS));
        assert_eq!(r.charge(Instant(45 * MS), configured), 0);
    }

    #[test]
    fn a_repeated_nak_counts_only_a_round_trip_after_the_resend() {
        let mut r = Recovery::default();
        r.on_send(Instant(0), Psn::new(1));
        r.on_ack(Instant(MS), Psn::new(2), 1);
        r.on_loss(Instant(10 * MS), Psn::new(5), Psn::new(9), false);
        assert!(!r.renak_is_new(Instant(10 * MS + MS / 4)));
        assert!(r.renak_is_new(Instant(10 * MS + MS / 2)));
    }
}
