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

mod node;
mod outbox;
mod qpn;
#[cfg(test)]
mod tests;
mod threads;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use softverbs_engine::memory::ExternalPayload;
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{DropReason, RxMeta, Transmit};
use softverbs_engine::types::Gid;
use softverbs_engine::{Error, Result};
use softverbs_wire::bth::peek_dest_qpn;
use softverbs_wire::ParsedPacket;

use crate::capture::{Carrier, Tap};
use crate::device::McastTable;
use crate::driver::{Driver, IcrcCheck, PacketBatch, PacketData, Route};
use crate::local::InProcess;
use crate::mem::KeyTable;
use crate::remote::{self, Pending};
use crate::shm::Shm;
use crate::stats::NodeCounters;
use crate::udp::Udp;

pub(crate) use node::Node;
use node::{Processing, QpMap};
pub(crate) use outbox::{Hold, ReceivePass};
use outbox::{Outbox, BURST_AFTER_POLL};
use qpn::{QpnTable, FIRST_QPN, LAST_QPN_INDEX};
use threads::{progress_thread, receive_thread, WakeUp};

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
    /// so that one ACK answers all of the batch's packets for this endpoint. An endpoint that
    /// holds one may leave all that the packet produced to `end_batch` (no ticket then).
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
    /// packets to send (that ACK, and whatever else its packets left for the end) and the
    /// ticket to release once they were sent.
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

/// What an endpoint made of a received packet ([`Endpoint::receive_packet`]).
pub(crate) struct Received {
    /// Packets to send in reply.
    pub(crate) txs: Vec<Transmit>,
    /// To [`Endpoint::release_ticket`] once they were sent; `None` when the endpoint holds an
    /// ACK and left everything the packet produced to [`Endpoint::end_batch`].
    pub(crate) ticket: Option<u64>,
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

/// While shared memory carries traffic, application polls look at idle UDP sockets at most
/// this often (each look is a system call, several times the cost of a poll that finds
/// nothing; a packet that comes over UDP meanwhile waits this long at most).
const UDP_LOOK_EVERY: Duration = Duration::from_micros(200);
/// How long after shared memory last delivered it still counts as carrying traffic.
const SHM_BUSY: Duration = Duration::from_millis(1);

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
}

impl<E: Endpoint> Fabric<E> {
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
