//! XRC on the simulated fabric: an initiator (XRC_SEND) on one node talks to a target
//! (XRC_RECV) on another, whose XRC domain holds several SRQs with their own PDs and CQs. Every
//! request names its SRQ in an XRCETH; receives come from that SRQ, complete on its CQ with the
//! target's QP number, and keys are checked against its PD. SEND, WRITE, READ and atomics are
//! run under loss, duplication and reordering.

mod sim;

use std::collections::BTreeSet;
use std::time::Duration;

use sim::*;
use softverbs_engine::types::{AccessFlags, QpState, QpType, WcOpcode, WcStatus};
use softverbs_engine::wr::{Payload, SendOp};
use softverbs_wire::Transport;

const XRCD: u32 = 7;

/// Node 0: an initiator. Node 1: a target of domain [`XRCD`] with two XRC SRQs, one in PD 1
/// and one in PD 2, each with its own CQ. Returns (sim, ini, tgt, [(srq index, srqn, cq)]).
fn setup(seed: u64, net: NetConfig) -> (Sim, QpId, QpId, [(usize, u32, usize); 2]) {
    let mut sim = Sim::new(seed, 2).with_net(net);
    let ini = sim.create_qp(0, QpType::XrcSend);
    let tgt = sim.create_xrc_tgt(1, XRCD);
    let cq_a = sim.create_cq(1);
    let cq_b = sim.create_cq(1);
    let (a, srqn_a) = sim.create_xrc_srq(1, XRCD, 1, cq_a);
    let (b, srqn_b) = sim.create_xrc_srq(1, XRCD, 2, cq_b);
    let o = ConnOpts {
        timeout: 8,
        ..ConnOpts::default()
    };
    sim.connect(ini, tgt, &o);
    (sim, ini, tgt, [(a, srqn_a, cq_a), (b, srqn_b, cq_b)])
}

fn to_srq(mut w: softverbs_engine::wr::SendWr, srqn: u32) -> softverbs_engine::wr::SendWr {
    w.xrc_srqn = Some(srqn);
    w
}

#[test]
fn xrc_requests_carry_xrceth_and_responses_do_not() {
    let (mut sim, ini, tgt, srqs) = setup(11, NetConfig::default());
    let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let log = seen.clone();
    sim.set_filter(move |p| {
        log.borrow_mut().push(*p);
        Verdict::Pass
    });
    let (srq, srqn, cq) = srqs[0];
    let buf = sim
        .mem(1)
        .alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
    sim.post_srq_recv(1, srq, recv(5, vec![buf.sge(0, 4096)]));
    let src = sim.mem(0).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
    sim.mem(0).poke(src.addr, b"xrc!");
    sim.post_send(ini, to_srq(send(1, vec![src.sge(0, 4)]), srqn));
    sim.post_send(ini, to_srq(read(2, buf.remote(0), vec![src.sge(8, 4)]), srqn));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(ini), &[1, 2]);
    let wcs = sim.take_cq(1, cq);
    assert_eq!(wcs.len(), 1);
    assert_wc(&wcs[0], 5, WcStatus::Success);
    assert_eq!((wcs[0].opcode, wcs[0].byte_len), (WcOpcode::Recv, 4));
    // The completion names the target QP and the initiator.
    assert_eq!((wcs[0].qp_num, wcs[0].src_qp), (tgt.qpn, ini.qpn));
    assert_eq!(sim.mem(0).peek(src.addr + 8, 4), b"xrc!");
    let seen = seen.borrow();
    assert!(!seen.is_empty());
    for p in seen.iter() {
        assert_eq!(p.opcode.transport(), Transport::Xrc, "{:?}", p.opcode);
        if p.opcode.is_request() {
            assert_eq!((p.from, p.dest_qpn, p.xrc_srqn), (ini, tgt.qpn, Some(srqn)));
        } else {
            assert_eq!((p.from, p.dest_qpn, p.xrc_srqn), (tgt, ini.qpn, None));
        }
    }
    assert!(seen.iter().any(|p| p.opcode.is_read() && p.opcode.is_response()));
}

#[test]
fn sends_land_in_the_named_srq_under_loss() {
    for seed in seeds(&[21, 22, 23]) {
        let (mut sim, ini, tgt, srqs) = setup(seed, NetConfig::lossy(8.0));
        let slot = 8192u64;
        let mut bufs = Vec::new();
        for (k, &(srq, _, _)) in srqs.iter().enumerate() {
            let pd = k as u32 + 1;
            let buf = sim.mem(1).alloc_mr(pd, 40 * slot, AccessFlags::LOCAL_WRITE);
            for i in 0..40 {
                sim.post_srq_recv(1, srq, recv(i, vec![buf.sge(i * slot, slot as u32)]));
            }
            bufs.push(buf);
        }
        let src = sim.mem(0).alloc_mr(1, 30 * slot, AccessFlags::empty());
        let data = sim.rng.bytes(30 * slot as usize);
        sim.mem(0).poke(src.addr, &data);
        // Messages alternate between the SRQs; several are multi-packet.
        let mut expect: [Vec<Vec<u8>>; 2] = [Vec::new(), Vec::new()];
        for m in 0..30u64 {
            let k = (m % 2) as usize;
            let len = 500 + 211 * m;
            let off = m * slot;
            sim.post_send(ini, to_srq(send(m, vec![src.sge(off, len as u32)]), srqs[k].1));
            expect[k].push(data[off as usize..(off + len) as usize].to_vec());
        }
        sim.run();
        assert_ok_in_order(&sim.take_send_cq(ini), &(0..30).collect::<Vec<_>>());
        for (k, &(srq, _, cq)) in srqs.iter().enumerate() {
            let wcs = sim.take_cq(1, cq);
            assert_eq!(wcs.len(), 15, "seed {seed} srq {k}");
            // Each SRQ's WQEs are used once each, in order; messages arrive in order.
            let ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
            assert_eq!(ids, (0..15).collect::<Vec<_>>(), "seed {seed}");
            for (wc, want) in wcs.iter().zip(&expect[k]) {
                assert_wc(wc, wc.wr_id, WcStatus::Success);
                assert_eq!(wc.qp_num, tgt.qpn);
                let got = sim
                    .mem(1)
                    .peek(bufs[k].addr + wc.wr_id * slot, wc.byte_len as usize);
                assert_eq!(&got, want, "seed {seed}");
            }
            assert_eq!(sim.nodes[1].srqs[srq].taken, 15);
        }
        assert!(
            sim.stats.lost > 0,
            "seed {seed}: the loss must have been exercised"
        );
    }
}

#[test]
fn write_read_and_atomics_under_loss_use_the_srq_pd() {
    for seed in seeds(&[31, 32, 33]) {
        let (mut sim, ini, tgt, srqs) = setup(seed, NetConfig::lossy(8.0));
        // Target memory in PD 2: reachable only through the SRQ whose PD is 2.
        let len = 64 * 1024;
        let dst = sim.mem(1).alloc_mr(2, len + 64, all_access());
        let src = sim.mem(0).alloc_mr(1, 2 * len + 64, all_access());
        let data = sim.rng.bytes(len as usize);
        sim.mem(0).poke(src.addr, &data);
        let srqn = srqs[1].1;
        sim.post_send(
            ini,
            to_srq(write(1, dst.remote(0), vec![src.sge(0, len as u32)]), srqn),
        );
        sim.post_send(
            ini,
            to_srq(read(2, dst.remote(0), vec![src.sge(len, len as u32)]), srqn),
        );
        sim.mem(1).poke_u64(dst.addr + len, 40);
        sim.post_send(
            ini,
            to_srq(fetch_add(3, dst.remote(len), 2, src.sge(2 * len, 8)), srqn),
        );
        sim.post_send(
            ini,
            to_srq(cmp_swp(4, dst.remote(len), 42, 7, src.sge(2 * len + 8, 8)), srqn),
        );
        // WRITE with immediate consumes a WQE of the named SRQ.
        let rbuf = sim.mem(1).alloc_mr(2, 64, AccessFlags::LOCAL_WRITE);
        sim.post_srq_recv(1, srqs[1].0, recv(77, vec![rbuf.sge(0, 64)]));
        let mut w = write(5, dst.remote(0), vec![src.sge(0, 16)]);
        w.op = SendOp::Write {
            remote: dst.remote(0),
            imm: Some(0x1234_5678),
        };
        sim.post_send(ini, to_srq(w, srqn));
        sim.run();
        assert_ok_in_order(&sim.take_send_cq(ini), &[1, 2, 3, 4, 5]);
        assert_eq!(sim.mem(1).peek(dst.addr + 16, len as usize - 16), data[16..]);
        // The READ saw the WRITE's data.
        assert_eq!(sim.mem(0).peek(src.addr + len, len as usize), data);
        assert_eq!(sim.mem(0).peek_u64(src.addr + 2 * len), 40);
        assert_eq!(sim.mem(0).peek_u64(src.addr + 2 * len + 8), 42);
        assert_eq!(
            sim.mem(1).peek_u64(dst.addr + len),
            7,
            "seed {seed}: each atomic once"
        );
        let wcs = sim.take_cq(1, srqs[1].2);
        assert_eq!(wcs.len(), 1);
        assert_wc(&wcs[0], 77, WcStatus::Success);
        assert_eq!(
            (wcs[0].opcode, wcs[0].qp_num, wcs[0].imm_data),
            (WcOpcode::RecvRdmaWithImm, tgt.qpn, 0x1234_5678)
        );
        assert!(sim.take_cq(1, srqs[0].2).is_empty());
        assert!(sim.stats.lost > 0);
    }
}

#[test]
fn a_key_of_another_pd_than_the_srq_is_a_remote_access_error() {
    let (mut sim, ini, tgt, srqs) = setup(41, NetConfig::default());
    // Memory in PD 2, but the request names the SRQ of PD 1.
    let dst = sim.mem(1).alloc_mr(2, 4096, all_access());
    let src = sim.mem(0).alloc_mr(1, 4096, all_access());
    sim.post_send(
        ini,
        to_srq(write(1, dst.remote(0), vec![src.sge(0, 64)]), srqs[0].1),
    );
    sim.post_send(ini, to_srq(send(2, vec![]), srqs[0].1));
    sim.run();
    let wcs = sim.take_send_cq(ini);
    assert_wc(&wcs[0], 1, WcStatus::RemAccessErr);
    assert_wc(&wcs[1], 2, WcStatus::WrFlushErr);
    assert_eq!(sim.state(ini), QpState::Err);
    assert_eq!(sim.state(tgt), QpState::Err);
}

#[test]
fn an_srqn_outside_the_targets_domain_is_refused() {
    let (mut sim, ini, tgt, srqs) = setup(51, NetConfig::default());
    // An XRC SRQ of another domain on the same node, with a WQE ready.
    let cq = sim.create_cq(1);
    let (other, other_srqn) = sim.create_xrc_srq(1, XRCD + 1, 1, cq);
    let buf = sim.mem(1).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
    sim.post_srq_recv(1, other, recv(9, vec![buf.sge(0, 64)]));
    sim.post_send(ini, to_srq(send(1, vec![]), other_srqn));
    sim.run();
    let wcs = sim.take_send_cq(ini);
    assert_eq!(wcs.len(), 1);
    assert_wc(&wcs[0], 1, WcStatus::RemAccessErr);
    assert_eq!(sim.state(tgt), QpState::Err);
    // Nothing was taken from the other domain's SRQ, nor from the target's own.
    assert_eq!(sim.nodes[1].srqs[other].taken, 0);
    assert!(sim.take_cq(1, cq).is_empty());
    assert!(sim.take_cq(1, srqs[0].2).is_empty());

    // A number no SRQ has.
    let (mut sim, ini, _, _) = setup(52, NetConfig::default());
    sim.post_send(ini, to_srq(send(1, vec![]), 0xAB_CDEF));
    sim.run();
    assert_wc(&sim.take_send_cq(ini)[0], 1, WcStatus::RemAccessErr);
}

#[test]
fn an_empty_xrc_srq_rnr_naks_until_a_wqe_is_posted() {
    let (mut sim, ini, tgt, srqs) = setup(61, NetConfig::default());
    let (srq, srqn, cq) = srqs[0];
    sim.post_send(ini, to_srq(send(1, vec![]), srqn));
    sim.run_for(Duration::from_millis(2));
    assert!(sim.qp(ini).engine.counters().rnr_naks_received > 0);
    let buf = sim.mem(1).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    sim.post_srq_recv(1, srq, recv(3, vec![buf.sge(0, 64)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(ini), &[1]);
    let wcs = sim.take_cq(1, cq);
    assert_eq!((wcs.len(), wcs[0].qp_num), (1, tgt.qpn));
}

#[test]
fn the_initiator_needs_a_remote_srqn_and_the_target_sends_nothing() {
    let (sim, ini, tgt, _) = setup(71, NetConfig::default());
    let limits = |t| softverbs_engine::wr::SendLimits {
        qp_type: t,
        max_send_sge: 4,
        max_inline_data: 64,
        max_msg_sz: 1 << 31,
        ud_mtu: 4096,
        max_rd_atomic: 4,
        max_tso_header: 0,
    };
    let w = send(1, vec![]);
    assert!(w.check(&limits(QpType::XrcSend)).is_err(), "no remote_srqn");
    assert!(to_srq(w.clone(), 0x100_0000)
        .check(&limits(QpType::XrcSend))
        .is_err());
    assert!(to_srq(w.clone(), 0xFF_FFFF)
        .check(&limits(QpType::XrcSend))
        .is_ok());
    assert!(to_srq(w, 1).check(&limits(QpType::XrcRecv)).is_err());
    let inline = wr(
        2,
        SendOp::Send {
            imm: None,
            invalidate: None,
        },
        Payload::Inline(vec![1; 8]),
    );
    assert!(to_srq(inline, 1).check(&limits(QpType::XrcSend)).is_ok());
    // ATOMIC WRITE is an RC-only extension: XRC has no opcode for it.
    let aw = wr(
        3,
        SendOp::AtomicWrite {
            remote: softverbs_engine::wr::RemoteAddr { addr: 0, rkey: 1 },
            value: [0; 8],
        },
        Payload::Sges(vec![]),
    );
    assert!(to_srq(aw.clone(), 1).check(&limits(QpType::XrcSend)).is_err());
    assert!(aw.check(&limits(QpType::Rc)).is_ok());
    let _ = (sim, ini, tgt);
    let ids: BTreeSet<u32> = [QpType::XrcSend.raw(), QpType::XrcRecv.raw()].into();
    assert_eq!(ids, [9, 10].into());
}

#[test]
fn several_targets_feed_one_srq_under_loss() {
    for seed in seeds(&[81, 82]) {
        let mut sim = Sim::new(seed, 3).with_net(NetConfig::lossy(8.0));
        let cq = sim.create_cq(2);
        let (srq, srqn) = sim.create_xrc_srq(2, XRCD, 1, cq);
        let o = ConnOpts {
            timeout: 8,
            ..ConnOpts::default()
        };
        // One initiator per node, each with its own target in the same domain.
        let pairs: Vec<(QpId, QpId)> = (0..2)
            .map(|n| {
                let ini = sim.create_qp(n, QpType::XrcSend);
                let tgt = sim.create_xrc_tgt(2, XRCD);
                sim.connect(ini, tgt, &o);
                (ini, tgt)
            })
            .collect();
        let slot = 4096u64;
        let buf = sim.mem(2).alloc_mr(1, 80 * slot, AccessFlags::LOCAL_WRITE);
        for i in 0..80 {
            sim.post_srq_recv(2, srq, recv(i, vec![buf.sge(i * slot, slot as u32)]));
        }
        for (n, &(ini, _)) in pairs.iter().enumerate() {
            let src = sim.mem(n).alloc_mr(1, slot, AccessFlags::empty());
            sim.mem(n).poke(src.addr, &[n as u8 + 1; 4096]);
            for m in 0..30 {
                sim.post_send(ini, to_srq(send(m, vec![src.sge(0, 2000 + m as u32)]), srqn));
            }
        }
        sim.run();
        for &(ini, _) in &pairs {
            assert_ok_in_order(&sim.take_send_cq(ini), &(0..30).collect::<Vec<_>>());
        }
        let wcs = sim.take_cq(2, cq);
        assert_eq!(wcs.len(), 60, "seed {seed}");
        let ids: BTreeSet<u64> = wcs.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, (0..60).collect(), "seed {seed}: each WQE once");
        for (n, &(ini, tgt)) in pairs.iter().enumerate() {
            let mine: Vec<_> = wcs.iter().filter(|w| w.qp_num == tgt.qpn).collect();
            assert_eq!(mine.len(), 30, "seed {seed}");
            // In order per target, from its initiator, with its data.
            let lens: Vec<u32> = mine.iter().map(|w| w.byte_len).collect();
            assert_eq!(lens, (0..30).map(|m| 2000 + m).collect::<Vec<_>>());
            for w in mine {
                assert_eq!(w.src_qp, ini.qpn);
                let got = sim.mem(2).peek(buf.addr + w.wr_id * slot, w.byte_len as usize);
                assert!(got.iter().all(|&b| b == n as u8 + 1), "seed {seed}");
            }
        }
        assert_eq!(sim.nodes[2].srqs[srq].taken, 60);
        assert!(sim.stats.lost > 0);
    }
}
