//! The rsocket protocol of librdmacm (`librdmacm/docs/rsocket` in rdma-core): sockets carried
//! over RDMA, so that a softverbs rsocket and one of librdmacm talk to each other.
//!
//! Stream sockets run over an RC connection. Each side tells the other in the connection's
//! private data ([`ConnDataRepr`]) where its *target SGL* is (two [`SgeRepr`] slots the peer
//! writes receive buffers into), its first receive buffer and how many receives it posted
//! (credits). Data then moves by RDMA WRITE WITH IMMEDIATE into the advertised buffer, the
//! 32-bit immediate saying what the write was ([`Message`]); credit and buffer updates and
//! control messages (shutdown, disconnect, keepalive) are immediates too. The SGL and iomap
//! entries a side writes into its peer's memory are in the *peer's* byte order
//! ([`ByteOrder`], announced by [`conn_flag::NET`]); everything in the private data is
//! big-endian.
//!
//! Datagram sockets run over UD QPs with Q_Key 0x01234567. A socket first reaches a peer over
//! an ordinary UDP socket with a [`DsUdpHeaderRepr`] in front of the data, which tells the
//! receiver the sender's UD QP number; the receiver answers with a control datagram naming its
//! own. Afterwards datagrams go over UD, each starting with a [`DsHeaderRepr`] that names the
//! sender's IP address and UDP port.
//!
//! ```
//! use softverbs_wire::rsocket::{ByteOrder, ConnDataRepr, Message, SgeRepr, CONN_DATA_LEN};
//!
//! let msg = Message::Data(1500);
//! assert_eq!(Message::from_imm(msg.imm()), msg);
//!
//! let conn = ConnDataRepr {
//!     flags: softverbs_wire::rsocket::conn_flag::IOMAP,
//!     credits: 384,
//!     target_iomap_size: 0,
//!     target_sgl: SgeRepr { addr: 0x1000, key: 7, length: 2 },
//!     data_buf: SgeRepr { addr: 0x8000, key: 9, length: 65536 },
//! };
//! let mut buf = [0u8; CONN_DATA_LEN];
//! conn.emit(&mut buf).unwrap();
//! assert_eq!(ConnDataRepr::parse(&buf).unwrap(), conn);
//! assert_eq!(conn.sgl_order(), ByteOrder::Little);
//! ```

use core::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use crate::field::{read_u16, read_u32, read_u64, write_u16, write_u32, write_u64, MASK_24};
use crate::{Error, Result};

/// Message types: the top 3 bits of an immediate.
pub mod op {
    /// Application data was written into the next receive buffer; the low bits give its length.
    pub const DATA: u8 = 0;
    /// A direct write into an iomapped buffer. Never sent as an immediate: the sender marks its
    /// own work requests with it.
    pub const WRITE: u8 = 2;
    /// Credits granted, and possibly a target SGL entry updated; the low bits give the receive
    /// sequence number up to which the peer may send.
    pub const SGL: u8 = 4;
    /// An iomap entry was updated; the low bits give its index.
    pub const IOMAP_SGL: u8 = 6;
    /// A control message ([`super::ctrl`]).
    pub const CTRL: u8 = 7;
}

/// Control messages ([`op::CTRL`]).
pub mod ctrl {
    /// The sender is fully disconnected: it will neither send nor receive.
    pub const DISCONNECT: u32 = 0;
    /// A keepalive (a plain RDMA WRITE, which costs the peer no receive).
    pub const KEEPALIVE: u32 = 1;
    /// The sender shut down its sending side.
    pub const SHUTDOWN: u32 = 2;
}

/// Mask of the data bits of an immediate.
pub const MSG_DATA_MASK: u32 = 0x1FFF_FFFF;

/// An rsocket message, as carried in the immediate data of an RDMA WRITE WITH IMMEDIATE (host
/// order; the verbs carry it in network order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Message {
    /// That many bytes of application data arrived in the next receive buffer.
    Data(u32),
    /// The peer may send up to this receive sequence number (16 bits used); a target SGL
    /// entry may have been updated with the same write.
    Sgl(u32),
    /// The iomap entry with this index was updated.
    IomapSgl(u32),
    /// A control message ([`ctrl`]).
    Ctrl(u32),
    /// A type this implementation gives no meaning (reserved types, or [`op::WRITE`]).
    Other {
        /// The type (3 bits).
        op: u8,
        /// The data (29 bits).
        data: u32,
    },
}

impl Message {
    /// Decodes an immediate (host order).
    pub const fn from_imm(imm: u32) -> Self {
        let data = imm & MSG_DATA_MASK;
        match (imm >> 29) as u8 {
            op::DATA => Self::Data(data),
            op::SGL => Self::Sgl(data),
            op::IOMAP_SGL => Self::IomapSgl(data),
            op::CTRL => Self::Ctrl(data),
            op => Self::Other { op, data },
        }
    }

    /// The message type.
    pub const fn op(&self) -> u8 {
        match self {
            Self::Data(_) => op::DATA,
            Self::Sgl(_) => op::SGL,
            Self::IomapSgl(_) => op::IOMAP_SGL,
            Self::Ctrl(_) => op::CTRL,
            Self::Other { op, .. } => *op & 7,
        }
    }

    /// The 29 data bits.
    pub const fn data(&self) -> u32 {
        match self {
            Self::Data(d)
            | Self::Sgl(d)
            | Self::IomapSgl(d)
            | Self::Ctrl(d)
            | Self::Other { data: d, .. } => *d & MSG_DATA_MASK,
        }
    }

    /// The immediate (host order); data wider than 29 bits is truncated.
    pub const fn imm(&self) -> u32 {
        ((self.op() as u32) << 29) | self.data()
    }
}

/// Connection flags ([`ConnDataRepr::flags`]).
pub mod conn_flag {
    /// The sender is big-endian: SGL and iomap entries written into its memory must be
    /// big-endian.
    pub const NET: u8 = 1;
    /// The sender supports iomapped buffers: its iomap table follows its target SGL.
    pub const IOMAP: u8 = 2;
}

/// The version of the connection data this module speaks.
pub const CONN_DATA_VERSION: u8 = 1;
/// Length of [`ConnDataRepr`] on the wire.
pub const CONN_DATA_LEN: usize = 40;
/// Length of an [`SgeRepr`].
pub const SGE_LEN: usize = 16;
/// Length of an [`IomapRepr`].
pub const IOMAP_LEN: usize = 24;
/// Entries in a target SGL.
pub const SGL_SIZE: u32 = 2;

/// The byte order of memory a peer writes SGL and iomap entries into: its owner's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ByteOrder {
    /// Little-endian (x86, most ARM).
    Little,
    /// Big-endian ("network" order; [`conn_flag::NET`]).
    Big,
}

impl ByteOrder {
    /// The order of the machine this code runs on.
    pub const fn native() -> Self {
        if cfg!(target_endian = "big") {
            Self::Big
        } else {
            Self::Little
        }
    }

    fn u32(self, b: &[u8]) -> u32 {
        let a = [b[0], b[1], b[2], b[3]];
        match self {
            Self::Little => u32::from_le_bytes(a),
            Self::Big => u32::from_be_bytes(a),
        }
    }

    fn u64(self, b: &[u8]) -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[..8]);
        match self {
            Self::Little => u64::from_le_bytes(a),
            Self::Big => u64::from_be_bytes(a),
        }
    }

    fn put_u32(self, b: &mut [u8], v: u32) {
        b[..4].copy_from_slice(&match self {
            Self::Little => v.to_le_bytes(),
            Self::Big => v.to_be_bytes(),
        });
    }

    fn put_u64(self, b: &mut [u8], v: u64) {
        b[..8].copy_from_slice(&match self {
            Self::Little => v.to_le_bytes(),
            Self::Big => v.to_be_bytes(),
        });
    }
}

/// A buffer a peer may write into (`struct rs_sge`): address, remote key, length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SgeRepr {
    /// Remote address.
    pub addr: u64,
    /// Remote key.
    pub key: u32,
    /// Length in bytes (for the target SGL in the connection data: its number of entries).
    pub length: u32,
}

impl SgeRepr {
    /// Parses an entry written in `order`; fails on a short buffer.
    pub fn parse(buf: &[u8], order: ByteOrder) -> Result<Self> {
        if buf.len() < SGE_LEN {
            return Err(Error);
        }
        Ok(Self {
            addr: order.u64(&buf[0..8]),
            key: order.u32(&buf[8..12]),
            length: order.u32(&buf[12..16]),
        })
    }

    /// Writes the entry in `order`; fails on a short buffer.
    pub fn emit(&self, buf: &mut [u8], order: ByteOrder) -> Result<()> {
        if buf.len() < SGE_LEN {
            return Err(Error);
        }
        order.put_u64(&mut buf[0..8], self.addr);
        order.put_u32(&mut buf[8..12], self.key);
        order.put_u32(&mut buf[12..16], self.length);
        Ok(())
    }
}

/// An iomap entry (`struct rs_iomap`): the buffer behind an offset of the peer's iomap space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IomapRepr {
    /// The offset the buffer is mapped at.
    pub offset: u64,
    /// The buffer.
    pub sge: SgeRepr,
}

impl IomapRepr {
    /// Parses an entry written in `order`; fails on a short buffer.
    pub fn parse(buf: &[u8], order: ByteOrder) -> Result<Self> {
        if buf.len() < IOMAP_LEN {
            return Err(Error);
        }
        Ok(Self {
            offset: order.u64(&buf[0..8]),
            sge: SgeRepr::parse(&buf[8..], order)?,
        })
    }

    /// Writes the entry in `order`; fails on a short buffer.
    pub fn emit(&self, buf: &mut [u8], order: ByteOrder) -> Result<()> {
        if buf.len() < IOMAP_LEN {
            return Err(Error);
        }
        order.put_u64(&mut buf[0..8], self.offset);
        self.sge.emit(&mut buf[8..], order)
    }

    /// Whether `offset` falls inside the mapped buffer.
    pub fn contains(&self, offset: u64) -> bool {
        offset >= self.offset && offset - self.offset < u64::from(self.sge.length)
    }
}

/// The connection data each side puts at the start of its private data (`struct
/// rs_conn_data`): the REQ's and the REP's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnDataRepr {
    /// [`conn_flag`] bits.
    pub flags: u8,
    /// Receives the sender posted: how many messages the peer may send before it hears more.
    pub credits: u16,
    /// Size of the sender's iomap table, in the 8-bit scale of [`value_to_scale`].
    pub target_iomap_size: u8,
    /// Where the sender's target SGL is; `length` counts its entries (2).
    pub target_sgl: SgeRepr,
    /// The sender's first receive buffer, for the peer's first target SGL entry.
    pub data_buf: SgeRepr,
}

impl ConnDataRepr {
    /// Parses connection data; fails on a short buffer or a version other than 1.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        if buf.len() < CONN_DATA_LEN || buf[0] != CONN_DATA_VERSION {
            return Err(Error);
        }
        let sge = |b: &[u8]| SgeRepr {
            addr: read_u64(&b[0..8]),
            key: read_u32(&b[8..12]),
            length: read_u32(&b[12..16]),
        };
        Ok(Self {
            flags: buf[1],
            credits: read_u16(&buf[2..4]),
            target_iomap_size: buf[7],
            target_sgl: sge(&buf[8..24]),
            data_buf: sge(&buf[24..40]),
        })
    }

    /// Writes the connection data (version 1, reserved bytes zero); fails on a short buffer.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        if buf.len() < CONN_DATA_LEN {
            return Err(Error);
        }
        buf[0] = CONN_DATA_VERSION;
        buf[1] = self.flags;
        write_u16(&mut buf[2..4], self.credits);
        buf[4..7].fill(0);
        buf[7] = self.target_iomap_size;
        for (at, s) in [(8, &self.target_sgl), (24, &self.data_buf)] {
            write_u64(&mut buf[at..at + 8], s.addr);
            write_u32(&mut buf[at + 8..at + 12], s.key);
            write_u32(&mut buf[at + 12..at + 16], s.length);
        }
        Ok(())
    }

    /// The byte order the sender's SGL and iomap entries must be written in.
    pub const fn sgl_order(&self) -> ByteOrder {
        if self.flags & conn_flag::NET != 0 {
            ByteOrder::Big
        } else {
            ByteOrder::Little
        }
    }
}

/// librdmacm's 8-bit scale for iomap table sizes: values up to 128 as they are, larger ones
/// as `128 | value >> 8` (so a scaled byte reaches 127 << 8).
pub const fn value_to_scale(value: u32) -> u8 {
    if value <= 128 {
        value as u8
    } else {
        (0x80 | ((value >> 8) & 0x7F)) as u8
    }
}

/// The inverse of [`value_to_scale`].
pub const fn scale_to_value(scale: u8) -> u32 {
    if scale <= 128 {
        scale as u32
    } else {
        ((scale & 0x7F) as u32) << 8
    }
}

/// The tag that starts a [`DsUdpHeaderRepr`].
pub const DS_UDP_TAG: u32 = 0x5555_5555;
/// Length of a [`DsUdpHeaderRepr`] for IPv4.
pub const DS_UDP_IPV4_HDR_LEN: usize = 16;
/// Length of a [`DsUdpHeaderRepr`] for IPv6.
pub const DS_UDP_IPV6_HDR_LEN: usize = 28;
/// Length of a [`DsHeaderRepr`] for IPv4.
pub const DS_IPV4_HDR_LEN: usize = 8;
/// Length of a [`DsHeaderRepr`] for IPv6.
pub const DS_IPV6_HDR_LEN: usize = 24;

/// What a [`DsUdpHeaderRepr`] datagram is.
pub mod udp_op {
    /// Application data follows the header.
    pub const DATA: u8 = super::op::DATA;
    /// No data: the answer to a data datagram, naming the answerer's QP.
    pub const CTRL: u8 = super::op::CTRL;
}

/// The header of a datagram sent over the UDP socket (`struct ds_udp_header`), before the
/// peer's UD QP is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DsUdpHeaderRepr {
    /// [`udp_op`].
    pub op: u8,
    /// The sender's UD QP number (24 bits).
    pub qpn: u32,
    /// The sender's IP address (of the family of the datagram).
    pub addr: IpAddr,
}

impl DsUdpHeaderRepr {
    /// Parses the header of a datagram that came from an address of family `v4`; fails on a
    /// short buffer, a wrong tag, or a version or length that does not fit the family.
    pub fn parse(buf: &[u8], from_v4: bool) -> Result<Self> {
        if buf.len() < DS_UDP_IPV4_HDR_LEN || read_u32(&buf[0..4]) != DS_UDP_TAG {
            return Err(Error);
        }
        let (version, len) = (buf[4], usize::from(buf[6]));
        let addr = match (version, len, from_v4) {
            (4, DS_UDP_IPV4_HDR_LEN, true) => IpAddr::V4(Ipv4Addr::from(read_u32(&buf[12..16]))),
            (6, DS_UDP_IPV6_HDR_LEN, false) if buf.len() >= DS_UDP_IPV6_HDR_LEN => {
                let mut a = [0u8; 16];
                a.copy_from_slice(&buf[12..28]);
                IpAddr::V6(Ipv6Addr::from(a))
            }
            _ => return Err(Error),
        };
        Ok(Self {
            op: buf[5],
            qpn: read_u32(&buf[8..12]) & MASK_24,
            addr,
        })
    }

    /// Bytes the header takes: 16 for IPv4, 28 for IPv6.
    pub const fn buffer_len(&self) -> usize {
        match self.addr {
            IpAddr::V4(_) => DS_UDP_IPV4_HDR_LEN,
            IpAddr::V6(_) => DS_UDP_IPV6_HDR_LEN,
        }
    }

    /// Writes the header; fails on a short buffer.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        let len = self.buffer_len();
        if buf.len() < len {
            return Err(Error);
        }
        write_u32(&mut buf[0..4], DS_UDP_TAG);
        buf[4] = if self.addr.is_ipv4() { 4 } else { 6 };
        buf[5] = self.op;
        buf[6] = len as u8;
        buf[7] = 0;
        write_u32(&mut buf[8..12], self.qpn & MASK_24);
        match self.addr {
            IpAddr::V4(a) => buf[12..16].copy_from_slice(&a.octets()),
            IpAddr::V6(a) => buf[12..28].copy_from_slice(&a.octets()),
        }
        Ok(())
    }
}

/// The header in front of every datagram sent over UD (`struct ds_header`): the sender's
/// address, which the receiver reports as the datagram's source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DsHeaderRepr {
    /// The sender's IP address and UDP port (IPv6: with its flow information).
    pub src: SocketAddr,
}

impl DsHeaderRepr {
    /// Parses the header; fails on a short buffer or a version and length that do not match.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        if buf.len() < DS_IPV4_HDR_LEN {
            return Err(Error);
        }
        let port = read_u16(&buf[2..4]);
        let src = match (buf[0], usize::from(buf[1])) {
            (4, DS_IPV4_HDR_LEN) => {
                SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(read_u32(&buf[4..8])), port))
            }
            (6, DS_IPV6_HDR_LEN) if buf.len() >= DS_IPV6_HDR_LEN => {
                let mut a = [0u8; 16];
                a.copy_from_slice(&buf[8..24]);
                // librdmacm copies the bytes of `sin6_flowinfo` as they are in the socket
                // address; `SocketAddrV6` keeps that field's value unconverted too.
                let flowinfo = u32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
                SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(a), port, flowinfo, 0))
            }
            _ => return Err(Error),
        };
        Ok(Self { src })
    }

    /// Bytes the header takes: 8 for IPv4, 24 for IPv6.
    pub const fn buffer_len(&self) -> usize {
        match self.src {
            SocketAddr::V4(_) => DS_IPV4_HDR_LEN,
            SocketAddr::V6(_) => DS_IPV6_HDR_LEN,
        }
    }

    /// Writes the header; fails on a short buffer.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        let len = self.buffer_len();
        if buf.len() < len {
            return Err(Error);
        }
        buf[1] = len as u8;
        write_u16(&mut buf[2..4], self.src.port());
        match self.src {
            SocketAddr::V4(a) => {
                buf[0] = 4;
                buf[4..8].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                buf[0] = 6;
                buf[4..8].copy_from_slice(&a.flowinfo().to_ne_bytes());
                buf[8..24].copy_from_slice(&a.ip().octets());
            }
        }
        Ok(())
    }
}

/// Length of a path record (`struct ibv_path_record`).
pub const PATH_RECORD_LEN: usize = 64;
/// Length of `struct ibv_path_data` (flags, reserved, path record): what the `RDMA_ROUTE`
/// socket option gives.
pub const PATH_DATA_LEN: usize = 72;

/// The path of a connection as `RDMA_ROUTE` reports it: an IB SA path record (`struct
/// ibv_path_record`, big-endian fields) inside `struct ibv_path_data`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PathRecordRepr {
    /// Destination GID.
    pub dgid: [u8; 16],
    /// Source GID.
    pub sgid: [u8; 16],
    /// Destination LID (0xFFFF on RoCE beyond a subnet).
    pub dlid: u16,
    /// Source LID.
    pub slid: u16,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Whether the path is reversible.
    pub reversible: bool,
    /// Partition key.
    pub pkey: u16,
    /// Service level (4 bits).
    pub sl: u8,
    /// Path MTU (the IB enumeration, 1 = 256 .. 5 = 4096).
    pub mtu: u8,
    /// Static rate (the IB enumeration).
    pub rate: u8,
    /// Packet lifetime (4.096 us x 2^n).
    pub packet_life_time: u8,
    /// Preference (`ibv_path_data.flags`).
    pub preference: u8,
}

impl PathRecordRepr {
    /// Writes the record as `struct ibv_path_data` (selectors "exactly", one path; the flags
    /// word in host order, as librdmacm fills it); fails on a short buffer.
    pub fn emit_path_data(&self, buf: &mut [u8]) -> Result<()> {
        if buf.len() < PATH_DATA_LEN {
            return Err(Error);
        }
        buf[..PATH_DATA_LEN].fill(0);
        buf[0..4].copy_from_slice(&u32::from(self.preference).to_ne_bytes());
        let p = &mut buf[8..8 + PATH_RECORD_LEN];
        p[8..24].copy_from_slice(&self.dgid);
        p[24..40].copy_from_slice(&self.sgid);
        write_u16(&mut p[40..42], self.dlid);
        write_u16(&mut p[42..44], self.slid);
        write_u32(
            &mut p[44..48],
            ((self.flow_label & 0xF_FFFF) << 8) | u32::from(self.hop_limit),
        );
        p[48] = self.traffic_class;
        p[49] = (u8::from(self.reversible) << 7) | 1;
        write_u16(&mut p[50..52], self.pkey);
        write_u16(&mut p[52..54], u16::from(self.sl & 0xF));
        // Selector 2 ("exactly") in the top two bits.
        p[54] = (self.mtu & 0x3F) | 2 << 6;
        p[55] = (self.rate & 0x3F) | 2 << 6;
        p[56] = (self.packet_life_time & 0x3F) | 2 << 6;
        p[57] = self.preference;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immediates_round_trip_and_keep_29_bits() {
        for m in [
            Message::Data(0),
            Message::Data(MSG_DATA_MASK),
            Message::Sgl(0xFFFF + 384),
            Message::IomapSgl(3),
            Message::Ctrl(ctrl::SHUTDOWN),
            Message::Other { op: 1, data: 5 },
        ] {
            assert_eq!(Message::from_imm(m.imm()), m);
        }
        assert_eq!(Message::Ctrl(ctrl::DISCONNECT).imm(), 0xE000_0000);
        assert_eq!(Message::Sgl(10).imm(), 0x8000_000A);
        assert_eq!(Message::Data(MSG_DATA_MASK + 1).imm(), 0);
    }

    #[test]
    fn connection_data_layout() {
        let c = ConnDataRepr {
            flags: conn_flag::IOMAP | conn_flag::NET,
            credits: 0x0180,
            target_iomap_size: 1,
            target_sgl: SgeRepr {
                addr: 0x0102_0304_0506_0708,
                key: 0x1112_1314,
                length: 2,
            },
            data_buf: SgeRepr {
                addr: 0x2122_2324_2526_2728,
                key: 0x3132_3334,
                length: 0x0001_0000,
            },
        };
        let mut b = [0xAAu8; CONN_DATA_LEN];
        c.emit(&mut b).unwrap();
        assert_eq!(&b[..8], &[1, 3, 0x01, 0x80, 0, 0, 0, 1]);
        assert_eq!(&b[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[16..24], &[0x11, 0x12, 0x13, 0x14, 0, 0, 0, 2]);
        assert_eq!(&b[36..40], &[0, 1, 0, 0]);
        assert_eq!(ConnDataRepr::parse(&b).unwrap(), c);
        assert_eq!(c.sgl_order(), ByteOrder::Big);
        b[0] = 2;
        assert!(ConnDataRepr::parse(&b).is_err());
        assert!(ConnDataRepr::parse(&b[..39]).is_err());
    }

    #[test]
    fn sgl_entries_in_either_order() {
        let s = SgeRepr {
            addr: 0x1122_3344_5566_7788,
            key: 0xAABB_CCDD,
            length: 4096,
        };
        let mut le = [0u8; SGE_LEN];
        s.emit(&mut le, ByteOrder::Little).unwrap();
        assert_eq!(le[0], 0x88);
        assert_eq!(&le[12..16], &4096u32.to_le_bytes());
        let mut be = [0u8; SGE_LEN];
        s.emit(&mut be, ByteOrder::Big).unwrap();
        assert_eq!(be[0], 0x11);
        assert_eq!(SgeRepr::parse(&le, ByteOrder::Little).unwrap(), s);
        assert_eq!(SgeRepr::parse(&be, ByteOrder::Big).unwrap(), s);
        let io = IomapRepr { offset: 100, sge: s };
        let mut b = [0u8; IOMAP_LEN];
        io.emit(&mut b, ByteOrder::native()).unwrap();
        assert_eq!(IomapRepr::parse(&b, ByteOrder::native()).unwrap(), io);
        assert!(io.contains(100) && io.contains(4195) && !io.contains(4196) && !io.contains(99));
    }

    #[test]
    fn iomap_scale() {
        for v in [0, 1, 127, 128] {
            assert_eq!(scale_to_value(value_to_scale(v)), v);
        }
        assert_eq!(scale_to_value(value_to_scale(4096)), 4096);
        assert_eq!(scale_to_value(value_to_scale(300)), 256);
    }

    #[test]
    fn datagram_headers() {
        let v4 = DsHeaderRepr {
            src: "10.1.2.3:7174".parse().unwrap(),
        };
        let mut b = [0u8; DS_IPV6_HDR_LEN];
        v4.emit(&mut b).unwrap();
        assert_eq!(&b[..8], &[4, 8, 0x1C, 0x06, 10, 1, 2, 3]);
        assert_eq!(DsHeaderRepr::parse(&b[..8]).unwrap(), v4);
        let v6 = DsHeaderRepr {
            src: "[fe80::1]:9".parse().unwrap(),
        };
        v6.emit(&mut b).unwrap();
        assert_eq!((b[0], b[1]), (6, 24));
        assert_eq!(DsHeaderRepr::parse(&b).unwrap(), v6);
        assert!(DsHeaderRepr::parse(&b[..8]).is_err());
        b[1] = 8;
        assert!(DsHeaderRepr::parse(&b).is_err());

        let u = DsUdpHeaderRepr {
            op: udp_op::DATA,
            qpn: 0x12_3456,
            addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
        };
        let mut b = [0u8; DS_UDP_IPV6_HDR_LEN];
        u.emit(&mut b).unwrap();
        assert_eq!(
            &b[..16],
            &[0x55, 0x55, 0x55, 0x55, 4, 0, 16, 0, 0, 0x12, 0x34, 0x56, 127, 0, 0, 1]
        );
        assert_eq!(DsUdpHeaderRepr::parse(&b[..16], true).unwrap(), u);
        assert!(
            DsUdpHeaderRepr::parse(&b[..16], false).is_err(),
            "family mismatch"
        );
        b[0] = 0;
        assert!(DsUdpHeaderRepr::parse(&b[..16], true).is_err(), "tag");
    }

    #[test]
    fn path_data_layout() {
        let p = PathRecordRepr {
            dgid: [1; 16],
            sgid: [2; 16],
            dlid: 0xFFFF,
            hop_limit: 64,
            flow_label: 0x12345,
            mtu: 5,
            pkey: 0xFFFF,
            packet_life_time: 16,
            ..PathRecordRepr::default()
        };
        let mut b = [0u8; PATH_DATA_LEN];
        p.emit_path_data(&mut b).unwrap();
        assert_eq!(&b[16..32], &[1; 16]);
        assert_eq!(&b[52..56], &[0x01, 0x23, 0x45, 64]);
        assert_eq!(b[8 + 54], 0x85);
    }
}
