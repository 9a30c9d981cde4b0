//! The RDMA connection manager (`librdmacm`): event channels, CM ids and their events.
//!
//! A [`CmId`] is what `rdma_create_id` returns: resolve an address and a route, then connect,
//! or bind and listen. Results and the peer's actions arrive as [`CmEvent`]s on an
//! [`EventChannel`] in the order `rdma_cm(7)` gives; an event is acknowledged when dropped,
//! and because it holds the ids it is about, an id cannot be destroyed while its events are
//! held. [`CmId::create_qp`] makes the id's QP and moves it through the states as librdmacm
//! does, so a connected QP is ready to use when ESTABLISHED arrives.
//!
//! ```
//! use std::net::{Ipv4Addr, SocketAddr};
//! use std::time::Duration;
//! use softverbs::cm::{CmEventType, CmId, ConnParam, EventChannel, PortSpace};
//! use softverbs::{QpInit, QpType};
//!
//! let t = Some(Duration::from_secs(10));
//! let ch = EventChannel::new()?;
//! let server = CmId::new(Some(&ch), PortSpace::Tcp)?;
//! server.bind_addr(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
//! server.listen(8)?;
//! let port = server.src_addr().unwrap().port();
//!
//! let client = CmId::new(Some(&ch), PortSpace::Tcp)?;
//! client.resolve_addr(None, SocketAddr::from((Ipv4Addr::LOCALHOST, port)), 2000)?;
//! assert_eq!(ch.get_event_timeout(t)?.event_type(), CmEventType::AddrResolved);
//! client.resolve_route(2000)?;
//! assert_eq!(ch.get_event_timeout(t)?.event_type(), CmEventType::RouteResolved);
//! let ctx = client.context()?;
//! let (pd, cq) = (ctx.alloc_pd()?, ctx.create_cq(16, None, 0)?);
//! client.create_qp(&pd, &QpInit::new(QpType::Rc, &cq))?;
//! client.connect(&ConnParam::default())?;
//!
//! let request = ch.get_event_timeout(t)?;
//! assert_eq!(request.event_type(), CmEventType::ConnectRequest);
//! let conn = request.id().clone();
//! drop(request);
//! conn.create_qp(&pd, &QpInit::new(QpType::Rc, &cq))?;
//! conn.accept(&ConnParam::default())?;
//! let mut established = 0;
//! while established < 2 {
//!     let ev = ch.get_event_timeout(t)?;
//!     assert_eq!(ev.event_type(), CmEventType::Established);
//!     established += 1;
//! }
//! assert_eq!(client.qp().unwrap().state(), softverbs::QpState::Rts);
//! # Ok::<(), softverbs::Error>(())
//! ```

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use softverbs_device as core;
use softverbs_device::cm as ccm;
use softverbs_engine::types::{QpAttr, QpAttrMask, QpState};
use softverbs_engine::{Error, Result};

pub use softverbs_device::cm::{
    live_ids, source_for, CmEventType, CmStats, ConnParam, Ece, EventParam, PortSpace, UdParam, RDMA_UDP_QKEY,
};

use crate::context::Context;
use crate::pd::ProtectionDomain;
use crate::qp::{QpInit, QueuePair};

/// `rdma_create_event_channel`: where the events of the ids created on it arrive. Its file
/// descriptor is readable exactly while an event is pending; with O_NONBLOCK set on it,
/// [`EventChannel::get_event`] gives EAGAIN instead of waiting.
#[derive(Debug, Clone)]
pub struct EventChannel(Arc<ccm::EventChannel>);

impl EventChannel {
    /// A new channel.
    pub fn new() -> Result<Self> {
        Ok(Self(ccm::EventChannel::new()?))
    }

    /// `rdma_get_cm_event`: waits for the next event.
    pub fn get_event(&self) -> Result<CmEvent> {
        self.get_event_timeout(None)
    }

    /// The next event, waiting at most `timeout` (EAGAIN when it passes).
    pub fn get_event_timeout(&self, timeout: Option<Duration>) -> Result<CmEvent> {
        let ev = self.0.get_event(timeout)?;
        let id = CmId::wrap(&ev.id, None);
        let listen_id = ev.listen_id.as_ref().map(|l| CmId::wrap(l, None));
        Ok(CmEvent {
            core: ev,
            id,
            listen_id,
        })
    }

    /// Events waiting.
    pub fn pending(&self) -> usize {
        self.0.pending()
    }
}

impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// An event (`struct rdma_cm_event`), acknowledged when dropped.
#[derive(Debug)]
pub struct CmEvent {
    core: ccm::CmEvent,
    id: CmId,
    listen_id: Option<CmId>,
}

impl CmEvent {
    /// The event.
    pub fn event_type(&self) -> CmEventType {
        self.core.event
    }

    /// Status: 0, a REJ reason (REJECTED), a SIDR status, or `-errno`.
    pub fn status(&self) -> i32 {
        self.core.status
    }

    /// The id the event is about; for CONNECT_REQUEST the new id, to accept or reject.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// The listening id, for CONNECT_REQUEST.
    pub fn listen_id(&self) -> Option<&CmId> {
        self.listen_id.as_ref()
    }

    /// The parameters.
    pub fn param(&self) -> &EventParam {
        &self.core.param
    }

    /// The connection parameters, for connected ids' events that carry them.
    pub fn conn(&self) -> Option<&ConnParam> {
        match &self.core.param {
            EventParam::Conn(c) => Some(c),
            _ => None,
        }
    }

    /// The UD parameters (SIDR and multicast events).
    pub fn ud(&self) -> Option<&UdParam> {
        match &self.core.param {
            EventParam::Ud(u) => Some(u),
            _ => None,
        }
    }
}

impl Drop for CmEvent {
    fn drop(&mut self) {
        self.core.ack();
    }
}

#[derive(Debug)]
struct IdInner {
    core: Arc<ccm::CmId>,
    qp: Mutex<Option<QueuePair>>,
}

impl Drop for IdInner {
    fn drop(&mut self) {
        let key = Arc::as_ptr(&self.core) as usize;
        let mut h = handles().lock();
        // A new handle may have been made for the core id since this one died.
        if h.get(&key).is_some_and(|w| w.strong_count() == 0) {
            h.remove(&key);
        }
        drop(h);
        self.core.detach_qp();
        self.core.destroy();
    }
}

/// The safe handle of each live core id, so an event hands back the caller's own handle.
fn handles() -> &'static Mutex<HashMap<usize, Weak<IdInner>>> {
    static H: std::sync::OnceLock<Mutex<HashMap<usize, Weak<IdInner>>>> = std::sync::OnceLock::new();
    H.get_or_init(Default::default)
}

/// One verbs context per device for the ids of this process, as librdmacm keeps them.
fn context_of(device: &core::Device) -> Result<Context> {
    static C: std::sync::OnceLock<Mutex<HashMap<String, Context>>> = std::sync::OnceLock::new();
    let mut map = C.get_or_init(Default::default).lock();
    if let Some(c) = map.get(device.name()) {
        return Ok(c.clone());
    }
    let ctx = Context::open(device)?;
    map.insert(device.name().to_string(), ctx.clone());
    Ok(ctx)
}

/// An RDMA CM id (`rdma_create_id`). Cheap to clone; destroyed (`rdma_destroy_id`) with its
/// last handle, which the events about it hold too.
#[derive(Debug, Clone)]
pub struct CmId(Arc<IdInner>);

impl CmId {
    /// An id in `ps` reporting to `channel`; with `None` the id is synchronous: each call
    /// waits for its own result and fails if it is a failure event.
    pub fn new(channel: Option<&EventChannel>, ps: PortSpace) -> Result<Self> {
        let core = ccm::CmId::create(channel.map(|c| &c.0), ps)?;
        Ok(Self::wrap(&core, None))
    }

    fn wrap(core: &Arc<ccm::CmId>, qp: Option<QueuePair>) -> Self {
        let key = Arc::as_ptr(core) as usize;
        let mut h = handles().lock();
        if let Some(inner) = h.get(&key).and_then(Weak::upgrade) {
            return Self(inner);
        }
        let inner = Arc::new(IdInner {
            core: core.clone(),
            qp: Mutex::new(qp),
        });
        h.insert(key, Arc::downgrade(&inner));
        Self(inner)
    }

    /// The core id.
    pub fn core(&self) -> &Arc<ccm::CmId> {
        &self.0.core
    }

    /// Whether two handles name the same id.
    pub fn same_as(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// `rdma_bind_addr`.
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<()> {
        self.0.core.bind_addr(addr)
    }

    /// `rdma_resolve_addr`: ADDR_RESOLVED or ADDR_ERROR follows.
    pub fn resolve_addr(&self, src: Option<SocketAddr>, dst: SocketAddr, timeout_ms: u32) -> Result<()> {
        self.0.core.resolve_addr(src, dst, timeout_ms)
    }

    /// `rdma_resolve_route`: ROUTE_RESOLVED follows.
    pub fn resolve_route(&self, timeout_ms: u32) -> Result<()> {
        self.0.core.resolve_route(timeout_ms)
    }

    /// `rdma_listen`.
    pub fn listen(&self, backlog: i32) -> Result<()> {
        self.0.core.listen(backlog)
    }

    /// `rdma_get_request` (synchronous listeners).
    pub fn get_request(&self) -> Result<Self> {
        let core = self.0.core.get_request()?;
        Ok(Self::wrap(&core, None))
    }

    /// `rdma_connect`.
    pub fn connect(&self, param: &ConnParam) -> Result<()> {
        self.0.core.connect(param)
    }

    /// `rdma_accept`.
    pub fn accept(&self, param: &ConnParam) -> Result<()> {
        self.0.core.accept(param)
    }

    /// `rdma_reject` (REJ reason 28, or SIDR status REJECT).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        self.0.core.reject(private_data)
    }

    /// `rdma_reject_ece`: a rejection saying the ECE values offered are not supported
    /// (reason 35).
    pub fn reject_ece(&self, private_data: &[u8]) -> Result<()> {
        self.0.core.reject_ece(private_data)
    }

    /// `rdma_set_local_ece`: the ECE values the next REQ or REP carries.
    pub fn set_local_ece(&self, ece: Ece) {
        self.0.core.set_local_ece(ece);
    }

    /// `rdma_get_remote_ece`: the peer's ECE values (zero until its REQ or REP arrived).
    pub fn remote_ece(&self) -> Ece {
        self.0.core.remote_ece()
    }

    /// `rdma_establish` after CONNECT_RESPONSE.
    pub fn establish(&self) -> Result<()> {
        self.0.core.establish()
    }

    /// `rdma_notify(IBV_EVENT_COMM_EST)`.
    pub fn notify_established(&self) -> Result<()> {
        self.0.core.notify_established()
    }

    /// `rdma_disconnect`.
    pub fn disconnect(&self) -> Result<()> {
        self.0.core.disconnect()
    }

    /// `rdma_join_multicast` (UD ids): MULTICAST_JOIN follows; the QP joins when it is read.
    pub fn join_multicast(&self, group: IpAddr) -> Result<()> {
        self.0.core.join_multicast(group)
    }

    /// `rdma_join_multicast_ex`: with `send_only`, the QP is not attached (it sends to the
    /// group and receives nothing from it).
    pub fn join_multicast_ex(&self, group: IpAddr, send_only: bool) -> Result<()> {
        self.0.core.join_multicast_ex(group, send_only)
    }

    /// `rdma_leave_multicast`.
    pub fn leave_multicast(&self, group: IpAddr) -> Result<()> {
        self.0.core.leave_multicast(group)
    }

    /// `rdma_migrate_id`: reports to `channel` from now on (`None`: synchronous). Waits until the
    /// events already taken from the old channel were acknowledged (dropped); pending ones move.
    pub fn migrate(&self, channel: Option<&EventChannel>) -> Result<()> {
        self.0.core.migrate(channel.map(|c| &c.0))
    }

    /// `rdma_set_option(RDMA_OPTION_ID_TOS)`.
    pub fn set_tos(&self, tos: u8) {
        self.0.core.set_tos(tos);
    }

    /// `rdma_set_option(RDMA_OPTION_ID_ACK_TIMEOUT)`.
    pub fn set_ack_timeout(&self, timeout: u8) {
        self.0.core.set_ack_timeout(timeout);
    }

    /// `rdma_init_qp_attr`.
    pub fn init_qp_attr(&self, state: QpState) -> Result<(QpAttr, QpAttrMask)> {
        self.0.core.init_qp_attr(state)
    }

    /// The local address.
    pub fn src_addr(&self) -> Option<SocketAddr> {
        self.0.core.src_addr()
    }

    /// The peer's address.
    pub fn dst_addr(&self) -> Option<SocketAddr> {
        self.0.core.dst_addr()
    }

    /// The port space.
    pub fn port_space(&self) -> PortSpace {
        self.0.core.port_space()
    }

    /// The source GID index (`id->route.addr` on the port).
    pub fn sgid_index(&self) -> u8 {
        self.0.core.sgid_index()
    }

    /// The verbs context of the id's device (`id->verbs`), shared by every id on it.
    pub fn context(&self) -> Result<Context> {
        let dev = self
            .0
            .core
            .device()
            .ok_or_else(|| Error::invalid("the id is not bound to a device"))?;
        context_of(&dev)
    }

    /// `rdma_create_qp`: a QP on the id's device in `pd`, moved as librdmacm does (INIT for
    /// connected QPs; RTS for UD).
    pub fn create_qp(&self, pd: &ProtectionDomain, init: &QpInit<'_>) -> Result<QueuePair> {
        let qp = pd.create_qp(init)?;
        self.0.core.attach_qp(qp.core())?;
        *self.0.qp.lock() = Some(qp.clone());
        Ok(qp)
    }

    /// `rdma_destroy_qp`: the id forgets its QP (destroyed with its last handle).
    pub fn destroy_qp(&self) {
        self.0.core.detach_qp();
        self.0.qp.lock().take();
    }

    /// The id's QP.
    pub fn qp(&self) -> Option<QueuePair> {
        self.0.qp.lock().clone()
    }

    /// (delivered, acknowledged) events counted against the id.
    pub fn event_counts(&self) -> (u64, u64) {
        self.0.core.event_counts()
    }
}

/// `(engine entries, registered ids)` of `ctx`'s device CM: zero once every connection was
/// torn down and its timewait ended.
pub fn cm_entries(ctx: &Context) -> Result<(usize, usize)> {
    ccm::live_entries(ctx.core().device())
}

/// What `ctx`'s device CM dropped, answered from a stored reply and resent after a timeout:
/// resends show the CM recovering lost MADs.
pub fn cm_stats(ctx: &Context) -> Result<CmStats> {
    ccm::stats(ctx.core().device())
}
