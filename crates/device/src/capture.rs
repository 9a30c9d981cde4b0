//! Packet captures: every RoCEv2 packet this process sends or receives, in a pcap file that
//! Wireshark and tshark decode.
//!
//! The fabric taps its drivers. What it hands to a driver (UDP, shared memory, or another
//! device's node in this process) is written as an outgoing record just before the driver
//! takes it; what the UDP or shared-memory driver received is written as an incoming record
//! before the nodes see it. A packet between two devices of this process is recorded once, as
//! outgoing (as a capture on `lo` shows a packet once).
//!
//! Each record is one RoCEv2 packet with the IP and UDP headers of the datagram the UDP driver
//! sends for it: the kernel's defaults for a socket with DF set (IPv4 ID 0, TOS 0, TTL 64), the
//! slot ports (see `crate::udp`), a UDP checksum, and the ICRC. So a burst the UDP driver hands
//! the kernel as one GSO batch appears as the separate datagrams that go on the wire, and a
//! packet carried by shared memory appears as the datagram it stands for, payload included
//! (read from the sender's memory where the carrier left it there). An incoming datagram keeps
//! the bytes it arrived with; a UDP socket does not see the IP header, so it is rebuilt the
//! same way, with the IPv4 ID and DF flag the peer used (kernel rxe and NICs send IDs other
//! than 0) worked out from the ICRC, which covers them.
//!
//! The file is pcap with nanosecond timestamps and link type `LINUX_SLL` (Linux "cooked"
//! capture, whose packet type tells incoming from outgoing, `sll.pkttype` in Wireshark).
//! Records are written under one lock, one `write` per batch of packets, so threads and QPs
//! share one file, and a process that exits or is killed leaves a file that ends after its
//! last whole batch.

use std::fs::File;
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::{Mutex, RwLock};
use softverbs_engine::transport::ExternalRanges;
use softverbs_engine::types::Gid;
use softverbs_wire::icrc;
use softverbs_wire::udp::UdpPacket;
use softverbs_wire::Ipv4Packet;

use crate::driver::{PacketBatch, Route};

/// pcap's magic number for nanosecond timestamps.
const PCAP_MAGIC_NS: u32 = 0xa1b2_3c4d;
/// `LINKTYPE_LINUX_SLL`.
const LINKTYPE_LINUX_SLL: u32 = 113;
/// Largest record kept whole (RoCE packets are at most 4 KiB of payload plus headers).
const SNAPLEN: u32 = 262_144;
/// Length of a cooked-capture header.
const SLL_LEN: usize = 16;
/// `ARPHRD_NONE`: no link-layer address.
const ARPHRD_NONE: u16 = 0xFFFE;
/// Cooked-capture packet types.
const PACKET_HOST: u16 = 0;
const PACKET_MULTICAST: u16 = 2;
const PACKET_OUTGOING: u16 = 4;

/// The environment variable that starts a capture when the process starts its devices.
pub const ENV: &str = "SOFTVERBS_PCAP";

/// What a capture has written so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CaptureStats {
    /// Records of packets this process sent.
    pub outgoing: u64,
    /// Records of packets this process received from another process or host.
    pub incoming: u64,
    /// Packets that could not be written (the file could not be written, or addresses of
    /// different families).
    pub lost: u64,
}

/// A packet capture to a file (see the [module documentation](self)).
#[derive(Debug)]
pub struct Capture {
    path: PathBuf,
    /// `None` once stopped.
    file: Mutex<Option<File>>,
    outgoing: AtomicU64,
    incoming: AtomicU64,
    lost: AtomicU64,
}

/// Which driver received a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Carrier {
    /// The bytes are a datagram's, ICRC included.
    Udp,
    /// Packets of another process of this host: their ICRCs were never computed.
    Shm,
}

impl Capture {
    /// Creates (or truncates) `path` and writes the pcap header.
    fn create(path: &Path) -> io::Result<Self> {
        // Payloads are in it: readable by the user only, as the memory they come from.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)?;
        let mut header = Vec::with_capacity(24);
        header.extend_from_slice(&PCAP_MAGIC_NS.to_le_bytes());
        header.extend_from_slice(&2u16.to_le_bytes());
        header.extend_from_slice(&4u16.to_le_bytes());
        header.extend_from_slice(&0i32.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        header.extend_from_slice(&SNAPLEN.to_le_bytes());
        header.extend_from_slice(&LINKTYPE_LINUX_SLL.to_le_bytes());
        file.write_all(&header)?;
        Ok(Self {
            path: path.to_owned(),
            file: Mutex::new(Some(file)),
            outgoing: AtomicU64::new(0),
            incoming: AtomicU64::new(0),
            lost: AtomicU64::new(0),
        })
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What was written so far.
    pub fn stats(&self) -> CaptureStats {
        CaptureStats {
            outgoing: self.outgoing.load(Ordering::Relaxed),
            incoming: self.incoming.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
        }
    }

    /// Whether the capture still writes.
    pub fn is_running(&self) -> bool {
        self.file.lock().is_some()
    }

    /// Stops writing and closes the file; if this is the process's capture, the process has
    /// none afterwards. Every record written is in the file already.
    pub fn stop(self: &Arc<Self>) {
        if let Some(tap) = crate::device::process_tap() {
            tap.take_if(self);
        }
        self.file.lock().take();
    }

    /// Records packets handed to a driver along `route`; `exts[i]`, if given, says where packet
    /// `i`'s payload is in this process's memory.
    pub(crate) fn outgoing(&self, route: &Route, packets: &[Vec<u8>], exts: &[Option<ExternalRanges>]) {
        let (src, dst) = (
            SocketAddr::new(route.sgid.to_ip(), route.ports.0),
            SocketAddr::new(route.dgid.to_ip(), route.ports.1),
        );
        let mut out = Vec::new();
        let (mut written, mut lost) = (0, 0);
        let ts = now();
        for (i, p) in packets.iter().enumerate() {
            let full = exts
                .get(i)
                .copied()
                .flatten()
                .and_then(|e| crate::remote::materialize(p, &e));
            let bytes = full.as_deref().unwrap_or(p);
            if record(&mut out, ts, PACKET_OUTGOING, src, dst, bytes, IcrcFrom::Computed) {
                written += 1;
            } else {
                lost += 1;
            }
        }
        self.write(&out, &self.outgoing, written, lost);
    }

    /// Records the packets a driver received.
    pub(crate) fn incoming(&self, carrier: Carrier, batch: &PacketBatch) {
        let mut out = Vec::new();
        let (mut written, mut lost) = (0, 0);
        let ts = now();
        for (data, desc) in batch.iter() {
            let (src, dst) = (
                SocketAddr::new(desc.meta.sgid.to_ip(), desc.ports.0),
                SocketAddr::new(desc.meta.dgid.to_ip(), desc.ports.1),
            );
            let full = desc
                .remote
                .and_then(|r| crate::remote::materialize_from(r.pid, data, &r.ranges));
            let bytes = full.as_deref().unwrap_or(data);
            let kind = if is_multicast(&desc.meta.dgid) {
                PACKET_MULTICAST
            } else {
                PACKET_HOST
            };
            let icrc_from = match carrier {
                Carrier::Shm => IcrcFrom::Computed,
                Carrier::Udp => IcrcFrom::Peer,
            };
            if record(&mut out, ts, kind, src, dst, bytes, icrc_from) {
                written += 1;
            } else {
                lost += 1;
            }
        }
        self.write(&out, &self.incoming, written, lost);
    }

    /// Appends `records` (one `write`, so a killed process leaves whole records only).
    fn write(&self, records: &[u8], counter: &AtomicU64, written: u64, lost: u64) {
        let mut file = self.file.lock();
        let ok = match file.as_mut() {
            _ if records.is_empty() => true,
            Some(f) => match f.write_all(records) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "packet capture: write failed");
                    false
                }
            },
            None => return,
        };
        if ok {
            counter.fetch_add(written, Ordering::Relaxed);
            self.lost.fetch_add(lost, Ordering::Relaxed);
        } else {
            self.lost.fetch_add(written + lost, Ordering::Relaxed);
        }
    }
}

fn is_multicast(gid: &Gid) -> bool {
    gid.is_multicast()
}

fn now() -> Duration {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
}

/// Where a record's ICRC comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IcrcFrom {
    /// Computed here, as the UDP driver computes it.
    Computed,
    /// Sent by a peer whose IP header only its ICRC tells (see [`recover_ipv4_header`]).
    Peer,
}

/// Appends one record: the pcap record header, the cooked header and the datagram for `roce`
/// (BTH to ICRC) from `src` to `dst`. False (nothing appended) if the addresses are of
/// different families or the packet has no room for an ICRC.
fn record(
    out: &mut Vec<u8>,
    ts: Duration,
    packet_type: u16,
    src: SocketAddr,
    dst: SocketAddr,
    roce: &[u8],
    icrc_from: IcrcFrom,
) -> bool {
    if roce.len() < icrc::ICRC_LEN {
        return false;
    }
    let udp = icrc::udp_header(src.port(), dst.port(), roce.len());
    let mut v4;
    let (ip, protocol): (&[u8], u16) = match (src.ip().to_canonical(), dst.ip().to_canonical()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            v4 = icrc::ipv4_header(s, d, roce.len());
            if icrc_from == IcrcFrom::Peer {
                recover_ipv4_header(&mut v4, &udp, roce);
            }
            (&v4, 0x0800)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => (&icrc::ipv6_header(s, d, roce.len()), 0x86DD),
        _ => return false,
    };
    let start = out.len();
    let len = SLL_LEN + ip.len() + udp.len() + roce.len();
    out.extend_from_slice(&(ts.as_secs() as u32).to_le_bytes());
    out.extend_from_slice(&ts.subsec_nanos().to_le_bytes());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(&packet_type.to_be_bytes());
    out.extend_from_slice(&ARPHRD_NONE.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(&protocol.to_be_bytes());
    out.extend_from_slice(ip);
    let udp_at = out.len();
    out.extend_from_slice(&udp);
    let roce_at = out.len();
    out.extend_from_slice(roce);
    if icrc_from == IcrcFrom::Computed && icrc::fill(src, dst, &mut out[roce_at..]).is_err() {
        out.truncate(start);
        return false;
    }
    let sum = softverbs_wire::udp::checksum(src.ip(), dst.ip(), &out[udp_at..]);
    UdpPacket::new_unchecked(&mut out[udp_at..roce_at]).set_checksum(sum);
    true
}

/// Rebuilds the IPv4 ID and DF flag a peer sent `roce` with, which a UDP socket does not
/// report: softverbs peers send ID 0 with DF (what `ip` holds already), kernel rxe and NICs
/// other IDs. The ICRC covers both, and a CRC is affine in its input, so the 17 unknown bits
/// follow from the carried ICRC by elimination over GF(2) (17 CRCs of the packet). `ip` is left
/// as it is if no choice of them gives the carried ICRC (a damaged packet).
fn recover_ipv4_header(ip: &mut [u8; icrc::IPV4_HEADER_LEN], udp: &[u8; icrc::UDP_HEADER_LEN], roce: &[u8]) {
    let Some(carried) = icrc::read(roce) else { return };
    let covered = &roce[..roce.len() - icrc::ICRC_LEN];
    let crc_with = |ident: u16, df: bool| {
        let mut h = *ip;
        let mut v = Ipv4Packet::new_unchecked(&mut h);
        v.set_ident(ident);
        v.set_dont_frag(df);
        icrc::icrc_ipv4(&h, udp, covered)
    };
    let base = crc_with(0, true);
    if base == carried {
        return;
    }
    // Column i: how bit i of (ID, DF flipped) changes the CRC.
    let mut rows: Vec<(u32, u32)> = (0..17)
        .map(|i| {
            let c = if i < 16 {
                crc_with(1 << i, true)
            } else {
                crc_with(0, false)
            };
            (c ^ base, 1u32 << i)
        })
        .collect();
    // Gaussian elimination: reduce the target by a basis in echelon form.
    let mut basis: Vec<(u32, u32)> = Vec::new();
    for (mut v, mut m) in rows.drain(..) {
        for &(bv, bm) in &basis {
            if v ^ bv < v {
                v ^= bv;
                m ^= bm;
            }
        }
        if v != 0 {
            basis.push((v, m));
            basis.sort_by_key(|b| std::cmp::Reverse(b.0));
        }
    }
    let (mut t, mut x) = (base ^ carried, 0u32);
    for &(bv, bm) in &basis {
        if t ^ bv < t {
            t ^= bv;
            x ^= bm;
        }
    }
    if t != 0 {
        return;
    }
    let mut v = Ipv4Packet::new_unchecked(&mut ip[..]);
    v.set_ident(x as u16);
    v.set_dont_frag(x & (1 << 16) == 0);
    v.fill_checksum();
}

/// The fabric's hook for a capture: one load when none runs.
#[derive(Debug, Default)]
pub(crate) struct Tap {
    on: AtomicBool,
    capture: RwLock<Option<Arc<Capture>>>,
}

impl Tap {
    /// The running capture, if any.
    #[inline]
    pub(crate) fn get(&self) -> Option<Arc<Capture>> {
        if !self.on.load(Ordering::Relaxed) {
            return None;
        }
        self.capture.read().clone()
    }

    /// Makes `capture` the one this tap writes to; returns the previous one.
    fn set(&self, capture: Option<Arc<Capture>>) -> Option<Arc<Capture>> {
        let mut c = self.capture.write();
        self.on.store(capture.is_some(), Ordering::Relaxed);
        std::mem::replace(&mut *c, capture)
    }

    /// Detaches `capture` if it is the one written to.
    fn take_if(&self, capture: &Arc<Capture>) {
        let mut c = self.capture.write();
        if c.as_ref().is_some_and(|cur| Arc::ptr_eq(cur, capture)) {
            *c = None;
            self.on.store(false, Ordering::Relaxed);
        }
    }
}

/// Starts capturing every packet of this process to `path` (created, or truncated), in place
/// of any capture running (which is stopped).
pub fn start(path: impl AsRef<Path>) -> io::Result<Arc<Capture>> {
    let capture = Arc::new(Capture::create(path.as_ref())?);
    let tap = crate::device::process_tap()
        .ok_or_else(|| io::Error::other("this process has no fabric to capture (its thread limit)"))?;
    if let Some(old) = tap.set(Some(capture.clone())) {
        old.file.lock().take();
    }
    tracing::info!(path = %path.as_ref().display(), "packet capture started");
    Ok(capture)
}

/// The capture running in this process, if any.
pub fn current() -> Option<Arc<Capture>> {
    crate::device::process_tap()?.get()
}

/// Stops the process's capture, if one runs, and returns what it wrote.
pub fn stop() -> Option<CaptureStats> {
    let c = crate::device::process_tap()?.set(None)?;
    c.file.lock().take();
    Some(c.stats())
}

/// The file [`ENV`] names, with `%p` replaced by the process ID (so that processes started
/// with one environment write files of their own).
pub(crate) fn env_path() -> Option<PathBuf> {
    let v = std::env::var_os(ENV)?;
    let s = v.to_string_lossy();
    if s.is_empty() {
        return None;
    }
    Some(PathBuf::from(s.replace("%p", &std::process::id().to_string())))
}

/// Starts the capture [`ENV`] asks for on `tap` (the process's, when its devices start). A
/// file that cannot be created is reported on the log and ignored.
pub(crate) fn start_from_env(tap: &Tap) {
    let Some(path) = env_path() else { return };
    match Capture::create(&path) {
        Ok(c) => {
            tap.set(Some(Arc::new(c)));
            tracing::info!(path = %path.display(), "packet capture started ({ENV})");
        }
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "{ENV}: cannot create the capture file"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use softverbs_engine::transport::RxMeta;
    use softverbs_wire::{BthRepr, Opcode, PacketRepr, Psn, RocePacket};

    fn send_only(qpn: u32, payload: &[u8]) -> Vec<u8> {
        let repr = PacketRepr::new(BthRepr::new(Opcode::RcSendOnly, qpn, Psn::new(3)), payload.len());
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit_with_payload(&mut buf, payload).unwrap();
        buf
    }

    fn route(src: &str, dst: &str) -> Route {
        Route {
            sgid: Gid::from_ip(src.parse().unwrap()),
            dgid: Gid::from_ip(dst.parse().unwrap()),
            dest_qpn: 0x2_0011,
            traffic_class: 0,
            hop_limit: 64,
            ifindex: 0,
            ports: (4792, 4793),
        }
    }

    /// The records of a pcap file: (packet type, datagram from the IP header on).
    fn records(bytes: &[u8]) -> Vec<(u16, Vec<u8>)> {
        assert_eq!(&bytes[..4], &PCAP_MAGIC_NS.to_le_bytes());
        assert_eq!(&bytes[20..24], &LINKTYPE_LINUX_SLL.to_le_bytes());
        let mut at = 24;
        let mut out = Vec::new();
        while at < bytes.len() {
            let incl = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
            let rec = &bytes[at + 16..at + 16 + incl];
            out.push((u16::from_be_bytes([rec[0], rec[1]]), rec[SLL_LEN..].to_vec()));
            at += 16 + incl;
        }
        out
    }

    #[test]
    fn records_carry_headers_checksums_and_icrcs() {
        let dir = std::env::temp_dir().join(format!("sv-capture-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.pcap");
        let cap = Capture::create(&path).unwrap();
        let v4 = route("127.0.0.1", "127.0.0.2");
        cap.outgoing(
            &v4,
            &[send_only(0x2_0011, b"hello"), send_only(0x2_0011, b"")],
            &[],
        );
        let v6 = route("fe80::1", "fe80::2");
        cap.outgoing(&v6, &[send_only(0x2_0011, &[7; 100])], &[]);
        // Mixed families cannot be one datagram: lost, not written.
        let bad = Route { dgid: v6.dgid, ..v4 };
        cap.outgoing(&bad, &[send_only(1, b"x")], &[]);
        // A received datagram keeps its ICRC as it came (here: a wrong one).
        let mut batch = PacketBatch::default();
        let mut rx = send_only(0x1_0011, b"in");
        let n = rx.len();
        rx[n - 4..].copy_from_slice(&[1, 2, 3, 4]);
        let meta = RxMeta {
            sgid: v4.dgid,
            dgid: v4.sgid,
            traffic_class: 0,
            hop_limit: 64,
        };
        batch.push(&rx, meta, crate::driver::IcrcCheck::Bad, (4793, 4792));
        cap.incoming(Carrier::Udp, &batch);
        // One from shared memory gets its ICRC computed.
        cap.incoming(Carrier::Shm, &batch);
        assert_eq!(
            cap.stats(),
            CaptureStats {
                outgoing: 3,
                incoming: 2,
                lost: 1
            }
        );
        let recs = records(&std::fs::read(&path).unwrap());
        assert_eq!(recs.len(), 5);
        let kinds: Vec<u16> = recs.iter().map(|r| r.0).collect();
        assert_eq!(
            kinds,
            [
                PACKET_OUTGOING,
                PACKET_OUTGOING,
                PACKET_OUTGOING,
                PACKET_HOST,
                PACKET_HOST
            ]
        );
        for (i, (_, dgram)) in recs.iter().enumerate() {
            let (ip_len, src, dst): (usize, IpAddr, IpAddr) = if dgram[0] >> 4 == 4 {
                let ip = softverbs_wire::Ipv4Packet::new_checked(&dgram[..]).unwrap();
                assert!(ip.verify_checksum());
                assert_eq!(usize::from(ip.total_len()), dgram.len());
                (20, ip.src_addr().into(), ip.dst_addr().into())
            } else {
                let ip = softverbs_wire::Ipv6Packet::new_checked(&dgram[..]).unwrap();
                assert_eq!(usize::from(ip.payload_len()) + 40, dgram.len());
                (40, ip.src_addr().into(), ip.dst_addr().into())
            };
            let udp = UdpPacket::new_checked(&dgram[ip_len..]).unwrap();
            let sum = softverbs_wire::udp::checksum(src, dst, &dgram[ip_len..]);
            assert_eq!(udp.checksum(), sum, "record {i}");
            let roce = &dgram[ip_len + 8..];
            RocePacket::parse(roce).unwrap();
            let ok = icrc::verify(
                SocketAddr::new(src, udp.src_port()),
                SocketAddr::new(dst, udp.dst_port()),
                roce,
            );
            assert_eq!(ok, i != 3, "record {i}: only the received bad ICRC stays bad");
        }
        assert_eq!(&recs[0].1[20 + 8 + 12..20 + 8 + 17], b"hello");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_ip_id_and_df_of_a_peer_are_recovered_from_the_icrc() {
        let (s, d) = ("10.0.17.1".parse().unwrap(), "10.0.18.1".parse().unwrap());
        let roce = send_only(0x11, &[5; 200]);
        let udp = icrc::udp_header(49152, 4791, roce.len());
        for (ident, df) in [
            (0x718c, true),
            (0x0001, true),
            (0xffff, false),
            (0, false),
            (0, true),
        ] {
            // What the peer sent, and the ICRC over it.
            let mut sent = icrc::ipv4_header(s, d, roce.len());
            let mut v = Ipv4Packet::new_unchecked(&mut sent);
            v.set_ident(ident);
            v.set_dont_frag(df);
            v.fill_checksum();
            let mut pkt = roce.clone();
            let n = pkt.len();
            let c = icrc::icrc_ipv4(&sent, &udp, &pkt[..n - 4]);
            pkt[n - 4..].copy_from_slice(&c.to_le_bytes());
            let mut rebuilt = icrc::ipv4_header(s, d, roce.len());
            recover_ipv4_header(&mut rebuilt, &udp, &pkt);
            assert_eq!(rebuilt, sent, "ID {ident:#x} DF {df}");
            // A damaged packet leaves the header as it was.
            pkt[20] ^= 1;
            let mut rebuilt = icrc::ipv4_header(s, d, roce.len());
            recover_ipv4_header(&mut rebuilt, &udp, &pkt);
            assert_eq!(
                rebuilt,
                icrc::ipv4_header(s, d, roce.len()),
                "no ID from a damaged packet"
            );
        }
    }

    #[test]
    fn a_stopped_capture_writes_nothing_more() {
        let dir = std::env::temp_dir().join(format!("sv-capture-stop-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("b.pcap");
        let cap = Arc::new(Capture::create(&path).unwrap());
        let tap = Tap::default();
        assert!(tap.get().is_none());
        tap.set(Some(cap.clone()));
        tap.get()
            .unwrap()
            .outgoing(&route("10.0.0.1", "10.0.0.2"), &[send_only(5, b"a")], &[]);
        tap.take_if(&cap);
        assert!(tap.get().is_none());
        cap.file.lock().take();
        assert!(!cap.is_running());
        cap.outgoing(&route("10.0.0.1", "10.0.0.2"), &[send_only(5, b"b")], &[]);
        assert_eq!(records(&std::fs::read(&path).unwrap()).len(), 1);
        assert_eq!(cap.stats().outgoing, 1);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "only its owner may read a capture");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
