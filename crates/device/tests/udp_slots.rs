//! A process that finds every UDP slot taken cannot number QPs that other processes could reach:
//! creating them fails with ENOMEM (rather than giving QPs whose traffic goes astray), and works
//! once a slot is free. Alone in its binary, because the UDP driver is process-wide.

use std::net::UdpSocket;
use std::sync::Arc;

use softverbs_device::config::Config;
use softverbs_device::*;
use softverbs_engine::types::*;

const ENOMEM: i32 = 12;
const SLOTS: u8 = 2;

/// A base port whose first slots are free now (not the standard range, which other softverbs
/// processes on the host may use).
fn free_base_port() -> u16 {
    let free =
        |port: u16| UdpSocket::bind(("0.0.0.0", port)).is_ok() && UdpSocket::bind(("::", port)).is_ok();
    let seed = std::process::id() as u16;
    (0..1000u16)
        .map(|i| 20_000 + (seed.wrapping_add(i.wrapping_mul(83)) % 40_000))
        .find(|&base| (base..=base + u16::from(SLOTS)).all(free))
        .expect("a free range of UDP ports")
}

fn qp_init(cq: &Arc<Cq>) -> QpInitAttr {
    QpInitAttr {
        qp_type: QpType::Rc,
        send_cq: Some(cq.clone()),
        recv_cq: Some(cq.clone()),
        srq: None,
        cap: QpCap {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        max_tso_header: 0,
    }
}

#[test]
fn no_free_slot_gives_enomem_until_one_frees() {
    let base = free_base_port();
    // Other processes hold every slot (an IPv4 socket on the port is enough to take it).
    let holders: Vec<UdpSocket> = (1..=SLOTS)
        .map(|k| UdpSocket::bind(("0.0.0.0", base + u16::from(k))).unwrap())
        .collect();
    let cfg = Config {
        interfaces: Some(vec!["lo".into()]),
        udp_port: base,
        udp_slots: SLOTS,
        ..Config::default()
    };
    let dev = discover(&cfg).unwrap().remove(0);
    let ctx = Context::open(&dev).unwrap();
    let pd = Pd::alloc(&ctx).unwrap();
    let cq = Cq::create(&ctx, 4, None, 0).unwrap();
    let spare = Cq::create(&ctx, 4, None, 0).unwrap();
    let err = Qp::create(&pd, &qp_init(&spare)).unwrap_err();
    assert_eq!(err.errno(), ENOMEM);
    assert!(err.to_string().contains("UDP slot"), "{err}");
    let srq = Srq::create(
        &pd,
        &SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        },
    );
    assert_eq!(srq.unwrap_err().errno(), ENOMEM);
    assert_eq!(dev.udp_status(), None);
    // The failure took nothing: the CQ it named is not in use.
    spare.destroy().expect("no QP holds the CQ");
    drop(holders);
    let qp = Qp::create(&pd, &qp_init(&cq)).expect("a slot is free now");
    let (slot, port, _) = dev.udp_status().expect("the UDP driver runs");
    assert!((1..=SLOTS).contains(&slot));
    assert_eq!(port, base + u16::from(slot));
    assert_eq!(qp.qpn() >> 16, u32::from(slot), "the QP number carries the slot");
    qp.destroy().unwrap();
    cq.destroy().unwrap();
}
