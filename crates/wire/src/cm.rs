//! InfiniBand Communication Management (CM) messages, the data area of a
//! CM MAD (IBTA Vol. 1 ch. 12, Tables 106-120).
//!
//! Each message has a zero-copy view over the 232 bytes after the MAD
//! header (offsets below are relative to that area, big-endian, bit 0 the
//! most significant) and a validated repr. [`CmMessage`] parses and emits a
//! whole 256-byte MAD. Private data is carried at its full fixed size, as
//! the wire does; unused bytes are zero.
//!
//! The module also holds what the RDMA CM (`rdma_cm`) adds on top: the
//! 36-byte private-data header of REQ and SIDR_REQ ([`CmaHeaderRepr`]) and
//! the service IDs of its port spaces ([`service_id`]).
//!
//! ```
//! use softverbs_wire::cm::{CmMessage, RtuRepr};
//! use softverbs_wire::mad::MAD_LEN;
//!
//! let rtu = CmMessage::Rtu(RtuRepr { local_comm_id: 1, remote_comm_id: 2, private_data: [0; 224] });
//! let mut mad = [0u8; MAD_LEN];
//! rtu.emit(0x77, 0, &mut mad).unwrap();
//! let (header, parsed) = CmMessage::parse(&mad).unwrap();
//! assert_eq!(header.transaction_id, 0x77);
//! assert_eq!(parsed, rtu);
//! ```

use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::field::MASK_24;
use crate::mad::{MadPacket, MadRepr, CM_CLASS_VERSION, DATA_LEN, MAD_LEN, METHOD_SEND, MGMT_CLASS_CM};
use crate::{header_view, Error, Result};

/// CM attribute IDs (MAD header `AttributeID`).
pub mod attr {
    /// ClassPortInfo.
    pub const CLASS_PORT_INFO: u16 = 0x0001;
    /// Request for communication.
    pub const REQ: u16 = 0x0010;
    /// Message receipt acknowledgement.
    pub const MRA: u16 = 0x0011;
    /// Reject.
    pub const REJ: u16 = 0x0012;
    /// Reply to a request.
    pub const REP: u16 = 0x0013;
    /// Ready to use.
    pub const RTU: u16 = 0x0014;
    /// Disconnect request.
    pub const DREQ: u16 = 0x0015;
    /// Disconnect reply.
    pub const DREP: u16 = 0x0016;
    /// Service ID resolution request.
    pub const SIDR_REQ: u16 = 0x0017;
    /// Service ID resolution reply.
    pub const SIDR_REP: u16 = 0x0018;
    /// Load alternate path (not supported here).
    pub const LAP: u16 = 0x0019;
    /// Alternate path response (not supported here).
    pub const APR: u16 = 0x001A;
}

/// REJ reasons (`ib_cm_rej_reason`) that a CM on RoCE meets.
pub mod rej_reason {
    /// No QP available.
    pub const NO_QP: u16 = 1;
    /// No resources.
    pub const NO_RESOURCES: u16 = 3;
    /// The sender gave up waiting for a reply.
    pub const TIMEOUT: u16 = 4;
    /// Request not supported.
    pub const UNSUPPORTED: u16 = 5;
    /// The communication ID is not known.
    pub const INVALID_COMM_ID: u16 = 6;
    /// No listener for the service ID.
    pub const INVALID_SERVICE_ID: u16 = 8;
    /// Transport type not supported.
    pub const INVALID_TRANSPORT_TYPE: u16 = 9;
    /// The QPN or communication ID is still in timewait.
    pub const STALE_CONN: u16 = 10;
    /// The passive side cannot reach the requester's GID.
    pub const INVALID_GID: u16 = 12;
    /// Path MTU not supported.
    pub const INVALID_MTU: u16 = 26;
    /// Not enough responder resources.
    pub const INSUFFICIENT_RESP_RESOURCES: u16 = 27;
    /// Rejected by the consumer (`rdma_reject`); private data is valid.
    pub const CONSUMER_DEFINED: u16 = 28;
    /// The communication ID is already in use.
    pub const DUPLICATE_LOCAL_COMM_ID: u16 = 30;
    /// Class version not supported.
    pub const INVALID_CLASS_VERSION: u16 = 31;
    /// ECE options not supported (`rdma_reject_ece`).
    pub const VENDOR_OPTION_NOT_SUPPORTED: u16 = 35;
}

/// SIDR_REP status values.
pub mod sidr_status {
    /// The service answered.
    pub const SUCCESS: u8 = 0;
    /// No listener for the service ID.
    pub const UNSUPPORTED: u8 = 1;
    /// The consumer rejected the request.
    pub const REJECT: u8 = 2;
    /// No QP available.
    pub const NO_QP: u8 = 3;
    /// Redirected.
    pub const REDIRECT: u8 = 4;
    /// Version not supported.
    pub const UNSUPPORTED_VERSION: u8 = 5;
}

/// Private data bytes of each message.
pub mod private_data_len {
    /// REQ.
    pub const REQ: usize = 92;
    /// MRA.
    pub const MRA: usize = 222;
    /// REJ.
    pub const REJ: usize = 148;
    /// REP.
    pub const REP: usize = 196;
    /// RTU.
    pub const RTU: usize = 224;
    /// DREQ.
    pub const DREQ: usize = 220;
    /// DREP.
    pub const DREP: usize = 224;
    /// SIDR_REQ.
    pub const SIDR_REQ: usize = 216;
    /// SIDR_REP.
    pub const SIDR_REP: usize = 136;
}

/// Length of the REJ Additional Rejection Information and the SIDR_REP
/// Additional Information.
pub const ARI_LEN: usize = 72;

/// The Q_Key `rdma_cm` puts on every UD QP (`RDMA_UDP_QKEY`).
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;

/// Defines getters and setters of a view from a compact field list.
///
/// Kinds: `u8(off)`, `u16(off)`, `u24(off)`, `u32(off)`, `u64(off)`,
/// `bits(off, shift, width)` (a bit field of one byte, `shift` counted from
/// the LSB), `flag(off, mask)`, `gid(off)` and `bytes(off, len)`. Setters
/// of partial fields keep the other bits of their byte.
macro_rules! accessors {
    ($view:ident { $( $(#[$doc:meta])* $get:ident, $set:ident: $kind:ident($($arg:expr),*); )* }) => {
        impl<T: AsRef<[u8]>> $view<T> {
            $(
                $(#[$doc])*
                pub fn $get(&self) -> accessors!(@ty $kind) {
                    let b = self.buffer.as_ref();
                    accessors!(@get $kind, b, $($arg),*)
                }
            )*
        }

        impl<T: AsRef<[u8]> + AsMut<[u8]>> $view<T> {
            $(
                #[doc = concat!("Sets the field [`", stringify!($get), "`](Self::", stringify!($get),
                    ") reads; values wider than the field are truncated.")]
                pub fn $set(&mut self, value: accessors!(@ty $kind)) {
                    let b = self.buffer.as_mut();
                    accessors!(@set $kind, b, value, $($arg),*);
                }
            )*
        }
    };
    (@ty u8) => { u8 };
    (@ty u16) => { u16 };
    (@ty u24) => { u32 };
    (@ty u32) => { u32 };
    (@ty u64) => { u64 };
    (@ty bits) => { u8 };
    (@ty flag) => { bool };
    (@ty gid) => { [u8; 16] };
    (@ty bytes) => { &[u8] };
    (@get u8, $b:ident, $off:expr) => { $b[$off] };
    (@get u16, $b:ident, $off:expr) => { crate::field::read_u16(&$b[$off..]) };
    (@get u24, $b:ident, $off:expr) => { crate::field::read_u24(&$b[$off..]) };
    (@get u32, $b:ident, $off:expr) => { crate::field::read_u32(&$b[$off..]) };
    (@get u64, $b:ident, $off:expr) => { crate::field::read_u64(&$b[$off..]) };
    (@get bits, $b:ident, $off:expr, $shift:expr, $width:expr) => {
        ($b[$off] >> $shift) & ((1u8 << $width) - 1)
    };
    (@get flag, $b:ident, $off:expr, $mask:expr) => { $b[$off] & $mask != 0 };
    (@get gid, $b:ident, $off:expr) => {{
        let mut g = [0u8; 16];
        g.copy_from_slice(&$b[$off..$off + 16]);
        g
    }};
    (@get bytes, $b:ident, $off:expr, $len:expr) => { &$b[$off..$off + $len] };
    (@set u8, $b:ident, $v:ident, $off:expr) => { $b[$off] = $v };
    (@set u16, $b:ident, $v:ident, $off:expr) => { crate::field::write_u16(&mut $b[$off..], $v) };
    (@set u24, $b:ident, $v:ident, $off:expr) => {
        crate::field::write_u24(&mut $b[$off..], $v & MASK_24)
    };
    (@set u32, $b:ident, $v:ident, $off:expr) => { crate::field::write_u32(&mut $b[$off..], $v) };
    (@set u64, $b:ident, $v:ident, $off:expr) => { crate::field::write_u64(&mut $b[$off..], $v) };
    (@set bits, $b:ident, $v:ident, $off:expr, $shift:expr, $width:expr) => {{
        let mask: u8 = ((1u8 << $width) - 1) << $shift;
        $b[$off] = ($b[$off] & !mask) | (($v << $shift) & mask);
    }};
    (@set flag, $b:ident, $v:ident, $off:expr, $mask:expr) => {
        crate::field::set_bit(&mut $b[$off], $mask, $v)
    };
    (@set gid, $b:ident, $v:ident, $off:expr) => { $b[$off..$off + 16].copy_from_slice(&$v) };
    (@set bytes, $b:ident, $v:ident, $off:expr, $len:expr) => {{
        let dst = &mut $b[$off..$off + $len];
        let n = $v.len().min($len);
        dst[..n].copy_from_slice(&$v[..n]);
        dst[n..].fill(0);
    }};
}

/// Reads a fixed-size array out of a slice of exactly that length.
fn array<const N: usize>(src: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&src[..N]);
    a
}

// ---------------------------------------------------------------------------------------------
// Path information (44 bytes, twice in a REQ)

/// Length of the path information block of a REQ.
pub const PATH_LEN: usize = 44;

header_view! {
    /// A zero-copy view of a REQ's primary or alternate path (44 bytes).
    CmPathPacket, PATH_LEN
}

accessors!(CmPathPacket {
    /// Local port LID (0xFFFF on RoCE beyond one hop).
    local_lid, set_local_lid: u16(0);
    /// Remote port LID.
    remote_lid, set_remote_lid: u16(2);
    /// Local port GID (the requester's IP).
    local_gid, set_local_gid: gid(4);
    /// Remote port GID (the responder's IP).
    remote_gid, set_remote_gid: gid(20);
    /// Static rate (6 bits).
    packet_rate, set_packet_rate: bits(39, 0, 6);
    /// Traffic class (the IP TOS).
    traffic_class, set_traffic_class: u8(40);
    /// Hop limit.
    hop_limit, set_hop_limit: u8(41);
    /// Service level (4 bits).
    sl, set_sl: bits(42, 4, 4);
    /// Whether the path stays in the subnet.
    subnet_local, set_subnet_local: flag(42, 0x08);
    /// Local ACK timeout (5 bits, 4.096 us x 2^n).
    local_ack_timeout, set_local_ack_timeout: bits(43, 3, 5);
});

// Flow label and packet rate share the 32-bit word at 36: the label is its
// top 20 bits.
impl<T: AsRef<[u8]>> CmPathPacket<T> {
    /// Flow label (20 bits; becomes the UDP source port on RoCEv2).
    pub fn flow_label(&self) -> u32 {
        crate::field::read_u32(&self.buffer.as_ref()[36..]) >> 12
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CmPathPacket<T> {
    /// Sets the flow label; only the low 20 bits are used.
    pub fn set_flow_label(&mut self, value: u32) {
        let b = self.buffer.as_mut();
        let old = crate::field::read_u32(&b[36..]);
        crate::field::write_u32(&mut b[36..], ((value & 0xF_FFFF) << 12) | (old & 0xFFF));
    }
}

/// A parsed path information block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CmPathRepr {
    /// Local port LID.
    pub local_lid: u16,
    /// Remote port LID.
    pub remote_lid: u16,
    /// Local port GID.
    pub local_gid: [u8; 16],
    /// Remote port GID.
    pub remote_gid: [u8; 16],
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Static rate (6 bits).
    pub packet_rate: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Service level (4 bits).
    pub sl: u8,
    /// Subnet local.
    pub subnet_local: bool,
    /// Local ACK timeout (5 bits).
    pub local_ack_timeout: u8,
}

impl CmPathRepr {
    /// Parses a path block; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &CmPathPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            local_lid: packet.local_lid(),
            remote_lid: packet.remote_lid(),
            local_gid: packet.local_gid(),
            remote_gid: packet.remote_gid(),
            flow_label: packet.flow_label(),
            packet_rate: packet.packet_rate(),
            traffic_class: packet.traffic_class(),
            hop_limit: packet.hop_limit(),
            sl: packet.sl(),
            subnet_local: packet.subnet_local(),
            local_ack_timeout: packet.local_ack_timeout(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        PATH_LEN
    }

    /// Writes the block, reserved bits zero (including byte 43's low bits,
    /// which hold the REQ's SAP flag in the alternate path: set it after).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut CmPathPacket<T>) {
        packet.buffer.as_mut()[..PATH_LEN].fill(0);
        packet.set_local_lid(self.local_lid);
        packet.set_remote_lid(self.remote_lid);
        packet.set_local_gid(self.local_gid);
        packet.set_remote_gid(self.remote_gid);
        packet.set_flow_label(self.flow_label);
        packet.set_packet_rate(self.packet_rate);
        packet.set_traffic_class(self.traffic_class);
        packet.set_hop_limit(self.hop_limit);
        packet.set_sl(self.sl);
        packet.set_subnet_local(self.subnet_local);
        packet.set_local_ack_timeout(self.local_ack_timeout);
    }
}

// ---------------------------------------------------------------------------------------------
// REQ

header_view! {
    /// A zero-copy view of a REQ (Table 106), the data area of its MAD.
    ReqPacket, DATA_LEN
}

mod req {
    pub(super) const PRIMARY_PATH: usize = 52;
    pub(super) const ALTERNATE_PATH: usize = 96;
    pub(super) const PRIVATE_DATA: usize = 140;
}

accessors!(ReqPacket {
    /// Local communication ID (the sender's).
    local_comm_id, set_local_comm_id: u32(0);
    /// ECE vendor ID (24 bits).
    vendor_id, set_vendor_id: u24(5);
    /// Service ID.
    service_id, set_service_id: u64(8);
    /// Local CA GUID (node GUID).
    local_ca_guid, set_local_ca_guid: u64(16);
    /// Local Q_Key (unused for RC).
    local_qkey, set_local_qkey: u32(28);
    /// Local QPN (24 bits).
    local_qpn, set_local_qpn: u24(32);
    /// Responder resources offered (the sender's `max_dest_rd_atomic`).
    responder_resources, set_responder_resources: u8(35);
    /// Local EECN (24 bits).
    local_eecn, set_local_eecn: u24(36);
    /// Initiator depth (the sender's `max_rd_atomic`).
    initiator_depth, set_initiator_depth: u8(39);
    /// Remote EECN (24 bits).
    remote_eecn, set_remote_eecn: u24(40);
    /// Remote CM response timeout (5 bits).
    remote_cm_response_timeout, set_remote_cm_response_timeout: bits(43, 3, 5);
    /// Transport service type (2 bits: RC 0, UC 1, 3 = extended).
    transport_type, set_transport_type: bits(43, 1, 2);
    /// End-to-end flow control.
    e2e_flow_control, set_e2e_flow_control: flag(43, 0x01);
    /// Starting PSN (24 bits): the PSN the requester expects first, where the responder's
    /// send queue starts (Linux's `ib_cm` reading).
    starting_psn, set_starting_psn: u24(44);
    /// Local CM response timeout (5 bits).
    local_cm_response_timeout, set_local_cm_response_timeout: bits(47, 3, 5);
    /// Retry count (3 bits).
    retry_count, set_retry_count: bits(47, 0, 3);
    /// Partition key.
    pkey, set_pkey: u16(48);
    /// Path MTU (4 bits, `ibv_mtu` enum 1-5).
    path_mtu, set_path_mtu: bits(50, 4, 4);
    /// RDC exists.
    rdc_exists, set_rdc_exists: flag(50, 0x08);
    /// RNR retry count (3 bits).
    rnr_retry_count, set_rnr_retry_count: bits(50, 0, 3);
    /// Max CM retries (4 bits).
    max_cm_retries, set_max_cm_retries: bits(51, 4, 4);
    /// The requester uses an SRQ.
    srq, set_srq: flag(51, 0x08);
    /// Extended transport type (3 bits; XRC = 1).
    extended_transport_type, set_extended_transport_type: bits(51, 0, 3);
    /// Alternate path: SAP supported.
    sap_supported, set_sap_supported: flag(139, 0x04);
    /// Private data (92 bytes).
    private_data, set_private_data: bytes(req::PRIVATE_DATA, private_data_len::REQ);
});

impl<T: AsRef<[u8]>> ReqPacket<T> {
    /// The primary path block.
    pub fn primary_path(&self) -> CmPathPacket<&[u8]> {
        CmPathPacket::new_unchecked(&self.buffer.as_ref()[req::PRIMARY_PATH..req::PRIMARY_PATH + PATH_LEN])
    }

    /// The alternate path block (all zero on RoCE).
    pub fn alternate_path(&self) -> CmPathPacket<&[u8]> {
        CmPathPacket::new_unchecked(
            &self.buffer.as_ref()[req::ALTERNATE_PATH..req::ALTERNATE_PATH + PATH_LEN],
        )
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ReqPacket<T> {
    /// The primary path block, mutably.
    pub fn primary_path_mut(&mut self) -> CmPathPacket<&mut [u8]> {
        CmPathPacket::new_unchecked(
            &mut self.buffer.as_mut()[req::PRIMARY_PATH..req::PRIMARY_PATH + PATH_LEN],
        )
    }

    /// The alternate path block, mutably.
    pub fn alternate_path_mut(&mut self) -> CmPathPacket<&mut [u8]> {
        CmPathPacket::new_unchecked(
            &mut self.buffer.as_mut()[req::ALTERNATE_PATH..req::ALTERNATE_PATH + PATH_LEN],
        )
    }
}

/// A parsed REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReqRepr {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// ECE vendor ID (24 bits).
    pub vendor_id: u32,
    /// Service ID.
    pub service_id: u64,
    /// Local CA GUID.
    pub local_ca_guid: u64,
    /// Local Q_Key.
    pub local_qkey: u32,
    /// Local QPN (24 bits).
    pub local_qpn: u32,
    /// Responder resources.
    pub responder_resources: u8,
    /// Local EECN (24 bits).
    pub local_eecn: u32,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Remote EECN (24 bits).
    pub remote_eecn: u32,
    /// Remote CM response timeout (5 bits).
    pub remote_cm_response_timeout: u8,
    /// Transport service type (2 bits).
    pub transport_type: u8,
    /// End-to-end flow control.
    pub e2e_flow_control: bool,
    /// Starting PSN (24 bits).
    pub starting_psn: u32,
    /// Local CM response timeout (5 bits).
    pub local_cm_response_timeout: u8,
    /// Retry count (3 bits).
    pub retry_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// Path MTU (4 bits).
    pub path_mtu: u8,
    /// RDC exists.
    pub rdc_exists: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// Max CM retries (4 bits).
    pub max_cm_retries: u8,
    /// SRQ.
    pub srq: bool,
    /// Extended transport type (3 bits).
    pub extended_transport_type: u8,
    /// Primary path.
    pub primary_path: CmPathRepr,
    /// Alternate path.
    pub alternate_path: CmPathRepr,
    /// SAP supported.
    pub sap_supported: bool,
    /// Private data.
    pub private_data: [u8; private_data_len::REQ],
}

impl Default for ReqRepr {
    fn default() -> Self {
        Self {
            local_comm_id: 0,
            vendor_id: 0,
            service_id: 0,
            local_ca_guid: 0,
            local_qkey: 0,
            local_qpn: 0,
            responder_resources: 0,
            local_eecn: 0,
            initiator_depth: 0,
            remote_eecn: 0,
            remote_cm_response_timeout: 0,
            transport_type: 0,
            e2e_flow_control: false,
            starting_psn: 0,
            local_cm_response_timeout: 0,
            retry_count: 0,
            pkey: 0,
            path_mtu: 0,
            rdc_exists: false,
            rnr_retry_count: 0,
            max_cm_retries: 0,
            srq: false,
            extended_transport_type: 0,
            primary_path: CmPathRepr::default(),
            alternate_path: CmPathRepr::default(),
            sap_supported: false,
            private_data: [0; private_data_len::REQ],
        }
    }
}

impl ReqRepr {
    /// Parses a REQ; fails only on a short buffer (every bit pattern of
    /// the fields is representable; the CM judges the values).
    pub fn parse<T: AsRef<[u8]>>(packet: &ReqPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            local_comm_id: packet.local_comm_id(),
            vendor_id: packet.vendor_id(),
            service_id: packet.service_id(),
            local_ca_guid: packet.local_ca_guid(),
            local_qkey: packet.local_qkey(),
            local_qpn: packet.local_qpn(),
            responder_resources: packet.responder_resources(),
            local_eecn: packet.local_eecn(),
            initiator_depth: packet.initiator_depth(),
            remote_eecn: packet.remote_eecn(),
            remote_cm_response_timeout: packet.remote_cm_response_timeout(),
            transport_type: packet.transport_type(),
            e2e_flow_control: packet.e2e_flow_control(),
            starting_psn: packet.starting_psn(),
            local_cm_response_timeout: packet.local_cm_response_timeout(),
            retry_count: packet.retry_count(),
            pkey: packet.pkey(),
            path_mtu: packet.path_mtu(),
            rdc_exists: packet.rdc_exists(),
            rnr_retry_count: packet.rnr_retry_count(),
            max_cm_retries: packet.max_cm_retries(),
            srq: packet.srq(),
            extended_transport_type: packet.extended_transport_type(),
            primary_path: CmPathRepr::parse(&packet.primary_path())?,
            alternate_path: CmPathRepr::parse(&packet.alternate_path())?,
            sap_supported: packet.sap_supported(),
            private_data: array(packet.private_data()),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        DATA_LEN
    }

    /// Writes the message; reserved bits are zero.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut ReqPacket<T>) {
        packet.buffer.as_mut()[..DATA_LEN].fill(0);
        packet.set_local_comm_id(self.local_comm_id);
        packet.set_vendor_id(self.vendor_id);
        packet.set_service_id(self.service_id);
        packet.set_local_ca_guid(self.local_ca_guid);
        packet.set_local_qkey(self.local_qkey);
        packet.set_local_qpn(self.local_qpn);
        packet.set_responder_resources(self.responder_resources);
        packet.set_local_eecn(self.local_eecn);
        packet.set_initiator_depth(self.initiator_depth);
        packet.set_remote_eecn(self.remote_eecn);
        packet.set_remote_cm_response_timeout(self.remote_cm_response_timeout);
        packet.set_transport_type(self.transport_type);
        packet.set_e2e_flow_control(self.e2e_flow_control);
        packet.set_starting_psn(self.starting_psn);
        packet.set_local_cm_response_timeout(self.local_cm_response_timeout);
        packet.set_retry_count(self.retry_count);
        packet.set_pkey(self.pkey);
        packet.set_path_mtu(self.path_mtu);
        packet.set_rdc_exists(self.rdc_exists);
        packet.set_rnr_retry_count(self.rnr_retry_count);
        packet.set_max_cm_retries(self.max_cm_retries);
        packet.set_srq(self.srq);
        packet.set_extended_transport_type(self.extended_transport_type);
        self.primary_path.emit(&mut packet.primary_path_mut());
        self.alternate_path.emit(&mut packet.alternate_path_mut());
        packet.set_sap_supported(self.sap_supported);
        packet.set_private_data(&self.private_data);
    }
}

// ---------------------------------------------------------------------------------------------
// MRA

/// Which message an MRA or REJ refers to (2 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MessageKind {
    /// A REQ.
    #[default]
    Req,
    /// A REP.
    Rep,
    /// Another message (LAP for an MRA; for a REJ, the REJ stands alone).
    Other,
}

impl MessageKind {
    fn from_bits(bits: u8) -> Result<Self> {
        match bits {
            0 => Ok(Self::Req),
            1 => Ok(Self::Rep),
            2 => Ok(Self::Other),
            _ => Err(Error),
        }
    }

    /// The 2-bit wire value.
    pub const fn bits(self) -> u8 {
        match self {
            Self::Req => 0,
            Self::Rep => 1,
            Self::Other => 2,
        }
    }
}

header_view! {
    /// A zero-copy view of an MRA (Table 107).
    MraPacket, DATA_LEN
}

accessors!(MraPacket {
    /// Local communication ID.
    local_comm_id, set_local_comm_id: u32(0);
    /// Remote communication ID.
    remote_comm_id, set_remote_comm_id: u32(4);
    /// Message MRAed (2 bits).
    message_mraed, set_message_mraed: bits(8, 6, 2);
    /// Service timeout (5 bits).
    service_timeout, set_service_timeout: bits(9, 3, 5);
    /// Private data (222 bytes).
    private_data, set_private_data: bytes(10, private_data_len::MRA);
});

/// A parsed MRA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MraRepr {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// The message acknowledged.
    pub message_mraed: MessageKind,
    /// Service timeout (5 bits).
    pub service_timeout: u8,
    /// Private data.
    pub private_data: [u8; private_data_len::MRA],
}

impl MraRepr {
    /// Parses an MRA; fails on a short buffer or message value 3.
    pub fn parse<T: AsRef<[u8]>>(packet: &MraPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            local_comm_id: packet.local_comm_id(),
            remote_comm_id: packet.remote_comm_id(),
            message_mraed: MessageKind::from_bits(packet.message_mraed())?,
            service_timeout: packet.service_timeout(),
            private_data: array(packet.private_data()),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        DATA_LEN
    }

    /// Writes the message; reserved bits are zero.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut MraPacket<T>) {
        packet.buffer.as_mut()[..DATA_LEN].fill(0);
        packet.set_local_comm_id(self.local_comm_id);
        packet.set_remote_comm_id(self.remote_comm_id);
        packet.set_message_mraed(self.message_mraed.bits());
        packet.set_service_timeout(self.service_timeout);
        packet.set_private_data(&self.private_data);
    }
}

// ---------------------------------------------------------------------------------------------
// REJ

header_view! {
    /// A zero-copy view of a REJ (Table 108).
    RejPacket, DATA_LEN
}

accessors!(RejPacket {
    /// Local communication ID (0 when rejecting a message of an unknown connection).
    local_comm_id, set_local_comm_id: u32(0);
    /// Remote communication ID.
    remote_comm_id, set_remote_comm_id: u32(4);
    /// Message rejected (2 bits).
    message_rejected, set_message_rejected: bits(8, 6, 2);
    /// Length of the additional rejection information (7 bits).
    ari_length, set_ari_length: bits(9, 1, 7);
    /// Reason (see [`rej_reason`]).
    reason, set_reason: u16(10);
    /// Additional rejection information (72 bytes).
    ari, set_ari: bytes(12, ARI_LEN);
    /// Private data (148 bytes).
    private_data, set_private_data: bytes(84, private_data_len::REJ);
});

/// A parsed REJ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RejRepr {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// The message rejected.
    pub message_rejected: MessageKind,
    /// ARI length (at most 72).
    pub ari_length: u8,
    /// Reason.
    pub reason: u16,
    /// Additional rejection information.
    pub ari: [u8; ARI_LEN],
    /// Private data.
    pub private_data: [u8; private_data_len::REJ],
}

impl RejRepr {
    /// Parses a REJ; fails on a short buffer, message value 3 or an ARI
    /// length above 72.
    pub fn parse<T: AsRef<[u8]>>(packet: &RejPacket<T>) -> Result<Self> {
        packet.check_len()?;
        let ari_length = packet.ari_length();
        if usize::from(ari_length) > ARI_LEN {
            return Err(Error);
        }
        Ok(Self {
            local_comm_id: packet.local_comm_id(),
            remote_comm_id: packet.remote_comm_id(),
            message_rejected: MessageKind::from_bits(packet.message_rejected())?,
            ari_length,
            reason: packet.reason(),
            ari: array(packet.ari()),
            private_data: array(packet.private_data()),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        DATA_LEN
    }

    /// Writes the message; reserved bits are zero.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut RejPacket<T>) {
        packet.buffer.as_mut()[..DATA_LEN].fill(0);
        packet.set_local_comm_id(self.local_comm_id);
        packet.set_remote_comm_id(self.remote_comm_id);
        packet.set_message_rejected(self.message_rejected.bits());
        packet.set_ari_length(self.ari_length);
        packet.set_reason(self.reason);
        packet.set_ari(&self.ari);
        packet.set_private_data(&self.private_data);
    }
}

// ---------------------------------------------------------------------------------------------
// REP

header_view! {
    /// A zero-copy view of a REP (Table 110).
    RepPacket, DATA_LEN
}

accessors!(RepPacket {
    /// Local communication ID (the responder's).
    local_comm_id, set_local_comm_id: u32(0);
    /// Remote communication ID (the REQ's local one).
    remote_comm_id, set_remote_comm_id: u32(4);
    /// Local Q_Key.
    local_qkey, set_local_qkey: u32(8);
    /// Local QPN (24 bits).
    local_qpn, set_local_qpn: u24(12);
    /// ECE vendor ID, high byte.
    vendor_id_h, set_vendor_id_h: u8(15);
    /// Local EECN (24 bits; an XRC target's QPN).
    local_eecn, set_local_eecn: u24(16);
    /// ECE vendor ID, middle byte.
    vendor_id_m, set_vendor_id_m: u8(19);
    /// Starting PSN (24 bits): the PSN the responder expects first, where the requester's
    /// send queue starts.
    starting_psn, set_starting_psn: u24(20);
    /// ECE vendor ID, low byte.
    vendor_id_l, set_vendor_id_l: u8(23);
    /// Responder resources.
    responder_resources, set_responder_resources: u8(24);
    /// Initiator depth.
    initiator_depth, set_initiator_depth: u8(25);
    /// Target ACK delay (5 bits).
    target_ack_delay, set_target_ack_delay: bits(26, 3, 5);
    /// Failover accepted (2 bits).
    failover_accepted, set_failover_accepted: bits(26, 1, 2);
    /// End-to-end flow control.
    e2e_flow_control, set_e2e_flow_control: flag(26, 0x01);
    /// RNR retry count (3 bits).
    rnr_retry_count, set_rnr_retry_count: bits(27, 5, 3);
    /// SRQ.
    srq, set_srq: flag(27, 0x10);
    /// Local CA GUID.
    local_ca_guid, set_local_ca_guid: u64(28);
    /// Private data (196 bytes).
    private_data, set_private_data: bytes(36, private_data_len::REP);
});

/// A parsed REP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RepRepr {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// Local Q_Key.
    pub local_qkey: u32,
    /// Local QPN (24 bits).
    pub local_qpn: u32,
    /// Local EECN (24 bits).
    pub local_eecn: u32,
    /// Starting PSN (24 bits).
    pub starting_psn: u32,
    /// ECE vendor ID (24 bits, split over three bytes on the wire).
    pub vendor_id: u32,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Target ACK delay (5 bits).
    pub target_ack_delay: u8,
    /// Failover accepted (2 bits).
    pub failover_accepted: u8,
    /// End-to-end flow control.
    pub e2e_flow_control: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// SRQ.
    pub srq: bool,
    /// Local CA GUID.
    pub local_ca_guid: u64,
    /// Private data.
    pub private_data: [u8; private_data_len::REP],
}

impl Default for RepRepr {
    fn default() -> Self {
        Self {
            local_comm_id: 0,
            remote_comm_id: 0,
            local_qkey: 0,
            local_qpn: 0,
            local_eecn: 0,
            starting_psn: 0,
            vendor_id: 0,
            responder_resources: 0,
            initiator_depth: 0,
            target_ack_delay: 0,
            failover_accepted: 0,
            e2e_flow_control: false,
            rnr_retry_count: 0,
            srq: false,
            local_ca_guid: 0,
            private_data: [0; private_data_len::REP],
        }
    }
}

impl RepRepr {
    /// Parses a REP; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &RepPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            local_comm_id: packet.local_comm_id(),
            remote_comm_id: packet.remote_comm_id(),
            local_qkey: packet.local_qkey(),
            local_qpn: packet.local_qpn(),
            local_eecn: packet.local_eecn(),
            starting_psn: packet.starting_psn(),
            vendor_id: u32::from_be_bytes([
                0,
                packet.vendor_id_h(),
                packet.vendor_id_m(),
                packet.vendor_id_l(),
            ]),
            responder_resources: packet.responder_resources(),
            initiator_depth: packet.initiator_depth(),
            target_ack_delay: packet.target_ack_delay(),
            failover_accepted: packet.failover_accepted(),
            e2e_flow_control: packet.e2e_flow_control(),
            rnr_retry_count: packet.rnr_retry_count(),
            srq: packet.srq(),
            local_ca_guid: packet.local_ca_guid(),
            private_data: array(packet.private_data()),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        DATA_LEN
    }

    /// Writes the message; reserved bits are zero.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut RepPacket<T>) {
        packet.buffer.as_mut()[..DATA_LEN].fill(0);
        let [_, h, m, l] = self.vendor_id.to_be_bytes();
        packet.set_local_comm_id(self.local_comm_id);
        packet.set_remote_comm_id(self.remote_comm_id);
        packet.set_local_qkey(self.local_qkey);
        packet.set_local_qpn(self.local_qpn);
        packet.set_vendor_id_h(h);
        packet.set_local_eecn(self.local_eecn);
        packet.set_vendor_id_m(m);
        packet.set_starting_psn(self.starting_psn);
        packet.set_vendor_id_l(l);
        packet.set_responder_resources(self.responder_resources);
        packet.set_initiator_depth(self.initiator_depth);
        packet.set_target_ack_delay(self.target_ack_delay);
        packet.set_failover_accepted(self.failover_accepted);
        packet.set_e2e_flow_control(self.e2e_flow_control);
        packet.set_rnr_retry_count(self.rnr_retry_count);
        packet.set_srq(self.srq);
        packet.set_local_ca_guid(self.local_ca_guid);
        packet.set_private_data(&self.private_data);
    }
}

// ---------------------------------------------------------------------------------------------
// RTU, DREQ, DREP

header_view! {
    /// A zero-copy view of an RTU (Table 111).
    RtuPacket, DATA_LEN
}

accessors!(RtuPacket {
    /// Local communication ID.
    local_comm_id, set_local_comm_id: u32(0);
    /// Remote communication ID.
    remote_comm_id, set_remote_comm_id: u32(4);
    /// Private data (224 bytes).
    private_data, set_private_data: bytes(8, private_data_len::RTU);
});

/// A parsed RTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RtuRepr {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// Private data.
    pub private_data: [u8; private_data_len::RTU],
}

impl RtuRepr {
    /// Parses an RTU; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &RtuPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            local_comm_id: packet.local_comm_id(),
            remote_comm_id: packet.remote_comm_id(),
            private_data: array(packet.private_data()),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        DATA_LEN
    }

    /// Writes the message.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut RtuPacket<T>) {
        packet.set_local_comm_id(self.local_comm_id);
        packet.set_remote_comm_id(self.remote_comm_id);
        packet.set_private_data(&self.private_data);
    }
}

header_view! {
    /// A zero-copy view of a DREQ (Table 112).
    DreqPacket, DATA_LEN
}

accessors!(DreqPacket {
    /// Local communication ID.
    local_comm_id, set_local_comm_id: u32(0);
    /// Remote communication ID.
    remote_comm_id, set_remote_comm_id: u32(4);
    /// Remote QPN or EECN (24 bits).
    remote_qpn, set_remote_qpn: u24(8);
    /// Private data (220 bytes).
    private_data, set_private_data: bytes(12, private_data_len::DREQ);
});

/// A parsed DREQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DreqRepr {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// Remote QPN (24 bits).
    pub remote_qpn: u32,
    /// Private data.
    pub private_data: [u8; private_data_len::DREQ],
}

impl DreqRepr {
    /// Parses a DREQ; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &DreqPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            local_comm_id: packet.local_comm_id(),
            remote_comm_id: packet.remote_comm_id(),
            remote_qpn: packet.remote_qpn(),
            private_data: array(packet.private_data()),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        DATA_LEN
    }

    /// Writes the message; the reserved byte is zero.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut DreqPacket<T>) {
        packet.set_local_comm_id(self.local_comm_id);
        packet.set_remote_comm_id(self.remote_comm_id);
        packet.set_remote_qpn(self.remote_qpn);
        packet.buffer.as_mut()[11] = 0;
        packet.set_private_data(&self.private_data);
    }
}

header_view! {
    /// A zero-copy view of a DREP (Table 113).
    DrepPacket, DATA_LEN
}

accessors!(DrepPacket {
    /// Local communication ID.
    local_comm_id, set_local_comm_id: u32(0);
    /// Remote communication ID.
    remote_comm_id, set_remote_comm_id: u32(4);
    /// Private data (224 bytes).
    private_data, set_private_data: bytes(8, private_data_len::DREP);
});

/// A parsed DREP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DrepRepr {
    /// Local communication ID.
    pub local_comm_id: u32,
    /// Remote communication ID.
    pub remote_comm_id: u32,
    /// Private data.
    pub private_data: [u8; private_data_len::DREP],
}

impl DrepRepr {
    /// Parses a DREP; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &DrepPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            local_comm_id: packet.local_comm_id(),
            remote_comm_id: packet.remote_comm_id(),
            private_data: array(packet.private_data()),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        DATA_LEN
    }

    /// Writes the message.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut DrepPacket<T>) {
        packet.set_local_comm_id(self.local_comm_id);
        packet.set_remote_comm_id(self.remote_comm_id);
        packet.set_private_data(&self.private_data);
    }
}

// ---------------------------------------------------------------------------------------------
// SIDR

header_view! {
    /// A zero-copy view of a SIDR_REQ (Table 119).
    SidrReqPacket, DATA_LEN
}

accessors!(SidrReqPacket {
    /// Request ID.
    request_id, set_request_id: u32(0);
    /// Partition key.
    pkey, set_pkey: u16(4);
    /// Service ID.
    service_id, set_service_id: u64(8);
    /// Private data (216 bytes).
    private_data, set_private_data: bytes(16, private_data_len::SIDR_REQ);
});

/// A parsed SIDR_REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SidrReqRepr {
    /// Request ID.
    pub request_id: u32,
    /// Partition key.
    pub pkey: u16,
    /// Service ID.
    pub service_id: u64,
    /// Private data.
    pub private_data: [u8; private_data_len::SIDR_REQ],
}

impl SidrReqRepr {
    /// Parses a SIDR_REQ; fails only on a short buffer.
    pub fn parse<T: AsRef<[u8]>>(packet: &SidrReqPacket<T>) -> Result<Self> {
        packet.check_len()?;
        Ok(Self {
            request_id: packet.request_id(),
            pkey: packet.pkey(),
            service_id: packet.service_id(),
            private_data: array(packet.private_data()),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        DATA_LEN
    }

    /// Writes the message; the reserved word is zero.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut SidrReqPacket<T>) {
        packet.set_request_id(self.request_id);
        packet.set_pkey(self.pkey);
        packet.buffer.as_mut()[6..8].fill(0);
        packet.set_service_id(self.service_id);
        packet.set_private_data(&self.private_data);
    }
}

header_view! {
    /// A zero-copy view of a SIDR_REP (Table 120).
    SidrRepPacket, DATA_LEN
}

accessors!(SidrRepPacket {
    /// Request ID (the SIDR_REQ's).
    request_id, set_request_id: u32(0);
    /// Status (see [`sidr_status`]).
    status, set_status: u8(4);
    /// Additional information length.
    info_length, set_info_length: u8(5);
    /// ECE vendor ID, high 16 bits.
    vendor_id_h, set_vendor_id_h: u16(6);
    /// QPN (24 bits).
    qpn, set_qpn: u24(8);
    /// ECE vendor ID, low byte.
    vendor_id_l, set_vendor_id_l: u8(11);
    /// Service ID.
    service_id, set_service_id: u64(12);
    /// Q_Key.
    qkey, set_qkey: u32(20);
    /// Additional information (72 bytes).
    info, set_info: bytes(24, ARI_LEN);
    /// Private data (136 bytes).
    private_data, set_private_data: bytes(96, private_data_len::SIDR_REP);
});

/// A parsed SIDR_REP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SidrRepRepr {
    /// Request ID.
    pub request_id: u32,
    /// Status.
    pub status: u8,
    /// Additional information length (at most 72).
    pub info_length: u8,
    /// ECE vendor ID (24 bits).
    pub vendor_id: u32,
    /// QPN (24 bits).
    pub qpn: u32,
    /// Service ID.
    pub service_id: u64,
    /// Q_Key.
    pub qkey: u32,
    /// Additional information.
    pub info: [u8; ARI_LEN],
    /// Private data.
    pub private_data: [u8; private_data_len::SIDR_REP],
}

impl SidrRepRepr {
    /// Parses a SIDR_REP; fails on a short buffer or an information
    /// length above 72.
    pub fn parse<T: AsRef<[u8]>>(packet: &SidrRepPacket<T>) -> Result<Self> {
        packet.check_len()?;
        let info_length = packet.info_length();
        if usize::from(info_length) > ARI_LEN {
            return Err(Error);
        }
        let [_, _, h, m] = u32::from(packet.vendor_id_h()).to_be_bytes();
        Ok(Self {
            request_id: packet.request_id(),
            status: packet.status(),
            info_length,
            vendor_id: u32::from_be_bytes([0, h, m, packet.vendor_id_l()]),
            qpn: packet.qpn(),
            service_id: packet.service_id(),
            qkey: packet.qkey(),
            info: array(packet.info()),
            private_data: array(packet.private_data()),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        DATA_LEN
    }

    /// Writes the message.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut SidrRepPacket<T>) {
        let [_, h, m, l] = self.vendor_id.to_be_bytes();
        packet.set_request_id(self.request_id);
        packet.set_status(self.status);
        packet.set_info_length(self.info_length);
        packet.set_vendor_id_h(u16::from_be_bytes([h, m]));
        packet.set_qpn(self.qpn);
        packet.set_vendor_id_l(l);
        packet.set_service_id(self.service_id);
        packet.set_qkey(self.qkey);
        packet.set_info(&self.info);
        packet.set_private_data(&self.private_data);
    }
}

// ---------------------------------------------------------------------------------------------
// Whole messages

/// Any CM message this crate knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmMessage {
    /// REQ.
    Req(ReqRepr),
    /// MRA.
    Mra(MraRepr),
    /// REJ.
    Rej(RejRepr),
    /// REP.
    Rep(RepRepr),
    /// RTU.
    Rtu(RtuRepr),
    /// DREQ.
    Dreq(DreqRepr),
    /// DREP.
    Drep(DrepRepr),
    /// SIDR_REQ.
    SidrReq(SidrReqRepr),
    /// SIDR_REP.
    SidrRep(SidrRepRepr),
}

impl CmMessage {
    /// The MAD attribute ID of this message.
    pub const fn attr_id(&self) -> u16 {
        match self {
            Self::Req(_) => attr::REQ,
            Self::Mra(_) => attr::MRA,
            Self::Rej(_) => attr::REJ,
            Self::Rep(_) => attr::REP,
            Self::Rtu(_) => attr::RTU,
            Self::Dreq(_) => attr::DREQ,
            Self::Drep(_) => attr::DREP,
            Self::SidrReq(_) => attr::SIDR_REQ,
            Self::SidrRep(_) => attr::SIDR_REP,
        }
    }

    /// Parses a whole MAD (at least 256 bytes; a longer buffer, such as a
    /// receive buffer with room to spare, is read up to 256).
    ///
    /// Fails unless it is a CM class version 2 Send of a known attribute
    /// whose fields are valid.
    pub fn parse(mad: &[u8]) -> Result<(MadRepr, Self)> {
        let mad = mad.get(..MAD_LEN).ok_or(Error)?;
        let packet = MadPacket::new_checked(mad)?;
        let header = MadRepr::parse(&packet)?;
        if header.mgmt_class != MGMT_CLASS_CM
            || header.class_version != CM_CLASS_VERSION
            || header.method != METHOD_SEND
            || header.response
        {
            return Err(Error);
        }
        let data = packet.data();
        let message = match header.attr_id {
            attr::REQ => Self::Req(ReqRepr::parse(&ReqPacket::new_checked(data)?)?),
            attr::MRA => Self::Mra(MraRepr::parse(&MraPacket::new_checked(data)?)?),
            attr::REJ => Self::Rej(RejRepr::parse(&RejPacket::new_checked(data)?)?),
            attr::REP => Self::Rep(RepRepr::parse(&RepPacket::new_checked(data)?)?),
            attr::RTU => Self::Rtu(RtuRepr::parse(&RtuPacket::new_checked(data)?)?),
            attr::DREQ => Self::Dreq(DreqRepr::parse(&DreqPacket::new_checked(data)?)?),
            attr::DREP => Self::Drep(DrepRepr::parse(&DrepPacket::new_checked(data)?)?),
            attr::SIDR_REQ => Self::SidrReq(SidrReqRepr::parse(&SidrReqPacket::new_checked(data)?)?),
            attr::SIDR_REP => Self::SidrRep(SidrRepRepr::parse(&SidrRepPacket::new_checked(data)?)?),
            _ => return Err(Error),
        };
        Ok((header, message))
    }

    /// Bytes needed to emit: one MAD.
    pub const fn buffer_len(&self) -> usize {
        MAD_LEN
    }

    /// Writes the whole 256-byte MAD (CM Send header with `transaction_id`
    /// and `attr_mod`, then the message) into the start of `buf`; fails if
    /// `buf` is shorter than [`MAD_LEN`].
    pub fn emit(&self, transaction_id: u64, attr_mod: u32, buf: &mut [u8]) -> Result<()> {
        let buf = buf.get_mut(..MAD_LEN).ok_or(Error)?;
        let mut header = MadRepr::cm_send(self.attr_id(), transaction_id);
        header.attr_mod = attr_mod;
        let mut packet = MadPacket::new_unchecked(&mut *buf);
        header.emit(&mut packet);
        let data = packet.data_mut();
        match self {
            Self::Req(m) => m.emit(&mut ReqPacket::new_unchecked(data)),
            Self::Mra(m) => m.emit(&mut MraPacket::new_unchecked(data)),
            Self::Rej(m) => m.emit(&mut RejPacket::new_unchecked(data)),
            Self::Rep(m) => m.emit(&mut RepPacket::new_unchecked(data)),
            Self::Rtu(m) => m.emit(&mut RtuPacket::new_unchecked(data)),
            Self::Dreq(m) => m.emit(&mut DreqPacket::new_unchecked(data)),
            Self::Drep(m) => m.emit(&mut DrepPacket::new_unchecked(data)),
            Self::SidrReq(m) => m.emit(&mut SidrReqPacket::new_unchecked(data)),
            Self::SidrRep(m) => m.emit(&mut SidrRepPacket::new_unchecked(data)),
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// RDMA CM: service IDs and the private-data header

/// An `rdma_cm` port space (`enum rdma_port_space`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortSpace {
    /// `RDMA_PS_IPOIB`: UD.
    Ipoib,
    /// `RDMA_PS_TCP`: RC (and UC).
    Tcp,
    /// `RDMA_PS_UDP`: UD and multicast.
    Udp,
    /// `RDMA_PS_IB`: any QP type, addressed by AF_IB service IDs.
    Ib,
}

impl PortSpace {
    /// The `rdma_port_space` value.
    pub const fn value(self) -> u16 {
        match self {
            Self::Ipoib => 0x0002,
            Self::Tcp => 0x0106,
            Self::Udp => 0x0111,
            Self::Ib => 0x013F,
        }
    }

    /// The port space of an `rdma_port_space` value.
    pub const fn from_value(value: u16) -> Option<Self> {
        match value {
            0x0002 => Some(Self::Ipoib),
            0x0106 => Some(Self::Tcp),
            0x0111 => Some(Self::Udp),
            0x013F => Some(Self::Ib),
            _ => None,
        }
    }
}

/// The service ID of `port` in `ps`: `ps << 16 | port`.
pub const fn service_id(ps: PortSpace, port: u16) -> u64 {
    ((ps.value() as u64) << 16) | port as u64
}

/// The port space and port of an `rdma_cm` service ID, or `None` if it is
/// not one (a bare AF_IB service ID, say).
pub const fn service_id_parts(sid: u64) -> Option<(PortSpace, u16)> {
    if sid >> 32 != 0 {
        return None;
    }
    match PortSpace::from_value((sid >> 16) as u16) {
        Some(ps) => Some((ps, sid as u16)),
        None => None,
    }
}

/// Length of the `rdma_cm` private-data header of REQ and SIDR_REQ.
pub const CMA_HEADER_LEN: usize = 36;

header_view! {
    /// A zero-copy view of the `rdma_cm` private-data header (`cma_hdr`).
    CmaHeaderPacket, CMA_HEADER_LEN
}

accessors!(CmaHeaderPacket {
    /// CMA version (0).
    cma_version, set_cma_version: u8(0);
    /// IP version (4 bits: 4 or 6).
    ip_version, set_ip_version: bits(1, 4, 4);
    /// The active side's source port.
    port, set_port: u16(2);
    /// Source address (IPv4 in the last 4 bytes, after 12 zeros).
    src_addr, set_src_addr: gid(4);
    /// Destination address (same layout).
    dst_addr, set_dst_addr: gid(20);
});

/// A parsed `rdma_cm` private-data header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmaHeaderRepr {
    /// The active side's source port.
    pub port: u16,
    /// The active side's address.
    pub src_addr: IpAddr,
    /// The passive side's address.
    pub dst_addr: IpAddr,
}

fn cma_addr(raw: [u8; 16], v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4(Ipv4Addr::new(raw[12], raw[13], raw[14], raw[15]))
    } else {
        IpAddr::V6(Ipv6Addr::from(raw))
    }
}

fn cma_raw(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(v4) => {
            let mut raw = [0u8; 16];
            raw[12..].copy_from_slice(&v4.octets());
            raw
        }
        IpAddr::V6(v6) => v6.octets(),
    }
}

impl CmaHeaderRepr {
    /// Parses the header; fails on a short buffer, a CMA version other
    /// than 0 or an IP version other than 4 or 6.
    pub fn parse<T: AsRef<[u8]>>(packet: &CmaHeaderPacket<T>) -> Result<Self> {
        packet.check_len()?;
        if packet.cma_version() != 0 {
            return Err(Error);
        }
        let v4 = match packet.ip_version() {
            4 => true,
            6 => false,
            _ => return Err(Error),
        };
        Ok(Self {
            port: packet.port(),
            src_addr: cma_addr(packet.src_addr(), v4),
            dst_addr: cma_addr(packet.dst_addr(), v4),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        CMA_HEADER_LEN
    }

    /// Writes the header. The IP version is taken from `src_addr`; both
    /// addresses must be of the same family (an IPv4 `dst_addr` next to an
    /// IPv6 `src_addr` is written in the IPv4 layout all the same).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut CmaHeaderPacket<T>) {
        packet.set_cma_version(0);
        packet.buffer.as_mut()[1] = 0;
        packet.set_ip_version(if self.src_addr.is_ipv4() { 4 } else { 6 });
        packet.set_port(self.port);
        packet.set_src_addr(cma_raw(self.src_addr));
        packet.set_dst_addr(cma_raw(self.dst_addr));
    }
}

#[cfg(test)]
mod tests;
