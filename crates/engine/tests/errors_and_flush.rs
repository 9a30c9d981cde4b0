//! Failure paths: remote access violations (class C at the responder), receive buffers too small,
//! retry exhaustion when the peer vanishes, the flush of everything outstanding when a QP enters
//! ERR, and the SQD drain.

mod sim;

use std::time::Duration;

use sim::*;
use softverbs_engine::types::{AccessFlags, EventType, QpState, QpType, SendFlags, WcOpcode, WcStatus};
use softverbs_engine::wr::{RemoteAddr, SendWr};
use softverbs_wire::{AethSyndrome, NakCode};

struct Case {
    name: &'static str,
    /// Builds the offending WR from (local MR, remote MR of PD 1 with all rights, remote MR of
    /// PD 1 with `mr_access`, remote MR of PD 2).
    op: fn(&Mr, &Mr, &Mr, &Mr) -> SendWr,
    mr_access: AccessFlags,
    qp_access: AccessFlags,
    requester: WcStatus,
    nak: NakCode,
    event: EventType,
}

fn bad_rkey(r: &Mr) -> RemoteAddr {
    RemoteAddr {
        addr: r.addr,
        rkey: r.rkey ^ 0x0F00,
    }
}

#[test]
fn remote_access_violations_fail_the_requester_and_break_the_responder() {
    let all = all_access();
    let cases = [
        Case {
            name: "WRITE with a bad rkey",
            op: |l, r, _, _| write(1, bad_rkey(r), vec![l.sge(0, 16)]),
            mr_access: all,
            qp_access: all,
            requester: WcStatus::RemAccessErr,
            nak: NakCode::RemoteAccessError,
            event: EventType::QpAccessErr,
        },
        Case {
            name: "READ past the end of the region",
            op: |l, r, _, _| read(1, r.remote(r.len - 8), vec![l.sge(0, 16)]),
            mr_access: all,
            qp_access: all,
            requester: WcStatus::RemAccessErr,
            nak: NakCode::RemoteAccessError,
            event: EventType::QpAccessErr,
        },
        Case {
            name: "WRITE to a region without REMOTE_WRITE",
            op: |l, _, m, _| write(1, m.remote(0), vec![l.sge(0, 16)]),
            mr_access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
            qp_access: all,
            requester: WcStatus::RemAccessErr,
            nak: NakCode::RemoteAccessError,
            event: EventType::QpAccessErr,
        },
        Case {
            name: "READ from a region without REMOTE_READ",
            op: |l, _, m, _| read(1, m.remote(0), vec![l.sge(0, 16)]),
            mr_access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            qp_access: all,
            requester: WcStatus::RemAccessErr,
            nak: NakCode::RemoteAccessError,
            event: EventType::QpAccessErr,
        },
        Case {
            name: "atomic on a region without REMOTE_ATOMIC",
            op: |l, _, m, _| fetch_add(1, m.remote(0), 1, l.sge(0, 8)),
            mr_access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            qp_access: all,
            requester: WcStatus::RemAccessErr,
            nak: NakCode::RemoteAccessError,
            event: EventType::QpAccessErr,
        },
        Case {
            name: "WRITE to a region of another PD",
            op: |l, _, _, o| write(1, o.remote(0), vec![l.sge(0, 16)]),
            mr_access: all,
            qp_access: all,
            requester: WcStatus::RemAccessErr,
            nak: NakCode::RemoteAccessError,
            event: EventType::QpAccessErr,
        },
        Case {
            name: "WRITE to a QP without REMOTE_WRITE",
            op: |l, r, _, _| write(1, r.remote(0), vec![l.sge(0, 16)]),
            mr_access: all,
            qp_access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
            requester: WcStatus::RemInvReqErr,
            nak: NakCode::InvalidRequest,
            event: EventType::QpReqErr,
        },
        Case {
            name: "READ from a QP without REMOTE_READ",
            op: |l, r, _, _| read(1, r.remote(0), vec![l.sge(0, 16)]),
            mr_access: all,
            qp_access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            requester: WcStatus::RemInvReqErr,
            nak: NakCode::InvalidRequest,
            event: EventType::QpReqErr,
        },
        Case {
            name: "atomic to a QP without REMOTE_ATOMIC",
            op: |l, r, _, _| cmp_swp(1, r.remote(0), 0, 1, l.sge(0, 8)),
            mr_access: all,
            qp_access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            requester: WcStatus::RemInvReqErr,
            nak: NakCode::InvalidRequest,
            event: EventType::QpReqErr,
        },
        Case {
            name: "misaligned atomic",
            op: |l, r, _, _| fetch_add(1, r.remote(4), 1, l.sge(0, 8)),
            mr_access: all,
            qp_access: all,
            requester: WcStatus::RemInvReqErr,
            nak: NakCode::InvalidRequest,
            event: EventType::QpReqErr,
        },
    ];
    for c in &cases {
        let o = ConnOpts {
            access: c.qp_access,
            ..ConnOpts::default()
        };
        let (mut sim, a, b) = Sim::pair(1, QpType::Rc, &o);
        sim.record();
        let local = sim.mem(0).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
        let remote = sim.mem(1).alloc_mr(1, 4096, all_access());
        let limited = sim.mem(1).alloc_mr(1, 4096, c.mr_access);
        let other_pd = sim.mem(1).alloc_mr(2, 4096, all_access());
        let before = sim.mem(1).peek(remote.addr, 4096);
        // A receive posted at the responder is flushed when it breaks.
        sim.post_recv(b, recv(50, vec![remote.sge(0, 64)]));
        sim.post_send_unchecked(a, (c.op)(&local, &remote, &limited, &other_pd));
        // WRs behind the bad one are flushed, signaled or not.
        sim.post_send(a, write(2, remote.remote(0), vec![local.sge(0, 16)]));
        let mut unsignaled = write(3, remote.remote(0), vec![local.sge(0, 16)]);
        unsignaled.flags = SendFlags::empty();
        sim.post_send(a, unsignaled);
        sim.run();
        let s = sim.take_send_cq(a);
        assert_eq!(
            s.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            vec![
                (1, c.requester),
                (2, WcStatus::WrFlushErr),
                (3, WcStatus::WrFlushErr)
            ],
            "{}",
            c.name
        );
        assert_eq!(sim.state(a), QpState::Err, "{}", c.name);
        assert_eq!(
            sim.state(b),
            QpState::Err,
            "{}: the responder breaks (class C)",
            c.name
        );
        assert_eq!(sim.take_events(b), vec![c.event], "{}", c.name);
        let r = sim.take_recv_cq(b);
        assert_eq!(
            r.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            vec![(50, WcStatus::WrFlushErr)],
            "{}",
            c.name
        );
        let naks: Vec<_> = sim
            .log
            .as_ref()
            .unwrap()
            .iter()
            .filter_map(|p| p.syndrome)
            .filter(|s| !s.is_ack())
            .collect();
        assert_eq!(naks, vec![AethSyndrome::Nak(c.nak)], "{}", c.name);
        assert_eq!(
            sim.mem(1).peek(remote.addr, 4096),
            before,
            "{}: nothing written",
            c.name
        );
        assert_eq!(sim.mem(1).atomics.get(), 0, "{}", c.name);
    }
}

#[test]
fn a_receive_too_small_for_the_send_is_a_length_error_on_both_sides() {
    let (mut sim, a, b) = Sim::pair(2, QpType::Rc, &ConnOpts::default());
    let src = sim.mem(0).alloc_mr(1, 4096, AccessFlags::empty());
    let dst = sim.mem(1).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
    sim.post_recv(b, recv(1, vec![dst.sge(0, 1000)]));
    sim.post_recv(b, recv(2, vec![dst.sge(1000, 1000)]));
    sim.post_send(a, send(10, vec![src.sge(0, 3000)]));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_wc(&s[0], 10, WcStatus::RemInvReqErr);
    let r = sim.take_recv_cq(b);
    assert_eq!(
        r.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::LocLenErr), (2, WcStatus::WrFlushErr)]
    );
    assert_eq!(sim.take_events(b), vec![EventType::QpReqErr]);
}

#[test]
fn a_bad_local_key_fails_at_the_requester_without_sending() {
    let (mut sim, a, _b) = Sim::pair(3, QpType::Rc, &ConnOpts::default());
    sim.record();
    let local = sim.mem(0).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 4096, all_access());
    let mut sge = local.sge(0, 64);
    sge.lkey ^= 0xF0;
    sim.post_send(a, write(1, remote.remote(0), vec![sge]));
    sim.post_send(a, write(2, remote.remote(0), vec![local.sge(0, 64)]));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_eq!(
        s.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::LocProtErr), (2, WcStatus::WrFlushErr)]
    );
    assert_eq!(sim.state(a), QpState::Err);
    assert!(sim.log.as_ref().unwrap().is_empty(), "nothing went on the wire");
}

#[test]
fn read_into_a_buffer_without_local_write_is_a_local_error() {
    let (mut sim, a, b) = Sim::pair(4, QpType::Rc, &ConnOpts::default());
    let local = sim.mem(0).alloc_mr(1, 4096, AccessFlags::empty());
    let remote = sim.mem(1).alloc_mr(1, 4096, all_access());
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 64)]));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_wc(&s[0], 1, WcStatus::LocAccessErr);
    assert_eq!(sim.state(a), QpState::Err);
    assert_eq!(sim.state(b), QpState::Rts, "the responder did nothing wrong");
}

#[test]
fn retry_exhaustion_when_the_peer_vanishes() {
    let o = ConnOpts {
        retry_cnt: 3,
        timeout: 10,
        ..ConnOpts::default()
    };
    let (mut sim, a, _b) = Sim::pair(5, QpType::Rc, &o);
    sim.record();
    let local = sim.mem(0).alloc_mr(1, 8192, AccessFlags::LOCAL_WRITE);
    let remote = sim.mem(1).alloc_mr(1, 8192, all_access());
    sim.nodes[1].up = false;
    let start = sim.now;
    sim.post_send(a, write(1, remote.remote(0), vec![local.sge(0, 3000)]));
    sim.post_send(a, read(2, remote.remote(0), vec![local.sge(0, 100)]));
    let mut unsignaled = send(3, vec![local.sge(0, 10)]);
    unsignaled.flags = SendFlags::empty();
    sim.post_send(a, unsignaled);
    sim.post_send(a, fetch_add(4, remote.remote(0), 1, local.sge(0, 8)));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_eq!(
        s.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![
            (1, WcStatus::RetryExcErr),
            (2, WcStatus::WrFlushErr),
            (3, WcStatus::WrFlushErr),
            (4, WcStatus::WrFlushErr),
        ]
    );
    assert_eq!(s[1].opcode, WcOpcode::RdmaRead);
    assert_eq!(sim.state(a), QpState::Err);
    let c = sim.qp(a).engine.counters();
    assert_eq!(c.timeouts, 4, "the first try and retry_cnt retries each time out");
    // 4 timeouts of 4.096 us * 2^10.
    let elapsed = sim.now - start;
    assert!(elapsed >= Duration::from_nanos((4 * 4096) << 10), "{elapsed:?}");
    assert!(elapsed < Duration::from_nanos((5 * 4096) << 10), "{elapsed:?}");
    // Every pass resent the first packet.
    let first: Vec<_> = sim
        .log
        .as_ref()
        .unwrap()
        .iter()
        .filter(|p| p.psn.value() == o.psn_a)
        .collect();
    assert_eq!(first.len(), 4);
}

#[test]
fn retry_cnt_zero_gives_up_after_one_timeout() {
    let o = ConnOpts {
        retry_cnt: 0,
        timeout: 4,
        ..ConnOpts::default()
    };
    let (mut sim, a, _b) = Sim::pair(6, QpType::Rc, &o);
    sim.nodes[1].up = false;
    sim.post_send(a, send(1, vec![]));
    sim.run();
    assert_wc(&sim.take_send_cq(a)[0], 1, WcStatus::RetryExcErr);
    assert_eq!(sim.qp(a).engine.counters().timeouts, 1);
}

#[test]
fn timeout_zero_waits_forever() {
    let o = ConnOpts {
        retry_cnt: 0,
        timeout: 0,
        ..ConnOpts::default()
    };
    let (mut sim, a, _b) = Sim::pair(7, QpType::Rc, &o);
    sim.nodes[1].up = false;
    sim.post_send(a, send(1, vec![]));
    sim.run();
    assert!(sim.take_send_cq(a).is_empty());
    assert_eq!(sim.state(a), QpState::Rts);
    assert_eq!(sim.qp(a).engine.poll_timeout(), None);
}

#[test]
fn moving_to_err_flushes_every_send_and_receive() {
    let (mut sim, a, b) = Sim::pair(8, QpType::Rc, &ConnOpts::default());
    let local = sim.mem(0).alloc_mr(1, 1 << 20, all_access());
    let remote = sim.mem(1).alloc_mr(1, 1 << 20, all_access());
    sim.nodes[1].up = false;
    for i in 0..4 {
        sim.post_recv(a, recv(100 + i, vec![local.sge(i * 64, 64)]));
    }
    for i in 0..6u64 {
        let mut w = write(i, remote.remote(0), vec![local.sge(0, 100_000)]);
        if i % 2 == 1 {
            w.flags = SendFlags::empty();
        }
        sim.post_send(a, w);
    }
    sim.run_for(Duration::from_micros(100));
    assert!(sim.take_send_cq(a).is_empty());
    sim.set_state(a, QpState::Err);
    let s = sim.take_send_cq(a);
    assert_eq!(
        s.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        (0..6).map(|i| (i, WcStatus::WrFlushErr)).collect::<Vec<_>>()
    );
    assert!(s
        .iter()
        .all(|w| w.opcode == WcOpcode::RdmaWrite && w.qp_num == a.qpn));
    let r = sim.take_recv_cq(a);
    assert_eq!(
        r.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        (100..104).map(|i| (i, WcStatus::WrFlushErr)).collect::<Vec<_>>()
    );
    // Posting in ERR completes at once, flushed.
    sim.post_send(a, send(9, vec![]));
    sim.post_recv(a, recv(109, vec![]));
    assert_eq!(
        sim.take_send_cq(a)
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect::<Vec<_>>(),
        vec![(9, WcStatus::WrFlushErr)]
    );
    assert_eq!(
        sim.take_recv_cq(a)
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect::<Vec<_>>(),
        vec![(109, WcStatus::WrFlushErr)]
    );
    // Nothing is sent any more, and no timer is left.
    sim.nodes[1].up = true;
    sim.record();
    sim.run();
    assert!(sim.log.as_ref().unwrap().iter().all(|p| p.from != a));
    assert_eq!(sim.qp(a).engine.poll_timeout(), None);
    let _ = b;
}

#[test]
fn err_then_reset_then_reconnect_works_again() {
    let o = ConnOpts::default();
    let (mut sim, a, b) = Sim::pair(9, QpType::Rc, &o);
    let local = sim.mem(0).alloc_mr(1, 4096, all_access());
    let remote = sim.mem(1).alloc_mr(1, 4096, all_access());
    sim.set_state(a, QpState::Err);
    sim.set_state(b, QpState::Err);
    sim.set_state(a, QpState::Reset);
    sim.set_state(b, QpState::Reset);
    let o2 = ConnOpts {
        psn_a: 0x77,
        psn_b: 0x99,
        ..o
    };
    sim.connect(a, b, &o2);
    sim.mem(0).poke(local.addr, &[3; 64]);
    sim.post_send(a, write(1, remote.remote(0), vec![local.sge(0, 64)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1]);
    assert_eq!(sim.mem(1).peek(remote.addr, 64), vec![3; 64]);
}

#[test]
fn sqd_finishes_started_wqes_then_raises_sq_drained() {
    let (mut sim, a, b) = Sim::pair(10, QpType::Rc, &ConnOpts::default());
    let local = sim.mem(0).alloc_mr(1, 1 << 20, all_access());
    let remote = sim.mem(1).alloc_mr(1, 1 << 20, all_access());
    // 64 KiB = 64 packets at MTU 1024: two WQEs fill the 128-PSN window.
    for i in 0..6 {
        sim.post_send(
            a,
            write(i, remote.remote(i * 65536), vec![local.sge(i * 65536, 65536)]),
        );
    }
    assert_eq!(sim.qp(a).engine.send_queue_len(), 6);
    sim.drain(a);
    assert!(sim.qp(a).engine.sq_draining());
    assert!(
        sim.take_events(a).is_empty(),
        "not drained while WQEs are in flight"
    );
    sim.run();
    assert_eq!(sim.take_events(a), vec![EventType::SqDrained]);
    assert!(!sim.qp(a).engine.sq_draining());
    assert_ok_in_order(&sim.take_send_cq(a), &[0, 1]);
    assert_eq!(sim.qp(a).engine.send_queue_len(), 4, "unstarted WQEs wait in SQD");
    // A WR posted in SQD waits too; back to RTS everything goes.
    sim.post_send(a, send(6, vec![]));
    sim.post_recv(b, recv(1, vec![]));
    sim.run();
    assert!(sim.take_send_cq(a).is_empty());
    sim.set_state(a, QpState::Rts);
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[2, 3, 4, 5, 6]);
    assert!(sim.take_events(a).is_empty());
}

#[test]
fn sqd_on_an_idle_queue_is_drained_at_once_and_without_notify_raises_nothing() {
    let (mut sim, a, b) = Sim::pair(11, QpType::Rc, &ConnOpts::default());
    sim.drain(a);
    assert_eq!(sim.take_events(a), vec![EventType::SqDrained]);
    sim.set_state(a, QpState::Rts);
    sim.post_recv(b, recv(1, vec![]));
    sim.post_send(a, send(1, vec![]));
    // (apply_modify keeps en_sqd_async_notify from the earlier drain, so clear it explicitly.)
    let attr = softverbs_engine::types::QpAttr {
        qp_state: QpState::Sqd,
        en_sqd_async_notify: false,
        ..Default::default()
    };
    sim.modify(
        a,
        &attr,
        softverbs_engine::types::QpAttrMask::STATE | softverbs_engine::types::QpAttrMask::EN_SQD_ASYNC_NOTIFY,
    );
    sim.run();
    assert!(sim.take_events(a).is_empty());
    assert_ok_in_order(&sim.take_send_cq(a), &[1]);
}

#[test]
fn srq_qp_entering_err_raises_last_wqe_reached() {
    let mut sim = Sim::new(12, 2);
    let srq = sim.create_srq(1);
    let a = sim.create_qp(0, QpType::Rc);
    let b = sim.create_qp_with(
        1,
        QpType::Rc,
        QpOpts {
            srq: Some(srq),
            ..QpOpts::default()
        },
    );
    sim.connect(a, b, &ConnOpts::default());
    let dst = sim.mem(1).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
    for i in 0..3 {
        sim.post_srq_recv(1, srq, recv(i, vec![dst.sge(0, 4096)]));
    }
    // A two-packet SEND whose LAST is lost: the receive in progress is flushed, the rest of the
    // SRQ stays for other QPs.
    sim.set_filter(|p| {
        if p.opcode == softverbs_wire::Opcode::RcSendLast {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    let src = sim.mem(0).alloc_mr(1, 4096, AccessFlags::empty());
    sim.post_send(a, send(1, vec![src.sge(0, 2000)]));
    sim.run_for(Duration::from_micros(50));
    sim.set_state(b, QpState::Err);
    assert_eq!(sim.take_events(b), vec![EventType::QpLastWqeReached]);
    assert_eq!(
        sim.take_recv_cq(b)
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect::<Vec<_>>(),
        vec![(0, WcStatus::WrFlushErr)]
    );
    assert_eq!(sim.nodes[1].srqs[srq].queue.len(), 2);
}

#[test]
fn a_response_that_does_not_fit_is_a_bad_response() {
    // The responder believes the path MTU is 4096 while the requester uses 1024: READ
    // responses come back too long for the requester's segmentation.
    let mut sim = Sim::new(13, 2);
    let a = sim.create_qp(0, QpType::Rc);
    let b = sim.create_qp(1, QpType::Rc);
    let o = ConnOpts::default();
    sim.bring_up(
        a,
        b,
        &ConnOpts {
            mtu: softverbs_engine::types::Mtu::Mtu1024,
            ..o
        },
        o.psn_a,
        o.psn_b,
    );
    sim.bring_up(
        b,
        a,
        &ConnOpts {
            mtu: softverbs_engine::types::Mtu::Mtu4096,
            ..o
        },
        o.psn_b,
        o.psn_a,
    );
    let local = sim.mem(0).alloc_mr(1, 8192, all_access());
    let remote = sim.mem(1).alloc_mr(1, 8192, all_access());
    sim.post_send(a, read(1, remote.remote(0), vec![local.sge(0, 3000)]));
    sim.run();
    assert_wc(&sim.take_send_cq(a)[0], 1, WcStatus::BadRespErr);
    assert_eq!(sim.state(a), QpState::Err);
}
