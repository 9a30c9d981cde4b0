//! Tail probes: when a full flight goes unacknowledged, the requester sends its newest packet
//! again with AckReq a few round trips later instead of idling until the retransmission timer
//! (whose floor, 10 ms, is sized for hosts that deschedule a receiver). A lost ACK is then
//! answered by the duplicate's acknowledgement, a lost tail by a sequence NAK.

mod sim;

use std::time::Duration;

use sim::*;
use softverbs_engine::types::{Mtu, QpType, WcStatus};
use softverbs_wire::{Opcode, Psn};

/// The local ACK timeout exponent: 4.096 us * 2^14 = 67 ms, so that the measured timer runs
/// at its floor.
const TIMEOUT: u8 = 14;

/// A connected pair that has measured its round trip (one small WRITE), and a 128-packet
/// WRITE (one full window at MTU 256) ready to post: (sim, requester, responder, source,
/// destination, the data).
fn measured_pair(seed: u64) -> (Sim, QpId, QpId, Mr, Mr, Vec<u8>) {
    let o = ConnOpts {
        mtu: Mtu::Mtu256,
        timeout: TIMEOUT,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(seed, QpType::Rc, &o);
    const LEN: u32 = 128 * 256;
    let src = sim.mem(0).alloc_mr(1, u64::from(LEN), all_access());
    let dst = sim.mem(1).alloc_mr(1, u64::from(LEN), all_access());
    let data: Vec<u8> = (0..LEN).map(|i| (i % 253) as u8).collect();
    sim.mem(0).poke(src.addr, &data);
    sim.post_send(a, write(1, dst.remote(0), vec![src.sge(0, 64)]));
    sim.run_until(Duration::from_secs(1), |s| s.send_cq_len(a) > 0);
    assert_wc(&sim.take_send_cq(a)[0], 1, WcStatus::Success);
    (sim, a, b, src, dst, data)
}

#[test]
fn a_lost_acknowledgement_of_a_full_window_is_recovered_by_a_probe() {
    let (mut sim, a, b, src, dst, data) = measured_pair(11);
    let start = sim.now.0;
    // Every acknowledgement of the window's first transmission is lost.
    sim.set_filter(move |p| {
        if p.from.node == 1 && p.opcode == Opcode::RcAcknowledge && p.time.0 < start + 1_000_000 {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    sim.post_send(a, write(2, dst.remote(0), vec![src.sge(0, data.len() as u32)]));
    sim.run_until(Duration::from_secs(1), |s| s.send_cq_len(a) > 0);
    assert_wc(&sim.take_send_cq(a)[0], 2, WcStatus::Success);
    assert_eq!(sim.mem(1).peek(dst.addr, data.len()), data);
    let took = Duration::from_nanos(sim.now.0 - start);
    let c = sim.qp(a).engine.counters();
    assert_eq!(c.tail_probes, 1, "{c:?}");
    assert_eq!(c.timeouts, 0, "the timer never fired ({c:?})");
    assert_eq!(c.retransmits, 0, "the probe is the only copy sent ({c:?})");
    assert!(
        took < Duration::from_millis(10),
        "done {took:?} after the post: the requester waited for its timer"
    );
    let _ = b;
}

#[test]
fn a_lost_tail_is_resent_after_the_nak_a_probe_draws() {
    let (mut sim, a, b, src, dst, data) = measured_pair(12);
    let start = sim.now.0;
    // The requester's first PSN (the warm-up WRITE took it).
    let first = Psn::new(ConnOpts::default().psn_a);
    // The last 20 packets of the window are lost the first time they are sent; nothing
    // follows them, so no later packet can show the responder the hole.
    let mut seen = std::collections::HashSet::new();
    sim.set_filter(move |p| {
        if p.from.node == 0 && p.time.0 >= start && p.payload_len > 0 {
            let late = first.distance(p.psn);
            if (109..=128).contains(&late) && seen.insert(p.psn) {
                return Verdict::Drop;
            }
        }
        Verdict::Pass
    });
    sim.post_send(a, write(2, dst.remote(0), vec![src.sge(0, data.len() as u32)]));
    sim.run_until(Duration::from_secs(1), |s| s.send_cq_len(a) > 0);
    assert_wc(&sim.take_send_cq(a)[0], 2, WcStatus::Success);
    assert_eq!(sim.mem(1).peek(dst.addr, data.len()), data);
    let took = Duration::from_nanos(sim.now.0 - start);
    let c = sim.qp(a).engine.counters();
    assert_eq!(c.tail_probes, 1, "{c:?}");
    assert_eq!(c.timeouts, 0, "the timer never fired ({c:?})");
    assert!(c.seq_naks_received >= 1, "the probe drew a NAK ({c:?})");
    assert!(c.retransmits >= 20, "the lost tail was resent ({c:?})");
    assert!(
        took < Duration::from_millis(10),
        "done {took:?} after the post: the requester waited for its timer"
    );
    let _ = b;
}

#[test]
fn a_probe_that_overtakes_the_tail_draws_no_go_back_n() {
    let (mut sim, a, b, src, dst, data) = measured_pair(13);
    let start = sim.now.0;
    let first = Psn::new(ConnOpts::default().psn_a);
    // The last 20 packets of the window are held back on their way (a backlog of another
    // core, say) until after the probe, which lands past them and draws a NAK.
    let mut seen = std::collections::HashSet::new();
    sim.set_filter(move |p| {
        if p.from.node == 0 && p.time.0 >= start && p.payload_len > 0 {
            let late = first.distance(p.psn);
            if (109..=128).contains(&late) && seen.insert(p.psn) {
                return Verdict::Delay(4_500_000);
            }
        }
        Verdict::Pass
    });
    sim.post_send(a, write(2, dst.remote(0), vec![src.sge(0, data.len() as u32)]));
    sim.run_until(Duration::from_secs(1), |s| s.send_cq_len(a) > 0);
    assert_wc(&sim.take_send_cq(a)[0], 2, WcStatus::Success);
    assert_eq!(sim.mem(1).peek(dst.addr, data.len()), data);
    let c = sim.qp(a).engine.counters();
    assert_eq!(c.tail_probes, 1, "{c:?}");
    assert!(c.seq_naks_received >= 1, "the probe drew a NAK ({c:?})");
    assert_eq!(c.timeouts, 0, "{c:?}");
    assert_eq!(
        c.retransmits, 0,
        "the held packets arrived within a round trip of the NAK: nothing resent ({c:?})"
    );
    let _ = b;
}
