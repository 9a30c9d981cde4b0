//! Completion events whose completions were all polled before the event was read: the event is
//! withdrawn from the channel and the CQ's notification request restored, so a program that
//! polls once per event never meets an empty CQ, and no later completion goes unannounced.

use std::sync::Arc;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use softverbs_device::config::Config;
use softverbs_device::*;
use softverbs_engine::types::*;
use softverbs_engine::Error;

fn ctx() -> Arc<Context> {
    let cfg = Config {
        interfaces: Some(vec!["lo".into()]),
        ..Config::default()
    };
    Context::open(&discover(&cfg).unwrap().remove(0)).unwrap()
}

fn no_event(ch: &CompChannel) -> bool {
    matches!(
        ch.get_cq_event(Some(Duration::from_millis(20))),
        Err(Error::WouldBlock)
    )
}

fn event(ch: &CompChannel, cq: &Arc<Cq>) {
    let got = ch.get_cq_event(Some(Duration::from_secs(10))).unwrap();
    assert!(Arc::ptr_eq(&got, cq));
    got.ack_events(1);
}

fn readable(ch: &CompChannel) -> bool {
    let mut fds = [PollFd::new(ch.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::ZERO).unwrap() == 1
}

fn recv(solicited: bool) -> WorkCompletion {
    WorkCompletion {
        opcode: WcOpcode::Recv,
        solicited,
        ..WorkCompletion::default()
    }
}

/// The `ibv_rc_pingpong -t -e` pattern: event, re-arm, a second completion raises a second
/// event, one poll pass consumes both completions.
#[test]
fn an_event_whose_completions_were_polled_is_withdrawn_and_the_request_restored() {
    let ctx = ctx();
    let ch = CompChannel::create(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, Some(&ch), 0).unwrap();
    cq.req_notify(false).unwrap();
    cq.push(WorkCompletion::default()).unwrap();
    event(&ch, &cq);
    cq.req_notify(false).unwrap();
    cq.push(WorkCompletion::default()).unwrap();
    assert!(readable(&ch), "the second completion raised an event");
    let mut wc = [WorkCompletion::default(); 4];
    assert_eq!(cq.poll(&mut wc), 2);
    assert!(!readable(&ch), "the spent event was withdrawn");
    assert!(no_event(&ch));
    // The request is armed again: the next completion is announced.
    cq.push(WorkCompletion::default()).unwrap();
    event(&ch, &cq);
    assert_eq!(cq.poll(&mut wc), 1);
    cq.destroy().unwrap();
    assert_eq!(cq.comp_event_counts(), (2, 2));
}

#[test]
fn an_event_stays_while_completions_remain() {
    let ctx = ctx();
    let ch = CompChannel::create(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, Some(&ch), 0).unwrap();
    cq.req_notify(false).unwrap();
    cq.push(WorkCompletion::default()).unwrap();
    cq.push(WorkCompletion::default()).unwrap();
    let mut wc = [WorkCompletion::default(); 1];
    assert_eq!(cq.poll(&mut wc), 1);
    event(&ch, &cq);
    assert_eq!(cq.poll(&mut wc), 1);
    // Delivered, so nothing to withdraw, and the request was spent: no further event.
    cq.push(WorkCompletion::default()).unwrap();
    assert!(no_event(&ch));
    cq.destroy().unwrap();
}

#[test]
fn a_delivered_event_does_not_rearm_the_cq() {
    let ctx = ctx();
    let ch = CompChannel::create(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, Some(&ch), 0).unwrap();
    cq.req_notify(false).unwrap();
    cq.push(WorkCompletion::default()).unwrap();
    event(&ch, &cq);
    let mut wc = [WorkCompletion::default(); 2];
    assert_eq!(cq.poll(&mut wc), 1);
    cq.push(WorkCompletion::default()).unwrap();
    assert!(no_event(&ch), "only ibv_req_notify_cq arms the CQ again");
    cq.destroy().unwrap();
}

#[test]
fn a_withdrawn_solicited_only_request_stays_solicited_only() {
    let ctx = ctx();
    let ch = CompChannel::create(&ctx).unwrap();
    let cq = Cq::create(&ctx, 8, Some(&ch), 0).unwrap();
    cq.req_notify(true).unwrap();
    cq.push(recv(true)).unwrap();
    let mut wc = [WorkCompletion::default(); 2];
    assert_eq!(cq.poll(&mut wc), 1);
    assert!(no_event(&ch));
    cq.push(recv(false)).unwrap();
    assert!(
        no_event(&ch),
        "an unsolicited receive does not fire a solicited-only request"
    );
    cq.push(recv(true)).unwrap();
    event(&ch, &cq);
    cq.destroy().unwrap();
}

/// Two CQs on one channel: withdrawing one CQ's spent event leaves the other's.
#[test]
fn withdrawal_leaves_other_cqs_events() {
    let ctx = ctx();
    let ch = CompChannel::create(&ctx).unwrap();
    let a = Cq::create(&ctx, 8, Some(&ch), 0).unwrap();
    let b = Cq::create(&ctx, 8, Some(&ch), 0).unwrap();
    a.req_notify(false).unwrap();
    b.req_notify(false).unwrap();
    a.push(WorkCompletion::default()).unwrap();
    b.push(WorkCompletion::default()).unwrap();
    let mut wc = [WorkCompletion::default(); 2];
    assert_eq!(a.poll(&mut wc), 1);
    event(&ch, &b);
    assert!(no_event(&ch));
    a.destroy().unwrap();
    b.destroy().unwrap();
}
