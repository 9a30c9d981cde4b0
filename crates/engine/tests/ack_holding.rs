//! Held ACKs (`QpEngine::hold_acks`), as a device uses them for a received batch: the
//! packets that arrive together are answered by one positive ACK, a NAK still leaves behind
//! the ACK decided before it, and transfers stay exact under loss.

mod sim;

use sim::*;
use softverbs_engine::types::{Mtu, QpType, WcStatus};
use softverbs_wire::{AethSyndrome, NakCode, Opcode, Psn};

const N: u64 = 8;

/// A pair whose link takes no time per packet, so that what `a` sends at one instant arrives
/// at `b` at one instant (one batch).
fn instant_pair(seed: u64, hold: bool) -> (Sim, QpId, QpId) {
    let (mut sim, a, b) = Sim::pair(seed, QpType::Rc, &ConnOpts::default());
    sim.net.link_gbps = 0;
    sim.hold_acks = hold;
    sim.record();
    (sim, a, b)
}

/// Posts `N` 64-byte SENDs from `a` to `b`, each into its own receive, and runs to the end.
fn sends(sim: &mut Sim, a: QpId, b: QpId) {
    let src = sim.mem(0).alloc_mr(1, 64 * N, all_access());
    let dst = sim.mem(1).alloc_mr(1, 64 * N, all_access());
    for i in 0..N {
        sim.post_recv(b, recv(100 + i, vec![dst.sge(i * 64, 64)]));
    }
    for i in 0..N {
        sim.post_send(a, send(i, vec![src.sge(i * 64, 64)]));
    }
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &(0..N).collect::<Vec<_>>());
    assert_ok_in_order(&sim.take_recv_cq(b), &(100..100 + N).collect::<Vec<_>>());
}

/// What `b` sent: (opcode, PSN, syndrome), in order.
fn sent_by(sim: &Sim, b: QpId) -> Vec<(Opcode, Psn, Option<AethSyndrome>)> {
    sim.log
        .as_ref()
        .expect("recording")
        .iter()
        .filter(|p| p.from == b)
        .map(|p| (p.opcode, p.psn, p.syndrome))
        .collect()
}

#[test]
fn sends_that_arrive_together_are_answered_by_one_ack() {
    let (mut sim, a, b) = instant_pair(1, false);
    sends(&mut sim, a, b);
    let each = sent_by(&sim, b);
    assert!(each.len() > 1, "without holding, several ACKs: {each:?}");

    let (mut sim, a, b) = instant_pair(1, true);
    sends(&mut sim, a, b);
    let held = sent_by(&sim, b);
    let first = sim.qp(a).attr.sq_psn;
    assert_eq!(
        held,
        [(
            Opcode::RcAcknowledge,
            Psn::new(first) + (N as u32 - 1),
            Some(AethSyndrome::ACK_UNLIMITED)
        )],
        "one ACK, for the last SEND"
    );
    assert_eq!(sim.qp(b).engine.counters().acks_held, N - 1);
    assert_eq!(sim.qp(a).engine.counters().retransmits, 0);
}

#[test]
fn a_nak_leaves_behind_the_ack_held_before_it() {
    let (mut sim, a, b) = instant_pair(2, true);
    let first = sim.qp(a).attr.sq_psn;
    // The third SEND is lost once: the batch is SENDs 0, 1, 3, ..., and 3 is out of sequence.
    let lost = Psn::new(first) + 2;
    let mut dropped = false;
    sim.set_filter(move |p| {
        if !dropped && p.opcode == Opcode::RcSendOnly && p.psn == lost {
            dropped = true;
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    sends(&mut sim, a, b);
    let from_b = sent_by(&sim, b);
    assert!(from_b.len() >= 2, "{from_b:?}");
    assert_eq!(
        from_b[..2],
        [
            (
                Opcode::RcAcknowledge,
                Psn::new(first) + 1,
                Some(AethSyndrome::ACK_UNLIMITED)
            ),
            (
                Opcode::RcAcknowledge,
                lost,
                Some(AethSyndrome::Nak(NakCode::PsnSequenceError))
            ),
        ],
        "the ACK of SENDs 0 and 1, then the NAK asking for 2"
    );
}

#[test]
fn transfers_stay_exact_under_loss_with_acks_held() {
    const MIB: u64 = 1 << 20;
    for (seed, loss) in [(3, 1.0), (4, 10.0), (5, 10.0)] {
        let (mut sim, a, b) = lossy_pair(seed, loss, Mtu::Mtu1024);
        sim.hold_acks = true;
        let amr = sim.mem(0).alloc_mr(1, MIB, all_access());
        let bmr = sim.mem(1).alloc_mr(1, MIB, all_access());
        let data = sim.rng.bytes(MIB as usize);
        sim.mem(0).poke(amr.addr, &data);
        sim.post_send(a, write(1, bmr.remote(0), vec![amr.sge(0, (MIB / 2) as u32)]));
        sim.post_recv(b, recv(9, vec![bmr.sge(MIB / 2, (MIB / 2) as u32)]));
        sim.post_send(a, send(2, vec![amr.sge(MIB / 2, (MIB / 2) as u32)]));
        sim.run();
        let s = sim.take_send_cq(a);
        assert_ok_in_order(&s, &[1, 2]);
        assert!(s.iter().all(|w| w.status == WcStatus::Success));
        assert_ok_in_order(&sim.take_recv_cq(b), &[9]);
        assert!(
            sim.mem(1).peek(bmr.addr, MIB as usize) == data,
            "seed {seed} loss {loss}: bytes differ"
        );
    }
}
