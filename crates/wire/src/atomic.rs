//! Atomic ETH (28 bytes) and Atomic ACK ETH (8 bytes).

use crate::field::{read_u32, read_u64, write_u32, write_u64};
use crate::{header_view, Result};

mod field {
    use crate::field::Field;

    pub(super) const VA: Field = 0..8;
    pub(super) const RKEY: Field = 8..12;
    /// Swap (compare & swap) or add (fetch & add) data precedes compare.
    pub(super) const SWAP_ADD: Field = 12..20;
    pub(super) const COMPARE: Field = 20..28;

    pub(super) const ORIG: Field = 0..8;
}

/// Length of the Atomic ETH.
pub const ATOMIC_ETH_LEN: usize = field::COMPARE.end;

/// Length of the Atomic ACK ETH.
pub const ATOMIC_ACK_ETH_LEN: usize = field::ORIG.end;

header_view! {
    /// A zero-copy view of an Atomic ETH.
    AtomicEthPacket, ATOMIC_ETH_LEN
}

header_view! {
    /// A zero-copy view of an Atomic ACK ETH.
    AtomicAckEthPacket, ATOMIC_ACK_ETH_LEN
}

impl<T: AsRef<[u8]>> AtomicEthPacket<T> {
    /// Remote virtual address (8-byte aligned when valid).
    pub fn va(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::VA])
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::RKEY])
    }

    /// Swap data (COMPARE_SWAP) or add data (FETCH_ADD).
    pub fn swap_add(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::SWAP_ADD])
    }

    /// Compare data (COMPARE_SWAP only).
    pub fn compare(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::COMPARE])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicEthPacket<T> {
    /// Sets the remote virtual address.
    pub fn set_va(&mut self, value: u64) {
        write_u64(&mut self.buffer.as_mut()[field::VA], value);
    }

    /// Sets the remote key.
    pub fn set_rkey(&mut self, value: u32) {
        write_u32(&mut self.buffer.as_mut()[field::RKEY], value);
    }

    /// Sets the swap/add data.
    pub fn set_swap_add(&mut self, value: u64) {
        write_u64(&mut self.buffer.as_mut()[field::SWAP_ADD], value);
    }

    /// Sets the compare data.
    pub fn set_compare(&mut self, value: u64) {
        write_u64(&mut self.buffer.as_mut()[field::COMPARE], value);
    }
}

impl<T: AsRef<[u8]>> AtomicAckEthPacket<T> {
    /// The remote data before the atomic operation.
    pub fn orig(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::ORIG])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicAckEthPacket<T> {
    /// Sets the original remote data.
    pub fn set_orig(&mut self, value: u64) {
        write_u64(&mut self.buffer.as_mut()[field::ORIG], value);
    }
}

/// A parsed Atomic ETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicEthRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap data (COMPARE_SWAP) or add data (FETCH_ADD).
    pub swap_add: u64,
    /// Compare data (ignored by FETCH_ADD).
    pub compare: u64,
}

impl AtomicEthRepr {
    /// Parses an Atomic ETH; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &AtomicEthPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            va: packet.va(),
            rkey: packet.rkey(),
            swap_add: packet.swap_add(),
            compare: packet.compare(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        ATOMIC_ETH_LEN
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut AtomicEthPacket<T>) {
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_swap_add(self.swap_add);
        packet.set_compare(self.compare);
    }
}

/// A parsed Atomic ACK ETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicAckEthRepr {
    /// The remote data before the atomic operation.
    pub orig: u64,
}

impl AtomicAckEthRepr {
    /// Parses an Atomic ACK ETH; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &AtomicAckEthPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self { orig: packet.orig() })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        ATOMIC_ACK_ETH_LEN
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut AtomicAckEthPacket<T>) {
        packet.set_orig(self.orig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{strategies, Error};
    use proptest::prelude::*;

    #[test]
    fn swap_add_comes_before_compare() {
        let repr = AtomicEthRepr {
            va: 0x1000,
            rkey: 7,
            swap_add: 0x1111,
            compare: 0x2222,
        };
        let mut buf = [0u8; ATOMIC_ETH_LEN];
        repr.emit(&mut AtomicEthPacket::new_unchecked(&mut buf));
        assert_eq!(&buf[..12], &[0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 7]);
        assert_eq!(&buf[12..20], &0x1111u64.to_be_bytes());
        assert_eq!(&buf[20..], &0x2222u64.to_be_bytes());
        assert_eq!(
            AtomicEthRepr::parse(&AtomicEthPacket::new_checked(&buf).unwrap()),
            Ok(repr)
        );
        assert_eq!(AtomicEthPacket::new_checked(&buf[..27]), Err(Error));
    }

    #[test]
    fn ack_deconstruct_and_construct() {
        let bytes = 0x0123_4567_89ab_cdefu64.to_be_bytes();
        let repr = AtomicAckEthRepr {
            orig: 0x0123_4567_89ab_cdef,
        };
        assert_eq!(
            AtomicAckEthRepr::parse(&AtomicAckEthPacket::new_checked(&bytes).unwrap()),
            Ok(repr)
        );
        let mut buf = [0u8; ATOMIC_ACK_ETH_LEN];
        repr.emit(&mut AtomicAckEthPacket::new_unchecked(&mut buf));
        assert_eq!(buf, bytes);
        assert_eq!(AtomicAckEthPacket::new_checked(&bytes[..7]), Err(Error));
    }

    proptest! {
        #[test]
        fn round_trip(repr in strategies::atomic_eth(), orig in any::<u64>()) {
            let mut buf = [0u8; ATOMIC_ETH_LEN];
            repr.emit(&mut AtomicEthPacket::new_unchecked(&mut buf));
            prop_assert_eq!(AtomicEthRepr::parse(&AtomicEthPacket::new_unchecked(&buf)), Ok(repr));
            let ack = AtomicAckEthRepr { orig };
            ack.emit(&mut AtomicAckEthPacket::new_unchecked(&mut buf));
            prop_assert_eq!(AtomicAckEthRepr::parse(&AtomicAckEthPacket::new_unchecked(&buf)), Ok(ack));
        }
    }
}
