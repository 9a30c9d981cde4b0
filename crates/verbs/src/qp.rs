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
///
/// A new QP is in RESET. [`QueuePair::modify`] moves it through INIT (port and the rights the
/// peer has on local memory), RTR (ready to receive: the peer's address, QP number and first
/// PSN) and RTS (ready to send: its own first PSN, timeout and retries), each step naming the
/// attributes it sets in a [`QpAttrMask`] as `ibv_modify_qp(3)` lists them. Receives may be
/// posted from INIT on, sends from RTS on. The transports differ in what the steps need: UC
/// takes no retry or RDMA READ attributes (and has no READ or atomics); UD takes a Q_Key at
/// INIT and no peer at all, each send naming its destination through an
/// [`AddressHandle`](crate::AddressHandle) (see its example). Moving to ERR flushes every
/// posted WR with `IBV_WC_WR_FLUSH_ERR`; dropping the last handle destroys the QP.
///
/// Two RC QPs of one process connected over the loopback device, then a SEND, an RDMA
/// WRITE, an RDMA READ and an atomic fetch-and-add between them:
///
/// ```
/// use std::net::Ipv4Addr;
/// use std::time::{Duration, Instant};
/// use softverbs::*;
///
/// let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").expect("loopback").open()?;
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(16, None, 0)?;
/// let access = AccessFlags::LOCAL_WRITE
///     | AccessFlags::REMOTE_WRITE
///     | AccessFlags::REMOTE_READ
///     | AccessFlags::REMOTE_ATOMIC;
/// let a = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
/// let b = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
/// let (mem_a, mem_b) = (pd.register(4096, access)?, pd.register(4096, access)?);
/// assert_eq!(a.state(), QpState::Reset);
///
/// // RoCE addresses a peer by GID: here 127.0.0.1's, from the port's GID table.
/// let gid = Gid::from(Ipv4Addr::LOCALHOST);
/// let sgid_index = (0..).find(|&i| ctx.query_gid(1, i).is_ok_and(|g| g == gid)).unwrap() as u8;
/// let path = AhAttr {
///     is_global: true,
///     port_num: 1,
///     grh: GlobalRoute { dgid: gid, sgid_index, hop_limit: 64, ..Default::default() },
///     ..Default::default()
/// };
/// for (qp, peer) in [(&a, b.qp_num()), (&b, a.qp_num())] {
///     let init = QpAttr {
///         qp_state: QpState::Init,
///         port_num: 1,
///         qp_access_flags: access, // what the peer may do to this side's memory
///         ..Default::default()
///     };
///     qp.modify(&init, QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT
///         | QpAttrMask::ACCESS_FLAGS)?;
///     let rtr = QpAttr {
///         qp_state: QpState::Rtr,
///         ah_attr: path,
///         path_mtu: Mtu::Mtu1024,
///         dest_qp_num: peer,
///         rq_psn: 100, // the PSN of the peer's first packet
///         max_dest_rd_atomic: 1,
///         min_rnr_timer: 12,
///         ..Default::default()
///     };
///     let rtr_mask = QpAttrMask::STATE | QpAttrMask::AV | QpAttrMask::PATH_MTU | QpAttrMask::DEST_QPN
///         | QpAttrMask::RQ_PSN | QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER;
///     qp.modify(&rtr, rtr_mask)?;
///     let rts = QpAttr {
///         qp_state: QpState::Rts,
///         sq_psn: 100,
///         timeout: 14, // 4.096 us * 2^14 = 67 ms before a resend
///         retry_cnt: 7,
///         rnr_retry: 7,
///         max_rd_atomic: 1,
///         ..Default::default()
///     };
///     let rts_mask = QpAttrMask::STATE | QpAttrMask::SQ_PSN | QpAttrMask::TIMEOUT | QpAttrMask::RETRY_CNT
///         | QpAttrMask::RNR_RETRY | QpAttrMask::MAX_QP_RD_ATOMIC;
///     qp.modify(&rts, rts_mask)?;
/// }
/// assert_eq!((a.state(), a.query().dest_qp_num), (QpState::Rts, b.qp_num()));
///
/// // Busy-polls the CQ until `n` completions arrived (bounded in time).
/// let wait = |n: usize| {
///     let (mut got, mut wc) = (Vec::new(), [WorkCompletion::default(); 4]);
///     let deadline = Instant::now() + Duration::from_secs(20);
///     while got.len() < n && Instant::now() < deadline {
///         let k = cq.poll(&mut wc);
///         got.extend_from_slice(&wc[..k]);
///     }
///     assert!(got.iter().all(|w| w.status == WcStatus::Success), "{got:?}");
///     got
/// };
/// let request = |wr_id, op, sge| SendRequest {
///     wr_id,
///     op,
///     flags: SendFlags::SIGNALED,
///     payload: Payload::Sges(vec![sge]),
///     ud: None,
///     xrc_srqn: None,
/// };
///
/// // SEND consumes a receive the peer posted.
/// b.post_recv(&[RecvWr { wr_id: 1, sg_list: vec![mem_b.sge(0..64)?] }])?;
/// mem_a.write(0, b"a message")?;
/// a.post_send(&[request(2, SendOp::Send { imm: None, invalidate: None }, mem_a.sge(0..9)?)])?;
/// let wcs = wait(2);
/// let recv = wcs.iter().find(|w| w.opcode == WcOpcode::Recv).unwrap();
/// assert_eq!((recv.wr_id, recv.byte_len, recv.qp_num), (1, 9, b.qp_num()));
///
/// // One-sided operations name the peer's memory by address and rkey: b takes no part.
/// mem_b.write(3072, &40u64.to_ne_bytes())?;
/// a.post_send(&[
///     request(3, SendOp::Write { remote: mem_b.remote(1024), imm: None }, mem_a.sge(0..9)?),
///     request(4, SendOp::Read { remote: mem_b.remote(1024) }, mem_a.sge(2048..2057)?),
///     request(5, SendOp::FetchAdd { remote: mem_b.remote(3072), add: 2 }, mem_a.sge(3072..3080)?),
/// ])?;
/// let ops: Vec<_> = wait(3).iter().map(|w| (w.wr_id, w.opcode)).collect();
/// assert_eq!(ops, [(3, WcOpcode::RdmaWrite), (4, WcOpcode::RdmaRead), (5, WcOpcode::FetchAdd)]);
/// let mut read_back = [0u8; 9];
/// mem_a.read(2048, &mut read_back)?;
/// assert_eq!(&read_back, b"a message");
/// assert_eq!((mem_a.read_u64(3072)?, mem_b.read_u64(3072)?), (40, 42), "old value, new value");
/// # Ok::<(), softverbs::Error>(())
/// ```
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
///
/// QPs created with [`QpInit::srq`] take their receives from the SRQ instead of a queue of
/// their own, so one pool of buffers serves many QPs (RC and UD; XRC has SRQs of its own, see
/// [`XrcDomain`](crate::XrcDomain)). Arming its limit (`srq_limit`) asks for an `IBV_EVENT_SRQ_LIMIT_REACHED`
/// async event once fewer WRs than that remain, which is when to post more. Two UD QPs on
/// one SRQ:
///
/// ```
/// use std::net::Ipv4Addr;
/// use std::time::{Duration, Instant};
/// use softverbs::*;
///
/// const QKEY: u32 = 0x1111_1111;
/// let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").expect("loopback").open()?;
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(32, None, 0)?;
/// let srq = pd.create_srq(&SrqAttr { max_wr: 16, max_sge: 1, srq_limit: 0 })?;
/// let mr = pd.register(16 * 256, AccessFlags::LOCAL_WRITE)?;
/// let wrs: Vec<RecvWr> = (0..8)
///     .map(|i| Ok(RecvWr { wr_id: i, sg_list: vec![mr.sge(i as usize * 256..(i as usize + 1) * 256)?] }))
///     .collect::<Result<_>>()?;
/// srq.post_recv(&wrs)?;
/// // Fewer than 7 left: an event.
/// srq.modify(&SrqAttr { srq_limit: 7, ..srq.query() }, SrqAttrMask::LIMIT.bits())?;
///
/// let on_srq = QpInit { srq: Some(&srq), ..QpInit::new(QpType::Ud, &cq) };
/// let receivers = [pd.create_qp(&on_srq)?, pd.create_qp(&on_srq)?];
/// let sender = pd.create_qp(&QpInit::new(QpType::Ud, &cq))?;
/// for qp in receivers.iter().chain([&sender]) {
///     use QpAttrMask as M;
///     let init = QpAttr { qp_state: QpState::Init, port_num: 1, qkey: QKEY, ..Default::default() };
///     qp.modify(&init, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY)?;
///     qp.modify(&QpAttr { qp_state: QpState::Rtr, ..Default::default() }, M::STATE)?;
///     qp.modify(&QpAttr { qp_state: QpState::Rts, ..Default::default() }, M::STATE | M::SQ_PSN)?;
/// }
/// let gid = Gid::from(Ipv4Addr::LOCALHOST);
/// let sgid_index = (0..).find(|&i| ctx.query_gid(1, i).is_ok_and(|g| g == gid)).unwrap() as u8;
/// let ah = pd.create_ah(&AhAttr {
///     is_global: true,
///     port_num: 1,
///     grh: GlobalRoute { dgid: gid, sgid_index, hop_limit: 64, ..Default::default() },
///     ..Default::default()
/// })?;
/// for r in &receivers {
///     sender.post_send(&[SendRequest {
///         wr_id: 100,
///         op: SendOp::Send { imm: None, invalidate: None },
///         flags: SendFlags::SIGNALED,
///         payload: Payload::Sges(vec![mr.sge(0..16)?]),
///         ud: Some(ah.ud_address(r.qp_num(), QKEY)),
///         xrc_srqn: None,
///     }])?;
/// }
///
/// let (mut recvs, mut wc) = (Vec::new(), [WorkCompletion::default(); 4]);
/// let deadline = Instant::now() + Duration::from_secs(20);
/// while recvs.len() < 2 && Instant::now() < deadline {
///     let n = cq.poll(&mut wc);
///     recvs.extend(wc[..n].iter().filter(|w| w.opcode == WcOpcode::Recv).map(|w| w.qp_num));
/// }
/// recvs.sort();
/// let mut qpns: Vec<u32> = receivers.iter().map(QueuePair::qp_num).collect();
/// qpns.sort();
/// assert_eq!(recvs, qpns, "each receiver took one WR of the SRQ");
/// assert_eq!(srq.len(), 6);
/// let event = ctx.get_async_event_timeout(Some(Duration::from_secs(20)))?;
/// assert_eq!(event.event_type(), EventType::SrqLimitReached);
/// assert!(matches!(event.target(), AsyncEventTarget::Srq(s) if s.srq_num() == srq.srq_num()));
/// assert_eq!(srq.query().srq_limit, 0, "the limit disarms when it fires");
/// # Ok::<(), softverbs::Error>(())
/// ```
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
