//! The InfiniBand Communication Manager (IB CM) protocol as a sans-IO state machine.
//!
//! One [`CmEngine`] serves one device port. It speaks the CM MADs of
//! [`softverbs_wire::cm`] to peers (the Linux kernel's `ib_cm` among them) and reports what
//! happens as [`CmEvent`]s in the order `rdma_cm(7)` gives them, so that an `rdma_cm` layer can
//! map each one to an `rdma_cm_event` ([`CmEvent::rdma_cm_event`]).
//!
//! # The sans-IO contract
//!
//! As with the transport engine, nothing here reads a clock or does I/O. Inputs:
//!
//! * API calls: [`listen`](CmEngine::listen), [`connect`](CmEngine::connect),
//!   [`accept`](CmEngine::accept), [`reject`](CmEngine::reject),
//!   [`establish`](CmEngine::establish), [`notify_established`](CmEngine::notify_established),
//!   [`disconnect`](CmEngine::disconnect), [`destroy`](CmEngine::destroy),
//!   [`sidr_request`](CmEngine::sidr_request), [`sidr_reply`](CmEngine::sidr_reply);
//! * received MADs with the sender's GID: [`handle_mad`](CmEngine::handle_mad);
//! * the passage of time: [`handle_timeout`](CmEngine::handle_timeout).
//!
//! After each input the driver drains [`poll_transmit`](CmEngine::poll_transmit) (MADs to send
//! from QP1 to the destination GID's QP1), [`poll_event`](CmEngine::poll_event) and
//! [`poll_timeout`](CmEngine::poll_timeout). Randomness (communication IDs, SIDR request IDs,
//! transaction IDs) comes from a generator seeded by the caller; starting PSNs are passed in.
//!
//! # Connections
//!
//! A connection is named by its local communication ID ([`CommId`]), chosen by the engine. The
//! active side calls `connect` (REQ), receives [`CmEvent::ConnectResponse`] (REP), moves its QP
//! to RTR and RTS and calls `establish` (RTU, then [`CmEvent::Established`]). The passive side
//! receives [`CmEvent::ConnectRequest`] on a listened service ID, calls `accept` (REP) or
//! `reject` (REJ) and gets [`CmEvent::Established`] on the RTU (or on `notify_established`,
//! when data arrived first). Either side's `disconnect` sends a DREQ; the peer reports
//! [`CmEvent::Disconnected`] and answers with a DREP when its application calls `disconnect` in
//! turn. Both sides then wait in timewait and report [`CmEvent::TimewaitExit`], after which the
//! connection is gone.
//!
//! # Reliability
//!
//! MADs are unreliable datagrams. REQ, REP and DREQ are resent after the CM response timeout
//! (`ms(n) = 1 << max(n - 8, 0)` milliseconds, see [`cm_timeout`]) up to `max_cm_retries`
//! times; an MRA stretches the wait to the service timeout it carries. Duplicates are answered
//! from the reply already sent (REP, MRA, RTU, REJ or DREP), never by acting twice. A REQ for a
//! service nobody listens on is rejected with reason 8, a SIDR_REQ with status 1, and a DREQ is
//! answered by a DREP even when the connection is unknown, so the peer can finish.

mod conn;

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use softverbs_wire::cm::{
    private_data_len, rej_reason, sidr_status, CmMessage, CmPathRepr, MessageKind, RejRepr, RepRepr, ReqRepr,
    SidrRepRepr, SidrReqRepr, ARI_LEN,
};
use softverbs_wire::mad::MAD_LEN;

use crate::time::Instant;
use crate::types::Gid;

use conn::{Conn, PendingSidr, Role, ServedSidr, State};

/// `-ETIMEDOUT`, the status of `RDMA_CM_EVENT_UNREACHABLE` and of a DREQ that timed out.
pub const ETIMEDOUT_STATUS: i32 = -110;

/// The CM's conversion of a 5-bit time field (4.096 us x 2^n) to a duration, as Linux does it:
/// `1 << max(n - 8, 0)` milliseconds.
pub fn cm_timeout(n: u8) -> Duration {
    Duration::from_millis(1u64 << n.saturating_sub(8).min(31))
}

/// A connection's local communication ID, the handle the API and the events use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CommId(pub u32);

/// A SIDR exchange: the request ID, and on the passive side the requester's GID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SidrId {
    /// The requester's GID (this port's own GID for requests it sent).
    pub requester: Gid,
    /// The SIDR request ID.
    pub request_id: u32,
}

/// Settings of one engine (one device port).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmConfig {
    /// This port's GID, used to tell this side's SIDR requests apart.
    pub local_gid: Gid,
    /// The device's node GUID, sent as the local CA GUID.
    pub ca_guid: u64,
    /// CM response timeout this side asks its peers to answer within (`rdma_cm`: 20).
    pub cm_response_timeout: u8,
    /// Resends of a REQ, REP, DREQ or SIDR_REQ before giving up (`rdma_cm`: 15).
    pub max_cm_retries: u8,
    /// Packet lifetime of the path (4.096 us x 2^n; RoCE: 16).
    pub packet_life_time: u8,
    /// Service timeout an MRA announces when a duplicate REQ or REP arrives before the
    /// application answered (Linux: 24, about 68.7 s).
    pub mra_service_timeout: u8,
    /// When non-zero, the top byte of every communication ID and SIDR request ID this engine
    /// chooses. Several processes of one host share a GID; the tag (a process's slot) lets a
    /// reply be routed to the process whose engine sent the request.
    pub id_tag: u8,
}

impl Default for CmConfig {
    fn default() -> Self {
        Self {
            local_gid: Gid::ZERO,
            ca_guid: 0,
            cm_response_timeout: 20,
            max_cm_retries: 15,
            packet_life_time: 16,
            mra_service_timeout: 24,
            id_tag: 0,
        }
    }
}

/// Enhanced connection establishment (ECE) values of one side, as Linux carries them: the
/// vendor ID in the REQ's or REP's vendor ID field (24 bits) and the options in the MAD
/// header's attribute modifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ece {
    /// Vendor ID (24 bits).
    pub vendor_id: u32,
    /// Vendor options (`ibv_ece.options`).
    pub options: u32,
}

/// What `connect` puts in the REQ beyond what the engine fills in itself (communication ID, CA
/// GUID, CM timeouts and retries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectParams {
    /// Service ID to connect to (see [`softverbs_wire::cm::service_id`]).
    pub service_id: u64,
    /// The local QP number.
    pub local_qpn: u32,
    /// The PSN the local QP expects first, its `rq_psn` (24 bits): the responder's send queue
    /// starts there, as Linux's CM reads a REQ's Starting PSN.
    pub starting_psn: u32,
    /// Transport service type: RC 0, UC 1, 3 with `extended_transport_type` 1 for XRC.
    pub transport_type: u8,
    /// Extended transport type (XRC = 1).
    pub extended_transport_type: u8,
    /// This side's `max_dest_rd_atomic`.
    pub responder_resources: u8,
    /// This side's `max_rd_atomic`.
    pub initiator_depth: u8,
    /// Transport retry count (3 bits).
    pub retry_count: u8,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// The QP uses an SRQ.
    pub srq: bool,
    /// End-to-end flow control (passed through).
    pub flow_control: bool,
    /// Path MTU (`ibv_mtu`, 1-5).
    pub path_mtu: u8,
    /// Partition key.
    pub pkey: u16,
    /// The primary path: GIDs (the two IPs), flow label, traffic class, hop limit, ACK timeout.
    pub path: CmPathRepr,
    /// ECE values offered.
    pub ece: Ece,
}

impl Default for ConnectParams {
    fn default() -> Self {
        Self {
            service_id: 0,
            local_qpn: 0,
            starting_psn: 0,
            transport_type: 0,
            extended_transport_type: 0,
            responder_resources: 0,
            initiator_depth: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: false,
            flow_control: false,
            path_mtu: 3,
            pkey: 0xFFFF,
            path: CmPathRepr {
                local_lid: 0xFFFF,
                remote_lid: 0xFFFF,
                hop_limit: 64,
                local_ack_timeout: 18,
                ..CmPathRepr::default()
            },
            ece: Ece::default(),
        }
    }
}

/// What `accept` puts in the REP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AcceptParams {
    /// The local QP number.
    pub local_qpn: u32,
    /// The PSN the local QP expects first, its `rq_psn` (24 bits): the requester's send queue
    /// starts there.
    pub starting_psn: u32,
    /// Local Q_Key (UD only; 0 for connected QPs).
    pub local_qkey: u32,
    /// This side's `max_dest_rd_atomic`.
    pub responder_resources: u8,
    /// This side's `max_rd_atomic`.
    pub initiator_depth: u8,
    /// Target ACK delay (5 bits).
    pub target_ack_delay: u8,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// The QP uses an SRQ.
    pub srq: bool,
    /// End-to-end flow control.
    pub flow_control: bool,
    /// ECE values answered.
    pub ece: Ece,
}

/// What `sidr_reply` puts in the SIDR_REP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SidrReplyParams {
    /// Status (see [`sidr_status`]); 0 accepts.
    pub status: u8,
    /// The UD QP number.
    pub qpn: u32,
    /// The UD QP's Q_Key.
    pub qkey: u32,
}

/// A MAD to send from QP1 to the destination's QP1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmTransmit {
    /// Destination GID (the peer's IP address).
    pub dest: Gid,
    /// The whole 256-byte MAD.
    pub mad: [u8; MAD_LEN],
}

/// A CM event, in the order `rdma_cm(7)` reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmEvent {
    /// A REQ arrived on a listened service ID (passive side). `id` is a new connection; answer
    /// with [`CmEngine::accept`] or [`CmEngine::reject`].
    ConnectRequest {
        /// The new connection.
        id: CommId,
        /// The requester's GID.
        source: Gid,
        /// The whole request: the peer's QPN, PSN, resources, path and 92 bytes of private
        /// data (the `rdma_cm` header and the user's data).
        req: Box<ReqRepr>,
        /// The requester's ECE values.
        ece: Ece,
    },
    /// A REP arrived (active side). Move the QP to RTR and RTS, then call
    /// [`CmEngine::establish`] (or [`CmEngine::reject`]).
    ConnectResponse {
        /// The connection.
        id: CommId,
        /// The whole reply, with 196 bytes of private data.
        rep: Box<RepRepr>,
        /// The responder's ECE values.
        ece: Ece,
    },
    /// The connection is established: the active side sent its RTU, or the passive side
    /// received it (or was told data arrived).
    Established {
        /// The connection.
        id: CommId,
    },
    /// The peer rejected the REQ or the REP.
    Rejected {
        /// The connection, gone now.
        id: CommId,
        /// REJ reason (the `rdma_cm` event status).
        reason: u16,
        /// The REJ's 148 bytes of private data.
        private_data: Box<[u8; private_data_len::REJ]>,
    },
    /// No answer to the REQ after every retry (status `-ETIMEDOUT`). The connection is gone.
    Unreachable {
        /// The connection.
        id: CommId,
    },
    /// No RTU after every resend of the REP (passive side). The connection is gone.
    ConnectError {
        /// The connection.
        id: CommId,
    },
    /// The connection is disconnected: a DREQ or DREP arrived, or the DREQ timed out.
    Disconnected {
        /// The connection.
        id: CommId,
        /// The DREQ was never answered (status `-ETIMEDOUT`).
        timed_out: bool,
    },
    /// Timewait ended; the connection is gone and its QP may be reused.
    TimewaitExit {
        /// The connection.
        id: CommId,
    },
    /// A SIDR_REQ arrived on a listened service ID; answer with [`CmEngine::sidr_reply`].
    SidrRequest {
        /// The exchange.
        id: SidrId,
        /// The whole request, with 216 bytes of private data.
        req: Box<SidrReqRepr>,
    },
    /// The SIDR_REP for a request of this side (any status).
    SidrReply {
        /// The exchange.
        id: SidrId,
        /// The whole reply.
        rep: Box<SidrRepRepr>,
    },
    /// No SIDR_REP after every retry (status `-ETIMEDOUT`).
    SidrTimeout {
        /// The exchange.
        id: SidrId,
    },
}

/// `enum rdma_cm_event_type` values.
pub mod rdma_cm_event {
    /// `RDMA_CM_EVENT_CONNECT_REQUEST`.
    pub const CONNECT_REQUEST: u32 = 4;
    /// `RDMA_CM_EVENT_CONNECT_RESPONSE`.
    pub const CONNECT_RESPONSE: u32 = 5;
    /// `RDMA_CM_EVENT_CONNECT_ERROR`.
    pub const CONNECT_ERROR: u32 = 6;
    /// `RDMA_CM_EVENT_UNREACHABLE`.
    pub const UNREACHABLE: u32 = 7;
    /// `RDMA_CM_EVENT_REJECTED`.
    pub const REJECTED: u32 = 8;
    /// `RDMA_CM_EVENT_ESTABLISHED`.
    pub const ESTABLISHED: u32 = 9;
    /// `RDMA_CM_EVENT_DISCONNECTED`.
    pub const DISCONNECTED: u32 = 10;
    /// `RDMA_CM_EVENT_TIMEWAIT_EXIT`.
    pub const TIMEWAIT_EXIT: u32 = 15;
}

impl CmEvent {
    /// The `rdma_cm` event type and status this event becomes. A SIDR reply with status 0
    /// becomes ESTABLISHED, any other status UNREACHABLE with that status.
    pub fn rdma_cm_event(&self) -> (u32, i32) {
        use rdma_cm_event as e;
        match self {
            Self::ConnectRequest { .. } | Self::SidrRequest { .. } => (e::CONNECT_REQUEST, 0),
            Self::ConnectResponse { .. } => (e::CONNECT_RESPONSE, 0),
            Self::Established { .. } => (e::ESTABLISHED, 0),
            Self::Rejected { reason, .. } => (e::REJECTED, i32::from(*reason)),
            Self::Unreachable { .. } | Self::SidrTimeout { .. } => (e::UNREACHABLE, ETIMEDOUT_STATUS),
            Self::ConnectError { .. } => (e::CONNECT_ERROR, ETIMEDOUT_STATUS),
            Self::Disconnected { timed_out, .. } => {
                (e::DISCONNECTED, if *timed_out { ETIMEDOUT_STATUS } else { 0 })
            }
            Self::TimewaitExit { .. } => (e::TIMEWAIT_EXIT, 0),
            Self::SidrReply { rep, .. } if rep.status == sidr_status::SUCCESS => (e::ESTABLISHED, 0),
            Self::SidrReply { rep, .. } => (e::UNREACHABLE, i32::from(rep.status)),
        }
    }

    /// The connection the event is about, if it is about one.
    pub fn comm_id(&self) -> Option<CommId> {
        match self {
            Self::ConnectRequest { id, .. }
            | Self::ConnectResponse { id, .. }
            | Self::Established { id }
            | Self::Rejected { id, .. }
            | Self::Unreachable { id }
            | Self::ConnectError { id }
            | Self::Disconnected { id, .. }
            | Self::TimewaitExit { id } => Some(*id),
            Self::SidrRequest { .. } | Self::SidrReply { .. } | Self::SidrTimeout { .. } => None,
        }
    }
}

/// A caller error from the CM API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CmError {
    /// No connection or SIDR exchange has this ID (EINVAL).
    #[error("unknown connection or request")]
    UnknownId,
    /// The call does not fit the connection's state (EINVAL).
    #[error("the connection is not in a state that allows this")]
    InvalidState,
    /// More private data than the message carries (EINVAL).
    #[error("private data too long for the message")]
    PrivateDataTooLong,
    /// The service ID is already listened on (EADDRINUSE).
    #[error("service ID already in use")]
    AddressInUse,
}

impl CmError {
    /// The errno an `rdma_*` call returns for this error.
    pub fn errno(self) -> i32 {
        match self {
            Self::AddressInUse => 98,
            _ => 22,
        }
    }
}

/// Counters of what the engine dropped or answered on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CmStats {
    /// MADs that did not parse as CM messages.
    pub malformed: u64,
    /// Messages for no known connection (other than DREQ), or out of state.
    pub ignored: u64,
    /// Duplicates answered from a stored reply.
    pub duplicates_answered: u64,
    /// Messages resent after a timeout.
    pub retransmitted: u64,
}

/// A small deterministic generator (splitmix64) for IDs; seeded by the caller.
#[derive(Debug, Clone)]
struct IdRng(u64);

impl IdRng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
}

fn copy_private<const N: usize>(data: &[u8]) -> Result<[u8; N], CmError> {
    if data.len() > N {
        return Err(CmError::PrivateDataTooLong);
    }
    let mut out = [0u8; N];
    out[..data.len()].copy_from_slice(data);
    Ok(out)
}

/// A REJ. One with reason TIMEOUT carries the sender's CA GUID as its ARI: Linux finds the
/// connection it rejects by that GUID and the sender's communication ID.
fn make_rej(
    local_comm_id: u32,
    remote_comm_id: u32,
    message_rejected: MessageKind,
    reason: u16,
    ca_guid: u64,
    private_data: [u8; private_data_len::REJ],
) -> RejRepr {
    let mut ari = [0u8; ARI_LEN];
    let mut ari_length = 0;
    if reason == rej_reason::TIMEOUT {
        ari[..8].copy_from_slice(&ca_guid.to_be_bytes());
        ari_length = 8;
    }
    RejRepr {
        local_comm_id,
        remote_comm_id,
        message_rejected,
        ari_length,
        reason,
        ari,
        private_data,
    }
}

fn encode(msg: &CmMessage, tid: u64) -> [u8; MAD_LEN] {
    encode_with(msg, tid, 0)
}

/// [`encode`] with the header's attribute modifier (ECE options in a REQ or REP).
fn encode_with(msg: &CmMessage, tid: u64, attr_mod: u32) -> [u8; MAD_LEN] {
    let mut mad = [0u8; MAD_LEN];
    // The buffer is exactly one MAD long, so emitting cannot fail.
    let _ = msg.emit(tid, attr_mod, &mut mad);
    mad
}

/// The CM of one device port. See the [module documentation](self).
#[derive(Debug)]
pub struct CmEngine {
    config: CmConfig,
    rng: IdRng,
    /// Upper half of this engine's transaction IDs.
    tid_prefix: u32,
    listeners: BTreeMap<u64, ()>,
    conns: BTreeMap<u32, Conn>,
    /// SIDR requests this side sent, by request ID.
    sidr_out: BTreeMap<u32, PendingSidr>,
    /// SIDR requests this side received and has not forgotten.
    sidr_in: BTreeMap<SidrId, ServedSidr>,
    transmits: VecDeque<CmTransmit>,
    events: VecDeque<CmEvent>,
    stats: CmStats,
}

impl CmEngine {
    /// A CM with no listeners and no connections. `seed` drives every ID the engine chooses.
    pub fn new(config: CmConfig, seed: u64) -> Self {
        let mut rng = IdRng(seed);
        let tid_prefix = rng.next_u32();
        Self {
            config,
            rng,
            tid_prefix,
            listeners: BTreeMap::new(),
            conns: BTreeMap::new(),
            sidr_out: BTreeMap::new(),
            sidr_in: BTreeMap::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: CmStats::default(),
        }
    }

    /// The engine's settings.
    pub fn config(&self) -> &CmConfig {
        &self.config
    }

    /// Counters of dropped and answered messages.
    pub fn stats(&self) -> CmStats {
        self.stats
    }

    /// Connections, remembered rejections and SIDR exchanges still held (timewait included).
    /// Zero once everything has been torn down and every timer has run out.
    pub fn live_entries(&self) -> usize {
        self.conns.len() + self.sidr_out.len() + self.sidr_in.len()
    }

    /// Whether `id` names a connection still held (in any state, timewait included).
    pub fn has_connection(&self, id: CommId) -> bool {
        self.conns.contains_key(&id.0)
    }

    /// Starts delivering REQs and SIDR_REQs for `service_id`.
    pub fn listen(&mut self, service_id: u64) -> Result<(), CmError> {
        if self.listeners.insert(service_id, ()).is_some() {
            return Err(CmError::AddressInUse);
        }
        Ok(())
    }

    /// Stops listening on `service_id`; connections already requested are unaffected.
    pub fn unlisten(&mut self, service_id: u64) -> Result<(), CmError> {
        self.listeners
            .remove(&service_id)
            .map(|_| ())
            .ok_or(CmError::UnknownId)
    }

    /// Sends a REQ to `dest` and returns the new connection's ID. At most 56 bytes of user data
    /// fit after the 36-byte `rdma_cm` header, which the caller includes in `private_data`
    /// (92 bytes in all).
    pub fn connect(
        &mut self,
        now: Instant,
        dest: Gid,
        params: &ConnectParams,
        private_data: &[u8],
    ) -> Result<CommId, CmError> {
        let private_data = copy_private::<{ private_data_len::REQ }>(private_data)?;
        let id = self.new_comm_id();
        let req = ReqRepr {
            local_comm_id: id,
            vendor_id: params.ece.vendor_id & 0xFF_FFFF,
            service_id: params.service_id,
            local_ca_guid: self.config.ca_guid,
            local_qpn: params.local_qpn & 0xFF_FFFF,
            responder_resources: params.responder_resources,
            initiator_depth: params.initiator_depth,
            remote_cm_response_timeout: self.config.cm_response_timeout & 0x1F,
            transport_type: params.transport_type & 3,
            e2e_flow_control: params.flow_control,
            starting_psn: params.starting_psn & 0xFF_FFFF,
            local_cm_response_timeout: self.config.cm_response_timeout & 0x1F,
            retry_count: params.retry_count & 7,
            pkey: params.pkey,
            path_mtu: params.path_mtu & 0xF,
            rnr_retry_count: params.rnr_retry_count & 7,
            max_cm_retries: self.config.max_cm_retries & 0xF,
            srq: params.srq,
            extended_transport_type: params.extended_transport_type & 7,
            primary_path: params.path,
            private_data,
            ..ReqRepr::default()
        };
        let timeout =
            2 * cm_timeout(self.config.packet_life_time) + cm_timeout(req.remote_cm_response_timeout);
        let tid = self.tid(id);
        let mut conn = Conn::new(Role::Active, id, dest, tid, timeout, req.max_cm_retries);
        conn.local_qpn = req.local_qpn;
        conn.timewait = cm_timeout(params.path.local_ack_timeout);
        conn.state = State::ReqSent;
        let mad = encode_with(&CmMessage::Req(req), tid, params.ece.options);
        conn.send_with_retry(now, mad, &mut self.transmits);
        self.conns.insert(id, conn);
        Ok(CommId(id))
    }

    /// Answers a [`CmEvent::ConnectRequest`] with a REP (up to 196 bytes of private data). The
    /// QP should be in RTS already.
    pub fn accept(
        &mut self,
        now: Instant,
        id: CommId,
        params: &AcceptParams,
        private_data: &[u8],
    ) -> Result<(), CmError> {
        let private_data = copy_private::<{ private_data_len::REP }>(private_data)?;
        let ca_guid = self.config.ca_guid;
        let conn = self.conns.get_mut(&id.0).ok_or(CmError::UnknownId)?;
        if !matches!(conn.state, State::ReqRcvd) || conn.detached {
            return Err(CmError::InvalidState);
        }
        let rep = RepRepr {
            local_comm_id: id.0,
            remote_comm_id: conn.remote_comm_id,
            local_qkey: params.local_qkey,
            local_qpn: params.local_qpn & 0xFF_FFFF,
            starting_psn: params.starting_psn & 0xFF_FFFF,
            responder_resources: params.responder_resources,
            initiator_depth: params.initiator_depth,
            target_ack_delay: params.target_ack_delay & 0x1F,
            e2e_flow_control: params.flow_control,
            rnr_retry_count: params.rnr_retry_count & 7,
            srq: params.srq,
            local_ca_guid: ca_guid,
            vendor_id: params.ece.vendor_id & 0xFF_FFFF,
            private_data,
            ..RepRepr::default()
        };
        conn.local_qpn = rep.local_qpn;
        conn.state = State::RepSent;
        let mad = encode_with(&CmMessage::Rep(rep), conn.tid, params.ece.options);
        conn.send_with_retry(now, mad, &mut self.transmits);
        Ok(())
    }

    /// Rejects a [`CmEvent::ConnectRequest`] (passive side) or a
    /// [`CmEvent::ConnectResponse`] (active side) with `reason` (`rdma_reject`: 28) and up to
    /// 148 bytes of private data. The connection is gone for the caller; its REJ is kept a
    /// while to answer the peer's retries.
    pub fn reject(
        &mut self,
        now: Instant,
        id: CommId,
        reason: u16,
        private_data: &[u8],
    ) -> Result<(), CmError> {
        let private_data = copy_private::<{ private_data_len::REJ }>(private_data)?;
        let ca_guid = self.config.ca_guid;
        let conn = self.conns.get_mut(&id.0).ok_or(CmError::UnknownId)?;
        let message_rejected = match conn.state {
            State::ReqRcvd => MessageKind::Req,
            State::RepRcvd => MessageKind::Rep,
            _ => return Err(CmError::InvalidState),
        };
        let rej = make_rej(
            id.0,
            conn.remote_comm_id,
            message_rejected,
            reason,
            ca_guid,
            private_data,
        );
        let mad = encode(&CmMessage::Rej(rej), conn.tid);
        conn.send_reply(mad, &mut self.transmits);
        conn.enter_rejected(now);
        Ok(())
    }

    /// Active side, after [`CmEvent::ConnectResponse`]: sends the RTU and reports
    /// [`CmEvent::Established`].
    pub fn establish(&mut self, id: CommId) -> Result<(), CmError> {
        let conn = self.conns.get_mut(&id.0).ok_or(CmError::UnknownId)?;
        if !matches!(conn.state, State::RepRcvd) || conn.detached {
            return Err(CmError::InvalidState);
        }
        let rtu = softverbs_wire::cm::RtuRepr {
            local_comm_id: id.0,
            remote_comm_id: conn.remote_comm_id,
            private_data: [0; private_data_len::RTU],
        };
        let mad = encode(&CmMessage::Rtu(rtu), conn.tid);
        conn.send_reply(mad, &mut self.transmits);
        conn.state = State::Established;
        self.events.push_back(CmEvent::Established { id });
        Ok(())
    }

    /// Passive side: the QP received data before the RTU (`rdma_notify(IBV_EVENT_COMM_EST)`);
    /// the connection counts as established now. Does nothing if it already is.
    pub fn notify_established(&mut self, id: CommId) -> Result<(), CmError> {
        let conn = self.conns.get_mut(&id.0).ok_or(CmError::UnknownId)?;
        match conn.state {
            State::RepSent => {
                conn.retry = None;
                conn.state = State::Established;
                if !conn.detached {
                    self.events.push_back(CmEvent::Established { id });
                }
                Ok(())
            }
            State::Established => Ok(()),
            _ => Err(CmError::InvalidState),
        }
    }

    /// `rdma_disconnect`: on an established connection, sends a DREQ (up to 220 bytes of
    /// private data); after [`CmEvent::Disconnected`] caused by the peer's DREQ, answers it
    /// with a DREP and enters timewait. Does nothing if this side already disconnected.
    pub fn disconnect(&mut self, now: Instant, id: CommId, private_data: &[u8]) -> Result<(), CmError> {
        let private_data = copy_private::<{ private_data_len::DREQ }>(private_data)?;
        let conn = self.conns.get_mut(&id.0).ok_or(CmError::UnknownId)?;
        match conn.state {
            State::Established => {
                conn.send_dreq(now, private_data, &mut self.transmits);
                Ok(())
            }
            State::DreqRcvd => {
                conn.send_drep(&mut self.transmits);
                conn.enter_timewait(now);
                Ok(())
            }
            State::DreqSent | State::TimeWait => Ok(()),
            _ => Err(CmError::InvalidState),
        }
    }

    /// `rdma_destroy_id`: the caller forgets `id`. No more events are reported for it; the
    /// protocol is finished politely (a REJ for a connection being set up, a DREQ for an
    /// established one, timewait) and the state dropped when done.
    pub fn destroy(&mut self, now: Instant, id: CommId) -> Result<(), CmError> {
        let ca_guid = self.config.ca_guid;
        let conn = self.conns.get_mut(&id.0).ok_or(CmError::UnknownId)?;
        conn.detached = true;
        match conn.state {
            State::ReqSent | State::RepRcvd | State::ReqRcvd => {
                // As Linux: a requester still waiting gives up (TIMEOUT, rejecting no message
                // of the peer's: it knows only our ID and CA GUID); one that has the REP, or a
                // responder deciding, rejects it.
                let (reason, message) = match conn.state {
                    State::ReqSent => (rej_reason::TIMEOUT, MessageKind::Other),
                    State::RepRcvd => (rej_reason::CONSUMER_DEFINED, MessageKind::Rep),
                    _ => (rej_reason::CONSUMER_DEFINED, MessageKind::Req),
                };
                let rej = make_rej(
                    id.0,
                    conn.remote_comm_id,
                    message,
                    reason,
                    ca_guid,
                    [0; private_data_len::REJ],
                );
                let mad = encode(&CmMessage::Rej(rej), conn.tid);
                conn.send_reply(mad, &mut self.transmits);
                if conn.role == Role::Active {
                    self.conns.remove(&id.0);
                } else {
                    conn.enter_rejected(now);
                }
            }
            State::RepSent | State::Established => {
                conn.send_dreq(now, [0; private_data_len::DREQ], &mut self.transmits);
            }
            State::DreqRcvd => {
                conn.send_drep(&mut self.transmits);
                conn.enter_timewait(now);
            }
            State::DreqSent | State::TimeWait | State::Rejected => {}
        }
        Ok(())
    }

    /// Sends a SIDR_REQ for `service_id` to `dest` (up to 216 bytes of private data: the
    /// `rdma_cm` header and 180 bytes of user data) and returns the exchange's ID.
    pub fn sidr_request(
        &mut self,
        now: Instant,
        dest: Gid,
        service_id: u64,
        pkey: u16,
        private_data: &[u8],
    ) -> Result<SidrId, CmError> {
        let private_data = copy_private::<{ private_data_len::SIDR_REQ }>(private_data)?;
        let request_id = loop {
            let raw = self.rng.next_u32();
            let candidate = self.tagged(raw);
            if !self.sidr_out.contains_key(&candidate) {
                break candidate;
            }
        };
        let req = SidrReqRepr {
            request_id,
            pkey,
            service_id,
            private_data,
        };
        let tid = self.tid(request_id);
        let mad = encode(&CmMessage::SidrReq(req), tid);
        let timeout = cm_timeout(self.config.cm_response_timeout);
        let pending = PendingSidr {
            dest,
            mad,
            deadline: now + timeout,
            timeout,
            retries_left: self.config.max_cm_retries,
        };
        self.transmits.push_back(CmTransmit { dest, mad });
        self.sidr_out.insert(request_id, pending);
        Ok(SidrId {
            requester: self.config.local_gid,
            request_id,
        })
    }

    /// Answers a [`CmEvent::SidrRequest`] with a SIDR_REP (up to 136 bytes of private data).
    /// The reply is kept a while to answer the requester's retries.
    pub fn sidr_reply(
        &mut self,
        now: Instant,
        id: SidrId,
        params: &SidrReplyParams,
        private_data: &[u8],
    ) -> Result<(), CmError> {
        let private_data = copy_private::<{ private_data_len::SIDR_REP }>(private_data)?;
        let keep = self.sidr_keep();
        let served = self.sidr_in.get_mut(&id).ok_or(CmError::UnknownId)?;
        if served.reply.is_some() {
            return Err(CmError::InvalidState);
        }
        let rep = SidrRepRepr {
            request_id: id.request_id,
            status: params.status,
            info_length: 0,
            vendor_id: 0,
            qpn: params.qpn & 0xFF_FFFF,
            service_id: served.service_id,
            qkey: params.qkey,
            info: [0; ARI_LEN],
            private_data,
        };
        let mad = encode(&CmMessage::SidrRep(rep), served.tid);
        served.reply = Some(mad);
        served.expires = now + keep;
        self.transmits.push_back(CmTransmit {
            dest: id.requester,
            mad,
        });
        Ok(())
    }

    /// Handles a MAD received on QP1 from `source`. Anything that is not a CM message of a
    /// known kind is counted and dropped.
    pub fn handle_mad(&mut self, now: Instant, source: Gid, mad: &[u8]) {
        let Ok((header, msg)) = CmMessage::parse(mad) else {
            self.stats.malformed += 1;
            return;
        };
        let tid = header.transaction_id;
        match msg {
            CmMessage::Req(req) => self.on_req(source, tid, header.attr_mod, &req),
            CmMessage::Mra(mra) => self.on_mra(now, &mra),
            CmMessage::Rej(rej) => self.on_rej(now, &rej),
            CmMessage::Rep(rep) => self.on_rep(header.attr_mod, &rep),
            CmMessage::Rtu(rtu) => self.on_rtu(&rtu),
            CmMessage::Dreq(dreq) => self.on_dreq(now, source, tid, &dreq),
            CmMessage::Drep(drep) => self.on_drep(now, &drep),
            CmMessage::SidrReq(req) => self.on_sidr_req(now, source, tid, &req),
            CmMessage::SidrRep(rep) => self.on_sidr_rep(&rep),
        }
    }

    /// Resends what timed out, gives up on what ran out of retries and ends timewaits.
    pub fn handle_timeout(&mut self, now: Instant) {
        let due: Vec<u32> = self
            .conns
            .iter()
            .filter(|(_, c)| c.deadline().is_some_and(|d| d <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.conn_timeout(now, id);
        }
        let due: Vec<u32> = self
            .sidr_out
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for request_id in due {
            let Some(p) = self.sidr_out.get_mut(&request_id) else {
                continue;
            };
            if p.retries_left == 0 {
                self.sidr_out.remove(&request_id);
                self.events.push_back(CmEvent::SidrTimeout {
                    id: SidrId {
                        requester: self.config.local_gid,
                        request_id,
                    },
                });
            } else {
                p.retries_left -= 1;
                p.deadline = now + p.timeout;
                self.stats.retransmitted += 1;
                self.transmits.push_back(CmTransmit {
                    dest: p.dest,
                    mad: p.mad,
                });
            }
        }
        self.sidr_in.retain(|_, s| s.reply.is_none() || s.expires > now);
    }

    /// The next MAD to send, if any.
    pub fn poll_transmit(&mut self) -> Option<CmTransmit> {
        self.transmits.pop_front()
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<CmEvent> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called next, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let conns = self.conns.values().filter_map(Conn::deadline);
        let out = self.sidr_out.values().map(|p| p.deadline);
        let served = self
            .sidr_in
            .values()
            .filter(|s| s.reply.is_some())
            .map(|s| s.expires);
        conns.chain(out).chain(served).min()
    }

    // -----------------------------------------------------------------------------------------

    fn new_comm_id(&mut self) -> u32 {
        loop {
            let raw = self.rng.next_u32();
            let id = self.tagged(raw);
            // 0 marks "unknown" in REJs to messages of no connection.
            if id != 0 && !self.conns.contains_key(&id) {
                return id;
            }
        }
    }

    /// `raw` with the configured tag in its top byte (unchanged without a tag).
    fn tagged(&self, raw: u32) -> u32 {
        match self.config.id_tag {
            0 => raw,
            tag => (u32::from(tag) << 24) | (raw & 0x00FF_FFFF),
        }
    }

    fn tid(&self, low: u32) -> u64 {
        (u64::from(self.tid_prefix) << 32) | u64::from(low)
    }

    /// How long a served SIDR reply or a REJ is remembered: the requester's whole retry span.
    fn sidr_keep(&self) -> Duration {
        cm_timeout(self.config.cm_response_timeout) * (u32::from(self.config.max_cm_retries) + 1)
    }

    fn emit(&mut self, conn_detached: bool, event: CmEvent) {
        if !conn_detached {
            self.events.push_back(event);
        }
    }

    fn stateless_rej(&mut self, dest: Gid, tid: u64, remote_comm_id: u32, message: MessageKind, reason: u16) {
        let rej = make_rej(
            0,
            remote_comm_id,
            message,
            reason,
            self.config.ca_guid,
            [0; private_data_len::REJ],
        );
        self.transmits.push_back(CmTransmit {
            dest,
            mad: encode(&CmMessage::Rej(rej), tid),
        });
    }

    fn on_req(&mut self, source: Gid, tid: u64, attr_mod: u32, req: &ReqRepr) {
        // A retry of a REQ already seen is matched by the requester's CA GUID and comm ID.
        let dup = self.conns.values_mut().find(|c| {
            c.role == Role::Passive
                && c.remote_ca_guid == req.local_ca_guid
                && c.remote_comm_id == req.local_comm_id
        });
        if let Some(conn) = dup {
            match conn.state {
                State::TimeWait => {
                    let (d, remote) = (conn.dest, conn.remote_comm_id);
                    self.stateless_rej(d, tid, remote, MessageKind::Req, rej_reason::STALE_CONN);
                }
                State::ReqRcvd if conn.stored.is_none() => {
                    // The application is still deciding: ask the requester to wait.
                    let mra = softverbs_wire::cm::MraRepr {
                        local_comm_id: conn.id,
                        remote_comm_id: conn.remote_comm_id,
                        message_mraed: MessageKind::Req,
                        service_timeout: self.config.mra_service_timeout & 0x1F,
                        private_data: [0; private_data_len::MRA],
                    };
                    let mad = encode(&CmMessage::Mra(mra), conn.tid);
                    conn.send_reply(mad, &mut self.transmits);
                    self.stats.duplicates_answered += 1;
                }
                State::RepSent => {
                    // Resend the REP now rather than at its next timeout.
                    if let Some(r) = &conn.retry {
                        self.transmits.push_back(CmTransmit {
                            dest: conn.dest,
                            mad: r.mad,
                        });
                        self.stats.duplicates_answered += 1;
                    }
                }
                State::ReqRcvd | State::Rejected => {
                    // The stored reply: the MRA or the REJ.
                    if let Some(mad) = conn.stored {
                        self.transmits.push_back(CmTransmit { dest: conn.dest, mad });
                        self.stats.duplicates_answered += 1;
                    }
                }
                _ => self.stats.ignored += 1,
            }
            return;
        }
        // A REQ from a QP still in timewait here is stale.
        let stale = self.conns.values().any(|c| {
            c.state == State::TimeWait
                && c.remote_ca_guid == req.local_ca_guid
                && c.remote_qpn == req.local_qpn
        });
        if stale {
            self.stateless_rej(
                source,
                tid,
                req.local_comm_id,
                MessageKind::Req,
                rej_reason::STALE_CONN,
            );
            return;
        }
        if !self.listeners.contains_key(&req.service_id) {
            self.stateless_rej(
                source,
                tid,
                req.local_comm_id,
                MessageKind::Req,
                rej_reason::INVALID_SERVICE_ID,
            );
            return;
        }
        let id = self.new_comm_id();
        let timeout =
            2 * cm_timeout(self.config.packet_life_time) + cm_timeout(req.local_cm_response_timeout);
        // The REP, MRA, RTU and REJ of this exchange carry the REQ's transaction ID; this
        // side's DREQ starts a transaction of its own.
        let mut conn = Conn::new(Role::Passive, id, source, tid, timeout, req.max_cm_retries);
        conn.dreq_tid = self.tid(id);
        conn.remote_comm_id = req.local_comm_id;
        conn.remote_ca_guid = req.local_ca_guid;
        conn.remote_qpn = req.local_qpn;
        conn.timewait = cm_timeout(req.primary_path.local_ack_timeout);
        conn.reject_keep = (2 * cm_timeout(self.config.packet_life_time)
            + cm_timeout(req.remote_cm_response_timeout))
            * (u32::from(req.max_cm_retries) + 1);
        conn.state = State::ReqRcvd;
        self.conns.insert(id, conn);
        self.events.push_back(CmEvent::ConnectRequest {
            id: CommId(id),
            source,
            req: Box::new(*req),
            ece: Ece {
                vendor_id: req.vendor_id,
                options: attr_mod,
            },
        });
    }

    fn on_mra(&mut self, now: Instant, mra: &softverbs_wire::cm::MraRepr) {
        let plt = cm_timeout(self.config.packet_life_time);
        let Some(conn) = self.conns.get_mut(&mra.remote_comm_id) else {
            self.stats.ignored += 1;
            return;
        };
        let expected = match conn.state {
            State::ReqSent => MessageKind::Req,
            State::RepSent => MessageKind::Rep,
            _ => {
                self.stats.ignored += 1;
                return;
            }
        };
        if mra.message_mraed != expected {
            self.stats.ignored += 1;
            return;
        }
        if conn.role == Role::Active {
            conn.remote_comm_id = mra.local_comm_id;
        }
        if let Some(r) = conn.retry.as_mut() {
            // The peer got the message and needs longer: wait its service time, then resend.
            r.deadline = now + cm_timeout(mra.service_timeout) + plt;
        }
    }

    fn on_rej(&mut self, now: Instant, rej: &RejRepr) {
        // A requester that gives up before knowing our ID (Linux: REJ TIMEOUT from REQ_SENT)
        // names the connection by its own ID and CA GUID (in the ARI) only.
        let key = if self.conns.contains_key(&rej.remote_comm_id) {
            Some(rej.remote_comm_id)
        } else {
            let guid = (rej.reason == rej_reason::TIMEOUT)
                .then(|| u64::from_be_bytes(rej.ari[..8].try_into().unwrap_or([0; 8])));
            self.conns
                .values()
                .find(|c| {
                    c.role == Role::Passive
                        && c.remote_comm_id == rej.local_comm_id
                        && guid.is_some_and(|g| g == c.remote_ca_guid)
                })
                .map(|c| c.id)
        };
        let Some(conn) = key.and_then(|k| self.conns.get_mut(&k)) else {
            self.stats.ignored += 1;
            return;
        };
        let applies = match conn.state {
            State::ReqSent => rej.message_rejected == MessageKind::Req,
            // Or the requester gave up before the REP reached it (Linux: TIMEOUT, no message).
            State::RepSent => rej.message_rejected == MessageKind::Rep || rej.reason == rej_reason::TIMEOUT,
            State::RepRcvd => rej.message_rejected == MessageKind::Rep,
            // The requester gave up while this side decided.
            State::ReqRcvd => true,
            _ => false,
        };
        if !applies || (conn.role == Role::Passive && rej.local_comm_id != conn.remote_comm_id) {
            self.stats.ignored += 1;
            return;
        }
        let (id, detached) = (conn.id, conn.detached);
        match conn.role {
            Role::Active => {
                self.conns.remove(&id);
            }
            Role::Passive => conn.enter_rejected(now),
        }
        self.emit(
            detached,
            CmEvent::Rejected {
                id: CommId(id),
                reason: rej.reason,
                private_data: Box::new(rej.private_data),
            },
        );
    }

    fn on_rep(&mut self, attr_mod: u32, rep: &RepRepr) {
        let Some(conn) = self.conns.get_mut(&rep.remote_comm_id) else {
            self.stats.ignored += 1;
            return;
        };
        if conn.role != Role::Active {
            self.stats.ignored += 1;
            return;
        }
        match conn.state {
            State::ReqSent => {
                conn.retry = None;
                conn.remote_comm_id = rep.local_comm_id;
                conn.remote_ca_guid = rep.local_ca_guid;
                conn.remote_qpn = rep.local_qpn;
                conn.state = State::RepRcvd;
                let (id, detached) = (conn.id, conn.detached);
                self.emit(
                    detached,
                    CmEvent::ConnectResponse {
                        id: CommId(id),
                        rep: Box::new(*rep),
                        ece: Ece {
                            vendor_id: rep.vendor_id,
                            options: attr_mod,
                        },
                    },
                );
            }
            _ if rep.local_comm_id != conn.remote_comm_id => self.stats.ignored += 1,
            State::RepRcvd if conn.stored.is_none() => {
                // The application has not established yet: ask the responder to wait.
                let mra = softverbs_wire::cm::MraRepr {
                    local_comm_id: conn.id,
                    remote_comm_id: conn.remote_comm_id,
                    message_mraed: MessageKind::Rep,
                    service_timeout: self.config.mra_service_timeout & 0x1F,
                    private_data: [0; private_data_len::MRA],
                };
                let mad = encode(&CmMessage::Mra(mra), conn.tid);
                conn.send_reply(mad, &mut self.transmits);
                self.stats.duplicates_answered += 1;
            }
            State::RepRcvd | State::Established | State::Rejected => {
                // The stored MRA, RTU or REJ.
                if let Some(mad) = conn.stored {
                    self.transmits.push_back(CmTransmit { dest: conn.dest, mad });
                    self.stats.duplicates_answered += 1;
                }
            }
            _ => self.stats.ignored += 1,
        }
    }

    fn on_rtu(&mut self, rtu: &softverbs_wire::cm::RtuRepr) {
        let Some(conn) = self.conns.get_mut(&rtu.remote_comm_id) else {
            self.stats.ignored += 1;
            return;
        };
        if conn.state != State::RepSent || conn.remote_comm_id != rtu.local_comm_id {
            self.stats.ignored += 1;
            return;
        }
        conn.retry = None;
        conn.state = State::Established;
        let (id, detached) = (conn.id, conn.detached);
        self.emit(detached, CmEvent::Established { id: CommId(id) });
    }

    fn on_dreq(&mut self, now: Instant, source: Gid, tid: u64, dreq: &softverbs_wire::cm::DreqRepr) {
        let known = self
            .conns
            .get(&dreq.remote_comm_id)
            .is_some_and(|c| c.remote_comm_id == dreq.local_comm_id);
        if known
            && self
                .conns
                .get(&dreq.remote_comm_id)
                .is_some_and(|c| c.local_qpn != dreq.remote_qpn)
        {
            // As Linux: a DREQ naming another QP is not for this connection.
            self.stats.ignored += 1;
            return;
        }
        if !known {
            // Answer anyway so the peer can leave its DREQ-sent state.
            let drep = softverbs_wire::cm::DrepRepr {
                local_comm_id: dreq.remote_comm_id,
                remote_comm_id: dreq.local_comm_id,
                private_data: [0; private_data_len::DREP],
            };
            self.transmits.push_back(CmTransmit {
                dest: source,
                mad: encode(&CmMessage::Drep(drep), tid),
            });
            self.stats.duplicates_answered += 1;
            return;
        }
        let Some(conn) = self.conns.get_mut(&dreq.remote_comm_id) else {
            return;
        };
        // The DREP answers this DREQ's transaction.
        conn.drep_tid = tid;
        let (id, detached) = (CommId(conn.id), conn.detached);
        match conn.state {
            State::RepSent | State::Established => {
                // A DREQ before the RTU means the RTU was lost: the peer was established.
                let implicit_rtu = conn.state == State::RepSent;
                conn.retry = None;
                if detached {
                    conn.send_drep(&mut self.transmits);
                    conn.enter_timewait(now);
                } else {
                    conn.state = State::DreqRcvd;
                }
                if implicit_rtu {
                    self.emit(detached, CmEvent::Established { id });
                }
                self.emit(detached, CmEvent::Disconnected { id, timed_out: false });
            }
            State::DreqSent => {
                // Both sides disconnected at once: each answers the other's DREQ.
                conn.retry = None;
                conn.send_drep(&mut self.transmits);
                conn.enter_timewait(now);
                self.emit(detached, CmEvent::Disconnected { id, timed_out: false });
            }
            State::TimeWait => {
                // Our DREP was lost, or the peer's DREQ crossed ours.
                conn.send_drep(&mut self.transmits);
                self.stats.duplicates_answered += 1;
            }
            _ => self.stats.ignored += 1,
        }
    }

    fn on_drep(&mut self, now: Instant, drep: &softverbs_wire::cm::DrepRepr) {
        let Some(conn) = self.conns.get_mut(&drep.remote_comm_id) else {
            self.stats.ignored += 1;
            return;
        };
        if conn.state != State::DreqSent || conn.remote_comm_id != drep.local_comm_id {
            self.stats.ignored += 1;
            return;
        }
        conn.retry = None;
        conn.enter_timewait(now);
        let (id, detached) = (CommId(conn.id), conn.detached);
        self.emit(detached, CmEvent::Disconnected { id, timed_out: false });
    }

    fn on_sidr_req(&mut self, now: Instant, source: Gid, tid: u64, req: &SidrReqRepr) {
        let id = SidrId {
            requester: source,
            request_id: req.request_id,
        };
        if let Some(served) = self.sidr_in.get(&id) {
            if let Some(mad) = served.reply {
                self.transmits.push_back(CmTransmit { dest: source, mad });
                self.stats.duplicates_answered += 1;
            }
            return;
        }
        if !self.listeners.contains_key(&req.service_id) {
            let rep = SidrRepRepr {
                request_id: req.request_id,
                status: sidr_status::UNSUPPORTED,
                info_length: 0,
                vendor_id: 0,
                qpn: 0,
                service_id: req.service_id,
                qkey: 0,
                info: [0; ARI_LEN],
                private_data: [0; private_data_len::SIDR_REP],
            };
            self.transmits.push_back(CmTransmit {
                dest: source,
                mad: encode(&CmMessage::SidrRep(rep), tid),
            });
            return;
        }
        self.sidr_in.insert(
            id,
            ServedSidr {
                service_id: req.service_id,
                tid,
                reply: None,
                expires: now,
            },
        );
        self.events.push_back(CmEvent::SidrRequest {
            id,
            req: Box::new(*req),
        });
    }

    fn on_sidr_rep(&mut self, rep: &SidrRepRepr) {
        if self.sidr_out.remove(&rep.request_id).is_none() {
            self.stats.ignored += 1;
            return;
        }
        self.events.push_back(CmEvent::SidrReply {
            id: SidrId {
                requester: self.config.local_gid,
                request_id: rep.request_id,
            },
            rep: Box::new(*rep),
        });
    }

    fn conn_timeout(&mut self, now: Instant, id: u32) {
        let ca_guid = self.config.ca_guid;
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let (cid, detached) = (CommId(id), conn.detached);
        match conn.state {
            State::TimeWait => {
                self.conns.remove(&id);
                self.emit(detached, CmEvent::TimewaitExit { id: cid });
            }
            State::Rejected => {
                self.conns.remove(&id);
            }
            _ => {
                let Some(retry) = conn.retry.as_mut() else {
                    return;
                };
                if retry.retries_left > 0 {
                    retry.retries_left -= 1;
                    retry.deadline = now + retry.timeout;
                    self.transmits.push_back(CmTransmit {
                        dest: conn.dest,
                        mad: retry.mad,
                    });
                    self.stats.retransmitted += 1;
                    return;
                }
                conn.retry = None;
                match conn.state {
                    State::ReqSent => {
                        self.conns.remove(&id);
                        self.emit(detached, CmEvent::Unreachable { id: cid });
                    }
                    State::RepSent => {
                        let rej = make_rej(
                            id,
                            conn.remote_comm_id,
                            MessageKind::Rep,
                            rej_reason::TIMEOUT,
                            ca_guid,
                            [0; private_data_len::REJ],
                        );
                        let mad = encode(&CmMessage::Rej(rej), conn.tid);
                        conn.send_reply(mad, &mut self.transmits);
                        conn.enter_rejected(now);
                        self.emit(detached, CmEvent::ConnectError { id: cid });
                    }
                    State::DreqSent => {
                        conn.enter_timewait(now);
                        self.emit(
                            detached,
                            CmEvent::Disconnected {
                                id: cid,
                                timed_out: true,
                            },
                        );
                    }
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
