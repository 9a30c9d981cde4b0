//! Flow counters (`ibv_create_counters`, `ibv_attach_counters_point_flow`,
//! `ibv_read_counters`, `ibv_destroy_counters`) on raw packet flows of the loopback device:
//! the packets and bytes of the frames a rule takes, by the points attached, and the man-page
//! errors. Raw packet QPs need CAP_NET_RAW: run as root (as CI does).

mod common;
#[path = "raw/frames.rs"]
mod frames;

use std::time::{Duration, Instant};

use common::*;
use frames::experimental_frame;
use softverbs::*;

const SLOT: usize = 2048;
const EINVAL: i32 = 22;
const EBUSY: i32 = 16;

fn raw_qp(pd: &ProtectionDomain, cq: &CompletionQueue) -> QueuePair {
    let mut init = QpInit::new(QpType::RawPacket, cq);
    init.cap.max_send_wr = 64;
    init.cap.max_recv_wr = 64;
    let qp = pd.create_qp(&init).unwrap();
    let attr = |s| QpAttr {
        qp_state: s,
        port_num: 1,
        ..Default::default()
    };
    qp.modify(&attr(QpState::Init), QpAttrMask::STATE | QpAttrMask::PORT)
        .unwrap();
    qp.modify(&attr(QpState::Rtr), QpAttrMask::STATE).unwrap();
    qp.modify(&attr(QpState::Rts), QpAttrMask::STATE).unwrap();
    qp
}

/// An ETH rule for frames of `ether_type` from `src_mac` (a MAC of this process, so that other
/// programs' frames on the shared loopback interface stay out).
fn rule(src_mac: [u8; 6], ether_type: u16, drop: bool) -> FlowAttr {
    FlowAttr {
        flow_type: FlowType::Normal,
        priority: 0,
        port: 1,
        flags: 0,
        specs: vec![FlowSpec::Eth {
            val: EthFilter {
                src_mac,
                ether_type,
                ..Default::default()
            },
            mask: EthFilter {
                src_mac: [0xFF; 6],
                ether_type: 0xFFFF,
                ..Default::default()
            },
        }],
        tag: None,
        drop,
    }
}

fn poll_until(cq: &CompletionQueue, n: usize, limit: Duration) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        let more = drain(cq);
        if more.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
        got.extend(more);
    }
    got
}

#[test]
fn counters_count_the_frames_their_flows_take() {
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "raw packet QPs need CAP_NET_RAW: run as root"
    );
    let ctx = lo();
    let pd = ctx.alloc_pd().unwrap();
    let send_cq = ctx.create_cq(64, None, 0).unwrap();
    let recv_cq = ctx.create_cq(64, None, 0).unwrap();
    let tx = raw_qp(&pd, &send_cq);
    let rx = raw_qp(&pd, &recv_cq);
    let mr = pd.register(SLOT * 64, AccessFlags::LOCAL_WRITE).unwrap();
    rx.post_recv(
        &(0..32)
            .map(|s| RecvWr {
                wr_id: s,
                sg_list: vec![mr.sge(s as usize * SLOT..(s as usize + 1) * SLOT).unwrap()],
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let pid = std::process::id().to_be_bytes();
    let src_mac = [0x02, 0x5c, pid[0], pid[1], pid[2], pid[3]];

    // Delivered frames: packets at 0 and 2, bytes at 1.
    let delivered = ctx.create_counters();
    delivered.attach_point(CounterDesc::Packets, 0).unwrap();
    delivered.attach_point(CounterDesc::Bytes, 1).unwrap();
    delivered.attach_point(CounterDesc::Packets, 2).unwrap();
    // Dropped frames: packets and bytes added up at index 0.
    let dropped = ctx.create_counters();
    dropped.attach_point(CounterDesc::Packets, 0).unwrap();
    dropped.attach_point(CounterDesc::Bytes, 0).unwrap();
    let mut v = [7u64; 4];
    delivered.read(&mut v, 0).unwrap();
    assert_eq!(v, [0; 4], "cleared at creation, 0 where no point is");

    let keep = rx
        .create_flow_counted(&rule(src_mac, 0x88B5, false), &delivered)
        .unwrap();
    let drop_rule = rx
        .create_flow_counted(&rule(src_mac, 0x88B6, true), &dropped)
        .unwrap();
    assert_eq!(
        delivered
            .attach_point(CounterDesc::Packets, 3)
            .unwrap_err()
            .errno(),
        EBUSY,
        "no points once bound"
    );
    let delivered = match delivered.destroy() {
        Err((c, e)) => {
            assert_eq!(e.errno(), EBUSY, "destroy while bound");
            c
        }
        Ok(()) => panic!("destroyed while bound to a flow"),
    };

    // Frames of 3 lengths of each kind; the loopback packet socket may lose frames under a
    // flood from other programs, so what was received is compared, not what was sent.
    let send = |i: usize, ether_type: u16, len: usize| {
        let mut f = experimental_frame([0x02, 0, 0, 0, 0, 0x43], src_mac, &vec![i as u8; len]);
        f[12..14].copy_from_slice(&ether_type.to_be_bytes());
        let s = 40 + i;
        mr.write(s * SLOT, &f).unwrap();
        tx.post_send(&[SendRequest {
            wr_id: s as u64,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![mr.sge(s * SLOT..s * SLOT + f.len()).unwrap()]),
            ud: None,
            xrc_srqn: None,
        }])
        .unwrap();
        assert_eq!(poll_until(&send_cq, 1, Duration::from_secs(10)).len(), 1);
    };
    for (i, len) in [60usize, 200, 1000].into_iter().enumerate() {
        send(i, 0x88B5, len);
        send(i + 3, 0x88B6, len);
    }
    let mut got = poll_until(&recv_cq, 3, Duration::from_secs(5));
    got.extend(poll_until(&recv_cq, usize::MAX, Duration::from_millis(300)));
    assert!(!got.is_empty(), "no frame came back through the loopback");
    assert!(got.iter().all(|wc| wc.status == WcStatus::Success));
    let packets = got.len() as u64;
    let bytes: u64 = got.iter().map(|wc| u64::from(wc.byte_len)).sum();
    let mut v = [0u64; 3];
    delivered.read(&mut v, READ_COUNTERS_PREFER_CACHED).unwrap();
    assert_eq!(v, [packets, bytes, packets]);
    let mut two = [0u64; 2];
    delivered.read(&mut two, 0).unwrap();
    assert_eq!(two, [packets, bytes], "indexes beyond ncounters are left out");
    assert_eq!(delivered.read(&mut two, 2).unwrap_err().errno(), EINVAL);

    let mut d = [0u64; 1];
    dropped.read(&mut d, 0).unwrap();
    // Each dropped frame adds one packet and its length (at least 60 bytes) at index 0.
    assert!(d[0] == 0 || d[0] >= 61, "{d:?}");
    assert!(d[0] <= 3 + 3 * 1100, "{d:?}");

    drop((keep, drop_rule));
    delivered.destroy().map_err(|(_, e)| e).unwrap();
    dropped.destroy().map_err(|(_, e)| e).unwrap();
}

#[test]
fn counters_of_another_device_are_einval() {
    let a = lo();
    let b = lo_with("max_qp=16");
    let c = b.create_counters();
    let pd = a.alloc_pd().unwrap();
    let cq = a.create_cq(4, None, 0).unwrap();
    let qp = raw_qp(&pd, &cq);
    let r = qp.create_flow_counted(&rule([2, 0, 0, 0, 0, 1], 0x88B5, false), &c);
    assert_eq!(r.unwrap_err().errno(), EINVAL);
    // Unbound: more points and destruction are fine.
    c.attach_point(CounterDesc::Bytes, 5).unwrap();
    c.destroy().map_err(|(_, e)| e).unwrap();
}
