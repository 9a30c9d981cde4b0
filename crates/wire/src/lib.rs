//! RoCEv2 wire format: zero-copy header views, validated representations,
//! the opcode table, 24-bit PSNs and the ICRC.
//!
//! The crate does no I/O and contains no `unsafe`. It covers the UDP payload
//! of a RoCEv2 packet (destination port [`ROCE_UDP_PORT`]): the Base Transport
//! Header, the extension headers, the payload, the pad and the invariant CRC.
//! The IPv4, IPv6 and UDP headers ([`ipv4`], [`ipv6`], [`udp`]) matter to the
//! ICRC ([`icrc`]) and to the 40-byte GRH area of UD receive buffers
//! ([`grh`]); this crate is the only place that knows their layouts.
//! Management datagrams carried on QP1 have their own modules: the MAD
//! common header ([`mad`]) and the Communication Management messages
//! ([`cm`]). librdmacm's rsocket protocol, carried in private data,
//! immediates and RDMA-written buffers, is in [`rsocket`].
//!
//! # Two levels: `Packet` and `Repr`
//!
//! Every header has two types, in the manner of smoltcp's `wire` module:
//!
//! * a zero-copy view, `XxxPacket<T: AsRef<[u8]>>`, with one getter per field
//!   and, when `T: AsMut<[u8]>`, one setter per field;
//! * a small validated value, `XxxRepr`, with `parse`, `emit` and
//!   `buffer_len`.
//!
//! The contract, which every type here keeps:
//!
//! * `XxxPacket::new_unchecked` wraps any buffer; an accessor may then panic
//!   if the buffer is too short. It exists for emitting into a buffer sized by
//!   `buffer_len()`, whose old contents must not be validated.
//! * After `XxxPacket::new_checked` (or `check_len`) succeeds, **no accessor
//!   panics**.
//! * `XxxRepr::emit` **never panics** on a buffer of at least `buffer_len()`
//!   bytes.
//! * Parsing never panics on any input: malformed input is an [`Error`].
//!
//! A whole packet is parsed by [`RocePacket::parse`], which checks the
//! header version, the opcode, every length and the pad against the
//! [opcode table](Opcode::info), and is emitted by [`PacketRepr`].
//!
//! ```
//! use softverbs_wire::{BthRepr, Opcode, PacketRepr, Psn, RethRepr, RocePacket};
//!
//! // An RC WRITE ONLY of 5 bytes: BTH, RETH, payload, 3 pad bytes, ICRC.
//! let mut repr = PacketRepr::new(BthRepr::new(Opcode::RcWriteOnly, 0x11, Psn::new(7)), 5);
//! repr.bth.ack_req = true;
//! repr.reth = Some(RethRepr { va: 0x1000, rkey: 0xabcd, dma_len: 5 });
//! let mut buf = vec![0u8; repr.buffer_len()];
//! repr.emit_with_payload(&mut buf, b"hello").unwrap();
//! assert_eq!(buf.len(), 12 + 16 + 5 + 3 + 4);
//!
//! // The ICRC covers the IP and UDP headers the kernel will add.
//! let src = "10.0.0.1:49152".parse().unwrap();
//! let dst = "10.0.0.2:4791".parse().unwrap();
//! softverbs_wire::icrc::fill(src, dst, &mut buf).unwrap();
//! assert!(softverbs_wire::icrc::verify(src, dst, &buf));
//!
//! let parsed = RocePacket::parse(&buf).unwrap();
//! assert_eq!(parsed.repr, repr);
//! assert_eq!(parsed.payload, b"hello");
//! ```
#![no_std]
#![deny(unsafe_code)]

// Tests and proptest need `std`; the library itself does not.
#[cfg(test)]
extern crate std;

mod field;

pub mod aeth;
pub mod atomic;
pub mod bth;
pub mod cm;
pub mod deth;
pub mod feth;
pub mod grh;
pub mod icrc;
pub mod imm;
pub mod ipv4;
pub mod ipv6;
pub mod mad;
pub mod opcode;
pub mod packet;
pub mod psn;
pub mod reth;
pub mod rsocket;
pub mod tm;
pub mod udp;
pub mod xrceth;

#[cfg(test)]
mod strategies;

use core::fmt;

pub use aeth::{AethPacket, AethRepr, AethSyndrome, NakCode};
pub use atomic::{AtomicAckEthPacket, AtomicAckEthRepr, AtomicEthPacket, AtomicEthRepr};
pub use bth::{BthPacket, BthRepr};
pub use deth::{DethPacket, DethRepr};
pub use feth::{FethPacket, FethRepr};
pub use grh::{GrhPacket, GrhRepr};
pub use imm::{IethPacket, IethRepr, ImmDtPacket, ImmDtRepr};
pub use ipv4::{Ipv4Packet, Ipv4Repr};
pub use ipv6::{Ipv6Packet, Ipv6Repr};
pub use mad::{MadPacket, MadRepr};
pub use opcode::{Header, HeaderSet, OpFlags, Opcode, OpcodeInfo, Position, Transport, OPCODE_TABLE};
pub use packet::{is_positive_ack, pad_count_for, PacketRepr, ParsedPacket, RocePacket};
pub use psn::Psn;
pub use reth::{RethPacket, RethRepr};
pub use tm::{RvhPacket, RvhRepr, TmHeaders, TmhOpcode, TmhPacket, TmhRepr};
pub use udp::{UdpPacket, UdpRepr};
pub use xrceth::{XrcEthPacket, XrcEthRepr};

/// The IANA UDP destination port of RoCEv2.
pub const ROCE_UDP_PORT: u16 = 4791;

/// The destination QPN that addresses a multicast group.
pub const MULTICAST_QPN: u32 = 0xFF_FFFF;

/// A malformed or unsupported packet.
///
/// Deliberately carries no detail: a receiver's only sensible reaction to
/// a bad packet is to count it and drop it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Error;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("malformed or unsupported RoCE packet")
    }
}

impl core::error::Error for Error {}

/// The result type of this crate.
pub type Result<T> = core::result::Result<T, Error>;

/// Generates a header view struct with the constructors every view shares,
/// so each header module only spells out its fields.
macro_rules! header_view {
    ($(#[$doc:meta])* $name:ident, $len:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// Wraps a buffer without checking its length.
            ///
            /// Accessors may panic on a short buffer; use this only to
            /// emit into a buffer of at least the header's length.
            pub const fn new_unchecked(buffer: T) -> Self {
                Self { buffer }
            }

            /// Wraps a buffer after checking that it holds the whole header.
            pub fn new_checked(buffer: T) -> $crate::Result<Self> {
                let packet = Self::new_unchecked(buffer);
                packet.check_len()?;
                Ok(packet)
            }

            /// Checks that the buffer holds the whole header, so that no
            /// accessor can panic.
            pub fn check_len(&self) -> $crate::Result<()> {
                if self.buffer.as_ref().len() < $len {
                    Err($crate::Error)
                } else {
                    Ok(())
                }
            }

            /// Returns the underlying buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}
pub(crate) use header_view;
