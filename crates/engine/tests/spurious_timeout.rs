//! A retransmission timer that fires while the acknowledgements are only late (the receiver
//! was descheduled, say): the go-back-N it starts must end as soon as they arrive.

mod sim;

use std::time::Duration;

use sim::*;
use softverbs_engine::types::{Mtu, QpType, WcStatus};

/// The responder's ACKs for the first window are held back past the retransmission timer, so
/// the requester goes back to resend them; the responder acknowledges the resent duplicates
/// with everything it has, past what was resent. The requester used to keep its send position
/// at the resend, now before the window's base, which the window test reads as a full window:
/// nothing more went out until the next timer expiry. It now goes on at once from the first
/// PSN not acknowledged.
#[test]
fn acknowledgement_past_the_resend_ends_the_go_back_n_at_once() {
    let o = ConnOpts {
        mtu: Mtu::Mtu256,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(7, QpType::Rc, &o);
    const PACKETS: u32 = 1000;
    let len = PACKETS * 256;
    let src = sim.mem(0).alloc_mr(1, u64::from(len), all_access());
    let dst = sim.mem(1).alloc_mr(1, u64::from(len), all_access());
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    sim.mem(0).poke(src.addr, &data);
    let start = sim.now.0;
    // Held past the first expiry and the next one.
    const HELD: u64 = 40_000_000;
    sim.set_filter(move |p| {
        if p.from.node == 1 && p.time.0 < start + 1_000_000 {
            Verdict::Delay(HELD)
        } else {
            Verdict::Pass
        }
    });
    sim.post_send(a, write(1, dst.remote(0), vec![src.sge(0, len)]));
    sim.run_until(Duration::from_secs(5), |s| s.send_cq_len(a) > 0);
    let wcs = sim.take_send_cq(a);
    assert_wc(&wcs[0], 1, WcStatus::Success);
    assert_eq!(sim.mem(1).peek(dst.addr, len as usize), data);
    let c = sim.qp(a).engine.counters();
    // Nothing was measured before the first window, so the timer waits the configured local
    // ACK timeout once. The ACK of the resend covers the whole window, and the transfer goes on
    // at once: no second expiry, done soon after the first.
    assert_eq!(c.timeouts, 1, "one expiry, the held ACKs' ({c:?})");
    assert_eq!(c.spurious_timeouts, 1, "and it is known to be spurious ({c:?})");
    let configured = Duration::from_nanos(4096 << o.timeout);
    let took = Duration::from_nanos(sim.now.0 - start);
    assert!(
        took < configured * 3 / 2,
        "completed after {took:?} (timeout {configured:?}): the requester waited after the \
         resend was acknowledged"
    );
    assert!(
        c.retransmits <= 2,
        "only the go-back-N's first packets: {} resent",
        c.retransmits
    );
    let _ = b;
}
