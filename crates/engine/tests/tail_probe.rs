//! Tail probes: when a full flight goes unacknowledged, the requester sends its newest packet
//! again with AckReq a few round trips later instead of idling until the retransmission timer
//! (whose floor, 10 ms, is sized for hosts that deschedule a receiver). A lost ACK is then
//! answered by the duplicate's acknowledgement, a lost tail by a sequence NAK.

mod sim;

use std::time::Duration;

use sim::*;
use softverbs_engine::transport::QpCounters;
use softverbs_engine::types::{Mtu, QpType, WcStatus};
use softverbs_wire::{Opcode, Psn};

/// The local ACK timeout exponent: 4.096 us * 2^14 = 67 ms, so that the measured timer runs
/// at its floor.
const TIMEOUT: u8 = 14;

/// A connected pair that has measured its round trip (one small WRITE), with a 128-packet
/// WRITE (one full window at MTU 256) ready to post.
struct Window {
    sim: Sim,
    a: QpId,
    src: Mr,
    dst: Mr,
    data: Vec<u8>,
    /// When the window's WRITE is posted.
    start: u64,
}

impl Window {
    fn new(seed: u64) -> Self {
        let o = ConnOpts {
            mtu: Mtu::Mtu256,
            timeout: TIMEOUT,
            ..ConnOpts::default()
        };
        let (mut sim, a, _) = Sim::pair(seed, QpType::Rc, &o);
        const LEN: u32 = 128 * 256;
        let src = sim.mem(0).alloc_mr(1, u64::from(LEN), all_access());
        let dst = sim.mem(1).alloc_mr(1, u64::from(LEN), all_access());
        let data: Vec<u8> = (0..LEN).map(|i| (i % 253) as u8).collect();
        sim.mem(0).poke(src.addr, &data);
        sim.post_send(a, write(1, dst.remote(0), vec![src.sge(0, 64)]));
        sim.run_until(Duration::from_secs(1), |s| s.send_cq_len(a) > 0);
        assert_wc(&sim.take_send_cq(a)[0], 1, WcStatus::Success);
        let start = sim.now.0;
        Self {
            sim,
            a,
            src,
            dst,
            data,
            start,
        }
    }

    /// The last 20 request packets of the window meet `verdict` the first time they are sent;
    /// nothing follows them, so no later packet can show the responder the hole.
    fn on_the_tail(&mut self, verdict: Verdict) {
        let start = self.start;
        // The requester's first PSN (the warm-up WRITE took it).
        let first = Psn::new(ConnOpts::default().psn_a);
        let mut seen = std::collections::HashSet::new();
        self.sim.set_filter(move |p| {
            if p.from.node == 0 && p.time.0 >= start && p.payload_len > 0 {
                let late = first.distance(p.psn);
                if (109..=128).contains(&late) && seen.insert(p.psn) {
                    return verdict;
                }
            }
            Verdict::Pass
        });
    }

    /// Posts the WRITE, checks that it completed with the data in place, and returns how long
    /// it took and the requester's counters.
    fn transfer(mut self) -> (Duration, QpCounters) {
        let (a, len) = (self.a, self.data.len());
        self.sim
            .post_send(a, write(2, self.dst.remote(0), vec![self.src.sge(0, len as u32)]));
        self.sim
            .run_until(Duration::from_secs(1), |s| s.send_cq_len(a) > 0);
        assert_wc(&self.sim.take_send_cq(a)[0], 2, WcStatus::Success);
        assert_eq!(self.sim.mem(1).peek(self.dst.addr, len), self.data);
        let took = Duration::from_nanos(self.sim.now.0 - self.start);
        (took, self.sim.qp(a).engine.counters())
    }
}

/// Well before the retransmission timer (10 ms at its floor).
fn before_the_timer(took: Duration) {
    assert!(
        took < Duration::from_millis(10),
        "done {took:?} after the post: the requester waited for its timer"
    );
}

#[test]
fn a_lost_acknowledgement_of_a_full_window_is_recovered_by_a_probe() {
    let mut w = Window::new(11);
    let start = w.start;
    // Every acknowledgement of the window's first transmission is lost.
    w.sim.set_filter(move |p| {
        if p.from.node == 1 && p.opcode == Opcode::RcAcknowledge && p.time.0 < start + 1_000_000 {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    let (took, c) = w.transfer();
    assert_eq!(c.tail_probes, 1, "{c:?}");
    assert_eq!(c.timeouts, 0, "the timer never fired ({c:?})");
    assert_eq!(c.retransmits, 0, "the probe is the only copy sent ({c:?})");
    before_the_timer(took);
}

#[test]
fn a_lost_tail_is_resent_after_the_nak_a_probe_draws() {
    let mut w = Window::new(12);
    w.on_the_tail(Verdict::Drop);
    let (took, c) = w.transfer();
    assert_eq!(c.tail_probes, 1, "{c:?}");
    assert_eq!(c.timeouts, 0, "the timer never fired ({c:?})");
    assert!(c.seq_naks_received >= 1, "the probe drew a NAK ({c:?})");
    assert!(c.retransmits >= 20, "the lost tail was resent ({c:?})");
    before_the_timer(took);
}

#[test]
fn a_probe_that_overtakes_the_tail_draws_no_go_back_n() {
    let mut w = Window::new(13);
    // Held back on their way (in a backlog of another core, say) until after the probe, which
    // lands past them and draws a NAK.
    w.on_the_tail(Verdict::Delay(4_500_000));
    let (_, c) = w.transfer();
    assert_eq!(c.tail_probes, 1, "{c:?}");
    assert!(c.seq_naks_received >= 1, "the probe drew a NAK ({c:?})");
    assert_eq!(c.timeouts, 0, "{c:?}");
    assert_eq!(
        c.retransmits, 0,
        "the held packets arrived within a round trip of the NAK: nothing resent ({c:?})"
    );
}
