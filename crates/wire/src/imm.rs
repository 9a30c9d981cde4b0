//! The two 4-byte headers: immediate data (ImmDt) and the invalidate
//! R_Key (IETH).

use crate::field::{read_u32, write_u32};
use crate::{header_view, Result};

/// Length of ImmDt.
pub const IMM_DT_LEN: usize = field::IMM.end;

/// Length of the IETH.
pub const IETH_LEN: usize = field::RKEY.end;

mod field {
    use crate::field::Field;

    /// ImmDt's only field.
    pub(super) const IMM: Field = 0..4;
    /// The IETH's only field.
    pub(super) const RKEY: Field = 0..4;
}

header_view! {
    /// A zero-copy view of ImmDt.
    ImmDtPacket, IMM_DT_LEN
}

header_view! {
    /// A zero-copy view of an IETH.
    IethPacket, IETH_LEN
}

impl<T: AsRef<[u8]>> ImmDtPacket<T> {
    /// The immediate data, read big-endian.
    pub fn imm_data(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::IMM])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ImmDtPacket<T> {
    /// Sets the immediate data.
    pub fn set_imm_data(&mut self, value: u32) {
        write_u32(&mut self.buffer.as_mut()[field::IMM], value);
    }
}

impl<T: AsRef<[u8]>> IethPacket<T> {
    /// The R_Key to invalidate.
    pub fn rkey(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::RKEY])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> IethPacket<T> {
    /// Sets the R_Key to invalidate.
    pub fn set_rkey(&mut self, value: u32) {
        write_u32(&mut self.buffer.as_mut()[field::RKEY], value);
    }
}

/// Parsed immediate data.
///
/// The value is the big-endian reading of the 4 wire bytes; verbs'
/// `wc.imm_data` keeps network byte order, i.e. holds `imm_data.to_be()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ImmDtRepr {
    /// Immediate data.
    pub imm_data: u32,
}

impl ImmDtRepr {
    /// Parses ImmDt; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &ImmDtPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            imm_data: packet.imm_data(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        IMM_DT_LEN
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut ImmDtPacket<T>) {
        packet.set_imm_data(self.imm_data);
    }
}

/// A parsed IETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IethRepr {
    /// R_Key to invalidate.
    pub rkey: u32,
}

impl IethRepr {
    /// Parses an IETH; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &IethPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self { rkey: packet.rkey() })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        IETH_LEN
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut IethPacket<T>) {
        packet.set_rkey(self.rkey);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use proptest::prelude::*;

    #[test]
    fn deconstruct_and_construct() {
        let bytes = [0x12, 0x34, 0x56, 0x78];
        let imm = ImmDtRepr {
            imm_data: 0x1234_5678,
        };
        let ieth = IethRepr { rkey: 0x1234_5678 };
        assert_eq!(
            ImmDtRepr::parse(&ImmDtPacket::new_checked(&bytes).unwrap()),
            Ok(imm)
        );
        assert_eq!(
            IethRepr::parse(&IethPacket::new_checked(&bytes).unwrap()),
            Ok(ieth)
        );
        let mut buf = [0u8; 4];
        imm.emit(&mut ImmDtPacket::new_unchecked(&mut buf));
        assert_eq!(buf, bytes);
        let mut buf = [0u8; 4];
        ieth.emit(&mut IethPacket::new_unchecked(&mut buf));
        assert_eq!(buf, bytes);
        assert_eq!(ImmDtPacket::new_checked(&bytes[..3]), Err(Error));
        assert_eq!(IethPacket::new_checked(&bytes[..3]), Err(Error));
    }

    proptest! {
        #[test]
        fn round_trip(imm_data in any::<u32>(), rkey in any::<u32>()) {
            let mut buf = [0u8; 4];
            ImmDtRepr { imm_data }.emit(&mut ImmDtPacket::new_unchecked(&mut buf));
            prop_assert_eq!(ImmDtRepr::parse(&ImmDtPacket::new_unchecked(&buf)), Ok(ImmDtRepr { imm_data }));
            IethRepr { rkey }.emit(&mut IethPacket::new_unchecked(&mut buf));
            prop_assert_eq!(IethRepr::parse(&IethPacket::new_unchecked(&buf)), Ok(IethRepr { rkey }));
        }
    }
}
