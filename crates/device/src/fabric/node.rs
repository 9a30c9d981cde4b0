//! A device's endpoint on the fabric: its QPs, memory keys and inbound packets, and the
//! handling of what arrives for it.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::{Mutex, RwLock};
use softverbs_engine::memory::ExternalPayload;
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{buffers, RxMeta, Transmit};
use softverbs_engine::types::Gid;
use softverbs_wire::{pad_count_for, RocePacket};

use super::outbox::coalesce_acks;
use super::{bump, is_gsi_qpn, Endpoint, Fabric, Gsi, Hold, Received, MULTICAST_QPN};
use crate::device::McastTable;
use crate::driver::{Driver, PacketBatch, PacketData, PacketDesc};
use crate::local::InProcess;
use crate::mem::KeyTable;
use crate::remote::{Pending, RemotePayload, RemoteRef};
use crate::stats::NodeCounters;

/// A node's QPs by number: looked up up to three times per packet, so hashed cheaply. The keys
/// are numbers this process chose, so a peer cannot make them collide; it can only look up.
pub(super) type QpMap<E> = HashMap<u32, Weak<E>, crate::sync::NumberHash>;

/// Each endpoint's ticket for a received packet (to release once its replies were sent), with
/// where its replies are in the batch's outputs (a QP whose payload copy failed sends none of
/// them).
type BatchTickets<E> = Vec<(Arc<E>, u64, Range<usize>)>;

/// What a node's driving thread works with, kept between batches so that handling a packet
/// allocates none of it.
pub(super) struct Processing<E> {
    pub(super) batch: PacketBatch,
    /// Each endpoint's ticket for a packet, and the range of the batch's replies it produced.
    pub(super) tickets: BatchTickets<E>,
    /// The endpoints one packet is for.
    pub(super) targets: Vec<Arc<E>>,
    /// The endpoints that hold an ACK back until the end of the batch.
    pub(super) acking: Vec<Arc<E>>,
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

/// One device's endpoint on the fabric.
pub(crate) struct Node<E: Endpoint> {
    pub(super) fabric: Arc<Fabric<E>>,
    pub(super) gids: Vec<Gid>,
    pub(super) ifindex: u32,
    pub(super) qps: RwLock<QpMap<E>>,
    /// Multicast group -> attached QP numbers.
    pub(crate) mcast: Mutex<McastTable>,
    pub(crate) keys: KeyTable,
    /// Flow rules of UD QPs.
    pub(crate) ud_flows: E::Steering,
    /// Packets for this node: the in-process driver's queue, where other drivers' packets are
    /// delivered too.
    pub(super) inbound: InProcess,
    /// The batch being processed and what its packets need (kept for their memory); only the
    /// driving thread touches them.
    pub(super) processing: Mutex<Processing<E>>,
    pub(super) driving: AtomicBool,
    pub(crate) counters: NodeCounters,
    /// QP1, once the connection manager was started on this node.
    pub(super) gsi: OnceLock<Arc<dyn Gsi>>,
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

    pub(super) fn has_gid(&self, gid: &Gid) -> bool {
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
    pub(super) fn takes_gsi(&self, qpn: u32, own_slot: Option<u8>) -> bool {
        is_gsi_qpn(qpn) && self.gsi.get().is_some() && own_slot.is_some_and(|s| u32::from(s) == qpn >> 16)
    }

    pub(super) fn has_qp(&self, qpn: u32) -> bool {
        self.qps.read().contains_key(&qpn)
    }

    /// The index of the interface this node's device stands for.
    pub(crate) fn ifindex(&self) -> u32 {
        self.ifindex
    }

    pub(super) fn has_group(&self, gid: &Gid) -> bool {
        self.mcast.lock().groups.contains_key(gid)
    }

    pub(super) fn deliver(
        &self,
        data: PacketData<'_>,
        meta: RxMeta,
        ports: (u16, u16),
        remote: Option<RemoteRef>,
    ) {
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
    pub(super) fn drive(self: &Arc<Self>, now: Instant) -> bool {
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
                // The clock is read again for every batch after the first (whose `now` the
                // caller read a moment ago): a thread may drive for a long while when packets
                // keep coming, and a stale `now` would time round trips as zero and arm
                // retransmission timers that fire early.
                let now = if did { now.max(self.fabric.now()) } else { now };
                did = true;
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
            let Some(ticket) = ticket else {
                // Everything this packet produced waits for the QP's `end_batch`.
                buffers::recycle_transmits(txs);
                continue;
            };
            let at = out.len();
            if out.is_empty() {
                // The usual single reply: its vector is the batch's, no copy. The one it replaces
                // may have room (a packet before it whose ACK is held left it empty): kept for
                // the next packet rather than freed.
                buffers::recycle_transmits(std::mem::replace(out, txs));
            } else {
                let mut txs = txs;
                out.append(&mut txs);
                buffers::recycle_transmits(txs);
            }
            tickets.push((qp, ticket, at..out.len()));
        }
    }

    /// Runs due transport timers of this node's QPs; returns the earliest pending deadline.
    pub(super) fn run_timers(self: &Arc<Self>, now: Instant) -> Option<Instant> {
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
