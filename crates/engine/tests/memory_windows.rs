//! Memory windows on the simulated fabric: BIND_MW and LOCAL_INV execute in send-queue order
//! and complete in posting order, remote access through a bound window works and stops once it
//! is invalidated (locally, or by the peer's SEND with Invalidate, which takes effect before the
//! receive completes), and every failure ends with the status the verbs name. Most tests run
//! under loss, duplication and reordering for several seeds.

mod sim;

use sim::*;
use softverbs_engine::memory::MemError;
use softverbs_engine::mw::{inc_rkey, MwBind, MwType};
use softverbs_engine::types::{AccessFlags, Mtu, QpState, QpType, SendFlags, WcFlags, WcOpcode, WcStatus};
use softverbs_engine::wr::RemoteAddr;

const SEEDS: [u64; 4] = [1, 0xC0FFEE, 0x5EED_0003, 42];

fn lossy_pair(seed: u64, loss: f64) -> (Sim, QpId, QpId) {
    let o = ConnOpts {
        mtu: Mtu::Mtu1024,
        timeout: 8,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(seed, QpType::Rc, &o);
    sim.net = NetConfig {
        corrupt_pct: loss / 4.0,
        ..NetConfig::lossy(loss)
    };
    (sim, a, b)
}

/// A region that windows may be bound to.
fn bindable() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND
}

fn bind_req(mw: u32, mr: &Mr, offset: u64, length: u64, access: AccessFlags) -> MwBind {
    MwBind {
        mw_rkey: mw,
        new_rkey: inc_rkey(mw),
        mr_lkey: mr.lkey,
        addr: mr.addr + offset,
        length,
        access,
    }
}

const RW: AccessFlags = AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE);

#[test]
fn write_and_read_through_a_window_until_local_invalidate() {
    for seed in SEEDS {
        let (mut sim, a, b) = lossy_pair(seed, 5.0);
        let src = sim.mem(0).alloc_mr(1, 8192, AccessFlags::LOCAL_WRITE);
        let target = sim.mem(1).alloc_mr(1, 16384, bindable());
        let mw = sim.mem(1).alloc_mw(1, MwType::Type2);
        // The window covers [4096, 12288) of the region; its new key comes from the bind.
        let bind = bind_req(mw, &target, 4096, 8192, RW);
        sim.post_send(b, bind_mw(10, bind));
        sim.run();
        let s = sim.take_send_cq(b);
        assert_ok_in_order(&s, &[10]);
        assert_eq!(s[0].opcode, WcOpcode::BindMw);
        let rkey = bind.new_rkey;
        assert_eq!(sim.mem(1).window(mw).rkey, rkey);

        let data = sim.rng.bytes(8192);
        sim.mem(0).poke(src.addr, &data);
        let remote = RemoteAddr {
            addr: target.addr + 4096,
            rkey,
        };
        sim.post_send(a, write(1, remote, vec![src.sge(0, 8192)]));
        sim.post_send(a, read(2, remote, vec![src.sge(0, 4096)]));
        sim.run();
        assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
        assert_eq!(sim.mem(1).peek(target.addr + 4096, 8192), data, "seed {seed}");
        assert_eq!(
            sim.mem(1).peek(target.addr, 4096),
            vec![0; 4096],
            "outside the window"
        );

        sim.post_send(b, local_inv(11, rkey));
        sim.run();
        let s = sim.take_send_cq(b);
        assert_ok_in_order(&s, &[11]);
        assert_eq!(s[0].opcode, WcOpcode::LocalInv);
        assert!(sim.mem(1).window(mw).target.is_none());

        // The peer's access now fails, and the memory stays as it was.
        sim.mem(0).poke(src.addr, &[0xEE; 64]);
        sim.post_send(a, write(3, remote, vec![src.sge(0, 64)]));
        sim.run();
        let s = sim.take_send_cq(a);
        assert_eq!(s.len(), 1, "seed {seed}: {s:?}");
        assert_wc(&s[0], 3, WcStatus::RemAccessErr);
        assert_eq!(sim.state(a), QpState::Err);
        assert_eq!(sim.mem(1).peek(target.addr + 4096, 64), data[..64].to_vec());
        assert_eq!(sim.state(b), QpState::Err, "the responder moves to ERR too");
    }
}

#[test]
fn send_with_invalidate_invalidates_before_the_receive_completes() {
    for seed in SEEDS {
        let (mut sim, a, b) = lossy_pair(seed, 5.0);
        let src = sim.mem(0).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
        let target = sim.mem(1).alloc_mr(1, 4096, bindable());
        let rbuf = sim.mem(1).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
        let mw = sim.mem(1).alloc_mw(1, MwType::Type2);
        let bind = bind_req(mw, &target, 0, 4096, RW);
        sim.post_send(b, bind_mw(10, bind));
        sim.post_recv(b, recv(20, vec![rbuf.sge(0, 4096)]));
        sim.run();
        assert_ok_in_order(&sim.take_send_cq(b), &[10]);
        let rkey = bind.new_rkey;
        let remote = RemoteAddr {
            addr: target.addr,
            rkey,
        };
        let data = sim.rng.bytes(2048);
        sim.mem(0).poke(src.addr, &data);
        // In one go: a WRITE through the window, the SEND that invalidates it, and a second
        // WRITE, which the responder executes after the invalidation and so refuses.
        sim.post_send(a, write(1, remote, vec![src.sge(0, 2048)]));
        sim.post_send(a, send_inv(2, rkey, vec![src.sge(0, 3000)]));
        sim.post_send(
            a,
            write(
                3,
                RemoteAddr {
                    addr: target.addr + 2048,
                    rkey,
                },
                vec![src.sge(0, 100)],
            ),
        );
        sim.run();
        let s = sim.take_send_cq(a);
        let got: Vec<_> = s.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            got,
            vec![
                (1, WcStatus::Success),
                (2, WcStatus::Success),
                (3, WcStatus::RemAccessErr)
            ],
            "seed {seed}"
        );
        let r = sim.take_recv_cq(b);
        assert_ok_in_order(&r, &[20]);
        assert!(r[0].wc_flags.contains(WcFlags::WITH_INV));
        assert_eq!(r[0].imm_data, rkey, "invalidated_rkey");
        assert_eq!(r[0].byte_len, 3000);
        assert!(sim.mem(1).window(mw).target.is_none());
        assert_eq!(sim.mem(1).peek(target.addr, 2048), data);
        assert_eq!(sim.mem(1).peek(target.addr + 2048, 100), vec![0; 100]);
    }
}

#[test]
fn send_with_invalidate_of_a_bad_key_fails_both_sides() {
    // A free (never bound) window cannot be invalidated, nor can a region's key.
    for region_key in [false, true] {
        let (mut sim, a, b) = lossy_pair(7, 0.0);
        let src = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
        let rbuf = sim.mem(1).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
        let target = sim.mem(1).alloc_mr(1, 64, bindable());
        let mw = sim.mem(1).alloc_mw(1, MwType::Type2);
        let key = if region_key { target.rkey } else { mw };
        sim.post_recv(b, recv(20, vec![rbuf.sge(0, 64)]));
        sim.post_recv(b, recv(21, vec![rbuf.sge(0, 64)]));
        sim.post_send(a, send_inv(1, key, vec![src.sge(0, 64)]));
        sim.run();
        let s = sim.take_send_cq(a);
        assert_eq!(s.len(), 1);
        assert_wc(&s[0], 1, WcStatus::RemInvReqErr);
        let r = sim.take_recv_cq(b);
        let got: Vec<_> = r.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            got,
            vec![(20, WcStatus::RemInvReqErr), (21, WcStatus::WrFlushErr)]
        );
        assert_eq!(sim.state(b), QpState::Err);
    }
}

#[test]
fn a_bind_completes_in_posting_order_behind_unacknowledged_sends() {
    for seed in SEEDS {
        let (mut sim, a, b) = lossy_pair(seed, 10.0);
        let src = sim
            .mem(0)
            .alloc_mr(1, 1 << 16, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND);
        let dst = sim.mem(1).alloc_mr(1, 1 << 16, AccessFlags::LOCAL_WRITE);
        let mw = sim.mem(0).alloc_mw(1, MwType::Type2);
        sim.post_recv(b, recv(50, vec![dst.sge(0, 1 << 16)]));
        sim.post_send(a, send(1, vec![src.sge(0, 1 << 16)]));
        let bind = bind_req(mw, &src, 0, 100, AccessFlags::REMOTE_READ);
        sim.post_send(a, bind_mw(2, bind));
        sim.post_send(a, send(3, vec![]));
        sim.post_recv(b, recv(51, vec![]));
        sim.run();
        let s = sim.take_send_cq(a);
        assert_ok_in_order(&s, &[1, 2, 3]);
        assert_eq!(
            s.iter().map(|w| w.opcode).collect::<Vec<_>>(),
            [WcOpcode::Send, WcOpcode::BindMw, WcOpcode::Send]
        );
        assert!(sim.mem(0).window(mw).target.is_some(), "seed {seed}");
    }
}

#[test]
fn an_unsignaled_bind_completes_silently() {
    let (mut sim, a, _b) = lossy_pair(3, 0.0);
    let mr = sim.mem(0).alloc_mr(1, 4096, bindable());
    let mw = sim.mem(0).alloc_mw(1, MwType::Type2);
    let mut wr = bind_mw(1, bind_req(mw, &mr, 0, 64, AccessFlags::REMOTE_READ));
    wr.flags = SendFlags::empty();
    sim.post_send(a, wr);
    sim.run();
    assert!(sim.take_send_cq(a).is_empty());
    assert!(sim.mem(0).window(mw).target.is_some());
}

/// Runs one bind on node 0's QP and returns its completion status and the QP state after.
fn bind_status(setup: impl FnOnce(&mut Sim) -> MwBind, qp_pd: u32) -> (WcStatus, QpState, WcStatus) {
    let mut sim = Sim::new(11, 2);
    let a = sim.create_qp_with(
        0,
        QpType::Rc,
        QpOpts {
            pd: qp_pd,
            ..QpOpts::default()
        },
    );
    let b = sim.create_qp(1, QpType::Rc);
    sim.connect(a, b, &ConnOpts::default());
    let bind = setup(&mut sim);
    sim.post_recv(b, recv(9, vec![]));
    sim.post_send(a, bind_mw(1, bind));
    sim.post_send(a, send(2, vec![]));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_eq!(s.len(), 2, "{s:?}");
    assert_eq!(s[0].opcode, WcOpcode::BindMw);
    (s[0].status, sim.state(a), s[1].status)
}

/// Builds the regions and window of a bind case and returns the bind.
type Setup = Box<dyn FnOnce(&mut Sim) -> MwBind>;

#[test]
fn bind_errors_complete_with_mw_bind_err_and_fail_the_qp() {
    let cases: Vec<(&str, Setup, u32)> = vec![
        (
            "region without MW_BIND (C10-73)",
            Box::new(|s| {
                let mr = s.mem(0).alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE);
                let mw = s.mem(0).alloc_mw(1, MwType::Type2);
                bind_req(mw, &mr, 0, 64, AccessFlags::REMOTE_READ)
            }),
            1,
        ),
        (
            "remote write window on a region without local write (C10-74)",
            Box::new(|s| {
                let mr = s.mem(0).alloc_mr(1, 4096, AccessFlags::MW_BIND);
                let mw = s.mem(0).alloc_mw(1, MwType::Type2);
                bind_req(mw, &mr, 0, 64, AccessFlags::REMOTE_WRITE)
            }),
            1,
        ),
        (
            "window beyond the region (C10-75)",
            Box::new(|s| {
                let mr = s.mem(0).alloc_mr(1, 4096, bindable());
                let mw = s.mem(0).alloc_mw(1, MwType::Type2);
                bind_req(mw, &mr, 4000, 97, AccessFlags::REMOTE_READ)
            }),
            1,
        ),
        (
            "QP of another PD (C10-72)",
            Box::new(|s| {
                let mr = s.mem(0).alloc_mr(1, 4096, bindable());
                let mw = s.mem(0).alloc_mw(1, MwType::Type2);
                bind_req(mw, &mr, 0, 64, AccessFlags::REMOTE_READ)
            }),
            2,
        ),
        (
            "zero length on a type 2 window (o10-37.2.40)",
            Box::new(|s| {
                let mr = s.mem(0).alloc_mr(1, 4096, bindable());
                let mw = s.mem(0).alloc_mw(1, MwType::Type2);
                bind_req(mw, &mr, 0, 0, AccessFlags::REMOTE_READ)
            }),
            1,
        ),
        (
            "deregistered region",
            Box::new(|s| {
                let mr = s.mem(0).alloc_mr(1, 4096, bindable());
                s.mem(0).dereg(&mr);
                let mw = s.mem(0).alloc_mw(1, MwType::Type2);
                bind_req(mw, &mr, 0, 64, AccessFlags::REMOTE_READ)
            }),
            1,
        ),
        (
            "zero-based type 1 window (o10-36.2.2)",
            Box::new(|s| {
                let mr = s.mem(0).alloc_mr(1, 4096, bindable());
                let mw = s.mem(0).alloc_mw(1, MwType::Type1);
                bind_req(mw, &mr, 0, 64, AccessFlags::REMOTE_READ | AccessFlags::ZERO_BASED)
            }),
            1,
        ),
    ];
    for (what, setup, pd) in cases {
        let got = bind_status(setup, pd);
        assert_eq!(
            got,
            (WcStatus::MwBindErr, QpState::Err, WcStatus::WrFlushErr),
            "{what}"
        );
    }
    // The same bind on a good region succeeds, and the QP keeps working.
    let got = bind_status(
        |s| {
            let mr = s.mem(0).alloc_mr(1, 4096, bindable());
            let mw = s.mem(0).alloc_mw(1, MwType::Type2);
            bind_req(mw, &mr, 4000, 96, AccessFlags::REMOTE_READ)
        },
        1,
    );
    assert_eq!(got, (WcStatus::Success, QpState::Rts, WcStatus::Success));
}

#[test]
fn a_bound_type2_window_must_be_invalidated_before_it_is_bound_again() {
    let (mut sim, a, _b) = lossy_pair(5, 0.0);
    let mr = sim.mem(0).alloc_mr(1, 4096, bindable());
    let mw = sim.mem(0).alloc_mw(1, MwType::Type2);
    let first = bind_req(mw, &mr, 0, 64, AccessFlags::REMOTE_READ);
    sim.post_send(a, bind_mw(1, first));
    let again = MwBind {
        new_rkey: inc_rkey(first.new_rkey),
        ..first
    };
    sim.post_send(a, bind_mw(2, again));
    sim.run();
    let s = sim.take_send_cq(a);
    assert_wc(&s[0], 1, WcStatus::Success);
    assert_wc(&s[1], 2, WcStatus::MwBindErr);
    assert_eq!(sim.mem(0).refused.borrow().last(), Some(&MemError::BadState));
}

#[test]
fn local_invalidate_and_rebind_give_a_new_key() {
    let (mut sim, a, b) = lossy_pair(9, 2.0);
    let src = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    let mr = sim.mem(1).alloc_mr(1, 4096, bindable());
    let mw = sim.mem(1).alloc_mw(1, MwType::Type2);
    let first = bind_req(mw, &mr, 0, 4096, RW);
    let second = MwBind {
        new_rkey: inc_rkey(first.new_rkey),
        ..first
    };
    sim.post_send(b, bind_mw(1, first));
    sim.post_send(b, local_inv(2, first.new_rkey));
    sim.post_send(b, bind_mw(3, second));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(b), &[1, 2, 3]);
    sim.mem(0).poke(src.addr, &[5; 64]);
    // The new key works; the old one names an earlier binding and fails.
    sim.post_send(
        a,
        write(
            4,
            RemoteAddr {
                addr: mr.addr,
                rkey: second.new_rkey,
            },
            vec![src.sge(0, 64)],
        ),
    );
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[4]);
    assert_eq!(sim.mem(1).peek(mr.addr, 64), vec![5; 64]);
    sim.post_send(
        a,
        write(
            5,
            RemoteAddr {
                addr: mr.addr,
                rkey: first.new_rkey,
            },
            vec![src.sge(0, 64)],
        ),
    );
    sim.run();
    assert_wc(&sim.take_send_cq(a)[0], 5, WcStatus::RemAccessErr);
}

#[test]
fn local_invalidate_errors_complete_with_loc_qp_op_err() {
    // A type 1 window (o10-37.2.26), a free window, and a stale key.
    for case in 0..3 {
        let (mut sim, a, _b) = lossy_pair(21, 0.0);
        let mr = sim.mem(0).alloc_mr(1, 4096, bindable());
        let ty = if case == 0 { MwType::Type1 } else { MwType::Type2 };
        let mw = sim.mem(0).alloc_mw(1, ty);
        let bind = bind_req(mw, &mr, 0, 64, AccessFlags::REMOTE_READ);
        if case != 1 {
            sim.post_send(a, bind_mw(1, bind));
        }
        let key = if case == 2 { mw } else { bind.new_rkey };
        sim.post_send(a, local_inv(2, key));
        sim.run();
        let s = sim.take_send_cq(a);
        let last = s.last().unwrap();
        assert_eq!(
            (last.wr_id, last.status, last.opcode),
            (2, WcStatus::LocQpOpErr, WcOpcode::LocalInv),
            "case {case}"
        );
        assert_eq!(sim.state(a), QpState::Err);
    }
}

#[test]
fn a_type2_window_serves_only_the_qp_it_is_bound_to() {
    // Two connections into node 1, both in PD 1: the window is bound on the first.
    let mut sim = Sim::new(13, 2);
    let (a1, b1) = (sim.create_qp(0, QpType::Rc), sim.create_qp(1, QpType::Rc));
    let (a2, b2) = (sim.create_qp(0, QpType::Rc), sim.create_qp(1, QpType::Rc));
    sim.connect(a1, b1, &ConnOpts::default());
    sim.connect(a2, b2, &ConnOpts::default());
    let src = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    let mr = sim.mem(1).alloc_mr(1, 4096, bindable());
    let mw = sim.mem(1).alloc_mw(1, MwType::Type2);
    let bind = bind_req(mw, &mr, 0, 4096, RW);
    sim.post_send(b1, bind_mw(1, bind));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(b1), &[1]);
    let remote = RemoteAddr {
        addr: mr.addr,
        rkey: bind.new_rkey,
    };
    sim.post_send(a2, read(2, remote, vec![src.sge(0, 64)]));
    sim.run();
    assert_wc(&sim.take_send_cq(a2)[0], 2, WcStatus::RemAccessErr);
    assert_eq!(sim.mem(1).refused.borrow().last(), Some(&MemError::WrongQp));
    sim.post_send(a1, read(3, remote, vec![src.sge(0, 64)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a1), &[3]);
}

#[test]
fn a_type1_window_serves_every_qp_of_its_pd_and_unbinds_with_length_zero() {
    let mut sim = Sim::new(17, 2);
    let (a1, b1) = (sim.create_qp(0, QpType::Rc), sim.create_qp(1, QpType::Rc));
    let (a2, b2) = (sim.create_qp(0, QpType::Rc), sim.create_qp(1, QpType::Rc));
    sim.connect(a1, b1, &ConnOpts::default());
    sim.connect(a2, b2, &ConnOpts::default());
    let src = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    let mr = sim.mem(1).alloc_mr(1, 4096, bindable());
    sim.mem(1).poke(mr.addr + 100, &[9; 64]);
    let mw = sim.mem(1).alloc_mw(1, MwType::Type1);
    let bind = bind_req(mw, &mr, 100, 64, AccessFlags::REMOTE_READ);
    sim.post_send(b1, bind_mw(1, bind));
    sim.run();
    let remote = RemoteAddr {
        addr: mr.addr + 100,
        rkey: bind.new_rkey,
    };
    sim.post_send(a2, read(2, remote, vec![src.sge(0, 64)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a2), &[2]);
    assert_eq!(sim.mem(0).peek(src.addr, 64), vec![9; 64]);
    // Unbind: a bind with length 0 and the next tag.
    let unbind = MwBind {
        mw_rkey: bind.new_rkey,
        new_rkey: inc_rkey(bind.new_rkey),
        mr_lkey: 0,
        addr: 0,
        length: 0,
        access: AccessFlags::empty(),
    };
    sim.post_send(b2, bind_mw(3, unbind));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(b2), &[3]);
    sim.post_send(a1, read(4, remote, vec![src.sge(0, 64)]));
    sim.run();
    assert_wc(&sim.take_send_cq(a1)[0], 4, WcStatus::RemAccessErr);
}

#[test]
fn zero_based_windows_are_addressed_by_offset() {
    let (mut sim, a, b) = lossy_pair(23, 3.0);
    let dst = sim.mem(0).alloc_mr(1, 256, AccessFlags::LOCAL_WRITE);
    let mr = sim.mem(1).alloc_mr(1, 8192, bindable());
    let data = sim.rng.bytes(256);
    sim.mem(1).poke(mr.addr + 4500, &data);
    let mw = sim.mem(1).alloc_mw(1, MwType::Type2);
    let bind = bind_req(
        mw,
        &mr,
        4096,
        1024,
        AccessFlags::REMOTE_READ | AccessFlags::ZERO_BASED,
    );
    sim.post_send(b, bind_mw(1, bind));
    sim.run();
    let at = |addr| RemoteAddr {
        addr,
        rkey: bind.new_rkey,
    };
    sim.post_send(a, read(2, at(4500 - 4096), vec![dst.sge(0, 256)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[2]);
    assert_eq!(sim.mem(0).peek(dst.addr, 256), data);
    // The virtual address is not an offset into the window: out of range.
    sim.post_send(a, read(3, at(mr.addr + 4500), vec![dst.sge(0, 256)]));
    sim.run();
    assert_wc(&sim.take_send_cq(a)[0], 3, WcStatus::RemAccessErr);
}

#[test]
fn windows_bind_on_uc_queue_pairs() {
    let (mut sim, a, b) = Sim::pair(29, QpType::Uc, &ConnOpts::default());
    let src = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    let mr = sim.mem(1).alloc_mr(1, 4096, bindable());
    let mw = sim.mem(1).alloc_mw(1, MwType::Type2);
    let bind = bind_req(mw, &mr, 0, 4096, AccessFlags::REMOTE_WRITE);
    sim.post_send(b, bind_mw(1, bind));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(b), &[1]);
    sim.mem(0).poke(src.addr, &[3; 64]);
    let remote = RemoteAddr {
        addr: mr.addr,
        rkey: bind.new_rkey,
    };
    sim.post_send(a, write(2, remote, vec![src.sge(0, 64)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[2]);
    assert_eq!(sim.mem(1).peek(mr.addr, 64), vec![3; 64]);
    sim.post_send(b, local_inv(3, bind.new_rkey));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(b), &[3]);
    // UC drops a write it may not execute; the memory is untouched.
    sim.mem(0).poke(src.addr, &[4; 64]);
    sim.post_send(a, write(4, remote, vec![src.sge(0, 64)]));
    sim.run();
    assert_eq!(sim.mem(1).peek(mr.addr, 64), vec![3; 64]);
}

#[test]
fn binds_carry_no_data_and_are_refused_on_ud() {
    let (mut sim, a, _b) = lossy_pair(31, 0.0);
    let mr = sim.mem(0).alloc_mr(1, 64, bindable());
    let mw = sim.mem(0).alloc_mw(1, MwType::Type2);
    let mut wr = bind_mw(1, bind_req(mw, &mr, 0, 64, AccessFlags::REMOTE_READ));
    wr.payload = softverbs_engine::wr::Payload::Sges(vec![mr.sge(0, 8)]);
    let limits = softverbs_engine::wr::SendLimits {
        qp_type: QpType::Rc,
        max_send_sge: 4,
        max_inline_data: 64,
        max_msg_sz: 1 << 31,
        ud_mtu: 1024,
        max_rd_atomic: 1,
        max_tso_header: 0,
    };
    assert_eq!(wr.check(&limits).unwrap_err().errno(), 22);
    let inv = local_inv(2, mw);
    let ud = softverbs_engine::wr::SendLimits {
        qp_type: QpType::Ud,
        ..limits
    };
    assert_eq!(inv.check(&ud).unwrap_err().errno(), 22);
    assert!(inv.check(&limits).is_ok());
    // A checked bind executes.
    sim.post_send(a, bind_mw(3, bind_req(mw, &mr, 0, 64, AccessFlags::REMOTE_READ)));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[3]);
}

#[test]
fn a_window_refuses_qps_of_another_pd() {
    // Node 1 has a QP in PD 1, which binds a type 1 window, and one in PD 2, which may not use it.
    let mut sim = Sim::new(37, 2);
    let (a1, b1) = (sim.create_qp(0, QpType::Rc), sim.create_qp(1, QpType::Rc));
    let a2 = sim.create_qp(0, QpType::Rc);
    let b2 = sim.create_qp_with(
        1,
        QpType::Rc,
        QpOpts {
            pd: 2,
            ..QpOpts::default()
        },
    );
    sim.connect(a1, b1, &ConnOpts::default());
    sim.connect(a2, b2, &ConnOpts::default());
    let src = sim.mem(0).alloc_mr(1, 64, AccessFlags::LOCAL_WRITE);
    let mr = sim.mem(1).alloc_mr(1, 4096, bindable());
    let mw = sim.mem(1).alloc_mw(1, MwType::Type1);
    let bind = bind_req(mw, &mr, 0, 4096, RW);
    sim.post_send(b1, bind_mw(1, bind));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(b1), &[1]);
    let remote = RemoteAddr {
        addr: mr.addr,
        rkey: bind.new_rkey,
    };
    sim.post_send(a2, write(2, remote, vec![src.sge(0, 64)]));
    sim.run();
    assert_wc(&sim.take_send_cq(a2)[0], 2, WcStatus::RemAccessErr);
    assert_eq!(sim.mem(1).refused.borrow().last(), Some(&MemError::WrongPd));
    sim.post_send(a1, write(3, remote, vec![src.sge(0, 64)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a1), &[3]);
}
