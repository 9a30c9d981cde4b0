//! Async verbs on tokio (feature `tokio`).
//!
//! - [`AsyncCompletionChannel`] and [`AsyncEvents`]: a completion channel and a context's
//!   async event fd as tokio [`AsyncFd`]s. Both fds are readable exactly while an event is
//!   pending, so a task waiting on them sleeps in the reactor: no thread and no busy loop.
//! - [`CompletionStream`]: a CQ with its own channel whose [`CompletionStream::next`] yields
//!   work completions, arming the CQ and sleeping on the channel when it is empty.
//! - [`AsyncQp`]: an RC or UC queue pair whose work requests are futures. [`AsyncQp::send`],
//!   [`AsyncQp::recv`], [`AsyncQp::write`], [`AsyncQp::read`] (and [`AsyncQp::post`] for any
//!   operation) post one work request at once and return an [`Op`] that resolves to its
//!   completion and the buffer.
//!
//! # Buffers belong to the work request until its completion
//!
//! A work request names its memory by address; the device may read or write that memory until
//! the request completes (successfully, in error, or flushed). Here the request *owns* it: the
//! operation takes the buffer (a [`MemoryRegion`] or an [`OwnedRegion`], anything that is
//! [`WrBuffer`]) by value, and only the completion hands it back. Dropping the [`Op`] (a
//! cancelled `select!` branch, a timeout, an aborted task) does not end the request: the buffer
//! moves into the queue pair, which keeps it until the completion arrives and then drops it.
//! When the last handle of the queue pair goes, it is moved to the error state first (which
//! flushes every outstanding request) and the buffers are dropped after. So a buffer is never
//! reused, changed or freed while the device may still use it, whatever the program cancels,
//! and the type system says so: a buffer you hold is one no work request uses.
//!
//! ```compile_fail,E0382
//! # async fn f(qp: softverbs::aio::AsyncQp, mr: softverbs::MemoryRegion) {
//! let op = qp.send(mr, 0..64);
//! mr.write(0, b"changed while in flight"); // error: `mr` was moved into the work request
//! # }
//! ```
//!
//! Leaking an [`Op`] (`std::mem::forget`, a reference cycle) leaks its buffer with it: the
//! memory is never freed nor deregistered, so the device's later accesses still land in memory
//! nobody else is given. Ownership, unlike a borrow, stays sound when a destructor never runs.
//!
//! # Compared with rust-ibverbs and async-rdma
//!
//! How each crate keeps a buffer alive and untouched while the device (or a peer) uses it
//! (rust-ibverbs as of its `MemoryRegion<O>` API, async-rdma as of its `LocalMr` API):
//!
//! | | rust-ibverbs | async-rdma | softverbs |
//! |---|---|---|---|
//! | posting a work request | `unsafe fn post_send`/`post_receive`: the caller promises the memory stays valid and untouched until the completion | safe, awaited (`rdma.write(&lmr, &mut rmr).await`) | safe; the request takes the buffer by value ([`AsyncQp::send`], ...) |
//! | the future dropped (timeout, `select!`, aborted task) | no futures; a buffer freed or reused too early is undefined behaviour | the in-flight request keeps holding the region's lock: later requests on the region fail and its accessors block until the completion | the buffer moves into the queue pair until the completion, then is dropped; nothing waits |
//! | the handle leaked (`mem::forget`) | undefined behaviour if the memory is then freed | not examined | the buffer is leaked, never freed nor deregistered |
//! | the program's own access to registered memory | `bytes_mut()` hands out `&mut [u8]` at any time, while a receive or a peer's WRITE may be landing (a data race the documentation warns of) | blocking read/write lock guards (a runtime thread may block), raw pointers for the rest | copying accessors at any time; slices only inside guards that make the device's accesses fail meanwhile ([`OwnedRegion::local`], [`OwnedRegion::local_mut`]); never blocks on the device |
//! | a peer's RDMA WRITE or READ | not tracked: lands in memory the program may be holding a `&mut [u8]` of | lent by a protocol of its own (`request_remote_mr`, `send_remote_mr`, with a timeout); the device is not kept out while the program holds a guard | refused (a remote-access NAK) while a guard excludes it |
//! | the program's own buffers | `MemoryRegion<O>` over any `DerefMut<Target = [u8]>`, handed back by `into_inner` | memory the crate allocates | `Vec<u8>`, `Box<[u8]>`, `BytesMut`, `memmap2` mappings, handed back by [`OwnedRegion::dereg`]; borrows through [`ProtectionDomain::scoped`] or the `unsafe` [`ProtectionDomain::register_borrowed`] |
//! | tearing down under outstanding requests | the caller's business (the `unsafe` contracts) | not examined | the last handle moves the QP to ERR (flushing every request) before it frees their buffers |
//!
//! So posting is safe, a cancelled request keeps its buffer by ownership rather than by a
//! lock, nothing blocks a thread of the runtime, and a peer's access to a region is held to
//! the same rule as a local request's (see [`crate::zero_copy`]).
//!
//! ```
//! use softverbs::aio::AsyncQp;
//! use softverbs::{devices, AccessFlags, QpAttr, QpAttrMask, QpCap, QpState, QpType};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").unwrap().open()?;
//! let pd = ctx.alloc_pd()?;
//! let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
//! let qp = AsyncQp::new(&pd, QpType::Rc, cap)?;
//! let init = QpAttr { qp_state: QpState::Init, port_num: 1, ..Default::default() };
//! let mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
//! qp.qp().modify(&init, mask)?;
//! let buf = pd.register_owned(vec![0u8; 4096], AccessFlags::LOCAL_WRITE)?;
//! // In INIT, not connected yet: the receive is posted and waits; dropping it leaves the
//! // buffer with the QP.
//! let recv = qp.recv(buf, 0..4096);
//! assert_eq!(qp.outstanding(), 1);
//! drop(recv);
//! assert_eq!(qp.outstanding(), 1, "still posted, the buffer kept by the queue pair");
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;
use softverbs_device::qp::SendRequest;
use softverbs_engine::types::{
    QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SendFlags, WcStatus, WorkCompletion,
};
use softverbs_engine::wr::{Payload, RemoteAddr, SendOp};
use softverbs_engine::{Error, Result};
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use crate::context::{AsyncEvent, Context};
use crate::cq::{CompletionChannel, CompletionQueue, CqEvent};
use crate::pd::{MemoryRegion, ProtectionDomain};
use crate::qp::{QpInit, QueuePair};
use crate::zero_copy::{OwnedRegion, StableBuffer};

mod reactor;

use reactor::EventFd;

fn runtime() -> Result<()> {
    tokio::runtime::Handle::try_current()
        .map(drop)
        .map_err(|_| Error::invalid("the async API needs a tokio runtime (with I/O enabled)"))
}

/// A completion channel registered with the tokio reactor: [`AsyncCompletionChannel::get_cq_event`]
/// waits for the next CQ event without blocking a thread.
///
/// Create it inside a tokio runtime with I/O enabled (EINVAL otherwise).
#[derive(Debug)]
pub struct AsyncCompletionChannel {
    fd: AsyncFd<EventFd<CompletionChannel>>,
}

impl AsyncCompletionChannel {
    /// Registers `channel` with the current runtime's reactor.
    pub fn new(channel: CompletionChannel) -> Result<Self> {
        Ok(Self {
            fd: reactor::register(channel)?,
        })
    }

    /// The channel.
    pub fn channel(&self) -> &CompletionChannel {
        self.fd.get_ref().get()
    }

    /// `ibv_get_cq_event`, awaited: the next CQ event (acknowledged when dropped).
    pub async fn get_cq_event(&self) -> Result<CqEvent> {
        std::future::poll_fn(|cx| self.poll_cq_event(cx)).await
    }

    /// Polls for the next CQ event: `Pending` (with `cx` woken when one arrives) if there is
    /// none. Only the task that polled last is woken.
    pub fn poll_cq_event(&self, cx: &mut TaskContext<'_>) -> Poll<Result<CqEvent>> {
        loop {
            let mut ready = match self.fd.poll_read_ready(cx) {
                Poll::Ready(r) => r?,
                Poll::Pending => return Poll::Pending,
            };
            // The fd is readable exactly while an event is pending; the channel's own lock
            // decides who gets it, so taking it without waiting is the non-blocking read.
            match self.channel().get_cq_event_timeout(Some(Duration::ZERO)) {
                Err(Error::WouldBlock) => ready.clear_ready(),
                r => return Poll::Ready(r),
            }
        }
    }
}

/// A context's async event fd registered with the tokio reactor: [`AsyncEvents::next`] waits
/// for the next async event (`ibv_get_async_event`) without blocking a thread.
#[derive(Debug)]
pub struct AsyncEvents {
    fd: AsyncFd<EventFd<Context>>,
}

impl AsyncEvents {
    /// Registers `ctx`'s async event fd with the current runtime's reactor (EINVAL outside a
    /// runtime with I/O enabled).
    pub fn new(ctx: &Context) -> Result<Self> {
        Ok(Self {
            fd: reactor::register(ctx.clone())?,
        })
    }

    /// The next async event (acknowledged when dropped).
    pub async fn next(&self) -> Result<AsyncEvent> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// Polls for the next async event; `Pending` if none is pending. Only the task that polled
    /// last is woken.
    pub fn poll_next(&self, cx: &mut TaskContext<'_>) -> Poll<Result<AsyncEvent>> {
        loop {
            let mut ready = match self.fd.poll_read_ready(cx) {
                Poll::Ready(r) => r?,
                Poll::Pending => return Poll::Pending,
            };
            match self
                .fd
                .get_ref()
                .get()
                .get_async_event_timeout(Some(Duration::ZERO))
            {
                Err(Error::WouldBlock) => ready.clear_ready(),
                r => return Poll::Ready(r),
            }
        }
    }
}

/// Completions polled per call.
const BATCH: usize = 32;

/// A completion queue with a channel of its own, read as a stream of work completions.
///
/// [`CompletionStream::next`] returns the next completion; when the CQ is empty it arms the CQ
/// (`ibv_req_notify_cq`), looks once more (a completion may have come in between), and then
/// sleeps until the channel has an event. Create it inside a tokio runtime.
///
/// ```
/// use softverbs::aio::CompletionStream;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> softverbs::Result<()> {
/// let ctx = softverbs::devices()?.into_iter().find(|d| d.netdev() == "lo").unwrap().open()?;
/// let mut stream = CompletionStream::new(&ctx, 64)?;
/// // Create QPs on `stream.cq()`, post, then: `let wc = stream.next().await?;`
/// assert!(stream.cq().cqe() >= 64);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct CompletionStream {
    cq: CompletionQueue,
    channel: AsyncCompletionChannel,
    batch: [WorkCompletion; BATCH],
    filled: usize,
    pos: usize,
    armed: bool,
}

impl CompletionStream {
    /// A CQ of at least `cqe` entries on a channel of its own.
    pub fn new(ctx: &Context, cqe: i32) -> Result<Self> {
        runtime()?;
        let channel = ctx.create_comp_channel()?;
        let cq = ctx.create_cq(cqe, Some(&channel), 0)?;
        Ok(Self {
            cq,
            channel: AsyncCompletionChannel::new(channel)?,
            batch: [WorkCompletion::default(); BATCH],
            filled: 0,
            pos: 0,
            armed: false,
        })
    }

    /// The CQ, to create QPs on.
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// The next work completion.
    pub async fn next(&mut self) -> Result<WorkCompletion> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// Polls for the next work completion: `Pending` (with `cx` woken by the next completion
    /// event) if the CQ is empty.
    pub fn poll_next(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<WorkCompletion>> {
        loop {
            if self.pos < self.filled {
                self.pos += 1;
                return Poll::Ready(Ok(self.batch[self.pos - 1]));
            }
            self.filled = self.cq.poll(&mut self.batch);
            self.pos = 0;
            if self.filled > 0 {
                continue;
            }
            if !self.armed {
                // Arm, then look again: a completion that came before the arm raised no event.
                if let Err(e) = self.cq.req_notify(false) {
                    return Poll::Ready(Err(e));
                }
                self.armed = true;
                continue;
            }
            match self.channel.poll_cq_event(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(event)) => {
                    event.ack();
                    self.armed = false;
                }
            }
        }
    }
}

/// Memory a work request of an [`AsyncQp`] can own: a registered region.
pub trait WrBuffer: Send + 'static {
    /// The region whose keys and addresses the work request uses.
    fn region(&self) -> &MemoryRegion;
}

impl WrBuffer for MemoryRegion {
    fn region(&self) -> &MemoryRegion {
        self
    }
}

impl<B: StableBuffer> WrBuffer for OwnedRegion<B> {
    fn region(&self) -> &MemoryRegion {
        self
    }
}

/// Why a work request of an [`AsyncQp`] did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum WrError {
    /// It was not posted (the range is outside the buffer, the queue is full, the QP is in a
    /// state that refuses it, ...).
    #[error("the work request was not posted: {0}")]
    Post(#[source] Error),
    /// It completed with an error status (the completion tells which).
    #[error("the work request completed with {:?}", .0.status)]
    Completion(Box<WorkCompletion>),
}

impl WrError {
    /// The completion status, if the request was posted.
    pub fn status(&self) -> Option<WcStatus> {
        match self {
            Self::Post(_) => None,
            Self::Completion(wc) => Some(wc.status),
        }
    }
}

/// What an outstanding work request waits for.
enum Slot {
    /// Its [`Op`] waits (and wants this waker woken).
    Waiting(Option<Waker>),
    /// The completion arrived; the [`Op`] has not taken it yet.
    Done(WorkCompletion),
    /// The [`Op`] was dropped: the queue pair keeps the buffer until the completion.
    Abandoned(#[allow(dead_code)] Box<dyn Send>),
}

#[derive(Default)]
struct Table {
    next: u64,
    slots: HashMap<u64, Slot>,
    /// Completions of work requests posted on the QP directly, not through the [`AsyncQp`].
    strays: u64,
    /// The completion task has ended (its runtime shut down, or its channel failed):
    /// [`Op`]s poll the CQ themselves.
    closed: bool,
    /// Moved to the error state because the task ended.
    flushed: bool,
}

struct Shared {
    // Field order is drop order: the QP handle before the table, whose abandoned buffers
    // the QP may have used.
    qp: QueuePair,
    cq: CompletionQueue,
    table: Mutex<Table>,
    /// Dropping it ends the completion task.
    _stop: oneshot::Sender<()>,
}

impl Shared {
    /// Hands `wc` to its work request.
    fn complete(&self, wc: WorkCompletion) {
        let mut t = self.table.lock();
        let (waker, freed) = match t.slots.get_mut(&wc.wr_id) {
            Some(Slot::Waiting(w)) => {
                let w = w.take();
                t.slots.insert(wc.wr_id, Slot::Done(wc));
                (w, None)
            }
            Some(Slot::Abandoned(_)) => (None, t.slots.remove(&wc.wr_id)),
            Some(Slot::Done(_)) | None => {
                t.strays += 1;
                (None, None)
            }
        };
        drop(t);
        // The buffer of a dropped request is freed here, outside the lock: the device is done.
        drop(freed);
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The completion task ended: wake every waiter, which then polls the CQ itself.
    fn close(&self) {
        let mut t = self.table.lock();
        t.closed = true;
        let wakers: Vec<Waker> = t
            .slots
            .values_mut()
            .filter_map(|s| match s {
                Slot::Waiting(w) => w.take(),
                _ => None,
            })
            .collect();
        drop(t);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Without the completion task: flush the QP (once) so every outstanding request
    /// completes, and route what the CQ holds.
    fn drain_inline(&self) {
        let flush = {
            let mut t = self.table.lock();
            !std::mem::replace(&mut t.flushed, true)
        };
        if flush {
            let _ = to_error(&self.qp);
        }
        let mut wc = [WorkCompletion::default(); BATCH];
        loop {
            let n = self.cq.poll(&mut wc);
            wc[..n].iter().for_each(|w| self.complete(*w));
            if n < BATCH {
                break;
            }
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Requests still outstanding own buffers that are dropped next: flush them first, so
        // the device is done with those buffers (even if handles of the QP live on elsewhere).
        if !self.table.get_mut().slots.is_empty() {
            let _ = to_error(&self.qp);
        }
    }
}

fn to_error(qp: &QueuePair) -> Result<()> {
    qp.modify(
        &QpAttr {
            qp_state: QpState::Err,
            ..Default::default()
        },
        QpAttrMask::STATE,
    )
}

/// Marks the queue pair's table closed when the completion task ends, however it ends.
struct Closer(Weak<Shared>);

impl Drop for Closer {
    fn drop(&mut self) {
        if let Some(s) = self.0.upgrade() {
            s.close();
        }
    }
}

async fn dispatch(mut stream: CompletionStream, shared: Weak<Shared>, mut stop: oneshot::Receiver<()>) {
    let _closer = Closer(shared.clone());
    loop {
        let next = std::future::poll_fn(|cx| {
            if Pin::new(&mut stop).poll(cx).is_ready() {
                return Poll::Ready(None);
            }
            stream.poll_next(cx).map(Some)
        })
        .await;
        match (next, shared.upgrade()) {
            (Some(Ok(wc)), Some(s)) => s.complete(wc),
            _ => return,
        }
    }
}

/// A reliable or unreliable connected queue pair whose work requests are futures owning their
/// buffers (see the [module documentation](self)).
///
/// It has one CQ (with a channel of its own) for both queues, sized for every request the
/// queues can hold, and a task on the current tokio runtime that sleeps on the channel and
/// hands each completion to its request. Connect it with [`AsyncQp::qp`]'s
/// [`QueuePair::modify`] as any QP. Work requests posted on that `QueuePair` directly are not
/// tracked: their completions are counted ([`AsyncQp::stray_completions`]) and dropped.
/// Cheap to clone; the QP is destroyed with the last clone and the last outstanding [`Op`].
#[derive(Clone)]
pub struct AsyncQp {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for AsyncQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncQp")
            .field("qp_num", &self.shared.qp.qp_num())
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

impl AsyncQp {
    /// An RC or UC QP (EINVAL for other types) with capabilities `cap` on `pd`, and its
    /// completion task on the current tokio runtime (EINVAL outside one).
    pub fn new(pd: &ProtectionDomain, qp_type: QpType, cap: QpCap) -> Result<Self> {
        if !matches!(qp_type, QpType::Rc | QpType::Uc) {
            return Err(Error::invalid("an AsyncQp is RC or UC"));
        }
        let want = cap.max_send_wr.saturating_add(cap.max_recv_wr).max(1);
        let stream = CompletionStream::new(pd.context(), i32::try_from(want).unwrap_or(i32::MAX))?;
        let cq = stream.cq().clone();
        let qp = pd.create_qp(&QpInit {
            qp_type,
            send_cq: &cq,
            recv_cq: &cq,
            srq: None,
            cap,
            sq_sig_all: false,
        })?;
        // Every request is signaled: the CQ must hold a completion for each one the queues
        // can hold, or it would overrun.
        let granted = qp.cap();
        let need = granted.max_send_wr.saturating_add(granted.max_recv_wr);
        if need > cq.cqe() {
            cq.resize(i32::try_from(need).unwrap_or(i32::MAX))?;
        }
        let (stop, stopped) = oneshot::channel();
        let shared = Arc::new(Shared {
            qp,
            cq,
            table: Mutex::new(Table::default()),
            _stop: stop,
        });
        tokio::spawn(dispatch(stream, Arc::downgrade(&shared), stopped));
        Ok(Self { shared })
    }

    /// The queue pair, to connect (`modify`), query, or read counters of.
    pub fn qp(&self) -> &QueuePair {
        &self.shared.qp
    }

    /// Work requests posted through this QP whose completion has not been taken yet, including
    /// those whose [`Op`] was dropped (their buffers are still held).
    pub fn outstanding(&self) -> usize {
        self.shared
            .table
            .lock()
            .slots
            .values()
            .filter(|s| !matches!(s, Slot::Done(_)))
            .count()
    }

    /// Completions of work requests that were not posted through this `AsyncQp`.
    pub fn stray_completions(&self) -> u64 {
        self.shared.table.lock().strays
    }

    /// SEND of `range` of `buf`; the [`Op`] resolves at the completion, handing `buf` back.
    pub fn send<R: WrBuffer>(&self, buf: R, range: Range<usize>) -> Op<R> {
        self.post(
            SendOp::Send {
                imm: None,
                invalidate: None,
            },
            buf,
            range,
        )
    }

    /// RDMA WRITE of `range` of `buf` to `remote`.
    pub fn write<R: WrBuffer>(&self, buf: R, range: Range<usize>, remote: RemoteAddr) -> Op<R> {
        self.post(SendOp::Write { remote, imm: None }, buf, range)
    }

    /// RDMA READ from `remote` into `range` of `buf`.
    pub fn read<R: WrBuffer>(&self, buf: R, range: Range<usize>, remote: RemoteAddr) -> Op<R> {
        self.post(SendOp::Read { remote }, buf, range)
    }

    /// A receive into `range` of `buf`; the completion's `byte_len` says how much arrived.
    pub fn recv<R: WrBuffer>(&self, buf: R, range: Range<usize>) -> Op<R> {
        self.start(buf, range, |qp, wr_id, sg_list| {
            qp.post_recv(&[RecvWr { wr_id, sg_list }]).map_err(Error::from)
        })
    }

    /// Posts `op` (signaled) with `range` of `buf` as its gather or scatter list (none for an
    /// empty range), now; the returned [`Op`] resolves at its completion.
    pub fn post<R: WrBuffer>(&self, op: SendOp, buf: R, range: Range<usize>) -> Op<R> {
        self.start(buf, range, move |qp, wr_id, sges| {
            qp.post_send(&[SendRequest {
                wr_id,
                op,
                flags: SendFlags::SIGNALED,
                payload: Payload::Sges(sges),
                ud: None,
                xrc_srqn: None,
            }])
            .map_err(Error::from)
        })
    }

    fn start<R: WrBuffer>(
        &self,
        buf: R,
        range: Range<usize>,
        post: impl FnOnce(&QueuePair, u64, Vec<softverbs_engine::types::Sge>) -> Result<()>,
    ) -> Op<R> {
        let failed = |buf, e| Op {
            shared: self.shared.clone(),
            id: None,
            buf: Some(buf),
            early: Some(WrError::Post(e)),
        };
        let sges = if range.is_empty() {
            Vec::new()
        } else {
            match buf.region().sge(range) {
                Ok(sge) => vec![sge],
                Err(e) => return failed(buf, e),
            }
        };
        let id = {
            let mut t = self.shared.table.lock();
            if t.closed {
                drop(t);
                return failed(buf, Error::invalid("the queue pair's completion task has ended"));
            }
            let id = t.next;
            t.next += 1;
            t.slots.insert(id, Slot::Waiting(None));
            id
        };
        if let Err(e) = post(&self.shared.qp, id, sges) {
            self.shared.table.lock().slots.remove(&id);
            return failed(buf, e);
        }
        Op {
            shared: self.shared.clone(),
            id: Some(id),
            buf: Some(buf),
            early: None,
        }
    }
}

/// One posted work request of an [`AsyncQp`]: resolves to its completion (`Ok` only for
/// `IBV_WC_SUCCESS`) and the buffer. Dropping it before that leaves the request and its buffer
/// with the queue pair until the completion (see the [module documentation](self)).
#[must_use = "dropping an Op leaves its buffer with the queue pair until the completion"]
pub struct Op<R: WrBuffer> {
    shared: Arc<Shared>,
    /// `None` if it was never posted.
    id: Option<u64>,
    buf: Option<R>,
    early: Option<WrError>,
}

impl<R: WrBuffer> std::fmt::Debug for Op<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Op")
            .field("wr_id", &self.id)
            .field("done", &self.buf.is_none())
            .finish_non_exhaustive()
    }
}

impl<R: WrBuffer> Op<R> {
    /// The work request id the completion carries (`None` if it was not posted).
    pub fn wr_id(&self) -> Option<u64> {
        self.id
    }
}

// The buffer is never pinned: an `Op` only moves it in and out whole.
impl<R: WrBuffer> Unpin for Op<R> {}

impl<R: WrBuffer> Future for Op<R> {
    type Output = (Result<WorkCompletion, WrError>, R);

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(e) = this.early.take() {
            return Poll::Ready((
                Err(e),
                this.buf.take().expect("an Op is not polled after it resolved"),
            ));
        }
        let id = this.id.expect("a posted request has an id");
        for attempt in 0..2 {
            let mut t = this.shared.table.lock();
            let closed = t.closed;
            match t.slots.get_mut(&id) {
                Some(Slot::Done(_)) => {
                    let Some(Slot::Done(wc)) = t.slots.remove(&id) else {
                        unreachable!()
                    };
                    drop(t);
                    let r = if wc.status == WcStatus::Success {
                        Ok(wc)
                    } else {
                        Err(WrError::Completion(Box::new(wc)))
                    };
                    return Poll::Ready((r, this.buf.take().expect("not resolved yet")));
                }
                Some(Slot::Waiting(w)) => {
                    if !closed {
                        *w = Some(cx.waker().clone());
                        return Poll::Pending;
                    }
                    drop(t);
                    if attempt == 0 {
                        this.shared.drain_inline();
                    }
                }
                _ => panic!("an Op is not polled after it resolved"),
            }
        }
        // Without the task, the flushed QP completes everything at once: look again soon.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl<R: WrBuffer> Drop for Op<R> {
    fn drop(&mut self) {
        let (Some(id), Some(buf)) = (self.id, self.buf.take()) else {
            return;
        };
        let mut t = self.shared.table.lock();
        match t.slots.get_mut(&id) {
            Some(slot @ Slot::Waiting(_)) => *slot = Slot::Abandoned(Box::new(buf)),
            // Completed, not taken: the device is done with the buffer.
            Some(Slot::Done(_)) => {
                t.slots.remove(&id);
                drop(t);
                drop(buf);
            }
            _ => {}
        }
    }
}
