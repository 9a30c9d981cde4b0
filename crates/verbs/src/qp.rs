//! Queue pairs and shared receive queues.

use std::sync::Arc;

use softverbs_device as core;
use softverbs_device::qp::{PostError, SendRequest};
use softverbs_engine::tm::{SrqOp, TmCap};
use softverbs_engine::transport::QpCounters;
use softverbs_engine::types::{Gid, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SrqAttr};
use softverbs_engine::Result;

use crate::context::{Context, Target};
use crate::cq::CompletionQueue;
use crate::pd::ProtectionDomain;
use crate::xrc::XrcDomain;

/// What a new QP is made of (`struct ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy)]
pub struct QpInit<'a> {
    /// Transport service.
    pub qp_type: QpType,
    /// CQ for send completions.
    pub send_cq: &'a CompletionQueue,
    /// CQ for receive completions (ignored for XRC_SEND, which receives nothing).
    pub recv_cq: &'a CompletionQueue,
    /// SRQ to receive from (RC and UD only).
    pub srq: Option<&'a SharedReceiveQueue>,
    /// Requested capabilities.
    pub cap: QpCap,
    /// Every send WR completes with a completion entry.
    pub sq_sig_all: bool,
}

impl<'a> QpInit<'a> {
    /// A QP of `qp_type` using `cq` for both queues, with small default capabilities.
    pub fn new(qp_type: QpType, cq: &'a CompletionQueue) -> Self {
        Self {
            qp_type,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: QpCap {
                max_send_wr: 16,
                max_recv_wr: 16,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
        }
    }
}

#[derive(Debug)]
pub(crate) struct QpInner {
    pub(crate) core: Arc<core::Qp>,
    ctx: Context,
    _pd: Option<ProtectionDomain>,
    _send_cq: Option<CompletionQueue>,
    _recv_cq: Option<CompletionQueue>,
    _srq: Option<SharedReceiveQueue>,
    /// Created through a parent domain: keeps it busy.
    _domain: Option<core::DomainUse>,
    /// XRC target: the domain handle it was created or opened through, and for an
    /// `ibv_open_qp` handle its event token (closing it then closes only the handle).
    xrcd: Option<(XrcDomain, Option<u64>)>,
}

/// A fresh token for an `ibv_open_qp` handle: its key among the context's event targets. The
/// top bit keeps it apart from the object addresses the other targets are keyed by.
pub(crate) fn opener_token() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    (1 << 63) | NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Drop for QpInner {
    fn drop(&mut self) {
        if let Some((xrcd, Some(token))) = &self.xrcd {
            self.ctx.unregister_target(*token as usize);
            let r = self.core.close_opened(xrcd.core(), *token);
            debug_assert!(r.is_ok(), "{r:?}");
            return;
        }
        self.ctx.unregister_target(Arc::as_ptr(&self.core) as usize);
        // Detach first: a QP still in a multicast group cannot be destroyed.
        for gid in self.core.mcast_groups() {
            let _ = self.core.detach_mcast(&gid, 0);
        }
        let r = self.core.destroy();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// A queue pair (`ibv_create_qp`). Cheap to clone; destroyed with its last handle.
#[derive(Debug, Clone)]
pub struct QueuePair(pub(crate) Arc<QpInner>);

impl QueuePair {
    pub(crate) fn create(pd: &ProtectionDomain, init: &QpInit<'_>) -> Result<Self> {
        Self::create_with(pd, init, 0)
    }

    /// [`QueuePair::create`] with a `max_tso_header` (raw packet QPs).
    pub(crate) fn create_with(pd: &ProtectionDomain, init: &QpInit<'_>, max_tso_header: u16) -> Result<Self> {
        let xrc_send = init.qp_type == QpType::XrcSend;
        let core_init = core::QpInitAttr {
            qp_type: init.qp_type,
            send_cq: Some(init.send_cq.core().clone()),
            recv_cq: (!xrc_send).then(|| init.recv_cq.core().clone()),
            srq: init.srq.map(|s| s.0.core.clone()),
            cap: init.cap,
            sq_sig_all: init.sq_sig_all,
            max_tso_header,
        };
        let domain = pd.parent_core().map(|d| d.hold()).transpose()?;
        let core = core::Qp::create_in(pd.context().core(), pd.core(), &core_init)?;
        Ok(Self::wrap(QpInner {
            _domain: domain,
            core,
            ctx: pd.context().clone(),
            _pd: Some(pd.clone()),
            _send_cq: Some(init.send_cq.clone()),
            _recv_cq: (!xrc_send).then(|| init.recv_cq.clone()),
            _srq: init.srq.cloned(),
            xrcd: None,
        }))
    }

    /// An XRC_RECV QP of `xrcd`'s domain, created (`opened` None) or opened (`ibv_open_qp`,
    /// with the handle's event token).
    pub(crate) fn xrc_recv(xrcd: &XrcDomain, core: Arc<core::Qp>, opened: Option<u64>) -> Self {
        let inner = QpInner {
            _domain: None,
            core,
            ctx: xrcd.context().clone(),
            _pd: None,
            _send_cq: None,
            _recv_cq: None,
            _srq: None,
            xrcd: Some((xrcd.clone(), opened)),
        };
        if let Some(token) = opened {
            // Events for this handle carry its token.
            let inner = Arc::new(inner);
            inner
                .ctx
                .register_target(token as usize, Target::Qp(Arc::downgrade(&inner)));
            Self(inner)
        } else {
            Self::wrap(inner)
        }
    }

    fn wrap(inner: QpInner) -> Self {
        let inner = Arc::new(inner);
        inner.ctx.register_target(
            Arc::as_ptr(&inner.core) as usize,
            Target::Qp(Arc::downgrade(&inner)),
        );
        Self(inner)
    }

    pub(crate) fn core(&self) -> &Arc<core::Qp> {
        &self.0.core
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.0.core.qpn()
    }

    /// Transport service.
    pub fn qp_type(&self) -> QpType {
        self.0.core.qp_type()
    }

    /// The capabilities granted, each at least what was asked.
    pub fn cap(&self) -> QpCap {
        self.0.core.cap()
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.0.core.state()
    }

    /// Whether the QP sends a completion for every WR.
    pub fn sq_sig_all(&self) -> bool {
        self.0.core.init_attr().sq_sig_all
    }

    /// `ibv_modify_qp`: on error nothing changes, and the error names the offending attribute.
    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.0.core.modify(attr, mask)
    }

    /// `ibv_query_qp`: the current attributes.
    pub fn query(&self) -> QpAttr {
        self.0.core.query()
    }

    /// `ibv_post_recv`: posts WRs in order; on error, WRs before `PostError::index` were posted.
    /// Build SGEs with [`MemoryRegion::sge`](crate::MemoryRegion::sge).
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        self.0.core.post_recv(wrs)
    }

    /// `ibv_post_send`: checks and posts WRs in order, then starts sending; on error, WRs before
    /// `PostError::index` were posted. Memory is named by SGEs from
    /// [`MemoryRegion::sge`](crate::MemoryRegion::sge) (checked by key, as an HCA does) or given
    /// inline.
    pub fn post_send(&self, wrs: &[SendRequest]) -> Result<(), PostError> {
        self.0.core.post_send(wrs)
    }

    /// Transport counters (packets, retransmissions, drops) of this QP.
    pub fn counters(&self) -> QpCounters {
        self.0.core.counters()
    }

    /// `ibv_attach_mcast` (UD only; attaching twice is harmless).
    pub fn attach_mcast(&self, gid: &Gid, lid: u16) -> Result<()> {
        self.0.core.attach_mcast(gid, lid)
    }

    /// `ibv_detach_mcast`.
    pub fn detach_mcast(&self, gid: &Gid, lid: u16) -> Result<()> {
        self.0.core.detach_mcast(gid, lid)
    }

    /// Whether two handles are the same QP.
    pub fn same_as(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[derive(Debug)]
pub(crate) struct SrqInner {
    pub(crate) core: Arc<core::Srq>,
    pd: ProtectionDomain,
    /// The CQ of a tag-matching or XRC SRQ.
    _cq: Option<CompletionQueue>,
    /// An XRC SRQ keeps its domain.
    _xrcd: Option<XrcDomain>,
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        self.pd
            .context()
            .unregister_target(Arc::as_ptr(&self.core) as usize);
        let r = self.core.destroy();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// A shared receive queue (`ibv_create_srq`). Cheap to clone; destroyed with its last handle.
#[derive(Debug, Clone)]
pub struct SharedReceiveQueue(pub(crate) Arc<SrqInner>);

impl SharedReceiveQueue {
    pub(crate) fn create(
        pd: &ProtectionDomain,
        attr: &SrqAttr,
        tm: Option<(&CompletionQueue, TmCap)>,
    ) -> Result<Self> {
        let core = match tm {
            Some((cq, cap)) => core::Srq::create_tm(pd.core(), attr, cq.core(), cap)?,
            None => core::Srq::create(pd.core(), attr)?,
        };
        Ok(Self::wrap(SrqInner {
            core,
            pd: pd.clone(),
            _cq: tm.map(|(cq, _)| cq.clone()),
            _xrcd: None,
        }))
    }

    /// `ibv_create_srq_ex` with `IBV_SRQT_XRC`.
    pub(crate) fn create_xrc(
        xrcd: &XrcDomain,
        pd: &ProtectionDomain,
        cq: &CompletionQueue,
        attr: &SrqAttr,
    ) -> Result<Self> {
        Ok(Self::wrap(SrqInner {
            core: core::Srq::create_xrc(pd.core(), xrcd.core(), cq.core(), attr)?,
            pd: pd.clone(),
            _cq: Some(cq.clone()),
            _xrcd: Some(xrcd.clone()),
        }))
    }

    fn wrap(inner: SrqInner) -> Self {
        let inner = Arc::new(inner);
        let pd = &inner.pd;
        pd.context().register_target(
            Arc::as_ptr(&inner.core) as usize,
            Target::Srq(Arc::downgrade(&inner)),
        );
        Self(inner)
    }

    /// `ibv_get_srq_num`: the 24-bit SRQ number, unique on the host; XRC initiators address
    /// XRC SRQs by it.
    pub fn srq_num(&self) -> u32 {
        self.0.core.srq_num()
    }

    /// Whether this is an XRC SRQ.
    pub fn is_xrc(&self) -> bool {
        self.0.core.is_xrc()
    }

    /// `ibv_query_srq`.
    pub fn query(&self) -> SrqAttr {
        self.0.core.query()
    }

    /// `ibv_modify_srq` with an `ibv_srq_attr_mask` (see [`SrqAttrMask`](crate::SrqAttrMask)).
    pub fn modify(&self, attr: &SrqAttr, mask: u32) -> Result<()> {
        self.0.core.modify(attr, mask)
    }

    /// `ibv_post_srq_recv`.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        self.0.core.post_recv(wrs)
    }

    /// Posted WRs not yet consumed.
    pub fn len(&self) -> usize {
        self.0.core.len()
    }

    /// Whether no WR is posted.
    pub fn is_empty(&self) -> bool {
        self.0.core.is_empty()
    }

    /// Whether this is a tag-matching SRQ.
    pub fn is_tm(&self) -> bool {
        self.0.core.is_tm()
    }

    /// `ibv_post_srq_ops` on a tag-matching SRQ: performs the operations in order, stopping at
    /// the first that cannot be posted. Returns the handle of each `IBV_WR_TAG_ADD` performed
    /// (0 for other operations) and the first refusal: EINVAL (not a tag-matching SRQ, too many
    /// SGEs, handle outside the list) or ENOMEM (`max_ops` operations outstanding, or the tag
    /// list full). Only operations with [`OpsFlags::SIGNALED`](crate::OpsFlags) complete (a
    /// failed `IBV_WR_TAG_DEL` too, with `IBV_WC_TM_ERR`), on the SRQ's CQ. An operation stays
    /// outstanding until its completion, or that of a later operation, is polled, so unsignaled
    /// operations need a signaled one now and then.
    pub fn post_ops(&self, ops: &[SrqOp]) -> (Vec<u32>, Result<(), PostError>) {
        self.0.core.post_ops(ops)
    }

    /// Entries in the tag list.
    pub fn tm_tags(&self) -> usize {
        self.0.core.tm_tags()
    }
}
