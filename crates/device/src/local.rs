//! The in-process driver: packets between nodes of this process, through a queue in memory.
//!
//! Each node has one, as its inbound queue: the fabric sends to the destination node's driver,
//! and the node receives from its own when it is driven. Sending moves the packets' buffers
//! into the queue; receiving hands the whole queue over by exchanging batches, so a packet goes
//! from the sending QP to the receiving one uncopied. Packets other drivers received are queued
//! here too ([`InProcess::deliver`]), so a node has a single queue, in arrival order. The
//! threads that send also drive the fabric, so nothing has to wait on this driver; `wait` and
//! `wake` exist for the trait's sake.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::driver::{Driver, IcrcCheck, PacketBatch, PacketData, Route};
use crate::remote::RemoteRef;
use softverbs_engine::transport::RxMeta;

/// Packets between nodes of this process.
#[derive(Debug, Default)]
pub(crate) struct InProcess {
    queue: Mutex<PacketBatch>,
    /// Whether the queue holds packets (changed under its lock): polling threads check it
    /// without taking the lock, so an idle driver costs them no shared writes.
    pending: AtomicBool,
    /// Raised after every packet queued here; shared by the nodes of one fabric, so that a
    /// poller learns that no node has anything with a single load.
    queued: Arc<AtomicBool>,
    ready: Condvar,
}

impl InProcess {
    /// A queue that raises `queued` whenever a packet is put in it.
    pub(crate) fn new(queued: Arc<AtomicBool>) -> Self {
        Self {
            queued,
            ..Self::default()
        }
    }

    /// Whether packets may be waiting, without taking the lock: a hint for polling threads
    /// (a sender always sees its own packets).
    pub(crate) fn has_pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Whether the queue is empty, under its lock: ordered with every send and receive.
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.lock().is_empty()
    }

    /// Queues every packet of `batch`, which another driver received, leaving `batch` empty:
    /// into an empty queue by exchanging the batches (no copy), else each copied behind what
    /// waits. Their ICRCs were checked by the driver, so they are queued as verified.
    pub(crate) fn deliver_all(&self, batch: &mut PacketBatch) {
        batch.mark_verified();
        let mut q = self.queue.lock();
        if q.is_empty() {
            q.swap(batch);
        } else {
            for (data, rx) in batch.drain() {
                q.push_data(data, rx);
            }
        }
        self.pending.store(!q.is_empty(), Ordering::Release);
        drop(q);
        self.queued.store(true, Ordering::Release);
        self.ready.notify_all();
    }

    /// Queues a packet another driver received (moved if it has a buffer of its own).
    pub(crate) fn deliver(
        &self,
        data: PacketData<'_>,
        meta: RxMeta,
        ports: (u16, u16),
        remote: Option<RemoteRef>,
    ) {
        let mut q = self.queue.lock();
        q.push_data(data, (meta, IcrcCheck::Ok, ports, remote));
        self.pending.store(true, Ordering::Release);
        drop(q);
        self.queued.store(true, Ordering::Release);
        self.ready.notify_all();
    }
}

impl Driver for InProcess {
    fn send(&self, route: &Route, packets: &mut [Vec<u8>]) -> usize {
        let meta = route.meta();
        let mut q = self.queue.lock();
        for p in packets.iter_mut() {
            // Nothing here can corrupt a packet, so there is no ICRC to check.
            q.push_owned(std::mem::take(p), meta, IcrcCheck::Ok, route.ports);
        }
        self.pending.store(!q.is_empty(), Ordering::Release);
        drop(q);
        self.queued.store(true, Ordering::Release);
        self.ready.notify_all();
        packets.len()
    }

    fn recv(&self, batch: &mut PacketBatch) -> usize {
        let mut q = self.queue.lock();
        if q.is_empty() {
            return 0;
        }
        let n = q.len();
        self.pending.store(false, Ordering::Release);
        if batch.is_empty() {
            // The common case: take the queue's buffer and leave it the caller's empty one.
            q.swap(batch);
        } else {
            for (data, rx) in q.drain() {
                batch.push_data(data, rx);
            }
        }
        n
    }

    fn wait(&self, timeout: Duration) -> bool {
        let mut q = self.queue.lock();
        if q.is_empty() {
            self.ready.wait_for(&mut q, timeout);
        }
        !q.is_empty()
    }

    fn wake(&self) {
        let _q = self.queue.lock();
        self.ready.notify_all();
    }

    fn readiness(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use softverbs_engine::types::Gid;

    /// A route between two addresses, with a traffic class and hop limit to check they travel.
    fn route() -> Route {
        Route {
            sgid: Gid::from_ip("10.0.0.1".parse().unwrap()),
            dgid: Gid::from_ip("10.0.0.2".parse().unwrap()),
            dest_qpn: 0x11,
            traffic_class: 3,
            hop_limit: 9,
            ifindex: 1,
            ports: (4792, 4793),
        }
    }

    #[test]
    fn packets_come_out_in_order_with_their_route() {
        let d = InProcess::default();
        let route = route();
        assert!(!d.wait(Duration::from_millis(1)), "nothing queued");
        assert!(!d.has_pending());
        assert_eq!(d.send(&route, &mut [vec![1], vec![2, 2]]), 2);
        assert_eq!(d.send(&route, &mut [vec![3]]), 1);
        assert!(d.wait(Duration::ZERO));
        assert!(d.has_pending());
        let mut b = PacketBatch::default();
        b.push(&[0], route.meta(), IcrcCheck::Ok, route.ports);
        assert_eq!(d.recv(&mut b), 3);
        let got: Vec<Vec<u8>> = b.iter().map(|(p, _)| p.to_vec()).collect();
        assert_eq!(got, [vec![0], vec![1], vec![2, 2], vec![3]]);
        assert!(b
            .iter()
            .all(|(_, m)| m.meta == route.meta() && m.ports == route.ports));
        let mut empty = PacketBatch::default();
        assert_eq!(d.recv(&mut empty), 0, "the queue was emptied");
        assert!(!d.has_pending());
        d.send(&route, &mut [vec![4]]);
        assert_eq!(d.recv(&mut empty), 1);
        assert_eq!(empty.iter().next().map(|(p, _)| p.to_vec()), Some(vec![4]));
    }

    #[test]
    fn a_received_batch_is_handed_over_whole_and_in_order() {
        let queued = Arc::new(AtomicBool::new(false));
        let d = InProcess::new(queued.clone());
        let route = route();
        let received = |bytes: &[&[u8]]| {
            let mut b = PacketBatch::default();
            for p in bytes {
                b.push(p, route.meta(), IcrcCheck::Unverified, route.ports);
            }
            b
        };
        // Into an empty queue the batch moves (its buffer with it), leaving the caller's empty.
        let mut rx = received(&[&[1], &[2, 2]]);
        d.deliver_all(&mut rx);
        assert!(rx.is_empty() && rx.bytes() == 0);
        assert!(
            rx.spare(0).is_empty(),
            "the caller got the queue's unused buffer, not its own back"
        );
        assert!(d.has_pending() && queued.load(Ordering::Acquire));
        // Behind packets already waiting, they are queued after them, copied.
        d.send(&route, &mut [vec![9]]);
        let mut more = received(&[&[3]]);
        d.deliver_all(&mut more);
        assert!(more.is_empty());
        let mut out = PacketBatch::default();
        assert_eq!(d.recv(&mut out), 4);
        let got: Vec<Vec<u8>> = out.iter().map(|(p, _)| p.to_vec()).collect();
        assert_eq!(got, [vec![1], vec![2, 2], vec![9], vec![3]]);
        assert!(
            out.iter()
                .all(|(_, m)| m.icrc == IcrcCheck::Ok && m.ports == route.ports),
            "verdicts were acted on before queueing"
        );
        assert!(!d.has_pending());
    }
}
