//! `SOCK_DGRAM` rsockets: librdmacm's datagram protocol.
//!
//! A datagram socket is an ordinary UDP socket plus a UD QP per local address it sends from
//! (each on that address's device). The first datagram to a peer goes over the UDP socket
//! with a [`DsUdpHeaderRepr`] naming the sender's QP; the receiver answers with a control
//! datagram naming its own, and from then on each side sends to the other's QP over UD
//! (Q_Key 0x01234567), each datagram led by a [`DsHeaderRepr`] with the sender's address.
//! librdmacm reads the UDP socket on a service thread; here whoever calls into the socket
//! (receiving, sending, polling) reads it too, so a socket nobody uses costs nothing.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::libc;
use nix::sys::socket::{self as sock, sockopt, AddressFamily, MsgFlags, SockFlag, SockType, SockaddrStorage};
use parking_lot::Mutex;
use softverbs_engine::types::{AccessFlags, QpCap, QpType, RecvWr, SendFlags, Sge, WcStatus, WorkCompletion};
use softverbs_engine::wr::{Payload, SendOp};
use softverbs_engine::Result;
use softverbs_wire::rsocket::{
    udp_op, DsHeaderRepr, DsUdpHeaderRepr, DS_UDP_IPV4_HDR_LEN, DS_UDP_IPV6_HDR_LEN,
};

use super::fd::{socket_fd, FdFlags};
use super::options::SockOpt;
use super::wait::{take_comp_events, Notifier, Source, WaitSet, Waitable};
use super::{defaults, errno, resources, Domain, Shutdown};
use crate::cm::{self, CmId, PortSpace, RDMA_UDP_QKEY};
use crate::context::Context;
use crate::cq::{CompChannel, Cq};
use crate::mem::AtomicBuffer;
use crate::pd::{Ah, Mr, Pd};
use crate::qp::{Qp, QpInitAttr, SendRequest, UdAddress};

/// Bytes of a send or receive slot: a datagram with its header fits in one (librdmacm's
/// `RS_SNDLOWAT`).
const SLOT: u32 = 2048;
/// The GRH area in front of every UD receive.
const GRH: u32 = 40;
/// Marks receive work requests.
const RECV: u64 = 1 << 63;
/// How long `close` waits for sends in flight.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// A UD QP for one local address.
#[derive(Debug)]
struct DsQp {
    src: SocketAddr,
    id: Arc<CmId>,
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    comp: Arc<CompChannel>,
    cq: Arc<Cq>,
    qp: Arc<Qp>,
    smr: Arc<Mr>,
    rbuf: Arc<AtomicBuffer>,
    rmr: Arc<Mr>,
}

impl DsQp {
    fn destroy(&self) {
        let _ = self.qp.destroy();
        let _ = self.cq.destroy();
        let _ = self.comp.destroy();
        for mr in [&self.smr, &self.rmr] {
            let _ = mr.dereg();
        }
        self.id.detach_qp();
        self.id.destroy();
    }

    fn post_recv(&self, slot: u32) -> Result<()> {
        self.qp
            .post_recv(&[RecvWr {
                wr_id: RECV | u64::from(slot),
                sg_list: vec![Sge {
                    addr: self.rbuf.addr() + u64::from(slot) * u64::from(GRH + SLOT),
                    length: GRH + SLOT,
                    lkey: self.rmr.lkey(),
                }],
            }])
            .map_err(Into::into)
    }
}

/// A peer: the QP we reach it from, and its QP once known.
#[derive(Debug)]
struct Dest {
    qp: usize,
    ah: Option<Arc<Ah>>,
    qpn: u32,
}

/// Buffers and queues, made on first use (bind, connect or send).
#[derive(Debug)]
struct Endpoint {
    sbuf: Arc<AtomicBuffer>,
    free: Vec<u32>,
    sq: u32,
    rq: u32,
}

/// What the socket's lock guards.
#[derive(Debug)]
pub(crate) struct State {
    closed: bool,
    sbuf_size: u32,
    rbuf_size: u32,
    sq: u32,
    rq: u32,
    inline: u32,
    fd: FdFlags,
    reuseaddr: bool,
    err: i32,
    ep: Option<Endpoint>,
    qps: Vec<DsQp>,
    dests: HashMap<SocketAddr, Dest>,
    conn_dest: Option<SocketAddr>,
    rmsgs: VecDeque<(SocketAddr, Vec<u8>)>,
}

/// A datagram rsocket (`rsocket(AF_INET*, SOCK_DGRAM, 0)`).
#[derive(Debug)]
pub struct Datagram {
    domain: Domain,
    udp: Arc<OwnedFd>,
    notify: Notifier,
    st: Mutex<State>,
}

fn to_std(a: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = a.as_sockaddr_in() {
        return Some(SocketAddr::V4((*v4).into()));
    }
    a.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into()))
}

fn nix_err(e: nix::errno::Errno) -> softverbs_engine::Error {
    errno(e as i32)
}

impl Datagram {
    /// A new socket (its UDP socket is made now; its QPs when first needed).
    pub fn new(domain: Domain) -> Result<Arc<Self>> {
        let af = match domain {
            Domain::Inet => AddressFamily::Inet,
            Domain::Inet6 => AddressFamily::Inet6,
        };
        let udp = sock::socket(
            af,
            SockType::Datagram,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(nix_err)?;
        let d = defaults();
        Ok(Arc::new(Self {
            domain,
            udp: Arc::new(udp),
            notify: Notifier::new()?,
            st: Mutex::new(State {
                closed: false,
                sbuf_size: d.wmem,
                rbuf_size: d.mem,
                sq: d.sqsize,
                rq: d.rqsize,
                inline: d.inline,
                fd: FdFlags::default(),
                reuseaddr: false,
                err: 0,
                ep: None,
                qps: Vec::new(),
                dests: HashMap::new(),
                conn_dest: None,
                rmsgs: VecDeque::new(),
            }),
        }))
    }

    /// The socket's number: its UDP socket's file descriptor.
    pub fn number(&self) -> i32 {
        self.udp.as_raw_fd()
    }

    /// Sizes the queues and the send buffer (librdmacm's `ds_set_qp_size`: a slot of 2 KiB
    /// per queue entry, the buffers bounding the queues).
    fn init_ep(st: &mut State) -> Result<()> {
        if st.ep.is_some() {
            return Ok(());
        }
        let max = crate::device::device_list()
            .ok()
            .and_then(|l| l.iter().map(|d| d.attr().max_qp_wr).min())
            .unwrap_or(16384)
            .min(0xFFFE);
        let (mut sq, mut rq) = (st.sq.clamp(1, max), st.rq.clamp(1, max));
        let (mut sbuf, mut rbuf) = (st.sbuf_size, st.rbuf_size);
        if rq > rbuf / SLOT {
            rq = (rbuf / SLOT).max(1);
        }
        rbuf = rq * SLOT;
        if sq > sbuf / SLOT {
            sq = (sbuf / SLOT).max(1);
        }
        sbuf = sq * SLOT;
        st.ep = Some(Endpoint {
            sbuf: Arc::new(AtomicBuffer::new(sbuf as usize)),
            free: (0..sq).rev().collect(),
            sq,
            rq,
        });
        st.sq = sq;
        st.rq = rq;
        st.sbuf_size = sbuf;
        st.rbuf_size = rbuf;
        Ok(())
    }

    /// `rbind`: binds the UDP socket (EADDRINUSE, EADDRNOTAVAIL as for UDP).
    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        let mut st = self.st.lock();
        Self::check_open(&st)?;
        Self::init_ep(&mut st)?;
        sock::bind(self.udp.as_raw_fd(), &SockaddrStorage::from(addr)).map_err(nix_err)
    }

    /// `rconnect`: the default destination of `send`, and the only source `recv` takes.
    pub fn connect(&self, addr: SocketAddr) -> Result<()> {
        let mut st = self.st.lock();
        Self::check_open(&st)?;
        Self::init_ep(&mut st)?;
        sock::connect(self.udp.as_raw_fd(), &SockaddrStorage::from(addr)).map_err(nix_err)?;
        self.dest(&mut st, addr)?;
        st.conn_dest = Some(addr);
        Ok(())
    }

    /// The local address traffic towards `dst` leaves from: the bound address, or if that is
    /// the wildcard or loopback, the one routing picks, with our port.
    fn source_for(&self, dst: SocketAddr) -> Result<SocketAddr> {
        let fd = self.udp.as_raw_fd();
        let mut local = sock::getsockname::<SockaddrStorage>(fd)
            .ok()
            .as_ref()
            .and_then(to_std)
            .unwrap_or_else(|| self.domain.any());
        if local.port() == 0 {
            // Unbound: take a port now, so that the peer can answer.
            sock::bind(fd, &SockaddrStorage::from(self.domain.any())).map_err(nix_err)?;
            local = sock::getsockname::<SockaddrStorage>(fd)
                .ok()
                .as_ref()
                .and_then(to_std)
                .ok_or_else(|| errno(libc::EINVAL))?;
        }
        let ip = local.ip();
        if ip.is_unspecified() || ip.is_loopback() {
            let routed = cm::source_for(dst.ip()).map_err(|e| errno(-e))?;
            local.set_ip(routed);
        }
        Ok(local)
    }

    fn make_qp(st: &mut State, src: SocketAddr) -> Result<usize> {
        let ep = st.ep.as_ref().expect("initialised");
        let id = CmId::create(None, PortSpace::Udp)?;
        if cm::any_addr(src.ip()) {
            // A loopback address binds like the wildcard (no device); resolving from it finds
            // the loopback device, which carries these datagrams.
            id.resolve_addr(Some(src), src, 2000)?;
        } else {
            id.bind_addr(src)?;
        }
        let device = id.device().ok_or_else(|| errno(libc::EADDRNOTAVAIL))?;
        let (ctx, pd) = resources(&device)?;
        let comp = CompChannel::create(&ctx)?;
        let cq = Cq::create(&ctx, (ep.sq + ep.rq) as i32, Some(&comp), 0)?;
        let qp = Qp::create(
            &pd,
            &QpInitAttr {
                qp_type: QpType::Ud,
                send_cq: Some(cq.clone()),
                recv_cq: Some(cq.clone()),
                srq: None,
                cap: QpCap {
                    max_send_wr: ep.sq,
                    max_recv_wr: ep.rq,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: st.inline.min(device.limits().max_inline_data),
                },
                sq_sig_all: true,
                max_tso_header: 0,
            },
        )?;
        id.attach_qp(&qp)?;
        let local = AccessFlags::LOCAL_WRITE.bits();
        let smr = Mr::register(&pd, ep.sbuf.clone(), ep.sbuf.addr(), local)?;
        let rbuf = Arc::new(AtomicBuffer::new((ep.rq * (GRH + SLOT)) as usize));
        let rmr = Mr::register(&pd, rbuf.clone(), rbuf.addr(), local)?;
        let q = DsQp {
            src,
            id,
            ctx,
            pd,
            comp,
            cq,
            qp,
            smr,
            rbuf,
            rmr,
        };
        for slot in 0..ep.rq {
            if let Err(e) = q.post_recv(slot) {
                q.destroy();
                return Err(e);
            }
        }
        st.qps.push(q);
        Ok(st.qps.len() - 1)
    }

    /// The peer entry for `addr`, made with a QP for the local address towards it if new.
    fn dest(&self, st: &mut State, addr: SocketAddr) -> Result<()> {
        if st.dests.contains_key(&addr) {
            return Ok(());
        }
        let src = self.source_for(addr)?;
        let qp = match st.qps.iter().position(|q| q.src == src) {
            Some(i) => i,
            None => Self::make_qp(st, src)?,
        };
        st.dests.insert(addr, Dest { qp, ah: None, qpn: 0 });
        Ok(())
    }

    /// A UDP datagram: the header naming QP `qp`, then `data`. Returns the data bytes sent.
    fn send_udp(&self, st: &State, qp: usize, op: u8, data: &[&[u8]], to: SocketAddr) -> Result<usize> {
        let q = &st.qps[qp];
        let hdr = DsUdpHeaderRepr {
            op,
            qpn: q.qp.qpn(),
            addr: q.src.ip(),
        };
        let mut buf = vec![0u8; hdr.buffer_len()];
        hdr.emit(&mut buf).expect("sized");
        for d in data {
            buf.extend_from_slice(d);
        }
        let n = sock::sendto(
            self.udp.as_raw_fd(),
            &buf,
            &SockaddrStorage::from(to),
            MsgFlags::empty(),
        )
        .map_err(nix_err)?;
        Ok(n.saturating_sub(hdr.buffer_len()))
    }

    /// The address handle towards `to` from QP `qp`'s address.
    fn make_ah(q: &DsQp, to: SocketAddr) -> Result<Arc<Ah>> {
        let id = CmId::create(None, PortSpace::Udp)?;
        let r = id
            .resolve_addr(Some(SocketAddr::new(q.src.ip(), 0)), to, 2000)
            .and_then(|()| id.resolve_route(2000))
            .and_then(|()| id.ah_attr());
        id.destroy();
        Ah::create(&q.pd, &r?)
    }

    /// One datagram from the UDP socket: a peer telling its QP (and maybe sending data).
    fn on_udp(&self, st: &mut State, buf: &[u8], from: SocketAddr) {
        let Ok(hdr) = DsUdpHeaderRepr::parse(buf, from.is_ipv4()) else {
            return;
        };
        if self.dest(st, from).is_err() {
            return;
        }
        let qp = st.dests[&from].qp;
        if hdr.op == udp_op::DATA {
            // Tell the sender which QP to use from now on.
            let _ = self.send_udp(st, qp, udp_op::CTRL, &[], from);
        }
        let known = st.dests[&from].ah.is_some() && st.dests[&from].qpn == hdr.qpn;
        if !known {
            if let Ok(ah) = Self::make_ah(&st.qps[qp], from) {
                let d = st.dests.get_mut(&from).expect("made above");
                d.ah = Some(ah);
                d.qpn = hdr.qpn;
            }
        }
        if hdr.op == udp_op::DATA && st.rmsgs.len() < st.rq as usize {
            st.rmsgs.push_back((from, buf[hdr.buffer_len()..].to_vec()));
        }
    }

    /// The largest datagram that fits a slot and the path MTU.
    fn max_payload(st: &State, qp: usize, hdr: usize) -> usize {
        let mtu = st.qps[qp].ctx.device().port_attr().active_mtu.bytes() as usize;
        (SLOT as usize).min(mtu).saturating_sub(hdr)
    }

    /// `rsendto`/`rsend`/`rsendmsg`: one datagram to `dst` (default: the connected peer;
    /// EDESTADDRREQ without one). Over the UDP socket until the peer's QP is known, over UD
    /// after. EMSGSIZE beyond a slot (2 KiB with the header) or the path MTU; EAGAIN if
    /// non-blocking and every send slot is in flight.
    pub fn send_vectored(&self, bufs: &[&[u8]], flags: i32, dst: Option<SocketAddr>) -> Result<usize> {
        let mut st = self.st.lock();
        Self::check_open(&st)?;
        Self::init_ep(&mut st)?;
        let to = dst.or(st.conn_dest).ok_or_else(|| errno(libc::EDESTADDRREQ))?;
        self.dest(&mut st, to)?;
        self.progress(&mut st);
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        let qp = st.dests[&to].qp;
        let hdr = DsHeaderRepr { src: st.qps[qp].src };
        // Either path must fit: a receiver of librdmacm reads UDP datagrams into one slot.
        let udp_hdr = if hdr.src.is_ipv4() {
            DS_UDP_IPV4_HDR_LEN
        } else {
            DS_UDP_IPV6_HDR_LEN
        };
        let limit = Self::max_payload(&st, qp, hdr.buffer_len().max(udp_hdr));
        if len > limit {
            return Err(errno(libc::EMSGSIZE));
        }
        if st.dests[&to].ah.is_none() {
            return self.send_udp(&st, qp, udp_op::DATA, bufs, to);
        }
        let nonblock = st.fd.nonblocking(flags);
        let has_slot = |st: &State| st.ep.as_ref().is_some_and(|e| !e.free.is_empty());
        self.wait(&mut st, nonblock, None, has_slot)?;
        let st = &mut *st;
        let ep = st.ep.as_mut().expect("initialised");
        let slot = ep.free.pop().expect("waited for a slot");
        let mut b = vec![0u8; hdr.buffer_len()];
        hdr.emit(&mut b).expect("sized");
        for d in bufs {
            b.extend_from_slice(d);
        }
        let q = &st.qps[qp];
        let payload = if b.len() <= st.inline as usize && b.len() <= q.qp.cap().max_inline_data as usize {
            Payload::Inline(b)
        } else {
            let at = u64::from(slot) * u64::from(SLOT);
            ep.sbuf.write_bytes(at as usize, &b);
            Payload::Sges(vec![Sge {
                addr: ep.sbuf.addr() + at,
                length: b.len() as u32,
                lkey: q.smr.lkey(),
            }])
        };
        let d = &st.dests[&to];
        let flags = match payload {
            Payload::Inline(_) => SendFlags::SIGNALED | SendFlags::INLINE,
            _ => SendFlags::SIGNALED,
        };
        let r = q.qp.post_send(&[SendRequest {
            wr_id: u64::from(slot),
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags,
            payload,
            ud: Some(UdAddress {
                ah: d.ah.clone().expect("known peer"),
                remote_qpn: d.qpn,
                remote_qkey: RDMA_UDP_QKEY,
            }),
            xrc_srqn: None,
        }]);
        if let Err(e) = r {
            ep.free.push(slot);
            return Err(e.into());
        }
        Ok(len)
    }

    /// `rrecvfrom`/`rrecv`/`rrecvmsg`: the next datagram (truncated to the buffers) and its
    /// sender. EAGAIN if non-blocking and none is there; EINVAL before the socket was bound,
    /// connected or used to send (nothing can arrive).
    pub fn recv_from(&self, bufs: &mut [&mut [u8]], flags: i32) -> Result<(usize, Option<SocketAddr>)> {
        let mut st = self.st.lock();
        Self::check_open(&st)?;
        if st.ep.is_none() {
            return Err(errno(libc::EINVAL));
        }
        let nonblock = st.fd.nonblocking(flags);
        self.wait(&mut st, nonblock, None, |st| !st.rmsgs.is_empty())?;
        let (src, data) = st.rmsgs.front().expect("waited for a datagram");
        let (src, mut off) = (*src, 0);
        for b in bufs.iter_mut() {
            let n = b.len().min(data.len() - off);
            b[..n].copy_from_slice(&data[off..off + n]);
            off += n;
        }
        if flags & libc::MSG_PEEK == 0 {
            st.rmsgs.pop_front();
        }
        Ok((off, Some(src)))
    }

    /// `rshutdown`: datagram sockets have no connection to end; ENOTCONN unless connected.
    pub fn shutdown(&self, _how: Shutdown) -> Result<()> {
        let st = self.st.lock();
        Self::check_open(&st)?;
        if st.conn_dest.is_none() {
            return Err(errno(libc::ENOTCONN));
        }
        Ok(())
    }

    /// `rclose`: waits (briefly) for the datagrams in flight, then frees the QPs.
    pub fn close(&self) {
        let mut st = self.st.lock();
        if st.closed {
            return;
        }
        if st.ep.is_some() {
            let all_done = |st: &State| st.ep.as_ref().is_none_or(|e| e.free.len() == e.sq as usize);
            let _ = self.wait(&mut st, false, Some(Instant::now() + CLOSE_LINGER), all_done);
        }
        st.closed = true;
        st.dests.clear();
        for q in st.qps.drain(..) {
            q.destroy();
        }
        self.notify.wake();
    }

    /// `rgetpeername`: the connected peer (ENOTCONN otherwise).
    pub fn peer_addr(&self) -> Result<SocketAddr> {
        Self::check_open(&self.st.lock())?;
        let a = sock::getpeername::<SockaddrStorage>(self.udp.as_raw_fd()).map_err(nix_err)?;
        to_std(&a).ok_or_else(|| errno(libc::ENOTCONN))
    }

    /// `rgetsockname`: the UDP socket's address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Self::check_open(&self.st.lock())?;
        let a = sock::getsockname::<SockaddrStorage>(self.udp.as_raw_fd()).map_err(nix_err)?;
        Ok(to_std(&a).unwrap_or_else(|| self.domain.any()))
    }

    /// `rfcntl`, as for streams.
    pub fn fcntl(&self, cmd: i32, arg: i32) -> Result<i32> {
        let mut st = self.st.lock();
        Self::check_open(&st)?;
        st.fd.fcntl(cmd, arg)
    }

    /// Applies an option to the UDP socket too, as librdmacm does for every level but
    /// `SOL_RDMA`.
    fn set_kernel_option(&self, opt: &SockOpt) -> Result<()> {
        let fd = self.udp.as_fd();
        let r = match *opt {
            SockOpt::ReuseAddr(b) => sock::setsockopt(&fd, sockopt::ReuseAddr, &b),
            SockOpt::KeepAlive(b) => sock::setsockopt(&fd, sockopt::KeepAlive, &b),
            SockOpt::OobInline(b) => sock::setsockopt(&fd, sockopt::OobInline, &b),
            SockOpt::RcvBuf(v) => sock::setsockopt(&fd, sockopt::RcvBuf, &(v as usize)),
            SockOpt::SndBuf(v) => sock::setsockopt(&fd, sockopt::SndBuf, &(v as usize)),
            SockOpt::Linger { on, secs } => sock::setsockopt(
                &fd,
                sockopt::Linger,
                &libc::linger {
                    l_onoff: i32::from(on),
                    l_linger: secs,
                },
            ),
            SockOpt::V6Only(b) => sock::setsockopt(&fd, sockopt::Ipv6V6Only, &b),
            SockOpt::Ip { level, name, value } => match (level, name) {
                (libc::SOL_SOCKET, libc::SO_BROADCAST) => {
                    sock::setsockopt(&fd, sockopt::Broadcast, &(value != 0))
                }
                (libc::SOL_SOCKET, libc::SO_REUSEPORT) => {
                    sock::setsockopt(&fd, sockopt::ReusePort, &(value != 0))
                }
                (libc::SOL_SOCKET, libc::SO_PRIORITY) => sock::setsockopt(&fd, sockopt::Priority, &value),
                (libc::IPPROTO_IP, libc::IP_TOS) => sock::setsockopt(&fd, sockopt::IpTos, &value),
                (libc::IPPROTO_IP, libc::IP_TTL) => sock::setsockopt(&fd, sockopt::Ipv4Ttl, &value),
                (libc::IPPROTO_IP, libc::IP_MULTICAST_TTL) => {
                    sock::setsockopt(&fd, sockopt::IpMulticastTtl, &(value as u8))
                }
                (libc::IPPROTO_IP, libc::IP_MULTICAST_LOOP) => {
                    sock::setsockopt(&fd, sockopt::IpMulticastLoop, &(value != 0))
                }
                (libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS) => {
                    sock::setsockopt(&fd, sockopt::Ipv6Ttl, &value)
                }
                (libc::IPPROTO_IPV6, libc::IPV6_MULTICAST_HOPS) => {
                    sock::setsockopt(&fd, sockopt::Ipv6MulticastHops, &value)
                }
                (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => sock::setsockopt(&fd, sockopt::Ipv6TClass, &value),
                _ => Err(nix::errno::Errno::ENOPROTOOPT),
            },
            // TCP options on a UDP socket, as the kernel answers them.
            SockOpt::NoDelay(_)
            | SockOpt::MaxSeg(_)
            | SockOpt::KeepIdle(_)
            | SockOpt::KeepCnt(_)
            | SockOpt::KeepIntvl(_) => Err(nix::errno::Errno::EOPNOTSUPP),
            SockOpt::Error(_) | SockOpt::Type(_) | SockOpt::Domain(_) | SockOpt::AcceptConn(_) => {
                Err(nix::errno::Errno::ENOPROTOOPT)
            }
            _ => Ok(()),
        };
        r.map_err(nix_err)
    }

    /// `rsetsockopt`: socket and IP options go to the UDP socket as well; buffer sizes count
    /// until the first QP exists; the `SOL_RDMA` sizes are EINVAL once the socket was used.
    pub fn set_option(&self, opt: SockOpt) -> Result<()> {
        let mut st = self.st.lock();
        Self::check_open(&st)?;
        self.set_kernel_option(&opt)?;
        let inited = st.ep.is_some();
        match opt {
            SockOpt::ReuseAddr(b) => st.reuseaddr = b,
            SockOpt::RcvBuf(v) if st.qps.is_empty() => st.rbuf_size = v.saturating_mul(2).max(SLOT),
            SockOpt::SndBuf(v) if !inited => st.sbuf_size = v.saturating_mul(2).max(SLOT),
            SockOpt::SqSize(_)
            | SockOpt::RqSize(_)
            | SockOpt::Inline(_)
            | SockOpt::IomapSize(_)
            | SockOpt::Route(_)
                if inited =>
            {
                return Err(errno(libc::EINVAL))
            }
            SockOpt::SqSize(v) => st.sq = v.min(0xFFFE),
            SockOpt::RqSize(v) => st.rq = v.min(0xFFFE),
            SockOpt::Inline(v) => st.inline = v.min(0xFFFE),
            SockOpt::IomapSize(_) | SockOpt::Route(_) => {}
            _ => {}
        }
        Ok(())
    }

    /// `rgetsockopt`.
    pub fn get_option(&self, level: i32, name: i32) -> Result<SockOpt> {
        use libc::*;
        let mut st = self.st.lock();
        Self::check_open(&st)?;
        Ok(match (level, name) {
            (SOL_SOCKET, SO_REUSEADDR) => SockOpt::ReuseAddr(st.reuseaddr),
            (SOL_SOCKET, SO_RCVBUF) => SockOpt::RcvBuf(st.rbuf_size),
            (SOL_SOCKET, SO_SNDBUF) => SockOpt::SndBuf(st.sbuf_size),
            (SOL_SOCKET, SO_ERROR) => SockOpt::Error(std::mem::take(&mut st.err)),
            (SOL_SOCKET, SO_TYPE) => SockOpt::Type(SOCK_DGRAM),
            (SOL_SOCKET, SO_DOMAIN) => SockOpt::Domain(self.domain.raw()),
            (SOL_SOCKET, SO_ACCEPTCONN) => SockOpt::AcceptConn(false),
            (super::level::RDMA, super::name::RDMA_SQSIZE) => SockOpt::SqSize(st.sq),
            (super::level::RDMA, super::name::RDMA_RQSIZE) => SockOpt::RqSize(st.rq),
            (super::level::RDMA, super::name::RDMA_INLINE) => SockOpt::Inline(st.inline),
            (super::level::RDMA, super::name::RDMA_IOMAPSIZE) => SockOpt::IomapSize(0),
            _ => return Err(errno(ENOPROTOOPT)),
        })
    }

    // ---- for poll -----------------------------------------------------------------------

    pub(crate) fn poll_events(&self, events: i16) -> i16 {
        use super::poll::{POLLIN, POLLNVAL, POLLOUT};
        let mut st = self.st.lock();
        if st.closed {
            return POLLNVAL;
        }
        self.progress(&mut st);
        let mut r = 0;
        if events & POLLIN != 0 && !st.rmsgs.is_empty() {
            r |= POLLIN;
        }
        if events & POLLOUT != 0 && st.ep.as_ref().is_none_or(|e| !e.free.is_empty()) {
            r |= POLLOUT;
        }
        r
    }
}

impl Waitable for Datagram {
    type State = State;

    fn parts(&self) -> (&Mutex<State>, &Notifier) {
        (&self.st, &self.notify)
    }

    fn wait_set(&self, st: &State) -> WaitSet {
        let mut w = WaitSet::default();
        w.sources.push(Source::Fd(self.udp.clone()));
        for q in &st.qps {
            w.sources.push(Source::Comp(q.comp.clone()));
            w.devices.push(q.ctx.device().clone());
        }
        w
    }

    fn arm(&self, st: &State) {
        for q in &st.qps {
            let _ = q.cq.req_notify(false);
        }
    }

    /// Takes what arrived: completions of every QP, datagrams on the UDP socket.
    fn take_events(&self, st: &mut State) -> bool {
        let mut changed = false;
        let mut wcs = [WorkCompletion::default(); 32];
        for i in 0..st.qps.len() {
            take_comp_events(&st.qps[i].comp);
            loop {
                let n = st.qps[i].cq.poll(&mut wcs);
                for wc in &wcs[..n] {
                    changed = true;
                    if wc.wr_id & RECV == 0 {
                        if let Some(ep) = st.ep.as_mut() {
                            ep.free.push(wc.wr_id as u32);
                        }
                        continue;
                    }
                    let slot = wc.wr_id as u32;
                    if wc.status == WcStatus::Success
                        && wc.byte_len >= GRH + 8
                        && st.rmsgs.len() < st.rq as usize
                    {
                        let q = &st.qps[i];
                        let mut b = vec![0u8; (wc.byte_len - GRH) as usize];
                        q.rbuf.read_bytes((slot * (GRH + SLOT) + GRH) as usize, &mut b);
                        if let Ok(h) = DsHeaderRepr::parse(&b) {
                            b.drain(..h.buffer_len());
                            st.rmsgs.push_back((h.src, b));
                        }
                    }
                    if wc.status != WcStatus::WrFlushErr {
                        let _ = st.qps[i].post_recv(slot);
                    }
                }
                if n < wcs.len() {
                    break;
                }
            }
        }
        let mut buf = vec![0u8; (SLOT as usize) + DS_UDP_IPV6_HDR_LEN];
        while let Ok((n, Some(from))) = sock::recvfrom::<SockaddrStorage>(self.udp.as_raw_fd(), &mut buf) {
            changed = true;
            if let Some(from) = to_std(&from) {
                self.on_udp(st, &buf[..n], from);
            }
        }
        changed
    }

    fn is_closed(st: &State) -> bool {
        st.closed
    }
}

socket_fd!(Datagram, udp);
