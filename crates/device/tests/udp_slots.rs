//! A process that finds every UDP slot taken cannot number QPs that other processes could reach:
//! creating them fails with ENOMEM (rather than giving QPs whose traffic goes astray), and works
//! once a slot is free. Alone in its binary, because the UDP driver is process-wide.

use std::net::UdpSocket;

use softverbs_device::config::Config;
use softverbs_device::*;
use softverbs_engine::types::*;

mod common;

const ENOMEM: i32 = 12;
const SLOTS: u8 = 2;

#[test]
fn no_free_slot_gives_enomem_until_one_frees() {
    let base = common::free_base_port(u16::from(SLOTS));
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
    let err = Qp::create(&pd, &common::qp_init(&spare, QpType::Rc)).unwrap_err();
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
    let qp = Qp::create(&pd, &common::qp_init(&cq, QpType::Rc)).expect("a slot is free now");
    let (slot, port, _) = dev.udp_status().expect("the UDP driver runs");
    assert!((1..=SLOTS).contains(&slot));
    assert_eq!(port, base + u16::from(slot));
    assert_eq!(qp.qpn() >> 16, u32::from(slot), "the QP number carries the slot");
    qp.destroy().unwrap();
    cq.destroy().unwrap();
}
