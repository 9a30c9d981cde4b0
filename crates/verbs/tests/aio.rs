//! The tokio integration (`softverbs::aio`): completion streams and async events on the
//! reactor, work requests as futures that own their buffers, and what happens to a buffer
//! when its future is dropped.

mod common;

use std::time::Duration;

use softverbs::aio::{AsyncEvents, AsyncQp, CompletionStream, WrError};
use softverbs::*;

const LOCAL: AccessFlags = AccessFlags::LOCAL_WRITE;
const REMOTE: AccessFlags = AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ);
const ALL: AccessFlags = LOCAL.union(REMOTE);
const LIMIT: Duration = Duration::from_secs(20);

const PATH: common::RcPath = common::RcPath {
    access: REMOTE,
    mtu: Mtu::Mtu1024,
    psn: 1,
    rd_atomic: 1,
    timeout: 14,
    retry_cnt: 7,
};

fn cap(depth: u32) -> QpCap {
    QpCap {
        max_send_wr: depth,
        max_recv_wr: depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    }
}

/// Two connected async RC QPs on one device.
fn pair(ctx: &Context, pd: &ProtectionDomain) -> (AsyncQp, AsyncQp) {
    let a = AsyncQp::new(pd, QpType::Rc, cap(16)).unwrap();
    let b = AsyncQp::new(pd, QpType::Rc, cap(16)).unwrap();
    common::connect_rc(ctx, a.qp(), b.qp().qp_num(), &PATH);
    common::connect_rc(ctx, b.qp(), a.qp().qp_num(), &PATH);
    (a, b)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

/// CPU seconds the calling thread used so far.
fn cpu() -> f64 {
    let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_THREAD).unwrap();
    let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
    t(u.user_time()) + t(u.system_time())
}

async fn within<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("within the time limit")
}

fn send_req(wr_id: u64, sge: Sge) -> SendRequest {
    SendRequest {
        wr_id,
        op: SendOp::Send {
            imm: None,
            invalidate: None,
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![sge]),
        ud: None,
        xrc_srqn: None,
    }
}

// On the test's own thread, so that the CPU it uses is the stream's (other tests run in
// parallel in this process).
#[tokio::test(flavor = "current_thread")]
async fn a_completion_stream_yields_completions_and_sleeps_when_idle() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let mut stream = CompletionStream::new(&ctx, 64).unwrap();
    let mk = || {
        let mut init = QpInit::new(QpType::Rc, stream.cq());
        init.sq_sig_all = true;
        pd.create_qp(&init).unwrap()
    };
    let (a, b) = (mk(), mk());
    common::connect_rc(&ctx, &a, b.qp_num(), &PATH);
    common::connect_rc(&ctx, &b, a.qp_num(), &PATH);
    let mr = pd.register_bytes(&pattern(1, 4096), ALL).unwrap();
    let dst = pd.register(4096, ALL).unwrap();
    b.post_recv(&common::recv_wrs(&dst, 10..11, 4096)).unwrap();
    a.post_send(&[send_req(20, mr.sge(0..4096).unwrap())]).unwrap();
    let mut got = [
        within(stream.next()).await.unwrap(),
        within(stream.next()).await.unwrap(),
    ];
    got.sort_by_key(|w| w.wr_id);
    assert_eq!(
        got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(10, WcStatus::Success), (20, WcStatus::Success)]
    );
    assert_eq!(dst.to_vec(), pattern(1, 4096));
    // Nothing in flight: the stream sleeps on its channel, using no CPU.
    let before = cpu();
    let idle = tokio::time::timeout(Duration::from_millis(500), stream.next()).await;
    let used = cpu() - before;
    assert!(idle.is_err(), "no completion while idle");
    assert!(used < 0.1, "{used:.3} CPU s in 0.5 s idle: a busy loop?");
    // A completion after the stream armed the CQ and slept wakes it.
    let waker = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        b.post_recv(&common::recv_wrs(&dst, 11..12, 4096)).unwrap();
        a.post_send(&[send_req(21, mr.sge(0..16).unwrap())]).unwrap();
        (a, b, mr, dst)
    });
    let first = within(stream.next()).await.unwrap();
    let second = within(stream.next()).await.unwrap();
    let mut ids = [first.wr_id, second.wr_id];
    ids.sort_unstable();
    assert_eq!(ids, [11, 21]);
    drop(waker.await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_events_arrive_through_the_reactor() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let events = AsyncEvents::new(&ctx).unwrap();
    // Nothing pending: the wait times out.
    assert!(tokio::time::timeout(Duration::from_millis(100), events.next())
        .await
        .is_err());
    // An SRQ whose posted receives drop below its limit raises IBV_EVENT_SRQ_LIMIT_REACHED.
    let cq = ctx.create_cq(16, None, 0).unwrap();
    let srq = pd
        .create_srq(&SrqAttr {
            max_wr: 16,
            max_sge: 1,
            srq_limit: 0,
        })
        .unwrap();
    let mut init = QpInit::new(QpType::Rc, &cq);
    init.srq = Some(&srq);
    let a = pd.create_qp(&init).unwrap();
    let b = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    common::connect_rc(&ctx, &a, b.qp_num(), &PATH);
    common::connect_rc(&ctx, &b, a.qp_num(), &PATH);
    let dst = pd.register(4096, ALL).unwrap();
    srq.post_recv(&common::recv_wrs(&dst, 0..3, 64)).unwrap();
    srq.modify(
        &SrqAttr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: 3,
        },
        SrqAttrMask::LIMIT.bits(),
    )
    .unwrap();
    let src = pd.register(64, ALL).unwrap();
    let waiter = tokio::spawn(async move { within(events.next()).await.map(|e| e.event_type()) });
    tokio::time::sleep(Duration::from_millis(20)).await;
    b.post_send(&[send_req(1, src.sge(0..8).unwrap())]).unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), EventType::SrqLimitReached);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_recv_write_and_read_as_futures() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let (a, b) = pair(&ctx, &pd);
    let inbox = pd.register_owned(vec![0u8; 64 * 1024], ALL).unwrap();
    let outbox = pd.register_owned(pattern(2, 64 * 1024), LOCAL).unwrap();
    let recv = b.recv(inbox, 0..64 * 1024);
    let ((sent, outbox), (got, inbox)) =
        within(async { tokio::join!(a.send(outbox, 0..10_000), recv) }).await;
    assert_eq!(sent.unwrap().opcode, WcOpcode::Send);
    let wc = got.unwrap();
    assert_eq!((wc.opcode, wc.byte_len), (WcOpcode::Recv, 10_000));
    assert_eq!(inbox.local()[..10_000], pattern(2, 64 * 1024)[..10_000]);
    // WRITE into the peer's region, then READ it back into a plain (atomic) region.
    let remote = inbox.remote(20_000);
    let (r, outbox) = within(a.write(outbox, 0..30_000, remote)).await;
    r.unwrap();
    let back = pd.register(30_000, ALL).unwrap();
    let (r, back) = within(a.read(back, 0..30_000, remote)).await;
    assert_eq!(r.unwrap().opcode, WcOpcode::RdmaRead);
    assert_eq!(back.to_vec(), outbox.local()[..30_000]);
    assert_eq!(inbox.local()[20_000..50_000], outbox.local()[..30_000]);
    assert_eq!((a.outstanding(), b.outstanding()), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_hand_the_buffer_back() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let (a, _b) = pair(&ctx, &pd);
    let buf = pd.register_owned(vec![1u8; 100], ALL).unwrap();
    // Outside the buffer: not posted.
    let (r, buf) = a.send(buf, 50..200).await;
    assert!(matches!(r, Err(WrError::Post(ref e)) if e.errno() == 22), "{r:?}");
    // A WRITE with a key the peer does not have: an error completion.
    let bogus = RemoteAddr {
        addr: buf.addr(),
        rkey: buf.rkey() ^ 0x5a5a,
    };
    let (r, buf) = within(a.write(buf, 0..10, bogus)).await;
    assert_eq!(r.unwrap_err().status(), Some(WcStatus::RemAccessErr));
    // The QP is in error now: later requests are flushed, the buffer still comes back.
    let (r, buf) = within(a.send(buf, 0..10)).await;
    assert_eq!(r.unwrap_err().status(), Some(WcStatus::WrFlushErr));
    assert_eq!(buf.to_vec(), vec![1u8; 100]);
}

/// Scribbles over freshly allocated memory of `len`-byte allocations: a buffer freed too
/// early would likely be reused here.
fn churn(len: usize) {
    let junk: Vec<Vec<u8>> = (0..16).map(|k| vec![0xF0 | k as u8; len]).collect();
    std::hint::black_box(&junk);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_receive_keeps_its_buffer_posted_until_its_completion() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let (a, b) = pair(&ctx, &pd);
    let n = 32 * 1024;
    // A receive given up by a timeout: the request stays posted with its buffer.
    let first = pd.register_owned(vec![0u8; n], LOCAL).unwrap();
    let timed_out = tokio::time::timeout(Duration::from_millis(50), b.recv(first, 0..n)).await;
    assert!(timed_out.is_err());
    assert_eq!(b.outstanding(), 1, "still posted, the buffer kept by the QP");
    churn(n);
    let second = pd.register_owned(vec![0u8; n], LOCAL).unwrap();
    let second = b.recv(second, 0..n);
    // Two messages: the first goes to the abandoned buffer, the second to `second`.
    for seed in [5u8, 6] {
        let out = pd.register_owned(pattern(seed, n), LOCAL).unwrap();
        let (r, _) = within(a.send(out, 0..n)).await;
        r.unwrap();
    }
    let (r, second) = within(second).await;
    assert_eq!(r.unwrap().byte_len as usize, n);
    assert_eq!(
        second.local()[..],
        pattern(6, n)[..],
        "the order of receives is kept"
    );
    // The abandoned one completed (and its buffer was freed) without anyone waiting.
    within(async {
        while b.outstanding() > 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    assert_eq!(b.stray_completions(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_send_keeps_its_buffer_until_its_completion() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let (a, b) = pair(&ctx, &pd);
    let n = 256 * 1024;
    let mut recvs = Vec::new();
    for _ in 0..8 {
        recvs.push(b.recv(pd.register_owned(vec![0u8; n], LOCAL).unwrap(), 0..n));
    }
    // Post eight sends and drop each future at once; the buffers must survive the churn.
    for seed in 0..8u8 {
        drop(a.send(pd.register_owned(pattern(seed, n), LOCAL).unwrap(), 0..n));
        churn(n);
    }
    for (seed, recv) in recvs.into_iter().enumerate() {
        let (r, buf) = within(recv).await;
        assert_eq!(r.unwrap().byte_len as usize, n);
        assert!(
            buf.local()[..] == pattern(seed as u8, n)[..],
            "message {seed} intact"
        );
    }
    within(async {
        while a.outstanding() > 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_handle_flushes_outstanding_requests_and_frees_their_buffers() {
    // A device with room for four regions: the buffers of abandoned requests must be freed
    // (deregistered) once the queue pair is gone, or the next registrations fail.
    let ctx = common::lo_with("max_mr=4");
    let pd = ctx.alloc_pd().unwrap();
    let qp = AsyncQp::new(&pd, QpType::Rc, cap(8)).unwrap();
    common::to_init(qp.qp());
    let qpn = qp.qp().qp_num();
    for _ in 0..4 {
        drop(qp.recv(pd.register_owned(vec![0u8; 4096], LOCAL).unwrap(), 0..4096));
    }
    assert_eq!(qp.outstanding(), 4);
    assert!(
        pd.register_owned(vec![0u8; 4096], LOCAL).is_err(),
        "all four regions in use"
    );
    drop(qp);
    let again: Vec<_> = (0..4)
        .map(|_| pd.register_owned(vec![0u8; 4096], LOCAL).unwrap())
        .collect();
    assert_eq!(again.len(), 4);
    assert_ne!(qpn, 0);
}

#[test]
fn outside_a_runtime_the_async_api_says_so() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    assert_eq!(CompletionStream::new(&ctx, 4).unwrap_err().errno(), 22);
    assert_eq!(AsyncEvents::new(&ctx).unwrap_err().errno(), 22);
    assert_eq!(AsyncQp::new(&pd, QpType::Rc, cap(4)).unwrap_err().errno(), 22);
}

#[tokio::test]
async fn only_connected_types_make_async_queue_pairs() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    assert_eq!(AsyncQp::new(&pd, QpType::Ud, cap(4)).unwrap_err().errno(), 22);
    assert!(AsyncQp::new(&pd, QpType::Uc, cap(4)).is_ok());
}

/// Waits (bounded) until `qp` has `n` requests outstanding.
async fn outstanding(qp: &AsyncQp, n: usize) {
    within(async {
        while qp.outstanding() != n {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_task_and_a_lost_select_branch_leave_their_buffers_with_the_queue_pair() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let (a, b) = pair(&ctx, &pd);
    let n = 48 * 1024;
    // A task awaiting a receive, aborted: its future (and the `Op` in it) is dropped.
    let buf = pd.register_owned(vec![0u8; n], LOCAL).unwrap();
    let b2 = b.clone();
    let task = tokio::spawn(async move { b2.recv(buf, 0..n).await });
    outstanding(&b, 1).await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_eq!(b.outstanding(), 1, "the aborted task's receive stays posted");
    // A receive that loses a `select!` against a timer.
    let op = b.recv(pd.register_owned(vec![0u8; n], LOCAL).unwrap(), 0..n);
    tokio::select! {
        _ = op => panic!("nothing was sent yet"),
        () = tokio::time::sleep(Duration::from_millis(20)) => {}
    }
    assert_eq!(b.outstanding(), 2, "so does the lost branch's");
    churn(n);
    // Three messages: the first two land in the abandoned buffers (still allocated, still
    // registered), the third in a receive someone awaits.
    let third = b.recv(pd.register_owned(vec![0u8; n], LOCAL).unwrap(), 0..n);
    for seed in [7u8, 8, 9] {
        let (r, _) = within(a.send(pd.register_owned(pattern(seed, n), LOCAL).unwrap(), 0..n)).await;
        r.unwrap();
    }
    let (r, third) = within(third).await;
    assert_eq!(r.unwrap().byte_len as usize, n);
    assert!(
        third.local()[..] == pattern(9, n)[..],
        "receives keep their order"
    );
    outstanding(&b, 0).await;
    assert_eq!(b.stray_completions(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_request_leaks_its_buffer_instead_of_freeing_it() {
    // `mem::forget` runs no destructor: the buffer the request owns is never freed nor
    // deregistered, so the device's later write lands in memory nobody else can get.
    let ctx = common::lo_with("max_mr=3");
    let pd = ctx.alloc_pd().unwrap();
    let (a, b) = pair(&ctx, &pd);
    let n = 16 * 1024;
    std::mem::forget(b.recv(pd.register_owned(vec![0u8; n], LOCAL).unwrap(), 0..n));
    churn(n);
    let (r, out) = within(a.send(pd.register_owned(pattern(4, n), LOCAL).unwrap(), 0..n)).await;
    r.unwrap();
    drop(out);
    outstanding(&b, 0).await;
    // Three regions at most: the forgotten one still holds its place.
    let one = pd.register_owned(vec![0u8; 64], LOCAL).unwrap();
    let two = pd.register_owned(vec![0u8; 64], LOCAL).unwrap();
    assert!(
        pd.register_owned(vec![0u8; 64], LOCAL).is_err(),
        "the forgotten request's region is still registered"
    );
    drop((one, two));
}

#[test]
fn requests_outlive_their_runtime_and_complete_flushed() {
    // The completion task ends with its runtime; an `Op` polled afterwards (on another
    // runtime) flushes the queue pair itself and resolves, with its buffer.
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (a, _b, recv) = first.block_on(async {
        let (a, b) = pair(&ctx, &pd);
        let recv = b.recv(pd.register_owned(vec![3u8; 4096], LOCAL).unwrap(), 0..4096);
        (a, b, recv)
    });
    drop(first);
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (r, buf) = second.block_on(within(recv));
    assert_eq!(r.unwrap_err().status(), Some(WcStatus::WrFlushErr));
    assert_eq!(buf.local()[..], [3u8; 4096][..], "handed back untouched");
    // New requests are refused at once, and their buffer comes back too.
    let (r, buf) = second.block_on(a.send(pd.register_owned(vec![1u8; 16], LOCAL).unwrap(), 0..16));
    assert!(matches!(r, Err(WrError::Post(ref e)) if e.errno() == 22), "{r:?}");
    assert_eq!(buf.dereg().map_err(|(_, e)| e).unwrap(), vec![1u8; 16]);
}
