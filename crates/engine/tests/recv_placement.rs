//! Per-message receive placement ([`RecvPlacement`], what a tag-matching SRQ chooses at a
//! message's first packet) and work the driver posts for itself ([`QpEngine::post_internal`]),
//! on the simulated fabric, also under loss: skipped headers never land, a match spanning
//! packets is reported exactly once before its data, a message that lands nowhere hands its end
//! back to the driver, and an internal READ completes to the driver, never to the send CQ.
//!
//! [`QpEngine::post_internal`]: softverbs_engine::transport::QpEngine::post_internal

mod sim;

use std::collections::VecDeque;
use std::time::Duration;

use sim::*;
use softverbs_engine::tm::TmInfo;
use softverbs_engine::transport::{RecvPlacement, WorkQueue};
use softverbs_engine::types::{AccessFlags, Mtu, QpType, RecvWr, WcFlags, WcOpcode, WcStatus};
use softverbs_engine::wr::SendOp;

const HDR: usize = 16;

/// Like a tag-matching SRQ matching an eager message: skip a 16-byte header; report the match
/// early when the message spans packets. A first byte of 0xFF means "land nowhere, tell me".
fn tagged(first: &[u8], only: bool, queue: &mut VecDeque<RecvWr>) -> Option<RecvPlacement> {
    let mut p = RecvPlacement::plain(queue.pop_front()?);
    p.opcode = WcOpcode::TmRecv;
    p.tm_info = TmInfo {
        tag: u64::from(first[1]),
        priv_data: 0,
    };
    if first[0] == 0xFF {
        p.limit = Some(0);
        p.queue = WorkQueue::Internal;
        return Some(p);
    }
    p.skip = HDR as u64;
    if only {
        p.flags = WcFlags::TM_MATCH | WcFlags::TM_DATA_VALID;
    } else {
        p.early_flags = Some(WcFlags::TM_MATCH);
        p.flags = WcFlags::TM_DATA_VALID;
    }
    Some(p)
}

fn setup(seed: u64, net: NetConfig) -> (Sim, QpId, QpId, usize, usize) {
    let mut sim = Sim::new(seed, 2).with_net(net);
    let srq = sim.create_srq(1);
    sim.nodes[1].srqs[srq].placer = Some(tagged);
    let cq = sim.create_cq(1);
    let a = sim.create_qp(0, QpType::Rc);
    let b = sim.create_qp_with(
        1,
        QpType::Rc,
        QpOpts {
            srq: Some(srq),
            recv_cq: Some(cq),
            ..QpOpts::default()
        },
    );
    let o = ConnOpts {
        mtu: Mtu::Mtu1024,
        timeout: 8,
        ..ConnOpts::default()
    };
    sim.connect(a, b, &o);
    (sim, a, b, srq, cq)
}

#[test]
fn headers_are_skipped_and_a_spanning_match_is_reported_once_under_loss() {
    for seed in seeds(&[1, 2, 3, 4]) {
        let (mut sim, a, _b, srq, cq) = setup(seed, NetConfig::lossy(5.0));
        let slot = 16_384u64;
        let lens = [HDR + 100, HDR + 1008, HDR + 3000, HDR + 10_000];
        let dst = sim
            .mem(1)
            .alloc_mr(1, slot * lens.len() as u64, AccessFlags::LOCAL_WRITE);
        for i in 0..lens.len() as u64 {
            sim.post_srq_recv(1, srq, recv(i, vec![dst.sge(i * slot, slot as u32)]));
        }
        let src = sim
            .mem(0)
            .alloc_mr(1, slot * lens.len() as u64, AccessFlags::empty());
        let mut datas = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            let mut data = sim.rng.bytes(len);
            data[0] = 3;
            data[1] = i as u8;
            sim.mem(0).poke(src.addr + i as u64 * slot, &data);
            sim.post_send(a, send(i as u64, vec![src.sge(i as u64 * slot, len as u32)]));
            datas.push(data);
        }
        sim.run();
        let wcs = sim.take_cq(1, cq);
        let mut expect = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            // Packets of at most 1024 bytes: only the first message is one packet.
            if len > 1024 {
                expect.push((i as u64, WcFlags::TM_MATCH, 0));
                expect.push((i as u64, WcFlags::TM_DATA_VALID, len - HDR));
            } else {
                expect.push((i as u64, WcFlags::TM_MATCH | WcFlags::TM_DATA_VALID, len - HDR));
            }
        }
        let got: Vec<_> = wcs
            .iter()
            .map(|w| (w.wr_id, w.wc_flags, w.byte_len as usize))
            .collect();
        assert_eq!(got, expect, "seed {seed}");
        assert!(wcs
            .iter()
            .all(|w| w.status == WcStatus::Success && w.opcode == WcOpcode::TmRecv));
        assert!(wcs.iter().all(|w| w.tm_info.tag == w.wr_id), "seed {seed}");
        for (i, data) in datas.iter().enumerate() {
            let landed = sim.mem(1).peek(dst.addr + i as u64 * slot, data.len() - HDR);
            assert_eq!(landed, data[HDR..], "seed {seed}: message {i} without its header");
        }
    }
}

#[test]
fn a_message_that_lands_nowhere_hands_its_end_back() {
    let (mut sim, a, b, srq, cq) = setup(7, NetConfig::default());
    let dst = sim.mem(1).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
    sim.post_srq_recv(1, srq, recv(9, vec![dst.sge(0, 4096)]));
    let src = sim.mem(0).alloc_mr(1, 4096, AccessFlags::empty());
    let mut data = vec![0xAB; 3000];
    data[0] = 0xFF;
    data[1] = 5;
    sim.mem(0).poke(src.addr, &data);
    sim.post_send(a, send(1, vec![src.sge(0, 3000)]));
    sim.run();
    assert!(sim.take_cq(1, cq).is_empty(), "nothing on the receive CQ");
    let back = std::mem::take(&mut sim.qp_mut(b).internal);
    assert_eq!(back.len(), 1);
    assert_eq!(
        (back[0].wr_id, back[0].status, back[0].byte_len),
        (9, WcStatus::Success, 0)
    );
    assert_eq!(back[0].tm_info.tag, 5);
    assert_eq!(sim.mem(1).peek(dst.addr, 3000), vec![0; 3000], "no byte placed");
    // The sender sees an ordinary successful SEND.
    assert_eq!(sim.take_send_cq(a)[0].status, WcStatus::Success);
}

#[test]
fn internal_reads_complete_to_the_driver_only() {
    for seed in seeds(&[11, 12]) {
        let (mut sim, a, b, _srq, _cq) = setup(seed, NetConfig::lossy(3.0));
        let len = 50_000u64;
        let src = sim.mem(0).alloc_mr(1, len, AccessFlags::REMOTE_READ);
        let data = sim.rng.bytes(len as usize);
        sim.mem(0).poke(src.addr, &data);
        let dst = sim.mem(1).alloc_mr(1, len, AccessFlags::LOCAL_WRITE);
        let mut read = send(42, vec![dst.sge(0, len as u32)]);
        read.op = SendOp::Read {
            remote: src.remote(0),
        };
        // Unsignaled, yet it completes: the driver needs to know.
        read.flags = softverbs_engine::types::SendFlags::empty();
        sim.post_internal(b, read);
        assert_eq!(
            sim.qp(b).engine.send_queue_len(),
            0,
            "takes no slot of the application's queue"
        );
        assert_eq!(sim.qp(b).engine.internal_queue_len(), 1);
        sim.run_for(Duration::from_secs(30));
        let back = std::mem::take(&mut sim.qp_mut(b).internal);
        assert_eq!(back.len(), 1, "seed {seed}");
        assert_eq!(
            (back[0].wr_id, back[0].status, back[0].opcode),
            (42, WcStatus::Success, WcOpcode::RdmaRead)
        );
        assert!(
            sim.take_send_cq(b).is_empty(),
            "seed {seed}: nothing on the send CQ"
        );
        assert_eq!(sim.mem(1).peek(dst.addr, len as usize), data, "seed {seed}");
        assert_eq!(sim.qp(b).engine.internal_queue_len(), 0);
        let _ = a;
    }
}
