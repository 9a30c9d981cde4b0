//! RDMA Extended Transport Header (16 bytes): WRITE FIRST/ONLY, READ REQUEST.

use crate::field::{read_u32, read_u64, write_u32, write_u64};
use crate::{header_view, Result};

mod field {
    use crate::field::Field;

    pub(super) const VA: Field = 0..8;
    pub(super) const RKEY: Field = 8..12;
    pub(super) const DMA_LEN: Field = 12..16;
}

/// Length of the RETH.
pub const HEADER_LEN: usize = field::DMA_LEN.end;

header_view! {
    /// A zero-copy view of a RETH.
    RethPacket, HEADER_LEN
}

impl<T: AsRef<[u8]>> RethPacket<T> {
    /// Remote virtual address.
    pub fn va(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::VA])
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::RKEY])
    }

    /// DMA length: the total length of the whole message, not this packet.
    pub fn dma_len(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::DMA_LEN])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RethPacket<T> {
    /// Sets the remote virtual address.
    pub fn set_va(&mut self, value: u64) {
        write_u64(&mut self.buffer.as_mut()[field::VA], value);
    }

    /// Sets the remote key.
    pub fn set_rkey(&mut self, value: u32) {
        write_u32(&mut self.buffer.as_mut()[field::RKEY], value);
    }

    /// Sets the DMA length.
    pub fn set_dma_len(&mut self, value: u32) {
        write_u32(&mut self.buffer.as_mut()[field::DMA_LEN], value);
    }
}

/// A parsed RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RethRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Total message length.
    pub dma_len: u32,
}

impl RethRepr {
    /// Parses a RETH; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &RethPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            va: packet.va(),
            rkey: packet.rkey(),
            dma_len: packet.dma_len(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut RethPacket<T>) {
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_dma_len(self.dma_len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{strategies, Error};
    use proptest::prelude::*;

    static BYTES: [u8; 16] = [1, 2, 3, 4, 5, 6, 7, 8, 0xde, 0xad, 0xbe, 0xef, 0, 0, 0x10, 0];

    #[test]
    fn deconstruct_and_construct() {
        let repr = RethRepr {
            va: 0x0102_0304_0506_0708,
            rkey: 0xdead_beef,
            dma_len: 4096,
        };
        assert_eq!(
            RethRepr::parse(&RethPacket::new_checked(&BYTES[..]).unwrap()),
            Ok(repr)
        );
        let mut buf = [0u8; HEADER_LEN];
        repr.emit(&mut RethPacket::new_unchecked(&mut buf));
        assert_eq!(buf, BYTES);
        assert_eq!(RethPacket::new_checked(&BYTES[..15]), Err(Error));
    }

    proptest! {
        #[test]
        fn round_trip(repr in strategies::reth()) {
            let mut buf = [0u8; HEADER_LEN];
            repr.emit(&mut RethPacket::new_unchecked(&mut buf));
            prop_assert_eq!(RethRepr::parse(&RethPacket::new_unchecked(&buf)), Ok(repr));
        }
    }
}
