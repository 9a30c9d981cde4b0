//! XRC through the safe API: ibv_open_xrcd(3) (fd, O_CREAT, O_EXCL, EAGAIN, EINVAL, EBADF),
//! ibv_create_srq_ex(3) with IBV_SRQT_XRC and ibv_get_srq_num(3), ibv_create_qp_ex(3) of
//! XRC_SEND and XRC_RECV QPs, ibv_open_qp(3), and traffic from an initiator to the SRQs of a
//! target's domain on the loopback device. Teardown rules a safe program cannot break (EBUSY)
//! are tested on the core in `crates/device/tests/xrc.rs`.

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::*;
use softverbs::*;

const EINVAL: i32 = 22;
const EAGAIN: i32 = 11;

fn tmp_file(tag: &str) -> (std::fs::File, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!(
        "softverbs-xrc-test-{tag}-{}-{:?}",
        std::process::id(),
        Instant::now()
    ));
    let f = std::fs::File::create(&path).unwrap();
    (f, path)
}

fn srq_attr() -> SrqAttr {
    SrqAttr {
        max_wr: 16,
        max_sge: 1,
        srq_limit: 0,
    }
}

/// Polls `cq` until it has returned `n` completions; fails after 10 s.
fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.len() < n {
        out.extend(drain(cq));
        assert!(Instant::now() < deadline, "only {} of {n} completions", out.len());
        std::thread::yield_now();
    }
    out
}

mod ibv_open_xrcd {
    use super::*;

    #[test]
    fn anonymous_domains_are_distinct() {
        let ctx = lo();
        let a = ctx.open_xrcd(None, 0).unwrap();
        let b = ctx.open_xrcd(None, O_CREAT | O_EXCL).unwrap();
        assert!(!a.same_domain(&b));
        assert!(a.same_domain(&a.clone()));
    }

    #[test]
    fn fd_domains_are_keyed_by_inode_with_o_creat_and_o_excl() {
        let ctx = lo();
        let (f, path) = tmp_file("inode");
        // No domain yet and no O_CREAT: EAGAIN.
        assert_eq!(ctx.open_xrcd(Some(f.as_fd()), 0).unwrap_err().errno(), EAGAIN);
        let a = ctx.open_xrcd(Some(f.as_fd()), O_CREAT).unwrap();
        // Now it exists: O_EXCL is EINVAL, a plain open shares it.
        assert_eq!(
            ctx.open_xrcd(Some(f.as_fd()), O_CREAT | O_EXCL)
                .unwrap_err()
                .errno(),
            EINVAL
        );
        let b = ctx.open_xrcd(Some(f.as_fd()), 0).unwrap();
        assert!(a.same_domain(&b));
        // Another fd of the same file (same inode) names the same domain, on another context too.
        let f2 = std::fs::File::open(&path).unwrap();
        let ctx2 = lo();
        let c = ctx2.open_xrcd(Some(f2.as_fd()), 0).unwrap();
        assert!(a.same_domain(&c));
        // Another file is another domain.
        let (g, gpath) = tmp_file("other");
        let d = ctx.open_xrcd(Some(g.as_fd()), O_CREAT).unwrap();
        assert!(!a.same_domain(&d));
        // The last close destroys it: opening without O_CREAT fails again.
        drop((a, b, c));
        assert_eq!(ctx.open_xrcd(Some(f.as_fd()), 0).unwrap_err().errno(), EAGAIN);
        drop(d);
        std::fs::remove_file(path).unwrap();
        std::fs::remove_file(gpath).unwrap();
    }
}

mod ibv_create_srq_ex {
    use super::*;

    #[test]
    fn srqs_have_unique_24_bit_numbers() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16, None, 0).unwrap();
        let x = ctx.open_xrcd(None, 0).unwrap();
        let srqs: Vec<_> = (0..4)
            .map(|_| x.create_srq(&pd, &cq, &srq_attr()).unwrap())
            .collect();
        let basic = pd.create_srq(&srq_attr()).unwrap();
        let nums: std::collections::BTreeSet<u32> = srqs
            .iter()
            .chain([&basic])
            .map(SharedReceiveQueue::srq_num)
            .collect();
        assert_eq!(nums.len(), 5);
        assert!(nums.iter().all(|&n| n <= 0xFF_FFFF && n != 0));
        assert!(srqs.iter().all(SharedReceiveQueue::is_xrc));
        // max_wr and max_sge at least what was asked.
        let a = srqs[0].query();
        assert!(a.max_wr >= 16 && a.max_sge >= 1);
        assert!(!basic.is_xrc());
        // Invalid sizes are EINVAL as for any SRQ.
        let bad = SrqAttr {
            max_wr: 0,
            ..srq_attr()
        };
        assert_eq!(x.create_srq(&pd, &cq, &bad).unwrap_err().errno(), EINVAL);
    }

    #[test]
    fn the_domain_pd_and_cq_must_share_a_context() {
        let (a, b) = (lo(), lo());
        let pd = a.alloc_pd().unwrap();
        let cq = b.create_cq(4, None, 0).unwrap();
        let x = a.open_xrcd(None, 0).unwrap();
        assert_eq!(x.create_srq(&pd, &cq, &srq_attr()).unwrap_err().errno(), EINVAL);
    }

    #[test]
    fn an_xrc_srq_cannot_be_attached_to_an_rc_qp() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4, None, 0).unwrap();
        let x = ctx.open_xrcd(None, 0).unwrap();
        let srq = x.create_srq(&pd, &cq, &srq_attr()).unwrap();
        let mut init = QpInit::new(QpType::Rc, &cq);
        init.srq = Some(&srq);
        assert_eq!(pd.create_qp(&init).unwrap_err().errno(), EINVAL);
    }
}

mod ibv_create_qp_ex {
    use super::*;

    #[test]
    fn xrc_send_has_no_receive_side_and_xrc_recv_needs_a_domain() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4, None, 0).unwrap();
        let ini = pd.create_qp(&QpInit::new(QpType::XrcSend, &cq)).unwrap();
        assert_eq!(ini.qp_type(), QpType::XrcSend);
        let cap = ini.cap();
        assert_eq!((cap.max_recv_wr, cap.max_recv_sge), (0, 0));
        assert!(cap.max_send_wr >= 16);
        assert_eq!(ini.post_recv(&[]).unwrap_err().error.errno(), EINVAL);
        // An XRC_RECV QP is created on a domain, not a PD.
        assert_eq!(
            pd.create_qp(&QpInit::new(QpType::XrcRecv, &cq))
                .unwrap_err()
                .errno(),
            EINVAL
        );
        let x = ctx.open_xrcd(None, 0).unwrap();
        let tgt = x.create_recv_qp().unwrap();
        assert_eq!(tgt.qp_type(), QpType::XrcRecv);
        assert_ne!(tgt.qp_num(), ini.qp_num());
        assert_eq!(tgt.post_recv(&[]).unwrap_err().error.errno(), EINVAL);
        // An XRC SRQ is not attached to an initiator either.
        let srq = x.create_srq(&pd, &cq, &srq_attr()).unwrap();
        let mut init = QpInit::new(QpType::XrcSend, &cq);
        init.srq = Some(&srq);
        assert_eq!(pd.create_qp(&init).unwrap_err().errno(), EINVAL);
    }

    #[test]
    fn modify_follows_the_xrc_rows_of_the_state_table() {
        let ctx = lo();
        let x = ctx.open_xrcd(None, 0).unwrap();
        let tgt = x.create_recv_qp().unwrap();
        // RESET->INIT needs PKEY_INDEX|PORT|ACCESS_FLAGS, as RC.
        let init = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            ..Default::default()
        };
        let e = tgt
            .modify(
                &init,
                QpAttrMask::STATE | QpAttrMask::PORT | QpAttrMask::PKEY_INDEX,
            )
            .unwrap_err();
        assert_eq!(e.errno(), EINVAL);
        assert!(e.to_string().contains("IBV_QP_ACCESS_FLAGS"), "{e}");
        xrc_up(&ctx, &tgt, 0x11);
        assert_eq!(tgt.state(), QpState::Rts);
        // The other half's attributes are ignored, as the kernel does (perftest passes the RC
        // sets): the initiator takes the responder ones at RTR.
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4, None, 0).unwrap();
        let ini = pd.create_qp(&QpInit::new(QpType::XrcSend, &cq)).unwrap();
        ini.modify(
            &QpAttr {
                qp_state: QpState::Init,
                port_num: 1,
                ..Default::default()
            },
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
        )
        .unwrap();
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            ah_attr: ah_attr(&ctx),
            path_mtu: Mtu::Mtu1024,
            dest_qp_num: tgt.qp_num(),
            max_dest_rd_atomic: 4,
            min_rnr_timer: 12,
            ..Default::default()
        };
        let rc_rtr = QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER;
        ini.modify(&rtr, rc_rtr).unwrap();
        assert_eq!(ini.state(), QpState::Rtr);
        // Attributes no half takes are still refused.
        let e = ini
            .modify(
                &QpAttr {
                    qp_state: QpState::Rtr,
                    qkey: 1,
                    ..Default::default()
                },
                QpAttrMask::STATE | QpAttrMask::QKEY,
            )
            .unwrap_err();
        assert_eq!(e.errno(), EINVAL);
        // The target sends nothing.
        let req = SendRequest {
            wr_id: 1,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![]),
            ud: None,
            xrc_srqn: Some(1),
        };
        assert_eq!(tgt.post_send(&[req]).unwrap_err().error.errno(), EINVAL);
    }
}

mod ibv_open_qp {
    use super::*;

    #[test]
    fn opens_xrc_recv_qps_of_the_same_domain_only() {
        let ctx = lo();
        let (f, path) = tmp_file("openqp");
        let x1 = ctx.open_xrcd(Some(f.as_fd()), O_CREAT).unwrap();
        let x2 = ctx.open_xrcd(Some(f.as_fd()), 0).unwrap();
        let other = ctx.open_xrcd(None, 0).unwrap();
        let tgt = x1.create_recv_qp().unwrap();
        let opened = x2.open_qp(tgt.qp_num(), QpType::XrcRecv).unwrap();
        assert_eq!(opened.qp_num(), tgt.qp_num());
        assert_eq!(opened.qp_type(), QpType::XrcRecv);
        // Another domain, another type, or another kind of QP: EINVAL.
        assert_eq!(
            other.open_qp(tgt.qp_num(), QpType::XrcRecv).unwrap_err().errno(),
            EINVAL
        );
        assert_eq!(x2.open_qp(tgt.qp_num(), QpType::Rc).unwrap_err().errno(), EINVAL);
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4, None, 0).unwrap();
        let rc = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
        assert_eq!(
            x1.open_qp(rc.qp_num(), QpType::XrcRecv).unwrap_err().errno(),
            EINVAL
        );
        // Closing the creator's handle leaves the QP to the opener: it can still be modified
        // and opened again.
        let qpn = tgt.qp_num();
        drop(tgt);
        xrc_up(&ctx, &opened, 0x11);
        assert_eq!(opened.state(), QpState::Rts);
        let again = x1.open_qp(qpn, QpType::XrcRecv).unwrap();
        drop((opened, again));
        // The last handle destroyed it.
        assert_eq!(x1.open_qp(qpn, QpType::XrcRecv).unwrap_err().errno(), EINVAL);
        drop((x1, x2));
        std::fs::remove_file(path).unwrap();
    }
}

mod traffic {
    use super::*;

    /// A target's async events reach its creator and every `ibv_open_qp` handle, each in its
    /// own context and naming its own handle.
    #[test]
    fn async_events_reach_every_opener() {
        let (ca, cb, cc) = (lo(), lo(), lo());
        let (f, path) = tmp_file("events");
        let xb = cb.open_xrcd(Some(f.as_fd()), O_CREAT).unwrap();
        let xc = cc.open_xrcd(Some(f.as_fd()), 0).unwrap();
        let tgt = xb.create_recv_qp().unwrap();
        let opened = xc.open_qp(tgt.qp_num(), QpType::XrcRecv).unwrap();
        let pa = ca.alloc_pd().unwrap();
        let cq = ca.create_cq(4, None, 0).unwrap();
        let ini = pa.create_qp(&QpInit::new(QpType::XrcSend, &cq)).unwrap();
        xrc_up(&ca, &ini, tgt.qp_num());
        xrc_up(&cb, &opened, ini.qp_num());
        // A request for an SRQ the domain does not have: the target goes to ERR with an
        // access error, which both handles hear about.
        let req = SendRequest {
            wr_id: 1,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![]),
            ud: None,
            xrc_srqn: Some(0xAB_CDEF),
        };
        ini.post_send(&[req]).unwrap();
        assert_eq!(wait(&cq, 1)[0].status, WcStatus::RemAccessErr);
        for (ctx, handle) in [(&cb, &tgt), (&cc, &opened)] {
            let ev = ctx
                .get_async_event_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            assert_eq!(ev.event_type(), EventType::QpAccessErr);
            match ev.target() {
                AsyncEventTarget::Qp(q) => assert!(q.same_as(handle)),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(tgt.state(), QpState::Err);
        drop((opened, tgt, xb, xc));
        std::fs::remove_file(path).unwrap();
    }

    /// An initiator on one context sends to the SRQs of a target's domain on another (both on
    /// the loopback device): every receive completes on its SRQ's CQ with the target's QPN;
    /// WRITE, READ and atomics use keys of the SRQ's PD.
    #[test]
    fn initiator_to_the_srqs_of_a_targets_domain() {
        initiator_to_srqs(AccessFlags::empty());
    }

    /// The same on explicit on-demand-paging regions on both sides, as `xrc_odp_caps`
    /// advertises (SEND, SRQ receives, WRITE, READ, atomics).
    #[test]
    fn initiator_to_the_srqs_of_a_targets_domain_on_odp_regions() {
        initiator_to_srqs(AccessFlags::ON_DEMAND);
    }

    fn initiator_to_srqs(extra_access: AccessFlags) {
        let (ca, cb) = (lo(), lo());
        let pa = ca.alloc_pd().unwrap();
        let cqa = ca.create_cq(32, None, 0).unwrap();
        let ini = pa.create_qp(&QpInit::new(QpType::XrcSend, &cqa)).unwrap();
        let x = cb.open_xrcd(None, 0).unwrap();
        let tgt = x.create_recv_qp().unwrap();
        let (pb1, pb2) = (cb.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
        let (cq1, cq2) = (
            cb.create_cq(32, None, 0).unwrap(),
            cb.create_cq(32, None, 0).unwrap(),
        );
        let s1 = x.create_srq(&pb1, &cq1, &srq_attr()).unwrap();
        let s2 = x.create_srq(&pb2, &cq2, &srq_attr()).unwrap();
        xrc_up(&ca, &ini, tgt.qp_num());
        xrc_up(&cb, &tgt, ini.qp_num());

        let local = AccessFlags::LOCAL_WRITE | extra_access;
        let remote =
            local | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
        let m1 = pb1.register(4096, local).unwrap();
        let m2 = pb2.register(4096, remote).unwrap();
        s1.post_recv(&recv_wrs(&m1, 10..12, 4096)).unwrap();
        s2.post_recv(&recv_wrs(&m2, 20..21, 64)).unwrap();
        let src = pa.register(4096, remote).unwrap();
        src.write(0, b"to srq one").unwrap();
        src.write(100, b"to srq two").unwrap();
        m2.write(1024, &5u64.to_ne_bytes()).unwrap();
        let send = |wr_id, off: usize, len: usize, srqn| SendRequest {
            wr_id,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![src.sge(off..off + len).unwrap()]),
            ud: None,
            xrc_srqn: Some(srqn),
        };
        let (n1, n2) = (s1.srq_num(), s2.srq_num());
        let reqs = [
            send(1, 0, 10, n1),
            send(2, 100, 10, n2),
            SendRequest {
                op: SendOp::Write {
                    remote: m2.remote(512),
                    imm: None,
                },
                ..send(3, 0, 10, n2)
            },
            SendRequest {
                op: SendOp::Read {
                    remote: m2.remote(512),
                },
                ..send(4, 200, 10, n2)
            },
            SendRequest {
                op: SendOp::FetchAdd {
                    remote: m2.remote(1024),
                    add: 3,
                },
                ..send(5, 256, 8, n2)
            },
        ];
        ini.post_send(&reqs).unwrap();
        let wcs = wait(&cqa, 5);
        for (wc, id) in wcs.iter().zip(1..) {
            assert_eq!(
                (wc.wr_id, wc.status, wc.qp_num),
                (id, WcStatus::Success, ini.qp_num())
            );
        }
        let r1 = wait(&cq1, 1);
        assert_eq!(
            (r1[0].wr_id, r1[0].byte_len, r1[0].qp_num),
            (10, 10, tgt.qp_num())
        );
        assert_eq!(r1[0].opcode, WcOpcode::Recv);
        let r2 = wait(&cq2, 1);
        assert_eq!(
            (r2[0].wr_id, r2[0].qp_num, r2[0].src_qp),
            (20, tgt.qp_num(), ini.qp_num())
        );
        assert_eq!(&m1.to_vec()[..10], b"to srq one");
        assert_eq!(&m2.to_vec()[..10], b"to srq two");
        assert_eq!(&m2.to_vec()[512..522], b"to srq one");
        assert_eq!(&src.to_vec()[200..210], b"to srq one");
        assert_eq!(src.read_u64(256).unwrap(), 5);
        assert_eq!(m2.read_u64(1024).unwrap(), 8);
        assert!(drain(&cq1).is_empty() && drain(&cq2).is_empty());

        // A WRITE with a key of PD 2 through the SRQ of PD 1: remote access error.
        let bad = SendRequest {
            op: SendOp::Write {
                remote: m2.remote(0),
                imm: None,
            },
            ..send(6, 0, 10, n1)
        };
        ini.post_send(&[bad]).unwrap();
        let wcs = wait(&cqa, 1);
        assert_eq!((wcs[0].wr_id, wcs[0].status), (6, WcStatus::RemAccessErr));
        assert_eq!(ini.state(), QpState::Err);
    }

    #[test]
    fn an_initiator_send_needs_a_remote_srqn() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4, None, 0).unwrap();
        let ini = pd.create_qp(&QpInit::new(QpType::XrcSend, &cq)).unwrap();
        xrc_up(&ctx, &ini, 0x11);
        let req = SendRequest {
            wr_id: 1,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![]),
            ud: None,
            xrc_srqn: None,
        };
        assert_eq!(ini.post_send(&[req]).unwrap_err().error.errno(), EINVAL);
    }
}
