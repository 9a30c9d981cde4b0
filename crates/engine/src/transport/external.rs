//! Payloads that stay in the sender's memory until the receiver places them.
//!
//! A carrier between processes of one host (shared memory) does not need the payload bytes in
//! the packet: the receiver can copy them once, straight from the sender's registered buffer
//! into its own. The requester (and the responder, for READ responses) therefore leaves the
//! payload of a large packet where it is when the QP allows it ([`QpEngine::set_external_payloads`]
//! and [`Memory::locate`]): the [`Transmit`] carries the headers and [`ExternalRanges`], and the
//! carrier moves the ranges instead of bytes. A carrier that needs the bytes fills them in
//! (the ranges are this process's memory).
//!
//! On the receiving side the packet's payload is an [`RxData::External`]: the engine decides
//! exactly as for bytes in the packet (same checks, same PSN and length rules), and places it
//! with [`Memory::write_external`], which the device may defer to one copy for a whole batch.
//! Only reliable transports use this: their sender keeps the buffer until the ACK, which the
//! receiver sends after the bytes were copied.
//!
//! [`QpEngine::set_external_payloads`]: super::QpEngine::set_external_payloads
//! [`Transmit`]: super::Transmit

use std::borrow::Cow;
use std::ops::{Deref, Range};

use softverbs_wire::ParsedPacket;

use crate::memory::{ExternalPayload, KeyRef, MemError, Memory};

/// Gather pieces one packet's external payload may have (more: the bytes go in the packet).
pub const MAX_EXTERNAL_RANGES: usize = 4;

/// The smallest packet payload left external: below it, copying the bytes costs less than the
/// receiver's system call.
pub const EXTERNAL_MIN_PACKET: usize = 1024;

/// The smallest message whose packets are left external: a message of several packets lets the
/// receiver copy them with one call.
pub const EXTERNAL_MIN_MESSAGE: u64 = 8192;

/// Where a packet's payload is in the sending process's memory: byte ranges, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ExternalRanges {
    /// The payload length (the sum of the ranges).
    pub len: u32,
    /// Used entries of `ranges`.
    pub count: u8,
    /// (address, length) in the sender's address space.
    pub ranges: [(u64, u32); MAX_EXTERNAL_RANGES],
}

impl ExternalRanges {
    /// The used ranges.
    pub fn ranges(&self) -> &[(u64, u32)] {
        &self.ranges[..usize::from(self.count)]
    }

    /// Appends a range, merging it with the last one if contiguous; false if full.
    pub fn push(&mut self, addr: u64, len: u32) -> bool {
        if len == 0 {
            return true;
        }
        if let Some(last) = self.ranges[..usize::from(self.count)].last_mut() {
            if last.0 + u64::from(last.1) == addr {
                last.1 += len;
                self.len += len;
                return true;
            }
        }
        if usize::from(self.count) == MAX_EXTERNAL_RANGES {
            return false;
        }
        self.ranges[usize::from(self.count)] = (addr, len);
        self.count += 1;
        self.len += len;
        true
    }
}

/// The payload of a received packet.
#[derive(Clone, Copy)]
pub enum RxData<'a> {
    /// In the packet.
    Bytes(&'a [u8]),
    /// `len` bytes from `offset` of a payload left in the sender's memory.
    External {
        /// The whole payload.
        src: &'a dyn ExternalPayload,
        /// Where this part starts in it.
        offset: u64,
        /// This part's length.
        len: u64,
    },
}

impl std::fmt::Debug for RxData<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bytes(b) => write!(f, "Bytes({})", b.len()),
            Self::External { offset, len, .. } => write!(f, "External({offset}+{len})"),
        }
    }
}

impl<'a> RxData<'a> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Self::Bytes(b) => b.len(),
            Self::External { len, .. } => *len as usize,
        }
    }

    /// Whether there is no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A part of it (`range` within this one).
    pub fn slice(&self, range: Range<usize>) -> Self {
        match *self {
            Self::Bytes(b) => Self::Bytes(&b[range]),
            Self::External { src, offset, .. } => Self::External {
                src,
                offset: offset + range.start as u64,
                len: (range.end - range.start) as u64,
            },
        }
    }

    /// Stores it at `addr` of the region named by `key`.
    pub fn write_to(&self, mem: &dyn Memory, key: KeyRef, addr: u64) -> Result<(), MemError> {
        match *self {
            Self::Bytes(b) => mem.write(key, addr, b),
            Self::External { src, offset, len } => mem.write_external(key, addr, src, offset, len),
        }
    }

    /// The bytes themselves (read from the sender now if they are external).
    pub fn to_bytes(&self) -> Result<Cow<'a, [u8]>, MemError> {
        match *self {
            Self::Bytes(b) => Ok(Cow::Borrowed(b)),
            Self::External { src, offset, len } => {
                let mut v = vec![0u8; len as usize];
                src.read(offset, &mut v)?;
                Ok(Cow::Owned(v))
            }
        }
    }
}

/// A received packet as the engine handles it: its headers, and its payload wherever it is.
#[derive(Debug, Clone, Copy)]
pub struct Rx<'a> {
    pkt: &'a ParsedPacket<'a>,
    /// The payload (the packet's own `payload` is empty when it is external).
    pub data: RxData<'a>,
}

impl<'a> Rx<'a> {
    /// A packet with its payload inside.
    pub fn new(pkt: &'a ParsedPacket<'a>) -> Self {
        Self {
            pkt,
            data: RxData::Bytes(pkt.payload),
        }
    }

    /// A packet whose payload is `src` (the headers' payload length must be its length).
    pub fn external(pkt: &'a ParsedPacket<'a>, src: &'a dyn ExternalPayload) -> Self {
        Self {
            pkt,
            data: RxData::External {
                src,
                offset: 0,
                len: src.len(),
            },
        }
    }
}

impl<'a> Deref for Rx<'a> {
    type Target = ParsedPacket<'a>;

    fn deref(&self) -> &ParsedPacket<'a> {
        self.pkt
    }
}

/// Where `len` bytes starting `offset` bytes into a gather list are in this process's memory,
/// checked with local read rights; `None` if some piece is not ordinary memory or there are
/// too many pieces (the bytes then travel in the packet).
pub(crate) fn locate_gather(
    mem: &dyn Memory,
    (pd, qpn): (u32, u32),
    sges: &[crate::types::Sge],
    offset: u64,
    len: u64,
) -> Option<ExternalRanges> {
    let mut out = ExternalRanges::default();
    let mut skip = offset;
    let mut left = len;
    for sge in sges {
        if left == 0 {
            break;
        }
        let sge_len = u64::from(sge.length);
        if skip >= sge_len {
            skip -= sge_len;
            continue;
        }
        let take = (sge_len - skip).min(left);
        let key = KeyRef {
            key: sge.lkey,
            pd,
            qpn,
            access: crate::memory::Access::LocalRead,
        };
        let host = mem.locate(key, sge.addr + skip, take).ok()??;
        if !out.push(host, u32::try_from(take).ok()?) {
            return None;
        }
        left -= take;
        skip = 0;
    }
    (left == 0).then_some(out)
}

/// A packet whose payload stays at `ranges`: the headers of `repr` with an empty payload.
pub(crate) fn build_external(
    repr: &softverbs_wire::PacketRepr,
    dest: super::Dest,
    ranges: ExternalRanges,
) -> super::Transmit {
    let mut bare = *repr;
    bare.payload_len = 0;
    bare.bth.pad_count = 0;
    let mut data = super::buffers::take(bare.buffer_len());
    // The repr is built by the engine from its own table; emitting it cannot fail.
    bare.emit(&mut data).expect("engine-built packet");
    super::Transmit {
        dest,
        data,
        external: Some(ranges),
    }
}
