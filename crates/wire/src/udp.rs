//! UDP header (RFC 768, 8 bytes). RoCEv2 sends checksum 0: the ICRC
//! protects the payload, so the checksum is neither computed nor checked.

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

    proptest! {
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
