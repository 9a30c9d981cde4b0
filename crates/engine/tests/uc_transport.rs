//! UC: SEND and WRITE (with and without immediate) without acknowledgements; a message with a
//! hole is dropped whole and its receive WQE reused; errors never move the QP to ERR.

mod sim;

use sim::*;
use softverbs_engine::types::{AccessFlags, Mtu, QpState, QpType, WcFlags, WcOpcode};
use softverbs_engine::wr::{Payload, SendOp};
use softverbs_wire::Opcode;

fn uc(seed: u64) -> (Sim, QpId, QpId) {
    Sim::pair(
        seed,
        QpType::Uc,
        &ConnOpts {
            mtu: Mtu::Mtu1024,
            ..ConnOpts::default()
        },
    )
}

#[test]
fn send_and_write_with_and_without_immediate() {
    let (mut sim, a, b) = uc(1);
    sim.record();
    let src = sim.mem(0).alloc_mr(1, 8192, AccessFlags::empty());
    let dst = sim
        .mem(1)
        .alloc_mr(1, 16384, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    let data = sim.rng.bytes(8192);
    sim.mem(0).poke(src.addr, &data);
    sim.post_recv(b, recv(1, vec![dst.sge(0, 4096)]));
    sim.post_recv(b, recv(2, vec![dst.sge(4096, 4096)]));
    sim.post_recv(b, recv(3, vec![]));
    sim.post_send(a, send(10, vec![src.sge(0, 3000)]));
    sim.post_send(
        a,
        wr(
            11,
            SendOp::Send {
                imm: Some(0x0102_0304),
                invalidate: None,
            },
            Payload::Sges(vec![src.sge(0, 500)]),
        ),
    );
    sim.post_send(a, write(12, dst.remote(8192), vec![src.sge(0, 5000)]));
    sim.post_send(
        a,
        wr(
            13,
            SendOp::Write {
                remote: dst.remote(8192 + 5000),
                imm: Some(7),
            },
            Payload::Sges(vec![src.sge(5000, 3192)]),
        ),
    );
    sim.run();
    let s = sim.take_send_cq(a);
    assert_ok_in_order(&s, &[10, 11, 12, 13]);
    assert_eq!(
        s.iter().map(|w| w.opcode).collect::<Vec<_>>(),
        [
            WcOpcode::Send,
            WcOpcode::Send,
            WcOpcode::RdmaWrite,
            WcOpcode::RdmaWrite
        ]
    );
    let r = sim.take_recv_cq(b);
    assert_ok_in_order(&r, &[1, 2, 3]);
    assert_eq!((r[0].byte_len, r[0].wc_flags), (3000, WcFlags::empty()));
    assert_eq!((r[1].byte_len, r[1].imm_data), (500, 0x0102_0304));
    assert!(r[1].wc_flags.contains(WcFlags::WITH_IMM));
    assert_eq!(
        (r[2].opcode, r[2].byte_len, r[2].imm_data),
        (WcOpcode::RecvRdmaWithImm, 3192, 7)
    );
    let m = sim.mem(1);
    assert_eq!(m.peek(dst.addr, 3000), data[..3000]);
    assert_eq!(m.peek(dst.addr + 4096, 500), data[..500]);
    assert_eq!(m.peek(dst.addr + 8192, 8192), data);
    let log = sim.log.take().unwrap();
    assert!(
        log.iter()
            .all(|p| p.from == a && p.opcode.is_request() && !p.ack_req),
        "UC has no ACKs and no AckReq"
    );
    assert!(
        log.iter().any(|p| p.opcode == Opcode::UcSendFirst)
            && log.iter().any(|p| p.opcode == Opcode::UcWriteLastWithImm)
    );
}

#[test]
fn a_message_with_a_lost_packet_is_dropped_whole_and_its_receive_reused() {
    let (mut sim, a, b) = uc(2);
    let src = sim.mem(0).alloc_mr(1, 4096, AccessFlags::empty());
    let dst = sim
        .mem(1)
        .alloc_mr(1, 4 * 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    let data = sim.rng.bytes(4096);
    sim.mem(0).poke(src.addr, &data);
    for i in 0..3 {
        sim.post_recv(b, recv(i, vec![dst.sge(i * 4096, 4096)]));
    }
    // Drop the MIDDLE packet of the second 3-packet message (PSNs 0x1000.. : msg 2 is 0x1003..0x1005).
    sim.set_filter(|p| {
        if p.opcode.is_request() && p.psn.value() == 0x1004 {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    for i in 0..3 {
        sim.post_send(a, send(10 + i, vec![src.sge(0, 3000)]));
    }
    sim.run();
    // The sender cannot know: all three complete.
    assert_ok_in_order(&sim.take_send_cq(a), &[10, 11, 12]);
    // The receiver completes messages 1 and 3; message 3 went into receive WQE 1 (reused).
    let r = sim.take_recv_cq(b);
    assert_ok_in_order(&r, &[0, 1]);
    assert!(r.iter().all(|w| w.byte_len == 3000));
    assert_eq!(sim.mem(1).peek(dst.addr + 4096, 3000), data[..3000]);
    assert_eq!(sim.qp(b).engine.recv_queue_len(), 1);
    assert_eq!(sim.state(b), QpState::Rts);
    // Same for a WRITE with immediate: its last packet never comes, so no receive is consumed.
    sim.clear_filter();
    sim.set_filter(|p| {
        if p.opcode == Opcode::UcWriteFirst {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    sim.post_send(
        a,
        wr(
            20,
            SendOp::Write {
                remote: dst.remote(12288),
                imm: Some(1),
            },
            Payload::Sges(vec![src.sge(0, 3000)]),
        ),
    );
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[20]);
    assert!(sim.take_recv_cq(b).is_empty());
    assert_eq!(
        sim.mem(1).peek(dst.addr + 12288 + 1024, 2000),
        vec![0; 2000],
        "the rest of a broken WRITE is discarded"
    );
}

#[test]
fn network_duplicates_are_not_delivered_twice() {
    let (mut sim, a, b) = uc(3);
    sim.net.dup_pct = 100.0;
    let src = sim.mem(0).alloc_mr(1, 4096, AccessFlags::empty());
    let dst = sim
        .mem(1)
        .alloc_mr(1, 10 * 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    for i in 0..10 {
        sim.post_recv(b, recv(i, vec![dst.sge(i * 4096, 4096)]));
    }
    for i in 0..4 {
        sim.post_send(a, send(i, vec![src.sge(0, 100 + 1000 * i as u32)]));
    }
    sim.run();
    assert_ok_in_order(&sim.take_recv_cq(b), &[0, 1, 2, 3]);
    assert_eq!(sim.qp(b).engine.recv_queue_len(), 6);
}

#[test]
fn write_errors_and_missing_receives_drop_the_message_silently() {
    let (mut sim, a, b) = uc(4);
    let src = sim.mem(0).alloc_mr(1, 4096, AccessFlags::empty());
    let dst = sim
        .mem(1)
        .alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    let ro = sim.mem(1).alloc_mr(1, 4096, AccessFlags::REMOTE_READ);
    sim.mem(0).poke(src.addr, &[1; 4096]);
    // Bad rkey, out of range, region without REMOTE_WRITE, and a SEND with no receive posted.
    let mut bad = dst.remote(0);
    bad.rkey ^= 0xFF;
    sim.post_send(a, write(1, bad, vec![src.sge(0, 64)]));
    sim.post_send(a, write(2, dst.remote(4000), vec![src.sge(0, 200)]));
    sim.post_send(a, write(3, ro.remote(0), vec![src.sge(0, 64)]));
    sim.post_send(a, send(4, vec![src.sge(0, 64)]));
    // Then a good message still gets through.
    sim.post_send(a, write(5, dst.remote(0), vec![src.sge(0, 64)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2, 3, 4, 5]);
    assert!(sim.take_recv_cq(b).is_empty());
    assert_eq!(sim.state(b), QpState::Rts);
    assert!(sim.take_events(b).is_empty());
    assert_eq!(sim.mem(1).peek(dst.addr, 64), vec![1; 64]);
    assert_eq!(sim.mem(1).peek(dst.addr + 4000, 96), vec![0; 96]);
    assert_eq!(sim.mem(1).peek(ro.addr, 64), vec![0; 64]);
    assert_eq!(sim.qp(b).drops.len(), 4);
}

#[test]
fn uc_under_loss_delivers_only_whole_messages() {
    for seed in seeds(&[5, 6, 7]) {
        let (mut sim, a, b) = uc(seed);
        sim.net = NetConfig::lossy(10.0);
        let src = sim.mem(0).alloc_mr(1, 1 << 16, AccessFlags::empty());
        let dst = sim.mem(1).alloc_mr(1, 200 * 4096, AccessFlags::LOCAL_WRITE);
        let data = sim.rng.bytes(1 << 16);
        sim.mem(0).poke(src.addr, &data);
        for i in 0..200 {
            sim.post_recv(b, recv(i, vec![dst.sge(i * 4096, 4096)]));
        }
        let mut lens = Vec::new();
        for i in 0..100u64 {
            let len = (sim.rng.below(4000) + 1) as u32;
            lens.push(len);
            // Each message's bytes are distinguishable: offset by its index.
            sim.post_send(a, send(i, vec![src.sge(i * 97, len)]));
        }
        sim.run();
        assert_eq!(sim.take_send_cq(a).len(), 100);
        let r = sim.take_recv_cq(b);
        assert!(r.len() < 100 && r.len() > 30, "{} of 100 made it", r.len());
        // Completed receives are in order, each holding exactly one whole message.
        let mut prev_msg = None;
        for (slot, wc) in r.iter().enumerate() {
            assert_eq!(wc.wr_id, slot as u64);
            let got = sim
                .mem(1)
                .peek(dst.addr + slot as u64 * 4096, wc.byte_len as usize);
            let msg = (0..100u64)
                .find(|&i| {
                    lens[i as usize] == wc.byte_len
                        && got == data[(i * 97) as usize..(i * 97) as usize + got.len()]
                })
                .expect("a receive holds a whole message");
            assert!(prev_msg < Some(msg));
            prev_msg = Some(msg);
        }
    }
}
