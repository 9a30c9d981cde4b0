//! Byte ranges and big-endian accessors shared by the header modules.
//!
//! Callers index with ranges that `check_len` has already validated, so the
//! slices passed here always have the expected length.

/// A byte range of a header.
pub(crate) type Field = core::ops::Range<usize>;

/// Mask of a 24-bit field (QPN, PSN, MSN, EE context).
pub(crate) const MASK_24: u32 = 0x00FF_FFFF;

pub(crate) fn read_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

pub(crate) fn read_u24(b: &[u8]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}

pub(crate) fn read_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

pub(crate) fn read_u64(b: &[u8]) -> u64 {
    let mut bytes = [0; 8];
    bytes.copy_from_slice(&b[..8]);
    u64::from_be_bytes(bytes)
}

pub(crate) fn write_u16(b: &mut [u8], v: u16) {
    b[..2].copy_from_slice(&v.to_be_bytes());
}

pub(crate) fn write_u24(b: &mut [u8], v: u32) {
    b[..3].copy_from_slice(&v.to_be_bytes()[1..]);
}

pub(crate) fn write_u32(b: &mut [u8], v: u32) {
    b[..4].copy_from_slice(&v.to_be_bytes());
}

pub(crate) fn write_u64(b: &mut [u8], v: u64) {
    b[..8].copy_from_slice(&v.to_be_bytes());
}

/// Sets or clears `mask` in `byte`.
pub(crate) fn set_bit(byte: &mut u8, mask: u8, on: bool) {
    if on {
        *byte |= mask;
    } else {
        *byte &= !mask;
    }
}
