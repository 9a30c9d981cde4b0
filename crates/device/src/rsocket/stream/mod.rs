//! `SOCK_STREAM` rsockets: an RC connection set up by the connection manager, with librdmacm's
//! connection data in the REQ and REP private data and its data protocol ([`conn`]) after.

mod conn;

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::libc;
use nix::sys::eventfd::{EfdFlags, EventFd};
use parking_lot::{Condvar, Mutex, MutexGuard};
use softverbs_engine::types::Gid;
use softverbs_engine::{Error, Result};
use softverbs_wire::rsocket::{
    ctrl, scale_to_value, value_to_scale, ConnDataRepr, PathRecordRepr, CONN_DATA_LEN,
};

use super::fd::{socket_fd, FdFlags};
use super::options::SockOpt;
use super::wait::{self, take_comp_events, Notifier, Source, WaitSet, Waitable};
use super::{defaults, errno, Domain, Shutdown};
use crate::cm::{CmEvent, CmEventType, CmId, ConnParam, EventChannel, EventParam, PortSpace};
use crate::sync::EventQueue;

pub(crate) use conn::SNDLOWAT;
use conn::{Conn, Sizes};

/// How long `close` waits for what was sent to leave before it tears the connection down.
const CLOSE_LINGER: Duration = Duration::from_secs(5);
/// The resolution timeouts passed to the connection manager (as librdmacm's first try).
const RESOLVE_MS: u32 = 2000;
/// Default seconds between keepalives (`/proc/sys/net/ipv4/tcp_keepalive_time` when readable).
const KEEPALIVE_DEFAULT: u32 = 7200;

/// Where a stream socket is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Init,
    Bound,
    Listening,
    /// Waiting for ADDR_RESOLVED.
    Resolving,
    /// Waiting for ROUTE_RESOLVED.
    Routing,
    /// REQ sent, waiting for ESTABLISHED.
    Connecting,
    /// Accepted (REP sent), waiting for ESTABLISHED; data may already arrive.
    Accepting,
    /// Connected once; the connection's [`conn::Status`] tells what is left of it.
    Open,
    /// The connection could not be made (`err` says why).
    ConnectError,
    Closed,
}

impl Phase {
    fn opening(self) -> bool {
        matches!(
            self,
            Self::Resolving | Self::Routing | Self::Connecting | Self::Accepting
        )
    }
}

/// Options that only remember what they were set to.
#[derive(Debug, Clone, Copy, Default)]
struct Flags {
    reuseaddr: bool,
    keepalive: bool,
    oobinline: bool,
    nodelay: bool,
    v6only: bool,
    linger: Option<i32>,
}

#[derive(Debug)]
struct Listener {
    /// Accepted connections waiting for `accept`; at most the backlog (more are rejected).
    queue: Arc<EventQueue<Arc<Stream>>>,
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
}

/// What the socket's lock guards.
#[derive(Debug)]
pub(crate) struct State {
    phase: Phase,
    id: Arc<CmId>,
    sizes: Sizes,
    fd: FdFlags,
    flags: Flags,
    keepalive_time: u32,
    /// `SO_ERROR`.
    err: i32,
    /// Why the last connect failed.
    connect_err: i32,
    /// A non-blocking connect finished and no `connect` call has said so yet.
    connect_unreported: bool,
    route: Option<Vec<u8>>,
    conn: Option<Conn>,
    listener: Option<Listener>,
    /// `rdma_disconnect` was called.
    disconnected: bool,
}

/// Tells a keepalive thread to stop.
type Stop = Arc<(Mutex<bool>, Condvar)>;

/// The keepalive thread of a socket with `SO_KEEPALIVE`.
#[derive(Debug, Default)]
struct Keepalive {
    thread: Mutex<Option<(Stop, JoinHandle<()>)>>,
}

/// A stream rsocket (`rsocket(AF_INET*, SOCK_STREAM, 0)`).
#[derive(Debug)]
pub struct Stream {
    domain: Domain,
    /// The CM events of the socket's id arrive here; its fd is the socket's number.
    channel: Arc<EventChannel>,
    notify: Notifier,
    st: Mutex<State>,
    keepalive: Keepalive,
}

fn keepalive_default() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_keepalive_time")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(KEEPALIVE_DEFAULT)
}

fn default_sizes() -> Sizes {
    let d = defaults();
    Sizes {
        sbuf: d.wmem,
        rbuf: d.mem,
        sq: d.sqsize,
        rq: d.rqsize,
        inline: d.inline,
        iomap: d.iomap_size,
    }
}

/// The errno for a CM event that ended a connection attempt.
fn event_errno(ev: &CmEvent) -> i32 {
    match ev.event {
        CmEventType::Rejected => libc::ECONNREFUSED,
        _ if ev.status < 0 => -ev.status,
        CmEventType::Unreachable => libc::EHOSTUNREACH,
        _ => libc::ECONNREFUSED,
    }
}

impl Stream {
    fn build(domain: Domain, channel: Arc<EventChannel>, st: State) -> Result<Arc<Self>> {
        Ok(Arc::new(Self {
            domain,
            channel,
            notify: Notifier::new()?,
            st: Mutex::new(st),
            keepalive: Keepalive::default(),
        }))
    }

    fn state(id: Arc<CmId>, phase: Phase, sizes: Sizes) -> State {
        State {
            phase,
            id,
            sizes,
            fd: FdFlags::default(),
            flags: Flags::default(),
            keepalive_time: 0,
            err: 0,
            connect_err: 0,
            connect_unreported: false,
            route: None,
            conn: None,
            listener: None,
            disconnected: false,
        }
    }

    /// A new, unconnected socket.
    pub fn new(domain: Domain) -> Result<Arc<Self>> {
        let channel = EventChannel::new()?;
        let id = CmId::create(Some(&channel), PortSpace::Tcp)?;
        Self::build(domain, channel, Self::state(id, Phase::Init, default_sizes()))
    }

    /// The socket's number: its CM event channel's file descriptor.
    pub fn number(&self) -> i32 {
        self.channel.fd()
    }

    /// The address family.
    pub fn domain(&self) -> Domain {
        self.domain
    }

    /// `rbind`: EINVAL if already bound or in use, EADDRNOTAVAIL for an address no device has.
    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        let mut st = self.st.lock();
        if st.phase != Phase::Init {
            return Err(errno(libc::EINVAL));
        }
        st.id.bind_addr(addr)?;
        st.phase = Phase::Bound;
        Ok(())
    }

    /// `rlisten`: requests are accepted as they come, by a thread of the socket, and wait for
    /// [`Stream::accept`] in a queue. EADDRINUSE if another socket of this host listens on the
    /// port.
    pub fn listen(self: &Arc<Self>, backlog: i32) -> Result<()> {
        let mut st = self.st.lock();
        match st.phase {
            Phase::Listening => return Ok(()),
            Phase::Init | Phase::Bound => {}
            Phase::Closed => return Err(errno(libc::EBADF)),
            _ => return Err(errno(libc::EINVAL)),
        }
        st.id.listen(backlog)?;
        let queue = Arc::new(EventQueue::new()?);
        let stop = Arc::new(
            EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(std::io::Error::from)?,
        );
        let (me, ch, q, s) = (
            Arc::downgrade(self),
            self.channel.clone(),
            queue.clone(),
            stop.clone(),
        );
        // As listen(2): a backlog of 0 still takes one; the system's limit caps it.
        let backlog = usize::try_from(backlog).unwrap_or(0).clamp(1, 4096);
        let thread = std::thread::Builder::new()
            .name("rsocket-accept".into())
            .spawn(move || acceptor(&me, &ch, &q, &s, backlog))
            .map_err(Error::Io)?;
        st.listener = Some(Listener {
            queue,
            stop,
            thread: Some(thread),
        });
        st.phase = Phase::Listening;
        Ok(())
    }

    /// A socket for a connection request the accept thread answered.
    fn accepted(domain: Domain, sizes: Sizes, id: &Arc<CmId>, param: &ConnParam) -> Result<Arc<Self>> {
        let peer = ConnDataRepr::parse(&param.private_data).map_err(|_| errno(libc::EPROTO))?;
        let channel = EventChannel::new()?;
        id.migrate(Some(&channel))?;
        let mut conn = Conn::create(id, sizes)?;
        conn.open(&peer)?;
        let mut data = vec![0u8; CONN_DATA_LEN];
        conn.conn_data().emit(&mut data).expect("40 bytes");
        id.accept(&ConnParam {
            private_data: data,
            ..param.clone()
        })?;
        let mut st = Self::state(id.clone(), Phase::Accepting, conn.sizes);
        st.conn = Some(conn);
        Self::build(domain, channel, st)
    }

    /// `raccept`: the next accepted connection. EINVAL if the socket does not listen, EAGAIN
    /// if non-blocking and none is waiting.
    pub fn accept(&self) -> Result<Arc<Self>> {
        let mut st = self.st.lock();
        let queue = match (&st.listener, st.phase) {
            (Some(l), Phase::Listening) => l.queue.clone(),
            (_, Phase::Closed) => return Err(errno(libc::EBADF)),
            _ => return Err(errno(libc::EINVAL)),
        };
        let nonblock = st.fd.nonblocking(0);
        loop {
            self.wait(&mut st, nonblock, None, |_| queue.len() > 0)?;
            // Another thread may have taken it meanwhile.
            if let Ok(s) = queue.pop(Some(Duration::ZERO)) {
                return Ok(s);
            }
        }
    }

    /// `rconnect`: resolves the address and the route, makes the endpoint and sends the
    /// request with this side's connection data. Blocking: returns once connected
    /// (ECONNREFUSED if nobody listens, ETIMEDOUT if nobody answers). Non-blocking:
    /// EINPROGRESS, then `poll` for POLLOUT and `SO_ERROR`; EALREADY while in progress.
    pub fn connect(&self, addr: SocketAddr) -> Result<()> {
        let mut st = self.st.lock();
        match st.phase {
            Phase::Init | Phase::Bound => {}
            Phase::Resolving | Phase::Routing | Phase::Connecting => return Err(errno(libc::EALREADY)),
            Phase::Accepting | Phase::Open => {
                if std::mem::take(&mut st.connect_unreported) {
                    return Ok(());
                }
                return Err(errno(libc::EISCONN));
            }
            Phase::ConnectError => {
                let e = std::mem::take(&mut st.connect_err);
                st.err = 0;
                return Err(errno(if e == 0 { libc::ECONNABORTED } else { e }));
            }
            Phase::Listening => return Err(errno(libc::EINVAL)),
            Phase::Closed => return Err(errno(libc::EBADF)),
        }
        let src = st.id.src_addr();
        st.id.resolve_addr(src, addr, RESOLVE_MS)?;
        st.phase = Phase::Resolving;
        self.progress(&mut st);
        if st.fd.nonblocking(0) {
            if st.phase.opening() {
                st.connect_unreported = true;
                return Err(errno(libc::EINPROGRESS));
            }
        } else {
            self.wait(&mut st, false, None, |st| !st.phase.opening())?;
        }
        match st.phase {
            Phase::Open => Ok(()),
            _ => {
                let e = std::mem::take(&mut st.connect_err);
                st.err = 0;
                Err(errno(if e == 0 { libc::ECONNREFUSED } else { e }))
            }
        }
    }

    fn fail_connect(&self, st: &mut State, e: i32) {
        st.phase = Phase::ConnectError;
        st.err = e;
        st.connect_err = e;
        if let Some(mut c) = st.conn.take() {
            st.id.detach_qp();
            c.destroy();
        }
    }

    /// Handles one CM event of the socket's id.
    fn on_cm_event(&self, st: &mut State, ev: &CmEvent) {
        use CmEventType as E;
        match (st.phase, ev.event) {
            (Phase::Resolving, E::AddrResolved) => match st.id.resolve_route(RESOLVE_MS) {
                Ok(()) => st.phase = Phase::Routing,
                Err(e) => self.fail_connect(st, e.errno()),
            },
            (Phase::Routing, E::RouteResolved) => {
                let r = Conn::create(&st.id, st.sizes).and_then(|c| {
                    let mut data = vec![0u8; CONN_DATA_LEN];
                    c.conn_data().emit(&mut data).expect("40 bytes");
                    st.conn = Some(c);
                    st.id.connect(&ConnParam {
                        private_data: data,
                        responder_resources: 0,
                        initiator_depth: 0,
                        flow_control: 1,
                        retry_count: 7,
                        rnr_retry_count: 7,
                        srq: 0,
                        qp_num: 0,
                    })
                });
                match r {
                    Ok(()) => st.phase = Phase::Connecting,
                    Err(e) => self.fail_connect(st, e.errno()),
                }
            }
            (Phase::Connecting, E::Established) => {
                let peer = match &ev.param {
                    EventParam::Conn(c) => ConnDataRepr::parse(&c.private_data).ok(),
                    _ => None,
                };
                let opened = match (peer, st.conn.as_mut()) {
                    (Some(p), Some(c)) => c.open(&p).is_ok(),
                    _ => false,
                };
                if opened {
                    st.phase = Phase::Open;
                } else {
                    // Not an rsocket at the other end.
                    let _ = st.id.disconnect();
                    st.disconnected = true;
                    self.fail_connect(st, libc::EPROTO);
                }
            }
            (Phase::Resolving | Phase::Routing | Phase::Connecting, _) if ev.event != E::TimewaitExit => {
                self.fail_connect(st, event_errno(ev));
            }
            (Phase::Accepting, E::Established) => st.phase = Phase::Open,
            (Phase::Accepting, E::ConnectError | E::Rejected | E::Unreachable | E::Disconnected) => {
                st.phase = Phase::Open;
                if let Some(c) = st.conn.as_mut() {
                    c.status.disconnect();
                    c.status.failed = ev.event != E::Disconnected;
                }
            }
            (Phase::Open, E::Disconnected) => {
                if let Some(c) = st.conn.as_mut() {
                    c.status.disconnect();
                }
            }
            _ => {}
        }
    }

    /// Before a transfer: a connection still being made is driven (and waited for when
    /// blocking); then the socket must be connected (ENOTCONN).
    fn ready_for_io(&self, st: &mut MutexGuard<'_, State>, nonblock: bool) -> Result<()> {
        if st.phase.opening() {
            self.progress(st);
            if st.phase.opening() {
                self.wait(st, nonblock, None, |st| !st.phase.opening())?;
            }
        }
        match st.phase {
            Phase::Open => Ok(()),
            Phase::Closed => Err(errno(libc::EBADF)),
            _ => Err(errno(libc::ENOTCONN)),
        }
    }

    /// Whether a send can go on: there is room to send, or sending has ended (which the
    /// sender then reports).
    fn send_ready(st: &State) -> bool {
        st.conn
            .as_ref()
            .is_some_and(|c| c.can_send() || !c.status.writable)
    }

    /// Why the socket cannot send anymore.
    fn send_error(st: &State) -> Error {
        match &st.conn {
            Some(c) if c.status.failed => errno(libc::ECONNRESET),
            _ => errno(libc::EPIPE),
        }
    }

    fn conn(st: &mut State) -> &mut Conn {
        st.conn.as_mut().expect("an open socket has a connection")
    }

    /// Announces queued iomaps to the peer (before any transfer, as librdmacm does).
    fn send_iomaps(&self, st: &mut MutexGuard<'_, State>, nonblock: bool) -> Result<()> {
        while Self::conn(st).iomap_pending() {
            self.wait(st, nonblock, None, Self::send_ready)?;
            if !Self::conn(st).status.writable {
                return Err(Self::send_error(st));
            }
            Self::conn(st).send_next_iomap()?;
        }
        Ok(())
    }

    /// `rsend`/`rsendmsg`: copies the data out in writes into the peer's receive buffers as
    /// credits and buffer space allow. Returns what was sent, which is less than asked only if
    /// the socket is non-blocking (or `MSG_DONTWAIT`) and the rest would block. EPIPE after
    /// `shutdown(SHUT_WR)` or once the peer ended the connection, ECONNRESET if it broke,
    /// ENOTCONN if never connected.
    pub fn send_vectored(&self, bufs: &[&[u8]], flags: i32) -> Result<usize> {
        let mut st = self.st.lock();
        let nonblock = st.fd.nonblocking(flags);
        self.ready_for_io(&mut st, nonblock)?;
        if !Self::conn(&mut st).status.writable {
            return Err(Self::send_error(&st));
        }
        self.send_iomaps(&mut st, nonblock)?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let (mut sent, mut olen) = (0usize, conn::Conn::first_len());
        let (mut piece, mut at) = (0usize, 0usize);
        let mut gathered = Vec::new();
        while sent < total {
            if !Self::send_ready(&st) {
                if let Err(e) = self.wait(&mut st, nonblock, None, Self::send_ready) {
                    return if sent > 0 { Ok(sent) } else { Err(e) };
                }
            }
            let c = Self::conn(&mut st);
            if !c.status.writable {
                let e = Self::send_error(&st);
                return if sent > 0 { Ok(sent) } else { Err(e) };
            }
            let n = c.next_len(total - sent, &mut olen) as usize;
            while at == bufs[piece].len() {
                piece += 1;
                at = 0;
            }
            // One piece: straight from the caller's buffer; across pieces: gathered first.
            let chunk: &[u8] = if bufs[piece].len() - at >= n {
                let s = &bufs[piece][at..at + n];
                at += n;
                s
            } else {
                gathered.clear();
                while gathered.len() < n {
                    while at == bufs[piece].len() {
                        piece += 1;
                        at = 0;
                    }
                    let take = (n - gathered.len()).min(bufs[piece].len() - at);
                    gathered.extend_from_slice(&bufs[piece][at..at + take]);
                    at += take;
                }
                &gathered
            };
            if let Err(e) = c.send_data(chunk) {
                return if sent > 0 { Ok(sent) } else { Err(e) };
            }
            sent += n;
        }
        Ok(sent)
    }

    /// `rrecv`/`rrecvmsg`: copies received data into the buffers in order. Returns 0 once the
    /// peer shut down its sending side or disconnected and everything before was read.
    /// `MSG_PEEK` leaves the data; `MSG_WAITALL` waits until the buffers are full. EAGAIN if
    /// non-blocking with nothing to read, ECONNRESET if the connection broke, ENOTCONN if
    /// never connected.
    pub fn recv_vectored(&self, bufs: &mut [&mut [u8]], flags: i32) -> Result<usize> {
        let mut st = self.st.lock();
        let nonblock = st.fd.nonblocking(flags);
        let (peek, waitall) = (flags & libc::MSG_PEEK != 0, flags & libc::MSG_WAITALL != 0);
        self.ready_for_io(&mut st, nonblock)?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Ok(0);
        }
        let mut done = 0;
        loop {
            let ready = |st: &State| {
                st.conn
                    .as_ref()
                    .is_some_and(|c| c.has_data() || !c.status.readable)
            };
            if !Self::conn(&mut st).has_data() {
                if let Err(e) = self.wait(&mut st, nonblock, None, ready) {
                    return if done > 0 { Ok(done) } else { Err(e) };
                }
            }
            let c = Self::conn(&mut st);
            if !c.has_data() {
                if c.status.failed && done == 0 {
                    return Err(errno(libc::ECONNRESET));
                }
                break;
            }
            if peek {
                let mut tmp = vec![0u8; total];
                let n = c.read(&mut tmp, true);
                let mut off = 0;
                for b in bufs.iter_mut() {
                    let k = b.len().min(n - off);
                    b[..k].copy_from_slice(&tmp[off..off + k]);
                    off += k;
                }
                return Ok(n);
            }
            let mut skip = done;
            for b in bufs.iter_mut() {
                if skip >= b.len() {
                    skip -= b.len();
                    continue;
                }
                let n = c.read(&mut b[skip..], false);
                done += n;
                if n < b.len() - skip {
                    break;
                }
                skip = 0;
            }
            let _ = c.update_credits();
            if !(waitall && done < total && c.status.readable) {
                break;
            }
        }
        Ok(done)
    }

    /// The body of `shutdown`, under the socket's lock.
    fn shutdown_locked(&self, st: &mut MutexGuard<'_, State>, how: Shutdown, deadline: Instant) {
        let c = Self::conn(st);
        if c.status.connected {
            let msg = match how {
                Shutdown::Both => {
                    c.status.readable = false;
                    c.status.writable = false;
                    Some(ctrl::DISCONNECT)
                }
                Shutdown::Write => {
                    c.status.writable = false;
                    Some(if c.status.readable {
                        ctrl::SHUTDOWN
                    } else {
                        ctrl::DISCONNECT
                    })
                }
                Shutdown::Read => {
                    c.status.readable = false;
                    (!c.status.writable).then_some(ctrl::DISCONNECT)
                }
            };
            if let Some(msg) = msg {
                let can = |st: &State| st.conn.as_ref().is_none_or(|c| c.can_send_ctrl());
                if self.wait(st, false, Some(deadline), can).is_ok() {
                    let _ = Self::conn(st).send_ctrl(msg);
                }
                let done = |st: &State| st.conn.as_ref().is_none_or(|c| c.all_sends_done());
                let _ = self.wait(st, false, Some(deadline), done);
            }
        }
        let gone = !Self::conn(st).status.connected;
        if gone && !st.disconnected {
            st.disconnected = true;
            let _ = st.id.disconnect();
        }
        self.notify.wake();
    }

    /// `rshutdown`: SHUT_WR tells the peer no more data comes (its reads then end), SHUT_RDWR
    /// disconnects, in order: what was sent is delivered first. Waits (a few seconds at most)
    /// for the sends to complete. ENOTCONN if the socket was never connected.
    pub fn shutdown(&self, how: Shutdown) -> Result<()> {
        let mut st = self.st.lock();
        if st.phase == Phase::Accepting {
            let _ = self.wait(&mut st, false, Some(Instant::now() + CLOSE_LINGER), |st| {
                st.phase != Phase::Accepting
            });
        }
        match st.phase {
            Phase::Open => {}
            Phase::Closed => return Err(errno(libc::EBADF)),
            _ => return Err(errno(libc::ENOTCONN)),
        }
        self.shutdown_locked(&mut st, how, Instant::now() + CLOSE_LINGER);
        Ok(())
    }

    /// `rclose`: a connected socket is shut down in order first (at most a few seconds'
    /// wait); a listening one rejects what it did not accept and closes what was accepted
    /// but not taken. Then everything is freed. Later calls fail with EBADF.
    pub fn close(&self) {
        self.stop_keepalive();
        let mut st = self.st.lock();
        if st.phase == Phase::Closed {
            return;
        }
        if st.phase == Phase::Open && st.conn.as_ref().is_some_and(|c| c.status.connected) {
            self.shutdown_locked(&mut st, Shutdown::Both, Instant::now() + CLOSE_LINGER);
        }
        let listener = st.listener.take();
        st.phase = Phase::Closed;
        drop(st);
        if let Some(mut l) = listener {
            let _ = l.stop.write(1);
            if let Some(t) = l.thread.take() {
                if t.thread().id() != std::thread::current().id() {
                    let _ = t.join();
                }
            }
            while let Ok(s) = l.queue.pop(Some(Duration::ZERO)) {
                s.close();
            }
        }
        let mut st = self.st.lock();
        st.id.destroy();
        if let Some(mut c) = st.conn.take() {
            st.id.detach_qp();
            c.destroy();
        }
        self.notify.wake();
    }

    /// `rgetpeername`: ENOTCONN unless connected (or being accepted).
    pub fn peer_addr(&self) -> Result<SocketAddr> {
        let st = self.st.lock();
        match st.phase {
            Phase::Open | Phase::Accepting => st.id.dst_addr().ok_or_else(|| errno(libc::ENOTCONN)),
            Phase::Closed => Err(errno(libc::EBADF)),
            _ => Err(errno(libc::ENOTCONN)),
        }
    }

    /// `rgetsockname`: the bound or connected address (the family's any address before).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        let st = self.st.lock();
        Self::check_open(&st)?;
        Ok(st.id.src_addr().unwrap_or_else(|| self.domain.any()))
    }

    /// Whether reads and writes (and accept, connect) do not block.
    pub fn is_nonblocking(&self) -> bool {
        self.st.lock().fd.is_nonblocking()
    }

    /// `rfcntl`: F_GETFL, F_SETFL (O_NONBLOCK is what counts), F_GETFD, F_SETFD; EINVAL for
    /// other commands.
    pub fn fcntl(&self, cmd: i32, arg: i32) -> Result<i32> {
        self.st.lock().fd.fcntl(cmd, arg)
    }

    /// `rsetsockopt`. The `SOL_RDMA` sizes are EINVAL once a connection is being made;
    /// buffer sizes count only before (a listening socket passes its own to what it accepts).
    pub fn set_option(self: &Arc<Self>, opt: SockOpt) -> Result<()> {
        let mut st = self.st.lock();
        let before = matches!(st.phase, Phase::Init | Phase::Bound | Phase::Listening);
        match opt {
            SockOpt::ReuseAddr(b) => st.flags.reuseaddr = b,
            SockOpt::OobInline(b) => st.flags.oobinline = b,
            SockOpt::NoDelay(b) => st.flags.nodelay = b,
            SockOpt::V6Only(b) => st.flags.v6only = b,
            SockOpt::Linger { on, secs } => st.flags.linger = on.then_some(secs),
            SockOpt::RcvBuf(v) => {
                if st.conn.is_none() {
                    st.sizes.rbuf = v.saturating_mul(2).max(2 * SNDLOWAT);
                }
            }
            SockOpt::SndBuf(v) => {
                if st.conn.is_none() {
                    st.sizes.sbuf = v.saturating_mul(2).max(2 * SNDLOWAT);
                }
            }
            SockOpt::KeepAlive(on) => {
                st.flags.keepalive = on;
                if st.keepalive_time == 0 {
                    st.keepalive_time = keepalive_default();
                }
                let secs = st.keepalive_time;
                drop(st);
                self.stop_keepalive();
                if on {
                    self.start_keepalive(secs)?;
                }
            }
            SockOpt::KeepIdle(secs) => {
                if secs <= 0 {
                    return Err(errno(libc::EINVAL));
                }
                st.keepalive_time = secs as u32;
                if st.flags.keepalive {
                    drop(st);
                    self.stop_keepalive();
                    self.start_keepalive(secs as u32)?;
                }
            }
            SockOpt::KeepCnt(_) | SockOpt::KeepIntvl(_) | SockOpt::MaxSeg(_) => {}
            SockOpt::SqSize(_)
            | SockOpt::RqSize(_)
            | SockOpt::Inline(_)
            | SockOpt::IomapSize(_)
            | SockOpt::Route(_)
                if !before =>
            {
                return Err(errno(libc::EINVAL))
            }
            SockOpt::SqSize(v) => st.sizes.sq = v.min(0xFFFE),
            SockOpt::RqSize(v) => st.sizes.rq = v.min(0xFFFE),
            SockOpt::Inline(v) => st.sizes.inline = v.min(0xFFFE),
            SockOpt::IomapSize(v) => st.sizes.iomap = scale_to_value(value_to_scale(v)),
            SockOpt::Route(r) => st.route = Some(r),
            SockOpt::Error(_)
            | SockOpt::Type(_)
            | SockOpt::Domain(_)
            | SockOpt::AcceptConn(_)
            | SockOpt::Ip { .. } => return Err(errno(libc::ENOPROTOOPT)),
        }
        Ok(())
    }

    /// The path of the connection as `RDMA_ROUTE` gives it (one path, once resolved).
    fn path_data(st: &State) -> Vec<u8> {
        let (Some(src), Some(dst)) = (st.id.src_addr(), st.id.dst_addr()) else {
            return Vec::new();
        };
        let mtu = st
            .conn
            .as_ref()
            .map_or_else(|| st.id.path_mtu(), |c| c.qp.query().path_mtu);
        let rec = PathRecordRepr {
            dgid: Gid::from_ip(dst.ip()).0,
            sgid: Gid::from_ip(src.ip()).0,
            dlid: 0xFFFF,
            slid: 0xFFFF,
            flow_label: (u32::from(src.port()) * 31 + u32::from(dst.port())) & 0xF_FFFF,
            hop_limit: 64,
            reversible: true,
            pkey: 0xFFFF,
            mtu: mtu as u8,
            packet_life_time: 16,
            ..PathRecordRepr::default()
        };
        let mut b = vec![0u8; softverbs_wire::rsocket::PATH_DATA_LEN];
        rec.emit_path_data(&mut b).expect("72 bytes");
        b
    }

    /// `rgetsockopt` of `level`/`name`; ENOPROTOOPT for options rsockets do not have.
    pub fn get_option(&self, level: i32, name: i32) -> Result<SockOpt> {
        use libc::*;
        let mut st = self.st.lock();
        Self::check_open(&st)?;
        let sizes = st.conn.as_ref().map_or(st.sizes, |c| c.sizes);
        Ok(match (level, name) {
            (SOL_SOCKET, SO_REUSEADDR) => SockOpt::ReuseAddr(st.flags.reuseaddr),
            (SOL_SOCKET, SO_KEEPALIVE) => SockOpt::KeepAlive(st.flags.keepalive),
            (SOL_SOCKET, SO_OOBINLINE) => SockOpt::OobInline(st.flags.oobinline),
            (SOL_SOCKET, SO_RCVBUF) => SockOpt::RcvBuf(sizes.rbuf),
            (SOL_SOCKET, SO_SNDBUF) => SockOpt::SndBuf(sizes.sbuf),
            (SOL_SOCKET, SO_LINGER) => SockOpt::Linger {
                on: st.flags.linger.is_some(),
                secs: st.flags.linger.unwrap_or(0),
            },
            (SOL_SOCKET, SO_ERROR) => {
                self.progress(&mut st);
                SockOpt::Error(std::mem::take(&mut st.err))
            }
            (SOL_SOCKET, SO_TYPE) => SockOpt::Type(SOCK_STREAM),
            (SOL_SOCKET, SO_DOMAIN) => SockOpt::Domain(self.domain.raw()),
            (SOL_SOCKET, SO_ACCEPTCONN) => SockOpt::AcceptConn(st.phase == Phase::Listening),
            (IPPROTO_TCP, TCP_NODELAY) => SockOpt::NoDelay(st.flags.nodelay),
            (IPPROTO_TCP, TCP_MAXSEG) => SockOpt::MaxSeg(st.conn.as_ref().map_or(2048, Conn::mtu)),
            (IPPROTO_TCP, TCP_KEEPIDLE) => SockOpt::KeepIdle(if st.keepalive_time == 0 {
                keepalive_default() as i32
            } else {
                st.keepalive_time as i32
            }),
            (IPPROTO_TCP, TCP_KEEPCNT) => SockOpt::KeepCnt(1),
            (IPPROTO_TCP, TCP_KEEPINTVL) => SockOpt::KeepIntvl(1),
            (IPPROTO_IPV6, IPV6_V6ONLY) => SockOpt::V6Only(st.flags.v6only),
            (super::level::RDMA, super::name::RDMA_SQSIZE) => SockOpt::SqSize(sizes.sq),
            (super::level::RDMA, super::name::RDMA_RQSIZE) => SockOpt::RqSize(sizes.rq),
            (super::level::RDMA, super::name::RDMA_INLINE) => SockOpt::Inline(sizes.inline),
            (super::level::RDMA, super::name::RDMA_IOMAPSIZE) => SockOpt::IomapSize(sizes.iomap),
            (super::level::RDMA, super::name::RDMA_ROUTE) => {
                SockOpt::Route(st.route.clone().unwrap_or_else(|| Self::path_data(&st)))
            }
            _ => return Err(errno(ENOPROTOOPT)),
        })
    }

    /// `riomap`: registers `backing` (whose first byte is at `addr`) with the connection's
    /// device. `writable`: the peer may write it directly (`riowrite`) at `offset` (default:
    /// `addr`) once it heard of it, which it does before our next transfer; this takes one of
    /// the entries the peer allowed (`RDMA_IOMAPSIZE`), ENOMEM if none is left. Otherwise the
    /// mapping is local only. EINVAL unless connected.
    pub fn iomap(
        &self,
        backing: Arc<dyn crate::mem::MemoryBacking>,
        addr: u64,
        writable: bool,
        offset: Option<u64>,
    ) -> Result<u64> {
        let mut st = self.st.lock();
        if !matches!(st.phase, Phase::Open | Phase::Accepting) {
            return Err(errno(libc::EINVAL));
        }
        Self::conn(&mut st).iomap(backing, addr, writable, offset)
    }

    /// `riounmap`: EINVAL unless `addr` and `len` name a mapping.
    pub fn iounmap(&self, addr: u64, len: u64) -> Result<()> {
        let mut st = self.st.lock();
        match st.conn.as_mut() {
            Some(c) => c.iounmap(addr, len),
            None => Err(errno(libc::EINVAL)),
        }
    }

    /// `riowrite`: writes `buf` straight into the peer's buffer mapped at `offset` (and the
    /// ones after it), without the peer's application taking part; data sent afterwards
    /// arrives after it. Returns what was written, which is less than asked where the
    /// mappings end or a non-blocking call would block. EINVAL if no mapping of the peer holds
    /// `offset`.
    pub fn iowrite(&self, buf: &[u8], offset: u64, flags: i32) -> Result<usize> {
        let mut st = self.st.lock();
        let nonblock = st.fd.nonblocking(flags);
        self.ready_for_io(&mut st, nonblock)?;
        if !Self::conn(&mut st).status.writable {
            return Err(Self::send_error(&st));
        }
        self.send_iomaps(&mut st, nonblock)?;
        let (mut sent, mut olen) = (0usize, Conn::first_len());
        while sent < buf.len() {
            let at = offset + sent as u64;
            let Some(map) = Self::conn(&mut st).find_iomap(at) else {
                if sent == 0 {
                    return Err(errno(libc::EINVAL));
                }
                break;
            };
            if let Err(e) = self.wait(&mut st, nonblock, None, Self::send_ready) {
                return if sent > 0 { Ok(sent) } else { Err(e) };
            }
            let c = Self::conn(&mut st);
            if !c.status.writable {
                let e = Self::send_error(&st);
                return if sent > 0 { Ok(sent) } else { Err(e) };
            }
            let n = c.next_direct_len(&map, at, buf.len() - sent, &mut olen) as usize;
            if let Err(e) = c.send_direct(&map, at, &buf[sent..sent + n]) {
                return if sent > 0 { Ok(sent) } else { Err(e) };
            }
            sent += n;
        }
        Ok(sent)
    }

    fn start_keepalive(self: &Arc<Self>, secs: u32) -> Result<()> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let (me, s) = (Arc::downgrade(self), stop.clone());
        let t = std::thread::Builder::new()
            .name("rsocket-keepalive".into())
            .spawn(move || keepalive(&me, &s, Duration::from_secs(u64::from(secs))))
            .map_err(Error::Io)?;
        *self.keepalive.thread.lock() = Some((stop, t));
        Ok(())
    }

    fn stop_keepalive(&self) {
        let Some((stop, t)) = self.keepalive.thread.lock().take() else {
            return;
        };
        *stop.0.lock() = true;
        stop.1.notify_all();
        if t.thread().id() != std::thread::current().id() {
            let _ = t.join();
        }
    }

    // ---- for poll -----------------------------------------------------------------------

    /// The poll events of the socket now, after taking what happened (librdmacm's
    /// `rs_poll_rs`).
    pub(crate) fn poll_events(&self, events: i16) -> i16 {
        use super::poll::{POLLERR, POLLHUP, POLLIN, POLLNVAL, POLLOUT};
        let mut st = self.st.lock();
        self.progress(&mut st);
        match st.phase {
            Phase::Open | Phase::Accepting => {
                let c = st.conn.as_ref().expect("an open socket has a connection");
                let mut r = 0;
                if events & POLLIN != 0 && (c.has_data() || !c.status.readable) {
                    r |= POLLIN;
                }
                if events & POLLOUT != 0 && st.phase == Phase::Open && c.can_send() {
                    r |= POLLOUT;
                }
                // As a TCP socket: the end is reported once what came before it was read.
                if !c.status.connected && !c.has_data() {
                    r |= if c.status.failed { POLLERR } else { POLLHUP };
                }
                r
            }
            Phase::Listening => {
                let waiting = st.listener.as_ref().is_some_and(|l| l.queue.len() > 0);
                if events & POLLIN != 0 && waiting {
                    POLLIN
                } else {
                    0
                }
            }
            Phase::ConnectError => (events & (POLLIN | POLLOUT)) | POLLERR,
            Phase::Closed => POLLNVAL,
            _ => 0,
        }
    }
}

impl Waitable for Stream {
    type State = State;

    fn parts(&self) -> (&Mutex<State>, &Notifier) {
        (&self.st, &self.notify)
    }

    /// Takes what happened without waiting: CM events, completion events, completions;
    /// returns credits. True if anything changed.
    fn take_events(&self, st: &mut State) -> bool {
        let mut changed = false;
        // A listener's events (connection requests) are its accept thread's.
        while st.phase != Phase::Listening && self.channel.pending() > 0 {
            let Ok(ev) = self.channel.get_event(Some(Duration::ZERO)) else {
                break;
            };
            ev.ack();
            self.on_cm_event(st, &ev);
            changed = true;
        }
        let open = st.phase == Phase::Open;
        if let Some(c) = st.conn.as_mut().filter(|_| open || st.phase == Phase::Accepting) {
            take_comp_events(&c.comp);
            if open {
                let _ = c.update_credits();
            }
            changed |= c.poll().unwrap_or(true);
            if open {
                let _ = c.update_credits();
            }
        }
        changed
    }

    /// Requests the events that end a sleep on this socket.
    fn arm(&self, st: &State) {
        if let Some(c) = &st.conn {
            let _ = c.cq.req_notify(false);
        }
    }

    /// What a sleep on this socket waits for.
    fn wait_set(&self, st: &State) -> WaitSet {
        let mut w = WaitSet::default();
        match st.phase {
            Phase::Listening => {
                if let Some(l) = &st.listener {
                    w.sources.push(Source::Queue(l.queue.clone()));
                }
            }
            Phase::Resolving | Phase::Routing | Phase::Connecting => {
                w.sources.push(Source::Cm(self.channel.clone()));
            }
            Phase::Accepting | Phase::Open => {
                w.sources.push(Source::Cm(self.channel.clone()));
                if let Some(c) = &st.conn {
                    w.sources.push(Source::Comp(c.comp.clone()));
                    w.devices.push(c.ctx.device().clone());
                }
            }
            _ => {}
        }
        w
    }

    fn is_closed(st: &State) -> bool {
        st.phase == Phase::Closed
    }
}

socket_fd!(Stream, channel);

/// The accept thread of a listening socket: answers each connection request with a new
/// socket's connection data and queues the socket for `accept` (rejecting requests while
/// `backlog` wait there), until `stop` is written.
fn acceptor(
    me: &Weak<Stream>,
    channel: &EventChannel,
    queue: &EventQueue<Arc<Stream>>,
    stop: &EventFd,
    backlog: usize,
) {
    loop {
        let fds = [channel.as_fd(), stop.as_fd()];
        let _ = wait::sleep(&fds, nix::poll::PollTimeout::NONE);
        if stop.read().is_ok() {
            return;
        }
        while channel.pending() > 0 {
            let Ok(ev) = channel.get_event(Some(Duration::ZERO)) else {
                break;
            };
            ev.ack();
            if ev.event != CmEventType::ConnectRequest {
                continue;
            }
            let id = ev.id.clone();
            let room = queue.len() < backlog;
            let made = me.upgrade().filter(|_| room).and_then(|l| {
                let (domain, sizes) = {
                    let st = l.st.lock();
                    (l.domain, st.sizes)
                };
                match &ev.param {
                    EventParam::Conn(p) => Stream::accepted(domain, sizes, &id, p).ok(),
                    _ => None,
                }
            });
            match made {
                Some(s) => queue.push(s),
                None => {
                    let _ = id.reject(&[]);
                    id.destroy();
                }
            }
        }
    }
}

/// The keepalive thread: a keepalive every `every` while the connection lasts.
fn keepalive(me: &Weak<Stream>, stop: &(Mutex<bool>, Condvar), every: Duration) {
    loop {
        {
            let mut stopped = stop.0.lock();
            if !*stopped {
                stop.1.wait_for(&mut stopped, every);
            }
            if *stopped {
                return;
            }
        }
        let Some(s) = me.upgrade() else { return };
        let mut st = s.st.lock();
        s.progress(&mut st);
        if st.phase == Phase::Open {
            if let Some(c) = st.conn.as_mut() {
                let _ = c.send_keepalive();
            }
        }
    }
}
