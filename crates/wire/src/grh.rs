//! The 40-byte GRH area at the start of a UD receive buffer.
//!
//! RoCEv2 has no GRH on the wire; a UD receive buffer still starts with 40
//! bytes that stand for it (IBTA Annex 17, `man ibv_init_ah_from_wc`): the
//! IPv6 header, or, for IPv4, 20 undefined bytes (sent as zero) followed by
//! the IPv4 header.

use core::net::{IpAddr, Ipv4Addr};

use crate::ipv4::{self, Ipv4Packet, Ipv4Repr, IPPROTO_UDP};
use crate::ipv6::{self, Ipv6Packet, Ipv6Repr};
use crate::{header_view, Error, Result};

/// Length of the GRH area.
pub const HEADER_LEN: usize = ipv6::HEADER_LEN;

/// Where the IPv4 header starts in the area.
const IPV4_AT: usize = HEADER_LEN - ipv4::HEADER_LEN;

header_view! {
    /// A zero-copy view of a GRH area.
    GrhPacket, HEADER_LEN
}

impl<T: AsRef<[u8]>> GrhPacket<T> {
    /// The area read as an IPv6 header.
    pub fn ipv6(&self) -> Ipv6Packet<&[u8]> {
        Ipv6Packet::new_unchecked(&self.buffer.as_ref()[..HEADER_LEN])
    }

    /// The last 20 bytes read as an IPv4 header.
    pub fn ipv4(&self) -> Ipv4Packet<&[u8]> {
        Ipv4Packet::new_unchecked(&self.buffer.as_ref()[IPV4_AT..HEADER_LEN])
    }

    /// Which header the area holds (4 or 6), decided as rdma-core does:
    /// without a 6 in the first nibble it is IPv4 if the last 20 bytes
    /// start with version 4 and IHL 5. With a 6 there, the undefined first
    /// 20 bytes of an IPv4 area may look like IPv6, so a 20-byte IPv4
    /// header with a valid checksum still wins.
    pub fn ip_version(&self) -> Option<u8> {
        let v4 = self.ipv4();
        let v4_shape = v4.version() == 4 && v4.header_len() == ipv4::HEADER_LEN;
        if self.ipv6().version() != 6 {
            v4_shape.then_some(4)
        } else if v4_shape && v4.verify_checksum() {
            Some(4)
        } else {
            Some(6)
        }
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> GrhPacket<T> {
    /// The area as a mutable IPv6 header.
    pub fn ipv6_mut(&mut self) -> Ipv6Packet<&mut [u8]> {
        Ipv6Packet::new_unchecked(&mut self.buffer.as_mut()[..HEADER_LEN])
    }

    /// The last 20 bytes as a mutable IPv4 header.
    pub fn ipv4_mut(&mut self) -> Ipv4Packet<&mut [u8]> {
        Ipv4Packet::new_unchecked(&mut self.buffer.as_mut()[IPV4_AT..HEADER_LEN])
    }
}

/// The network header of a received UD packet as its GRH area tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrhRepr {
    /// Source address; IPv4 exactly when the area holds an IPv4 header.
    pub src_addr: IpAddr,
    /// Destination address.
    pub dst_addr: IpAddr,
    /// Traffic class (IPv4: the TOS byte).
    pub traffic_class: u8,
    /// Flow label (20 bits; IPv4 has none and gives 0).
    pub flow_label: u32,
    /// Hop limit (IPv4: the TTL).
    pub hop_limit: u8,
    /// Bytes after the IP header: the UDP header and its payload. Emitting
    /// saturates the IP length field at 65535.
    pub payload_len: usize,
}

impl GrhRepr {
    /// Whether [`emit`](GrhRepr::emit) writes IPv4: both addresses are
    /// IPv4 or IPv4-mapped.
    pub fn is_ipv4(&self) -> bool {
        self.ipv4_addrs().is_some()
    }

    fn ipv4_addrs(&self) -> Option<(Ipv4Addr, Ipv4Addr)> {
        match (self.src_addr.to_canonical(), self.dst_addr.to_canonical()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => Some((s, d)),
            _ => None,
        }
    }

    /// Parses an area (see [`GrhPacket::ip_version`]); fails on a short
    /// buffer or an area that holds neither header.
    ///
    /// Fields that do not identify the peer are not validated: the IPv4
    /// checksum only breaks the IPv4/IPv6 tie, and an IPv4 total length
    /// below 20 gives a payload length of 0.
    pub fn parse<T: AsRef<[u8]>>(packet: &GrhPacket<T>) -> Result<Self> {
        packet.check_len()?;
        match packet.ip_version().ok_or(Error)? {
            4 => {
                let ip = packet.ipv4();
                Ok(Self {
                    src_addr: ip.src_addr().into(),
                    dst_addr: ip.dst_addr().into(),
                    traffic_class: ip.tos(),
                    flow_label: 0,
                    hop_limit: ip.ttl(),
                    payload_len: usize::from(ip.total_len()).saturating_sub(ipv4::HEADER_LEN),
                })
            }
            _ => {
                let ip = packet.ipv6();
                Ok(Self {
                    src_addr: ip.src_addr().into(),
                    dst_addr: ip.dst_addr().into(),
                    traffic_class: ip.traffic_class(),
                    flow_label: ip.flow_label(),
                    hop_limit: ip.hop_limit(),
                    payload_len: usize::from(ip.payload_len()),
                })
            }
        }
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the area as a UDP packet's: IPv4 (zeros, then the header as
    /// Linux sends it with DF, ID 0 and a valid checksum) when both
    /// addresses are IPv4, else IPv6 with IPv4 addresses mapped.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut GrhPacket<T>) {
        if let Some((src_addr, dst_addr)) = self.ipv4_addrs() {
            packet.buffer.as_mut()[..IPV4_AT].fill(0);
            Ipv4Repr {
                src_addr,
                dst_addr,
                protocol: IPPROTO_UDP,
                payload_len: self.payload_len,
                tos: self.traffic_class,
                ident: 0,
                dont_frag: true,
                ttl: self.hop_limit,
            }
            .emit(&mut packet.ipv4_mut());
        } else {
            let v6 = |a: IpAddr| match a {
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                IpAddr::V6(v6) => v6,
            };
            Ipv6Repr {
                src_addr: v6(self.src_addr),
                dst_addr: v6(self.dst_addr),
                next_header: IPPROTO_UDP,
                payload_len: self.payload_len,
                hop_limit: self.hop_limit,
                traffic_class: self.traffic_class,
                flow_label: self.flow_label,
            }
            .emit(&mut packet.ipv6_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategies;
    use core::net::Ipv6Addr;
    use proptest::prelude::*;

    fn v4() -> GrhRepr {
        GrhRepr {
            src_addr: Ipv4Addr::new(10, 0, 0, 1).into(),
            dst_addr: Ipv4Addr::new(10, 0, 0, 2).into(),
            traffic_class: 0x10,
            flow_label: 0,
            hop_limit: 64,
            payload_len: 108,
        }
    }

    #[test]
    fn ipv4_sits_in_the_last_20_bytes_after_zeros() {
        let mut buf = [0xa5u8; HEADER_LEN];
        v4().emit(&mut GrhPacket::new_unchecked(&mut buf));
        assert_eq!(buf[..20], [0; 20]);
        let p = GrhPacket::new_checked(&buf[..]).unwrap();
        let ip = Ipv4Repr::parse(&p.ipv4()).unwrap();
        assert_eq!(
            (ip.payload_len, ip.tos, ip.ttl, ip.protocol),
            (108, 0x10, 64, IPPROTO_UDP)
        );
        assert!(ip.dont_frag && ip.ident == 0);
        assert_eq!(p.ip_version(), Some(4));
        assert_eq!(GrhRepr::parse(&p), Ok(v4()));
    }

    #[test]
    fn ipv4_mapped_addresses_give_ipv4() {
        let mapped = GrhRepr {
            src_addr: Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped().into(),
            ..v4()
        };
        assert!(mapped.is_ipv4());
        let mut buf = [0u8; HEADER_LEN];
        mapped.emit(&mut GrhPacket::new_unchecked(&mut buf));
        assert_eq!(GrhRepr::parse(&GrhPacket::new_unchecked(&buf[..])), Ok(v4()));
    }

    #[test]
    fn mixed_families_give_ipv6_with_mapped_addresses() {
        let mixed = GrhRepr {
            dst_addr: Ipv6Addr::LOCALHOST.into(),
            ..v4()
        };
        let mut buf = [0u8; HEADER_LEN];
        mixed.emit(&mut GrhPacket::new_unchecked(&mut buf));
        let p = GrhPacket::new_unchecked(&buf[..]);
        assert_eq!(p.ip_version(), Some(6));
        let ip = Ipv6Repr::parse(&p.ipv6()).unwrap();
        assert_eq!(ip.src_addr, Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped());
        assert_eq!((ip.next_header, ip.payload_len), (IPPROTO_UDP, 108));
    }

    /// An IPv4 header without checksum or length (as tests and some peers
    /// leave them) is still IPv4 when nothing suggests IPv6.
    #[test]
    fn a_bare_ipv4_header_is_read_as_ipv4() {
        let mut g = [0u8; HEADER_LEN];
        g[20] = 0x45;
        g[21] = 0x10;
        g[32..36].copy_from_slice(&[127, 0, 0, 1]);
        let r = GrhRepr::parse(&GrhPacket::new_unchecked(&g[..])).unwrap();
        assert_eq!(r.src_addr, IpAddr::from(Ipv4Addr::LOCALHOST));
        assert_eq!((r.traffic_class, r.payload_len), (0x10, 0));
    }

    #[test]
    fn a_6_in_the_first_nibble_needs_a_valid_ipv4_checksum_to_be_ipv4() {
        let mut buf = [0u8; HEADER_LEN];
        v4().emit(&mut GrhPacket::new_unchecked(&mut buf));
        buf[0] = 0x60;
        assert_eq!(GrhPacket::new_unchecked(&buf[..]).ip_version(), Some(4));
        assert_eq!(GrhRepr::parse(&GrhPacket::new_unchecked(&buf[..])), Ok(v4()));
        buf[30] ^= 1;
        assert_eq!(GrhPacket::new_unchecked(&buf[..]).ip_version(), Some(6));
    }

    #[test]
    fn neither_header_is_an_error() {
        assert_eq!(
            GrhRepr::parse(&GrhPacket::new_unchecked(&[0u8; 40][..])),
            Err(Error)
        );
        let mut g = [0u8; HEADER_LEN];
        g[20] = 0x46; // IPv4 with options cannot fit
        assert_eq!(GrhRepr::parse(&GrhPacket::new_unchecked(&g[..])), Err(Error));
        assert_eq!(GrhPacket::new_checked(&g[..39]), Err(Error));
    }

    fn grh() -> impl Strategy<Value = GrhRepr> {
        prop_oneof![
            strategies::ipv4().prop_map(|ip| GrhRepr {
                src_addr: ip.src_addr.into(),
                dst_addr: ip.dst_addr.into(),
                traffic_class: ip.tos,
                flow_label: 0,
                hop_limit: ip.ttl,
                payload_len: ip.payload_len,
            }),
            strategies::ipv6()
                .prop_filter("not IPv4-mapped", |ip| ip.src_addr.to_ipv4_mapped().is_none()
                    || ip.dst_addr.to_ipv4_mapped().is_none())
                .prop_map(|ip| GrhRepr {
                    src_addr: ip.src_addr.into(),
                    dst_addr: ip.dst_addr.into(),
                    traffic_class: ip.traffic_class,
                    flow_label: ip.flow_label,
                    hop_limit: ip.hop_limit,
                    payload_len: ip.payload_len,
                }),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(repr in grh()) {
            let mut buf = [0xffu8; HEADER_LEN];
            repr.emit(&mut GrhPacket::new_unchecked(&mut buf));
            let p = GrhPacket::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(p.ip_version(), Some(if repr.is_ipv4() { 4 } else { 6 }));
            prop_assert_eq!(GrhRepr::parse(&p), Ok(repr));
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..48)) {
            let _ = GrhPacket::new_checked(&bytes[..]).and_then(|p| GrhRepr::parse(&p));
        }
    }
}
