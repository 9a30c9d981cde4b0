//! An RNR NAK that arrives after the retransmission it should have prevented.

mod sim;

use std::time::Duration;

use sim::*;
use softverbs_engine::types::{AccessFlags, QpType};
use softverbs_wire::AethSyndrome;

/// The responder RNR-NAKs a SEND; the NAK is late, so the requester's ACK timeout resends the
/// SEND first, which the responder (a receive now posted) executes and ACKs. The late NAK then
/// rewinds the requester and starts an RNR wait, during which the ACK arrives: it acknowledges
/// the SEND, which must complete (not stay queued behind a window that moved past it).
#[test]
fn an_ack_during_the_rnr_wait_of_a_late_nak_completes_the_send() {
    let o = ConnOpts {
        rnr_retry: 7,
        // 1.28 ms: the ACK below arrives inside this wait.
        min_rnr_timer: 14,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(11, QpType::Rc, &o);
    let (mut naks, mut acks) = (0, 0);
    sim.set_filter(move |p| match p.syndrome {
        // The first RNR NAK lands 1 ms after the 4.2 ms ACK timeout resent the SEND.
        Some(AethSyndrome::RnrNak { .. }) if naks == 0 => {
            naks += 1;
            Verdict::Delay(5_200_000)
        }
        // The ACK of that resend lands inside the RNR wait the late NAK started.
        Some(AethSyndrome::Ack { .. }) if acks == 0 => {
            acks += 1;
            Verdict::Delay(2_000_000)
        }
        _ => Verdict::Pass,
    });
    let src = sim.mem(0).alloc_mr(1, 64, AccessFlags::empty());
    let dst = sim.mem(1).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    sim.post_send(a, send(1, vec![src.sge(0, 64)]));
    sim.run_for(Duration::from_millis(1));
    sim.post_recv(b, recv(1, vec![dst.sge(0, 64)]));
    sim.run_until(Duration::from_millis(200), |s| s.send_cq_len(a) > 0);
    assert_ok_in_order(&sim.take_recv_cq(b), &[1]);
    assert_ok_in_order(&sim.take_send_cq(a), &[1]);
}
