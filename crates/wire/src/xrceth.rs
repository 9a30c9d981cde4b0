//! XRC Extended Transport Header (4 bytes): every XRC request names the
//! shared receive queue it is for.

use crate::field::{read_u24, write_u24, MASK_24};
use crate::{header_view, Result};

mod field {
    use crate::field::Field;

    /// One reserved byte precedes the SRQ number.
    pub(super) const RESERVED: usize = 0;
    pub(super) const SRQN: Field = 1..4;
}

/// Length of the XRCETH.
pub const HEADER_LEN: usize = field::SRQN.end;

header_view! {
    /// A zero-copy view of an XRCETH.
    XrcEthPacket, HEADER_LEN
}

impl<T: AsRef<[u8]>> XrcEthPacket<T> {
    /// The XRC SRQ number (24 bits).
    pub fn srqn(&self) -> u32 {
        read_u24(&self.buffer.as_ref()[field::SRQN])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> XrcEthPacket<T> {
    /// Sets the SRQ number; only the low 24 bits are used.
    pub fn set_srqn(&mut self, value: u32) {
        write_u24(&mut self.buffer.as_mut()[field::SRQN], value & MASK_24);
    }
}

/// A parsed XRCETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct XrcEthRepr {
    /// The XRC SRQ number (24 bits).
    pub srqn: u32,
}

impl XrcEthRepr {
    /// Parses an XRCETH, ignoring the reserved byte; fails only on a short
    /// buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &XrcEthPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self { srqn: packet.srqn() })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header with a zero reserved byte.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut XrcEthPacket<T>) {
        packet.buffer.as_mut()[field::RESERVED] = 0;
        packet.set_srqn(self.srqn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use proptest::prelude::*;

    #[test]
    fn deconstruct_and_construct() {
        let bytes = [0xAA, 0x12, 0x34, 0x56];
        let repr = XrcEthRepr { srqn: 0x12_3456 };
        // The reserved byte is ignored on receive and zero on send.
        assert_eq!(
            XrcEthRepr::parse(&XrcEthPacket::new_checked(&bytes[..]).unwrap()),
            Ok(repr)
        );
        let mut buf = [0xffu8; HEADER_LEN];
        repr.emit(&mut XrcEthPacket::new_unchecked(&mut buf));
        assert_eq!(buf, [0, 0x12, 0x34, 0x56]);
        assert_eq!(XrcEthPacket::new_checked(&bytes[..3]), Err(Error));
    }

    proptest! {
        #[test]
        fn round_trip(srqn in 0..1u32 << 24) {
            let repr = XrcEthRepr { srqn };
            let mut buf = [0u8; HEADER_LEN];
            repr.emit(&mut XrcEthPacket::new_unchecked(&mut buf));
            prop_assert_eq!(XrcEthRepr::parse(&XrcEthPacket::new_unchecked(&buf)), Ok(repr));
        }
    }
}
