//! TCP segmentation offload for raw packet QPs (`IBV_WR_TSO`): a header (Ethernet, optional
//! VLAN tags, IPv4 or IPv6, TCP) and a TCP payload become frames of at most `mss` payload bytes,
//! each behind a copy of the header with the IP length, IPv4 ID and checksum, TCP sequence
//! number, flags and checksum fixed up, as a NIC does.

use softverbs_wire::ipv4::{self, Ipv4Packet};
use softverbs_wire::ipv6::{self, Ipv6Packet};

const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88A8;
const ETH_P_IPV4: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const IPPROTO_TCP: u8 = 6;
const TCP_FIN: u8 = 0x01;
const TCP_PSH: u8 = 0x08;
const TCP_CWR: u8 = 0x80;

/// Largest TCP payload one TSO work request may carry (`tso_caps.max_tso`).
pub const MAX_TSO: u32 = 256 * 1024;
/// Largest `max_tso_header` a QP may ask for.
pub const MAX_TSO_HEADER: u32 = 256;

/// Where the headers of a TSO header block are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TsoLayout {
    /// Offset of the IP header.
    pub l3: usize,
    /// Offset of the TCP header.
    pub l4: usize,
    /// IPv4 (else IPv6).
    pub ipv4: bool,
}

/// Checks that `hdr` is exactly Ethernet (+ VLAN tags) + IPv4/IPv6 + TCP, with no payload.
pub fn parse_header(hdr: &[u8]) -> Result<TsoLayout, &'static str> {
    let be16 = |o: usize| u16::from_be_bytes([hdr[o], hdr[o + 1]]);
    if hdr.len() < 14 {
        return Err("the TSO header is shorter than an Ethernet header");
    }
    let mut l3 = 14;
    let mut ether_type = be16(12);
    while matches!(ether_type, ETH_P_8021Q | ETH_P_8021AD) && hdr.len() >= l3 + 4 {
        ether_type = be16(l3 + 2);
        l3 += 4;
    }
    let v4 = Ipv4Packet::new_checked(&hdr[l3..])
        .ok()
        .filter(|ip| ip.version() == 4);
    let v6 = Ipv6Packet::new_checked(&hdr[l3..])
        .ok()
        .filter(|ip| ip.version() == 6);
    let (l4, ipv4) = match (ether_type, v4, v6) {
        (ETH_P_IPV4, Some(ip), _) => {
            if ip.protocol() != IPPROTO_TCP {
                return Err("the TSO header's IPv4 protocol is not TCP");
            }
            if ip.header_len() < ipv4::HEADER_LEN {
                return Err("the TSO header's IPv4 header length is below 20 bytes");
            }
            (l3 + ip.header_len(), true)
        }
        (ETH_P_IPV6, _, Some(ip)) => {
            if ip.next_header() != IPPROTO_TCP {
                return Err("the TSO header's IPv6 next header is not TCP");
            }
            (l3 + ipv6::HEADER_LEN, false)
        }
        _ => return Err("the TSO header holds no IPv4 or IPv6 header"),
    };
    if hdr.len() < l4 + 20 || hdr.len() != l4 + usize::from(hdr[l4 + 12] >> 4) * 4 {
        return Err("the TSO header does not end with its TCP header");
    }
    Ok(TsoLayout { l3, l4, ipv4 })
}

fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum()
}

fn fold(mut sum: u32) -> u16 {
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

/// Cuts `data` into segments of `mss` bytes behind copies of `hdr` (checked by
/// [`parse_header`]). An empty payload gives one segment with the header alone.
pub fn segment(hdr: &[u8], layout: TsoLayout, data: &[u8], mss: usize) -> Vec<Vec<u8>> {
    let TsoLayout { l3, l4, ipv4 } = layout;
    let chunks: Vec<&[u8]> = if data.is_empty() {
        vec![data]
    } else {
        data.chunks(mss.max(1)).collect()
    };
    let seq0 = u32::from_be_bytes([hdr[l4 + 4], hdr[l4 + 5], hdr[l4 + 6], hdr[l4 + 7]]);
    let id0 = if ipv4 {
        Ipv4Packet::new_unchecked(&hdr[l3..l4]).ident()
    } else {
        0
    };
    let last = chunks.len() - 1;
    let mut offset = 0u32;
    chunks
        .iter()
        .enumerate()
        .map(|(i, chunk)| {
            let mut f = Vec::with_capacity(hdr.len() + chunk.len());
            f.extend_from_slice(hdr);
            f.extend_from_slice(chunk);
            let tcp_len = f.len() - l4;
            if ipv4 {
                let total = f.len() - l3;
                let mut ip = Ipv4Packet::new_unchecked(&mut f[l3..l4]);
                ip.set_total_len(total as u16);
                ip.set_ident(id0.wrapping_add(i as u16));
                ip.fill_checksum();
            } else {
                Ipv6Packet::new_unchecked(&mut f[l3..l4]).set_payload_len(tcp_len as u16);
            }
            f[l4 + 4..l4 + 8].copy_from_slice(&seq0.wrapping_add(offset).to_be_bytes());
            if i != last {
                f[l4 + 13] &= !(TCP_FIN | TCP_PSH);
            }
            if i != 0 {
                f[l4 + 13] &= !TCP_CWR;
            }
            // The TCP checksum over the pseudo-header, the TCP header and the payload.
            f[l4 + 16..l4 + 18].fill(0);
            let mut pseudo = Vec::with_capacity(40);
            if ipv4 {
                let ip = Ipv4Packet::new_unchecked(&f[l3..l4]);
                pseudo.extend_from_slice(&ip.src_addr().octets());
                pseudo.extend_from_slice(&ip.dst_addr().octets());
                pseudo.extend_from_slice(&[0, IPPROTO_TCP]);
                pseudo.extend_from_slice(&(tcp_len as u16).to_be_bytes());
            } else {
                let ip = Ipv6Packet::new_unchecked(&f[l3..l4]);
                pseudo.extend_from_slice(&ip.src_addr().octets());
                pseudo.extend_from_slice(&ip.dst_addr().octets());
                pseudo.extend_from_slice(&(tcp_len as u32).to_be_bytes());
                pseudo.extend_from_slice(&[0, 0, 0, IPPROTO_TCP]);
            }
            let c = fold(sum16(&pseudo) + sum16(&f[l4..]));
            f[l4 + 16..l4 + 18].copy_from_slice(&c.to_be_bytes());
            offset = offset.wrapping_add(chunk.len() as u32);
            f
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4_header(flags: u8) -> Vec<u8> {
        let mut h = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x08, 0x00];
        h.extend_from_slice(&[
            0x45, 0, 0, 0, 0x10, 0x00, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ]);
        h.extend_from_slice(&[0x30, 0x39, 0x00, 0x50, 0xFF, 0xFF, 0xFF, 0xF0, 0, 0, 0, 1]);
        h.extend_from_slice(&[0x50, flags, 0xFF, 0xFF, 0, 0, 0, 0]);
        h
    }

    /// A valid ones'-complement checksum sums to 0xFFFF (folds to 0).
    fn checks(data: &[u8]) -> bool {
        fold(sum16(data)) == 0
    }

    #[test]
    fn ipv4_segments_carry_fixed_up_headers() {
        let hdr = v4_header(TCP_FIN | TCP_PSH | TCP_CWR | 0x10);
        let layout = parse_header(&hdr).unwrap();
        assert_eq!(
            layout,
            TsoLayout {
                l3: 14,
                l4: 34,
                ipv4: true
            }
        );
        let data: Vec<u8> = (0..2500u32).map(|i| (i % 251) as u8).collect();
        let segs = segment(&hdr, layout, &data, 1000);
        assert_eq!(segs.iter().map(Vec::len).collect::<Vec<_>>(), [1054, 1054, 554]);
        let mut joined = Vec::new();
        for (i, s) in segs.iter().enumerate() {
            assert_eq!(
                u16::from_be_bytes([s[16], s[17]]) as usize,
                s.len() - 14,
                "total length"
            );
            assert_eq!(u16::from_be_bytes([s[18], s[19]]), 0x1000 + i as u16, "IPv4 ID");
            assert!(checks(&s[14..34]), "IPv4 header checksum");
            let seq = u32::from_be_bytes([s[38], s[39], s[40], s[41]]);
            assert_eq!(
                seq,
                0xFFFF_FFF0u32.wrapping_add(1000 * i as u32),
                "sequence wraps"
            );
            let flags = s[47];
            assert_eq!(
                flags & (TCP_FIN | TCP_PSH) != 0,
                i == 2,
                "FIN/PSH on the last only"
            );
            assert_eq!(flags & TCP_CWR != 0, i == 0, "CWR on the first only");
            assert_ne!(flags & 0x10, 0, "ACK everywhere");
            let mut pseudo = s[26..34].to_vec();
            pseudo.extend_from_slice(&[0, 6]);
            pseudo.extend_from_slice(&((s.len() - 34) as u16).to_be_bytes());
            pseudo.extend_from_slice(&s[34..]);
            assert!(checks(&pseudo), "TCP checksum");
            joined.extend_from_slice(&s[54..]);
        }
        assert_eq!(joined, data);
    }

    #[test]
    fn ipv6_payload_length_and_empty_payload() {
        let mut hdr = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x86, 0xDD];
        hdr.extend_from_slice(&[0x60, 0, 0, 0, 0, 0, 6, 64]);
        hdr.extend_from_slice(&[0xfe; 32]);
        hdr.extend_from_slice(&[0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0x50, 0x18, 1, 0, 0, 0, 0, 0]);
        let layout = parse_header(&hdr).unwrap();
        assert!(!layout.ipv4);
        let segs = segment(&hdr, layout, &[7; 300], 128);
        assert_eq!(segs.len(), 3);
        assert_eq!(u16::from_be_bytes([segs[2][18], segs[2][19]]), 20 + 44);
        assert_eq!(segment(&hdr, layout, &[], 128).len(), 1);
    }

    #[test]
    fn headers_must_end_with_tcp() {
        let hdr = v4_header(0x10);
        assert!(parse_header(&hdr[..40]).is_err());
        let mut more = hdr.clone();
        more.push(0);
        assert!(parse_header(&more).is_err(), "payload bytes in the header");
        let mut udp = hdr;
        udp[23] = 17;
        assert!(parse_header(&udp).is_err());
    }
}
