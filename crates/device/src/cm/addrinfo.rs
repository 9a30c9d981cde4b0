//! `rdma_getaddrinfo`: names and services to the addresses an id binds to or connects to.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};

use softverbs_engine::types::QpType;

use super::PortSpace;

/// `RAI_*` flags of `struct rdma_addrinfo`.
pub mod rai {
    /// The result is for a listener (`src` is set).
    pub const PASSIVE: u32 = 1;
    /// `node` is a numeric address: no name lookup.
    pub const NUMERICHOST: u32 = 2;
    /// No route resolution.
    pub const NOROUTE: u32 = 4;
    /// `hints.family` restricts the addresses.
    pub const FAMILY: u32 = 8;
}

/// `EAI_*` errors (netdb.h values), as `rdma_getaddrinfo` returns them.
pub mod eai {
    /// `EAI_BADFLAGS`.
    pub const BADFLAGS: i32 = -1;
    /// `EAI_NONAME`: the name does not resolve, or neither node nor service was given.
    pub const NONAME: i32 = -2;
    /// `EAI_FAMILY`.
    pub const FAMILY: i32 = -6;
    /// `EAI_SERVICE`: the service is not a port number.
    pub const SERVICE: i32 = -8;
}

/// `AF_INET`.
pub const AF_INET: i32 = 2;
/// `AF_INET6`.
pub const AF_INET6: i32 = 10;

/// What the caller asks for (the fields of `hints` softverbs honours).
#[derive(Debug, Clone, Default)]
pub struct AddrHints {
    /// `RAI_*` flags.
    pub flags: u32,
    /// `AF_INET`, `AF_INET6` or 0 (any).
    pub family: i32,
    /// QP type (`None`: RC).
    pub qp_type: Option<QpType>,
    /// Port space (`None`: from the QP type, UDP for UD, else TCP).
    pub port_space: Option<PortSpace>,
    /// A source address for active results.
    pub src: Option<SocketAddr>,
}

/// One `struct rdma_addrinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddrInfo {
    /// `RAI_*` flags of the result.
    pub flags: u32,
    /// `AF_INET` or `AF_INET6`.
    pub family: i32,
    /// QP type.
    pub qp_type: QpType,
    /// Port space.
    pub port_space: PortSpace,
    /// Local address (passive results, or the hint's source).
    pub src: Option<SocketAddr>,
    /// Peer address (active results).
    pub dst: Option<SocketAddr>,
}

fn family_of(ip: &IpAddr) -> i32 {
    if ip.is_ipv4() {
        AF_INET
    } else {
        AF_INET6
    }
}

/// `rdma_getaddrinfo(node, service, hints)`: the addresses `node` (a name or numeric address)
/// and `service` (a port number) stand for, for a listener with `RAI_PASSIVE` (no node: the
/// wildcard address) or for connecting otherwise. Errors are `EAI_*` values.
pub fn getaddrinfo(
    node: Option<&str>,
    service: Option<&str>,
    hints: &AddrHints,
) -> Result<Vec<AddrInfo>, i32> {
    if hints.flags & !(rai::PASSIVE | rai::NUMERICHOST | rai::NOROUTE | rai::FAMILY) != 0 {
        return Err(eai::BADFLAGS);
    }
    if node.is_none() && service.is_none() {
        return Err(eai::NONAME);
    }
    if ![0, AF_INET, AF_INET6].contains(&hints.family) {
        return Err(eai::FAMILY);
    }
    let port = match service {
        None => 0,
        Some(s) => s.parse::<u16>().map_err(|_| eai::SERVICE)?,
    };
    let passive = hints.flags & rai::PASSIVE != 0;
    let ips: Vec<IpAddr> = match node {
        None if passive => vec![if hints.family == AF_INET6 {
            IpAddr::V6(Ipv6Addr::UNSPECIFIED)
        } else {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        }],
        None => vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
        Some(n) => match n.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) if hints.flags & rai::NUMERICHOST != 0 => return Err(eai::NONAME),
            Err(_) => {
                let mut v: Vec<IpAddr> = (n, port)
                    .to_socket_addrs()
                    .map_err(|_| eai::NONAME)?
                    .map(|a| a.ip())
                    .collect();
                v.dedup();
                v
            }
        },
    };
    let qp_type = hints.qp_type.unwrap_or(QpType::Rc);
    let port_space = hints.port_space.unwrap_or(if qp_type == QpType::Ud {
        PortSpace::Udp
    } else {
        PortSpace::Tcp
    });
    let out: Vec<AddrInfo> = ips
        .into_iter()
        .filter(|ip| hints.family == 0 || family_of(ip) == hints.family)
        .map(|ip| {
            let addr = SocketAddr::new(ip, port);
            AddrInfo {
                flags: hints.flags,
                family: family_of(&ip),
                qp_type,
                port_space,
                src: if passive { Some(addr) } else { hints.src },
                dst: (!passive).then_some(addr),
            }
        })
        .collect();
    if out.is_empty() {
        return Err(eai::NONAME);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passive_active_and_errors() {
        let passive = AddrHints {
            flags: rai::PASSIVE,
            ..AddrHints::default()
        };
        let r = getaddrinfo(None, Some("7471"), &passive).unwrap();
        assert_eq!(r[0].src, Some("0.0.0.0:7471".parse().unwrap()));
        assert_eq!(
            (r[0].dst, r[0].port_space, r[0].qp_type),
            (None, PortSpace::Tcp, QpType::Rc)
        );
        let ud = AddrHints {
            qp_type: Some(QpType::Ud),
            flags: rai::NUMERICHOST,
            ..AddrHints::default()
        };
        let r = getaddrinfo(Some("127.0.0.1"), Some("7174"), &ud).unwrap();
        assert_eq!(r[0].dst, Some("127.0.0.1:7174".parse().unwrap()));
        assert_eq!((r[0].port_space, r[0].family), (PortSpace::Udp, AF_INET));
        assert_eq!(getaddrinfo(Some("localhost"), Some("x"), &ud), Err(eai::SERVICE));
        assert_eq!(
            getaddrinfo(Some("localhost"), Some("1"), &ud),
            Err(eai::NONAME),
            "not numeric"
        );
        assert_eq!(getaddrinfo(None, None, &ud), Err(eai::NONAME));
        let v6 = AddrHints {
            flags: rai::FAMILY,
            family: AF_INET6,
            ..AddrHints::default()
        };
        assert_eq!(getaddrinfo(Some("127.0.0.1"), Some("1"), &v6), Err(eai::NONAME));
        let bad = AddrHints {
            flags: 0x100,
            ..AddrHints::default()
        };
        assert_eq!(getaddrinfo(None, Some("1"), &bad), Err(eai::BADFLAGS));
    }
}
