//! Teardown rules of the man pages, on the core object model that both front ends share. The
//! safe Rust API cannot express these misuses (objects hold what they depend on), but C callers
//! can, so every rule is checked here: the call fails with EBUSY and changes nothing.

use std::sync::Arc;
use std::time::Duration;

use softverbs_device::config::Config;
use softverbs_device::*;
use softverbs_engine::types::*;

const EBUSY: i32 = 16;
const EINVAL: i32 = 22;

fn device(limits: &str) -> Device {
    let mut cfg = Config {
        interfaces: Some(vec!["lo".into()]),
        ..Config::default()
    };
    cfg.limits.apply_list(limits).unwrap();
    discover(&cfg).unwrap().remove(0)
}

fn ctx() -> Arc<Context> {
    Context::open(&device("")).unwrap()
}

fn qp_init(cq: &Arc<Cq>, qp_type: QpType, srq: Option<&Arc<Srq>>) -> QpInitAttr {
    QpInitAttr {
        qp_type,
        send_cq: Some(cq.clone()),
        recv_cq: Some(cq.clone()),
        srq: srq.cloned(),
        cap: QpCap {
            max_send_wr: 4,
            max_recv_wr: 4,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        max_tso_header: 0,
    }
}

fn to_init(qp: &Qp) {
    let attr = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qkey: 1,
        ..QpAttr::default()
    };
    let extra = if qp.qp_type() == QpType::Ud {
        QpAttrMask::QKEY
    } else {
        QpAttrMask::ACCESS_FLAGS
    };
    qp.modify(
        &attr,
        QpAttrMask::STATE | QpAttrMask::PORT | QpAttrMask::PKEY_INDEX | extra,
    )
    .unwrap();
}

fn to_err(qp: &Qp) {
    qp.modify(
        &QpAttr {
            qp_state: QpState::Err,
            ..QpAttr::default()
        },
        QpAttrMask::STATE,
    )
    .unwrap();
}

fn loopback_ah(ctx: &Context) -> AhAttr {
    let sgid = ctx
        .device()
        .gid_table()
        .iter()
        .position(|g| !g.is_zero())
        .unwrap();
    AhAttr {
        grh: GlobalRoute {
            dgid: ctx.device().gid_table()[sgid],
            sgid_index: sgid as u8,
            ..Default::default()
        },
        is_global: true,
        port_num: 1,
        ..Default::default()
    }
}

#[test]
fn ibv_dealloc_pd_fails_while_an_mr_qp_srq_or_ah_uses_it() {
    let ctx = ctx();
    let cq = Cq::create(&ctx, 8, None, 0).unwrap();
    let buf = [0u8; 64];
    type Make = Box<dyn Fn(&Arc<Pd>) -> Box<dyn FnOnce()>>;
    let users: Vec<(&str, Make)> = vec![
        ("mr", {
            let addr = buf.as_ptr() as u64;
            Box::new(move |pd: &Arc<Pd>| {
                let mr = Mr::register(pd, Arc::new(AtomicBuffer::new(64)), addr, 1).unwrap();
                Box::new(move || mr.dereg().unwrap())
            })
        }),
        ("qp", {
            let cq = cq.clone();
            Box::new(move |pd: &Arc<Pd>| {
                let qp = Qp::create(pd, &qp_init(&cq, QpType::Rc, None)).unwrap();
                Box::new(move || qp.destroy().unwrap())
            })
        }),
        (
            "srq",
            Box::new(|pd: &Arc<Pd>| {
                let srq = Srq::create(
                    pd,
                    &SrqAttr {
                        max_wr: 4,
                        max_sge: 1,
                        srq_limit: 0,
                    },
                )
                .unwrap();
                Box::new(move || srq.destroy().unwrap())
            }),
        ),
        (
            "ah",
            Box::new(|pd: &Arc<Pd>| {
                let ah = Ah::create(pd, &loopback_ah(pd.context())).unwrap();
                Box::new(move || ah.destroy().unwrap())
            }),
        ),
    ];
    for (what, make) in users {
        let pd = Pd::alloc(&ctx).unwrap();
        let release = make(&pd);
        let e = pd.dealloc().unwrap_err();
        assert_eq!(e.errno(), EBUSY, "{what}: {e}");
        // Nothing changed: the PD still takes new users.
        let another = Mr::register(&pd, Arc::new(AtomicBuffer::new(64)), buf.as_ptr() as u64, 0).unwrap();
        another.dereg().unwrap();
        release();
        pd.dealloc().unwrap();
        assert_eq!(
            pd.dealloc().unwrap_err().errno(),
            EINVAL,
            "{what}: a second dealloc is an error"
        );
    }
}

#[test]
fn ibv_destroy_cq_fails_while_a_qp_uses_it() {
    let ctx = ctx();
    let pd = Pd::alloc(&ctx).unwrap();
    let scq = Cq::create(&ctx, 8, None, 0).unwrap();
    let rcq = Cq::create(&ctx, 8, None, 0).unwrap();
    let init = QpInitAttr {
        recv_cq: Some(rcq.clone()),
        ..qp_init(&scq, QpType::Ud, None)
    };
    let qp = Qp::create(&pd, &init).unwrap();
    assert_eq!(scq.destroy().unwrap_err().errno(), EBUSY);
    assert_eq!(rcq.destroy().unwrap_err().errno(), EBUSY);
    to_init(&qp); // the QP still works after the refused destroys
    qp.destroy().unwrap();
    scq.destroy().unwrap();
    rcq.destroy().unwrap();
}

#[test]
fn ibv_destroy_comp_channel_fails_while_a_cq_uses_it() {
    let ctx = ctx();
    let ch = CompChannel::create(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, Some(&ch), 0).unwrap();
    assert_eq!(ch.destroy().unwrap_err().errno(), EBUSY);
    cq.req_notify(false).unwrap();
    cq.push(WorkCompletion::default()).unwrap();
    let got = ch.get_cq_event(Some(Duration::from_secs(5))).unwrap();
    assert!(
        Arc::ptr_eq(&got, &cq),
        "the channel still delivers after the refused destroy"
    );
    cq.ack_events(1);
    cq.destroy().unwrap();
    ch.destroy().unwrap();
}

#[test]
fn ibv_destroy_srq_fails_while_a_qp_uses_it() {
    let ctx = ctx();
    let pd = Pd::alloc(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, None, 0).unwrap();
    let srq = Srq::create(
        &pd,
        &SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        },
    )
    .unwrap();
    let qp = Qp::create(&pd, &qp_init(&cq, QpType::Rc, Some(&srq))).unwrap();
    assert_eq!(srq.destroy().unwrap_err().errno(), EBUSY);
    srq.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: vec![],
    }])
    .unwrap();
    qp.destroy().unwrap();
    srq.destroy().unwrap();
}

#[test]
fn ibv_destroy_qp_fails_while_attached_to_a_multicast_group() {
    let ctx = ctx();
    let pd = Pd::alloc(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, None, 0).unwrap();
    let qp = Qp::create(&pd, &qp_init(&cq, QpType::Ud, None)).unwrap();
    let mgid = Gid::from(std::net::Ipv4Addr::new(239, 0, 0, 1));
    qp.attach_mcast(&mgid, 0).unwrap();
    assert_eq!(qp.destroy().unwrap_err().errno(), EBUSY);
    assert_eq!(qp.mcast_groups(), vec![mgid], "still attached");
    to_init(&qp);
    qp.detach_mcast(&mgid, 0).unwrap();
    qp.destroy().unwrap();
}

#[test]
fn destroying_a_qp_waits_for_its_async_events_to_be_acknowledged() {
    let ctx = ctx();
    let pd = Pd::alloc(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, None, 0).unwrap();
    let srq = Srq::create(
        &pd,
        &SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        },
    )
    .unwrap();
    let qp = Qp::create(&pd, &qp_init(&cq, QpType::Rc, Some(&srq))).unwrap();
    to_init(&qp);
    to_err(&qp); // raises IBV_EVENT_QP_LAST_WQE_REACHED
    let ev = ctx.get_async_event(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(ev.event_type, EventType::QpLastWqeReached);
    let destroyer = {
        let qp = qp.clone();
        std::thread::spawn(move || qp.destroy())
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !destroyer.is_finished(),
        "destroy must wait for the acknowledgement"
    );
    ctx.ack_async_event(&ev);
    destroyer.join().unwrap().unwrap();
}

#[test]
fn destroying_an_object_drops_its_undelivered_events() {
    let ctx = ctx();
    let pd = Pd::alloc(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, None, 0).unwrap();
    let srq = Srq::create(
        &pd,
        &SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        },
    )
    .unwrap();
    let qp = Qp::create(&pd, &qp_init(&cq, QpType::Rc, Some(&srq))).unwrap();
    to_init(&qp);
    to_err(&qp);
    assert_eq!(ctx.pending_async_events(), 1);
    qp.destroy().unwrap(); // never delivered, so nothing to wait for
    assert_eq!(ctx.pending_async_events(), 0);
}

#[test]
fn destroying_a_cq_waits_for_completion_events_to_be_acknowledged() {
    let ctx = ctx();
    let ch = CompChannel::create(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, Some(&ch), 0).unwrap();
    cq.req_notify(false).unwrap();
    cq.push(WorkCompletion::default()).unwrap();
    let got = ch.get_cq_event(None).unwrap();
    let destroyer = {
        let cq = cq.clone();
        std::thread::spawn(move || cq.destroy())
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !destroyer.is_finished(),
        "destroy must wait for ibv_ack_cq_events"
    );
    got.ack_events(1);
    destroyer.join().unwrap().unwrap();
    assert_eq!(cq.comp_event_counts(), (1, 1));
}

#[test]
fn req_notify_solicited_only_ignores_unsolicited_successes() {
    let ctx = ctx();
    let ch = CompChannel::create(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, Some(&ch), 0).unwrap();
    cq.req_notify(true).unwrap();
    let recv = WorkCompletion {
        opcode: WcOpcode::Recv,
        ..WorkCompletion::default()
    };
    cq.push(recv).unwrap();
    cq.push(WorkCompletion {
        solicited: true,
        ..WorkCompletion::default()
    })
    .unwrap(); // a send: never solicited
    assert!(matches!(
        ch.get_cq_event(Some(Duration::from_millis(1))),
        Err(softverbs_engine::Error::WouldBlock)
    ));
    cq.push(WorkCompletion {
        solicited: true,
        ..recv
    })
    .unwrap();
    let got = ch.get_cq_event(Some(Duration::from_secs(5))).unwrap();
    got.ack_events(1);
}

#[test]
fn cq_overrun_raises_cq_err_and_loses_nothing_already_queued() {
    let ctx = ctx();
    let cq = Cq::create(&ctx, 1, None, 0).unwrap();
    assert_eq!(cq.cqe(), 1);
    cq.push(WorkCompletion {
        wr_id: 1,
        ..WorkCompletion::default()
    })
    .unwrap();
    assert_eq!(
        cq.push(WorkCompletion {
            wr_id: 2,
            ..WorkCompletion::default()
        }),
        Err(CqOverrun)
    );
    assert!(cq.is_overrun());
    let ev = ctx.get_async_event(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(ev.event_type, EventType::CqErr);
    assert!(matches!(&ev.element, EventElement::Cq(c) if Arc::ptr_eq(c, &cq)));
    ctx.ack_async_event(&ev);
    let mut wc = [WorkCompletion::default(); 2];
    assert_eq!(cq.poll(&mut wc), 1);
    assert_eq!(wc[0].wr_id, 1);
}

#[test]
fn srq_limit_event_fires_once_when_armed() {
    let ctx = ctx();
    let pd = Pd::alloc(&ctx).unwrap();
    let srq = Srq::create(
        &pd,
        &SrqAttr {
            max_wr: 8,
            max_sge: 1,
            srq_limit: 0,
        },
    )
    .unwrap();
    let wrs: Vec<RecvWr> = (0..4)
        .map(|i| RecvWr {
            wr_id: i,
            sg_list: vec![],
        })
        .collect();
    srq.post_recv(&wrs).unwrap();
    srq.take().unwrap();
    assert_eq!(ctx.pending_async_events(), 0, "not armed yet");
    srq.modify(
        &SrqAttr {
            srq_limit: 2,
            ..SrqAttr::default()
        },
        2,
    )
    .unwrap();
    srq.take().unwrap(); // 2 left: not below the limit
    assert_eq!(ctx.pending_async_events(), 0);
    srq.take().unwrap(); // 1 left: below
    assert_eq!(srq.query().srq_limit, 0, "the event disarms the limit");
    srq.take().unwrap();
    assert_eq!(ctx.pending_async_events(), 1, "fires once");
    let ev = ctx.get_async_event(None).unwrap();
    assert_eq!(ev.event_type, EventType::SrqLimitReached);
    ctx.ack_async_event(&ev);
}

#[test]
fn objects_of_a_destroyed_parent_cannot_be_created() {
    let ctx = ctx();
    let pd = Pd::alloc(&ctx).unwrap();
    pd.dealloc().unwrap();
    assert_eq!(
        Srq::create(
            &pd,
            &SrqAttr {
                max_wr: 1,
                max_sge: 1,
                srq_limit: 0
            }
        )
        .unwrap_err()
        .errno(),
        EINVAL
    );
}

#[test]
fn nothing_leaks_after_everything_is_destroyed() {
    let dev = device("max_pd=1,max_cq=1,max_qp=1,max_mr=1,max_srq=1,max_ah=1");
    for round in 0..4 {
        let ctx = Context::open(&dev).unwrap();
        let pd = Pd::alloc(&ctx).unwrap();
        let cq = Cq::create(&ctx, 4, None, 0).unwrap();
        let srq = Srq::create(
            &pd,
            &SrqAttr {
                max_wr: 4,
                max_sge: 1,
                srq_limit: 0,
            },
        )
        .unwrap();
        let qp = Qp::create(&pd, &qp_init(&cq, QpType::Ud, Some(&srq))).unwrap();
        let buf = [0u8; 8];
        let mr = Mr::register(&pd, Arc::new(AtomicBuffer::new(8)), buf.as_ptr() as u64, 0).unwrap();
        let ah = Ah::create(&pd, &loopback_ah(&ctx)).unwrap();
        // Half of the rounds tear down explicitly, the others by dropping the handles.
        if round % 2 == 0 {
            ah.destroy().unwrap();
            mr.dereg().unwrap();
            qp.destroy().unwrap();
            srq.destroy().unwrap();
            cq.destroy().unwrap();
            pd.dealloc().unwrap();
        }
    }
    for _ in 0..2 {
        let ctx = Context::open(&dev).unwrap();
        let pd = Pd::alloc(&ctx).unwrap();
        let cq = Cq::create(&ctx, 4, None, 0).unwrap();
        let _qp = Qp::create(&pd, &qp_init(&cq, QpType::Ud, None)).unwrap();
    }
}
