//! Packets leaving the process: routing, runs of packets along one link, and the outbox
//! where they may wait to leave in one batch.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{buffers, ExternalRanges, Transmit};
use softverbs_engine::types::Gid;
use softverbs_wire::bth::peek_dest_qpn;
use softverbs_wire::is_positive_ack;

use super::{bump, Endpoint, Fabric, Node, MCAST_MEMBERS_FOR, MULTICAST_QPN};
use crate::driver::{Driver, Route};
use crate::remote;

/// Drops every positive ACK that a later positive ACK to the same QP makes redundant: ACKs are
/// cumulative, so within one batch only the newest of each QP needs to go out. NAKs, responses
/// and requests are kept, in order.
pub(super) fn coalesce_acks(mut txs: Vec<Transmit>) -> Vec<Transmit> {
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
pub(super) fn same_link(a: &Route, b: &Route) -> bool {
    let unicast = a.dest_qpn != MULTICAST_QPN && b.dest_qpn != MULTICAST_QPN;
    (a.dest_qpn == b.dest_qpn || unicast)
        && Route {
            dest_qpn: a.dest_qpn,
            ..*b
        } == *a
}

/// The runs one routing produced: nearly always one (a QP's packets go to one peer), kept
/// inline so that routing a packet allocates no list.
pub(super) type Runs<E> = SmallVec<[Run<E>; 1]>;

/// Packets for other processes along one link, from one node.
pub(super) struct Run<E: Endpoint> {
    pub(super) from: Arc<Node<E>>,
    pub(super) route: Route,
    /// The destination is an address of this host (another process may have a mailbox).
    pub(super) local_host: bool,
    pub(super) packets: Vec<Vec<u8>>,
    /// For each packet, where its payload is if it was left in memory. Shorter than `packets`
    /// when the last ones have none (empty, with no allocation, in the common case of none).
    pub(super) exts: Vec<Option<ExternalRanges>>,
}

impl<E: Endpoint> Run<E> {
    /// Appends a packet, with where its payload is if it was left in memory.
    pub(super) fn push(&mut self, data: Vec<u8>, ext: Option<ExternalRanges>) {
        if ext.is_some() {
            self.exts.resize(self.packets.len(), None);
            self.exts.push(ext);
        }
        self.packets.push(data);
    }

    /// Appends the packets of `other`, which goes along the same link.
    pub(super) fn append(&mut self, mut other: Self) {
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
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&[u8]) -> bool) {
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
pub(super) struct Outbox<E: Endpoint> {
    pub(super) runs: Vec<Run<E>>,
    pub(super) packets: usize,
    pub(super) bytes: usize,
    pub(super) tickets: Vec<(Arc<E>, u64)>,
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
    pub(super) fn is_empty(&self) -> bool {
        self.runs.is_empty() && self.tickets.is_empty()
    }

    /// Adds a run; its positive ACKs replace the waiting ones to the same QP.
    pub(super) fn push(&mut self, mut run: Run<E>) {
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
pub(super) const ACK_LEN: usize = 12 + 4 + 4;

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
    pub(super) fn new(fabric: &'a Fabric<E>) -> Self {
        IN_RECEIVE_PASS.with(|c| c.set(true));
        Self { fabric, received: 0 }
    }

    /// Whether the pass should end: the drivers ran dry (a driver reads until its sockets or
    /// rings are empty, so a short batch means they were), or enough came that the peers wait
    /// for ACKs.
    pub(super) fn done(&mut self, got: usize) -> bool {
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
pub(super) const OUTBOX_PACKETS: usize = 64;
/// Bytes held back at most, likewise.
pub(super) const OUTBOX_BYTES: usize = 64 << 10;

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
/// outbox for its next poll. At least `APP_POLLING` (`threads.rs`): a burst of posts between two polls
/// may take a while, and sending each post alone makes it longer still.
pub(super) const BURST_AFTER_POLL: Duration = Duration::from_millis(1);

impl<E: Endpoint> Fabric<E> {
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
    /// read a moment ago, if any, for the drivers to use instead of reading the clock. A lone
    /// packet for a shared-memory peer takes a shorter way ([`Fabric::send_one_by_shm`]).
    pub(crate) fn send_then_release(
        &self,
        from: &Arc<Node<E>>,
        txs: Vec<Transmit>,
        tickets: impl IntoIterator<Item = (Arc<E>, u64)>,
        hold: Hold,
        now: Option<Instant>,
    ) {
        let txs = match self.send_one_by_shm(from, txs, now) {
            Ok(()) => {
                for (qp, ticket) in tickets {
                    qp.release_ticket(ticket);
                }
                return;
            }
            Err(txs) => txs,
        };
        let runs = self.route(from, txs);
        // Shared memory costs no system call: nothing to save by waiting. Nothing to send (a
        // work request queued behind a full window): its tickets wait behind the packets that
        // wait, if any, rather than send them early.
        let worth_waiting = || {
            runs.iter().any(|r| !(r.local_host && self.shm.get().is_some()))
                || (runs.is_empty() && self.outbox_busy.load(Ordering::Acquire))
        };
        // Asked last: `in_burst` reads the clock.
        let wait = hold != Hold::No
            && worth_waiting()
            && (IN_RECEIVE_PASS.with(Cell::get) || (hold == Hold::Posted && self.in_burst()));
        if !wait {
            // At once, behind whatever waits (in order), without going through the outbox.
            let waiting = {
                let _sending = self.sending.lock();
                let waiting = self.take_outbox();
                if !waiting.runs.is_empty() {
                    self.send_runs(waiting.runs, now);
                }
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
    pub(super) fn route(&self, from: &Arc<Node<E>>, mut txs: Vec<Transmit>) -> Runs<E> {
        let mut remote = Runs::new();
        if txs.is_empty() {
            buffers::recycle_transmits(txs);
            return remote;
        }
        let nodes = self.live_nodes();
        let own_slot = self.udp.get().map(|u| u.slot());
        // `local_host`: the destination address is one of this fabric's devices'.
        let mut add_remote =
            |route: Route, local_host: bool, data: Vec<u8>, ext: Option<ExternalRanges>| match remote
                .last_mut()
            {
                Some(r) if same_link(&r.route, &route) => r.push(data, ext),
                _ => {
                    let mut run = Run {
                        from: from.clone(),
                        route,
                        local_host,
                        packets: buffers::take_list(),
                        exts: Vec::new(),
                    };
                    run.push(data, ext);
                    remote.push(run);
                }
            };
        for mut tx in txs.drain(..) {
            count_tx(from, &tx);
            let qpn = peek_dest_qpn(&tx.data).unwrap_or(0);
            let route = self.route_of(from, &tx, qpn);
            if qpn == MULTICAST_QPN {
                // Members may live in this process, other processes and other hosts.
                for n in nodes.iter().filter(|n| n.has_group(&tx.dest.dgid)) {
                    n.inbound.send(&route, &mut [tx.data.clone()]);
                }
                add_remote(route, false, tx.data, tx.external);
                continue;
            }
            let (target, local_host) = find_node(&nodes, &tx.dest.dgid, qpn, own_slot);
            if let Some(n) = target {
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
                add_remote(route, local_host, tx.data, tx.external);
            }
        }
        buffers::recycle_transmits(txs);
        remote
    }

    /// The route of a packet from `from` to QP `qpn`.
    fn route_of(&self, from: &Node<E>, tx: &Transmit, qpn: u32) -> Route {
        Route {
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
        }
    }

    /// Sends a lone unicast packet for another process of this host straight into its
    /// mailbox, as [`Fabric::route`] and [`Fabric::send_runs`] would, without building runs:
    /// the usual case of a post or an ACK, where that machinery was most of the cost. Hands
    /// the packets back (nothing sent) when they need the general path: several packets, a
    /// payload left in memory, a capture, multicast, a destination in this process or on
    /// another host, packets waiting in the outbox (they go first), or a peer without a
    /// mailbox. (With payloads left in memory taking this path, the two-process soak saw
    /// damaged RC messages; why is not known yet.)
    fn send_one_by_shm(
        &self,
        from: &Arc<Node<E>>,
        mut txs: Vec<Transmit>,
        now: Option<Instant>,
    ) -> Result<(), Vec<Transmit>> {
        let Some(shm) = self.shm.get() else {
            return Err(txs);
        };
        let [tx] = txs.as_slice() else { return Err(txs) };
        let qpn = peek_dest_qpn(&tx.data).unwrap_or(0);
        if tx.external.is_some()
            || qpn == MULTICAST_QPN
            || self.tap.get().is_some()
            || self.outbox_busy.load(Ordering::Acquire)
        {
            return Err(txs);
        }
        let own_slot = self.udp.get().map(|u| u.slot());
        let elsewhere = {
            let nodes = self.nodes.read();
            let (target, local_host) = find_node(&nodes, &tx.dest.dgid, qpn, own_slot);
            target.is_none() && local_host
        };
        if !elsewhere {
            return Err(txs);
        }
        let route = self.route_of(from, tx, qpn);
        {
            let _sending = self.sending.lock();
            // Packets put in the outbox meanwhile leave first, by the general path.
            if self.outbox_busy.load(Ordering::Acquire) {
                return Err(txs);
            }
            let packet = std::slice::from_ref(&tx.data);
            let sent = match now {
                Some(now) => shm.send_to_process_at(now.as_nanos(), &route, packet, &[]),
                None => shm.send_to_process(&route, packet, &[]),
            };
            let Some(sent) = sent else { return Err(txs) };
            count_tx(from, tx);
            count_shm(from, sent, 0);
            count_unroutable(from, 1 - sent);
        }
        for tx in txs.drain(..) {
            buffers::recycle(tx.data);
        }
        buffers::recycle_transmits(txs);
        Ok(())
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
                    let in_memory = exts.iter().take(n).filter(|e| e.is_some()).count();
                    count_shm(&from, n, in_memory);
                    n
                }
                None => self.udp.get().map_or(0, |u| u.send(&route, &mut packets)),
            };
            if route.dest_qpn != MULTICAST_QPN {
                count_unroutable(&from, packets.len() - sent);
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
}

/// The node of `nodes` that takes packets for QP `qpn` at `dgid`, and whether `dgid` is one of
/// their addresses at all (an address of this host, where another process may have the QP):
/// one scan for both.
fn find_node<'a, E: Endpoint>(
    nodes: &'a [Arc<Node<E>>],
    dgid: &Gid,
    qpn: u32,
    own_slot: Option<u8>,
) -> (Option<&'a Arc<Node<E>>>, bool) {
    let mut local_host = false;
    let target = nodes.iter().find(|n| {
        let here = n.has_gid(dgid);
        local_host |= here;
        here && (n.has_qp(qpn) || n.takes_gsi(qpn, own_slot))
    });
    (target, local_host)
}

/// Counts a packet leaving `from` (its bytes include a payload left in memory).
fn count_tx<E: Endpoint>(from: &Node<E>, tx: &Transmit) {
    bump(from.counters.tx_packets());
    let ext_len: u64 = tx
        .external
        .as_ref()
        .map_or(0, |e| e.ranges().iter().map(|r| u64::from(r.1)).sum());
    from.counters
        .tx_bytes()
        .fetch_add(tx.data.len() as u64 + ext_len, Ordering::Relaxed);
}

/// Counts `n` packets from `from` that went through shared memory, `in_memory` of them with
/// their payload left in memory.
fn count_shm<E: Endpoint>(from: &Node<E>, n: usize, in_memory: usize) {
    from.counters
        .tx_shm_packets()
        .fetch_add(n as u64, Ordering::Relaxed);
    if in_memory > 0 {
        from.counters
            .tx_payloads_in_memory()
            .fetch_add(in_memory as u64, Ordering::Relaxed);
    }
}

/// Counts `n` unicast packets from `from` that no carrier took.
fn count_unroutable<E: Endpoint>(from: &Node<E>, n: usize) {
    if n > 0 {
        from.counters
            .tx_unroutable()
            .fetch_add(n as u64, Ordering::Relaxed);
    }
}
