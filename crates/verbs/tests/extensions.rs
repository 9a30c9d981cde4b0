//! ATOMIC WRITE and FLUSH, completion timestamps and on-demand paging through the safe API, on
//! the in-process fabric.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use softverbs::*;

const FLUSH_ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC)
    .union(AccessFlags::FLUSH_GLOBAL)
    .union(AccessFlags::FLUSH_PERSISTENT);

struct Side {
    ctx: Context,
    _pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side(mr_access: AccessFlags, ts: Timestamps) -> Side {
    let ctx = lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq_with_timestamps(256, None, 0, ts).unwrap();
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    let mr = pd.register(4096, mr_access).unwrap();
    Side {
        ctx,
        _pd: pd,
        cq,
        qp,
        mr,
    }
}

/// Connects two RC QPs with `qp_access` granted and one READ/atomic resource each way.
fn connect(a: &Side, b: &Side, qp_access: AccessFlags) {
    for (s, peer) in [(a, b), (b, a)] {
        to_rts(&s.ctx, &s.qp, peer.qp.qp_num());
        let attr = QpAttr {
            qp_state: QpState::Rts,
            qp_access_flags: qp_access,
            ..Default::default()
        };
        s.qp.modify(&attr, QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS)
            .unwrap();
    }
}

fn pair(mr_access: AccessFlags, qp_access: AccessFlags) -> (Side, Side) {
    let (a, b) = (
        side(mr_access, Timestamps::default()),
        side(mr_access, Timestamps::default()),
    );
    connect(&a, &b, qp_access);
    (a, b)
}

fn req(wr_id: u64, op: SendOp) -> SendRequest {
    SendRequest {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![]),
        ud: None,
        xrc_srqn: None,
    }
}

fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < n {
        got.extend(drain(cq));
        assert!(std::time::Instant::now() < deadline, "timed out with {got:?}");
    }
    got
}

fn remote_qp_access() -> AccessFlags {
    AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::FLUSH_GLOBAL
        | AccessFlags::FLUSH_PERSISTENT
}

#[test]
fn the_device_advertises_atomic_write_flush_timestamps_and_odp() {
    let ctx = lo();
    let ex = ctx.query_device_ex();
    let want = cap_flags_ex::ATOMIC_WRITE | cap_flags_ex::FLUSH_GLOBAL | cap_flags_ex::FLUSH_PERSISTENT;
    assert_eq!(ex.device_cap_flags_ex & want, want);
    assert_eq!(
        ex.device_cap_flags_ex & 0xFFFF_FFFF,
        u64::from(ctx.query_device().device_cap_flags)
    );
    assert_eq!(ex.hca_core_clock, HCA_CORE_CLOCK_KHZ);
    assert_ne!(ex.completion_timestamp_mask, 0);
    assert_eq!(ex.odp_caps.general_caps, odp::SUPPORT | odp::SUPPORT_IMPLICIT);
    assert_eq!(
        ex.odp_caps.rc_odp_caps & (odp::SEND | odp::RECV),
        odp::SEND | odp::RECV
    );
}

#[test]
fn atomic_write_stores_eight_bytes_at_the_target() {
    let (a, b) = pair(FLUSH_ACCESS, remote_qp_access());
    b.mr.fill(0xEE);
    let value = 0x1122_3344_5566_7788u64.to_ne_bytes();
    let op = SendOp::AtomicWrite {
        remote: b.mr.remote(16),
        value,
    };
    a.qp.post_send(&[req(7, op)]).unwrap();
    let wc = wait(&a.cq, 1);
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].opcode),
        (7, WcStatus::Success, WcOpcode::AtomicWrite)
    );
    assert_eq!(b.mr.read_u64(16).unwrap(), 0x1122_3344_5566_7788);
    assert_eq!(b.mr.read_u64(8).unwrap(), u64::from_ne_bytes([0xEE; 8]));
    assert_eq!(b.mr.read_u64(24).unwrap(), u64::from_ne_bytes([0xEE; 8]));
    assert!(drain(&b.cq).is_empty(), "no completion at the target");
}

#[test]
fn flush_after_writes_completes_for_range_and_region() {
    let (a, b) = pair(FLUSH_ACCESS, remote_qp_access());
    a.mr.write(0, b"placed data").unwrap();
    let write = SendRequest {
        payload: Payload::Sges(vec![a.mr.sge(0..11).unwrap()]),
        ..req(
            1,
            SendOp::Write {
                remote: b.mr.remote(100),
                imm: None,
            },
        )
    };
    let range = SendOp::Flush {
        remote: b.mr.remote(100),
        len: 11,
        placement: FLUSH_GLOBAL,
        select: FlushSelect::Range,
    };
    let whole = SendOp::Flush {
        remote: b.mr.remote(0),
        len: 0,
        placement: FLUSH_GLOBAL | FLUSH_PERSISTENT,
        select: FlushSelect::Mr,
    };
    a.qp.post_send(&[write, req(2, range), req(3, whole)]).unwrap();
    let wcs = wait(&a.cq, 3);
    let got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status, w.opcode)).collect();
    assert_eq!(
        got,
        vec![
            (1, WcStatus::Success, WcOpcode::RdmaWrite),
            (2, WcStatus::Success, WcOpcode::Flush),
            (3, WcStatus::Success, WcOpcode::Flush)
        ]
    );
    let mut placed = [0u8; 11];
    b.mr.read(100, &mut placed).unwrap();
    assert_eq!(&placed, b"placed data");
}

#[test]
fn access_errors_complete_with_remote_errors() {
    // The target region lacks FLUSH_PERSISTENT and REMOTE_WRITE.
    let mr_access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::FLUSH_GLOBAL;
    let (a, b) = pair(mr_access, remote_qp_access());
    let op = SendOp::Flush {
        remote: b.mr.remote(0),
        len: 64,
        placement: FLUSH_PERSISTENT,
        select: FlushSelect::Range,
    };
    a.qp.post_send(&[req(1, op)]).unwrap();
    let wc = wait(&a.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::RemAccessErr));

    let (a, b) = pair(mr_access, remote_qp_access());
    let op = SendOp::AtomicWrite {
        remote: b.mr.remote(0),
        value: [1; 8],
    };
    a.qp.post_send(&[req(2, op)]).unwrap();
    let wc = wait(&a.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (2, WcStatus::RemAccessErr));
    assert_eq!(b.mr.read_u64(0).unwrap(), 0);

    // The target QP does not allow FLUSH at all: invalid request.
    let (a, b) = pair(FLUSH_ACCESS, AccessFlags::REMOTE_WRITE);
    let op = SendOp::Flush {
        remote: b.mr.remote(0),
        len: 8,
        placement: FLUSH_GLOBAL,
        select: FlushSelect::Range,
    };
    a.qp.post_send(&[req(3, op)]).unwrap();
    let wc = wait(&a.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (3, WcStatus::RemInvReqErr));
}

#[test]
fn post_send_rejects_misaligned_atomic_write_and_bad_flush_type() {
    let (a, b) = pair(FLUSH_ACCESS, remote_qp_access());
    let misaligned = SendOp::AtomicWrite {
        remote: b.mr.remote(4),
        value: [0; 8],
    };
    assert_eq!(
        a.qp.post_send(&[req(1, misaligned)]).unwrap_err().error.errno(),
        22
    );
    let bad = SendOp::Flush {
        remote: b.mr.remote(0),
        len: 8,
        placement: 0,
        select: FlushSelect::Range,
    };
    assert_eq!(a.qp.post_send(&[req(2, bad)]).unwrap_err().error.errno(), 22);
}

#[test]
fn completions_carry_monotonic_timestamps_consistent_with_wall_time() {
    let ts = Timestamps {
        raw: true,
        wallclock: true,
    };
    let (a, b) = (side(FLUSH_ACCESS, ts), side(FLUSH_ACCESS, Timestamps::default()));
    connect(&a, &b, remote_qp_access());
    let khz = a.ctx.query_device_ex().hca_core_clock;
    let wall_before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
    let raw_before = a.ctx.query_raw_clock();
    let mut stamps = Vec::new();
    for i in 0..20u64 {
        let op = SendOp::AtomicWrite {
            remote: b.mr.remote(0),
            value: i.to_ne_bytes(),
        };
        a.qp.post_send(&[req(i, op)]).unwrap();
        let wc = wait(&a.cq, 1)[0];
        assert_eq!(wc.status, WcStatus::Success);
        stamps.push((wc.timestamp, wc.wallclock_ns));
        if i == 9 {
            std::thread::sleep(Duration::from_millis(30));
        }
    }
    let raw_after = a.ctx.query_raw_clock();
    let wall_after = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
    assert!(
        stamps.windows(2).all(|w| w[0].0 <= w[1].0),
        "raw clock monotonic: {stamps:?}"
    );
    for &(raw, wall) in &stamps {
        assert!((raw_before..=raw_after).contains(&raw));
        assert!((wall_before..=wall_after).contains(&wall));
    }
    // The 30 ms pause shows in both clocks, at the advertised rate.
    let raw_gap_ns = (stamps[10].0 - stamps[9].0) * 1_000_000 / khz;
    let wall_gap_ns = stamps[10].1 - stamps[9].1;
    assert!(raw_gap_ns >= 30_000_000, "{raw_gap_ns}");
    assert!(
        raw_gap_ns.abs_diff(wall_gap_ns) < 5_000_000,
        "{raw_gap_ns} vs {wall_gap_ns}"
    );
    // A CQ without timestamps leaves them 0.
    let op = SendOp::AtomicWrite {
        remote: a.mr.remote(0),
        value: [0; 8],
    };
    b.qp.post_send(&[req(99, op)]).unwrap();
    let wc = wait(&b.cq, 1)[0];
    assert_eq!((wc.timestamp, wc.wallclock_ns), (0, 0));
}

#[test]
fn odp_regions_carry_traffic() {
    let odp = FLUSH_ACCESS | AccessFlags::ON_DEMAND;
    let (a, b) = pair(odp, remote_qp_access());
    assert!(a.mr.access().contains(AccessFlags::ON_DEMAND));
    a.mr.write(0, &[5; 256]).unwrap();
    let write = SendRequest {
        payload: Payload::Sges(vec![a.mr.sge(0..256).unwrap()]),
        ..req(
            1,
            SendOp::Write {
                remote: b.mr.remote(512),
                imm: None,
            },
        )
    };
    a.qp.post_send(&[write]).unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 256];
    b.mr.read(512, &mut got).unwrap();
    assert_eq!(got, [5; 256]);
}

#[test]
fn advise_mr_validates_like_the_man_page() {
    let ctx = lo();
    let pd = ctx.alloc_pd().unwrap();
    let odp = pd
        .register(8192, AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND)
        .unwrap();
    let ro = pd.register(64, AccessFlags::ON_DEMAND).unwrap();
    let plain = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
    let other = ctx.alloc_pd().unwrap();
    let foreign = other
        .register(64, AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND)
        .unwrap();
    let all = [odp.sge(0..8192).unwrap()];
    assert!(pd.advise_mr(0, 0, &all).is_ok());
    assert!(pd.advise_mr(1, 1, &all).is_ok());
    assert!(pd.advise_mr(2, 0, &all).is_ok());
    let errno = |advice, flags, sges: &[Sge]| pd.advise_mr(advice, flags, sges).unwrap_err().errno();
    assert_eq!(errno(3, 0, &all), 95, "unknown advice");
    assert_eq!(errno(0, 2, &all), 22, "unknown flag");
    assert_eq!(errno(0, 0, &[]), 22, "no SGE");
    let mut bad_key = all[0];
    bad_key.lkey ^= 0x00FF_0000;
    assert_eq!(errno(0, 0, &[bad_key]), 2, "unknown lkey: ENOENT");
    assert_eq!(errno(0, 0, &[plain.sge(0..8).unwrap()]), 22, "not ODP");
    let past = Sge {
        addr: odp.addr() + 4096,
        length: 8192,
        lkey: odp.lkey(),
    };
    assert_eq!(errno(0, 0, &[past]), 14, "outside the region: EFAULT");
    assert!(pd.advise_mr(0, 0, &[ro.sge(0..8).unwrap()]).is_ok());
    assert_eq!(
        errno(1, 0, &[ro.sge(0..8).unwrap()]),
        1,
        "write prefetch of read-only: EPERM"
    );
    assert_eq!(errno(0, 0, &[foreign.sge(0..8).unwrap()]), 1, "another PD: EPERM");
}

/// ibv_alloc_null_mr(3): a receive skips its first bytes through the null MR, a send gathers
/// zeros from it, and its rkey gives remote peers nothing.
#[test]
fn null_mr_discards_scattered_bytes_and_gathers_zeros() {
    let (mut a, mut b) = (
        side(FLUSH_ACCESS, Timestamps::default()),
        side(FLUSH_ACCESS, Timestamps::default()),
    );
    // Scatter lists of two entries.
    for s in [&mut a, &mut b] {
        let mut init = QpInit::new(QpType::Rc, &s.cq);
        init.cap.max_recv_sge = 2;
        s.qp = s._pd.create_qp(&init).unwrap();
    }
    connect(&a, &b, remote_qp_access());
    let null = b._pd.alloc_null_mr().unwrap();
    a.mr.write(0, b"headerpayload").unwrap();
    let skip = Sge {
        addr: 0x1000,
        length: 6,
        lkey: null.lkey(),
    };
    b.qp.post_recv(&[RecvWr {
        wr_id: 7,
        sg_list: vec![skip, b.mr.sge(100..164).unwrap()],
    }])
    .unwrap();
    let send = |wr_id, sges| SendRequest {
        payload: Payload::Sges(sges),
        ..req(
            wr_id,
            SendOp::Send {
                imm: None,
                invalidate: None,
            },
        )
    };
    a.qp.post_send(&[send(1, vec![a.mr.sge(0..13).unwrap()])])
        .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let r = wait(&b.cq, 1);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (7, WcStatus::Success, 13)
    );
    let mut got = [0u8; 8];
    b.mr.read(100, &mut got).unwrap();
    assert_eq!(&got, b"payload\0");

    // Gathering from the null MR sends zeros.
    a.mr.write(200, &[0xff; 16]).unwrap();
    a.qp.post_recv(&[RecvWr {
        wr_id: 8,
        sg_list: vec![a.mr.sge(200..216).unwrap()],
    }])
    .unwrap();
    let zeros = Sge {
        addr: 0x2000,
        length: 16,
        lkey: null.lkey(),
    };
    b.qp.post_send(&[send(2, vec![zeros])]).unwrap();
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&a.cq, 1)[0].byte_len, 16);
    let mut got = [0xaau8; 16];
    a.mr.read(200, &mut got).unwrap();
    assert_eq!(got, [0; 16]);

    // Not reachable remotely.
    let write = SendRequest {
        payload: Payload::Sges(vec![a.mr.sge(0..8).unwrap()]),
        ..req(
            3,
            SendOp::Write {
                remote: null.remote(0x3000),
                imm: None,
            },
        )
    };
    a.qp.post_send(&[write]).unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemAccessErr);
}

/// Implicit ODP (`ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_ON_DEMAND)`): one region's keys reach
/// every live host buffer by address, receives and RDMA writes land there, prefetch checks the
/// range, and memory no buffer holds (or a dropped buffer) is refused.
#[test]
fn implicit_odp_region_reaches_host_buffers_by_address() {
    let (a, b) = pair(FLUSH_ACCESS, remote_qp_access());
    assert_eq!(
        a._pd
            .register_implicit_odp(AccessFlags::LOCAL_WRITE)
            .unwrap_err()
            .errno(),
        22,
        "implicit regions need IBV_ACCESS_ON_DEMAND"
    );
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::ON_DEMAND;
    let implicit = a._pd.register_implicit_odp(access).unwrap();
    assert!(implicit.access().contains(AccessFlags::ON_DEMAND));
    let buf = HostBuffer::new(4096).unwrap();
    let other = HostBuffer::new(64).unwrap();

    // A receive through the implicit lkey lands at the buffer's address.
    a.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: vec![implicit.sge(&buf, 100..400).unwrap()],
    }])
    .unwrap();
    b.mr.write(0, &[0x5A; 300]).unwrap();
    let send = SendRequest {
        payload: Payload::Sges(vec![b.mr.sge(0..300).unwrap()]),
        ..req(
            2,
            SendOp::Send {
                imm: None,
                invalidate: None,
            },
        )
    };
    b.qp.post_send(&[send]).unwrap();
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::Success);
    let wc = wait(&a.cq, 1)[0];
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 300));
    let v = buf.to_vec();
    assert!(v[100..400].iter().all(|&x| x == 0x5A) && v[..100].iter().all(|&x| x == 0));

    // Gathering from a second buffer with the same lkey.
    other.write(0, &[7; 64]).unwrap();
    let write = SendRequest {
        payload: Payload::Sges(vec![implicit.sge(&other, 0..64).unwrap()]),
        ..req(
            3,
            SendOp::Write {
                remote: b.mr.remote(1024),
                imm: None,
            },
        )
    };
    a.qp.post_send(&[write]).unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 64];
    b.mr.read(1024, &mut got).unwrap();
    assert_eq!(got, [7; 64]);

    // Prefetch: a mapped range is fine, one past the buffer's end is EFAULT.
    let pd = implicit.pd();
    assert!(pd
        .advise_mr(1, 1, &[implicit.sge(&buf, 0..4096).unwrap()])
        .is_ok());
    let mut past = implicit.sge(&buf, 0..4096).unwrap();
    past.length += 1;
    assert_eq!(pd.advise_mr(1, 0, &[past]).unwrap_err().errno(), 14);

    // The peer's RDMA write with the implicit rkey reaches the buffer while it lives...
    b.mr.write(2048, &[9; 16]).unwrap();
    let rdma = |wr_id, remote| SendRequest {
        payload: Payload::Sges(vec![b.mr.sge(2048..2064).unwrap()]),
        ..req(wr_id, SendOp::Write { remote, imm: None })
    };
    b.qp.post_send(&[rdma(4, implicit.remote(&buf, 8))]).unwrap();
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 16];
    buf.read(8, &mut got).unwrap();
    assert_eq!(got, [9; 16]);
    // ...and is refused once it is gone.
    let gone = implicit.remote(&other, 0);
    drop(other);
    b.qp.post_send(&[rdma(5, gone)]).unwrap();
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::RemAccessErr);
}
