//! Flow steering and receive-side scaling for raw packet QPs: the header fields of an Ethernet
//! frame, flow rules that match them (`ibv_create_flow`), and the Toeplitz hash that spreads
//! frames over receive work queues (`rx_hash_conf`). Pure functions; the device applies them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use bitflags::bitflags;
use softverbs_wire::ipv4::{self, Ipv4Packet, IPPROTO_UDP};
use softverbs_wire::ipv6::{self, Ipv6Packet};

const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88A8;
const ETH_P_IPV4: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const IPPROTO_TCP: u8 = 6;

/// The L3 header of a frame, as far as steering looks at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L3 {
    /// IPv4.
    V4 {
        /// Source address.
        src: Ipv4Addr,
        /// Destination address.
        dst: Ipv4Addr,
        /// Protocol.
        proto: u8,
        /// Type of service.
        tos: u8,
        /// Time to live.
        ttl: u8,
        /// The three flag bits (reserved, DF, MF).
        flags: u8,
    },
    /// IPv6.
    V6 {
        /// Source address.
        src: Ipv6Addr,
        /// Destination address.
        dst: Ipv6Addr,
        /// Flow label (20 bits).
        flow_label: u32,
        /// Next header.
        next_hdr: u8,
        /// Traffic class.
        traffic_class: u8,
        /// Hop limit.
        hop_limit: u8,
    },
}

/// The L4 ports of a TCP or UDP frame (first fragment only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L4 {
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
}

/// The header fields of an Ethernet frame that flows and RSS look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeaders {
    /// Destination MAC.
    pub dst_mac: [u8; 6],
    /// Source MAC, if known (a datagram received over UDP does not show it).
    pub src_mac: Option<[u8; 6]>,
    /// The first VLAN tag (TCI), if the frame has one.
    pub vlan_tag: Option<u16>,
    /// The ethertype after the last VLAN tag.
    pub ether_type: u16,
    /// The IP header, if the frame carries IPv4 or IPv6.
    pub l3: Option<L3>,
    /// TCP or UDP ports, if present.
    pub l4: Option<L4>,
}

impl FrameHeaders {
    /// Parses what it can; `None` only if the frame is shorter than an Ethernet header.
    /// Truncated or unknown inner headers simply leave `l3`/`l4` empty.
    pub fn parse(frame: &[u8]) -> Option<Self> {
        if frame.len() < 14 {
            return None;
        }
        let mut h = Self {
            dst_mac: frame[0..6].try_into().ok()?,
            src_mac: Some(frame[6..12].try_into().ok()?),
            vlan_tag: None,
            ether_type: u16::from_be_bytes([frame[12], frame[13]]),
            l3: None,
            l4: None,
        };
        let mut off = 14;
        while matches!(h.ether_type, ETH_P_8021Q | ETH_P_8021AD) && frame.len() >= off + 4 {
            let tci = u16::from_be_bytes([frame[off], frame[off + 1]]);
            h.vlan_tag.get_or_insert(tci);
            h.ether_type = u16::from_be_bytes([frame[off + 2], frame[off + 3]]);
            off += 4;
        }
        let ip = &frame[off..];
        let (proto, l4_off) = match h.ether_type {
            ETH_P_IPV4 => match Ipv4Packet::new_checked(ip) {
                Ok(v4) if v4.version() == 4 => {
                    h.l3 = Some(L3::V4 {
                        src: v4.src_addr(),
                        dst: v4.dst_addr(),
                        proto: v4.protocol(),
                        tos: v4.tos(),
                        ttl: v4.ttl(),
                        flags: v4.flags(),
                    });
                    // Only the first fragment carries the ports.
                    let ihl = v4.header_len();
                    (
                        v4.protocol(),
                        (v4.frag_offset() == 0 && ihl >= ipv4::HEADER_LEN).then_some(ihl),
                    )
                }
                _ => return Some(h),
            },
            ETH_P_IPV6 => match Ipv6Packet::new_checked(ip) {
                Ok(v6) if v6.version() == 6 => {
                    h.l3 = Some(L3::V6 {
                        src: v6.src_addr(),
                        dst: v6.dst_addr(),
                        flow_label: v6.flow_label(),
                        next_hdr: v6.next_header(),
                        traffic_class: v6.traffic_class(),
                        hop_limit: v6.hop_limit(),
                    });
                    (v6.next_header(), Some(ipv6::HEADER_LEN))
                }
                _ => return Some(h),
            },
            _ => return Some(h),
        };
        if let Some(o) = l4_off {
            // TCP and UDP both start with the two ports; 4 bytes are enough to read them.
            if matches!(proto, IPPROTO_TCP | IPPROTO_UDP) && ip.len() >= o + 4 {
                h.l4 = Some(L4 {
                    proto,
                    src_port: u16::from_be_bytes([ip[o], ip[o + 1]]),
                    dst_port: u16::from_be_bytes([ip[o + 2], ip[o + 3]]),
                });
            }
        }
        Some(h)
    }

    /// The outer headers of a RoCEv2 datagram as far as a UDP receiver knows them: the
    /// addresses and ports of `src` and `dst`, `tos`/`ttl` (traffic class and hop limit for
    /// IPv6) as the receive's GRH reports them, DF set with IPv4 (RoCEv2 senders set it),
    /// flow label 0, and an untagged frame to `dst_mac` (or to the IP multicast MAC of a
    /// group address) from an unknown source MAC. No header bytes exist to parse: the socket
    /// or the in-process hand-over deliver only the UDP payload.
    pub fn roce_datagram(dst_mac: [u8; 6], src: SocketAddr, dst: SocketAddr, tos: u8, ttl: u8) -> Self {
        let l3 = match (src.ip(), dst.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => L3::V4 {
                src: s,
                dst: d,
                proto: IPPROTO_UDP,
                tos,
                ttl,
                flags: IPV4_FLAG_DF,
            },
            (s, d) => L3::V6 {
                src: ipv6_of(s),
                dst: ipv6_of(d),
                flow_label: 0,
                next_hdr: IPPROTO_UDP,
                traffic_class: tos,
                hop_limit: ttl,
            },
        };
        let dst_mac = multicast_mac(dst.ip()).unwrap_or(dst_mac);
        Self {
            dst_mac,
            src_mac: None,
            vlan_tag: None,
            ether_type: if matches!(l3, L3::V4 { .. }) {
                ETH_P_IPV4
            } else {
                ETH_P_IPV6
            },
            l3: Some(l3),
            l4: Some(L4 {
                proto: IPPROTO_UDP,
                src_port: src.port(),
                dst_port: dst.port(),
            }),
        }
    }

    /// Whether the destination MAC is a multicast (or broadcast) address.
    pub fn is_multicast(&self) -> bool {
        self.dst_mac[0] & 1 != 0
    }
}

/// The DF bit among the three IPv4 flag bits.
const IPV4_FLAG_DF: u8 = 0b010;

fn ipv6_of(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// The Ethernet multicast MAC an IP group address maps to (RFC 1112: 01:00:5e and the low 23
/// bits; RFC 2464: 33:33 and the low 32 bits); `None` for a unicast address.
pub fn multicast_mac(ip: IpAddr) -> Option<[u8; 6]> {
    match ip {
        IpAddr::V4(v4) if v4.is_multicast() => {
            let o = v4.octets();
            Some([0x01, 0x00, 0x5e, o[1] & 0x7f, o[2], o[3]])
        }
        IpAddr::V6(v6) if v6.is_multicast() => {
            let o = v6.octets();
            Some([0x33, 0x33, o[12], o[13], o[14], o[15]])
        }
        _ => None,
    }
}

/// `struct ibv_flow_eth_filter`, numbers in host order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EthFilter {
    /// Destination MAC.
    pub dst_mac: [u8; 6],
    /// Source MAC.
    pub src_mac: [u8; 6],
    /// Ethertype after the last VLAN tag.
    pub ether_type: u16,
    /// VLAN TCI.
    pub vlan_tag: u16,
}

/// `struct ibv_flow_ipv4_ext_filter` (the plain IPv4 spec has only the addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Filter {
    /// Source address.
    pub src_ip: Ipv4Addr,
    /// Destination address.
    pub dst_ip: Ipv4Addr,
    /// Protocol.
    pub proto: u8,
    /// Type of service.
    pub tos: u8,
    /// Time to live.
    pub ttl: u8,
    /// The three flag bits.
    pub flags: u8,
}

impl Default for Ipv4Filter {
    fn default() -> Self {
        Self {
            src_ip: Ipv4Addr::UNSPECIFIED,
            dst_ip: Ipv4Addr::UNSPECIFIED,
            proto: 0,
            tos: 0,
            ttl: 0,
            flags: 0,
        }
    }
}

/// `struct ibv_flow_ipv6_filter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Filter {
    /// Source address.
    pub src_ip: Ipv6Addr,
    /// Destination address.
    pub dst_ip: Ipv6Addr,
    /// Flow label.
    pub flow_label: u32,
    /// Next header.
    pub next_hdr: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
}

impl Default for Ipv6Filter {
    fn default() -> Self {
        Self {
            src_ip: Ipv6Addr::UNSPECIFIED,
            dst_ip: Ipv6Addr::UNSPECIFIED,
            flow_label: 0,
            next_hdr: 0,
            traffic_class: 0,
            hop_limit: 0,
        }
    }
}

/// `struct ibv_flow_tcp_udp_filter`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PortFilter {
    /// Destination port.
    pub dst_port: u16,
    /// Source port.
    pub src_port: u16,
}

/// One header spec of a flow: a value and a mask; a field matches when
/// `frame & mask == value & mask`. An L3 or L4 spec also requires that header to be present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowSpec {
    /// `IBV_FLOW_SPEC_ETH`.
    Eth {
        /// Value.
        val: EthFilter,
        /// Mask.
        mask: EthFilter,
    },
    /// `IBV_FLOW_SPEC_IPV4` / `IBV_FLOW_SPEC_IPV4_EXT`.
    Ipv4 {
        /// Value.
        val: Ipv4Filter,
        /// Mask.
        mask: Ipv4Filter,
    },
    /// `IBV_FLOW_SPEC_IPV6`.
    Ipv6 {
        /// Value.
        val: Ipv6Filter,
        /// Mask.
        mask: Ipv6Filter,
    },
    /// `IBV_FLOW_SPEC_TCP`.
    Tcp {
        /// Value.
        val: PortFilter,
        /// Mask.
        mask: PortFilter,
    },
    /// `IBV_FLOW_SPEC_UDP`.
    Udp {
        /// Value.
        val: PortFilter,
        /// Mask.
        mask: PortFilter,
    },
}

fn eq_masked<const N: usize>(a: [u8; N], v: [u8; N], m: [u8; N]) -> bool {
    (0..N).all(|i| a[i] & m[i] == v[i] & m[i])
}

fn ports(f: &FrameHeaders, proto: u8, val: &PortFilter, mask: &PortFilter) -> bool {
    f.l4.is_some_and(|l4| {
        l4.proto == proto
            && l4.src_port & mask.src_port == val.src_port & mask.src_port
            && l4.dst_port & mask.dst_port == val.dst_port & mask.dst_port
    })
}

impl FlowSpec {
    /// Whether the frame matches this spec.
    pub fn matches(&self, f: &FrameHeaders) -> bool {
        match self {
            Self::Eth { val, mask } => {
                let vlan_ok = mask.vlan_tag == 0
                    || f.vlan_tag
                        .is_some_and(|t| t & mask.vlan_tag == val.vlan_tag & mask.vlan_tag);
                vlan_ok
                    && eq_masked(f.dst_mac, val.dst_mac, mask.dst_mac)
                    && (mask.src_mac == [0; 6]
                        || f.src_mac.is_some_and(|m| eq_masked(m, val.src_mac, mask.src_mac)))
                    && f.ether_type & mask.ether_type == val.ether_type & mask.ether_type
            }
            Self::Ipv4 { val, mask } => match f.l3 {
                Some(L3::V4 {
                    src,
                    dst,
                    proto,
                    tos,
                    ttl,
                    flags,
                }) => {
                    eq_masked(src.octets(), val.src_ip.octets(), mask.src_ip.octets())
                        && eq_masked(dst.octets(), val.dst_ip.octets(), mask.dst_ip.octets())
                        && eq_masked(
                            [proto, tos, ttl, flags],
                            [val.proto, val.tos, val.ttl, val.flags],
                            [mask.proto, mask.tos, mask.ttl, mask.flags],
                        )
                }
                _ => false,
            },
            Self::Ipv6 { val, mask } => match f.l3 {
                Some(L3::V6 {
                    src,
                    dst,
                    flow_label,
                    next_hdr,
                    traffic_class,
                    hop_limit,
                }) => {
                    eq_masked(src.octets(), val.src_ip.octets(), mask.src_ip.octets())
                        && eq_masked(dst.octets(), val.dst_ip.octets(), mask.dst_ip.octets())
                        && flow_label & mask.flow_label == val.flow_label & mask.flow_label
                        && eq_masked(
                            [next_hdr, traffic_class, hop_limit],
                            [val.next_hdr, val.traffic_class, val.hop_limit],
                            [mask.next_hdr, mask.traffic_class, mask.hop_limit],
                        )
                }
                _ => false,
            },
            Self::Tcp { val, mask } => ports(f, IPPROTO_TCP, val, mask),
            Self::Udp { val, mask } => ports(f, IPPROTO_UDP, val, mask),
        }
    }
}

bitflags! {
    /// `enum ibv_rx_hash_fields`: the header fields that feed the RSS hash.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct RxHashFields: u64 {
        /// IPv4 source address.
        const SRC_IPV4 = 1;
        /// IPv4 destination address.
        const DST_IPV4 = 1 << 1;
        /// IPv6 source address.
        const SRC_IPV6 = 1 << 2;
        /// IPv6 destination address.
        const DST_IPV6 = 1 << 3;
        /// TCP source port.
        const SRC_PORT_TCP = 1 << 4;
        /// TCP destination port.
        const DST_PORT_TCP = 1 << 5;
        /// UDP source port.
        const SRC_PORT_UDP = 1 << 6;
        /// UDP destination port.
        const DST_PORT_UDP = 1 << 7;
    }
}

/// `IBV_RX_HASH_FUNC_TOEPLITZ`.
pub const RX_HASH_FUNC_TOEPLITZ: u8 = 1;

/// The Toeplitz hash of `input` under `key` (the Microsoft RSS definition): for every set bit
/// of the input, XOR in the 32 key bits starting at that bit's position.
pub fn toeplitz(key: &[u8], input: &[u8]) -> u32 {
    let key_bit = |j: usize| key.get(j / 8).map_or(0, |b| u32::from(b >> (7 - j % 8) & 1));
    let mut window = (0..32).fold(0u32, |w, j| (w << 1) | key_bit(j));
    let mut hash = 0;
    for (i, byte) in input.iter().enumerate() {
        for b in 0..8 {
            if byte & (0x80 >> b) != 0 {
                hash ^= window;
            }
            window = (window << 1) | key_bit(i * 8 + b + 32);
        }
    }
    hash
}

impl RxHashFields {
    /// The hash input for a frame: the selected fields it has, in the order source address,
    /// destination address, source port, destination port.
    pub fn input(self, f: &FrameHeaders) -> Vec<u8> {
        let mut v = Vec::with_capacity(36);
        match f.l3 {
            Some(L3::V4 { src, dst, .. }) => {
                if self.contains(Self::SRC_IPV4) {
                    v.extend_from_slice(&src.octets());
                }
                if self.contains(Self::DST_IPV4) {
                    v.extend_from_slice(&dst.octets());
                }
            }
            Some(L3::V6 { src, dst, .. }) => {
                if self.contains(Self::SRC_IPV6) {
                    v.extend_from_slice(&src.octets());
                }
                if self.contains(Self::DST_IPV6) {
                    v.extend_from_slice(&dst.octets());
                }
            }
            None => {}
        }
        if let Some(l4) = f.l4 {
            let (s, d) = match l4.proto {
                IPPROTO_TCP => (Self::SRC_PORT_TCP, Self::DST_PORT_TCP),
                _ => (Self::SRC_PORT_UDP, Self::DST_PORT_UDP),
            };
            if self.contains(s) {
                v.extend_from_slice(&l4.src_port.to_be_bytes());
            }
            if self.contains(d) {
                v.extend_from_slice(&l4.dst_port.to_be_bytes());
            }
        }
        v
    }

    /// Checks a field set as `ibv_create_qp_ex` does: known bits, not IPv4 with IPv6, not TCP
    /// with UDP.
    pub fn validate(bits: u64) -> Result<Self, &'static str> {
        let f = Self::from_bits(bits).ok_or("rx_hash_fields_mask has unsupported bits")?;
        let v4 = f.intersects(Self::SRC_IPV4 | Self::DST_IPV4);
        let v6 = f.intersects(Self::SRC_IPV6 | Self::DST_IPV6);
        let tcp = f.intersects(Self::SRC_PORT_TCP | Self::DST_PORT_TCP);
        let udp = f.intersects(Self::SRC_PORT_UDP | Self::DST_PORT_UDP);
        if v4 && v6 {
            return Err("rx_hash_fields_mask mixes IPv4 and IPv6 fields");
        }
        if tcp && udp {
            return Err("rx_hash_fields_mask mixes TCP and UDP fields");
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests;
