//! Completion queues and completion channels.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Duration;

use softverbs_device as core;
use softverbs_engine::types::WorkCompletion;
use softverbs_engine::Result;

use crate::context::{Context, Target};
use crate::Moderation;

#[derive(Debug)]
pub(crate) struct ChannelInner {
    core: Arc<core::CompChannel>,
    ctx: Context,
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // Every CQ using the channel holds a handle to it, so none is left.
        let r = self.core.destroy();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// A completion event channel (`ibv_create_comp_channel`). Its fd ([`AsFd`]) becomes readable
/// when an attached CQ has an event.
///
/// The pattern of `ibv_get_cq_event(3)`: arm the CQ ([`CompletionQueue::req_notify`]), wait
/// for its event, acknowledge the event (dropping the [`CqEvent`] does), arm again, then poll
/// the CQ empty; arming before polling is what makes sure no completion is missed. Here the
/// receiving side of a UC pair sleeps on a channel, with a CQ that also stamps each completion
/// with the device clock and the wall clock (`ibv_create_cq_ex`, see
/// [`Context::create_cq_with_timestamps`]):
///
/// ```
/// use std::net::Ipv4Addr;
/// use std::time::Duration;
/// use softverbs::*;
///
/// let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").expect("loopback").open()?;
/// let pd = ctx.alloc_pd()?;
/// let channel = ctx.create_comp_channel()?;
/// let clocks = Timestamps { raw: true, wallclock: true };
/// let recv_cq = ctx.create_cq_with_timestamps(16, Some(&channel), 0, clocks)?;
/// let send_cq = ctx.create_cq(16, None, 0)?;
/// let sender = pd.create_qp(&QpInit::new(QpType::Uc, &send_cq))?;
/// let receiver = pd.create_qp(&QpInit::new(QpType::Uc, &recv_cq))?;
///
/// // UC connects as RC does, with fewer attributes: no retries, no RDMA READ or atomics.
/// let gid = Gid::from(Ipv4Addr::LOCALHOST);
/// let sgid_index = (0..).find(|&i| ctx.query_gid(1, i).is_ok_and(|g| g == gid)).unwrap() as u8;
/// for (qp, peer) in [(&sender, receiver.qp_num()), (&receiver, sender.qp_num())] {
///     use QpAttrMask as M;
///     let init = QpAttr { qp_state: QpState::Init, port_num: 1, ..Default::default() };
///     qp.modify(&init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS)?;
///     let rtr = QpAttr {
///         qp_state: QpState::Rtr,
///         ah_attr: AhAttr {
///             is_global: true,
///             port_num: 1,
///             grh: GlobalRoute { dgid: gid, sgid_index, hop_limit: 64, ..Default::default() },
///             ..Default::default()
///         },
///         path_mtu: Mtu::Mtu1024,
///         dest_qp_num: peer,
///         ..Default::default()
///     };
///     qp.modify(&rtr, M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN)?;
///     qp.modify(&QpAttr { qp_state: QpState::Rts, ..Default::default() }, M::STATE | M::SQ_PSN)?;
/// }
///
/// let mr = pd.register(64, AccessFlags::LOCAL_WRITE)?;
/// receiver.post_recv(&[RecvWr { wr_id: 9, sg_list: vec![mr.sge(0..64)?] }])?;
/// recv_cq.req_notify(false)?;
/// let before = ctx.query_raw_clock();
/// mr.write(0, b"wake up")?;
/// sender.post_send(&[SendRequest {
///     wr_id: 1,
///     op: SendOp::Send { imm: None, invalidate: None },
///     flags: SendFlags::empty(), // unsignaled: no completion on the sending side
///     payload: Payload::Sges(vec![mr.sge(0..7)?]),
///     ud: None,
///     xrc_srqn: None,
/// }])?;
///
/// let event = channel.get_cq_event_timeout(Some(Duration::from_secs(20)))?;
/// assert!(event.cq().same_as(&recv_cq));
/// event.ack();
/// recv_cq.req_notify(false)?;
/// let mut wc = [WorkCompletion::default(); 4];
/// assert_eq!(recv_cq.poll(&mut wc), 1);
/// assert_eq!((wc[0].wr_id, wc[0].opcode, wc[0].byte_len), (9, WcOpcode::Recv, 7));
/// // Device clock ticks are of `hca_core_clock` kHz.
/// assert!(wc[0].timestamp >= before && ctx.query_device_ex().hca_core_clock > 0);
/// assert!(wc[0].wallclock_ns > 0);
/// assert_eq!(send_cq.poll(&mut wc), 0);
/// # Ok::<(), softverbs::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct CompletionChannel(pub(crate) Arc<ChannelInner>);

impl CompletionChannel {
    pub(crate) fn create(ctx: &Context) -> Result<Self> {
        Ok(Self(Arc::new(ChannelInner {
            core: core::CompChannel::create(ctx.core())?,
            ctx: ctx.clone(),
        })))
    }

    /// `ibv_get_cq_event`: waits for the next CQ event. EAGAIN at once if the fd was made
    /// non-blocking and nothing is pending.
    pub fn get_cq_event(&self) -> Result<CqEvent> {
        self.get_cq_event_timeout(None)
    }

    /// As [`CompletionChannel::get_cq_event`], giving up with `Error::WouldBlock` after
    /// `timeout`.
    pub fn get_cq_event_timeout(&self, timeout: Option<Duration>) -> Result<CqEvent> {
        loop {
            let core_cq = self.0.core.get_cq_event(timeout)?;
            let cq = match self.0.ctx.0.targets.lock().get(&(Arc::as_ptr(&core_cq) as usize)) {
                Some(Target::Cq(w)) => w.upgrade(),
                _ => None,
            };
            match cq {
                Some(inner) => {
                    return Ok(CqEvent {
                        cq: CompletionQueue(inner),
                        acked: false,
                    })
                }
                // The CQ is being destroyed on another thread, waiting for this acknowledgement.
                None => core_cq.ack_events(1),
            }
        }
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.core.as_fd()
    }
}

/// A completion event from a channel. It is acknowledged (`ibv_ack_cq_events`) when dropped or
/// by [`CqEvent::ack`]; it holds its CQ, so the CQ cannot be destroyed before that.
#[derive(Debug)]
pub struct CqEvent {
    cq: CompletionQueue,
    acked: bool,
}

impl CqEvent {
    /// The CQ that got the event.
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// Acknowledges the event now.
    pub fn ack(mut self) {
        self.acked = true;
        self.cq.0.core.ack_events(1);
    }
}

impl Drop for CqEvent {
    fn drop(&mut self) {
        if !self.acked {
            self.cq.0.core.ack_events(1);
        }
    }
}

#[derive(Debug)]
pub(crate) struct CqInner {
    pub(crate) core: Arc<core::Cq>,
    ctx: Context,
    _channel: Option<CompletionChannel>,
}

impl Drop for CqInner {
    fn drop(&mut self) {
        self.ctx.unregister_target(Arc::as_ptr(&self.core) as usize);
        // QPs hold handles to their CQs and events hold the CQ, so destroy cannot fail or wait.
        let r = self.core.destroy();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// A completion queue (`ibv_create_cq`). Cheap to clone; destroyed with its last handle.
#[derive(Debug, Clone)]
pub struct CompletionQueue(pub(crate) Arc<CqInner>);

impl CompletionQueue {
    pub(crate) fn create(
        ctx: &Context,
        cqe: i32,
        channel: Option<&CompletionChannel>,
        comp_vector: i32,
    ) -> Result<Self> {
        let core = core::Cq::create(ctx.core(), cqe, channel.map(|c| &c.0.core), comp_vector)?;
        let inner = Arc::new(CqInner {
            core,
            ctx: ctx.clone(),
            _channel: channel.cloned(),
        });
        ctx.register_target(
            Arc::as_ptr(&inner.core) as usize,
            Target::Cq(Arc::downgrade(&inner)),
        );
        Ok(Self(inner))
    }

    pub(crate) fn core(&self) -> &Arc<core::Cq> {
        &self.0.core
    }

    /// The actual number of entries (`ibv_cq.cqe`), at least what was asked.
    pub fn cqe(&self) -> u32 {
        self.0.core.cqe()
    }

    /// `ibv_poll_cq`: fills `wc` with up to `wc.len()` completions, oldest first; returns how
    /// many. Each polled completion is removed from the CQ.
    pub fn poll(&self, wc: &mut [WorkCompletion]) -> usize {
        self.0.core.poll(wc)
    }

    /// `ibv_req_notify_cq`: one completion event for the next completion, or the next solicited
    /// or unsuccessful one if `solicited_only`.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        self.0.core.req_notify(solicited_only)
    }

    /// `ibv_resize_cq`: returns the new size; EINVAL below the unpolled completions.
    pub fn resize(&self, cqe: i32) -> Result<u32> {
        self.0.core.resize(cqe)
    }

    /// `ibv_modify_cq` with `IBV_CQ_MODERATE`: once armed, the completion event waits for
    /// `cq_count` completions or `cq_period` microseconds after the first, whichever comes
    /// first. EINVAL if `cq_period` exceeds `cq_mod_caps`.
    pub fn modify_moderation(&self, moderation: Moderation) -> Result<()> {
        self.0.core.modify_moderation(moderation)
    }

    /// The moderation set by [`CompletionQueue::modify_moderation`] (none at creation).
    pub fn moderation(&self) -> Moderation {
        self.0.core.moderation()
    }

    /// Whether the CQ overran (`IBV_EVENT_CQ_ERR`).
    pub fn is_overrun(&self) -> bool {
        self.0.core.is_overrun()
    }

    /// Whether two handles are the same CQ.
    pub fn same_as(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
