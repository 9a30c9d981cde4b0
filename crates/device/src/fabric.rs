//! Moving packets: each device has a `Node` (its QPs, memory keys and inbound packets), and
//! the process-wide `Fabric` carries packets between nodes and runs the progress thread.
//!
//! Progress happens in three places, so that nothing waits on the application:
//! - the thread that posts a work request drives the fabric until it is quiet, so an exchange
//!   between QPs of this process completes at once;
//! - polling an empty CQ drives it too (a single-threaded program that posts and then polls
//!   always completes);
//! - the progress thread sleeps until the earliest transport deadline (retransmission, RNR
//!   wait) and handles it; it uses no CPU when no deadline is pending.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock};
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{DropReason, RxMeta, Transmit};
use softverbs_engine::types::Gid;
use softverbs_engine::{Error, Result};
use softverbs_wire::bth::peek_dest_qpn;
use softverbs_wire::{is_positive_ack, RocePacket};

use crate::device::McastTable;
use crate::mem::KeyTable;
use crate::qp::Qp;
use crate::udp::{Datagram, Udp};

/// The multicast destination QPN.
pub const MULTICAST_QPN: u32 = 0xFF_FFFF;

/// A received packet with what the network told about it.
#[derive(Debug)]
pub(crate) struct Packet {
    pub(crate) data: Vec<u8>,
    pub(crate) meta: RxMeta,
    /// UDP source and destination ports (for UD flow rules).
    pub(crate) ports: (u16, u16),
}

/// Packet counters of one device, readable through the verbs API.
#[derive(Debug, Default)]
pub struct NodeCounters {
    /// Packets handed to the fabric.
    pub tx_packets: AtomicU64,
    /// Packets received.
    pub rx_packets: AtomicU64,
    /// Received packets that did not parse (bad header, length, opcode).
    pub rx_malformed: AtomicU64,
    /// Received packets for a QP number that does not exist.
    pub rx_unknown_qp: AtomicU64,
    /// Received packets a QP dropped (wrong state or PSN, no receive WQE, duplicate, ...).
    pub rx_dropped: AtomicU64,
    /// Received packets with a P_Key not in the table.
    pub rx_bad_pkey: AtomicU64,
    /// Received datagrams with the wrong Q_Key.
    pub rx_bad_qkey: AtomicU64,
    /// Received packets with a bad ICRC (dropped).
    pub rx_bad_icrc: AtomicU64,
    /// Received IPv4 packets whose ICRC could not be checked (sent with a non-zero IP ID).
    pub rx_icrc_unverified: AtomicU64,
    /// Sent packets no node was listening for.
    pub tx_unroutable: AtomicU64,
}

/// A snapshot of [`NodeCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)] // the fields mirror NodeCounters
pub struct CounterSnapshot {
    pub tx_packets: u64,
    pub rx_packets: u64,
    pub rx_malformed: u64,
    pub rx_unknown_qp: u64,
    pub rx_dropped: u64,
    pub rx_bad_pkey: u64,
    pub rx_bad_qkey: u64,
    pub rx_bad_icrc: u64,
    pub rx_icrc_unverified: u64,
    pub tx_unroutable: u64,
}

impl NodeCounters {
    /// The current values.
    pub fn snapshot(&self) -> CounterSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            tx_packets: g(&self.tx_packets),
            rx_packets: g(&self.rx_packets),
            rx_malformed: g(&self.rx_malformed),
            rx_unknown_qp: g(&self.rx_unknown_qp),
            rx_dropped: g(&self.rx_dropped),
            rx_bad_pkey: g(&self.rx_bad_pkey),
            rx_bad_qkey: g(&self.rx_bad_qkey),
            rx_bad_icrc: g(&self.rx_bad_icrc),
            rx_icrc_unverified: g(&self.rx_icrc_unverified),
            tx_unroutable: g(&self.tx_unroutable),
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// One device's endpoint on the fabric.
#[derive(Debug)]
pub(crate) struct Node {
    gids: Vec<Gid>,
    ifindex: u32,
    qps: RwLock<HashMap<u32, Weak<Qp>>>,
    /// Multicast group -> attached QP numbers.
    pub(crate) mcast: Mutex<McastTable>,
    pub(crate) keys: KeyTable,
    /// Flow rules of UD QPs.
    pub(crate) ud_flows: crate::flow::UdFlows,
    inbound: Mutex<VecDeque<Packet>>,
    driving: AtomicBool,
    pub(crate) counters: NodeCounters,
}

impl Node {
    pub(crate) fn new(gids: &[Gid], ifindex: u32) -> Arc<Self> {
        let node = Arc::new(Self {
            gids: gids.iter().copied().filter(|g| !g.is_zero()).collect(),
            ifindex,
            qps: RwLock::new(HashMap::new()),
            mcast: Mutex::new(McastTable::default()),
            keys: KeyTable::default(),
            ud_flows: Default::default(),
            inbound: Mutex::new(VecDeque::new()),
            driving: AtomicBool::new(false),
            counters: NodeCounters::default(),
        });
        let mut nodes = fabric().nodes.write();
        // Devices are built on every device listing and most are dropped at once: forget the
        // dead ones here, or the list (and each dead node's memory) grows with every call.
        nodes.retain(|n| n.strong_count() > 0);
        nodes.push(Arc::downgrade(&node));
        drop(nodes);
        node
    }

    pub(crate) fn add_qp(&self, qp: &Arc<Qp>) {
        self.qps.write().insert(qp.qpn(), Arc::downgrade(qp));
    }

    /// The live QP numbered `qpn` on this node.
    pub(crate) fn qp(&self, qpn: u32) -> Option<Arc<Qp>> {
        self.qps.read().get(&qpn).and_then(Weak::upgrade)
    }

    pub(crate) fn remove_qp(&self, qpn: u32) {
        self.qps.write().remove(&qpn);
    }

    fn has_gid(&self, gid: &Gid) -> bool {
        self.gids.contains(gid)
    }

    fn has_qp(&self, qpn: u32) -> bool {
        self.qps.read().contains_key(&qpn)
    }

    fn has_group(&self, gid: &Gid) -> bool {
        self.mcast.lock().groups.contains_key(gid)
    }

    pub(crate) fn deliver(&self, pkt: Packet) {
        self.inbound.lock().push_back(pkt);
    }

    fn qps(&self) -> Vec<Arc<Qp>> {
        self.qps.read().values().filter_map(Weak::upgrade).collect()
    }

    /// Processes inbound packets until none are left. Returns whether anything was done.
    /// Only one thread drives a node at a time, so packets of a QP are handled in order.
    fn drive(&self, now: Instant) -> bool {
        let mut did = false;
        loop {
            if self.driving.swap(true, Ordering::Acquire) {
                return did;
            }
            loop {
                let batch: Vec<Packet> = self.inbound.lock().drain(..).collect();
                if batch.is_empty() {
                    break;
                }
                did = true;
                let mut out = Vec::new();
                let mut tickets = Vec::new();
                for pkt in batch {
                    self.receive(now, pkt, &mut out, &mut tickets);
                }
                // One send for the whole batch: fewer system calls, and one ACK per QP. Only
                // then do the batch's completions become visible: an application that sees its
                // last completion and exits must not leave the peer without the ACK.
                fabric().send_all(self, coalesce_acks(out));
                for (qp, ticket) in tickets {
                    qp.release(ticket);
                }
            }
            self.driving.store(false, Ordering::Release);
            // A packet may have arrived after the last check but before the release.
            if self.inbound.lock().is_empty() {
                return did;
            }
        }
    }

    fn receive(&self, now: Instant, pkt: Packet, out: &mut Vec<Transmit>, tickets: &mut Vec<(Arc<Qp>, u64)>) {
        bump(&self.counters.rx_packets);
        let Ok(parsed) = RocePacket::parse(&pkt.data) else {
            bump(&self.counters.rx_malformed);
            return;
        };
        let qpn = parsed.repr.bth.dest_qpn;
        let mut targets: Vec<Arc<Qp>> = if qpn == MULTICAST_QPN {
            let members: Vec<u32> = self
                .mcast
                .lock()
                .groups
                .get(&pkt.meta.dgid)
                .map(|m| m.iter().copied().collect())
                .unwrap_or_default();
            let qps = self.qps.read();
            members
                .iter()
                .filter_map(|q| qps.get(q).and_then(Weak::upgrade))
                .collect()
        } else {
            self.qps
                .read()
                .get(&qpn)
                .and_then(Weak::upgrade)
                .into_iter()
                .collect()
        };
        if targets.is_empty() {
            bump(&self.counters.rx_unknown_qp);
        }
        let (meta, len) = (&pkt.meta, pkt.data.len());
        self.ud_flows.steer(&parsed, meta, pkt.ports, len, &mut targets);
        for qp in targets {
            let (outputs, dropped) = qp.handle_packet(now, &parsed, &pkt.meta);
            match dropped {
                None => {}
                Some(DropReason::BadPkey) => bump(&self.counters.rx_bad_pkey),
                Some(DropReason::BadQkey) => bump(&self.counters.rx_bad_qkey),
                Some(_) => bump(&self.counters.rx_dropped),
            }
            out.extend(outputs.txs);
            tickets.push((qp, outputs.ticket));
        }
    }

    /// Runs due transport timers of this node's QPs; returns the earliest pending deadline.
    fn run_timers(&self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for qp in self.qps() {
            let due = qp.deadline();
            if due.is_some_and(|d| d <= now) {
                let out = qp.handle_timeout(now);
                qp.transmit(out.txs);
                qp.release(out.ticket);
            }
            if let Some(d) = qp.deadline() {
                next = Some(next.map_or(d, |n: Instant| n.min(d)));
            }
        }
        next
    }
}

/// Drops every positive ACK that a later positive ACK to the same QP makes redundant: ACKs are
/// cumulative, so within one batch only the newest of each QP needs to go out. NAKs, responses
/// and requests are kept, in order.
fn coalesce_acks(mut txs: Vec<Transmit>) -> Vec<Transmit> {
    let is_ack = |t: &Transmit| is_positive_ack(&t.data);
    // Only ever called on positive ACKs, which hold a whole BTH.
    let key = |t: &Transmit| (t.dest.dgid, peek_dest_qpn(&t.data).unwrap_or(0));
    if txs.iter().filter(|t| is_ack(t)).count() < 2 {
        return txs;
    }
    let mut keep = vec![true; txs.len()];
    let mut newest: HashMap<(Gid, u32), usize> = HashMap::new();
    for (i, t) in txs.iter().enumerate() {
        if is_ack(t) {
            if let Some(prev) = newest.insert(key(t), i) {
                keep[prev] = false;
            }
        }
    }
    let mut k = keep.into_iter();
    txs.retain(|_| k.next().unwrap_or(true));
    txs
}

/// The process-wide fabric between nodes.
#[derive(Debug)]
pub(crate) struct Fabric {
    nodes: RwLock<Vec<Weak<Node>>>,
    epoch: std::time::Instant,
    wake: WakeUp,
    qpns: Mutex<QpnTable>,
    udp: OnceLock<Arc<Udp>>,
    /// Serialises attempts to start the UDP driver.
    udp_start: Mutex<()>,
    /// When an application thread last polled an empty CQ (engine nanoseconds).
    app_poll_at: AtomicU64,
}

/// QPNs 0 and 1 are the special management QPs; ordinary QPs start above them, as on hardware.
const FIRST_QPN: u32 = 0x11;
/// The last per-process QP index (bits 0..16; the slot fills bits 16..24).
const LAST_QPN_INDEX: u32 = 0xFFFF;

/// The per-process QP indices in use, handed out round robin so that a freed number is not
/// reused at once.
#[derive(Debug)]
struct QpnTable {
    next: u32,
    first: u32,
    last: u32,
    live: HashSet<u32>,
}

impl QpnTable {
    fn new(first: u32, last: u32) -> Self {
        Self {
            next: first,
            first,
            last,
            live: HashSet::new(),
        }
    }

    /// A free index, or `None` when every one is in use (a full table must not be searched
    /// forever).
    fn alloc(&mut self) -> Option<u32> {
        if self.live.len() as u64 > u64::from(self.last - self.first) {
            return None;
        }
        loop {
            let idx = self.next;
            self.next = if idx >= self.last { self.first } else { idx + 1 };
            if self.live.insert(idx) {
                return Some(idx);
            }
        }
    }

    fn free(&mut self, idx: u32) {
        self.live.remove(&idx);
    }
}

/// The fabric of this process.
pub(crate) fn fabric() -> &'static Fabric {
    static FABRIC: OnceLock<Fabric> = OnceLock::new();
    FABRIC.get_or_init(|| {
        std::thread::Builder::new()
            .name("softverbs-progress".into())
            .spawn(progress_thread)
            .expect("spawn the progress thread");
        Fabric {
            nodes: RwLock::new(Vec::new()),
            epoch: std::time::Instant::now(),
            wake: WakeUp::new(),
            qpns: Mutex::new(QpnTable::new(FIRST_QPN, LAST_QPN_INDEX)),
            udp: OnceLock::new(),
            udp_start: Mutex::new(()),
            app_poll_at: AtomicU64::new(0),
        }
    })
}

/// How recently an application thread must have polled for the receive thread to leave the
/// socket to it.
const APP_POLLING: Duration = Duration::from_micros(200);

fn receive_thread(udp: &Udp) {
    let f = fabric();
    loop {
        // While an application thread polls a CQ, it reads the socket itself with no thread
        // hand-off: do not even wait on the socket, since every wake-up would take a core from a
        // spinning thread.
        let since = f
            .now()
            .as_nanos()
            .saturating_sub(f.app_poll_at.load(Ordering::Relaxed));
        if since < APP_POLLING.as_nanos() as u64 {
            std::thread::sleep(APP_POLLING);
            continue;
        }
        // Wakes at least once a second to take over the standard port if it was freed.
        if udp.wait_readable(Duration::from_secs(1)) {
            udp.receive(|d| f.deliver_datagrams(d));
            f.drive(f.now());
        }
    }
}

fn progress_thread() {
    let f = fabric();
    loop {
        f.wake.begin_pass();
        let now = f.now();
        f.drive(now);
        let mut next = None;
        for node in f.live_nodes() {
            if let Some(d) = node.run_timers(now) {
                next = Some(next.map_or(d, |n: Instant| n.min(d)));
            }
        }
        f.drive(f.now());
        let (mut guard, target) = f.wake.end_pass(next.map_or(u64::MAX, |d| d.as_nanos()));
        if target == u64::MAX {
            f.wake.cv.wait(&mut guard);
        } else {
            let wait = Duration::from_nanos(target.saturating_sub(f.now().as_nanos()));
            if !wait.is_zero() {
                f.wake.cv.wait_for(&mut guard, wait);
            }
        }
    }
}

/// The progress thread's next wake-up, lowered by the threads that set transport deadlines.
#[derive(Debug)]
struct WakeUp {
    /// Nanoseconds since the fabric's epoch; MAX: none.
    at: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
}

impl WakeUp {
    fn new() -> Self {
        Self {
            at: AtomicU64::new(u64::MAX),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        }
    }

    fn load(&self) -> u64 {
        self.at.load(Ordering::Acquire)
    }

    /// Starts a pass of the progress thread over the timers. From here on `schedule` merges
    /// each new deadline into `at`, and `end_pass` merges the earliest node timer into it too,
    /// never storing over it. A deadline set before this is already in its QP, which the pass
    /// reads after it; one set later lowers `at` and is kept. (Storing the pass's result, as an
    /// earlier version did, lost any deadline scheduled while the timers were being run.)
    fn begin_pass(&self) {
        self.at.store(u64::MAX, Ordering::Release);
        // Pairs with the fence in `schedule`: either it sees this store, or the pass sees the
        // QP's deadline stored before it.
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Ends a pass whose earliest node timer is `found`: the time to wake at, with the lock
    /// held so that a `schedule` from here on notifies the waiting thread.
    fn end_pass(&self, found: u64) -> (parking_lot::MutexGuard<'_, ()>, u64) {
        let guard = self.lock.lock();
        let target = self.at.fetch_min(found, Ordering::AcqRel).min(found);
        (guard, target)
    }

    /// Makes the thread wake by `at`. A deadline at or after `at` needs nothing: the thread
    /// wakes by then, or is in a pass, which only lowers `at`.
    fn schedule(&self, at: u64) {
        // The caller stored the deadline in its QP first; see `begin_pass`.
        std::sync::atomic::fence(Ordering::SeqCst);
        if at < self.load() {
            let _guard = self.lock.lock();
            // The minimum: a concurrent, later deadline must not replace an earlier one.
            self.at.fetch_min(at, Ordering::AcqRel);
            self.cv.notify_one();
        }
    }
}

impl Fabric {
    /// The engine's clock: nanoseconds since the fabric started.
    pub(crate) fn now(&self) -> Instant {
        Instant(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    fn live_nodes(&self) -> Vec<Arc<Node>> {
        let nodes: Vec<Arc<Node>> = self.nodes.read().iter().filter_map(Weak::upgrade).collect();
        if nodes.len() < self.nodes.read().len() {
            // Devices were dropped: forget them (rare, so the hot path only reads).
            self.nodes.write().retain(|n| n.strong_count() > 0);
        }
        nodes
    }

    /// Tells the progress thread about a deadline, waking it if it would sleep past it.
    pub(crate) fn schedule(&self, at: Instant) {
        self.wake.schedule(at.as_nanos());
    }

    /// Drives every node until no packet is left in flight.
    pub(crate) fn drive(&self, now: Instant) {
        let nodes = self.live_nodes();
        loop {
            let mut did = false;
            for n in &nodes {
                did |= n.drive(now);
            }
            if !did {
                return;
            }
        }
    }

    /// Makes progress from an application thread: delivers packets in flight and, if a
    /// transport deadline has passed, runs the timers (so busy polling does not wait for the
    /// progress thread to be scheduled).
    pub(crate) fn progress(&self, now: Instant) {
        self.app_poll_at.store(now.as_nanos(), Ordering::Relaxed);
        if let Some(u) = self.udp() {
            u.try_receive(|d| self.deliver_datagrams(d));
        }
        self.drive(now);
        if self.wake.load() <= now.as_nanos() {
            for n in self.live_nodes() {
                n.run_timers(now);
            }
            self.drive(self.now());
        }
    }

    /// Routes packets from `from` to their destination nodes: to a node of this process, or out
    /// over UDP (runs of packets to one destination QP leave in one batch).
    pub(crate) fn send_all(&self, from: &Node, txs: Vec<Transmit>) {
        if txs.is_empty() {
            return;
        }
        let nodes = self.live_nodes();
        // Packets for other processes, in runs with one (source GID, destination GID, QP).
        type Run = ((Gid, Gid, u32), Vec<Vec<u8>>);
        let mut remote: Vec<Run> = Vec::new();
        for mut tx in txs {
            bump(&from.counters.tx_packets);
            let meta = RxMeta {
                sgid: from
                    .gids
                    .get(usize::from(tx.dest.sgid_index))
                    .copied()
                    .unwrap_or(Gid::ZERO),
                dgid: tx.dest.dgid,
                traffic_class: tx.dest.traffic_class,
                hop_limit: tx.dest.hop_limit,
            };
            let qpn = peek_dest_qpn(&tx.data).unwrap_or(0);
            // The ports the datagram would have had over UDP.
            let ports = self.udp().map_or((0, 0), |u| (u.port(), u.dest_port(qpn)));
            let targets: Vec<&Arc<Node>> = if qpn == MULTICAST_QPN {
                nodes.iter().filter(|n| n.has_group(&tx.dest.dgid)).collect()
            } else {
                nodes
                    .iter()
                    .filter(|n| n.has_gid(&tx.dest.dgid) && n.has_qp(qpn))
                    .take(1)
                    .collect()
            };
            // Multicast members may live in other processes and hosts too.
            if targets.is_empty() || qpn == MULTICAST_QPN {
                let key = (meta.sgid, tx.dest.dgid, qpn);
                let only_remote = targets.is_empty();
                let data = if only_remote {
                    std::mem::take(&mut tx.data)
                } else {
                    tx.data.clone()
                };
                match remote.last_mut() {
                    Some((k, batch)) if *k == key => batch.push(data),
                    _ => remote.push((key, vec![data])),
                }
                if only_remote {
                    continue;
                }
            }
            let (last, rest) = targets.split_last().expect("non-empty");
            for n in rest {
                n.deliver(Packet {
                    data: tx.data.clone(),
                    meta,
                    ports,
                });
            }
            last.deliver(Packet {
                data: tx.data,
                meta,
                ports,
            });
        }
        for ((sgid, dgid, qpn), mut batch) in remote {
            let sent = self.udp().map_or(0, |u| {
                u.send(sgid.to_ip(), dgid.to_ip(), from.ifindex, qpn, &mut batch)
            });
            if qpn != MULTICAST_QPN {
                for _ in sent..batch.len() {
                    bump(&from.counters.tx_unroutable);
                }
            }
        }
    }

    /// Starts the UDP driver (once per process) on the first free slot of `slots` above
    /// `base_port`; its slot numbers this process's QPs. `None` while every slot is taken: the
    /// next call tries again.
    pub(crate) fn start_udp(&'static self, base_port: u16, slots: u8) -> Option<&'static Arc<Udp>> {
        if let Some(u) = self.udp.get() {
            return Some(u);
        }
        let _starting = self.udp_start.lock();
        if let Some(u) = self.udp.get() {
            return Some(u);
        }
        let Some(udp) = Udp::start(base_port, slots) else {
            tracing::warn!(
                base_port,
                slots,
                "no free UDP slot (ports base+1..=base+slots are all taken): QPs cannot be created"
            );
            return None;
        };
        let u = udp.clone();
        std::thread::Builder::new()
            .name("softverbs-rx".into())
            .spawn(move || receive_thread(&u))
            .expect("spawn the receive thread");
        let _ = self.udp.set(udp);
        self.udp.get()
    }

    fn udp(&self) -> Option<&Arc<Udp>> {
        self.udp.get()
    }

    /// Forwarded datagrams the UDP driver dropped as forged.
    pub(crate) fn forged_forwards(&self) -> u64 {
        self.udp().map_or(0, |u| u.forged_forwards())
    }

    /// (slot, own UDP port, holds the standard port) if the UDP driver runs.
    pub(crate) fn udp_status(&self) -> Option<(u8, u16, bool)> {
        self.udp().map(|u| (u.slot(), u.port(), u.is_forwarder()))
    }

    /// A fresh QP number, unique among live QPs of this host: the process's UDP slot in bits
    /// 16..24 and a per-process index below. Fails with ENOMEM once every index is in use, or
    /// while this process has no UDP slot: a number without one would collide with another
    /// process's and its traffic would go astray, so no QP is better than a silent one.
    pub(crate) fn alloc_qpn(&'static self, base_port: u16, slots: u8) -> Result<u32> {
        let slot = self
            .start_udp(base_port, slots)
            .map(|u| u32::from(u.slot()))
            .ok_or_else(|| {
                Error::no_resources(format!(
                    "no free UDP slot: ports {}..={} are all taken by other processes",
                    u32::from(base_port) + 1,
                    u32::from(base_port) + u32::from(slots)
                ))
            })?;
        let idx = self.qpns.lock().alloc().ok_or_else(|| {
            Error::no_resources(format!(
                "all {} QP numbers of this process are in use (QPs, SRQs and WQs share them)",
                LAST_QPN_INDEX - FIRST_QPN + 1
            ))
        })?;
        Ok((slot << 16) | idx)
    }

    /// Hands received datagrams to their nodes' inbound queues, in order.
    fn deliver_datagrams(&self, dgrams: Vec<Datagram>) {
        if dgrams.is_empty() {
            return;
        }
        let nodes = self.live_nodes();
        for d in dgrams {
            let multicast = d.meta.dgid.is_multicast();
            let targets: Vec<&Arc<Node>> = nodes
                .iter()
                .filter(|n| {
                    if multicast {
                        n.has_group(&d.meta.dgid)
                    } else {
                        n.has_gid(&d.meta.dgid)
                    }
                })
                .collect();
            let Some(first) = targets.first() else { continue };
            if d.bad_icrc {
                bump(&first.counters.rx_bad_icrc);
                continue;
            }
            if d.icrc_unverified {
                bump(&first.counters.rx_icrc_unverified);
            }
            for n in targets.iter().take(if multicast { usize::MAX } else { 1 }) {
                n.deliver(Packet {
                    data: d.data.clone(),
                    meta: d.meta,
                    ports: d.ports,
                });
            }
        }
    }

    /// Releases a QP number.
    pub(crate) fn free_qpn(&self, qpn: u32) {
        self.qpns.lock().free(qpn & LAST_QPN_INDEX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_qpn_table_fails_instead_of_spinning() {
        let mut t = QpnTable::new(FIRST_QPN, FIRST_QPN + 3);
        let got: Vec<u32> = (0..4).map(|_| t.alloc().expect("a free index")).collect();
        assert_eq!(got, [0x11, 0x12, 0x13, 0x14]);
        assert_eq!(t.alloc(), None, "every index is in use");
        t.free(0x13);
        assert_eq!(t.alloc(), Some(0x13), "a freed index is found again");
        assert_eq!(t.alloc(), None);
    }

    #[test]
    fn deadline_scheduled_during_a_pass_is_kept() {
        let w = WakeUp::new();
        w.begin_pass();
        // A QP sets a deadline while the progress thread runs the timers (after it read that
        // QP), and the pass finds only a later one elsewhere.
        w.schedule(100);
        let (guard, target) = w.end_pass(500);
        drop(guard);
        assert_eq!(target, 100, "the scheduled deadline survives the pass");
        assert_eq!(w.load(), 100);
        // A later deadline never replaces an earlier one.
        w.schedule(300);
        assert_eq!(w.load(), 100);
        // The next pass starts afresh: what is due is in the QPs' state, which it reads.
        w.begin_pass();
        let (guard, target) = w.end_pass(u64::MAX);
        drop(guard);
        assert_eq!(target, u64::MAX);
        w.begin_pass();
        let (guard, target) = w.end_pass(700);
        drop(guard);
        assert_eq!(target, 700);
    }

    fn rss_bytes() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4096
    }

    #[test]
    fn repeated_device_listing_does_not_grow() {
        let per_call = crate::device::device_list().unwrap().len();
        // Warm up allocator pools before measuring.
        for _ in 0..1000 {
            crate::device::device_list().unwrap();
        }
        let rss = rss_bytes();
        for _ in 0..40_000 {
            crate::device::device_list().unwrap();
        }
        // Live nodes: the registry's devices plus the ones other tests of this process hold.
        let nodes = fabric().nodes.read().len();
        assert!(
            nodes <= per_call + 64,
            "{nodes} nodes registered after 40,000 listings"
        );
        let grown = rss_bytes().saturating_sub(rss);
        assert!(grown < 4 << 20, "RSS grew by {grown} bytes over 40,000 listings");
    }
}
