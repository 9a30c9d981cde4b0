//! rsockets: sockets over RDMA, compatible with librdmacm's (`rsocket(7)`).
//!
//! [`RStream`] and [`RListener`] are to an RC connection what `TcpStream` and `TcpListener`
//! are to TCP; [`RDatagram`] is a `UdpSocket` over UD QPs. Both ends may be softverbs or
//! librdmacm (on a kernel RDMA device): they speak librdmacm's protocol. A stream can also map
//! a [`HostBuffer`] for its peer to write into directly ([`RStream::iomap`],
//! [`RStream::iowrite`]). [`poll`] waits on any of them and on ordinary file descriptors.
//!
//! ```
//! use std::io::{Read, Write};
//! use std::net::{Ipv4Addr, SocketAddr};
//! use softverbs::rsocket::{RListener, RStream};
//!
//! let listener = RListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
//! let addr = listener.local_addr()?;
//! let mut client = RStream::connect(addr)?;
//! let (mut server, _peer) = listener.accept()?;
//! client.write_all(b"ping")?;
//! let mut buf = [0u8; 4];
//! server.read_exact(&mut buf)?;
//! assert_eq!(&buf, b"ping");
//! drop(client);
//! assert_eq!(server.read(&mut buf)?, 0, "the peer closed");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::io;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

use nix::libc;
use softverbs_device::mem::MemoryBacking;
use softverbs_device::rsocket as rs;
use softverbs_engine::{Error, Result};

pub use softverbs_device::rsocket::{msg, SockOpt, POLLERR, POLLHUP, POLLIN, POLLNVAL, POLLOUT};

use crate::host::HostBuffer;

/// Sizes of a stream socket's resources, for [`RStream::connect_with`] and
/// [`RListener::bind_with`] (`SO_SNDBUF`, `SO_RCVBUF` and the `SOL_RDMA` options). Unset
/// fields keep librdmacm's defaults (or `/etc/rdma/rsocket/`'s).
#[derive(Debug, Clone, Default)]
pub struct StreamOptions {
    /// Send buffer bytes (as `SO_SNDBUF`: the socket gets twice this).
    pub send_buffer: Option<u32>,
    /// Receive buffer bytes (as `SO_RCVBUF`: the socket gets twice this).
    pub recv_buffer: Option<u32>,
    /// Send queue depth (`RDMA_SQSIZE`).
    pub sq_size: Option<u32>,
    /// Receive queue depth, which bounds the peer's credits (`RDMA_RQSIZE`).
    pub rq_size: Option<u32>,
    /// Writes up to this many bytes go inline (`RDMA_INLINE`).
    pub inline: Option<u32>,
    /// How many buffers the peer may map for direct writes into us (`RDMA_IOMAPSIZE`); 0, the
    /// default, allows none.
    pub iomap_size: Option<u32>,
}

impl StreamOptions {
    fn apply(&self, s: &rs::Socket) -> Result<()> {
        let set = |level: i32, name: i32, v: Option<u32>| -> Result<()> {
            match v {
                Some(v) => s.setsockopt(level, name, &(v as i32).to_ne_bytes()),
                None => Ok(()),
            }
        };
        set(rs::level::SOCKET, libc::SO_SNDBUF, self.send_buffer)?;
        set(rs::level::SOCKET, libc::SO_RCVBUF, self.recv_buffer)?;
        set(rs::level::RDMA, rs::name::RDMA_SQSIZE, self.sq_size)?;
        set(rs::level::RDMA, rs::name::RDMA_RQSIZE, self.rq_size)?;
        set(rs::level::RDMA, rs::name::RDMA_INLINE, self.inline)?;
        set(rs::level::RDMA, rs::name::RDMA_IOMAPSIZE, self.iomap_size)
    }
}

fn af(addr: &SocketAddr) -> i32 {
    if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    }
}

fn set_nonblocking(s: &rs::Socket, on: bool) -> Result<()> {
    let flags = s.fcntl(libc::F_GETFL, 0)?;
    let flags = if on {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    s.fcntl(libc::F_SETFL, flags).map(|_| ())
}

fn int_option(s: &rs::Socket, level: i32, name: i32) -> Result<i32> {
    let b = s.getsockopt(level, name)?;
    let a: [u8; 4] = b.get(..4).and_then(|b| b.try_into().ok()).unwrap_or_default();
    Ok(i32::from_ne_bytes(a))
}

fn shut(how: std::net::Shutdown) -> i32 {
    match how {
        std::net::Shutdown::Read => libc::SHUT_RD,
        std::net::Shutdown::Write => libc::SHUT_WR,
        std::net::Shutdown::Both => libc::SHUT_RDWR,
    }
}

/// A connected stream rsocket, like `TcpStream`. Reads return 0 once the peer shut down its
/// sending side or closed. Dropping it closes it in order: what was written is delivered,
/// then the peer's reads end.
#[derive(Debug)]
pub struct RStream {
    sock: rs::Socket,
}

impl RStream {
    /// Connects to `addr` (ECONNREFUSED if nobody listens there).
    pub fn connect(addr: SocketAddr) -> Result<Self> {
        Self::connect_with(addr, &StreamOptions::default())
    }

    /// Connects to `addr` with the given resource sizes.
    pub fn connect_with(addr: SocketAddr, opts: &StreamOptions) -> Result<Self> {
        let sock = rs::Socket::new(af(&addr), libc::SOCK_STREAM, 0)?;
        opts.apply(&sock)?;
        sock.connect(addr)?;
        Ok(Self { sock })
    }

    /// Starts connecting without waiting: poll for [`POLLOUT`] (or call
    /// [`RStream::take_error`]) to learn when it is done.
    pub fn connect_nonblocking(addr: SocketAddr, opts: &StreamOptions) -> Result<Self> {
        let sock = rs::Socket::new(af(&addr), libc::SOCK_STREAM, 0)?;
        opts.apply(&sock)?;
        set_nonblocking(&sock, true)?;
        match sock.connect(addr) {
            Ok(()) => {}
            Err(e) if e.errno() == libc::EINPROGRESS => {}
            Err(e) => return Err(e),
        }
        Ok(Self { sock })
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Result<SocketAddr> {
        self.sock.peer_addr()
    }

    /// The local address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.sock.local_addr()
    }

    /// Shuts down reading, writing or both; writing's end reaches the peer after the data.
    pub fn shutdown(&self, how: std::net::Shutdown) -> Result<()> {
        self.sock.shutdown(rs::Shutdown::from_raw(shut(how))?)
    }

    /// Makes reads and writes return EAGAIN ([`io::ErrorKind::WouldBlock`]) instead of
    /// waiting.
    pub fn set_nonblocking(&self, on: bool) -> Result<()> {
        set_nonblocking(&self.sock, on)
    }

    /// Receives into `buf` with `MSG_*` flags ([`msg`]); 0 at the end of the stream.
    pub fn recv(&self, buf: &mut [u8], flags: i32) -> Result<usize> {
        self.sock.recv(buf, flags)
    }

    /// Reads without consuming.
    pub fn peek(&self, buf: &mut [u8]) -> Result<usize> {
        self.sock.recv(buf, msg::PEEK)
    }

    /// Sends `buf` with `MSG_*` flags; returns how much was sent (all, unless non-blocking).
    pub fn send(&self, buf: &[u8], flags: i32) -> Result<usize> {
        self.sock.send(buf, flags)
    }

    /// `TCP_NODELAY` (remembered; rsockets always send at once).
    pub fn set_nodelay(&self, on: bool) -> Result<()> {
        self.sock
            .setsockopt(libc::IPPROTO_TCP, libc::TCP_NODELAY, &i32::from(on).to_ne_bytes())
    }

    /// Sends keepalives every `every` while idle (`None`: none), so that a vanished peer is
    /// noticed.
    pub fn set_keepalive(&self, every: Option<Duration>) -> Result<()> {
        if let Some(d) = every {
            let secs = d.as_secs().clamp(1, i32::MAX as u64) as i32;
            self.sock
                .setsockopt(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, &secs.to_ne_bytes())?;
        }
        self.sock.setsockopt(
            rs::level::SOCKET,
            libc::SO_KEEPALIVE,
            &i32::from(every.is_some()).to_ne_bytes(),
        )
    }

    /// The pending error (`SO_ERROR`), cleared by reading it.
    pub fn take_error(&self) -> Result<Option<io::Error>> {
        let e = int_option(&self.sock, rs::level::SOCKET, libc::SO_ERROR)?;
        Ok((e != 0).then(|| io::Error::from_raw_os_error(e)))
    }

    /// Any socket option, decoded ([`SockOpt`]).
    pub fn option(&self, level: i32, name: i32) -> Result<Vec<u8>> {
        self.sock.getsockopt(level, name)
    }

    /// Maps `buf` so that the peer may write into it directly at `offset` (default: the
    /// buffer's address) with [`RStream::iowrite`]. The peer must have allowed mappings
    /// ([`StreamOptions::iomap_size`]); it learns of this one before the next data we send.
    /// The mapping lasts until the returned value is dropped.
    pub fn iomap(&self, buf: &HostBuffer, offset: Option<u64>) -> Result<IoMapping> {
        let backing = buf.backing();
        let addr = backing.addr();
        let len = backing.byte_len() as u64;
        let dyn_backing: Arc<dyn MemoryBacking> = backing.clone();
        let offset = self.sock.iomap(dyn_backing, addr, true, offset)?;
        Ok(IoMapping {
            sock: self.sock.clone(),
            addr,
            len,
            offset,
            _mem: backing,
        })
    }

    /// Writes `data` directly into the peer's buffer mapped at `offset` (and the ones after
    /// it); the peer's application is not told, but data sent afterwards arrives after it.
    /// Returns how much was written (less where the peer's mappings end). EINVAL if no
    /// mapping of the peer holds `offset`.
    pub fn iowrite(&self, data: &[u8], offset: u64) -> Result<usize> {
        self.sock.iowrite(data, offset, 0)
    }

    /// The socket, for [`PollItem::stream`].
    fn socket(&self) -> &rs::Socket {
        &self.sock
    }
}

impl io::Read for RStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl io::Read for &RStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.sock.recv(buf, 0).map_err(Into::into)
    }
}

impl io::Write for RStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl io::Write for &RStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.sock.send(buf, 0).map_err(Into::into)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for RStream {
    fn drop(&mut self) {
        self.sock.close();
    }
}

/// A buffer mapped by [`RStream::iomap`]; unmapped when dropped.
#[derive(Debug)]
pub struct IoMapping {
    sock: rs::Socket,
    addr: u64,
    len: u64,
    offset: u64,
    _mem: Arc<softverbs_device::mem::AtomicBuffer>,
}

impl IoMapping {
    /// The offset the peer writes at.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl Drop for IoMapping {
    fn drop(&mut self) {
        let _ = self.sock.iounmap(self.addr, self.len);
    }
}

/// A listening stream rsocket, like `TcpListener`. Connections are accepted as they arrive
/// and wait for [`RListener::accept`].
#[derive(Debug)]
pub struct RListener {
    sock: rs::Socket,
}

impl RListener {
    /// Listens on `addr` (port 0: one is chosen; see [`RListener::local_addr`]).
    pub fn bind(addr: SocketAddr) -> Result<Self> {
        Self::bind_with(addr, &StreamOptions::default())
    }

    /// Listens on `addr`; accepted streams get `opts`' sizes.
    pub fn bind_with(addr: SocketAddr, opts: &StreamOptions) -> Result<Self> {
        let sock = rs::Socket::new(af(&addr), libc::SOCK_STREAM, 0)?;
        opts.apply(&sock)?;
        sock.bind(addr)?;
        sock.listen(128)?;
        Ok(Self { sock })
    }

    /// The next connection and its peer's address.
    pub fn accept(&self) -> Result<(RStream, SocketAddr)> {
        let (sock, peer) = self.sock.accept()?;
        let peer = peer.ok_or_else(|| Error::invalid("the accepted connection has no peer address"))?;
        Ok((RStream { sock }, peer))
    }

    /// The address listened on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.sock.local_addr()
    }

    /// Makes [`RListener::accept`] return EAGAIN instead of waiting.
    pub fn set_nonblocking(&self, on: bool) -> Result<()> {
        set_nonblocking(&self.sock, on)
    }
}

impl Drop for RListener {
    fn drop(&mut self) {
        self.sock.close();
    }
}

/// A datagram rsocket, like `UdpSocket`. Datagrams up to 2 KiB (with a small header) travel
/// over UD once the peer's QP is known, over UDP before.
#[derive(Debug)]
pub struct RDatagram {
    sock: rs::Socket,
}

impl RDatagram {
    /// A socket bound to `addr`.
    pub fn bind(addr: SocketAddr) -> Result<Self> {
        let sock = rs::Socket::new(af(&addr), libc::SOCK_DGRAM, 0)?;
        sock.bind(addr)?;
        Ok(Self { sock })
    }

    /// Sets the default destination of [`RDatagram::send`] and filters what is received.
    pub fn connect(&self, addr: SocketAddr) -> Result<()> {
        self.sock.connect(addr)
    }

    /// Sends one datagram to `addr`.
    pub fn send_to(&self, buf: &[u8], addr: SocketAddr) -> Result<usize> {
        self.sock.send_to(buf, 0, Some(addr))
    }

    /// Sends one datagram to the connected peer.
    pub fn send(&self, buf: &[u8]) -> Result<usize> {
        self.sock.send(buf, 0)
    }

    /// Receives one datagram (truncated to `buf`) and its sender.
    pub fn recv_from(&self, buf: &mut [u8]) -> Result<(usize, SocketAddr)> {
        let (n, from) = self.sock.recv_from(buf, 0)?;
        Ok((
            n,
            from.ok_or_else(|| Error::invalid("a datagram without a sender"))?,
        ))
    }

    /// Receives one datagram.
    pub fn recv(&self, buf: &mut [u8]) -> Result<usize> {
        self.sock.recv(buf, 0)
    }

    /// Looks at the next datagram without taking it.
    pub fn peek_from(&self, buf: &mut [u8]) -> Result<(usize, SocketAddr)> {
        let (n, from) = self.sock.recv_from(buf, msg::PEEK)?;
        Ok((
            n,
            from.ok_or_else(|| Error::invalid("a datagram without a sender"))?,
        ))
    }

    /// The local address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.sock.local_addr()
    }

    /// The connected peer.
    pub fn peer_addr(&self) -> Result<SocketAddr> {
        self.sock.peer_addr()
    }

    /// Makes sends and receives return EAGAIN instead of waiting.
    pub fn set_nonblocking(&self, on: bool) -> Result<()> {
        set_nonblocking(&self.sock, on)
    }
}

impl Drop for RDatagram {
    fn drop(&mut self) {
        self.sock.close();
    }
}

/// An entry of [`poll`].
#[derive(Debug)]
pub struct PollItem<'a> {
    entry: rs::PollEntry<'a>,
}

impl<'a> PollItem<'a> {
    /// Watches a stream for `events` ([`POLLIN`], [`POLLOUT`]).
    pub fn stream(s: &'a RStream, events: i16) -> Self {
        Self::socket(s.socket(), events)
    }

    /// Watches a listener: [`POLLIN`] when a connection waits.
    pub fn listener(l: &'a RListener, events: i16) -> Self {
        Self::socket(&l.sock, events)
    }

    /// Watches a datagram socket.
    pub fn datagram(d: &'a RDatagram, events: i16) -> Self {
        Self::socket(&d.sock, events)
    }

    /// Watches an ordinary file descriptor.
    pub fn fd(fd: BorrowedFd<'a>, events: i16) -> Self {
        Self {
            entry: rs::PollEntry::new(rs::PollTarget::Fd(fd), events),
        }
    }

    fn socket(s: &'a rs::Socket, events: i16) -> Self {
        Self {
            entry: rs::PollEntry::new(rs::PollTarget::Socket(s), events),
        }
    }

    /// What happened, after [`poll`].
    pub fn revents(&self) -> i16 {
        self.entry.revents
    }
}

/// Waits until an item is ready or `timeout` passes (`None`: forever); returns how many are
/// ready (0 after a timeout). Sleeps without using the CPU.
pub fn poll(items: &mut [PollItem<'_>], timeout: Option<Duration>) -> Result<usize> {
    let mut entries: Vec<rs::PollEntry<'_>> = items.iter().map(|i| i.entry).collect();
    let n = rs::poll(&mut entries, timeout)?;
    for (i, e) in items.iter_mut().zip(entries) {
        i.entry.revents = e.revents;
    }
    Ok(n)
}
