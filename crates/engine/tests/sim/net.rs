//! The network: link and fault parameters, statistics, the filter hook and packets in flight.

use std::net::SocketAddr;

use softverbs_engine::memory::{ExternalPayload, MemError};
use softverbs_engine::time::Instant;
use softverbs_engine::transport::ExternalRanges;
use softverbs_engine::types::Gid;
use softverbs_wire::{AethSyndrome, Opcode, Psn};

use super::QpId;

/// Fault and link parameters.
#[derive(Debug, Clone, Copy)]
pub struct NetConfig {
    /// One-way propagation latency.
    pub latency_ns: u64,
    /// Egress link rate in bits per nanosecond (Gbit/s); 0 = infinitely fast.
    pub link_gbps: u64,
    /// Packets lost, percent.
    pub loss_pct: f64,
    /// Packets duplicated, percent.
    pub dup_pct: f64,
    /// Packets delayed by a random extra `0..=reorder_max_ns`, percent.
    pub reorder_pct: f64,
    pub reorder_max_ns: u64,
    /// Packets with one byte flipped (caught by the ICRC), percent.
    pub corrupt_pct: f64,
    /// Largest UDP payload (BTH..ICRC) the network carries; bigger ones are dropped.
    pub link_mtu: usize,
    /// The same packet (sending QP, destination node, opcode and PSN) is lost, corrupted or
    /// delayed at most this many times in a row; its next transmission gets through intact and
    /// on time. 0 = unbounded. This keeps pure chance from exhausting a reliable QP's retry
    /// budget (with 3, a stalled request/response pair fails at most 6 rounds in a row, below
    /// retry_cnt 7) while leaving loss and reordering rates essentially unchanged.
    pub max_burst: u32,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            latency_ns: 2_000,
            link_gbps: 100,
            loss_pct: 0.0,
            dup_pct: 0.0,
            reorder_pct: 0.0,
            reorder_max_ns: 0,
            corrupt_pct: 0.0,
            link_mtu: 4096 + 128,
            max_burst: 0,
        }
    }
}

impl NetConfig {
    /// A lossy network: `loss_pct` loss, with duplication and reordering proportional to it.
    pub fn lossy(loss_pct: f64) -> Self {
        Self {
            loss_pct,
            dup_pct: loss_pct / 2.0,
            reorder_pct: loss_pct,
            reorder_max_ns: 20_000,
            max_burst: 3,
            ..Self::default()
        }
    }
}

/// What happened on the network.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    pub sent: u64,
    pub delivered: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub corrupted: u64,
    pub mtu_dropped: u64,
    pub filtered: u64,
    pub bad_icrc: u64,
    pub malformed: u64,
    pub no_route: u64,
    pub no_qp: u64,
    pub node_down: u64,
    pub engine_dropped: u64,
    pub payload_bytes: u64,
    /// Packets sent with their payload left in the sender's memory.
    pub external: u64,
}

/// A packet as the filter hook sees it.
#[derive(Debug, Clone, Copy)]
pub struct PacketInfo {
    pub from: QpId,
    pub to_node: usize,
    pub opcode: Opcode,
    pub psn: Psn,
    pub dest_qpn: u32,
    pub ack_req: bool,
    pub solicited: bool,
    pub syndrome: Option<AethSyndrome>,
    /// The XRCETH's SRQ number (XRC requests).
    pub xrc_srqn: Option<u32>,
    pub payload_len: usize,
    pub time: Instant,
}

/// A filter decides the fate of each packet before faults apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drop,
    /// Deliver, but this much later.
    Delay(u64),
}

pub(super) type Filter = Box<dyn FnMut(&PacketInfo) -> Verdict>;

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct InFlight {
    pub(super) at: u64,
    pub(super) seq: u64,
    pub(super) to_node: usize,
    pub(super) src: SocketAddr,
    pub(super) dst: SocketAddr,
    pub(super) meta_tc: u8,
    pub(super) meta_hop: u8,
    pub(super) sgid: Gid,
    pub(super) dgid: Gid,
    pub(super) data: Vec<u8>,
    /// The sending node and where the payload is in its memory, if it stayed there.
    pub(super) ext: Option<(usize, ExternalRanges)>,
}

/// A payload read from the sender's memory when the packet arrives (what a receiver copying
/// out of the sender sees).
pub(super) struct SimExternal(pub(super) Vec<u8>);

impl ExternalPayload for SimExternal {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let at = offset as usize;
        dst.copy_from_slice(self.0.get(at..at + dst.len()).ok_or(MemError::OutOfRange)?);
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The UDP source port of a QP: constant per QP, as the kernel convention keeps it.
pub(super) fn sport(qpn: u32) -> u16 {
    0xC000 | (qpn & 0x3FFF) as u16
}
