//! Memory windows and memory-region re-registration through the safe API, between two
//! contexts on the loopback device: the man pages' statements and error cases
//! (`ibv_alloc_mw(3)`, `ibv_bind_mw(3)`, `ibv_post_send(3)`, `ibv_rereg_mr(3)`), and RC traffic
//! through windows and after every kind of re-registration.

mod common;

use std::time::Duration;

use common::*;
use softverbs::*;

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

const REMOTE: AccessFlags = AccessFlags::REMOTE_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);
const RW: AccessFlags = AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE);
/// A region windows can be bound to, with no remote rights of its own.
const BINDABLE: AccessFlags = AccessFlags::LOCAL_WRITE.union(AccessFlags::MW_BIND);

fn side() -> Side {
    let ctx = lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None, 0).unwrap();
    let mut init = QpInit::new(QpType::Rc, &cq);
    init.cap = QpCap {
        max_send_wr: 32,
        max_recv_wr: 32,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 0,
    };
    let qp = pd.create_qp(&init).unwrap();
    let mr = pd.register(8192, AccessFlags::LOCAL_WRITE).unwrap();
    Side { ctx, pd, cq, qp, mr }
}

fn pair() -> (Side, Side) {
    let (a, b) = (side(), side());
    for (s, dest) in [(&a, b.qp.qp_num()), (&b, a.qp.qp_num())] {
        to_rts(&s.ctx, &s.qp, dest);
        let attr = QpAttr {
            qp_state: QpState::Rts,
            qp_access_flags: REMOTE,
            ..Default::default()
        };
        s.qp.modify(&attr, QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS)
            .unwrap();
    }
    (a, b)
}

fn req(wr_id: u64, op: SendOp, sges: Vec<Sge>) -> SendRequest {
    SendRequest {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(sges),
        ud: None,
        xrc_srqn: None,
    }
}

/// Polls until `n` completions arrived (bounded in time).
fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < n {
        got.extend(drain(cq));
        assert!(std::time::Instant::now() < deadline, "timed out with {got:?}");
    }
    got
}

fn one(cq: &CompletionQueue) -> (u64, WcStatus, WcOpcode) {
    let w = wait(cq, 1);
    assert_eq!(w.len(), 1, "{w:?}");
    (w[0].wr_id, w[0].status, w[0].opcode)
}

fn write(wr_id: u64, remote: RemoteAddr, sge: Sge) -> SendRequest {
    req(wr_id, SendOp::Write { remote, imm: None }, vec![sge])
}

fn read(wr_id: u64, remote: RemoteAddr, sge: Sge) -> SendRequest {
    req(wr_id, SendOp::Read { remote }, vec![sge])
}

/// `b` binds a type 2 window over [1024, 5120) of `target` and returns it with its new key.
fn bound_type2(b: &Side, target: &MemoryRegion, access: AccessFlags) -> (MemoryWindow, u32) {
    let mw = b.pd.alloc_mw(MwType::Type2).unwrap();
    let rkey = inc_rkey(mw.rkey());
    b.qp.post_send(&[mw.bind_request(10, rkey, target, target.addr() + 1024, 4096, access)])
        .unwrap();
    assert_eq!(one(&b.cq), (10, WcStatus::Success, WcOpcode::BindMw));
    assert_eq!(mw.current(), (rkey, true));
    (mw, rkey)
}

#[test]
fn device_reports_memory_windows() {
    let ctx = lo();
    let attr = ctx.query_device();
    assert!(attr.max_mw > 0);
    assert_ne!(attr.device_cap_flags & (1 << 17), 0, "IBV_DEVICE_MEM_WINDOW");
    assert_ne!(
        attr.device_cap_flags & (1 << 24),
        0,
        "IBV_DEVICE_MEM_WINDOW_TYPE_2B"
    );
}

#[test]
fn window_keys_differ_and_max_mw_is_enforced() {
    let ctx = lo_with("max_mw=2");
    let pd = ctx.alloc_pd().unwrap();
    let w1 = pd.alloc_mw(MwType::Type1).unwrap();
    let w2 = pd.alloc_mw(MwType::Type2).unwrap();
    assert_ne!(w1.rkey() >> 8, w2.rkey() >> 8);
    assert_eq!((w1.mw_type(), w2.mw_type()), (MwType::Type1, MwType::Type2));
    assert_eq!(pd.alloc_mw(MwType::Type2).unwrap_err().errno(), 12, "ENOMEM");
    drop(w1);
    pd.alloc_mw(MwType::Type1).unwrap();
}

#[test]
fn type2_window_serves_write_and_read_until_local_invalidate() {
    let (a, b) = pair();
    let target = b.pd.register(8192, BINDABLE).unwrap();
    let (mw, rkey) = bound_type2(&b, &target, RW);
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13) as u8).collect();
    a.mr.write(0, &data).unwrap();
    let remote = RemoteAddr {
        addr: target.addr() + 1024,
        rkey,
    };
    a.qp.post_send(&[write(1, remote, a.mr.sge(0..4096).unwrap())])
        .unwrap();
    assert_eq!(one(&a.cq), (1, WcStatus::Success, WcOpcode::RdmaWrite));
    let mut got = vec![0u8; 4096];
    target.read(1024, &mut got).unwrap();
    assert_eq!(got, data);
    a.qp.post_send(&[read(2, remote, a.mr.sge(4096..8192).unwrap())])
        .unwrap();
    assert_eq!(one(&a.cq), (2, WcStatus::Success, WcOpcode::RdmaRead));
    a.mr.read(4096, &mut got).unwrap();
    assert_eq!(got, data);
    // LOCAL_INV: the window is free again and the peer's next access fails.
    b.qp.post_send(&[req(11, SendOp::LocalInv { rkey }, vec![])])
        .unwrap();
    assert_eq!(one(&b.cq), (11, WcStatus::Success, WcOpcode::LocalInv));
    assert_eq!(mw.current(), (rkey, false));
    a.mr.fill(0xEE);
    a.qp.post_send(&[write(3, remote, a.mr.sge(0..64).unwrap())])
        .unwrap();
    assert_eq!(one(&a.cq), (3, WcStatus::RemAccessErr, WcOpcode::RdmaWrite));
    target.read(1024, &mut got).unwrap();
    assert_eq!(got, data, "the target memory is untouched");
}

#[test]
fn send_with_invalidate_frees_the_window_before_the_receive_completes() {
    let (a, b) = pair();
    let target = b.pd.register(8192, BINDABLE).unwrap();
    let (mw, rkey) = bound_type2(&b, &target, RW);
    b.qp.post_recv(&recv_wrs(&b.mr, 20..21, 64)).unwrap();
    let inv = SendOp::Send {
        imm: None,
        invalidate: Some(rkey),
    };
    a.qp.post_send(&[req(1, inv, vec![a.mr.sge(0..64).unwrap()])])
        .unwrap();
    assert_eq!(one(&a.cq), (1, WcStatus::Success, WcOpcode::Send));
    let r = wait(&b.cq, 1);
    assert_eq!((r[0].wr_id, r[0].status), (20, WcStatus::Success));
    assert!(r[0].wc_flags.contains(WcFlags::WITH_INV));
    assert_eq!(r[0].imm_data, rkey, "invalidated_rkey");
    // By the time the receive completed, the window was free.
    assert_eq!(mw.current(), (rkey, false));
    let remote = RemoteAddr {
        addr: target.addr() + 1024,
        rkey,
    };
    a.qp.post_send(&[read(2, remote, a.mr.sge(0..64).unwrap())])
        .unwrap();
    assert_eq!(one(&a.cq).1, WcStatus::RemAccessErr);
}

#[test]
fn ibv_bind_mw_binds_type1_windows_only_and_checks_its_arguments() {
    let (a, b) = pair();
    let target = b.pd.register(8192, BINDABLE).unwrap();
    let other_pd = b.ctx.alloc_pd().unwrap();
    let foreign = other_pd.register(64, BINDABLE).unwrap();
    let t1 = b.pd.alloc_mw(MwType::Type1).unwrap();
    let t2 = b.pd.alloc_mw(MwType::Type2).unwrap();
    let info = MwBindInfo {
        wr_id: 5,
        send_flags: SendFlags::SIGNALED,
        mr: Some(&target),
        addr: target.addr(),
        length: 4096,
        access: AccessFlags::REMOTE_READ,
    };
    assert_eq!(t2.bind(&b.qp, &info).unwrap_err().errno(), 22, "type 2: EINVAL");
    let no_mr = MwBindInfo { mr: None, ..info };
    assert_eq!(
        t1.bind(&b.qp, &no_mr).unwrap_err().errno(),
        22,
        "addr without MR: EINVAL"
    );
    let other = MwBindInfo {
        mr: Some(&foreign),
        addr: foreign.addr(),
        length: 64,
        ..info
    };
    assert_eq!(
        t1.bind(&b.qp, &other).unwrap_err().errno(),
        1,
        "MR of another PD: EPERM"
    );
    let old = t1.rkey();
    let new = t1.bind(&b.qp, &info).unwrap();
    assert_eq!(new, inc_rkey(old));
    assert_eq!(t1.rkey(), new, "mw->rkey is updated at post time");
    assert_eq!(one(&b.cq), (5, WcStatus::Success, WcOpcode::BindMw));
    target.write(100, &[7; 32]).unwrap();
    let remote = RemoteAddr {
        addr: target.addr() + 100,
        rkey: new,
    };
    a.qp.post_send(&[read(1, remote, a.mr.sge(0..32).unwrap())])
        .unwrap();
    assert_eq!(one(&a.cq), (1, WcStatus::Success, WcOpcode::RdmaRead));
    let mut got = [0u8; 32];
    a.mr.read(0, &mut got).unwrap();
    assert_eq!(got, [7; 32]);
    // Unbind: no region, address and length 0.
    let unbind = MwBindInfo {
        mr: None,
        addr: 0,
        length: 0,
        ..info
    };
    let newer = t1.bind(&b.qp, &unbind).unwrap();
    assert_eq!(newer, inc_rkey(new));
    assert_eq!(one(&b.cq).1, WcStatus::Success);
    a.qp.post_send(&[read(2, remote, a.mr.sge(0..32).unwrap())])
        .unwrap();
    assert_eq!(one(&a.cq).1, WcStatus::RemAccessErr);
}

#[test]
fn a_failed_bind_completes_with_mw_bind_err_and_the_qp_fails() {
    let (_a, b) = pair();
    // No IBV_ACCESS_MW_BIND on the region.
    let target = b.pd.register(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let mw = b.pd.alloc_mw(MwType::Type2).unwrap();
    let rkey = inc_rkey(mw.rkey());
    b.qp.post_send(&[
        mw.bind_request(1, rkey, &target, target.addr(), 64, AccessFlags::REMOTE_READ),
        req(2, SendOp::LocalInv { rkey }, vec![]),
    ])
    .unwrap();
    let w = wait(&b.cq, 2);
    assert_eq!(
        (w[0].wr_id, w[0].status, w[0].opcode),
        (1, WcStatus::MwBindErr, WcOpcode::BindMw)
    );
    assert_eq!((w[1].wr_id, w[1].status), (2, WcStatus::WrFlushErr));
    assert_eq!(b.qp.state(), QpState::Err);
    assert!(!mw.current().1);
}

#[test]
fn bound_windows_keep_their_region_registered() {
    let (_a, b) = pair();
    let mut target = b.pd.register(8192, BINDABLE).unwrap();
    let (mw, rkey) = bound_type2(&b, &target, AccessFlags::REMOTE_READ);
    // ibv_dereg_mr and ibv_rereg_mr: EBUSY while a window is bound.
    let change = Rereg {
        access: Some(BINDABLE | AccessFlags::REMOTE_READ),
        ..Rereg::default()
    };
    assert_eq!(target.rereg(change).unwrap_err().errno(), 16);
    let (target, e) = target.dereg().unwrap_err();
    assert_eq!(e.errno(), 16);
    b.qp.post_send(&[req(11, SendOp::LocalInv { rkey }, vec![])])
        .unwrap();
    assert_eq!(one(&b.cq).1, WcStatus::Success);
    target.dereg().unwrap();
    // Deallocating a bound window unbinds it, releasing its region.
    let target = b.pd.register(8192, BINDABLE).unwrap();
    let (mw2, _) = bound_type2(&b, &target, AccessFlags::REMOTE_READ);
    drop(mw2);
    target.dereg().unwrap();
    drop(mw);
}

#[test]
fn destroying_the_qp_frees_its_type2_windows() {
    let (_a, b) = pair();
    let target = b.pd.register(8192, BINDABLE).unwrap();
    let (mw, rkey) = bound_type2(&b, &target, AccessFlags::REMOTE_READ);
    let Side { qp, .. } = b;
    drop(qp);
    assert_eq!(mw.current(), (rkey, false));
    target.dereg().unwrap();
}

#[test]
fn local_invalidate_of_a_type1_window_fails_with_loc_qp_op_err() {
    let (_a, b) = pair();
    let target = b.pd.register(4096, BINDABLE).unwrap();
    let t1 = b.pd.alloc_mw(MwType::Type1).unwrap();
    let info = MwBindInfo {
        wr_id: 1,
        send_flags: SendFlags::SIGNALED,
        mr: Some(&target),
        addr: target.addr(),
        length: 64,
        access: AccessFlags::REMOTE_READ,
    };
    let rkey = t1.bind(&b.qp, &info).unwrap();
    assert_eq!(one(&b.cq).1, WcStatus::Success);
    b.qp.post_send(&[req(2, SendOp::LocalInv { rkey }, vec![])])
        .unwrap();
    assert_eq!(one(&b.cq), (2, WcStatus::LocQpOpErr, WcOpcode::LocalInv));
}

#[test]
fn bind_and_local_inv_carry_no_data() {
    let (_a, b) = pair();
    let mw = b.pd.alloc_mw(MwType::Type2).unwrap();
    let e =
        b.qp.post_send(&[req(
            1,
            SendOp::LocalInv { rkey: mw.rkey() },
            vec![b.mr.sge(0..8).unwrap()],
        )])
        .unwrap_err();
    assert_eq!((e.index, e.error.errno()), (0, 22));
}

mod rereg {
    use super::*;

    /// `a` writes 64 bytes of `fill` through `rkey` at `addr` and reads them back.
    fn traffic(a: &Side, addr: u64, rkey: u32, fill: u8) -> WcStatus {
        a.mr.fill(fill);
        let remote = RemoteAddr { addr, rkey };
        a.qp.post_send(&[write(1, remote, a.mr.sge(0..64).unwrap())])
            .unwrap();
        let (_, status, _) = one(&a.cq);
        if status != WcStatus::Success {
            return status;
        }
        a.qp.post_send(&[read(2, remote, a.mr.sge(64..128).unwrap())])
            .unwrap();
        let (_, status, _) = one(&a.cq);
        let mut got = [0u8; 64];
        a.mr.read(64, &mut got).unwrap();
        assert_eq!(got, [fill; 64]);
        status
    }

    #[test]
    fn access_change_keeps_the_keys_and_rc_traffic_follows_the_new_rights() {
        let (a, b) = pair();
        let mut mr = b.pd.register(4096, AccessFlags::LOCAL_WRITE).unwrap();
        let (lkey, rkey) = (mr.lkey(), mr.rkey());
        mr.rereg(Rereg {
            access: Some(AccessFlags::LOCAL_WRITE | RW),
            ..Rereg::default()
        })
        .unwrap();
        assert_eq!((mr.lkey(), mr.rkey()), (lkey, rkey));
        assert_eq!(mr.access(), AccessFlags::LOCAL_WRITE | RW);
        assert_eq!(traffic(&a, mr.addr(), rkey, 0x11), WcStatus::Success);
        let mut got = [0u8; 64];
        mr.read(0, &mut got).unwrap();
        assert_eq!(got, [0x11; 64]);
    }

    #[test]
    fn removing_remote_write_makes_the_next_write_fail() {
        let (a, b) = pair();
        let mut mr = b.pd.register(4096, AccessFlags::LOCAL_WRITE | RW).unwrap();
        assert_eq!(traffic(&a, mr.addr(), mr.rkey(), 1), WcStatus::Success);
        mr.rereg(Rereg {
            access: Some(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ),
            ..Rereg::default()
        })
        .unwrap();
        assert_eq!(traffic(&a, mr.addr(), mr.rkey(), 2), WcStatus::RemAccessErr);
    }

    #[test]
    fn translation_change_moves_the_region_and_rc_traffic_reaches_the_new_memory() {
        let (a, b) = pair();
        let mut mr = b.pd.register(4096, AccessFlags::LOCAL_WRITE | RW).unwrap();
        let (old_addr, rkey) = (mr.addr(), mr.rkey());
        mr.rereg(Rereg {
            len: Some(16384),
            ..Rereg::default()
        })
        .unwrap();
        assert_eq!(mr.len(), 16384);
        assert_eq!(mr.rkey(), rkey);
        assert_ne!(mr.addr(), old_addr);
        assert_eq!(traffic(&a, mr.addr() + 12000, rkey, 0x22), WcStatus::Success);
        let mut got = [0u8; 64];
        mr.read(12000, &mut got).unwrap();
        assert_eq!(got, [0x22; 64]);
        // The old addresses are outside the region now.
        assert_eq!(traffic(&a, old_addr, rkey, 0x23), WcStatus::RemAccessErr);
    }

    #[test]
    fn pd_change_lets_the_qps_of_the_new_pd_use_the_region() {
        let (a, b) = pair();
        let other = b.ctx.alloc_pd().unwrap();
        let mut mr = other.register(4096, AccessFlags::LOCAL_WRITE | RW).unwrap();
        mr.rereg(Rereg {
            pd: Some(&b.pd),
            ..Rereg::default()
        })
        .unwrap();
        // The old PD is free to go; the QP of the new one reaches the region.
        drop(other);
        assert_eq!(traffic(&a, mr.addr(), mr.rkey(), 0x33), WcStatus::Success);
        // And local work requests of that QP may use it too.
        b.qp.post_send(&[write(
            7,
            RemoteAddr {
                addr: a.mr.addr(),
                rkey: 0,
            },
            mr.sge(0..8).unwrap(),
        )])
        .unwrap();
        // rkey 0 names nothing at the peer: the failure is remote, so the gather succeeded.
        assert_eq!(one(&b.cq).1, WcStatus::RemAccessErr);
    }

    #[test]
    fn man_page_errors() {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let mut mr = pd.register(4096, AccessFlags::LOCAL_WRITE).unwrap();
        assert_eq!(mr.rereg(Rereg::default()).unwrap_err().errno(), 22, "no flags");
        let zero = Rereg {
            len: Some(0),
            ..Rereg::default()
        };
        assert_eq!(mr.rereg(zero).unwrap_err().errno(), 22, "length 0");
        let bad = Rereg {
            access: Some(AccessFlags::REMOTE_WRITE),
            ..Rereg::default()
        };
        assert_eq!(
            mr.rereg(bad).unwrap_err().errno(),
            22,
            "remote write without local write"
        );
        let odp = Rereg {
            access: Some(AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND),
            ..Rereg::default()
        };
        assert_eq!(
            mr.rereg(odp).unwrap_err().errno(),
            95,
            "ODP without a new translation"
        );
        assert_eq!(mr.access(), AccessFlags::LOCAL_WRITE, "unchanged after errors");
        mr.rereg(Rereg {
            len: Some(4096),
            ..odp
        })
        .unwrap();
        assert_eq!(mr.access(), AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND);
        let other_ctx = lo();
        let foreign = other_ctx.alloc_pd().unwrap();
        // Another context on the same device is fine (contexts share the device).
        mr.rereg(Rereg {
            pd: Some(&foreign),
            ..Rereg::default()
        })
        .unwrap();
    }
}
