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
///
/// XRC (eXtended Reliable Connection) lets one connection serve many receivers: an XRC_SEND
/// QP is connected to an XRC_RECV QP of a domain, and each of its sends names which of the
/// domain's SRQs receives it (`xrc_srqn`). Processes share a domain by opening it through
/// the same file (`fd` and [`O_CREAT`]), and each other's XRC_RECV QPs by number
/// ([`XrcDomain::open_qp`]).
///
/// ```
/// use std::net::Ipv4Addr;
/// use std::time::{Duration, Instant};
/// use softverbs::*;
///
/// let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").expect("loopback").open()?;
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(16, None, 0)?;
/// // The receiving side: a domain, an SRQ of it, and an XRC_RECV QP (which has no queues).
/// let xrcd = ctx.open_xrcd(None, 0)?;
/// let srq = xrcd.create_srq(&pd, &cq, &SrqAttr { max_wr: 16, max_sge: 1, srq_limit: 0 })?;
/// let b = xrcd.create_recv_qp()?;
/// // The sending side: an XRC_SEND QP (which receives nothing), connected as RC QPs are.
/// let a = pd.create_qp(&QpInit::new(QpType::XrcSend, &cq))?;
/// # let gid = Gid::from(Ipv4Addr::LOCALHOST);
/// # let sgid_index = (0..).find(|&i| ctx.query_gid(1, i).is_ok_and(|g| g == gid)).unwrap() as u8;
/// # for (qp, peer) in [(&a, b.qp_num()), (&b, a.qp_num())] {
/// #     use QpAttrMask as M;
/// #     let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
/// #     let init =
/// #         QpAttr { qp_state: QpState::Init, port_num: 1, qp_access_flags: access, ..Default::default() };
/// #     qp.modify(&init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS)?;
/// #     let grh = GlobalRoute { dgid: gid, sgid_index, hop_limit: 64, ..Default::default() };
/// #     let ah_attr = AhAttr { is_global: true, port_num: 1, grh, ..Default::default() };
/// #     let rtr = QpAttr {
/// #         qp_state: QpState::Rtr, ah_attr, path_mtu: Mtu::Mtu1024, dest_qp_num: peer,
/// #         max_dest_rd_atomic: 1, min_rnr_timer: 12, ..Default::default()
/// #     };
/// #     qp.modify(&rtr, M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN
/// #         | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER)?;
/// #     let rts = QpAttr {
/// #         qp_state: QpState::Rts, timeout: 14, retry_cnt: 7, rnr_retry: 7, max_rd_atomic: 1,
/// #         ..Default::default()
/// #     };
/// #     qp.modify(&rts, M::STATE | M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY
/// #         | M::MAX_QP_RD_ATOMIC)?;
/// # }
/// assert_eq!((a.state(), b.state()), (QpState::Rts, QpState::Rts));
///
/// let mr = pd.register(4096, AccessFlags::LOCAL_WRITE)?;
/// srq.post_recv(&[RecvWr { wr_id: 1, sg_list: vec![mr.sge(0..1024)?] }])?;
/// mr.write(2048, b"to an SRQ, by number")?;
/// a.post_send(&[SendRequest {
///     wr_id: 2,
///     op: SendOp::Send { imm: None, invalidate: None },
///     flags: SendFlags::SIGNALED,
///     payload: Payload::Sges(vec![mr.sge(2048..2068)?]),
///     ud: None,
///     xrc_srqn: Some(srq.srq_num()),
/// }])?;
/// let (mut got, mut wc) = (Vec::new(), [WorkCompletion::default(); 2]);
/// let deadline = Instant::now() + Duration::from_secs(20);
/// while got.len() < 2 && Instant::now() < deadline {
///     let n = cq.poll(&mut wc);
///     got.extend(wc[..n].iter().map(|w| (w.wr_id, w.opcode, w.status)));
/// }
/// got.sort_by_key(|c| c.0);
/// assert_eq!(got, [(1, WcOpcode::Recv, WcStatus::Success), (2, WcOpcode::Send, WcStatus::Success)]);
///
/// // Another handle on the receiving QP, as a process sharing the domain would open it.
/// let opened = xrcd.open_qp(b.qp_num(), QpType::XrcRecv)?;
/// assert_eq!(opened.qp_num(), b.qp_num());
/// # Ok::<(), softverbs::Error>(())
/// ```
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
