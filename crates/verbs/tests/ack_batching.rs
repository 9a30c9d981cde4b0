//! A receiver answers the SENDs it handles in one batch with one ACK per batch, built once:
//! the device holds each QP's positive ACK until the end of the batch instead of building one
//! per packet and dropping all but the last. Alone in its binary, since it reads the process's
//! device counters.

mod common;

use std::time::{Duration, Instant};

use common::*;
use softverbs::*;

const N: usize = 32;

#[test]
fn a_batch_of_sends_is_answered_by_acks_built_once() {
    let ctx_a = lo();
    let ctx_b = lo();
    let side = |ctx: &Context| {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(2 * N as i32, None, 0).unwrap();
        let mut init = QpInit::new(QpType::Rc, &cq);
        init.cap.max_send_wr = N as u32;
        init.cap.max_recv_wr = N as u32;
        let qp = pd.create_qp(&init).unwrap();
        let mr = pd.register(64 * N, AccessFlags::LOCAL_WRITE).unwrap();
        (pd, cq, qp, mr)
    };
    let (_pa, cq_a, qp_a, mr_a) = side(&ctx_a);
    let (_pb, cq_b, qp_b, mr_b) = side(&ctx_b);
    to_rts(&ctx_a, &qp_a, qp_b.qp_num());
    to_rts(&ctx_b, &qp_b, qp_a.qp_num());
    let recvs: Vec<RecvWr> = (0..N)
        .map(|i| RecvWr {
            wr_id: i as u64,
            sg_list: vec![mr_b.sge(i * 64..(i + 1) * 64).unwrap()],
        })
        .collect();
    qp_b.post_recv(&recvs).unwrap();
    let payload: Vec<u8> = (0..64 * N).map(|i| (i * 13) as u8).collect();
    mr_a.write(0, &payload).unwrap();

    let before = lo_counters();
    let sends: Vec<SendRequest> = (0..N)
        .map(|i| SendRequest {
            wr_id: i as u64,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![mr_a.sge(i * 64..(i + 1) * 64).unwrap()]),
            ud: None,
            xrc_srqn: None,
        })
        .collect();
    // One list: the receiver finds all of them queued, or most, when it drives.
    qp_a.post_send(&sends).unwrap();
    let wait = |cq: &CompletionQueue| {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        while got.len() < N {
            got.extend(drain(cq));
            assert!(Instant::now() < deadline, "timed out with {} of {N}", got.len());
        }
        got
    };
    let s = wait(&cq_a);
    let r = wait(&cq_b);
    assert!(s.iter().chain(&r).all(|w| w.status == WcStatus::Success));
    assert_eq!(
        s.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        (0..N as u64).collect::<Vec<_>>()
    );
    let mut got = vec![0u8; 64 * N];
    mr_b.read(0, &mut got).unwrap();
    assert_eq!(got, payload);

    // Every SEND asked for an ACK: each was either sent or held and answered by a later one.
    let now = lo_counters();
    let acks = now.tx_packets - before.tx_packets - N as u64;
    let held = qp_b.counters().acks_held;
    assert!(acks >= 1, "the held ACK left");
    assert!(held >= 1, "SENDs handled together shared an ACK");
    assert_eq!(
        acks + held,
        N as u64,
        "{acks} ACKs sent, {held} held, for {N} SENDs"
    );
    assert_eq!(now.tx_acks_coalesced, before.tx_acks_coalesced);
    assert_eq!(now.retransmits, before.retransmits);
}
