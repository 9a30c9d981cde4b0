//! rsockets: librdmacm's socket API over RDMA (`rsocket(7)`), on the device's connection
//! manager, QPs, CQs and memory regions, speaking librdmacm's wire protocol
//! ([`softverbs_wire::rsocket`]) so that either end may be librdmacm's.
//!
//! - [`Stream`]: `SOCK_STREAM` over an RC connection set up by the connection manager
//!   ([`crate::cm::CmId`], port space TCP). Data is copied into a registered send buffer and
//!   RDMA-written into the peer's receive buffer with an immediate saying how much arrived;
//!   credits and buffer updates flow back the same way. A listening socket accepts requests
//!   on a thread of its own as they come (as librdmacm's service thread does), so a connect
//!   completes without the server calling `accept`, as with TCP.
//! - [`Datagram`]: `SOCK_DGRAM` over UD QPs, one per local address in use, reached first
//!   through an ordinary UDP socket that tells each peer the QP number (librdmacm's datagram
//!   protocol).
//! - [`poll`]: `rpoll`/`rselect` over rsockets and ordinary file descriptors together.
//!
//! Blocking calls sleep in `poll(2)` on the completion channel, the CM event channel, the
//! UDP socket or the accept queue they wait for, plus an eventfd through which a thread that
//! made progress on a socket wakes the others waiting on it: an idle socket costs no CPU.
//! Errors carry the errno a socket gives (ECONNREFUSED, ENOTCONN, EPIPE, EAGAIN,
//! EINPROGRESS, ...). Defaults come from librdmacm's configuration files in
//! `/etc/rdma/rsocket/` when present.

mod dgram;
mod fd;
mod options;
mod poll;
mod stream;
mod wait;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use softverbs_engine::{Error, Result};

use crate::context::Context;
use crate::device::Device;
use crate::pd::Pd;

pub use dgram::Datagram;
pub use options::{level, name, SockOpt};
pub use poll::{poll, PollEntry, PollTarget, POLLERR, POLLHUP, POLLIN, POLLNVAL, POLLOUT};
pub use stream::Stream;

/// `MSG_*` flags the rsocket calls honour.
pub mod msg {
    /// Look at the data without consuming it.
    pub const PEEK: i32 = nix::libc::MSG_PEEK;
    /// Do not block this call.
    pub const DONTWAIT: i32 = nix::libc::MSG_DONTWAIT;
    /// Receive: wait until the whole buffer is filled (or the stream ends).
    pub const WAITALL: i32 = nix::libc::MSG_WAITALL;
}

/// The address family of a socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Domain {
    /// `AF_INET`.
    Inet,
    /// `AF_INET6`.
    Inet6,
}

impl Domain {
    /// From `AF_INET`/`AF_INET6`; EAFNOSUPPORT otherwise (`AF_IB` included: addresses here
    /// are IP addresses).
    pub fn from_raw(af: i32) -> Result<Self> {
        match af {
            nix::libc::AF_INET => Ok(Self::Inet),
            nix::libc::AF_INET6 => Ok(Self::Inet6),
            _ => Err(errno(nix::libc::EAFNOSUPPORT)),
        }
    }

    /// `AF_INET` or `AF_INET6`.
    pub fn raw(self) -> i32 {
        match self {
            Self::Inet => nix::libc::AF_INET,
            Self::Inet6 => nix::libc::AF_INET6,
        }
    }

    /// The unspecified address of the family, port 0.
    fn any(self) -> SocketAddr {
        match self {
            Self::Inet => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
            Self::Inet6 => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        }
    }
}

/// How `shutdown` closes a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// No more receiving (`SHUT_RD`).
    Read,
    /// No more sending: the peer's receives end (`SHUT_WR`).
    Write,
    /// Both (`SHUT_RDWR`).
    Both,
}

impl Shutdown {
    /// From `SHUT_RD`/`SHUT_WR`/`SHUT_RDWR`; EINVAL otherwise.
    pub fn from_raw(how: i32) -> Result<Self> {
        match how {
            nix::libc::SHUT_RD => Ok(Self::Read),
            nix::libc::SHUT_WR => Ok(Self::Write),
            nix::libc::SHUT_RDWR => Ok(Self::Both),
            _ => Err(errno(nix::libc::EINVAL)),
        }
    }
}

/// An error with the given errno.
pub(crate) fn errno(e: i32) -> Error {
    Error::Io(std::io::Error::from_raw_os_error(e))
}

/// Defaults for new sockets: librdmacm's, or what `/etc/rdma/rsocket/` says.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Defaults {
    pub(crate) mem: u32,
    pub(crate) wmem: u32,
    pub(crate) sqsize: u32,
    pub(crate) rqsize: u32,
    pub(crate) inline: u32,
    pub(crate) iomap_size: u32,
    /// Microseconds a blocking call keeps polling before it sleeps.
    pub(crate) polling_time: u32,
    /// Longest single sleep of `poll` in milliseconds (a safeguard, as in librdmacm).
    pub(crate) wake_up_interval: u32,
}

/// Where librdmacm's administrator settings live.
const CONF_DIR: &str = "/etc/rdma/rsocket";

pub(crate) fn defaults() -> &'static Defaults {
    static D: OnceLock<Defaults> = OnceLock::new();
    D.get_or_init(|| {
        let read = |name: &str, default: u32| -> u32 {
            std::fs::read_to_string(format!("{CONF_DIR}/{name}"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(default)
        };
        let iomap = read("iomap_size", 0);
        Defaults {
            mem: read("mem_default", 1 << 17).max(1),
            wmem: {
                let w = read("wmem_default", 1 << 17);
                if w < stream::SNDLOWAT {
                    stream::SNDLOWAT << 1
                } else {
                    w
                }
            },
            sqsize: read("sqsize_default", 384).min(0xFFFF),
            rqsize: read("rqsize_default", 384).min(0xFFFF),
            inline: read("inline_default", 64).min(0xFFFF),
            // Rounded to what the 8-bit scale of the connection data can say.
            iomap_size: softverbs_wire::rsocket::scale_to_value(softverbs_wire::rsocket::value_to_scale(
                iomap,
            )),
            polling_time: read("polling_time", 10),
            wake_up_interval: read("wake_up_interval", 5000).max(1),
        }
    })
}

/// The verbs context and protection domain rsockets use on `device`: one of each per device,
/// as librdmacm keeps (its default PD of `rdma_create_qp`).
pub(crate) fn resources(device: &Device) -> Result<(Arc<Context>, Arc<Pd>)> {
    type PerDevice = (Device, Arc<Context>, Arc<Pd>);
    static ALL: Mutex<Vec<PerDevice>> = Mutex::new(Vec::new());
    let mut all = ALL.lock();
    if let Some((_, c, p)) = all.iter().find(|(d, _, _)| d == device) {
        return Ok((c.clone(), p.clone()));
    }
    let ctx = Context::open(device)?;
    let pd = Pd::alloc(&ctx)?;
    all.push((device.clone(), ctx.clone(), pd.clone()));
    Ok((ctx, pd))
}

/// An rsocket of either type, as `rsocket(domain, type, protocol)` makes it.
#[derive(Debug, Clone)]
pub enum Socket {
    /// `SOCK_STREAM`.
    Stream(Arc<Stream>),
    /// `SOCK_DGRAM`.
    Datagram(Arc<Datagram>),
}

impl Socket {
    /// `rsocket`: `domain` AF_INET or AF_INET6 (EAFNOSUPPORT otherwise), `ty` SOCK_STREAM or
    /// SOCK_DGRAM, optionally with SOCK_NONBLOCK and SOCK_CLOEXEC (ESOCKTNOSUPPORT for other
    /// types), `protocol` 0 or the type's (IPPROTO_TCP, IPPROTO_UDP; EPROTONOSUPPORT otherwise).
    pub fn new(domain: i32, ty: i32, protocol: i32) -> Result<Self> {
        use nix::libc::{IPPROTO_TCP, IPPROTO_UDP, SOCK_CLOEXEC, SOCK_DGRAM, SOCK_NONBLOCK, SOCK_STREAM};
        let domain = Domain::from_raw(domain)?;
        let nonblocking = ty & SOCK_NONBLOCK != 0;
        let s = match ty & !(SOCK_NONBLOCK | SOCK_CLOEXEC) {
            SOCK_STREAM if protocol == 0 || protocol == IPPROTO_TCP => Self::Stream(Stream::new(domain)?),
            SOCK_DGRAM if protocol == 0 || protocol == IPPROTO_UDP => Self::Datagram(Datagram::new(domain)?),
            SOCK_STREAM | SOCK_DGRAM => return Err(errno(nix::libc::EPROTONOSUPPORT)),
            _ => return Err(errno(nix::libc::ESOCKTNOSUPPORT)),
        };
        if nonblocking {
            s.fcntl(nix::libc::F_SETFL, nix::libc::O_NONBLOCK)?;
        }
        Ok(s)
    }

    /// The number the socket is known by: a file descriptor it owns for its lifetime (the CM
    /// event channel's of a stream, the UDP socket of a datagram socket, as in librdmacm), so
    /// it never equals another open descriptor of the process.
    pub fn number(&self) -> i32 {
        match self {
            Self::Stream(s) => s.number(),
            Self::Datagram(d) => d.number(),
        }
    }

    /// `rbind`.
    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        match self {
            Self::Stream(s) => s.bind(addr),
            Self::Datagram(d) => d.bind(addr),
        }
    }

    /// `rlisten` (EOPNOTSUPP on a datagram socket).
    pub fn listen(&self, backlog: i32) -> Result<()> {
        match self {
            Self::Stream(s) => s.listen(backlog),
            Self::Datagram(_) => Err(errno(nix::libc::EOPNOTSUPP)),
        }
    }

    /// `raccept`: the new connection and its peer's address (EOPNOTSUPP on a datagram socket).
    pub fn accept(&self) -> Result<(Self, Option<SocketAddr>)> {
        match self {
            Self::Stream(s) => {
                let c = s.accept()?;
                let peer = c.peer_addr().ok();
                Ok((Self::Stream(c), peer))
            }
            Self::Datagram(_) => Err(errno(nix::libc::EOPNOTSUPP)),
        }
    }

    /// `rconnect`.
    pub fn connect(&self, addr: SocketAddr) -> Result<()> {
        match self {
            Self::Stream(s) => s.connect(addr),
            Self::Datagram(d) => d.connect(addr),
        }
    }

    /// `rshutdown`.
    pub fn shutdown(&self, how: Shutdown) -> Result<()> {
        match self {
            Self::Stream(s) => s.shutdown(how),
            Self::Datagram(d) => d.shutdown(how),
        }
    }

    /// `rclose`: ends the connection in order (the peer reads what was sent, then the end)
    /// and frees everything.
    pub fn close(&self) {
        match self {
            Self::Stream(s) => s.close(),
            Self::Datagram(d) => d.close(),
        }
    }

    /// `rsend`/`rwrite` with `MSG_*` flags.
    pub fn send(&self, buf: &[u8], flags: i32) -> Result<usize> {
        self.send_vectored(&[buf], flags)
    }

    /// `rsendmsg`/`rwritev`: the pieces in order, as one datagram for datagram sockets.
    pub fn send_vectored(&self, bufs: &[&[u8]], flags: i32) -> Result<usize> {
        match self {
            Self::Stream(s) => s.send_vectored(bufs, flags),
            Self::Datagram(d) => d.send_vectored(bufs, flags, None),
        }
    }

    /// `rsendto`: EISCONN with an address on a stream socket, as for TCP.
    pub fn send_to(&self, buf: &[u8], flags: i32, dst: Option<SocketAddr>) -> Result<usize> {
        self.send_msg(&[buf], flags, dst)
    }

    /// `rsendmsg` with a destination (`msg_name`): the pieces as one message to `dst`.
    pub fn send_msg(&self, bufs: &[&[u8]], flags: i32, dst: Option<SocketAddr>) -> Result<usize> {
        match self {
            Self::Stream(s) if dst.is_none() => s.send_vectored(bufs, flags),
            Self::Stream(_) => Err(errno(nix::libc::EISCONN)),
            Self::Datagram(d) => d.send_vectored(bufs, flags, dst),
        }
    }

    /// `rrecv`/`rread` with `MSG_*` flags: 0 once a stream's peer has ended it.
    pub fn recv(&self, buf: &mut [u8], flags: i32) -> Result<usize> {
        self.recv_from(buf, flags).map(|(n, _)| n)
    }

    /// `rrecvfrom`: the data and where it came from (a stream's peer).
    pub fn recv_from(&self, buf: &mut [u8], flags: i32) -> Result<(usize, Option<SocketAddr>)> {
        match self {
            Self::Stream(s) => {
                let n = s.recv_vectored(&mut [buf], flags)?;
                Ok((n, s.peer_addr().ok()))
            }
            Self::Datagram(d) => d.recv_from(&mut [buf], flags),
        }
    }

    /// `rrecvmsg`/`rreadv`: fills the pieces in order (one datagram for datagram sockets).
    pub fn recv_vectored(&self, bufs: &mut [&mut [u8]], flags: i32) -> Result<(usize, Option<SocketAddr>)> {
        match self {
            Self::Stream(s) => Ok((s.recv_vectored(bufs, flags)?, None)),
            Self::Datagram(d) => d.recv_from(bufs, flags),
        }
    }

    /// `rgetpeername` (ENOTCONN if there is no peer).
    pub fn peer_addr(&self) -> Result<SocketAddr> {
        match self {
            Self::Stream(s) => s.peer_addr(),
            Self::Datagram(d) => d.peer_addr(),
        }
    }

    /// `rgetsockname`.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        match self {
            Self::Stream(s) => s.local_addr(),
            Self::Datagram(d) => d.local_addr(),
        }
    }

    /// `rsetsockopt` with the option's bytes as C passes them.
    pub fn setsockopt(&self, level: i32, name: i32, value: &[u8]) -> Result<()> {
        let opt = SockOpt::decode(level, name, value)?;
        match self {
            Self::Stream(s) => s.set_option(opt),
            Self::Datagram(d) => d.set_option(opt),
        }
    }

    /// `rgetsockopt`: the option's bytes as C receives them.
    pub fn getsockopt(&self, level: i32, name: i32) -> Result<Vec<u8>> {
        let opt = match self {
            Self::Stream(s) => s.get_option(level, name)?,
            Self::Datagram(d) => d.get_option(level, name)?,
        };
        Ok(opt.encode())
    }

    /// `rfcntl`: F_GETFL, F_SETFL (O_NONBLOCK), F_GETFD, F_SETFD; EINVAL for other commands.
    pub fn fcntl(&self, cmd: i32, arg: i32) -> Result<i32> {
        match self {
            Self::Stream(s) => s.fcntl(cmd, arg),
            Self::Datagram(d) => d.fcntl(cmd, arg),
        }
    }

    /// `riomap` (streams only; EOPNOTSUPP otherwise): see [`Stream::iomap`].
    pub fn iomap(
        &self,
        backing: Arc<dyn crate::mem::MemoryBacking>,
        addr: u64,
        writable: bool,
        offset: Option<u64>,
    ) -> Result<u64> {
        match self {
            Self::Stream(s) => s.iomap(backing, addr, writable, offset),
            Self::Datagram(_) => Err(errno(nix::libc::EOPNOTSUPP)),
        }
    }

    /// `riounmap` (streams only).
    pub fn iounmap(&self, addr: u64, len: u64) -> Result<()> {
        match self {
            Self::Stream(s) => s.iounmap(addr, len),
            Self::Datagram(_) => Err(errno(nix::libc::EOPNOTSUPP)),
        }
    }

    /// `riowrite` (streams only): see [`Stream::iowrite`].
    pub fn iowrite(&self, buf: &[u8], offset: u64, flags: i32) -> Result<usize> {
        match self {
            Self::Stream(s) => s.iowrite(buf, offset, flags),
            Self::Datagram(_) => Err(errno(nix::libc::EOPNOTSUPP)),
        }
    }
}
