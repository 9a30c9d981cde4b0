//! Null memory regions (`ibv_alloc_null_mr`): writes through their lkey are discarded, reads
//! give zeros, and they grant no remote access.

mod common;

use std::time::{Duration, Instant};

use common::*;
use softverbs::*;

struct Side {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side() -> Side {
    let ctx = lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None, 0).unwrap();
    let mut init = QpInit::new(QpType::Rc, &cq);
    init.cap.max_send_sge = 4;
    init.cap.max_recv_sge = 4;
    let qp = pd.create_qp(&init).unwrap();
    let mr = pd
        .register(
            256,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .unwrap();
    Side {
        _ctx: ctx,
        pd,
        cq,
        qp,
        mr,
    }
}

fn pair() -> (Side, Side) {
    let (a, b) = (side(), side());
    to_rts(&a._ctx, &a.qp, b.qp.qp_num());
    to_rts(&b._ctx, &b.qp, a.qp.qp_num());
    for s in [&a, &b] {
        s.qp.modify(
            &QpAttr {
                qp_state: QpState::Rts,
                qp_access_flags: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
                ..Default::default()
            },
            QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS,
        )
        .unwrap();
    }
    (a, b)
}

fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < n {
        got.extend(drain(cq));
        assert!(Instant::now() < deadline, "timed out with {got:?}");
    }
    got
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

const SEND: SendOp = SendOp::Send {
    imm: None,
    invalidate: None,
};

#[test]
fn receive_discards_the_part_scattered_to_the_null_mr() {
    let (a, b) = pair();
    let null = b.pd.alloc_null_mr().unwrap();
    b.mr.write(0, &[0xee; 64]).unwrap();
    b.qp.post_recv(&[RecvWr {
        wr_id: 7,
        sg_list: vec![null.sge(0..16).unwrap(), b.mr.sge(0..48).unwrap()],
    }])
    .unwrap();
    let msg: Vec<u8> = (0..64).collect();
    a.mr.write(0, &msg).unwrap();
    a.qp.post_send(&[send(1, SEND, vec![a.mr.sge(0..64).unwrap()])])
        .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let wc = wait(&b.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status, wc.byte_len), (7, WcStatus::Success, 64));
    let mut got = [0u8; 64];
    b.mr.read(0, &mut got).unwrap();
    assert_eq!(&got[..48], &msg[16..], "the bytes after the discarded 16");
    assert_eq!(&got[48..], &[0xee; 16], "untouched beyond the message");
}

#[test]
fn send_from_the_null_mr_transmits_zeros() {
    let (a, b) = pair();
    let null = a.pd.alloc_null_mr().unwrap();
    b.mr.write(0, &[0xee; 40]).unwrap();
    b.qp.post_recv(&recv_wrs(&b.mr, 0..1, 64)).unwrap();
    a.mr.write(0, &[5; 8]).unwrap();
    // Any address works with the null lkey.
    let zeros = Sge {
        addr: 0x1234_5678,
        length: 32,
        lkey: null.lkey(),
    };
    a.qp.post_send(&[send(1, SEND, vec![a.mr.sge(0..8).unwrap(), zeros])])
        .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&b.cq, 1)[0].byte_len, 40);
    let mut got = [0u8; 40];
    b.mr.read(0, &mut got).unwrap();
    assert_eq!(&got[..8], &[5; 8]);
    assert_eq!(&got[8..], &[0; 32]);
    let mut back = [1u8; 8];
    null.read(100, &mut back).unwrap();
    assert_eq!(back, [0; 8], "reads give zeros");
}

#[test]
fn rdma_read_into_the_null_mr_is_discarded() {
    let (a, b) = pair();
    let null = a.pd.alloc_null_mr().unwrap();
    b.mr.write(0, &[9; 32]).unwrap();
    a.mr.write(0, &[3; 32]).unwrap();
    let op = SendOp::Read {
        remote: b.mr.remote(0),
    };
    a.qp.post_send(&[send(
        1,
        op,
        vec![null.sge(0..16).unwrap(), a.mr.sge(0..16).unwrap()],
    )])
    .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 32];
    a.mr.read(0, &mut got).unwrap();
    assert_eq!(&got[..16], &[9; 16]);
    assert_eq!(&got[16..], &[3; 16]);
}

#[test]
fn the_null_mr_grants_no_remote_access() {
    let (a, b) = pair();
    let null = b.pd.alloc_null_mr().unwrap();
    let op = SendOp::Write {
        remote: null.remote(0),
        imm: None,
    };
    a.qp.post_send(&[send(1, op, vec![a.mr.sge(0..8).unwrap()])])
        .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemAccessErr);
}

#[test]
fn null_mr_cannot_be_reregistered_and_is_deregistered_like_any_region() {
    let a = side();
    let mut null = a.pd.alloc_null_mr().unwrap();
    assert_eq!(null.addr(), 0);
    let remote = Rereg {
        access: Some(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE),
        ..Rereg::default()
    };
    assert_eq!(null.rereg(remote).unwrap_err().errno(), 22, "rereg: EINVAL");
    null.dereg().map_err(|(_, e)| e).unwrap();
}
