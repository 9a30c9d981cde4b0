//! Packet pacing of raw packet QPs (`ibv_modify_qp_rate_limit`, `IBV_QP_RATE_LIMIT`): the
//! man-page errors, and sends held to the rate. Raw packet QPs need CAP_NET_RAW: run as root.

mod common;
#[path = "raw/frames.rs"]
mod frames;

use std::time::{Duration, Instant};

use common::*;
use frames::experimental_frame;
use softverbs::*;

const EINVAL: i32 = 22;
const SLOT: usize = 2048;

fn raw_qp(pd: &ProtectionDomain, cq: &CompletionQueue, rts: bool) -> QueuePair {
    let mut init = QpInit::new(QpType::RawPacket, cq);
    init.cap.max_send_wr = 64;
    let qp = pd.create_qp(&init).unwrap();
    let attr = |s| QpAttr {
        qp_state: s,
        port_num: 1,
        ..Default::default()
    };
    qp.modify(&attr(QpState::Init), QpAttrMask::STATE | QpAttrMask::PORT)
        .unwrap();
    if rts {
        qp.modify(&attr(QpState::Rtr), QpAttrMask::STATE).unwrap();
        qp.modify(&attr(QpState::Rts), QpAttrMask::STATE).unwrap();
    }
    qp
}

fn root() {
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "raw packet QPs need CAP_NET_RAW: run as root"
    );
}

#[test]
fn caps_and_man_page_errors() {
    root();
    let ctx = lo();
    let caps = ctx.query_device_ex().packet_pacing_caps;
    assert_eq!(caps.supported_qpts, 1 << 8, "raw packet QPs only");
    assert!(caps.qp_rate_limit_min >= 1 && caps.qp_rate_limit_min <= caps.qp_rate_limit_max);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None, 0).unwrap();
    let errno = |r: Result<()>| r.unwrap_err().errno();

    let rc = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    assert_eq!(errno(rc.modify_rate_limit(1000, 0, 0)), EINVAL, "an RC QP");
    let init = raw_qp(&pd, &cq, false);
    assert_eq!(
        errno(init.modify_rate_limit(1000, 0, 0)),
        EINVAL,
        "a raw QP in INIT"
    );
    let qp = raw_qp(&pd, &cq, true);
    assert_eq!(
        errno(qp.modify_rate_limit(caps.qp_rate_limit_max + 1, 0, 0)),
        EINVAL,
        "beyond qp_rate_limit_max"
    );
    assert_eq!(
        errno(qp.modify_rate_limit(0, 4096, 0)),
        EINVAL,
        "a burst without a rate"
    );
    assert_eq!(
        errno(qp.modify_rate_limit(0, 0, 512)),
        EINVAL,
        "a packet size without a rate"
    );
    qp.modify_rate_limit(caps.qp_rate_limit_max, 65536, 1500).unwrap();
    assert_eq!(qp.query().rate_limit, caps.qp_rate_limit_max);
    qp.modify_rate_limit(0, 0, 0).unwrap();
    assert_eq!(qp.query().rate_limit, 0);

    // IBV_QP_RATE_LIMIT of ibv_modify_qp: RTS->RTS of a raw QP, within the caps.
    let rts = |rate_limit| QpAttr {
        qp_state: QpState::Rts,
        rate_limit,
        ..Default::default()
    };
    let mask = QpAttrMask::STATE | QpAttrMask::RATE_LIMIT;
    qp.modify(&rts(5000), mask).unwrap();
    assert_eq!(qp.query().rate_limit, 5000);
    assert_eq!(errno(qp.modify(&rts(caps.qp_rate_limit_max + 1), mask)), EINVAL);
    assert_eq!(qp.query().rate_limit, 5000, "unchanged by the refused modify");
}

/// Sends `n` frames of `len` bytes as fast as they can be posted; returns how long until the
/// last send completed.
fn send_burst(qp: &QueuePair, cq: &CompletionQueue, mr: &MemoryRegion, n: usize, len: usize) -> Duration {
    let pid = std::process::id().to_be_bytes();
    let f = experimental_frame(
        [0x02, 0, 0, 0, 0, 0x46],
        [0x02, 0x5d, pid[0], pid[1], pid[2], pid[3]],
        &vec![0x5a; len - 14],
    );
    mr.write(0, &f).unwrap();
    let start = Instant::now();
    let wrs: Vec<SendRequest> = (0..n)
        .map(|i| SendRequest {
            wr_id: i as u64,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![mr.sge(0..len).unwrap()]),
            ud: None,
            xrc_srqn: None,
        })
        .collect();
    qp.post_send(&wrs).unwrap();
    let deadline = start + Duration::from_secs(20);
    let mut done = Vec::new();
    while done.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} sends completed",
            done.len()
        );
        let more = drain(cq);
        if more.is_empty() {
            std::thread::sleep(Duration::from_micros(200));
        }
        done.extend(more);
    }
    let elapsed = start.elapsed();
    assert!(done.iter().all(|wc| wc.status == WcStatus::Success), "{done:?}");
    let ids: Vec<u64> = done.iter().map(|wc| wc.wr_id).collect();
    assert_eq!(ids, (0..n as u64).collect::<Vec<_>>(), "in order");
    elapsed
}

#[test]
fn sends_are_held_to_the_rate() {
    root();
    let ctx = lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None, 0).unwrap();
    let qp = raw_qp(&pd, &cq, true);
    let mr = pd.register(SLOT, AccessFlags::LOCAL_WRITE).unwrap();
    // 800 kbit/s = 100 kB/s with a one-frame burst: 11 frames of 1000 bytes take 100 ms
    // after the first.
    qp.modify_rate_limit(800, 1000, 1000).unwrap();
    let paced = send_burst(&qp, &cq, &mr, 11, 1000);
    assert!(
        paced >= Duration::from_millis(99),
        "11 kB at 100 kB/s went out in {paced:?}"
    );
    // Unlimited again: the pace no longer applies (the bound only has to separate the two).
    qp.modify_rate_limit(0, 0, 0).unwrap();
    let free = send_burst(&qp, &cq, &mr, 11, 1000);
    assert!(free < paced, "unlimited {free:?} vs paced {paced:?}");
}
