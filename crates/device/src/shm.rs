//! The shared-memory driver: RoCE packets to the other processes of this user on this host go
//! through their mailboxes (`softverbs-shm`) instead of the kernel's UDP stack.
//!
//! Every process that runs the UDP driver also creates a mailbox named after its network
//! namespace and its UDP slot port, in a directory private to the user. The fabric sends a run
//! of packets whose destination address belongs to one of its own devices (so: this host, this
//! network namespace) and whose QP number names another process's slot to that process's
//! mailbox if it has one; otherwise, and for multicast, the packets go over UDP as before. A
//! peer of another user has no mailbox this process may open, so it is reached over UDP.
//!
//! Each record is one packet exactly as the UDP driver would send it (BTH to ICRC), behind a
//! header with what the receiver would learn from the IP and UDP headers: source and
//! destination GID, traffic class, hop limit and ports. A packet whose payload the engine left
//! in registered memory (large RC payloads, see `softverbs_engine::transport::ExternalRanges`)
//! travels without it, with the sender's process ID and the payload's address ranges instead:
//! the receiver copies the bytes once, straight into the destination buffer (`crate::remote`). The engines on both sides are the
//! same, so RC, UC and UD behave exactly as over UDP; the node counters count these packets
//! too. A packet never leaves memory private to the user, so there is no ICRC to check.
//!
//! `SOFTVERBS_SHM=0` turns the driver off.

use std::os::fd::BorrowedFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use parking_lot::Mutex;
use softverbs_engine::transport::{ExternalRanges, RxMeta, MAX_EXTERNAL_RANGES};
use softverbs_engine::types::Gid;
use softverbs_shm::{Inbox, Layout, Outbox};

use crate::driver::{Driver, IcrcCheck, PacketBatch, Route};
use crate::remote::RemoteRef;

/// Bytes in front of each packet: source GID, destination GID, traffic class, hop limit, two
/// reserved bytes, source and destination UDP port.
const HEADER: usize = 40;
/// A mailbox: rings for up to 32 sending processes at once, 1 MiB each (a whole send window of
/// 4 KiB packets).
const LAYOUT: Layout = Layout {
    rings: 32,
    ring_capacity: 1 << 20,
};
/// How long to wait for room in a full ring before the packet is lost. A local receiver that
/// is merely slower than its sender must lose nothing (as the UDP driver paces a local flood by
/// the receiver's socket queue, with the same bound); one stalled for this long is treated like
/// a full socket buffer.
const FULL_WAIT: Duration = Duration::from_millis(200);
/// Within the wait, how long to only yield before sleeping between looks.
const FULL_SPIN: Duration = Duration::from_millis(1);
/// How often a process without a mailbox is looked for again (an open that fails: one system
/// call). Short, so that a process with a mailbox that took the port of one without is soon
/// reached through it.
const RETRY_ABSENT: Duration = Duration::from_millis(10);
/// A run sent after a pause this long first checks that the peer still lives: a conversation
/// that resumes (a new process may have taken a dead one's port meanwhile) never starts in a
/// dead mailbox.
const IDLE_RECHECK: Duration = Duration::from_millis(1);
/// How often a port whose mailbox was left by a dead owner is looked at again.
const RETRY_STALE: Duration = Duration::from_millis(10);
/// How often a peer's liveness is checked while sending to it (two system calls): a peer that
/// died, and whose port a process without a mailbox took, must be reached over UDP again well
/// within a retransmission timeout.
const CHECK_ALIVE: Duration = Duration::from_millis(10);
/// Flag in header byte 34: the payload is in the sender's memory, described by the
/// [`REMOTE`] bytes after the header.
const FLAG_REMOTE: u8 = 1;
/// Flags in header byte 34 for a datagram the holder of the standard port forwarded: its ICRC
/// could not be checked (IPv4 with a non-zero IP ID), or was checked and is wrong (the owner
/// drops and counts it, as it would have had it read the datagram itself).
const FLAG_ICRC_UNVERIFIED: u8 = 2;
const FLAG_ICRC_BAD: u8 = 4;
/// Bytes describing a payload in the sender's memory: process ID, length, range count, three
/// reserved bytes, then [`MAX_EXTERNAL_RANGES`] (address, length) pairs.
const REMOTE: usize = 12 + 12 * MAX_EXTERNAL_RANGES;

/// Records handed over per receive call. Each batch's payload copies, and then its ACK, happen
/// when it has been processed: half a send window (64 of 128 packets) lets the sender refill
/// the window while the rest is copied (a whole window per batch left the sender waiting for
/// every copy: 1 MiB WRITEs gained a few percent; 32 and 16 did no better).
const MAX_BATCH: usize = 64;
/// How often the receive thread lets go of the mailboxes of peers that are gone (see
/// [`Shm::prune`]).
const PRUNE_EVERY: Duration = Duration::from_secs(1);
/// A peer's mailbox not sent to for this long is let go (reopened when needed).
const IDLE_CLOSE: Duration = Duration::from_secs(10);

/// `d` in nanoseconds.
const fn nanos(d: Duration) -> u64 {
    d.as_nanos() as u64
}

/// Whether the environment allows the driver (`SOFTVERBS_SHM=0` turns it off).
pub(crate) fn enabled() -> bool {
    std::env::var("SOFTVERBS_SHM").map_or(true, |v| v.trim() != "0")
}

/// What this process knows of another's mailbox.
#[derive(Debug)]
enum Peer {
    Open {
        out: Outbox,
        /// When the owner was last found alive ([`Shm::clock`]).
        checked: u64,
        /// When a run was last sent ([`Shm::clock`]).
        sent: u64,
        /// The owner let its ring stay full for a whole [`FULL_WAIT`] (it is stopped, or
        /// stuck): until a record fits again, a full ring loses packets at once, as a full
        /// socket buffer does, rather than hold every send (and every forward of the standard
        /// port's datagrams) up.
        stalled: bool,
    },
    /// None (or not ours to open, or its owner dead) when last looked for; look again from
    /// this time on.
    Absent(u64),
}

/// The shared-memory driver of this process.
#[derive(Debug)]
pub(crate) struct Shm {
    inbox: Inbox,
    dir: PathBuf,
    netns: u64,
    /// By slot port: a short list (one entry per process this one talks to), searched on
    /// every send, which a linear scan of the ports does faster than hashing.
    peers: Mutex<Vec<(u16, Peer)>>,
    /// When [`Shm::prune`] next looks ([`Shm::clock`]).
    next_prune: std::sync::atomic::AtomicU64,
    /// The fabric's epoch: this driver's times are the fabric's (nanoseconds since it), so
    /// that a sender can hand over the time it already read.
    epoch: std::time::Instant,
}

impl Shm {
    /// Creates this process's mailbox for its UDP slot `port`; `None` if the driver is off or
    /// the mailbox cannot be made (the fabric then uses UDP only).
    pub(crate) fn start(port: u16, epoch: std::time::Instant) -> Option<Arc<Self>> {
        if !enabled() {
            return None;
        }
        let uid = nix::unistd::getuid().as_raw();
        let dir = softverbs_shm::private_dir(&format!("softverbs-shm-{uid}"))
            .inspect_err(|e| tracing::warn!("shared-memory driver off: {e}"))
            .ok()?;
        let netns = std::fs::metadata("/proc/self/ns/net").map_or(0, |m| m.ino());
        let path = dir.join(format!("{netns}-{port}"));
        let inbox = Inbox::create(&path, LAYOUT)
            .inspect_err(|e| tracing::warn!(path = %path.display(), "shared-memory driver off: {e}"))
            .ok()?;
        tracing::debug!(path = %path.display(), "shared-memory driver up");
        Some(Arc::new(Self {
            inbox,
            dir,
            netns,
            peers: Mutex::new(Vec::new()),
            next_prune: std::sync::atomic::AtomicU64::new(0),
            epoch,
        }))
    }

    /// Now, in nanoseconds since the fabric's epoch (compared as plain integers).
    fn clock(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Lets go of the mailboxes (a descriptor and a mapping each) of peers that are gone (the
    /// owner died or dropped it), or that nothing was sent to for [`IDLE_CLOSE`]: a process
    /// that talked to many short-lived peers would otherwise keep all of them mapped. At most
    /// once per [`PRUNE_EVERY`].
    fn prune(&self) {
        use std::sync::atomic::Ordering;
        let now = self.clock();
        if now < self.next_prune.load(Ordering::Relaxed) {
            return;
        }
        self.next_prune.store(now + nanos(PRUNE_EVERY), Ordering::Relaxed);
        let mut peers = self.peers.lock();
        for (_, peer) in peers.iter_mut() {
            if let Peer::Open { out, sent, .. } = peer {
                let idle = now.saturating_sub(*sent) >= nanos(IDLE_CLOSE);
                if idle || out.is_closed() || !out.owner_alive() {
                    *peer = Peer::Absent(now);
                }
            }
        }
        // Ports not looked at for a while are forgotten altogether.
        peers.retain(|(_, p)| !matches!(p, Peer::Absent(at) if now.saturating_sub(*at) >= nanos(IDLE_CLOSE)));
    }

    /// How many peers' mailboxes this process has open (tests).
    #[cfg(test)]
    fn open_peers(&self) -> usize {
        self.peers
            .lock()
            .iter()
            .filter(|(_, p)| matches!(p, Peer::Open { .. }))
            .count()
    }

    /// Sends a run of packets to the process whose slot port is `route.ports.1`, if it has a
    /// mailbox. `None` if it has none (the caller uses UDP); else how many packets went.
    ///
    /// `exts[i]`, if given, says where packet `i`'s payload is in this process's memory.
    pub(crate) fn send_to_process(
        &self,
        route: &Route,
        packets: &[Vec<u8>],
        exts: &[Option<ExternalRanges>],
    ) -> Option<usize> {
        self.send_to_process_at(self.clock(), route, packets, exts)
    }

    /// [`Shm::send_to_process`] at `now` (nanoseconds since the fabric's epoch), a time the
    /// caller read a moment ago: a send then reads no clock (one read is a visible part of a
    /// one-way latency of a microsecond or two).
    pub(crate) fn send_to_process_at(
        &self,
        now: u64,
        route: &Route,
        packets: &[Vec<u8>],
        exts: &[Option<ExternalRanges>],
    ) -> Option<usize> {
        let header = encode_header(route);
        self.with_peer(route.ports.1, now, |out, stalled| {
            let patient = !*stalled;
            let went = push_all(out, &header, packets, exts, patient);
            let was = *stalled;
            *stalled = went < packets.len() && (patient || went == 0);
            if *stalled && !was {
                tracing::debug!(
                    port = route.ports.1,
                    "a local receiver leaves its ring full; losing packets"
                );
            }
            went
        })
    }

    /// Hands a datagram that the holder of the standard port received for another slot to
    /// that slot's process (UDP port `slot_port`), if it has a mailbox: the original
    /// addresses and ports, and the ICRC verdict made here, travel in the record's header, so
    /// the owner handles it as if it had read it from the network. `None` if the process has
    /// no mailbox (the caller forwards over UDP); else whether the packet went.
    ///
    /// Unlike a second UDP hop, a receiver that falls behind loses nothing: a full ring is
    /// waited on (the standard port's socket buffer holds what arrives meanwhile). Only a
    /// receiver that drains nothing for [`FULL_WAIT`] loses the packet, as a full socket
    /// buffer would, and the next ones at once while its ring stays full.
    pub(crate) fn forward(
        &self,
        slot_port: u16,
        meta: &RxMeta,
        ports: (u16, u16),
        icrc: IcrcCheck,
        packet: &[u8],
    ) -> Option<bool> {
        let mut header = [0u8; HEADER];
        header[..16].copy_from_slice(&meta.sgid.0);
        header[16..32].copy_from_slice(&meta.dgid.0);
        header[32] = meta.traffic_class;
        header[33] = meta.hop_limit;
        header[34] = match icrc {
            IcrcCheck::Ok => 0,
            IcrcCheck::Unverified => FLAG_ICRC_UNVERIFIED,
            IcrcCheck::Bad => FLAG_ICRC_BAD,
        };
        header[36..38].copy_from_slice(&ports.0.to_be_bytes());
        header[38..40].copy_from_slice(&ports.1.to_be_bytes());
        self.with_peer(slot_port, self.clock(), |out, stalled| {
            let went = push_all(out, &header, std::slice::from_ref(&packet), &[], !*stalled) == 1;
            *stalled = !went;
            went
        })
    }

    /// Runs `f` on the mailbox of the process whose slot port is `port`, opening it (or
    /// checking that its owner still lives) first; `None` if it has none this process may
    /// use.
    fn with_peer<R>(&self, port: u16, now: u64, f: impl FnOnce(&mut Outbox, &mut bool) -> R) -> Option<R> {
        let mut peers = self.peers.lock();
        let at = match peers.iter().position(|(p, _)| *p == port) {
            Some(at) => at,
            None => {
                peers.push((port, Peer::Absent(now)));
                peers.len() - 1
            }
        };
        let peer = &mut peers[at].1;
        if let Peer::Open {
            out, checked, sent, ..
        } = peer
        {
            let idle = now.saturating_sub(*sent) >= nanos(IDLE_RECHECK);
            *sent = now;
            if out.is_closed() {
                // Replaced by a new owner of the port (or dropped): look again at once.
                *peer = Peer::Absent(now);
            } else if idle || now.saturating_sub(*checked) >= nanos(CHECK_ALIVE) {
                if out.owner_alive() {
                    *checked = now;
                } else {
                    *peer = Peer::Absent(now);
                }
            }
        }
        if let Peer::Absent(retry_at) = peer {
            if now < *retry_at {
                return None;
            }
            match Outbox::open(&self.dir.join(format!("{}-{port}", self.netns))) {
                Ok(out) if out.owner_alive() => {
                    *peer = Peer::Open {
                        out,
                        checked: now,
                        sent: now,
                        stalled: false,
                    }
                }
                // A mailbox its owner left behind when it died: the next owner of the port
                // will replace it soon, if one comes.
                Ok(_) => {
                    *peer = Peer::Absent(now + nanos(RETRY_STALE));
                    return None;
                }
                // None (a process with the driver off, or of another user).
                Err(_) => {
                    *peer = Peer::Absent(now + nanos(RETRY_ABSENT));
                    return None;
                }
            }
        }
        let Peer::Open { out, stalled, .. } = peer else {
            return None;
        };
        Some(f(out, stalled))
    }
}

/// Writes one record per packet behind `header` into `out`, waiting for room while the ring is
/// full (if `patient`: for at most [`FULL_WAIT`], while its owner lives); returns how many
/// went.
fn push_all(
    out: &mut Outbox,
    header: &[u8; HEADER],
    packets: &[impl AsRef<[u8]>],
    exts: &[Option<ExternalRanges>],
    patient: bool,
) -> usize {
    // A system call: only records that point into this process's memory carry the pid.
    let pid = exts
        .iter()
        .any(Option::is_some)
        .then(std::process::id)
        .unwrap_or(0);
    let mut sent = 0;
    for (i, p) in packets.iter().enumerate() {
        let p = p.as_ref();
        let ext = exts.get(i).copied().flatten();
        let extra = if ext.is_some() { REMOTE } else { 0 };
        let fill = |rec: &mut [u8]| {
            rec[..HEADER].copy_from_slice(header);
            if let Some(ext) = &ext {
                rec[34] |= FLAG_REMOTE;
                encode_remote(pid, ext, &mut rec[HEADER..HEADER + REMOTE]);
            }
            rec[HEADER + extra..].copy_from_slice(p);
        };
        let len = HEADER + extra + p.len();
        // Read the clock only once the ring was found full (rare).
        let mut start = None;
        loop {
            let waited = || start.map_or(Duration::ZERO, |s: StdInstant| s.elapsed());
            match out.push(len, fill) {
                Ok(true) => {
                    sent += 1;
                    break;
                }
                Ok(false) if !patient => return sent,
                // Full: the receiver is behind; give it the core for a while.
                Ok(false) if start.is_none() || waited() < FULL_SPIN => {
                    start.get_or_insert_with(StdInstant::now);
                    std::thread::yield_now();
                }
                Ok(false) if waited() < FULL_WAIT && out.owner_alive() => {
                    std::thread::sleep(Duration::from_micros(50));
                }
                _ => return sent,
            }
        }
    }
    sent
}

/// A record's header for packets sent along `route`.
fn encode_header(route: &Route) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..16].copy_from_slice(&route.sgid.0);
    h[16..32].copy_from_slice(&route.dgid.0);
    h[32] = route.traffic_class;
    h[33] = route.hop_limit;
    h[36..38].copy_from_slice(&route.ports.0.to_be_bytes());
    h[38..40].copy_from_slice(&route.ports.1.to_be_bytes());
    h
}

/// Writes where a payload is (see [`REMOTE`]).
fn encode_remote(pid: u32, ext: &ExternalRanges, out: &mut [u8]) {
    out[..4].copy_from_slice(&pid.to_le_bytes());
    out[4..8].copy_from_slice(&ext.len.to_le_bytes());
    out[8] = ext.count;
    for (i, &(addr, len)) in ext.ranges.iter().enumerate() {
        let at = 12 + 12 * i;
        out[at..at + 8].copy_from_slice(&addr.to_le_bytes());
        out[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
    }
}

/// Reads where a payload is; `None` if the description is not one a sender writes.
fn parse_remote(b: &[u8; REMOTE]) -> Option<RemoteRef> {
    let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let mut ranges = ExternalRanges {
        len: u32_at(4),
        count: b[8],
        ..Default::default()
    };
    if usize::from(ranges.count) > MAX_EXTERNAL_RANGES {
        return None;
    }
    for (i, r) in ranges.ranges.iter_mut().enumerate() {
        let at = 12 + 12 * i;
        *r = (
            u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes")),
            u32_at(at + 8),
        );
    }
    Some(RemoteRef {
        pid: u32_at(0),
        ranges,
    })
}

/// Reads a record's header: what the receiver would have learned from IP and UDP.
fn parse_header(h: &[u8; HEADER]) -> (RxMeta, (u16, u16)) {
    let gid = |b: &[u8]| Gid(b.try_into().expect("16 bytes"));
    let meta = RxMeta {
        sgid: gid(&h[..16]),
        dgid: gid(&h[16..32]),
        traffic_class: h[32],
        hop_limit: h[33],
    };
    let ports = (
        u16::from_be_bytes([h[36], h[37]]),
        u16::from_be_bytes([h[38], h[39]]),
    );
    (meta, ports)
}

impl Driver for Shm {
    fn send(&self, route: &Route, packets: &mut [Vec<u8>]) -> usize {
        self.send_to_process(route, packets, &[]).unwrap_or(0)
    }

    fn recv(&self, batch: &mut PacketBatch) -> usize {
        let mut n = 0;
        self.inbox.poll(MAX_BATCH, |rec| {
            let Some((h, packet)) = rec.split_first_chunk::<HEADER>() else {
                return;
            };
            let (meta, ports) = parse_header(h);
            let icrc = if h[34] & FLAG_ICRC_BAD != 0 {
                IcrcCheck::Bad
            } else if h[34] & FLAG_ICRC_UNVERIFIED != 0 {
                IcrcCheck::Unverified
            } else {
                IcrcCheck::Ok
            };
            if h[34] & FLAG_REMOTE == 0 {
                batch.push(packet, meta, icrc, ports);
            } else {
                let Some((r, packet)) = packet.split_first_chunk::<REMOTE>() else {
                    return;
                };
                let Some(remote) = parse_remote(r) else { return };
                batch.push_remote(packet, Some(remote), meta, icrc, ports);
            }
            n += 1;
        });
        n
    }

    fn wait(&self, timeout: Duration) -> bool {
        self.inbox.wait(timeout)
    }

    fn wake(&self) {
        self.inbox.wake();
    }

    fn tick(&self) {
        self.prune();
    }

    fn readiness(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    /// Two ports of this test only (mailbox names; nothing is bound).
    fn test_ports() -> u16 {
        40_000 + ((std::process::id() % 5_000) as u16) * 2
    }

    #[test]
    fn a_stalled_receiver_holds_sends_up_once_and_a_gone_one_is_let_go() {
        let port = test_ports();
        let shm = Shm::start(port, std::time::Instant::now()).expect("a mailbox");
        // A receiver that never reads: its one small ring fills after a few dozen records.
        let peer_path = shm.dir.join(format!("{}-{}", shm.netns, port + 1));
        let layout = Layout {
            rings: 1,
            ring_capacity: 64 << 10,
        };
        let inbox = Inbox::create(&peer_path, layout).unwrap();
        let route = Route {
            sgid: Gid::from(Ipv4Addr::LOCALHOST),
            dgid: Gid::from(Ipv4Addr::LOCALHOST),
            dest_qpn: 0x02_0011,
            traffic_class: 0,
            hop_limit: 64,
            ifindex: 1,
            ports: (port, port + 1),
        };
        let packet = vec![7u8; 1000];
        let start = StdInstant::now();
        let sent: usize = (0..300)
            .map(|_| {
                shm.send_to_process(&route, std::slice::from_ref(&packet), &[])
                    .unwrap()
            })
            .sum();
        // Each of the ~240 sends into the full ring used to wait 200 ms (48 s in all); now the
        // first one does and the others lose their packet at once.
        assert!(sent > 0 && sent < 300, "{sent} of 300 fit");
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "sends into a full ring took {:?}",
            start.elapsed()
        );
        // Once the receiver reads, records fit again.
        let mut read = 0;
        inbox.poll(usize::MAX, |_| read += 1);
        assert_eq!(read, sent);
        assert_eq!(
            shm.send_to_process(&route, std::slice::from_ref(&packet), &[]),
            Some(1)
        );
        assert_eq!(shm.open_peers(), 1);
        // A receiver that is gone (here: dropped its mailbox) is let go of by the upkeep.
        drop(inbox);
        shm.prune();
        assert_eq!(
            shm.open_peers(),
            0,
            "the mailbox of a peer that is gone is unmapped"
        );
    }

    #[test]
    fn headers_round_trip() {
        let route = Route {
            sgid: Gid::from(Ipv4Addr::new(127, 0, 0, 1)),
            dgid: Gid::from(Ipv4Addr::new(127, 0, 0, 2)),
            dest_qpn: 0x02_0011,
            traffic_class: 7,
            hop_limit: 9,
            ifindex: 1,
            ports: (4792, 4793),
        };
        let (meta, ports) = parse_header(&encode_header(&route));
        assert_eq!(meta, route.meta());
        assert_eq!(ports, route.ports);
    }

    #[test]
    fn payload_descriptions_round_trip_and_bad_ones_are_refused() {
        let mut ext = ExternalRanges::default();
        assert!(ext.push(0x7f00_0000_1000, 4096));
        assert!(ext.push(0x7f00_0000_9000, 100));
        let mut b = [0u8; REMOTE];
        encode_remote(4242, &ext, &mut b);
        assert_eq!(
            parse_remote(&b),
            Some(RemoteRef {
                pid: 4242,
                ranges: ext
            })
        );
        b[8] = MAX_EXTERNAL_RANGES as u8 + 1;
        assert_eq!(parse_remote(&b), None);
    }
}
