//! Whole packets: the UDP payload from the BTH through the ICRC.

use crate::bth::{self, BthPacket, BthRepr};
use crate::icrc::ICRC_LEN;
use crate::{
    AethPacket, AethRepr, AethSyndrome, AtomicAckEthPacket, AtomicAckEthRepr, AtomicEthPacket, AtomicEthRepr,
    DethPacket, DethRepr, Error, FethPacket, FethRepr, Header, IethPacket, IethRepr, ImmDtPacket, ImmDtRepr,
    Opcode, Result, RethPacket, RethRepr, XrcEthPacket, XrcEthRepr,
};

/// The pad count that rounds `payload_len` up to a multiple of 4.
pub const fn pad_count_for(payload_len: usize) -> u8 {
    (payload_len.wrapping_neg() & 3) as u8
}

/// Whether `packet` is an RC ACKNOWLEDGE with a positive ACK syndrome (not
/// a NAK or RNR NAK), read from the BTH and AETH alone, without checking
/// the rest of the packet.
pub fn is_positive_ack(packet: &[u8]) -> bool {
    BthPacket::new_checked(packet).is_ok_and(|bth| bth.opcode() == Some(Opcode::RcAcknowledge))
        && packet
            .get(bth::HEADER_LEN..)
            .and_then(|rest| AethPacket::new_checked(rest).ok())
            .is_some_and(|aeth| aeth.syndrome().is_ok_and(AethSyndrome::is_ack))
}

/// A structurally checked view of a whole RoCEv2 UDP payload.
///
/// Only [`RocePacket::new_checked`] builds one, so every accessor is
/// panic-free: the header version is 0, the opcode is known, the buffer
/// holds every header the opcode table lists, the pad fits, the 4 ICRC
/// bytes are present, and opcodes without payload carry neither payload
/// nor pad. Header *contents* are validated by [`PacketRepr::parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RocePacket<T: AsRef<[u8]>> {
    buffer: T,
    opcode: Opcode,
}

impl<T: AsRef<[u8]>> RocePacket<T> {
    /// Checks the structure of `buffer` and wraps it.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let bytes = buffer.as_ref();
        let bth = BthPacket::new_checked(bytes)?;
        if bth.tver() != 0 {
            return Err(Error);
        }
        let opcode = bth.opcode().ok_or(Error)?;
        let rest = bytes
            .len()
            .checked_sub(opcode.header_len() + ICRC_LEN)
            .ok_or(Error)?;
        let pad = usize::from(bth.pad_count());
        if rest < pad || (!opcode.has_payload() && rest != 0) {
            return Err(Error);
        }
        Ok(Self { buffer, opcode })
    }

    /// The opcode.
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// The BTH.
    pub fn bth(&self) -> BthPacket<&[u8]> {
        BthPacket::new_unchecked(&self.buffer.as_ref()[..bth::HEADER_LEN])
    }

    /// The bytes of extension header `header`, if the opcode has it.
    pub fn header(&self, header: Header) -> Option<&[u8]> {
        let offset = self.opcode.offset(header)?;
        self.buffer.as_ref().get(offset..offset + header.size())
    }

    /// Number of pad bytes.
    pub fn pad_len(&self) -> usize {
        usize::from(self.bth().pad_count())
    }

    /// The payload, without pad.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.payload_range()]
    }

    fn payload_range(&self) -> core::ops::Range<usize> {
        let end = self.buffer.as_ref().len() - ICRC_LEN - self.pad_len();
        self.opcode.header_len()..end
    }

    /// Everything the ICRC covers after the IP and UDP headers: BTH through
    /// pad.
    pub fn without_icrc(&self) -> &[u8] {
        let bytes = self.buffer.as_ref();
        &bytes[..bytes.len() - ICRC_LEN]
    }

    /// The ICRC value (sent least significant byte first).
    pub fn icrc(&self) -> u32 {
        let bytes = self.buffer.as_ref();
        let mut icrc = [0; ICRC_LEN];
        icrc.copy_from_slice(&bytes[bytes.len() - ICRC_LEN..]);
        u32::from_le_bytes(icrc)
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RocePacket<T> {
    /// The payload, mutably.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let range = self.payload_range();
        &mut self.buffer.as_mut()[range]
    }

    /// Writes the ICRC value into the last 4 bytes.
    pub fn set_icrc(&mut self, icrc: u32) {
        let bytes = self.buffer.as_mut();
        let at = bytes.len() - ICRC_LEN;
        bytes[at..].copy_from_slice(&icrc.to_le_bytes());
    }
}

impl<'a> RocePacket<&'a [u8]> {
    /// Parses a whole UDP payload: structure, then every header.
    pub fn parse(bytes: &'a [u8]) -> Result<ParsedPacket<'a>> {
        let packet = Self::new_checked(bytes)?;
        let repr = PacketRepr::parse(&packet)?;
        let payload = &bytes[packet.payload_range()];
        Ok(ParsedPacket {
            repr,
            payload,
            icrc: packet.icrc(),
        })
    }
}

/// The result of [`RocePacket::parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParsedPacket<'a> {
    /// All headers, plus the payload length.
    pub repr: PacketRepr,
    /// The payload, without pad.
    pub payload: &'a [u8],
    /// The ICRC as carried (not verified; see [`crate::icrc`]).
    pub icrc: u32,
}

impl ParsedPacket<'_> {
    /// The opcode.
    pub fn opcode(&self) -> Opcode {
        self.repr.bth.opcode
    }
}

/// Every header of a packet plus its payload length.
///
/// Each `Option` must be `Some` exactly when the opcode carries that header
/// ([`Opcode::headers`]); [`PacketRepr::emit`] checks this. The pad length
/// is `bth.pad_count`, which [`PacketRepr::new`] derives from the payload
/// length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PacketRepr {
    /// Base transport header.
    pub bth: BthRepr,
    /// DETH (UD).
    pub deth: Option<DethRepr>,
    /// XRCETH (XRC requests).
    pub xrceth: Option<XrcEthRepr>,
    /// FETH (FLUSH).
    pub feth: Option<FethRepr>,
    /// RETH.
    pub reth: Option<RethRepr>,
    /// Atomic ETH.
    pub atomic_eth: Option<AtomicEthRepr>,
    /// AETH.
    pub aeth: Option<AethRepr>,
    /// Atomic ACK ETH.
    pub atomic_ack_eth: Option<AtomicAckEthRepr>,
    /// Immediate data.
    pub imm_dt: Option<ImmDtRepr>,
    /// Invalidate ETH.
    pub ieth: Option<IethRepr>,
    /// Payload length, without pad.
    pub payload_len: usize,
}

impl PacketRepr {
    /// A packet with no extension header set yet, whose pad count is
    /// derived from `payload_len`.
    pub const fn new(mut bth: BthRepr, payload_len: usize) -> Self {
        bth.pad_count = pad_count_for(payload_len);
        Self {
            bth,
            deth: None,
            xrceth: None,
            feth: None,
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack_eth: None,
            imm_dt: None,
            ieth: None,
            payload_len,
        }
    }

    /// Parses every header of a checked packet.
    pub fn parse<T: AsRef<[u8]>>(packet: &RocePacket<T>) -> Result<Self> {
        let bth = BthRepr::parse(&packet.bth())?;
        // Keep the pad count as received rather than the one `new` derives.
        let mut repr = Self {
            bth,
            ..Self::new(bth, packet.payload().len())
        };
        // Headers come in wire order, each right after the one before.
        let mut at = bth::HEADER_LEN;
        for header in bth.opcode.headers().iter() {
            let bytes = packet.buffer.as_ref().get(at..at + header.size()).ok_or(Error)?;
            at += header.size();
            match header {
                Header::Deth => repr.deth = Some(DethRepr::parse(&DethPacket::new_unchecked(bytes))?),
                Header::Feth => repr.feth = Some(FethRepr::parse(&FethPacket::new_unchecked(bytes))?),
                Header::Reth => repr.reth = Some(RethRepr::parse(&RethPacket::new_unchecked(bytes))?),
                Header::AtomicEth => {
                    repr.atomic_eth = Some(AtomicEthRepr::parse(&AtomicEthPacket::new_unchecked(bytes))?);
                }
                Header::Aeth => repr.aeth = Some(AethRepr::parse(&AethPacket::new_unchecked(bytes))?),
                Header::AtomicAckEth => {
                    let view = AtomicAckEthPacket::new_unchecked(bytes);
                    repr.atomic_ack_eth = Some(AtomicAckEthRepr::parse(&view)?);
                }
                Header::ImmDt => repr.imm_dt = Some(ImmDtRepr::parse(&ImmDtPacket::new_unchecked(bytes))?),
                Header::Ieth => repr.ieth = Some(IethRepr::parse(&IethPacket::new_unchecked(bytes))?),
                // Reserved: ignored on receive, zero on send.
                Header::CnpPad => {}
                // No known opcode has it.
                Header::XrcEth => {
                    repr.xrceth = Some(XrcEthRepr::parse(&XrcEthPacket::new_unchecked(bytes))?);
                }
            }
        }
        Ok(repr)
    }

    /// The opcode.
    pub const fn opcode(&self) -> Opcode {
        self.bth.opcode
    }

    /// Length of the BTH and extension headers.
    pub const fn header_len(&self) -> usize {
        self.bth.opcode.header_len()
    }

    /// Total length of the UDP payload: headers, payload, pad and ICRC.
    pub const fn buffer_len(&self) -> usize {
        (self.header_len() + ICRC_LEN + self.bth.pad_count as usize).saturating_add(self.payload_len)
    }

    fn has(&self, header: Header) -> bool {
        match header {
            Header::Deth => self.deth.is_some(),
            Header::Feth => self.feth.is_some(),
            Header::Reth => self.reth.is_some(),
            Header::AtomicEth => self.atomic_eth.is_some(),
            Header::Aeth => self.aeth.is_some(),
            Header::AtomicAckEth => self.atomic_ack_eth.is_some(),
            Header::ImmDt => self.imm_dt.is_some(),
            Header::Ieth => self.ieth.is_some(),
            Header::CnpPad => self.bth.opcode.headers().contains(Header::CnpPad),
            Header::XrcEth => self.xrceth.is_some(),
        }
    }

    /// Checks that the headers match the opcode, that the pad count fits in
    /// its field, and that an opcode without payload has neither payload
    /// nor pad.
    pub fn check(&self) -> Result<()> {
        let op = self.bth.opcode;
        let headers_match = Header::ALL
            .iter()
            .all(|&h| self.has(h) == op.headers().contains(h));
        let payload_ok = op.has_payload() || (self.payload_len == 0 && self.bth.pad_count == 0);
        if headers_match && payload_ok && self.bth.pad_count <= 3 {
            Ok(())
        } else {
            Err(Error)
        }
    }

    /// Writes headers, zero pad and a zero ICRC into the first
    /// [`buffer_len`](Self::buffer_len) bytes of `buffer`, leaving the
    /// payload bytes untouched; returns that length.
    ///
    /// Fails if [`check`](Self::check) fails or `buffer` is too short.
    pub fn emit(&self, buffer: &mut [u8]) -> Result<usize> {
        self.check()?;
        let len = self.buffer_len();
        let buffer = buffer.get_mut(..len).ok_or(Error)?;
        self.bth.emit(&mut BthPacket::new_unchecked(&mut *buffer));
        let mut at = bth::HEADER_LEN;
        for header in self.bth.opcode.headers().iter() {
            let slot = &mut buffer[at..at + header.size()];
            at += header.size();
            // `check` guarantees each `Option` matching the opcode is `Some`.
            match header {
                Header::Deth => self.deth.ok_or(Error)?.emit(&mut DethPacket::new_unchecked(slot)),
                Header::Feth => self.feth.ok_or(Error)?.emit(&mut FethPacket::new_unchecked(slot)),
                Header::Reth => self.reth.ok_or(Error)?.emit(&mut RethPacket::new_unchecked(slot)),
                Header::AtomicEth => {
                    self.atomic_eth
                        .ok_or(Error)?
                        .emit(&mut AtomicEthPacket::new_unchecked(slot));
                }
                Header::Aeth => self.aeth.ok_or(Error)?.emit(&mut AethPacket::new_unchecked(slot)),
                Header::AtomicAckEth => {
                    self.atomic_ack_eth
                        .ok_or(Error)?
                        .emit(&mut AtomicAckEthPacket::new_unchecked(slot));
                }
                Header::ImmDt => self
                    .imm_dt
                    .ok_or(Error)?
                    .emit(&mut ImmDtPacket::new_unchecked(slot)),
                Header::Ieth => self.ieth.ok_or(Error)?.emit(&mut IethPacket::new_unchecked(slot)),
                Header::CnpPad => slot.fill(0),
                Header::XrcEth => self
                    .xrceth
                    .ok_or(Error)?
                    .emit(&mut XrcEthPacket::new_unchecked(slot)),
            }
        }
        // Pad and ICRC slot.
        buffer[at + self.payload_len..].fill(0);
        Ok(len)
    }

    /// The payload bytes of a buffer laid out by this repr.
    pub fn payload_mut<'b>(&self, buffer: &'b mut [u8]) -> Result<&'b mut [u8]> {
        let start = self.header_len();
        buffer
            .get_mut(start..start.saturating_add(self.payload_len))
            .ok_or(Error)
    }

    /// [`emit`](Self::emit), then copies `payload`, whose length must be
    /// `payload_len`.
    pub fn emit_with_payload(&self, buffer: &mut [u8], payload: &[u8]) -> Result<usize> {
        if payload.len() != self.payload_len {
            return Err(Error);
        }
        let len = self.emit(buffer)?;
        self.payload_mut(buffer)?.copy_from_slice(payload);
        Ok(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::opcode::OPCODE_TABLE;
    use crate::{strategies, NakCode, Psn};
    use proptest::prelude::*;
    use std::vec;
    use std::vec::Vec;

    /// UDP payload of the ConnectX-4 Lx CNP capture (roce.md vector 1).
    #[rustfmt::skip]
    static CNP: [u8; 32] = [
        0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x01, 0x18, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x82, 0xfd, 0x00, 0x2a,
    ];

    #[test]
    fn xrc_request_carries_xrceth_after_bth() {
        use crate::{RethRepr, XrcEthRepr};
        let bth = BthRepr::new(Opcode::XrcWriteOnlyWithImm, 0x12, Psn::new(3));
        let repr = PacketRepr {
            xrceth: Some(XrcEthRepr { srqn: 0xAB_CDEF }),
            reth: Some(RethRepr {
                va: 0x1000,
                rkey: 7,
                dma_len: 2,
            }),
            imm_dt: Some(ImmDtRepr {
                imm_data: 0x0102_0304,
            }),
            ..PacketRepr::new(bth, 2)
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit_with_payload(&mut buf, b"hi").unwrap();
        // BTH, XRCETH (reserved byte, SRQN), RETH, ImmDt, payload, pad, ICRC.
        assert_eq!(buf.len(), 12 + 4 + 16 + 4 + 2 + 2 + 4);
        assert_eq!(buf[12..16], [0, 0xAB, 0xCD, 0xEF]);
        assert_eq!(buf[16..24], 0x1000u64.to_be_bytes());
        let parsed = RocePacket::parse(&buf).unwrap();
        assert_eq!(parsed.repr, repr);
        assert_eq!(parsed.payload, b"hi");
        // Without its XRCETH the request cannot be emitted.
        let bad = PacketRepr { xrceth: None, ..repr };
        assert_eq!(bad.emit(&mut buf), Err(Error));
        // Responses have the RC layout.
        let ack = PacketRepr {
            aeth: Some(AethRepr {
                syndrome: AethSyndrome::ACK_UNLIMITED,
                msn: 1,
            }),
            ..PacketRepr::new(BthRepr::new(Opcode::XrcAcknowledge, 0x12, Psn::new(3)), 0)
        };
        assert_eq!(ack.buffer_len(), 12 + 4 + 4);
    }

    #[test]
    fn parses_cnp_capture() {
        let p = RocePacket::parse(&CNP).unwrap();
        assert_eq!(p.opcode(), Opcode::Cnp);
        let bth = p.repr.bth;
        assert!(bth.becn && !bth.fecn && !bth.ack_req);
        assert_eq!((bth.dest_qpn, bth.psn, bth.pkey), (0x118, Psn::ZERO, 0xffff));
        assert!(p.payload.is_empty());
        assert_eq!(p.icrc, 0x2a00_fd82);
        let mut out = [0xffu8; 32];
        assert_eq!(p.repr.emit(&mut out), Ok(32));
        assert_eq!(out[..28], CNP[..28]);
    }

    #[test]
    fn parses_scapy_uc_send_only() {
        let bytes = crate::icrc::tests::scapy_uc_send_only();
        let roce = &bytes[28..];
        let p = RocePacket::parse(roce).unwrap();
        assert_eq!(p.opcode(), Opcode::UcSendOnly);
        assert_eq!(p.payload.len(), 18);
        assert_eq!(p.repr.bth.pad_count, 2);
        assert_eq!(p.icrc.to_le_bytes(), [0x78, 0xf3, 0x53, 0xf3]);
        let view = RocePacket::new_checked(roce).unwrap();
        assert_eq!(view.pad_len(), 2);
        assert_eq!(view.header(Header::Reth), None);
        assert_eq!(view.without_icrc().len(), roce.len() - 4);
    }

    fn ack(syndrome: AethSyndrome) -> PacketRepr {
        let mut repr = PacketRepr::new(BthRepr::new(Opcode::RcAcknowledge, 5, Psn::new(9)), 0);
        repr.aeth = Some(AethRepr { syndrome, msn: 3 });
        repr
    }

    #[test]
    fn positive_acks_are_told_from_naks_and_requests() {
        let bytes = |repr: PacketRepr| {
            let mut buf = vec![0u8; repr.buffer_len()];
            repr.emit(&mut buf).unwrap();
            buf
        };
        let ok = bytes(ack(AethSyndrome::ACK_UNLIMITED));
        assert!(is_positive_ack(&ok));
        assert!(!is_positive_ack(&ok[..15]), "AETH cut short");
        assert!(!is_positive_ack(&bytes(ack(AethSyndrome::Nak(
            NakCode::PsnSequenceError
        )))));
        assert!(!is_positive_ack(&bytes(ack(AethSyndrome::RnrNak { timer: 1 }))));
        let send = PacketRepr::new(BthRepr::new(Opcode::RcSendOnly, 5, Psn::new(9)), 0);
        assert!(!is_positive_ack(&bytes(send)));
    }

    #[test]
    fn emit_rejects_inconsistent_reprs() {
        let mut buf = [0u8; 64];
        let good = ack(AethSyndrome::ACK_UNLIMITED);
        assert_eq!(good.emit(&mut buf), Ok(20));
        assert_eq!(good.emit(&mut buf[..19]), Err(Error));
        assert_eq!(PacketRepr { aeth: None, ..good }.emit(&mut buf), Err(Error));
        assert_eq!(
            PacketRepr {
                reth: Some(RethRepr::default()),
                ..good
            }
            .emit(&mut buf),
            Err(Error)
        );
        assert_eq!(
            PacketRepr {
                payload_len: 4,
                ..good
            }
            .emit(&mut buf),
            Err(Error)
        );
        let mut padded = good;
        padded.bth.pad_count = 1;
        assert_eq!(padded.emit(&mut buf), Err(Error));
        let mut send = PacketRepr::new(BthRepr::new(Opcode::RcSendFirst, 1, Psn::ZERO), 8);
        send.bth.pad_count = 4;
        assert_eq!(send.emit(&mut buf), Err(Error));
        assert_eq!(
            PacketRepr {
                payload_len: usize::MAX,
                ..send
            }
            .emit(&mut buf),
            Err(Error)
        );
        assert_eq!(send.emit_with_payload(&mut buf, &[0; 7]), Err(Error));
    }

    #[test]
    fn parse_rejects_malformed() {
        let mut buf = [0u8; 20];
        ack(AethSyndrome::ACK_UNLIMITED).emit(&mut buf).unwrap();
        assert!(RocePacket::parse(&buf).is_ok());
        assert_eq!(RocePacket::parse(&buf[..19]), Err(Error));
        let mut longer = [0u8; 24];
        longer[..20].copy_from_slice(&buf);
        assert_eq!(RocePacket::parse(&longer), Err(Error), "payload on an ACK");
        let mut bad = buf;
        bad[12] = 0x40; // reserved AETH type
        assert_eq!(RocePacket::parse(&bad), Err(Error));
        let mut bad = buf;
        bad[1] = 0x01; // TVer 1
        assert_eq!(RocePacket::parse(&bad), Err(Error));
        let mut bad = buf;
        bad[0] = 0x15; // unknown opcode
        assert_eq!(RocePacket::parse(&bad), Err(Error));
        // A SEND whose pad count exceeds what is there.
        let send = [
            0x04, 0x30, 0xff, 0xff, 0, 0, 0, 1, 0, 0, 0, 0, 0xaa, 0, 0, 0, 1, 2, 3, 4,
        ];
        assert_eq!(RocePacket::parse(&send).map(|p| p.payload), Ok(&[0xaa][..]));
        assert_eq!(RocePacket::parse(&send[..19]).map(|p| p.payload.len()), Ok(0));
        assert_eq!(RocePacket::parse(&send[..18]), Err(Error));
    }

    #[test]
    fn flush_and_atomic_write_layouts() {
        // FLUSH: BTH, FETH, RETH, no payload; bytes as rxe lays them out.
        let mut flush = PacketRepr::new(BthRepr::new(Opcode::RcFlush, 0x11, Psn::new(5)), 0);
        flush.feth = Some(FethRepr {
            placement: crate::feth::PLACEMENT_GLOBAL,
            selectivity: crate::feth::SELECT_MR,
        });
        flush.reth = Some(RethRepr {
            va: 0x1000,
            rkey: 0xabcd,
            dma_len: 64,
        });
        let mut buf = vec![0u8; flush.buffer_len()];
        assert_eq!(flush.emit(&mut buf), Ok(36));
        assert_eq!(buf[0], 0x1C);
        assert_eq!(buf[12..16], [0, 0, 0, 0x11]);
        assert_eq!(buf[16..24], 0x1000u64.to_be_bytes());
        let parsed = RocePacket::parse(&buf).unwrap();
        assert_eq!(parsed.repr, flush);
        // A FLUSH carrying payload is malformed.
        let mut longer = buf.clone();
        longer.splice(32..32, [0u8; 4]);
        assert_eq!(RocePacket::parse(&longer), Err(Error));

        // ATOMIC WRITE: BTH, RETH, 8 bytes of payload.
        let mut aw = PacketRepr::new(BthRepr::new(Opcode::RcAtomicWrite, 0x11, Psn::new(6)), 8);
        aw.reth = Some(RethRepr {
            va: 0x2000,
            rkey: 7,
            dma_len: 8,
        });
        let mut buf = vec![0u8; aw.buffer_len()];
        assert_eq!(aw.emit_with_payload(&mut buf, b"12345678"), Ok(12 + 16 + 8 + 4));
        assert_eq!(buf[0], 0x1D);
        let parsed = RocePacket::parse(&buf).unwrap();
        assert_eq!((parsed.repr, parsed.payload), (aw, &b"12345678"[..]));
    }

    #[test]
    fn view_mutation() {
        let repr = PacketRepr::new(BthRepr::new(Opcode::RcSendOnly, 1, Psn::ZERO), 3);
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut buf).unwrap();
        let mut view = RocePacket::new_checked(&mut buf[..]).unwrap();
        view.payload_mut().copy_from_slice(b"abc");
        view.set_icrc(0x0403_0201);
        assert_eq!(&buf[12..], b"abc\0\x01\x02\x03\x04");
    }

    /// Emits `repr` with `payload`, the way a sender would.
    fn build(repr: &PacketRepr, payload: &[u8]) -> Vec<u8> {
        let mut buf = vec![0xeeu8; repr.buffer_len()];
        assert_eq!(repr.emit_with_payload(&mut buf, payload), Ok(buf.len()));
        buf
    }

    #[test]
    fn every_opcode_round_trips() {
        for info in OPCODE_TABLE {
            let mut repr = PacketRepr::new(BthRepr::new(info.opcode, 7, Psn::new(1)), 0);
            repr.deth = info.headers.contains(Header::Deth).then(DethRepr::default);
            repr.xrceth = info.headers.contains(Header::XrcEth).then(XrcEthRepr::default);
            repr.feth = info.headers.contains(Header::Feth).then(FethRepr::default);
            repr.reth = info.headers.contains(Header::Reth).then(RethRepr::default);
            repr.atomic_eth = info
                .headers
                .contains(Header::AtomicEth)
                .then(AtomicEthRepr::default);
            repr.aeth = info.headers.contains(Header::Aeth).then_some(AethRepr {
                syndrome: AethSyndrome::ACK_UNLIMITED,
                msn: 0,
            });
            repr.atomic_ack_eth = info
                .headers
                .contains(Header::AtomicAckEth)
                .then(AtomicAckEthRepr::default);
            repr.imm_dt = info.headers.contains(Header::ImmDt).then(ImmDtRepr::default);
            repr.ieth = info.headers.contains(Header::Ieth).then(IethRepr::default);
            let buf = build(&repr, &[]);
            assert_eq!(buf.len(), info.header_len + ICRC_LEN, "{}", info.name);
            assert_eq!(RocePacket::parse(&buf).map(|p| p.repr), Ok(repr), "{}", info.name);
        }
    }

    proptest! {
        #[test]
        fn round_trip((repr, payload) in strategies::packet()) {
            let buf = build(&repr, &payload);
            let parsed = RocePacket::parse(&buf).unwrap();
            prop_assert_eq!(parsed.repr, repr);
            prop_assert_eq!(parsed.payload, &payload[..]);
            prop_assert_eq!(parsed.icrc, 0);
        }

        #[test]
        fn emit_writes_every_header_pad_and_icrc_byte((repr, _) in strategies::packet(), junk in any::<u8>()) {
            // Packet buffers are reused without clearing: what an earlier packet left must not
            // show through anything but the payload, which the caller writes.
            let mut clean = vec![0u8; repr.buffer_len()];
            let mut reused = vec![junk; repr.buffer_len()];
            repr.emit(&mut clean).unwrap();
            repr.emit(&mut reused).unwrap();
            let payload = repr.header_len()..repr.header_len() + repr.payload_len;
            reused[payload.clone()].fill(0);
            prop_assert_eq!(&reused, &clean);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            if let Ok(p) = RocePacket::parse(&bytes) {
                prop_assert_eq!(p.repr.buffer_len(), bytes.len());
            }
        }

        #[test]
        fn mutated_packets_never_panic(
            (repr, payload) in strategies::packet(),
            edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
            cut in any::<usize>(),
        ) {
            let mut buf = build(&repr, &payload);
            for (at, byte) in edits {
                let len = buf.len();
                buf[at % len] = byte;
            }
            let cut = cut % (buf.len() + 1);
            for bytes in [&buf[..], &buf[..cut]] {
                if let Ok(p) = RocePacket::parse(bytes) {
                    // Whatever parses re-emits to the same length and headers.
                    let again = build(&p.repr, p.payload);
                    prop_assert_eq!(again.len(), bytes.len());
                    prop_assert_eq!(RocePacket::parse(&again).map(|q| q.repr), Ok(p.repr));
                }
            }
        }
    }
}
