//! QP1 of one device port: the CM engine on the fabric, and the dispatch of its events to ids.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use softverbs_engine::cm::{CmConfig, CmEngine, CommId};
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{Dest, RxMeta, Transmit};
use softverbs_engine::types::Gid;
use softverbs_wire::cm::CmMessage;
use softverbs_wire::{BthPacket, BthRepr, DethPacket, DethRepr, Opcode, ParsedPacket, Psn};

use crate::device::{Device, Node};
use crate::fabric::{is_gsi_qpn, Gsi};

use super::{registry, CmId};

/// The Q_Key of QP1.
pub(crate) const GSI_QKEY: u32 = 0x8001_0000;

/// The CM of one device port: its engine and the ids it serves.
pub(crate) struct CmPort {
    node: Weak<Node>,
    /// The device (its node holds this port: devices of the registry live as long as the process).
    pub(crate) device: Device,
    /// This process's UDP slot (tags IDs, names QP1 for peers of this host).
    pub(crate) slot: u8,
    pub(crate) base_port: u16,
    pub(crate) inner: Mutex<PortInner>,
}

impl std::fmt::Debug for CmPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmPort")
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

/// State under the port's lock.
pub(crate) struct PortInner {
    pub(crate) engine: CmEngine,
    /// Connections by local communication ID.
    pub(crate) conns: HashMap<CommId, Weak<CmId>>,
    /// Listeners by service ID.
    pub(crate) listeners: HashMap<u64, Weak<CmId>>,
    /// SIDR requests this side sent, by request ID.
    pub(crate) sidr_out: HashMap<u32, Weak<CmId>>,
    /// Requests to a peer of this host that nobody listens for yet (see [`HOLD_UNROUTED`]).
    unrouted: Vec<Unrouted>,
    /// Requests lately delivered to a listener of this host, by [`request_key`]: a resend
    /// finding no listener means the listener went away, and is answered at once.
    delivered: VecDeque<(u64, Instant)>,
}

/// How long a request counts as delivered (longer than any request's retries).
const DELIVERED_FOR: Duration = Duration::from_secs(120);
/// The most requests remembered as delivered.
const DELIVERED_MAX: usize = 4096;

/// How long a REQ or SIDR_REQ to an address of this host waits for a listener before this
/// process's own CM answers it (a REJ or SIDR_REP "no listener"). A request between hosts
/// spends at least a network round trip before the peer looks for its listener; between two
/// processes of one host it would otherwise be looked up at once, so a server that listens
/// again right after an exchange with its client (perftest's `-R` does) would lose the race
/// it always wins on a network. The wait is re-checked every [`UNROUTED_RECHECK`].
const HOLD_UNROUTED: Duration = Duration::from_millis(100);
const UNROUTED_RECHECK: Duration = Duration::from_millis(1);

/// A request held back by [`HOLD_UNROUTED`].
struct Unrouted {
    key: u64,
    dest: Gid,
    mad: [u8; 256],
    give_up: Instant,
    recheck: Instant,
}

impl PortInner {
    /// The engine's next timer or the next look for a held request's listener.
    fn next_deadline(&self) -> Option<Instant> {
        let held = self.unrouted.iter().map(|u| u.recheck).min();
        match (self.engine.poll_timeout(), held) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl CmPort {
    /// The port of `device`, started on first use.
    pub(crate) fn of(device: &Device) -> softverbs_engine::Result<Arc<Self>> {
        let node = device.node();
        // QP numbers carry the process's slot: allocating one starts the UDP driver.
        let probe = device.alloc_qpn()?;
        device.free_qpn(probe);
        let slot = (probe >> 16) as u8;
        let base_port = device.config().udp_port;
        let guid = device.guid();
        let local_gid = node.gids().first().copied().unwrap_or(Gid::ZERO);
        let weak = Arc::downgrade(node);
        let gsi = node.gsi(|| {
            let mut seed = [0u8; 8];
            let _ = getrandom::getrandom(&mut seed);
            let mut config = CmConfig {
                local_gid,
                ca_guid: guid,
                id_tag: slot,
                ..CmConfig::default()
            };
            // Shorter waits for tests and small clusters; the defaults are rdma_cm's.
            let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u8>().ok());
            if let Some(t) = env("SOFTVERBS_CM_RESPONSE_TIMEOUT") {
                config.cm_response_timeout = t.min(31);
            }
            if let Some(r) = env("SOFTVERBS_CM_RETRIES") {
                config.max_cm_retries = r.min(15);
            }
            if let Some(p) = env("SOFTVERBS_CM_PACKET_LIFETIME") {
                config.packet_life_time = p.min(31);
            }
            let engine = CmEngine::new(config, u64::from_ne_bytes(seed));
            Arc::new(Self {
                node: weak,
                device: device.clone(),
                slot,
                base_port,
                inner: Mutex::new(PortInner {
                    engine,
                    conns: HashMap::new(),
                    listeners: HashMap::new(),
                    sidr_out: HashMap::new(),
                    unrouted: Vec::new(),
                    delivered: VecDeque::new(),
                }),
            })
        });
        gsi.clone()
            .as_any()
            .downcast::<Self>()
            .map_err(|_| softverbs_engine::Error::invalid("QP1 of this device is not a CM"))
    }

    pub(crate) fn node(&self) -> Option<Arc<Node>> {
        self.node.upgrade()
    }

    pub(crate) fn now(&self) -> Instant {
        self.node().map_or(Instant(0), |n| n.fabric().now())
    }

    /// Runs `f` on the locked state, dispatches the events it caused, sends the MADs and
    /// tells the progress thread about the next deadline.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut PortInner, Instant) -> R) -> R {
        let now = self.now();
        let mut inner = self.inner.lock();
        let r = f(&mut inner, now);
        let txs = self.settle(&mut inner, now);
        let next = inner.next_deadline();
        drop(inner);
        if let Some(node) = self.node() {
            let fabric = node.fabric();
            fabric.send_all(&node, txs);
            if let Some(at) = next {
                fabric.schedule(at);
            }
            // Peers in this process answer at once, as for posted work requests.
            fabric.drive(fabric.now());
        }
        r
    }

    /// Dispatches every pending engine event and turns the engine's MADs into packets.
    fn settle(&self, inner: &mut PortInner, now: Instant) -> Vec<Transmit> {
        while let Some(ev) = inner.engine.poll_event() {
            super::dispatch(self, inner, now, ev);
        }
        let mut out = Vec::new();
        let Some(node) = self.node() else {
            while inner.engine.poll_transmit().is_some() {}
            return out;
        };
        while inner.delivered.len() > DELIVERED_MAX
            || inner
                .delivered
                .front()
                .is_some_and(|&(_, at)| at + DELIVERED_FOR <= now)
        {
            inner.delivered.pop_front();
        }
        while let Some(t) = inner.engine.poll_transmit() {
            let qpn = match self.route(&node, &t.dest, &t.mad) {
                Route::Qpn(qpn) => qpn,
                Route::Listener(slot, key) => {
                    inner.delivered.push_back((key, now));
                    gsi_qpn(slot)
                }
                Route::NoListener(key) => {
                    if inner.unrouted.iter().any(|u| u.key == key) {
                        // A resend of a request still held: that one stands for it.
                        continue;
                    }
                    if inner.delivered.iter().any(|&(k, _)| k == key) {
                        gsi_qpn(self.slot)
                    } else {
                        inner.unrouted.push(Unrouted {
                            key,
                            dest: t.dest,
                            mad: t.mad,
                            give_up: now + HOLD_UNROUTED,
                            recheck: now + UNROUTED_RECHECK,
                        });
                        continue;
                    }
                }
            };
            out.push(self.packet(&node, t.dest, qpn, &t.mad));
        }
        // Held requests whose listener appeared, or whose wait is over.
        let mut i = 0;
        while i < inner.unrouted.len() {
            let u = &mut inner.unrouted[i];
            if u.recheck > now {
                i += 1;
                continue;
            }
            let slot = match mad_slot(self.base_port, &u.mad) {
                Some(slot) => slot,
                // Nobody listens: this process's own CM answers as the host would.
                None if u.give_up <= now => self.slot,
                None => {
                    u.recheck = now + UNROUTED_RECHECK;
                    i += 1;
                    continue;
                }
            };
            let u = inner.unrouted.swap_remove(i);
            if slot != self.slot {
                inner.delivered.push_back((u.key, now));
            }
            out.push(self.packet(&node, u.dest, gsi_qpn(slot), &u.mad));
        }
        out
    }

    /// Where `mad` to `dest` goes: QP1 of a standard peer, or of the process of this host it
    /// belongs to (found from the IDs the message carries or the listener registry).
    fn route(&self, node: &Node, dest: &Gid, mad: &[u8]) -> Route {
        // Address resolution picks the device that owns the source address, so a peer on this
        // host is reached through the node that has its address.
        if !node.gids().contains(dest) {
            return Route::Qpn(1);
        }
        match (mad_slot(self.base_port, mad), request_key(mad)) {
            (Some(slot), Some(key)) => Route::Listener(slot, key),
            (Some(slot), None) => Route::Qpn(gsi_qpn(slot)),
            (None, Some(key)) => Route::NoListener(key),
            // An unknown ID: this process's own CM answers as the host would.
            (None, None) => Route::Qpn(gsi_qpn(self.slot)),
        }
    }

    /// A UD SEND ONLY from QP1 to QP `dest_qpn` carrying `mad`.
    fn packet(&self, node: &Node, dest: Gid, dest_qpn: u32, mad: &[u8]) -> Transmit {
        let bth = BthRepr::new(Opcode::UdSendOnly, dest_qpn, Psn::new(0));
        let deth = DethRepr {
            qkey: GSI_QKEY,
            src_qpn: 1,
        };
        let (b, d) = (softverbs_wire::bth::HEADER_LEN, softverbs_wire::deth::HEADER_LEN);
        // MADs are 256 bytes: no pad; the driver fills the ICRC.
        let mut data = vec![0u8; b + d + mad.len() + 4];
        bth.emit(&mut BthPacket::new_unchecked(&mut data[..b]));
        deth.emit(&mut DethPacket::new_unchecked(&mut data[b..b + d]));
        data[b + d..b + d + mad.len()].copy_from_slice(mad);
        Transmit {
            dest: Dest {
                dgid: dest,
                sgid_index: source_index(node.gids(), &dest),
                traffic_class: 0,
                hop_limit: 64,
                flow_label: 0,
            },
            data,
            external: None,
        }
    }
}

/// QP1 of the process with UDP slot `slot`.
fn gsi_qpn(slot: u8) -> u32 {
    (u32::from(slot) << 16) | 1
}

/// Where a MAD to a peer goes (see [`CmPort::route`]).
enum Route {
    /// To this QP (of a standard peer, or of the process a reply belongs to).
    Qpn(u32),
    /// A request (by [`request_key`]) to the listener in the process with this slot.
    Listener(u8, u64),
    /// A request (by [`request_key`]) to this host that nobody listens for (yet).
    NoListener(u64),
}

/// Tells a request (REQ or SIDR_REQ) and its resends apart from other requests; `None` for
/// any other MAD.
fn request_key(mad: &[u8]) -> Option<u64> {
    match CmMessage::parse(mad).ok()?.1 {
        CmMessage::Req(r) => Some(u64::from(r.local_comm_id)),
        CmMessage::SidrReq(r) => Some((1 << 32) | u64::from(r.request_id)),
        _ => None,
    }
}

/// The process (slot) of this host a MAD belongs to: the listener's for a request, the one
/// whose ID a reply names; `None` when that cannot be told (then whoever got it handles it).
pub(crate) fn mad_slot(base_port: u16, mad: &[u8]) -> Option<u8> {
    let slot = match CmMessage::parse(mad).ok()?.1 {
        CmMessage::Req(r) => registry::lookup(base_port, r.service_id)?,
        CmMessage::SidrReq(r) => registry::lookup(base_port, r.service_id)?,
        CmMessage::SidrRep(r) => (r.request_id >> 24) as u8,
        CmMessage::Rep(r) => (r.remote_comm_id >> 24) as u8,
        CmMessage::Rtu(r) => (r.remote_comm_id >> 24) as u8,
        CmMessage::Rej(r) => (r.remote_comm_id >> 24) as u8,
        CmMessage::Mra(r) => (r.remote_comm_id >> 24) as u8,
        CmMessage::Dreq(r) => (r.remote_comm_id >> 24) as u8,
        CmMessage::Drep(r) => (r.remote_comm_id >> 24) as u8,
    };
    (slot != 0).then_some(slot)
}

/// For the holder of the standard port: the slot of the process a datagram to QP1 (BTH, DETH,
/// MAD, ICRC) from another host belongs to, so it is forwarded there like any packet of that
/// slot. Only UD SEND ONLY packets to QPN 1 with QP1's Q_Key are looked at.
pub(crate) fn forward_slot(base_port: u16, datagram: &[u8]) -> Option<u8> {
    let pkt = softverbs_wire::RocePacket::new_checked(datagram).ok()?;
    let repr = softverbs_wire::PacketRepr::parse(&pkt).ok()?;
    let ok = repr.bth.opcode == Opcode::UdSendOnly
        && repr.bth.dest_qpn == 1
        && repr.deth.is_some_and(|d| d.qkey == GSI_QKEY);
    if !ok {
        return None;
    }
    mad_slot(base_port, pkt.payload())
}

/// The GID to send to `dest` from: `dest` itself if it is ours; else, of the addresses of its
/// family and scope (a link-local IPv6 address only towards a link-local one: a MAD from
/// `fe80::` to a global address goes nowhere), the one sharing the longest prefix with it (the
/// address of its subnet); else the first of its family.
pub(crate) fn source_index(gids: &[Gid], dest: &Gid) -> u8 {
    let v4 = |g: &Gid| g.to_ip().is_ipv4();
    let link_local = |g: &Gid| matches!(g.to_ip(), IpAddr::V6(a) if a.segments()[0] & 0xffc0 == 0xfe80);
    let usable = |g: &Gid| v4(g) == v4(dest) && !g.to_ip().is_loopback();
    let common = |g: &Gid| (u128::from_be_bytes(g.0) ^ u128::from_be_bytes(dest.0)).leading_zeros();
    gids.iter()
        .position(|g| g == dest)
        .or_else(|| {
            let same_scope = gids
                .iter()
                .enumerate()
                .filter(|(_, g)| usable(g) && link_local(g) == link_local(dest));
            // The first of the longest prefixes.
            same_scope
                .min_by_key(|&(i, g)| (std::cmp::Reverse(common(g)), i))
                .map(|(i, _)| i)
        })
        .or_else(|| gids.iter().position(usable))
        .or_else(|| gids.iter().position(|g| v4(g) == v4(dest)))
        .unwrap_or(0) as u8
}

impl Gsi for CmPort {
    fn receive(&self, now: Instant, pkt: &ParsedPacket<'_>, meta: &RxMeta) -> Vec<Transmit> {
        let ok = pkt.repr.bth.opcode == Opcode::UdSendOnly
            && is_gsi_qpn(pkt.repr.bth.dest_qpn)
            && pkt.repr.deth.is_some_and(|d| d.qkey == GSI_QKEY);
        if !ok {
            return Vec::new();
        }
        let mut inner = self.inner.lock();
        inner.engine.handle_mad(now, meta.sgid, pkt.payload);
        let txs = self.settle(&mut inner, now);
        if let (Some(at), Some(node)) = (inner.next_deadline(), self.node()) {
            node.fabric().schedule(at);
        }
        txs
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.inner.lock().next_deadline()
    }

    fn on_timeout(&self, now: Instant) -> Vec<Transmit> {
        let mut inner = self.inner.lock();
        inner.engine.handle_timeout(now);
        self.settle(&mut inner, now)
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mads_leave_from_an_address_of_the_destinations_family_and_scope() {
        let gid = |s: &str| Gid::from_ip(s.parse().unwrap());
        // As a tap device lists them: link-local first, then IPv4, then a global IPv6 address.
        let gids = [gid("fe80::1"), gid("10.0.0.1"), gid("fd77::1"), gid("::1")];
        assert_eq!(source_index(&gids, &gid("fd77::2")), 2);
        assert_eq!(source_index(&gids, &gid("2001:db8::9")), 2);
        assert_eq!(source_index(&gids, &gid("fe80::2")), 0);
        assert_eq!(source_index(&gids, &gid("10.0.0.2")), 1);
        assert_eq!(source_index(&gids, &gid("::1")), 3, "an address of ours");
        // Without a global address, the link-local one is all there is.
        assert_eq!(source_index(&gids[..2], &gid("fd77::2")), 0);
        // Of several, the address of the destination's subnet.
        let two = [
            gid("192.168.1.5"),
            gid("10.77.0.1"),
            gid("fd00::1"),
            gid("fd77::1"),
        ];
        assert_eq!(source_index(&two, &gid("10.77.0.2")), 1);
        assert_eq!(source_index(&two, &gid("192.168.1.9")), 0);
        assert_eq!(source_index(&two, &gid("fd77::2")), 3);
    }
}
