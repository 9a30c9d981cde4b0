//! Moving packets: each device has a `Node` (its QPs, memory keys and inbound packets), and
//! a `Fabric` carries packets between nodes, through its drivers, and runs the progress
//! thread.
//!
//! The fabric is an owned object: the device registry creates one for the process and every
//! node holds an `Arc` of it; the fabric lists its nodes until their devices' `NodeHandle`s
//! are dropped. It knows QPs only through the `Endpoint` trait, so this module does not
//! depend on the QP's internals, and it reads packet headers only through `softverbs-wire`
//! views.
//!
//! Routing: a packet whose destination GID and QP number belong to a node of this fabric goes
//! to that node's in-process driver (`InProcess`, the node's inbound queue); every other packet
//! goes out through the UDP driver (`Udp`), which starts with the first QP number the process
//! allocates (its slot numbers the QPs). A multicast packet goes to every member node here and
//! out over UDP. A batch the UDP driver received is handed to the nodes whose GIDs its packets
//! were sent to, into the same inbound queues. Packets for QP1 (QPN 1, or 1 with a process's slot)
//! go to the node's `Gsi` handler, the connection manager, which the progress thread also runs
//! the timers of.
//!
//! Progress happens in four places, so that nothing waits on the application:
//! - the thread that posts a work request drives the fabric until it is quiet, so an exchange
//!   between QPs of this process completes at once;
//! - polling an empty CQ drives it too (a single-threaded program that posts and then polls
//!   always completes), reading the UDP sockets without blocking;
//! - the receive thread waits on the UDP driver's readiness and handles what arrives;
//! - the progress thread sleeps until the earliest transport deadline (retransmission, RNR
//!   wait) and handles it; it uses no CPU when no deadline is pending.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock};
use smallvec::SmallVec;
use softverbs_engine::memory::ExternalPayload;
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{buffers, DropReason, ExternalRanges, RxMeta, Transmit};
use softverbs_engine::types::Gid;
use softverbs_engine::{Error, Result};
use softverbs_wire::bth::peek_dest_qpn;
use softverbs_wire::{is_positive_ack, pad_count_for, ParsedPacket, RocePacket};

use crate::capture::{Carrier, Tap};
use crate::device::McastTable;
use crate::driver::{Driver, IcrcCheck, PacketBatch, PacketData, PacketDesc, Route};
use crate::local::InProcess;
use crate::mem::KeyTable;
use crate::remote::{self, Pending, RemotePayload, RemoteRef};
use crate::shm::Shm;
use crate::stats::NodeCounters;
use crate::udp::Udp;

/// The multicast destination QPN.
pub const MULTICAST_QPN: u32 = 0xFF_FFFF;
/// How long the member processes of a multicast group are taken as known (a process that
/// joins is reached within this).
const MCAST_MEMBERS_FOR: std::time::Duration = std::time::Duration::from_millis(20);

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What the fabric needs of a QP: the boundary between packet moving and the transport.
pub(crate) trait Endpoint: Send + Sync + 'static {
    /// The QP number.
    fn number(&self) -> u32;

    /// Handles a received packet. Returns the packets to send in reply, the ticket to
    /// [`Endpoint::release_ticket`] once they were sent, and why the packet was dropped if it was.
    /// A payload the sender left in its memory is `ext`; copies into this process's memory
    /// may be noted in `pending` instead of done (see [`crate::remote`]).
    ///
    /// With `more`, other packets of the received batch follow: a positive ACK this one calls
    /// for may be held back (then `Received::ack_held` says so) until [`Endpoint::end_batch`],
    /// so that one ACK answers all of the batch's packets for this endpoint.
    fn receive_packet(
        &self,
        now: Instant,
        pkt: &ParsedPacket<'_>,
        ext: Option<&dyn ExternalPayload>,
        meta: &RxMeta,
        pending: &Pending,
        more: bool,
    ) -> Received;

    /// The end of a received batch in which this endpoint held an ACK back: returns the
    /// packets to send (that ACK) and the ticket to release once they were sent.
    fn end_batch(&self, now: Instant) -> (Vec<Transmit>, u64);

    /// Makes the completions held under `ticket` (and earlier ones) visible: their packets
    /// were handed to the fabric.
    fn release_ticket(&self, ticket: u64);

    /// A payload copy noted while handling the packets of `ticket` failed: those packets'
    /// completions fail and the QP moves to the error state.
    fn fail_ticket(&self, ticket: u64);

    /// The next transport deadline.
    fn next_deadline(&self) -> Option<Instant>;

    /// Runs expired transport timers, sending what they produce.
    fn on_timeout(&self, now: Instant);

    /// A node's flow rules for received packets (UD flow steering).
    type Steering: Default + Send + Sync + std::fmt::Debug;

    /// Adds to `targets` (the endpoints a received packet is addressed to) the endpoints whose
    /// rules in `steering` take it. `ports` are its UDP source and destination ports (those
    /// it would have had over UDP if it stayed in this process); `len` its length.
    fn steer(
        steering: &Self::Steering,
        pkt: &ParsedPacket<'_>,
        meta: &RxMeta,
        ports: (u16, u16),
        len: usize,
        targets: &mut Vec<Arc<Self>>,
    );
}

/// A node's QPs by number: looked up up to three times per packet, so hashed cheaply. The keys
/// are numbers this process chose, so a peer cannot make them collide; it can only look up.
type QpMap<E> = HashMap<u32, Weak<E>, crate::sync::NumberHash>;

/// Each endpoint's ticket for a received packet (to release once its replies were sent), with
/// where its replies are in the batch's outputs (a QP whose payload copy failed sends none of
/// them).
type BatchTickets<E> = Vec<(Arc<E>, u64, Range<usize>)>;

/// What a node's driving thread works with, kept between batches so that handling a packet
/// allocates none of it.
struct Processing<E> {
    batch: PacketBatch,
    /// Each endpoint's ticket for a packet, and the range of the batch's replies it produced.
    tickets: BatchTickets<E>,
    /// The endpoints one packet is for.
    targets: Vec<Arc<E>>,
    /// The endpoints that hold an ACK back until the end of the batch.
    acking: Vec<Arc<E>>,
}

/// Where [`Node::receive`] puts what a packet produced, for the end of its batch.
struct Replies<'a, E> {
    out: &'a mut Vec<Transmit>,
    tickets: &'a mut BatchTickets<E>,
    /// Scratch: the endpoints the packet is for.
    targets: &'a mut Vec<Arc<E>>,
    /// The endpoints holding an ACK back.
    acking: &'a mut Vec<Arc<E>>,
    /// Packets of the batch follow this one (an ACK may wait for them: a batch of one
    /// packet, what a ping-pong gets, has nothing to wait for).
    more: bool,
}

/// What an endpoint made of a received packet ([`Endpoint::receive_packet`]).
pub(crate) struct Received {
    /// Packets to send in reply.
    pub(crate) txs: Vec<Transmit>,
    /// To [`Endpoint::release_ticket`] once they were sent.
    pub(crate) ticket: u64,
    /// Why the packet was dropped, if it was.
    pub(crate) dropped: Option<DropReason>,
    /// A positive ACK is held back for [`Endpoint::end_batch`].
    pub(crate) ack_held: bool,
}

/// The management QP (QP1) of a node: receives the MADs addressed to it and runs its timers
/// (the connection manager, `crate::cm`). The fabric only routes to it.
pub(crate) trait Gsi: Send + Sync + 'static {
    /// Handles a UD packet addressed to QP1 (its source GID in `meta`); returns what to send.
    fn receive(&self, now: Instant, pkt: &ParsedPacket<'_>, meta: &RxMeta) -> Vec<Transmit>;
    /// The next timer deadline.
    fn next_deadline(&self) -> Option<Instant>;
    /// Runs expired timers; returns what to send.
    fn on_timeout(&self, now: Instant) -> Vec<Transmit>;
    /// The concrete handler, for its owner to find again.
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
}

/// Whether `qpn` names QP1 of some process: 1 from standard peers, or 1 with a softverbs
/// process's slot in bits 16..24 (no ordinary QP has index 1).
pub(crate) fn is_gsi_qpn(qpn: u32) -> bool {
    qpn & 0xFFFF == 1 && qpn != MULTICAST_QPN
}

/// One device's endpoint on the fabric.
pub(crate) struct Node<E: Endpoint> {
    fabric: Arc<Fabric<E>>,
    gids: Vec<Gid>,
    ifindex: u32,
    qps: RwLock<QpMap<E>>,
    /// Multicast group -> attached QP numbers.
    pub(crate) mcast: Mutex<McastTable>,
    pub(crate) keys: KeyTable,
    /// Flow rules of UD QPs.
    pub(crate) ud_flows: E::Steering,
    /// Packets for this node: the in-process driver's queue, where other drivers' packets are
    /// delivered too.
    inbound: InProcess,
    /// The batch being processed and what its packets need (kept for their memory); only the
    /// driving thread touches them.
    processing: Mutex<Processing<E>>,
    driving: AtomicBool,
    pub(crate) counters: NodeCounters,
    /// QP1, once the connection manager was started on this node.
    gsi: OnceLock<Arc<dyn Gsi>>,
}

impl<E: Endpoint> std::fmt::Debug for Node<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("gids", &self.gids)
            .field("ifindex", &self.ifindex)
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl<E: Endpoint> Node<E> {
    /// The fabric this node is on.
    pub(crate) fn fabric(&self) -> &Arc<Fabric<E>> {
        &self.fabric
    }

    pub(crate) fn add_qp(&self, qp: &Arc<E>) {
        if self.qps.write().insert(qp.number(), Arc::downgrade(qp)).is_none() {
            bump(self.counters.qps());
        }
    }

    /// The live QP numbered `qpn` on this node.
    pub(crate) fn qp(&self, qpn: u32) -> Option<Arc<E>> {
        self.qps.read().get(&qpn).and_then(Weak::upgrade)
    }

    pub(crate) fn remove_qp(&self, qpn: u32) {
        if self.qps.write().remove(&qpn).is_some() {
            self.counters.qps().fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn has_gid(&self, gid: &Gid) -> bool {
        self.gids.contains(gid)
    }

    /// The node's GIDs (its GID table without the unused entries).
    pub(crate) fn gids(&self) -> &[Gid] {
        &self.gids
    }

    /// QP1's handler, installed by `init` on first use.
    pub(crate) fn gsi(&self, init: impl FnOnce() -> Arc<dyn Gsi>) -> &Arc<dyn Gsi> {
        self.gsi.get_or_init(init)
    }

    /// Whether this node takes packets for `qpn` as QP1 (see [`is_gsi_qpn`]).
    fn takes_gsi(&self, qpn: u32, own_slot: Option<u8>) -> bool {
        is_gsi_qpn(qpn) && self.gsi.get().is_some() && own_slot.is_some_and(|s| u32::from(s) == qpn >> 16)
    }

    fn has_qp(&self, qpn: u32) -> bool {
        self.qps.read().contains_key(&qpn)
    }

    /// The index of the interface this node's device stands for.
    pub(crate) fn ifindex(&self) -> u32 {
        self.ifindex
    }

    fn has_group(&self, gid: &Gid) -> bool {
        self.mcast.lock().groups.contains_key(gid)
    }

    fn deliver(&self, data: PacketData<'_>, meta: RxMeta, ports: (u16, u16), remote: Option<RemoteRef>) {
        self.inbound.deliver(data, meta, ports, remote);
    }

    /// Queues a received packet as a driver would (tests of what the receive path does).
    #[cfg(test)]
    pub(crate) fn inject(&self, data: &[u8], meta: RxMeta, remote: Option<RemoteRef>) {
        self.deliver(PacketData::Shared(data), meta, (0, 0), remote);
    }

    fn qps(&self) -> Vec<Arc<E>> {
        self.qps.read().values().filter_map(Weak::upgrade).collect()
    }

    /// Processes inbound packets until none are left. Returns whether anything was done.
    /// Only one thread drives a node at a time, so packets of a QP are handled in order.
    fn drive(self: &Arc<Self>, now: Instant) -> bool {
        let mut did = false;
        // Without a lock: whoever queues a packet drives the fabric next, and sees its own.
        if !self.inbound.has_pending() {
            return did;
        }
        loop {
            if self.driving.swap(true, Ordering::Acquire) {
                return did;
            }
            let mut processing = self.processing.lock();
            let Processing {
                batch,
                tickets,
                targets,
                acking,
            } = &mut *processing;
            while self.inbound.recv(batch) > 0 {
                did = true;
                // The clock is read again for every batch: a thread may drive for a long
                // while when packets keep coming, and a stale `now` would time round trips as
                // zero and arm retransmission timers that fire early.
                let now = now.max(self.fabric.now());
                let mut out = Vec::new();
                let pending = Pending::default();
                let n = batch.len();
                for (i, (data, desc)) in batch.iter().enumerate() {
                    let to = Replies {
                        out: &mut out,
                        tickets: &mut *tickets,
                        targets: &mut *targets,
                        acking: &mut *acking,
                        more: i + 1 < n,
                    };
                    self.receive(now, data, desc, &pending, to);
                }
                batch.clear();
                for qp in acking.drain(..) {
                    let (mut txs, ticket) = qp.end_batch(now);
                    let at = out.len();
                    out.append(&mut txs);
                    buffers::recycle_transmits(txs);
                    tickets.push((qp, ticket, at..out.len()));
                }
                // Payloads left in their senders' memory are copied before anything they
                // caused (ACKs, completions) is seen.
                let (copies, failures) = pending.flush();
                self.counters
                    .rx_payload_copies()
                    .fetch_add(copies, Ordering::Relaxed);
                self.counters
                    .rx_payload_copy_failures()
                    .fetch_add(failures, Ordering::Relaxed);
                let failed = pending.take_failed();
                if !failed.is_empty() {
                    // A QP whose payload could not be placed acknowledges none of the batch.
                    let mut keep = vec![true; out.len()];
                    for (qp, _, range) in tickets.iter() {
                        if failed.contains(&qp.number()) {
                            keep[range.clone()].fill(false);
                        }
                    }
                    let mut k = keep.into_iter();
                    out.retain(|_| k.next().unwrap_or(true));
                }
                // One send for the whole batch: fewer system calls, and one ACK per QP. Only
                // then do the batch's completions become visible: an application that sees its
                // last completion and exits must not leave the peer without the ACK.
                if failed.is_empty() {
                    let tickets = tickets.drain(..).map(|(qp, ticket, _)| (qp, ticket));
                    self.fabric
                        .send_then_release(self, coalesce_acks(out), tickets, Hold::InPass, Some(now));
                } else {
                    let (bad, good): (Vec<_>, Vec<_>) = tickets
                        .drain(..)
                        .map(|(qp, ticket, _)| (qp, ticket))
                        .partition(|(qp, _)| failed.contains(&qp.number()));
                    self.fabric
                        .send_then_release(self, coalesce_acks(out), good, Hold::InPass, Some(now));
                    for (qp, ticket) in bad {
                        qp.fail_ticket(ticket);
                    }
                }
            }
            drop(processing);
            self.driving.store(false, Ordering::Release);
            // A packet may have arrived after the last check but before the release.
            if self.inbound.is_empty() {
                return did;
            }
        }
    }

    fn receive(&self, now: Instant, data: &[u8], desc: &PacketDesc, pending: &Pending, to: Replies<'_, E>) {
        let Replies {
            out,
            tickets,
            targets,
            acking,
            more,
        } = to;
        let (meta, ports) = (&desc.meta, desc.ports);
        bump(self.counters.rx_packets());
        self.counters
            .rx_bytes()
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        let Ok(mut parsed) = RocePacket::parse(data) else {
            bump(self.counters.rx_malformed());
            tracing::debug!(len = data.len(), src = %meta.sgid.to_ip(), "dropped a packet: malformed");
            return;
        };
        if let Some(r) = &desc.remote {
            // The headers were sent with an empty payload; the payload is in the sender.
            if !parsed.payload.is_empty() || !r.is_consistent() {
                bump(self.counters.rx_malformed());
                tracing::debug!(pid = r.pid, "dropped a packet: inconsistent payload reference");
                return;
            }
            parsed.repr.payload_len = r.ranges.len as usize;
            parsed.repr.bth.pad_count = pad_count_for(parsed.repr.payload_len);
        }
        let qpn = parsed.repr.bth.dest_qpn;
        if is_gsi_qpn(qpn) {
            match self.gsi.get() {
                Some(gsi) => out.extend(gsi.receive(now, &parsed, meta)),
                None => {
                    bump(self.counters.rx_unknown_qp());
                    tracing::debug!(qpn, "dropped a packet: no connection manager on QP1");
                }
            }
            return;
        }
        targets.clear();
        if qpn == MULTICAST_QPN {
            let members: Vec<u32> = self
                .mcast
                .lock()
                .groups
                .get(&meta.dgid)
                .map(|m| m.iter().copied().collect())
                .unwrap_or_default();
            let qps = self.qps.read();
            targets.extend(members.iter().filter_map(|q| qps.get(q).and_then(Weak::upgrade)));
        } else {
            targets.extend(self.qps.read().get(&qpn).and_then(Weak::upgrade));
        }
        if targets.is_empty() {
            bump(self.counters.rx_unknown_qp());
            tracing::debug!(qpn, src = %meta.sgid.to_ip(), "dropped a packet: no such QP");
        }
        E::steer(&self.ud_flows, &parsed, meta, ports, data.len(), targets);
        for qp in targets.drain(..) {
            let ext = desc.remote.map(|at| RemotePayload { at, qpn: qp.number() });
            let ext = ext.as_ref().map(|e| e as &dyn ExternalPayload);
            let Received {
                txs,
                ticket,
                dropped,
                ack_held,
            } = qp.receive_packet(now, &parsed, ext, meta, pending, more);
            if ack_held && !acking.iter().any(|q| Arc::ptr_eq(q, &qp)) {
                acking.push(qp.clone());
            }
            if let Some(reason) = dropped {
                tracing::debug!(
                    qpn = qp.number(),
                    psn = parsed.repr.bth.psn.value(),
                    opcode = ?parsed.repr.bth.opcode,
                    ?reason,
                    "dropped a packet"
                );
                self.counters.count_drop(reason);
            }
            let at = out.len();
            if out.is_empty() {
                // The usual single reply: its vector is the batch's, no copy.
                *out = txs;
            } else {
                let mut txs = txs;
                out.append(&mut txs);
                buffers::recycle_transmits(txs);
            }
            tickets.push((qp, ticket, at..out.len()));
        }
    }

    /// Runs due transport timers of this node's QPs; returns the earliest pending deadline.
    fn run_timers(self: &Arc<Self>, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        if let Some(gsi) = self.gsi.get() {
            if gsi.next_deadline().is_some_and(|d| d <= now) {
                self.fabric.send_all(self, gsi.on_timeout(now));
            }
            next = gsi.next_deadline();
        }
        for qp in self.qps() {
            if qp.next_deadline().is_some_and(|d| d <= now) {
                qp.on_timeout(now);
            }
            if let Some(d) = qp.next_deadline() {
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
    // From the newest back: an ACK to a QP already seen is older than that one. A batch holds
    // ACKs to few QPs, so a list beats hashing the 20-byte keys.
    let mut keep = vec![true; txs.len()];
    let mut seen: Vec<(Gid, u32)> = Vec::new();
    for (i, t) in txs.iter().enumerate().rev() {
        if is_ack(t) {
            let k = key(t);
            if seen.contains(&k) {
                keep[i] = false;
            } else {
                seen.push(k);
            }
        }
    }
    let mut k = keep.into_iter();
    txs.retain(|_| k.next().unwrap_or(true));
    txs
}

/// Whether packets along `b` may join a batch along `a`: the same addresses, ports and
/// header fields, to the same process (QPs of one peer process share its port).
fn same_link(a: &Route, b: &Route) -> bool {
    let unicast = a.dest_qpn != MULTICAST_QPN && b.dest_qpn != MULTICAST_QPN;
    (a.dest_qpn == b.dest_qpn || unicast)
        && Route {
            dest_qpn: a.dest_qpn,
            ..*b
        } == *a
}

/// The runs one routing produced: nearly always one (a QP's packets go to one peer), kept
/// inline so that routing a packet allocates no list.
type Runs<E> = SmallVec<[Run<E>; 1]>;

/// Packets for other processes along one link, from one node.
struct Run<E: Endpoint> {
    from: Arc<Node<E>>,
    route: Route,
    /// The destination is an address of this host (another process may have a mailbox).
    local_host: bool,
    packets: Vec<Vec<u8>>,
    /// For each packet, where its payload is if it was left in memory. Shorter than `packets`
    /// when the last ones have none (empty, with no allocation, in the common case of none).
    exts: Vec<Option<ExternalRanges>>,
}

impl<E: Endpoint> Run<E> {
    /// Appends a packet, with where its payload is if it was left in memory.
    fn push(&mut self, data: Vec<u8>, ext: Option<ExternalRanges>) {
        if ext.is_some() {
            self.exts.resize(self.packets.len(), None);
            self.exts.push(ext);
        }
        self.packets.push(data);
    }

    /// Appends the packets of `other`, which goes along the same link.
    fn append(&mut self, mut other: Self) {
        if !other.exts.is_empty() {
            self.exts.resize(self.packets.len(), None);
            self.exts.extend(other.exts);
        }
        self.packets.append(&mut other.packets);
        buffers::recycle_list(other.packets);
    }

    /// Drops every positive ACK of the run that a later one to the same QP covers.
    fn keep_last_acks(&mut self, acked: impl Fn(&[u8]) -> Option<u32>) {
        let mut seen: Vec<u32> = Vec::new();
        let mut keep: Vec<bool> = self
            .packets
            .iter()
            .rev()
            .map(|p| match acked(p) {
                Some(q) if seen.contains(&q) => false,
                Some(q) => {
                    seen.push(q);
                    true
                }
                None => true,
            })
            .collect();
        keep.reverse();
        let mut k = keep.into_iter();
        let before = self.packets.len();
        self.retain(|_| k.next().unwrap_or(true));
        self.from
            .counters
            .tx_acks_coalesced()
            .fetch_add((before - self.packets.len()) as u64, Ordering::Relaxed);
    }

    /// Keeps the packets `keep` says yes to (in order), with what is known of their payloads.
    fn retain(&mut self, mut keep: impl FnMut(&[u8]) -> bool) {
        if self.exts.is_empty() {
            self.packets.retain(|p| keep(p));
            return;
        }
        let mut exts = std::mem::take(&mut self.exts).into_iter();
        let mut kept = Vec::with_capacity(self.packets.len());
        self.packets.retain(|p| {
            let ext = exts.next().flatten();
            let k = keep(p);
            if k {
                kept.push(ext);
            }
            k
        });
        self.exts = kept;
    }
}

/// Packets waiting to be handed to a driver, in the order they were produced, and the tickets
/// to release once they were.
struct Outbox<E: Endpoint> {
    runs: Vec<Run<E>>,
    packets: usize,
    bytes: usize,
    tickets: Vec<(Arc<E>, u64)>,
}

impl<E: Endpoint> Default for Outbox<E> {
    fn default() -> Self {
        Self {
            runs: Vec::new(),
            packets: 0,
            bytes: 0,
            tickets: Vec::new(),
        }
    }
}

impl<E: Endpoint> Outbox<E> {
    fn is_empty(&self) -> bool {
        self.runs.is_empty() && self.tickets.is_empty()
    }

    /// Adds a run; its positive ACKs replace the waiting ones to the same QP.
    fn push(&mut self, mut run: Run<E>) {
        let acked = |p: &[u8]| is_positive_ack(p).then(|| peek_dest_qpn(p)).flatten();
        let acks = run.packets.iter().filter(|p| acked(p).is_some()).count();
        if acks == 0 {
            // Requests only (the common case of a posting thread): nothing to coalesce.
            self.packets += run.packets.len();
            self.bytes += run.packets.iter().map(Vec::len).sum::<usize>();
            if !run.packets.is_empty() {
                self.runs.push(run);
            }
            return;
        }
        for qpn in run.packets.iter().filter_map(|p| acked(p)) {
            for old in &mut self.runs {
                if old.route.dgid != run.route.dgid {
                    continue;
                }
                let before = old.packets.len();
                old.retain(|p| acked(p) != Some(qpn));
                let gone = before - old.packets.len();
                old.from
                    .counters
                    .tx_acks_coalesced()
                    .fetch_add(gone as u64, Ordering::Relaxed);
                self.packets -= gone;
                self.bytes -= gone * ACK_LEN;
            }
        }
        self.runs.retain(|r| !r.packets.is_empty());
        if acks > 1 {
            run.keep_last_acks(acked);
        }
        self.packets += run.packets.len();
        self.bytes += run.packets.iter().map(Vec::len).sum::<usize>();
        if !run.packets.is_empty() {
            self.runs.push(run);
        }
    }
}

/// Bytes of a positive ACK (BTH, AETH, ICRC).
const ACK_LEN: usize = 12 + 4 + 4;

thread_local! {
    /// Set while this thread runs a [`ReceivePass`].
    static IN_RECEIVE_PASS: Cell<bool> = const { Cell::new(false) };
}

/// A thread reading packets until its drivers run dry: what they cause waits in the outbox
/// (ACKs coalesce there) and is sent when the pass ends, on drop.
pub(crate) struct ReceivePass<'a, E: Endpoint> {
    fabric: &'a Fabric<E>,
    /// Packets received in this pass.
    pub(crate) received: usize,
}

impl<'a, E: Endpoint> ReceivePass<'a, E> {
    fn new(fabric: &'a Fabric<E>) -> Self {
        IN_RECEIVE_PASS.with(|c| c.set(true));
        Self { fabric, received: 0 }
    }

    /// Whether the pass should end: the drivers ran dry (a driver reads until its sockets or
    /// rings are empty, so a short batch means they were), or enough came that the peers wait
    /// for ACKs.
    fn done(&mut self, got: usize) -> bool {
        self.received += got;
        got < RECEIVE_PASS_PACKETS / 2 || self.received >= RECEIVE_PASS_PACKETS || self.fabric.outbox_full()
    }
}

impl<E: Endpoint> Drop for ReceivePass<'_, E> {
    fn drop(&mut self) {
        IN_RECEIVE_PASS.with(|c| c.set(false));
        self.fabric.flush_outbox();
    }
}

/// Packets a receive pass reads at most before what they caused is sent: a requester sets
/// AckReq at least every 64 packets and keeps at most 128 unacknowledged, so it must not wait
/// for a whole window.
const RECEIVE_PASS_PACKETS: usize = 64;

/// Packets of posted work requests held back (see [`Fabric::send_then_release`]) up to a GSO
/// batch: beyond it waiting saves no system call.
const OUTBOX_PACKETS: usize = 64;
/// Bytes held back at most, likewise.
const OUTBOX_BYTES: usize = 64 << 10;

/// The nodes of a fabric as listed at one moment: taking the list costs one reference count
/// (it is read on every poll and every send), and it changes only when a device comes or goes.
type LiveNodes<E> = Arc<[Arc<Node<E>>]>;

/// A device's hold on its node. The fabric lists its nodes strongly (so that listing them
/// needs no upgrade of weak references); this handle, owned by the device, takes the node off
/// the list when it is dropped, which breaks the cycle between node and fabric.
pub(crate) struct NodeHandle<E: Endpoint>(Arc<Node<E>>);

impl<E: Endpoint> std::ops::Deref for NodeHandle<E> {
    type Target = Arc<Node<E>>;

    fn deref(&self) -> &Arc<Node<E>> {
        &self.0
    }
}

impl<E: Endpoint> std::fmt::Debug for NodeHandle<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<E: Endpoint> Drop for NodeHandle<E> {
    fn drop(&mut self) {
        self.0.fabric.remove_node(&self.0);
    }
}

/// The fabric between the nodes of this process: routes packets through its drivers and
/// runs the progress and receive threads. Created by the device registry; nodes own it.
pub(crate) struct Fabric<E: Endpoint> {
    me: Weak<Self>,
    nodes: RwLock<LiveNodes<E>>,
    epoch: std::time::Instant,
    wake: Arc<WakeUp>,
    qpns: Mutex<QpnTable>,
    /// The UDP driver, once a QP number was allocated.
    udp: OnceLock<Arc<Udp>>,
    /// The UDP driver's receive batch; holding it is the right to receive from it.
    udp_rx: Mutex<PacketBatch>,
    /// Serialises attempts to start the UDP driver.
    udp_start: Mutex<()>,
    /// The shared-memory driver (started with the UDP driver, unless turned off).
    shm: OnceLock<Arc<Shm>>,
    /// The shared-memory driver's receive batch; holding it is the right to receive from it.
    shm_rx: Mutex<PacketBatch>,
    /// Other processes of this host in each multicast group sent to, and when that was looked
    /// up (see `crate::mcast`).
    mcast_members: Mutex<HashMap<Gid, (std::time::Instant, Vec<u8>)>>,
    /// While shared memory carries traffic, application polls leave the UDP sockets alone
    /// until this time (engine nanoseconds); 0 after they delivered something.
    udp_next_look: AtomicU64,
    /// Until when (engine nanoseconds) shared memory counts as carrying traffic.
    shm_busy_until: AtomicU64,
    /// When an application thread last polled an empty CQ (engine nanoseconds), reading the
    /// drivers itself.
    app_poll_at: AtomicU64,
    /// When an application thread last polled a CQ, empty or not (engine nanoseconds; 0:
    /// never).
    app_active_at: AtomicU64,
    /// Packets for other processes not yet handed to a driver.
    outbox: Mutex<Outbox<E>>,
    /// The outbox holds something (a look without the lock; changed under it).
    outbox_busy: AtomicBool,
    /// Held while a batch taken from the outbox is being sent.
    sending: Mutex<()>,
    /// Receive threads waiting on their driver (not napping while an application polls).
    rx_waiting: AtomicU32,
    /// [`BURST_AFTER_POLL`] in nanoseconds (tests widen it).
    burst_after_poll: AtomicU64,
    /// Posts since an application thread last polled a CQ.
    posts_since_poll: AtomicU32,
    /// Raised whenever a packet is queued at any node (see [`InProcess::new`]), lowered by
    /// [`Fabric::drive`] before it looks at the nodes: a poll with nothing in flight costs one
    /// load.
    queued: Arc<AtomicBool>,
    /// The packet capture, if one runs: every packet handed to or received from a driver.
    tap: Tap,
}

impl<E: Endpoint> std::fmt::Debug for Fabric<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fabric")
            .field("nodes", &self.nodes.read().len())
            .field("udp", &self.udp.get())
            .finish_non_exhaustive()
    }
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

/// How recently an application thread must have polled for the receive thread to leave the
/// socket to it, and how long that thread then naps before it looks again. Every nap's end is
/// a wake-up that takes a core from a spinning poller (at 200 us, two processes ping-ponging
/// over shared memory saw 17,000 context switches a second and a quarter more latency).
const APP_POLLING: Duration = Duration::from_millis(1);
/// The nap instead while posted packets wait in the outbox: its end sends them if the
/// application stopped polling right after it posted.
const HELD_NAP: Duration = Duration::from_micros(200);

/// Whether packets handed to [`Fabric::send_then_release`] may wait in the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// They leave at once (with whatever waits before them).
    No,
    /// Responses to received packets: during a receive pass they wait for its end (when the
    /// drivers ran dry), so that one ACK per QP covers the pass.
    InPass,
    /// Packets of work requests just posted: as `InPass`, and also while the application
    /// busy-polls (see `Fabric::in_burst`); its next poll sends them (or a wait on a
    /// completion channel), or else the receive thread: a napping one when its nap ends, a
    /// waiting one is woken. Packets to shared-memory peers never wait (they cost no system
    /// call).
    Posted,
}

/// How recently an application thread must have polled for what it posts to wait in the
/// outbox for its next poll. At least [`APP_POLLING`]: a burst of posts between two polls
/// may take a while, and sending each post alone makes it longer still.
const BURST_AFTER_POLL: Duration = Duration::from_millis(1);

/// While shared memory carries traffic, application polls look at idle UDP sockets at most
/// this often (each look is a system call, several times the cost of a poll that finds
/// nothing; a packet that comes over UDP meanwhile waits this long at most).
const UDP_LOOK_EVERY: Duration = Duration::from_micros(200);
/// How long after shared memory last delivered it still counts as carrying traffic.
const SHM_BUSY: Duration = Duration::from_millis(1);

/// Waits on a receiving driver (UDP or shared memory) and hands what arrives to the nodes with
/// `pump`; ends once the fabric is gone.
fn receive_thread<E: Endpoint, D: Driver>(
    fabric: Weak<Fabric<E>>,
    driver: Arc<D>,
    pump: fn(&Fabric<E>, bool) -> usize,
) {
    loop {
        let Some(f) = fabric.upgrade() else { return };
        // Also while an application polls (below): a busy poller never lets this thread wait
        // on the driver, and the upkeep (taking the standard port over, letting go of peers
        // that are gone) must not depend on that.
        driver.tick();
        // What a polling application posted goes out by now at the latest.
        f.flush_outbox();
        // While an application thread polls a CQ, it reads the driver itself with no thread
        // hand-off: do not even wait on it, since every wake-up would take a core from a
        // spinning thread (and senders to a mailbox ring its doorbell only while this thread
        // sleeps on it).
        let since = f
            .now()
            .as_nanos()
            .saturating_sub(f.app_poll_at.load(Ordering::Relaxed));
        if since < APP_POLLING.as_nanos() as u64 {
            let nap = if f.outbox_busy.load(Ordering::Acquire) {
                HELD_NAP
            } else {
                APP_POLLING
            };
            drop(f);
            std::thread::sleep(nap);
            continue;
        }
        // From here on a thread that holds posted packets back wakes this one: see
        // `send_then_release`.
        f.rx_waiting.fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        f.flush_outbox();
        drop(f);
        // Wakes at least once a second, for the upkeep above.
        let readable = driver.wait(Duration::from_secs(1));
        let Some(f) = fabric.upgrade() else { return };
        f.rx_waiting.fetch_sub(1, Ordering::SeqCst);
        if readable {
            // A burst usually goes on: look again for a moment before sleeping, since each
            // sleep costs the sender a wake-up call and this thread a few microseconds.
            let mut last = std::time::Instant::now();
            loop {
                let mut pass = ReceivePass::new(&f);
                loop {
                    let got = pump(&f, true);
                    f.drive(f.now());
                    if pass.done(got) {
                        break;
                    }
                }
                if pass.received > 0 {
                    last = std::time::Instant::now();
                }
                drop(pass);
                if last.elapsed() >= RX_LINGER {
                    break;
                }
                std::thread::yield_now();
            }
        }
    }
}

/// How long a receive thread keeps looking after its last packet before it sleeps.
const RX_LINGER: Duration = Duration::from_micros(50);

/// Runs transport timers when they are due; ends once the fabric is gone.
fn progress_thread<E: Endpoint>(fabric: Weak<Fabric<E>>, wake: Arc<WakeUp>) {
    loop {
        let Some(f) = fabric.upgrade() else { return };
        wake.begin_pass();
        f.drive(f.now());
        // Read after the drive, which may take a while under load.
        let now = f.now();
        let mut next = None;
        for node in f.live_nodes().iter() {
            if let Some(d) = node.run_timers(now) {
                next = Some(next.map_or(d, |n: Instant| n.min(d)));
            }
        }
        f.drive(f.now());
        let wait_from = f.now().as_nanos();
        // Not kept across the wait: the fabric ends when its last owner lets go.
        drop(f);
        let (mut guard, target) = wake.end_pass(next.map_or(u64::MAX, |d| d.as_nanos()));
        if wake.closed.load(Ordering::Acquire) {
            return;
        }
        if target == u64::MAX {
            wake.cv.wait(&mut guard);
        } else {
            let wait = Duration::from_nanos(target.saturating_sub(wait_from));
            if !wait.is_zero() {
                wake.cv.wait_for(&mut guard, wait);
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
    /// The fabric is gone: the progress thread ends.
    closed: AtomicBool,
}

impl WakeUp {
    fn new() -> Self {
        Self {
            at: AtomicU64::new(u64::MAX),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            closed: AtomicBool::new(false),
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

    /// Ends the progress thread.
    fn close(&self) {
        let _guard = self.lock.lock();
        self.closed.store(true, Ordering::Release);
        self.cv.notify_one();
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

impl<E: Endpoint> Drop for Fabric<E> {
    fn drop(&mut self) {
        self.wake.close();
        if let Some(u) = self.udp.get() {
            u.wake();
        }
    }
}

impl<E: Endpoint> Fabric<E> {
    /// A fabric with no node yet, and its progress thread. Fails when the thread cannot be
    /// started (the process's or user's thread limit).
    pub(crate) fn new() -> std::io::Result<Arc<Self>> {
        let f = Arc::new_cyclic(|me| Self {
            me: me.clone(),
            nodes: RwLock::new(Vec::new().into()),
            epoch: std::time::Instant::now(),
            wake: Arc::new(WakeUp::new()),
            qpns: Mutex::new(QpnTable::new(FIRST_QPN, LAST_QPN_INDEX)),
            udp: OnceLock::new(),
            udp_rx: Mutex::new(PacketBatch::default()),
            udp_start: Mutex::new(()),
            shm: OnceLock::new(),
            mcast_members: Mutex::new(HashMap::new()),
            shm_rx: Mutex::new(PacketBatch::default()),
            udp_next_look: AtomicU64::new(0),
            shm_busy_until: AtomicU64::new(0),
            app_poll_at: AtomicU64::new(0),
            app_active_at: AtomicU64::new(0),
            outbox: Mutex::new(Outbox::default()),
            outbox_busy: AtomicBool::new(false),
            sending: Mutex::new(()),
            rx_waiting: AtomicU32::new(0),
            burst_after_poll: AtomicU64::new(BURST_AFTER_POLL.as_nanos() as u64),
            posts_since_poll: AtomicU32::new(0),
            queued: Arc::new(AtomicBool::new(false)),
            tap: Tap::default(),
        });
        let (me, wake) = (Arc::downgrade(&f), f.wake.clone());
        std::thread::Builder::new()
            .name("softverbs-progress".into())
            .spawn(move || progress_thread(me, wake))?;
        Ok(f)
    }

    /// A node for a device with these GIDs on interface `ifindex`.
    pub(crate) fn add_node(
        self: &Arc<Self>,
        counters: NodeCounters,
        gids: &[Gid],
        ifindex: u32,
    ) -> NodeHandle<E> {
        let node = Arc::new(Node {
            fabric: self.clone(),
            gids: gids.iter().copied().filter(|g| !g.is_zero()).collect(),
            ifindex,
            qps: RwLock::new(QpMap::default()),
            mcast: Mutex::new(McastTable::default()),
            keys: KeyTable::default(),
            ud_flows: Default::default(),
            inbound: InProcess::new(self.queued.clone()),
            processing: Mutex::new(Processing {
                batch: PacketBatch::default(),
                tickets: Vec::new(),
                targets: Vec::new(),
                acking: Vec::new(),
            }),
            driving: AtomicBool::new(false),
            counters,
            gsi: OnceLock::new(),
        });
        let mut nodes = self.nodes.write();
        *nodes = nodes.iter().cloned().chain([node.clone()]).collect();
        drop(nodes);
        NodeHandle(node)
    }

    /// Takes `node` off the list (its device is gone). Devices are built on every device
    /// listing and most are dropped at once, so this keeps the list (and each node's memory)
    /// from growing with every call.
    fn remove_node(&self, node: &Arc<Node<E>>) {
        let mut nodes = self.nodes.write();
        *nodes = nodes.iter().filter(|n| !Arc::ptr_eq(n, node)).cloned().collect();
    }

    /// Nodes registered.
    #[cfg(test)]
    fn node_count(&self) -> usize {
        self.nodes.read().len()
    }

    /// The packet-capture hook.
    pub(crate) fn tap(&self) -> &Tap {
        &self.tap
    }

    /// The engine's clock: nanoseconds since the fabric started.
    pub(crate) fn now(&self) -> Instant {
        Instant(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// The nodes in use (those whose devices still exist).
    fn live_nodes(&self) -> LiveNodes<E> {
        self.nodes.read().clone()
    }

    /// Tells the progress thread about a deadline, waking it if it would sleep past it.
    pub(crate) fn schedule(&self, at: Instant) {
        self.wake.schedule(at.as_nanos());
    }

    /// Drives every node until no packet is left in flight.
    ///
    /// Every queue raises `queued` after it took a packet, and this lowers it before it looks
    /// at the nodes, so a packet queued before the flag was lowered is seen by this pass, and
    /// one queued later raises it again for the next pass (here, or another thread's). A node
    /// another thread is driving is left to that thread, which runs until its queue is empty.
    pub(crate) fn drive(&self, now: Instant) {
        // The usual empty poll ends here, without even a look at the node list.
        if !self.queued.load(Ordering::Acquire) {
            return;
        }
        while self.queued.swap(false, Ordering::AcqRel) {
            // Listed after the flag was lowered: a node added since is in the list.
            for n in self.live_nodes().iter() {
                n.drive(now);
            }
        }
    }

    /// [`Fabric::drive`] at the current time, read only if a packet is queued (a sender calls
    /// this after every post, mostly with nothing to do).
    pub(crate) fn drive_queued(&self) {
        if self.queued.load(Ordering::Acquire) {
            self.drive(self.now());
        }
    }

    /// Makes progress from an application thread: delivers packets in flight and, if a
    /// transport deadline has passed, runs the timers (so busy polling does not wait for the
    /// progress thread to be scheduled).
    pub(crate) fn progress(&self, now: Instant) {
        self.app_poll_at.store(now.as_nanos(), Ordering::Relaxed);
        self.polled(now);
        // One receive pass: read until the drivers run dry, so that what the packets cause
        // (ACKs above all) leaves in one batch when the pass ends.
        let mut pass = ReceivePass::new(self);
        let mut at = now;
        loop {
            let mut got = self.pump_shm(false);
            if got > 0 {
                self.shm_busy_until
                    .store(now.as_nanos() + SHM_BUSY.as_nanos() as u64, Ordering::Relaxed);
            }
            // Looking at the UDP sockets is a system call. While shared memory carries this
            // process's traffic, a poller that found them empty looks again only after a
            // while; as long as they deliver, or when shared memory is quiet, every poll reads
            // them.
            let t = at.as_nanos();
            let skip = t < self.shm_busy_until.load(Ordering::Relaxed)
                && t < self.udp_next_look.load(Ordering::Relaxed);
            if !skip {
                let n = self.pump_udp(false);
                let next = if n > 0 {
                    0
                } else {
                    t + UDP_LOOK_EVERY.as_nanos() as u64
                };
                self.udp_next_look.store(next, Ordering::Relaxed);
                got += n;
            }
            self.drive(at);
            if pass.done(got) {
                break;
            }
            at = self.now();
        }
        if self.wake.load() <= now.as_nanos() {
            let now = self.now();
            for n in self.live_nodes().iter() {
                n.run_timers(now);
            }
            self.drive(self.now());
        }
        drop(pass);
    }

    /// Notes that an application thread polls a CQ (so it is busy polling) and sends what it
    /// posted since its last poll, in one batch.
    pub(crate) fn polled(&self, now: Instant) {
        self.app_active_at.store(now.as_nanos().max(1), Ordering::Relaxed);
        self.posts_since_poll.store(0, Ordering::Relaxed);
        self.flush_outbox();
    }

    /// Reads the UDP driver and hands what it got to the nodes before another thread may read
    /// (so packets reach the nodes in the order the sockets held them). With `wait` false, an
    /// application thread gives way if another thread is reading.
    fn pump_udp(&self, wait: bool) -> usize {
        let Some(udp) = self.udp.get() else { return 0 };
        self.pump(&**udp, Carrier::Udp, &self.udp_rx, wait)
    }

    /// Reads the shared-memory driver, as [`Fabric::pump_udp`] reads the UDP one.
    fn pump_shm(&self, wait: bool) -> usize {
        let Some(shm) = self.shm.get() else { return 0 };
        self.pump(&**shm, Carrier::Shm, &self.shm_rx, wait)
    }

    /// Receives from `driver` into `rx` (whose lock is the right to receive from it) and hands
    /// the batch to the nodes before another thread may receive, so packets reach the nodes in
    /// the driver's order. With `wait` false, an application thread gives way if another
    /// thread is receiving.
    fn pump(&self, driver: &dyn Driver, carrier: Carrier, rx: &Mutex<PacketBatch>, wait: bool) -> usize {
        let mut batch = if wait {
            rx.lock()
        } else {
            let Some(b) = rx.try_lock() else { return 0 };
            b
        };
        let n = driver.recv(&mut batch);
        if n > 0 {
            if let Some(cap) = self.tap.get() {
                cap.incoming(carrier, &batch);
            }
            self.deliver_batch(&self.live_nodes(), &mut batch);
        }
        batch.clear();
        n
    }

    /// Routes packets from `from` to their destinations at once: to the in-process driver of
    /// the node of this fabric that has the destination GID and QP, otherwise out through
    /// shared memory or UDP (runs of packets along one link in one batch). Used where packets
    /// must not wait behind others (a QP moving to the error state under its lock).
    pub(crate) fn send_all(&self, from: &Arc<Node<E>>, txs: Vec<Transmit>) {
        let runs = self.route(from, txs);
        self.send_runs(runs, None);
    }

    /// Sends packets from `from` as [`Fabric::send_all`] does, then makes the completions held
    /// under `tickets` visible. Packets for other processes go through the outbox, in order:
    /// the next thread that sends takes everything in it, and releases the tickets once their
    /// packets were handed to a driver (an application that sees its last completion and
    /// exits must not leave the peer without the packets it was waiting for).
    ///
    /// With `hold`, the packets may stay in the outbox for a short while, to leave with others
    /// in one batch (one `sendmmsg` or GSO call instead of a system call each): see [`Hold`].
    /// A full outbox leaves at once. A positive ACK replaces the waiting ACKs of its QP (ACKs
    /// are cumulative), so one ACK covers every packet of a pass. `now`: a time the caller
    /// read a moment ago, if any, for the drivers to use instead of reading the clock.
    pub(crate) fn send_then_release(
        &self,
        from: &Arc<Node<E>>,
        txs: Vec<Transmit>,
        tickets: impl IntoIterator<Item = (Arc<E>, u64)>,
        hold: Hold,
        now: Option<Instant>,
    ) {
        let runs = self.route(from, txs);
        // Shared memory costs no system call: nothing to save by waiting.
        let by_udp = runs.iter().any(|r| !(r.local_host && self.shm.get().is_some()));
        let may_wait = match hold {
            Hold::No => false,
            Hold::InPass => IN_RECEIVE_PASS.with(Cell::get),
            Hold::Posted => IN_RECEIVE_PASS.with(Cell::get) || self.in_burst(),
        };
        // Nothing to send (a work request queued behind a full window): its tickets wait
        // behind the packets that wait, if any, rather than send them early.
        let wait = may_wait && (by_udp || (runs.is_empty() && self.outbox_busy.load(Ordering::Acquire)));
        if !wait {
            // At once, behind whatever waits (in order), without going through the outbox.
            let waiting = {
                let _sending = self.sending.lock();
                let waiting = self.take_outbox();
                self.send_runs(waiting.runs, now);
                self.send_runs(runs, now);
                waiting.tickets
            };
            for (qp, ticket) in waiting.into_iter().chain(tickets) {
                qp.release_ticket(ticket);
            }
            return;
        }
        let (full, first) = {
            let mut out = self.outbox.lock();
            let first = out.is_empty();
            for run in runs {
                out.push(run);
            }
            out.tickets.extend(tickets);
            self.outbox_busy.store(!out.is_empty(), Ordering::Release);
            (out.packets >= OUTBOX_PACKETS || out.bytes >= OUTBOX_BYTES, first)
        };
        if full {
            self.flush_outbox();
        } else if hold == Hold::Posted && !IN_RECEIVE_PASS.with(Cell::get) {
            // Pairs with the fence in `receive_thread`: either that thread sees these packets
            // before it waits, or this one sees it waiting and wakes it.
            std::sync::atomic::fence(Ordering::SeqCst);
            if first && self.rx_waiting.load(Ordering::SeqCst) > 0 {
                // A receive thread waits on its driver: it looks at the outbox once woken
                // (then naps while the application polls, see `receive_thread`).
                if let Some(u) = self.udp.get() {
                    u.wake();
                }
                if let Some(s) = self.shm.get() {
                    s.wake();
                }
            }
        }
    }

    /// Whether work requests are being posted in a burst by a busy-polling application: it
    /// polled a CQ lately (its next poll sends them) and this is not the first post since. The
    /// first goes at once: a program that posts one message per event may sleep next, outside
    /// softverbs (in `epoll_wait`, say), and its message must not wait for anyone.
    fn in_burst(&self) -> bool {
        let later = self.posts_since_poll.fetch_add(1, Ordering::Relaxed) > 0;
        let polled_at = self.app_active_at.load(Ordering::Relaxed);
        later
            && polled_at != 0
            && self.now().as_nanos().saturating_sub(polled_at) < self.burst_after_poll.load(Ordering::Relaxed)
    }

    /// Empties the outbox.
    fn take_outbox(&self) -> Outbox<E> {
        let mut out = self.outbox.lock();
        if out.is_empty() {
            return Outbox::default();
        }
        self.outbox_busy.store(false, Ordering::Release);
        std::mem::take(&mut *out)
    }

    /// Whether the outbox holds a batch's worth.
    fn outbox_full(&self) -> bool {
        let out = self.outbox.lock();
        out.packets >= OUTBOX_PACKETS || out.bytes >= OUTBOX_BYTES
    }

    /// Sends what the outbox holds, in order, and then releases the tickets of what was sent.
    pub(crate) fn flush_outbox(&self) {
        // Every poll comes here: most find nothing, without taking a lock.
        if !self.outbox_busy.load(Ordering::Acquire) {
            return;
        }
        let tickets = {
            // Taking and sending under one lock keeps the packets in the order they were
            // produced; each thread sends at most what was there when it came (a thread that
            // sends for others forever would never poll again).
            let _sending = self.sending.lock();
            let batch = self.take_outbox();
            self.send_runs(batch.runs, None);
            batch.tickets
        };
        for (qp, ticket) in tickets {
            qp.release_ticket(ticket);
        }
    }

    /// Delivers the packets for this process's nodes and returns the others in runs along one
    /// link (one batch each for a driver), counting every packet on `from`.
    fn route(&self, from: &Arc<Node<E>>, mut txs: Vec<Transmit>) -> Runs<E> {
        let mut remote = Runs::new();
        if txs.is_empty() {
            buffers::recycle_transmits(txs);
            return remote;
        }
        let nodes = self.live_nodes();
        let own_slot = self.udp.get().map(|u| u.slot());
        let mut add_remote =
            |route: Route, data: Vec<u8>, ext: Option<ExternalRanges>| match remote.last_mut() {
                Some(r) if same_link(&r.route, &route) => r.push(data, ext),
                _ => {
                    let mut run = Run {
                        from: from.clone(),
                        route,
                        local_host: route.dest_qpn != MULTICAST_QPN
                            && nodes.iter().any(|n| n.has_gid(&route.dgid)),
                        packets: buffers::take_list(),
                        exts: Vec::new(),
                    };
                    run.push(data, ext);
                    remote.push(run);
                }
            };
        for mut tx in txs.drain(..) {
            bump(from.counters.tx_packets());
            let ext_len: u64 = tx
                .external
                .as_ref()
                .map_or(0, |e| e.ranges().iter().map(|r| u64::from(r.1)).sum());
            from.counters
                .tx_bytes()
                .fetch_add(tx.data.len() as u64 + ext_len, Ordering::Relaxed);
            let qpn = peek_dest_qpn(&tx.data).unwrap_or(0);
            let route = Route {
                sgid: from
                    .gids
                    .get(usize::from(tx.dest.sgid_index))
                    .copied()
                    .unwrap_or(Gid::ZERO),
                dgid: tx.dest.dgid,
                dest_qpn: qpn,
                traffic_class: tx.dest.traffic_class,
                hop_limit: tx.dest.hop_limit,
                ifindex: from.ifindex,
                // The ports the datagram has, or would have had, over UDP.
                ports: self.udp.get().map_or((0, 0), |u| (u.port(), u.dest_port(qpn))),
            };
            if qpn == MULTICAST_QPN {
                // Members may live in this process, other processes and other hosts.
                for n in nodes.iter().filter(|n| n.has_group(&tx.dest.dgid)) {
                    n.inbound.send(&route, &mut [tx.data.clone()]);
                }
                add_remote(route, tx.data, tx.external);
            } else if let Some(n) = nodes
                .iter()
                .find(|n| n.has_gid(&tx.dest.dgid) && (n.has_qp(qpn) || n.takes_gsi(qpn, own_slot)))
            {
                if let Some(ext) = &tx.external {
                    // This process's carrier moves bytes.
                    let Some(full) = remote::materialize(&tx.data, ext) else {
                        continue;
                    };
                    tx.data = full;
                }
                if let Some(cap) = self.tap.get() {
                    cap.outgoing(&route, std::slice::from_ref(&tx.data), &[]);
                }
                n.inbound.send(&route, std::slice::from_mut(&mut tx.data));
            } else {
                add_remote(route, tx.data, tx.external);
            }
        }
        buffers::recycle_transmits(txs);
        remote
    }

    /// Sends runs of packets for other processes: through a process's mailbox if it has one,
    /// otherwise over UDP. Adjacent runs along one link (QPs of one peer process) go together.
    /// `now`: the time the caller read a moment ago, if it did (the shared-memory driver then
    /// reads no clock).
    fn send_runs(&self, runs: impl IntoIterator<Item = Run<E>>, now: Option<Instant>) {
        let mut runs = runs.into_iter().peekable();
        while let Some(mut run) = runs.next() {
            while let Some(next) =
                runs.next_if(|n| Arc::ptr_eq(&n.from, &run.from) && same_link(&n.route, &run.route))
            {
                run.append(next);
            }
            let Run {
                from,
                route,
                local_host,
                mut packets,
                exts,
            } = run;
            if let Some(cap) = self.tap.get() {
                cap.outgoing(&route, &packets, &exts);
            }
            if route.dest_qpn == MULTICAST_QPN {
                self.copy_to_local_members(&route, &packets);
            }
            // Another process on this host (the address is one of this fabric's devices'):
            // through its mailbox if it has one.
            let by_shm = match self.shm.get() {
                Some(shm) if local_host => match now {
                    Some(now) => shm.send_to_process_at(now.as_nanos(), &route, &packets, &exts),
                    None => shm.send_to_process(&route, &packets, &exts),
                },
                _ => None,
            };
            if by_shm.is_none() && exts.iter().any(Option::is_some) {
                // UDP carries bytes: fetch the payloads left in memory.
                for (data, ext) in packets.iter_mut().zip(&exts) {
                    if let Some(ext) = ext {
                        *data = remote::materialize(data, ext).unwrap_or_default();
                    }
                }
                packets.retain(|d| !d.is_empty());
            }
            let sent = match by_shm {
                Some(n) => {
                    from.counters
                        .tx_shm_packets()
                        .fetch_add(n as u64, Ordering::Relaxed);
                    let in_memory = exts.iter().take(n).filter(|e| e.is_some()).count();
                    from.counters
                        .tx_payloads_in_memory()
                        .fetch_add(in_memory as u64, Ordering::Relaxed);
                    n
                }
                None => self.udp.get().map_or(0, |u| u.send(&route, &mut packets)),
            };
            if route.dest_qpn != MULTICAST_QPN {
                for _ in sent..packets.len() {
                    bump(from.counters.tx_unroutable());
                }
            }
            // The drivers took the bytes: the buffers (and the list) serve the next packets.
            buffers::recycle_list(packets);
        }
    }

    /// Multicast packets reach the members of their group in other processes of this host
    /// through their mailboxes (the network would loop them back only with a multicast route
    /// and group sockets, see `crate::mcast`); members elsewhere get them over UDP.
    fn copy_to_local_members(&self, route: &Route, packets: &[Vec<u8>]) {
        let (Some(shm), Some(udp)) = (self.shm.get(), self.udp.get()) else {
            return;
        };
        let (base, own) = (udp.base(), udp.slot());
        let slots = {
            let mut cache = self.mcast_members.lock();
            let now = std::time::Instant::now();
            let entry = cache.entry(route.dgid).or_insert_with(|| (now, Vec::new()));
            if entry.1.is_empty() || now.duration_since(entry.0) >= MCAST_MEMBERS_FOR {
                *entry = (now, crate::mcast::members(base, &route.dgid));
            }
            entry.1.clone()
        };
        for slot in slots.into_iter().filter(|&s| s != own) {
            let mut to = *route;
            to.ports.1 = base.saturating_add(u16::from(slot));
            let _ = shm.send_to_process(&to, packets, &[]);
        }
    }

    /// Starts the UDP driver (once per fabric) on the first free slot of `slots` above
    /// `base_port`; its slot numbers this process's QPs. Fails with ENOMEM while every slot is
    /// taken or its receive thread cannot be started: the next call tries again. Without a
    /// thread for the shared-memory mailbox the driver runs on UDP alone.
    fn start_udp(&self, base_port: u16, slots: u8) -> Result<&Arc<Udp>> {
        if let Some(u) = self.udp.get() {
            return Ok(u);
        }
        let _starting = self.udp_start.lock();
        if let Some(u) = self.udp.get() {
            return Ok(u);
        }
        let Some(udp) = Udp::start(base_port, slots) else {
            tracing::warn!(
                base_port,
                slots,
                "no free UDP slot (ports base+1..=base+slots are all taken): QPs cannot be created"
            );
            return Err(Error::no_resources(format!(
                "no free UDP slot: ports {}..={} are all taken by other processes",
                u32::from(base_port) + 1,
                u32::from(base_port) + u32::from(slots)
            )));
        };
        let (me, u) = (self.me.clone(), udp.clone());
        std::thread::Builder::new()
            .name("softverbs-rx".into())
            .spawn(move || receive_thread(me, u, Self::pump_udp))
            .map_err(|e| {
                // The thread did not start, so nothing else holds the driver: its sockets close
                // here and the slot is free for the next try.
                Error::no_resources(format!("cannot start the UDP receive thread: {e}"))
            })?;
        if let Some(shm) = Shm::start(udp.port(), self.epoch) {
            let (me, s) = (self.me.clone(), shm.clone());
            let started = std::thread::Builder::new()
                .name("softverbs-shm".into())
                .spawn(move || receive_thread(me, s, Self::pump_shm));
            match started {
                Ok(_) => {
                    udp.forward_through(shm.clone());
                    let _ = self.shm.set(shm);
                }
                Err(e) => tracing::warn!(
                    error = %e,
                    "no thread for the shared-memory mailbox: this process uses UDP alone"
                ),
            }
        }
        // Under `udp_start`, after the check above: nothing else sets it.
        Ok(self.udp.get_or_init(|| udp))
    }

    /// Whether packets to QP `dest_qpn` at `dgid` go through shared memory with their large
    /// payloads left in memory: the address is this host's (one of this fabric's devices), the
    /// QP number names another process's slot, that process has a mailbox this one can open,
    /// and it may copy out of this process ([`remote::peers_may_read_us`]).
    pub(crate) fn can_leave_payloads_in_memory(&self, dgid: &Gid, dest_qpn: u32) -> bool {
        remote::peers_may_read_us() && self.mailbox_reaches(dgid, dest_qpn) == Some(true)
    }

    /// Whether packets to QP `dest_qpn` at `dgid` stay on a carrier that loses none: a node of
    /// this process, or another process of this host reached through its mailbox (a full ring
    /// is waited on, not dropped).
    pub(crate) fn reaches_without_loss(&self, dgid: &Gid, dest_qpn: u32) -> bool {
        self.mailbox_reaches(dgid, dest_qpn) != Some(false)
    }

    /// For a destination on this host (one of this fabric's GIDs): whether another process's
    /// mailbox takes its packets (`Some(true)`), or they go over UDP (`Some(false)`); `None`
    /// when they stay in this process. A destination elsewhere is `Some(false)`.
    fn mailbox_reaches(&self, dgid: &Gid, dest_qpn: u32) -> Option<bool> {
        if !self.live_nodes().iter().any(|n| n.has_gid(dgid)) {
            return Some(false);
        }
        // Without a UDP driver every packet stays in this process.
        let udp = self.udp.get()?;
        if dest_qpn >> 16 == u32::from(udp.slot()) {
            return None;
        }
        let Some(shm) = self.shm.get() else {
            return Some(false);
        };
        let route = Route {
            sgid: Gid::ZERO,
            dgid: *dgid,
            dest_qpn,
            traffic_class: 0,
            hop_limit: 0,
            ifindex: 0,
            ports: (udp.port(), udp.dest_port(dest_qpn)),
        };
        Some(shm.send_to_process(&route, &[], &[]).is_some())
    }

    /// Forwarded datagrams the UDP driver dropped as forged.
    pub(crate) fn forged_forwards(&self) -> u64 {
        self.udp.get().map_or(0, |u| u.forged_forwards())
    }

    /// (slot, own UDP port, holds the standard port) if the UDP driver runs.
    pub(crate) fn udp_status(&self) -> Option<(u8, u16, bool)> {
        self.udp.get().map(|u| (u.slot(), u.port(), u.is_forwarder()))
    }

    /// A fresh QP number, unique among live QPs of this host: the process's UDP slot in bits
    /// 16..24 and a per-process index below. Fails with ENOMEM once every index is in use, or
    /// while this process has no UDP slot: a number without one would collide with another
    /// process's and its traffic would go astray, so no QP is better than a silent one.
    pub(crate) fn alloc_qpn(&self, base_port: u16, slots: u8) -> Result<u32> {
        let slot = u32::from(self.start_udp(base_port, slots)?.slot());
        let idx = self.qpns.lock().alloc().ok_or_else(|| {
            Error::no_resources(format!(
                "all {} QP numbers of this process are in use (QPs, SRQs and WQs share them)",
                LAST_QPN_INDEX - FIRST_QPN + 1
            ))
        })?;
        Ok((slot << 16) | idx)
    }

    /// Hands received packets to their nodes' inbound queues, in order: a multicast packet to
    /// every node in its group, any other to the node with its destination GID (the one that
    /// has its QP, if several share the GID). Packets with buffers of their own move there.
    fn deliver_batch(&self, nodes: &[Arc<Node<E>>], batch: &mut PacketBatch) {
        if let Some(target) = Self::sole_target(nodes, batch) {
            // The common case (one device, or one peer's traffic): the batch moves whole.
            for (_, d) in batch.iter() {
                if d.icrc == IcrcCheck::Unverified {
                    if let Some(first) = nodes.iter().find(|n| n.has_gid(&d.meta.dgid)) {
                        bump(first.counters.rx_icrc_unverified());
                    }
                }
            }
            target.inbound.deliver_all(batch);
            return;
        }
        for (data, (meta, icrc, ports, remote)) in batch.drain() {
            let dgid = meta.dgid;
            let targets: Vec<&Arc<Node<E>>> = if dgid.is_multicast() {
                nodes.iter().filter(|n| n.has_group(&dgid)).collect()
            } else {
                let Some((first, target)) = Self::unicast_target(nodes, &dgid, data.as_slice()) else {
                    tracing::debug!(dst = %dgid.to_ip(), "dropped a packet: no device has its address");
                    continue;
                };
                // The verdict counts on the first node with the GID, as before the choice.
                if !count_icrc(first, icrc) {
                    continue;
                }
                target.deliver(data, meta, ports, remote);
                continue;
            };
            let Some((last, rest)) = targets.split_last() else {
                continue;
            };
            if !count_icrc(targets[0], icrc) {
                continue;
            }
            for n in rest {
                n.deliver(PacketData::Shared(data.as_slice()), meta, ports, remote);
            }
            last.deliver(data, meta, ports, remote);
        }
    }

    /// The first node with `dgid`, and the node a unicast packet goes to: the one of the
    /// nodes with `dgid` that has its destination QP, else the first.
    fn unicast_target<'n>(nodes: &'n [Arc<Node<E>>], dgid: &Gid, packet: &[u8]) -> Option<NodePair<'n, E>> {
        let mut owners = nodes.iter().filter(|n| n.has_gid(dgid));
        let first = owners.next()?;
        let target = match peek_dest_qpn(packet) {
            Some(q) if !first.has_qp(q) => owners.find(|n| n.has_qp(q)).unwrap_or(first),
            _ => first,
        };
        Some((first, target))
    }

    /// The node every packet of `batch` goes to, if there is one: all unicast, none with a bad
    /// ICRC, all to the same node.
    fn sole_target<'n>(nodes: &'n [Arc<Node<E>>], batch: &PacketBatch) -> Option<&'n Arc<Node<E>>> {
        let mut sole: Option<&Arc<Node<E>>> = None;
        // Packets of a burst mostly share their destination: look each one up once.
        let mut last: Option<(Gid, Option<u32>)> = None;
        for (data, d) in batch.iter() {
            if d.meta.dgid.is_multicast() || d.icrc == IcrcCheck::Bad {
                return None;
            }
            let dest = (d.meta.dgid, peek_dest_qpn(data));
            if last == Some(dest) {
                continue;
            }
            let (_, target) = Self::unicast_target(nodes, &d.meta.dgid, data)?;
            match sole {
                Some(s) if !Arc::ptr_eq(s, target) => return None,
                _ => sole = Some(target),
            }
            last = Some(dest);
        }
        sole
    }

    /// Releases a QP number.
    pub(crate) fn free_qpn(&self, qpn: u32) {
        self.qpns.lock().free(qpn & LAST_QPN_INDEX);
    }
}

/// The first node with a packet's destination GID, and the node it goes to.
type NodePair<'n, E> = (&'n Arc<Node<E>>, &'n Arc<Node<E>>);

/// Counts a received packet's ICRC verdict on `node`; false if the packet is to be dropped.
fn count_icrc<E: Endpoint>(node: &Node<E>, icrc: IcrcCheck) -> bool {
    match icrc {
        IcrcCheck::Ok => true,
        IcrcCheck::Unverified => {
            bump(node.counters.rx_icrc_unverified());
            true
        }
        IcrcCheck::Bad => {
            bump(node.counters.rx_bad_icrc());
            tracing::debug!("dropped a packet: bad ICRC");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use softverbs_engine::transport::Dest;
    use softverbs_wire::{BthPacket, BthRepr, Opcode, Psn};

    /// An endpoint that records what the fabric hands it (no QP behind it: the fabric needs
    /// nothing of a QP but the `Endpoint` trait).
    #[derive(Debug, Default)]
    struct Probe {
        qpn: u32,
        got: Mutex<Vec<(Vec<u8>, RxMeta)>>,
        released: Mutex<Vec<u64>>,
    }

    impl Endpoint for Probe {
        fn number(&self) -> u32 {
            self.qpn
        }

        fn receive_packet(
            &self,
            _now: Instant,
            pkt: &ParsedPacket<'_>,
            _ext: Option<&dyn ExternalPayload>,
            meta: &RxMeta,
            _pending: &Pending,
            _more: bool,
        ) -> Received {
            let mut got = self.got.lock();
            got.push((pkt.payload.to_vec(), *meta));
            Received {
                txs: Vec::new(),
                ticket: got.len() as u64,
                dropped: None,
                ack_held: false,
            }
        }

        fn end_batch(&self, _now: Instant) -> (Vec<Transmit>, u64) {
            unreachable!("a probe holds no ACK")
        }

        fn release_ticket(&self, ticket: u64) {
            self.released.lock().push(ticket);
        }

        fn fail_ticket(&self, _ticket: u64) {
            unreachable!("no payload is left in memory in these tests")
        }

        fn next_deadline(&self) -> Option<Instant> {
            None
        }

        fn on_timeout(&self, _now: Instant) {}

        type Steering = ();

        fn steer(_: &(), _: &ParsedPacket<'_>, _: &RxMeta, _: (u16, u16), _: usize, _: &mut Vec<Arc<Self>>) {}
    }

    /// An RC SEND ONLY to `qpn` carrying `payload` (4 bytes, so no pad), with a zero ICRC.
    fn send_only(qpn: u32, payload: [u8; 4]) -> Vec<u8> {
        let mut p = vec![0u8; 12];
        BthRepr::new(Opcode::RcSendOnly, qpn, Psn::new(1)).emit(&mut BthPacket::new_unchecked(&mut p[..]));
        p.extend_from_slice(&payload);
        p.extend_from_slice(&[0; 4]);
        p
    }

    fn to(dgid: Gid, data: Vec<u8>) -> Transmit {
        Transmit {
            dest: Dest {
                dgid,
                sgid_index: 0,
                traffic_class: 5,
                hop_limit: 7,
                flow_label: 0,
            },
            data,
            external: None,
        }
    }

    #[test]
    fn an_outbox_keeps_the_last_ack_per_qp_and_each_payload_note_with_its_packet() {
        let gid = Gid::from_ip("10.0.0.1".parse().unwrap());
        let peer = Gid::from_ip("10.0.0.2".parse().unwrap());
        let fabric = Fabric::<Probe>::new().unwrap();
        let node = fabric.add_node(NodeCounters::default(), &[gid], 1);
        let route = Route {
            sgid: gid,
            dgid: peer,
            dest_qpn: 0x11,
            traffic_class: 0,
            hop_limit: 64,
            ifindex: 1,
            ports: (4792, 4793),
        };
        let run = || Run {
            from: Arc::clone(&node),
            route,
            local_host: false,
            packets: Vec::new(),
            exts: Vec::new(),
        };
        let mut ext = ExternalRanges::default();
        assert!(ext.push(0x1000, 2048));
        let notes = |r: &Run<Probe>| -> Vec<Option<ExternalRanges>> {
            (0..r.packets.len())
                .map(|i| r.exts.get(i).copied().flatten())
                .collect()
        };
        let mut out = Outbox::default();

        // Requests only: queued as they are; a payload note stays with its packet.
        let mut reqs = run();
        reqs.push(send_only(0x11, [1; 4]), None);
        reqs.push(ack(0x12, 1, false), None);
        reqs.push(send_only(0x11, [2; 4]), Some(ext));
        reqs.push(send_only(0x11, [3; 4]), None);
        out.push(reqs);
        assert_eq!(out.packets, 4);
        assert_eq!(
            out.runs[0].exts,
            [None, None, Some(ext)],
            "trailing packets without notes need no entry"
        );

        // A later ACK to QP 0x12 replaces the waiting one; within a run only the last to each QP
        // stays.
        let mut acks = run();
        acks.push(ack(0x12, 2, false), None);
        acks.push(ack(0x13, 1, false), None);
        acks.push(ack(0x12, 3, false), None);
        out.push(acks);
        let waiting: Vec<Vec<u8>> = out.runs.iter().flat_map(|r| r.packets.clone()).collect();
        assert_eq!(
            waiting,
            [
                send_only(0x11, [1; 4]),
                send_only(0x11, [2; 4]),
                send_only(0x11, [3; 4]),
                ack(0x13, 1, false),
                ack(0x12, 3, false)
            ]
        );
        assert_eq!(
            notes(&out.runs[0]),
            [None, Some(ext), None],
            "the note moved with its packet"
        );
        assert_eq!(out.packets, 5);
        assert_eq!(out.bytes, 3 * send_only(0x11, [0; 4]).len() + 2 * ACK_LEN);
        assert_eq!(node.counters.tx_acks_coalesced().load(Ordering::Relaxed), 2);

        // Runs along one link join with their notes where they were.
        let mut a = run();
        a.push(send_only(0x11, [4; 4]), None);
        let mut b = run();
        b.push(send_only(0x11, [5; 4]), None);
        b.push(send_only(0x11, [6; 4]), Some(ext));
        a.append(b);
        assert_eq!(a.packets.len(), 3);
        assert_eq!(notes(&a), [None, None, Some(ext)]);
        let mut c = run();
        c.push(send_only(0x11, [7; 4]), None);
        a.append(c);
        assert_eq!(notes(&a), [None, None, Some(ext), None]);
    }

    #[test]
    fn routes_between_nodes_through_the_in_process_driver() {
        let gid = |s: &str| Gid::from_ip(s.parse().unwrap());
        let (ga, gb, group) = (gid("10.0.0.1"), gid("10.0.0.2"), gid("ff0e::1"));
        let fabric = Fabric::<Probe>::new().unwrap();
        let a = fabric.add_node(NodeCounters::default(), &[ga], 1);
        let b = fabric.add_node(NodeCounters::default(), &[gb], 1);
        let probe = Arc::new(Probe {
            qpn: 0x11,
            ..Probe::default()
        });
        b.add_qp(&probe);
        b.mcast.lock().groups.entry(group).or_default().insert(0x11);

        fabric.send_all(
            &a,
            vec![
                to(gb, send_only(0x11, *b"one.")),
                // No such QP here, and no UDP driver yet: counted as unroutable.
                to(gb, send_only(0x12, *b"lost")),
                to(group, send_only(MULTICAST_QPN, *b"all.")),
            ],
        );
        // The progress thread may be driving the node at the same time (then this drive
        // returns at once and that thread delivers): wait, bounded, for both packets.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while probe.released.lock().len() < 2 && std::time::Instant::now() < deadline {
            fabric.drive(fabric.now());
            std::thread::yield_now();
        }

        let meta = |dgid| RxMeta {
            sgid: ga,
            dgid,
            traffic_class: 5,
            hop_limit: 7,
        };
        assert_eq!(
            *probe.got.lock(),
            [(b"one.".to_vec(), meta(gb)), (b"all.".to_vec(), meta(group))],
            "in order, with the sender's addresses"
        );
        assert_eq!(
            *probe.released.lock(),
            [1, 2],
            "every ticket released after its send"
        );
        let (ca, cb) = (a.counters.snapshot(), b.counters.snapshot());
        assert_eq!((ca.tx_packets, ca.tx_unroutable), (3, 1));
        assert_eq!((cb.rx_packets, cb.rx_unknown_qp), (2, 0));
    }

    /// A packet for a QP of another process (no such node here, and no UDP driver: counted as
    /// unroutable once it is sent).
    fn away(qpn: u32, payload: [u8; 4]) -> Transmit {
        to(Gid::from_ip("10.9.9.9".parse().unwrap()), send_only(qpn, payload))
    }

    #[test]
    fn posted_packets_wait_for_the_next_poll_of_a_busy_poller() {
        let fabric = Fabric::<Probe>::new().unwrap();
        // However slow this host: a poll and the posts after it are always one burst.
        fabric.burst_after_poll.store(u64::MAX, Ordering::Relaxed);
        let a = fabric.add_node(
            NodeCounters::default(),
            &[Gid::from_ip("10.0.0.4".parse().unwrap())],
            1,
        );
        let qp = Arc::new(Probe::default());
        let unroutable = || a.counters.snapshot().tx_unroutable;
        let post = |payload: &[u8; 4], ticket: u64, hold: Hold| {
            fabric.send_then_release(
                &a,
                vec![away(0x20_0011, *payload)],
                vec![(qp.clone(), ticket)],
                hold,
                None,
            );
        };

        // No application has polled: nothing would send them, so they go at once.
        post(b"now.", 1, Hold::Posted);
        assert_eq!((unroutable(), qp.released.lock().clone()), (1, vec![1]));

        // After a poll the first post goes at once (the program may sleep next); the rest of
        // the burst waits for the next poll, and so do their completions.
        fabric.polled(fabric.now());
        post(b"1st.", 2, Hold::Posted);
        assert_eq!((unroutable(), qp.released.lock().clone()), (2, vec![1, 2]));
        post(b"one.", 3, Hold::Posted);
        post(b"two.", 4, Hold::Posted);
        assert_eq!(unroutable(), 2, "held back");
        assert_eq!(*qp.released.lock(), [1, 2], "completions wait for their packets");
        fabric.progress(fabric.now());
        assert_eq!(unroutable(), 4, "sent by the poll");
        assert_eq!(*qp.released.lock(), [1, 2, 3, 4]);

        // Responses wait only during a receive pass.
        let released = || qp.released.lock().clone();
        post(b"rsp.", 5, Hold::InPass);
        assert_eq!(unroutable(), 5);
        {
            let _pass = ReceivePass::new(&fabric);
            post(b"rsp.", 6, Hold::InPass);
            assert_eq!(unroutable(), 5, "until the pass ends");
        }
        assert_eq!((unroutable(), released()), (6, vec![1, 2, 3, 4, 5, 6]));

        // Packets that may not wait (timers, ...) take the waiting ones with them, in order.
        post(b"1st.", 7, Hold::Posted);
        post(b"pst.", 8, Hold::Posted);
        assert_eq!(unroutable(), 7, "the second post waits");
        post(b"now.", 9, Hold::No);
        assert_eq!(unroutable(), 9);
        assert_eq!(released(), (1..=9).collect::<Vec<u64>>());

        // A full batch does not wait.
        let burst: Vec<Transmit> = (0..OUTBOX_PACKETS).map(|_| away(0x20_0011, *b"many")).collect();
        fabric.send_then_release(&a, burst, vec![(qp.clone(), 10)], Hold::Posted, None);
        assert_eq!(unroutable(), 9 + OUTBOX_PACKETS as u64);
        assert_eq!(released().last(), Some(&10));

        // Nothing to send: the completions wait behind the packets that wait, if any.
        post(b"one.", 11, Hold::Posted);
        fabric.send_then_release(&a, Vec::new(), vec![(qp.clone(), 12)], Hold::Posted, None);
        assert_eq!(released().last(), Some(&10), "held behind 11's packet");
        fabric.polled(fabric.now());
        assert_eq!(unroutable(), 10 + OUTBOX_PACKETS as u64);
        assert_eq!(released().last(), Some(&12));
        fabric.send_then_release(&a, Vec::new(), vec![(qp.clone(), 13)], Hold::Posted, None);
        assert_eq!(released().last(), Some(&13), "nothing waits: released at once");
    }

    /// A positive ACK (or, with `nak`, a sequence-error NAK) to `qpn` for `psn`.
    fn ack(qpn: u32, psn: u32, nak: bool) -> Vec<u8> {
        use softverbs_wire::aeth::{AethRepr, AethSyndrome, NakCode};
        use softverbs_wire::PacketRepr;
        let mut repr = PacketRepr::new(BthRepr::new(Opcode::RcAcknowledge, qpn, Psn::new(psn)), 0);
        let syndrome = if nak {
            AethSyndrome::Nak(NakCode::PsnSequenceError)
        } else {
            AethSyndrome::ACK_UNLIMITED
        };
        repr.aeth = Some(AethRepr { syndrome, msn: psn });
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut buf).unwrap();
        buf
    }

    #[test]
    fn the_outbox_keeps_the_newest_ack_of_each_qp() {
        let fabric = Fabric::<Probe>::new().unwrap();
        let a = fabric.add_node(
            NodeCounters::default(),
            &[Gid::from_ip("10.0.0.5".parse().unwrap())],
            1,
        );
        let peer = Gid::from_ip("10.9.9.8".parse().unwrap());
        let run = |packets: Vec<Vec<u8>>| {
            fabric
                .route(&a, packets.into_iter().map(|p| to(peer, p)).collect())
                .into_iter()
                .next()
                .expect("one run")
        };
        let mut out = Outbox::default();
        out.push(run(vec![
            ack(0x20_0011, 1, false),
            send_only(0x20_0011, *b"req."),
            ack(0x20_0012, 7, false),
        ]));
        out.push(run(vec![
            ack(0x20_0011, 2, true),
            ack(0x20_0011, 3, false),
            ack(0x20_0011, 4, false),
        ]));
        let left: Vec<Vec<u8>> = out.runs.iter().flat_map(|r| r.packets.clone()).collect();
        assert_eq!(
            left,
            [
                send_only(0x20_0011, *b"req."),
                ack(0x20_0012, 7, false),
                ack(0x20_0011, 2, true),
                ack(0x20_0011, 4, false),
            ],
            "requests, NAKs and other QPs' ACKs stay, in order; one ACK per QP, the newest"
        );
        assert_eq!(out.packets, 4);
        assert_eq!(out.bytes, left.iter().map(Vec::len).sum::<usize>());
    }

    #[test]
    fn runs_to_one_process_form_one_link() {
        let g = Gid::from_ip("10.9.9.7".parse().unwrap());
        let route = |dest_qpn, dgid| Route {
            sgid: Gid::ZERO,
            dgid,
            dest_qpn,
            traffic_class: 0,
            hop_limit: 64,
            ifindex: 1,
            ports: (4792, 4793),
        };
        assert!(same_link(&route(0x02_0011, g), &route(0x02_0012, g)));
        assert!(!same_link(&route(0x02_0011, g), &route(0x02_0011, Gid::ZERO)));
        assert!(!same_link(&route(0x02_0011, g), &route(MULTICAST_QPN, g)));
        assert!(same_link(&route(MULTICAST_QPN, g), &route(MULTICAST_QPN, g)));
        let other_port = Route {
            ports: (4792, 4794),
            ..route(0x03_0011, g)
        };
        assert!(!same_link(&route(0x02_0011, g), &other_port));
    }

    /// A QP1 handler that records the MADs it gets and has one timer.
    #[derive(Default)]
    struct GsiProbe {
        got: Mutex<Vec<(Vec<u8>, Gid)>>,
        deadline: Mutex<Option<Instant>>,
        fired: Mutex<u32>,
    }

    impl Gsi for GsiProbe {
        fn receive(&self, _now: Instant, pkt: &ParsedPacket<'_>, meta: &RxMeta) -> Vec<Transmit> {
            self.got.lock().push((pkt.payload.to_vec(), meta.sgid));
            Vec::new()
        }

        fn next_deadline(&self) -> Option<Instant> {
            *self.deadline.lock()
        }

        fn on_timeout(&self, _now: Instant) -> Vec<Transmit> {
            *self.fired.lock() += 1;
            self.deadline.lock().take();
            Vec::new()
        }

        fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
            self
        }
    }

    #[test]
    fn qp1_packets_reach_the_gsi_handler_and_its_timer_runs() {
        let gid = |s: &str| Gid::from_ip(s.parse().unwrap());
        let (ga, gb) = (gid("10.0.1.1"), gid("10.0.1.2"));
        let fabric = Fabric::<Probe>::new().unwrap();
        let _a = fabric.add_node(NodeCounters::default(), &[ga], 1);
        let b = fabric.add_node(NodeCounters::default(), &[gb], 1);
        // Without a handler, QP1 is an unknown QP.
        b.inject(
            &send_only(1, *b"none"),
            RxMeta {
                sgid: ga,
                dgid: gb,
                traffic_class: 0,
                hop_limit: 64,
            },
            None,
        );
        // The progress thread may be driving the node at that moment and handle the packet
        // itself: wait (bounded) for whoever handles it.
        let settle = |done: &dyn Fn() -> bool| {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !done() && std::time::Instant::now() < deadline {
                fabric.drive(fabric.now());
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        settle(&|| b.counters.snapshot().rx_unknown_qp == 1);
        assert_eq!(b.counters.snapshot().rx_unknown_qp, 1);

        let probe = Arc::new(GsiProbe::default());
        let p = probe.clone();
        b.gsi(move || p);
        b.inject(
            &send_only(1, *b"mad!"),
            RxMeta {
                sgid: ga,
                dgid: gb,
                traffic_class: 0,
                hop_limit: 64,
            },
            None,
        );
        // QP1 of a softverbs process (its slot in bits 16..24) is QP1 too.
        b.inject(
            &send_only(0x03_0001, *b"mad2"),
            RxMeta {
                sgid: ga,
                dgid: gb,
                traffic_class: 0,
                hop_limit: 64,
            },
            None,
        );
        settle(&|| probe.got.lock().len() >= 2);
        assert_eq!(
            *probe.got.lock(),
            [(b"mad!".to_vec(), ga), (b"mad2".to_vec(), ga)]
        );
        assert!(is_gsi_qpn(1) && is_gsi_qpn(0x05_0001) && !is_gsi_qpn(0x11) && !is_gsi_qpn(MULTICAST_QPN));

        // The progress thread runs the handler's timer.
        *probe.deadline.lock() = Some(fabric.now() + Duration::from_millis(20));
        fabric.schedule(fabric.now() + Duration::from_millis(20));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while *probe.fired.lock() == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*probe.fired.lock(), 1, "the timer fired once");
    }

    #[test]
    fn the_progress_thread_ends_with_its_fabric() {
        let fabric = Fabric::<Probe>::new().unwrap();
        let node = fabric.add_node(
            NodeCounters::default(),
            &[Gid::from_ip("10.0.0.3".parse().unwrap())],
            1,
        );
        let wake = fabric.wake.clone();
        // Nodes own the fabric: it lives until the last one is gone.
        drop(fabric);
        assert!(!wake.closed.load(Ordering::Acquire));
        drop(node);
        // The progress thread may hold the fabric for the rest of a pass; then it is dropped
        // there.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&wake) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(wake.closed.load(Ordering::Acquire), "the fabric was dropped");
        assert_eq!(Arc::strong_count(&wake), 1, "the progress thread ended");
    }

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
        let nodes = crate::device::device_list().unwrap()[0]
            .node()
            .fabric()
            .node_count();
        assert!(
            nodes <= per_call + 64,
            "{nodes} nodes registered after 40,000 listings"
        );
        let grown = rss_bytes().saturating_sub(rss);
        assert!(grown < 4 << 20, "RSS grew by {grown} bytes over 40,000 listings");
    }
}
