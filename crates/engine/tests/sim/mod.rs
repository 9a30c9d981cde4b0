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

#![allow(dead_code, unreachable_pub, missing_docs)]

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use softverbs_engine::memory::{AtomicOp, ExternalPayload, KeyRef, MemError, Memory};
use softverbs_engine::mw::{key_index, MrInfo, MwBind, MwType, Window};
use softverbs_engine::qp_state::{self, PortLimits};
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{
    Completion, DropReason, ExternalRanges, QpConfig, QpEngine, RecvPlacement, RecvSource, Rx, RxMeta,
    Transmit, WorkQueue,
};
use softverbs_engine::types::{
    AccessFlags, AhAttr, EventType, Gid, GlobalRoute, Mtu, QpAttr, QpAttrMask, QpState, QpType, RecvWr,
    SendFlags, Sge, WcStatus, WorkCompletion,
};
use softverbs_engine::wr::{Payload, RemoteAddr, SendLimits, SendOp, SendWr, UdDest};
use softverbs_wire::{icrc, AethSyndrome, Opcode, Psn, RocePacket, MULTICAST_QPN, ROCE_UDP_PORT};

// ---------------------------------------------------------------------------------------------
// Seeds and randomness

/// xoshiro256**, seeded through splitmix64. (A bare splitmix64 counter is not enough here: a
/// retry loop that draws the same number of values per round walks the counter in a fixed
/// stride, and the outputs at such strides can correlate, so one packet was "corrupted" on
/// every retransmission.)
#[derive(Debug, Clone)]
pub struct Rng([u64; 4]);

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Self([next(), next(), next(), next()])
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// True with probability `pct` percent.
    pub fn chance(&mut self, pct: f64) -> bool {
        pct > 0.0 && (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 100.0 < pct
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.fill(&mut v);
        v
    }
}

/// The seed override from `SOFTVERBS_SIM_SEED`, if set.
pub fn seed_override() -> Option<u64> {
    let s = std::env::var("SOFTVERBS_SIM_SEED").ok()?;
    let s = s.trim();
    let v = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    Some(v.unwrap_or_else(|_| panic!("SOFTVERBS_SIM_SEED={s} is not a number")))
}

/// The seeds a multi-seed test runs: `defaults`, or just the override.
pub fn seeds(defaults: &[u64]) -> Vec<u64> {
    match seed_override() {
        Some(s) => vec![s],
        None => defaults.to_vec(),
    }
}

// ---------------------------------------------------------------------------------------------
// Registered memory

/// One registered memory region, as `ibv_reg_mr` returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mr {
    pub lkey: u32,
    pub rkey: u32,
    pub pd: u32,
    pub access: AccessFlags,
    pub addr: u64,
    pub len: u64,
}

impl Mr {
    /// An SGE over `len` bytes at `offset` into the region.
    pub fn sge(&self, offset: u64, len: u32) -> Sge {
        Sge {
            addr: self.addr + offset,
            length: len,
            lkey: self.lkey,
        }
    }

    /// The remote address of `offset` into the region.
    pub fn remote(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr + offset,
            rkey: self.rkey,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Region {
    mr: Mr,
    valid: bool,
}

/// A node's memory: one growing byte array at a node-specific base address, and the table of
/// regions registered over it. Every access is checked as an HCA checks it.
#[derive(Debug)]
pub struct SimMemory {
    base: u64,
    bytes: RefCell<Vec<u8>>,
    regions: RefCell<Vec<Region>>,
    /// Memory windows, by key index.
    windows: RefCell<BTreeMap<u32, Window>>,
    key_salt: u32,
    /// Accesses refused, by reason (for tests that assert a check happened).
    pub refused: RefCell<Vec<MemError>>,
    /// Atomics executed.
    pub atomics: Cell<u64>,
    /// FLUSHes executed.
    pub flushes: Cell<u64>,
    /// Payloads may stay here for the receiver to fetch ([`Memory::locate`] answers).
    pub external: Cell<bool>,
}

impl SimMemory {
    pub fn new(node: usize) -> Self {
        Self {
            // Distinct per node, so an address used on the wrong node fails loudly.
            base: 0x10_0000_0000 + (node as u64) * 0x1_0000_0000,
            bytes: RefCell::new(Vec::new()),
            regions: RefCell::new(Vec::new()),
            windows: RefCell::new(BTreeMap::new()),
            key_salt: 0x5A00_0000 ^ ((node as u32) << 16),
            refused: RefCell::new(Vec::new()),
            atomics: Cell::new(0),
            flushes: Cell::new(0),
            external: Cell::new(false),
        }
    }

    /// Allocates `len` zeroed bytes, 64-byte aligned; returns the address.
    pub fn alloc(&self, len: u64) -> u64 {
        let mut b = self.bytes.borrow_mut();
        let start = b.len().next_multiple_of(64);
        b.resize(start + len as usize, 0);
        self.base + start as u64
    }

    /// Registers `[addr, addr + len)` (as `ibv_reg_mr`). Remote write or atomic access needs
    /// local write too, as the verbs require.
    pub fn reg(&self, pd: u32, addr: u64, len: u64, access: AccessFlags) -> Mr {
        assert!(
            access.contains(AccessFlags::LOCAL_WRITE)
                || !access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC),
            "ibv_reg_mr: REMOTE_WRITE/REMOTE_ATOMIC need LOCAL_WRITE (EINVAL)"
        );
        assert!(addr >= self.base && addr + len <= self.base + self.bytes.borrow().len() as u64);
        let mut regions = self.regions.borrow_mut();
        let n = regions.len() as u32 + 1;
        let lkey = self.key_salt | (n << 4) | 0x1;
        let rkey = self.key_salt | (n << 4) | 0x2;
        let mr = Mr {
            lkey,
            rkey,
            pd,
            access,
            addr,
            len,
        };
        regions.push(Region { mr, valid: true });
        mr
    }

    /// Allocates and registers a region.
    pub fn alloc_mr(&self, pd: u32, len: u64, access: AccessFlags) -> Mr {
        let addr = self.alloc(len);
        self.reg(pd, addr, len, access)
    }

    /// Deregisters a region: its keys stop working.
    pub fn dereg(&self, mr: &Mr) {
        for r in self.regions.borrow_mut().iter_mut() {
            if r.mr.lkey == mr.lkey {
                r.valid = false;
            }
        }
    }

    /// Allocates a memory window (as `ibv_alloc_mw`); returns its rkey.
    pub fn alloc_mw(&self, pd: u32, mw_type: MwType) -> u32 {
        let mut w = self.windows.borrow_mut();
        // Window keys have the top bit set: region keys never do, so the two cannot collide.
        let rkey = 0x8000_0000 | (self.key_salt & 0x00FF_0000) | ((w.len() as u32 + 1) << 8);
        w.insert(key_index(rkey), Window::new(mw_type, pd, rkey));
        rkey
    }

    /// A window's state, by any of its keys.
    pub fn window(&self, rkey: u32) -> Window {
        self.windows.borrow()[&key_index(rkey)]
    }

    /// Reads memory directly (the application's view).
    pub fn peek(&self, addr: u64, len: usize) -> Vec<u8> {
        let off = (addr - self.base) as usize;
        self.bytes.borrow()[off..off + len].to_vec()
    }

    /// Writes memory directly (the application's view).
    pub fn poke(&self, addr: u64, data: &[u8]) {
        let off = (addr - self.base) as usize;
        self.bytes.borrow_mut()[off..off + data.len()].copy_from_slice(data);
    }

    pub fn peek_u64(&self, addr: u64) -> u64 {
        u64::from_ne_bytes(self.peek(addr, 8).try_into().unwrap())
    }

    pub fn poke_u64(&self, addr: u64, v: u64) {
        self.poke(addr, &v.to_ne_bytes());
    }

    /// Finds the region for `key` and checks PD, right and bounds; returns the byte offset.
    fn resolve(&self, key: KeyRef, addr: u64, len: u64) -> Result<usize, MemError> {
        let result = (|| {
            if key.access.is_remote() && key.key & 0x8000_0000 != 0 {
                // A window: its rules, then the region it is bound to (bound regions stay).
                let w = *self
                    .windows
                    .borrow()
                    .get(&key_index(key.key))
                    .ok_or(MemError::BadKey)?;
                let (lkey, iova) = w.resolve(key, addr, len)?;
                if !self.regions.borrow().iter().any(|r| r.valid && r.mr.lkey == lkey) {
                    return Err(MemError::BadKey);
                }
                // Sim regions are addressed by their virtual address (iova = addr).
                return Ok((iova - self.base) as usize);
            }
            let regions = self.regions.borrow();
            let r = regions
                .iter()
                .find(|r| {
                    r.valid
                        && if key.access.is_remote() {
                            r.mr.rkey == key.key
                        } else {
                            r.mr.lkey == key.key
                        }
                })
                .ok_or(MemError::BadKey)?;
            if r.mr.pd != key.pd {
                return Err(MemError::WrongPd);
            }
            if !r.mr.access.contains(key.access.required_flags()) {
                return Err(MemError::NoAccess);
            }
            if len == WHOLE_REGION {
                return Ok((r.mr.addr - self.base) as usize);
            }
            let end = addr.checked_add(len).ok_or(MemError::OutOfRange)?;
            if addr < r.mr.addr || end > r.mr.addr + r.mr.len {
                return Err(MemError::OutOfRange);
            }
            Ok((addr - self.base) as usize)
        })();
        if let Err(e) = result {
            self.refused.borrow_mut().push(e);
        }
        result
    }
}

impl Memory for SimMemory {
    fn read(&self, key: KeyRef, addr: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let off = self.resolve(key, addr, dst.len() as u64)?;
        dst.copy_from_slice(&self.bytes.borrow()[off..off + dst.len()]);
        Ok(())
    }

    fn write(&self, key: KeyRef, addr: u64, src: &[u8]) -> Result<(), MemError> {
        let off = self.resolve(key, addr, src.len() as u64)?;
        self.bytes.borrow_mut()[off..off + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn check(&self, key: KeyRef, addr: u64, len: u64) -> Result<(), MemError> {
        self.resolve(key, addr, len).map(|_| ())
    }

    fn locate(&self, key: KeyRef, addr: u64, len: u64) -> Result<Option<u64>, MemError> {
        let off = self.resolve(key, addr, len)?;
        Ok(self.external.get().then_some(self.base + off as u64))
    }

    fn atomic(&self, key: KeyRef, addr: u64, op: AtomicOp) -> Result<u64, MemError> {
        if addr % 8 != 0 {
            self.refused.borrow_mut().push(MemError::Misaligned);
            return Err(MemError::Misaligned);
        }
        let off = self.resolve(key, addr, 8)?;
        let mut b = self.bytes.borrow_mut();
        let old = u64::from_ne_bytes(b[off..off + 8].try_into().unwrap());
        b[off..off + 8].copy_from_slice(&op.apply(old).to_ne_bytes());
        self.atomics.set(self.atomics.get() + 1);
        Ok(old)
    }

    fn bind_mw(&self, qpn: u32, pd: u32, bind: &MwBind) -> Result<(), MemError> {
        let mut windows = self.windows.borrow_mut();
        let w = windows
            .get_mut(&key_index(bind.mw_rkey))
            .ok_or(MemError::BadKey)?;
        let mr = self
            .regions
            .borrow()
            .iter()
            .find(|r| r.valid && r.mr.lkey == bind.mr_lkey)
            .map(|r| MrInfo {
                pd: r.mr.pd,
                access: r.mr.access,
                iova: r.mr.addr,
                length: r.mr.len,
            });
        let result = w.check_bind(qpn, pd, bind, mr.as_ref());
        match result {
            Ok(target) => {
                w.apply_bind(bind, target);
                Ok(())
            }
            Err(e) => {
                self.refused.borrow_mut().push(e);
                Err(e)
            }
        }
    }

    fn invalidate(&self, qpn: u32, pd: u32, rkey: u32) -> Result<(), MemError> {
        let mut windows = self.windows.borrow_mut();
        let w = windows.get_mut(&key_index(rkey)).ok_or(MemError::BadKey)?;
        if let Err(e) = w.check_invalidate(qpn, pd, rkey) {
            self.refused.borrow_mut().push(e);
            return Err(e);
        }
        w.invalidate();
        Ok(())
    }

    fn flush(&self, key: KeyRef, addr: u64, len: u64, whole_region: bool) -> Result<(), MemError> {
        self.resolve(key, addr, if whole_region { WHOLE_REGION } else { len })?;
        self.flushes.set(self.flushes.get() + 1);
        Ok(())
    }
}

/// A length `resolve` takes as "the whole region, any address" (a FLUSH of the whole MR).
const WHOLE_REGION: u64 = u64::MAX;

// ---------------------------------------------------------------------------------------------
// Queues

/// A shared receive queue.
#[derive(Debug, Default)]
pub struct Srq {
    pub queue: VecDeque<RecvWr>,
    pub taken: u64,
    /// Chooses how a SEND is received from its first packet (as a tag-matching SRQ does);
    /// `None`: the next WQE takes the whole message.
    pub placer: Option<Placer>,
    /// An XRC SRQ: its number, XRC domain, PD and CQ.
    pub xrc: Option<XrcSrqInfo>,
}

/// What makes an SRQ an XRC SRQ.
#[derive(Debug, Clone, Copy)]
pub struct XrcSrqInfo {
    pub srqn: u32,
    pub xrcd: u32,
    pub pd: u32,
    pub cq: usize,
}

/// The SRQs of one XRC domain, as a target QP's receive source (the device's lookup by SRQN).
pub struct XrcDomainSrqs<'a> {
    pub srqs: &'a mut [Srq],
    pub xrcd: u32,
    pub selected: Option<usize>,
}

impl RecvSource for XrcDomainSrqs<'_> {
    fn take(&mut self) -> Option<RecvWr> {
        self.selected.and_then(|i| self.srqs[i].take())
    }

    fn put_back(&mut self, wr: RecvWr) {
        if let Some(i) = self.selected {
            self.srqs[i].put_back(wr);
        }
    }

    fn select_xrc_srq(&mut self, srqn: u32) -> Option<u32> {
        let xrcd = self.xrcd;
        let (i, info) = self
            .srqs
            .iter()
            .enumerate()
            .find_map(|(i, s)| s.xrc.filter(|x| x.srqn == srqn && x.xrcd == xrcd).map(|x| (i, x)))?;
        self.selected = Some(i);
        Some(info.pd)
    }
}

/// A [`RecvSource::take_send`] policy: first packet, whether it is the only one, the queue.
pub type Placer = fn(&[u8], bool, &mut VecDeque<RecvWr>) -> Option<RecvPlacement>;

impl RecvSource for Srq {
    fn take(&mut self) -> Option<RecvWr> {
        let wr = self.queue.pop_front();
        self.taken += u64::from(wr.is_some());
        wr
    }

    fn put_back(&mut self, wr: RecvWr) {
        self.taken -= 1;
        self.queue.push_front(wr);
    }

    fn take_send(&mut self, first: &[u8], only: bool) -> Option<RecvPlacement> {
        let Some(placer) = self.placer else {
            return self.take().map(RecvPlacement::plain);
        };
        let before = self.queue.len();
        let p = placer(first, only, &mut self.queue);
        self.taken += (before - self.queue.len()) as u64;
        p
    }
}

/// Names a QP: its node and number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpId {
    pub node: usize,
    pub qpn: u32,
}

/// A QP on a node: the engine plus what the device keeps around it.
#[derive(Debug)]
pub struct SimQp {
    pub engine: QpEngine,
    /// The attributes as the device keeps them (what `ibv_query_qp` returns).
    pub attr: QpAttr,
    pub srq: Option<usize>,
    /// XRC target: its XRC domain.
    pub xrcd: Option<u32>,
    pub send_cq: usize,
    pub recv_cq: usize,
    pub events: Vec<EventType>,
    pub drops: Vec<DropReason>,
    /// Multicast groups attached.
    pub mcast: Vec<Gid>,
    /// Completions handed back to the driver ([`WorkQueue::Internal`]).
    pub internal: Vec<WorkCompletion>,
}

/// One host with one GID.
#[derive(Debug)]
pub struct Node {
    pub gid: Gid,
    pub mem: SimMemory,
    pub qps: BTreeMap<u32, SimQp>,
    pub srqs: Vec<Srq>,
    pub cqs: Vec<Vec<WorkCompletion>>,
    /// A node that is down neither sends nor receives (the peer "vanished").
    pub up: bool,
    next_qpn: u32,
    /// When the egress link is free again.
    link_free: u64,
}

// ---------------------------------------------------------------------------------------------
// Network

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

type Filter = Box<dyn FnMut(&PacketInfo) -> Verdict>;

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: u64,
    seq: u64,
    to_node: usize,
    src: SocketAddr,
    dst: SocketAddr,
    meta_tc: u8,
    meta_hop: u8,
    sgid: Gid,
    dgid: Gid,
    data: Vec<u8>,
    /// The sending node and where the payload is in its memory, if it stayed there.
    ext: Option<(usize, ExternalRanges)>,
}

/// A payload read from the sender's memory when the packet arrives (what a receiver copying
/// out of the sender sees).
struct SimExternal(Vec<u8>);

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

/// The UDP source port of a QP: constant per QP, as the kernel convention keeps it.
fn sport(qpn: u32) -> u16 {
    0xC000 | (qpn & 0x3FFF) as u16
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

    // ----- objects -----

    pub fn create_cq(&mut self, node: usize) -> usize {
        self.nodes[node].cqs.push(Vec::new());
        self.nodes[node].cqs.len() - 1
    }

    pub fn create_srq(&mut self, node: usize) -> usize {
        self.nodes[node].srqs.push(Srq::default());
        self.nodes[node].srqs.len() - 1
    }

    /// An XRC SRQ in domain `xrcd` with PD `pd`, completing on CQ `cq`; returns its index and
    /// its SRQ number.
    pub fn create_xrc_srq(&mut self, node: usize, xrcd: u32, pd: u32, cq: usize) -> (usize, u32) {
        let idx = self.nodes[node].srqs.len();
        let srqn = 0x400 + idx as u32;
        self.nodes[node].srqs.push(Srq {
            xrc: Some(XrcSrqInfo { srqn, xrcd, pd, cq }),
            ..Srq::default()
        });
        (idx, srqn)
    }

    /// An XRC target QP of domain `xrcd` (no PD, no CQs of its own).
    pub fn create_xrc_tgt(&mut self, node: usize, xrcd: u32) -> QpId {
        self.create_qp_with(
            node,
            QpType::XrcRecv,
            QpOpts {
                pd: 0,
                xrcd: Some(xrcd),
                ..QpOpts::default()
            },
        )
    }

    /// Creates a QP in RESET with its own send and receive CQs.
    pub fn create_qp(&mut self, node: usize, qp_type: QpType) -> QpId {
        self.create_qp_with(node, qp_type, QpOpts::default())
    }

    pub fn create_qp_with(&mut self, node: usize, qp_type: QpType, o: QpOpts) -> QpId {
        let send_cq = o.send_cq.unwrap_or_else(|| self.create_cq(node));
        let recv_cq = o.recv_cq.unwrap_or_else(|| self.create_cq(node));
        let n = &mut self.nodes[node];
        let qpn = n.next_qpn;
        n.next_qpn += 1;
        let cfg = QpConfig {
            qp_type,
            qpn,
            pd: o.pd,
            sq_sig_all: o.sq_sig_all,
            has_srq: o.srq.is_some(),
        };
        n.qps.insert(
            qpn,
            SimQp {
                engine: QpEngine::new(cfg),
                attr: QpAttr::default(),
                srq: o.srq,
                xrcd: o.xrcd,
                send_cq,
                recv_cq,
                events: Vec::new(),
                drops: Vec::new(),
                internal: Vec::new(),
                mcast: Vec::new(),
            },
        );
        QpId { node, qpn }
    }

    /// `ibv_modify_qp`: validated with the engine's state table against this node's port,
    /// applied, then handed to the engine. Panics if the modify is invalid.
    pub fn modify(&mut self, id: QpId, attr: &QpAttr, mask: QpAttrMask) {
        self.try_modify(id, attr, mask)
            .unwrap_or_else(|e| panic!("modify_qp {id:?}: {e}"));
    }

    pub fn try_modify(&mut self, id: QpId, attr: &QpAttr, mask: QpAttrMask) -> Result<(), String> {
        let now = self.now;
        let node = &mut self.nodes[id.node];
        let gids = [node.gid];
        let limits = PortLimits {
            phys_port_cnt: 1,
            pkey_tbl_len: 1,
            gid_table: &gids,
            max_mtu: Mtu::Mtu4096,
            max_qp_init_rd_atom: 16,
            max_qp_rd_atom: 16,
        };
        let qp = node.qps.get_mut(&id.qpn).expect("no such QP");
        let qp_type = qp.engine.config().qp_type;
        let next = qp_state::validate_modify(qp_type, qp.attr.qp_state, attr, mask, &limits)
            .map_err(|e| e.to_string())?;
        qp_state::apply_modify(&mut qp.attr, attr, mask, next);
        qp.engine.set_attr(now, &qp.attr);
        self.pump(id);
        Ok(())
    }

    /// Moves a QP to `state` with nothing else (ERR, RESET, SQD without notify, ...).
    pub fn set_state(&mut self, id: QpId, state: QpState) {
        let attr = QpAttr {
            qp_state: state,
            ..QpAttr::default()
        };
        self.modify(id, &attr, QpAttrMask::STATE);
    }

    /// RTS -> SQD, asking for `IBV_EVENT_SQ_DRAINED`.
    pub fn drain(&mut self, id: QpId) {
        let attr = QpAttr {
            qp_state: QpState::Sqd,
            en_sqd_async_notify: true,
            ..QpAttr::default()
        };
        self.modify(id, &attr, QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY);
    }

    /// RESET -> INIT -> RTR -> RTS for an RC or UC QP talking to `remote`.
    pub fn bring_up(&mut self, id: QpId, remote: QpId, o: &ConnOpts, sq_psn: u32, rq_psn: u32) {
        use QpAttrMask as M;
        let qp_type = self.qp(id).engine.config().qp_type;
        // Exactly the attributes each transition requires for this QP type.
        let required = |from, to| {
            M::STATE
                | qp_state::transition_masks(qp_type, from, to)
                    .expect("a defined transition")
                    .required
        };
        let init = QpAttr {
            qp_state: QpState::Init,
            pkey_index: 0,
            port_num: 1,
            qp_access_flags: o.access,
            ..QpAttr::default()
        };
        self.modify(id, &init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS);
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: o.mtu,
            dest_qp_num: remote.qpn,
            rq_psn,
            max_dest_rd_atomic: o.max_dest_rd_atomic,
            min_rnr_timer: o.min_rnr_timer,
            ah_attr: self.ah_to(remote.node),
            ..QpAttr::default()
        };
        self.modify(id, &rtr, required(QpState::Init, QpState::Rtr));
        let rts = QpAttr {
            qp_state: QpState::Rts,
            sq_psn,
            timeout: o.timeout,
            retry_cnt: o.retry_cnt,
            rnr_retry: o.rnr_retry,
            max_rd_atomic: o.max_rd_atomic,
            ..QpAttr::default()
        };
        self.modify(id, &rts, required(QpState::Rtr, QpState::Rts));
    }

    /// Connects two RC or UC QPs both ways: `a` sends from `o.psn_a`, `b` from `o.psn_b`.
    pub fn connect(&mut self, a: QpId, b: QpId, o: &ConnOpts) {
        self.bring_up(a, b, o, o.psn_a, o.psn_b);
        self.bring_up(b, a, o, o.psn_b, o.psn_a);
    }

    /// Two nodes and a connected pair of `qp_type` QPs between them.
    pub fn pair(seed: u64, qp_type: QpType, o: &ConnOpts) -> (Self, QpId, QpId) {
        let mut sim = Self::new(seed, 2);
        let a = sim.create_qp(0, qp_type);
        let b = sim.create_qp(1, qp_type);
        sim.connect(a, b, o);
        (sim, a, b)
    }

    /// A UD QP brought to RTS with Q_Key `qkey`.
    pub fn ud_up(&mut self, id: QpId, qkey: u32) {
        use QpAttrMask as M;
        let init = QpAttr {
            qp_state: QpState::Init,
            pkey_index: 0,
            port_num: 1,
            qkey,
            ..QpAttr::default()
        };
        self.modify(id, &init, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY);
        self.modify(
            id,
            &QpAttr {
                qp_state: QpState::Rtr,
                ..QpAttr::default()
            },
            M::STATE,
        );
        self.modify(
            id,
            &QpAttr {
                qp_state: QpState::Rts,
                sq_psn: 0,
                ..QpAttr::default()
            },
            M::STATE | M::SQ_PSN,
        );
    }

    /// An address vector from this fabric's node `node`'s GID (RoCE: a GRH with the GID).
    pub fn ah_to(&self, node: usize) -> AhAttr {
        AhAttr {
            grh: GlobalRoute {
                dgid: self.nodes[node].gid,
                flow_label: 0,
                sgid_index: 0,
                hop_limit: 64,
                traffic_class: 0,
            },
            is_global: true,
            port_num: 1,
            ..AhAttr::default()
        }
    }

    /// A UD destination for QP `to`.
    pub fn ud_dest(&self, to: QpId, qkey: u32) -> UdDest {
        UdDest {
            dgid: self.nodes[to.node].gid,
            sgid_index: 0,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
            qpn: to.qpn,
            qkey,
        }
    }

    /// Attaches a UD QP to a multicast group (`ibv_attach_mcast`).
    pub fn attach_mcast(&mut self, id: QpId, mgid: Gid) {
        self.qp_mut(id).mcast.push(mgid);
    }

    // ----- posting -----

    /// `ibv_post_send`: checked like the device checks it, then queued and the QP driven.
    pub fn post_send(&mut self, id: QpId, wr: SendWr) {
        let qp = self.qp(id);
        let limits = SendLimits {
            qp_type: qp.engine.config().qp_type,
            max_send_sge: 16,
            max_inline_data: 4096,
            max_msg_sz: 1 << 31,
            ud_mtu: qp.attr.path_mtu.bytes().max(Mtu::Mtu4096.bytes()),
            max_rd_atomic: qp
                .attr
                .max_rd_atomic
                .max(u8::from(!qp.engine.config().qp_type.is_reliable())),
            max_tso_header: 0,
        };
        wr.check(&limits)
            .unwrap_or_else(|e| panic!("post_send {id:?}: {e}"));
        self.post_send_unchecked(id, wr);
    }

    pub fn post_send_unchecked(&mut self, id: QpId, wr: SendWr) {
        self.qp_mut(id).engine.post_send(wr);
        self.pump(id);
    }

    /// Work the driver posts for itself ([`QpEngine::post_internal`]).
    pub fn post_internal(&mut self, id: QpId, wr: SendWr) {
        self.qp_mut(id).engine.post_internal(wr);
        self.pump(id);
    }

    /// `ibv_post_recv` on the QP's own receive queue.
    pub fn post_recv(&mut self, id: QpId, wr: RecvWr) {
        self.qp_mut(id).engine.post_recv(wr);
        self.pump(id);
    }

    /// `ibv_post_srq_recv`.
    pub fn post_srq_recv(&mut self, node: usize, srq: usize, wr: RecvWr) {
        self.nodes[node].srqs[srq].queue.push_back(wr);
    }

    // ----- completions -----

    /// Takes every completion from CQ `cq` of `node`.
    pub fn take_cq(&mut self, node: usize, cq: usize) -> Vec<WorkCompletion> {
        std::mem::take(&mut self.nodes[node].cqs[cq])
    }

    pub fn take_send_cq(&mut self, id: QpId) -> Vec<WorkCompletion> {
        let cq = self.qp(id).send_cq;
        self.take_cq(id.node, cq)
    }

    pub fn take_recv_cq(&mut self, id: QpId) -> Vec<WorkCompletion> {
        let cq = self.qp(id).recv_cq;
        self.take_cq(id.node, cq)
    }

    pub fn cq_len(&self, node: usize, cq: usize) -> usize {
        self.nodes[node].cqs[cq].len()
    }

    pub fn send_cq_len(&self, id: QpId) -> usize {
        self.cq_len(id.node, self.qp(id).send_cq)
    }

    pub fn recv_cq_len(&self, id: QpId) -> usize {
        self.cq_len(id.node, self.qp(id).recv_cq)
    }

    pub fn take_events(&mut self, id: QpId) -> Vec<EventType> {
        std::mem::take(&mut self.qp_mut(id).events)
    }

    // ----- driving -----

    /// Drains one QP's outputs: packets onto the network, completions into its CQs, events.
    pub fn pump(&mut self, id: QpId) {
        let now = self.now;
        let mut txs = Vec::new();
        {
            let node = &mut self.nodes[id.node];
            let Some(qp) = node.qps.get_mut(&id.qpn) else {
                return;
            };
            // A spinning engine would never stop producing packets at one instant.
            for n in 0.. {
                let Some(tx) = qp.engine.poll_transmit(now, &node.mem) else {
                    break;
                };
                assert!(
                    n < 1_000_000,
                    "QP {id:?} produced a million packets without time passing"
                );
                txs.push(tx);
            }
            while let Some(Completion { queue, wc }) = qp.engine.poll_completion() {
                let cq = match queue {
                    WorkQueue::Send => qp.send_cq,
                    WorkQueue::Recv => qp.recv_cq,
                    WorkQueue::XrcSrq(srqn) => {
                        node.srqs
                            .iter()
                            .find_map(|s| s.xrc.filter(|x| x.srqn == srqn))
                            .expect("completion for an existing XRC SRQ")
                            .cq
                    }
                    WorkQueue::Internal => {
                        qp.internal.push(wc);
                        continue;
                    }
                };
                node.cqs[cq].push(wc);
            }
            while let Some(ev) = qp.engine.poll_event() {
                qp.events.push(ev);
            }
            if qp.engine.take_error_transition() {
                if self.trace {
                    eprintln!("{:>12} QP {id:?} entered ERR", now.0);
                }
                qp.attr.qp_state = QpState::Err;
                qp.attr.cur_qp_state = QpState::Err;
            }
        }
        for tx in txs {
            self.send(id, tx);
        }
    }

    /// Puts a packet on the network: ICRC, filter, faults, scheduling.
    fn send(&mut self, from: QpId, tx: Transmit) {
        let src_node = &self.nodes[from.node];
        if !src_node.up {
            self.stats.node_down += 1;
            return;
        }
        let src_gid = src_node.gid;
        let mut data = tx.data;
        let src = SocketAddr::new(src_gid.to_ip(), sport(from.qpn));
        let dst = SocketAddr::new(tx.dest.dgid.to_ip(), ROCE_UDP_PORT);
        icrc::fill(src, dst, &mut data).expect("source and destination of one IP family");
        let parsed = RocePacket::parse(&data).expect("the engine emits well-formed packets");
        let payload_len = tx.external.map_or(parsed.payload.len(), |e| e.len as usize);
        self.stats.sent += 1;
        self.stats.external += u64::from(tx.external.is_some());
        self.stats.payload_bytes += payload_len as u64;
        // Serialise on the sender's egress link.
        let wire_bits = (data.len() as u64 + 8 + 40 + 14 + 4 + 20) * 8;
        let link = &mut self.nodes[from.node].link_free;
        let depart = (*link).max(self.now.0) + wire_bits.checked_div(self.net.link_gbps).unwrap_or(0);
        *link = depart;
        let targets: Vec<usize> = if tx.dest.dgid.is_multicast() {
            (0..self.nodes.len())
                .filter(|&n| {
                    self.nodes[n]
                        .qps
                        .values()
                        .any(|q| q.mcast.contains(&tx.dest.dgid))
                })
                .collect()
        } else {
            self.nodes
                .iter()
                .position(|n| n.gid == tx.dest.dgid)
                .into_iter()
                .collect()
        };
        if targets.is_empty() {
            self.stats.no_route += 1;
        }
        for to_node in targets {
            let info = PacketInfo {
                from,
                to_node,
                opcode: parsed.opcode(),
                xrc_srqn: parsed.repr.xrceth.map(|x| x.srqn),
                psn: parsed.repr.bth.psn,
                dest_qpn: parsed.repr.bth.dest_qpn,
                ack_req: parsed.repr.bth.ack_req,
                solicited: parsed.repr.bth.solicited,
                syndrome: parsed.repr.aeth.map(|a| a.syndrome),
                payload_len,
                time: self.now,
            };
            if let Some(log) = &mut self.log {
                log.push(info);
            }
            let mut extra = 0;
            match self.filter.as_mut().map_or(Verdict::Pass, |f| f(&info)) {
                Verdict::Pass => {}
                Verdict::Drop => {
                    self.stats.filtered += 1;
                    self.trace_pkt("filter-drop", &info);
                    continue;
                }
                Verdict::Delay(d) => extra = d,
            }
            if data.len() > self.net.link_mtu {
                self.stats.mtu_dropped += 1;
                self.trace_pkt("mtu-drop", &info);
                continue;
            }
            let key = (from, to_node, info.opcode.as_u8(), info.psn.value());
            let spare =
                self.net.max_burst != 0 && self.bursts.get(&key).is_some_and(|&n| n >= self.net.max_burst);
            if !spare && self.rng.chance(self.net.loss_pct) {
                *self.bursts.entry(key).or_default() += 1;
                self.stats.lost += 1;
                self.trace_pkt("lost", &info);
                continue;
            }
            let copies = if self.rng.chance(self.net.dup_pct) {
                self.stats.duplicated += 1;
                2
            } else {
                1
            };
            // Copies that arrive intact and on time.
            let mut good = 0;
            for _ in 0..copies {
                let mut bytes = data.clone();
                let mut bad = false;
                if !spare && self.rng.chance(self.net.corrupt_pct) {
                    bad = true;
                    self.stats.corrupted += 1;
                    // Any byte but BTH byte 4 (FECN, BECN, reserved): switches may change that
                    // one, so the ICRC deliberately does not cover it.
                    let mut i = self.rng.below(bytes.len() as u64 - 1) as usize;
                    if i >= 4 {
                        i += 1;
                    }
                    bytes[i] ^= 1 << self.rng.below(8);
                }
                let mut at = depart + self.net.latency_ns + extra;
                if !spare && self.rng.chance(self.net.reorder_pct) {
                    bad = true;
                    self.stats.reordered += 1;
                    at += self.rng.below(self.net.reorder_max_ns + 1);
                }
                good += u32::from(!bad);
                self.trace_pkt("send", &info);
                self.seq += 1;
                self.queue.push(Reverse(InFlight {
                    at,
                    seq: self.seq,
                    to_node,
                    src,
                    dst,
                    meta_tc: tx.dest.traffic_class,
                    meta_hop: tx.dest.hop_limit,
                    sgid: src_gid,
                    dgid: tx.dest.dgid,
                    data: bytes,
                    ext: tx.external.map(|e| (from.node, e)),
                }));
            }
            // Corrupted or late counts as a mishap unless an intact, timely copy went too.
            if good == 0 {
                *self.bursts.entry(key).or_default() += 1;
            } else {
                self.bursts.remove(&key);
            }
        }
    }

    fn trace_pkt(&self, what: &str, p: &PacketInfo) {
        if self.trace {
            eprintln!(
                "{:>12} {what:<11} {:?} -> node {} qp {:#x} {:<28} psn {:>8} ackreq {} {:?} len {}",
                self.now.0,
                p.from,
                p.to_node,
                p.dest_qpn,
                p.opcode.name(),
                p.psn.value(),
                p.ack_req as u8,
                p.syndrome,
                p.payload_len
            );
        }
    }

    /// Delivers one packet to its node: ICRC check, parse, route to QP(s), engine, pump.
    fn deliver(&mut self, f: InFlight) {
        if !self.nodes[f.to_node].up {
            self.stats.node_down += 1;
            return;
        }
        if !icrc::verify(f.src, f.dst, &f.data) {
            self.stats.bad_icrc += 1;
            if self.trace {
                eprintln!(
                    "{:>12} bad-icrc    node {} {:02x?}",
                    self.now.0,
                    f.to_node,
                    &f.data[..12.min(f.data.len())]
                );
            }
            return;
        }
        let Ok(mut pkt) = RocePacket::parse(&f.data) else {
            self.stats.malformed += 1;
            return;
        };
        // A payload left in the sender's memory is read now, as a receiver copying it does.
        let ext = f.ext.map(|(from, e)| {
            let mem = &self.nodes[from].mem;
            let bytes: Vec<u8> = e
                .ranges()
                .iter()
                .flat_map(|&(a, l)| mem.peek(a, l as usize))
                .collect();
            pkt.repr.payload_len = bytes.len();
            pkt.repr.bth.pad_count = softverbs_wire::pad_count_for(bytes.len());
            SimExternal(bytes)
        });
        let dest_qpn = pkt.repr.bth.dest_qpn;
        let node = &self.nodes[f.to_node];
        let qpns: Vec<u32> = if dest_qpn == MULTICAST_QPN {
            node.qps
                .iter()
                .filter(|(_, q)| q.mcast.contains(&f.dgid))
                .map(|(&n, _)| n)
                .collect()
        } else if node.qps.contains_key(&dest_qpn) {
            vec![dest_qpn]
        } else {
            Vec::new()
        };
        if qpns.is_empty() {
            self.stats.no_qp += 1;
            return;
        }
        self.stats.delivered += 1;
        let meta = RxMeta {
            sgid: f.sgid,
            dgid: f.dgid,
            traffic_class: f.meta_tc,
            hop_limit: f.meta_hop,
        };
        let now = self.now;
        for qpn in qpns {
            let node = &mut self.nodes[f.to_node];
            let Node { mem, qps, srqs, .. } = node;
            let qp = qps.get_mut(&qpn).expect("routed QP exists");
            let mut domain;
            let srq = match (qp.srq, qp.xrcd) {
                (Some(i), _) => Some(&mut srqs[i] as &mut dyn RecvSource),
                (None, Some(xrcd)) => {
                    domain = XrcDomainSrqs {
                        srqs,
                        xrcd,
                        selected: None,
                    };
                    Some(&mut domain as &mut dyn RecvSource)
                }
                (None, None) => None,
            };
            let rx = match &ext {
                Some(e) => Rx::external(&pkt, e),
                None => Rx::new(&pkt),
            };
            let result = qp.engine.handle_rx(now, &rx, &meta, mem, srq);
            if self.trace {
                eprintln!(
                    "{:>12} deliver     node {} qp {:#x} {:<28} psn {:>8} {:?} -> {:?}",
                    now.0,
                    f.to_node,
                    qpn,
                    pkt.opcode().name(),
                    pkt.repr.bth.psn.value(),
                    pkt.repr.aeth.map(|a| a.syndrome),
                    result
                );
            }
            if let Err(reason) = result {
                qp.drops.push(reason);
                self.stats.engine_dropped += 1;
            }
            self.pump(QpId { node: f.to_node, qpn });
        }
    }

    fn all_qps(&self) -> Vec<QpId> {
        self.nodes
            .iter()
            .enumerate()
            .flat_map(|(node, n)| n.qps.keys().map(move |&qpn| QpId { node, qpn }))
            .collect()
    }

    /// The next instant anything happens: a delivery or an engine timeout.
    pub fn next_event(&self) -> Option<Instant> {
        let delivery = self.queue.peek().map(|Reverse(f)| Instant(f.at));
        let timer = self
            .nodes
            .iter()
            .filter(|n| n.up)
            .flat_map(|n| n.qps.values())
            .filter_map(|q| q.engine.poll_timeout())
            .min();
        match (delivery, timer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// One step: jump to the next event, deliver what is due, fire due timers. False when
    /// nothing is left to happen.
    pub fn step(&mut self) -> bool {
        let Some(next) = self.next_event() else {
            return false;
        };
        self.steps += 1;
        assert!(
            self.steps <= self.max_steps,
            "simulation exceeded {} steps (livelock?)",
            self.max_steps
        );
        self.now = self.now.max(next);
        while self.queue.peek().is_some_and(|Reverse(f)| f.at <= self.now.0) {
            let Reverse(f) = self.queue.pop().expect("peeked");
            self.deliver(f);
        }
        let now = self.now;
        for id in self.all_qps() {
            if !self.nodes[id.node].up {
                continue;
            }
            let due = self.qp(id).engine.poll_timeout().is_some_and(|t| t <= now);
            if due {
                if self.trace {
                    eprintln!("{:>12} timeout     {id:?}", now.0);
                }
                self.qp_mut(id).engine.handle_timeout(now);
                self.pump(id);
            }
        }
        true
    }

    /// Runs until nothing is left to happen (capped at an hour of virtual time).
    pub fn run(&mut self) {
        self.run_for(Duration::from_secs(3600));
    }

    /// Runs until idle or until `d` of virtual time has passed, whichever is first.
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        while self.next_event().is_some_and(|t| t <= end) {
            self.step();
        }
    }

    /// Runs until `cond` holds; panics if the fabric goes idle first or `limit` passes.
    pub fn run_until(&mut self, limit: Duration, mut cond: impl FnMut(&mut Self) -> bool) {
        let end = self.now + limit;
        while !cond(self) {
            match self.next_event() {
                Some(t) if t <= end => {
                    self.step();
                }
                Some(_) => panic!("condition not reached within {limit:?} of virtual time"),
                None => panic!(
                    "fabric went idle before the condition held (virtual time {} ns)",
                    self.now.0
                ),
            }
        }
    }

    /// Lets virtual time pass (timers fire on the way).
    pub fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        while self.next_event().is_some_and(|t| t <= end) {
            self.step();
        }
        self.now = end;
    }
}

// ---------------------------------------------------------------------------------------------
// Options and WR builders

#[derive(Debug, Clone, Copy)]
pub struct QpOpts {
    pub pd: u32,
    pub sq_sig_all: bool,
    pub srq: Option<usize>,
    pub send_cq: Option<usize>,
    pub recv_cq: Option<usize>,
    /// XRC target QPs: the XRC domain whose SRQs they serve.
    pub xrcd: Option<u32>,
}

impl Default for QpOpts {
    fn default() -> Self {
        Self {
            pd: 1,
            sq_sig_all: false,
            srq: None,
            send_cq: None,
            recv_cq: None,
            xrcd: None,
        }
    }
}

/// Connection attributes for RC and UC QPs.
#[derive(Debug, Clone, Copy)]
pub struct ConnOpts {
    pub mtu: Mtu,
    pub psn_a: u32,
    pub psn_b: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub access: AccessFlags,
}

impl Default for ConnOpts {
    fn default() -> Self {
        Self {
            mtu: Mtu::Mtu1024,
            psn_a: 0x1000,
            psn_b: 0x2000,
            // 4.096 us * 2^10 = 4.2 ms: far above the fabric's round trip.
            timeout: 10,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            access: AccessFlags::LOCAL_WRITE
                | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
        }
    }
}

/// Two connected RC QPs on a network losing `loss` % of packets (and corrupting a quarter as
/// many), with a short ACK timeout so that recovery is quick in virtual time.
pub fn lossy_pair(seed: u64, loss: f64, mtu: Mtu) -> (Sim, QpId, QpId) {
    let o = ConnOpts {
        mtu,
        timeout: 8,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(seed, QpType::Rc, &o);
    sim.net = NetConfig {
        corrupt_pct: loss / 4.0,
        ..NetConfig::lossy(loss)
    };
    (sim, a, b)
}

/// Every right a region can have.
pub fn all_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC
}

pub fn recv(wr_id: u64, sges: Vec<Sge>) -> RecvWr {
    RecvWr { wr_id, sg_list: sges }
}

pub fn wr(wr_id: u64, op: SendOp, payload: Payload) -> SendWr {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload,
        ud: None,
        xrc_srqn: None,
    }
}

pub fn send(wr_id: u64, sges: Vec<Sge>) -> SendWr {
    wr(
        wr_id,
        SendOp::Send {
            imm: None,
            invalidate: None,
        },
        Payload::Sges(sges),
    )
}

pub fn write(wr_id: u64, remote: RemoteAddr, sges: Vec<Sge>) -> SendWr {
    wr(wr_id, SendOp::Write { remote, imm: None }, Payload::Sges(sges))
}

pub fn read(wr_id: u64, remote: RemoteAddr, sges: Vec<Sge>) -> SendWr {
    wr(wr_id, SendOp::Read { remote }, Payload::Sges(sges))
}

pub fn cmp_swp(wr_id: u64, remote: RemoteAddr, compare: u64, swap: u64, result: Sge) -> SendWr {
    wr(
        wr_id,
        SendOp::CompareSwap {
            remote,
            compare,
            swap,
        },
        Payload::Sges(vec![result]),
    )
}

pub fn bind_mw(wr_id: u64, bind: MwBind) -> SendWr {
    wr(wr_id, SendOp::BindMw(bind), Payload::Sges(Vec::new()))
}

pub fn local_inv(wr_id: u64, rkey: u32) -> SendWr {
    wr(wr_id, SendOp::LocalInv { rkey }, Payload::Sges(Vec::new()))
}

pub fn send_inv(wr_id: u64, rkey: u32, sges: Vec<Sge>) -> SendWr {
    wr(
        wr_id,
        SendOp::Send {
            imm: None,
            invalidate: Some(rkey),
        },
        Payload::Sges(sges),
    )
}

pub fn fetch_add(wr_id: u64, remote: RemoteAddr, add: u64, result: Sge) -> SendWr {
    wr(
        wr_id,
        SendOp::FetchAdd { remote, add },
        Payload::Sges(vec![result]),
    )
}

/// Asserts a completion's identity and status, with a readable message.
#[track_caller]
pub fn assert_wc(wc: &WorkCompletion, wr_id: u64, status: WcStatus) {
    assert_eq!((wc.wr_id, wc.status), (wr_id, status), "completion {wc:?}");
}

/// Asserts that `wcs` are exactly `ids`, in order, all successful.
#[track_caller]
pub fn assert_ok_in_order(wcs: &[WorkCompletion], ids: &[u64]) {
    let got: Vec<(u64, WcStatus)> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
    let want: Vec<(u64, WcStatus)> = ids.iter().map(|&i| (i, WcStatus::Success)).collect();
    assert_eq!(got, want);
}

/// An IPv4 multicast GID (`::ffff:224.x.y.z`).
pub fn mgid_v4(a: u8, b: u8, c: u8) -> Gid {
    Gid::from_ip(IpAddr::V4(Ipv4Addr::new(224, a, b, c)))
}
