//! Socket options: the ones `rsocket(7)` lists (and librdmacm implements), decoded from and
//! encoded to the bytes `setsockopt`/`getsockopt` pass.

use nix::libc;
use softverbs_engine::Result;

use super::errno;

/// Option levels.
pub mod level {
    /// `SOL_SOCKET`.
    pub const SOCKET: i32 = nix::libc::SOL_SOCKET;
    /// `IPPROTO_IP` (datagram sockets pass these to their UDP socket).
    pub const IP: i32 = nix::libc::IPPROTO_IP;
    /// `IPPROTO_TCP`.
    pub const TCP: i32 = nix::libc::IPPROTO_TCP;
    /// `IPPROTO_IPV6`.
    pub const IPV6: i32 = nix::libc::IPPROTO_IPV6;
    /// `SOL_RDMA` (`<rdma/rsocket.h>`): the RDMA resources behind a socket.
    pub const RDMA: i32 = 0x10000;
}

/// `SOL_RDMA` option names (`<rdma/rsocket.h>`).
pub mod name {
    /// Send queue depth.
    pub const RDMA_SQSIZE: i32 = 0;
    /// Receive queue depth.
    pub const RDMA_RQSIZE: i32 = 1;
    /// Bytes sent inline.
    pub const RDMA_INLINE: i32 = 2;
    /// Entries of the iomap table the peer may map buffers into.
    pub const RDMA_IOMAPSIZE: i32 = 3;
    /// The path (`struct ibv_path_data`).
    pub const RDMA_ROUTE: i32 = 4;
}

/// A socket option and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SockOpt {
    /// `SO_REUSEADDR`.
    ReuseAddr(bool),
    /// `SO_KEEPALIVE`: send keepalives after [`SockOpt::KeepIdle`] seconds without traffic.
    KeepAlive(bool),
    /// `SO_OOBINLINE` (kept; rsockets have no out-of-band data).
    OobInline(bool),
    /// `SO_RCVBUF`: set takes the wanted size, get gives twice that, as Linux.
    RcvBuf(u32),
    /// `SO_SNDBUF`: as [`SockOpt::RcvBuf`].
    SndBuf(u32),
    /// `SO_LINGER` (`struct linger`).
    Linger {
        /// `l_onoff`.
        on: bool,
        /// `l_linger` in seconds.
        secs: i32,
    },
    /// `SO_ERROR` (get only; reading it clears it).
    Error(i32),
    /// `SO_TYPE` (get only).
    Type(i32),
    /// `SO_DOMAIN` (get only).
    Domain(i32),
    /// `SO_ACCEPTCONN` (get only).
    AcceptConn(bool),
    /// `TCP_NODELAY` (kept; every send leaves at once).
    NoDelay(bool),
    /// `TCP_MAXSEG`: set is accepted and ignored; get gives the path MTU.
    MaxSeg(u32),
    /// `TCP_KEEPIDLE`: seconds between keepalives (positive).
    KeepIdle(i32),
    /// `TCP_KEEPCNT` (accepted; a reliable connection fails by itself).
    KeepCnt(i32),
    /// `TCP_KEEPINTVL` (accepted, as `TCP_KEEPCNT`).
    KeepIntvl(i32),
    /// `IPV6_V6ONLY`.
    V6Only(bool),
    /// `RDMA_SQSIZE`.
    SqSize(u32),
    /// `RDMA_RQSIZE`.
    RqSize(u32),
    /// `RDMA_INLINE`.
    Inline(u32),
    /// `RDMA_IOMAPSIZE`.
    IomapSize(u32),
    /// `RDMA_ROUTE`: `struct ibv_path_data` entries.
    Route(Vec<u8>),
    /// An integer option of the IP layer that only a datagram socket's UDP socket takes.
    Ip {
        /// Level (`IPPROTO_IP`, `IPPROTO_IPV6` or `SOL_SOCKET`).
        level: i32,
        /// Option name.
        name: i32,
        /// Value.
        value: i32,
    },
}

fn int(v: &[u8]) -> Result<i32> {
    let b: [u8; 4] = v
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| errno(libc::EINVAL))?;
    Ok(i32::from_ne_bytes(b))
}

fn size(v: &[u8]) -> Result<u32> {
    // As librdmacm, sizes are read as unsigned; a negative int becomes huge and is then
    // clamped by whoever uses it.
    int(v).map(|i| i as u32)
}

impl SockOpt {
    /// Decodes `setsockopt(level, name, value)`. EINVAL for a value shorter than the option's
    /// type, ENOPROTOOPT for options rsockets do not have.
    pub fn decode(level: i32, name: i32, value: &[u8]) -> Result<Self> {
        use libc::*;
        Ok(match (level, name) {
            (SOL_SOCKET, SO_REUSEADDR) => Self::ReuseAddr(int(value)? != 0),
            (SOL_SOCKET, SO_KEEPALIVE) => Self::KeepAlive(int(value)? != 0),
            (SOL_SOCKET, SO_OOBINLINE) => Self::OobInline(int(value)? != 0),
            (SOL_SOCKET, SO_RCVBUF) => Self::RcvBuf(size(value)?),
            (SOL_SOCKET, SO_SNDBUF) => Self::SndBuf(size(value)?),
            (SOL_SOCKET, SO_LINGER) => {
                if value.len() < 8 {
                    return Err(errno(EINVAL));
                }
                Self::Linger {
                    on: int(&value[..4])? != 0,
                    secs: int(&value[4..8])?,
                }
            }
            (SOL_SOCKET, SO_BROADCAST | SO_REUSEPORT | SO_PRIORITY)
            | (IPPROTO_IP, IP_TOS | IP_TTL | IP_MULTICAST_TTL | IP_MULTICAST_LOOP)
            | (IPPROTO_IPV6, IPV6_UNICAST_HOPS | IPV6_MULTICAST_HOPS | IPV6_TCLASS) => Self::Ip {
                level,
                name,
                value: int(value)?,
            },
            (IPPROTO_TCP, TCP_NODELAY) => Self::NoDelay(int(value)? != 0),
            (IPPROTO_TCP, TCP_MAXSEG) => Self::MaxSeg(size(value)?),
            (IPPROTO_TCP, TCP_KEEPIDLE) => Self::KeepIdle(int(value)?),
            (IPPROTO_TCP, TCP_KEEPCNT) => Self::KeepCnt(int(value)?),
            (IPPROTO_TCP, TCP_KEEPINTVL) => Self::KeepIntvl(int(value)?),
            (IPPROTO_IPV6, IPV6_V6ONLY) => Self::V6Only(int(value)? != 0),
            (level::RDMA, name::RDMA_SQSIZE) => Self::SqSize(size(value)?),
            (level::RDMA, name::RDMA_RQSIZE) => Self::RqSize(size(value)?),
            (level::RDMA, name::RDMA_INLINE) => Self::Inline(size(value)?),
            (level::RDMA, name::RDMA_IOMAPSIZE) => Self::IomapSize(size(value)?),
            (level::RDMA, name::RDMA_ROUTE) => Self::Route(value.to_vec()),
            _ => return Err(errno(ENOPROTOOPT)),
        })
    }

    /// The bytes `getsockopt` returns.
    pub fn encode(&self) -> Vec<u8> {
        let i = |v: i32| v.to_ne_bytes().to_vec();
        match self {
            Self::ReuseAddr(b)
            | Self::KeepAlive(b)
            | Self::OobInline(b)
            | Self::AcceptConn(b)
            | Self::NoDelay(b)
            | Self::V6Only(b) => i(i32::from(*b)),
            Self::RcvBuf(v)
            | Self::SndBuf(v)
            | Self::MaxSeg(v)
            | Self::SqSize(v)
            | Self::RqSize(v)
            | Self::Inline(v)
            | Self::IomapSize(v) => i(*v as i32),
            Self::Error(v)
            | Self::Type(v)
            | Self::Domain(v)
            | Self::KeepIdle(v)
            | Self::KeepCnt(v)
            | Self::KeepIntvl(v) => i(*v),
            Self::Ip { value, .. } => i(*value),
            Self::Linger { on, secs } => {
                let mut v = i(i32::from(*on));
                v.extend_from_slice(&secs.to_ne_bytes());
                v
            }
            Self::Route(b) => b.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_and_encode() {
        let one = 1i32.to_ne_bytes();
        assert_eq!(
            SockOpt::decode(libc::SOL_SOCKET, libc::SO_REUSEADDR, &one).unwrap(),
            SockOpt::ReuseAddr(true)
        );
        assert_eq!(
            SockOpt::decode(level::RDMA, name::RDMA_INLINE, &64i32.to_ne_bytes()).unwrap(),
            SockOpt::Inline(64)
        );
        let short = SockOpt::decode(libc::SOL_SOCKET, libc::SO_RCVBUF, &[1, 0]).unwrap_err();
        assert_eq!(short.errno(), libc::EINVAL);
        let unknown = SockOpt::decode(libc::SOL_SOCKET, libc::SO_PASSCRED, &one).unwrap_err();
        assert_eq!(unknown.errno(), libc::ENOPROTOOPT);
        let linger = SockOpt::Linger { on: true, secs: 5 };
        assert_eq!(
            SockOpt::decode(libc::SOL_SOCKET, libc::SO_LINGER, &linger.encode()).unwrap(),
            linger
        );
        assert_eq!(SockOpt::Error(111).encode(), 111i32.to_ne_bytes());
    }
}
