//! IPv6 fixed header (RFC 8200, 40 bytes); RoCEv2 sends no extension
//! headers.

use core::net::Ipv6Addr;

use crate::field::{read_u16, read_u32, write_u16, write_u32};
use crate::{header_view, Error, Result};

mod field {
    use crate::field::Field;

    /// Version (4 bits), traffic class (8 bits), flow label (20 bits).
    pub(super) const VER_TC_FLOW: Field = 0..4;
    pub(super) const LENGTH: Field = 4..6;
    pub(super) const NEXT_HEADER: usize = 6;
    pub(super) const HOP_LIMIT: usize = 7;
    pub(super) const SRC_ADDR: Field = 8..24;
    pub(super) const DST_ADDR: Field = 24..40;

    pub(super) const VERSION_SHIFT: u32 = 28;
    pub(super) const TC_SHIFT: u32 = 20;
    pub(super) const FLOW_MASK: u32 = 0x000F_FFFF;
}

/// Length of the IPv6 header.
pub const HEADER_LEN: usize = field::DST_ADDR.end;

header_view! {
    /// A zero-copy view of an IPv6 header.
    Ipv6Packet, HEADER_LEN
}

impl<T: AsRef<[u8]>> Ipv6Packet<T> {
    fn data(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    fn word(&self) -> u32 {
        read_u32(&self.data()[field::VER_TC_FLOW])
    }

    /// IP version; 6 in a valid header.
    pub fn version(&self) -> u8 {
        (self.word() >> field::VERSION_SHIFT) as u8
    }

    /// Traffic class: DSCP (high 6 bits) and ECN (low 2 bits).
    pub fn traffic_class(&self) -> u8 {
        (self.word() >> field::TC_SHIFT) as u8
    }

    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        self.word() & field::FLOW_MASK
    }

    /// Length of everything after this header.
    pub fn payload_len(&self) -> u16 {
        read_u16(&self.data()[field::LENGTH])
    }

    /// Protocol of the next header.
    pub fn next_header(&self) -> u8 {
        self.data()[field::NEXT_HEADER]
    }

    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        self.data()[field::HOP_LIMIT]
    }

    /// Source address.
    pub fn src_addr(&self) -> Ipv6Addr {
        let mut a = [0; 16];
        a.copy_from_slice(&self.data()[field::SRC_ADDR]);
        a.into()
    }

    /// Destination address.
    pub fn dst_addr(&self) -> Ipv6Addr {
        let mut a = [0; 16];
        a.copy_from_slice(&self.data()[field::DST_ADDR]);
        a.into()
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv6Packet<T> {
    fn data_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }

    fn set_word(&mut self, mask: u32, value: u32) {
        let old = self.word();
        write_u32(
            &mut self.data_mut()[field::VER_TC_FLOW],
            (old & !mask) | (value & mask),
        );
    }

    /// Sets the version; only the low 4 bits are used.
    pub fn set_version(&mut self, value: u8) {
        self.set_word(
            0xF << field::VERSION_SHIFT,
            u32::from(value) << field::VERSION_SHIFT,
        );
    }

    /// Sets the traffic class.
    pub fn set_traffic_class(&mut self, value: u8) {
        self.set_word(0xFF << field::TC_SHIFT, u32::from(value) << field::TC_SHIFT);
    }

    /// Sets the flow label; only the low 20 bits are used.
    pub fn set_flow_label(&mut self, value: u32) {
        self.set_word(field::FLOW_MASK, value);
    }

    /// Sets the payload length.
    pub fn set_payload_len(&mut self, value: u16) {
        write_u16(&mut self.data_mut()[field::LENGTH], value);
    }

    /// Sets the next header.
    pub fn set_next_header(&mut self, value: u8) {
        self.data_mut()[field::NEXT_HEADER] = value;
    }

    /// Sets the hop limit.
    pub fn set_hop_limit(&mut self, value: u8) {
        self.data_mut()[field::HOP_LIMIT] = value;
    }

    /// Sets the source address.
    pub fn set_src_addr(&mut self, value: Ipv6Addr) {
        self.data_mut()[field::SRC_ADDR].copy_from_slice(&value.octets());
    }

    /// Sets the destination address.
    pub fn set_dst_addr(&mut self, value: Ipv6Addr) {
        self.data_mut()[field::DST_ADDR].copy_from_slice(&value.octets());
    }
}

/// A validated IPv6 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv6Repr {
    /// Source address.
    pub src_addr: Ipv6Addr,
    /// Destination address.
    pub dst_addr: Ipv6Addr,
    /// Protocol of the next header.
    pub next_header: u8,
    /// Bytes after the header; `emit` saturates it at 65535.
    pub payload_len: usize,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
}

impl Ipv6Repr {
    /// Parses an IPv6 header; fails on a short buffer or a version other
    /// than 6.
    pub fn parse<T: AsRef<[u8]>>(packet: &Ipv6Packet<T>) -> Result<Self> {
        packet.check_len()?;
        if packet.version() != 6 {
            return Err(Error);
        }
        Ok(Self {
            src_addr: packet.src_addr(),
            dst_addr: packet.dst_addr(),
            next_header: packet.next_header(),
            payload_len: usize::from(packet.payload_len()),
            hop_limit: packet.hop_limit(),
            traffic_class: packet.traffic_class(),
            flow_label: packet.flow_label(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header; the flow label is truncated to 20 bits.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Ipv6Packet<T>) {
        packet.set_word(u32::MAX, 0);
        packet.set_version(6);
        packet.set_traffic_class(self.traffic_class);
        packet.set_flow_label(self.flow_label);
        packet.set_payload_len(self.payload_len.min(usize::from(u16::MAX)) as u16);
        packet.set_next_header(self.next_header);
        packet.set_hop_limit(self.hop_limit);
        packet.set_src_addr(self.src_addr);
        packet.set_dst_addr(self.dst_addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategies;
    use proptest::prelude::*;

    fn repr() -> Ipv6Repr {
        Ipv6Repr {
            src_addr: "2001:db8::1".parse().unwrap(),
            dst_addr: "2001:db8::2".parse().unwrap(),
            next_header: 17,
            payload_len: 48,
            hop_limit: 64,
            traffic_class: 0xab,
            flow_label: 0x1_2345,
        }
    }

    fn bytes() -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..8].copy_from_slice(&[0x6a, 0xb1, 0x23, 0x45, 0x00, 0x30, 0x11, 0x40]);
        b[8..10].copy_from_slice(&[0x20, 0x01]);
        b[10..12].copy_from_slice(&[0x0d, 0xb8]);
        b[23] = 1;
        b[24..26].copy_from_slice(&[0x20, 0x01]);
        b[26..28].copy_from_slice(&[0x0d, 0xb8]);
        b[39] = 2;
        b
    }

    #[test]
    fn deconstruct() {
        let b = bytes();
        let p = Ipv6Packet::new_checked(&b[..]).unwrap();
        assert_eq!(
            (p.version(), p.traffic_class(), p.flow_label()),
            (6, 0xab, 0x1_2345)
        );
        assert_eq!((p.payload_len(), p.next_header(), p.hop_limit()), (48, 17, 64));
        assert_eq!(Ipv6Repr::parse(&p), Ok(repr()));
    }

    #[test]
    fn construct() {
        let mut buf = [0xa5u8; HEADER_LEN];
        repr().emit(&mut Ipv6Packet::new_unchecked(&mut buf));
        assert_eq!(buf, bytes());
    }

    #[test]
    fn rejects_short_and_other_versions() {
        let b = bytes();
        assert_eq!(Ipv6Packet::new_checked(&b[..39]), Err(Error));
        let mut v4 = b;
        v4[0] = 0x4a;
        assert_eq!(Ipv6Repr::parse(&Ipv6Packet::new_unchecked(&v4[..])), Err(Error));
    }

    #[test]
    fn setters_touch_only_their_bits() {
        let mut buf = [0u8; HEADER_LEN];
        let mut p = Ipv6Packet::new_unchecked(&mut buf);
        p.set_flow_label(u32::MAX);
        p.set_version(6);
        p.set_traffic_class(0x81);
        p.set_flow_label(0);
        assert_eq!(buf[..4], [0x68, 0x10, 0, 0]);
    }

    proptest! {
        #[test]
        fn round_trip(repr in strategies::ipv6()) {
            let mut buf = [0xffu8; HEADER_LEN];
            repr.emit(&mut Ipv6Packet::new_unchecked(&mut buf));
            prop_assert_eq!(Ipv6Repr::parse(&Ipv6Packet::new_checked(&buf[..]).unwrap()), Ok(repr));
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..48)) {
            let _ = Ipv6Packet::new_checked(&bytes[..]).and_then(|p| Ipv6Repr::parse(&p));
        }
    }
}
