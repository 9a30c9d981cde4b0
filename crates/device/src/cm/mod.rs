//! The RDMA connection manager (`rdma_cm(7)` semantics) on the device: event channels, CM ids,
//! address and route resolution, the QP transitions librdmacm performs, and QP1 on the fabric.
//!
//! Each device port gets a [`CmEngine`](softverbs_engine::cm::CmEngine) (the IB CM protocol,
//! sans-IO) behind QP1 (module `port`): MADs addressed to QP1 reach it from the fabric, the MADs it
//! emits leave as UD SEND ONLY packets from QP1, and the progress thread runs its timers. Its
//! events are turned here into `rdma_cm` events on the ids' channels, with the QP transitions
//! librdmacm performs (passive accept: RTR and RTS before the REP; active: RTR and RTS on the
//! REP, then the RTU; REJECTED moves the QP to ERR; DISCONNECTED leaves it alone).
//!
//! Several processes of one host share its addresses. A MAD for a peer on this host goes to QP1
//! of the right process (QPN `slot << 16 | 1`): replies by the slot in the top byte of the
//! communication or SIDR request ID it names (`CmConfig::id_tag`), requests by a per-host
//! registry of listeners (a locked file per service ID, module `registry`). MADs from other
//! hosts arrive at QP1 of the process holding the standard RoCE port.

mod addrinfo;
mod port;
mod registry;

pub use addrinfo::{eai, getaddrinfo, rai, AddrHints, AddrInfo, AF_INET, AF_INET6};

pub(crate) use port::forward_slot;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use softverbs_engine::cm::{
    AcceptParams, CmEvent as EngineEvent, CommId, ConnectParams, SidrId, SidrReplyParams,
};
pub use softverbs_engine::cm::{CmStats, Ece};
use softverbs_engine::time::Instant;
use softverbs_engine::types::{
    AccessFlags, AhAttr, Gid, GlobalRoute, Mtu, QpAttr, QpAttrMask, QpState, QpType,
};
use softverbs_engine::{Error, Result};
use softverbs_wire::cm::{
    private_data_len, rej_reason, service_id, sidr_status, CmPathRepr, CmaHeaderPacket, CmaHeaderRepr,
    CMA_HEADER_LEN,
};
pub use softverbs_wire::cm::{PortSpace, RDMA_UDP_QKEY};

use crate::device::{device_list, Device};
use crate::qp::Qp;
use crate::sync::{AckCounter, EventQueue};

use port::{CmPort, PortInner};

/// `enum rdma_cm_event_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(missing_docs)] // the names of rdma_cm(7)
pub enum CmEventType {
    AddrResolved = 0,
    AddrError = 1,
    RouteResolved = 2,
    RouteError = 3,
    ConnectRequest = 4,
    ConnectResponse = 5,
    ConnectError = 6,
    Unreachable = 7,
    Rejected = 8,
    Established = 9,
    Disconnected = 10,
    DeviceRemoval = 11,
    MulticastJoin = 12,
    MulticastError = 13,
    AddrChange = 14,
    TimewaitExit = 15,
}

/// `struct rdma_conn_param`, as passed to connect and accept and as events report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnParam {
    /// Private data (events: the whole message area, zero-padded).
    pub private_data: Vec<u8>,
    /// This side's `max_dest_rd_atomic`; 0xFF: the device maximum.
    pub responder_resources: u8,
    /// This side's `max_rd_atomic`; 0xFF: the device maximum.
    pub initiator_depth: u8,
    /// End-to-end flow control (passed through).
    pub flow_control: u8,
    /// Transport retry count (3 bits; ignored on accept).
    pub retry_count: u8,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// Whether the QP uses an SRQ (only when the id has no QP).
    pub srq: u8,
    /// The QP number (only when the id has no QP; events: the peer's).
    pub qp_num: u32,
}

impl Default for ConnParam {
    /// What `rdma_connect` uses for a NULL `conn_param`: retries 7/7, no RDMA reads.
    fn default() -> Self {
        Self {
            private_data: Vec::new(),
            responder_resources: 0,
            initiator_depth: 0,
            flow_control: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: 0,
            qp_num: 0,
        }
    }
}

/// `struct rdma_ud_param`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UdParam {
    /// Private data (the whole message area, zero-padded).
    pub private_data: Vec<u8>,
    /// Address vector of the peer or group.
    pub ah_attr: AhAttr,
    /// The peer's QP number (0xFFFFFF for a group).
    pub qp_num: u32,
    /// The Q_Key to use.
    pub qkey: u32,
}

/// An event's parameters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum EventParam {
    /// None.
    #[default]
    None,
    /// Connected ids.
    Conn(ConnParam),
    /// UD ids and multicast.
    Ud(UdParam),
}

/// `struct rdma_cm_event`. Every event taken from a channel must be acknowledged
/// ([`CmEvent::ack`]) before the id it counts against can be destroyed.
#[derive(Debug, Clone)]
pub struct CmEvent {
    /// The id the event is about (for CONNECT_REQUEST: the new id).
    pub id: Arc<CmId>,
    /// The listening id, for CONNECT_REQUEST.
    pub listen_id: Option<Arc<CmId>>,
    /// The event.
    pub event: CmEventType,
    /// Status: 0, a REJ reason, a SIDR status or `-errno`.
    pub status: i32,
    /// Parameters.
    pub param: EventParam,
}

impl CmEvent {
    /// The id whose destruction waits for this event's acknowledgement (the listener for
    /// CONNECT_REQUEST, as librdmacm counts it).
    fn owner(&self) -> &Arc<CmId> {
        self.listen_id.as_ref().unwrap_or(&self.id)
    }

    /// `rdma_ack_cm_event`.
    pub fn ack(&self) {
        self.owner().acks.ack(1);
    }
}

/// `struct rdma_event_channel`: a queue of events with a file descriptor that is readable
/// exactly while an event is pending (O_NONBLOCK on it makes reads non-blocking).
#[derive(Debug)]
pub struct EventChannel {
    queue: EventQueue<CmEvent>,
}

impl EventChannel {
    /// `rdma_create_event_channel`.
    pub fn new() -> Result<Arc<Self>> {
        Ok(Arc::new(Self {
            queue: EventQueue::new()?,
        }))
    }

    /// The file descriptor.
    pub fn fd(&self) -> RawFd {
        self.queue.raw_fd()
    }

    /// The file descriptor, borrowed.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.queue.as_fd()
    }

    /// Events waiting.
    pub fn pending(&self) -> usize {
        self.queue.len()
    }

    /// `rdma_get_cm_event`: the next event, waiting up to `timeout` (`None`: forever; EAGAIN
    /// when it passes or the fd is non-blocking). A MULTICAST_JOIN attaches the id's QP to the
    /// group now, as librdmacm does when the event is read.
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<CmEvent> {
        let ev = self.queue.pop(timeout)?;
        ev.owner().acks.delivered();
        if ev.event == CmEventType::MulticastJoin {
            if let EventParam::Ud(ud) = &ev.param {
                let st = ev.id.state.lock();
                // Send-only members are not attached (`rdma_join_multicast_ex` join flag 1).
                let qp = st
                    .qp
                    .clone()
                    .filter(|_| !st.send_only.contains(&ud.ah_attr.grh.dgid));
                drop(st);
                if let Some(qp) = qp {
                    let _ = qp.attach_mcast(&ud.ah_attr.grh.dgid, 0);
                }
            }
        }
        Ok(ev)
    }

    fn push(&self, ev: CmEvent) {
        self.queue.push(ev);
    }
}

/// Where an id is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    AddrResolved,
    RouteResolved,
    Listening,
    /// REQ or SIDR_REQ sent.
    Connecting,
    /// CONNECT_REQUEST reported, not yet answered.
    Requested,
    /// REP sent.
    Accepted,
    /// CONNECT_RESPONSE reported (the id has no QP): waiting for `establish`.
    Responded,
    Connected,
    Disconnected,
    Failed,
    Destroyed,
}

/// An id's mutable state.
#[derive(Debug)]
struct IdState {
    phase: Phase,
    src: Option<SocketAddr>,
    dst: Option<SocketAddr>,
    device: Option<Device>,
    port: Option<Arc<CmPort>>,
    sgid_index: u8,
    qp: Option<Arc<Qp>>,
    conn: Option<CommId>,
    sidr: Option<SidrId>,
    listening: Option<(u64, registry::Listening)>,
    /// Passive side: the request being answered.
    req: Option<Box<softverbs_wire::cm::ReqRepr>>,
    /// Active side: what the REQ asked for.
    offered: Option<ConnectParams>,
    /// Active side: the REP, for the ESTABLISHED event.
    rep: Option<Box<softverbs_wire::cm::RepRepr>>,
    tos: u8,
    ack_timeout: Option<u8>,
    mcast: Vec<Gid>,
    /// Of those, the groups joined send-only.
    send_only: Vec<Gid>,
    link: Link,
    /// The ports a listener listens on (every device's for the wildcard address).
    ports: Vec<Arc<CmPort>>,
    /// ECE values this side offers or answers with (`rdma_set_local_ece`).
    local_ece: Ece,
    /// The peer's ECE values, from its REQ or REP.
    remote_ece: Ece,
}

/// `struct rdma_cm_id`.
#[derive(Debug)]
pub struct CmId {
    me: Weak<Self>,
    /// The channel and whether it is the id's private one (a synchronous id).
    channel: Mutex<(Arc<EventChannel>, bool)>,
    ps: PortSpace,
    qp_type: QpType,
    acks: AckCounter,
    state: Mutex<IdState>,
}

/// CM ids alive in this process.
static LIVE_IDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many CM ids are alive in this process (leak checks).
pub fn live_ids() -> usize {
    LIVE_IDS.load(std::sync::atomic::Ordering::Relaxed)
}

impl Drop for CmId {
    fn drop(&mut self) {
        LIVE_IDS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The ACK timeout the CM puts in paths: `max(PLT + 1, ack_delay)` with RoCE's PLT of 16.
const DEFAULT_ACK_TIMEOUT: u8 = 17;
/// Ephemeral ports, as Linux's default range.
const EPHEMERAL: std::ops::RangeInclusive<u16> = 32768..=60999;

fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    let _ = getrandom::getrandom(&mut b);
    u32::from_ne_bytes(b)
}

fn os_err(errno: i32) -> Error {
    Error::Io(std::io::Error::from_raw_os_error(errno))
}

fn cm_err(e: softverbs_engine::cm::CmError) -> Error {
    os_err(e.errno())
}

/// The softverbs device, port 1 and GID index that own `ip`.
pub fn device_of(ip: IpAddr) -> Result<(Device, u8)> {
    let gid = Gid::from_ip(ip);
    for d in device_list()? {
        if let Some(i) = d.gid_table().iter().position(|g| *g == gid) {
            return Ok((d, i as u8));
        }
    }
    Err(Error::NoDevice(
        format!("no softverbs device has the address {ip}").into(),
    ))
}

/// Whether a bound address stands for every device: the wildcard, and (as the kernel's
/// `rdma_cm` treats them) loopback addresses. Binding to one attaches no device, and a listener
/// bound to one takes requests for any address. Address resolution from a loopback source
/// still finds the loopback device (`sv_lo`).
pub fn any_addr(ip: IpAddr) -> bool {
    ip.is_unspecified() || ip.is_loopback()
}

/// The source address the kernel would use towards `dst` (a connected UDP socket's local
/// address); `-errno` on failure.
pub fn source_for(dst: IpAddr) -> std::result::Result<IpAddr, i32> {
    let bind: SocketAddr = match dst {
        IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let s = UdpSocket::bind(bind).map_err(|e| -e.raw_os_error().unwrap_or(22))?;
    s.connect((dst, 9))
        .map_err(|e| -e.raw_os_error().unwrap_or(101))?;
    s.local_addr()
        .map(|a| a.ip())
        .map_err(|e| -e.raw_os_error().unwrap_or(22))
}

impl CmId {
    /// `rdma_create_id`: an id in `ps` reporting to `channel`, or synchronous (its calls block
    /// until their result) with no channel.
    pub fn create(channel: Option<&Arc<EventChannel>>, ps: PortSpace) -> Result<Arc<Self>> {
        let qp_type = match ps {
            PortSpace::Tcp | PortSpace::Ib => QpType::Rc,
            PortSpace::Udp | PortSpace::Ipoib => QpType::Ud,
        };
        Self::build(channel.cloned(), ps, qp_type)
    }

    fn build(channel: Option<Arc<EventChannel>>, ps: PortSpace, qp_type: QpType) -> Result<Arc<Self>> {
        let sync = channel.is_none();
        LIVE_IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let channel = match channel {
            Some(c) => c,
            None => EventChannel::new()?,
        };
        Ok(Arc::new_cyclic(|me| Self {
            me: me.clone(),
            channel: Mutex::new((channel, sync)),
            ps,
            qp_type,
            acks: AckCounter::default(),
            state: Mutex::new(IdState {
                phase: Phase::Idle,
                src: None,
                dst: None,
                device: None,
                port: None,
                sgid_index: 0,
                qp: None,
                conn: None,
                sidr: None,
                listening: None,
                req: None,
                offered: None,
                rep: None,
                tos: 0,
                ack_timeout: None,
                mcast: Vec::new(),
                send_only: Vec::new(),
                ports: Vec::new(),
                link: Link::default(),
                local_ece: Ece::default(),
                remote_ece: Ece::default(),
            }),
        }))
    }

    fn arc(&self) -> Arc<Self> {
        self.me.upgrade().expect("a live id")
    }

    /// The channel events are reported on (a private one for synchronous ids).
    pub fn channel(&self) -> Arc<EventChannel> {
        self.channel.lock().0.clone()
    }

    /// Whether the id is synchronous.
    pub fn is_sync(&self) -> bool {
        self.channel.lock().1
    }

    /// `rdma_migrate_id`: reports to `channel` from now on (`None`: the id becomes synchronous).
    /// Waits until the events already delivered were acknowledged; undelivered ones move along.
    pub fn migrate(&self, channel: Option<&Arc<EventChannel>>) -> Result<()> {
        let new = match channel {
            Some(c) => (c.clone(), false),
            None => (EventChannel::new()?, true),
        };
        self.acks.wait_all_acked();
        let mut ch = self.channel.lock();
        let mut moving = Vec::new();
        ch.0.queue.remove_where(|e| {
            let mine = std::ptr::eq(Arc::as_ptr(e.owner()), self);
            if mine {
                moving.push(e.clone());
            }
            mine
        });
        for e in moving {
            new.0.push(e);
        }
        *ch = new;
        Ok(())
    }

    /// Pushes an event on the id's channel (under the channel lock, so a migration moves it).
    fn push(&self, ev: CmEvent) {
        self.channel.lock().0.push(ev);
    }

    /// The port space.
    pub fn port_space(&self) -> PortSpace {
        self.ps
    }

    /// The QP type of this id.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// The device the id is bound to (after bind to an address, resolution or a request).
    pub fn device(&self) -> Option<Device> {
        self.state.lock().device.clone()
    }

    /// The port number (1 once bound to a device, 0 before).
    pub fn port_num(&self) -> u8 {
        u8::from(self.state.lock().device.is_some())
    }

    /// The local address.
    pub fn src_addr(&self) -> Option<SocketAddr> {
        self.state.lock().src
    }

    /// The peer's address.
    pub fn dst_addr(&self) -> Option<SocketAddr> {
        self.state.lock().dst
    }

    /// The source GID index on the port.
    pub fn sgid_index(&self) -> u8 {
        self.state.lock().sgid_index
    }

    /// The QP made by [`CmId::attach_qp`].
    pub fn qp(&self) -> Option<Arc<Qp>> {
        self.state.lock().qp.clone()
    }

    /// `rdma_set_option(RDMA_OPTION_ID_TOS)`.
    pub fn set_tos(&self, tos: u8) {
        self.state.lock().tos = tos;
    }

    /// `rdma_set_option(RDMA_OPTION_ID_ACK_TIMEOUT)`.
    pub fn set_ack_timeout(&self, timeout: u8) {
        self.state.lock().ack_timeout = Some(timeout & 0x1F);
    }

    fn event(&self, event: CmEventType, status: i32, param: EventParam) {
        self.push(CmEvent {
            id: self.arc(),
            listen_id: None,
            event,
            status,
            param,
        });
    }

    /// Synchronous ids: takes the result of the call just made. Failure events become errors.
    fn complete_sync(&self) -> Result<()> {
        let (ch, sync) = self.channel.lock().clone();
        if !sync {
            return Ok(());
        }
        let ev = ch.get_event(None)?;
        ev.ack();
        if ev.status != 0
            || matches!(
                ev.event,
                CmEventType::AddrError
                    | CmEventType::RouteError
                    | CmEventType::Unreachable
                    | CmEventType::Rejected
                    | CmEventType::ConnectError
            )
        {
            let errno = if ev.status < 0 { -ev.status } else { 111 };
            return Err(os_err(errno));
        }
        Ok(())
    }

    /// `rdma_bind_addr`: binds to a local address (port 0: an ephemeral one when listening).
    /// A specific address binds the id to that address's device; the wildcard and loopback
    /// addresses do not ([`any_addr`]), so `verbs` stays NULL and a listener hears every device.
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<()> {
        let mut st = self.state.lock();
        if st.phase != Phase::Idle || st.src.is_some() {
            return Err(Error::invalid("the id is already bound"));
        }
        if !any_addr(addr.ip()) {
            let (d, idx) = device_of(addr.ip()).map_err(|_| os_err(99))?;
            st.port = Some(CmPort::of(&d)?);
            st.device = Some(d);
            st.sgid_index = idx;
        }
        st.src = Some(addr);
        Ok(())
    }

    /// `rdma_resolve_addr`: finds the device, port and source GID towards `dst` (from `src`
    /// or the kernel's route) and reports ADDR_RESOLVED, or ADDR_ERROR with `-errno`.
    pub fn resolve_addr(&self, src: Option<SocketAddr>, dst: SocketAddr, _timeout_ms: u32) -> Result<()> {
        {
            let mut st = self.state.lock();
            if !matches!(st.phase, Phase::Idle | Phase::AddrResolved) {
                return Err(Error::invalid("the id is in use"));
            }
            let src = src.or(st.src).filter(|s| !s.ip().is_unspecified());
            let result = (|| -> std::result::Result<(Device, u8, IpAddr), i32> {
                let ip = match src {
                    Some(s) => s.ip(),
                    None => source_for(dst.ip())?,
                };
                let (d, idx) = device_of(ip).map_err(|_| -19)?;
                Ok((d, idx, ip))
            })();
            match result {
                Ok((d, idx, ip)) => {
                    let port = src.map_or(0, |s| s.port());
                    let port = if port == 0 {
                        *EPHEMERAL.start()
                            + (random_u32() % u32::from(EPHEMERAL.end() - EPHEMERAL.start())) as u16
                    } else {
                        port
                    };
                    st.port = Some(CmPort::of(&d)?);
                    st.device = Some(d);
                    st.sgid_index = idx;
                    st.src = Some(SocketAddr::new(ip, port));
                    st.dst = Some(dst);
                    st.phase = Phase::AddrResolved;
                    drop(st);
                    self.event(CmEventType::AddrResolved, 0, EventParam::None);
                }
                Err(errno) => {
                    drop(st);
                    self.event(CmEventType::AddrError, errno, EventParam::None);
                }
            }
        }
        self.complete_sync()
    }

    /// `rdma_resolve_route`: on RoCE a local fill-in of the path; reports ROUTE_RESOLVED.
    pub fn resolve_route(&self, _timeout_ms: u32) -> Result<()> {
        {
            let mut st = self.state.lock();
            if st.phase != Phase::AddrResolved {
                return Err(Error::invalid("the address is not resolved"));
            }
            st.phase = Phase::RouteResolved;
        }
        self.event(CmEventType::RouteResolved, 0, EventParam::None);
        self.complete_sync()
    }

    /// The path MTU: the port's active MTU.
    pub fn path_mtu(&self) -> Mtu {
        self.state
            .lock()
            .device
            .as_ref()
            .map_or(Mtu::Mtu1024, |d| d.port_attr().active_mtu)
    }

    /// The address vector towards the peer (after route resolution or a request).
    pub fn ah_attr(&self) -> Result<AhAttr> {
        let st = self.state.lock();
        let dst = st.dst.ok_or_else(|| Error::invalid("no destination"))?;
        Ok(av(&st, Gid::from_ip(dst.ip())))
    }

    /// `rdma_listen`: REQs and SIDR_REQs for the bound port reach this id's channel as
    /// CONNECT_REQUEST events. EADDRINUSE if another id of this host listens on the port.
    pub fn listen(&self, _backlog: i32) -> Result<()> {
        let mut st = self.state.lock();
        if st.phase != Phase::Idle {
            return Err(Error::invalid("the id is in use"));
        }
        let src = st.src.unwrap_or_else(|| (Ipv4Addr::UNSPECIFIED, 0).into());
        let ports: Vec<Arc<CmPort>> = match &st.port {
            Some(p) => vec![p.clone()],
            None => device_list()?
                .iter()
                .map(CmPort::of)
                .collect::<Result<Vec<_>>>()?,
        };
        let first = ports.first().ok_or_else(|| os_err(19))?;
        let (base, slot) = (first.base_port, first.slot);
        let (sid, reg, port) = if src.port() == 0 {
            let mut found = None;
            for _ in 0..64 {
                let p = *EPHEMERAL.start()
                    + (random_u32() % u32::from(EPHEMERAL.end() - EPHEMERAL.start())) as u16;
                let sid = service_id(self.ps, p);
                if let Ok(reg) = registry::listen(base, sid, slot) {
                    found = Some((sid, reg, p));
                    break;
                }
            }
            found.ok_or_else(|| os_err(98))?
        } else {
            let sid = service_id(self.ps, src.port());
            (sid, registry::listen(base, sid, slot)?, src.port())
        };
        let me = self.me.clone();
        for p in &ports {
            let r = p.with(|inner, _| {
                inner.engine.listen(sid).map_err(cm_err)?;
                inner.listeners.insert(sid, me.clone());
                Ok::<(), Error>(())
            });
            if let Err(e) = r {
                for q in &ports {
                    q.with(|inner, _| {
                        if inner.listeners.get(&sid).is_some_and(|w| w.ptr_eq(&me)) {
                            inner.listeners.remove(&sid);
                            let _ = inner.engine.unlisten(sid);
                        }
                    });
                }
                return Err(e);
            }
        }
        st.src = Some(SocketAddr::new(src.ip(), port));
        st.listening = Some((sid, reg));
        if st.port.is_none() {
            st.port = Some(first.clone());
        }
        st.phase = Phase::Listening;
        st.ports = ports;
        Ok(())
    }

    /// `rdma_get_request` for synchronous listeners: waits for the next CONNECT_REQUEST and
    /// returns its new id.
    pub fn get_request(&self) -> Result<Arc<Self>> {
        loop {
            let ev = self.channel().get_event(None)?;
            ev.ack();
            if ev.event == CmEventType::ConnectRequest {
                return Ok(ev.id);
            }
        }
    }
}

/// What both sides agreed on for the QP transitions.
#[derive(Debug, Clone, Copy, Default)]
struct Link {
    remote_qpn: u32,
    rq_psn: u32,
    sq_psn: u32,
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry: u8,
    mtu: u32,
    /// The local ACK timeout of the path (the REQ's), unless the id's option says otherwise.
    ack_timeout: Option<u8>,
}

impl Link {
    /// The passive side's link from a REQ, before the application answers. The REQ's Starting
    /// PSN is the PSN the requester expects first, so this side's send queue starts there (as
    /// Linux's `ib_cm` reads it); `rq_psn` is this side's choice, which the REP carries. The
    /// resources are the requester's, swapped, until accept clamps them.
    fn requested(req: &softverbs_wire::cm::ReqRepr, rq_psn: u32, active_mtu: u32) -> Self {
        Self {
            remote_qpn: req.local_qpn,
            rq_psn,
            sq_psn: req.starting_psn,
            responder_resources: req.initiator_depth,
            initiator_depth: req.responder_resources,
            retry_count: req.retry_count,
            rnr_retry: req.rnr_retry_count,
            mtu: u32::from(req.path_mtu).min(active_mtu),
            // Linux's responder uses the requester's value (its packet lifetime plus one).
            ack_timeout: Some(req.primary_path.local_ack_timeout),
        }
    }

    /// The active side's link once the REP came: the responder's QP, the PSN it expects first
    /// (where this side's send queue starts), and the resources clamped to what it grants.
    fn replied(&mut self, rep: &softverbs_wire::cm::RepRepr) {
        self.remote_qpn = rep.local_qpn;
        self.sq_psn = rep.starting_psn;
        self.responder_resources = self.responder_resources.min(rep.initiator_depth);
        self.initiator_depth = self.initiator_depth.min(rep.responder_resources);
        self.rnr_retry = rep.rnr_retry_count;
    }
}

/// The address vector towards `dgid` from the id's source GID.
fn av(st: &IdState, dgid: Gid) -> AhAttr {
    AhAttr {
        grh: GlobalRoute {
            dgid,
            flow_label: 0,
            sgid_index: st.sgid_index,
            hop_limit: 64,
            traffic_class: st.tos,
        },
        is_global: true,
        port_num: 1,
        ..AhAttr::default()
    }
}

fn psn() -> u32 {
    random_u32() & 0xFF_FFFF
}

/// Resolves 0xFF to `max` and refuses more than `max` (EINVAL).
fn resources(v: u8, max: u32) -> Result<u8> {
    let max = max.min(255) as u8;
    match v {
        0xFF => Ok(max),
        v if v > max => Err(Error::invalid(format!("{v} exceeds the device limit {max}"))),
        v => Ok(v),
    }
}

impl CmId {
    /// `rdma_init_qp_attr`: the attributes and mask for moving the id's QP to `state` (INIT,
    /// RTR or RTS), as librdmacm applies them.
    pub fn init_qp_attr(&self, state: QpState) -> Result<(QpAttr, QpAttrMask)> {
        let st = self.state.lock();
        let mut a = QpAttr {
            qp_state: state,
            ..QpAttr::default()
        };
        let ud = matches!(self.qp_type, QpType::Ud);
        let mask = match state {
            QpState::Init => {
                a.pkey_index = 0;
                a.port_num = 1;
                if ud {
                    a.qkey = RDMA_UDP_QKEY;
                    QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY
                } else {
                    a.qp_access_flags = AccessFlags::empty();
                    QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS
                }
            }
            QpState::Rtr if ud => QpAttrMask::STATE,
            QpState::Rts if ud => {
                a.sq_psn = 0;
                QpAttrMask::STATE | QpAttrMask::SQ_PSN
            }
            QpState::Rtr => {
                let dst = st.dst.ok_or_else(|| Error::invalid("the id is not connected"))?;
                let l = st.link;
                a.ah_attr = av(&st, Gid::from_ip(dst.ip()));
                a.path_mtu = Mtu::from_raw(l.mtu).unwrap_or(Mtu::Mtu1024);
                a.dest_qp_num = l.remote_qpn;
                a.rq_psn = l.rq_psn;
                a.max_dest_rd_atomic = l.responder_resources;
                a.min_rnr_timer = 0;
                a.qp_access_flags = AccessFlags::REMOTE_WRITE;
                if l.responder_resources > 0 {
                    a.qp_access_flags |= AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
                }
                QpAttrMask::STATE
                    | QpAttrMask::AV
                    | QpAttrMask::PATH_MTU
                    | QpAttrMask::DEST_QPN
                    | QpAttrMask::RQ_PSN
                    | QpAttrMask::MAX_DEST_RD_ATOMIC
                    | QpAttrMask::MIN_RNR_TIMER
                    | QpAttrMask::ACCESS_FLAGS
            }
            QpState::Rts => {
                let l = st.link;
                a.sq_psn = l.sq_psn;
                a.timeout = st.ack_timeout.or(l.ack_timeout).unwrap_or(DEFAULT_ACK_TIMEOUT);
                a.retry_cnt = l.retry_count & 7;
                a.rnr_retry = l.rnr_retry & 7;
                a.max_rd_atomic = l.initiator_depth;
                QpAttrMask::STATE
                    | QpAttrMask::SQ_PSN
                    | QpAttrMask::TIMEOUT
                    | QpAttrMask::RETRY_CNT
                    | QpAttrMask::RNR_RETRY
                    | QpAttrMask::MAX_QP_RD_ATOMIC
            }
            QpState::Err | QpState::Reset => QpAttrMask::STATE,
            _ => return Err(Error::invalid("rdma_init_qp_attr: INIT, RTR, RTS, ERR or RESET")),
        };
        Ok((a, mask))
    }

    fn move_qp(&self, qp: &Qp, state: QpState) -> Result<()> {
        let (a, m) = self.init_qp_attr(state)?;
        qp.modify(&a, m)
    }

    /// The QP half of `rdma_create_qp`: makes `qp` (created on the id's device) the id's QP and
    /// moves it as librdmacm does: INIT for connected QPs; INIT (Q_Key 0x01234567), RTR and RTS
    /// at once for UD.
    pub fn attach_qp(&self, qp: &Arc<Qp>) -> Result<()> {
        {
            let st = self.state.lock();
            let dev = st
                .device
                .as_ref()
                .ok_or_else(|| Error::invalid("the id has no device yet"))?;
            if qp.context().device() != dev {
                return Err(Error::invalid("the QP is on another device"));
            }
            if st.qp.is_some() {
                return Err(Error::invalid("the id already has a QP"));
            }
            if (qp.qp_type() == QpType::Ud) != (self.qp_type == QpType::Ud) {
                return Err(Error::invalid("the QP type does not fit the port space"));
            }
        }
        self.move_qp(qp, QpState::Init)?;
        if self.qp_type == QpType::Ud {
            self.move_qp(qp, QpState::Rtr)?;
            self.move_qp(qp, QpState::Rts)?;
        }
        self.state.lock().qp = Some(qp.clone());
        Ok(())
    }

    /// `rdma_destroy_qp`: forgets the id's QP (its owner destroys it).
    pub fn detach_qp(&self) {
        self.state.lock().qp = None;
    }

    fn port(&self) -> Result<Arc<CmPort>> {
        self.state
            .lock()
            .port
            .clone()
            .ok_or_else(|| Error::invalid("the id is not bound to a device"))
    }

    /// `rdma_connect`: RC ids send a REQ (ESTABLISHED, or CONNECT_RESPONSE without a QP,
    /// REJECTED, UNREACHABLE follow); UD ids a SIDR_REQ (ESTABLISHED with the peer's QP number
    /// and Q_Key, or UNREACHABLE). User private data: at most 56 bytes (RC) or 180 (UD).
    pub fn connect(&self, param: &ConnParam) -> Result<()> {
        let port = self.port()?;
        let (src, dst, qp, tos, ack, local_ece) = {
            let st = self.state.lock();
            if st.phase != Phase::RouteResolved {
                return Err(Error::invalid("the route is not resolved"));
            }
            (
                st.src.unwrap(),
                st.dst.unwrap(),
                st.qp.clone(),
                st.tos,
                st.ack_timeout,
                st.local_ece,
            )
        };
        let hdr = CmaHeaderRepr {
            port: src.port(),
            src_addr: src.ip(),
            dst_addr: dst.ip(),
        };
        let mut private = vec![0u8; CMA_HEADER_LEN];
        hdr.emit(&mut CmaHeaderPacket::new_unchecked(&mut private[..]));
        private.extend_from_slice(&param.private_data);
        let sid = service_id(self.ps, dst.port());
        let dgid = Gid::from_ip(dst.ip());
        let me = self.me.clone();
        if self.qp_type == QpType::Ud {
            if private.len() > private_data_len::SIDR_REQ {
                return Err(Error::invalid("more than 180 bytes of private data"));
            }
            port.with(|inner, now| {
                let id = inner
                    .engine
                    .sidr_request(now, dgid, sid, 0xFFFF, &private)
                    .map_err(cm_err)?;
                inner.sidr_out.insert(id.request_id, me);
                let mut st = self.state.lock();
                st.sidr = Some(id);
                st.phase = Phase::Connecting;
                Ok::<(), Error>(())
            })?;
            return self.complete_sync();
        }
        if private.len() > private_data_len::REQ {
            return Err(Error::invalid("more than 56 bytes of private data"));
        }
        let attr = port.device.attr();
        let responder_resources = resources(param.responder_resources, attr.max_qp_rd_atom)?;
        let initiator_depth = resources(param.initiator_depth, attr.max_qp_init_rd_atom)?;
        let (local_qpn, srq) = match &qp {
            Some(q) => (q.qpn(), q.init_attr().srq.is_some()),
            None => (param.qp_num, param.srq != 0),
        };
        let mtu = self.path_mtu().raw();
        // The REQ's Starting PSN is the PSN this side expects first (Linux starts the
        // responder's send queue there); ours starts at the REP's.
        let rq_psn = psn();
        let sgid = Gid::from_ip(src.ip());
        let params = ConnectParams {
            service_id: sid,
            local_qpn,
            starting_psn: rq_psn,
            transport_type: 0,
            extended_transport_type: 0,
            responder_resources,
            initiator_depth,
            retry_count: param.retry_count & 7,
            rnr_retry_count: param.rnr_retry_count & 7,
            srq,
            flow_control: param.flow_control != 0,
            path_mtu: mtu as u8,
            pkey: 0xFFFF,
            ece: local_ece,
            path: CmPathRepr {
                local_lid: 0xFFFF,
                remote_lid: 0xFFFF,
                local_gid: sgid.0,
                remote_gid: dgid.0,
                flow_label: (u32::from(src.port()) * 31 + u32::from(dst.port())) & 0xF_FFFF,
                traffic_class: tos,
                hop_limit: 64,
                local_ack_timeout: ack.unwrap_or(DEFAULT_ACK_TIMEOUT),
                ..CmPathRepr::default()
            },
        };
        port.with(|inner, now| {
            let id = inner
                .engine
                .connect(now, dgid, &params, &private)
                .map_err(cm_err)?;
            inner.conns.insert(id, me);
            let mut st = self.state.lock();
            st.conn = Some(id);
            st.offered = Some(params);
            st.link = Link {
                rq_psn,
                responder_resources,
                initiator_depth,
                retry_count: param.retry_count & 7,
                mtu,
                ack_timeout: Some(params.path.local_ack_timeout),
                ..Link::default()
            };
            st.phase = Phase::Connecting;
            Ok::<(), Error>(())
        })?;
        self.complete_sync()
    }

    /// `rdma_accept` on an id from CONNECT_REQUEST. RC: moves the QP to RTR and RTS, then sends
    /// the REP (ESTABLISHED follows on the RTU); resources are clamped to what the request
    /// offered. UD: answers with a SIDR_REP (status 0, the QP's number, Q_Key 0x01234567) and
    /// reports nothing more. Private data: at most 196 bytes (RC) or 136 (UD).
    pub fn accept(&self, param: &ConnParam) -> Result<()> {
        let port = self.port()?;
        let (phase, qp, conn, sidr, req) = {
            let st = self.state.lock();
            (st.phase, st.qp.clone(), st.conn, st.sidr, st.req.clone())
        };
        if phase != Phase::Requested {
            return Err(Error::invalid("the id has no request to accept"));
        }
        if self.qp_type == QpType::Ud {
            let sidr = sidr.ok_or_else(|| Error::invalid("no SIDR request"))?;
            if param.private_data.len() > private_data_len::SIDR_REP {
                return Err(Error::invalid("more than 136 bytes of private data"));
            }
            let qpn = qp.as_ref().map_or(param.qp_num, |q| q.qpn());
            port.with(|inner, now| {
                inner
                    .engine
                    .sidr_reply(
                        now,
                        sidr,
                        &SidrReplyParams {
                            status: sidr_status::SUCCESS,
                            qpn,
                            qkey: RDMA_UDP_QKEY,
                        },
                        &param.private_data,
                    )
                    .map_err(cm_err)
            })?;
            self.state.lock().phase = Phase::Connected;
            return Ok(());
        }
        let (conn, req) = conn
            .zip(req)
            .ok_or_else(|| Error::invalid("no connection request"))?;
        if param.private_data.len() > private_data_len::REP {
            return Err(Error::invalid("more than 196 bytes of private data"));
        }
        let attr = port.device.attr();
        let responder_resources =
            resources(param.responder_resources, attr.max_qp_rd_atom)?.min(req.initiator_depth);
        let initiator_depth =
            resources(param.initiator_depth, attr.max_qp_init_rd_atom)?.min(req.responder_resources);
        let rq_psn = self.state.lock().link.rq_psn;
        {
            let mut st = self.state.lock();
            st.link.responder_resources = responder_resources;
            st.link.initiator_depth = initiator_depth;
            // The passive side sends with the requester's retry counts.
            st.link.retry_count = req.retry_count;
            // And with the RNR retry count the REQ asked the responder to use; the REP tells the
            // requester ours.
            st.link.rnr_retry = req.rnr_retry_count & 7;
        }
        let (local_qpn, srq) = match &qp {
            Some(q) => {
                self.move_qp(q, QpState::Rtr)?;
                self.move_qp(q, QpState::Rts)?;
                (q.qpn(), q.init_attr().srq.is_some())
            }
            None => (param.qp_num, param.srq != 0),
        };
        let params = AcceptParams {
            local_qpn,
            starting_psn: rq_psn,
            local_qkey: 0,
            responder_resources,
            initiator_depth,
            target_ack_delay: 0,
            rnr_retry_count: param.rnr_retry_count & 7,
            srq,
            flow_control: param.flow_control != 0,
            ece: self.state.lock().local_ece,
        };
        port.with(|inner, now| {
            inner
                .engine
                .accept(now, conn, &params, &param.private_data)
                .map_err(cm_err)?;
            self.state.lock().phase = Phase::Accepted;
            Ok::<(), Error>(())
        })?;
        self.complete_sync()
    }

    /// `rdma_set_local_ece`: the ECE values the next REQ or REP carries.
    pub fn set_local_ece(&self, ece: Ece) {
        self.state.lock().local_ece = ece;
    }

    /// `rdma_get_remote_ece`: the peer's ECE values, from its REQ or REP (zero before).
    pub fn remote_ece(&self) -> Ece {
        self.state.lock().remote_ece
    }

    /// `rdma_reject_ece`: as [`CmId::reject`], with reason 35 (vendor option not supported),
    /// which tells the peer the ECE values it offered were refused.
    pub fn reject_ece(&self, private_data: &[u8]) -> Result<()> {
        self.reject_with(rej_reason::VENDOR_OPTION_NOT_SUPPORTED, private_data)
    }

    /// `rdma_reject`: a REJ with reason 28 (consumer defined) and up to 148 bytes of private
    /// data, or for UD a SIDR_REP with status REJECT (up to 136 bytes).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        self.reject_with(rej_reason::CONSUMER_DEFINED, private_data)
    }

    fn reject_with(&self, reason: u16, private_data: &[u8]) -> Result<()> {
        let port = self.port()?;
        let (phase, conn, sidr) = {
            let st = self.state.lock();
            (st.phase, st.conn, st.sidr)
        };
        if !matches!(phase, Phase::Requested | Phase::Responded) {
            return Err(Error::invalid("nothing to reject"));
        }
        if self.qp_type == QpType::Ud {
            let sidr = sidr.ok_or_else(|| Error::invalid("no SIDR request"))?;
            port.with(|inner, now| {
                inner.engine.sidr_reply(
                    now,
                    sidr,
                    &SidrReplyParams {
                        status: sidr_status::REJECT,
                        qpn: 0,
                        qkey: 0,
                    },
                    private_data,
                )
            })
            .map_err(cm_err)?;
        } else {
            let conn = conn.ok_or_else(|| Error::invalid("no connection"))?;
            port.with(|inner, now| {
                let r = inner.engine.reject(now, conn, reason, private_data);
                if r.is_ok() {
                    inner.conns.remove(&conn);
                }
                r
            })
            .map_err(cm_err)?;
        }
        self.state.lock().phase = Phase::Failed;
        Ok(())
    }

    /// `rdma_establish`: after CONNECT_RESPONSE (the id has no QP, the application moved its
    /// own to RTS), sends the RTU. The id is connected on return; ESTABLISHED is reported on
    /// the passive side only (as librdmacm over Linux does: this side asked for no event).
    pub fn establish(&self) -> Result<()> {
        let port = self.port()?;
        let conn = {
            let st = self.state.lock();
            if st.phase != Phase::Responded {
                return Err(Error::invalid("no CONNECT_RESPONSE to answer"));
            }
            st.conn.ok_or_else(|| Error::invalid("no connection"))?
        };
        port.with(|inner, _| inner.engine.establish(conn)).map_err(cm_err)
    }

    /// `rdma_notify(IBV_EVENT_COMM_EST)`: data arrived before the RTU.
    pub fn notify_established(&self) -> Result<()> {
        let port = self.port()?;
        let conn = self
            .state
            .lock()
            .conn
            .ok_or_else(|| Error::invalid("no connection"))?;
        port.with(|inner, _| inner.engine.notify_established(conn))
            .map_err(cm_err)
    }

    /// `rdma_disconnect`: moves the QP to ERR, then sends a DREQ (or the DREP to the peer's);
    /// DISCONNECTED follows.
    pub fn disconnect(&self) -> Result<()> {
        let port = self.port()?;
        let (conn, qp) = {
            let st = self.state.lock();
            (st.conn, st.qp.clone())
        };
        let conn = conn.ok_or_else(|| Error::invalid("the id is not connected"))?;
        if let Some(qp) = qp {
            let _ = self.move_qp(&qp, QpState::Err);
        }
        port.with(|inner, now| inner.engine.disconnect(now, conn, &[]))
            .map_err(cm_err)
    }

    /// `rdma_join_multicast` on a UD id: the join is local (no SA on RoCE); MULTICAST_JOIN
    /// reports the group's address vector (MGID = the group's IP, QPN 0xFFFFFF, Q_Key
    /// 0x01234567); the id's QP is attached when the event is read.
    pub fn join_multicast(&self, group: IpAddr) -> Result<()> {
        self.join_multicast_ex(group, false)
    }

    /// `rdma_join_multicast_ex`: as [`CmId::join_multicast`]; a send-only member (join flag
    /// `RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER`) gets the event but its QP is not attached.
    pub fn join_multicast_ex(&self, group: IpAddr, send_only: bool) -> Result<()> {
        if self.qp_type != QpType::Ud {
            return Err(Error::invalid("only UD ids join groups"));
        }
        let mgid = Gid::from_ip(group);
        if !mgid.is_multicast() {
            return Err(Error::invalid("not a multicast address"));
        }
        let param = {
            let mut st = self.state.lock();
            if st.device.is_none() {
                return Err(Error::invalid("bind or resolve an address first"));
            }
            if st.mcast.contains(&mgid) {
                return Err(os_err(98));
            }
            st.mcast.push(mgid);
            if send_only {
                st.send_only.push(mgid);
            }
            let mut ah = av(&st, mgid);
            ah.grh.hop_limit = 1;
            UdParam {
                private_data: Vec::new(),
                ah_attr: ah,
                qp_num: 0xFF_FFFF,
                qkey: RDMA_UDP_QKEY,
            }
        };
        self.event(CmEventType::MulticastJoin, 0, EventParam::Ud(param));
        self.complete_sync()
    }

    /// `rdma_leave_multicast`.
    pub fn leave_multicast(&self, group: IpAddr) -> Result<()> {
        let mgid = Gid::from_ip(group);
        let mut st = self.state.lock();
        let at = st
            .mcast
            .iter()
            .position(|g| *g == mgid)
            .ok_or_else(|| Error::invalid("not a member"))?;
        st.mcast.remove(at);
        let was_send_only = st.send_only.contains(&mgid);
        st.send_only.retain(|g| *g != mgid);
        if let Some(qp) = st.qp.as_ref().filter(|_| !was_send_only) {
            let _ = qp.detach_mcast(&mgid, 0);
        }
        Ok(())
    }

    /// `rdma_destroy_id`: stops listening, ends the connection politely (REJ, DREQ or DREP as
    /// its state needs), drops undelivered events (undelivered requests are rejected), then
    /// waits until every delivered event was acknowledged.
    pub fn destroy(&self) {
        let (listening, ports, conn, sidr, port, qp, mcast, unanswered) = {
            let mut st = self.state.lock();
            if st.phase == Phase::Destroyed {
                return;
            }
            let unanswered = st.phase == Phase::Requested;
            st.phase = Phase::Destroyed;
            (
                st.listening.take(),
                std::mem::take(&mut st.ports),
                st.conn.take(),
                st.sidr.take(),
                st.port.clone(),
                st.qp.take(),
                std::mem::take(&mut st.mcast),
                unanswered,
            )
        };
        if let Some((sid, reg)) = listening {
            for p in &ports {
                p.with(|inner, _| {
                    if inner.listeners.get(&sid).is_some_and(|w| w.ptr_eq(&self.me)) {
                        inner.listeners.remove(&sid);
                        let _ = inner.engine.unlisten(sid);
                    }
                });
            }
            drop(reg);
        }
        if let Some(port) = &port {
            port.with(|inner, now| {
                if let Some(c) = conn {
                    let _ = inner.engine.destroy(now, c);
                    inner.conns.remove(&c);
                }
                if let Some(s) = sidr {
                    if unanswered {
                        // A SIDR request nobody will answer: refuse it, so it is forgotten.
                        let refuse = SidrReplyParams {
                            status: sidr_status::REJECT,
                            qpn: 0,
                            qkey: 0,
                        };
                        let _ = inner.engine.sidr_reply(now, s, &refuse, &[]);
                    } else {
                        inner.sidr_out.remove(&s.request_id);
                    }
                }
            });
        }
        if let Some(qp) = qp {
            for g in mcast {
                let _ = qp.detach_mcast(&g, 0);
            }
        }
        let mut orphans = Vec::new();
        self.channel().queue.remove_where(|e| {
            let mine = std::ptr::eq(Arc::as_ptr(e.owner()), self) || std::ptr::eq(Arc::as_ptr(&e.id), self);
            if mine && e.listen_id.is_some() && !std::ptr::eq(Arc::as_ptr(&e.id), self) {
                orphans.push(e.id.clone());
            }
            mine
        });
        for child in orphans {
            // A request nobody will see: reject it.
            let _ = child.reject(&[]);
            child.destroy();
        }
        self.acks.wait_all_acked();
    }

    /// (delivered, acknowledged) events counted against this id.
    pub fn event_counts(&self) -> (u64, u64) {
        self.acks.counts()
    }
}

/// Live connections, remembered rejections and SIDR exchanges of `device`'s CM (timewait
/// included), and ids registered with it: both reach zero once everything was torn down and the
/// timers ran out.
pub fn live_entries(device: &Device) -> Result<(usize, usize)> {
    let port = CmPort::of(device)?;
    let inner = port.inner.lock();
    let ids = inner.conns.len() + inner.listeners.len() + inner.sidr_out.len();
    Ok((inner.engine.live_entries(), ids))
}

/// What `device`'s CM dropped, answered on its own and resent (its engine's counters).
pub fn stats(device: &Device) -> Result<CmStats> {
    let port = CmPort::of(device)?;
    let stats = port.inner.lock().engine.stats();
    Ok(stats)
}

/// CONNECT_REQUEST parameters from a REQ (the peer's view swapped, as the kernel reports
/// it; the user data after the CMA header).
fn req_param(req: &softverbs_wire::cm::ReqRepr) -> EventParam {
    EventParam::Conn(ConnParam {
        private_data: req.private_data[CMA_HEADER_LEN..].to_vec(),
        responder_resources: req.initiator_depth,
        initiator_depth: req.responder_resources,
        flow_control: u8::from(req.e2e_flow_control),
        retry_count: req.retry_count,
        rnr_retry_count: req.rnr_retry_count,
        srq: u8::from(req.srq),
        qp_num: req.local_qpn,
    })
}

/// Turns one engine event into `rdma_cm` events (and QP transitions). Runs under the port's
/// lock; takes id locks inside it (the order every path uses).
fn dispatch(port: &CmPort, inner: &mut PortInner, now: Instant, ev: EngineEvent) {
    let find = |inner: &PortInner, id: &CommId| inner.conns.get(id).and_then(Weak::upgrade);
    match ev {
        EngineEvent::ConnectRequest {
            id,
            source: _,
            req,
            ece,
        } => {
            let listener = inner.listeners.get(&req.service_id).and_then(Weak::upgrade);
            let hdr = CmaHeaderRepr::parse(&CmaHeaderPacket::new_unchecked(
                &req.private_data[..CMA_HEADER_LEN],
            ));
            let (Some(listener), Ok(hdr)) = (listener, hdr) else {
                let _ = inner.engine.reject(now, id, rej_reason::INVALID_SERVICE_ID, &[]);
                return;
            };
            let (bound, ports) = {
                let l = listener.state.lock();
                (l.src, l.ports.clone())
            };
            if bound.is_some_and(|b| !any_addr(b.ip()) && b.ip() != hdr.dst_addr) {
                let _ = inner.engine.reject(now, id, rej_reason::INVALID_SERVICE_ID, &[]);
                return;
            }
            let Ok(child) = CmId::build(
                (!listener.is_sync()).then(|| listener.channel()),
                listener.ps,
                listener.qp_type,
            ) else {
                let _ = inner.engine.reject(now, id, rej_reason::NO_RESOURCES, &[]);
                return;
            };
            {
                let mut st = child.state.lock();
                let local = hdr.dst_addr;
                st.phase = Phase::Requested;
                st.src = Some(SocketAddr::new(local, bound.map_or(0, |b| b.port())));
                st.dst = Some(SocketAddr::new(hdr.src_addr, hdr.port));
                st.remote_ece = ece;
                st.device = Some(port.device.clone());
                st.port = ports.iter().find(|p| std::ptr::eq(Arc::as_ptr(p), port)).cloned();
                st.sgid_index = port::source_index(port.device.node().gids(), &Gid::from_ip(local));
                st.conn = Some(id);
                // What accept will use unless told less, so that an application that moves
                // its own QP with `init_qp_attr` before accepting gets the same values.
                st.link = Link::requested(&req, psn(), port.device.port_attr().active_mtu.raw());
                st.tos = req.primary_path.traffic_class;
                st.req = Some(req.clone());
            }
            inner.conns.insert(id, Arc::downgrade(&child));
            let param = req_param(&req);
            listener.push(CmEvent {
                id: child,
                listen_id: Some(listener.clone()),
                event: CmEventType::ConnectRequest,
                status: 0,
                param,
            });
        }
        EngineEvent::SidrRequest { id, req } => {
            let listener = inner.listeners.get(&req.service_id).and_then(Weak::upgrade);
            let hdr = CmaHeaderRepr::parse(&CmaHeaderPacket::new_unchecked(
                &req.private_data[..CMA_HEADER_LEN],
            ));
            let unsupported = SidrReplyParams {
                status: sidr_status::UNSUPPORTED,
                qpn: 0,
                qkey: 0,
            };
            let (Some(listener), Ok(hdr)) = (listener, hdr) else {
                let _ = inner.engine.sidr_reply(now, id, &unsupported, &[]);
                return;
            };
            let Ok(child) = CmId::build(
                (!listener.is_sync()).then(|| listener.channel()),
                listener.ps,
                listener.qp_type,
            ) else {
                let _ = inner.engine.sidr_reply(now, id, &unsupported, &[]);
                return;
            };
            let ah = {
                let bound = listener.state.lock().src;
                let ports = listener.state.lock().ports.clone();
                let mut st = child.state.lock();
                let local = hdr.dst_addr;
                st.phase = Phase::Requested;
                st.src = Some(SocketAddr::new(local, bound.map_or(0, |b| b.port())));
                st.dst = Some(SocketAddr::new(hdr.src_addr, hdr.port));
                st.device = Some(port.device.clone());
                st.port = ports.iter().find(|p| std::ptr::eq(Arc::as_ptr(p), port)).cloned();
                st.sgid_index = port::source_index(port.device.node().gids(), &Gid::from_ip(local));
                st.sidr = Some(id);
                av(&st, Gid::from_ip(hdr.src_addr))
            };
            listener.push(CmEvent {
                id: child,
                listen_id: Some(listener.clone()),
                event: CmEventType::ConnectRequest,
                status: 0,
                param: EventParam::Ud(UdParam {
                    private_data: req.private_data[CMA_HEADER_LEN..].to_vec(),
                    ah_attr: ah,
                    qp_num: 0,
                    qkey: 0,
                }),
            });
        }
        EngineEvent::ConnectResponse { id, rep, ece } => {
            let Some(cmid) = find(inner, &id) else { return };
            let qp = {
                let mut st = cmid.state.lock();
                st.remote_ece = ece;
                st.link.replied(&rep);
                st.rep = Some(rep.clone());
                st.qp.clone()
            };
            match qp {
                Some(qp) => {
                    let moved = cmid
                        .move_qp(&qp, QpState::Rtr)
                        .and_then(|()| cmid.move_qp(&qp, QpState::Rts));
                    if moved.is_err() {
                        let _ = inner.engine.reject(now, id, rej_reason::NO_QP, &[]);
                        inner.conns.remove(&id);
                        cmid.state.lock().phase = Phase::Failed;
                        cmid.event(CmEventType::ConnectError, -22, EventParam::None);
                    } else {
                        // ESTABLISHED follows from the engine.
                        let _ = inner.engine.establish(id);
                    }
                }
                None => {
                    cmid.state.lock().phase = Phase::Responded;
                    cmid.event(CmEventType::ConnectResponse, 0, rep_param(&rep));
                }
            }
        }
        EngineEvent::Established { id } => {
            let Some(cmid) = find(inner, &id) else { return };
            let (rep, after_response) = {
                let mut st = cmid.state.lock();
                let after_response = st.phase == Phase::Responded;
                st.phase = Phase::Connected;
                (st.rep.clone(), after_response)
            };
            if after_response {
                // `rdma_establish` answered CONNECT_RESPONSE: no second event.
                return;
            }
            let param = match rep {
                Some(rep) => rep_param(&rep),
                None => EventParam::Conn(ConnParam {
                    retry_count: 0,
                    rnr_retry_count: 0,
                    ..ConnParam::default()
                }),
            };
            cmid.event(CmEventType::Established, 0, param);
        }
        EngineEvent::Rejected {
            id,
            reason,
            private_data,
        } => {
            let Some(cmid) = inner.conns.remove(&id).and_then(|w| w.upgrade()) else {
                return;
            };
            let qp = {
                let mut st = cmid.state.lock();
                st.phase = Phase::Failed;
                st.conn = None;
                st.qp.clone()
            };
            if let Some(qp) = qp {
                let _ = cmid.move_qp(&qp, QpState::Err);
            }
            cmid.event(
                CmEventType::Rejected,
                i32::from(reason),
                EventParam::Conn(ConnParam {
                    private_data: private_data.to_vec(),
                    retry_count: 0,
                    rnr_retry_count: 0,
                    ..ConnParam::default()
                }),
            );
        }
        EngineEvent::Unreachable { id } | EngineEvent::ConnectError { id } => {
            let Some(cmid) = inner.conns.remove(&id).and_then(|w| w.upgrade()) else {
                return;
            };
            let ty = if matches!(ev_kind(&cmid), Phase::Connecting) {
                CmEventType::Unreachable
            } else {
                CmEventType::ConnectError
            };
            {
                let mut st = cmid.state.lock();
                st.phase = Phase::Failed;
                st.conn = None;
            }
            cmid.event(ty, softverbs_engine::cm::ETIMEDOUT_STATUS, EventParam::None);
        }
        EngineEvent::Disconnected { id, timed_out } => {
            let Some(cmid) = find(inner, &id) else { return };
            cmid.state.lock().phase = Phase::Disconnected;
            let status = if timed_out {
                softverbs_engine::cm::ETIMEDOUT_STATUS
            } else {
                0
            };
            cmid.event(CmEventType::Disconnected, status, EventParam::None);
        }
        EngineEvent::TimewaitExit { id } => {
            let Some(cmid) = inner.conns.remove(&id).and_then(|w| w.upgrade()) else {
                return;
            };
            cmid.state.lock().conn = None;
            cmid.event(CmEventType::TimewaitExit, 0, EventParam::None);
        }
        EngineEvent::SidrReply { id, rep } => {
            let Some(cmid) = inner.sidr_out.remove(&id.request_id).and_then(|w| w.upgrade()) else {
                return;
            };
            let ah = {
                let mut st = cmid.state.lock();
                st.sidr = None;
                let dst = st.dst.map(|d| Gid::from_ip(d.ip())).unwrap_or(Gid::ZERO);
                av(&st, dst)
            };
            let ok = rep.status == sidr_status::SUCCESS && rep.qkey == RDMA_UDP_QKEY;
            cmid.state.lock().phase = if ok { Phase::Connected } else { Phase::Failed };
            if ok {
                cmid.event(
                    CmEventType::Established,
                    0,
                    EventParam::Ud(UdParam {
                        private_data: rep.private_data.to_vec(),
                        ah_attr: ah,
                        qp_num: rep.qpn,
                        qkey: rep.qkey,
                    }),
                );
            } else {
                let status = if rep.status == 0 {
                    -22
                } else {
                    i32::from(rep.status)
                };
                cmid.event(CmEventType::Unreachable, status, EventParam::None);
            }
        }
        EngineEvent::SidrTimeout { id } => {
            let Some(cmid) = inner.sidr_out.remove(&id.request_id).and_then(|w| w.upgrade()) else {
                return;
            };
            {
                let mut st = cmid.state.lock();
                st.sidr = None;
                st.phase = Phase::Failed;
            }
            cmid.event(
                CmEventType::Unreachable,
                softverbs_engine::cm::ETIMEDOUT_STATUS,
                EventParam::None,
            );
        }
    }
}

fn ev_kind(id: &CmId) -> Phase {
    id.state.lock().phase
}

/// ESTABLISHED / CONNECT_RESPONSE parameters from a REP (the peer's view swapped, as the
/// kernel reports it).
fn rep_param(rep: &softverbs_wire::cm::RepRepr) -> EventParam {
    EventParam::Conn(ConnParam {
        private_data: rep.private_data.to_vec(),
        responder_resources: rep.initiator_depth,
        initiator_depth: rep.responder_resources,
        flow_control: u8::from(rep.e2e_flow_control),
        retry_count: 0,
        rnr_retry_count: rep.rnr_retry_count,
        srq: u8::from(rep.srq),
        qp_num: rep.local_qpn,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destroy_waits_for_the_acknowledgement_of_delivered_events() {
        let ch = EventChannel::new().unwrap();
        let id = CmId::create(Some(&ch), PortSpace::Tcp).unwrap();
        id.resolve_addr(None, SocketAddr::from((Ipv4Addr::LOCALHOST, 9)), 2000)
            .unwrap();
        let ev = ch.get_event(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(ev.event, CmEventType::AddrResolved);
        assert_eq!(id.port_num(), 1);
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (id2, done2) = (id.clone(), done.clone());
        let t = std::thread::spawn(move || {
            id2.destroy();
            done2.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !done.load(std::sync::atomic::Ordering::SeqCst),
            "destroy waits for the ack"
        );
        ev.ack();
        t.join().unwrap();
        assert!(done.load(std::sync::atomic::Ordering::SeqCst));
        // Undelivered events are dropped with their id.
        let id = CmId::create(Some(&ch), PortSpace::Tcp).unwrap();
        id.resolve_addr(None, SocketAddr::from((Ipv4Addr::LOCALHOST, 9)), 2000)
            .unwrap();
        assert_eq!(ch.pending(), 1);
        id.destroy();
        assert_eq!(ch.pending(), 0);
    }

    #[test]
    fn a_loopback_bind_attaches_no_device() {
        // As the kernel's rdma_cm: loopback addresses bind like the wildcard.
        for ip in [
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        ] {
            assert!(any_addr(ip));
            let id = CmId::create(None, PortSpace::Tcp).unwrap();
            id.bind_addr(SocketAddr::new(ip, 0)).unwrap();
            assert!(id.device().is_none(), "{ip}");
            assert_eq!(id.port_num(), 0);
            assert_eq!(id.src_addr(), Some(SocketAddr::new(ip, 0)));
            id.destroy();
        }
        assert!(any_addr(IpAddr::V4(Ipv4Addr::UNSPECIFIED)));
        assert!(!any_addr(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1))));
        // Resolving from a loopback source still finds the loopback device.
        let id = CmId::create(None, PortSpace::Tcp).unwrap();
        id.resolve_addr(
            Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
            SocketAddr::from((Ipv4Addr::LOCALHOST, 9)),
            2000,
        )
        .unwrap();
        assert_eq!(id.port_num(), 1);
        id.destroy();
    }

    #[test]
    fn psns_go_where_linux_reads_them() {
        // The values of a REQ and a REP Linux 6.1 sent (crates/wire/tests/cm_linux.rs).
        let req = softverbs_wire::cm::ReqRepr {
            local_qpn: 0x12,
            starting_psn: 0x2e_9764,
            initiator_depth: 1,
            responder_resources: 2,
            path_mtu: 3,
            primary_path: CmPathRepr {
                local_ack_timeout: 19,
                ..CmPathRepr::default()
            },
            ..Default::default()
        };
        // The responder sends from the REQ's Starting PSN and expects its own, sent in the REP.
        let l = Link::requested(&req, 0x6a_877e, 5);
        assert_eq!((l.remote_qpn, l.sq_psn, l.rq_psn), (0x12, 0x2e_9764, 0x6a_877e));
        assert_eq!((l.responder_resources, l.initiator_depth, l.mtu), (1, 2, 3));
        assert_eq!(l.ack_timeout, Some(19), "the requester's ACK timeout");
        // The requester expects the PSN its REQ named and sends from the REP's.
        let mut l = Link {
            rq_psn: 0x47_a746,
            responder_resources: 4,
            initiator_depth: 4,
            ..Link::default()
        };
        let rep = softverbs_wire::cm::RepRepr {
            local_qpn: 0x11,
            starting_psn: 0x56_7c26,
            responder_resources: 1,
            initiator_depth: 2,
            rnr_retry_count: 7,
            ..Default::default()
        };
        l.replied(&rep);
        assert_eq!((l.remote_qpn, l.sq_psn, l.rq_psn), (0x11, 0x56_7c26, 0x47_a746));
        assert_eq!((l.responder_resources, l.initiator_depth, l.rnr_retry), (2, 1, 7));
    }

    #[test]
    fn conn_param_resources() {
        assert_eq!(resources(0xFF, 16).unwrap(), 16);
        assert_eq!(resources(4, 16).unwrap(), 4);
        assert_eq!(resources(17, 16).unwrap_err().errno(), 22);
        assert_eq!(resources(0xFF, 1000).unwrap(), 255);
    }

    #[test]
    fn resolution_finds_the_loopback_device() {
        assert_eq!(
            source_for(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            Ok(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        let (d, idx) = device_of(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        assert_eq!(
            d.gid_table()[usize::from(idx)],
            Gid::from_ip(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert_eq!(
            device_of(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)))
                .unwrap_err()
                .errno(),
            19
        );
    }
}
