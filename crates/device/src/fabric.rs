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
            inbound: Mutex::new(VecDeque::new()),
            driving: AtomicBool::new(false),
            counters: NodeCounters::default(),
        });
        fabric().nodes.write().push(Arc::downgrade(&node));
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
        let targets: Vec<Arc<Qp>> = if qpn == MULTICAST_QPN {
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
            return;
        }
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
                fabric().send_all(self, out.txs);
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
    /// The progress thread's next wake-up (nanoseconds since the epoch; MAX: none).
    wake_at: AtomicU64,
    wake_lock: Mutex<()>,
    wake: Condvar,
    qpns: Mutex<(u32, HashSet<u32>)>,
    udp: OnceLock<Option<Arc<Udp>>>,
    /// When an application thread last polled an empty CQ (engine nanoseconds).
    app_poll_at: AtomicU64,
}

/// QPNs 0 and 1 are the special management QPs; ordinary QPs start above them, as on hardware.
const FIRST_QPN: u32 = 0x11;

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
            wake_at: AtomicU64::new(u64::MAX),
            wake_lock: Mutex::new(()),
            wake: Condvar::new(),
            qpns: Mutex::new((FIRST_QPN, HashSet::new())),
            udp: OnceLock::new(),
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
        let now = f.now();
        f.drive(now);
        let mut next = None;
        for node in f.live_nodes() {
            if let Some(d) = node.run_timers(now) {
                next = Some(next.map_or(d, |n: Instant| n.min(d)));
            }
        }
        f.drive(f.now());
        let mut guard = f.wake_lock.lock();
        let target = next.map_or(u64::MAX, |d| d.as_nanos());
        f.wake_at.store(target, Ordering::Release);
        if target == u64::MAX {
            f.wake.wait(&mut guard);
        } else {
            let wait = Duration::from_nanos(target.saturating_sub(f.now().as_nanos()));
            if !wait.is_zero() {
                f.wake.wait_for(&mut guard, wait);
            }
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
        if at.as_nanos() < self.wake_at.load(Ordering::Acquire) {
            let _guard = self.wake_lock.lock();
            self.wake_at.store(at.as_nanos(), Ordering::Release);
            self.wake.notify_one();
        }
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
        if self.wake_at.load(Ordering::Acquire) <= now.as_nanos() {
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
                });
            }
            last.deliver(Packet { data: tx.data, meta });
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

    /// Starts the UDP driver (once per process) on `base_port`; its slot numbers this
    /// process's QPs.
    pub(crate) fn start_udp(&'static self, base_port: u16) -> Option<&'static Arc<Udp>> {
        self.udp
            .get_or_init(|| {
                let udp = Udp::start(base_port);
                if let Some(u) = &udp {
                    let u = u.clone();
                    std::thread::Builder::new()
                        .name("softverbs-rx".into())
                        .spawn(move || receive_thread(&u))
                        .expect("spawn the receive thread");
                } else {
                    tracing::warn!(
                        base_port,
                        "no UDP port available: only QPs of this process can talk"
                    );
                }
                udp
            })
            .as_ref()
    }

    fn udp(&self) -> Option<&Arc<Udp>> {
        self.udp.get().and_then(Option::as_ref)
    }

    /// (slot, own UDP port, holds the standard port) if the UDP driver runs.
    pub(crate) fn udp_status(&self) -> Option<(u8, u16, bool)> {
        self.udp().map(|u| (u.slot(), u.port(), u.is_forwarder()))
    }

    /// A fresh QP number, unique among live QPs of this host: the process's UDP slot in bits
    /// 16..24 and a per-process index below.
    pub(crate) fn alloc_qpn(&'static self, base_port: u16) -> u32 {
        let slot = self.start_udp(base_port).map_or(0, |u| u32::from(u.slot()));
        let mut t = self.qpns.lock();
        loop {
            let idx = t.0;
            t.0 = if t.0 >= 0xFFFF { FIRST_QPN } else { t.0 + 1 };
            let qpn = (slot << 16) | idx;
            if t.1.insert(qpn) {
                return qpn;
            }
        }
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
                });
            }
        }
    }

    /// Releases a QP number.
    pub(crate) fn free_qpn(&self, qpn: u32) {
        self.qpns.lock().1.remove(&qpn);
    }
}
