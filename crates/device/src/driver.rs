//! Packet drivers: what carries RoCE packets between the fabric's nodes.
//!
//! The [`Fabric`](crate::fabric::Fabric) decides where each packet goes; a [`Driver`] only moves
//! batches of packets and says when there may be more to read. Two drivers exist:
//! - [`InProcess`](crate::local::InProcess): between nodes of this process (each node's inbound
//!   queue in memory, into which the fabric also delivers what other drivers received);
//! - [`Udp`](crate::udp::Udp): RoCEv2 over UDP, to other processes and hosts.
//!
//! A shared-memory driver between processes of one host plugs in the same way: `send` writes a
//! batch into the peer's ring (a shared mapping set up when the peer was found), `recv` copies
//! this process's ring into the caller's [`PacketBatch`], [`Driver::readiness`] returns an
//! eventfd the peer signals after writing to an empty ring, and [`Driver::wake`] signals it
//! locally. The fabric then picks that driver for destinations whose GID and slot belong to a
//! process it has a ring with, before falling back to UDP.

use std::fmt;
use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use softverbs_engine::transport::RxMeta;
use softverbs_engine::types::Gid;

use crate::remote::RemoteRef;

/// Where a run of packets goes: one source and destination address and one destination QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Route {
    /// The sender's GID (its source address).
    pub(crate) sgid: Gid,
    /// The destination GID (an address or a multicast group).
    pub(crate) dgid: Gid,
    /// The destination QP number of every packet of the run.
    pub(crate) dest_qpn: u32,
    /// Traffic class / TOS.
    pub(crate) traffic_class: u8,
    /// Hop limit / TTL.
    pub(crate) hop_limit: u8,
    /// The sending device's interface (the scope of link-local IPv6 addresses).
    pub(crate) ifindex: u32,
    /// The UDP source and destination ports the packet has on the wire, or would have had if
    /// it stays in this process (UD flow rules match them).
    pub(crate) ports: (u16, u16),
}

impl Route {
    /// What a receiver on the same fabric learns about a packet sent along this route.
    pub(crate) fn meta(&self) -> RxMeta {
        RxMeta {
            sgid: self.sgid,
            dgid: self.dgid,
            traffic_class: self.traffic_class,
            hop_limit: self.hop_limit,
        }
    }
}

/// What a driver found out about a received packet's ICRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IcrcCheck {
    /// Verified, or not needed (the packet never left this process).
    Ok,
    /// Checked and wrong: the packet must be dropped.
    Bad,
    /// Could not be checked (IPv4 sent with a non-zero IP ID); the packet is kept.
    Unverified,
}

/// Where a packet's bytes are.
#[derive(Debug, Clone)]
enum Bytes {
    /// In the batch's shared buffer.
    Shared(Range<usize>),
    /// In a buffer of its own, handed over by a sender in this process (moved, not copied).
    Owned(Vec<u8>),
}

/// One packet of a [`PacketBatch`].
#[derive(Debug, Clone)]
pub(crate) struct PacketDesc {
    bytes: Bytes,
    /// What the network told about the packet.
    pub(crate) meta: RxMeta,
    /// The driver's ICRC verdict.
    pub(crate) icrc: IcrcCheck,
    /// UDP source and destination ports (see [`Route::ports`]).
    pub(crate) ports: (u16, u16),
    /// Where the payload is if the sender left it in its memory (the bytes are then the
    /// packet with an empty payload).
    pub(crate) remote: Option<RemoteRef>,
}

/// A packet taken out of a batch by [`PacketBatch::drain`].
#[derive(Debug)]
pub(crate) enum PacketData<'a> {
    /// Bytes still in the batch's buffer: copy them to keep them.
    Shared(&'a [u8]),
    /// A buffer of its own, now the caller's.
    Owned(Vec<u8>),
}

impl PacketData<'_> {
    /// The bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Self::Shared(b) => b,
            Self::Owned(v) => v,
        }
    }
}

/// What was learned about a received packet besides its bytes: meta data, ICRC verdict, UDP
/// ports and, for a payload left in the sender's memory, where it is.
pub(crate) type RxInfo = (RxMeta, IcrcCheck, (u16, u16), Option<RemoteRef>);

/// Received packets: the bytes back to back in one reusable buffer (what a driver receives
/// into), or in buffers of their own that senders in this process handed over, plus a
/// descriptor per packet. Clearing keeps the shared buffer, so a batch reused for every
/// receive allocates nothing once it has grown to the largest burst.
#[derive(Debug, Default)]
pub(crate) struct PacketBatch {
    /// Zero-filled once when grown; `used` bytes of it hold packets.
    buf: Vec<u8>,
    used: usize,
    pkts: Vec<PacketDesc>,
}

/// Memory a batch keeps after a burst; more is given back when it is cleared.
const KEEP_BYTES: usize = 4 << 20;

impl PacketBatch {
    /// Forgets every packet, keeping the memory (up to a bound).
    pub(crate) fn clear(&mut self) {
        self.used = 0;
        // Buffers handed over by senders in this process serve its next packets.
        for d in self.pkts.drain(..) {
            if let Bytes::Owned(v) = d.bytes {
                softverbs_engine::transport::buffers::recycle(v);
            }
        }
        if self.buf.len() > KEEP_BYTES {
            self.buf.truncate(KEEP_BYTES);
            self.buf.shrink_to_fit();
        }
    }

    /// Number of packets.
    pub(crate) fn len(&self) -> usize {
        self.pkts.len()
    }

    /// Whether the batch holds no packet.
    pub(crate) fn is_empty(&self) -> bool {
        self.pkts.is_empty()
    }

    /// Bytes of packet data held in the shared buffer.
    pub(crate) fn bytes(&self) -> usize {
        self.used
    }

    /// Appends a copy of `data`.
    pub(crate) fn push(&mut self, data: &[u8], meta: RxMeta, icrc: IcrcCheck, ports: (u16, u16)) {
        self.push_remote(data, None, meta, icrc, ports);
    }

    /// Appends a copy of `data`, whose payload may be at `remote`.
    pub(crate) fn push_remote(
        &mut self,
        data: &[u8],
        remote: Option<RemoteRef>,
        meta: RxMeta,
        icrc: IcrcCheck,
        ports: (u16, u16),
    ) {
        let start = self.used;
        self.spare(data.len())[..data.len()].copy_from_slice(data);
        self.pkts.push(PacketDesc {
            bytes: Bytes::Shared(start..start + data.len()),
            meta,
            icrc,
            ports,
            remote,
        });
        self.used += data.len();
    }

    /// Appends a packet that keeps its own buffer (no copy).
    pub(crate) fn push_owned(&mut self, data: Vec<u8>, meta: RxMeta, icrc: IcrcCheck, ports: (u16, u16)) {
        self.pkts.push(PacketDesc {
            bytes: Bytes::Owned(data),
            meta,
            icrc,
            ports,
            remote: None,
        });
    }

    /// Appends a packet taken from another batch: moved if it has its own buffer, copied
    /// otherwise.
    pub(crate) fn push_data(&mut self, data: PacketData<'_>, rx: RxInfo) {
        let (meta, icrc, ports, remote) = rx;
        match data {
            PacketData::Shared(b) => self.push_remote(b, remote, meta, icrc, ports),
            PacketData::Owned(v) => {
                self.push_owned(v, meta, icrc, ports);
                if let Some(last) = self.pkts.last_mut() {
                    last.remote = remote;
                }
            }
        }
    }

    /// At least `min` writable bytes after the packets held, for a driver to receive into
    /// directly; describe what landed there with [`PacketBatch::add`] and keep it with
    /// [`PacketBatch::commit`].
    pub(crate) fn spare(&mut self, min: usize) -> &mut [u8] {
        let need = self.used + min;
        if self.buf.len() < need {
            self.buf.resize(need.max(self.buf.len() * 2), 0);
        }
        &mut self.buf[self.used..]
    }

    /// Records a packet at `range` of the last [`PacketBatch::spare`] area.
    pub(crate) fn add(&mut self, range: Range<usize>, meta: RxMeta, icrc: IcrcCheck, ports: (u16, u16)) {
        let range = self.used + range.start..self.used + range.end;
        debug_assert!(range.end <= self.buf.len());
        self.pkts.push(PacketDesc {
            bytes: Bytes::Shared(range),
            meta,
            icrc,
            ports,
            remote: None,
        });
    }

    /// Keeps the first `n` bytes of the last [`PacketBatch::spare`] area.
    pub(crate) fn commit(&mut self, n: usize) {
        self.used += n;
        debug_assert!(self.used <= self.buf.len());
    }

    /// The packets, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], &PacketDesc)> {
        self.pkts.iter().map(|d| {
            let data = match &d.bytes {
                Bytes::Shared(r) => &self.buf[r.clone()],
                Bytes::Owned(v) => v.as_slice(),
            };
            (data, d)
        })
    }

    /// Takes the packets out, oldest first, with what was learned about each; the batch is
    /// empty afterwards (and keeps its memory).
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = (PacketData<'_>, RxInfo)> {
        self.used = 0;
        let buf = &self.buf;
        self.pkts.drain(..).map(move |d| {
            let data = match d.bytes {
                Bytes::Shared(r) => PacketData::Shared(&buf[r]),
                Bytes::Owned(v) => PacketData::Owned(v),
            };
            (data, (d.meta, d.icrc, d.ports, d.remote))
        })
    }

    /// Records every packet's ICRC as verified (once its verdict was acted on).
    pub(crate) fn mark_verified(&mut self) {
        for d in &mut self.pkts {
            d.icrc = IcrcCheck::Ok;
        }
    }

    /// Exchanges the contents of two batches (no copy).
    pub(crate) fn swap(&mut self, other: &mut Self) {
        std::mem::swap(self, other);
    }
}

/// A carrier of RoCE packets (the payload of a RoCEv2 UDP datagram: BTH to ICRC).
///
/// The fabric calls `recv` from one thread at a time per driver and hands the batch on before
/// the next call, so a driver that reads a FIFO keeps each QP's packets in order (the UDP
/// driver's batch is behind a lock; a node's in-process driver is read by the thread driving
/// the node).
pub(crate) trait Driver: Send + Sync + fmt::Debug {
    /// Sends a run of packets along `route`, filling in their ICRCs if the carrier needs them.
    /// Returns how many were accepted; the rest are lost (as on a network). A driver that
    /// keeps packets in memory may take their buffers, leaving empty ones behind.
    fn send(&self, route: &Route, packets: &mut [Vec<u8>]) -> usize;

    /// Appends the packets waiting now to `batch`, without blocking. Returns how many were
    /// appended. A driver may stop early (the batch is large); the rest stays for the next
    /// call and readiness stays signalled.
    fn recv(&self, batch: &mut PacketBatch) -> usize;

    /// Blocks until `recv` may find packets, [`Driver::wake`] is called or `timeout` passes.
    /// Returns whether packets may be waiting.
    fn wait(&self, timeout: Duration) -> bool;

    /// Ends a [`Driver::wait`] in another thread early.
    fn wake(&self);

    /// Upkeep that must happen whether or not packets come: the receive thread calls it on
    /// every turn of its loop (at least once a second, and every few hundred microseconds
    /// while the application busy-polls, when the thread does not wait on the driver at all).
    /// Rate-limited by the driver.
    fn tick(&self) {}

    /// A descriptor that polls readable while packets may be waiting (for an event loop that
    /// waits on several drivers at once); `None` if the driver is only ever pumped by the
    /// threads that send to it. The fabric's own threads use [`Driver::wait`]; this is for an
    /// event loop over several drivers, which the shared-memory driver will bring.
    #[cfg_attr(not(test), allow(dead_code))]
    fn readiness(&self) -> Option<BorrowedFd<'_>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(n: u8) -> RxMeta {
        RxMeta {
            sgid: Gid::ZERO,
            dgid: Gid::ZERO,
            traffic_class: n,
            hop_limit: 64,
        }
    }

    #[test]
    fn batch_keeps_packets_in_order_and_reuses_memory() {
        let mut b = PacketBatch::default();
        b.push(&[1, 2, 3], meta(1), IcrcCheck::Ok, (1, 2));
        let spare = b.spare(8);
        spare[..5].copy_from_slice(&[9, 9, 4, 5, 6]);
        // A driver received 5 bytes, of which the last 3 are a packet (a 2-byte wrapper).
        b.add(2..5, meta(2), IcrcCheck::Unverified, (3, 4));
        b.commit(5);
        let got: Vec<(Vec<u8>, u8, IcrcCheck)> = b
            .iter()
            .map(|(d, p)| (d.to_vec(), p.meta.traffic_class, p.icrc))
            .collect();
        assert_eq!(
            got,
            [
                (vec![1, 2, 3], 1, IcrcCheck::Ok),
                (vec![4, 5, 6], 2, IcrcCheck::Unverified)
            ]
        );
        assert_eq!((b.len(), b.bytes()), (2, 8));
        let cap = b.buf.capacity();
        b.clear();
        assert!(b.is_empty());
        b.push(&[7; 8], meta(3), IcrcCheck::Ok, (0, 0));
        assert_eq!(b.buf.capacity(), cap, "a cleared batch reuses its memory");
        assert_eq!(b.iter().next().map(|(d, _)| d.to_vec()), Some(vec![7; 8]));
    }

    #[test]
    fn clearing_a_batch_hands_owned_buffers_back_for_the_next_packet() {
        use softverbs_engine::transport::buffers;
        let owned = buffers::take(100);
        let at = owned.as_ptr();
        let mut b = PacketBatch::default();
        b.push_owned(owned, meta(1), IcrcCheck::Ok, (1, 1));
        assert_eq!(buffers::pooled(100), 0);
        b.clear();
        assert_eq!(buffers::pooled(100), 1, "the packet's buffer went back");
        let next = buffers::take(100);
        assert_eq!(next.as_ptr(), at, "and serves the next packet");
    }

    #[test]
    fn owned_packets_move_and_shared_ones_are_copied() {
        let mut b = PacketBatch::default();
        let owned = vec![5u8; 100];
        let at = owned.as_ptr();
        b.push(&[1, 2], meta(1), IcrcCheck::Ok, (1, 1));
        b.push_owned(owned, meta(2), IcrcCheck::Ok, (2, 2));
        b.push(&[3], meta(3), IcrcCheck::Bad, (3, 3));
        let mut to = PacketBatch::default();
        for (data, (m, icrc, ports, remote)) in b.drain() {
            if let PacketData::Owned(v) = &data {
                assert_eq!(v.as_ptr(), at, "the buffer itself moves");
            }
            assert_eq!(ports, (m.traffic_class.into(), m.traffic_class.into()));
            assert_eq!(remote, None);
            to.push_data(data, (m, icrc, ports, remote));
        }
        assert!(b.is_empty() && b.bytes() == 0);
        let got: Vec<(Vec<u8>, u8, IcrcCheck)> = to
            .iter()
            .map(|(d, p)| (d.to_vec(), p.meta.traffic_class, p.icrc))
            .collect();
        assert_eq!(
            got,
            [
                (vec![1, 2], 1, IcrcCheck::Ok),
                (vec![5; 100], 2, IcrcCheck::Ok),
                (vec![3], 3, IcrcCheck::Bad)
            ]
        );
        assert_eq!(to.bytes(), 3, "only the shared packets take buffer space");
    }
}
