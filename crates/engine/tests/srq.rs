//! Shared receive queues: several QPs draw from one SRQ, each message consumes exactly one WQE
//! (also under loss and retransmission), an empty SRQ RNR-NAKs until a WQE is posted, and UC
//! puts a WQE back when its message is abandoned.

mod sim;

use std::collections::BTreeSet;
use std::time::Duration;

use sim::*;
use softverbs_engine::types::{AccessFlags, QpType};
use softverbs_wire::Opcode;

/// `senders` nodes each connected (`qp_type`) to one of `senders` QPs on node 0 sharing an SRQ
/// and a receive CQ.
fn star(
    seed: u64,
    senders: usize,
    qp_type: QpType,
    net: NetConfig,
) -> (Sim, usize, usize, Vec<(QpId, QpId)>) {
    let mut sim = Sim::new(seed, senders + 1).with_net(net);
    let srq = sim.create_srq(0);
    let cq = sim.create_cq(0);
    let o = ConnOpts {
        timeout: 8,
        ..ConnOpts::default()
    };
    let pairs = (1..=senders)
        .map(|n| {
            let s = sim.create_qp(n, qp_type);
            let r = sim.create_qp_with(
                0,
                qp_type,
                QpOpts {
                    srq: Some(srq),
                    recv_cq: Some(cq),
                    ..QpOpts::default()
                },
            );
            sim.connect(s, r, &o);
            (s, r)
        })
        .collect();
    (sim, srq, cq, pairs)
}

#[test]
fn several_rc_qps_share_one_srq() {
    let (mut sim, srq, cq, pairs) = star(1, 3, QpType::Rc, NetConfig::default());
    let slot = 8192u64;
    let buf = sim.mem(0).alloc_mr(1, 30 * slot, AccessFlags::LOCAL_WRITE);
    for i in 0..30 {
        sim.post_srq_recv(0, srq, recv(i, vec![buf.sge(i * slot, slot as u32)]));
    }
    let mut sent = Vec::new();
    for (n, (s, _)) in pairs.iter().enumerate() {
        let src = sim.mem(s.node).alloc_mr(1, 8 * slot, AccessFlags::empty());
        let data = sim.rng.bytes(8 * slot as usize);
        sim.mem(s.node).poke(src.addr, &data);
        for m in 0..8u64 {
            let len = 1000 + 700 * m + n as u64;
            sim.post_send(*s, send(m, vec![src.sge(m * slot, len as u32)]));
            sent.push((
                pairs[n].1.qpn,
                data[(m * slot) as usize..(m * slot + len) as usize].to_vec(),
            ));
        }
    }
    sim.run();
    let wcs = sim.take_cq(0, cq);
    assert_eq!(wcs.len(), 24);
    // Every WQE used once, in SRQ order; each message found whole in the buffer it landed in.
    assert_eq!(
        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        (0..24).collect::<Vec<_>>()
    );
    let mut remaining = sent.clone();
    for wc in &wcs {
        let got = sim.mem(0).peek(buf.addr + wc.wr_id * slot, wc.byte_len as usize);
        let i = remaining
            .iter()
            .position(|(qpn, d)| *qpn == wc.qp_num && *d == got)
            .expect("a message sent to that QP");
        remaining.remove(i);
    }
    assert_eq!(sim.nodes[0].srqs[srq].queue.len(), 6);
    // Per QP, messages arrive in order.
    for (_, r) in &pairs {
        let order: Vec<u32> = wcs
            .iter()
            .filter(|w| w.qp_num == r.qpn)
            .map(|w| w.byte_len)
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]));
    }
}

#[test]
fn every_message_consumes_exactly_one_srq_wqe_under_loss() {
    for seed in seeds(&[2, 3, 4]) {
        let (mut sim, srq, cq, pairs) = star(seed, 4, QpType::Rc, NetConfig::lossy(10.0));
        let buf = sim.mem(0).alloc_mr(1, 200 * 4096, AccessFlags::LOCAL_WRITE);
        for i in 0..200 {
            sim.post_srq_recv(0, srq, recv(i, vec![buf.sge(i * 4096, 4096)]));
        }
        for (s, _) in &pairs {
            let src = sim.mem(s.node).alloc_mr(1, 4096, AccessFlags::empty());
            for m in 0..40 {
                sim.post_send(*s, send(m, vec![src.sge(0, 3000)]));
            }
        }
        sim.run();
        for (s, _) in &pairs {
            assert_ok_in_order(&sim.take_send_cq(*s), &(0..40).collect::<Vec<_>>());
        }
        let wcs = sim.take_cq(0, cq);
        assert_eq!(wcs.len(), 160);
        let ids: BTreeSet<u64> = wcs.iter().map(|w| w.wr_id).collect();
        assert_eq!(
            ids,
            (0..160).collect::<BTreeSet<_>>(),
            "the first 160 WQEs, each once"
        );
        assert_eq!(sim.nodes[0].srqs[srq].taken, 160);
        assert_eq!(sim.nodes[0].srqs[srq].queue.len(), 40);
    }
}

#[test]
fn an_empty_srq_rnr_naks_until_a_wqe_is_posted() {
    let (mut sim, srq, cq, pairs) = star(5, 2, QpType::Rc, NetConfig::default());
    let buf = sim.mem(0).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
    sim.post_send(pairs[0].0, send(1, vec![]));
    sim.post_send(pairs[1].0, send(2, vec![]));
    sim.run_for(Duration::from_millis(2));
    assert!(sim.qp(pairs[0].0).engine.counters().rnr_naks_received > 0);
    assert!(sim.take_cq(0, cq).is_empty());
    sim.post_srq_recv(0, srq, recv(10, vec![buf.sge(0, 64)]));
    sim.post_srq_recv(0, srq, recv(11, vec![buf.sge(64, 64)]));
    sim.run_for(Duration::from_millis(10));
    assert_ok_in_order(&sim.take_send_cq(pairs[0].0), &[1]);
    assert_ok_in_order(&sim.take_send_cq(pairs[1].0), &[2]);
    let mut ids: Vec<u64> = sim.take_cq(0, cq).iter().map(|w| w.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![10, 11]);
}

#[test]
fn uc_puts_the_wqe_of_an_abandoned_message_back() {
    let (mut sim, srq, cq, pairs) = star(6, 1, QpType::Uc, NetConfig::default());
    let (s, _r) = pairs[0];
    let buf = sim.mem(0).alloc_mr(1, 3 * 4096, AccessFlags::LOCAL_WRITE);
    for i in 0..3 {
        sim.post_srq_recv(0, srq, recv(i, vec![buf.sge(i * 4096, 4096)]));
    }
    // The first message loses its LAST packet after its FIRST took WQE 0.
    let mut dropped = false;
    sim.set_filter(move |p| {
        if !dropped && p.opcode == Opcode::UcSendLast {
            dropped = true;
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    let src = sim.mem(1).alloc_mr(1, 4096, AccessFlags::empty());
    sim.mem(1).poke(src.addr, &[5; 4096]);
    sim.post_send(s, send(1, vec![src.sge(0, 2000)]));
    sim.post_send(s, send(2, vec![src.sge(0, 3000)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(s), &[1, 2]);
    let wcs = sim.take_cq(0, cq);
    assert_ok_in_order(&wcs, &[0]);
    assert_eq!(wcs[0].byte_len, 3000, "the second message used WQE 0 again");
    assert_eq!(sim.nodes[0].srqs[srq].queue.len(), 2);
}
