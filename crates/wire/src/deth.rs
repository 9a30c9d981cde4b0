//! Datagram Extended Transport Header (8 bytes): UD packets.

use crate::field::{read_u24, read_u32, write_u24, write_u32, MASK_24};
use crate::{header_view, Result};

mod field {
    use crate::field::Field;

    pub(super) const QKEY: Field = 0..4;
    /// One reserved byte precedes the source QPN.
    pub(super) const RESERVED: usize = 4;
    pub(super) const SRC_QPN: Field = 5..8;
}

/// Length of the DETH.
pub const HEADER_LEN: usize = field::SRC_QPN.end;

/// The Q_Key of the GSI (QP1).
pub const GSI_QKEY: u32 = 0x8001_0000;

header_view! {
    /// A zero-copy view of a DETH.
    DethPacket, HEADER_LEN
}

impl<T: AsRef<[u8]>> DethPacket<T> {
    /// Queue key.
    pub fn qkey(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::QKEY])
    }

    /// Source QP number (24 bits).
    pub fn src_qpn(&self) -> u32 {
        read_u24(&self.buffer.as_ref()[field::SRC_QPN])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> DethPacket<T> {
    /// Sets the queue key.
    pub fn set_qkey(&mut self, value: u32) {
        write_u32(&mut self.buffer.as_mut()[field::QKEY], value);
    }

    /// Sets the source QPN; only the low 24 bits are used.
    pub fn set_src_qpn(&mut self, value: u32) {
        write_u24(&mut self.buffer.as_mut()[field::SRC_QPN], value & MASK_24);
    }
}

/// A parsed DETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DethRepr {
    /// Queue key.
    pub qkey: u32,
    /// Source QPN (24 bits).
    pub src_qpn: u32,
}

impl DethRepr {
    /// Parses a DETH, ignoring the reserved byte; fails only on a short
    /// buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &DethPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            qkey: packet.qkey(),
            src_qpn: packet.src_qpn(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header with a zero reserved byte.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut DethPacket<T>) {
        packet.set_qkey(self.qkey);
        packet.buffer.as_mut()[field::RESERVED] = 0;
        packet.set_src_qpn(self.src_qpn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{strategies, Error};
    use proptest::prelude::*;

    #[test]
    fn deconstruct_and_construct() {
        let bytes = [0x80, 0x01, 0, 0, 0, 0, 0, 1];
        let repr = DethRepr {
            qkey: GSI_QKEY,
            src_qpn: 1,
        };
        assert_eq!(
            DethRepr::parse(&DethPacket::new_checked(&bytes[..]).unwrap()),
            Ok(repr)
        );
        let mut buf = [0xffu8; HEADER_LEN];
        repr.emit(&mut DethPacket::new_unchecked(&mut buf));
        assert_eq!(buf, bytes);
        assert_eq!(DethPacket::new_checked(&bytes[..7]), Err(Error));
    }

    proptest! {
        #[test]
        fn round_trip(repr in strategies::deth()) {
            let mut buf = [0u8; HEADER_LEN];
            repr.emit(&mut DethPacket::new_unchecked(&mut buf));
            prop_assert_eq!(DethRepr::parse(&DethPacket::new_unchecked(&buf)), Ok(repr));
        }
    }
}
