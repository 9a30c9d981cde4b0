//! RoCEv2 over UDP: the driver that carries packets between processes and hosts.
//!
//! Several processes on one host share the RoCE port without a daemon. Each process takes a
//! *slot* k (1..=255) by binding UDP port `base + k` (`base` is 4791 unless configured), and
//! every QP number it allocates carries the slot in bits 16..24. A sender that knows a QPN
//! therefore knows the port to send to: softverbs peers talk to each other directly. Standard
//! peers (the kernel's rxe, RoCE NICs) always send to `base`; whichever process holds `base`
//! forwards packets for other slots to their process: through its shared-memory mailbox
//! (`crate::shm`) where it has one, which waits for room rather than drop; otherwise to its
//! port, wrapped in a small header that keeps the original addresses (so ICRC checks and GRHs
//! stay right). If that process exits, another one takes `base` over within a second.
//!
//! Sockets get large buffers and report their overflows (`SO_RXQ_OVFL`), which the driver's
//! own counter block counts (`rx_socket_drops`), beside the forwarding counts.
//!
//! Packets are sent from unconnected sockets with `IP_PMTUDISC_DO`, so Linux sends IPv4
//! datagrams with ID 0 and DF set, and numbers the segments of a GSO batch 0, 1, ...: that is
//! what the ICRCs are computed over. The IPv4 ID of a received datagram is not visible to a UDP
//! socket, so an IPv4 ICRC can only be verified when the ID is known: 0, or the packet's place
//! in the GRO batch it arrived in (a softverbs sender's GSO batch arrives whole); a mismatch is
//! counted as unverifiable rather than dropped. IPv6 ICRCs are always verified, and mismatches
//! are dropped and counted.

use std::io::{IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant as StdInstant};

use nix::errno::Errno;
use nix::libc;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::{
    bind, getsockopt, recvmmsg, sendmmsg, sendmsg, setsockopt, socket, sockopt, AddressFamily,
    ControlMessage, ControlMessageOwned, MsgFlags, MultiHeaders, SockFlag, SockType, SockaddrIn, SockaddrIn6,
    SockaddrStorage,
};
use parking_lot::Mutex;
use softverbs_engine::transport::RxMeta;
use softverbs_engine::types::Gid;
use softverbs_wire::icrc;

use crate::driver::{Driver, IcrcCheck, PacketBatch, Route};
use crate::pace::Pacer;
use crate::shm::Shm;
use crate::stats::{NodeCounters, UDP_BLOCK};

/// First bytes of a forwarded datagram. 0x53 is an RD opcode, which no valid packet here uses.
const FORWARD_MAGIC: [u8; 4] = *b"SVFW";
/// Magic, source address and port, destination address.
const FORWARD_HEADER: usize = 4 + 16 + 2 + 16;
/// Largest receive: a GRO-coalesced batch of datagrams.
const MAX_DATAGRAM: usize = 65536;
/// Bytes after which a receive call stops reading (the rest is read by the next call).
const RX_BATCH_BYTES: usize = 1 << 20;
/// Most datagrams sent in one `sendmmsg` call.
const MMSG_MAX: usize = 64;
/// Most datagrams read in one `recvmmsg` call (each gets room for a GRO batch).
const RECV_MMSG: usize = 8;
/// Largest received datagram moved to close the gap behind the previous one.
const COMPACT_MAX: usize = 1024;
/// Most datagrams sent in one GSO batch (the kernel's limit is 64).
const GSO_MAX_SEGMENTS: usize = 64;
/// Most bytes in one GSO batch (the UDP payload limit).
const GSO_MAX_BYTES: usize = 65_000;

/// A bound socket pair (IPv4 and, where available, IPv6) on one port.
#[derive(Debug)]
struct Sockets {
    v4: OwnedFd,
    v6: Option<OwnedFd>,
    port: u16,
    /// The overflow count each socket (IPv4, IPv6) last reported: the kernel's is cumulative.
    overflows: [AtomicU32; 2],
}

fn udp_socket(family: AddressFamily) -> nix::Result<OwnedFd> {
    socket(
        family,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
}

/// Socket buffers big enough for a full send window of every QP: a receive buffer that
/// overflows turns into go-back-N retransmissions. The `FORCE` variants pass `net.core.rmem_max`
/// when allowed (root); otherwise the plain ones get what the system permits.
fn big_buffers(fd: &OwnedFd) {
    const SIZE: usize = 16 << 20;
    if setsockopt(fd, sockopt::RcvBufForce, &SIZE).is_err() {
        let _ = setsockopt(fd, sockopt::RcvBuf, &SIZE);
    }
    if setsockopt(fd, sockopt::SndBufForce, &SIZE).is_err() {
        let _ = setsockopt(fd, sockopt::SndBuf, &SIZE);
    }
    // Every read then tells how many datagrams the socket dropped for want of room, which
    // `rx_socket_drops` counts: a drop on the host is visible, not a silent gap in the PSNs.
    let _ = setsockopt(fd, sockopt::RxqOvfl, &1);
}

impl Sockets {
    fn bind(port: u16) -> nix::Result<Self> {
        let v4 = udp_socket(AddressFamily::Inet)?;
        setsockopt(&v4, sockopt::Ipv4PacketInfo, &true)?;
        // Receive batches of datagrams in one call where the kernel can coalesce them.
        let _ = setsockopt(&v4, sockopt::UdpGroSegment, &true);
        // Ask for DF and thereby IP ID 0: the ICRC covers the ID.
        rustix::net::sockopt::set_ip_mtu_discover(&v4, rustix::net::sockopt::Ipv4PathMtuDiscovery::DO)
            .map_err(|e| Errno::from_raw(e.raw_os_error()))?;
        big_buffers(&v4);
        bind(
            v4.as_raw_fd(),
            &SockaddrIn::from(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)),
        )?;
        let v6 = (|| -> nix::Result<OwnedFd> {
            let v6 = udp_socket(AddressFamily::Inet6)?;
            setsockopt(&v6, sockopt::Ipv6V6Only, &true)?;
            setsockopt(&v6, sockopt::Ipv6RecvPacketInfo, &true)?;
            let _ = setsockopt(&v6, sockopt::UdpGroSegment, &true);
            big_buffers(&v6);
            bind(
                v6.as_raw_fd(),
                &SockaddrIn6::from(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, port, 0, 0)),
            )?;
            Ok(v6)
        })();
        match v6 {
            Ok(v6) => Ok(Self {
                v4,
                v6: Some(v6),
                port,
                overflows: Default::default(),
            }),
            // A host without IPv6 still gets IPv4; a port taken on IPv6 only is taken.
            Err(Errno::EADDRINUSE) => Err(Errno::EADDRINUSE),
            Err(_) => Ok(Self {
                v4,
                v6: None,
                port,
                overflows: Default::default(),
            }),
        }
    }

    fn fds(&self) -> impl Iterator<Item = &OwnedFd> {
        std::iter::once(&self.v4).chain(self.v6.as_ref())
    }

    /// Each socket with its last reported overflow count.
    fn fds_with_overflows(&self) -> impl Iterator<Item = (&OwnedFd, &AtomicU32)> {
        self.fds().zip(&self.overflows)
    }
}

/// The process's UDP endpoint.
#[derive(Debug)]
pub(crate) struct Udp {
    slot: u8,
    base: u16,
    own: Sockets,
    /// The standard port, when this process holds it.
    forwarder: Mutex<Option<Arc<Sockets>>>,
    last_takeover_try: Mutex<StdInstant>,
    /// Readable while a socket is, or after `wake`.
    epoll: Epoll,
    /// Ends a `wait` early.
    waker: EventFd,
    /// Whether GSO sends are allowed (`SOFTVERBS_GSO`) and the kernel accepts them.
    gso: std::sync::atomic::AtomicBool,
    /// GSO also towards addresses other than loopback ones (`SOFTVERBS_GSO=1`).
    gso_links: bool,
    /// Holds back floods towards receivers on this host that cannot keep up.
    pacer: Pacer,
    /// Forwarded datagrams dropped because they did not come from the standard port.
    forged: std::sync::atomic::AtomicU64,
    /// The mailboxes of the other processes of this host, through which datagrams for their
    /// slots are forwarded (set once the shared-memory driver runs).
    mailboxes: OnceLock<Arc<Shm>>,
    /// What belongs to no one device: socket overflows, forwarding.
    counters: NodeCounters,
    /// Sockets (bit i: the i-th of `receive_into`'s list) read directly, without a readiness
    /// check first: those that delivered since the last full scan.
    hot: AtomicU8,
    /// Sockets that delivered since the last full scan.
    delivered: AtomicU8,
    /// Receive calls since the last full scan of every socket.
    since_scan: AtomicU32,
    /// The next receive scans every socket (`wait` found one readable).
    scan_next: AtomicBool,
}

/// A receive call scans every socket at least once in this many calls; in between it reads
/// only the sockets that delivered lately (one system call per socket, rather than a readiness
/// check and then a read).
const SCAN_EVERY: u32 = 64;

/// Where the driver sends runs of packets as GSO batches (`SOFTVERBS_GSO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GsoPolicy {
    /// `0`: never; one datagram per packet, in `sendmmsg` calls.
    Off,
    /// `loopback`: to loopback addresses only.
    Loopback,
    /// The default (`1`): to every destination.
    Everywhere,
}

fn gso_policy() -> GsoPolicy {
    match std::env::var("SOFTVERBS_GSO").as_deref().map(str::trim) {
        Ok("0") => GsoPolicy::Off,
        Ok("loopback") => GsoPolicy::Loopback,
        _ => GsoPolicy::Everywhere,
    }
}

/// The slot of a QP number: which process (and port) owns it.
pub(crate) fn slot_of(qpn: u32) -> u8 {
    (qpn >> 16) as u8
}

/// The `recvmmsg` headers of one call, with room for every datagram's address and control
/// messages.
///
/// nix's headers keep the lengths the kernel wrote back into them (of the address and the
/// control messages), so a set that received datagrams cannot serve another call: it would
/// offer the kernel only the room the last datagrams used. A call that failed (above all
/// EAGAIN, which is what most looks at an idle socket get) wrote nothing, so its set is kept
/// for this thread's next call instead of being allocated and zeroed again.
struct RecvHeaders(MultiHeaders<SockaddrStorage>);

thread_local! {
    static RECV_HEADERS: std::cell::RefCell<Option<RecvHeaders>> = const { std::cell::RefCell::new(None) };
}

impl RecvHeaders {
    /// This thread's kept set, or a new one.
    fn take() -> Self {
        RECV_HEADERS
            .try_with(|h| h.try_borrow_mut().ok().and_then(|mut h| h.take()))
            .ok()
            .flatten()
            .unwrap_or_else(|| {
                Self(MultiHeaders::preallocate(
                    RECV_MMSG,
                    Some(nix::cmsg_space!(libc::in6_pktinfo, i32, u32)),
                ))
            })
    }

    /// Keeps a set the kernel did not write to for this thread's next call.
    fn keep(self) {
        let _ = RECV_HEADERS.try_with(|h| {
            if let Ok(mut h) = h.try_borrow_mut() {
                *h = Some(self);
            }
        });
    }
}

impl Udp {
    /// Binds the first free slot of `base + 1..=base + slots`. `None` if every one is taken
    /// (or no UDP socket can be bound at all).
    pub(crate) fn start(base: u16, slots: u8) -> Option<Arc<Self>> {
        let (slot, own) = (1..=slots).find_map(|k| {
            let port = base.checked_add(u16::from(k))?;
            Sockets::bind(port).ok().map(|s| (k, s))
        })?;
        let rcvbuf = getsockopt(&own.v4, sockopt::RcvBuf).unwrap_or(0);
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).ok()?;
        let waker = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK).ok()?;
        epoll
            .add(&waker, EpollEvent::new(EpollFlags::EPOLLIN, WAKER))
            .ok()?;
        for fd in own.fds() {
            epoll.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 0)).ok()?;
        }
        let gso = gso_policy();
        let forwarder = Sockets::bind(base).ok().map(Arc::new);
        if let Some(f) = &forwarder {
            watch(&epoll, f);
        }
        let udp = Arc::new(Self {
            slot,
            base,
            own,
            forwarder: Mutex::new(forwarder),
            last_takeover_try: Mutex::new(StdInstant::now()),
            epoll,
            waker,
            gso: std::sync::atomic::AtomicBool::new(gso != GsoPolicy::Off),
            gso_links: gso == GsoPolicy::Everywhere,
            pacer: Pacer::new(rcvbuf),
            forged: std::sync::atomic::AtomicU64::new(0),
            mailboxes: OnceLock::new(),
            // On the process's board; private to each driver in unit tests, where several run
            // in one process (a board block is shared by name).
            counters: if cfg!(test) {
                NodeCounters::default()
            } else {
                NodeCounters::new(UDP_BLOCK)
            },
            // The own IPv4 socket: what softverbs peers on IPv4 send to.
            hot: AtomicU8::new(1),
            delivered: AtomicU8::new(0),
            since_scan: AtomicU32::new(0),
            scan_next: AtomicBool::new(true),
        });
        tracing::debug!(
            slot,
            port = udp.own.port,
            forwarder = udp.forwarder.lock().is_some(),
            "UDP driver up"
        );
        Some(udp)
    }

    /// This process's slot.
    pub(crate) fn slot(&self) -> u8 {
        self.slot
    }

    /// The standard RoCE port, above which the slots' ports are.
    pub(crate) fn base(&self) -> u16 {
        self.base
    }

    /// This process's own UDP port.
    pub(crate) fn port(&self) -> u16 {
        self.own.port
    }

    /// Forwarded datagrams dropped as forged (not from the standard port).
    pub(crate) fn forged_forwards(&self) -> u64 {
        self.forged.load(Ordering::Relaxed)
    }

    /// Forwards datagrams for other slots through the receivers' mailboxes in `shm` from now
    /// on (where a receiver has one) rather than by a second UDP send.
    pub(crate) fn forward_through(&self, shm: Arc<Shm>) {
        let _ = self.mailboxes.set(shm);
    }

    /// The driver's counters ([`UDP_BLOCK`]).
    #[cfg(test)]
    pub(crate) fn counters(&self) -> &NodeCounters {
        &self.counters
    }

    /// Whether this process holds the standard port.
    pub(crate) fn is_forwarder(&self) -> bool {
        self.forwarder.lock().is_some()
    }

    fn socket_for(&self, ip: &IpAddr) -> Option<&OwnedFd> {
        match ip {
            IpAddr::V4(_) => Some(&self.own.v4),
            IpAddr::V6(_) => self.own.v6.as_ref(),
        }
    }

    /// The UDP port packets for `dest_qpn` go to: its slot's, or the standard port for
    /// standard peers (slot 0) and multicast.
    pub(crate) fn dest_port(&self, dest_qpn: u32) -> u16 {
        let slot = slot_of(dest_qpn);
        if slot == 0 || dest_qpn == crate::fabric::MULTICAST_QPN {
            self.base
        } else {
            self.base.saturating_add(u16::from(slot))
        }
    }

    /// Sends RoCE packets (BTH..ICRC) from `src` to `dst` for destination QP `dest_qpn`,
    /// filling in their ICRCs. Runs of equal-sized packets go out as one GSO batch: one system
    /// call, segmented by the kernel (or by the NIC) into the standard datagrams a run of
    /// single sends would give. `scope` is the interface index for link-local IPv6. Returns
    /// how many were handed to the kernel.
    fn send_packets(
        &self,
        src: IpAddr,
        dst: IpAddr,
        scope: u32,
        dest_qpn: u32,
        packets: &mut [Vec<u8>],
    ) -> usize {
        let port = self.dest_port(dest_qpn);
        let src_sa = SocketAddr::new(src, self.own.port);
        let dst_sa = SocketAddr::new(dst, port);
        // The IPv4 ID is in the ICRC: a single datagram of our unconnected DF socket carries
        // ID 0, segment `i` of a GSO batch ID `i` (`icrc::compute_with_ident`). Only a packet
        // too short for an ICRC fails here; it goes out as it is, and its receiver drops it
        // as malformed.
        let fill = |packets: &mut [Vec<u8>], numbered: bool| {
            for (i, p) in packets.iter_mut().enumerate() {
                let ident = if numbered { i as u16 } else { 0 };
                let _ = icrc::fill_with_ident(src_sa, dst_sa, p, ident);
            }
        };
        if dst.is_loopback() {
            let bytes = packets.iter().map(Vec::len).sum();
            self.pacer.before_send(dst.is_ipv6(), port, bytes);
        }
        let Some(fd) = self.socket_for(&dst) else {
            return 0;
        };
        if !self.gso.load(Ordering::Relaxed) || !(self.gso_links || dst.is_loopback()) {
            fill(packets, false);
            return self.send_each(fd, src, dst_sa, scope, packets);
        }
        let mut sent = 0;
        // Packets from `singles` up to `at` wait to go out one datagram each.
        let mut singles = 0;
        let mut at = 0;
        while at < packets.len() {
            let rest = &packets[at..];
            let seg = rest[0].len();
            let mut n = 1;
            let mut bytes = seg;
            // A batch: equal sizes, except that the last may be shorter.
            while n < rest.len()
                && n < GSO_MAX_SEGMENTS
                && bytes + rest[n].len() <= GSO_MAX_BYTES
                && rest[n - 1].len() == seg
                && rest[n].len() <= seg
            {
                bytes += rest[n].len();
                n += 1;
            }
            if n > 1 && self.gso.load(Ordering::Relaxed) {
                sent += self.send_each(fd, src, dst_sa, scope, &packets[singles..at]);
                fill(&mut packets[at..at + n], true);
                match self.send_on(fd, src, dst_sa, scope, &packets[at..at + n], Some(seg as u16)) {
                    Ok(()) => {
                        sent += n;
                        at += n;
                        singles = at;
                        continue;
                    }
                    // The kernel or the route does not do GSO (no UDP_SEGMENT, no checksum
                    // offload on the device): one datagram per packet from now on.
                    Err(Errno::EIO | Errno::EINVAL | Errno::ENOPROTOOPT | Errno::EOPNOTSUPP) => {
                        tracing::info!(%dst, "no UDP GSO here: one datagram per packet");
                        self.gso.store(false, Ordering::Relaxed);
                    }
                    // Anything else (a full socket buffer, say) is this batch's: it goes out
                    // one datagram each, as a lone send would.
                    Err(_) => {}
                }
                singles = at;
            }
            fill(&mut packets[at..at + n], false);
            at += n;
        }
        sent + self.send_each(fd, src, dst_sa, scope, &packets[singles..])
    }

    /// Sends each packet as its own datagram, up to `MMSG_MAX` in one system call
    /// (`sendmmsg`). Returns how many the kernel took; a packet it refuses is skipped (and
    /// logged), as a send of that packet alone would drop it.
    fn send_each(
        &self,
        fd: &OwnedFd,
        src: IpAddr,
        dst: SocketAddr,
        scope: u32,
        packets: &[Vec<u8>],
    ) -> usize {
        let mut sent = 0;
        let mut rest = packets;
        while let Some(first) = rest.first() {
            if rest.len() > 1 {
                let chunk = &rest[..rest.len().min(MMSG_MAX)];
                if let Ok(k @ 1..) = send_mmsg(fd, src, dst, scope, chunk) {
                    sent += k;
                    rest = &rest[k..];
                    continue;
                }
            }
            // Alone, so that a failure is logged and costs this packet only.
            sent += usize::from(
                self.send_on(fd, src, dst, scope, std::slice::from_ref(first), None)
                    .is_ok(),
            );
            rest = &rest[1..];
        }
        sent
    }

    fn send_on<P: AsRef<[u8]>>(
        &self,
        fd: &OwnedFd,
        src: IpAddr,
        dst: SocketAddr,
        scope: u32,
        parts: &[P],
        gso: Option<u16>,
    ) -> nix::Result<()> {
        // On the stack: this runs for every datagram or GSO batch sent.
        let mut slices = [IoSlice::new(&[]); GSO_MAX_SEGMENTS];
        if parts.len() > slices.len() {
            return Err(Errno::EMSGSIZE);
        }
        for (slot, p) in slices.iter_mut().zip(parts) {
            *slot = IoSlice::new(p.as_ref());
        }
        let iov = &slices[..parts.len()];
        let gso_size = gso.unwrap_or(0);
        let gso_cmsg = ControlMessage::UdpGsoSegments(&gso_size);
        let r = match (src, dst) {
            (IpAddr::V4(s), SocketAddr::V4(d)) => {
                let info = pktinfo_v4(s);
                let info_cmsg = ControlMessage::Ipv4PacketInfo(&info);
                let cmsgs: &[ControlMessage<'_>] = if gso.is_some() {
                    &[info_cmsg, gso_cmsg]
                } else {
                    &[info_cmsg]
                };
                sendmsg(
                    fd.as_raw_fd(),
                    iov,
                    cmsgs,
                    MsgFlags::empty(),
                    Some(&SockaddrIn::from(d)),
                )
            }
            (IpAddr::V6(s), SocketAddr::V6(d)) => {
                let (d, info) = scoped_v6(s, d, scope);
                let info_cmsg = ControlMessage::Ipv6PacketInfo(&info);
                let cmsgs: &[ControlMessage<'_>] = if gso.is_some() {
                    &[info_cmsg, gso_cmsg]
                } else {
                    &[info_cmsg]
                };
                sendmsg(
                    fd.as_raw_fd(),
                    iov,
                    cmsgs,
                    MsgFlags::empty(),
                    Some(&SockaddrIn6::from(d)),
                )
            }
            _ => return Err(Errno::EAFNOSUPPORT),
        };
        r.map(drop)
            .inspect_err(|e| tracing::debug!(%dst, error = %e, "UDP send failed"))
    }

    /// Reads the datagrams waiting on every socket into `batch`, without blocking.
    ///
    /// A busy poller calls this all the time, so the common case costs one system call: the
    /// sockets that delivered lately are read directly; every socket is looked at (one
    /// `poll` over all, then a read of the ready ones) every [`SCAN_EVERY`] calls, when none
    /// is hot, and after `wait` saw one readable.
    fn receive_into(&self, batch: &mut PacketBatch) -> usize {
        let before = batch.len();
        let fwd = self.forwarder.lock().clone();
        let mut fds: [Option<(&OwnedFd, bool, &AtomicU32)>; 4] = [None; 4];
        for (i, (f, o)) in self.own.fds_with_overflows().enumerate() {
            fds[i] = Some((f, false, o));
        }
        if let Some(f) = fwd.as_ref() {
            for (i, (f, o)) in f.fds_with_overflows().enumerate() {
                fds[2 + i] = Some((f, true, o));
            }
        }
        let hot = self.hot.load(Ordering::Relaxed);
        let scan = self.scan_next.swap(false, Ordering::Relaxed)
            || hot == 0
            || self.since_scan.fetch_add(1, Ordering::Relaxed) + 1 >= SCAN_EVERY;
        let mut ready = [false; 4];
        if scan {
            self.since_scan.store(0, Ordering::Relaxed);
            // Sockets that delivered since the last scan stay hot; the others cool down.
            self.hot
                .store(self.delivered.swap(0, Ordering::Relaxed) | 1, Ordering::Relaxed);
            // One readiness check over every socket costs less than a failing read on each.
            let mut pfds: Vec<PollFd<'_>> = fds
                .iter()
                .flatten()
                .map(|(f, _, _)| PollFd::new(f.as_fd(), PollFlags::POLLIN))
                .collect();
            if !matches!(poll(&mut pfds, PollTimeout::ZERO), Ok(n) if n > 0) {
                return 0;
            }
            let mut it = pfds.iter();
            for (i, fd) in fds.iter().enumerate() {
                if fd.is_some() {
                    ready[i] = it.next().and_then(|p| p.revents()).is_some_and(|r| !r.is_empty());
                }
            }
        } else {
            for (i, r) in ready.iter_mut().enumerate() {
                *r = hot & (1 << i) != 0;
            }
        }
        for (i, slot) in fds.iter().enumerate() {
            let Some((fd, is_forwarder, overflows)) = *slot else {
                continue;
            };
            if !ready[i] {
                continue;
            }
            let mut read = 0;
            // Bounded (256 datagrams), so one busy socket does not starve the others and a
            // batch stays small; what is left is read on the next call (the socket stays
            // readable). A short read means the socket is empty.
            for _ in 0..256 / RECV_MMSG {
                if batch.bytes() >= RX_BATCH_BYTES {
                    break;
                }
                let n = self.recv_many(fd, is_forwarder, overflows, batch);
                read += n;
                if n < RECV_MMSG {
                    break;
                }
            }
            if read > 0 {
                self.delivered.fetch_or(1 << i, Ordering::Relaxed);
                self.hot.fetch_or(1 << i, Ordering::Relaxed);
            }
        }
        batch.len() - before
    }

    /// Reads up to `RECV_MMSG` datagrams (each possibly a GRO batch) in one `recvmmsg` call,
    /// straight into `batch`. Returns how many were read; 0 when the socket is empty.
    ///
    /// `overflows` is the socket's overflow count as last reported; what it grew by is added
    /// to `rx_socket_drops`.
    fn recv_many(
        &self,
        fd: &OwnedFd,
        is_forwarder: bool,
        overflows: &AtomicU32,
        batch: &mut PacketBatch,
    ) -> usize {
        let mut got: [Option<Received>; RECV_MMSG] = [None; RECV_MMSG];
        let mut overflow = None;
        {
            let spare = &mut batch.spare(RECV_MMSG * MAX_DATAGRAM)[..RECV_MMSG * MAX_DATAGRAM];
            let mut chunks = spare.chunks_mut(MAX_DATAGRAM);
            let mut iovs: [[IoSliceMut<'_>; 1]; RECV_MMSG] =
                std::array::from_fn(|_| [IoSliceMut::new(chunks.next().expect("one chunk per datagram"))]);
            let mut headers = RecvHeaders::take();
            let msgs = match recvmmsg(
                fd.as_raw_fd(),
                &mut headers.0,
                iovs.iter_mut(),
                MsgFlags::MSG_DONTWAIT,
                None,
            ) {
                Ok(m) => m,
                Err(e) => {
                    if e != Errno::EAGAIN {
                        tracing::debug!(error = %e, "UDP receive failed");
                    }
                    // A failed call received nothing, so the kernel wrote nothing back.
                    headers.keep();
                    return 0;
                }
            };
            for (slot, msg) in got.iter_mut().zip(msgs) {
                let len = msg.bytes;
                let src = msg.address.and_then(|a| {
                    a.as_sockaddr_in()
                        .map(|s| SocketAddr::from(SocketAddrV4::from(*s)))
                        .or_else(|| {
                            a.as_sockaddr_in6()
                                .map(|s| SocketAddr::from(SocketAddrV6::from(*s)))
                        })
                });
                let mut dst_ip = None;
                let mut segment = len;
                if let Ok(cmsgs) = msg.cmsgs() {
                    for c in cmsgs {
                        match c {
                            ControlMessageOwned::UdpGroSegments(size) if size > 0 => segment = size as usize,
                            ControlMessageOwned::Ipv4PacketInfo(i) => {
                                dst_ip = Some(IpAddr::V4(Ipv4Addr::from(i.ipi_addr.s_addr.to_ne_bytes())));
                            }
                            ControlMessageOwned::Ipv6PacketInfo(i) => {
                                dst_ip = Some(IpAddr::V6(Ipv6Addr::from(i.ipi6_addr.s6_addr)));
                            }
                            ControlMessageOwned::RxqOvfl(n) => overflow = Some(n),
                            _ => {}
                        }
                    }
                }
                *slot = Some(Received {
                    len,
                    src,
                    dst_ip,
                    segment: segment.max(1),
                });
            }
        }
        if let Some(n) = overflow {
            self.count_overflows(overflows, n);
        }
        // Datagram i landed at i * MAX_DATAGRAM. Small ones move down behind the previous one,
        // so the batch stays dense; large ones (GRO batches, full-MTU packets) stay where they
        // are rather than be copied again.
        let mut read = 0;
        let mut dense = 0;
        for (i, info) in got.iter().enumerate() {
            let Some(Received {
                len,
                src,
                dst_ip,
                segment,
            }) = *info
            else {
                break;
            };
            read += 1;
            let (Some(src), Some(dst_ip)) = (src, dst_ip) else {
                continue;
            };
            let from = i * MAX_DATAGRAM;
            let start = if len <= COMPACT_MAX && from != dense {
                batch.spare(0).copy_within(from..from + len, dense);
                dense
            } else {
                from
            };
            // Once at least: an empty datagram is a packet too (a malformed one, which must be
            // counted as such rather than vanish here).
            let mut at = start;
            let mut index = 0u16;
            loop {
                let end = (at + segment).min(start + len);
                let kept = self.accept(src, dst_ip, is_forwarder, &batch.spare(0)[at..end], index);
                if let Some((skip, meta, icrc, ports)) = kept {
                    batch.add(at + skip..end, meta, icrc, ports);
                }
                index = index.wrapping_add(1);
                at = end;
                if at >= start + len {
                    break;
                }
            }
            dense = start + len;
        }
        batch.commit(dense);
        read
    }

    /// Adds to `rx_socket_drops` what a socket's cumulative overflow count `now` grew by since
    /// it was last reported (`last`).
    fn count_overflows(&self, last: &AtomicU32, now: u32) {
        let was = last.swap(now, Ordering::Relaxed);
        let grew = now.wrapping_sub(was);
        // The count only grows; a smaller value is an older report read by another thread.
        if grew != 0 && grew < u32::MAX / 2 {
            self.counters
                .rx_socket_drops()
                .fetch_add(u64::from(grew), Ordering::Relaxed);
        } else if grew != 0 {
            last.fetch_max(was, Ordering::Relaxed);
        }
    }

    /// Handles one received datagram, the `index`-th of its GRO batch: unwraps forwarded ones,
    /// forwards those of other slots. Returns what to keep: how many leading bytes to skip (a
    /// forwarding header), what the network told about the packet, its ICRC verdict and its
    /// UDP ports.
    fn accept(
        &self,
        src: SocketAddr,
        dst_ip: IpAddr,
        is_forwarder: bool,
        bytes: &[u8],
        index: u16,
    ) -> Option<(usize, RxMeta, IcrcCheck, (u16, u16))> {
        let port = if is_forwarder { self.base } else { self.own.port };

        if let Some(fw) = ForwardHeader::parse(bytes) {
            // Only the holder of the standard port may forward: it sends from that port, from
            // the local address the packet reached to the same address. No other local socket
            // can use the port while it is held, and Linux drops packets from off the host
            // that claim a local source address, so anything else is forged (it would let its
            // sender pose as any peer) and is dropped.
            if is_forwarder || src.port() != self.base || src.ip() != dst_ip {
                self.forged.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%src, %dst_ip, "dropped a forwarded datagram not from the RoCE port");
                return None;
            }
            // Forwarded to us by the holder of the standard port: restore the real addresses.
            let orig_dst = SocketAddr::new(fw.dst_ip, self.base);
            let (meta, icrc) = classify(fw.src, orig_dst, &bytes[FORWARD_HEADER..], 0);
            return Some((FORWARD_HEADER, meta, icrc, (fw.src.port(), self.base)));
        }
        if is_forwarder {
            let qpn = softverbs_wire::bth::peek_dest_qpn(bytes).unwrap_or(0);
            let mut slot = slot_of(qpn);
            if qpn == 1 {
                // QP1 of this host: the connection manager tells which process the MAD is for.
                slot = crate::cm::forward_slot(self.base, bytes).unwrap_or(0);
            }
            if slot != 0 && slot != self.slot && qpn != crate::fabric::MULTICAST_QPN {
                self.forward(src, dst_ip, slot, bytes, index);
                return None;
            }
        }
        let (meta, icrc) = classify(src, SocketAddr::new(dst_ip, port), bytes, index);
        Some((0, meta, icrc, (src.port(), port)))
    }

    /// Hands a datagram that reached the standard port to the process of `slot`: through its
    /// mailbox when it has one, which waits for room rather than lose the packet (a second
    /// UDP hop would drop it silently whenever the receiver's socket buffer is full, while the
    /// peer sees only a hole in its PSNs); over UDP otherwise.
    /// `index`: the datagram's place in its GRO batch (see [`classify`]).
    fn forward(&self, src: SocketAddr, dst_ip: IpAddr, slot: u8, bytes: &[u8], index: u16) {
        let port = self.base.saturating_add(u16::from(slot));
        let c = &self.counters;
        if let Some(shm) = self.mailboxes.get() {
            // Checked here, as the owner would have checked it had it read the datagram.
            let (meta, icrc) = classify(src, SocketAddr::new(dst_ip, self.base), bytes, index);
            if let Some(went) = shm.forward(port, &meta, (src.port(), self.base), icrc, bytes) {
                let counter = if went {
                    c.forwarded_shm()
                } else {
                    c.forward_drops()
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if went {
                    c.forwarded().fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
        }
        let header = ForwardHeader { src, dst_ip }.emit();
        let to = SocketAddr::new(dst_ip, port);
        // From the standard port, which is how the receiver tells a forward from a forgery.
        let Some(fwd) = self.forwarder.lock().clone() else {
            return;
        };
        let fd = match dst_ip {
            IpAddr::V4(_) => Some(&fwd.v4),
            IpAddr::V6(_) => fwd.v6.as_ref(),
        };
        let sent = fd.is_some_and(|fd| self.send_on(fd, dst_ip, to, 0, &[&header, bytes], None).is_ok());
        let counter = if sent { c.forwarded() } else { c.forward_drops() };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes the standard port over when its holder has gone (checked at most once a second).
    fn maybe_take_over(&self) {
        let mut last = self.last_takeover_try.lock();
        if last.elapsed() < Duration::from_secs(1) {
            return;
        }
        *last = StdInstant::now();
        let mut fwd = self.forwarder.lock();
        if fwd.is_none() {
            *fwd = Sockets::bind(self.base).ok().map(Arc::new);
            if let Some(f) = fwd.as_ref() {
                watch(&self.epoll, f);
                tracing::info!(port = self.base, "took over the standard RoCE port");
            }
        }
    }
}

/// The IPv4 source address of a datagram, as a control message sets it.
fn pktinfo_v4(src: Ipv4Addr) -> libc::in_pktinfo {
    libc::in_pktinfo {
        ipi_ifindex: 0,
        ipi_spec_dst: libc::in_addr {
            s_addr: u32::from_ne_bytes(src.octets()),
        },
        ipi_addr: libc::in_addr { s_addr: 0 },
    }
}

/// The IPv6 destination with its scope (for link-local addresses) and the source address
/// control message.
fn scoped_v6(src: Ipv6Addr, dst: SocketAddrV6, scope: u32) -> (SocketAddrV6, libc::in6_pktinfo) {
    let link_local = (dst.ip().segments()[0] & 0xffc0) == 0xfe80;
    let scope = if link_local { scope } else { 0 };
    let info = libc::in6_pktinfo {
        ipi6_addr: libc::in6_addr {
            s6_addr: src.octets(),
        },
        ipi6_ifindex: scope,
    };
    (SocketAddrV6::new(*dst.ip(), dst.port(), 0, scope), info)
}

/// Sends each packet as a datagram from `src` to `dst` in one `sendmmsg` call; returns how
/// many the kernel took (it stops at the first it refuses).
fn send_mmsg(
    fd: &OwnedFd,
    src: IpAddr,
    dst: SocketAddr,
    scope: u32,
    packets: &[Vec<u8>],
) -> nix::Result<usize> {
    let iovs: Vec<[IoSlice<'_>; 1]> = packets.iter().map(|p| [IoSlice::new(p)]).collect();
    match (src, dst) {
        (IpAddr::V4(s), SocketAddr::V4(d)) => {
            let info = pktinfo_v4(s);
            let cmsgs = [ControlMessage::Ipv4PacketInfo(&info)];
            let to = SockaddrStorage::from(SocketAddr::V4(d));
            send_mmsg_to(fd, &iovs, to, &cmsgs, nix::cmsg_space!(libc::in_pktinfo))
        }
        (IpAddr::V6(s), SocketAddr::V6(d)) => {
            let (d, info) = scoped_v6(s, d, scope);
            let cmsgs = [ControlMessage::Ipv6PacketInfo(&info)];
            let to = SockaddrStorage::from(SocketAddr::V6(d));
            send_mmsg_to(fd, &iovs, to, &cmsgs, nix::cmsg_space!(libc::in6_pktinfo))
        }
        _ => Err(Errno::EAFNOSUPPORT),
    }
}

/// `sendmmsg` of `iovs`, each to `to` with the control messages `cmsgs`, whose encoded size
/// must be exactly `space`'s capacity (the kernel parses the whole control area).
fn send_mmsg_to<'a>(
    fd: &OwnedFd,
    iovs: &'a [[IoSlice<'a>; 1]],
    to: SockaddrStorage,
    cmsgs: &'a [ControlMessage<'a>],
    space: Vec<u8>,
) -> nix::Result<usize> {
    let addrs = vec![Some(to); iovs.len()];
    // The results are counted by reading them back, which reads address slots the kernel
    // does not write on send: with a union address type, that is sound.
    let mut headers = MultiHeaders::<SockaddrStorage>::preallocate(iovs.len(), Some(space));
    let results = sendmmsg(
        fd.as_raw_fd(),
        &mut headers,
        iovs,
        addrs,
        cmsgs,
        MsgFlags::empty(),
    )?;
    Ok(results.count())
}

/// What `recvmmsg` said about one datagram.
#[derive(Debug, Clone, Copy)]
struct Received {
    len: usize,
    src: Option<SocketAddr>,
    /// The address it reached.
    dst_ip: Option<IpAddr>,
    /// The GRO segment size (the length if it is one datagram).
    segment: usize,
}

/// The epoll token of the waker (sockets use 0).
const WAKER: u64 = 1;

/// Adds the standard port's sockets to the readiness set.
fn watch(epoll: &Epoll, s: &Sockets) {
    for fd in s.fds() {
        if let Err(e) = epoll.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 0)) {
            tracing::warn!(error = %e, "the standard port's socket cannot be watched");
        }
    }
}

impl Driver for Udp {
    fn send(&self, route: &Route, packets: &mut [Vec<u8>]) -> usize {
        self.send_packets(
            route.sgid.to_ip(),
            route.dgid.to_ip(),
            route.ifindex,
            route.dest_qpn,
            packets,
        )
    }

    fn recv(&self, batch: &mut PacketBatch) -> usize {
        self.receive_into(batch)
    }

    fn wait(&self, timeout: Duration) -> bool {
        self.tick();
        let mut events = [EpollEvent::empty(); 8];
        let ms = PollTimeout::try_from(timeout.as_millis().min(60_000) as i32).unwrap_or(PollTimeout::MAX);
        let n = self.epoll.wait(&mut events, ms).unwrap_or(0);
        let mut readable = false;
        for e in &events[..n] {
            if e.data() == WAKER {
                let _ = self.waker.read();
            } else {
                readable = true;
            }
        }
        if readable {
            // The readable socket may not be a hot one.
            self.scan_next.store(true, Ordering::Relaxed);
        }
        readable
    }

    fn wake(&self) {
        let _ = self.waker.write(1);
    }

    fn tick(&self) {
        self.maybe_take_over();
    }

    fn readiness(&self) -> Option<BorrowedFd<'_>> {
        Some(self.epoll.0.as_fd())
    }
}

/// What a received packet's addresses tell the engine, and its ICRC verdict. `index` is the
/// packet's place in the GRO batch it came in: a softverbs sender's GSO batch arrives whole on
/// a socket with `UDP_GRO`, its segment `i` with IPv4 ID `i` (ID 0 for a lone datagram).
fn classify(src: SocketAddr, dst: SocketAddr, bytes: &[u8], index: u16) -> (RxMeta, IcrcCheck) {
    // A later packet of a GRO batch is most likely a GSO segment: its place first, so that a
    // softverbs sender's packets cost one CRC each.
    let segment = index != 0 && src.ip().to_canonical().is_ipv4();
    let verified = (segment && icrc::compute_with_ident(src, dst, bytes, index).ok() == icrc::read(bytes))
        || icrc::verify(src, dst, bytes);
    let icrc = match (verified, src.ip()) {
        (true, _) => IcrcCheck::Ok,
        // Only the sender knows the IPv4 ID it used; see the module documentation.
        (false, IpAddr::V4(_)) => IcrcCheck::Unverified,
        (false, IpAddr::V6(_)) => IcrcCheck::Bad,
    };
    let meta = RxMeta {
        sgid: Gid::from_ip(src.ip()),
        dgid: Gid::from_ip(dst.ip()),
        traffic_class: 0,
        hop_limit: 64,
    };
    (meta, icrc)
}

/// The wrapping the holder of the standard port puts in front of a datagram it forwards to
/// another slot: magic, original source address and port, and the address it reached (IPv4
/// as IPv4-mapped IPv6), so that the receiver checks the ICRC and builds GRHs as if the peer
/// had sent to it directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ForwardHeader {
    src: SocketAddr,
    dst_ip: IpAddr,
}

impl ForwardHeader {
    /// The header at the start of `bytes`, if it carries one.
    fn parse(bytes: &[u8]) -> Option<Self> {
        let h: &[u8; FORWARD_HEADER] = bytes.get(..FORWARD_HEADER)?.try_into().ok()?;
        let (magic, rest) = h.split_at(4);
        if magic != FORWARD_MAGIC {
            return None;
        }
        let (src_ip, rest) = rest.split_at(16);
        let (src_port, dst_ip) = rest.split_at(2);
        let ip = |b: &[u8]| {
            let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(b).expect("16 bytes"));
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        };
        let port = u16::from_be_bytes(src_port.try_into().expect("2 bytes"));
        Some(Self {
            src: SocketAddr::new(ip(src_ip), port),
            dst_ip: ip(dst_ip),
        })
    }

    fn emit(&self) -> [u8; FORWARD_HEADER] {
        let mapped = |ip: IpAddr| match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        let mut h = [0u8; FORWARD_HEADER];
        let (magic, rest) = h.split_at_mut(4);
        magic.copy_from_slice(&FORWARD_MAGIC);
        let (src_ip, rest) = rest.split_at_mut(16);
        src_ip.copy_from_slice(&mapped(self.src.ip()));
        let (src_port, dst_ip) = rest.split_at_mut(2);
        src_port.copy_from_slice(&self.src.port().to_be_bytes());
        dst_ip.copy_from_slice(&mapped(self.dst_ip));
        h
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::net::UdpSocket;

    /// A base port whose first slots are free now (not the standard port, which other
    /// processes on the host may hold).
    pub(crate) fn free_base_port() -> u16 {
        let free =
            |port: u16| UdpSocket::bind(("0.0.0.0", port)).is_ok() && UdpSocket::bind(("::", port)).is_ok();
        // Each call of this process starts elsewhere: tests running at once must not pick the
        // same range before either binds it.
        static CALLS: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
        let call = CALLS.fetch_add(1, Ordering::Relaxed);
        let seed = (std::process::id() as u16).wrapping_add(call.wrapping_mul(4001));
        (0..1000u16)
            .map(|i| 20_000 + (seed.wrapping_add(i.wrapping_mul(89)) % 40_000))
            .find(|&base| (base..base + 4).all(free))
            .expect("a free range of UDP ports")
    }

    /// A BTH-sized packet for `qpn` with a recognisable payload.
    fn packet(qpn: u32, tag: u8) -> Vec<u8> {
        use softverbs_wire::{BthPacket, BthRepr, Opcode, Psn};
        let mut p = vec![0u8; 12 + 4 + 4];
        let bth = BthRepr::new(Opcode::UdSendOnly, qpn, Psn::new(0));
        bth.emit(&mut BthPacket::new_unchecked(&mut p[..]));
        p[16] = tag;
        p
    }

    /// Runs the holder's receive side (which keeps nothing: it forwards) until `to` gets a
    /// datagram or `wait` passes.
    fn forward_within(holder: &Udp, to: &Udp, wait: Duration) -> Vec<(Vec<u8>, RxMeta)> {
        let deadline = StdInstant::now() + wait;
        let mut got = Vec::new();
        let mut batch = PacketBatch::default();
        while got.is_empty() && StdInstant::now() < deadline {
            if holder.wait(Duration::from_millis(20)) {
                assert_eq!(holder.recv(&mut batch), 0, "forwarded, not kept");
            }
            if to.wait(Duration::from_millis(20)) {
                to.recv(&mut batch);
                got.extend(batch.iter().map(|(d, p)| (d.to_vec(), p.meta)));
                batch.clear();
            }
        }
        got
    }

    #[test]
    fn forwards_only_from_the_standard_port_are_accepted() {
        let base = free_base_port();
        let holder = Udp::start(base, 255).expect("slot 1");
        let other = Udp::start(base, 255).expect("slot 2");
        assert!(holder.is_forwarder() && !other.is_forwarder());
        let dest_qpn = (u32::from(other.slot()) << 16) | 0x11;
        let peer = UdpSocket::bind("127.0.0.1:0").unwrap();

        // A standard peer's packet reaches the holder, which forwards it to the slot's owner
        // with the peer's address restored.
        peer.send_to(&packet(dest_qpn, 1), ("127.0.0.1", base)).unwrap();
        let got = forward_within(&holder, &other, Duration::from_secs(10));
        assert_eq!(got.len(), 1, "the forwarded packet arrives");
        assert_eq!(got[0].0, packet(dest_qpn, 1));
        assert_eq!(got[0].1.sgid, Gid::from_ip(peer.local_addr().unwrap().ip()));
        assert_eq!(other.forged_forwards(), 0);

        // The same wrapping from an ordinary socket, claiming another source, is dropped.
        let mut forged = Vec::new();
        forged.extend_from_slice(&FORWARD_MAGIC);
        forged.extend_from_slice(&Ipv4Addr::new(10, 9, 8, 7).to_ipv6_mapped().octets());
        forged.extend_from_slice(&base.to_be_bytes());
        forged.extend_from_slice(&Ipv4Addr::LOCALHOST.to_ipv6_mapped().octets());
        forged.extend_from_slice(&packet(dest_qpn, 2));
        peer.send_to(&forged, ("127.0.0.1", other.port())).unwrap();
        // Sent to the holder's standard port too: a forwarding header is never valid there.
        peer.send_to(&forged, ("127.0.0.1", base)).unwrap();
        let deadline = StdInstant::now() + Duration::from_secs(10);
        while other.forged_forwards() + holder.forged_forwards() < 2 && StdInstant::now() < deadline {
            for u in [&holder, &other] {
                if u.wait(Duration::from_millis(50)) {
                    let mut batch = PacketBatch::default();
                    assert_eq!(u.recv(&mut batch), 0, "a forged forward was delivered: {batch:?}");
                }
            }
        }
        assert_eq!(other.forged_forwards(), 1, "dropped and counted at the slot port");
        assert_eq!(
            holder.forged_forwards(),
            1,
            "dropped and counted at the standard port"
        );
    }

    #[test]
    fn forward_header_round_trips() {
        for (src, dst) in [
            ("192.0.2.7:49152", "192.0.2.1"),
            ("[2001:db8::7]:4791", "2001:db8::1"),
        ] {
            let h = ForwardHeader {
                src: src.parse().unwrap(),
                dst_ip: dst.parse().unwrap(),
            };
            let mut bytes = h.emit().to_vec();
            bytes.extend_from_slice(&packet(0x11, 1));
            assert_eq!(ForwardHeader::parse(&bytes), Some(h));
            assert_eq!(
                ForwardHeader::parse(&bytes[..FORWARD_HEADER - 1]),
                None,
                "too short"
            );
        }
        assert_eq!(ForwardHeader::parse(&[0u8; 64]), None, "no magic");
    }

    #[test]
    fn wake_ends_a_wait_early() {
        let udp = Udp::start(free_base_port(), 255).expect("a slot");
        udp.wake();
        let start = StdInstant::now();
        assert!(!udp.wait(Duration::from_secs(20)), "woken, nothing to read");
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(udp.readiness().is_some());
    }

    /// Receives `n` datagrams on a plain socket, or fails after a bounded wait.
    fn receive_plain(sock: &UdpSocket, n: usize) -> Vec<Vec<u8>> {
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 2048];
        (0..n)
            .map(|i| {
                let len = sock
                    .recv(&mut buf)
                    .unwrap_or_else(|e| panic!("datagram {i} of {n}: {e}"));
                buf[..len].to_vec()
            })
            .collect()
    }

    /// Packets for `qpn` of the given sizes, each with its index in the payload.
    fn sized_packets(qpn: u32, sizes: &[usize]) -> Vec<Vec<u8>> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let mut p = packet(qpn, i as u8);
                p.resize(len, i as u8);
                p
            })
            .collect()
    }

    #[test]
    fn runs_leave_as_one_datagram_per_packet_in_order() {
        let base = free_base_port();
        let udp = Udp::start(base, 255).expect("a slot");
        // A plain socket on the port of slot 3 stands in for a peer process.
        let peer = UdpSocket::bind(("127.0.0.1", base + 3)).unwrap();
        let qpn = (3 << 16) | 0x11;
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let sizes = [100, 100, 100, 50, 70, 30, 30, 200, 20];
        // With GSO, runs of equal sizes (the last may be shorter) go out segmented, and each
        // packet's ICRC covers the IPv4 ID the kernel gives its segment; the rest go one by
        // one, with ID 0. Without GSO, the whole run in sendmmsg calls.
        let gso_idents = [0, 1, 2, 3, 0, 1, 0, 0, 1];
        for gso in [true, false] {
            udp.gso.store(gso, Ordering::Relaxed);
            let mut packets = sized_packets(qpn, &sizes);
            assert_eq!(udp.send_packets(lo, lo, 0, qpn, &mut packets), sizes.len());
            let got = receive_plain(&peer, sizes.len());
            assert_eq!(got, packets, "gso {gso}: every packet its own datagram, in order");
            let src = SocketAddr::new(lo, udp.port());
            let dst = SocketAddr::new(lo, base + 3);
            for (i, p) in got.iter().enumerate() {
                let ident = if gso { gso_idents[i] } else { 0 };
                assert_eq!(
                    icrc::compute_with_ident(src, dst, p, ident).ok(),
                    icrc::read(p),
                    "gso {gso}: packet {i}'s ICRC covers IPv4 ID {ident}"
                );
            }
        }
        // More than one sendmmsg call's worth.
        let many: Vec<usize> = (0..MMSG_MAX * 2 + 5).map(|i| 40 + i % 7).collect();
        let mut packets = sized_packets(qpn, &many);
        assert_eq!(udp.send_packets(lo, lo, 0, qpn, &mut packets), many.len());
        assert_eq!(receive_plain(&peer, many.len()), packets);
    }

    #[test]
    fn a_socket_that_was_quiet_is_still_read() {
        let udp = Udp::start(free_base_port(), 255).expect("a slot");
        if udp.own.v6.is_none() {
            return; // no IPv6 on this host: one socket, always read
        }
        let qpn = (u32::from(udp.slot()) << 16) | 0x11;
        let v4 = UdpSocket::bind("127.0.0.1:0").unwrap();
        let v6 = UdpSocket::bind("[::1]:0").unwrap();
        let mut batch = PacketBatch::default();
        let receive = |batch: &mut PacketBatch, calls: u32| -> usize {
            // Busy polling: no `wait`, so no hint which socket is readable.
            (0..calls).map(|_| udp.recv(batch)).sum()
        };
        // The IPv4 socket delivers, so it is read directly from then on.
        v4.send_to(&packet(qpn, 1), ("127.0.0.1", udp.port())).unwrap();
        let deadline = StdInstant::now() + Duration::from_secs(10);
        while batch.is_empty() && StdInstant::now() < deadline {
            receive(&mut batch, 1);
        }
        assert_eq!(batch.len(), 1);
        assert_eq!(udp.hot.load(Ordering::Relaxed) & 0b10, 0, "IPv6 was quiet");
        // A datagram on the quiet IPv6 socket is found by a full scan within SCAN_EVERY calls.
        v6.send_to(&packet(qpn, 2), ("::1", udp.port())).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let got = receive(&mut batch, SCAN_EVERY + 1);
        assert_eq!(got, 1, "read within a scan period");
        assert_eq!(batch.iter().last().map(|(d, _)| d.to_vec()), Some(packet(qpn, 2)));
        assert_ne!(udp.hot.load(Ordering::Relaxed) & 0b10, 0, "and now hot");
        // After a wait saw a socket readable, the next receive looks at every socket.
        batch.clear();
        udp.hot.store(1, Ordering::Relaxed);
        udp.delivered.store(0, Ordering::Relaxed);
        v6.send_to(&packet(qpn, 3), ("::1", udp.port())).unwrap();
        assert!(udp.wait(Duration::from_secs(10)), "readable");
        udp.since_scan.store(0, Ordering::Relaxed);
        assert_eq!(receive(&mut batch, 1), 1, "the first receive after the wait");
    }

    #[test]
    fn headers_kept_from_empty_looks_still_carry_every_address() {
        let udp = Udp::start(free_base_port(), 255).expect("a slot");
        let qpn = (u32::from(udp.slot()) << 16) | 0x11;
        let mut peers = vec![(
            UdpSocket::bind("127.0.0.1:0").unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
        )];
        if udp.own.v6.is_some() {
            peers.push((
                UdpSocket::bind("[::1]:0").unwrap(),
                IpAddr::V6(Ipv6Addr::LOCALHOST),
            ));
        }
        let mut batch = PacketBatch::default();
        for round in 0..4u8 {
            // Looks at empty sockets, which keep this thread's headers for the next call.
            for _ in 0..3 {
                assert_eq!(udp.recv(&mut batch), 0);
            }
            assert!(
                RECV_HEADERS.with(|h| h.borrow().is_some()),
                "an empty look keeps its headers"
            );
            for (peer, ip) in &peers {
                peer.send_to(&packet(qpn, round), (*ip, udp.port())).unwrap();
            }
            let deadline = StdInstant::now() + Duration::from_secs(10);
            while batch.len() < peers.len() && StdInstant::now() < deadline {
                if udp.wait(Duration::from_millis(50)) {
                    udp.recv(&mut batch);
                }
            }
            assert_eq!(batch.len(), peers.len(), "round {round}");
            for (peer, ip) in &peers {
                let gid = Gid::from_ip(*ip);
                let port = peer.local_addr().unwrap().port();
                assert!(
                    batch.iter().any(|(data, d)| data == packet(qpn, round).as_slice()
                        && d.meta.sgid == gid
                        && d.meta.dgid == gid
                        && d.ports == (port, udp.port())),
                    "round {round}: the datagram from {ip} with its source, destination and ports"
                );
            }
            batch.clear();
        }
    }

    #[test]
    fn an_empty_datagram_is_received_as_an_empty_packet() {
        let udp = Udp::start(free_base_port(), 255).expect("a slot");
        let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
        peer.send_to(&[], ("127.0.0.1", udp.port())).unwrap();
        peer.send_to(&[1, 2, 3], ("127.0.0.1", udp.port())).unwrap();
        let mut batch = PacketBatch::default();
        let deadline = StdInstant::now() + Duration::from_secs(10);
        while batch.len() < 2 && StdInstant::now() < deadline {
            if udp.wait(Duration::from_millis(50)) {
                udp.recv(&mut batch);
            }
        }
        // Both reach the nodes, which count them as malformed: nothing vanishes uncounted.
        let got: Vec<Vec<u8>> = batch.iter().map(|(d, _)| d.to_vec()).collect();
        assert_eq!(got, [vec![], vec![1, 2, 3]]);
    }

    #[test]
    fn bursts_are_received_in_order_into_one_batch() {
        let udp = Udp::start(free_base_port(), 255).expect("a slot");
        let qpn = (u32::from(udp.slot()) << 16) | 0x11;
        let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
        // Equal sizes (which the kernel may coalesce into GRO batches), odd ones, and some
        // too large to be moved together after a receive.
        let sizes: Vec<usize> = (0..RECV_MMSG * 5 + 3)
            .map(|i| match i % 7 {
                3 => 33 + i,
                5 => COMPACT_MAX + 100 * i,
                _ => 64,
            })
            .collect();
        let packets = sized_packets(qpn, &sizes);
        for p in &packets {
            peer.send_to(p, ("127.0.0.1", udp.port())).unwrap();
        }
        let mut batch = PacketBatch::default();
        let deadline = StdInstant::now() + Duration::from_secs(10);
        while batch.len() < packets.len() && StdInstant::now() < deadline {
            if udp.wait(Duration::from_millis(50)) {
                udp.recv(&mut batch);
            }
        }
        let got: Vec<Vec<u8>> = batch.iter().map(|(d, _)| d.to_vec()).collect();
        assert_eq!(got, packets, "every datagram, in the order sent");
        let from = Gid::from_ip(IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!(batch
            .iter()
            .all(|(_, d)| d.meta.sgid == from && d.meta.dgid == from));
        // A plain socket leaves the ICRC zero, and the IP ID it used is unknown.
        assert!(batch.iter().all(|(_, d)| d.icrc == IcrcCheck::Unverified));
    }

    #[test]
    fn a_gso_batch_of_ours_arrives_with_every_icrc_verified() {
        let base = free_base_port();
        let (tx, rx) = (
            Udp::start(base, 255).expect("a slot"),
            Udp::start(base, 255).expect("another slot"),
        );
        let qpn = (u32::from(rx.slot()) << 16) | 0x11;
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        // Two full GSO batches and a run that ends shorter: segments 1.. carry IPv4 IDs 1..,
        // which the receiver learns from their place in the GRO batch.
        let sizes: Vec<usize> = (0..GSO_MAX_SEGMENTS * 2 + 5)
            .map(|i| if i == 132 { 300 } else { 900 })
            .collect();
        let mut packets = sized_packets(qpn, &sizes);
        assert_eq!(tx.send_packets(lo, lo, 0, qpn, &mut packets), sizes.len());
        assert!(tx.gso.load(Ordering::Relaxed), "the kernel took the GSO sends");
        let mut batch = PacketBatch::default();
        let deadline = StdInstant::now() + Duration::from_secs(10);
        while batch.len() < packets.len() && StdInstant::now() < deadline {
            if rx.wait(Duration::from_millis(50)) {
                rx.recv(&mut batch);
            }
        }
        let got: Vec<Vec<u8>> = batch.iter().map(|(d, _)| d.to_vec()).collect();
        assert_eq!(got, packets, "every packet, in order");
        let verdicts: Vec<IcrcCheck> = batch.iter().map(|(_, d)| d.icrc).collect();
        assert!(verdicts.iter().all(|&v| v == IcrcCheck::Ok), "{verdicts:?}");
    }

    /// A full-MTU (1024-byte payload) packet for `qpn` numbered `n`.
    fn numbered(qpn: u32, n: u32) -> Vec<u8> {
        let mut p = packet(qpn, 0);
        p.resize(12 + 1024 + 4, 0);
        p[12..16].copy_from_slice(&n.to_be_bytes());
        p
    }

    #[test]
    fn socket_overflows_are_counted() {
        let udp = Udp::start(free_base_port(), 255).expect("a slot");
        let qpn = (u32::from(udp.slot()) << 16) | 0x11;
        // A small receive buffer, so that a burst nobody reads overflows it.
        setsockopt(&udp.own.v4, sockopt::RcvBuf, &4096).unwrap();
        let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
        const SENT: u32 = 200;
        for n in 0..SENT {
            peer.send_to(&numbered(qpn, n), ("127.0.0.1", udp.port()))
                .unwrap();
        }
        let mut batch = PacketBatch::default();
        let mut kept = 0;
        let drops = || udp.counters().rx_socket_drops().load(Ordering::Relaxed);
        // Reads until `until` datagrams are accounted for, or none came for a while.
        let mut read_all = |until: u64| {
            let deadline = StdInstant::now() + Duration::from_secs(10);
            let mut quiet = 0;
            while kept + drops() < until && quiet < 10 && StdInstant::now() < deadline {
                if udp.wait(Duration::from_millis(50)) {
                    kept += udp.recv(&mut batch) as u64;
                    batch.clear();
                    quiet = 0;
                } else {
                    quiet += 1;
                }
            }
            kept
        };
        let before = read_all(u64::from(SENT));
        assert!(
            before < u64::from(SENT),
            "a 4 KiB buffer cannot hold {SENT} datagrams"
        );
        // The kernel reports a socket's drops with the next datagram it queues.
        peer.send_to(&numbered(qpn, SENT), ("127.0.0.1", udp.port()))
            .unwrap();
        let kept = read_all(u64::from(SENT) + 1);
        assert_eq!(kept, before + 1);
        assert_eq!(
            kept + drops(),
            u64::from(SENT) + 1,
            "each datagram is kept or counted"
        );
    }

    #[test]
    fn a_burst_forwarded_through_mailboxes_loses_nothing() {
        let base = free_base_port();
        let holder = Udp::start(base, 255).expect("slot 1");
        let other = Udp::start(base, 255).expect("slot 2");
        let (Some(holder_box), Some(other_box)) = (
            Shm::start(holder.port(), std::time::Instant::now()),
            Shm::start(other.port(), std::time::Instant::now()),
        ) else {
            panic!("mailboxes cannot be made here");
        };
        holder.forward_through(holder_box);
        // The receiver's UDP socket is tiny: a forward over UDP would overflow it at once.
        setsockopt(&other.own.v4, sockopt::RcvBuf, &4096).unwrap();
        let qpn = (u32::from(other.slot()) << 16) | 0x11;
        // Several times what the receiver's ring holds, as fast as a peer can send it.
        const SENT: u32 = 4000;
        let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
        let sender = std::thread::spawn(move || {
            for n in 0..SENT {
                peer.send_to(&numbered(qpn, n), ("127.0.0.1", base)).unwrap();
            }
            peer.local_addr().unwrap()
        });
        // The receiver drains its mailbox slowly, so the holder must wait for room.
        let receiver = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut batch = PacketBatch::default();
            let deadline = StdInstant::now() + Duration::from_secs(60);
            while got.len() < SENT as usize && StdInstant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
                other_box.recv(&mut batch);
                got.extend(batch.iter().map(|(d, p)| (d.to_vec(), p.meta, p.ports)));
                batch.clear();
            }
            got
        });
        let deadline = StdInstant::now() + Duration::from_secs(60);
        let mut batch = PacketBatch::default();
        let c = holder.counters();
        let handled = || c.forwarded().load(Ordering::Relaxed) + c.forward_drops().load(Ordering::Relaxed);
        while handled() < u64::from(SENT) && StdInstant::now() < deadline {
            if holder.wait(Duration::from_millis(20)) {
                assert_eq!(holder.recv(&mut batch), 0, "forwarded, not kept");
                batch.clear();
            }
        }
        let from = sender.join().unwrap();
        let got = receiver.join().unwrap();
        assert_eq!(
            c.rx_socket_drops().load(Ordering::Relaxed),
            0,
            "the standard port kept up"
        );
        assert_eq!(
            c.forward_drops().load(Ordering::Relaxed),
            0,
            "nothing was lost forwarding"
        );
        assert_eq!(c.forwarded_shm().load(Ordering::Relaxed), u64::from(SENT));
        let numbers: Vec<u32> = got
            .iter()
            .map(|(d, _, _)| u32::from_be_bytes(d[12..16].try_into().unwrap()))
            .collect();
        assert_eq!(numbers, (0..SENT).collect::<Vec<_>>(), "every packet, in order");
        // As if the peer had sent to the receiver directly.
        let (data, meta, ports) = &got[0];
        assert_eq!(data, &numbered(qpn, 0));
        assert_eq!(meta.sgid, Gid::from_ip(from.ip()));
        assert_eq!(*ports, (from.port(), base));
        assert_eq!(other.counters().rx_socket_drops().load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_receiver_that_drains_nothing_holds_up_forwarding_once() {
        let base = free_base_port();
        let holder = Udp::start(base, 255).expect("slot 1");
        let other = Udp::start(base, 255).expect("slot 2");
        let (Some(holder_box), Some(other_box)) = (
            Shm::start(holder.port(), std::time::Instant::now()),
            Shm::start(other.port(), std::time::Instant::now()),
        ) else {
            panic!("mailboxes cannot be made here");
        };
        holder.forward_through(holder_box);
        let qpn = (u32::from(other.slot()) << 16) | 0x11;
        let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
        let c = holder.counters();
        let handled = || c.forwarded().load(Ordering::Relaxed) + c.forward_drops().load(Ordering::Relaxed);
        let mut batch = PacketBatch::default();
        let mut forward_all = |until: u64| {
            let deadline = StdInstant::now() + Duration::from_secs(30);
            while handled() < until && StdInstant::now() < deadline {
                if holder.wait(Duration::from_millis(20)) {
                    holder.recv(&mut batch);
                    batch.clear();
                }
            }
        };
        // More than the receiver's ring holds, which it does not drain: the first packet that
        // finds no room waits, the rest are dropped at once.
        const SENT: u32 = 3000;
        let start = StdInstant::now();
        for n in 0..SENT {
            peer.send_to(&numbered(qpn, n), ("127.0.0.1", base)).unwrap();
        }
        forward_all(u64::from(SENT));
        let took = start.elapsed();
        let (went, lost) = (
            c.forwarded_shm().load(Ordering::Relaxed),
            c.forward_drops().load(Ordering::Relaxed),
        );
        assert_eq!(went + lost, u64::from(SENT));
        assert!(went > 0 && lost > 0, "{went} forwarded, {lost} lost");
        assert!(took < Duration::from_secs(20), "{lost} drops took {took:?}");
        // Once it drains, forwarding resumes.
        let mut got = 0;
        let mut drained = PacketBatch::default();
        while other_box.recv(&mut drained) > 0 {
            got += drained.len() as u64;
            drained.clear();
        }
        assert_eq!(got, went);
        peer.send_to(&numbered(qpn, SENT), ("127.0.0.1", base)).unwrap();
        forward_all(u64::from(SENT) + 1);
        assert_eq!(c.forwarded_shm().load(Ordering::Relaxed), went + 1);
    }
}
