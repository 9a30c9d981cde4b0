//! The verbs vocabulary, with the numeric values of `<infiniband/verbs.h>` so that the C ABI can
//! convert without tables of its own.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use bitflags::bitflags;

use crate::error::{Error, Result};

/// Declares a C-style enum with a checked conversion from its raw value.
macro_rules! c_enum {
    ($(#[$m:meta])* $name:ident : $repr:ty { $($(#[$vm:meta])* $v:ident = $n:expr),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr($repr)]
        pub enum $name { $($(#[$vm])* $v = $n),+ }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$v),+];

            /// Converts a raw C value, or `None` if it names no variant.
            pub fn from_raw(raw: $repr) -> Option<Self> {
                match raw { $($n => Some(Self::$v),)+ _ => None }
            }

            /// The raw C value.
            pub fn raw(self) -> $repr { self as $repr }
        }
    };
}

c_enum! {
    /// `enum ibv_qp_type`: the transport service of a QP.
    QpType: u32 {
        /// Reliable connected.
        Rc = 2,
        /// Unreliable connected.
        Uc = 3,
        /// Unreliable datagram.
        Ud = 4,
        /// Raw Ethernet frames (`IBV_QPT_RAW_PACKET`).
        RawPacket = 8,
        /// XRC initiator (`IBV_QPT_XRC_SEND`): sends to XRC SRQs of a peer, receives nothing.
        XrcSend = 9,
        /// XRC target (`IBV_QPT_XRC_RECV`): executes requests for the SRQs of its XRC domain;
        /// it has no PD, CQs or work queues of its own.
        XrcRecv = 10,
    }
}

impl QpType {
    /// Reliable: RC or either XRC half (ACKs, retries, READ and atomics).
    pub fn is_reliable(self) -> bool {
        matches!(self, Self::Rc | Self::XrcSend | Self::XrcRecv)
    }

    /// Either XRC half.
    pub fn is_xrc(self) -> bool {
        matches!(self, Self::XrcSend | Self::XrcRecv)
    }
}

c_enum! {
    /// `enum ibv_qp_state`.
    QpState: u32 {
        /// Reset: no traffic, queues empty.
        Reset = 0,
        /// Initialised: receives may be posted.
        Init = 1,
        /// Ready to receive.
        Rtr = 2,
        /// Ready to send.
        Rts = 3,
        /// Send queue drain.
        Sqd = 4,
        /// Send queue error (UC/UD only).
        Sqe = 5,
        /// Error: everything is flushed.
        Err = 6,
    }
}

impl QpState {
    /// The state's name as the IBTA writes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Reset => "RESET",
            Self::Init => "INIT",
            Self::Rtr => "RTR",
            Self::Rts => "RTS",
            Self::Sqd => "SQD",
            Self::Sqe => "SQE",
            Self::Err => "ERR",
        }
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for QpType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Rc => "RC",
            Self::Uc => "UC",
            Self::Ud => "UD",
            Self::RawPacket => "RAW_PACKET",
            Self::XrcSend => "XRC_SEND",
            Self::XrcRecv => "XRC_RECV",
        })
    }
}

c_enum! {
    /// `enum ibv_mtu`: an InfiniBand path MTU.
    Mtu: u32 {
        /// 256 bytes.
        Mtu256 = 1,
        /// 512 bytes.
        Mtu512 = 2,
        /// 1024 bytes.
        Mtu1024 = 3,
        /// 2048 bytes.
        Mtu2048 = 4,
        /// 4096 bytes.
        Mtu4096 = 5,
    }
}

impl Mtu {
    /// Payload bytes per packet.
    pub fn bytes(self) -> u32 {
        128 << self.raw()
    }

    /// The largest IB MTU not above `bytes`, if any.
    pub fn largest_within(bytes: u32) -> Option<Self> {
        Self::ALL.iter().rev().copied().find(|m| m.bytes() <= bytes)
    }
}

c_enum! {
    /// `enum ibv_port_state`.
    PortState: u32 {
        /// No state change.
        Nop = 0,
        /// Link down.
        Down = 1,
        /// Link up, not yet configured.
        Init = 2,
        /// Configured, not yet active.
        Armed = 3,
        /// Active.
        Active = 4,
        /// Active, deferred.
        ActiveDefer = 5,
    }
}

c_enum! {
    /// `enum ibv_node_type`.
    NodeType: i32 {
        /// Channel adapter.
        Ca = 1,
    }
}

c_enum! {
    /// `enum ibv_transport_type`.
    TransportType: i32 {
        /// InfiniBand transport (RoCE devices report this too).
        Ib = 0,
    }
}

c_enum! {
    /// `enum ibv_atomic_cap`.
    AtomicCap: u32 {
        /// No atomics.
        None = 0,
        /// Atomic with respect to this device.
        Hca = 1,
        /// Atomic with respect to the whole system.
        Glob = 2,
    }
}

c_enum! {
    /// `enum ibv_mig_state`.
    MigState: u32 {
        /// Migrated (the only state without alternate paths).
        Migrated = 0,
        /// Rearm.
        Rearm = 1,
        /// Armed.
        Armed = 2,
    }
}

/// `IBV_LINK_LAYER_ETHERNET`.
pub const LINK_LAYER_ETHERNET: u8 = 2;
/// `IBV_GID_TYPE_ROCE_V2` as `ibv_query_gid_type` reports it.
pub const GID_TYPE_ROCE_V2: u32 = 2;

bitflags! {
    /// `enum ibv_access_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct AccessFlags: u32 {
        /// Local write.
        const LOCAL_WRITE = 1;
        /// Remote RDMA write.
        const REMOTE_WRITE = 1 << 1;
        /// Remote RDMA read.
        const REMOTE_READ = 1 << 2;
        /// Remote atomics.
        const REMOTE_ATOMIC = 1 << 3;
        /// Memory-window binding.
        const MW_BIND = 1 << 4;
        /// Zero-based addressing.
        const ZERO_BASED = 1 << 5;
        /// On-demand paging.
        const ON_DEMAND = 1 << 6;
        /// Huge pages hint.
        const HUGETLB = 1 << 7;
        /// Remote FLUSH with the global-visibility placement type.
        const FLUSH_GLOBAL = 1 << 8;
        /// Remote FLUSH with the persistence placement type.
        const FLUSH_PERSISTENT = 1 << 9;
        /// Relaxed ordering (an optional flag: devices may ignore it).
        const RELAXED_ORDERING = 1 << 20;
    }
}

/// `IBV_ACCESS_OPTIONAL_RANGE`: bits a device may ignore rather than reject.
pub const ACCESS_OPTIONAL_RANGE: u32 = 0x3ff0_0000;

bitflags! {
    /// `enum ibv_qp_attr_mask`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct QpAttrMask: u32 {
        /// `qp_state`.
        const STATE = 1;
        /// `cur_qp_state`.
        const CUR_STATE = 1 << 1;
        /// `en_sqd_async_notify`.
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        /// `qp_access_flags`.
        const ACCESS_FLAGS = 1 << 3;
        /// `pkey_index`.
        const PKEY_INDEX = 1 << 4;
        /// `port_num`.
        const PORT = 1 << 5;
        /// `qkey`.
        const QKEY = 1 << 6;
        /// `ah_attr`.
        const AV = 1 << 7;
        /// `path_mtu`.
        const PATH_MTU = 1 << 8;
        /// `timeout`.
        const TIMEOUT = 1 << 9;
        /// `retry_cnt`.
        const RETRY_CNT = 1 << 10;
        /// `rnr_retry`.
        const RNR_RETRY = 1 << 11;
        /// `rq_psn`.
        const RQ_PSN = 1 << 12;
        /// `max_rd_atomic`.
        const MAX_QP_RD_ATOMIC = 1 << 13;
        /// The alternate path.
        const ALT_PATH = 1 << 14;
        /// `min_rnr_timer`.
        const MIN_RNR_TIMER = 1 << 15;
        /// `sq_psn`.
        const SQ_PSN = 1 << 16;
        /// `max_dest_rd_atomic`.
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        /// `path_mig_state`.
        const PATH_MIG_STATE = 1 << 18;
        /// `cap`.
        const CAP = 1 << 19;
        /// `dest_qp_num`.
        const DEST_QPN = 1 << 20;
        /// `rate_limit`.
        const RATE_LIMIT = 1 << 25;
    }
}

impl QpAttrMask {
    /// The C names of the attributes in this mask, e.g. `IBV_QP_AV|IBV_QP_PATH_MTU`.
    pub fn names(self) -> String {
        let names: Vec<String> = self.iter_names().map(|(n, _)| format!("IBV_QP_{n}")).collect();
        let unknown = self.bits() & !Self::all().bits();
        let mut s = names.join("|");
        if unknown != 0 {
            if !s.is_empty() {
                s.push('|');
            }
            s.push_str(&format!("{unknown:#x}"));
        }
        s
    }
}

bitflags! {
    /// `enum ibv_srq_attr_mask`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SrqAttrMask: u32 {
        /// Resize the SRQ.
        const MAX_WR = 1;
        /// Set (arm) the limit.
        const LIMIT = 1 << 1;
    }
}

bitflags! {
    /// `enum ibv_wc_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct WcFlags: u32 {
        /// The first 40 bytes of the buffer hold a network header.
        const GRH = 1;
        /// `imm_data` is valid.
        const WITH_IMM = 1 << 1;
        /// IP checksum verified.
        const IP_CSUM_OK = 1 << 2;
        /// `invalidated_rkey` is valid.
        const WITH_INV = 1 << 3;
        /// Tag matching: software must report its unexpected-message count (`IBV_WR_TAG_SYNC`).
        const TM_SYNC_REQ = 1 << 4;
        /// Tag matching: the message matched a posted tag.
        const TM_MATCH = 1 << 5;
        /// Tag matching: all data of the matched message is in memory.
        const TM_DATA_VALID = 1 << 6;
    }
}

bitflags! {
    /// `enum ibv_send_flags`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        /// Wait for earlier READ/atomic operations.
        const FENCE = 1;
        /// Generate a completion.
        const SIGNALED = 1 << 1;
        /// Set the solicited-event bit.
        const SOLICITED = 1 << 2;
        /// Copy the data into the WQE.
        const INLINE = 1 << 3;
        /// Offload IP checksum (raw packet QPs).
        const IP_CSUM = 1 << 4;
    }
}

c_enum! {
    /// `enum ibv_wc_status`.
    WcStatus: u32 {
        /// Success.
        Success = 0,
        /// Local length error.
        LocLenErr = 1,
        /// Local QP operation error.
        LocQpOpErr = 2,
        /// Local EE context operation error.
        LocEecOpErr = 3,
        /// Local protection error.
        LocProtErr = 4,
        /// Flushed.
        WrFlushErr = 5,
        /// Memory-window bind error.
        MwBindErr = 6,
        /// Bad response.
        BadRespErr = 7,
        /// Local access error.
        LocAccessErr = 8,
        /// Remote invalid request.
        RemInvReqErr = 9,
        /// Remote access error.
        RemAccessErr = 10,
        /// Remote operational error.
        RemOpErr = 11,
        /// Transport retry counter exceeded.
        RetryExcErr = 12,
        /// RNR retry counter exceeded.
        RnrRetryExcErr = 13,
        /// Local RDD violation.
        LocRddViolErr = 14,
        /// Remote invalid RD request.
        RemInvRdReqErr = 15,
        /// Remote aborted.
        RemAbortErr = 16,
        /// Invalid EE context number.
        InvEecnErr = 17,
        /// Invalid EE context state.
        InvEecStateErr = 18,
        /// Fatal error.
        FatalErr = 19,
        /// Response timeout.
        RespTimeoutErr = 20,
        /// General error.
        GeneralErr = 21,
        /// Tag-matching list operation failed (the tag was consumed meanwhile).
        TmErr = 22,
        /// A matched rendezvous request was left to software (`IBV_WC_TM_RNDV_INCOMPLETE`).
        TmRndvIncomplete = 23,
    }
}

impl WcStatus {
    /// The text `ibv_wc_status_str` gives.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::LocLenErr => "local length error",
            Self::LocQpOpErr => "local QP operation error",
            Self::LocEecOpErr => "local EE context operation error",
            Self::LocProtErr => "local protection error",
            Self::WrFlushErr => "Work Request Flushed Error",
            Self::MwBindErr => "memory management operation error",
            Self::BadRespErr => "bad response error",
            Self::LocAccessErr => "local access error",
            Self::RemInvReqErr => "remote invalid request error",
            Self::RemAccessErr => "remote access error",
            Self::RemOpErr => "remote operation error",
            Self::RetryExcErr => "transport retry counter exceeded",
            Self::RnrRetryExcErr => "RNR retry counter exceeded",
            Self::LocRddViolErr => "local RDD violation error",
            Self::RemInvRdReqErr => "remote invalid RD request",
            Self::RemAbortErr => "aborted error",
            Self::InvEecnErr => "invalid EE context number",
            Self::InvEecStateErr => "invalid EE context state",
            Self::FatalErr => "fatal error",
            Self::RespTimeoutErr => "response timeout error",
            Self::GeneralErr => "general error",
            Self::TmErr => "TM error",
            Self::TmRndvIncomplete => "TM software rendezvous",
        }
    }
}

c_enum! {
    /// `enum ibv_wc_opcode`.
    WcOpcode: u32 {
        /// Send.
        Send = 0,
        /// RDMA write.
        RdmaWrite = 1,
        /// RDMA read.
        RdmaRead = 2,
        /// Compare and swap.
        CompSwap = 3,
        /// Fetch and add.
        FetchAdd = 4,
        /// Memory-window bind.
        BindMw = 5,
        /// Local invalidate.
        LocalInv = 6,
        /// TCP segmentation offload send.
        Tso = 7,
        /// FLUSH (memory-placement extension).
        Flush = 8,
        /// ATOMIC WRITE (memory-placement extension).
        AtomicWrite = 9,
        /// Receive.
        Recv = 128,
        /// Receive of an RDMA write with immediate.
        RecvRdmaWithImm = 129,
        /// Tag-matching: a tag was added.
        TmAdd = 130,
        /// Tag-matching: a tag was removed.
        TmDel = 131,
        /// Tag-matching: the unexpected-message count was synchronised.
        TmSync = 132,
        /// Tag-matching: a tagged receive (match and/or data).
        TmRecv = 133,
        /// Tag-matching: a message sent without a tag.
        TmNoTag = 134,
    }
}

c_enum! {
    /// `enum ibv_wr_opcode`.
    WrOpcode: u32 {
        /// RDMA write.
        RdmaWrite = 0,
        /// RDMA write with immediate.
        RdmaWriteWithImm = 1,
        /// Send.
        Send = 2,
        /// Send with immediate.
        SendWithImm = 3,
        /// RDMA read.
        RdmaRead = 4,
        /// Atomic compare and swap.
        AtomicCmpAndSwp = 5,
        /// Atomic fetch and add.
        AtomicFetchAndAdd = 6,
        /// Local invalidate.
        LocalInv = 7,
        /// Bind memory window.
        BindMw = 8,
        /// Send with invalidate.
        SendWithInv = 9,
        /// TCP segmentation offload (raw packet QPs).
        Tso = 10,
        /// FLUSH (memory-placement extension; no `ibv_send_wr` form).
        Flush = 14,
        /// ATOMIC WRITE (memory-placement extension; no `ibv_send_wr` form).
        AtomicWrite = 15,
    }
}

c_enum! {
    /// `enum ibv_event_type`.
    EventType: u32 {
        /// CQ overrun.
        CqErr = 0,
        /// QP moved to the error state.
        QpFatal = 1,
        /// Invalid request local work queue error.
        QpReqErr = 2,
        /// Local access violation.
        QpAccessErr = 3,
        /// Communication established.
        CommEst = 4,
        /// Send queue drained.
        SqDrained = 5,
        /// Path migrated.
        PathMig = 6,
        /// Path migration failed.
        PathMigErr = 7,
        /// Device fatal.
        DeviceFatal = 8,
        /// Port became active.
        PortActive = 9,
        /// Port went down.
        PortErr = 10,
        /// LID changed.
        LidChange = 11,
        /// P_Key table changed.
        PkeyChange = 12,
        /// SM changed.
        SmChange = 13,
        /// SRQ error.
        SrqErr = 14,
        /// SRQ limit reached.
        SrqLimitReached = 15,
        /// Last WQE reached on a QP with an SRQ.
        QpLastWqeReached = 16,
        /// Client reregister.
        ClientReregister = 17,
        /// GID table changed.
        GidChange = 18,
        /// WQ fatal.
        WqFatal = 19,
    }
}

impl EventType {
    /// The text `ibv_event_type_str` gives.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CqErr => "CQ error",
            Self::QpFatal => "local work queue catastrophic error",
            Self::QpReqErr => "invalid request local work queue error",
            Self::QpAccessErr => "local access violation work queue error",
            Self::CommEst => "communication established",
            Self::SqDrained => "send queue drained",
            Self::PathMig => "path migrated",
            Self::PathMigErr => "path migration request error",
            Self::DeviceFatal => "local catastrophic error",
            Self::PortActive => "port active",
            Self::PortErr => "port error",
            Self::LidChange => "LID change",
            Self::PkeyChange => "P_Key change",
            Self::SmChange => "SM change",
            Self::SrqErr => "SRQ catastrophic error",
            Self::SrqLimitReached => "SRQ limit reached",
            Self::QpLastWqeReached => "last WQE reached",
            Self::ClientReregister => "client reregistration",
            Self::GidChange => "GID table change",
            Self::WqFatal => "WQ fatal",
        }
    }
}

/// A 128-bit GID (`union ibv_gid`), in network byte order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The all-zero GID, which never names a usable address.
    pub const ZERO: Self = Self([0; 16]);

    /// The RoCE v2 GID of an IP address: IPv4 is mapped into `::ffff:a.b.c.d`.
    pub fn from_ip(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self(v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => Self(v6.octets()),
        }
    }

    /// The IP address this GID stands for under RoCE v2.
    pub fn to_ip(self) -> IpAddr {
        let v6 = Ipv6Addr::from(self.0);
        match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        }
    }

    /// Whether the GID is all zeros.
    pub fn is_zero(self) -> bool {
        self == Self::ZERO
    }

    /// Whether the GID is a multicast address (`ff00::/8`, or a mapped IPv4 class-D address).
    pub fn is_multicast(self) -> bool {
        match self.to_ip() {
            IpAddr::V4(v4) => v4.is_multicast(),
            IpAddr::V6(v6) => v6.is_multicast(),
        }
    }

    /// The subnet prefix (upper 64 bits) as a number.
    pub fn subnet_prefix(self) -> u64 {
        u64::from_be_bytes(self.0[..8].try_into().expect("8 bytes"))
    }

    /// The interface id (lower 64 bits) as a number.
    pub fn interface_id(self) -> u64 {
        u64::from_be_bytes(self.0[8..].try_into().expect("8 bytes"))
    }
}

impl From<Ipv4Addr> for Gid {
    fn from(ip: Ipv4Addr) -> Self {
        Self::from_ip(IpAddr::V4(ip))
    }
}

impl From<Ipv6Addr> for Gid {
    fn from(ip: Ipv6Addr) -> Self {
        Self::from_ip(IpAddr::V6(ip))
    }
}

impl fmt::Display for Gid {
    /// Formats as eight groups of four hex digits, as `ibv_devinfo` prints GIDs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// `struct ibv_global_route`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GlobalRoute {
    /// Destination GID or MGID.
    pub dgid: Gid,
    /// Flow label: 20 bits; a QP or AH keeps only those (see [`AhAttr::masked`]).
    pub flow_label: u32,
    /// Index of the source GID in the port's table.
    pub sgid_index: u8,
    /// Hop limit (IPv6) or TTL (IPv4).
    pub hop_limit: u8,
    /// Traffic class (IPv6) or TOS (IPv4).
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`: an address vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AhAttr {
    /// Global routing attributes (valid when `is_global`).
    pub grh: GlobalRoute,
    /// Destination LID (unused on RoCE).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub src_path_bits: u8,
    /// Static rate (`enum ibv_rate`).
    pub static_rate: u8,
    /// Whether `grh` is valid. RoCE needs it.
    pub is_global: bool,
    /// Port number.
    pub port_num: u8,
}

impl GlobalRoute {
    /// The flow label's width: an IPv6 flow label is 20 bits.
    pub const FLOW_LABEL_MASK: u32 = 0xF_FFFF;
}

impl AhAttr {
    /// The address vector as a QP or AH keeps it: the flow label cut to its 20 bits. The kernel
    /// passes the field through unchecked and hardware masks it, and UCX sets all 32 bits on
    /// RoCE, so wider values are accepted rather than refused.
    pub fn masked(mut self) -> Self {
        self.grh.flow_label &= GlobalRoute::FLOW_LABEL_MASK;
        self
    }
}

/// `struct ibv_qp_cap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Gather entries per send WR.
    pub max_send_sge: u32,
    /// Scatter entries per receive WR.
    pub max_recv_sge: u32,
    /// Bytes of inline data per send WR.
    pub max_inline_data: u32,
}

/// `struct ibv_qp_attr`: every attribute `ibv_modify_qp` can set and `ibv_query_qp` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    /// Next (modify) or current (query) state.
    pub qp_state: QpState,
    /// Assumed current state (modify with `IBV_QP_CUR_STATE`).
    pub cur_qp_state: QpState,
    /// Path MTU.
    pub path_mtu: Mtu,
    /// Path migration state.
    pub path_mig_state: MigState,
    /// Q_Key (UD).
    pub qkey: u32,
    /// Receive PSN (24 bits).
    pub rq_psn: u32,
    /// Send PSN (24 bits).
    pub sq_psn: u32,
    /// Destination QP number (24 bits).
    pub dest_qp_num: u32,
    /// Remote access rights.
    pub qp_access_flags: AccessFlags,
    /// Capabilities.
    pub cap: QpCap,
    /// Primary path.
    pub ah_attr: AhAttr,
    /// Alternate path.
    pub alt_ah_attr: AhAttr,
    /// P_Key index.
    pub pkey_index: u16,
    /// Alternate P_Key index.
    pub alt_pkey_index: u16,
    /// Raise `IBV_EVENT_SQ_DRAINED` when the SQD transition completes.
    pub en_sqd_async_notify: bool,
    /// Whether the send queue is still draining (query only).
    pub sq_draining: bool,
    /// Outstanding READ/atomic operations as initiator.
    pub max_rd_atomic: u8,
    /// Responder resources for READ/atomic operations.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Port number.
    pub port_num: u8,
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Transport retry count.
    pub retry_cnt: u8,
    /// RNR retry count (7 = infinite).
    pub rnr_retry: u8,
    /// Alternate port number.
    pub alt_port_num: u8,
    /// Alternate local ACK timeout.
    pub alt_timeout: u8,
    /// Rate limit in kbit/s (raw packet QPs).
    pub rate_limit: u32,
}

impl Default for QpAttr {
    fn default() -> Self {
        Self {
            qp_state: QpState::Reset,
            cur_qp_state: QpState::Reset,
            path_mtu: Mtu::Mtu256,
            path_mig_state: MigState::Migrated,
            qkey: 0,
            rq_psn: 0,
            sq_psn: 0,
            dest_qp_num: 0,
            qp_access_flags: AccessFlags::empty(),
            cap: QpCap::default(),
            ah_attr: AhAttr::default(),
            alt_ah_attr: AhAttr::default(),
            pkey_index: 0,
            alt_pkey_index: 0,
            en_sqd_async_notify: false,
            sq_draining: false,
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            port_num: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            alt_port_num: 0,
            alt_timeout: 0,
            rate_limit: 0,
        }
    }
}

/// `struct ibv_srq_attr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrqAttr {
    /// Queue depth.
    pub max_wr: u32,
    /// Scatter entries per WR.
    pub max_sge: u32,
    /// Low-watermark; 0 means not armed.
    pub srq_limit: u32,
}

/// `struct ibv_sge`: one scatter/gather element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the memory region.
    pub lkey: u32,
}

/// A receive work request as the device keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecvWr {
    /// User identifier returned in the completion.
    pub wr_id: u64,
    /// Where to scatter the data.
    pub sg_list: Vec<Sge>,
}

/// `struct ibv_wc`: a work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The completed WR's id.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Operation.
    pub opcode: WcOpcode,
    /// Vendor error syndrome.
    pub vendor_err: u32,
    /// Bytes transferred.
    pub byte_len: u32,
    /// Immediate data (network byte order) or invalidated R_Key.
    pub imm_data: u32,
    /// Local QP number.
    pub qp_num: u32,
    /// Source QP number (UD).
    pub src_qp: u32,
    /// Flags.
    pub wc_flags: WcFlags,
    /// P_Key index.
    pub pkey_index: u16,
    /// Source LID.
    pub slid: u16,
    /// Service level.
    pub sl: u8,
    /// DLID path bits.
    pub dlid_path_bits: u8,
    /// Whether the message carried the solicited-event bit (for solicited-only notification).
    pub solicited: bool,
    /// Tag-matching receives: the TMH's tag and `app_ctx` (`ibv_wc_read_tm_info`).
    pub tm_info: crate::tm::TmInfo,
    /// The tag of the flow that steered a received frame (`ibv_wc_read_flow_tag`); 0 if none.
    pub flow_tag: u32,
    /// When the completion was queued, in ticks of the device's completion clock
    /// (`ibv_wc_read_completion_ts`); 0 unless the CQ records timestamps.
    pub timestamp: u64,
    /// When the completion was queued, in wall-clock nanoseconds since the epoch
    /// (`ibv_wc_read_completion_wallclock_ns`); 0 unless the CQ records them.
    pub wallclock_ns: u64,
}

impl Default for WorkCompletion {
    fn default() -> Self {
        Self::error(0, WcStatus::Success, WcOpcode::Send, 0)
    }
}

impl WorkCompletion {
    /// A completion with only the fields valid for errors set (`wr_id`, `status`, `qp_num`).
    pub fn error(wr_id: u64, status: WcStatus, opcode: WcOpcode, qp_num: u32) -> Self {
        Self {
            wr_id,
            status,
            opcode,
            vendor_err: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num,
            src_qp: 0,
            wc_flags: WcFlags::empty(),
            pkey_index: 0,
            slid: 0,
            sl: 0,
            dlid_path_bits: 0,
            solicited: false,
            tm_info: crate::tm::TmInfo::default(),
            flow_tag: 0,
            timestamp: 0,
            wallclock_ns: 0,
        }
    }

    /// Whether a solicited-only CQ notification fires for this completion: the message carried
    /// the solicited bit, or the completion is an error (`ibv_req_notify_cq(3)`).
    pub fn is_solicited(&self) -> bool {
        self.status != WcStatus::Success || (self.solicited && self.opcode.raw() & 0x80 != 0)
    }
}

/// Checks a 24-bit field (QPN, PSN) and names it in the error.
pub fn check_u24(value: u32, name: &'static str) -> Result<u32> {
    if value > 0xFF_FFFF {
        Err(Error::invalid(format!(
            "{name} {value:#x} does not fit in 24 bits"
        )))
    } else {
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_values() {
        assert_eq!(Mtu::Mtu256.bytes(), 256);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::largest_within(1500 - 80), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::largest_within(9000 - 80), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::largest_within(100), None);
        assert_eq!(Mtu::from_raw(6), None);
    }

    #[test]
    fn gid_mapping() {
        let g = Gid::from(Ipv4Addr::new(127, 0, 0, 1));
        assert_eq!(g.to_string(), "0000:0000:0000:0000:0000:ffff:7f00:0001");
        assert_eq!(g.to_ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_eq!(
            Gid::from(Ipv6Addr::LOCALHOST).to_ip(),
            IpAddr::V6(Ipv6Addr::LOCALHOST)
        );
        assert!(Gid::from(Ipv4Addr::new(224, 0, 0, 9)).is_multicast());
        assert!(!g.is_multicast());
        assert!(Gid::ZERO.is_zero());
    }

    #[test]
    fn mask_names() {
        let m = QpAttrMask::AV | QpAttrMask::PATH_MTU;
        assert_eq!(m.names(), "IBV_QP_AV|IBV_QP_PATH_MTU");
        assert_eq!(QpAttrMask::from_bits_retain(1 << 30).names(), "0x40000000");
    }

    #[test]
    fn solicited_rule() {
        let mut wc = WorkCompletion::error(1, WcStatus::Success, WcOpcode::Recv, 5);
        assert!(!wc.is_solicited());
        wc.solicited = true;
        assert!(wc.is_solicited());
        wc.opcode = WcOpcode::Send;
        assert!(!wc.is_solicited(), "send completions are never solicited");
        wc.status = WcStatus::WrFlushErr;
        assert!(wc.is_solicited(), "error completions always are");
    }
}
