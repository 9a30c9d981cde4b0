//! UD: SEND (with immediate) with the 40-byte GRH area, the source QP and `IBV_WC_GRH`;
//! Q_Key checks; multicast to several QPs; no receive or a short buffer.

mod sim;

use std::net::IpAddr;

use sim::*;
use softverbs_engine::transport::DropReason;
use softverbs_engine::types::{AccessFlags, QpState, QpType, WcFlags, WcOpcode, WcStatus};
use softverbs_engine::wr::{Payload, SendOp, SendWr};
use softverbs_wire::Opcode;

const QKEY: u32 = 0x1111_2222;

fn ud_send(wr_id: u64, sim: &Sim, to: QpId, qkey: u32, payload: Payload, imm: Option<u32>) -> SendWr {
    let mut w = wr(
        wr_id,
        SendOp::Send {
            imm,
            invalidate: None,
        },
        payload,
    );
    w.ud = Some(sim.ud_dest(to, qkey));
    w
}

fn ud_pair(sim: &mut Sim) -> (QpId, QpId) {
    let a = sim.create_qp(0, QpType::Ud);
    let b = sim.create_qp(1, QpType::Ud);
    sim.ud_up(a, QKEY);
    sim.ud_up(b, QKEY);
    (a, b)
}

#[test]
fn send_lands_after_a_40_byte_ipv4_header_area() {
    let mut sim = Sim::new(1, 2);
    sim.record();
    let (a, b) = ud_pair(&mut sim);
    let src = sim.mem(0).alloc_mr(1, 2048, AccessFlags::empty());
    let dst = sim.mem(1).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
    let data = sim.rng.bytes(2048);
    sim.mem(0).poke(src.addr, &data);
    sim.post_recv(b, recv(1, vec![dst.sge(0, 40), dst.sge(1000, 3000)]));
    sim.post_recv(b, recv(2, vec![dst.sge(0, 2000)]));
    sim.post_send(
        a,
        ud_send(10, &sim, b, QKEY, Payload::Sges(vec![src.sge(0, 2048)]), None),
    );
    sim.post_send(
        a,
        ud_send(
            11,
            &sim,
            b,
            QKEY,
            Payload::Inline(b"hello".to_vec()),
            Some(0xAABB_CCDD),
        ),
    );
    sim.run();
    let s = sim.take_send_cq(a);
    assert_ok_in_order(&s, &[10, 11]);
    assert!(s.iter().all(|w| w.opcode == WcOpcode::Send));
    let r = sim.take_recv_cq(b);
    assert_ok_in_order(&r, &[1, 2]);
    assert_eq!(r[0].byte_len, 40 + 2048);
    assert_eq!(r[0].src_qp, a.qpn);
    assert_eq!(r[0].wc_flags, WcFlags::GRH);
    assert_eq!(r[1].byte_len, 45);
    assert_eq!(r[1].wc_flags, WcFlags::GRH | WcFlags::WITH_IMM);
    assert_eq!(r[1].imm_data, 0xAABB_CCDD);
    assert_eq!(sim.mem(1).peek(dst.addr + 1000, 2048), data);
    assert_eq!(sim.mem(1).peek(dst.addr + 40, 5), b"hello");
    // IPv4: 20 undefined (zero) bytes, then the IPv4 header with the addresses.
    let grh = sim.mem(1).peek(dst.addr, 40);
    assert_eq!(&grh[..20], &[0; 20]);
    assert_eq!(grh[20], 0x45);
    assert_eq!(grh[29], 17, "protocol UDP");
    let (IpAddr::V4(sa), IpAddr::V4(da)) = (sim.nodes[0].gid.to_ip(), sim.nodes[1].gid.to_ip()) else {
        panic!()
    };
    assert_eq!(&grh[32..36], &sa.octets());
    assert_eq!(&grh[36..40], &da.octets());
    let log = sim.log.take().unwrap();
    assert!(log
        .iter()
        .all(|p| matches!(p.opcode, Opcode::UdSendOnly | Opcode::UdSendOnlyWithImm) && !p.ack_req));
}

#[test]
fn ipv6_grh_area_is_the_whole_ipv6_header() {
    let mut sim = Sim::new_ipv6(2, 2);
    let (a, b) = ud_pair(&mut sim);
    let dst = sim.mem(1).alloc_mr(1, 256, AccessFlags::LOCAL_WRITE);
    sim.post_recv(b, recv(1, vec![dst.sge(0, 256)]));
    sim.post_send(a, ud_send(1, &sim, b, QKEY, Payload::Inline(vec![9; 100]), None));
    sim.run();
    let r = sim.take_recv_cq(b);
    assert_ok_in_order(&r, &[1]);
    let grh = sim.mem(1).peek(dst.addr, 40);
    assert_eq!(grh[0] >> 4, 6);
    assert_eq!(grh[6], 17);
    assert_eq!(&grh[8..24], &sim.nodes[0].gid.0);
    assert_eq!(&grh[24..40], &sim.nodes[1].gid.0);
    assert_eq!(sim.mem(1).peek(dst.addr + 40, 100), vec![9; 100]);
}

#[test]
fn qkey_mismatch_is_dropped_and_counted() {
    let mut sim = Sim::new(3, 2);
    let (a, b) = ud_pair(&mut sim);
    let dst = sim.mem(1).alloc_mr(1, 256, AccessFlags::LOCAL_WRITE);
    sim.post_recv(b, recv(1, vec![dst.sge(0, 256)]));
    sim.post_send(
        a,
        ud_send(1, &sim, b, QKEY + 1, Payload::Inline(vec![1; 8]), None),
    );
    // A WR Q_Key with the high bit set means "the QP's own Q_Key", which matches.
    sim.post_send(
        a,
        ud_send(2, &sim, b, 0x8000_0000, Payload::Inline(vec![2; 8]), None),
    );
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
    let r = sim.take_recv_cq(b);
    assert_ok_in_order(&r, &[1]);
    assert_eq!(sim.mem(1).peek(dst.addr + 40, 8), vec![2; 8]);
    assert_eq!(sim.qp(b).engine.counters().qkey_violations, 1);
    assert_eq!(sim.qp(b).drops, vec![DropReason::BadQkey]);
}

#[test]
fn multicast_reaches_every_attached_qp_with_a_matching_qkey() {
    let mut sim = Sim::new(4, 4);
    let mgid = mgid_v4(1, 2, 3);
    let sender = sim.create_qp(0, QpType::Ud);
    sim.ud_up(sender, QKEY);
    let mut members = Vec::new();
    // Two members on node 1, one each on nodes 2 and 3, one with another Q_Key, one not attached.
    for (node, qkey, attach) in [
        (1, QKEY, true),
        (1, QKEY, true),
        (2, QKEY, true),
        (3, QKEY + 5, true),
        (3, QKEY, false),
    ] {
        let q = sim.create_qp(node, QpType::Ud);
        sim.ud_up(q, qkey);
        if attach {
            sim.attach_mcast(q, mgid);
        }
        let buf = sim.mem(node).alloc_mr(1, 256, AccessFlags::LOCAL_WRITE);
        sim.post_recv(q, recv(q.qpn.into(), vec![buf.sge(0, 256)]));
        members.push((q, buf));
    }
    let mut w = wr(
        1,
        SendOp::Send {
            imm: Some(5),
            invalidate: None,
        },
        Payload::Inline(b"to the group".to_vec()),
    );
    let mut dest = sim.ud_dest(members[0].0, QKEY);
    dest.dgid = mgid;
    dest.qpn = softverbs_wire::MULTICAST_QPN;
    w.ud = Some(dest);
    sim.post_send(sender, w);
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(sender), &[1]);
    for (i, (q, buf)) in members.iter().enumerate() {
        let r = sim.take_recv_cq(*q);
        if i < 3 {
            assert_ok_in_order(&r, &[q.qpn.into()]);
            assert_eq!(r[0].src_qp, sender.qpn);
            assert_eq!(r[0].byte_len, 40 + 12);
            assert_eq!(sim.mem(q.node).peek(buf.addr + 40, 12), b"to the group");
        } else {
            assert!(r.is_empty(), "member {i} must not receive");
        }
    }
    assert_eq!(sim.qp(members[3].0).engine.counters().qkey_violations, 1);
}

#[test]
fn no_receive_drops_and_a_short_buffer_is_a_length_error() {
    let mut sim = Sim::new(5, 2);
    let (a, b) = ud_pair(&mut sim);
    let dst = sim.mem(1).alloc_mr(1, 256, AccessFlags::LOCAL_WRITE);
    sim.post_send(a, ud_send(1, &sim, b, QKEY, Payload::Inline(vec![1; 100]), None));
    sim.run();
    assert_eq!(sim.qp(b).drops, vec![DropReason::NoReceiveWqe]);
    sim.post_recv(b, recv(7, vec![dst.sge(0, 100)]));
    sim.post_send(a, ud_send(2, &sim, b, QKEY, Payload::Inline(vec![1; 100]), None));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
    let r = sim.take_recv_cq(b);
    assert_eq!(r.len(), 1);
    assert_wc(&r[0], 7, WcStatus::LocLenErr);
    assert_eq!(
        sim.state(b),
        QpState::Rts,
        "a UD receive error does not break the QP"
    );
}

#[test]
fn an_oversized_datagram_is_lost_but_completes() {
    let mut sim = Sim::new(6, 2);
    sim.net.link_mtu = 1100;
    let (a, b) = ud_pair(&mut sim);
    let src = sim.mem(0).alloc_mr(1, 4096, AccessFlags::empty());
    let dst = sim.mem(1).alloc_mr(1, 8192, AccessFlags::LOCAL_WRITE);
    sim.post_recv(b, recv(1, vec![dst.sge(0, 8192)]));
    sim.post_send(
        a,
        ud_send(1, &sim, b, QKEY, Payload::Sges(vec![src.sge(0, 4096)]), None),
    );
    sim.post_send(
        a,
        ud_send(2, &sim, b, QKEY, Payload::Sges(vec![src.sge(0, 1000)]), None),
    );
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
    assert_eq!(sim.stats.mtu_dropped, 1);
    let r = sim.take_recv_cq(b);
    assert_ok_in_order(&r, &[1]);
    assert_eq!(r[0].byte_len, 1040);
}

#[test]
fn ud_with_a_shared_receive_queue() {
    let mut sim = Sim::new(7, 2);
    let srq = sim.create_srq(1);
    let a = sim.create_qp(0, QpType::Ud);
    let b1 = sim.create_qp_with(
        1,
        QpType::Ud,
        QpOpts {
            srq: Some(srq),
            ..QpOpts::default()
        },
    );
    let b2 = sim.create_qp_with(
        1,
        QpType::Ud,
        QpOpts {
            srq: Some(srq),
            ..QpOpts::default()
        },
    );
    for q in [a, b1, b2] {
        sim.ud_up(q, QKEY);
    }
    let dst = sim.mem(1).alloc_mr(1, 4 * 256, AccessFlags::LOCAL_WRITE);
    for i in 0..3 {
        sim.post_srq_recv(1, srq, recv(i, vec![dst.sge(i * 256, 256)]));
    }
    sim.post_send(a, ud_send(1, &sim, b1, QKEY, Payload::Inline(vec![1; 10]), None));
    sim.post_send(a, ud_send(2, &sim, b2, QKEY, Payload::Inline(vec![2; 10]), None));
    sim.post_send(a, ud_send(3, &sim, b1, QKEY, Payload::Inline(vec![3; 10]), None));
    sim.run();
    let r1 = sim.take_recv_cq(b1);
    let r2 = sim.take_recv_cq(b2);
    assert_eq!(r1.iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![0, 2]);
    assert_eq!(r2.iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![1]);
    assert!(r1.iter().chain(&r2).all(|w| w.qp_num != 0 && w.byte_len == 50));
    assert_eq!(sim.mem(1).peek(dst.addr + 256 + 40, 10), vec![2; 10]);
    assert_eq!(sim.nodes[1].srqs[srq].queue.len(), 0);
}
