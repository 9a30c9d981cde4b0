//! UDP header (RFC 768, 8 bytes). RoCEv2 allows checksum 0: the ICRC
//! protects the payload, so the checksum is not checked on receipt.
//! [`checksum`] computes it as a host stack does on a datagram it sends
//! (packet captures show it).

use core::net::IpAddr;

use crate::field::{read_u16, write_u16};
use crate::{header_view, Error, Result};

mod field {
    use crate::field::Field;

    pub(super) const SRC_PORT: Field = 0..2;
    pub(super) const DST_PORT: Field = 2..4;
    pub(super) const LENGTH: Field = 4..6;
    pub(super) const CHECKSUM: Field = 6..8;
}

/// Length of the UDP header.
pub const HEADER_LEN: usize = field::CHECKSUM.end;

header_view! {
    /// A zero-copy view of a UDP header.
    UdpPacket, HEADER_LEN
}

impl<T: AsRef<[u8]>> UdpPacket<T> {
    fn data(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// Source port.
    pub fn src_port(&self) -> u16 {
        read_u16(&self.data()[field::SRC_PORT])
    }

    /// Destination port.
    pub fn dst_port(&self) -> u16 {
        read_u16(&self.data()[field::DST_PORT])
    }

    /// Length of header and payload.
    pub fn len(&self) -> u16 {
        read_u16(&self.data()[field::LENGTH])
    }

    /// Whether the length field is 0 (never valid: the header alone is 8).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checksum as carried (0: none).
    pub fn checksum(&self) -> u16 {
        read_u16(&self.data()[field::CHECKSUM])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> UdpPacket<T> {
    /// Sets the source port.
    pub fn set_src_port(&mut self, value: u16) {
        write_u16(&mut self.buffer.as_mut()[field::SRC_PORT], value);
    }

    /// Sets the destination port.
    pub fn set_dst_port(&mut self, value: u16) {
        write_u16(&mut self.buffer.as_mut()[field::DST_PORT], value);
    }

    /// Sets the length of header and payload.
    pub fn set_len(&mut self, value: u16) {
        write_u16(&mut self.buffer.as_mut()[field::LENGTH], value);
    }

    /// Sets the checksum field as given.
    pub fn set_checksum(&mut self, value: u16) {
        write_u16(&mut self.buffer.as_mut()[field::CHECKSUM], value);
    }
}

/// A validated UDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdpRepr {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Bytes after the header; `emit` saturates the length at 65535.
    pub payload_len: usize,
}

impl UdpRepr {
    /// Parses a UDP header; fails on a short buffer or a length below 8.
    /// The checksum is not checked (see the module documentation).
    pub fn parse<T: AsRef<[u8]>>(packet: &UdpPacket<T>) -> Result<Self> {
        packet.check_len()?;
        let payload_len = usize::from(packet.len()).checked_sub(HEADER_LEN).ok_or(Error)?;
        Ok(Self {
            src_port: packet.src_port(),
            dst_port: packet.dst_port(),
            payload_len,
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header with checksum 0, as rxe sends it.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut UdpPacket<T>) {
        let len = HEADER_LEN
            .saturating_add(self.payload_len)
            .min(usize::from(u16::MAX)) as u16;
        packet.set_src_port(self.src_port);
        packet.set_dst_port(self.dst_port);
        packet.set_len(len);
        packet.set_checksum(0);
    }
}

/// The UDP checksum of `datagram` (the UDP header, whose checksum field
/// is skipped, and the payload) sent from `src` to `dst`: the ones'
/// complement sum over the pseudo-header of RFC 768 (IPv4) or RFC 8200
/// (IPv6) and the datagram, with a result of 0 sent as 0xFFFF. IPv4-mapped
/// IPv6 addresses count as IPv4. Families that differ give 0 (no
/// checksum).
pub fn checksum(src: IpAddr, dst: IpAddr, datagram: &[u8]) -> u16 {
    let len = datagram.len() as u64;
    let proto = u64::from(crate::ipv4::IPPROTO_UDP);
    // A 64-bit accumulator cannot overflow for any datagram length.
    let mut sum = match (src.to_canonical(), dst.to_canonical()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => add_words(&s.octets()) + add_words(&d.octets()) + proto + len,
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            add_words(&s.octets()) + add_words(&d.octets()) + (len >> 16) + (len & 0xFFFF) + proto
        }
        _ => return 0,
    };
    let (head, rest) = datagram.split_at(datagram.len().min(field::CHECKSUM.start));
    sum += add_words(head) + add_words(rest.get(2..).unwrap_or_default());
    while sum >> 16 != 0 {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    match !(sum as u16) {
        0 => 0xFFFF,
        c => c,
    }
}

/// Sum of big-endian 16-bit words (an odd last byte is padded with 0).
fn add_words(bytes: &[u8]) -> u64 {
    bytes
        .chunks(2)
        .map(|c| u64::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategies;
    use proptest::prelude::*;

    // The UDP header of scapy's UC SEND ONLY test packet (roce.md vector 2).
    static BYTES: [u8; 8] = [0xc0, 0x00, 0x12, 0xb7, 0x00, 0x2c, 0xac, 0xa2];

    #[test]
    fn deconstruct_and_construct() {
        let p = UdpPacket::new_checked(&BYTES[..]).unwrap();
        assert_eq!(
            (p.src_port(), p.dst_port(), p.len(), p.checksum()),
            (49152, 4791, 44, 0xaca2)
        );
        assert!(!p.is_empty());
        let repr = UdpRepr::parse(&p).unwrap();
        assert_eq!(
            repr,
            UdpRepr {
                src_port: 49152,
                dst_port: crate::ROCE_UDP_PORT,
                payload_len: 36
            }
        );
        let mut buf = [0xa5u8; HEADER_LEN];
        repr.emit(&mut UdpPacket::new_unchecked(&mut buf));
        assert_eq!(buf[..6], BYTES[..6]);
        assert_eq!(buf[6..], [0, 0], "no checksum");
    }

    #[test]
    fn rejects_short_buffer_and_length() {
        assert_eq!(UdpPacket::new_checked(&BYTES[..7]), Err(Error));
        let mut bad = BYTES;
        bad[5] = 7;
        assert_eq!(UdpRepr::parse(&UdpPacket::new_unchecked(&bad[..])), Err(Error));
    }

    #[test]
    fn length_saturates() {
        let mut buf = [0u8; HEADER_LEN];
        let repr = UdpRepr {
            src_port: 1,
            dst_port: 2,
            payload_len: 1 << 20,
        };
        repr.emit(&mut UdpPacket::new_unchecked(&mut buf));
        assert_eq!(UdpPacket::new_unchecked(&buf).len(), u16::MAX);
    }

    #[test]
    fn checksum_matches_scapy() {
        // roce.md vector 2 (scapy's UC SEND ONLY): UDP header and payload, checksum 0xaca2.
        let packet = crate::icrc::tests::scapy_uc_send_only();
        let (src, dst) = (IpAddr::from([192, 168, 0, 7]), IpAddr::from([192, 168, 0, 7]));
        assert_eq!(checksum(src, dst, &packet[20..]), 0xaca2);
        // IPv4-mapped IPv6 addresses are IPv4.
        let mapped = |ip: IpAddr| match ip {
            IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
            v6 => v6,
        };
        assert_eq!(checksum(mapped(src), mapped(dst), &packet[20..]), 0xaca2);
        assert_eq!(checksum(src, IpAddr::from([0u16; 8]), &packet[20..]), 0);
    }

    proptest! {
        #[test]
        fn checksum_verifies(
            v6 in any::<bool>(),
            src in any::<[u8; 16]>(),
            dst in any::<[u8; 16]>(),
            payload in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let (s, d): (IpAddr, IpAddr) = if v6 {
                (src.into(), dst.into())
            } else {
                ([src[0], src[1], src[2], src[3]].into(), [dst[0], dst[1], dst[2], dst[3]].into())
            };
            let mut dgram = [0u8; HEADER_LEN].to_vec();
            dgram.extend_from_slice(&payload);
            UdpRepr { src_port: 5, dst_port: 4791, payload_len: payload.len() }
                .emit(&mut UdpPacket::new_unchecked(&mut dgram[..]));
            let c = checksum(s, d, &dgram);
            prop_assert_ne!(c, 0);
            // The receiver's check, written out: pseudo-header and datagram with the checksum
            // in place sum to all ones.
            UdpPacket::new_unchecked(&mut dgram[..]).set_checksum(c);
            let mut sum: u64 = dgram.chunks(2)
                .map(|w| u64::from(u16::from_be_bytes([w[0], w.get(1).copied().unwrap_or(0)])))
                .sum();
            let ips: ([u8; 16], [u8; 16]) = match (s, d) {
                (IpAddr::V4(a), IpAddr::V4(b)) => (a.to_ipv6_mapped().octets(), b.to_ipv6_mapped().octets()),
                (IpAddr::V6(a), IpAddr::V6(b)) => (a.octets(), b.octets()),
                _ => unreachable!(),
            };
            let skip = if v6 { 0 } else { 12 };
            for ip in [ips.0, ips.1] {
                sum += ip[skip..].chunks(2).map(|w| u64::from(u16::from_be_bytes([w[0], w[1]]))).sum::<u64>();
            }
            sum += 17 + dgram.len() as u64;
            while sum >> 16 != 0 {
                sum = (sum & 0xFFFF) + (sum >> 16);
            }
            prop_assert_eq!(sum, 0xFFFF);
        }

        #[test]
        fn round_trip(repr in strategies::udp()) {
            let mut buf = [0xffu8; HEADER_LEN];
            repr.emit(&mut UdpPacket::new_unchecked(&mut buf));
            prop_assert_eq!(UdpRepr::parse(&UdpPacket::new_checked(&buf[..]).unwrap()), Ok(repr));
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..16)) {
            let _ = UdpPacket::new_checked(&bytes[..]).and_then(|p| UdpRepr::parse(&p));
        }
    }
}
