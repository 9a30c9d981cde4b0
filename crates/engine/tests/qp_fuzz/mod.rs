//! A fuzz harness for the transport engine: fuzz bytes become a script ([`script`]) run against
//! two [`QpEngine`]s, one per simulated node, and every output is checked after every step.
//!
//! The same code runs under libFuzzer (`fuzz/fuzz_targets/engine_qp.rs`) and on stable in the
//! test suite (`tests/engine_fuzz_corpus.rs` replays the corpus), and the corpus generator
//! (`fuzz/examples/gen_engine_corpus.rs`) writes its scripts with it; all of them include this
//! directory and the simulator's `sim/mod.rs` (for [`SimMemory`], which checks keys, PDs, bounds
//! and rights as an HCA does) by path.
//!
//! The harness plays the device: QPs change state only through `qp_state::validate_modify` and
//! `apply_modify`, posts are checked with `SendWr::check` and the device's queue and state
//! limits, a received packet goes through the ICRC check the UDP driver makes (a mismatch is
//! dropped over IPv6 and delivered as unverified over IPv4, where the sender's IP ID is
//! unknown), `RocePacket::parse` and routing by destination QP, and timers fire once due.
//!
//! Invariants, checked after every input (a violation panics):
//! * every completion names a WR that was posted and not yet completed, on the queue it was
//!   posted to; send completions come in posting order (the WRs skipped over must be
//!   unsignaled ones that succeeded), receive completions in the order the WRs were posted;
//!   a successful completion is signaled; nothing completes to the driver's internal queue;
//! * new request PSNs follow each other (a READ reserves one per response packet) and
//!   anything else resends a PSN already sent (never on UC or UD); every packet parses, uses
//!   the QP's transport and is addressed to its peer (connected QPs) or to the destination of a
//!   posted WR (UD);
//! * memory changes only where the input may write: the receive buffers and READ/atomic result
//!   buffers of outstanding WRs, and for remote requests the range their RETH or atomic header
//!   names in a region (or window) that has the right; guard areas around every region and
//!   regions without the right stay as they were;
//! * counters never decrease, the engine's state matches the harness's, `poll_timeout` is
//!   never at or before `now` after an input (a driver would spin), a QP in ERR has no
//!   timer, and one input emits a bounded number of packets;
//! * at the end every QP is moved to ERR: then every signaled WR must have completed.

#![allow(dead_code)] // Shared by the fuzz target, the corpus generator and the replay test.

pub(crate) mod script;
mod track;

use std::cell::RefCell;
use std::collections::{BTreeSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use softverbs_engine::memory::{AtomicOp, ExternalPayload, KeyRef, MemError, Memory};
use softverbs_engine::mw::{key_index, MwBind, MwType};
use softverbs_engine::qp_state::{self, PortLimits};
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{
    Completion, QpConfig, QpCounters, QpEngine, RecvSource, RxMeta, WorkQueue, WINDOW,
};
use softverbs_engine::types::{
    AccessFlags, AhAttr, EventType, Gid, GlobalRoute, MigState, Mtu, QpAttr, QpAttrMask, QpState, QpType,
    RecvWr, SendFlags, Sge, WcFlags, WcOpcode, WcStatus,
};
use softverbs_engine::wr::{FlushSelect, Payload, RemoteAddr, SendLimits, SendOp, SendWr, UdDest};
use softverbs_wire::{
    icrc, AethRepr, AethSyndrome, AtomicAckEthRepr, AtomicEthRepr, BthRepr, DethRepr, FethRepr, IethRepr,
    ImmDtRepr, PacketRepr, ParsedPacket, Psn, RethRepr, RocePacket, Transport, XrcEthRepr, OPCODE_TABLE,
    ROCE_UDP_PORT,
};

use crate::sim::{Mr, SimMemory, Srq, XrcDomainSrqs, XrcSrqInfo};
use script::{
    Action, Advance, Connect, Inject, InjectRaw, Modify, PostRecv, PostSend, Reader, RemoteSpec, SetState,
    Setup, SgeSpec, WireOp,
};
use track::{self_overlapping, tainted, Expected, PostedRecv, PostedSend, PsnTrack, Spans, Tag, Write};

/// Regions of each node: length, PD and rights. Region 2 has no local or remote write, region 3
/// belongs to another PD, region 1 is local only; region 5 holds messages of 128 packets at
/// the smallest MTU (a full window).
const REGIONS: [(u64, u32, u32); 6] = [
    (512, 1, 0x3FF),  // every right, windows and FLUSH included
    (512, 1, 0x11),   // LOCAL_WRITE | MW_BIND
    (128, 1, 0x04),   // REMOTE_READ
    (128, 2, 0x0F),   // another PD
    (1024, 1, 0x07),  // LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ
    (32768, 1, 0x07), // the same, large
];
/// Poisoned bytes before, between and after the regions.
const GUARD: u64 = 64;
/// Queue depths, scatter entries and inline bytes, as a QP created with these caps has.
const MAX_WR: usize = 16;
const MAX_SGE: usize = 4;
const MAX_INLINE: u32 = 64;
/// No input may make a QP emit more packets than this: the largest legitimate burst is a full
/// window of RC requests, or every queued UC message at once (each at most four of the largest
/// region at the smallest MTU), plus the READ responses and ACKs one packet may draw.
const MAX_TX_PER_INPUT: usize = MAX_WR * (MAX_SGE * 32768 / 256 + 1) + 2 * WINDOW as usize;
/// Actions per script, and packets the network holds per direction.
const MAX_ACTIONS: usize = 400;
const WIRE_CAP: usize = 512;
/// The XRC SRQs of node 1 (PD 1 and PD 2), in XRC domain 1.
const XRC_SRQN: [u32; 2] = [0x400, 0x401];
const XRC_PD: [u32; 2] = [1, 2];
/// QP numbers of node 0 and node 1.
const QPN: [u32; 2] = [0x11, 0x122];
const PD: u32 = 1;

/// What a corpus reached: the replay test asserts it covers what the corpus is for.
#[derive(Debug, Default, Clone)]
pub(crate) struct Coverage {
    /// (QP type, state) pairs entered.
    pub(crate) states: BTreeSet<(u32, u32)>,
    /// (send queue, opcode, status) of completions.
    pub(crate) completions: BTreeSet<(bool, u32, u32)>,
    /// Opcodes handed to an engine.
    pub(crate) delivered: BTreeSet<u8>,
    /// Async events raised.
    pub(crate) events: BTreeSet<u32>,
    /// Engine counters, summed over the QPs.
    pub(crate) counters: QpCounters,
    pub(crate) bad_icrc: u64,
    pub(crate) unverified: u64,
    pub(crate) malformed: u64,
    pub(crate) no_qp: u64,
    pub(crate) engine_drops: u64,
    pub(crate) rejected: u64,
    pub(crate) actions: u64,
    /// Faithful mode: received messages and READ results whose bytes were compared.
    pub(crate) verified: u64,
}

impl Coverage {
    pub(crate) fn merge(&mut self, o: &Self) {
        self.states.extend(&o.states);
        self.completions.extend(&o.completions);
        self.delivered.extend(&o.delivered);
        self.events.extend(&o.events);
        let (a, b) = (&mut self.counters, &o.counters);
        a.tx_packets += b.tx_packets;
        a.retransmits += b.retransmits;
        a.rx_dropped += b.rx_dropped;
        a.qkey_violations += b.qkey_violations;
        a.pkey_violations += b.pkey_violations;
        a.timeouts += b.timeouts;
        a.spurious_timeouts += b.spurious_timeouts;
        a.tail_probes += b.tail_probes;
        a.rnr_naks_received += b.rnr_naks_received;
        a.seq_naks_received += b.seq_naks_received;
        a.duplicates += b.duplicates;
        self.bad_icrc += o.bad_icrc;
        self.unverified += o.unverified;
        self.malformed += o.malformed;
        self.no_qp += o.no_qp;
        self.engine_drops += o.engine_drops;
        self.rejected += o.rejected;
        self.actions += o.actions;
        self.verified += o.verified;
    }
}

/// Runs one script; panics on any violated invariant.
pub(crate) fn run(data: &[u8]) -> Coverage {
    let mut r = Reader::new(data);
    let mut setup = Setup::default();
    setup.io(&mut r);
    let mut h = Harness::new(&setup);
    while !r.done() && h.step < MAX_ACTIONS {
        let mut a = Action::Dereg(Default::default());
        a.io(&mut r);
        h.act(&a);
    }
    h.finish();
    h.cov
}

struct Node {
    gid: Gid,
    mem: SimMemory,
    base: u64,
    len: usize,
    /// Regions and whether they are still registered.
    regions: Vec<(Mr, bool)>,
    /// Keys of the windows as allocated (type 1, type 2); the current tag is the window's.
    windows: [u32; 2],
    srqs: Vec<Srq>,
    /// Per SRQ: WRs posted and not completed, in posting order.
    srq_posted: Vec<VecDeque<PostedRecv>>,
    /// Memory as it was after the last input.
    snapshot: Vec<u8>,
    /// Faithful mode: every write, with the step and what it was for.
    log: Vec<Write>,
}

struct Qp {
    engine: QpEngine,
    attr: QpAttr,
    srq: Option<usize>,
    xrc_tgt: bool,
    sends: VecDeque<PostedSend>,
    recvs: VecDeque<PostedRecv>,
    psn: PsnTrack,
    counters: QpCounters,
    /// The request PSN this QP should see next, as far as the harness can tell (to aim
    /// injected packets).
    rx_next: Psn,
}

struct Harness {
    now: Instant,
    ipv6: bool,
    adaptive: bool,
    nodes: [Node; 2],
    qps: [Qp; 2],
    /// Packets QP i sent towards node 1 - i, oldest first, with their ICRC.
    wire: [VecDeque<Vec<u8>>; 2],
    next_wr_id: u64,
    step: usize,
    current: Option<Action>,
    cov: Coverage,
    /// No packet is injected or corrupted (setup flag 32): data must arrive intact.
    faithful: bool,
    /// Faithful mode, both QPs connected afresh and in RTS or SQD since: `expect[q]` are the
    /// messages QP q's responder must execute, in order.
    stream_ok: bool,
    expect: [VecDeque<Expected>; 2],
    /// What the input being handled is for (see [`Tag`]).
    tag: Tag,
}

/// A node's memory as the engine sees it, recording the ranges it wrote: only those need
/// checking after an input (the engine reaches memory only through this trait; the whole of it,
/// guard areas included, is compared once more at the end).
struct Watch<'a> {
    mem: &'a SimMemory,
    writes: RefCell<Vec<(u64, u64)>>,
}

impl<'a> Watch<'a> {
    fn new(mem: &'a SimMemory) -> Self {
        Self {
            mem,
            writes: RefCell::new(Vec::new()),
        }
    }

    /// Records a write that succeeded, at the address it reached: through a window (a key
    /// with the top bit set, as `SimMemory` makes them) that is the window's translation.
    fn note<T>(&self, r: Result<T, MemError>, key: KeyRef, addr: u64, len: u64) -> Result<T, MemError> {
        if r.is_ok() && len > 0 {
            let at = if key.access.is_remote() && key.key & 0x8000_0000 != 0 {
                let (_, iova) = self
                    .mem
                    .window(key.key)
                    .resolve(key, addr, len)
                    .expect("the window let the write through");
                iova
            } else {
                addr
            };
            self.writes.borrow_mut().push((at, len));
        }
        r
    }

    fn take(self) -> Vec<(u64, u64)> {
        self.writes.into_inner()
    }
}

impl Memory for Watch<'_> {
    fn read(&self, key: KeyRef, addr: u64, dst: &mut [u8]) -> Result<(), MemError> {
        self.mem.read(key, addr, dst)
    }

    fn write(&self, key: KeyRef, addr: u64, src: &[u8]) -> Result<(), MemError> {
        self.note(self.mem.write(key, addr, src), key, addr, src.len() as u64)
    }

    fn check(&self, key: KeyRef, addr: u64, len: u64) -> Result<(), MemError> {
        self.mem.check(key, addr, len)
    }

    fn atomic(&self, key: KeyRef, addr: u64, op: AtomicOp) -> Result<u64, MemError> {
        self.note(self.mem.atomic(key, addr, op), key, addr, 8)
    }

    fn bind_mw(&self, qpn: u32, pd: u32, bind: &MwBind) -> Result<(), MemError> {
        self.mem.bind_mw(qpn, pd, bind)
    }

    fn invalidate(&self, qpn: u32, pd: u32, rkey: u32) -> Result<(), MemError> {
        self.mem.invalidate(qpn, pd, rkey)
    }

    fn flush(&self, key: KeyRef, addr: u64, len: u64, whole_region: bool) -> Result<(), MemError> {
        self.mem.flush(key, addr, len, whole_region)
    }

    fn write_external(
        &self,
        key: KeyRef,
        addr: u64,
        src: &dyn ExternalPayload,
        offset: u64,
        len: u64,
    ) -> Result<(), MemError> {
        self.note(
            self.mem.write_external(key, addr, src, offset, len),
            key,
            addr,
            len,
        )
    }

    fn locate(&self, key: KeyRef, addr: u64, len: u64) -> Result<Option<u64>, MemError> {
        self.mem.locate(key, addr, len)
    }
}

/// The initial contents of a node's memory: a pattern that differs per byte and per node, so
/// a misplaced copy shows.
fn poison(node: usize, len: usize) -> Vec<u8> {
    static POISON: std::sync::OnceLock<[Vec<u8>; 2]> = std::sync::OnceLock::new();
    let p = POISON.get_or_init(|| {
        let total = (REGIONS.iter().map(|r| r.0 + GUARD).sum::<u64>() + 2 * GUARD) as usize;
        [0u8, 1].map(|i| {
            (0..total)
                .map(|k| (k as u8).wrapping_mul(31) ^ (0xA5 + i))
                .collect()
        })
    });
    p[node][..len].to_vec()
}

/// `QP_FUZZ_TRACE=1` prints every action, delivery and completion (to read a crash).
fn trace() -> bool {
    static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("QP_FUZZ_TRACE").is_some())
}

fn sport(qpn: u32) -> u16 {
    0xC000 | (qpn & 0x3FFF) as u16
}

fn access(bits: u8) -> AccessFlags {
    let map = [
        AccessFlags::LOCAL_WRITE,
        AccessFlags::REMOTE_WRITE,
        AccessFlags::REMOTE_READ,
        AccessFlags::REMOTE_ATOMIC,
        AccessFlags::MW_BIND,
        AccessFlags::FLUSH_GLOBAL,
        AccessFlags::FLUSH_PERSISTENT,
        AccessFlags::ZERO_BASED,
    ];
    map.iter()
        .enumerate()
        .filter(|(i, _)| bits & (1 << i) != 0)
        .fold(AccessFlags::empty(), |a, (_, f)| a | *f)
}

fn mw_access(bits: u8) -> AccessFlags {
    let map = [
        AccessFlags::REMOTE_READ,
        AccessFlags::REMOTE_WRITE,
        AccessFlags::REMOTE_ATOMIC,
        AccessFlags::ZERO_BASED,
        AccessFlags::LOCAL_WRITE,
    ];
    map.iter()
        .enumerate()
        .filter(|(i, _)| bits & (1 << i) != 0)
        .fold(AccessFlags::empty(), |a, (_, f)| a | *f)
}

fn state(v: u8) -> QpState {
    QpState::from_raw(u32::from(v % 7)).expect("0..=6 are states")
}

fn mtu(v: u8) -> Mtu {
    Mtu::from_raw(1 + u32::from(v % 5)).expect("1..=5 are MTUs")
}

/// PSNs a READ of `len` bytes takes: one per response packet, at least one.
fn read_psns(len: u32, mtu: Mtu) -> u32 {
    len.div_ceil(mtu.bytes()).max(1)
}

fn signed(v: u16) -> u64 {
    v as i16 as i64 as u64
}

impl Harness {
    fn new(setup: &Setup) -> Self {
        let ipv6 = setup.flags & 1 != 0;
        let kind = setup.transport % 4;
        let types = match kind {
            0 => [QpType::Rc; 2],
            1 => [QpType::Uc; 2],
            2 => [QpType::Ud; 2],
            _ => [QpType::XrcSend, QpType::XrcRecv],
        };
        let xrc = kind == 3;
        let nodes = [0, 1].map(|i| {
            let gid = if ipv6 {
                Gid::from(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, i as u16 + 1))
            } else {
                Gid::from(Ipv4Addr::new(10, 0, 0, i as u8 + 1))
            };
            let mem = SimMemory::new(i);
            let base = mem.alloc(GUARD);
            let mut regions = Vec::new();
            for &(len, pd, bits) in &REGIONS {
                let mr = mem.alloc_mr(pd, len, AccessFlags::from_bits_truncate(bits));
                regions.push((mr, true));
                mem.alloc(GUARD);
            }
            let end = mem.alloc(0);
            let len = (end - base) as usize;
            let poison = poison(i, len);
            mem.poke(base, &poison);
            let windows = [mem.alloc_mw(PD, MwType::Type1), mem.alloc_mw(PD, MwType::Type2)];
            let srqs: Vec<Srq> = if xrc && i == 1 {
                (0..2)
                    .map(|k| Srq {
                        xrc: Some(XrcSrqInfo {
                            srqn: XRC_SRQN[k],
                            xrcd: 1,
                            pd: XRC_PD[k],
                            cq: 0,
                        }),
                        ..Srq::default()
                    })
                    .collect()
            } else if !xrc && setup.flags & (4 << (1 - i)) != 0 {
                vec![Srq::default()]
            } else {
                Vec::new()
            };
            Node {
                gid,
                mem,
                base,
                len,
                regions,
                windows,
                srq_posted: srqs.iter().map(|_| VecDeque::new()).collect(),
                srqs,
                snapshot: poison,
                log: Vec::new(),
            }
        });
        let adaptive = setup.flags & 16 == 0;
        let qps = [0, 1].map(|i| {
            let qp_type = types[i];
            let has_srq = !nodes[i].srqs.is_empty() && !xrc;
            let mut engine = QpEngine::new(QpConfig {
                qp_type,
                qpn: QPN[i],
                pd: if qp_type == QpType::XrcRecv { 0 } else { PD },
                sq_sig_all: setup.flags & 2 != 0,
                has_srq,
            });
            engine.set_adaptive_retransmit(adaptive);
            Qp {
                engine,
                attr: QpAttr::default(),
                srq: has_srq.then_some(0),
                xrc_tgt: qp_type == QpType::XrcRecv,
                sends: VecDeque::new(),
                recvs: VecDeque::new(),
                psn: PsnTrack::default(),
                counters: QpCounters::default(),
                rx_next: Psn::ZERO,
            }
        });
        Self {
            now: Instant(1_000_000),
            ipv6,
            adaptive,
            nodes,
            qps,
            wire: [VecDeque::new(), VecDeque::new()],
            next_wr_id: 1,
            step: 0,
            current: None,
            cov: Coverage::default(),
            faithful: setup.flags & 32 != 0,
            stream_ok: false,
            expect: [VecDeque::new(), VecDeque::new()],
            tag: Tag::Other,
        }
    }

    #[track_caller]
    fn fail(&self, msg: impl std::fmt::Display) -> ! {
        panic!(
            "engine invariant violated at step {} (virtual time {} ns): {msg}\n  action: {:?}\n  QP states: {} {}",
            self.step,
            self.now.0,
            self.current,
            self.qps[0].attr.qp_state,
            self.qps[1].attr.qp_state,
        );
    }

    fn qp_type(&self, q: usize) -> QpType {
        self.qps[q].engine.config().qp_type
    }

    fn addr(&self, node: usize, port: u16) -> SocketAddr {
        SocketAddr::new(self.nodes[node].gid.to_ip(), port)
    }

    fn act(&mut self, a: &Action) {
        if trace() {
            eprintln!("step {} at {} ns: {a:?}", self.step, self.now.0);
        }
        self.step += 1;
        self.cov.actions += 1;
        self.current = Some(a.clone());
        let forged = matches!(a, Action::Inject(_) | Action::InjectRaw(_))
            || matches!(a, Action::Wire(w) if w.op % 7 == 4);
        if self.faithful && forged {
            self.cov.rejected += 1;
            return;
        }
        match a {
            Action::Connect(c) => self.connect(c),
            Action::Modify(m) => self.modify_action(m),
            Action::SetState(s) => self.set_state(s),
            Action::PostSend(p) => self.post_send(p),
            Action::PostRecv(p) => self.post_recv(p),
            Action::Wire(w) => self.wire_op(w),
            Action::Inject(i) => self.inject(i),
            Action::InjectRaw(r) => self.inject_raw(r),
            Action::Advance(t) => self.advance(t),
            Action::Dereg(d) => {
                let node = usize::from(d.node % 2);
                let r = usize::from(d.region) % REGIONS.len();
                let (mr, valid) = &mut self.nodes[node].regions[r];
                *valid = false;
                self.nodes[node].mem.dereg(mr);
            }
        }
    }

    // ----- state changes -----

    fn limits_gid(&self, q: usize) -> [Gid; 1] {
        [self.nodes[q].gid]
    }

    /// `ibv_modify_qp` as the device does it. Returns whether it was accepted.
    fn modify(&mut self, q: usize, attr: &QpAttr, mask: QpAttrMask) -> bool {
        let qp_type = self.qp_type(q);
        let mask = qp_state::effective_mask(qp_type, mask);
        let gids = self.limits_gid(q);
        let limits = PortLimits {
            phys_port_cnt: 1,
            pkey_tbl_len: 1,
            gid_table: &gids,
            max_mtu: Mtu::Mtu4096,
            max_qp_init_rd_atom: 16,
            max_qp_rd_atom: 16,
        };
        let qp = &mut self.qps[q];
        let prev = qp.attr.qp_state;
        let Ok(next) = qp_state::validate_modify(qp_type, prev, attr, mask, &limits) else {
            self.cov.rejected += 1;
            return false;
        };
        qp_state::apply_modify(&mut qp.attr, attr, mask, next);
        qp.engine.set_attr(self.now, &qp.attr);
        if !matches!(qp_type, QpType::Ud) && matches!(next, QpState::Rtr | QpState::Rts) {
            qp.engine.set_adaptive_retransmit(self.adaptive);
        }
        self.entered(q, prev, next);
        self.after_input(q, &Spans::default());
        true
    }

    /// Bookkeeping for a state the QP entered.
    fn entered(&mut self, q: usize, prev: QpState, next: QpState) {
        self.cov.states.insert((self.qp_type(q).raw(), next.raw()));
        if !(matches!(prev, QpState::Rts | QpState::Sqd) && matches!(next, QpState::Rts | QpState::Sqd)) {
            self.stream_ok = false;
            self.expect = [VecDeque::new(), VecDeque::new()];
        }
        if self.faithful && next == QpState::Reset {
            // Packets of an earlier connection would be taken for this one's (a real peer
            // would have picked new PSNs).
            self.wire = [VecDeque::new(), VecDeque::new()];
        }
        let qp = &mut self.qps[q];
        if next == QpState::Reset {
            // RESET discards the queues without completions; a receive the QP had taken from
            // its SRQ for a message in progress is gone with it.
            qp.sends.clear();
            qp.recvs.clear();
            let srqs: Vec<usize> = if qp.xrc_tgt {
                (0..self.nodes[q].srqs.len()).collect()
            } else {
                qp.srq.into_iter().collect()
            };
            let node = &mut self.nodes[q];
            for i in srqs {
                let queued: Vec<u64> = node.srqs[i].queue.iter().map(|w| w.wr_id).collect();
                node.srq_posted[i].retain(|p| queued.contains(&p.wr_id));
            }
        }
        if prev == QpState::Init && next == QpState::Rtr {
            qp.rx_next = Psn::new(qp.attr.rq_psn);
        }
        if prev == QpState::Rtr && next == QpState::Rts {
            qp.psn.reset(qp.attr.sq_psn);
        }
    }

    fn peer_ah(&self, q: usize) -> AhAttr {
        AhAttr {
            grh: GlobalRoute {
                dgid: self.nodes[1 - q].gid,
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

    fn connect(&mut self, c: &Connect) {
        use QpAttrMask as M;
        let targets: &[usize] = match c.qp % 3 {
            0 => &[0],
            1 => &[1],
            _ => &[0, 1],
        };
        for &q in targets {
            let (sq_psn, rq_psn) = if q == 0 {
                (c.psn0, c.psn1)
            } else {
                (c.psn1, c.psn0)
            };
            let qp_type = self.qp_type(q);
            if self.qps[q].attr.qp_state != QpState::Reset {
                let reset = QpAttr {
                    qp_state: QpState::Reset,
                    ..QpAttr::default()
                };
                self.modify(q, &reset, M::STATE);
            }
            let init = QpAttr {
                qp_state: QpState::Init,
                pkey_index: 0,
                port_num: 1,
                qp_access_flags: access(c.access & 0x7F),
                qkey: c.qkey,
                ..QpAttr::default()
            };
            let extra = if qp_type == QpType::Ud {
                M::QKEY
            } else {
                M::ACCESS_FLAGS
            };
            if !self.modify(q, &init, M::STATE | M::PKEY_INDEX | M::PORT | extra) || c.upto % 3 == 0 {
                continue;
            }
            let required = |from, to| {
                M::STATE
                    | qp_state::transition_masks(qp_type, from, to)
                        .expect("a defined transition")
                        .required
            };
            let rtr = QpAttr {
                qp_state: QpState::Rtr,
                path_mtu: mtu(c.mtu),
                dest_qp_num: QPN[1 - q],
                rq_psn,
                max_dest_rd_atomic: c.max_dest_rd % 17,
                min_rnr_timer: c.min_rnr % 32,
                ah_attr: self.peer_ah(q),
                ..QpAttr::default()
            };
            if !self.modify(q, &rtr, required(QpState::Init, QpState::Rtr)) || c.upto % 3 == 1 {
                continue;
            }
            let rts = QpAttr {
                qp_state: QpState::Rts,
                sq_psn,
                timeout: c.timeout % 32,
                retry_cnt: c.retry % 8,
                rnr_retry: c.rnr_retry % 8,
                max_rd_atomic: c.max_rd % 17,
                ..QpAttr::default()
            };
            self.modify(q, &rts, required(QpState::Rtr, QpState::Rts));
        }
        // Only a reliable transport delivers every message, once and in order.
        let reliable = self.qp_type(0).is_reliable();
        if self.faithful
            && reliable
            && targets.len() == 2
            && self.qps.iter().all(|q| q.attr.qp_state == QpState::Rts)
        {
            self.stream_ok = true;
        }
    }

    fn modify_action(&mut self, m: &Modify) {
        let q = usize::from(m.qp % 2);
        let dgid = match m.dgid % 5 {
            0 => self.nodes[1 - q].gid,
            1 => self.nodes[q].gid,
            2 => Gid::ZERO,
            3 => Gid::from_ip(IpAddr::V4(Ipv4Addr::new(224, 0, 0, 9))),
            _ if self.ipv6 => Gid::from(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x77)),
            _ => Gid::from(Ipv4Addr::new(10, 0, 0, 77)),
        };
        let attr = QpAttr {
            qp_state: state(m.state),
            cur_qp_state: state(m.cur_state),
            path_mtu: mtu(m.mtu),
            path_mig_state: MigState::from_raw(u32::from(m.mig % 3)).expect("0..=2"),
            qkey: m.qkey,
            rq_psn: m.rq_psn,
            sq_psn: m.sq_psn,
            dest_qp_num: if m.dest_qpn % 2 == 0 {
                QPN[1 - q]
            } else {
                m.sq_psn & 0xFF_FFFF
            },
            qp_access_flags: access(m.access),
            ah_attr: AhAttr {
                grh: GlobalRoute {
                    dgid,
                    flow_label: m.rq_psn,
                    sgid_index: m.sgid_index % 3,
                    hop_limit: 64,
                    traffic_class: 0,
                },
                is_global: true,
                port_num: 1,
                ..AhAttr::default()
            },
            pkey_index: u16::from(m.pkey_index % 2),
            en_sqd_async_notify: m.notify % 2 == 1,
            max_rd_atomic: m.max_rd % 17,
            max_dest_rd_atomic: m.max_dest_rd % 17,
            min_rnr_timer: m.min_rnr % 32,
            port_num: m.port % 3,
            timeout: m.timeout % 32,
            retry_cnt: m.retry % 8,
            rnr_retry: m.rnr_retry % 8,
            ..QpAttr::default()
        };
        self.modify(q, &attr, QpAttrMask::from_bits_retain(m.mask));
    }

    fn set_state(&mut self, s: &SetState) {
        let q = usize::from(s.qp % 2);
        let next = state(s.state);
        if next == QpState::Sqe {
            // The HCA's own transition on a UC/UD send error; nothing in the engine or the
            // device makes it, and the state table only leaves it (SQE->RTS).
            let unreliable = matches!(self.qp_type(q), QpType::Uc | QpType::Ud);
            let qp = &mut self.qps[q];
            if qp.attr.qp_state == QpState::Rts && unreliable {
                qp.attr.qp_state = QpState::Sqe;
                qp.attr.cur_qp_state = QpState::Sqe;
                qp.engine.set_attr(self.now, &qp.attr);
                self.entered(q, QpState::Rts, QpState::Sqe);
                self.after_input(q, &Spans::default());
            } else {
                self.cov.rejected += 1;
            }
            return;
        }
        let notify = next == QpState::Sqd && s.notify % 2 == 1;
        let attr = QpAttr {
            qp_state: next,
            en_sqd_async_notify: notify,
            ..QpAttr::default()
        };
        let mut mask = QpAttrMask::STATE;
        if notify {
            mask |= QpAttrMask::EN_SQD_ASYNC_NOTIFY;
        }
        self.modify(q, &attr, mask);
    }

    // ----- work requests -----

    fn region(&self, node: usize, i: usize) -> Mr {
        self.nodes[node].regions[i].0
    }

    /// The address an `(sel, off)` pair names, given the base of the key's region.
    fn address(&self, node: usize, sel: u8, off: u16, key_base: u64, key_region: usize) -> u64 {
        match (sel >> 4) % 4 {
            0 => key_base.wrapping_add(signed(off)),
            1 => u64::MAX - u64::from(off),
            2 => u64::from(off),
            _ => self
                .region(node, (key_region + 1) % REGIONS.len())
                .addr
                .wrapping_add(signed(off)),
        }
    }

    fn sge(&self, node: usize, s: &SgeSpec) -> Sge {
        let (lkey, r) = match usize::from(s.region & 15) % 8 {
            i @ 0..=4 => (self.region(node, i).lkey, i),
            5 => (self.region(node, 0).rkey, 0),
            6 => (0x0BAD_0001, 0),
            _ => (self.region(node, 5).lkey, 5),
        };
        Sge {
            addr: self.address(node, s.region, s.off, self.region(node, r).addr, r),
            length: s.len,
            lkey,
        }
    }

    fn sges(&self, node: usize, n: u8, specs: [&SgeSpec; 4]) -> Vec<Sge> {
        specs
            .iter()
            .take(usize::from(n) % (MAX_SGE + 2))
            .map(|s| self.sge(node, s))
            .collect()
    }

    /// A window's current key.
    fn window_key(&self, node: usize, w: usize) -> u32 {
        self.nodes[node].mem.window(self.nodes[node].windows[w]).rkey
    }

    fn remote(&self, node: usize, r: &RemoteSpec) -> RemoteAddr {
        let (rkey, base, region) = match usize::from(r.region & 15) % 10 {
            i @ 0..=4 => {
                let mr = self.region(node, i);
                (mr.rkey, mr.addr, i)
            }
            i @ (5 | 6) => {
                let win = self.nodes[node].mem.window(self.nodes[node].windows[i - 5]);
                let base = match win.target {
                    Some(t) if t.access.contains(AccessFlags::ZERO_BASED) => 0,
                    Some(t) => t.addr,
                    None => self.region(node, 0).addr,
                };
                (win.rkey, base, 0)
            }
            7 => (self.region(node, 0).lkey, self.region(node, 0).addr, 0),
            8 => (0x0BAD_0002, self.region(node, 0).addr, 0),
            _ => {
                let mr = self.region(node, 5);
                (mr.rkey, mr.addr, 5)
            }
        };
        RemoteAddr {
            addr: self.address(node, r.region, r.off, base, region),
            rkey,
        }
    }

    fn send_op(&self, q: usize, p: &PostSend) -> SendOp {
        let peer = 1 - q;
        let remote = self.remote(peer, &p.remote);
        let imm = Some(p.imm);
        match p.op % 12 {
            0 => SendOp::Send {
                imm: None,
                invalidate: None,
            },
            1 => SendOp::Send {
                imm,
                invalidate: None,
            },
            2 => {
                let rkey = match p.mw.mw % 4 {
                    w @ (0 | 1) => self.window_key(peer, usize::from(w)),
                    2 => self.region(peer, 0).rkey,
                    _ => 0x8000_7700,
                };
                SendOp::Send {
                    imm: None,
                    invalidate: Some(rkey),
                }
            }
            3 => SendOp::Write { remote, imm: None },
            4 => SendOp::Write { remote, imm },
            5 => SendOp::Read { remote },
            6 => SendOp::CompareSwap {
                remote,
                compare: p.compare,
                swap: p.value,
            },
            7 => SendOp::FetchAdd { remote, add: p.value },
            8 => {
                let m = &p.mw;
                let mw_rkey = if m.mw & 4 != 0 {
                    0x8000_7700
                } else {
                    self.window_key(q, usize::from(m.mw % 2))
                };
                let (mr_lkey, base) = match usize::from(m.region % 7) {
                    i @ (0..=4 | 6) => {
                        let i = if i == 6 { 5 } else { i };
                        let mr = self.region(q, i);
                        (mr.lkey, mr.addr)
                    }
                    _ => (0x0BAD_0003, self.region(q, 0).addr),
                };
                SendOp::BindMw(MwBind {
                    mw_rkey,
                    new_rkey: (mw_rkey & !0xFF) | u32::from(m.tag),
                    mr_lkey,
                    addr: base.wrapping_add(signed(m.off)),
                    length: u64::from(m.len),
                    access: mw_access(m.access),
                })
            }
            9 => {
                let key = self.window_key(q, usize::from(p.mw.mw % 2));
                let rkey = if p.mw.mw & 4 != 0 {
                    key.wrapping_sub(1)
                } else {
                    key
                };
                SendOp::LocalInv { rkey }
            }
            10 => SendOp::AtomicWrite {
                remote,
                value: p.value.to_ne_bytes(),
            },
            _ => SendOp::Flush {
                remote,
                len: p.remote.len,
                placement: (p.value & 3) as u8,
                select: if p.value & 4 != 0 {
                    FlushSelect::Mr
                } else {
                    FlushSelect::Range
                },
            },
        }
    }

    /// The bytes of `[addr, addr + len)` of node `node`, if they are in its memory.
    fn bytes(&self, node: usize, addr: u64, len: u64) -> Option<Vec<u8>> {
        if len == 0 {
            return Some(Vec::new());
        }
        let n = &self.nodes[node];
        let end = addr.checked_add(len)?;
        (addr >= n.base && end <= n.base + n.len as u64).then(|| n.mem.peek(addr, len as usize))
    }

    /// A send payload's bytes and where they are (for gather lists inside registered
    /// regions; `None` if some entry is not, which fails the WR).
    fn payload_bytes(&self, q: usize, payload: &Payload) -> (Option<Vec<u8>>, Vec<(u64, u64)>) {
        match payload {
            Payload::Inline(b) => (Some(b.clone()), Vec::new()),
            Payload::Sges(sges) => {
                let src: Vec<(u64, u64)> = sges.iter().map(|s| (s.addr, u64::from(s.length))).collect();
                let regions = &self.nodes[q].regions;
                let mut data = Some(Vec::new());
                for s in sges.iter().filter(|s| s.length > 0) {
                    let inside = regions.iter().any(|(mr, valid)| {
                        *valid
                            && mr.lkey == s.lkey
                            && s.addr >= mr.addr
                            && s.addr
                                .checked_add(u64::from(s.length))
                                .is_some_and(|e| e <= mr.addr + mr.len)
                    });
                    match (inside, self.bytes(q, s.addr, u64::from(s.length)), &mut data) {
                        (true, Some(b), Some(d)) => d.extend(b),
                        _ => data = None,
                    }
                }
                (data, src)
            }
            Payload::Headed { .. } => (None, Vec::new()),
        }
    }

    /// The first `len` bytes a scatter list holds.
    fn scattered(&self, node: usize, sges: &[Sge], len: u64) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        let mut left = len;
        for s in sges {
            if left == 0 {
                break;
            }
            let take = left.min(u64::from(s.length));
            out.extend(self.bytes(node, s.addr, take)?);
            left -= take;
        }
        (left == 0).then_some(out)
    }

    fn post_send(&mut self, p: &PostSend) {
        let q = usize::from(p.qp % 2);
        let peer = 1 - q;
        let qp_type = self.qp_type(q);
        if matches!(
            self.qps[q].attr.qp_state,
            QpState::Reset | QpState::Init | QpState::Rtr
        ) || self.qps[q].engine.send_queue_len() >= MAX_WR
        {
            self.cov.rejected += 1;
            return;
        }
        let op = self.send_op(q, p);
        let mut flags = SendFlags::empty();
        for (bit, f) in [
            SendFlags::FENCE,
            SendFlags::SIGNALED,
            SendFlags::SOLICITED,
            SendFlags::INLINE,
        ]
        .into_iter()
        .enumerate()
        {
            if p.flags & (1 << bit) != 0 {
                flags |= f;
            }
        }
        let payload = if flags.contains(SendFlags::INLINE) {
            Payload::Inline(vec![p.fill; usize::from(p.inline_len)])
        } else {
            Payload::Sges(self.sges(q, p.nsge, [&p.sge0, &p.sge1, &p.sge2, &p.sge3]))
        };
        let ud = (qp_type == QpType::Ud).then(|| UdDest {
            dgid: match (p.ud >> 4) % 3 {
                0 => self.nodes[peer].gid,
                1 => self.nodes[q].gid,
                _ if self.ipv6 => Gid::from(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x77)),
                _ => Gid::from(Ipv4Addr::new(10, 0, 0, 77)),
            },
            sgid_index: 0,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
            qpn: match p.ud % 4 {
                0 => QPN[peer],
                1 => QPN[q],
                2 => softverbs_wire::MULTICAST_QPN,
                _ => 0xABCD,
            },
            qkey: match (p.ud >> 2) % 3 {
                0 => self.qps[peer].attr.qkey,
                1 => 0x8000_0000,
                _ => 0x1111_2222,
            },
        });
        let xrc_srqn = match p.xrc % 4 {
            k @ (0 | 1) => Some(XRC_SRQN[usize::from(k)]),
            2 => Some(0x999),
            _ => None,
        };
        let wr_id = self.next_wr_id;
        self.next_wr_id += 1;
        let wr = SendWr {
            wr_id,
            op,
            flags,
            payload,
            ud,
            xrc_srqn,
        };
        let limits = SendLimits {
            qp_type,
            max_send_sge: MAX_SGE as u32,
            max_inline_data: MAX_INLINE,
            max_msg_sz: 1 << 31,
            ud_mtu: 4096,
            max_rd_atomic: self.qps[q].attr.max_rd_atomic,
            max_tso_header: 0,
        };
        if wr.check(&limits).is_err() {
            self.cov.rejected += 1;
            return;
        }
        let sges = match (&wr.payload, op.is_read_or_atomic()) {
            (Payload::Sges(s), true) => s.clone(),
            _ => Vec::new(),
        };
        let carries_message = matches!(op, SendOp::Send { .. } | SendOp::Write { imm: Some(_), .. });
        if self.stream_ok && carries_message {
            let (data, src) = self.payload_bytes(q, &wr.payload);
            let (imm, inv) = match op {
                SendOp::Send { imm, invalidate } => (imm, invalidate),
                SendOp::Write { imm, .. } => (imm, None),
                _ => (None, None),
            };
            self.expect[peer].push_back(Expected {
                wr_id,
                data,
                src,
                posted: self.step,
                len: wr.payload.len(),
                imm,
                inv,
                write_imm: matches!(op, SendOp::Write { .. }),
                xrc_srqn,
            });
        }
        let step = self.step;
        let qp = &mut self.qps[q];
        qp.sends.push_back(PostedSend {
            wr_id,
            signaled: qp.engine.config().sq_sig_all || flags.contains(SendFlags::SIGNALED),
            op,
            len: wr.payload.len(),
            sges,
            ud,
            posted: step,
            psns: None,
        });
        qp.engine.post_send(wr);
        self.after_input(q, &Spans::default());
    }

    fn post_recv(&mut self, p: &PostRecv) {
        let q = usize::from(p.qp % 2);
        let xrc = self.qp_type(0) == QpType::XrcSend;
        // XRC receives go to the target's SRQs, on node 1.
        let node = if xrc { 1 } else { q };
        let sges = self.sges(node, p.nsge, [&p.sge0, &p.sge1, &p.sge2, &p.sge3]);
        if sges.len() > MAX_SGE {
            self.cov.rejected += 1;
            return;
        }
        let wr_id = self.next_wr_id;
        self.next_wr_id += 1;
        let srq = if xrc {
            Some(usize::from(p.srq % 2))
        } else {
            self.qps[q].srq
        };
        let posted = PostedRecv {
            wr_id,
            sges: sges.clone(),
            posted: self.step,
        };
        let wr = RecvWr { wr_id, sg_list: sges };
        if let Some(i) = srq {
            let n = &mut self.nodes[node];
            if n.srqs[i].queue.len() >= MAX_WR {
                self.cov.rejected += 1;
                return;
            }
            n.srqs[i].queue.push_back(wr);
            n.srq_posted[i].push_back(posted);
            return;
        }
        let qp = &mut self.qps[q];
        if qp.attr.qp_state == QpState::Reset || qp.engine.recv_queue_len() >= MAX_WR {
            self.cov.rejected += 1;
            return;
        }
        qp.recvs.push_back(posted);
        qp.engine.post_recv(wr);
        self.after_input(q, &Spans::default());
    }

    // ----- the network -----

    fn wire_op(&mut self, w: &WireOp) {
        let dir = usize::from(w.dir % 2);
        match w.op % 7 {
            0 => {
                if let Some(p) = self.wire[dir].pop_front() {
                    self.deliver(1 - dir, &p);
                }
            }
            1 => {
                self.wire[dir].pop_front();
            }
            2 => {
                if let Some(p) = self.wire[dir].front().cloned() {
                    self.deliver(1 - dir, &p);
                }
            }
            3 => {
                if let Some(p) = self.wire[dir].pop_front() {
                    self.wire[dir].push_back(p);
                }
            }
            4 => {
                if let Some(mut p) = self.wire[dir].pop_front() {
                    let at = usize::from(w.pos) % p.len();
                    p[at] ^= w.xor.max(1);
                    if w.count % 2 == 1 {
                        let _ = icrc::fill(
                            self.addr(dir, sport(QPN[dir])),
                            self.addr(1 - dir, ROCE_UDP_PORT),
                            &mut p,
                        );
                    }
                    self.deliver(1 - dir, &p);
                }
            }
            5 => {
                for _ in 0..=(w.count % 64) {
                    let Some(p) = self.wire[dir].pop_front() else {
                        break;
                    };
                    self.deliver(1 - dir, &p);
                }
            }
            _ => self.pump(),
        }
    }

    /// Delivers in both directions until both are quiet.
    fn pump(&mut self) {
        for _ in 0..4096 {
            let mut any = false;
            for dir in 0..2 {
                if let Some(p) = self.wire[dir].pop_front() {
                    self.deliver(1 - dir, &p);
                    any = true;
                }
            }
            if !any {
                return;
            }
        }
    }

    /// A packet arrives at node `to` from the other node: ICRC, parse and routing as the
    /// device does them, then the engine, then every check.
    fn deliver(&mut self, to: usize, data: &[u8]) {
        let from = 1 - to;
        let (src, dst) = (self.addr(from, sport(QPN[from])), self.addr(to, ROCE_UDP_PORT));
        // `icrc::verify` is bypassed under cfg(fuzzing); comparing here keeps the fuzzer and the
        // replay on stable identical.
        let icrc_ok = matches!((icrc::compute(src, dst, data), icrc::read(data)), (Ok(a), Some(b)) if a == b);
        if !icrc_ok {
            if self.ipv6 {
                self.cov.bad_icrc += 1;
                return;
            }
            self.cov.unverified += 1;
        }
        let Ok(pkt) = RocePacket::parse(data) else {
            self.cov.malformed += 1;
            return;
        };
        if pkt.repr.bth.dest_qpn != QPN[to] {
            self.cov.no_qp += 1;
            return;
        }
        self.cov.delivered.insert(pkt.opcode().as_u8());
        let spans = self.write_spans(to, &pkt);
        self.tag = self.tag_for(to, &pkt);
        let meta = RxMeta {
            sgid: self.nodes[from].gid,
            dgid: self.nodes[to].gid,
            traffic_class: 0,
            hop_limit: 64,
        };
        let now = self.now;
        let Self { nodes, qps, .. } = self;
        let (node, qp) = (&mut nodes[to], &mut qps[to]);
        let mut domain;
        let srq: Option<&mut dyn RecvSource> = if qp.xrc_tgt {
            domain = XrcDomainSrqs {
                srqs: &mut node.srqs,
                xrcd: 1,
                selected: None,
            };
            Some(&mut domain)
        } else {
            qp.srq.map(|i| &mut node.srqs[i] as &mut dyn RecvSource)
        };
        let mem = Watch::new(&node.mem);
        let result = qp.engine.handle_packet(now, &pkt, &meta, &mem, srq);
        let wrote = mem.take();
        if trace() {
            eprintln!(
                "  deliver to {to}: {} psn {} ackreq {} {:?} -> {result:?}",
                pkt.opcode().name(),
                pkt.repr.bth.psn,
                pkt.repr.bth.ack_req,
                pkt.repr.aeth.map(|a| a.syndrome)
            );
        }
        if result.is_err() {
            self.cov.engine_drops += 1;
        } else if pkt.opcode().is_request() && pkt.repr.bth.psn == qp.rx_next {
            let reserve = match pkt.repr.reth {
                Some(r) if pkt.opcode().is_read() => read_psns(r.dma_len, qp.attr.path_mtu),
                _ => 1,
            };
            qp.rx_next = pkt.repr.bth.psn + reserve;
        }
        self.after_input_wrote(to, &spans, wrote);
        self.tag = Tag::Other;
    }

    /// What a packet for QP `q` writes memory for: a response for the request it answers, a
    /// SEND for the oldest receive of the queue it lands in.
    fn tag_for(&self, q: usize, pkt: &ParsedPacket<'_>) -> Tag {
        let op = pkt.opcode();
        if op.is_response() {
            return Tag::Response(q, pkt.repr.bth.psn);
        }
        if !op.is_send() {
            return Tag::Other;
        }
        let qp = &self.qps[q];
        let queue = if qp.xrc_tgt {
            let srqn = pkt.repr.xrceth.map(|x| x.srqn);
            match XRC_SRQN.iter().position(|&n| Some(n) == srqn) {
                Some(i) => &self.nodes[q].srq_posted[i],
                None => return Tag::Other,
            }
        } else {
            match qp.srq {
                Some(i) => &self.nodes[q].srq_posted[i],
                None => &qp.recvs,
            }
        };
        queue.front().map_or(Tag::Other, |r| Tag::Recv(r.wr_id))
    }

    /// Where a packet delivered to QP `q` may write: the buffers of outstanding WRs it could
    /// complete, and the remote range it names in a region or window with the right.
    fn write_spans(&self, q: usize, pkt: &ParsedPacket<'_>) -> Spans {
        let mut s = Spans::default();
        let op = pkt.opcode();
        let node = &self.nodes[q];
        let qp = &self.qps[q];
        if op.is_response() {
            for w in &qp.sends {
                s.add_sges(&w.sges, &node.regions);
            }
            return s;
        }
        let pds: Vec<u32> = if qp.xrc_tgt {
            match pkt.repr.xrceth {
                Some(x) if op.starts_message() => XRC_SRQN
                    .iter()
                    .zip(XRC_PD)
                    .filter(|(n, _)| **n == x.srqn)
                    .map(|(_, pd)| pd)
                    .collect(),
                _ => XRC_PD.to_vec(),
            }
        } else {
            vec![PD]
        };
        if op.is_send() {
            for r in &qp.recvs {
                s.add_sges(&r.sges, &node.regions);
            }
            for posted in &node.srq_posted {
                for r in posted {
                    s.add_sges(&r.sges, &node.regions);
                }
            }
        } else if op.is_write() || op.is_atomic_write() {
            match pkt.repr.reth {
                Some(r) => {
                    let len = if op.is_atomic_write() {
                        8
                    } else {
                        u64::from(r.dma_len)
                    };
                    self.remote_span(&mut s, q, &pds, r.rkey, r.va, len, AccessFlags::REMOTE_WRITE);
                }
                None => {
                    // MIDDLE or LAST: the message in progress, somewhere the QP may write.
                    for (mr, valid) in &node.regions {
                        if *valid && pds.contains(&mr.pd) && mr.access.contains(AccessFlags::REMOTE_WRITE) {
                            s.add_within(mr, mr.addr, mr.len);
                        }
                    }
                    for w in 0..2 {
                        let key = self.window_key(q, w);
                        self.remote_span(&mut s, q, &pds, key, 0, 0, AccessFlags::REMOTE_WRITE);
                    }
                }
            }
        } else if op.is_atomic() {
            if let Some(a) = pkt.repr.atomic_eth {
                self.remote_span(&mut s, q, &pds, a.rkey, a.va, 8, AccessFlags::REMOTE_ATOMIC);
            }
        }
        s
    }

    /// `[va, va + len)` of the region `rkey` names if it has `right`; all of a window's range
    /// if `rkey` names a bound window with `right`.
    #[allow(clippy::too_many_arguments)]
    fn remote_span(
        &self,
        s: &mut Spans,
        q: usize,
        pds: &[u32],
        rkey: u32,
        va: u64,
        len: u64,
        right: AccessFlags,
    ) {
        let node = &self.nodes[q];
        for (mr, valid) in &node.regions {
            if *valid && mr.rkey == rkey && pds.contains(&mr.pd) && mr.access.contains(right) {
                s.add_within(mr, va, len);
            }
        }
        for &w in &node.windows {
            if key_index(w) != key_index(rkey) {
                continue;
            }
            let win = node.mem.window(w);
            let Some(t) = win
                .target
                .filter(|t| win.rkey == rkey && t.access.contains(right))
            else {
                continue;
            };
            if !pds.contains(&win.pd) {
                continue;
            }
            for (mr, valid) in &node.regions {
                if *valid && mr.lkey == t.mr_lkey {
                    s.add_within(mr, t.addr, t.length);
                }
            }
        }
    }

    fn inject(&mut self, i: &Inject) {
        let q = usize::from(i.qp % 2);
        let info = &OPCODE_TABLE[usize::from(i.opcode) % OPCODE_TABLE.len()];
        let op = info.opcode;
        let qp = &self.qps[q];
        let delta = signed(i.psn as u16) as u32;
        let psn = match i.psn_base % 5 {
            0 => qp.rx_next + delta,
            1 => Psn::new(qp.attr.rq_psn) + delta,
            2 => qp.psn.next + delta,
            3 => qp.psn.first() + delta,
            _ => Psn::new(i.psn),
        };
        let dest_qpn = if i.dest % 8 == 7 {
            i.src_qpn & 0xFF_FFFF
        } else {
            QPN[q]
        };
        let mtu = qp.attr.path_mtu.bytes() as usize;
        let payload_len = if !op.has_payload() {
            0
        } else if op.is_atomic_write() && i.len & 0x8000 == 0 {
            8
        } else {
            usize::from(i.len) % (mtu + 65)
        };
        let mut bth = BthRepr::new(op, dest_qpn, psn);
        bth.ack_req = i.bth & 1 != 0;
        bth.solicited = i.bth & 2 != 0;
        if i.bth & 4 != 0 {
            bth.pkey = 0x1234;
        }
        bth.migreq = i.bth & 8 != 0;
        bth.fecn = i.bth & 16 != 0;
        bth.becn = i.bth & 32 != 0;
        let mut repr = PacketRepr::new(bth, payload_len);
        let has = |h| info.headers.contains(h);
        use softverbs_wire::Header as H;
        if has(H::Deth) {
            repr.deth = Some(DethRepr {
                qkey: if i.qkey % 2 == 0 { qp.attr.qkey } else { i.src_qpn },
                src_qpn: if i.qkey & 2 == 0 {
                    QPN[1 - q]
                } else {
                    i.src_qpn & 0xFF_FFFF
                },
            });
        }
        if has(H::XrcEth) {
            repr.xrceth = Some(XrcEthRepr {
                srqn: match i.xrc % 3 {
                    k @ (0 | 1) => XRC_SRQN[usize::from(k)],
                    _ => i.src_qpn & 0xFF_FFFF,
                },
            });
        }
        if has(H::Feth) {
            repr.feth = Some(FethRepr {
                placement: i.feth_placement,
                selectivity: i.feth_select,
            });
        }
        if has(H::Reth) {
            let r = self.remote(q, &i.reth);
            repr.reth = Some(RethRepr {
                va: r.addr,
                rkey: r.rkey,
                dma_len: match i.reth.len {
                    0 => payload_len as u32,
                    n => n - 1,
                },
            });
        }
        if has(H::AtomicEth) {
            let r = self.remote(q, &i.atomic);
            repr.atomic_eth = Some(AtomicEthRepr {
                va: r.addr,
                rkey: r.rkey,
                swap_add: i.swap,
                compare: i.compare,
            });
        }
        if has(H::Aeth) {
            repr.aeth = Some(AethRepr {
                syndrome: AethSyndrome::from_u8(i.aeth).unwrap_or(AethSyndrome::ACK_UNLIMITED),
                msn: i.msn & 0xFF_FFFF,
            });
        }
        if has(H::AtomicAckEth) {
            repr.atomic_ack_eth = Some(AtomicAckEthRepr { orig: i.swap });
        }
        if has(H::ImmDt) {
            repr.imm_dt = Some(ImmDtRepr { imm_data: i.imm });
        }
        if has(H::Ieth) {
            repr.ieth = Some(IethRepr {
                rkey: match i.ieth % 4 {
                    w @ (0 | 1) => self.window_key(q, usize::from(w)),
                    2 => self.region(q, 0).rkey,
                    _ => i.imm,
                },
            });
        }
        let payload: Vec<u8> = (0..payload_len).map(|k| i.fill.wrapping_add(k as u8)).collect();
        let mut data = vec![0u8; repr.buffer_len()];
        if repr.emit_with_payload(&mut data, &payload).is_err() {
            self.cov.malformed += 1;
            return;
        }
        if i.mut_xor != 0 {
            let at = usize::from(i.mut_pos) % data.len();
            data[at] ^= i.mut_xor;
        }
        if i.icrc % 4 != 3 {
            let from = 1 - q;
            let _ = icrc::fill(
                self.addr(from, sport(QPN[from])),
                self.addr(q, ROCE_UDP_PORT),
                &mut data,
            );
        }
        self.deliver(q, &data);
    }

    fn inject_raw(&mut self, r: &InjectRaw) {
        let q = usize::from(r.qp % 2);
        let mut data = r.data.clone();
        if r.icrc % 2 == 1 {
            let from = 1 - q;
            let _ = icrc::fill(
                self.addr(from, sport(QPN[from])),
                self.addr(q, ROCE_UDP_PORT),
                &mut data,
            );
        }
        self.deliver(q, &data);
    }

    // ----- time -----

    fn next_deadline(&self) -> Option<Instant> {
        self.qps.iter().filter_map(|q| q.engine.poll_timeout()).min()
    }

    fn fire_timers(&mut self, force: bool) {
        for q in 0..2 {
            let due = self.qps[q].engine.poll_timeout().is_some_and(|t| t <= self.now);
            if due || force {
                self.qps[q].engine.handle_timeout(self.now);
                self.after_input(q, &Spans::default());
            }
        }
    }

    fn advance(&mut self, t: &Advance) {
        let amount = u64::from(t.amount);
        match t.mode % 6 {
            0 => self.now = Instant(self.now.0 + amount),
            1 => self.now = Instant(self.now.0 + amount * 1_000),
            2 => self.now = Instant(self.now.0 + amount * 100_000),
            3 => {
                let next = self
                    .next_deadline()
                    .unwrap_or(self.now + Duration::from_millis(1));
                self.now = self.now.max(next);
            }
            4 => return self.fire_timers(true),
            _ => {
                // Like the simulator's run: the network, then the next timer, until quiet.
                let end = self.now + Duration::from_secs(10);
                for _ in 0..64 {
                    self.pump();
                    match self.next_deadline() {
                        Some(t) if t <= end => self.now = self.now.max(t),
                        _ => break,
                    }
                    self.fire_timers(false);
                }
                return;
            }
        }
        self.fire_timers(false);
    }

    // ----- checking -----

    /// After every input to QP `q`: drains its outputs and checks everything. `spans` is
    /// where the input may have written memory.
    fn after_input(&mut self, q: usize, spans: &Spans) {
        self.after_input_wrote(q, spans, Vec::new());
    }

    /// [`Harness::after_input`] for an input that already wrote these ranges.
    fn after_input_wrote(&mut self, q: usize, spans: &Spans, mut wrote: Vec<(u64, u64)>) {
        let mut n = 0;
        loop {
            let tx = {
                let Self { nodes, qps, now, .. } = &mut *self;
                let mem = Watch::new(&nodes[q].mem);
                let tx = qps[q].engine.poll_transmit(*now, &mem);
                wrote.extend(mem.take());
                tx
            };
            let Some(tx) = tx else { break };
            n += 1;
            if n > MAX_TX_PER_INPUT {
                self.fail(format!(
                    "QP {q} emitted more than {MAX_TX_PER_INPUT} packets for one input"
                ));
            }
            self.check_transmit(q, tx);
        }
        // Checked once this input's writes are logged: a completion's data check must see a
        // write that landed in its buffer during the same input (a late response of an earlier
        // READ into an overlapping buffer, say).
        let mut completions = Vec::new();
        while let Some(c) = self.qps[q].engine.poll_completion() {
            completions.push(c);
        }
        while let Some(e) = self.qps[q].engine.poll_event() {
            self.cov.events.insert(e.raw());
            let qp = &self.qps[q];
            let fits = match e {
                EventType::SqDrained => qp.attr.qp_state == QpState::Sqd,
                EventType::CommEst => qp.attr.qp_state == QpState::Rtr,
                EventType::QpLastWqeReached => qp.srq.is_some() || qp.xrc_tgt,
                _ => true,
            };
            if !fits {
                self.fail(format!("QP {q}: event {e:?} in {}", qp.attr.qp_state));
            }
        }
        if self.qps[q].engine.take_error_transition() {
            let prev = self.qps[q].attr.qp_state;
            let attr = &mut self.qps[q].attr;
            attr.qp_state = QpState::Err;
            attr.cur_qp_state = QpState::Err;
            self.entered(q, prev, QpState::Err);
        }
        let qp = &self.qps[q];
        if qp.engine.state() != qp.attr.qp_state {
            self.fail(format!(
                "QP {q}: the engine is in {} but was last moved to {}",
                qp.engine.state(),
                qp.attr.qp_state
            ));
        }
        match qp.engine.poll_timeout() {
            Some(t) if t <= self.now => self.fail(format!(
                "QP {q}: poll_timeout {} ns is not after now {} ns: the driver would spin",
                t.0, self.now.0
            )),
            Some(t) if qp.attr.qp_state == QpState::Err => {
                self.fail(format!("QP {q}: a timer at {} ns in the ERR state", t.0))
            }
            _ => {}
        }
        if qp.engine.send_queue_len() > qp.sends.len() || qp.engine.recv_queue_len() > qp.recvs.len() {
            self.fail(format!(
                "QP {q}: the engine holds {} send and {} receive WRs, but only {} and {} are outstanding",
                qp.engine.send_queue_len(),
                qp.engine.recv_queue_len(),
                qp.sends.len(),
                qp.recvs.len()
            ));
        }
        let (old, new) = (qp.counters, qp.engine.counters());
        let pairs = [
            ("tx_packets", old.tx_packets, new.tx_packets),
            ("retransmits", old.retransmits, new.retransmits),
            ("rx_dropped", old.rx_dropped, new.rx_dropped),
            ("qkey_violations", old.qkey_violations, new.qkey_violations),
            ("pkey_violations", old.pkey_violations, new.pkey_violations),
            ("timeouts", old.timeouts, new.timeouts),
            ("spurious_timeouts", old.spurious_timeouts, new.spurious_timeouts),
            ("tail_probes", old.tail_probes, new.tail_probes),
            ("rnr_naks_received", old.rnr_naks_received, new.rnr_naks_received),
            ("seq_naks_received", old.seq_naks_received, new.seq_naks_received),
            ("duplicates", old.duplicates, new.duplicates),
        ];
        for (name, a, b) in pairs {
            if b < a {
                self.fail(format!("QP {q}: counter {name} went from {a} to {b}"));
            }
        }
        self.qps[q].counters = new;
        // Only QP q's node can have changed, and only where the engine wrote through it.
        for (addr, len) in wrote {
            if !spans.covers(addr, len) {
                let n = &self.nodes[q];
                let place = n
                    .regions
                    .iter()
                    .position(|(mr, _)| (mr.addr..mr.addr + mr.len).contains(&addr))
                    .map_or("a guard area".to_string(), |r| format!("region {r}"));
                self.fail(format!(
                    "node {q}: {len} bytes written at {addr:#x} ({place}), where this input may not write \
                     (it may write {spans:x?})"
                ));
            }
            let (step, tag, faithful) = (self.step, self.tag, self.faithful);
            let n = &mut self.nodes[q];
            let off = (addr - n.base) as usize;
            n.snapshot[off..off + len as usize].copy_from_slice(&n.mem.peek(addr, len as usize));
            if faithful {
                n.log.push(Write {
                    start: addr,
                    end: addr + len,
                    step,
                    tag,
                });
            }
        }
        for c in completions {
            self.check_completion(q, c);
        }
    }

    fn check_memory(&mut self, node: usize, allowed: &Spans) {
        const CHUNK: usize = 64;
        let n = &self.nodes[node];
        let cur = n.mem.peek(n.base, n.len);
        for (c, (now, was)) in cur.chunks(CHUNK).zip(n.snapshot.chunks(CHUNK)).enumerate() {
            if now == was {
                continue;
            }
            for (k, (&now, &was)) in now.iter().zip(was).enumerate() {
                let addr = n.base + (c * CHUNK + k) as u64;
                if now == was || allowed.contains(addr) {
                    continue;
                }
                let place = n
                    .regions
                    .iter()
                    .position(|(mr, _)| (mr.addr..mr.addr + mr.len).contains(&addr))
                    .map_or("a guard area".to_string(), |r| format!("region {r}"));
                self.fail(format!(
                    "node {node}: byte {addr:#x} ({place}) changed from {was:#04x} to {now:#04x}, \
                     where this input may not write"
                ));
            }
        }
        self.nodes[node].snapshot = cur;
    }

    fn check_transmit(&mut self, q: usize, tx: softverbs_engine::transport::Transmit) {
        let peer = 1 - q;
        let qp_type = self.qp_type(q);
        let mut data = tx.data;
        if tx.external.is_some() {
            self.fail("a payload left in memory, which was never allowed");
        }
        let src = self.addr(q, sport(QPN[q]));
        let dst = SocketAddr::new(tx.dest.dgid.to_ip(), ROCE_UDP_PORT);
        let routable = icrc::fill(src, dst, &mut data).is_ok();
        let Ok(pkt) = RocePacket::parse(&data) else {
            self.fail(format!(
                "QP {q} emitted a packet that does not parse: {data:02x?}"
            ));
        };
        let op = pkt.opcode();
        let bth = pkt.repr.bth;
        let transport_ok = match qp_type {
            QpType::Rc => op.transport() == Transport::Rc,
            QpType::Uc => op.transport() == Transport::Uc && op.is_request(),
            QpType::Ud => op.transport() == Transport::Ud && op.is_request(),
            QpType::XrcSend => op.transport() == Transport::Xrc && op.is_request(),
            QpType::XrcRecv => op.transport() == Transport::Xrc && op.is_response(),
            QpType::RawPacket => false,
        };
        if !transport_ok || bth.pkey != softverbs_wire::bth::DEFAULT_PKEY {
            self.fail(format!(
                "{qp_type} QP {q} emitted {} with P_Key {:#x}",
                op.name(),
                bth.pkey
            ));
        }
        let qp = &self.qps[q];
        if qp_type == QpType::Ud {
            let deth_ok = pkt.repr.deth.is_some_and(|d| d.src_qpn == QPN[q]);
            let addressed = qp.sends.iter().any(|w| {
                w.ud.is_some_and(|u| u.dgid == tx.dest.dgid && u.qpn == bth.dest_qpn)
            });
            if !deth_ok || !addressed {
                self.fail(format!(
                    "UD QP {q} sent to {:?} QP {:#x} (DETH {:?}), which no posted WR names",
                    tx.dest.dgid, bth.dest_qpn, pkt.repr.deth
                ));
            }
        } else if bth.dest_qpn != qp.attr.dest_qp_num || tx.dest.dgid != qp.attr.ah_attr.grh.dgid {
            self.fail(format!(
                "QP {q} sent {} to {:?} QP {:#x}; its peer is {:?} QP {:#x}",
                op.name(),
                tx.dest.dgid,
                bth.dest_qpn,
                qp.attr.ah_attr.grh.dgid,
                qp.attr.dest_qp_num
            ));
        }
        if op.is_request() {
            let reserve = match pkt.repr.reth {
                Some(r) if op.is_read() => read_psns(r.dma_len, qp.attr.path_mtu),
                _ => 1,
            };
            let reliable = qp_type.is_reliable();
            match self.qps[q].psn.on_request(bth.psn, reserve, reliable) {
                // A new READ: WQEs start in posting order, so it is the oldest READ not yet
                // started.
                Ok(false) if op.is_read() => {
                    if let Some(w) = self.qps[q]
                        .sends
                        .iter_mut()
                        .find(|w| matches!(w.op, SendOp::Read { .. }) && w.psns.is_none())
                    {
                        w.psns = Some((bth.psn, reserve));
                    }
                }
                Ok(_) => {}
                Err(e) => self.fail(format!("QP {q} ({qp_type}) {}: {e}", op.name())),
            }
        }
        if routable && tx.dest.dgid == self.nodes[peer].gid {
            let w = &mut self.wire[q];
            if w.len() >= WIRE_CAP {
                w.pop_front();
            }
            w.push_back(data);
        }
    }

    fn check_completion(&mut self, q: usize, c: Completion) {
        let wc = c.wc;
        if trace() {
            eprintln!(
                "  QP {q} completion {:?} wr {} {:?} {:?} len {}",
                c.queue, wc.wr_id, wc.opcode, wc.status, wc.byte_len
            );
        }
        self.cov
            .completions
            .insert((c.queue == WorkQueue::Send, wc.opcode.raw(), wc.status.raw()));
        if wc.qp_num != QPN[q] {
            self.fail(format!("QP {q}: a completion names QP {:#x}: {wc:?}", wc.qp_num));
        }
        let recv_srq = match c.queue {
            WorkQueue::Send => {
                let qp = &mut self.qps[q];
                let Some(pos) = qp.sends.iter().position(|w| w.wr_id == wc.wr_id) else {
                    self.fail(format!(
                        "QP {q}: send completion for a WR not outstanding (never posted, or completed already): {wc:?}"
                    ));
                };
                if let Some(skipped) = qp.sends.iter().take(pos).find(|w| w.signaled) {
                    let id = skipped.wr_id;
                    self.fail(format!(
                        "QP {q}: send completion for WR {} before the signaled WR {id} posted earlier",
                        wc.wr_id
                    ));
                }
                let w = track::take_through(&mut qp.sends, pos)
                    .pop()
                    .expect("pos is in range");
                if wc.opcode != w.op.wc_opcode() {
                    self.fail(format!(
                        "QP {q}: completion opcode {:?} for a {:?}",
                        wc.opcode, w.op
                    ));
                }
                if wc.status == WcStatus::Success {
                    if !w.signaled {
                        self.fail(format!(
                            "QP {q}: a successful completion of the unsignaled WR {}",
                            w.wr_id
                        ));
                    }
                    if u64::from(wc.byte_len) != w.len {
                        self.fail(format!(
                            "QP {q}: WR {} of {} bytes completed with byte_len {}",
                            w.wr_id, w.len, wc.byte_len
                        ));
                    }
                    if self.faithful {
                        self.check_read_data(q, &w);
                    }
                }
                return;
            }
            WorkQueue::Recv => {
                if self.qps[q].xrc_tgt || self.qp_type(q) == QpType::XrcSend {
                    self.fail(format!(
                        "XRC QP {q}: a completion on its own receive queue: {wc:?}"
                    ));
                }
                self.qps[q].srq
            }
            WorkQueue::XrcSrq(srqn) => {
                let idx = XRC_SRQN.iter().position(|&n| n == srqn);
                match idx {
                    Some(i) if self.qps[q].xrc_tgt => Some(i),
                    _ => self.fail(format!("QP {q}: a completion for XRC SRQ {srqn:#x}: {wc:?}")),
                }
            }
            WorkQueue::Internal => self.fail(format!(
                "QP {q}: a completion to the driver, which posted nothing: {wc:?}"
            )),
        };
        let queue = match recv_srq {
            Some(i) => &self.nodes[q].srq_posted[i],
            None => &self.qps[q].recvs,
        };
        let Some(front) = queue.front() else {
            self.fail(format!(
                "QP {q}: receive completion with no receive outstanding: {wc:?}"
            ));
        };
        if front.wr_id != wc.wr_id {
            let outstanding = queue.iter().any(|r| r.wr_id == wc.wr_id);
            self.fail(format!(
                "QP {q}: receive completion for WR {} (outstanding: {outstanding}) while WR {} was posted first",
                wc.wr_id, front.wr_id
            ));
        }
        let queue = match recv_srq {
            Some(i) => &mut self.nodes[q].srq_posted[i],
            None => &mut self.qps[q].recvs,
        };
        let r = queue.pop_front().expect("front exists");
        if self.stream_ok {
            self.check_message(q, &c, &r);
        }
        if wc.status == WcStatus::Success {
            let room: u64 = r.sges.iter().map(|s| u64::from(s.length)).sum();
            if !matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                self.fail(format!("QP {q}: receive completion with opcode {:?}", wc.opcode));
            }
            if wc.opcode == WcOpcode::Recv && u64::from(wc.byte_len) > room {
                self.fail(format!(
                    "QP {q}: received {} bytes into {room} bytes of buffers",
                    wc.byte_len
                ));
            }
        }
    }

    /// Faithful mode: a READ that succeeded holds the bytes of its remote range, unless those
    /// or its own buffer were written meanwhile by anything but its responses.
    fn check_read_data(&mut self, q: usize, w: &PostedSend) {
        let SendOp::Read { remote } = w.op else { return };
        if remote.rkey & 0x8000_0000 != 0 {
            // Through a window: its addresses may be offsets, and its binding may have moved.
            return;
        }
        let Some((first, n)) = w.psns else {
            self.fail(format!(
                "QP {q}: READ {} completed, but no request for it was sent",
                w.wr_id
            ));
        };
        let peer = 1 - q;
        let own = |t: Tag| matches!(t, Tag::Response(p, psn) if p == q && first.distance(psn) < n);
        let local_tainted = w
            .sges
            .iter()
            .any(|s| tainted(&self.nodes[q].log, w.posted, s.addr, u64::from(s.length), own));
        let remote_tainted = tainted(&self.nodes[peer].log, w.posted, remote.addr, w.len, |_| false);
        if local_tainted || remote_tainted || self_overlapping(&w.sges) {
            return;
        }
        let (Some(got), Some(want)) = (
            self.scattered(q, &w.sges, w.len),
            self.bytes(peer, remote.addr, w.len),
        ) else {
            return;
        };
        self.cov.verified += 1;
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            self.fail(format!(
                "QP {q}: READ {} of {} bytes completed, but byte {at} is {:#04x} where the source holds {:#04x}",
                w.wr_id, w.len, got[at], want[at]
            ));
        }
    }

    /// Faithful mode: a receive completes for the next message its peer posted, with that
    /// message's length, immediate data and (unless either buffer was written meanwhile by
    /// something else) bytes.
    fn check_message(&mut self, q: usize, c: &Completion, r: &PostedRecv) {
        let wc = &c.wc;
        if wc.status == WcStatus::WrFlushErr {
            // Flushed, not consumed by a message.
            return;
        }
        let Some(e) = self.expect[q].pop_front() else {
            self.fail(format!(
                "QP {q}: receive {} completed, but its peer sent no message: {wc:?}",
                r.wr_id
            ));
        };
        if wc.status != WcStatus::Success {
            return;
        }
        let want_opcode = if e.write_imm {
            WcOpcode::RecvRdmaWithImm
        } else {
            WcOpcode::Recv
        };
        let flags_ok = wc.wc_flags.contains(WcFlags::WITH_IMM) == e.imm.is_some()
            && wc.wc_flags.contains(WcFlags::WITH_INV) == e.inv.is_some();
        let imm_ok = match (e.imm, e.inv) {
            (Some(v), _) | (None, Some(v)) => wc.imm_data == v,
            (None, None) => true,
        };
        let srq_ok = match c.queue {
            WorkQueue::XrcSrq(n) => e.xrc_srqn == Some(n),
            _ => true,
        };
        if wc.opcode != want_opcode || u64::from(wc.byte_len) != e.len || !flags_ok || !imm_ok || !srq_ok {
            self.fail(format!(
                "QP {q}: receive {} completed as {wc:?} on {:?} for WR {} of its peer ({} bytes, imm {:?}, inv {:?}, write {}, SRQ {:?})",
                r.wr_id, c.queue, e.wr_id, e.len, e.imm, e.inv, e.write_imm, e.xrc_srqn
            ));
        }
        let Some(data) = e.data.filter(|_| !e.write_imm) else {
            return;
        };
        let peer = 1 - q;
        let src_tainted = e
            .src
            .iter()
            .any(|&(a, l)| tainted(&self.nodes[peer].log, e.posted, a, l, |_| false));
        let own = |t: Tag| t == Tag::Recv(r.wr_id);
        let dst_tainted = r
            .sges
            .iter()
            .any(|s| tainted(&self.nodes[q].log, r.posted, s.addr, u64::from(s.length), own));
        if src_tainted || dst_tainted || self_overlapping(&r.sges) {
            return;
        }
        self.cov.verified += 1;
        match self.scattered(q, &r.sges, e.len) {
            Some(got) if got == data => {}
            Some(got) => {
                let at = got.iter().zip(&data).position(|(a, b)| a != b).unwrap_or(0);
                self.fail(format!(
                    "QP {q}: receive {} of WR {} ({} bytes): byte {at} is {:#04x}, the sender's was {:#04x}",
                    r.wr_id, e.wr_id, e.len, got[at], data[at]
                ));
            }
            None => self.fail(format!("QP {q}: receive {} succeeded outside memory", r.wr_id)),
        }
    }

    /// Moves every QP to ERR and checks that every signaled WR completed.
    fn finish(&mut self) {
        self.current = None;
        // Nothing may have changed memory behind the engine's writes (guards included).
        for node in 0..2 {
            self.check_memory(node, &Spans::default());
        }
        for q in 0..2 {
            if !matches!(self.qps[q].attr.qp_state, QpState::Reset | QpState::Err) {
                let attr = QpAttr {
                    qp_state: QpState::Err,
                    ..QpAttr::default()
                };
                if !self.modify(q, &attr, QpAttrMask::STATE) {
                    self.fail(format!("QP {q}: moving to ERR was refused"));
                }
            }
            let qp = &self.qps[q];
            if let Some(w) = qp.sends.iter().find(|w| w.signaled) {
                self.fail(format!("QP {q}: the signaled WR {} never completed", w.wr_id));
            }
            if qp.engine.send_queue_len() != 0 || qp.engine.recv_queue_len() != 0 {
                self.fail(format!("QP {q}: WRs left in the engine after ERR"));
            }
            if let Some(r) = qp.recvs.front() {
                self.fail(format!("QP {q}: the receive WR {} never completed", r.wr_id));
            }
            self.cov.merge(&Coverage {
                counters: qp.engine.counters(),
                ..Coverage::default()
            });
        }
        for node in &self.nodes {
            for (srq, posted) in node.srqs.iter().zip(&node.srq_posted) {
                let queued: Vec<u64> = srq.queue.iter().map(|w| w.wr_id).collect();
                let tracked: Vec<u64> = posted.iter().map(|w| w.wr_id).collect();
                if queued != tracked {
                    self.fail(format!(
                        "an SRQ holds {queued:?} but {tracked:?} are outstanding: a WR taken from it never completed"
                    ));
                }
            }
        }
    }
}
