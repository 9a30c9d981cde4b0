//! ACK Extended Transport Header (4 bytes): syndrome and MSN.

use crate::field::{read_u24, write_u24, MASK_24};
use crate::{header_view, Error, Result};

mod field {
    use crate::field::Field;

    pub(super) const SYNDROME: usize = 0;
    pub(super) const MSN: Field = 1..4;

    /// Bit 7 is reserved and bits 6:5 give the type; rxe masks all three,
    /// so a set reserved bit makes the syndrome unknown.
    pub(super) const TYPE_MASK: u8 = 0xE0;
    pub(super) const VALUE_MASK: u8 = 0x1F;
    pub(super) const TYPE_ACK: u8 = 0x00;
    pub(super) const TYPE_RNR_NAK: u8 = 0x20;
    pub(super) const TYPE_NAK: u8 = 0x60;
}

/// Length of the AETH.
pub const HEADER_LEN: usize = field::MSN.end;

/// NAK codes (syndrome bits 4:0 of a NAK).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NakCode {
    /// PSN sequence error: the responder expected another PSN.
    PsnSequenceError,
    /// Invalid request.
    InvalidRequest,
    /// Remote access error (R_Key, range or access rights).
    RemoteAccessError,
    /// Remote operational error.
    RemoteOperationalError,
    /// Invalid RD request.
    InvalidRdRequest,
    /// A reserved code (5–31), kept so it round-trips.
    Unknown(u8),
}

impl From<u8> for NakCode {
    /// Reads the low 5 bits.
    fn from(value: u8) -> Self {
        match value & field::VALUE_MASK {
            0 => Self::PsnSequenceError,
            1 => Self::InvalidRequest,
            2 => Self::RemoteAccessError,
            3 => Self::RemoteOperationalError,
            4 => Self::InvalidRdRequest,
            v => Self::Unknown(v),
        }
    }
}

impl From<NakCode> for u8 {
    fn from(code: NakCode) -> Self {
        match code {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
            NakCode::Unknown(v) => v & field::VALUE_MASK,
        }
    }
}

/// The decoded AETH syndrome.
///
/// 5-bit values (`credits`, `timer`, `Unknown`) are truncated to 5 bits
/// on emit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AethSyndrome {
    /// Positive acknowledge with an end-to-end credit count (31 = none).
    Ack {
        /// Credit count code.
        credits: u8,
    },
    /// Receiver not ready; retry after the timer code's delay.
    RnrNak {
        /// RNR timer code (see [`rnr_timer_micros`]).
        timer: u8,
    },
    /// Negative acknowledge.
    Nak(NakCode),
}

impl AethSyndrome {
    /// The ACK rxe sends: credit code 31, "no credit information".
    pub const ACK_UNLIMITED: Self = Self::Ack { credits: 31 };

    /// Decodes a syndrome byte; the reserved type (bits 6:5 = 10) and a set
    /// bit 7 are errors, as in rxe.
    pub fn from_u8(byte: u8) -> Result<Self> {
        let value = byte & field::VALUE_MASK;
        match byte & field::TYPE_MASK {
            field::TYPE_ACK => Ok(Self::Ack { credits: value }),
            field::TYPE_RNR_NAK => Ok(Self::RnrNak { timer: value }),
            field::TYPE_NAK => Ok(Self::Nak(NakCode::from(value))),
            _ => Err(Error),
        }
    }

    /// Encodes the syndrome byte.
    pub fn to_u8(self) -> u8 {
        match self {
            Self::Ack { credits } => field::TYPE_ACK | (credits & field::VALUE_MASK),
            Self::RnrNak { timer } => field::TYPE_RNR_NAK | (timer & field::VALUE_MASK),
            Self::Nak(code) => field::TYPE_NAK | u8::from(code),
        }
    }

    /// Whether this is a positive ACK.
    pub const fn is_ack(self) -> bool {
        matches!(self, Self::Ack { .. })
    }
}

/// The RNR NAK delay of a 5-bit timer code, in microseconds (IBTA table;
/// code 0 is the longest, 655.36 ms).
pub const fn rnr_timer_micros(code: u8) -> u32 {
    const TABLE: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840,
        5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760,
        327_680, 491_520,
    ];
    TABLE[(code & field::VALUE_MASK) as usize]
}

header_view! {
    /// A zero-copy view of an AETH.
    AethPacket, HEADER_LEN
}

impl<T: AsRef<[u8]>> AethPacket<T> {
    /// The raw syndrome byte.
    pub fn syndrome_raw(&self) -> u8 {
        self.buffer.as_ref()[field::SYNDROME]
    }

    /// The decoded syndrome.
    pub fn syndrome(&self) -> Result<AethSyndrome> {
        AethSyndrome::from_u8(self.syndrome_raw())
    }

    /// Message sequence number (24 bits).
    pub fn msn(&self) -> u32 {
        read_u24(&self.buffer.as_ref()[field::MSN])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AethPacket<T> {
    /// Sets the raw syndrome byte.
    pub fn set_syndrome_raw(&mut self, value: u8) {
        self.buffer.as_mut()[field::SYNDROME] = value;
    }

    /// Sets the syndrome.
    pub fn set_syndrome(&mut self, value: AethSyndrome) {
        self.set_syndrome_raw(value.to_u8());
    }

    /// Sets the MSN; only the low 24 bits are used.
    pub fn set_msn(&mut self, value: u32) {
        write_u24(&mut self.buffer.as_mut()[field::MSN], value & MASK_24);
    }
}

/// A parsed AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AethRepr {
    /// Syndrome.
    pub syndrome: AethSyndrome,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

impl AethRepr {
    /// Parses an AETH; fails on a short buffer or a reserved syndrome.
    pub fn parse<T: AsRef<[u8]>>(packet: &AethPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            syndrome: packet.syndrome()?,
            msn: packet.msn(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut AethPacket<T>) {
        packet.set_syndrome(self.syndrome);
        packet.set_msn(self.msn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategies;
    use proptest::prelude::*;

    #[test]
    fn syndromes() {
        use AethSyndrome::*;
        assert_eq!(AethSyndrome::from_u8(0x1f), Ok(AethSyndrome::ACK_UNLIMITED));
        assert_eq!(AethSyndrome::from_u8(0x2e), Ok(RnrNak { timer: 14 }));
        assert_eq!(AethSyndrome::from_u8(0x60), Ok(Nak(NakCode::PsnSequenceError)));
        assert_eq!(AethSyndrome::from_u8(0x62), Ok(Nak(NakCode::RemoteAccessError)));
        assert_eq!(AethSyndrome::from_u8(0x7f), Ok(Nak(NakCode::Unknown(31))));
        assert_eq!(AethSyndrome::from_u8(0x40), Err(Error));
        assert_eq!(AethSyndrome::from_u8(0x9f), Err(Error));
        for byte in 0..=u8::MAX {
            if let Ok(s) = AethSyndrome::from_u8(byte) {
                assert_eq!(s.to_u8(), byte);
            }
        }
        assert_eq!(Nak(NakCode::Unknown(0x25)).to_u8(), 0x65);
        assert_eq!(rnr_timer_micros(0), 655_360);
        assert_eq!(rnr_timer_micros(14), 1_280);
        assert_eq!(rnr_timer_micros(31), 491_520);
    }

    #[test]
    fn deconstruct_and_construct() {
        let bytes = [0x1f, 0x00, 0x01, 0x02];
        let repr = AethRepr {
            syndrome: AethSyndrome::ACK_UNLIMITED,
            msn: 0x102,
        };
        assert_eq!(
            AethRepr::parse(&AethPacket::new_checked(&bytes).unwrap()),
            Ok(repr)
        );
        let mut buf = [0u8; HEADER_LEN];
        repr.emit(&mut AethPacket::new_unchecked(&mut buf));
        assert_eq!(buf, bytes);
        assert_eq!(AethPacket::new_checked(&bytes[..3]), Err(Error));
    }

    proptest! {
        #[test]
        fn round_trip(repr in strategies::aeth()) {
            let mut buf = [0u8; HEADER_LEN];
            repr.emit(&mut AethPacket::new_unchecked(&mut buf));
            prop_assert_eq!(AethRepr::parse(&AethPacket::new_unchecked(&buf)), Ok(repr));
        }
    }
}
