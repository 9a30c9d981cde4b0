//! Base Transport Header (12 bytes), first in every packet.

use crate::field::{read_u16, read_u24, set_bit, write_u16, write_u24, MASK_24};
use crate::{header_view, Error, Opcode, Psn, Result};

mod field {
    use crate::field::Field;

    pub(super) const OPCODE: usize = 0;
    /// SE, MigReq, PadCnt, TVer.
    pub(super) const FLAGS: usize = 1;
    pub(super) const PKEY: Field = 2..4;
    /// FECN, BECN and 6 reserved bits.
    pub(super) const ECN: usize = 4;
    pub(super) const DEST_QPN: Field = 5..8;
    /// AckReq and 7 reserved bits.
    pub(super) const ACK: usize = 8;
    pub(super) const PSN: Field = 9..12;

    pub(super) const SE: u8 = 0x80;
    pub(super) const MIGREQ: u8 = 0x40;
    pub(super) const PAD_SHIFT: u32 = 4;
    pub(super) const PAD_MASK: u8 = 0x30;
    pub(super) const TVER_MASK: u8 = 0x0F;
    pub(super) const FECN: u8 = 0x80;
    pub(super) const BECN: u8 = 0x40;
    pub(super) const ACK_REQ: u8 = 0x80;
}

/// Length of the BTH.
pub const HEADER_LEN: usize = field::PSN.end;

/// Offset of the byte holding FECN, BECN and reserved bits, which the ICRC
/// treats as variant.
pub(crate) const ECN_BYTE: usize = field::ECN;

/// The P_Key rxe sends: the default partition, full member.
pub const DEFAULT_PKEY: u16 = 0xFFFF;

header_view! {
    /// A zero-copy view of a BTH.
    BthPacket, HEADER_LEN
}

impl<T: AsRef<[u8]>> BthPacket<T> {
    fn data(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// The raw opcode byte.
    pub fn opcode_raw(&self) -> u8 {
        self.data()[field::OPCODE]
    }

    /// The opcode, if known.
    pub fn opcode(&self) -> Option<Opcode> {
        Opcode::from_u8(self.opcode_raw())
    }

    /// Solicited Event.
    pub fn solicited(&self) -> bool {
        self.data()[field::FLAGS] & field::SE != 0
    }

    /// MigReq (APM state; hardware sets it, rxe does not).
    pub fn migreq(&self) -> bool {
        self.data()[field::FLAGS] & field::MIGREQ != 0
    }

    /// Number of pad bytes (0–3) between payload and ICRC.
    pub fn pad_count(&self) -> u8 {
        (self.data()[field::FLAGS] & field::PAD_MASK) >> field::PAD_SHIFT
    }

    /// Transport header version; must be 0.
    pub fn tver(&self) -> u8 {
        self.data()[field::FLAGS] & field::TVER_MASK
    }

    /// Partition key.
    pub fn pkey(&self) -> u16 {
        read_u16(&self.data()[field::PKEY])
    }

    /// Forward explicit congestion notification.
    pub fn fecn(&self) -> bool {
        self.data()[field::ECN] & field::FECN != 0
    }

    /// Backward explicit congestion notification.
    pub fn becn(&self) -> bool {
        self.data()[field::ECN] & field::BECN != 0
    }

    /// Destination QP number (24 bits).
    pub fn dest_qpn(&self) -> u32 {
        read_u24(&self.data()[field::DEST_QPN])
    }

    /// Acknowledge request.
    pub fn ack_req(&self) -> bool {
        self.data()[field::ACK] & field::ACK_REQ != 0
    }

    /// Packet sequence number.
    pub fn psn(&self) -> Psn {
        Psn::new(read_u24(&self.data()[field::PSN]))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> BthPacket<T> {
    fn data_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }

    /// Sets the raw opcode byte.
    pub fn set_opcode_raw(&mut self, value: u8) {
        self.data_mut()[field::OPCODE] = value;
    }

    /// Sets the opcode.
    pub fn set_opcode(&mut self, value: Opcode) {
        self.set_opcode_raw(value.as_u8());
    }

    /// Sets Solicited Event.
    pub fn set_solicited(&mut self, value: bool) {
        set_bit(&mut self.data_mut()[field::FLAGS], field::SE, value);
    }

    /// Sets MigReq.
    pub fn set_migreq(&mut self, value: bool) {
        set_bit(&mut self.data_mut()[field::FLAGS], field::MIGREQ, value);
    }

    /// Sets the pad count; only the low 2 bits are used.
    pub fn set_pad_count(&mut self, value: u8) {
        let b = &mut self.data_mut()[field::FLAGS];
        *b = (*b & !field::PAD_MASK) | ((value << field::PAD_SHIFT) & field::PAD_MASK);
    }

    /// Sets the header version; only the low 4 bits are used.
    pub fn set_tver(&mut self, value: u8) {
        let b = &mut self.data_mut()[field::FLAGS];
        *b = (*b & !field::TVER_MASK) | (value & field::TVER_MASK);
    }

    /// Sets the partition key.
    pub fn set_pkey(&mut self, value: u16) {
        write_u16(&mut self.data_mut()[field::PKEY], value);
    }

    /// Sets FECN.
    pub fn set_fecn(&mut self, value: bool) {
        set_bit(&mut self.data_mut()[field::ECN], field::FECN, value);
    }

    /// Sets BECN.
    pub fn set_becn(&mut self, value: bool) {
        set_bit(&mut self.data_mut()[field::ECN], field::BECN, value);
    }

    /// Sets the destination QPN; only the low 24 bits are used.
    pub fn set_dest_qpn(&mut self, value: u32) {
        write_u24(&mut self.data_mut()[field::DEST_QPN], value & MASK_24);
    }

    /// Sets AckReq.
    pub fn set_ack_req(&mut self, value: bool) {
        set_bit(&mut self.data_mut()[field::ACK], field::ACK_REQ, value);
    }

    /// Sets the PSN.
    pub fn set_psn(&mut self, value: Psn) {
        write_u24(&mut self.data_mut()[field::PSN], value.value());
    }
}

/// The destination QPN of a packet (BTH first), read without parsing the
/// rest; `None` if it is shorter than a BTH. For routing a datagram before
/// it is handed to its QP, which does the full parse.
pub fn peek_dest_qpn(packet: &[u8]) -> Option<u32> {
    BthPacket::new_checked(packet).ok().map(|bth| bth.dest_qpn())
}

/// A validated BTH.
///
/// Reserved bits are not kept: they are ignored on parse and sent as zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BthRepr {
    /// Opcode.
    pub opcode: Opcode,
    /// Solicited Event.
    pub solicited: bool,
    /// MigReq.
    pub migreq: bool,
    /// Pad bytes before the ICRC (0–3).
    pub pad_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// Forward ECN.
    pub fecn: bool,
    /// Backward ECN.
    pub becn: bool,
    /// Destination QPN (24 bits).
    pub dest_qpn: u32,
    /// Acknowledge request.
    pub ack_req: bool,
    /// Packet sequence number.
    pub psn: Psn,
}

impl BthRepr {
    /// A BTH with the default P_Key and every flag clear.
    pub const fn new(opcode: Opcode, dest_qpn: u32, psn: Psn) -> Self {
        Self {
            opcode,
            solicited: false,
            migreq: false,
            pad_count: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qpn: dest_qpn & MASK_24,
            ack_req: false,
            psn,
        }
    }

    /// Parses a BTH; fails on a short buffer, TVer ≠ 0 or an unknown opcode.
    pub fn parse<T: AsRef<[u8]>>(packet: &BthPacket<T>) -> Result<Self> {
        packet.check_len()?;
        if packet.tver() != 0 {
            return Err(Error);
        }
        Ok(Self {
            opcode: packet.opcode().ok_or(Error)?,
            solicited: packet.solicited(),
            migreq: packet.migreq(),
            pad_count: packet.pad_count(),
            pkey: packet.pkey(),
            fecn: packet.fecn(),
            becn: packet.becn(),
            dest_qpn: packet.dest_qpn(),
            ack_req: packet.ack_req(),
            psn: packet.psn(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header, zeroing reserved bits; out-of-range fields are
    /// truncated to their width.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut BthPacket<T>) {
        let data = packet.data_mut();
        data[field::FLAGS] = 0;
        data[field::ECN] = 0;
        data[field::ACK] = 0;
        packet.set_opcode(self.opcode);
        packet.set_solicited(self.solicited);
        packet.set_migreq(self.migreq);
        packet.set_pad_count(self.pad_count);
        packet.set_pkey(self.pkey);
        packet.set_fecn(self.fecn);
        packet.set_becn(self.becn);
        packet.set_dest_qpn(self.dest_qpn);
        packet.set_ack_req(self.ack_req);
        packet.set_psn(self.psn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategies;
    use proptest::prelude::*;

    // The BTH of the scapy UC SEND ONLY test packet.
    static BYTES: [u8; 12] = [
        0x24, 0x60, 0xff, 0xff, 0x00, 0x00, 0x00, 0xd3, 0x00, 0xcf, 0x17, 0x10,
    ];

    fn repr() -> BthRepr {
        BthRepr {
            migreq: true,
            pad_count: 2,
            ..BthRepr::new(Opcode::UcSendOnly, 211, Psn::new(13_571_856))
        }
    }

    #[test]
    fn deconstruct() {
        let p = BthPacket::new_checked(&BYTES[..]).unwrap();
        assert_eq!(p.opcode(), Some(Opcode::UcSendOnly));
        assert!(!p.solicited() && p.migreq() && !p.fecn() && !p.becn() && !p.ack_req());
        assert_eq!((p.pad_count(), p.tver(), p.pkey()), (2, 0, 0xffff));
        assert_eq!((p.dest_qpn(), p.psn()), (211, Psn::new(0xcf1710)));
        assert_eq!(BthRepr::parse(&p), Ok(repr()));
    }

    #[test]
    fn construct() {
        let mut buf = [0xa5u8; HEADER_LEN];
        repr().emit(&mut BthPacket::new_unchecked(&mut buf));
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn setters_touch_only_their_bits() {
        let mut buf = [0u8; HEADER_LEN];
        let mut p = BthPacket::new_unchecked(&mut buf);
        p.set_solicited(true);
        p.set_becn(true);
        p.set_ack_req(true);
        p.set_tver(0xf);
        p.set_pad_count(3);
        p.set_dest_qpn(0xffff_ffff);
        p.set_tver(0);
        assert_eq!(buf, [0, 0xb0, 0, 0, 0x40, 0xff, 0xff, 0xff, 0x80, 0, 0, 0]);
    }

    #[test]
    fn rejects_short_bad_version_and_unknown_opcode() {
        assert_eq!(BthPacket::new_checked(&BYTES[..11]), Err(Error));
        let mut bad = BYTES;
        bad[1] |= 1;
        assert_eq!(BthRepr::parse(&BthPacket::new_unchecked(&bad[..])), Err(Error));
        let mut bad = BYTES;
        bad[0] = 0x15;
        assert_eq!(BthRepr::parse(&BthPacket::new_unchecked(&bad[..])), Err(Error));
    }

    #[test]
    fn reserved_bits_are_ignored() {
        let mut buf = BYTES;
        buf[4] |= 0x3f;
        buf[8] |= 0x7f;
        assert_eq!(BthRepr::parse(&BthPacket::new_unchecked(&buf[..])), Ok(repr()));
    }

    #[test]
    fn peek_reads_the_destination_qpn_only() {
        assert_eq!(peek_dest_qpn(&BYTES), Some(211));
        assert_eq!(peek_dest_qpn(&BYTES[..11]), None);
        let mut unknown = BYTES;
        unknown[0] = 0x15;
        assert_eq!(peek_dest_qpn(&unknown), Some(211), "no opcode check");
    }

    proptest! {
        #[test]
        fn round_trip(repr in strategies::bth()) {
            let mut buf = [0xffu8; HEADER_LEN];
            repr.emit(&mut BthPacket::new_unchecked(&mut buf));
            prop_assert_eq!(BthRepr::parse(&BthPacket::new_checked(&buf[..]).unwrap()), Ok(repr));
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..16)) {
            let _ = BthPacket::new_checked(&bytes[..]).and_then(|p| BthRepr::parse(&p));
        }
    }
}
