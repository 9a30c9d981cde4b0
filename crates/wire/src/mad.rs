//! The 24-byte common header of a Management Datagram (MAD).
//!
//! Every MAD is 256 bytes: this header and 232 bytes of class-specific
//! data. On RoCEv2 a MAD travels as the payload of a UD SEND ONLY from QP1
//! to QP1 (the GSI), with the DETH Q_Key [`GSI_QKEY`](crate::deth::GSI_QKEY).
//! The Communication Management class ([`MGMT_CLASS_CM`]) lays its messages
//! out in the data area; see [`cm`](crate::cm).

use crate::field::{read_u16, read_u32, read_u64, write_u16, write_u32, write_u64};
use crate::{header_view, Error, Result};

mod field {
    use crate::field::Field;

    pub(super) const BASE_VERSION: usize = 0;
    pub(super) const MGMT_CLASS: usize = 1;
    pub(super) const CLASS_VERSION: usize = 2;
    /// The response bit (MSB) and the method (7 bits).
    pub(super) const METHOD: usize = 3;
    pub(super) const STATUS: Field = 4..6;
    pub(super) const CLASS_SPECIFIC: Field = 6..8;
    pub(super) const TRANSACTION_ID: Field = 8..16;
    pub(super) const ATTR_ID: Field = 16..18;
    pub(super) const RESERVED: Field = 18..20;
    pub(super) const ATTR_MOD: Field = 20..24;
}

/// Length of the MAD common header.
pub const HEADER_LEN: usize = field::ATTR_MOD.end;
/// Length of a whole MAD.
pub const MAD_LEN: usize = 256;
/// Length of the class-specific data after the header.
pub const DATA_LEN: usize = MAD_LEN - HEADER_LEN;

/// The only MAD base version.
pub const BASE_VERSION: u8 = 1;
/// Management class of Communication Management.
pub const MGMT_CLASS_CM: u8 = 0x07;
/// Class version of Communication Management (IBTA 1.2).
pub const CM_CLASS_VERSION: u8 = 2;
/// Method Send: every CM message uses it.
pub const METHOD_SEND: u8 = 0x03;

const RESPONSE_BIT: u8 = 0x80;

header_view! {
    /// A zero-copy view of a MAD: the common header and, when the buffer
    /// holds it, the data area.
    MadPacket, HEADER_LEN
}

impl<T: AsRef<[u8]>> MadPacket<T> {
    /// Base version (1).
    pub fn base_version(&self) -> u8 {
        self.buffer.as_ref()[field::BASE_VERSION]
    }

    /// Management class.
    pub fn mgmt_class(&self) -> u8 {
        self.buffer.as_ref()[field::MGMT_CLASS]
    }

    /// Class version.
    pub fn class_version(&self) -> u8 {
        self.buffer.as_ref()[field::CLASS_VERSION]
    }

    /// Whether the R (response) bit is set.
    pub fn response(&self) -> bool {
        self.buffer.as_ref()[field::METHOD] & RESPONSE_BIT != 0
    }

    /// Method (7 bits).
    pub fn method(&self) -> u8 {
        self.buffer.as_ref()[field::METHOD] & !RESPONSE_BIT
    }

    /// Status.
    pub fn status(&self) -> u16 {
        read_u16(&self.buffer.as_ref()[field::STATUS])
    }

    /// Class-specific word.
    pub fn class_specific(&self) -> u16 {
        read_u16(&self.buffer.as_ref()[field::CLASS_SPECIFIC])
    }

    /// Transaction ID.
    pub fn transaction_id(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::TRANSACTION_ID])
    }

    /// Attribute ID: which message of the class this is.
    pub fn attr_id(&self) -> u16 {
        read_u16(&self.buffer.as_ref()[field::ATTR_ID])
    }

    /// Attribute modifier (ECE options in CM REQ, REP and SIDR_REP).
    pub fn attr_mod(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::ATTR_MOD])
    }

    /// The data after the header, up to [`DATA_LEN`] bytes (less if the
    /// buffer is short, more is never returned).
    pub fn data(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[HEADER_LEN..b.len().min(MAD_LEN)]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> MadPacket<T> {
    /// Sets the base version.
    pub fn set_base_version(&mut self, value: u8) {
        self.buffer.as_mut()[field::BASE_VERSION] = value;
    }

    /// Sets the management class.
    pub fn set_mgmt_class(&mut self, value: u8) {
        self.buffer.as_mut()[field::MGMT_CLASS] = value;
    }

    /// Sets the class version.
    pub fn set_class_version(&mut self, value: u8) {
        self.buffer.as_mut()[field::CLASS_VERSION] = value;
    }

    /// Sets or clears the R bit.
    pub fn set_response(&mut self, value: bool) {
        crate::field::set_bit(&mut self.buffer.as_mut()[field::METHOD], RESPONSE_BIT, value);
    }

    /// Sets the method; only the low 7 bits are used.
    pub fn set_method(&mut self, value: u8) {
        let b = &mut self.buffer.as_mut()[field::METHOD];
        *b = (*b & RESPONSE_BIT) | (value & !RESPONSE_BIT);
    }

    /// Sets the status.
    pub fn set_status(&mut self, value: u16) {
        write_u16(&mut self.buffer.as_mut()[field::STATUS], value);
    }

    /// Sets the class-specific word.
    pub fn set_class_specific(&mut self, value: u16) {
        write_u16(&mut self.buffer.as_mut()[field::CLASS_SPECIFIC], value);
    }

    /// Sets the transaction ID.
    pub fn set_transaction_id(&mut self, value: u64) {
        write_u64(&mut self.buffer.as_mut()[field::TRANSACTION_ID], value);
    }

    /// Sets the attribute ID.
    pub fn set_attr_id(&mut self, value: u16) {
        write_u16(&mut self.buffer.as_mut()[field::ATTR_ID], value);
    }

    /// Sets the attribute modifier.
    pub fn set_attr_mod(&mut self, value: u32) {
        write_u32(&mut self.buffer.as_mut()[field::ATTR_MOD], value);
    }

    /// The data after the header, mutably (up to [`DATA_LEN`] bytes).
    pub fn data_mut(&mut self) -> &mut [u8] {
        let b = self.buffer.as_mut();
        let end = b.len().min(MAD_LEN);
        &mut b[HEADER_LEN..end]
    }
}

/// A parsed MAD common header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MadRepr {
    /// Management class.
    pub mgmt_class: u8,
    /// Class version.
    pub class_version: u8,
    /// Whether this is a response (the R bit).
    pub response: bool,
    /// Method (7 bits).
    pub method: u8,
    /// Status.
    pub status: u16,
    /// Class-specific word.
    pub class_specific: u16,
    /// Transaction ID.
    pub transaction_id: u64,
    /// Attribute ID.
    pub attr_id: u16,
    /// Attribute modifier.
    pub attr_mod: u32,
}

impl MadRepr {
    /// A CM Send header for `attr_id` with transaction ID `transaction_id`.
    pub const fn cm_send(attr_id: u16, transaction_id: u64) -> Self {
        Self {
            mgmt_class: MGMT_CLASS_CM,
            class_version: CM_CLASS_VERSION,
            response: false,
            method: METHOD_SEND,
            status: 0,
            class_specific: 0,
            transaction_id,
            attr_id,
            attr_mod: 0,
        }
    }

    /// Parses the header; fails on a short buffer or a base version other
    /// than 1. The reserved word is ignored.
    pub fn parse<T: AsRef<[u8]>>(packet: &MadPacket<T>) -> Result<Self> {
        packet.check_len()?;
        if packet.base_version() != BASE_VERSION {
            return Err(Error);
        }
        Ok(Self {
            mgmt_class: packet.mgmt_class(),
            class_version: packet.class_version(),
            response: packet.response(),
            method: packet.method(),
            status: packet.status(),
            class_specific: packet.class_specific(),
            transaction_id: packet.transaction_id(),
            attr_id: packet.attr_id(),
            attr_mod: packet.attr_mod(),
        })
    }

    /// Bytes needed to emit the header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header (base version 1, reserved word zero).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut MadPacket<T>) {
        packet.set_base_version(BASE_VERSION);
        packet.set_mgmt_class(self.mgmt_class);
        packet.set_class_version(self.class_version);
        packet.set_method(self.method);
        packet.set_response(self.response);
        packet.set_status(self.status);
        packet.set_class_specific(self.class_specific);
        packet.set_transaction_id(self.transaction_id);
        packet.set_attr_id(self.attr_id);
        packet.buffer.as_mut()[field::RESERVED].fill(0);
        packet.set_attr_mod(self.attr_mod);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategies;
    use proptest::prelude::*;

    #[test]
    fn deconstruct_and_construct() {
        let bytes = [
            0x01, 0x07, 0x02, 0x03, 0x00, 0x00, 0x00, 0x00, // version, class, method, status
            0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, // transaction ID
            0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05, // REQ, attribute modifier 5
        ];
        let mut repr = MadRepr::cm_send(0x0010, 0x1122_3344_5566_7788);
        repr.attr_mod = 5;
        assert_eq!(
            MadRepr::parse(&MadPacket::new_checked(&bytes[..]).unwrap()),
            Ok(repr)
        );
        let mut buf = [0xffu8; HEADER_LEN];
        repr.emit(&mut MadPacket::new_unchecked(&mut buf));
        assert_eq!(buf, bytes);
        assert_eq!(MadPacket::new_checked(&bytes[..23]), Err(Error));
        let mut bad = bytes;
        bad[0] = 2;
        assert_eq!(MadRepr::parse(&MadPacket::new_unchecked(&bad[..])), Err(Error));
        bad[0] = 1;
        bad[3] = 0x83;
        let parsed = MadRepr::parse(&MadPacket::new_unchecked(&bad[..])).unwrap();
        assert!(parsed.response);
        assert_eq!(parsed.method, METHOD_SEND);
    }

    #[test]
    fn data_area_is_bounded() {
        let buf = [0u8; 300];
        assert_eq!(MadPacket::new_checked(&buf[..]).unwrap().data().len(), DATA_LEN);
        assert_eq!(MadPacket::new_checked(&buf[..30]).unwrap().data().len(), 6);
    }

    proptest! {
        #[test]
        fn round_trip(repr in strategies::mad()) {
            let mut buf = [0u8; HEADER_LEN];
            repr.emit(&mut MadPacket::new_unchecked(&mut buf));
            prop_assert_eq!(MadRepr::parse(&MadPacket::new_unchecked(&buf)), Ok(repr));
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = MadPacket::new_checked(&bytes[..]).and_then(|p| MadRepr::parse(&p));
        }
    }
}
