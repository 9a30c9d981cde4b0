//! CQ moderation (`ibv_modify_cq` with `IBV_CQ_MODERATE`): when an armed CQ raises its
//! completion event, and the man-page errors.

mod common;

use std::time::{Duration, Instant};

use common::*;
use softverbs::*;

const EINVAL: i32 = 22;

/// A CQ on a completion channel with two RC QPs whose receive completions go to it; each QP
/// holds `recvs` posted receives, so moving it to the error state flushes that many
/// completions into the CQ.
struct Setup {
    _ctx: Context,
    ch: CompletionChannel,
    cq: CompletionQueue,
    qps: Vec<QueuePair>,
}

fn setup(recvs: [u64; 2]) -> Setup {
    let ctx = lo();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq(64, Some(&ch), 0).unwrap();
    let qps = recvs
        .iter()
        .map(|&n| {
            let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
            to_init(&qp);
            qp.post_recv(&recv_wrs(&mr, 0..n, 64)).unwrap();
            qp
        })
        .collect();
    Setup {
        _ctx: ctx,
        ch,
        cq,
        qps,
    }
}

fn no_event(ch: &CompletionChannel, wait: Duration) -> bool {
    ch.get_cq_event_timeout(Some(wait)).is_err()
}

#[test]
fn device_reports_the_moderation_limits() {
    let ctx = lo();
    assert_eq!(ctx.query_device_ex().cq_mod_caps, (MAX_CQ_COUNT, MAX_CQ_PERIOD));
}

#[test]
fn period_beyond_the_caps_is_einval_and_leaves_the_moderation() {
    let ctx = lo();
    let cq = ctx.create_cq(4, None, 0).unwrap();
    assert_eq!(cq.moderation(), Moderation::default());
    let m = Moderation {
        cq_count: 8,
        cq_period: 100,
    };
    cq.modify_moderation(m).unwrap();
    assert_eq!(cq.moderation(), m);
    let err = cq
        .modify_moderation(Moderation {
            cq_count: 1,
            cq_period: MAX_CQ_PERIOD + 1,
        })
        .unwrap_err();
    assert_eq!(err.errno(), EINVAL);
    assert_eq!(cq.moderation(), m);
    // Every count fits the field.
    cq.modify_moderation(Moderation {
        cq_count: MAX_CQ_COUNT,
        cq_period: MAX_CQ_PERIOD,
    })
    .unwrap();
}

#[test]
fn event_waits_for_the_count_without_a_period() {
    let s = setup([2, 1]);
    s.cq.modify_moderation(Moderation {
        cq_count: 3,
        cq_period: 0,
    })
    .unwrap();
    s.cq.req_notify(false).unwrap();
    to_err(&s.qps[0]);
    assert_eq!(drain(&s.cq).len(), 2);
    assert!(no_event(&s.ch, Duration::from_millis(50)), "2 of 3: no event");
    to_err(&s.qps[1]);
    let ev = s.ch.get_cq_event_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(ev.cq().same_as(&s.cq));
    ev.ack();
    // One event per request.
    assert!(no_event(&s.ch, Duration::from_millis(20)));
}

#[test]
fn period_raises_the_event_short_of_the_count() {
    let s = setup([1, 0]);
    let period = 3000u16;
    s.cq.modify_moderation(Moderation {
        cq_count: 100,
        cq_period: period,
    })
    .unwrap();
    s.cq.req_notify(false).unwrap();
    let start = Instant::now();
    to_err(&s.qps[0]);
    let ev = s.ch.get_cq_event_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(
        start.elapsed() >= Duration::from_micros(u64::from(period)),
        "the event came before the period ended: {:?}",
        start.elapsed()
    );
    ev.ack();
    assert_eq!(drain(&s.cq).len(), 1);
}

#[test]
fn without_moderation_the_first_completion_raises_the_event() {
    let s = setup([1, 0]);
    s.cq.req_notify(false).unwrap();
    to_err(&s.qps[0]);
    s.ch.get_cq_event_timeout(Some(Duration::from_secs(5)))
        .unwrap()
        .ack();
}

#[test]
fn lowering_the_count_raises_a_held_back_event() {
    let s = setup([2, 0]);
    s.cq.modify_moderation(Moderation {
        cq_count: 5,
        cq_period: 0,
    })
    .unwrap();
    s.cq.req_notify(false).unwrap();
    to_err(&s.qps[0]);
    assert!(no_event(&s.ch, Duration::from_millis(50)));
    s.cq.modify_moderation(Moderation {
        cq_count: 2,
        cq_period: 0,
    })
    .unwrap();
    s.ch.get_cq_event_timeout(Some(Duration::from_secs(5)))
        .unwrap()
        .ack();
}

#[test]
fn completions_before_the_request_do_not_count() {
    let s = setup([2, 1]);
    s.cq.modify_moderation(Moderation {
        cq_count: 2,
        cq_period: 0,
    })
    .unwrap();
    to_err(&s.qps[0]);
    s.cq.req_notify(false).unwrap();
    assert!(no_event(&s.ch, Duration::from_millis(50)));
    to_err(&s.qps[1]);
    assert!(
        no_event(&s.ch, Duration::from_millis(50)),
        "one completion since the request: no event"
    );
}
