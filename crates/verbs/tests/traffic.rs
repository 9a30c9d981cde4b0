//! Traffic through the verbs API on the in-process fabric: every operation between two QPs,
//! across contexts, with the man-page statements about posting and polling.

mod common;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use common::*;
use softverbs::*;

/// Two connected QPs of `qp_type` on their own CQs, in two contexts.
struct Pair {
    a: Side,
    b: Side,
}

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

const ALL_ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

fn side(qp_type: QpType, len: usize) -> Side {
    let ctx = lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256, None, 0).unwrap();
    let mut init = QpInit::new(qp_type, &cq);
    init.cap = QpCap {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    };
    let qp = pd.create_qp(&init).unwrap();
    let mr = pd.register(len, ALL_ACCESS).unwrap();
    Side { ctx, pd, cq, qp, mr }
}

fn pair(qp_type: QpType, len: usize) -> Pair {
    let a = side(qp_type, len);
    let b = side(qp_type, len);
    to_rts_full(&a.ctx, &a.qp, b.qp.qp_num());
    to_rts_full(&b.ctx, &b.qp, a.qp.qp_num());
    Pair { a, b }
}

/// RTS with remote read/write/atomic rights granted.
fn to_rts_full(ctx: &Context, qp: &QueuePair, dest: u32) {
    to_rts(ctx, qp, dest);
    if qp.qp_type() != QpType::Ud {
        let attr = QpAttr {
            qp_state: QpState::Rts,
            qp_access_flags: ALL_ACCESS - AccessFlags::LOCAL_WRITE,
            ..Default::default()
        };
        qp.modify(&attr, QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS)
            .unwrap();
    }
}

fn send(wr_id: u64, op: SendOp, sges: Vec<Sge>) -> SendRequest {
    SendRequest {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(sges),
        ud: None,
        xrc_srqn: None,
    }
}

fn plain_send() -> SendOp {
    SendOp::Send {
        imm: None,
        invalidate: None,
    }
}

/// Polls until `n` completions arrived (bounded in time).
fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < n {
        got.extend(drain(cq));
        assert!(std::time::Instant::now() < deadline, "timed out with {got:?}");
    }
    got
}

mod ibv_post_send {
    use super::*;

    #[test]
    fn rc_send_is_received_byte_exact() {
        let p = pair(QpType::Rc, 8192);
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        p.a.mr.write(0, &data).unwrap();
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 9,
                sg_list: vec![p.b.mr.sge(0..8192).unwrap()],
            }])
            .unwrap();
        p.a.qp
            .post_send(&[send(1, plain_send(), vec![p.a.mr.sge(0..5000).unwrap()])])
            .unwrap();
        let s = wait(&p.a.cq, 1);
        assert_eq!(
            (s[0].wr_id, s[0].status, s[0].opcode),
            (1, WcStatus::Success, WcOpcode::Send)
        );
        let r = wait(&p.b.cq, 1);
        assert_eq!(
            (r[0].wr_id, r[0].status, r[0].opcode, r[0].byte_len),
            (9, WcStatus::Success, WcOpcode::Recv, 5000)
        );
        assert_eq!((r[0].qp_num, r[0].src_qp), (p.b.qp.qp_num(), p.a.qp.qp_num()));
        let mut got = vec![0u8; 5000];
        p.b.mr.read(0, &mut got).unwrap();
        assert_eq!(got, data);
    }

    #[test]
    fn every_rc_operation() {
        let p = pair(QpType::Rc, 4096);
        p.a.mr.write(0, b"hello, remote!").unwrap();
        // WRITE with immediate: data lands, and a receive completes with the immediate value.
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 20,
                sg_list: vec![],
            }])
            .unwrap();
        let op = SendOp::Write {
            remote: p.b.mr.remote(100),
            imm: Some(0x1234_5678u32.to_be()),
        };
        p.a.qp
            .post_send(&[send(2, op, vec![p.a.mr.sge(0..14).unwrap()])])
            .unwrap();
        assert_eq!(wait(&p.a.cq, 1)[0].opcode, WcOpcode::RdmaWrite);
        let r = wait(&p.b.cq, 1);
        assert_eq!(r[0].opcode, WcOpcode::RecvRdmaWithImm);
        assert_eq!(u32::from_be(r[0].imm_data), 0x1234_5678);
        assert!(r[0].wc_flags.contains(WcFlags::WITH_IMM));
        assert_eq!(r[0].byte_len, 14);
        let mut got = [0u8; 14];
        p.b.mr.read(100, &mut got).unwrap();
        assert_eq!(&got, b"hello, remote!");
        // READ it back into another place.
        let op = SendOp::Read {
            remote: p.b.mr.remote(100),
        };
        p.a.qp
            .post_send(&[send(3, op, vec![p.a.mr.sge(1000..1014).unwrap()])])
            .unwrap();
        let c = wait(&p.a.cq, 1);
        assert_eq!(
            (c[0].opcode, c[0].status, c[0].byte_len),
            (WcOpcode::RdmaRead, WcStatus::Success, 14)
        );
        let mut back = [0u8; 14];
        p.a.mr.read(1000, &mut back).unwrap();
        assert_eq!(&back, b"hello, remote!");
        // Atomics on a word of B, results into A.
        p.b.mr.write(8, &40u64.to_ne_bytes()).unwrap();
        let faa = SendOp::FetchAdd {
            remote: p.b.mr.remote(8),
            add: 2,
        };
        p.a.qp
            .post_send(&[send(4, faa, vec![p.a.mr.sge(16..24).unwrap()])])
            .unwrap();
        assert_eq!(wait(&p.a.cq, 1)[0].opcode, WcOpcode::FetchAdd);
        assert_eq!(
            p.a.mr.read_u64(16).unwrap(),
            40,
            "fetch-and-add returns the original value"
        );
        assert_eq!(p.b.mr.read_u64(8).unwrap(), 42);
        let cas = SendOp::CompareSwap {
            remote: p.b.mr.remote(8),
            compare: 42,
            swap: 7,
        };
        p.a.qp
            .post_send(&[send(5, cas, vec![p.a.mr.sge(24..32).unwrap()])])
            .unwrap();
        assert_eq!(wait(&p.a.cq, 1)[0].opcode, WcOpcode::CompSwap);
        assert_eq!(
            (p.a.mr.read_u64(24).unwrap(), p.b.mr.read_u64(8).unwrap()),
            (42, 7)
        );
        // SEND with invalidate frees a window of the receiver and reports its key.
        let target =
            p.b.pd
                .register(64, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)
                .unwrap();
        let mw = p.b.pd.alloc_mw(MwType::Type2).unwrap();
        let rkey = inc_rkey(mw.rkey());
        p.b.qp
            .post_send(&[mw.bind_request(20, rkey, &target, target.addr(), 64, AccessFlags::REMOTE_READ)])
            .unwrap();
        assert_eq!(wait(&p.b.cq, 1)[0].opcode, WcOpcode::BindMw);
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 21,
                sg_list: vec![p.b.mr.sge(0..64).unwrap()],
            }])
            .unwrap();
        let inv = SendOp::Send {
            imm: None,
            invalidate: Some(rkey),
        };
        p.a.qp
            .post_send(&[send(6, inv, vec![p.a.mr.sge(0..4).unwrap()])])
            .unwrap();
        wait(&p.a.cq, 1);
        let r = wait(&p.b.cq, 1);
        assert!(r[0].wc_flags.contains(WcFlags::WITH_INV));
        assert_eq!(r[0].imm_data, rkey);
        assert_eq!(mw.current(), (rkey, false));
    }

    #[test]
    fn inline_data_and_gather_lists() {
        let p = pair(QpType::Rc, 4096);
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 1,
                sg_list: vec![p.b.mr.sge(0..4).unwrap(), p.b.mr.sge(100..200).unwrap()],
            }])
            .unwrap();
        let req = SendRequest {
            wr_id: 7,
            op: plain_send(),
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
            payload: Payload::Inline(b"inline data!".to_vec()),
            ud: None,
            xrc_srqn: None,
        };
        p.a.qp.post_send(&[req]).unwrap();
        wait(&p.a.cq, 1);
        assert_eq!(wait(&p.b.cq, 1)[0].byte_len, 12);
        let mut head = [0u8; 4];
        let mut tail = [0u8; 8];
        p.b.mr.read(0, &mut head).unwrap();
        p.b.mr.read(100, &mut tail).unwrap();
        assert_eq!((&head, &tail), (b"inli", b"ne data!"), "scattered over two SGEs");
        // A gather list of three pieces.
        p.a.mr.write(0, b"abc").unwrap();
        p.a.mr.write(50, b"def").unwrap();
        p.a.mr.write(90, b"ghi").unwrap();
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 2,
                sg_list: vec![p.b.mr.sge(1000..1100).unwrap()],
            }])
            .unwrap();
        let sges = vec![
            p.a.mr.sge(0..3).unwrap(),
            p.a.mr.sge(50..53).unwrap(),
            p.a.mr.sge(90..93).unwrap(),
        ];
        p.a.qp.post_send(&[send(8, plain_send(), sges)]).unwrap();
        wait(&p.a.cq, 1);
        wait(&p.b.cq, 1);
        let mut got = [0u8; 9];
        p.b.mr.read(1000, &mut got).unwrap();
        assert_eq!(&got, b"abcdefghi");
    }

    #[test]
    fn unsignaled_sends_complete_silently_and_sq_sig_all_signals_them() {
        let p = pair(QpType::Rc, 4096);
        let mut reqs: Vec<SendRequest> = (0..3).map(|i| send(i, plain_send(), vec![])).collect();
        for r in &mut reqs[..2] {
            r.flags = SendFlags::empty();
        }
        p.b.qp
            .post_recv(
                &(0..3)
                    .map(|i| RecvWr {
                        wr_id: i,
                        sg_list: vec![],
                    })
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        p.a.qp.post_send(&reqs).unwrap();
        let c = wait(&p.a.cq, 1);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].wr_id, 2);
        assert_eq!(wait(&p.b.cq, 3).len(), 3);
        std::thread::sleep(Duration::from_millis(20));
        assert!(drain(&p.a.cq).is_empty());

        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let qp = pd
            .create_qp(&QpInit {
                sq_sig_all: true,
                ..QpInit::new(QpType::Ud, &cq)
            })
            .unwrap();
        to_rts(&ctx, &qp, 0);
        let ah = pd.create_ah(&ah_attr(&ctx)).unwrap();
        let req = SendRequest {
            flags: SendFlags::empty(),
            ud: Some(ah.ud_address(0xFFF0, 0x1111_1111)),
            ..send(1, plain_send(), vec![])
        };
        qp.post_send(&[req]).unwrap();
        assert_eq!(wait(&cq, 1)[0].wr_id, 1, "sq_sig_all signals every WR");
    }

    #[test]
    fn opcodes_illegal_for_the_transport_are_einval() {
        for (t, op) in [
            (
                QpType::Uc,
                SendOp::Read {
                    remote: RemoteAddr::default(),
                },
            ),
            (
                QpType::Uc,
                SendOp::FetchAdd {
                    remote: RemoteAddr::default(),
                    add: 1,
                },
            ),
            (
                QpType::Ud,
                SendOp::Write {
                    remote: RemoteAddr::default(),
                    imm: None,
                },
            ),
        ] {
            let p = pair(t, 64);
            let sg = vec![p.a.mr.sge(0..8).unwrap()];
            let e = p.a.qp.post_send(&[send(1, op, sg)]).unwrap_err();
            assert_eq!((e.index, e.error.errno()), (0, 22), "{t:?} {op:?}");
        }
    }

    #[test]
    fn first_bad_wr_is_reported_and_earlier_ones_are_posted() {
        let p = pair(QpType::Rc, 64);
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 1,
                sg_list: vec![p.b.mr.sge(0..64).unwrap()],
            }])
            .unwrap();
        let good = send(1, plain_send(), vec![p.a.mr.sge(0..8).unwrap()]);
        let too_many_sges = send(2, plain_send(), vec![p.a.mr.sge(0..1).unwrap(); 5]);
        let e =
            p.a.qp
                .post_send(&[good.clone(), too_many_sges, good])
                .unwrap_err();
        assert_eq!((e.index, e.error.errno()), (1, 22));
        assert_eq!(wait(&p.a.cq, 1).len(), 1, "only the first WR was posted");
    }

    #[test]
    fn sends_are_refused_before_rts() {
        let ctx = lo();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        to_init(&qp);
        assert_eq!(
            qp.post_send(&[send(1, plain_send(), vec![])])
                .unwrap_err()
                .error
                .errno(),
            22
        );
    }

    #[test]
    fn bad_lkey_completes_with_a_local_protection_error() {
        let p = pair(QpType::Rc, 64);
        let bad = Sge {
            addr: p.a.mr.addr(),
            length: 8,
            lkey: p.a.mr.lkey() ^ 0x5A5A,
        };
        p.a.qp
            .post_send(&[send(1, plain_send(), vec![bad]), send(2, plain_send(), vec![])])
            .unwrap();
        let c = wait(&p.a.cq, 2);
        assert_eq!(c[0].status, WcStatus::LocProtErr);
        assert_eq!(c[1].status, WcStatus::WrFlushErr);
        assert_eq!(p.a.qp.state(), QpState::Err);
    }

    #[test]
    fn remote_access_violation_is_reported_to_both_sides() {
        let p = pair(QpType::Rc, 64);
        let op = SendOp::Write {
            remote: RemoteAddr {
                addr: p.b.mr.addr() + 60,
                rkey: p.b.mr.rkey(),
            },
            imm: None,
        };
        p.a.qp
            .post_send(&[send(1, op, vec![p.a.mr.sge(0..8).unwrap()])])
            .unwrap();
        assert_eq!(wait(&p.a.cq, 1)[0].status, WcStatus::RemAccessErr);
        assert_eq!(p.a.qp.state(), QpState::Err);
        assert_eq!(p.b.qp.state(), QpState::Err);
        let ev =
            p.b.ctx
                .get_async_event_timeout(Some(Duration::from_secs(5)))
                .unwrap();
        assert_eq!(ev.event_type(), EventType::QpAccessErr);
    }

    #[test]
    fn single_thread_posts_then_polls_both_cqs() {
        let p = pair(QpType::Rc, 1 << 20);
        let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i ^ (i >> 8)) as u8).collect();
        p.a.mr.write(0, &data).unwrap();
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 5,
                sg_list: vec![p.b.mr.sge(0..1 << 20).unwrap()],
            }])
            .unwrap();
        p.a.qp
            .post_send(&[send(1, plain_send(), vec![p.a.mr.sge(0..1 << 20).unwrap()])])
            .unwrap();
        let mut wc = [WorkCompletion::default(); 1];
        let mut seen = (0, 0);
        for _ in 0..1_000_000 {
            seen.0 += p.a.cq.poll(&mut wc);
            seen.1 += p.b.cq.poll(&mut wc);
            if seen == (1, 1) {
                break;
            }
        }
        assert_eq!(seen, (1, 1));
        assert_eq!(p.b.mr.to_vec(), data);
    }

    #[test]
    fn two_qps_of_one_context_talk() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let a = pd.create_qp(&QpInit::new(QpType::Uc, &cq)).unwrap();
        let b = pd.create_qp(&QpInit::new(QpType::Uc, &cq)).unwrap();
        to_rts(&ctx, &a, b.qp_num());
        to_rts(&ctx, &b, a.qp_num());
        let mr = pd.register(64, ALL_ACCESS).unwrap();
        b.post_recv(&[RecvWr {
            wr_id: 3,
            sg_list: vec![mr.sge(32..64).unwrap()],
        }])
        .unwrap();
        mr.write(0, b"uc!").unwrap();
        a.post_send(&[send(4, plain_send(), vec![mr.sge(0..3).unwrap()])])
            .unwrap();
        let c = wait(&cq, 2);
        assert!(c.iter().any(|w| w.wr_id == 4 && w.opcode == WcOpcode::Send));
        assert!(c
            .iter()
            .any(|w| w.wr_id == 3 && w.opcode == WcOpcode::Recv && w.byte_len == 3));
    }
}

mod ibv_post_recv {
    use super::*;

    #[test]
    fn rnr_then_late_receive_succeeds() {
        let p = pair(QpType::Rc, 64);
        let attr = QpAttr {
            qp_state: QpState::Rts,
            min_rnr_timer: 1,
            ..Default::default()
        };
        p.b.qp
            .modify(&attr, QpAttrMask::STATE | QpAttrMask::MIN_RNR_TIMER)
            .unwrap();
        p.a.qp
            .post_send(&[send(1, plain_send(), vec![p.a.mr.sge(0..8).unwrap()])])
            .unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(
            drain(&p.a.cq).is_empty(),
            "no receive yet: the sender waits (RNR)"
        );
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 2,
                sg_list: vec![p.b.mr.sge(0..64).unwrap()],
            }])
            .unwrap();
        assert_eq!(wait(&p.a.cq, 1)[0].status, WcStatus::Success);
        assert_eq!(wait(&p.b.cq, 1)[0].wr_id, 2);
    }

    #[test]
    fn receive_buffer_too_small_is_an_error() {
        let p = pair(QpType::Rc, 64);
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 2,
                sg_list: vec![p.b.mr.sge(0..4).unwrap()],
            }])
            .unwrap();
        p.a.qp
            .post_send(&[send(1, plain_send(), vec![p.a.mr.sge(0..8).unwrap()])])
            .unwrap();
        assert_eq!(wait(&p.a.cq, 1)[0].status, WcStatus::RemInvReqErr);
        assert_eq!(wait(&p.b.cq, 1)[0].status, WcStatus::LocLenErr);
    }
}

mod ibv_post_srq_recv {
    use super::*;

    #[test]
    fn srq_feeds_several_qps_and_limit_event_fires_once() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64, None, 0).unwrap();
        let srq = pd
            .create_srq(&SrqAttr {
                max_wr: 16,
                max_sge: 1,
                srq_limit: 0,
            })
            .unwrap();
        let mr = pd.register(1024, ALL_ACCESS).unwrap();
        let wrs: Vec<RecvWr> = (0..8)
            .map(|i| RecvWr {
                wr_id: 100 + i,
                sg_list: vec![mr.sge(512 + i as usize * 64..576 + i as usize * 64).unwrap()],
            })
            .collect();
        srq.post_recv(&wrs).unwrap();
        srq.modify(
            &SrqAttr {
                srq_limit: 4,
                ..Default::default()
            },
            SrqAttrMask::LIMIT.bits(),
        )
        .unwrap();
        let receivers: Vec<QueuePair> = (0..2)
            .map(|_| {
                pd.create_qp(&QpInit {
                    srq: Some(&srq),
                    ..QpInit::new(QpType::Rc, &cq)
                })
                .unwrap()
            })
            .collect();
        let senders: Vec<QueuePair> = (0..2)
            .map(|_| pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap())
            .collect();
        for (s, r) in senders.iter().zip(&receivers) {
            to_rts(&ctx, s, r.qp_num());
            to_rts(&ctx, r, s.qp_num());
        }
        for (i, s) in senders.iter().enumerate().cycle().take(6) {
            s.post_send(&[send(i as u64, plain_send(), vec![mr.sge(0..16).unwrap()])])
                .unwrap();
        }
        let c = wait(&cq, 12);
        let recvs: Vec<_> = c.iter().filter(|w| w.opcode == WcOpcode::Recv).collect();
        assert_eq!(recvs.len(), 6);
        assert!(
            receivers
                .iter()
                .all(|r| recvs.iter().any(|w| w.qp_num == r.qp_num())),
            "both QPs took from the SRQ"
        );
        assert_eq!(srq.len(), 2);
        let ev = ctx.get_async_event_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(ev.event_type(), EventType::SrqLimitReached);
        assert_eq!(srq.query().srq_limit, 0, "the limit disarms after firing");
        drop(ev);
        assert_eq!(ctx.pending_async_events(), 0, "fires once");
    }
}

mod ibv_req_notify_cq {
    use super::*;

    #[test]
    fn solicited_only_waits_for_a_solicited_receive() {
        let p = pair(QpType::Rc, 64);
        let ch = p.b.ctx.create_comp_channel().unwrap();
        let rcq = p.b.ctx.create_cq(16, Some(&ch), 0).unwrap();
        let qp =
            p.b.pd
                .create_qp(&QpInit {
                    recv_cq: &rcq,
                    ..QpInit::new(QpType::Rc, &p.b.cq)
                })
                .unwrap();
        let a2 = p.a.pd.create_qp(&QpInit::new(QpType::Rc, &p.a.cq)).unwrap();
        to_rts_full(&p.a.ctx, &a2, qp.qp_num());
        to_rts_full(&p.b.ctx, &qp, a2.qp_num());
        qp.post_recv(
            &(0..2)
                .map(|i| RecvWr {
                    wr_id: i,
                    sg_list: vec![p.b.mr.sge(0..64).unwrap()],
                })
                .collect::<Vec<_>>(),
        )
        .unwrap();
        rcq.req_notify(true).unwrap();
        a2.post_send(&[send(1, plain_send(), vec![])]).unwrap();
        wait(&p.a.cq, 1);
        assert!(
            ch.get_cq_event_timeout(Some(Duration::from_millis(20))).is_err(),
            "unsolicited: no event"
        );
        let solicited = SendRequest {
            flags: SendFlags::SIGNALED | SendFlags::SOLICITED,
            ..send(2, plain_send(), vec![])
        };
        a2.post_send(&[solicited]).unwrap();
        let ev = ch.get_cq_event_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(ev.cq().same_as(&rcq));
        let c = wait(&rcq, 2);
        assert!(!c[0].solicited && c[1].solicited);
    }
}

mod ibv_attach_mcast {
    use super::*;

    #[test]
    fn multicast_reaches_every_attached_qp_once() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64, None, 0).unwrap();
        let mr = pd.register(4096, ALL_ACCESS).unwrap();
        let group = Gid::from(Ipv4Addr::new(239, 1, 1, 1));
        let members: Vec<QueuePair> = (0..3)
            .map(|_| pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap())
            .collect();
        for (i, m) in members.iter().enumerate() {
            to_rts(&ctx, m, 0);
            m.attach_mcast(&group, 0).unwrap();
            m.attach_mcast(&group, 0).unwrap(); // twice: still one copy
            m.post_recv(&[RecvWr {
                wr_id: i as u64,
                sg_list: vec![mr.sge(i * 1024..(i + 1) * 1024).unwrap()],
            }])
            .unwrap();
        }
        let sender = pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap();
        to_rts(&ctx, &sender, 0);
        let mut attr = ah_attr(&ctx);
        attr.grh.dgid = group;
        let ah = pd.create_ah(&attr).unwrap();
        mr.write(3500, b"to all").unwrap();
        let req = SendRequest {
            ud: Some(ah.ud_address(0xFF_FFFF, 0x1111_1111)),
            ..send(9, plain_send(), vec![mr.sge(3500..3506).unwrap()])
        };
        sender.post_send(&[req]).unwrap();
        let c = wait(&cq, 4);
        let recvs: Vec<_> = c.iter().filter(|w| w.opcode == WcOpcode::Recv).collect();
        assert_eq!(recvs.len(), 3);
        for w in &recvs {
            assert_eq!((w.byte_len, w.src_qp), (46, sender.qp_num()));
            assert!(w.wc_flags.contains(WcFlags::GRH));
            let mut got = [0u8; 6];
            mr.read(w.wr_id as usize * 1024 + 40, &mut got).unwrap();
            assert_eq!(&got, b"to all");
        }
        std::thread::sleep(Duration::from_millis(10));
        assert!(drain(&cq).is_empty(), "one copy per QP");
    }
}

mod ud {
    use super::*;

    #[test]
    fn ud_send_carries_grh_and_source_qp_and_wrong_qkey_is_dropped() {
        let p = pair(QpType::Ud, 4096);
        let ah = p.a.pd.create_ah(&ah_attr(&p.a.ctx)).unwrap();
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 1,
                sg_list: vec![p.b.mr.sge(0..2048).unwrap()],
            }])
            .unwrap();
        p.a.mr.write(0, b"datagram").unwrap();
        let imm = SendOp::Send {
            imm: Some(77u32.to_be()),
            invalidate: None,
        };
        let req = SendRequest {
            ud: Some(ah.ud_address(p.b.qp.qp_num(), 0x1111_1111)),
            ..send(5, imm, vec![p.a.mr.sge(0..8).unwrap()])
        };
        p.a.qp.post_send(std::slice::from_ref(&req)).unwrap();
        let r = wait(&p.b.cq, 1);
        assert_eq!((r[0].byte_len, r[0].src_qp), (48, p.a.qp.qp_num()));
        assert!(r[0].wc_flags.contains(WcFlags::GRH | WcFlags::WITH_IMM));
        assert_eq!(u32::from_be(r[0].imm_data), 77);
        let mut grh = [0u8; 40];
        p.b.mr.read(0, &mut grh).unwrap();
        let attr = p.b.ctx.init_ah_from_wc(1, &r[0], &grh).unwrap();
        assert_eq!(
            attr.grh.dgid,
            Gid::from(Ipv4Addr::LOCALHOST),
            "the GRH names the sender"
        );
        let mut payload = [0u8; 8];
        p.b.mr.read(40, &mut payload).unwrap();
        assert_eq!(&payload, b"datagram");
        // A wrong Q_Key: the datagram is dropped and counted.
        let before = p.b.ctx.counters().rx_bad_qkey;
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 2,
                sg_list: vec![p.b.mr.sge(0..2048).unwrap()],
            }])
            .unwrap();
        let bad = SendRequest {
            ud: Some(ah.ud_address(p.b.qp.qp_num(), 0x2222)),
            ..req
        };
        p.a.qp.post_send(&[bad]).unwrap();
        wait(&p.a.cq, 2);
        // The send completes when the datagram leaves; the receiver may still be handling it.
        let deadline = Instant::now() + Duration::from_secs(10);
        while p.b.ctx.counters().rx_bad_qkey == before {
            assert!(Instant::now() < deadline, "the bad Q_Key was never counted");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(drain(&p.b.cq).is_empty());
        assert_eq!(p.b.ctx.counters().rx_bad_qkey, before + 1);
        assert_eq!(
            p.b.ctx.query_port(1).unwrap().qkey_viol_cntr as u64,
            before + 1,
            "the port's Q_Key violation counter"
        );
    }

    #[test]
    fn ud_message_larger_than_the_mtu_is_refused_at_post() {
        let p = pair(QpType::Ud, 8192);
        let ah = p.a.pd.create_ah(&ah_attr(&p.a.ctx)).unwrap();
        let req = SendRequest {
            ud: Some(ah.ud_address(p.b.qp.qp_num(), 0x1111_1111)),
            ..send(5, plain_send(), vec![p.a.mr.sge(0..8000).unwrap()])
        };
        assert_eq!(p.a.qp.post_send(&[req]).unwrap_err().error.errno(), 22);
    }
}
