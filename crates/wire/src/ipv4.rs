//! IPv4 header (RFC 791): 20 bytes without options, which is all RoCEv2
//! sends; options are skipped on parse and never emitted.

use core::net::Ipv4Addr;

use crate::field::{read_u16, write_u16};
use crate::{header_view, Error, Result};

mod field {
    use crate::field::Field;

    /// Version (high nibble) and IHL in 32-bit words (low nibble).
    pub(super) const VER_IHL: usize = 0;
    /// DSCP and ECN.
    pub(super) const TOS: usize = 1;
    pub(super) const LENGTH: Field = 2..4;
    pub(super) const IDENT: Field = 4..6;
    /// Flags (3 bits) and fragment offset (13 bits).
    pub(super) const FLG_OFF: Field = 6..8;
    pub(super) const TTL: usize = 8;
    pub(super) const PROTOCOL: usize = 9;
    pub(super) const CHECKSUM: Field = 10..12;
    pub(super) const SRC_ADDR: Field = 12..16;
    pub(super) const DST_ADDR: Field = 16..20;

    pub(super) const DONT_FRAG: u16 = 0x4000;
    pub(super) const MORE_FRAGS: u16 = 0x2000;
    pub(super) const FRAG_OFFSET: u16 = 0x1FFF;
}

/// Length of an IPv4 header without options.
pub const HEADER_LEN: usize = field::DST_ADDR.end;

/// The IP protocol number of UDP.
pub const IPPROTO_UDP: u8 = 17;

header_view! {
    /// A zero-copy view of an IPv4 header.
    ///
    /// `check_len` covers the 20 fixed bytes only; [`verify_checksum`]
    /// reports a header whose options do not fit the buffer as invalid.
    ///
    /// [`verify_checksum`]: Ipv4Packet::verify_checksum
    Ipv4Packet, HEADER_LEN
}

/// The Internet checksum (RFC 1071) of `data`, before complementing:
/// the ones' complement sum folded to 16 bits.
fn ones_complement_sum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    sum as u16
}

impl<T: AsRef<[u8]>> Ipv4Packet<T> {
    fn data(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// IP version; 4 in a valid header.
    pub fn version(&self) -> u8 {
        self.data()[field::VER_IHL] >> 4
    }

    /// Header length in bytes (IHL × 4), options included.
    pub fn header_len(&self) -> usize {
        usize::from(self.data()[field::VER_IHL] & 0x0F) * 4
    }

    /// Type of service: DSCP (high 6 bits) and ECN (low 2 bits).
    pub fn tos(&self) -> u8 {
        self.data()[field::TOS]
    }

    /// Total length of the datagram, header included.
    pub fn total_len(&self) -> u16 {
        read_u16(&self.data()[field::LENGTH])
    }

    /// Identification.
    pub fn ident(&self) -> u16 {
        read_u16(&self.data()[field::IDENT])
    }

    /// The three flag bits: reserved (4), Don't Fragment (2), More
    /// Fragments (1).
    pub fn flags(&self) -> u8 {
        (read_u16(&self.data()[field::FLG_OFF]) >> 13) as u8
    }

    /// Don't Fragment.
    pub fn dont_frag(&self) -> bool {
        read_u16(&self.data()[field::FLG_OFF]) & field::DONT_FRAG != 0
    }

    /// More Fragments.
    pub fn more_frags(&self) -> bool {
        read_u16(&self.data()[field::FLG_OFF]) & field::MORE_FRAGS != 0
    }

    /// Fragment offset in 8-byte units.
    pub fn frag_offset(&self) -> u16 {
        read_u16(&self.data()[field::FLG_OFF]) & field::FRAG_OFFSET
    }

    /// Time to live.
    pub fn ttl(&self) -> u8 {
        self.data()[field::TTL]
    }

    /// Protocol of the payload ([`IPPROTO_UDP`] for RoCEv2).
    pub fn protocol(&self) -> u8 {
        self.data()[field::PROTOCOL]
    }

    /// Header checksum as carried.
    pub fn checksum(&self) -> u16 {
        read_u16(&self.data()[field::CHECKSUM])
    }

    /// Source address.
    pub fn src_addr(&self) -> Ipv4Addr {
        let b = &self.data()[field::SRC_ADDR];
        Ipv4Addr::new(b[0], b[1], b[2], b[3])
    }

    /// Destination address.
    pub fn dst_addr(&self) -> Ipv4Addr {
        let b = &self.data()[field::DST_ADDR];
        Ipv4Addr::new(b[0], b[1], b[2], b[3])
    }

    /// Whether the header checksum is right; false if the IHL is below 5
    /// or the options do not fit the buffer.
    pub fn verify_checksum(&self) -> bool {
        let len = self.header_len();
        len >= HEADER_LEN
            && self
                .data()
                .get(..len)
                .is_some_and(|h| ones_complement_sum(h) == 0xFFFF)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv4Packet<T> {
    fn data_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }

    /// Sets the version; only the low 4 bits are used.
    pub fn set_version(&mut self, value: u8) {
        let b = &mut self.data_mut()[field::VER_IHL];
        *b = (*b & 0x0F) | (value << 4);
    }

    /// Sets the header length in bytes; it is stored in 32-bit words, so
    /// `value` is divided by 4 and only 4 bits are kept.
    pub fn set_header_len(&mut self, value: usize) {
        let b = &mut self.data_mut()[field::VER_IHL];
        *b = (*b & 0xF0) | ((value / 4) as u8 & 0x0F);
    }

    /// Sets the type of service.
    pub fn set_tos(&mut self, value: u8) {
        self.data_mut()[field::TOS] = value;
    }

    /// Sets the total length.
    pub fn set_total_len(&mut self, value: u16) {
        write_u16(&mut self.data_mut()[field::LENGTH], value);
    }

    /// Sets the identification.
    pub fn set_ident(&mut self, value: u16) {
        write_u16(&mut self.data_mut()[field::IDENT], value);
    }

    fn set_flg_off(&mut self, mask: u16, value: u16) {
        let old = read_u16(&self.data()[field::FLG_OFF]);
        write_u16(
            &mut self.data_mut()[field::FLG_OFF],
            (old & !mask) | (value & mask),
        );
    }

    /// Sets Don't Fragment.
    pub fn set_dont_frag(&mut self, value: bool) {
        self.set_flg_off(field::DONT_FRAG, if value { field::DONT_FRAG } else { 0 });
    }

    /// Sets More Fragments.
    pub fn set_more_frags(&mut self, value: bool) {
        self.set_flg_off(field::MORE_FRAGS, if value { field::MORE_FRAGS } else { 0 });
    }

    /// Sets the fragment offset; only the low 13 bits are used.
    pub fn set_frag_offset(&mut self, value: u16) {
        self.set_flg_off(field::FRAG_OFFSET, value);
    }

    /// Sets the time to live.
    pub fn set_ttl(&mut self, value: u8) {
        self.data_mut()[field::TTL] = value;
    }

    /// Sets the protocol.
    pub fn set_protocol(&mut self, value: u8) {
        self.data_mut()[field::PROTOCOL] = value;
    }

    /// Sets the header checksum field as given.
    pub fn set_checksum(&mut self, value: u16) {
        write_u16(&mut self.data_mut()[field::CHECKSUM], value);
    }

    /// Sets the source address.
    pub fn set_src_addr(&mut self, value: Ipv4Addr) {
        self.data_mut()[field::SRC_ADDR].copy_from_slice(&value.octets());
    }

    /// Sets the destination address.
    pub fn set_dst_addr(&mut self, value: Ipv4Addr) {
        self.data_mut()[field::DST_ADDR].copy_from_slice(&value.octets());
    }

    /// Computes the header checksum over the first [`header_len`] bytes
    /// (clamped to the buffer and to at least 20) and stores it.
    ///
    /// [`header_len`]: Ipv4Packet::header_len
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let len = self.header_len().clamp(HEADER_LEN, self.data().len());
        let sum = ones_complement_sum(&self.data()[..len]);
        self.set_checksum(!sum);
    }
}

/// A validated IPv4 header without options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Repr {
    /// Source address.
    pub src_addr: Ipv4Addr,
    /// Destination address.
    pub dst_addr: Ipv4Addr,
    /// Protocol of the payload.
    pub protocol: u8,
    /// Bytes after the header; `emit` saturates the total length at
    /// 65535.
    pub payload_len: usize,
    /// Type of service (DSCP and ECN).
    pub tos: u8,
    /// Identification.
    pub ident: u16,
    /// Don't Fragment.
    pub dont_frag: bool,
    /// Time to live.
    pub ttl: u8,
}

impl Ipv4Repr {
    /// Parses an IPv4 header; fails on a short buffer, a version other
    /// than 4, an IHL below 5 or past the buffer, a total length shorter
    /// than the header, a bad checksum or a fragment. Options are skipped.
    pub fn parse<T: AsRef<[u8]>>(packet: &Ipv4Packet<T>) -> Result<Self> {
        packet.check_len()?;
        let header_len = packet.header_len();
        if packet.version() != 4 || !packet.verify_checksum() {
            return Err(Error);
        }
        if packet.more_frags() || packet.frag_offset() != 0 {
            return Err(Error);
        }
        let payload_len = usize::from(packet.total_len())
            .checked_sub(header_len)
            .ok_or(Error)?;
        Ok(Self {
            src_addr: packet.src_addr(),
            dst_addr: packet.dst_addr(),
            protocol: packet.protocol(),
            payload_len,
            tos: packet.tos(),
            ident: packet.ident(),
            dont_frag: packet.dont_frag(),
            ttl: packet.ttl(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes a 20-byte header with its checksum.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Ipv4Packet<T>) {
        let total = HEADER_LEN
            .saturating_add(self.payload_len)
            .min(usize::from(u16::MAX)) as u16;
        packet.set_version(4);
        packet.set_header_len(HEADER_LEN);
        packet.set_tos(self.tos);
        packet.set_total_len(total);
        packet.set_ident(self.ident);
        packet.set_flg_off(0xFFFF, if self.dont_frag { field::DONT_FRAG } else { 0 });
        packet.set_ttl(self.ttl);
        packet.set_protocol(self.protocol);
        packet.set_src_addr(self.src_addr);
        packet.set_dst_addr(self.dst_addr);
        packet.fill_checksum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategies;
    use proptest::prelude::*;

    // The IPv4 header of scapy's UC SEND ONLY test packet (roce.md vector 2).
    static BYTES: [u8; 20] = [
        0x45, 0x01, 0x00, 0x40, 0x04, 0x78, 0x40, 0x00, 0x40, 0x11, 0xb4, 0xd5, 0xc0, 0xa8, 0x00, 0x07, 0xc0,
        0xa8, 0x00, 0x07,
    ];

    fn repr() -> Ipv4Repr {
        Ipv4Repr {
            src_addr: Ipv4Addr::new(192, 168, 0, 7),
            dst_addr: Ipv4Addr::new(192, 168, 0, 7),
            protocol: IPPROTO_UDP,
            payload_len: 44,
            tos: 1,
            ident: 1144,
            dont_frag: true,
            ttl: 64,
        }
    }

    #[test]
    fn deconstruct() {
        let p = Ipv4Packet::new_checked(&BYTES[..]).unwrap();
        assert_eq!(
            (p.version(), p.header_len(), p.tos(), p.total_len()),
            (4, 20, 1, 64)
        );
        assert_eq!(
            (p.ident(), p.dont_frag(), p.more_frags(), p.frag_offset()),
            (1144, true, false, 0)
        );
        assert_eq!((p.ttl(), p.protocol(), p.checksum()), (64, 17, 0xb4d5));
        assert!(p.verify_checksum());
        assert_eq!(Ipv4Repr::parse(&p), Ok(repr()));
    }

    #[test]
    fn construct() {
        let mut buf = [0xa5u8; HEADER_LEN];
        repr().emit(&mut Ipv4Packet::new_unchecked(&mut buf));
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn rejects_bad_headers() {
        let parse = |b: &[u8]| Ipv4Packet::new_checked(b).and_then(|p| Ipv4Repr::parse(&p));
        assert_eq!(parse(&BYTES[..19]), Err(Error));
        let mut bad = BYTES;
        bad[11] ^= 1;
        assert_eq!(parse(&bad), Err(Error), "checksum");
        // Each of these is re-checksummed so that only the named field is wrong.
        let refill = |f: &dyn Fn(&mut Ipv4Packet<&mut [u8; 20]>)| {
            let mut b = BYTES;
            let mut p = Ipv4Packet::new_unchecked(&mut b);
            f(&mut p);
            p.fill_checksum();
            b
        };
        assert_eq!(parse(&refill(&|p| p.set_version(6))), Err(Error), "version");
        assert_eq!(parse(&refill(&|p| p.set_header_len(16))), Err(Error), "IHL 4");
        assert_eq!(
            parse(&refill(&|p| p.set_header_len(24))),
            Err(Error),
            "options past the buffer"
        );
        assert_eq!(
            parse(&refill(&|p| p.set_total_len(19))),
            Err(Error),
            "total length"
        );
        assert_eq!(
            parse(&refill(&|p| p.set_more_frags(true))),
            Err(Error),
            "fragment"
        );
        assert_eq!(parse(&refill(&|p| p.set_frag_offset(3))), Err(Error), "fragment");
    }

    #[test]
    fn options_are_covered_by_the_checksum_and_skipped() {
        let mut buf = [0u8; 24];
        buf[..20].copy_from_slice(&BYTES);
        let mut p = Ipv4Packet::new_unchecked(&mut buf);
        p.set_header_len(24);
        p.fill_checksum();
        let p = Ipv4Packet::new_checked(&buf[..]).unwrap();
        assert!(p.verify_checksum());
        let parsed = Ipv4Repr::parse(&p).unwrap();
        assert_eq!(parsed.payload_len, 40);
        let mut flipped = buf;
        flipped[22] ^= 0x10;
        assert!(!Ipv4Packet::new_unchecked(&flipped[..]).verify_checksum());
    }

    #[test]
    fn setters_touch_only_their_bits() {
        let mut buf = [0u8; HEADER_LEN];
        let mut p = Ipv4Packet::new_unchecked(&mut buf);
        p.set_header_len(60);
        p.set_version(4);
        p.set_frag_offset(0xFFFF);
        p.set_dont_frag(true);
        p.set_more_frags(true);
        p.set_more_frags(false);
        assert_eq!(buf[..8], [0x4f, 0, 0, 0, 0, 0, 0x5f, 0xff]);
    }

    #[test]
    fn total_length_saturates() {
        let mut buf = [0u8; HEADER_LEN];
        let big = Ipv4Repr {
            payload_len: usize::MAX,
            ..repr()
        };
        big.emit(&mut Ipv4Packet::new_unchecked(&mut buf));
        assert_eq!(Ipv4Packet::new_unchecked(&buf).total_len(), u16::MAX);
    }

    proptest! {
        #[test]
        fn round_trip(repr in strategies::ipv4()) {
            let mut buf = [0xffu8; HEADER_LEN];
            repr.emit(&mut Ipv4Packet::new_unchecked(&mut buf));
            let p = Ipv4Packet::new_checked(&buf[..]).unwrap();
            prop_assert!(p.verify_checksum());
            prop_assert_eq!(Ipv4Repr::parse(&p), Ok(repr));
        }

        #[test]
        fn any_flipped_bit_fails_the_checksum(repr in strategies::ipv4(), bit in 0..HEADER_LEN * 8) {
            let mut buf = [0u8; HEADER_LEN];
            repr.emit(&mut Ipv4Packet::new_unchecked(&mut buf));
            buf[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(!Ipv4Packet::new_unchecked(&buf[..]).verify_checksum());
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(p) = Ipv4Packet::new_checked(&bytes[..]) {
                let _ = (p.verify_checksum(), Ipv4Repr::parse(&p));
            }
        }
    }
}
