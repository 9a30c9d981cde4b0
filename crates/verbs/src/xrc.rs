//! XRC domains (`ibv_open_xrcd`) and what is created in them: XRC SRQs and XRC_RECV QPs.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use softverbs_device as core;
use softverbs_engine::types::{QpType, SrqAttr};
use softverbs_engine::Result;

use crate::context::Context;
use crate::cq::CompletionQueue;
use crate::pd::ProtectionDomain;
use crate::qp::{QueuePair, SharedReceiveQueue};

pub use softverbs_device::xrc::{O_CREAT, O_EXCL};

#[derive(Debug)]
pub(crate) struct XrcdInner {
    core: Arc<core::Xrcd>,
    ctx: Context,
}

impl Drop for XrcdInner {
    fn drop(&mut self) {
        // Every SRQ and QP of the domain holds a handle to it, so none is left.
        let r = self.core.close();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// An XRC domain handle (`ibv_open_xrcd`). Cheap to clone; closed with its last handle; the
/// domain itself lives while any process has it open.
#[derive(Debug, Clone)]
pub struct XrcDomain(Arc<XrcdInner>);

impl XrcDomain {
    pub(crate) fn open(ctx: &Context, fd: Option<BorrowedFd<'_>>, oflags: i32) -> Result<Self> {
        let core = core::Xrcd::open(ctx.core(), fd.map(|f| f.as_raw_fd()), oflags)?;
        Ok(Self(Arc::new(XrcdInner {
            core,
            ctx: ctx.clone(),
        })))
    }

    pub(crate) fn core(&self) -> &Arc<core::Xrcd> {
        &self.0.core
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.0.ctx
    }

    /// Whether two handles open the same domain (the same file's inode, or the same handle).
    pub fn same_domain(&self, other: &Self) -> bool {
        self.0.core.same_domain(&other.0.core)
    }

    /// `ibv_create_srq_ex` with `IBV_SRQT_XRC`: an SRQ of this domain whose receives all
    /// complete on `cq`, with keys checked against `pd`. Its number is
    /// [`SharedReceiveQueue::srq_num`].
    pub fn create_srq(
        &self,
        pd: &ProtectionDomain,
        cq: &CompletionQueue,
        attr: &SrqAttr,
    ) -> Result<SharedReceiveQueue> {
        SharedReceiveQueue::create_xrc(self, pd, cq, attr)
    }

    /// `ibv_create_qp_ex` of an `IBV_QPT_XRC_RECV` QP in this domain: no PD, CQs or work
    /// queues; requests from an XRC_SEND peer reach the domain's SRQs through it.
    pub fn create_recv_qp(&self) -> Result<QueuePair> {
        let core = core::Qp::create_xrc_recv(&self.0.core)?;
        Ok(QueuePair::xrc_recv(self, core, None))
    }

    /// `ibv_open_qp`: another handle on this domain's XRC_RECV QP numbered `qp_num`. EINVAL
    /// for any other `qp_type` or QP. Dropping the handle closes only it; the QP lives until its
    /// last handle is gone.
    pub fn open_qp(&self, qp_num: u32, qp_type: QpType) -> Result<QueuePair> {
        let token = crate::qp::opener_token();
        let core = core::Qp::open(&self.0.core, qp_num, qp_type, token)?;
        Ok(QueuePair::xrc_recv(self, core, Some(token)))
    }
}

impl Context {
    /// `ibv_open_xrcd`: `fd` `None` (-1) makes an anonymous domain. Otherwise the domain of the
    /// file's inode, shared by every process that opens that file: EAGAIN if it does not exist
    /// and `oflags` lacks [`O_CREAT`], EINVAL if it exists and `oflags` has [`O_EXCL`], EBADF for
    /// a bad fd.
    pub fn open_xrcd(&self, fd: Option<BorrowedFd<'_>>, oflags: i32) -> Result<XrcDomain> {
        XrcDomain::open(self, fd, oflags)
    }
}
