//! Every RC operation on a clean simulated fabric: data lands byte-exact, completions carry the
//! right fields, and the wire shows the segmentation, AckReq and solicited bits rxe produces.

mod sim;

use sim::*;
use softverbs_engine::types::{AccessFlags, Mtu, QpType, SendFlags, WcFlags, WcOpcode, WcStatus};
use softverbs_engine::wr::{Payload, SendOp};
use softverbs_wire::Opcode;

fn rc(seed: u64) -> (Sim, QpId, QpId) {
    Sim::pair(seed, QpType::Rc, &ConnOpts::default())
}

#[test]
fn send_lands_in_the_posted_receive_with_length_and_source_qp() {
    let (mut sim, a, b) = rc(1);
    let src = sim.mem(0).alloc_mr(1, 3000, AccessFlags::empty());
    let dst = sim.mem(1).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
    let data = sim.rng.bytes(3000);
    sim.mem(0).poke(src.addr, &data);
    sim.post_recv(b, recv(77, vec![dst.sge(0, 4096)]));
    sim.post_send(a, send(1, vec![src.sge(0, 3000)]));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_ok_in_order(&s, &[1]);
    assert_eq!((s[0].opcode, s[0].byte_len), (WcOpcode::Send, 3000));
    let r = sim.take_recv_cq(b);
    assert_ok_in_order(&r, &[77]);
    assert_eq!(r[0].opcode, WcOpcode::Recv);
    assert_eq!(r[0].byte_len, 3000);
    assert_eq!(r[0].src_qp, a.qpn);
    assert_eq!(r[0].qp_num, b.qpn);
    assert!(!r[0].wc_flags.contains(WcFlags::WITH_IMM));
    assert_eq!(sim.mem(1).peek(dst.addr, 3000), data);
}

#[test]
fn send_with_immediate_carries_it_in_network_order() {
    let (mut sim, a, b) = rc(2);
    let src = sim.mem(0).alloc_mr(1, 100, AccessFlags::empty());
    let dst = sim.mem(1).alloc_mr(1, 100, AccessFlags::LOCAL_WRITE);
    sim.mem(0).poke(src.addr, &[7; 100]);
    sim.post_recv(b, recv(5, vec![dst.sge(0, 100)]));
    // imm_data is opaque: whatever bytes the sender has in memory arrive unchanged.
    let imm = u32::from_ne_bytes([0xDE, 0xAD, 0xBE, 0xEF]);
    let wr = wr(
        1,
        SendOp::Send {
            imm: Some(imm),
            invalidate: None,
        },
        Payload::Sges(vec![src.sge(0, 100)]),
    );
    sim.post_send(a, wr);
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1]);
    let r = sim.take_recv_cq(b);
    assert_ok_in_order(&r, &[5]);
    assert!(r[0].wc_flags.contains(WcFlags::WITH_IMM));
    assert_eq!(r[0].imm_data, imm);
    assert_eq!(r[0].byte_len, 100);
    assert_eq!(sim.mem(1).peek(dst.addr, 100), vec![7; 100]);
}

#[test]
fn send_with_invalidate_reports_the_rkey() {
    let (mut sim, a, b) = rc(3);
    let src = sim.mem(0).alloc_mr(1, 64, AccessFlags::empty());
    let dst = sim.mem(1).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    let target = sim
        .mem(1)
        .alloc_mr(1, 64, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND);
    let mw = sim.mem(1).alloc_mw(1, softverbs_engine::mw::MwType::Type2);
    let bind = softverbs_engine::mw::MwBind {
        mw_rkey: mw,
        new_rkey: mw | 0x42,
        mr_lkey: target.lkey,
        addr: target.addr,
        length: 64,
        access: AccessFlags::REMOTE_READ,
    };
    sim.post_send(b, bind_mw(9, bind));
    sim.post_recv(b, recv(5, vec![dst.sge(0, 64)]));
    let wr = wr(
        1,
        SendOp::Send {
            imm: None,
            invalidate: Some(mw | 0x42),
        },
        Payload::Sges(vec![src.sge(0, 64)]),
    );
    sim.post_send(a, wr);
    sim.run();
    let s = sim.take_send_cq(a);
    assert_ok_in_order(&s, &[1]);
    assert_eq!(s[0].opcode, WcOpcode::Send);
    let r = sim.take_recv_cq(b);
    assert_ok_in_order(&r, &[5]);
    assert!(r[0].wc_flags.contains(WcFlags::WITH_INV));
    assert_eq!(r[0].imm_data, mw | 0x42, "invalidated_rkey");
    assert!(sim.mem(1).window(mw).target.is_none());
}

#[test]
fn write_places_bytes_without_consuming_a_receive() {
    let (mut sim, a, b) = rc(4);
    let src = sim.mem(0).alloc_mr(1, 10_000, AccessFlags::empty());
    let dst = sim.mem(1).alloc_mr(1, 20_000, all_access());
    let data = sim.rng.bytes(10_000);
    sim.mem(0).poke(src.addr, &data);
    sim.post_recv(b, recv(9, vec![dst.sge(0, 16)]));
    sim.post_send(a, write(1, dst.remote(5000), vec![src.sge(0, 10_000)]));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_ok_in_order(&s, &[1]);
    assert_eq!((s[0].opcode, s[0].byte_len), (WcOpcode::RdmaWrite, 10_000));
    assert!(sim.take_recv_cq(b).is_empty());
    assert_eq!(sim.qp(b).engine.recv_queue_len(), 1);
    assert_eq!(sim.mem(1).peek(dst.addr + 5000, 10_000), data);
    assert_eq!(
        sim.mem(1).peek(dst.addr, 5000),
        vec![0; 5000],
        "nothing written before the target"
    );
}

#[test]
fn write_with_immediate_completes_a_receive_with_the_total_length() {
    let (mut sim, a, b) = rc(5);
    let src = sim.mem(0).alloc_mr(1, 5000, AccessFlags::empty());
    let dst = sim.mem(1).alloc_mr(1, 5000, all_access());
    let data = sim.rng.bytes(5000);
    sim.mem(0).poke(src.addr, &data);
    sim.post_recv(b, recv(9, vec![]));
    let imm = 0xA1B2_C3D4u32.to_be();
    sim.post_send(
        a,
        wr(
            1,
            SendOp::Write {
                remote: dst.remote(0),
                imm: Some(imm),
            },
            Payload::Sges(vec![src.sge(0, 5000)]),
        ),
    );
    sim.run();
    let s = sim.take_send_cq(a);
    assert_ok_in_order(&s, &[1]);
    assert_eq!(s[0].opcode, WcOpcode::RdmaWrite);
    let r = sim.take_recv_cq(b);
    assert_ok_in_order(&r, &[9]);
    assert_eq!(r[0].opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!(r[0].byte_len, 5000);
    assert_eq!(r[0].imm_data, imm);
    assert!(r[0].wc_flags.contains(WcFlags::WITH_IMM));
    assert_eq!(sim.mem(1).peek(dst.addr, 5000), data);
}

#[test]
fn read_fetches_remote_bytes() {
    let (mut sim, a, b) = rc(6);
    let local = sim.mem(0).alloc_mr(1, 9000, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 9000, all_access());
    let data = sim.rng.bytes(9000);
    sim.mem(1).poke(remote.addr, &data);
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 9000)]));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_ok_in_order(&s, &[1]);
    assert_eq!((s[0].opcode, s[0].byte_len), (WcOpcode::RdmaRead, 9000));
    assert_eq!(sim.mem(0).peek(local.addr, 9000), data);
    assert!(sim.take_recv_cq(b).is_empty());
}

#[test]
fn compare_swap_and_fetch_add_return_the_original_value() {
    let (mut sim, a, _b) = rc(7);
    let local = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 64, all_access());
    sim.mem(1).poke_u64(remote.addr, 100);
    sim.mem(1).poke_u64(remote.addr + 8, 5);
    // Succeeds: 100 == 100.
    sim.post_send(a, cmp_swp(1, remote.remote(0), 100, 200, local.sge(0, 8)));
    // Fails: 200 != 100, memory unchanged.
    sim.post_send(a, cmp_swp(2, remote.remote(0), 100, 300, local.sge(8, 8)));
    sim.post_send(a, fetch_add(3, remote.remote(8), 10, local.sge(16, 8)));
    sim.post_send(a, fetch_add(4, remote.remote(8), u64::MAX, local.sge(24, 8)));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_ok_in_order(&s, &[1, 2, 3, 4]);
    assert_eq!(
        s.iter().map(|w| (w.opcode, w.byte_len)).collect::<Vec<_>>(),
        vec![
            (WcOpcode::CompSwap, 8),
            (WcOpcode::CompSwap, 8),
            (WcOpcode::FetchAdd, 8),
            (WcOpcode::FetchAdd, 8)
        ]
    );
    assert_eq!(sim.mem(0).peek_u64(local.addr), 100);
    assert_eq!(sim.mem(0).peek_u64(local.addr + 8), 200);
    assert_eq!(sim.mem(0).peek_u64(local.addr + 16), 5);
    assert_eq!(sim.mem(0).peek_u64(local.addr + 24), 15);
    assert_eq!(sim.mem(1).peek_u64(remote.addr), 200);
    assert_eq!(sim.mem(1).peek_u64(remote.addr + 8), 14, "5 + 10 - 1 (wrapping)");
    assert_eq!(sim.mem(1).atomics.get(), 4);
}

#[test]
fn inline_send_and_write_need_no_key() {
    let (mut sim, a, b) = rc(8);
    let dst = sim.mem(1).alloc_mr(1, 512, all_access());
    sim.post_recv(b, recv(1, vec![dst.sge(0, 256)]));
    let mut s = wr(
        10,
        SendOp::Send {
            imm: None,
            invalidate: None,
        },
        Payload::Inline(b"inline send".to_vec()),
    );
    s.flags |= SendFlags::INLINE;
    sim.post_send(a, s);
    let mut w = wr(
        11,
        SendOp::Write {
            remote: dst.remote(300),
            imm: None,
        },
        Payload::Inline(vec![0x5A; 200]),
    );
    w.flags |= SendFlags::INLINE;
    sim.post_send(a, w);
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[10, 11]);
    assert_eq!(sim.take_recv_cq(b)[0].byte_len, 11);
    assert_eq!(sim.mem(1).peek(dst.addr, 11), b"inline send");
    assert_eq!(sim.mem(1).peek(dst.addr + 300, 200), vec![0x5A; 200]);
    assert!(sim.mem(0).refused.borrow().is_empty());
}

#[test]
fn multi_sge_gather_and_scatter_cross_packet_boundaries() {
    let (mut sim, a, b) = rc(9);
    let src = sim.mem(0).alloc_mr(1, 8192, AccessFlags::LOCAL_WRITE);
    let dst = sim.mem(1).alloc_mr(1, 16384, all_access());
    let data = sim.rng.bytes(8192);
    sim.mem(0).poke(src.addr, &data);
    // Gather 3000 bytes from three pieces out of order; scatter into four uneven pieces.
    let gather = vec![src.sge(5000, 1000), src.sge(0, 1500), src.sge(7000, 500)];
    let expect: Vec<u8> = [&data[5000..6000], &data[0..1500], &data[7000..7500]].concat();
    let scatter = vec![
        dst.sge(100, 700),
        dst.sge(4000, 1),
        dst.sge(2000, 1299),
        dst.sge(6000, 2000),
    ];
    sim.post_recv(b, recv(1, scatter));
    sim.post_send(a, send(2, gather.clone()));
    // And the same gather list as an RDMA WRITE, plus a READ scattered into several pieces.
    sim.post_send(a, write(3, dst.remote(9000), gather));
    sim.post_send(
        a,
        read(4, dst.remote(9000), vec![src.sge(100, 1000), src.sge(3000, 2000)]),
    );
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[2, 3, 4]);
    assert_eq!(sim.take_recv_cq(b)[0].byte_len, 3000);
    let m = sim.mem(1);
    let got = [
        m.peek(dst.addr + 100, 700),
        m.peek(dst.addr + 4000, 1),
        m.peek(dst.addr + 2000, 1299),
        m.peek(dst.addr + 6000, 1000),
    ]
    .concat();
    assert_eq!(got, expect);
    assert_eq!(sim.mem(1).peek(dst.addr + 9000, 3000), expect);
    let read_back = [
        sim.mem(0).peek(src.addr + 100, 1000),
        sim.mem(0).peek(src.addr + 3000, 2000),
    ]
    .concat();
    assert_eq!(read_back, expect);
}

#[test]
fn unsignaled_wrs_complete_silently_unless_sq_sig_all() {
    for sig_all in [false, true] {
        let mut sim = Sim::new(10, 2);
        let a = sim.create_qp_with(
            0,
            QpType::Rc,
            QpOpts {
                sq_sig_all: sig_all,
                ..QpOpts::default()
            },
        );
        let b = sim.create_qp(1, QpType::Rc);
        sim.connect(a, b, &ConnOpts::default());
        let src = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
        let dst = sim.mem(1).alloc_mr(1, 64, all_access());
        for i in 0..6 {
            let mut w = write(i, dst.remote(0), vec![src.sge(0, 8)]);
            if i % 3 != 2 {
                w.flags.remove(SendFlags::SIGNALED);
            }
            sim.post_send(a, w);
        }
        sim.run();
        let ids: Vec<u64> = sim.take_send_cq(a).iter().map(|w| w.wr_id).collect();
        if sig_all {
            assert_eq!(ids, vec![0, 1, 2, 3, 4, 5]);
        } else {
            assert_eq!(ids, vec![2, 5]);
        }
        assert_eq!(
            sim.qp(a).engine.send_queue_len(),
            0,
            "unsignaled WQEs are retired too"
        );
    }
}

#[test]
fn fence_waits_for_earlier_reads() {
    let (mut sim, a, _b) = rc(11);
    sim.record();
    let local = sim.mem(0).alloc_mr(1, 8192, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 8192, all_access());
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 4096)]));
    let mut w = write(2, remote.remote(4096), vec![local.sge(0, 16)]);
    w.flags |= SendFlags::FENCE;
    sim.post_send(a, w);
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
    let log = sim.log.take().unwrap();
    let pos = |pred: &dyn Fn(&PacketInfo) -> bool| log.iter().position(pred).unwrap();
    let last_read_resp = log
        .iter()
        .rposition(|p| p.opcode == Opcode::RcReadResponseLast)
        .unwrap();
    let write_req = pos(&|p| p.opcode == Opcode::RcWriteOnly);
    assert!(
        write_req > last_read_resp,
        "a fenced WRITE leaves only after the READ completed"
    );

    // Without the fence it goes out right behind the READ request.
    let (mut sim, a, _b) = rc(11);
    sim.record();
    let local = sim.mem(0).alloc_mr(1, 8192, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 8192, all_access());
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 4096)]));
    sim.post_send(a, write(2, remote.remote(4096), vec![local.sge(0, 16)]));
    sim.run();
    let log = sim.log.take().unwrap();
    let write_req = log.iter().position(|p| p.opcode == Opcode::RcWriteOnly).unwrap();
    let first_resp = log
        .iter()
        .position(|p| p.opcode.is_read() && p.opcode.is_response())
        .unwrap();
    assert!(write_req < first_resp);
}

#[test]
fn solicited_bit_reaches_the_receive_completion() {
    let (mut sim, a, b) = rc(12);
    sim.record();
    let src = sim.mem(0).alloc_mr(1, 4096, AccessFlags::empty());
    let dst = sim.mem(1).alloc_mr(1, 8192, all_access());
    for i in 0..3 {
        sim.post_recv(b, recv(i, vec![dst.sge(i * 2048, 2048)]));
    }
    let mut s = send(1, vec![src.sge(0, 2000)]);
    s.flags |= SendFlags::SOLICITED;
    sim.post_send(a, s);
    sim.post_send(a, send(2, vec![src.sge(0, 10)]));
    let mut w = wr(
        3,
        SendOp::Write {
            remote: dst.remote(6144),
            imm: Some(1),
        },
        Payload::Sges(vec![src.sge(0, 10)]),
    );
    w.flags |= SendFlags::SOLICITED;
    sim.post_send(a, w);
    sim.run();
    let r = sim.take_recv_cq(b);
    assert_eq!(
        r.iter().map(|w| (w.wr_id, w.solicited)).collect::<Vec<_>>(),
        vec![(0, true), (1, false), (2, true)]
    );
    assert!(r[0].is_solicited() && !r[1].is_solicited());
    // SE only on the last packet of a message.
    let log = sim.log.take().unwrap();
    let se: Vec<(Opcode, bool)> = log
        .iter()
        .filter(|p| p.from == a)
        .map(|p| (p.opcode, p.solicited))
        .collect();
    assert_eq!(
        se,
        vec![
            (Opcode::RcSendFirst, false),
            (Opcode::RcSendLast, true),
            (Opcode::RcSendOnly, false),
            (Opcode::RcWriteOnlyWithImm, true)
        ]
    );
    assert!(sim.take_send_cq(a).iter().all(|w| !w.solicited));
}

#[test]
fn messages_are_segmented_at_the_path_mtu_with_ackreq_on_the_first_every_32nd_and_the_last() {
    for mtu in [Mtu::Mtu256, Mtu::Mtu1024, Mtu::Mtu4096] {
        let o = ConnOpts {
            mtu,
            ..ConnOpts::default()
        };
        let (mut sim, a, b) = Sim::pair(13, QpType::Rc, &o);
        sim.record();
        let m = mtu.bytes() as usize;
        let len = m * 100 + 17;
        let src = sim.mem(0).alloc_mr(1, len as u64, AccessFlags::empty());
        let dst = sim.mem(1).alloc_mr(1, len as u64, all_access());
        let data = sim.rng.bytes(len);
        sim.mem(0).poke(src.addr, &data);
        sim.post_send(a, write(1, dst.remote(0), vec![src.sge(0, len as u32)]));
        sim.run();
        assert_ok_in_order(&sim.take_send_cq(a), &[1]);
        assert_eq!(sim.mem(1).peek(dst.addr, len), data);
        let reqs: Vec<PacketInfo> = sim
            .log
            .take()
            .unwrap()
            .into_iter()
            .filter(|p| p.from == a)
            .collect();
        assert_eq!(reqs.len(), 101);
        assert_eq!(reqs[0].opcode, Opcode::RcWriteFirst);
        assert!(reqs[1..100]
            .iter()
            .all(|p| p.opcode == Opcode::RcWriteMiddle && p.payload_len == m));
        assert_eq!(
            (reqs[100].opcode, reqs[100].payload_len),
            (Opcode::RcWriteLast, 17)
        );
        assert_eq!(reqs[0].payload_len, m);
        for (i, p) in reqs.iter().enumerate() {
            assert_eq!(p.psn.value(), 0x1000 + i as u32);
            // The first packet of a new QP asks for an acknowledgement to time the round
            // trip; then every quarter of the 128-PSN window, and the last.
            assert_eq!(p.ack_req, i % 32 == 0 || i == 100, "AckReq on packet {i}");
        }
        let _ = b;
    }
}

#[test]
fn zero_length_send_write_and_read_complete() {
    let (mut sim, a, b) = rc(14);
    let local = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 64, all_access());
    sim.post_recv(b, recv(1, vec![remote.sge(0, 64)]));
    sim.post_recv(b, recv(2, vec![]));
    sim.post_recv(b, recv(3, vec![remote.sge(0, 0)]));
    sim.post_send(a, send(10, vec![]));
    // Zero-length WRITE and READ check neither the R_Key nor the address (IBTA C9-88).
    let bogus = softverbs_engine::wr::RemoteAddr {
        addr: 0xdead_0000,
        rkey: 0xbad,
    };
    sim.post_send(a, write(11, bogus, vec![]));
    sim.post_send(a, read(12, bogus, vec![]));
    sim.post_send(
        a,
        wr(
            13,
            SendOp::Write {
                remote: bogus,
                imm: Some(9),
            },
            Payload::Sges(vec![local.sge(0, 0)]),
        ),
    );
    sim.post_send(a, send(14, vec![local.sge(0, 0)]));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_ok_in_order(&s, &[10, 11, 12, 13, 14]);
    assert!(s.iter().all(|w| w.byte_len == 0));
    let r = sim.take_recv_cq(b);
    assert_eq!(
        r.iter()
            .map(|w| (w.wr_id, w.status, w.byte_len, w.opcode))
            .collect::<Vec<_>>(),
        vec![
            (1, WcStatus::Success, 0, WcOpcode::Recv),
            (2, WcStatus::Success, 0, WcOpcode::RecvRdmaWithImm),
            (3, WcStatus::Success, 0, WcOpcode::Recv),
        ]
    );
    assert!(sim.mem(1).refused.borrow().is_empty(), "no key was checked");
}

#[test]
fn psn_wraps_around_24_bits() {
    let o = ConnOpts {
        psn_a: 0xFF_FFF0,
        psn_b: 0xFF_FFFE,
        mtu: Mtu::Mtu256,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(15, QpType::Rc, &o);
    sim.record();
    let amr = sim.mem(0).alloc_mr(1, 65536, all_access());
    let bmr = sim.mem(1).alloc_mr(1, 65536, all_access());
    let data = sim.rng.bytes(8192);
    sim.mem(0).poke(amr.addr, &data);
    sim.mem(1).poke(bmr.addr + 16384, &data);
    // A 32-packet WRITE and a 32-packet READ, each crossing 0xFFFFFF -> 0, and traffic the other way.
    sim.post_send(a, write(1, bmr.remote(0), vec![amr.sge(0, 8192)]));
    sim.post_send(a, read(2, bmr.remote(16384), vec![amr.sge(16384, 8192)]));
    sim.post_send(a, fetch_add(3, bmr.remote(32768), 1, amr.sge(32768, 8)));
    for i in 0..4 {
        sim.post_recv(a, recv(i, vec![amr.sge(40000 + i * 1024, 1024)]));
        sim.post_send(b, send(100 + i, vec![bmr.sge(i * 1000, 1000)]));
    }
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2, 3]);
    assert_ok_in_order(&sim.take_send_cq(b), &[100, 101, 102, 103]);
    assert_eq!(sim.take_recv_cq(a).len(), 4);
    assert_eq!(sim.mem(1).peek(bmr.addr, 8192), data);
    assert_eq!(sim.mem(0).peek(amr.addr + 16384, 8192), data);
    assert_eq!(sim.mem(1).peek_u64(bmr.addr + 32768), 1);
    let log = sim.log.take().unwrap();
    assert!(log.iter().any(|p| p.psn.value() == 0xFF_FFFF) && log.iter().any(|p| p.psn.value() == 0));
    assert_eq!(sim.qp(a).engine.counters().retransmits, 0);
}

#[test]
fn many_qps_share_the_fabric() {
    let mut sim = Sim::new(16, 4);
    let o = ConnOpts::default();
    let mut pairs = Vec::new();
    for i in 0..24 {
        let (na, nb) = (i % 4, (i + 1 + i / 4) % 4);
        let nb = if nb == na { (nb + 1) % 4 } else { nb };
        let a = sim.create_qp(na, QpType::Rc);
        let b = sim.create_qp(nb, QpType::Rc);
        sim.connect(a, b, &o);
        let src = sim.mem(na).alloc_mr(1, 20_000, all_access());
        let dst = sim.mem(nb).alloc_mr(1, 20_000, all_access());
        let data = sim.rng.bytes(20_000);
        sim.mem(na).poke(src.addr, &data);
        pairs.push((a, b, src, dst, data));
    }
    for (i, (a, b, src, dst, _)) in pairs.iter().enumerate() {
        let i = i as u64;
        sim.post_recv(*b, recv(i, vec![dst.sge(10_000, 10_000)]));
        sim.post_send(*a, write(i, dst.remote(0), vec![src.sge(0, 10_000)]));
        sim.post_send(*a, send(1000 + i, vec![src.sge(10_000, 10_000)]));
    }
    sim.run();
    for (i, (a, b, _src, dst, data)) in pairs.iter().enumerate() {
        let i = i as u64;
        assert_ok_in_order(&sim.take_send_cq(*a), &[i, 1000 + i]);
        assert_ok_in_order(&sim.take_recv_cq(*b), &[i]);
        assert_eq!(&sim.mem(b.node).peek(dst.addr, 20_000), data);
    }
}

#[test]
fn works_over_ipv6_gids() {
    let mut sim = Sim::new_ipv6(17, 2);
    let a = sim.create_qp(0, QpType::Rc);
    let b = sim.create_qp(1, QpType::Rc);
    sim.connect(a, b, &ConnOpts::default());
    let src = sim.mem(0).alloc_mr(1, 5000, all_access());
    let dst = sim.mem(1).alloc_mr(1, 5000, all_access());
    let data = sim.rng.bytes(5000);
    sim.mem(0).poke(src.addr, &data);
    sim.post_send(a, write(1, dst.remote(0), vec![src.sge(0, 5000)]));
    sim.post_send(a, read(2, dst.remote(0), vec![src.sge(0, 5000)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
    assert_eq!(sim.mem(1).peek(dst.addr, 5000), data);
    assert_eq!(sim.stats.bad_icrc, 0);
}

#[test]
fn first_packet_in_rtr_raises_communication_established() {
    let mut sim = Sim::new(18, 2);
    let a = sim.create_qp(0, QpType::Rc);
    let b = sim.create_qp(1, QpType::Rc);
    let o = ConnOpts::default();
    sim.bring_up(a, b, &o, o.psn_a, o.psn_b);
    // b only reaches RTR.
    use softverbs_engine::types::{QpAttr, QpAttrMask as M, QpState};
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: o.access,
        ..QpAttr::default()
    };
    sim.modify(b, &init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS);
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: o.mtu,
        dest_qp_num: a.qpn,
        rq_psn: o.psn_a,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 1,
        ah_attr: sim.ah_to(0),
        ..QpAttr::default()
    };
    sim.modify(
        b,
        &rtr,
        M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
    );
    let dst = sim.mem(1).alloc_mr(1, 64, all_access());
    sim.post_recv(b, recv(1, vec![dst.sge(0, 64)]));
    sim.post_send(a, send(1, vec![]));
    sim.post_send(a, send(2, vec![]));
    sim.post_recv(b, recv(2, vec![dst.sge(0, 64)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
    assert_eq!(
        sim.take_events(b),
        vec![softverbs_engine::types::EventType::CommEst]
    );
}
