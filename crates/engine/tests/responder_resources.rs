//! The responder's READ/atomic resources: a duplicate READ is executed again (re-reading
//! memory), a duplicate atomic is answered from the saved original value and never applied
//! twice, lost READ responses are asked for again hole by hole, and `max_rd_atomic` bounds the
//! READ/atomic requests in flight.

mod sim;

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use sim::*;
use softverbs_engine::types::{AccessFlags, Mtu, QpType, WcStatus};
use softverbs_wire::Opcode;

/// A filter dropping the first `n` packets matching `pred`.
fn drop_first(n: usize, pred: impl Fn(&PacketInfo) -> bool + 'static) -> impl FnMut(&PacketInfo) -> Verdict {
    let mut left = n;
    move |p| {
        if left > 0 && pred(p) {
            left -= 1;
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    }
}

#[test]
fn a_lost_atomic_ack_is_replayed_not_reexecuted() {
    let (mut sim, a, b) = Sim::pair(1, QpType::Rc, &ConnOpts::default());
    let local = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 64, all_access());
    sim.mem(1).poke_u64(remote.addr, 1000);
    sim.set_filter(drop_first(1, |p| p.opcode == Opcode::RcAtomicAcknowledge));
    sim.post_send(a, fetch_add(1, remote.remote(0), 5, local.sge(0, 8)));
    sim.post_send(a, cmp_swp(2, remote.remote(0), 1005, 7, local.sge(8, 8)));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
    assert_eq!(sim.mem(0).peek_u64(local.addr), 1000);
    assert_eq!(sim.mem(0).peek_u64(local.addr + 8), 1005);
    assert_eq!(sim.mem(1).peek_u64(remote.addr), 7, "1000 + 5 once, then swapped");
    assert_eq!(sim.mem(1).atomics.get(), 2, "each atomic executed exactly once");
    assert!(
        sim.qp(b).engine.counters().duplicates >= 1,
        "the retry reached the responder as a duplicate"
    );
    assert!(sim.qp(a).engine.counters().retransmits >= 1);
}

#[test]
fn duplicated_atomic_requests_are_applied_once() {
    let (mut sim, a, _b) = Sim::pair(2, QpType::Rc, &ConnOpts::default());
    sim.net.dup_pct = 100.0;
    let local = sim.mem(0).alloc_mr(1, 8 * 32, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 64, all_access());
    for i in 0..32 {
        sim.post_send(a, fetch_add(i, remote.remote(0), 1, local.sge(i * 8, 8)));
    }
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &(0..32).collect::<Vec<_>>());
    assert_eq!(sim.mem(1).peek_u64(remote.addr), 32);
    for i in 0..32 {
        assert_eq!(sim.mem(0).peek_u64(local.addr + i * 8), i);
    }
    assert_eq!(sim.mem(1).atomics.get(), 32);
}

#[test]
fn a_duplicate_read_is_executed_again() {
    let (mut sim, a, b) = Sim::pair(3, QpType::Rc, &ConnOpts::default());
    let local = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 64, all_access());
    sim.mem(1).poke(remote.addr, &[1; 32]);
    sim.set_filter(drop_first(1, |p| p.opcode == Opcode::RcReadResponseOnly));
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 32)]));
    // Let the first response be lost, then change the source before the retry arrives.
    sim.run_until(Duration::from_millis(1), |s| s.stats.filtered == 1);
    sim.mem(1).poke(remote.addr, &[2; 32]);
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1]);
    assert_eq!(
        sim.mem(0).peek(local.addr, 32),
        vec![2; 32],
        "the retried READ re-read the memory"
    );
    assert_eq!(sim.qp(b).engine.counters().duplicates, 1);
}

#[test]
fn lost_read_responses_are_asked_for_hole_by_hole() {
    let o = ConnOpts {
        mtu: Mtu::Mtu1024,
        ..ConnOpts::default()
    };
    let (mut sim, a, _b) = Sim::pair(4, QpType::Rc, &o);
    sim.record();
    let local = sim.mem(0).alloc_mr(1, 65536, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 65536, all_access());
    let data = sim.rng.bytes(65536);
    sim.mem(1).poke(remote.addr, &data);
    // Lose responses 10-11 and 40 of 64.
    let first = o.psn_a;
    let mut lost = vec![10, 11, 40];
    sim.set_filter(move |p| {
        let k = p.psn.value().wrapping_sub(first);
        match lost.iter().position(|&l| l == k) {
            Some(i) if p.opcode.is_read() && p.opcode.is_response() => {
                lost.remove(i);
                Verdict::Drop
            }
            _ => Verdict::Pass,
        }
    });
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 65536)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1]);
    assert_eq!(sim.mem(0).peek(local.addr, 65536), data);
    let requests: Vec<_> = sim
        .log
        .as_ref()
        .unwrap()
        .iter()
        .filter(|p| p.opcode == Opcode::RcReadRequest)
        .map(|p| p.psn.value() - first)
        .collect();
    // The whole READ, then just the holes, without waiting for a timeout.
    assert_eq!(requests, vec![0, 10, 40]);
    assert_eq!(sim.qp(a).engine.counters().timeouts, 0);
    let resent = sim
        .log
        .as_ref()
        .unwrap()
        .iter()
        .filter(|p| p.opcode.is_read() && p.opcode.is_response())
        .count();
    assert_eq!(resent, 64 + 3, "only the missing responses are sent again");
}

#[test]
fn a_read_response_lost_before_later_acks_is_recovered_without_a_timeout() {
    let (mut sim, a, _b) = Sim::pair(5, QpType::Rc, &ConnOpts::default());
    sim.record();
    let local = sim.mem(0).alloc_mr(1, 8192, all_access());
    let remote = sim.mem(1).alloc_mr(1, 8192, all_access());
    let data = sim.rng.bytes(100);
    sim.mem(1).poke(remote.addr, &data);
    sim.set_filter(drop_first(1, |p| p.opcode == Opcode::RcReadResponseOnly));
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 100)]));
    for i in 2..6 {
        sim.post_send(a, write(i, remote.remote(4096), vec![local.sge(4096, 100)]));
    }
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2, 3, 4, 5]);
    assert_eq!(sim.mem(0).peek(local.addr, 100), data);
    assert_eq!(
        sim.qp(a).engine.counters().timeouts,
        0,
        "the ACK past the READ implied the loss"
    );
    // Only the READ request was repeated, not the WRITEs behind it.
    let log = sim.log.as_ref().unwrap();
    assert_eq!(
        log.iter().filter(|p| p.opcode == Opcode::RcReadRequest).count(),
        2
    );
    assert_eq!(log.iter().filter(|p| p.opcode == Opcode::RcWriteOnly).count(), 4);
}

#[test]
fn max_rd_atomic_bounds_outstanding_reads_and_atomics() {
    let o = ConnOpts {
        max_rd_atomic: 2,
        ..ConnOpts::default()
    };
    let (mut sim, a, _b) = Sim::pair(6, QpType::Rc, &o);
    sim.record();
    let local = sim.mem(0).alloc_mr(1, 65536, all_access());
    let remote = sim.mem(1).alloc_mr(1, 65536, all_access());
    // Hold every response back for 1 ms.
    let hold = Rc::new(Cell::new(true));
    let h = hold.clone();
    sim.set_filter(move |p| {
        if h.get() && p.opcode.is_response() && p.opcode != Opcode::RcAcknowledge {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    for i in 0..6 {
        if i % 3 == 2 {
            sim.post_send(a, fetch_add(i, remote.remote(0), 1, local.sge(60000 + i * 8, 8)));
        } else {
            sim.post_send(
                a,
                read(i, remote.remote(i * 1000), vec![local.sge(i * 1000, 1000)]),
            );
        }
    }
    // A SEND/WRITE behind them is not held up by the limit.
    sim.post_send(a, write(6, remote.remote(30000), vec![local.sge(0, 8)]));
    sim.run_for(Duration::from_micros(500));
    let distinct = |sim: &Sim| {
        let mut psns: Vec<u32> = sim
            .log
            .as_ref()
            .unwrap()
            .iter()
            .filter(|p| p.from == a && (p.opcode == Opcode::RcReadRequest || p.opcode.is_atomic()))
            .map(|p| p.psn.value())
            .collect();
        psns.sort_unstable();
        psns.dedup();
        psns.len()
    };
    assert_eq!(
        distinct(&sim),
        2,
        "only max_rd_atomic READ/atomic requests started"
    );
    hold.set(false);
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(distinct(&sim), 6);
    assert_eq!(sim.mem(1).peek_u64(remote.addr), 2);
}

#[test]
fn a_duplicate_read_for_an_evicted_resource_is_ignored() {
    // One responder resource: the second READ evicts the first; a retry of the first can then
    // not be answered, and the requester gives up after its retries.
    let mut sim = Sim::new(7, 2);
    let a = sim.create_qp(0, QpType::Rc);
    let b = sim.create_qp(1, QpType::Rc);
    let o = ConnOpts {
        retry_cnt: 2,
        timeout: 8,
        ..ConnOpts::default()
    };
    sim.bring_up(
        a,
        b,
        &ConnOpts {
            max_rd_atomic: 2,
            ..o
        },
        o.psn_a,
        o.psn_b,
    );
    sim.bring_up(
        b,
        a,
        &ConnOpts {
            max_dest_rd_atomic: 1,
            ..o
        },
        o.psn_b,
        o.psn_a,
    );
    let local = sim.mem(0).alloc_mr(1, 8192, all_access());
    let remote = sim.mem(1).alloc_mr(1, 8192, all_access());
    let first = o.psn_a;
    sim.set_filter(move |p| {
        if p.opcode == Opcode::RcReadResponseOnly && p.psn.value() == first {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 100)]));
    sim.post_send(a, read(2, remote.remote(0), vec![local.sge(100, 100)]));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_eq!(
        s.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)]
    );
}

#[test]
fn a_read_waiting_for_a_lost_response_keeps_its_responder_resource() {
    // Two resources on each side. READ 1's last response is lost; READs 2.. complete behind it
    // but must not start more READs than the responder keeps resources for, or READ 1's would
    // be evicted and its retry never answered.
    let o = ConnOpts {
        max_rd_atomic: 2,
        max_dest_rd_atomic: 2,
        retry_cnt: 7,
        timeout: 8,
        ..ConnOpts::default()
    };
    let (mut sim, a, _b) = Sim::pair(8, QpType::Rc, &o);
    sim.record();
    let local = sim.mem(0).alloc_mr(1, 65536, all_access());
    let remote = sim.mem(1).alloc_mr(1, 65536, all_access());
    let data = sim.rng.bytes(65536);
    sim.mem(1).poke(remote.addr, &data);
    // READ 1 (3 packets at MTU 1024) loses its last response for 2.5 ms (a few timeouts).
    let last = o.psn_a + 2;
    let until = sim.now.0 + 2_500_000;
    sim.set_filter(move |p| {
        if p.opcode.is_read() && p.opcode.is_response() && p.psn.value() == last && p.time.0 < until {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 3000)]));
    for i in 2..8 {
        sim.post_send(
            a,
            read(i, remote.remote(i * 4096), vec![local.sge(i * 4096, 100)]),
        );
    }
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(sim.mem(0).peek(local.addr, 3000), data[..3000]);
    for i in 2..8usize {
        assert_eq!(
            sim.mem(0).peek(local.addr + i as u64 * 4096, 100),
            data[i * 4096..i * 4096 + 100]
        );
    }
}

#[test]
fn a_sequence_nak_behind_a_stuck_read_is_acted_upon() {
    // A READ whose response is lost for a while sits at the front of the send queue, so the
    // window cannot move. A WRITE behind it loses a packet twice (first in the original pass,
    // then a later one in the go-back-N resend): the second NAK must trigger another resend at
    // once, not wait for a timeout (which would only ask for the READ's response again).
    let o = ConnOpts {
        mtu: Mtu::Mtu1024,
        timeout: 10,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(9, QpType::Rc, &o);
    sim.record();
    let local = sim.mem(0).alloc_mr(1, 65536, all_access());
    let remote = sim.mem(1).alloc_mr(1, 65536, all_access());
    let data = sim.rng.bytes(32768);
    sim.mem(0).poke(local.addr + 32768, &data);
    let (read_psn, x, y) = (o.psn_a, o.psn_a + 5, o.psn_a + 20);
    // Shorter than the first retransmission timeout (at least 1 ms).
    let until = sim.now.0 + 500_000;
    let mut copies = std::collections::HashMap::<u32, u32>::new();
    sim.set_filter(move |p| {
        if p.opcode.is_read() && p.opcode.is_response() && p.psn.value() == read_psn && p.time.0 < until {
            return Verdict::Drop;
        }
        if p.opcode.is_write() {
            let n = copies.entry(p.psn.value()).or_default();
            *n += 1;
            if (p.psn.value() == x && *n == 1) || (p.psn.value() == y && *n == 2) {
                return Verdict::Drop;
            }
        }
        Verdict::Pass
    });
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 100)]));
    sim.post_send(a, write(2, remote.remote(32768), vec![local.sge(32768, 32768)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
    assert_eq!(sim.mem(1).peek(remote.addr + 32768, 32768), data);
    assert_eq!(
        sim.qp(a).engine.counters().timeouts,
        1,
        "only the READ needed a timeout"
    );
    // One NAK per loss at least (the responder repeats one for packets asking for an
    // acknowledgement past the hole).
    let received = sim.qp(a).engine.counters().seq_naks_received;
    assert!(received >= 2);
    // The responder counts each it sent (none is lost here; one that finds nothing outstanding
    // is not counted by the requester).
    assert!(sim.qp(b).engine.counters().seq_naks_sent >= received);
    assert_eq!(
        sim.qp(a).engine.counters().seq_naks_sent,
        0,
        "the requester's responder saw no hole"
    );
}

#[test]
fn completing_a_read_resets_the_retry_budget_for_the_atomic_behind_it() {
    // retry_cnt 3. The READ spends two retries on a twice-lost response; once it completes the
    // budget must be full again for the atomic behind it, whose ACK is also lost twice.
    let o = ConnOpts {
        mtu: Mtu::Mtu1024,
        retry_cnt: 3,
        timeout: 8,
        ..ConnOpts::default()
    };
    let (mut sim, a, _b) = Sim::pair(10, QpType::Rc, &o);
    let local = sim.mem(0).alloc_mr(1, 8192, all_access());
    let remote = sim.mem(1).alloc_mr(1, 8192, all_access());
    let data = sim.rng.bytes(4096);
    sim.mem(1).poke(remote.addr, &data);
    let hole = o.psn_a + 1;
    let (mut hole_drops, mut ack_drops) = (2, 2);
    sim.set_filter(move |p| {
        if p.opcode.is_read() && p.opcode.is_response() && p.psn.value() == hole && hole_drops > 0 {
            hole_drops -= 1;
            return Verdict::Drop;
        }
        if p.opcode == Opcode::RcAtomicAcknowledge && ack_drops > 0 {
            ack_drops -= 1;
            return Verdict::Drop;
        }
        Verdict::Pass
    });
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 4096)]));
    sim.post_send(a, fetch_add(2, remote.remote(4096), 3, local.sge(4096, 8)));
    sim.post_send(a, write(3, remote.remote(5000), vec![local.sge(5000, 8)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2, 3]);
    assert_eq!(sim.mem(0).peek(local.addr, 4096), data);
    assert_eq!(sim.mem(1).peek_u64(remote.addr + 4096), 3);
}
