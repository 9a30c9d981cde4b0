//! `rdma_getaddrinfo`: names and services to the addresses an id binds to or connects to.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, ToSocketAddrs};

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
    /// A destination address, used when neither node nor service is given.
    pub dst: Option<SocketAddr>,
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
/// wildcard address) or for connecting otherwise. With neither node nor service the one result
/// is the hints' own flags, family, types and addresses, as librdmacm gives (libfabric's verbs
/// provider asks so for an address it already holds). Errors are `EAI_*` values.
pub fn getaddrinfo(
    node: Option<&str>,
    service: Option<&str>,
    hints: &AddrHints,
) -> Result<Vec<AddrInfo>, i32> {
    if hints.flags & !(rai::PASSIVE | rai::NUMERICHOST | rai::NOROUTE | rai::FAMILY) != 0 {
        return Err(eai::BADFLAGS);
    }
    let qp_type = hints.qp_type.unwrap_or(QpType::Rc);
    let port_space = hints.port_space.unwrap_or(if qp_type == QpType::Ud {
        PortSpace::Udp
    } else {
        PortSpace::Tcp
    });
    if node.is_none() && service.is_none() {
        return Ok(vec![AddrInfo {
            flags: hints.flags,
            family: hints.family,
            qp_type,
            port_space,
            src: hints.src,
            dst: hints.dst,
        }]);
    }
    if ![0, AF_INET, AF_INET6].contains(&hints.family) {
        return Err(eai::FAMILY);
    }
    let port = match service {
        None => 0,
        Some(s) => s.parse::<u16>().map_err(|_| eai::SERVICE)?,
    };
    let passive = hints.flags & rai::PASSIVE != 0;
    let addrs: Vec<SocketAddr> = match node {
        None if passive => vec![SocketAddr::new(
            if hints.family == AF_INET6 {
                IpAddr::V6(Ipv6Addr::UNSPECIFIED)
            } else {
                IpAddr::V4(Ipv4Addr::UNSPECIFIED)
            },
            port,
        )],
        None => vec![SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)],
        Some(n) => match numeric(n, port) {
            Some(a) => vec![a],
            None if hints.flags & rai::NUMERICHOST != 0 => return Err(eai::NONAME),
            None => {
                let mut v: Vec<SocketAddr> = (n, port).to_socket_addrs().map_err(|_| eai::NONAME)?.collect();
                v.dedup();
                v
            }
        },
    };
    let out: Vec<AddrInfo> = addrs
        .into_iter()
        .filter(|a| hints.family == 0 || family_of(&a.ip()) == hints.family)
        .map(|addr| AddrInfo {
            flags: hints.flags,
            family: family_of(&addr.ip()),
            qp_type,
            port_space,
            src: if passive { Some(addr) } else { hints.src },
            dst: (!passive).then_some(addr),
        })
        .collect();
    if out.is_empty() {
        return Err(eai::NONAME);
    }
    Ok(out)
}

/// A numeric host: an IPv4 or IPv6 address, the latter with an optional `%` scope (an
/// interface name or number, as getaddrinfo(3) takes for link-local addresses).
fn numeric(node: &str, port: u16) -> Option<SocketAddr> {
    if let Ok(ip) = node.parse::<IpAddr>() {
        return Some(SocketAddr::new(ip, port));
    }
    let (addr, scope) = node.split_once('%')?;
    let ip = addr.parse::<Ipv6Addr>().ok()?;
    let scope = match scope.parse::<u32>() {
        Ok(n) => n,
        Err(_) => nix::net::if_::if_nametoindex(scope).ok()?,
    };
    Some(SocketAddr::V6(SocketAddrV6::new(ip, port, 0, scope)))
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
        // A link-local address with its interface, as libfabric names them.
        let numeric = AddrHints {
            flags: rai::PASSIVE | rai::NUMERICHOST,
            ..AddrHints::default()
        };
        let r = getaddrinfo(Some("fe80::1%lo"), None, &numeric).unwrap();
        let lo = nix::net::if_::if_nametoindex("lo").unwrap();
        assert_eq!(
            r[0].src,
            Some(SocketAddr::V6(SocketAddrV6::new(
                "fe80::1".parse().unwrap(),
                0,
                0,
                lo
            )))
        );
        assert_eq!(r[0].family, AF_INET6);
        let r = getaddrinfo(Some("fe80::2%7"), Some("9"), &numeric).unwrap();
        assert_eq!(
            r[0].src,
            Some(SocketAddr::V6(SocketAddrV6::new(
                "fe80::2".parse().unwrap(),
                9,
                0,
                7
            )))
        );
        assert_eq!(
            getaddrinfo(Some("fe80::1%nosuchif0"), None, &numeric),
            Err(eai::NONAME)
        );
        // No node and no service: the hints' own addresses.
        let given = AddrHints {
            flags: rai::FAMILY,
            family: AF_INET,
            src: Some("10.1.2.3:0".parse().unwrap()),
            dst: Some("10.1.2.4:7471".parse().unwrap()),
            ..AddrHints::default()
        };
        let r = getaddrinfo(None, None, &given).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].src, r[0].dst), (given.src, given.dst));
        assert_eq!(
            (r[0].family, r[0].flags, r[0].port_space),
            (AF_INET, rai::FAMILY, PortSpace::Tcp)
        );
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
