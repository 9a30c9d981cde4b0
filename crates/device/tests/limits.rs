//! Process-wide limits that must fail with an errno rather than hang: the QP numbers of one
//! process (shared by QPs, SRQs and WQs).

use softverbs_device::config::Config;
use softverbs_device::*;
use softverbs_engine::types::*;

mod common;

const ENOMEM: i32 = 12;

#[test]
fn exhausted_qp_numbers_give_enomem() {
    let mut cfg = Config {
        interfaces: Some(vec!["lo".into()]),
        udp_port: common::free_base_port(3),
        ..Config::default()
    };
    // Raise the device's own limit above the number space, so the space is what runs out.
    cfg.limits.apply_list("max_qp=70000").unwrap();
    let dev = discover(&cfg).unwrap().remove(0);
    let ctx = Context::open(&dev).unwrap();
    let pd = Pd::alloc(&ctx).unwrap();
    let cq = Cq::create(&ctx, 16, None, 0).unwrap();
    let init = common::qp_init(&cq, QpType::Uc);
    let mut qps = Vec::new();
    let err = loop {
        match Qp::create(&pd, &init) {
            Ok(qp) => qps.push(qp),
            Err(e) => break e,
        }
        assert!(qps.len() <= 0x1_0000, "more QPs than QP numbers");
    };
    assert_eq!(err.errno(), ENOMEM, "{err}");
    assert_eq!(qps.len(), 0xFFFF - 0x11 + 1, "every index 0x11..=0xFFFF was used");
    // SRQs are numbered from the same space.
    let srq = Srq::create(
        &pd,
        &SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        },
    );
    assert_eq!(srq.unwrap_err().errno(), ENOMEM);
    // Nothing was leaked by the failures: freeing one number makes room for exactly one.
    let freed = qps.pop().unwrap();
    freed.destroy().unwrap();
    drop(freed);
    let again = Qp::create(&pd, &init).expect("a freed number is reused");
    assert_eq!(Qp::create(&pd, &init).unwrap_err().errno(), ENOMEM);
    again.destroy().unwrap();
    for qp in qps {
        qp.destroy().unwrap();
    }
    cq.destroy().unwrap();
}
