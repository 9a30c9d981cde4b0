//! Queue pairs and shared receive queues.

use std::sync::Arc;

use softverbs_device as core;
use softverbs_device::qp::{PostError, SendRequest};
use softverbs_engine::tm::{SrqOp, TmCap};
use softverbs_engine::transport::QpCounters;
use softverbs_engine::types::{Gid, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SrqAttr};
use softverbs_engine::Result;

use crate::context::Target;
use crate::cq::CompletionQueue;
use crate::pd::ProtectionDomain;

/// What a new QP is made of (`struct ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy)]
pub struct QpInit<'a> {
    /// Transport service.
    pub qp_type: QpType,
    /// CQ for send completions.
    pub send_cq: &'a CompletionQueue,
    /// CQ for receive completions.
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
    pd: ProtectionDomain,
    _send_cq: CompletionQueue,
    _recv_cq: CompletionQueue,
    _srq: Option<SharedReceiveQueue>,
    /// Created through a parent domain: keeps it busy.
    _domain: Option<core::DomainUse>,
}

impl Drop for QpInner {
    fn drop(&mut self) {
        self.pd
            .context()
            .unregister_target(Arc::as_ptr(&self.core) as usize);
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
        let core_init = core::QpInitAttr {
            qp_type: init.qp_type,
            send_cq: init.send_cq.core().clone(),
            recv_cq: init.recv_cq.core().clone(),
            srq: init.srq.map(|s| s.0.core.clone()),
            cap: init.cap,
            sq_sig_all: init.sq_sig_all,
            max_tso_header,
        };
        let domain = pd.parent_core().map(|d| d.hold()).transpose()?;
        let core = core::Qp::create_in(pd.context().core(), pd.core(), &core_init)?;
        let inner = Arc::new(QpInner {
            _domain: domain,
            core,
            pd: pd.clone(),
            _send_cq: init.send_cq.clone(),
            _recv_cq: init.recv_cq.clone(),
            _srq: init.srq.cloned(),
        });
        pd.context().register_target(
            Arc::as_ptr(&inner.core) as usize,
            Target::Qp(Arc::downgrade(&inner)),
        );
        Ok(Self(inner))
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
    _cq: Option<CompletionQueue>,
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
        let inner = Arc::new(SrqInner {
            core,
            pd: pd.clone(),
            _cq: tm.map(|(cq, _)| cq.clone()),
        });
        pd.context().register_target(
            Arc::as_ptr(&inner.core) as usize,
            Target::Srq(Arc::downgrade(&inner)),
        );
        Ok(Self(inner))
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
