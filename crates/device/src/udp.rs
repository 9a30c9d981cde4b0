//! RoCEv2 over UDP: the driver that carries packets between processes and hosts.
//!
//! Several processes on one host share the RoCE port without a daemon. Each process takes a
//! *slot* k (1..=255) by binding UDP port `base + k` (`base` is 4791 unless configured), and
//! every QP number it allocates carries the slot in bits 16..24. A sender that knows a QPN
//! therefore knows the port to send to: softverbs peers talk to each other directly. Standard
//! peers (the kernel's rxe, RoCE NICs) always send to `base`; whichever process holds `base`
//! forwards packets for other slots to their port, wrapped in a small header that keeps the
//! original addresses (so ICRC checks and GRHs stay right). If that process exits, another one
//! takes `base` over within a second.
//!
//! Packets are sent from unconnected sockets with `IP_PMTUDISC_DO`, so Linux sends IPv4
//! datagrams with ID 0 and DF set, which is what the ICRC is computed over. The IPv4 ID of a
//! received datagram is not visible to a UDP socket, so an IPv4 ICRC can only be verified when
//! the sender used ID 0 (any softverbs sender); a mismatch is counted as unverifiable rather
//! than dropped. IPv6 ICRCs are always verified, and mismatches are dropped and counted.

use std::io::{IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use nix::errno::Errno;
use nix::libc;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    bind, getsockopt, recvmsg, sendmsg, setsockopt, socket, sockopt, AddressFamily, ControlMessage,
    ControlMessageOwned, MsgFlags, SockFlag, SockType, SockaddrIn, SockaddrIn6, SockaddrStorage,
};
use parking_lot::Mutex;
use softverbs_engine::transport::RxMeta;
use softverbs_engine::types::Gid;
use softverbs_wire::icrc;

use crate::pace::Pacer;

/// First bytes of a forwarded datagram. 0x53 is an RD opcode, which no valid packet here uses.
const FORWARD_MAGIC: [u8; 4] = *b"SVFW";
/// Magic, source address and port, destination address.
const FORWARD_HEADER: usize = 4 + 16 + 2 + 16;
/// Largest receive: a GRO-coalesced batch of datagrams.
const MAX_DATAGRAM: usize = 65536;
/// Most datagrams sent in one GSO batch (the kernel's limit is 64).
const GSO_MAX_SEGMENTS: usize = 64;
/// Most bytes in one GSO batch (the UDP payload limit).
const GSO_MAX_BYTES: usize = 65_000;

/// What the receive side hands to the fabric.
#[derive(Debug)]
pub(crate) struct Datagram {
    pub(crate) data: Vec<u8>,
    pub(crate) meta: RxMeta,
    /// UDP source and destination ports.
    pub(crate) ports: (u16, u16),
    /// The ICRC could be checked and was wrong.
    pub(crate) bad_icrc: bool,
    /// The ICRC could not be checked (IPv4 with a non-zero IP ID).
    pub(crate) icrc_unverified: bool,
}

/// A bound socket pair (IPv4 and, where available, IPv6) on one port.
#[derive(Debug)]
struct Sockets {
    v4: OwnedFd,
    v6: Option<OwnedFd>,
    port: u16,
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
            }),
            // A host without IPv6 still gets IPv4; a port taken on IPv6 only is taken.
            Err(Errno::EADDRINUSE) => Err(Errno::EADDRINUSE),
            Err(_) => Ok(Self { v4, v6: None, port }),
        }
    }

    fn fds(&self) -> impl Iterator<Item = &OwnedFd> {
        std::iter::once(&self.v4).chain(self.v6.as_ref())
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
    rx: Mutex<RxBuffers>,
    /// Whether the kernel accepts UDP segmentation offload (GSO) sends.
    gso: std::sync::atomic::AtomicBool,
    /// Holds back floods towards receivers on this host that cannot keep up.
    pacer: Pacer,
    /// Forwarded datagrams dropped because they did not come from the standard port.
    forged: std::sync::atomic::AtomicU64,
}

#[derive(Debug)]
struct RxBuffers {
    data: Vec<u8>,
    cmsg: Vec<u8>,
}

/// The slot of a QP number: which process (and port) owns it.
pub(crate) fn slot_of(qpn: u32) -> u8 {
    (qpn >> 16) as u8
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
        let udp = Arc::new(Self {
            slot,
            base,
            own,
            forwarder: Mutex::new(Sockets::bind(base).ok().map(Arc::new)),
            last_takeover_try: Mutex::new(StdInstant::now()),
            rx: Mutex::new(RxBuffers {
                data: vec![0u8; MAX_DATAGRAM],
                cmsg: nix::cmsg_space!(libc::in6_pktinfo, i32),
            }),
            gso: std::sync::atomic::AtomicBool::new(true),
            pacer: Pacer::new(rcvbuf),
            forged: std::sync::atomic::AtomicU64::new(0),
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

    /// This process's own UDP port.
    pub(crate) fn port(&self) -> u16 {
        self.own.port
    }

    /// Forwarded datagrams dropped as forged (not from the standard port).
    pub(crate) fn forged_forwards(&self) -> u64 {
        self.forged.load(std::sync::atomic::Ordering::Relaxed)
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
    /// call, segmented by the kernel. `scope` is the interface index for link-local IPv6.
    /// Returns how many were handed to the kernel.
    pub(crate) fn send(
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
        for p in packets.iter_mut() {
            // Only a packet too short to hold a BTH fails here; it is dropped below.
            let _ = icrc::fill(src_sa, dst_sa, p);
        }
        if dst.is_loopback() {
            let bytes = packets.iter().map(Vec::len).sum();
            self.pacer.before_send(dst.is_ipv6(), port, bytes);
        }
        let mut sent = 0;
        let mut rest: &[Vec<u8>] = packets;
        while !rest.is_empty() {
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
            let batch = &rest[..n];
            // Only to loopback addresses: on a real link a capture would show the unsegmented
            // batch rather than the packets that go on the wire.
            let use_gso = n > 1 && dst.is_loopback() && self.gso.load(std::sync::atomic::Ordering::Relaxed);
            if use_gso {
                let parts: Vec<&[u8]> = batch.iter().map(Vec::as_slice).collect();
                if self.send_raw(src, dst_sa, scope, &parts, Some(seg as u16)) {
                    sent += n;
                    rest = &rest[n..];
                    continue;
                }
                // Without GSO support, fall back to one datagram per call from now on.
                self.gso.store(false, std::sync::atomic::Ordering::Relaxed);
            }
            for p in batch {
                sent += usize::from(self.send_raw(src, dst_sa, scope, &[p], None));
            }
            rest = &rest[n..];
        }
        sent
    }

    fn send_raw(&self, src: IpAddr, dst: SocketAddr, scope: u32, parts: &[&[u8]], gso: Option<u16>) -> bool {
        let Some(fd) = self.socket_for(&dst.ip()) else {
            return false;
        };
        self.send_on(fd, src, dst, scope, parts, gso)
    }

    fn send_on(
        &self,
        fd: &OwnedFd,
        src: IpAddr,
        dst: SocketAddr,
        scope: u32,
        parts: &[&[u8]],
        gso: Option<u16>,
    ) -> bool {
        let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let gso_size = gso.unwrap_or(0);
        let gso_cmsg = ControlMessage::UdpGsoSegments(&gso_size);
        let r = match (src, dst) {
            (IpAddr::V4(s), SocketAddr::V4(d)) => {
                let info = libc::in_pktinfo {
                    ipi_ifindex: 0,
                    ipi_spec_dst: libc::in_addr {
                        s_addr: u32::from_ne_bytes(s.octets()),
                    },
                    ipi_addr: libc::in_addr { s_addr: 0 },
                };
                let info_cmsg = ControlMessage::Ipv4PacketInfo(&info);
                let cmsgs: &[ControlMessage<'_>] = if gso.is_some() {
                    &[info_cmsg, gso_cmsg]
                } else {
                    &[info_cmsg]
                };
                sendmsg(
                    fd.as_raw_fd(),
                    &iov,
                    cmsgs,
                    MsgFlags::empty(),
                    Some(&SockaddrIn::from(d)),
                )
            }
            (IpAddr::V6(s), SocketAddr::V6(d)) => {
                let link_local = (d.ip().segments()[0] & 0xffc0) == 0xfe80;
                let d = SocketAddrV6::new(*d.ip(), d.port(), 0, if link_local { scope } else { 0 });
                let info = libc::in6_pktinfo {
                    ipi6_addr: libc::in6_addr { s6_addr: s.octets() },
                    ipi6_ifindex: if link_local { scope } else { 0 },
                };
                let info_cmsg = ControlMessage::Ipv6PacketInfo(&info);
                let cmsgs: &[ControlMessage<'_>] = if gso.is_some() {
                    &[info_cmsg, gso_cmsg]
                } else {
                    &[info_cmsg]
                };
                sendmsg(
                    fd.as_raw_fd(),
                    &iov,
                    cmsgs,
                    MsgFlags::empty(),
                    Some(&SockaddrIn6::from(d)),
                )
            }
            _ => return false,
        };
        match r {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!(%dst, error = %e, "UDP send failed");
                false
            }
        }
    }

    /// Waits up to `timeout` until a datagram can be read; false on timeout.
    pub(crate) fn wait_readable(&self, timeout: Duration) -> bool {
        self.maybe_take_over();
        let fwd = self.forwarder.lock().clone();
        let mut pfds: Vec<PollFd<'_>> = self
            .own
            .fds()
            .map(|f| PollFd::new(f.as_fd(), PollFlags::POLLIN))
            .collect();
        if let Some(f) = fwd.as_ref() {
            pfds.extend(f.fds().map(|f| PollFd::new(f.as_fd(), PollFlags::POLLIN)));
        }
        let ms = PollTimeout::try_from(timeout.as_millis().min(60_000) as i32).unwrap_or(PollTimeout::MAX);
        matches!(poll(&mut pfds, ms), Ok(n) if n > 0)
    }

    /// Reads every datagram waiting, without blocking, and hands them to `deliver` before
    /// another thread may read: datagrams reach the fabric in the order the socket had them
    /// (two readers delivering their batches in the other order would reorder a QP's packets,
    /// which UC cannot recover from).
    pub(crate) fn receive(&self, deliver: impl FnOnce(Vec<Datagram>)) {
        let mut rx = self.rx.lock();
        let out = self.receive_locked(&mut rx);
        deliver(out);
    }

    /// Like [`Udp::receive`] for a polling application thread; false (and nothing read) if
    /// another thread is receiving.
    pub(crate) fn try_receive(&self, deliver: impl FnOnce(Vec<Datagram>)) -> bool {
        let Some(mut rx) = self.rx.try_lock() else {
            return false;
        };
        let out = self.receive_locked(&mut rx);
        deliver(out);
        true
    }

    fn receive_locked(&self, rx: &mut RxBuffers) -> Vec<Datagram> {
        let fwd = self.forwarder.lock().clone();
        let mut fds: Vec<(&OwnedFd, bool)> = self.own.fds().map(|f| (f, false)).collect();
        if let Some(f) = fwd.as_ref() {
            fds.extend(f.fds().map(|f| (f, true)));
        }
        let mut out = Vec::new();
        // One readiness check over every socket costs less than a failing recvmsg on each.
        let mut pfds: Vec<PollFd<'_>> = fds
            .iter()
            .map(|(f, _)| PollFd::new(f.as_fd(), PollFlags::POLLIN))
            .collect();
        if !matches!(poll(&mut pfds, PollTimeout::ZERO), Ok(n) if n > 0) {
            return out;
        }
        let ready: Vec<bool> = pfds
            .iter()
            .map(|p| p.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(pfds);
        for ((fd, is_forwarder), ready) in fds.into_iter().zip(ready) {
            if !ready {
                continue;
            }
            // Bounded, so one busy socket does not starve the others.
            for _ in 0..256 {
                if !self.recv_one(fd, is_forwarder, rx, &mut out) {
                    break;
                }
            }
        }
        out
    }

    /// Reads one datagram, or one GRO batch of them, into `out`; false when the socket is empty.
    fn recv_one(
        &self,
        fd: &OwnedFd,
        is_forwarder: bool,
        rx: &mut RxBuffers,
        out: &mut Vec<Datagram>,
    ) -> bool {
        let RxBuffers { data, cmsg } = rx;
        cmsg.clear();
        let mut iov = [IoSliceMut::new(&mut data[..])];
        let msg = match recvmsg::<SockaddrStorage>(fd.as_raw_fd(), &mut iov, Some(cmsg), MsgFlags::empty()) {
            Ok(m) => m,
            Err(Errno::EAGAIN) => return false,
            Err(e) => {
                tracing::debug!(error = %e, "UDP receive failed");
                return false;
            }
        };
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
                    _ => {}
                }
            }
        }
        let (Some(src), Some(dst_ip)) = (src, dst_ip) else {
            return true;
        };
        for bytes in data[..len].chunks(segment.max(1)) {
            self.accept(src, dst_ip, is_forwarder, bytes, out);
        }
        true
    }

    /// Handles one received datagram: unwraps forwarded ones, forwards those of other slots.
    fn accept(
        &self,
        src: SocketAddr,
        dst_ip: IpAddr,
        is_forwarder: bool,
        bytes: &[u8],
        out: &mut Vec<Datagram>,
    ) {
        let port = if is_forwarder { self.base } else { self.own.port };

        if bytes.len() >= FORWARD_HEADER && bytes[..4] == FORWARD_MAGIC {
            // Only the holder of the standard port may forward: it sends from that port, from
            // the local address the packet reached to the same address. No other local socket
            // can use the port while it is held, and Linux drops packets from off the host
            // that claim a local source address, so anything else is forged (it would let its
            // sender pose as any peer) and is dropped.
            if is_forwarder || src.port() != self.base || src.ip() != dst_ip {
                self.forged.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::debug!(%src, %dst_ip, "dropped a forwarded datagram not from the RoCE port");
                return;
            }
            // Forwarded to us by the holder of the standard port: restore the real addresses.
            let ip = |b: &[u8]| {
                let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(b).expect("16 bytes"));
                v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
            };
            let orig_src = SocketAddr::new(ip(&bytes[4..20]), u16::from_be_bytes([bytes[20], bytes[21]]));
            let orig_dst = SocketAddr::new(ip(&bytes[22..38]), self.base);
            out.push(datagram(orig_src, orig_dst, &bytes[FORWARD_HEADER..]));
            return;
        }
        if is_forwarder {
            let qpn = softverbs_wire::bth::peek_dest_qpn(bytes).unwrap_or(0);
            let slot = slot_of(qpn);
            if slot != 0 && slot != self.slot && qpn != crate::fabric::MULTICAST_QPN {
                self.forward(src, dst_ip, slot, bytes);
                return;
            }
        }
        out.push(datagram(src, SocketAddr::new(dst_ip, port), bytes));
    }

    fn forward(&self, src: SocketAddr, dst_ip: IpAddr, slot: u8, bytes: &[u8]) {
        let mapped = |ip: IpAddr| match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        let mut header = [0u8; FORWARD_HEADER];
        header[..4].copy_from_slice(&FORWARD_MAGIC);
        header[4..20].copy_from_slice(&mapped(src.ip()));
        header[20..22].copy_from_slice(&src.port().to_be_bytes());
        header[22..38].copy_from_slice(&mapped(dst_ip));
        let to = SocketAddr::new(dst_ip, self.base.saturating_add(u16::from(slot)));
        // From the standard port, which is how the receiver tells a forward from a forgery.
        let Some(fwd) = self.forwarder.lock().clone() else {
            return;
        };
        let fd = match dst_ip {
            IpAddr::V4(_) => Some(&fwd.v4),
            IpAddr::V6(_) => fwd.v6.as_ref(),
        };
        if let Some(fd) = fd {
            self.send_on(fd, dst_ip, to, 0, &[&header, bytes], None);
        }
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
            if fwd.is_some() {
                tracing::info!(port = self.base, "took over the standard RoCE port");
            }
        }
    }
}

fn datagram(src: SocketAddr, dst: SocketAddr, bytes: &[u8]) -> Datagram {
    let icrc_ok = icrc::verify(src, dst, bytes);
    let (bad_icrc, icrc_unverified) = match (icrc_ok, src.ip()) {
        (true, _) => (false, false),
        // Only the sender knows the IPv4 ID it used; see the module documentation.
        (false, IpAddr::V4(_)) => (false, true),
        (false, IpAddr::V6(_)) => (true, false),
    };
    Datagram {
        data: bytes.to_vec(),
        meta: RxMeta {
            sgid: Gid::from_ip(src.ip()),
            dgid: Gid::from_ip(dst.ip()),
            traffic_class: 0,
            hop_limit: 64,
        },
        ports: (src.port(), dst.port()),
        bad_icrc,
        icrc_unverified,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;

    /// A base port whose first slots are free now (not the standard port, which other
    /// processes on the host may hold).
    fn free_base_port() -> u16 {
        let free =
            |port: u16| UdpSocket::bind(("0.0.0.0", port)).is_ok() && UdpSocket::bind(("::", port)).is_ok();
        let seed = std::process::id() as u16;
        (0..1000u16)
            .map(|i| 20_000 + (seed.wrapping_add(i.wrapping_mul(89)) % 40_000))
            .find(|&base| (base..base + 4).all(free))
            .expect("a free range of UDP ports")
    }

    /// A BTH-sized packet for `qpn` with a recognisable payload.
    fn packet(qpn: u32, tag: u8) -> Vec<u8> {
        let mut p = vec![0u8; 12 + 4 + 4];
        p[0] = 0x64; // UD SEND only
        p[2..4].copy_from_slice(&0xFFFFu16.to_be_bytes());
        p[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
        p[16] = tag;
        p
    }

    /// Runs the holder's receive side (which keeps nothing: it forwards) until `to` gets a
    /// datagram or `wait` passes.
    fn forward_within(holder: &Udp, to: &Udp, wait: Duration) -> Vec<Datagram> {
        let deadline = StdInstant::now() + wait;
        let mut got = Vec::new();
        while got.is_empty() && StdInstant::now() < deadline {
            if holder.wait_readable(Duration::from_millis(20)) {
                holder.receive(|d| assert!(d.is_empty(), "forwarded, not kept"));
            }
            if to.wait_readable(Duration::from_millis(20)) {
                to.receive(|d| got.extend(d));
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
        assert_eq!(got[0].data, packet(dest_qpn, 1));
        assert_eq!(got[0].meta.sgid, Gid::from_ip(peer.local_addr().unwrap().ip()));
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
                if u.wait_readable(Duration::from_millis(50)) {
                    u.receive(|d| assert!(d.is_empty(), "a forged forward was delivered: {d:?}"));
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
}
