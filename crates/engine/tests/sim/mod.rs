//! A deterministic simulated RoCEv2 fabric for the transport engine.
//!
//! Everything runs in virtual time (engine [`Instant`] nanoseconds) from one seeded RNG, so a run
//! is a pure function of its seed and its script. The pieces:
//!
//! * [`SimMemory`]: a node's address space with a registered-region table (lkey/rkey, PD, access
//!   rights, bounds, 8-byte aligned atomics) and memory windows, implementing the engine's
//!   [`Memory`] trait the way an HCA checks accesses;
//! * [`Srq`]: a shared receive queue implementing [`RecvSource`];
//! * [`Node`]: a GID (its IP address), memory, QPs, SRQs and CQs (`Vec`s of completions);
//! * [`Sim`]: the network between nodes (per-node egress link rate, fixed latency, loss,
//!   duplication, reordering by random extra delay, corruption, an MTU limit and a per-packet
//!   filter hook), with every packet's ICRC filled by the sender from SocketAddrs derived from
//!   the GIDs and verified by the receiver;
//! * the driving loop ([`Sim::step`]): after every input the QP's outputs are drained
//!   (`poll_transmit`, `poll_completion`, `poll_event`), then virtual time jumps to the next
//!   delivery or engine timeout. Step counts are bounded so a test can never hang.
//!
//! A failing test prints its seed; `SOFTVERBS_SIM_SEED=<seed>` reruns any test with that seed
//! only, and `SOFTVERBS_SIM_TRACE=1` prints every packet.
//!
//! [`Memory`]: softverbs_engine::memory::Memory
//! [`RecvSource`]: softverbs_engine::transport::RecvSource

#![allow(dead_code, unreachable_pub, missing_docs)]

mod builders;
mod completions;
mod driving;
mod memory;
mod net;
mod objects;
mod posting;
mod queues;
mod rng;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::net::{Ipv4Addr, Ipv6Addr};

use softverbs_engine::time::Instant;
use softverbs_engine::types::{Gid, QpState};

// Each test crate uses its own part of the simulator; the rest of these is unused there.
#[allow(unused_imports)]
pub use builders::{
    all_access, assert_ok_in_order, assert_wc, bind_mw, cmp_swp, fetch_add, local_inv, lossy_pair, mgid_v4,
    read, recv, send, send_inv, wr, write, ConnOpts, QpOpts,
};
#[allow(unused_imports)]
pub use memory::{Mr, SimMemory};
#[allow(unused_imports)]
pub use net::{NetConfig, NetStats, PacketInfo, Verdict};
#[allow(unused_imports)]
pub use queues::{Node, Placer, QpId, SimQp, Srq, XrcDomainSrqs, XrcSrqInfo};
#[allow(unused_imports)]
pub use rng::{seed_override, seeds, Rng};

use net::{Filter, InFlight};

/// The default cap on [`Sim::step`] calls per [`Sim`].
pub const DEFAULT_MAX_STEPS: u64 = 2_000_000;

/// The fabric and everything on it.
pub struct Sim {
    pub now: Instant,
    pub nodes: Vec<Node>,
    pub net: NetConfig,
    pub rng: Rng,
    pub seed: u64,
    pub stats: NetStats,
    /// Every packet handed to the network, in send order (opcode, from, psn), if enabled.
    pub log: Option<Vec<PacketInfo>>,
    pub filter: Option<Filter>,
    pub trace: bool,
    pub steps: u64,
    pub max_steps: u64,
    /// Deliver the packets due at one instant as a device delivers a received batch: each
    /// receiving QP holds its positive ACKs until the batch ends (`QpEngine::hold_acks`).
    pub hold_acks: bool,
    /// The QPs that received packets in the batch being delivered.
    acking: Vec<QpId>,
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    /// Consecutive mishaps per packet, for `NetConfig::max_burst`.
    bursts: BTreeMap<(QpId, usize, u8, u32), u32>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "simulated fabric: seed {} (rerun with SOFTVERBS_SIM_SEED={}), virtual time {} ns, {} steps, {:?}",
                self.seed, self.seed, self.now.0, self.steps, self.stats
            );
        }
    }
}

impl Sim {
    /// A fabric with `n` nodes on IPv4 10.0.0.1, 10.0.0.2, ... (or the seed override).
    pub fn new(seed: u64, n: usize) -> Self {
        Self::with_gids(
            seed,
            (0..n)
                .map(|i| Gid::from(Ipv4Addr::new(10, 0, 0, i as u8 + 1)))
                .collect(),
        )
    }

    /// A fabric with `n` nodes on IPv6 fd00::1, fd00::2, ...
    pub fn new_ipv6(seed: u64, n: usize) -> Self {
        Self::with_gids(
            seed,
            (0..n)
                .map(|i| Gid::from(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, i as u16 + 1)))
                .collect(),
        )
    }

    pub fn with_gids(seed: u64, gids: Vec<Gid>) -> Self {
        let seed = seed_override().unwrap_or(seed);
        let nodes = gids
            .into_iter()
            .enumerate()
            .map(|(i, gid)| Node {
                gid,
                mem: SimMemory::new(i),
                qps: BTreeMap::new(),
                srqs: Vec::new(),
                cqs: Vec::new(),
                up: true,
                next_qpn: 0x11,
                link_free: 0,
            })
            .collect();
        Self {
            now: Instant(1_000_000),
            nodes,
            net: NetConfig::default(),
            rng: Rng::new(seed),
            seed,
            stats: NetStats::default(),
            log: None,
            filter: None,
            trace: std::env::var_os("SOFTVERBS_SIM_TRACE").is_some(),
            steps: 0,
            max_steps: DEFAULT_MAX_STEPS,
            hold_acks: false,
            acking: Vec::new(),
            queue: BinaryHeap::new(),
            seq: 0,
            bursts: BTreeMap::new(),
        }
    }

    pub fn with_net(mut self, net: NetConfig) -> Self {
        self.net = net;
        self
    }

    /// Installs a filter applied to every packet before faults.
    pub fn set_filter(&mut self, f: impl FnMut(&PacketInfo) -> Verdict + 'static) {
        self.filter = Some(Box::new(f));
    }

    pub fn clear_filter(&mut self) {
        self.filter = None;
    }

    /// Starts recording every packet sent.
    pub fn record(&mut self) {
        self.log = Some(Vec::new());
    }

    pub fn mem(&self, node: usize) -> &SimMemory {
        &self.nodes[node].mem
    }

    pub fn qp(&self, id: QpId) -> &SimQp {
        &self.nodes[id.node].qps[&id.qpn]
    }

    pub fn qp_mut(&mut self, id: QpId) -> &mut SimQp {
        self.nodes[id.node].qps.get_mut(&id.qpn).expect("no such QP")
    }

    pub fn state(&self, id: QpId) -> QpState {
        self.qp(id).attr.qp_state
    }
}
