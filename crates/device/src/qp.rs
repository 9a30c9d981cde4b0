//! Queue pairs and shared receive queues.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use softverbs_engine::memory::{ExternalPayload, Memory};
use softverbs_engine::qp_state::{apply_modify, effective_mask, validate_modify};
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{
    Completion, DropReason, QpConfig, QpCounters, QpEngine, RecvSource, Rx, RxMeta, Transmit, WorkQueue,
};
use softverbs_engine::types::{
    EventType, Gid, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SendFlags, SrqAttr, SrqAttrMask,
    WcStatus, WorkCompletion,
};
use softverbs_engine::wr::{Payload, SendLimits, SendOp, SendWr, UdDest};
use softverbs_engine::{Error, Result};
use softverbs_wire::ParsedPacket;

use crate::context::{Context, EventElement};
use crate::cq::Cq;
use crate::device::{cap_flags, Fabric, Node, Resource};
use crate::fabric::{Endpoint, Hold, Received};
use crate::held::Held;
use crate::pd::{Ah, Pd};
use crate::raw::{require_cap_net_raw, RawPort};
use crate::remote::{Deferring, Pending};
use crate::sync::{AckCounter, UseCount};
use crate::tm::{QpRendezvous, TmRecv, TmShared, TmState};
use crate::wq::{Rss, RwqIndTable, RxHashConf};
use crate::xrc::{XrcDomain, Xrcd};
use crate::xrc_relay;

/// Rounds a queue depth up to a power of two, as ring-based hardware does; 0 stays 0.
fn round_depth(n: u32) -> u32 {
    if n == 0 {
        0
    } else {
        n.checked_next_power_of_two().unwrap_or(n)
    }
}

/// Which WR in a posted list failed, and why (`bad_wr`).
#[derive(Debug, thiserror::Error)]
#[error("work request {index}: {error}")]
pub struct PostError {
    /// Index of the first WR that was not posted; those before it were.
    pub index: usize,
    /// Why it was refused.
    #[source]
    pub error: Error,
}

impl From<PostError> for Error {
    fn from(e: PostError) -> Self {
        e.error
    }
}

/// `struct ibv_qp_init_attr`.
#[derive(Debug, Clone)]
pub struct QpInitAttr {
    /// Transport service.
    pub qp_type: QpType,
    /// CQ for send completions (none for an XRC target).
    pub send_cq: Option<Arc<Cq>>,
    /// CQ for receive completions (none for XRC QPs: an XRC SRQ has its own).
    pub recv_cq: Option<Arc<Cq>>,
    /// SRQ, if receives come from one.
    pub srq: Option<Arc<Srq>>,
    /// Requested capabilities.
    pub cap: QpCap,
    /// Every send WR generates a completion.
    pub sq_sig_all: bool,
    /// Largest `IBV_WR_TSO` header (`max_tso_header`, raw packet QPs only); 0 for no TSO.
    pub max_tso_header: u16,
}

/// How a UD send is addressed (`ibv_send_wr.wr.ud`).
#[derive(Debug, Clone)]
pub struct UdAddress {
    /// The address handle.
    pub ah: Arc<Ah>,
    /// Destination QP number.
    pub remote_qpn: u32,
    /// Destination Q_Key.
    pub remote_qkey: u32,
}

/// A send work request as the device accepts it (`struct ibv_send_wr`).
#[derive(Debug, Clone)]
pub struct SendRequest {
    /// User identifier returned in the completion.
    pub wr_id: u64,
    /// Operation.
    pub op: SendOp,
    /// `ibv_send_flags`.
    pub flags: SendFlags,
    /// Data: a gather list, or inline bytes already copied by the caller.
    pub payload: Payload,
    /// UD destination.
    pub ud: Option<UdAddress>,
    /// XRC_SEND: the SRQ number at the target (`qp_type.xrc.remote_srqn`).
    pub xrc_srqn: Option<u32>,
}

#[derive(Debug)]
struct QpInner {
    attr: QpAttr,
    engine: QpEngine,
    mcast: HashSet<Gid>,
    /// Rendezvous transfers for a tag-matching SRQ.
    tm: QpRendezvous,
    /// Completions waiting for the packets produced with them to leave.
    held: Held,
    /// The engine's counters as last added to the device's.
    reported: QpCounters,
    /// The latest time the engine was handed: see [`QpInner::clock`].
    clock: Instant,
}

impl QpInner {
    /// `now`, or the latest time the engine was already handed if that is later: threads read
    /// the clock before they take the lock, and a later reading may get it first. The engine
    /// times round trips from these times, so they must never go back.
    fn clock(&mut self, now: Instant) -> Instant {
        self.clock = self.clock.max(now);
        self.clock
    }
}

/// What one engine drain produced: packets to send, and the ticket that makes the completions
/// produced with them visible once they were sent ([`Qp::release`]).
#[derive(Debug)]
#[must_use = "the completions stay held until the ticket is released"]
pub(crate) struct Outputs {
    pub(crate) txs: Vec<Transmit>,
    pub(crate) ticket: u64,
    /// The time they were made at (what a carrier may use instead of reading the clock).
    pub(crate) now: Instant,
}

/// A queue pair (`ibv_create_qp`).
#[derive(Debug)]
pub struct Qp {
    me: Weak<Self>,
    /// The context it was created in (its async events go there); the PD's, unless the PD was
    /// imported from a context sharing its objects.
    ctx: Arc<Context>,
    /// None for an XRC target, which uses the PD of each SRQ it serves.
    pd: Option<Arc<Pd>>,
    /// The XRC domain of an XRC target.
    xrcd: Option<Arc<Xrcd>>,
    /// XRC target: open handles (the creator's and `ibv_open_qp`'s); the QP dies with the last.
    /// The flag says whether the creator's handle is still open.
    xrc_handles: Mutex<(u32, bool)>,
    /// `ibv_open_qp` handles: the context each was opened on and the front end's token for it.
    /// Async events reach every opener.
    openers: Mutex<Vec<(Weak<Context>, u64)>>,
    init: QpInitAttr,
    qpn: u32,
    handle: u32,
    inner: Mutex<QpInner>,
    /// Next transport deadline in engine nanoseconds; `u64::MAX` for none.
    deadline: AtomicU64,
    uses: UseCount,
    async_acks: AckCounter,
    user_data: AtomicU64,
    /// The packet socket of a raw packet QP.
    raw: Option<Arc<RawPort>>,
    /// The indirection table and hash of an RSS QP.
    rss: Option<Rss>,
}

/// Receive WQEs from a shared receive queue, for the engine.
struct SrqRecv<'a>(&'a Srq);

/// Receive WQEs of an XRC target: from the SRQ of its domain each request names, in this
/// process or, through the relay, in another process sharing the domain.
struct XrcRecv<'a> {
    domain: &'a XrcDomain,
    device: &'a str,
    selected: Option<XrcSelected>,
}

enum XrcSelected {
    Local(Arc<Srq>),
    /// An SRQ of the process serving `port`.
    Remote {
        port: u16,
        srqn: u32,
    },
}

impl XrcRecv<'_> {
    fn remote(&self) -> Option<xrc_relay::DomainRef<'_>> {
        Some(xrc_relay::DomainRef {
            device: self.device,
            inode: self.domain.inode()?,
        })
    }
}

impl RecvSource for XrcRecv<'_> {
    fn take(&mut self) -> Option<RecvWr> {
        match self.selected.as_ref()? {
            XrcSelected::Local(s) => s.take(),
            XrcSelected::Remote { port, srqn } => self.remote()?.take(*port, *srqn),
        }
    }

    fn put_back(&mut self, wr: RecvWr) {
        match &self.selected {
            Some(XrcSelected::Local(s)) => s.put_back(wr),
            Some(XrcSelected::Remote { port, srqn }) => {
                if let Some(r) = self.remote() {
                    r.put_back(*port, *srqn, &wr);
                }
            }
            None => {}
        }
    }

    fn select_xrc_srq(&mut self, srqn: u32) -> Option<u32> {
        if let Some(srq) = self.domain.srq(srqn) {
            let pd = srq.pd().handle();
            self.selected = Some(XrcSelected::Local(srq));
            return Some(pd);
        }
        // Not ours: the SRQ may belong to another process of a domain shared by file.
        let port = xrc_relay::owner_port(srqn)?;
        let pd = self.remote()?.select(port, srqn)?;
        self.selected = Some(XrcSelected::Remote { port, srqn });
        Some(pd)
    }
}

impl RecvSource for SrqRecv<'_> {
    fn take(&mut self) -> Option<RecvWr> {
        self.0.take()
    }

    fn put_back(&mut self, wr: RecvWr) {
        self.0.put_back(wr);
    }
}

impl Qp {
    /// `ibv_create_qp`. The returned QP's [`Qp::cap`] holds the actual capabilities, each at
    /// least what was asked for.
    pub fn create(pd: &Arc<Pd>, init: &QpInitAttr) -> Result<Arc<Self>> {
        Self::create_in(pd.context(), pd, init)
    }

    /// `ibv_create_qp` in `ctx`, which must share its objects with the PD's context (it is that
    /// context, or one imported from it or it from): the QP's async events go to `ctx`.
    pub fn create_in(ctx: &Arc<Context>, pd: &Arc<Pd>, init: &QpInitAttr) -> Result<Arc<Self>> {
        if !ctx.shares_objects_with(pd.context()) {
            return Err(Error::invalid("the PD belongs to another context"));
        }
        let mut init = init.clone();
        match init.qp_type {
            QpType::XrcRecv => {
                return Err(Error::invalid(
                    "an XRC_RECV QP is created on an XRC domain, without a PD",
                ))
            }
            // The initiator has no receive side: no receive CQ, and no receive capabilities.
            QpType::XrcSend => {
                init.recv_cq = None;
                init.cap.max_recv_wr = 0;
                init.cap.max_recv_sge = 0;
            }
            _ if init.recv_cq.is_none() => return Err(Error::invalid("recv_cq is required")),
            _ => {}
        }
        if init.send_cq.is_none() {
            return Err(Error::invalid("send_cq is required"));
        }
        Self::create_inner(ctx, Some(pd), None, &init, None)
    }

    /// `ibv_create_qp_ex` of an `IBV_QPT_XRC_RECV` QP: it belongs to the XRC domain of `xrcd`
    /// and has no PD, CQs or work queues; requests reach the domain's SRQs through it.
    pub fn create_xrc_recv(xrcd: &Arc<Xrcd>) -> Result<Arc<Self>> {
        let init = QpInitAttr {
            qp_type: QpType::XrcRecv,
            send_cq: None,
            recv_cq: None,
            srq: None,
            cap: QpCap::default(),
            sq_sig_all: false,
            max_tso_header: 0,
        };
        Self::create_inner(xrcd.context(), None, Some(xrcd), &init, None)
    }

    /// `ibv_create_qp_ex` with `IBV_QP_INIT_ATTR_IND_TABLE | IBV_QP_INIT_ATTR_RX_HASH`: a
    /// receive-only raw packet QP that spreads the frames its flows steer to it over the WQs
    /// of `table` by the hash. It has no queues or state of its own.
    pub fn create_rss(pd: &Arc<Pd>, table: &Arc<RwqIndTable>, hash: RxHashConf) -> Result<Arc<Self>> {
        if !Arc::ptr_eq(table.context(), pd.context()) {
            return Err(Error::invalid("the indirection table belongs to another context"));
        }
        // The QP's invariants want CQs; it names the first WQ's, which it never writes to
        // (the WQs complete on their own CQs).
        let cq = table.wqs()[0].cq().clone();
        let init = QpInitAttr {
            qp_type: QpType::RawPacket,
            send_cq: Some(cq.clone()),
            recv_cq: Some(cq),
            srq: None,
            cap: QpCap::default(),
            sq_sig_all: false,
            max_tso_header: 0,
        };
        table.uses().acquire("indirection table")?;
        let rss = Rss {
            table: table.clone(),
            hash,
        };
        Self::create_inner(pd.context(), Some(pd), None, &init, Some(rss))
    }

    fn create_inner(
        ctx: &Arc<Context>,
        pd: Option<&Arc<Pd>>,
        xrcd: Option<&Arc<Xrcd>>,
        init: &QpInitAttr,
        rss: Option<Rss>,
    ) -> Result<Arc<Self>> {
        let release_table = |rss: &Option<Rss>| {
            if let Some(r) = rss {
                r.table.uses().release();
            }
        };
        let raw = match init.qp_type {
            QpType::RawPacket => {
                let port = require_cap_net_raw("a raw packet QP").and_then(|()| {
                    let device = ctx.device();
                    device.shared().raw.get_or_open(device.netdev())
                });
                match port {
                    Ok(p) => Some(p),
                    Err(e) => {
                        release_table(&rss);
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        // Numbered first: validation takes references that are not easily undone.
        let qpn = match ctx.device().alloc_qpn() {
            Ok(n) => n,
            Err(e) => {
                release_table(&rss);
                return Err(e);
            }
        };
        let cap = match Self::validate_and_acquire(ctx, pd, xrcd, init) {
            Ok(cap) => cap,
            Err(e) => {
                ctx.device().free_qpn(qpn);
                release_table(&rss);
                return Err(e);
            }
        };
        Ok(Self::build(ctx, pd, xrcd, init, (qpn, cap), raw, rss))
    }

    fn validate_and_acquire(
        ctx: &Arc<Context>,
        pd: Option<&Arc<Pd>>,
        xrcd: Option<&Arc<Xrcd>>,
        init: &QpInitAttr,
    ) -> Result<QpCap> {
        let limits = *ctx.device().limits();
        for (cq, which) in [(&init.send_cq, "send_cq"), (&init.recv_cq, "recv_cq")] {
            // Contexts imported from one another share their objects, as one kernel ufile does.
            if cq
                .as_ref()
                .is_some_and(|cq| !cq.context().shares_objects_with(ctx))
            {
                return Err(Error::invalid(format!("{which} belongs to another context")));
            }
        }
        if let Some(srq) = &init.srq {
            if !matches!(init.qp_type, QpType::Rc | QpType::Ud) {
                return Err(Error::invalid("only RC and UD QPs can be associated with an SRQ"));
            }
            if srq.is_xrc() {
                return Err(Error::invalid(
                    "an XRC SRQ is reached through XRC QPs, not attached to a QP",
                ));
            }
            if !srq.pd().context().shares_objects_with(ctx) {
                return Err(Error::invalid("srq belongs to another context"));
            }
            if srq.is_tm() && init.qp_type != QpType::Rc {
                return Err(Error::invalid(
                    "only RC QPs can be associated with a tag-matching SRQ",
                ));
            }
        }
        let c = init.cap;
        let check = |v: u32, max: u32, name: &str| {
            if v > max {
                Err(Error::invalid(format!(
                    "cap.{name} {v} exceeds the device maximum {max}"
                )))
            } else {
                Ok(())
            }
        };
        check(c.max_send_wr, limits.max_qp_wr, "max_send_wr")?;
        check(c.max_send_sge, limits.max_sge, "max_send_sge")?;
        check(c.max_inline_data, limits.max_inline_data, "max_inline_data")?;
        if init.max_tso_header != 0 && init.qp_type != QpType::RawPacket {
            return Err(Error::invalid("max_tso_header is for raw packet QPs only"));
        }
        check(
            u32::from(init.max_tso_header),
            softverbs_engine::tso::MAX_TSO_HEADER,
            "max_tso_header",
        )?;
        // With an SRQ the receive capabilities are ignored (ibv_create_qp(3)).
        let cap = if init.srq.is_some() || init.qp_type.is_xrc() {
            QpCap {
                max_recv_wr: 0,
                max_recv_sge: 0,
                ..c
            }
        } else {
            check(c.max_recv_wr, limits.max_qp_wr, "max_recv_wr")?;
            check(c.max_recv_sge, limits.max_sge, "max_recv_sge")?;
            c
        };
        let cap = QpCap {
            max_send_wr: round_depth(cap.max_send_wr),
            max_recv_wr: round_depth(cap.max_recv_wr),
            max_send_sge: cap.max_send_sge,
            max_recv_sge: cap.max_recv_sge,
            // Inline data is copied into the WQE in 16-byte units.
            max_inline_data: cap
                .max_inline_data
                .div_ceil(16)
                .saturating_mul(16)
                .min(limits.max_inline_data),
        };

        // Take every reference, undoing the ones already taken if a later one fails.
        let mut taken: Vec<&UseCount> = Vec::new();
        let result = (|| {
            ctx.device().acquire(Resource::Qp)?;
            let deps = [
                pd.map(|p| (p.uses(), "protection domain")),
                xrcd.map(|x| (x.uses(), "XRC domain")),
                init.send_cq.as_ref().map(|c| (c.uses(), "send_cq")),
                init.recv_cq.as_ref().map(|c| (c.uses(), "recv_cq")),
            ];
            for (u, what) in deps.into_iter().flatten() {
                u.acquire(what)?;
                taken.push(u);
            }
            if let Some(srq) = &init.srq {
                srq.uses.acquire("srq")?;
                taken.push(&srq.uses);
            }
            Ok(())
        })();
        if let Err(e) = result {
            if !matches!(e, Error::NoResources(_)) {
                ctx.device().release(Resource::Qp);
            }
            taken.iter().for_each(|u| u.release());
            return Err(e);
        }
        Ok(cap)
    }

    fn build(
        ctx: &Arc<Context>,
        pd: Option<&Arc<Pd>>,
        xrcd: Option<&Arc<Xrcd>>,
        init: &QpInitAttr,
        (qpn, cap): (u32, QpCap),
        raw: Option<Arc<RawPort>>,
        rss: Option<Rss>,
    ) -> Arc<Self> {
        let attr = QpAttr {
            cap,
            ..QpAttr::default()
        };
        let engine = QpEngine::new(QpConfig {
            qp_type: init.qp_type,
            qpn,
            pd: pd.map_or(0, |p| p.handle()),
            sq_sig_all: init.sq_sig_all,
            has_srq: init.srq.is_some(),
        });
        let qp = Arc::new_cyclic(|me| Self {
            me: me.clone(),
            ctx: ctx.clone(),
            pd: pd.cloned(),
            xrcd: xrcd.cloned(),
            xrc_handles: Mutex::new((1, true)),
            openers: Mutex::new(Vec::new()),
            init: QpInitAttr { cap, ..init.clone() },
            qpn,
            handle: ctx.next_handle(),
            inner: Mutex::new(QpInner {
                attr,
                engine,
                mcast: HashSet::new(),
                tm: QpRendezvous::default(),
                held: Held::default(),
                reported: QpCounters::default(),
                clock: Instant(0),
            }),
            deadline: AtomicU64::new(u64::MAX),
            uses: UseCount::default(),
            async_acks: AckCounter::default(),
            user_data: AtomicU64::new(0),
            raw,
            rss,
        });
        ctx.device().node().add_qp(&qp);
        qp
    }

    /// The packet socket of a raw packet QP.
    pub(crate) fn raw_port(&self) -> Option<&Arc<RawPort>> {
        self.raw.as_ref()
    }

    /// Whether this is an RSS QP (created with an indirection table).
    pub fn is_rss(&self) -> bool {
        self.rss.is_some()
    }

    pub(crate) fn uses(&self) -> &UseCount {
        &self.uses
    }

    /// Handles a frame a flow steered to this raw packet QP: into its next receive WQE, or,
    /// for an RSS QP, to the WQ the hash selects.
    pub(crate) fn handle_frame(&self, frame: &[u8], flow_tag: u32) {
        if let Some(rss) = &self.rss {
            rss.deliver(frame, flow_tag);
            return;
        }
        let now = self.fabric().now();
        let mut inner = self.inner.lock();
        let node = self.node();
        let _ = match &self.init.srq {
            Some(srq) => inner
                .engine
                .handle_frame(frame, flow_tag, &node.keys, Some(&mut SrqRecv(srq))),
            None => inner.engine.handle_frame(frame, flow_tag, &node.keys, None),
        };
        let out = self.drain(&mut inner, now);
        drop(inner);
        debug_assert!(out.txs.is_empty());
        self.release(out.ticket);
    }

    /// The PD (none for an XRC target).
    pub fn pd(&self) -> Option<&Arc<Pd>> {
        self.pd.as_ref()
    }

    /// The XRC domain handle an XRC target was created with.
    pub fn xrcd(&self) -> Option<&Arc<Xrcd>> {
        self.xrcd.as_ref()
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn node(&self) -> &Arc<Node> {
        self.context().device().node()
    }

    fn fabric(&self) -> &Arc<Fabric> {
        self.node().fabric()
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// Handle (`ibv_qp.handle`).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// Transport service.
    pub fn qp_type(&self) -> QpType {
        self.init.qp_type
    }

    /// The creation attributes, with the actual capabilities.
    pub fn init_attr(&self) -> &QpInitAttr {
        &self.init
    }

    /// The actual capabilities.
    pub fn cap(&self) -> QpCap {
        self.init.cap
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.inner.lock().attr.qp_state
    }

    /// Transport counters of this QP.
    pub fn counters(&self) -> QpCounters {
        self.inner.lock().engine.counters()
    }

    /// A value the front end may associate with the QP (e.g. `qp_context`).
    pub fn user_data(&self) -> u64 {
        self.user_data.load(Ordering::Relaxed)
    }

    /// Sets [`Qp::user_data`].
    pub fn set_user_data(&self, v: u64) {
        self.user_data.store(v, Ordering::Relaxed);
    }

    pub(crate) fn async_acks(&self) -> &AckCounter {
        &self.async_acks
    }

    fn raise(&self, event: EventType) {
        tracing::debug!(qpn = self.qpn, ?event, "QP async event");
        let Some(me) = self.me.upgrade() else { return };
        let creator_open = self.xrc_handles.lock().1;
        if creator_open {
            self.context().raise(EventElement::Qp(me.clone()), event);
        }
        for (ctx, token) in self.openers.lock().iter() {
            if let Some(ctx) = ctx.upgrade() {
                ctx.raise(EventElement::OpenedQp(me.clone(), *token), event);
            }
        }
    }

    /// The next transport deadline.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        let d = self.deadline.load(Ordering::Acquire);
        (d != u64::MAX).then_some(Instant(d))
    }

    /// Moves the engine's outputs where they belong: completions are held under a new ticket
    /// (see [`Qp::release`]), events go to the context, deadlines to the progress thread.
    /// Returns the packets to send with the ticket.
    fn drain(&self, inner: &mut QpInner, now: Instant) -> Outputs {
        self.drain_with(inner, now, &self.node().keys)
    }

    /// Adds what the engine counted since the last look (resends, timer expiries, NAKs) to
    /// the device's counters, which every process's board shows.
    fn report(&self, inner: &mut QpInner) {
        let now = inner.engine.counters();
        let was = std::mem::replace(&mut inner.reported, now);
        if now == was {
            return;
        }
        if now.retransmits > was.retransmits || now.timeouts > was.timeouts {
            tracing::debug!(
                qpn = self.qpn,
                resent = now.retransmits - was.retransmits,
                timeouts = now.timeouts - was.timeouts,
                seq_naks = now.seq_naks_received - was.seq_naks_received,
                rnr_naks = now.rnr_naks_received - was.rnr_naks_received,
                "retransmission"
            );
        }
        let c = &self.node().counters;
        for (counter, (now, was)) in [
            (c.retransmits(), (now.retransmits, was.retransmits)),
            (c.timeouts(), (now.timeouts, was.timeouts)),
            (c.seq_naks(), (now.seq_naks_received, was.seq_naks_received)),
            (c.rnr_naks(), (now.rnr_naks_received, was.rnr_naks_received)),
            (c.seq_naks_sent(), (now.seq_naks_sent, was.seq_naks_sent)),
            (c.tail_probes(), (now.tail_probes, was.tail_probes)),
        ] {
            if now > was {
                counter.fetch_add(now - was, Ordering::Relaxed);
            }
        }
    }

    /// [`Qp::drain`] with the memory the engine was handed for the input just processed.
    fn drain_with(&self, inner: &mut QpInner, now: Instant, mem: &dyn Memory) -> Outputs {
        let mut txs = softverbs_engine::transport::buffers::take_transmits();
        let ticket = inner.held.issue();
        loop {
            while let Some(tx) = inner.engine.poll_transmit(now, mem) {
                txs.push(tx);
            }
            let mut posted = false;
            while let Some(c) = inner.engine.poll_completion() {
                log_error_completion(self.qpn, &c.wc);
                if c.queue == WorkQueue::Internal {
                    // A step of a rendezvous: it may post the next one and report the tag.
                    let QpInner {
                        attr,
                        engine,
                        tm,
                        held,
                        ..
                    } = &mut *inner;
                    let (wcs, p) = tm.on_internal(engine, &c.wc, self.qpn, attr.dest_qp_num);
                    posted |= p;
                    for wc in wcs {
                        held.hold(
                            ticket,
                            Completion {
                                queue: WorkQueue::Recv,
                                wc,
                            },
                        );
                    }
                    continue;
                }
                inner.held.hold(ticket, c);
            }
            if !posted {
                break;
            }
        }
        while let Some(ev) = inner.engine.poll_event() {
            self.raise(ev);
        }
        if inner.engine.take_error_transition() {
            tracing::warn!(
                qpn = self.qpn,
                from = %inner.attr.qp_state,
                "QP moved to the error state by its transport"
            );
            inner.attr.qp_state = QpState::Err;
        }
        self.report(inner);
        let deadline = inner.engine.poll_timeout();
        self.deadline
            .store(deadline.map_or(u64::MAX, Instant::as_nanos), Ordering::Release);
        if let Some(d) = deadline {
            self.fabric().schedule(d);
        }
        Outputs { txs, ticket, now }
    }

    /// Tells the QP that the packets of `ticket` were handed to the fabric: the completions
    /// produced with them (and with every earlier ticket already sent) go to their CQs now.
    pub(crate) fn release(&self, ticket: u64) {
        let mut inner = self.inner.lock();
        let mut ticket = ticket;
        loop {
            let mut overrun = false;
            // A tag-matching SRQ receives the completions of its QPs on its own CQ.
            let tm_cq = self.init.srq.as_ref().and_then(|s| s.tm_cq());
            inner.held.release(ticket, |c| {
                let cq = match c.queue {
                    WorkQueue::Send => self.init.send_cq.clone(),
                    WorkQueue::Recv => tm_cq.or(self.init.recv_cq.as_ref()).cloned(),
                    // An XRC target completes on the CQ of the SRQ the WQE came from; if that
                    // SRQ is gone, so is its CQ's interest in the completion.
                    WorkQueue::XrcSrq(srqn) => {
                        let Some(domain) = self.xrcd.as_ref().map(|x| x.domain()) else {
                            return;
                        };
                        if let Some(srq) = domain.srq(srqn) {
                            srq.xrc_cq().cloned()
                        } else {
                            // Another process's SRQ: its owner queues the completion.
                            if let (Some(port), Some(inode)) = (xrc_relay::owner_port(srqn), domain.inode()) {
                                let device = self.context().device();
                                xrc_relay::DomainRef {
                                    device: device.name(),
                                    inode,
                                }
                                .complete(port, srqn, &c.wc);
                            }
                            return;
                        }
                    }
                    // Consumed by the drain, never held.
                    WorkQueue::Internal => return,
                };
                if let Some(cq) = cq {
                    overrun |= cq.push(c.wc).is_err();
                }
            });
            if !overrun || inner.attr.qp_state == QpState::Err {
                return;
            }
            // A CQ overrun leaves the QP unusable: move it to ERR and flush (the flushed
            // completions are lost too, the CQ being in error).
            tracing::warn!(qpn = self.qpn, "CQ overrun: QP moves to the error state");
            let now = self.fabric().now();
            inner.attr.qp_state = QpState::Err;
            let attr = inner.attr;
            inner.engine.set_attr(now, &attr);
            self.raise(EventType::QpFatal);
            let out = self.drain(&mut inner, now);
            self.fabric().send_all(self.node(), out.txs);
            ticket = out.ticket;
        }
    }

    /// Sends packets, makes their completions visible, and lets the fabric run until it is
    /// quiet.
    fn emit(&self, out: Outputs) {
        self.emit_as(out, false);
    }

    /// [`Qp::emit`]; `posted` packets (of work requests just posted) may wait for the
    /// application's next poll to leave with the rest of its burst (see
    /// `Fabric::send_then_release`).
    fn emit_as(&self, out: Outputs, posted: bool) {
        self.send_then_release(out, posted);
        self.fabric().drive_queued();
    }

    /// Sends packets, then makes their completions visible.
    fn send_then_release(&self, out: Outputs, posted: bool) {
        match (&self.raw, self.me.upgrade()) {
            (None, Some(me)) => {
                let hold = if posted { Hold::Posted } else { Hold::No };
                self.fabric().send_then_release(
                    self.node(),
                    out.txs,
                    [(me, out.ticket)],
                    hold,
                    Some(out.now),
                );
            }
            _ => {
                self.transmit(out.txs);
                self.release(out.ticket);
            }
        }
    }

    /// Sends packets the way this QP's go: a raw QP's frames out of its packet socket, the
    /// others over the fabric.
    pub(crate) fn transmit(&self, txs: Vec<Transmit>) {
        match &self.raw {
            Some(port) => {
                for tx in &txs {
                    if let Err(e) = port.send(&tx.data) {
                        tracing::warn!(qpn = self.qpn, "raw frame not sent: {e}");
                    }
                }
            }
            None => self.fabric().send_all(self.node(), txs),
        }
    }

    /// Handles a packet for this QP (called by the node). Returns packets to send, why the
    /// packet was dropped if it was, and whether a positive ACK is held back for
    /// [`Endpoint::end_batch`] (`more`: packets of the same batch follow, see
    /// [`Endpoint::receive_packet`]).
    pub(crate) fn handle_packet(
        &self,
        now: Instant,
        pkt: &ParsedPacket<'_>,
        ext: Option<&dyn ExternalPayload>,
        meta: &RxMeta,
        pending: &Pending,
        more: bool,
    ) -> (Option<Outputs>, Option<DropReason>, bool) {
        let mut inner = self.inner.lock();
        let now = inner.clock(now);
        // The fabric ends the batch with `end_batch` if an ACK is held.
        if more {
            inner.engine.hold_acks();
        }
        let node = self.node();
        let pkt = match ext {
            Some(src) => Rx::external(pkt, src),
            None => Rx::new(pkt),
        };
        let pkt = &pkt;
        let keys = Deferring {
            mem: &node.keys,
            keys: &node.keys,
            pending,
        };
        let dropped = match &self.init.srq {
            None if self.xrcd.is_some() => {
                let device = self.context().device();
                let mut src = XrcRecv {
                    domain: self.xrcd.as_ref().expect("checked").domain(),
                    device: device.name(),
                    selected: None,
                };
                let mem = xrc_relay::XrcMemory {
                    local: &node.keys,
                    device: device.name(),
                };
                let mem = Deferring {
                    mem: &mem,
                    keys: &node.keys,
                    pending,
                };
                inner.engine.handle_rx(now, pkt, meta, &mem, Some(&mut src)).err()
            }
            Some(srq) if srq.is_tm() => {
                let QpInner { attr, engine, tm, .. } = &mut *inner;
                let mut src = TmRecv {
                    srq,
                    rndv: tm,
                    can_read: crate::tm::can_read(attr),
                };
                engine.handle_rx(now, pkt, meta, &keys, Some(&mut src)).err()
            }
            Some(srq) => {
                let mut src = SrqRecv(srq);
                inner
                    .engine
                    .handle_rx(now, pkt, meta, &keys, Some(&mut src))
                    .err()
            }
            None => inner.engine.handle_rx(now, pkt, meta, &keys, None).err(),
        };
        let ack_held = inner.engine.holds_ack();
        if ack_held {
            // Only the held ACK came of it (anything else to send would have let that ACK
            // out): the batch's end drains this QP (`end_batch`), and what this packet
            // produced (completions, a new deadline) is collected there with the rest of the
            // batch, once. Its completions stay as invisible meanwhile as under a ticket of
            // their own, and the batch's replies all leave in one send anyway.
            return (None, dropped, true);
        }
        let out = self.drain_with(&mut inner, now, &keys);
        inner.engine.release_acks();
        (Some(out), dropped, false)
    }

    /// A payload copy for packets handled under `ticket` failed (see [`crate::remote`]): the
    /// data the engine accepted is not there, so the completions those packets produced are
    /// flushed in error and the QP moves to the error state (`IBV_EVENT_QP_FATAL`).
    pub(crate) fn fail_copies(&self, ticket: u64) {
        let mut inner = self.inner.lock();
        inner.held.fail(ticket);
        if inner.attr.qp_state != QpState::Err {
            tracing::warn!(
                qpn = self.qpn,
                "a payload could not be copied from its sender: QP moves to the error state"
            );
            let now = self.fabric().now();
            inner.attr.qp_state = QpState::Err;
            let attr = inner.attr;
            inner.engine.set_attr(now, &attr);
            self.raise(EventType::QpFatal);
            drop(inner);
            self.release(ticket);
            let mut inner = self.inner.lock();
            let out = self.drain(&mut inner, now);
            drop(inner);
            self.emit(out);
            return;
        }
        drop(inner);
        self.release(ticket);
    }

    /// Handles expired transport timers (called by the progress machinery).
    pub(crate) fn handle_timeout(&self, now: Instant) -> Outputs {
        let mut inner = self.inner.lock();
        let now = inner.clock(now);
        inner.engine.handle_timeout(now);
        self.drain(&mut inner, now)
    }

    /// `ibv_query_qp`: every attribute (the mask is only a hint, so all are returned).
    pub fn query(&self) -> QpAttr {
        let inner = self.inner.lock();
        let mut attr = inner.attr;
        attr.cur_qp_state = attr.qp_state;
        attr.sq_draining = attr.qp_state == QpState::Sqd && inner.engine.sq_draining();
        attr
    }

    /// `ibv_modify_qp`: validates against the IBTA state table and the device limits; on any
    /// error nothing changes and the error names the offending attribute.
    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        if self.rss.is_some() {
            return Err(Error::not_supported(
                "an RSS QP has no state of its own: its WQs' states apply",
            ));
        }
        let ctx = self.context();
        let now = self.fabric().now();
        let mask = effective_mask(self.qp_type(), mask);
        let out = {
            let mut inner = self.inner.lock();
            let from = inner.attr.qp_state;
            let next = validate_modify(self.qp_type(), from, attr, mask, &ctx.port_limits())?;
            if mask.contains(QpAttrMask::RATE_LIMIT) {
                crate::rate_limit::check_rate(attr.rate_limit)?;
            }
            apply_modify(&mut inner.attr, attr, mask, next);
            let new = inner.attr;
            let _span = tracing::debug_span!("modify_qp", qpn = self.qpn).entered();
            tracing::debug!(
                qp_type = ?self.qp_type(),
                from = %from,
                to = %new.qp_state,
                dest_qpn = new.dest_qp_num,
                "QP state change"
            );
            inner.engine.set_attr(now, &new);
            let connected = matches!(self.qp_type(), QpType::Rc | QpType::Uc | QpType::XrcSend);
            if connected && matches!(new.qp_state, QpState::Rtr | QpState::Rts) {
                // Large payloads stay in registered memory while the peer is another process
                // of this host reached through shared memory (it copies them itself).
                let shm = self
                    .fabric()
                    .can_leave_payloads_in_memory(&new.ah_attr.grh.dgid, new.dest_qp_num);
                inner.engine.set_external_payloads(shm);
                // Early resends pay off only on a carrier that can lose packets (UDP).
                let lossless = self
                    .fabric()
                    .reaches_without_loss(&new.ah_attr.grh.dgid, new.dest_qp_num);
                inner.engine.set_adaptive_retransmit(!lossless);
            }
            if mask.contains(QpAttrMask::RATE_LIMIT) {
                inner
                    .engine
                    .set_rate_limit(now, crate::rate_limit::limit(attr.rate_limit, 0, 0));
            }
            if new.qp_state == QpState::Reset {
                if let Some(cq) = self.init.srq.as_ref().and_then(|s| s.tm_cq()) {
                    inner.tm.flush(cq, self.qpn);
                }
            }
            self.drain(&mut inner, now)
        };
        self.emit(out);
        Ok(())
    }

    /// `ibv_modify_qp_rate_limit`: paces the sends of a raw packet QP in RTS to `rate_kbps`
    /// (0: unlimited) in bursts of at most `max_burst_sz` bytes (0: one typical packet of
    /// `typical_pkt_sz`, 0: the port MTU). EINVAL for other QP types or states, a rate outside
    /// `packet_pacing_caps`, or burst or packet size without a rate.
    pub fn modify_rate_limit(&self, rate_kbps: u32, max_burst_sz: u32, typical_pkt_sz: u16) -> Result<()> {
        let now = self.fabric().now();
        let out = {
            let mut inner = self.inner.lock();
            crate::rate_limit::check(
                self.qp_type(),
                inner.attr.qp_state == QpState::Rts,
                rate_kbps,
                max_burst_sz,
                typical_pkt_sz,
            )?;
            inner.attr.rate_limit = rate_kbps;
            let limit = crate::rate_limit::limit(rate_kbps, max_burst_sz, typical_pkt_sz);
            inner.engine.set_rate_limit(now, limit);
            self.drain(&mut inner, now)
        };
        self.emit(out);
        Ok(())
    }

    /// `ibv_post_recv`: queues receive WRs in order, stopping at the first that cannot be
    /// posted. A QP in the error state completes them at once with `IBV_WC_WR_FLUSH_ERR`.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        let fail = |index, error| Err(PostError { index, error });
        if self.init.srq.is_some() {
            return fail(
                0,
                Error::invalid("the QP receives from an SRQ: use post_srq_recv"),
            );
        }
        if self.qp_type().is_xrc() {
            return fail(
                0,
                Error::invalid("XRC QPs have no receive queue: receives are posted to XRC SRQs"),
            );
        }
        if self.rss.is_some() {
            return fail(0, Error::invalid("an RSS QP receives through its WQs"));
        }
        let now = self.fabric().now();
        let mut inner = self.inner.lock();
        let now = inner.clock(now);
        if inner.attr.qp_state == QpState::Reset {
            return fail(
                0,
                Error::invalid("receives cannot be posted to a QP in the RESET state"),
            );
        }
        let cap = self.init.cap;
        let mut result = Ok(());
        for (index, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > cap.max_recv_sge as usize {
                result = fail(
                    index,
                    Error::invalid(format!(
                        "num_sge {} exceeds max_recv_sge {}",
                        wr.sg_list.len(),
                        cap.max_recv_sge
                    )),
                );
                break;
            }
            if inner.engine.recv_queue_len() >= cap.max_recv_wr as usize {
                result = fail(
                    index,
                    Error::no_resources(format!("the receive queue is full ({} WRs)", cap.max_recv_wr)),
                );
                break;
            }
            inner.engine.post_recv(wr.clone());
        }
        let out = self.drain(&mut inner, now);
        // The usual receive post produces nothing (no flush, no RNR'd message waiting): then
        // there is nothing to send or release.
        if out.txs.is_empty() && inner.held.withdraw(out.ticket) {
            drop(inner);
            softverbs_engine::transport::buffers::recycle_transmits(out.txs);
            self.fabric().drive_queued();
            return result;
        }
        drop(inner);
        self.emit(out);
        result
    }

    /// `ibv_post_send`: checks and queues send WRs in order, stopping at the first that cannot
    /// be posted, then starts sending. A QP in the error state completes them at once with
    /// `IBV_WC_WR_FLUSH_ERR`.
    pub fn post_send(&self, wrs: &[SendRequest]) -> Result<(), PostError> {
        if self.rss.is_some() {
            return Err(PostError {
                index: 0,
                error: Error::invalid("an RSS QP is receive-only"),
            });
        }
        let now = self.fabric().now();
        let mut inner = self.inner.lock();
        let now = inner.clock(now);
        let state = inner.attr.qp_state;
        if matches!(state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(PostError {
                index: 0,
                error: Error::invalid(format!("sends cannot be posted to a QP in the {state} state")),
            });
        }
        let port = *self.context().device().port_attr();
        let limits = SendLimits {
            qp_type: self.qp_type(),
            max_send_sge: self.init.cap.max_send_sge,
            max_inline_data: self.init.cap.max_inline_data,
            max_msg_sz: u64::from(port.max_msg_sz),
            ud_mtu: match &self.raw {
                Some(p) => p.max_frame(),
                None => port.active_mtu.bytes(),
            },
            max_rd_atomic: inner.attr.max_rd_atomic,
            max_tso_header: u32::from(self.init.max_tso_header),
        };
        let mut result = Ok(());
        for (index, req) in wrs.iter().enumerate() {
            let ud = match (&req.ud, self.qp_type()) {
                (Some(u), QpType::Ud) => {
                    if !Arc::ptr_eq(u.ah.pd().context(), self.context()) {
                        result = Err(PostError {
                            index,
                            error: Error::invalid("the address handle belongs to another context"),
                        });
                        break;
                    }
                    let g = u.ah.attr().grh;
                    Some(UdDest {
                        dgid: g.dgid,
                        sgid_index: g.sgid_index,
                        traffic_class: g.traffic_class,
                        hop_limit: g.hop_limit,
                        flow_label: g.flow_label,
                        qpn: u.remote_qpn,
                        qkey: u.remote_qkey,
                    })
                }
                _ => None,
            };
            let wr = SendWr {
                wr_id: req.wr_id,
                op: req.op,
                flags: req.flags,
                payload: req.payload.clone(),
                ud,
                xrc_srqn: req.xrc_srqn,
            };
            if let Err(error) = wr.check(&limits) {
                result = Err(PostError { index, error });
                break;
            }
            if inner.engine.send_queue_len() >= self.init.cap.max_send_wr as usize {
                result = Err(PostError {
                    index,
                    error: Error::no_resources(format!(
                        "the send queue is full ({} WRs)",
                        self.init.cap.max_send_wr
                    )),
                });
                break;
            }
            inner.engine.post_send(wr);
        }
        let out = self.drain(&mut inner, now);
        // Posting mostly completes nothing at once (the completion comes with the ACK): then
        // the ticket is taken back and there is nothing to release once the packets are out.
        // Later completions of this QP need not wait for them: the packets are handed to the
        // fabric before this call returns, and whatever a later drain sends leaves behind
        // them (the outbox is sent in order).
        let withdrawn = inner.held.withdraw(out.ticket);
        drop(inner);
        if withdrawn {
            self.send_posted(out.txs, out.now);
        } else {
            self.emit_as(out, true);
        }
        result
    }

    /// Sends the packets of work requests just posted whose drain held no completion (see
    /// `post_send`), as [`Qp::emit_as`] would with nothing to release.
    fn send_posted(&self, txs: Vec<Transmit>, now: Instant) {
        match &self.raw {
            None => {
                self.fabric()
                    .send_then_release(self.node(), txs, [], Hold::Posted, Some(now));
            }
            Some(_) => self.transmit(txs),
        }
        self.fabric().drive_queued();
    }

    /// Posted receive WRs not yet consumed.
    pub fn recv_queue_len(&self) -> usize {
        self.inner.lock().engine.recv_queue_len()
    }

    /// `ibv_attach_mcast`: UD only, `gid` must be a multicast GID; attaching twice is harmless.
    pub fn attach_mcast(&self, gid: &Gid, _lid: u16) -> Result<()> {
        if self.qp_type() != QpType::Ud {
            return Err(Error::invalid("only UD QPs can be attached to multicast groups"));
        }
        if !gid.is_multicast() {
            return Err(Error::invalid(format!("{gid} is not a multicast GID")));
        }
        let device = self.context().device();
        let limits = *device.limits();
        let mut inner = self.inner.lock();
        if inner.mcast.contains(gid) {
            return Ok(());
        }
        let mut table = device.node().mcast.lock();
        if table.total >= limits.max_total_mcast_qp_attach {
            return Err(Error::no_resources(format!(
                "max_total_mcast_qp_attach ({}) reached",
                limits.max_total_mcast_qp_attach
            )));
        }
        let groups = table.groups.len() as u32;
        let members = match table.groups.get(gid) {
            Some(m) => m.len() as u32,
            None if groups >= limits.max_mcast_grp => {
                return Err(Error::no_resources(format!(
                    "max_mcast_grp ({}) reached",
                    limits.max_mcast_grp
                )))
            }
            None => 0,
        };
        if members >= limits.max_mcast_qp_attach {
            return Err(Error::no_resources(format!(
                "max_mcast_qp_attach ({}) reached for {gid}",
                limits.max_mcast_qp_attach
            )));
        }
        let node = device.node();
        table.attach(
            *gid,
            self.qpn,
            device.config().udp_port,
            crate::udp::slot_of(self.qpn),
            node.ifindex(),
        );
        inner.mcast.insert(*gid);
        Ok(())
    }

    /// `ibv_detach_mcast`: EINVAL if the QP is not attached to `gid`.
    pub fn detach_mcast(&self, gid: &Gid, _lid: u16) -> Result<()> {
        let mut inner = self.inner.lock();
        if !inner.mcast.remove(gid) {
            return Err(Error::invalid(format!("the QP is not attached to {gid}")));
        }
        let device = self.context().device();
        device.node().mcast.lock().detach(gid, self.qpn);
        Ok(())
    }

    /// Multicast groups the QP is attached to.
    pub fn mcast_groups(&self) -> Vec<Gid> {
        self.inner.lock().mcast.iter().copied().collect()
    }

    fn teardown(&self) {
        // What the QP posted last may still wait in the fabric's outbox for the next poll:
        // it leaves before the QP goes, as it would have from a NIC's queue.
        self.fabric().flush_outbox();
        let device = self.context().device();
        // Type 2 windows bound to this QP die with it, before its number can be reused.
        device.node().keys.release_qp_windows(self.qpn);
        let groups: Vec<Gid> = self.inner.lock().mcast.drain().collect();
        if !groups.is_empty() {
            let mut table = device.node().mcast.lock();
            for g in groups {
                table.detach(&g, self.qpn);
            }
        }
        device.node().remove_qp(self.qpn);
        device.free_qpn(self.qpn);
        device.release(Resource::Qp);
        if let Some(pd) = &self.pd {
            pd.uses().release();
        }
        if let Some(x) = &self.xrcd {
            if std::mem::replace(&mut self.xrc_handles.lock().1, false) {
                x.uses().release();
            }
        }
        for cq in [&self.init.send_cq, &self.init.recv_cq].into_iter().flatten() {
            cq.uses().release();
        }
        if let Some(srq) = &self.init.srq {
            srq.uses.release();
        }
        if let Some(rss) = &self.rss {
            rss.table.uses().release();
        }
    }

    /// `ibv_open_qp`: another handle on the XRC target numbered `qpn` of the domain of `xrcd`.
    /// EINVAL unless `qp_type` is XRC_RECV and such a QP exists in that domain. The QP lives
    /// until its last handle is closed ([`Qp::close_opened`] or [`Qp::destroy`]).
    /// `token` names the new handle in its async events ([`EventElement::OpenedQp`]).
    pub fn open(xrcd: &Arc<Xrcd>, qpn: u32, qp_type: QpType, token: u64) -> Result<Arc<Self>> {
        if qp_type != QpType::XrcRecv {
            return Err(Error::invalid("ibv_open_qp opens XRC_RECV QPs only"));
        }
        let qp = xrcd
            .context()
            .device()
            .node()
            .qp(qpn)
            .filter(|q| q.xrcd.as_ref().is_some_and(|x| x.same_domain(xrcd)))
            .ok_or_else(|| Error::invalid(format!("the XRC domain has no XRC_RECV QP {qpn:#x}")))?;
        let mut handles = qp.xrc_handles.lock();
        if handles.0 == 0 {
            return Err(Error::invalid(format!("QP {qpn:#x} has been destroyed")));
        }
        xrcd.uses().acquire("XRC domain")?;
        handles.0 += 1;
        drop(handles);
        qp.openers.lock().push((Arc::downgrade(xrcd.context()), token));
        Ok(qp)
    }

    /// Closes the handle [`Qp::open`] returned through `xrcd` with `token`: its undelivered
    /// events are dropped; the last handle destroys the QP.
    pub fn close_opened(&self, xrcd: &Arc<Xrcd>, token: u64) -> Result<()> {
        self.openers.lock().retain(|(_, t)| *t != token);
        xrcd.context().forget_events(|e| {
            matches!(&e.element, EventElement::OpenedQp(q, t)
                if std::ptr::eq(Arc::as_ptr(q), self) && *t == token)
        });
        let last = {
            let mut handles = self.xrc_handles.lock();
            if handles.0 <= 1 {
                true
            } else {
                handles.0 -= 1;
                false
            }
        };
        if last {
            self.destroy_now()?;
        }
        xrcd.uses().release();
        Ok(())
    }

    /// `ibv_destroy_qp`: EBUSY while attached to a multicast group. Otherwise drops undelivered
    /// async events about the QP and waits until delivered ones were acknowledged.
    pub fn destroy(&self) -> Result<()> {
        if let Some(x) = &self.xrcd {
            // The creator's handle of an XRC target that others have opened: close only it.
            let mut handles = self.xrc_handles.lock();
            if handles.0 > 1 && handles.1 {
                handles.0 -= 1;
                handles.1 = false;
                x.uses().release();
                return Ok(());
            }
        }
        self.destroy_now()
    }

    fn destroy_now(&self) -> Result<()> {
        let attached = self.inner.lock().mcast.len();
        if attached > 0 {
            return Err(Error::busy(format!(
                "the QP is attached to {attached} multicast group(s)"
            )));
        }
        self.uses.retire("queue pair")?;
        self.context().forget_events(
            |e| matches!(&e.element, EventElement::Qp(q) if std::ptr::eq(Arc::as_ptr(q), self)),
        );
        self.async_acks.wait_all_acked();
        self.xrc_handles.lock().0 = 0;
        self.teardown();
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.teardown();
        }
    }
}

#[derive(Debug)]
struct SrqInner {
    attr: SrqAttr,
    queue: VecDeque<RecvWr>,
    tm: Option<TmState>,
}

/// What kind of SRQ (`enum ibv_srq_type`) and what that kind adds.
#[derive(Debug)]
pub enum SrqKind {
    /// `IBV_SRQT_BASIC`: attached to RC/UD QPs, completing on their receive CQs.
    Basic,
    /// `IBV_SRQT_XRC`: reached by number through the XRC targets of its domain.
    Xrc {
        /// The XRC domain handle it was created in.
        xrcd: Arc<Xrcd>,
        /// Every completion of its WQEs goes here.
        cq: Arc<Cq>,
    },
}

/// A shared receive queue (`ibv_create_srq`, `ibv_create_srq_ex`).
#[derive(Debug)]
pub struct Srq {
    me: Weak<Self>,
    pd: Arc<Pd>,
    kind: SrqKind,
    /// The SRQ number: what XRC initiators put in the XRCETH, unique on the host (the QP number
    /// scheme: the process's slot in bits 16..24). Basic SRQs have one too, as on ConnectX.
    srqn: u32,
    handle: u32,
    inner: Mutex<SrqInner>,
    /// Tag-matching SRQs (`IBV_SRQT_TM`): their CQ and sizes.
    tm: Option<TmShared>,
    uses: UseCount,
    async_acks: AckCounter,
    user_data: AtomicU64,
}

impl Srq {
    /// `ibv_create_srq`: [`Srq::query`] gives the actual `max_wr` and `max_sge`, each at least
    /// what was asked; `srq_limit` is ignored at creation.
    pub fn create(pd: &Arc<Pd>, attr: &SrqAttr) -> Result<Arc<Self>> {
        Self::create_with(pd, attr, None)
    }

    /// `ibv_create_srq_ex` with `IBV_SRQT_XRC`: an SRQ of the domain of `xrcd` whose
    /// completions all go to `cq`; [`Srq::srq_num`] is the number initiators address it by.
    pub fn create_xrc(pd: &Arc<Pd>, xrcd: &Arc<Xrcd>, cq: &Arc<Cq>, attr: &SrqAttr) -> Result<Arc<Self>> {
        Self::create_inner(pd, attr, None, Some((xrcd, cq)))
    }

    pub(crate) fn create_with(
        pd: &Arc<Pd>,
        attr: &SrqAttr,
        tm: Option<(TmShared, TmState)>,
    ) -> Result<Arc<Self>> {
        Self::create_inner(pd, attr, tm, None)
    }

    fn create_inner(
        pd: &Arc<Pd>,
        attr: &SrqAttr,
        tm: Option<(TmShared, TmState)>,
        xrc: Option<(&Arc<Xrcd>, &Arc<Cq>)>,
    ) -> Result<Arc<Self>> {
        let ctx = pd.context();
        if let Some((xrcd, cq)) = xrc {
            if !Arc::ptr_eq(xrcd.context(), ctx) || !Arc::ptr_eq(cq.context(), ctx) {
                return Err(Error::invalid(
                    "the XRC domain, CQ and PD of an SRQ must share one context",
                ));
            }
        }
        let limits = *ctx.device().limits();
        if attr.max_wr == 0 || attr.max_wr > limits.max_srq_wr {
            return Err(Error::invalid(format!(
                "max_wr {} is outside 1..={}",
                attr.max_wr, limits.max_srq_wr
            )));
        }
        if attr.max_sge > limits.max_srq_sge {
            return Err(Error::invalid(format!(
                "max_sge {} exceeds max_srq_sge {}",
                attr.max_sge, limits.max_srq_sge
            )));
        }
        ctx.device().acquire(Resource::Srq)?;
        let mut taken: Vec<&UseCount> = Vec::new();
        let deps = [
            Some((pd.uses(), "protection domain")),
            xrc.map(|(x, _)| (x.uses(), "XRC domain")),
            xrc.map(|(_, c)| (c.uses(), "cq")),
        ];
        for (u, what) in deps.into_iter().flatten() {
            if let Err(e) = u.acquire(what) {
                taken.iter().for_each(|u| u.release());
                ctx.device().release(Resource::Srq);
                return Err(e);
            }
            taken.push(u);
        }
        let kind = match xrc {
            None => SrqKind::Basic,
            Some((xrcd, cq)) => SrqKind::Xrc {
                xrcd: xrcd.clone(),
                cq: cq.clone(),
            },
        };
        let srqn = match ctx.device().alloc_qpn() {
            Ok(n) => n,
            Err(e) => {
                taken.iter().for_each(|u| u.release());
                ctx.device().release(Resource::Srq);
                return Err(e);
            }
        };
        let actual = SrqAttr {
            max_wr: round_depth(attr.max_wr).min(limits.max_srq_wr),
            max_sge: attr.max_sge.max(1),
            srq_limit: 0,
        };
        let (tm, tm_state) = tm.unzip();
        let srq = Arc::new_cyclic(|me| Self {
            me: me.clone(),
            pd: pd.clone(),
            kind,
            srqn,
            handle: ctx.next_handle(),
            inner: Mutex::new(SrqInner {
                attr: actual,
                queue: VecDeque::new(),
                tm: tm_state,
            }),
            tm,
            uses: UseCount::default(),
            async_acks: AckCounter::default(),
            user_data: AtomicU64::new(0),
        });
        if let SrqKind::Xrc { xrcd, .. } = &srq.kind {
            xrcd.domain().add_srq(srqn, &srq);
            xrc_relay::export(ctx.device(), xrcd.domain());
        }
        Ok(srq)
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// The kind of SRQ.
    pub fn kind(&self) -> &SrqKind {
        &self.kind
    }

    /// Whether this is an XRC SRQ.
    pub fn is_xrc(&self) -> bool {
        matches!(self.kind, SrqKind::Xrc { .. })
    }

    /// The CQ of an XRC SRQ.
    pub fn xrc_cq(&self) -> Option<&Arc<Cq>> {
        match &self.kind {
            SrqKind::Xrc { cq, .. } => Some(cq),
            SrqKind::Basic => None,
        }
    }

    /// The XRC domain handle of an XRC SRQ.
    pub fn xrcd(&self) -> Option<&Arc<Xrcd>> {
        match &self.kind {
            SrqKind::Xrc { xrcd, .. } => Some(xrcd),
            SrqKind::Basic => None,
        }
    }

    /// `ibv_get_srq_num`: the 24-bit SRQ number (XRC initiators address XRC SRQs by it).
    pub fn srq_num(&self) -> u32 {
        self.srqn
    }

    /// Handle (`ibv_srq.handle`).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// A value the front end may associate with the SRQ (e.g. `srq_context`).
    pub fn user_data(&self) -> u64 {
        self.user_data.load(Ordering::Relaxed)
    }

    /// Sets [`Srq::user_data`].
    pub fn set_user_data(&self, v: u64) {
        self.user_data.store(v, Ordering::Relaxed);
    }

    pub(crate) fn async_acks(&self) -> &AckCounter {
        &self.async_acks
    }

    /// `ibv_query_srq`. A `srq_limit` of 0 means the limit event is not armed.
    pub fn query(&self) -> SrqAttr {
        self.inner.lock().attr
    }

    /// Posted WRs not yet consumed.
    pub fn len(&self) -> usize {
        self.inner.lock().queue.len()
    }

    /// Whether no WR is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `ibv_modify_srq`: resizes (`IBV_SRQ_MAX_WR`) and/or arms the limit (`IBV_SRQ_LIMIT`). If
    /// any value is invalid nothing changes.
    pub fn modify(&self, attr: &SrqAttr, mask: u32) -> Result<()> {
        let Some(mask) = SrqAttrMask::from_bits(mask) else {
            return Err(Error::invalid(format!(
                "srq_attr_mask {mask:#x} has unknown bits"
            )));
        };
        let limits = *self.pd.context().device().limits();
        let mut inner = self.inner.lock();
        let mut new = inner.attr;
        if mask.contains(SrqAttrMask::MAX_WR) {
            debug_assert!(self.pd.context().device().attr().device_cap_flags & cap_flags::SRQ_RESIZE != 0);
            if attr.max_wr == 0 || attr.max_wr > limits.max_srq_wr {
                return Err(Error::invalid(format!(
                    "max_wr {} is outside 1..={}",
                    attr.max_wr, limits.max_srq_wr
                )));
            }
            if (attr.max_wr as usize) < inner.queue.len() {
                return Err(Error::invalid(format!(
                    "max_wr {} is below the {} WRs posted",
                    attr.max_wr,
                    inner.queue.len()
                )));
            }
            new.max_wr = round_depth(attr.max_wr).min(limits.max_srq_wr);
        }
        if mask.contains(SrqAttrMask::LIMIT) {
            if attr.srq_limit > new.max_wr {
                return Err(Error::invalid(format!(
                    "srq_limit {} exceeds max_wr {}",
                    attr.srq_limit, new.max_wr
                )));
            }
            new.srq_limit = attr.srq_limit;
        }
        inner.attr = new;
        Ok(())
    }

    /// `ibv_post_srq_recv`: queues WRs in order, stopping at the first that cannot be posted.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        let mut inner = self.inner.lock();
        for (index, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > inner.attr.max_sge as usize {
                return Err(PostError {
                    index,
                    error: Error::invalid(format!(
                        "num_sge {} exceeds max_sge {}",
                        wr.sg_list.len(),
                        inner.attr.max_sge
                    )),
                });
            }
            if inner.queue.len() >= inner.attr.max_wr as usize {
                return Err(PostError {
                    index,
                    error: Error::no_resources(format!("the SRQ is full ({} WRs)", inner.attr.max_wr)),
                });
            }
            inner.queue.push_back(wr.clone());
        }
        Ok(())
    }

    /// Takes the oldest posted WR for an incoming message. When that leaves fewer WRs than an
    /// armed limit, raises `IBV_EVENT_SRQ_LIMIT_REACHED` once and disarms the limit.
    pub fn take(&self) -> Option<RecvWr> {
        self.with_queue(|queue, _| queue.pop_front())
    }

    pub(crate) fn tm_shared(&self) -> Option<&TmShared> {
        self.tm.as_ref()
    }

    /// Runs `f` on the posted WRs and the tag-matching state under the SRQ's lock. When `f`
    /// takes WRs and leaves fewer than an armed limit, raises `IBV_EVENT_SRQ_LIMIT_REACHED`
    /// once and disarms the limit.
    pub(crate) fn with_queue<R>(
        &self,
        f: impl FnOnce(&mut VecDeque<RecvWr>, Option<&mut TmState>) -> R,
    ) -> R {
        let mut inner = self.inner.lock();
        let before = inner.queue.len();
        let SrqInner { queue, tm, .. } = &mut *inner;
        let r = f(queue, tm.as_mut());
        let limit = inner.attr.srq_limit;
        if inner.queue.len() < before && limit > 0 && (inner.queue.len() as u32) < limit {
            inner.attr.srq_limit = 0;
            drop(inner);
            if let Some(me) = self.me.upgrade() {
                self.pd
                    .context()
                    .raise(EventElement::Srq(me), EventType::SrqLimitReached);
            }
        }
        r
    }

    /// Returns a WQE taken for a message that was abandoned; it is the next one used.
    pub fn put_back(&self, wr: RecvWr) {
        self.inner.lock().queue.push_front(wr);
    }

    fn teardown(&self) {
        let device = self.pd.context().device();
        if let SrqKind::Xrc { xrcd, cq } = &self.kind {
            xrcd.domain().remove_srq(self.srqn);
            cq.uses().release();
            xrcd.uses().release();
        }
        device.free_qpn(self.srqn);
        device.release(Resource::Srq);
        self.pd.uses().release();
        if let Some(cq) = self.tm_cq() {
            cq.uses().release();
        }
    }

    /// `ibv_destroy_srq`: EBUSY while a QP uses the SRQ.
    pub fn destroy(&self) -> Result<()> {
        self.uses.retire("shared receive queue")?;
        self.pd.context().forget_events(
            |e| matches!(&e.element, EventElement::Srq(s) if std::ptr::eq(Arc::as_ptr(s), self)),
        );
        self.async_acks.wait_all_acked();
        self.teardown();
        Ok(())
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.teardown();
        }
    }
}

/// How the fabric reaches a QP.
impl Endpoint for Qp {
    fn number(&self) -> u32 {
        self.qpn
    }

    fn receive_packet(
        &self,
        now: Instant,
        pkt: &ParsedPacket<'_>,
        ext: Option<&dyn ExternalPayload>,
        meta: &RxMeta,
        pending: &Pending,
        more: bool,
    ) -> Received {
        let (out, dropped, ack_held) = self.handle_packet(now, pkt, ext, meta, pending, more);
        let (txs, ticket) = out.map_or((Vec::new(), None), |o| (o.txs, Some(o.ticket)));
        Received {
            txs,
            ticket,
            dropped,
            ack_held,
        }
    }

    fn end_batch(&self, now: Instant) -> (Vec<Transmit>, u64) {
        let mut inner = self.inner.lock();
        let now = inner.clock(now);
        inner.engine.release_acks();
        let out = self.drain(&mut inner, now);
        (out.txs, out.ticket)
    }

    fn release_ticket(&self, ticket: u64) {
        self.release(ticket);
    }

    fn fail_ticket(&self, ticket: u64) {
        self.fail_copies(ticket);
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.deadline()
    }

    fn on_timeout(&self, now: Instant) {
        let out = self.handle_timeout(now);
        self.send_then_release(out, false);
    }

    type Steering = crate::flow::UdFlows;

    fn steer(
        steering: &Self::Steering,
        pkt: &ParsedPacket<'_>,
        meta: &RxMeta,
        ports: (u16, u16),
        len: usize,
        targets: &mut Vec<Arc<Self>>,
    ) {
        steering.steer(pkt, meta, ports, len, targets);
    }
}

/// Logs a completion in error: at debug level, flushes (which every WR of a QP in the error
/// state gets) at trace level.
fn log_error_completion(qpn: u32, wc: &WorkCompletion) {
    match wc.status {
        WcStatus::Success => {}
        WcStatus::WrFlushErr => tracing::trace!(qpn, wr_id = wc.wr_id, "work request flushed"),
        status => tracing::debug!(qpn, wr_id = wc.wr_id, ?status, opcode = ?wc.opcode, "error completion"),
    }
}
