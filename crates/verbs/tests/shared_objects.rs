//! Device memory, thread and parent domains, and objects shared between contexts through the
//! command fd, through the safe API: the man pages' errors and traffic that uses them.

mod common;

use std::time::{Duration, Instant};

use common::*;
use softverbs::*;

const ALL_ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

fn errno<T: std::fmt::Debug>(r: Result<T>) -> i32 {
    r.expect_err("the call should fail").errno()
}

/// A connected RC QP on `pd` with its own CQ.
fn rc_qp(ctx: &Context, pd: &ProtectionDomain) -> (CompletionQueue, QueuePair) {
    let cq = ctx.create_cq(64, None, 0).unwrap();
    let mut init = QpInit::new(QpType::Rc, &cq);
    init.cap.max_send_sge = 2;
    init.cap.max_recv_sge = 2;
    let qp = pd.create_qp(&init).unwrap();
    (cq, qp)
}

fn connect(ctx_a: &Context, a: &QueuePair, ctx_b: &Context, b: &QueuePair) {
    to_rts(ctx_a, a, b.qp_num());
    to_rts(ctx_b, b, a.qp_num());
    for qp in [a, b] {
        let attr = QpAttr {
            qp_state: QpState::Rts,
            qp_access_flags: ALL_ACCESS - AccessFlags::LOCAL_WRITE,
            ..Default::default()
        };
        qp.modify(&attr, QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS)
            .unwrap();
    }
}

fn post(qp: &QueuePair, wr_id: u64, op: SendOp, sges: Vec<Sge>) {
    qp.post_send(&[SendRequest {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(sges),
        ud: None,
        xrc_srqn: None,
    }])
    .unwrap();
}

/// The next completion of `cq` (bounded in time).
fn next(cq: &CompletionQueue) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wc = [WorkCompletion::default(); 1];
    while cq.poll(&mut wc) == 0 {
        assert!(Instant::now() < deadline, "no completion");
    }
    wc[0]
}

fn send_op() -> SendOp {
    SendOp::Send {
        imm: None,
        invalidate: None,
    }
}

mod device_memory {
    use super::*;

    #[test]
    fn allocation_errors_follow_the_man_page() {
        let ctx = lo_with("max_dm_size=8192");
        assert_eq!(ctx.max_dm_size(), 8192);
        assert_eq!(errno(ctx.alloc_dm(0, 0)), 22, "0 bytes");
        assert_eq!(errno(ctx.alloc_dm(8193, 0)), 22, "more than max_dm_size");
        assert_eq!(errno(ctx.alloc_dm(64, 13)), 22, "alignment above 4 KiB");
        let a = ctx.alloc_dm(6000, 12).unwrap();
        assert_eq!(errno(ctx.alloc_dm(4096, 0)), 12, "the total is limited: ENOMEM");
        let b = ctx.alloc_dm(2192, 3).unwrap();
        drop(a);
        let c = ctx.alloc_dm(6000, 0).unwrap();
        assert_ne!(b.handle(), c.handle());
    }

    #[test]
    fn copies_are_bounds_checked() {
        let ctx = lo();
        let dm = ctx.alloc_dm(100, 0).unwrap();
        assert_eq!(dm.len(), 100);
        dm.copy_to(90, b"0123456789").unwrap();
        let mut got = [0u8; 10];
        dm.copy_from(90, &mut got).unwrap();
        assert_eq!(&got, b"0123456789");
        assert_eq!(errno(dm.copy_to(91, b"0123456789")), 22);
        assert_eq!(errno(dm.copy_from(u64::MAX, &mut got)), 22);
        let mut zero = [1u8; 8];
        dm.copy_from(0, &mut zero).unwrap();
        assert_eq!(zero, [0; 8], "device memory starts zeroed");
    }

    #[test]
    fn registration_is_zero_based_and_needs_the_flag() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let dm = ctx.alloc_dm(4096, 0).unwrap();
        assert_eq!(errno(pd.register_dm(&dm, 0, 4096, AccessFlags::LOCAL_WRITE)), 22);
        let zb = AccessFlags::LOCAL_WRITE | AccessFlags::ZERO_BASED;
        assert_eq!(errno(pd.register_dm(&dm, 4000, 100, zb)), 22, "past the end");
        let mr = pd.register_dm(&dm, 1000, 100, zb).unwrap();
        assert_eq!((mr.addr(), mr.len()), (0, 100));
        mr.write(10, b"via the region").unwrap();
        let mut got = [0u8; 14];
        dm.copy_from(1010, &mut got).unwrap();
        assert_eq!(&got, b"via the region");
        mr.fill(7);
        let mut around = [0u8; 102];
        dm.copy_from(999, &mut around).unwrap();
        assert_eq!((around[0], around[1], around[100], around[101]), (0, 7, 7, 0));
        assert_eq!(mr.to_vec(), vec![7u8; 100]);
    }

    #[test]
    fn local_and_remote_traffic_reaches_device_memory() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let dm = ctx.alloc_dm(8192, 3).unwrap();
        let dmr = pd
            .register_dm(&dm, 4096, 4096, ALL_ACCESS | AccessFlags::ZERO_BASED)
            .unwrap();
        let host = pd.register(4096, ALL_ACCESS).unwrap();
        let (cq_a, a) = rc_qp(&ctx, &pd);
        let (cq_b, b) = rc_qp(&ctx, &pd);
        connect(&ctx, &a, &ctx, &b);

        // A receive scatters into the DM region at offset 8.
        b.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: vec![dmr.sge(8..72).unwrap()],
        }])
        .unwrap();
        host.write(0, b"to device memory").unwrap();
        post(&a, 2, send_op(), vec![host.sge(0..16).unwrap()]);
        assert_eq!(next(&cq_a).status, WcStatus::Success);
        let r = next(&cq_b);
        assert_eq!((r.status, r.byte_len), (WcStatus::Success, 16));
        let mut got = [0u8; 16];
        dm.copy_from(4096 + 8, &mut got).unwrap();
        assert_eq!(&got, b"to device memory");

        // RDMA WRITE by rkey and offset, READ back, and an atomic on the DM.
        host.write(100, b"remote").unwrap();
        post(
            &a,
            3,
            SendOp::Write {
                remote: RemoteAddr {
                    addr: 512,
                    rkey: dmr.rkey(),
                },
                imm: None,
            },
            vec![host.sge(100..106).unwrap()],
        );
        assert_eq!(next(&cq_a).status, WcStatus::Success);
        let mut got = [0u8; 6];
        dm.copy_from(4096 + 512, &mut got).unwrap();
        assert_eq!(&got, b"remote");
        post(
            &b,
            4,
            SendOp::Read {
                remote: RemoteAddr {
                    addr: 512,
                    rkey: dmr.rkey(),
                },
            },
            vec![host.sge(200..206).unwrap()],
        );
        assert_eq!(next(&cq_b).status, WcStatus::Success);
        let mut back = [0u8; 6];
        host.read(200, &mut back).unwrap();
        assert_eq!(&back, b"remote");
        dm.copy_to(4096 + 1024, &40u64.to_ne_bytes()).unwrap();
        post(
            &a,
            5,
            SendOp::FetchAdd {
                remote: RemoteAddr {
                    addr: 1024,
                    rkey: dmr.rkey(),
                },
                add: 2,
            },
            vec![host.sge(0..8).unwrap()],
        );
        assert_eq!(next(&cq_a).status, WcStatus::Success);
        assert_eq!(host.read_u64(0).unwrap(), 40, "the old value comes back");
        assert_eq!(dmr.read_u64(1024).unwrap(), 42);

        // Past the end of the region: a remote access error.
        post(
            &a,
            6,
            SendOp::Write {
                remote: RemoteAddr {
                    addr: 4092,
                    rkey: dmr.rkey(),
                },
                imm: None,
            },
            vec![host.sge(100..106).unwrap()],
        );
        assert_eq!(next(&cq_a).status, WcStatus::RemAccessErr);
    }

    #[test]
    fn memory_is_returned_after_the_last_region() {
        let ctx = lo_with("max_dm_size=4096");
        let pd = ctx.alloc_pd().unwrap();
        let dm = ctx.alloc_dm(4096, 0).unwrap();
        let mr = pd
            .register_dm(&dm, 0, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::ZERO_BASED)
            .unwrap();
        drop(dm);
        assert_eq!(errno(ctx.alloc_dm(1, 0)), 12, "the region keeps the DM");
        drop(mr);
        ctx.alloc_dm(4096, 0).unwrap();
    }
}

mod parent_domain {
    use super::*;

    #[test]
    fn qps_of_a_parent_domain_carry_traffic() {
        let ctx = lo();
        let td = ctx.alloc_td().unwrap();
        let inner = ctx.alloc_pd().unwrap();
        let parent = inner.alloc_parent_domain(Some(&td)).unwrap();
        assert!(parent.is_parent_domain() && !inner.is_parent_domain());
        assert!(parent.thread_domain().is_some());
        assert_eq!(parent.handle(), inner.handle());
        assert_eq!(
            errno(parent.alloc_parent_domain(None)),
            22,
            "nested parent domain"
        );
        // The handles may go in any order: the parent domain keeps the PD and TD.
        drop(inner);
        drop(td);
        let mr = parent.register(4096, ALL_ACCESS).unwrap();
        let (cq_a, a) = rc_qp(&ctx, &parent);
        let (cq_b, b) = rc_qp(&ctx, &parent);
        connect(&ctx, &a, &ctx, &b);
        for i in 0..20u64 {
            b.post_recv(&[RecvWr {
                wr_id: i,
                sg_list: vec![mr.sge(1024..2048).unwrap()],
            }])
            .unwrap();
            mr.write(0, &i.to_ne_bytes()).unwrap();
            post(&a, i, send_op(), vec![mr.sge(0..8).unwrap()]);
            assert_eq!(next(&cq_a).status, WcStatus::Success);
            assert_eq!(next(&cq_b).byte_len, 8);
            let mut got = [0u8; 8];
            mr.read(1024, &mut got).unwrap();
            assert_eq!(u64::from_ne_bytes(got), i);
        }
    }

    #[test]
    fn a_thread_domain_of_another_context_is_refused() {
        let ctx = lo();
        let other = lo();
        let td = other.alloc_td().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        assert_eq!(errno(pd.alloc_parent_domain(Some(&td))), 22);
        pd.alloc_parent_domain(None).unwrap();
    }
}

mod import {
    use super::*;

    #[test]
    fn an_imported_context_shares_pd_mr_and_dm() {
        let ctx = lo();
        assert!(ctx.cmd_fd() >= 0);
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(4096, ALL_ACCESS).unwrap();
        let ctx2 = ctx.import_shared().unwrap();
        assert_ne!(ctx2.cmd_fd(), ctx.cmd_fd());
        assert_eq!(errno(ctx2.import_pd(0xdead_beef)), 22);
        let pd2 = ctx2.import_pd(pd.handle()).unwrap();
        assert!(pd2.is_imported());
        assert_eq!(errno(pd2.import_mr(pd.handle())), 22, "a PD's handle is no MR");
        let mr2 = pd2.import_mr(mr.handle()).unwrap();
        assert_eq!((mr2.lkey(), mr2.rkey(), mr2.len()), (mr.lkey(), mr.rkey(), 4096));

        // A QP of the second context on the imported PD writes with the imported MR's key
        // into the first context's region.
        let (cq_a, a) = rc_qp(&ctx, &pd);
        let (cq_b, b) = rc_qp(&ctx2, &pd2);
        connect(&ctx, &a, &ctx2, &b);
        mr2.write(0, b"shared").unwrap();
        post(
            &b,
            1,
            SendOp::Write {
                remote: mr.remote(2048),
                imm: None,
            },
            vec![mr2.sge(0..6).unwrap()],
        );
        assert_eq!(next(&cq_b).status, WcStatus::Success);
        let mut got = [0u8; 6];
        mr.read(2048, &mut got).unwrap();
        assert_eq!(&got, b"shared");
        drop(cq_a);

        // Unimporting leaves the object to its owner.
        let handle = mr.handle();
        drop(mr2);
        drop(b);
        let again = pd2.import_mr(handle).unwrap();
        drop(again);
        drop(a);
        drop(mr);
        assert_eq!(errno(pd2.import_mr(handle)), 22, "deregistered for every sharer");

        let dm = ctx.alloc_dm(64, 0).unwrap();
        let dm2 = ctx2.import_dm(dm.handle()).unwrap();
        dm.copy_to(0, b"dm").unwrap();
        let mut two = [0u8; 2];
        dm2.copy_from(0, &mut two).unwrap();
        assert_eq!(&two, b"dm");
    }

    #[test]
    fn async_events_of_a_qp_on_an_imported_pd_reach_the_importing_context() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let ctx2 = ctx.import_shared().unwrap();
        let pd2 = ctx2.import_pd(pd.handle()).unwrap();
        let (_cq, qp) = rc_qp(&ctx2, &pd2);
        to_rts(&ctx2, &qp, 3);
        let attr = QpAttr {
            qp_state: QpState::Sqd,
            en_sqd_async_notify: true,
            ..Default::default()
        };
        qp.modify(&attr, QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY)
            .unwrap();
        let ev = ctx2
            .get_async_event_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert_eq!(ev.event_type(), EventType::SqDrained);
        assert!(matches!(ev.target(), AsyncEventTarget::Qp(q) if q.same_as(&qp)));
        assert_eq!(ctx.pending_async_events(), 0);
    }

    #[test]
    fn a_foreign_fd_is_refused() {
        let file = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(errno(Context::import_device(file.into())), 22);
        let other = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(errno(Context::import_device(other.into())), 22);
    }

    #[test]
    fn objects_of_the_imported_context_are_visible_to_the_first() {
        let ctx = lo();
        let ctx2 = ctx.import_shared().unwrap();
        let pd = ctx2.alloc_pd().unwrap();
        let back = ctx.import_pd(pd.handle()).unwrap();
        let mr = back.register(64, AccessFlags::LOCAL_WRITE).unwrap();
        drop(back);
        assert_eq!(mr.len(), 64);
        drop(mr);
        let handle = pd.handle();
        drop(pd);
        assert_eq!(errno(ctx.import_pd(handle)), 22);
    }
}
