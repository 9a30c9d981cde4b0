//! Tag-matching headers (rdma-core `tm_types.h`): the Tag Matching Header (TMH, 16 bytes) that
//! starts every tag-matching message, and the Rendezvous Header (RVH, 16 bytes) that follows it
//! in a rendezvous request. Both travel inside ordinary RC SEND payloads, so they are not part
//! of [`RocePacket`](crate::RocePacket) parsing: a receiver with a tag-matching SRQ parses them
//! from the first packet's payload.

use crate::field::{read_u32, read_u64, write_u32, write_u64};
use crate::{header_view, Error, Result};

mod field {
    use crate::field::Field;

    pub(super) const OPCODE: usize = 0;
    pub(super) const RESERVED: Field = 1..4;
    pub(super) const APP_CTX: Field = 4..8;
    pub(super) const TAG: Field = 8..16;

    pub(super) const VA: Field = 0..8;
    pub(super) const RKEY: Field = 8..12;
    pub(super) const LEN: Field = 12..16;
}

/// Length of the TMH.
pub const TMH_LEN: usize = field::TAG.end;
/// Length of the RVH.
pub const RVH_LEN: usize = field::LEN.end;

/// `enum ibv_tmh_op`: what a tag-matching message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TmhOpcode {
    /// Untagged: always delivered whole to an unexpected-message buffer.
    NoTag = 0,
    /// Rendezvous request: TMH, RVH, optional metadata; the receiver READs the data.
    Rndv = 1,
    /// Rendezvous completion: the request's TMH and RVH with this opcode.
    Fin = 2,
    /// Eager: TMH followed by the data.
    Eager = 3,
}

impl TmhOpcode {
    /// The opcode of a raw value, if it names one.
    pub fn from_raw(raw: u8) -> Option<Self> {
        match raw {
            0 => Some(Self::NoTag),
            1 => Some(Self::Rndv),
            2 => Some(Self::Fin),
            3 => Some(Self::Eager),
            _ => None,
        }
    }
}

header_view! {
    /// A zero-copy view of a TMH.
    TmhPacket, TMH_LEN
}

impl<T: AsRef<[u8]>> TmhPacket<T> {
    /// The raw operation byte.
    pub fn opcode(&self) -> u8 {
        self.buffer.as_ref()[field::OPCODE]
    }

    /// Opaque application data (`app_ctx`).
    pub fn app_ctx(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::APP_CTX])
    }

    /// The tag.
    pub fn tag(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::TAG])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> TmhPacket<T> {
    /// Sets the operation byte.
    pub fn set_opcode(&mut self, value: u8) {
        self.buffer.as_mut()[field::OPCODE] = value;
    }

    /// Zeroes the reserved bytes.
    pub fn clear_reserved(&mut self) {
        self.buffer.as_mut()[field::RESERVED].fill(0);
    }

    /// Sets `app_ctx`.
    pub fn set_app_ctx(&mut self, value: u32) {
        write_u32(&mut self.buffer.as_mut()[field::APP_CTX], value);
    }

    /// Sets the tag.
    pub fn set_tag(&mut self, value: u64) {
        write_u64(&mut self.buffer.as_mut()[field::TAG], value);
    }
}

/// A parsed TMH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TmhRepr {
    /// Operation.
    pub opcode: TmhOpcode,
    /// Opaque application data.
    pub app_ctx: u32,
    /// The tag.
    pub tag: u64,
}

impl TmhRepr {
    /// Parses a TMH: fails on a short buffer or an unknown operation. The reserved bytes are
    /// not checked, as the header says only that senders zero them.
    pub fn parse<T: AsRef<[u8]>>(packet: &TmhPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            opcode: TmhOpcode::from_raw(packet.opcode()).ok_or(Error)?,
            app_ctx: packet.app_ctx(),
            tag: packet.tag(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        TMH_LEN
    }

    /// Writes the header, reserved bytes zeroed.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut TmhPacket<T>) {
        packet.set_opcode(self.opcode as u8);
        packet.clear_reserved();
        packet.set_app_ctx(self.app_ctx);
        packet.set_tag(self.tag);
    }
}

header_view! {
    /// A zero-copy view of an RVH.
    RvhPacket, RVH_LEN
}

impl<T: AsRef<[u8]>> RvhPacket<T> {
    /// Virtual address of the sender's data.
    pub fn va(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::VA])
    }

    /// Remote key of the sender's data.
    pub fn rkey(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::RKEY])
    }

    /// Length of the sender's data.
    pub fn len(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::LEN])
    }

    /// Whether the data is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RvhPacket<T> {
    /// Sets the virtual address.
    pub fn set_va(&mut self, value: u64) {
        write_u64(&mut self.buffer.as_mut()[field::VA], value);
    }

    /// Sets the remote key.
    pub fn set_rkey(&mut self, value: u32) {
        write_u32(&mut self.buffer.as_mut()[field::RKEY], value);
    }

    /// Sets the length.
    pub fn set_len(&mut self, value: u32) {
        write_u32(&mut self.buffer.as_mut()[field::LEN], value);
    }
}

/// A parsed RVH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RvhRepr {
    /// Virtual address of the sender's data.
    pub va: u64,
    /// Remote key of the sender's data.
    pub rkey: u32,
    /// Length of the sender's data.
    pub len: u32,
}

impl RvhRepr {
    /// Parses an RVH; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &RvhPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            va: packet.va(),
            rkey: packet.rkey(),
            len: packet.len(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        RVH_LEN
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut RvhPacket<T>) {
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_len(self.len);
    }
}

/// The tag-matching headers at the start of a message: the TMH and, for a rendezvous request,
/// the RVH after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TmHeaders {
    /// The TMH.
    pub tmh: TmhRepr,
    /// The RVH (rendezvous requests and FIN messages that carry one).
    pub rvh: Option<RvhRepr>,
}

impl TmHeaders {
    /// Parses the headers at the start of `payload`. A rendezvous request must hold its RVH;
    /// for FIN the RVH is taken when present.
    pub fn parse(payload: &[u8]) -> Result<Self> {
        let tmh = TmhRepr::parse(&TmhPacket::new_checked(payload)?)?;
        let rest = &payload[TMH_LEN..];
        let rvh = match tmh.opcode {
            TmhOpcode::Rndv => Some(RvhRepr::parse(&RvhPacket::new_checked(rest)?)?),
            TmhOpcode::Fin if rest.len() >= RVH_LEN => Some(RvhRepr::parse(&RvhPacket::new_unchecked(rest))?),
            _ => None,
        };
        Ok(Self { tmh, rvh })
    }

    /// Bytes needed to emit.
    pub fn buffer_len(&self) -> usize {
        TMH_LEN + self.rvh.map_or(0, |r| r.buffer_len())
    }

    /// Writes the headers into the first [`TmHeaders::buffer_len`] bytes of `buf`; fails if
    /// `buf` is shorter.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        if buf.len() < self.buffer_len() {
            return Err(Error);
        }
        let (head, rest) = buf.split_at_mut(TMH_LEN);
        self.tmh.emit(&mut TmhPacket::new_unchecked(head));
        if let Some(rvh) = self.rvh {
            rvh.emit(&mut RvhPacket::new_unchecked(&mut rest[..RVH_LEN]));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // The layout `tm_types.h` gives: opcode, 3 reserved bytes, app_ctx be32, tag be64.
    static TMH: [u8; 16] = [3, 0, 0, 0, 0xca, 0xfe, 0xba, 0xbe, 1, 2, 3, 4, 5, 6, 7, 8];
    static RVH: [u8; 16] = [
        0, 0, 0, 0x7f, 0, 0, 0x10, 0, 0x12, 0x34, 0x56, 0x78, 0, 0, 0x20, 0,
    ];

    #[test]
    fn deconstruct_and_construct() {
        let tmh = TmhRepr {
            opcode: TmhOpcode::Eager,
            app_ctx: 0xcafe_babe,
            tag: 0x0102_0304_0506_0708,
        };
        assert_eq!(
            TmhRepr::parse(&TmhPacket::new_checked(&TMH[..]).unwrap()),
            Ok(tmh)
        );
        let mut buf = [0xffu8; TMH_LEN];
        tmh.emit(&mut TmhPacket::new_unchecked(&mut buf));
        assert_eq!(buf, TMH);

        let rvh = RvhRepr {
            va: 0x7f_0000_1000,
            rkey: 0x1234_5678,
            len: 0x2000,
        };
        assert_eq!(
            RvhRepr::parse(&RvhPacket::new_checked(&RVH[..]).unwrap()),
            Ok(rvh)
        );
        let mut buf = [0u8; RVH_LEN];
        rvh.emit(&mut RvhPacket::new_unchecked(&mut buf));
        assert_eq!(buf, RVH);
    }

    #[test]
    fn message_headers() {
        let mut msg = [0u8; 40];
        msg[..16].copy_from_slice(&TMH);
        msg[0] = TmhOpcode::Rndv as u8;
        msg[16..32].copy_from_slice(&RVH);
        let h = TmHeaders::parse(&msg).unwrap();
        assert_eq!(h.tmh.opcode, TmhOpcode::Rndv);
        assert_eq!(h.rvh.unwrap().len, 0x2000);
        // A rendezvous request without a whole RVH is malformed.
        assert_eq!(TmHeaders::parse(&msg[..31]), Err(Error));
        // Eager and untagged messages carry no RVH even when data follows.
        msg[0] = TmhOpcode::Eager as u8;
        assert_eq!(TmHeaders::parse(&msg).unwrap().rvh, None);
        // FIN echoes the RVH when it fits.
        msg[0] = TmhOpcode::Fin as u8;
        assert!(TmHeaders::parse(&msg).unwrap().rvh.is_some());
        assert_eq!(TmHeaders::parse(&msg[..16]).unwrap().rvh, None);
        // Unknown operations and short messages are not tag-matching messages.
        msg[0] = 4;
        assert_eq!(TmHeaders::parse(&msg), Err(Error));
        assert_eq!(TmHeaders::parse(&TMH[..15]), Err(Error));
    }

    proptest! {
        #[test]
        fn round_trip(op in 0u8..4, app_ctx: u32, tag: u64, va: u64, rkey: u32, len: u32, with_rvh: bool) {
            let opcode = TmhOpcode::from_raw(op).unwrap();
            let rvh = (opcode == TmhOpcode::Rndv || (opcode == TmhOpcode::Fin && with_rvh))
                .then_some(RvhRepr { va, rkey, len });
            let h = TmHeaders { tmh: TmhRepr { opcode, app_ctx, tag }, rvh };
            let mut buf = [0u8; 32];
            h.emit(&mut buf[..h.buffer_len()]).unwrap();
            prop_assert_eq!(TmHeaders::parse(&buf[..h.buffer_len()]), Ok(h));
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..48)) {
            let _ = TmHeaders::parse(&bytes);
        }
    }
}
