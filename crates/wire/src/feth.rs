//! FLUSH Extended Transport Header (4 bytes): RC FLUSH requests (IBTA memory-placement
//! extensions).
//!
//! One big-endian word: bits 3:0 the placement type, bits 5:4 the selectivity level, the rest
//! reserved.

use crate::field::{read_u32, write_u32};
use crate::{header_view, Result};

/// Length of the FETH.
pub const HEADER_LEN: usize = 4;

/// Placement type bit: make the data globally visible.
pub const PLACEMENT_GLOBAL: u8 = 1;
/// Placement type bit: make the data persistent.
pub const PLACEMENT_PERSISTENT: u8 = 2;
/// Selectivity: flush the range the RETH names.
pub const SELECT_RANGE: u8 = 0;
/// Selectivity: flush the whole memory region (the RETH range is not checked).
pub const SELECT_MR: u8 = 1;

const PLACEMENT_MASK: u32 = 0xF;
const SELECTIVITY_SHIFT: u32 = 4;
const SELECTIVITY_MASK: u32 = 0x3;

header_view! {
    /// A zero-copy view of a FETH.
    FethPacket, HEADER_LEN
}

impl<T: AsRef<[u8]>> FethPacket<T> {
    /// The placement type (bits 3:0).
    pub fn placement(&self) -> u8 {
        (read_u32(&self.buffer.as_ref()[..HEADER_LEN]) & PLACEMENT_MASK) as u8
    }

    /// The selectivity level (bits 5:4).
    pub fn selectivity(&self) -> u8 {
        ((read_u32(&self.buffer.as_ref()[..HEADER_LEN]) >> SELECTIVITY_SHIFT) & SELECTIVITY_MASK) as u8
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> FethPacket<T> {
    /// Sets both fields and clears the reserved bits; higher bits of either value are dropped.
    pub fn set_fields(&mut self, placement: u8, selectivity: u8) {
        let word = (u32::from(placement) & PLACEMENT_MASK)
            | ((u32::from(selectivity) & SELECTIVITY_MASK) << SELECTIVITY_SHIFT);
        write_u32(&mut self.buffer.as_mut()[..HEADER_LEN], word);
    }
}

/// A parsed FETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FethRepr {
    /// Placement type: [`PLACEMENT_GLOBAL`] and/or [`PLACEMENT_PERSISTENT`] (4 bits).
    pub placement: u8,
    /// Selectivity level: [`SELECT_RANGE`] or [`SELECT_MR`] (2 bits).
    pub selectivity: u8,
}

impl FethRepr {
    /// Parses a FETH, ignoring the reserved bits; fails only on a short buffer. Whether the
    /// values are ones the responder supports is the responder's decision.
    pub fn parse<T: AsRef<[u8]>>(packet: &FethPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            placement: packet.placement(),
            selectivity: packet.selectivity(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header with zero reserved bits.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut FethPacket<T>) {
        packet.set_fields(self.placement, self.selectivity);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use proptest::prelude::*;

    #[test]
    fn deconstruct_and_construct() {
        // Selectivity MR, placement GLOBAL|PERSISTENT, reserved bits set on the wire.
        let bytes = [0xff, 0, 0, 0x13 | 0xC0];
        let repr = FethRepr::parse(&FethPacket::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(
            repr,
            FethRepr {
                placement: 3,
                selectivity: SELECT_MR
            }
        );
        let mut buf = [0xAAu8; HEADER_LEN];
        repr.emit(&mut FethPacket::new_unchecked(&mut buf));
        assert_eq!(buf, [0, 0, 0, 0x13]);
        assert_eq!(FethPacket::new_checked(&bytes[..3]), Err(Error));
    }

    proptest! {
        #[test]
        fn round_trip(placement in 0..16u8, selectivity in 0..4u8) {
            let repr = FethRepr { placement, selectivity };
            let mut buf = [0u8; HEADER_LEN];
            repr.emit(&mut FethPacket::new_unchecked(&mut buf));
            prop_assert_eq!(FethRepr::parse(&FethPacket::new_unchecked(&buf)), Ok(repr));
        }
    }
}
