//! BTH opcodes and the table that says which headers and roles each has.
//!
//! One `macro_rules!` list generates the [`Opcode`] enum, its names and the
//! [`OPCODE_TABLE`]; header offsets and lengths are computed by `const fn`
//! from each entry's [`HeaderSet`], so nothing is typed twice.

use core::fmt;
use core::ops::BitOr;

use crate::{aeth, atomic, bth, deth, feth, imm, reth, Error};

/// Size of the XRC extended transport header (XRC SRQ number).
pub const XRCETH_LEN: usize = crate::xrceth::HEADER_LEN;

/// Size of the reserved block that follows the BTH in a CNP.
pub const CNP_PAD_LEN: usize = 16;

/// An extension header that may follow the BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Header {
    /// Datagram ETH (UD).
    Deth,
    /// XRC ETH (every XRC request).
    XrcEth,
    /// FLUSH ETH (FLUSH requests).
    Feth,
    /// RDMA ETH (WRITE FIRST/ONLY, READ REQUEST).
    Reth,
    /// Atomic ETH (COMPARE_SWAP, FETCH_ADD).
    AtomicEth,
    /// ACK ETH (responses).
    Aeth,
    /// Atomic ACK ETH (ATOMIC ACKNOWLEDGE).
    AtomicAckEth,
    /// Immediate data.
    ImmDt,
    /// Invalidate ETH (SEND with invalidate).
    Ieth,
    /// The 16 reserved bytes of a CNP.
    CnpPad,
}

impl Header {
    /// Every header, in the order they appear on the wire (each at the position of its
    /// discriminant, which is also its bit in a [`HeaderSet`]).
    ///
    /// No opcode carries two headers whose relative order this merges
    /// ambiguously (e.g. AETH and ImmDt never meet).
    pub const ALL: [Self; 10] = [
        Self::Deth,
        Self::XrcEth,
        Self::Feth,
        Self::Reth,
        Self::AtomicEth,
        Self::Aeth,
        Self::AtomicAckEth,
        Self::ImmDt,
        Self::Ieth,
        Self::CnpPad,
    ];

    /// The header's size in bytes.
    pub const fn size(self) -> usize {
        match self {
            Self::Deth => deth::HEADER_LEN,
            Self::XrcEth => XRCETH_LEN,
            Self::Feth => feth::HEADER_LEN,
            Self::Reth => reth::HEADER_LEN,
            Self::AtomicEth => atomic::ATOMIC_ETH_LEN,
            Self::Aeth => aeth::HEADER_LEN,
            Self::AtomicAckEth => atomic::ATOMIC_ACK_ETH_LEN,
            Self::ImmDt => imm::IMM_DT_LEN,
            Self::Ieth => imm::IETH_LEN,
            Self::CnpPad => CNP_PAD_LEN,
        }
    }

    const fn bit(self) -> u16 {
        1 << self as u16
    }
}

// `HeaderSet::iter` relies on every header sitting in `Header::ALL` at its discriminant.
const _: () = {
    let mut i = 0;
    while i < Header::ALL.len() {
        assert!(Header::ALL[i] as usize == i);
        i += 1;
    }
};

/// The set of extension headers an opcode carries (a hand-rolled bit set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct HeaderSet(u16);

impl HeaderSet {
    /// No extension header.
    pub const EMPTY: Self = Self(0);

    /// The set with `header` added.
    pub const fn with(self, header: Header) -> Self {
        Self(self.0 | header.bit())
    }

    /// Whether `header` is in the set.
    pub const fn contains(self, header: Header) -> bool {
        self.0 & header.bit() != 0
    }

    /// The raw bits, one per [`Header`] variant.
    pub const fn bits(self) -> u16 {
        self.0
    }

    /// Offset of `header` from the start of the BTH, if present.
    pub const fn offset(self, header: Header) -> Option<usize> {
        if !self.contains(header) {
            return None;
        }
        let mut offset = bth::HEADER_LEN;
        let mut i = 0;
        while i < Header::ALL.len() {
            let h = Header::ALL[i];
            if h as u16 == header as u16 {
                break;
            }
            if self.contains(h) {
                offset += h.size();
            }
            i += 1;
        }
        Some(offset)
    }

    /// Length of the BTH plus every header in the set.
    pub const fn header_len(self) -> usize {
        let mut len = bth::HEADER_LEN;
        let mut i = 0;
        while i < Header::ALL.len() {
            if self.contains(Header::ALL[i]) {
                len += Header::ALL[i].size();
            }
            i += 1;
        }
        len
    }

    /// The headers in the set, in wire order.
    pub fn iter(self) -> impl Iterator<Item = Header> {
        // Bit i is `Header::ALL[i]` (the discriminants are the positions), so the set bits,
        // lowest first, are the headers in wire order: a packet with none (a SEND or WRITE
        // middle) costs no look at the others.
        let mut bits = self.0;
        core::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let i = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            Some(Header::ALL[i])
        })
    }
}

/// Role flags of an opcode (a hand-rolled bit set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct OpFlags(u16);

impl OpFlags {
    /// No flag.
    pub const EMPTY: Self = Self(0);
    /// A request (requester → responder).
    pub const REQ: Self = Self(1 << 0);
    /// A response: ACK, READ RESPONSE or ATOMIC ACKNOWLEDGE.
    pub const ACK: Self = Self(1 << 1);
    /// Part of a SEND.
    pub const SEND: Self = Self(1 << 2);
    /// Part of an RDMA WRITE.
    pub const WRITE: Self = Self(1 << 3);
    /// An RDMA READ request or response.
    pub const READ: Self = Self(1 << 4);
    /// An atomic request or its acknowledge.
    pub const ATOMIC: Self = Self(1 << 5);
    /// First packet of a multi-packet message.
    pub const FIRST: Self = Self(1 << 6);
    /// Middle packet of a multi-packet message.
    pub const MIDDLE: Self = Self(1 << 7);
    /// Last packet of a multi-packet message.
    pub const LAST: Self = Self(1 << 8);
    /// The only packet of a message.
    pub const ONLY: Self = Self(1 << 9);
    /// Carries immediate data.
    pub const IMM: Self = Self(1 << 10);
    /// Carries an R_Key to invalidate.
    pub const INV: Self = Self(1 << 11);
    /// Carries a payload (possibly empty); packets without this flag must
    /// have neither payload nor pad.
    pub const PAYLOAD: Self = Self(1 << 12);
    /// An ATOMIC WRITE request.
    pub const ATOMIC_WRITE: Self = Self(1 << 13);
    /// A FLUSH request.
    pub const FLUSH: Self = Self(1 << 14);

    /// Both sets together.
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// Whether every flag of `other` is set.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether any flag of `other` is set.
    pub const fn intersects(self, other: Self) -> bool {
        self.0 & other.0 != 0
    }

    /// The raw bits.
    pub const fn bits(self) -> u16 {
        self.0
    }
}

impl BitOr for OpFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        self.union(rhs)
    }
}

/// Transport service, from bits 7:5 of the opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Transport {
    /// Reliable Connection.
    Rc = 0x00,
    /// Unreliable Connection.
    Uc = 0x20,
    /// Reliable Datagram (nobody implements it; no opcode is known).
    Rd = 0x40,
    /// Unreliable Datagram.
    Ud = 0x60,
    /// Congestion Notification Packet.
    Cnp = 0x80,
    /// Extended Reliable Connection: the RC operations, requests with an XRCETH.
    Xrc = 0xA0,
}

impl Transport {
    /// Mask of the transport bits in an opcode byte.
    pub const MASK: u8 = 0xE0;

    /// The transport of a raw opcode byte, if it names one.
    pub const fn from_opcode_byte(byte: u8) -> Option<Self> {
        match byte & Self::MASK {
            0x00 => Some(Self::Rc),
            0x20 => Some(Self::Uc),
            0x40 => Some(Self::Rd),
            0x60 => Some(Self::Ud),
            0x80 => Some(Self::Cnp),
            0xA0 => Some(Self::Xrc),
            _ => None,
        }
    }

    /// The transport's bits 7:5, as they appear in the opcode byte.
    pub const fn bits(self) -> u8 {
        self as u8
    }
}

/// Where a packet sits in its message; picks FIRST/MIDDLE/LAST/ONLY.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Position {
    /// First of several packets.
    First,
    /// Neither first nor last.
    Middle,
    /// Last of several packets.
    Last,
    /// The whole message in one packet.
    Only,
}

impl Position {
    /// The position of a packet that does or does not start and end its
    /// message.
    pub const fn new(starts: bool, ends: bool) -> Self {
        match (starts, ends) {
            (true, true) => Self::Only,
            (true, false) => Self::First,
            (false, true) => Self::Last,
            (false, false) => Self::Middle,
        }
    }
}

/// Everything the table knows about one opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpcodeInfo {
    /// The opcode.
    pub opcode: Opcode,
    /// Its name, as the enum variant.
    pub name: &'static str,
    /// Transport service.
    pub transport: Transport,
    /// Extension headers after the BTH.
    pub headers: HeaderSet,
    /// Role flags.
    pub flags: OpFlags,
    /// Length of the BTH plus all extension headers.
    pub header_len: usize,
}

impl OpcodeInfo {
    const fn new(
        opcode: Opcode,
        name: &'static str,
        transport: Transport,
        headers: HeaderSet,
        flags: OpFlags,
    ) -> Self {
        Self {
            opcode,
            name,
            transport,
            headers,
            flags,
            header_len: headers.header_len(),
        }
    }

    /// Offset of `header` from the start of the BTH, if this opcode has it.
    pub const fn offset(&self, header: Header) -> Option<usize> {
        self.headers.offset(header)
    }
}

macro_rules! opcodes {
    ($(
        $(#[$doc:meta])*
        $name:ident = $value:literal, $transport:ident, [$($hdr:ident)*], [$($flag:ident)*];
    )*) => {
        /// A BTH opcode this crate knows.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u8)]
        pub enum Opcode {
            $( $(#[$doc])* $name = $value, )*
        }

        /// Metadata of every known opcode, in opcode order.
        pub const OPCODE_TABLE: &[OpcodeInfo] = &[
            $(
                OpcodeInfo::new(
                    Opcode::$name,
                    stringify!($name),
                    Transport::$transport,
                    HeaderSet::EMPTY $(.with(Header::$hdr))*,
                    OpFlags::EMPTY $(.union(OpFlags::$flag))*,
                ),
            )*
        ];
    };
}

opcodes! {
    /// RC SEND FIRST.
    RcSendFirst = 0x00, Rc, [], [REQ SEND FIRST PAYLOAD];
    /// RC SEND MIDDLE.
    RcSendMiddle = 0x01, Rc, [], [REQ SEND MIDDLE PAYLOAD];
    /// RC SEND LAST.
    RcSendLast = 0x02, Rc, [], [REQ SEND LAST PAYLOAD];
    /// RC SEND LAST with immediate.
    RcSendLastWithImm = 0x03, Rc, [ImmDt], [REQ SEND LAST IMM PAYLOAD];
    /// RC SEND ONLY.
    RcSendOnly = 0x04, Rc, [], [REQ SEND ONLY PAYLOAD];
    /// RC SEND ONLY with immediate.
    RcSendOnlyWithImm = 0x05, Rc, [ImmDt], [REQ SEND ONLY IMM PAYLOAD];
    /// RC RDMA WRITE FIRST.
    RcWriteFirst = 0x06, Rc, [Reth], [REQ WRITE FIRST PAYLOAD];
    /// RC RDMA WRITE MIDDLE.
    RcWriteMiddle = 0x07, Rc, [], [REQ WRITE MIDDLE PAYLOAD];
    /// RC RDMA WRITE LAST.
    RcWriteLast = 0x08, Rc, [], [REQ WRITE LAST PAYLOAD];
    /// RC RDMA WRITE LAST with immediate.
    RcWriteLastWithImm = 0x09, Rc, [ImmDt], [REQ WRITE LAST IMM PAYLOAD];
    /// RC RDMA WRITE ONLY.
    RcWriteOnly = 0x0A, Rc, [Reth], [REQ WRITE ONLY PAYLOAD];
    /// RC RDMA WRITE ONLY with immediate.
    RcWriteOnlyWithImm = 0x0B, Rc, [Reth ImmDt], [REQ WRITE ONLY IMM PAYLOAD];
    /// RC RDMA READ REQUEST.
    RcReadRequest = 0x0C, Rc, [Reth], [REQ READ ONLY];
    /// RC RDMA READ RESPONSE FIRST.
    RcReadResponseFirst = 0x0D, Rc, [Aeth], [ACK READ FIRST PAYLOAD];
    /// RC RDMA READ RESPONSE MIDDLE (no AETH).
    RcReadResponseMiddle = 0x0E, Rc, [], [ACK READ MIDDLE PAYLOAD];
    /// RC RDMA READ RESPONSE LAST.
    RcReadResponseLast = 0x0F, Rc, [Aeth], [ACK READ LAST PAYLOAD];
    /// RC RDMA READ RESPONSE ONLY.
    RcReadResponseOnly = 0x10, Rc, [Aeth], [ACK READ ONLY PAYLOAD];
    /// RC ACKNOWLEDGE (ACK, RNR NAK or NAK).
    RcAcknowledge = 0x11, Rc, [Aeth], [ACK ONLY];
    /// RC ATOMIC ACKNOWLEDGE.
    RcAtomicAcknowledge = 0x12, Rc, [Aeth AtomicAckEth], [ACK ATOMIC ONLY];
    /// RC COMPARE & SWAP.
    RcCompareSwap = 0x13, Rc, [AtomicEth], [REQ ATOMIC ONLY];
    /// RC FETCH & ADD.
    RcFetchAdd = 0x14, Rc, [AtomicEth], [REQ ATOMIC ONLY];
    /// RC SEND LAST with invalidate.
    RcSendLastWithInv = 0x16, Rc, [Ieth], [REQ SEND LAST INV PAYLOAD];
    /// RC SEND ONLY with invalidate.
    RcSendOnlyWithInv = 0x17, Rc, [Ieth], [REQ SEND ONLY INV PAYLOAD];
    /// RC FLUSH (memory-placement extension): FETH and RETH, no payload; answered by a
    /// zero-length READ RESPONSE ONLY.
    RcFlush = 0x1C, Rc, [Feth Reth], [REQ FLUSH ONLY];
    /// RC ATOMIC WRITE (memory-placement extension): RETH and exactly 8 bytes of payload;
    /// answered by a zero-length READ RESPONSE ONLY.
    RcAtomicWrite = 0x1D, Rc, [Reth], [REQ ATOMIC_WRITE ONLY PAYLOAD];
    /// UC SEND FIRST.
    UcSendFirst = 0x20, Uc, [], [REQ SEND FIRST PAYLOAD];
    /// UC SEND MIDDLE.
    UcSendMiddle = 0x21, Uc, [], [REQ SEND MIDDLE PAYLOAD];
    /// UC SEND LAST.
    UcSendLast = 0x22, Uc, [], [REQ SEND LAST PAYLOAD];
    /// UC SEND LAST with immediate.
    UcSendLastWithImm = 0x23, Uc, [ImmDt], [REQ SEND LAST IMM PAYLOAD];
    /// UC SEND ONLY.
    UcSendOnly = 0x24, Uc, [], [REQ SEND ONLY PAYLOAD];
    /// UC SEND ONLY with immediate.
    UcSendOnlyWithImm = 0x25, Uc, [ImmDt], [REQ SEND ONLY IMM PAYLOAD];
    /// UC RDMA WRITE FIRST.
    UcWriteFirst = 0x26, Uc, [Reth], [REQ WRITE FIRST PAYLOAD];
    /// UC RDMA WRITE MIDDLE.
    UcWriteMiddle = 0x27, Uc, [], [REQ WRITE MIDDLE PAYLOAD];
    /// UC RDMA WRITE LAST.
    UcWriteLast = 0x28, Uc, [], [REQ WRITE LAST PAYLOAD];
    /// UC RDMA WRITE LAST with immediate.
    UcWriteLastWithImm = 0x29, Uc, [ImmDt], [REQ WRITE LAST IMM PAYLOAD];
    /// UC RDMA WRITE ONLY.
    UcWriteOnly = 0x2A, Uc, [Reth], [REQ WRITE ONLY PAYLOAD];
    /// UC RDMA WRITE ONLY with immediate.
    UcWriteOnlyWithImm = 0x2B, Uc, [Reth ImmDt], [REQ WRITE ONLY IMM PAYLOAD];
    /// UD SEND ONLY.
    UdSendOnly = 0x64, Ud, [Deth], [REQ SEND ONLY PAYLOAD];
    /// UD SEND ONLY with immediate.
    UdSendOnlyWithImm = 0x65, Ud, [Deth ImmDt], [REQ SEND ONLY IMM PAYLOAD];
    /// Congestion Notification Packet (RoCEv2 ECN); carries no payload.
    Cnp = 0x81, Cnp, [CnpPad], [];
    /// XRC SEND FIRST.
    XrcSendFirst = 0xA0, Xrc, [XrcEth], [REQ SEND FIRST PAYLOAD];
    /// XRC SEND MIDDLE.
    XrcSendMiddle = 0xA1, Xrc, [XrcEth], [REQ SEND MIDDLE PAYLOAD];
    /// XRC SEND LAST.
    XrcSendLast = 0xA2, Xrc, [XrcEth], [REQ SEND LAST PAYLOAD];
    /// XRC SEND LAST with immediate.
    XrcSendLastWithImm = 0xA3, Xrc, [XrcEth ImmDt], [REQ SEND LAST IMM PAYLOAD];
    /// XRC SEND ONLY.
    XrcSendOnly = 0xA4, Xrc, [XrcEth], [REQ SEND ONLY PAYLOAD];
    /// XRC SEND ONLY with immediate.
    XrcSendOnlyWithImm = 0xA5, Xrc, [XrcEth ImmDt], [REQ SEND ONLY IMM PAYLOAD];
    /// XRC RDMA WRITE FIRST.
    XrcWriteFirst = 0xA6, Xrc, [XrcEth Reth], [REQ WRITE FIRST PAYLOAD];
    /// XRC RDMA WRITE MIDDLE.
    XrcWriteMiddle = 0xA7, Xrc, [XrcEth], [REQ WRITE MIDDLE PAYLOAD];
    /// XRC RDMA WRITE LAST.
    XrcWriteLast = 0xA8, Xrc, [XrcEth], [REQ WRITE LAST PAYLOAD];
    /// XRC RDMA WRITE LAST with immediate.
    XrcWriteLastWithImm = 0xA9, Xrc, [XrcEth ImmDt], [REQ WRITE LAST IMM PAYLOAD];
    /// XRC RDMA WRITE ONLY.
    XrcWriteOnly = 0xAA, Xrc, [XrcEth Reth], [REQ WRITE ONLY PAYLOAD];
    /// XRC RDMA WRITE ONLY with immediate.
    XrcWriteOnlyWithImm = 0xAB, Xrc, [XrcEth Reth ImmDt], [REQ WRITE ONLY IMM PAYLOAD];
    /// XRC RDMA READ REQUEST.
    XrcReadRequest = 0xAC, Xrc, [XrcEth Reth], [REQ READ ONLY];
    /// XRC RDMA READ RESPONSE FIRST.
    XrcReadResponseFirst = 0xAD, Xrc, [Aeth], [ACK READ FIRST PAYLOAD];
    /// XRC RDMA READ RESPONSE MIDDLE (no AETH).
    XrcReadResponseMiddle = 0xAE, Xrc, [], [ACK READ MIDDLE PAYLOAD];
    /// XRC RDMA READ RESPONSE LAST.
    XrcReadResponseLast = 0xAF, Xrc, [Aeth], [ACK READ LAST PAYLOAD];
    /// XRC RDMA READ RESPONSE ONLY.
    XrcReadResponseOnly = 0xB0, Xrc, [Aeth], [ACK READ ONLY PAYLOAD];
    /// XRC ACKNOWLEDGE (ACK, RNR NAK or NAK).
    XrcAcknowledge = 0xB1, Xrc, [Aeth], [ACK ONLY];
    /// XRC ATOMIC ACKNOWLEDGE.
    XrcAtomicAcknowledge = 0xB2, Xrc, [Aeth AtomicAckEth], [ACK ATOMIC ONLY];
    /// XRC COMPARE & SWAP.
    XrcCompareSwap = 0xB3, Xrc, [XrcEth AtomicEth], [REQ ATOMIC ONLY];
    /// XRC FETCH & ADD.
    XrcFetchAdd = 0xB4, Xrc, [XrcEth AtomicEth], [REQ ATOMIC ONLY];
    /// XRC SEND LAST with invalidate.
    XrcSendLastWithInv = 0xB6, Xrc, [XrcEth Ieth], [REQ SEND LAST INV PAYLOAD];
    /// XRC SEND ONLY with invalidate.
    XrcSendOnlyWithInv = 0xB7, Xrc, [XrcEth Ieth], [REQ SEND ONLY INV PAYLOAD];
}

/// `OPCODE_TABLE` index of each opcode byte, or `NO_INDEX`.
const NO_INDEX: u8 = u8::MAX;
const INDEX: [u8; 256] = {
    let mut index = [NO_INDEX; 256];
    let mut i = 0;
    while i < OPCODE_TABLE.len() {
        index[OPCODE_TABLE[i].opcode as usize] = i as u8;
        i += 1;
    }
    index
};

impl Opcode {
    /// Number of known opcodes.
    pub const COUNT: usize = OPCODE_TABLE.len();

    /// The opcode a raw byte names, if this crate knows it.
    pub const fn from_u8(byte: u8) -> Option<Self> {
        match INDEX[byte as usize] {
            NO_INDEX => None,
            i => Some(OPCODE_TABLE[i as usize].opcode),
        }
    }

    /// The raw opcode byte.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// This opcode's entry in [`OPCODE_TABLE`].
    pub const fn info(self) -> &'static OpcodeInfo {
        &OPCODE_TABLE[INDEX[self as usize] as usize]
    }

    /// The opcode's name (the variant name, e.g. `RcSendFirst`).
    pub const fn name(self) -> &'static str {
        self.info().name
    }

    /// Transport service.
    pub const fn transport(self) -> Transport {
        self.info().transport
    }

    /// Extension headers after the BTH.
    pub const fn headers(self) -> HeaderSet {
        self.info().headers
    }

    /// Role flags.
    pub const fn flags(self) -> OpFlags {
        self.info().flags
    }

    /// Length of the BTH and every extension header.
    pub const fn header_len(self) -> usize {
        self.info().header_len
    }

    /// Offset of `header` from the start of the BTH, if present.
    pub const fn offset(self, header: Header) -> Option<usize> {
        self.info().offset(header)
    }

    const fn has(self, flags: OpFlags) -> bool {
        self.flags().intersects(flags)
    }

    /// The packet's place in its message (`None` only for a CNP).
    pub const fn position(self) -> Option<Position> {
        let f = self.flags();
        if f.contains(OpFlags::FIRST) {
            Some(Position::First)
        } else if f.contains(OpFlags::MIDDLE) {
            Some(Position::Middle)
        } else if f.contains(OpFlags::LAST) {
            Some(Position::Last)
        } else if f.contains(OpFlags::ONLY) {
            Some(Position::Only)
        } else {
            None
        }
    }

    /// A request (sent by a requester).
    pub const fn is_request(self) -> bool {
        self.has(OpFlags::REQ)
    }
    /// A response (ACK, READ RESPONSE, ATOMIC ACKNOWLEDGE).
    pub const fn is_response(self) -> bool {
        self.has(OpFlags::ACK)
    }
    /// Part of a SEND.
    pub const fn is_send(self) -> bool {
        self.has(OpFlags::SEND)
    }
    /// Part of an RDMA WRITE.
    pub const fn is_write(self) -> bool {
        self.has(OpFlags::WRITE)
    }
    /// An RDMA READ request or response.
    pub const fn is_read(self) -> bool {
        self.has(OpFlags::READ)
    }
    /// An atomic request or ATOMIC ACKNOWLEDGE.
    pub const fn is_atomic(self) -> bool {
        self.has(OpFlags::ATOMIC)
    }
    /// An ATOMIC WRITE request.
    pub const fn is_atomic_write(self) -> bool {
        self.has(OpFlags::ATOMIC_WRITE)
    }
    /// A FLUSH request.
    pub const fn is_flush(self) -> bool {
        self.has(OpFlags::FLUSH)
    }
    /// A request that takes a responder resource and is answered by a response rather than an
    /// ACK: READ, the atomics, ATOMIC WRITE and FLUSH.
    pub const fn uses_responder_resource(self) -> bool {
        self.is_request()
            && self.has(
                OpFlags::READ
                    .union(OpFlags::ATOMIC)
                    .union(OpFlags::ATOMIC_WRITE)
                    .union(OpFlags::FLUSH),
            )
    }
    /// Carries ImmDt.
    pub const fn has_imm(self) -> bool {
        self.has(OpFlags::IMM)
    }
    /// Carries an IETH.
    pub const fn has_inv(self) -> bool {
        self.has(OpFlags::INV)
    }
    /// May carry payload.
    pub const fn has_payload(self) -> bool {
        self.has(OpFlags::PAYLOAD)
    }
    /// Exactly FIRST (not ONLY).
    pub const fn is_first(self) -> bool {
        self.has(OpFlags::FIRST)
    }
    /// Exactly MIDDLE.
    pub const fn is_middle(self) -> bool {
        self.has(OpFlags::MIDDLE)
    }
    /// Exactly LAST (not ONLY).
    pub const fn is_last(self) -> bool {
        self.has(OpFlags::LAST)
    }
    /// Exactly ONLY.
    pub const fn is_only(self) -> bool {
        self.has(OpFlags::ONLY)
    }
    /// FIRST or ONLY: the packet opens a message.
    pub const fn starts_message(self) -> bool {
        self.has(OpFlags::FIRST.union(OpFlags::ONLY))
    }
    /// LAST or ONLY: the packet completes a message.
    pub const fn ends_message(self) -> bool {
        self.has(OpFlags::LAST.union(OpFlags::ONLY))
    }

    /// The SEND opcode for a packet at `position` of a message on
    /// `transport`.
    ///
    /// `with_imm` and `with_inv` describe the whole message: they only
    /// change the LAST/ONLY opcode, so a requester can pass the same values
    /// for every packet. `None` for combinations that do not exist (both
    /// flags, invalidate outside RC, UD other than ONLY, non-SEND
    /// transports).
    pub const fn send(
        transport: Transport,
        position: Position,
        with_imm: bool,
        with_inv: bool,
    ) -> Option<Self> {
        if with_imm && with_inv {
            return None;
        }
        let code = match position {
            Position::First => 0x00,
            Position::Middle => 0x01,
            Position::Last if with_imm => 0x03,
            Position::Last if with_inv => 0x16,
            Position::Last => 0x02,
            Position::Only if with_imm => 0x05,
            Position::Only if with_inv => 0x17,
            Position::Only => 0x04,
        };
        Self::checked(transport.bits() | code, OpFlags::SEND)
    }

    /// The RDMA WRITE opcode for a packet at `position` on `transport`
    /// (RC or UC); `with_imm` describes the message, as for [`Opcode::send`].
    pub const fn write(transport: Transport, position: Position, with_imm: bool) -> Option<Self> {
        let code = match position {
            Position::First => 0x06,
            Position::Middle => 0x07,
            Position::Last if with_imm => 0x09,
            Position::Last => 0x08,
            Position::Only if with_imm => 0x0B,
            Position::Only => 0x0A,
        };
        Self::checked(transport.bits() | code, OpFlags::WRITE)
    }

    /// The RC READ RESPONSE opcode for a packet at `position`.
    pub const fn read_response(position: Position) -> Self {
        match position {
            Position::First => Self::RcReadResponseFirst,
            Position::Middle => Self::RcReadResponseMiddle,
            Position::Last => Self::RcReadResponseLast,
            Position::Only => Self::RcReadResponseOnly,
        }
    }

    /// The same operation on another transport (e.g. the XRC ACKNOWLEDGE for
    /// `RcAcknowledge`), if that transport has it.
    pub const fn on_transport(self, transport: Transport) -> Option<Self> {
        match Self::from_u8(transport.bits() | (self as u8 & !Transport::MASK)) {
            Some(op) if op.flags().bits() == self.flags().bits() => Some(op),
            _ => None,
        }
    }

    /// The RC opcode of the same operation: XRC opcodes are the RC ones with
    /// another transport prefix (and an XRCETH on requests); other opcodes
    /// are returned unchanged.
    pub const fn rc_equivalent(self) -> Self {
        match (self.transport(), self.on_transport(Transport::Rc)) {
            (Transport::Xrc, Some(op)) => op,
            _ => self,
        }
    }

    /// `from_u8`, but only if the opcode has `role` (rules out a transport
    /// whose bits collide with another operation, like CNP).
    const fn checked(byte: u8, role: OpFlags) -> Option<Self> {
        match Self::from_u8(byte) {
            Some(op) if op.flags().contains(role) => Some(op),
            _ => None,
        }
    }
}

impl TryFrom<u8> for Opcode {
    type Error = Error;
    fn try_from(byte: u8) -> Result<Self, Error> {
        Self::from_u8(byte).ok_or(Error)
    }
}

impl From<Opcode> for u8 {
    fn from(op: Opcode) -> Self {
        op.as_u8()
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_set_lists_its_headers_in_wire_order_each_at_its_offset() {
        // Every subset of the headers, not only the opcodes' sets.
        for bits in 0..1u16 << Header::ALL.len() {
            let set = HeaderSet(bits);
            let expected = Header::ALL.into_iter().filter(|&h| set.contains(h));
            assert!(set.iter().eq(expected), "set {bits:#x}");
            let mut at = bth::HEADER_LEN;
            for h in set.iter() {
                assert_eq!(set.offset(h), Some(at), "{h:?} in {bits:#x}");
                at += h.size();
            }
            assert_eq!(at, set.header_len());
        }
    }

    #[test]
    fn header_len_is_sum_of_header_sizes() {
        for info in OPCODE_TABLE {
            let sum: usize = bth::HEADER_LEN + info.headers.iter().map(Header::size).sum::<usize>();
            assert_eq!(info.header_len, sum, "{}", info.name);
            // Headers are contiguous, in wire order, after the BTH.
            let mut next = bth::HEADER_LEN;
            for h in info.headers.iter() {
                assert_eq!(info.offset(h), Some(next), "{} {h:?}", info.name);
                next += h.size();
            }
            assert_eq!(next, info.header_len);
            for h in Header::ALL {
                assert_eq!(info.offset(h).is_some(), info.headers.contains(h));
            }
        }
    }

    #[test]
    fn header_lengths_match_rxe() {
        use Opcode::*;
        for (op, len) in [
            (RcSendFirst, 12),
            (RcSendLastWithImm, 16),
            (RcWriteFirst, 28),
            (RcWriteOnlyWithImm, 32),
            (RcReadRequest, 28),
            (RcReadResponseMiddle, 12),
            (RcReadResponseOnly, 16),
            (RcAcknowledge, 16),
            (RcAtomicAcknowledge, 24),
            (RcCompareSwap, 40),
            (RcSendOnlyWithInv, 16),
            (RcFlush, 32),
            (RcAtomicWrite, 28),
            (UdSendOnly, 20),
            (UdSendOnlyWithImm, 24),
            (Cnp, 28),
        ] {
            assert_eq!(op.header_len(), len, "{op}");
        }
        assert_eq!(UdSendOnlyWithImm.offset(Header::ImmDt), Some(20));
        assert_eq!(RcWriteOnlyWithImm.offset(Header::ImmDt), Some(28));
        assert_eq!(RcAtomicAcknowledge.offset(Header::AtomicAckEth), Some(16));
        // rxe: the FETH comes first, then the RETH.
        assert_eq!(RcFlush.offset(Header::Feth), Some(12));
        assert_eq!(RcFlush.offset(Header::Reth), Some(16));
        assert!(RcAtomicWrite.has_payload() && !RcFlush.has_payload());
        assert!(RcFlush.uses_responder_resource() && RcAtomicWrite.uses_responder_resource());
        assert!(RcReadRequest.uses_responder_resource() && RcFetchAdd.uses_responder_resource());
        assert!(!RcReadResponseOnly.uses_responder_resource() && !RcWriteOnly.uses_responder_resource());
    }

    #[test]
    fn byte_round_trip_and_table_consistency() {
        let mut known = 0;
        for byte in 0..=u8::MAX {
            if let Some(op) = Opcode::from_u8(byte) {
                known += 1;
                assert_eq!(op.as_u8(), byte);
                assert_eq!(op.info().opcode, op);
                assert_eq!(Transport::from_opcode_byte(byte), Some(op.transport()));
                assert_eq!(Opcode::try_from(byte), Ok(op));
            } else {
                assert_eq!(Opcode::try_from(byte), Err(Error));
            }
        }
        assert_eq!(known, Opcode::COUNT);
        assert_eq!(Opcode::COUNT, 40 + 23);
        assert!(OPCODE_TABLE.windows(2).all(|w| w[0].opcode < w[1].opcode));
        assert_eq!(std::format!("{}", Opcode::RcSendOnlyWithInv), "RcSendOnlyWithInv");
    }

    #[test]
    fn xrc_opcodes_are_rc_with_the_xrc_prefix() {
        let mut xrc = 0;
        for info in OPCODE_TABLE.iter().filter(|i| i.transport == Transport::Xrc) {
            xrc += 1;
            let op = info.opcode;
            let rc = op.rc_equivalent();
            assert_eq!((rc.transport(), rc.as_u8() | 0xA0), (Transport::Rc, op.as_u8()));
            assert_eq!(rc.flags(), op.flags());
            assert_eq!(rc.on_transport(Transport::Xrc), Some(op));
            let extra = if op.is_request() { XRCETH_LEN } else { 0 };
            assert_eq!(op.header_len(), rc.header_len() + extra, "{op}");
            if op.is_request() {
                assert_eq!(op.offset(Header::XrcEth), Some(12), "{op}");
            }
        }
        // Every RC opcode up to SEND with invalidate has its XRC twin (0xA0-0xB4, 0xB6,
        // 0xB7); FLUSH and ATOMIC WRITE are RC-only extensions.
        assert_eq!(
            xrc,
            OPCODE_TABLE
                .iter()
                .filter(|i| i.transport == Transport::Rc
                    && !i.opcode.is_flush()
                    && !i.opcode.is_atomic_write())
                .count()
        );
        assert_eq!(Opcode::RcFlush.on_transport(Transport::Xrc), None);
        assert_eq!(Opcode::XrcAcknowledge.as_u8(), 0xB1);
        assert_eq!(Opcode::XrcSendOnlyWithInv.as_u8(), 0xB7);
        assert_eq!(Opcode::XrcCompareSwap.header_len(), 12 + 4 + 28);
        assert_eq!(
            Opcode::RcSendOnly.on_transport(Transport::Ud),
            Some(Opcode::UdSendOnly)
        );
        assert_eq!(Opcode::RcReadRequest.on_transport(Transport::Uc), None);
        assert_eq!(Opcode::UcSendOnly.rc_equivalent(), Opcode::UcSendOnly);
    }

    #[test]
    fn flags_are_coherent() {
        let positions = [OpFlags::FIRST, OpFlags::MIDDLE, OpFlags::LAST, OpFlags::ONLY];
        for info in OPCODE_TABLE {
            let op = info.opcode;
            let f = info.flags;
            if op == Opcode::Cnp {
                assert_eq!(op.position(), None);
                continue;
            }
            assert_eq!(positions.iter().filter(|&&p| f.contains(p)).count(), 1, "{op}");
            assert!(op.is_request() != op.is_response(), "{op}");
            assert_eq!(op.has_imm(), info.headers.contains(Header::ImmDt), "{op}");
            assert_eq!(op.has_inv(), info.headers.contains(Header::Ieth), "{op}");
            assert_eq!(
                info.headers.contains(Header::Deth),
                info.transport == Transport::Ud,
                "{op}"
            );
            // Every XRC request names its SRQ; responses never do.
            assert_eq!(
                info.headers.contains(Header::XrcEth),
                info.transport == Transport::Xrc && op.is_request(),
                "{op}"
            );
            let kinds = [
                op.is_send(),
                op.is_write(),
                op.is_read(),
                op.is_atomic(),
                op.is_atomic_write(),
                op.is_flush(),
            ];
            assert!(kinds.iter().filter(|&&k| k).count() <= 1, "{op}");
            assert_eq!(op.starts_message(), op.is_first() || op.is_only());
            assert_eq!(op.ends_message(), op.is_last() || op.is_only());
        }
    }

    #[test]
    fn constructors_pick_the_right_opcode() {
        use Position::*;
        use Transport::*;
        assert_eq!(Opcode::send(Rc, First, true, false), Some(Opcode::RcSendFirst));
        assert_eq!(Opcode::send(Rc, Middle, false, true), Some(Opcode::RcSendMiddle));
        assert_eq!(
            Opcode::send(Rc, Last, true, false),
            Some(Opcode::RcSendLastWithImm)
        );
        assert_eq!(
            Opcode::send(Rc, Last, false, true),
            Some(Opcode::RcSendLastWithInv)
        );
        assert_eq!(
            Opcode::send(Rc, Only, false, true),
            Some(Opcode::RcSendOnlyWithInv)
        );
        assert_eq!(Opcode::send(Uc, Only, false, false), Some(Opcode::UcSendOnly));
        assert_eq!(Opcode::send(Uc, Only, false, true), None);
        assert_eq!(
            Opcode::send(Ud, Only, true, false),
            Some(Opcode::UdSendOnlyWithImm)
        );
        assert_eq!(Opcode::send(Ud, First, false, false), None);
        assert_eq!(Opcode::send(Rc, Only, true, true), None);
        assert_eq!(Opcode::send(Cnp, Middle, false, false), None);
        assert_eq!(Opcode::send(Xrc, Only, false, false), Some(Opcode::XrcSendOnly));
        assert_eq!(Opcode::write(Uc, Last, true), Some(Opcode::UcWriteLastWithImm));
        assert_eq!(Opcode::write(Rc, Only, false), Some(Opcode::RcWriteOnly));
        assert_eq!(Opcode::write(Ud, Only, false), None);
        assert_eq!(Opcode::read_response(Middle), Opcode::RcReadResponseMiddle);
        for t in [Rc, Uc, Ud] {
            for p in [First, Middle, Last, Only] {
                for (imm, inv) in [(false, false), (true, false), (false, true)] {
                    if let Some(op) = Opcode::send(t, p, imm, inv) {
                        assert_eq!((op.transport(), op.position()), (t, Some(p)));
                        assert!(op.is_send());
                    }
                    if let Some(op) = Opcode::write(t, p, imm) {
                        assert_eq!((op.transport(), op.position()), (t, Some(p)));
                        assert_eq!(op.has_imm(), imm && op.ends_message());
                    }
                }
            }
        }
        for t in [Rc, Xrc] {
            for p in [First, Middle, Last, Only] {
                assert_eq!(
                    Opcode::read_response(p).on_transport(t).map(Opcode::position),
                    Some(Some(p))
                );
            }
        }
        assert_eq!(Position::new(true, true), Only);
        assert_eq!(Position::new(false, false), Middle);
    }
}
