//! The IB CM engine on a simulated network: two or three `CmEngine`s exchanging MADs with
//! seeded loss, duplication and reordering, in virtual time.
//!
//! Each node may run the "usual application" (`auto`): accept every request, establish on
//! every response, answer a peer's disconnect with its own, accept every SIDR request. Tests
//! that need another reaction turn it off and act on the recorded events.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use softverbs_engine::cm::{
    cm_timeout, AcceptParams, CmConfig, CmEngine, CmEvent, CommId, ConnectParams, SidrReplyParams,
    ETIMEDOUT_STATUS,
};
use softverbs_engine::time::Instant;
use softverbs_engine::types::Gid;
use softverbs_wire::cm::{
    private_data_len, rej_reason, service_id, sidr_status, CmMessage, CmaHeaderPacket, CmaHeaderRepr,
    PortSpace, RDMA_UDP_QKEY,
};
use softverbs_wire::mad::MAD_LEN;

/// splitmix64: the network's randomness, from the test's seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Decides, per destination node and message, to drop a packet.
type Filter = Box<dyn FnMut(usize, &CmMessage) -> bool>;

struct Node {
    gid: Gid,
    cm: CmEngine,
    auto: bool,
    events: Vec<(Instant, CmEvent)>,
    /// Connections this node's application disconnected (so `auto` does not do it twice).
    disconnected: Vec<CommId>,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Delivery {
    at: Instant,
    seq: u64,
    to: usize,
    from: Gid,
    mad: [u8; MAD_LEN],
}

struct Net {
    now: Instant,
    nodes: Vec<Node>,
    queue: BinaryHeap<Reverse<Delivery>>,
    rng: Rng,
    seq: u64,
    loss: f64,
    dup: f64,
    latency: Duration,
    /// Extra random delay up to this much, which reorders packets.
    jitter: Duration,
    /// Drops packets for which this returns true (after random loss).
    filter: Option<Filter>,
    sent: u64,
}

fn gid(i: usize) -> Gid {
    Gid::from_ip(IpAddr::V4(Ipv4Addr::new(10, 0, 0, u8::try_from(i + 1).unwrap())))
}

const PORT: u16 = 7471;

fn sid() -> u64 {
    service_id(PortSpace::Tcp, PORT)
}

impl Net {
    fn new(nodes: usize, seed: u64) -> Self {
        let nodes = (0..nodes)
            .map(|i| Node {
                gid: gid(i),
                cm: CmEngine::new(
                    CmConfig {
                        local_gid: gid(i),
                        ca_guid: 0x0200_00ff_fe00_0000 + i as u64,
                        ..CmConfig::default()
                    },
                    seed ^ ((i as u64 + 1) * 0x1234_5678),
                ),
                auto: true,
                events: Vec::new(),
                disconnected: Vec::new(),
            })
            .collect();
        Self {
            now: Instant::ZERO,
            nodes,
            queue: BinaryHeap::new(),
            rng: Rng(seed),
            seq: 0,
            loss: 0.0,
            dup: 0.0,
            latency: Duration::from_micros(50),
            jitter: Duration::ZERO,
            filter: None,
            sent: 0,
        }
    }

    fn index_of(&self, g: Gid) -> Option<usize> {
        self.nodes.iter().position(|n| n.gid == g)
    }

    /// Drains every node's transmits and events (reacting to events for `auto` nodes) until
    /// nothing is left to drain.
    fn drain(&mut self) {
        loop {
            let mut progress = false;
            for i in 0..self.nodes.len() {
                while let Some(t) = self.nodes[i].cm.poll_transmit() {
                    progress = true;
                    self.sent += 1;
                    let Some(to) = self.index_of(t.dest) else { continue };
                    if self.rng.chance(self.loss) {
                        continue;
                    }
                    if let Some(f) = self.filter.as_mut() {
                        let (_, msg) = CmMessage::parse(&t.mad).expect("the engine sends valid MADs");
                        if f(to, &msg) {
                            continue;
                        }
                    }
                    let copies = if self.rng.chance(self.dup) { 2 } else { 1 };
                    for _ in 0..copies {
                        let jitter = Duration::from_nanos(self.rng.below(self.jitter.as_nanos() as u64 + 1));
                        self.seq += 1;
                        self.queue.push(Reverse(Delivery {
                            at: self.now + self.latency + jitter,
                            seq: self.seq,
                            to,
                            from: self.nodes[i].gid,
                            mad: t.mad,
                        }));
                    }
                }
                while let Some(e) = self.nodes[i].cm.poll_event() {
                    progress = true;
                    self.react(i, &e);
                    self.nodes[i].events.push((self.now, e));
                }
            }
            if !progress {
                return;
            }
        }
    }

    fn react(&mut self, i: usize, e: &CmEvent) {
        let now = self.now;
        let node = &mut self.nodes[i];
        if !node.auto {
            return;
        }
        match e {
            CmEvent::ConnectRequest { id, req, .. } => {
                let params = AcceptParams {
                    local_qpn: 0x100 + (id.0 & 0xFFF),
                    starting_psn: id.0 & 0xFF_FFFF,
                    responder_resources: req.initiator_depth,
                    initiator_depth: req.responder_resources,
                    rnr_retry_count: 7,
                    ..AcceptParams::default()
                };
                node.cm.accept(now, *id, &params, b"welcome").unwrap();
            }
            CmEvent::ConnectResponse { id, .. } => node.cm.establish(*id).unwrap(),
            CmEvent::Disconnected { id, .. } if !node.disconnected.contains(id) => {
                node.disconnected.push(*id);
                node.cm.disconnect(now, *id, &[]).unwrap();
            }
            CmEvent::SidrRequest { id, .. } => {
                let params = SidrReplyParams {
                    status: sidr_status::SUCCESS,
                    qpn: 0x77,
                    qkey: RDMA_UDP_QKEY,
                };
                node.cm.sidr_reply(now, *id, &params, b"ud").unwrap();
            }
            _ => {}
        }
    }

    /// Runs until `done` holds or virtual time passes `limit` from now; returns whether `done`
    /// held. Bounded in steps, so it always returns.
    fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&Self) -> bool) -> bool {
        let end = self.now + limit;
        for _ in 0..10_000_000 {
            self.drain();
            if done(self) {
                return true;
            }
            let next_delivery = self.queue.peek().map(|d| d.0.at);
            let next_timer = self.nodes.iter().filter_map(|n| n.cm.poll_timeout()).min();
            let Some(next) = [next_delivery, next_timer].into_iter().flatten().min() else {
                return done(self);
            };
            if next > end {
                return false;
            }
            self.now = self.now.max(next);
            while self.queue.peek().is_some_and(|d| d.0.at <= self.now) {
                let Reverse(d) = self.queue.pop().unwrap();
                self.nodes[d.to].cm.handle_mad(self.now, d.from, &d.mad);
                self.drain();
            }
            for n in &mut self.nodes {
                if n.cm.poll_timeout().is_some_and(|t| t <= self.now) {
                    n.cm.handle_timeout(self.now);
                }
            }
        }
        panic!("simulation did not settle");
    }

    /// Runs until nothing is in flight and no timer is pending (or `limit` passes).
    fn settle(&mut self, limit: Duration) -> bool {
        self.run_until(limit, |n| {
            n.queue.is_empty() && n.nodes.iter().all(|x| x.cm.poll_timeout().is_none())
        })
    }

    fn connect(&mut self, from: usize, to: usize, user_data: &[u8]) -> CommId {
        let now = self.now;
        let pd = cma_private_data(from, to, 40000 + from as u16, user_data);
        let params = ConnectParams {
            service_id: sid(),
            local_qpn: 0x11 + from as u32,
            starting_psn: 0xABCDE,
            responder_resources: 4,
            initiator_depth: 2,
            path: softverbs_wire::cm::CmPathRepr {
                local_gid: self.nodes[from].gid.0,
                remote_gid: self.nodes[to].gid.0,
                ..ConnectParams::default().path
            },
            ..ConnectParams::default()
        };
        let dest = self.nodes[to].gid;
        self.nodes[from].cm.connect(now, dest, &params, &pd).unwrap()
    }

    /// The kinds of events node `i` reported about `id`, in order.
    fn seq_of(&self, i: usize, id: CommId) -> Vec<&'static str> {
        self.nodes[i]
            .events
            .iter()
            .filter(|(_, e)| e.comm_id() == Some(id))
            .map(|(_, e)| kind(e))
            .collect()
    }

    /// IDs of the connections node `i` got CONNECT_REQUEST for, in order.
    fn requests(&self, i: usize) -> Vec<CommId> {
        self.nodes[i]
            .events
            .iter()
            .filter_map(|(_, e)| match e {
                CmEvent::ConnectRequest { id, .. } => Some(*id),
                _ => None,
            })
            .collect()
    }

    /// The server node and connection of the client connection `client`.
    fn server_side(&self, client: CommId) -> (usize, CommId) {
        for (i, n) in self.nodes.iter().enumerate() {
            for (_, e) in &n.events {
                if let CmEvent::ConnectRequest { id, req, .. } = e {
                    if req.local_comm_id == client.0 {
                        return (i, *id);
                    }
                }
            }
        }
        panic!("no server saw {client:?}")
    }

    fn count(&self, i: usize, what: &str) -> usize {
        self.nodes[i]
            .events
            .iter()
            .filter(|(_, e)| kind(e) == what)
            .count()
    }
}

fn kind(e: &CmEvent) -> &'static str {
    match e {
        CmEvent::ConnectRequest { .. } => "CONNECT_REQUEST",
        CmEvent::ConnectResponse { .. } => "CONNECT_RESPONSE",
        CmEvent::Established { .. } => "ESTABLISHED",
        CmEvent::Rejected { .. } => "REJECTED",
        CmEvent::Unreachable { .. } => "UNREACHABLE",
        CmEvent::ConnectError { .. } => "CONNECT_ERROR",
        CmEvent::Disconnected { .. } => "DISCONNECTED",
        CmEvent::TimewaitExit { .. } => "TIMEWAIT_EXIT",
        CmEvent::SidrRequest { .. } => "SIDR_REQUEST",
        CmEvent::SidrReply { .. } => "SIDR_REPLY",
        CmEvent::SidrTimeout { .. } => "SIDR_TIMEOUT",
    }
}

fn cma_private_data(from: usize, to: usize, port: u16, user: &[u8]) -> Vec<u8> {
    let mut pd = vec![0u8; 36];
    let ip = |i: usize| IpAddr::V4(Ipv4Addr::new(10, 0, 0, u8::try_from(i + 1).unwrap()));
    CmaHeaderRepr {
        port,
        src_addr: ip(from),
        dst_addr: ip(to),
    }
    .emit(&mut CmaHeaderPacket::new_unchecked(&mut pd[..]));
    pd.extend_from_slice(user);
    pd
}

const MINUTE: Duration = Duration::from_secs(60);

#[test]
fn rc_active_and_passive_sequences() {
    let mut net = Net::new(2, 1);
    net.nodes[1].cm.listen(sid()).unwrap();
    let id = net.connect(0, 1, b"hello");
    assert!(net.run_until(MINUTE, |n| n.count(1, "ESTABLISHED") == 1));
    let server_id = net.requests(1)[0];
    // The request carries the connect parameters, swapped into the peer's view by rdma_cm.
    let (_, CmEvent::ConnectRequest { req, source, .. }) = &net.nodes[1].events[0] else {
        panic!("first event is not the request")
    };
    assert_eq!(*source, gid(0));
    assert_eq!((req.local_qpn, req.starting_psn), (0x11, 0xABCDE));
    assert_eq!((req.responder_resources, req.initiator_depth), (4, 2));
    assert_eq!((req.remote_cm_response_timeout, req.max_cm_retries), (20, 15));
    let hdr = CmaHeaderRepr::parse(&CmaHeaderPacket::new_checked(&req.private_data[..36]).unwrap()).unwrap();
    assert_eq!(
        (hdr.port, hdr.src_addr.to_string()),
        (40000, "10.0.0.1".to_owned())
    );
    assert_eq!(&req.private_data[36..41], b"hello");
    assert!(req.private_data[41..].iter().all(|&b| b == 0));
    // The response carries the accept parameters and all 196 bytes of private data.
    let rep = net.nodes[0]
        .events
        .iter()
        .find_map(|(_, e)| match e {
            CmEvent::ConnectResponse { rep, .. } => Some(rep.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(rep.local_qpn, 0x100 + (server_id.0 & 0xFFF));
    assert_eq!((rep.responder_resources, rep.initiator_depth), (2, 4));
    assert_eq!(&rep.private_data[..7], b"welcome");
    assert_eq!(rep.private_data.len(), private_data_len::REP);

    // The client disconnects; the server reports it and answers.
    let now = net.now;
    net.nodes[0].disconnected.push(id);
    net.nodes[0].cm.disconnect(now, id, &[]).unwrap();
    assert!(net.settle(MINUTE));
    assert_eq!(
        net.seq_of(0, id),
        ["CONNECT_RESPONSE", "ESTABLISHED", "DISCONNECTED", "TIMEWAIT_EXIT"]
    );
    assert_eq!(
        net.seq_of(1, server_id),
        ["CONNECT_REQUEST", "ESTABLISHED", "DISCONNECTED", "TIMEWAIT_EXIT"]
    );
    for n in &net.nodes {
        assert_eq!(n.cm.live_entries(), 0);
        assert_eq!(n.cm.stats().retransmitted, 0);
    }
    // The rdma_cm mapping of the statuses.
    let disc = &net.nodes[0].events[2].1;
    assert_eq!(disc.rdma_cm_event(), (10, 0));
}

#[test]
fn passive_side_needs_establish_only_for_connect_response() {
    // Without `auto`, the active side stays at CONNECT_RESPONSE until it establishes, and a
    // duplicate REP meanwhile is answered with an MRA, which keeps the passive side waiting
    // instead of timing out.
    let mut net = Net::new(2, 2);
    net.nodes[1].cm.listen(sid()).unwrap();
    net.nodes[0].auto = false;
    let id = net.connect(0, 1, &[]);
    assert!(net.run_until(MINUTE, |n| n.count(0, "CONNECT_RESPONSE") == 1));
    // Ten minutes pass: the REP is resent, answered by an MRA(24) (~68.7 s), resent again...
    assert!(!net.run_until(10 * MINUTE, |n| n.count(1, "CONNECT_ERROR") > 0));
    assert_eq!(net.count(1, "ESTABLISHED"), 0);
    net.nodes[0].cm.establish(id).unwrap();
    assert!(net.run_until(MINUTE, |n| n.count(1, "ESTABLISHED") == 1));
    assert_eq!(net.seq_of(0, id), ["CONNECT_RESPONSE", "ESTABLISHED"]);
    assert!(net.nodes[1].cm.stats().retransmitted >= 1, "the REP was resent");
}

#[test]
fn slow_passive_application_is_covered_by_mra() {
    // The server's application takes ten minutes to accept. The first REQ retry is answered
    // with an MRA(24), so the client waits ms(24) + ms(16) between tries instead of giving up
    // after 16 x 4608 ms.
    let mut net = Net::new(2, 15);
    net.nodes[1].cm.listen(sid()).unwrap();
    net.nodes[1].auto = false;
    let id = net.connect(0, 1, &[]);
    assert!(!net.run_until(10 * MINUTE, |n| n.count(0, "UNREACHABLE") > 0));
    assert_eq!(net.count(1, "CONNECT_REQUEST"), 1);
    let retries = net.nodes[0].cm.stats().retransmitted;
    let stretched = cm_timeout(24) + cm_timeout(16);
    assert!(retries >= 2 && u128::from(retries) <= 2 + (10 * MINUTE).as_millis() / stretched.as_millis());
    let server_id = net.requests(1)[0];
    let now = net.now;
    let params = AcceptParams {
        local_qpn: 0x99,
        starting_psn: 5,
        ..AcceptParams::default()
    };
    net.nodes[1].cm.accept(now, server_id, &params, &[]).unwrap();
    assert!(net.run_until(MINUTE, |n| n.count(1, "ESTABLISHED") == 1));
    assert_eq!(net.seq_of(0, id), ["CONNECT_RESPONSE", "ESTABLISHED"]);
}

#[test]
fn reject_with_private_data() {
    let mut net = Net::new(2, 3);
    net.nodes[1].cm.listen(sid()).unwrap();
    net.nodes[1].auto = false;
    let id = net.connect(0, 1, b"let me in");
    assert!(net.run_until(MINUTE, |n| n.count(1, "CONNECT_REQUEST") == 1));
    let server_id = net.requests(1)[0];
    let now = net.now;
    net.nodes[1]
        .cm
        .reject(now, server_id, rej_reason::CONSUMER_DEFINED, b"go away")
        .unwrap();
    assert!(net.settle(10 * MINUTE));
    assert_eq!(net.seq_of(0, id), ["REJECTED"]);
    let (
        _,
        CmEvent::Rejected {
            reason, private_data, ..
        },
    ) = &net.nodes[0].events[0]
    else {
        panic!("not rejected")
    };
    assert_eq!(*reason, rej_reason::CONSUMER_DEFINED);
    assert_eq!(&private_data[..7], b"go away");
    assert_eq!(private_data.len(), 148);
    assert_eq!(net.nodes[0].events[0].1.rdma_cm_event(), (8, 28));
    assert_eq!(net.seq_of(1, server_id), ["CONNECT_REQUEST"]);
    assert_eq!(net.nodes[0].cm.live_entries() + net.nodes[1].cm.live_entries(), 0);
}

#[test]
fn rejected_request_retried_gets_the_same_rej_not_a_second_request() {
    // The first REJ is lost: the REQ is retried and answered from the stored REJ.
    let mut net = Net::new(2, 4);
    net.nodes[1].cm.listen(sid()).unwrap();
    net.nodes[1].auto = false;
    let mut dropped = false;
    net.filter = Some(Box::new(move |_, m| {
        let drop = matches!(m, CmMessage::Rej(_)) && !dropped;
        dropped |= drop;
        drop
    }));
    let id = net.connect(0, 1, &[]);
    assert!(net.run_until(MINUTE, |n| n.count(1, "CONNECT_REQUEST") == 1));
    let server_id = net.requests(1)[0];
    let now = net.now;
    net.nodes[1]
        .cm
        .reject(now, server_id, rej_reason::CONSUMER_DEFINED, b"no")
        .unwrap();
    assert!(net.run_until(MINUTE, |n| n.count(0, "REJECTED") == 1));
    assert_eq!(net.seq_of(0, id), ["REJECTED"]);
    assert_eq!(net.count(1, "CONNECT_REQUEST"), 1);
    assert!(net.nodes[1].cm.stats().duplicates_answered >= 1);
}

#[test]
fn connect_to_port_nobody_listens_on() {
    let mut net = Net::new(2, 5);
    let id = net.connect(0, 1, &[]);
    assert!(net.settle(MINUTE));
    assert_eq!(net.seq_of(0, id), ["REJECTED"]);
    let (_, CmEvent::Rejected { reason, .. }) = &net.nodes[0].events[0] else {
        panic!("not rejected")
    };
    assert_eq!(*reason, rej_reason::INVALID_SERVICE_ID);
    assert!(net.nodes[1].events.is_empty());
    assert_eq!(net.nodes[0].cm.live_entries() + net.nodes[1].cm.live_entries(), 0);
}

#[test]
fn peer_that_never_answers_is_unreachable_after_the_retry_budget() {
    let mut net = Net::new(2, 6);
    net.nodes[1].cm.listen(sid()).unwrap();
    net.loss = 1.0;
    let start = net.now;
    let id = net.connect(0, 1, &[]);
    assert!(net.run_until(30 * MINUTE, |n| n.count(0, "UNREACHABLE") == 1));
    // 1 + 15 tries, each waiting 2 ms(16) + ms(20) = 4608 ms.
    let per_try = 2 * cm_timeout(16) + cm_timeout(20);
    assert_eq!(per_try, Duration::from_millis(4608));
    assert_eq!(net.now - start, per_try * 16);
    assert_eq!(net.nodes[0].cm.stats().retransmitted, 15);
    assert_eq!(net.sent, 16);
    assert_eq!(net.seq_of(0, id), ["UNREACHABLE"]);
    assert_eq!(net.nodes[0].events[0].1.rdma_cm_event(), (7, ETIMEDOUT_STATUS));
    assert_eq!(net.nodes[0].cm.live_entries(), 0);
}

#[test]
fn passive_side_gets_connect_error_when_the_rtu_never_comes() {
    let mut net = Net::new(2, 7);
    net.nodes[1].cm.listen(sid()).unwrap();
    // The client establishes, but its RTU (and its REJ, if any) never arrive.
    net.filter = Some(Box::new(|to, m| to == 1 && matches!(m, CmMessage::Rtu(_))));
    let _ = net.connect(0, 1, &[]);
    assert!(net.run_until(30 * MINUTE, |n| n.count(1, "CONNECT_ERROR") == 1));
    let server_id = net.requests(1)[0];
    assert_eq!(net.seq_of(1, server_id), ["CONNECT_REQUEST", "CONNECT_ERROR"]);
    assert_eq!(net.nodes[1].cm.stats().retransmitted, 15);
}

#[test]
fn disconnect_both_sides_at_once() {
    for seed in 0..20 {
        let mut net = Net::new(2, 100 + seed);
        net.jitter = Duration::from_micros(200);
        net.nodes[1].cm.listen(sid()).unwrap();
        let id = net.connect(0, 1, &[]);
        assert!(net.run_until(MINUTE, |n| n.count(1, "ESTABLISHED") == 1));
        let server_id = net.requests(1)[0];
        let now = net.now;
        for (i, cid) in [(0, id), (1, server_id)] {
            net.nodes[i].disconnected.push(cid);
            net.nodes[i].cm.disconnect(now, cid, &[]).unwrap();
        }
        assert!(net.settle(10 * MINUTE));
        let expect = ["ESTABLISHED", "DISCONNECTED", "TIMEWAIT_EXIT"];
        assert_eq!(net.seq_of(0, id)[1..], expect, "seed {seed}");
        assert_eq!(net.seq_of(1, server_id)[1..], expect, "seed {seed}");
        // Neither DREQ had to be resent: each was answered.
        assert_eq!(
            net.nodes[0].cm.stats().retransmitted + net.nodes[1].cm.stats().retransmitted,
            0
        );
        assert_eq!(net.nodes[0].cm.live_entries() + net.nodes[1].cm.live_entries(), 0);
    }
}

#[test]
fn lost_dreq_is_retried() {
    let mut net = Net::new(2, 8);
    net.nodes[1].cm.listen(sid()).unwrap();
    let id = net.connect(0, 1, &[]);
    assert!(net.run_until(MINUTE, |n| n.count(1, "ESTABLISHED") == 1));
    let mut drops = 0;
    net.filter = Some(Box::new(move |_, m| {
        let drop = matches!(m, CmMessage::Dreq(_)) && drops < 2;
        drops += u32::from(drop);
        drop
    }));
    let now = net.now;
    net.nodes[0].disconnected.push(id);
    net.nodes[0].cm.disconnect(now, id, &[]).unwrap();
    let start = net.now;
    assert!(net.run_until(MINUTE, |n| n.count(1, "DISCONNECTED") == 1));
    // Two DREQs lost: the third arrives after two timeouts of 4608 ms.
    assert!(net.now - start >= 2 * Duration::from_millis(4608));
    assert!(net.settle(10 * MINUTE));
    assert_eq!(
        net.seq_of(0, id),
        ["CONNECT_RESPONSE", "ESTABLISHED", "DISCONNECTED", "TIMEWAIT_EXIT"]
    );
    assert_eq!(net.nodes[0].cm.stats().retransmitted, 2);
    assert_eq!(net.nodes[0].cm.live_entries() + net.nodes[1].cm.live_entries(), 0);
}

#[test]
fn lost_drep_is_answered_again_and_unknown_dreq_gets_a_drep() {
    // Every DREP to the client is lost until the server has forgotten the connection; the
    // server still answers the retried DREQs, from timewait and then statelessly.
    let mut net = Net::new(2, 9);
    net.nodes[1].cm.listen(sid()).unwrap();
    let id = net.connect(0, 1, &[]);
    assert!(net.run_until(MINUTE, |n| n.count(1, "ESTABLISHED") == 1));
    let server_id = net.requests(1)[0];
    let mut drops = 0;
    net.filter = Some(Box::new(move |_, m| {
        let drop = matches!(m, CmMessage::Drep(_)) && drops < 3;
        drops += u32::from(drop);
        drop
    }));
    let now = net.now;
    net.nodes[0].disconnected.push(id);
    net.nodes[0].cm.disconnect(now, id, &[]).unwrap();
    assert!(net.settle(10 * MINUTE));
    assert_eq!(net.seq_of(0, id)[2..], ["DISCONNECTED", "TIMEWAIT_EXIT"]);
    let (_, CmEvent::Disconnected { timed_out, .. }) = net.nodes[0]
        .events
        .iter()
        .find(|(_, e)| kind(e) == "DISCONNECTED")
        .unwrap()
    else {
        unreachable!()
    };
    assert!(!timed_out, "the DREQ was answered in the end");
    assert_eq!(net.seq_of(1, server_id)[2..], ["DISCONNECTED", "TIMEWAIT_EXIT"]);
    assert_eq!(net.nodes[0].cm.live_entries() + net.nodes[1].cm.live_entries(), 0);
}

#[test]
fn dreq_that_is_never_answered_times_out() {
    let mut net = Net::new(2, 10);
    net.nodes[1].cm.listen(sid()).unwrap();
    let id = net.connect(0, 1, &[]);
    assert!(net.run_until(MINUTE, |n| n.count(1, "ESTABLISHED") == 1));
    net.loss = 1.0;
    let now = net.now;
    net.nodes[0].disconnected.push(id);
    net.nodes[0].cm.disconnect(now, id, &[]).unwrap();
    assert!(net.settle(30 * MINUTE));
    let last_two: Vec<_> = net.nodes[0]
        .events
        .iter()
        .rev()
        .take(2)
        .map(|(_, e)| e.clone())
        .collect();
    assert_eq!(last_two[0], CmEvent::TimewaitExit { id });
    assert_eq!(last_two[1], CmEvent::Disconnected { id, timed_out: true });
    assert_eq!(last_two[1].rdma_cm_event(), (10, ETIMEDOUT_STATUS));
}

#[test]
fn ud_sidr_sequences() {
    let mut net = Net::new(2, 11);
    let udp = service_id(PortSpace::Udp, 7174);
    net.nodes[1].cm.listen(udp).unwrap();
    let now = net.now;
    let pd = cma_private_data(0, 1, 40001, b"ud hello");
    let req = net.nodes[0]
        .cm
        .sidr_request(now, gid(1), udp, 0xFFFF, &pd)
        .unwrap();
    assert!(net.settle(10 * MINUTE));
    let kinds: Vec<_> = net.nodes[1].events.iter().map(|(_, e)| kind(e)).collect();
    assert_eq!(
        kinds,
        ["SIDR_REQUEST"],
        "the passive side gets nothing after its reply"
    );
    let (_, CmEvent::SidrRequest { req: sreq, .. }) = &net.nodes[1].events[0] else {
        unreachable!()
    };
    assert_eq!(&sreq.private_data[36..44], b"ud hello");
    assert_eq!(sreq.private_data.len() - 36, 180);
    let [(_, CmEvent::SidrReply { id, rep })] = &net.nodes[0].events[..] else {
        panic!("{:?}", net.nodes[0].events)
    };
    assert_eq!(*id, req);
    assert_eq!((rep.status, rep.qpn, rep.qkey), (0, 0x77, RDMA_UDP_QKEY));
    assert_eq!(&rep.private_data[..2], b"ud");
    assert_eq!(net.nodes[0].events[0].1.rdma_cm_event(), (9, 0));

    // Nobody listens on another port: status 1, which rdma_cm reports as UNREACHABLE.
    let now = net.now;
    net.nodes[0]
        .cm
        .sidr_request(now, gid(1), service_id(PortSpace::Udp, 1), 0xFFFF, &pd)
        .unwrap();
    assert!(net.settle(10 * MINUTE));
    let (_, last) = net.nodes[0].events.last().unwrap();
    let CmEvent::SidrReply { rep, .. } = last else {
        panic!("{last:?}")
    };
    assert_eq!(rep.status, sidr_status::UNSUPPORTED);
    assert_eq!(last.rdma_cm_event(), (7, 1));

    // A peer that never answers: SIDR_TIMEOUT after 1 + 15 tries of ms(20).
    net.loss = 1.0;
    let start = net.now;
    let now = net.now;
    net.nodes[0]
        .cm
        .sidr_request(now, gid(1), udp, 0xFFFF, &pd)
        .unwrap();
    assert!(net.settle(30 * MINUTE));
    assert_eq!(kind(&net.nodes[0].events.last().unwrap().1), "SIDR_TIMEOUT");
    assert_eq!(net.now - start, cm_timeout(20) * 16);
    for n in &net.nodes {
        assert_eq!(n.cm.live_entries(), 0);
    }
}

#[test]
fn sidr_under_loss_and_duplication_reports_once() {
    for seed in 0..10 {
        let mut net = Net::new(2, 200 + seed);
        net.loss = 0.3;
        net.dup = 0.3;
        net.jitter = Duration::from_millis(2);
        let udp = service_id(PortSpace::Udp, 7174);
        net.nodes[1].cm.listen(udp).unwrap();
        let now = net.now;
        net.nodes[0]
            .cm
            .sidr_request(now, gid(1), udp, 0xFFFF, &[])
            .unwrap();
        assert!(net.settle(30 * MINUTE));
        assert_eq!(net.count(1, "SIDR_REQUEST"), 1, "seed {seed}");
        let outcome: Vec<_> = net.nodes[0].events.iter().map(|(_, e)| kind(e)).collect();
        assert!(
            outcome == ["SIDR_REPLY"] || outcome == ["SIDR_TIMEOUT"],
            "seed {seed}: {outcome:?}"
        );
        assert_eq!(net.nodes[0].cm.live_entries() + net.nodes[1].cm.live_entries(), 0);
    }
}

#[test]
fn stale_connection_in_timewait_is_rejected() {
    // A REQ that reuses a QPN the server still holds in timewait gets STALE_CONN.
    let mut net = Net::new(2, 12);
    net.nodes[1].cm.listen(sid()).unwrap();
    let id = net.connect(0, 1, &[]);
    assert!(net.run_until(MINUTE, |n| n.count(1, "ESTABLISHED") == 1));
    let now = net.now;
    net.nodes[0].disconnected.push(id);
    net.nodes[0].cm.disconnect(now, id, &[]).unwrap();
    // Run until the server is in timewait, but not out of it.
    assert!(net.run_until(MINUTE, |n| n.count(1, "DISCONNECTED") == 1
        && n.count(0, "DISCONNECTED") == 1));
    assert_eq!(net.count(1, "TIMEWAIT_EXIT"), 0);
    let again = net.connect(0, 1, &[]); // same local QPN (0x11)
    assert!(net.run_until(MINUTE, |n| n.seq_of(0, again).contains(&"REJECTED")));
    let reason = net.nodes[0].events.iter().find_map(|(_, e)| match e {
        CmEvent::Rejected { id, reason, .. } if *id == again => Some(*reason),
        _ => None,
    });
    assert_eq!(reason, Some(rej_reason::STALE_CONN));
    // Once timewait is over the same QPN connects.
    assert!(net.settle(10 * MINUTE));
    let third = net.connect(0, 1, &[]);
    assert!(net.run_until(MINUTE, |n| n.seq_of(0, third).contains(&"ESTABLISHED")));
}

#[test]
fn three_nodes_many_connections_set_up_and_torn_down_leave_no_state() {
    let mut net = Net::new(3, 13);
    net.nodes[2].cm.listen(sid()).unwrap();
    net.nodes[1].cm.listen(sid()).unwrap();
    let mut ids = Vec::new();
    for k in 0..1000 {
        let (from, to) = [(0, 2), (1, 2), (0, 1)][k % 3];
        ids.push((from, net.connect(from, to, &[])));
    }
    assert!(
        net.run_until(MINUTE, |n| n.count(0, "ESTABLISHED") + n.count(1, "ESTABLISHED")
            >= 1000 + 333)
    );
    // Every client-side connection is established; the servers saw every request once.
    for (from, id) in &ids {
        assert_eq!(net.seq_of(*from, *id), ["CONNECT_RESPONSE", "ESTABLISHED"]);
    }
    assert_eq!(net.requests(1).len() + net.requests(2).len(), 1000);
    let live: Vec<usize> = net.nodes.iter().map(|n| n.cm.live_entries()).collect();
    assert_eq!(live, [667, 666, 667]);
    // Tear down: clients and servers alternate as the side that disconnects first.
    let now = net.now;
    for (k, (from, id)) in ids.iter().enumerate() {
        if k % 2 == 0 {
            net.nodes[*from].disconnected.push(*id);
            net.nodes[*from].cm.disconnect(now, *id, &[]).unwrap();
        } else {
            let (server, server_id) = net.server_side(*id);
            net.nodes[server].disconnected.push(server_id);
            net.nodes[server].cm.disconnect(now, server_id, &[]).unwrap();
        }
    }
    assert!(net.settle(10 * MINUTE));
    let exits: usize = (0..3).map(|i| net.count(i, "TIMEWAIT_EXIT")).sum();
    assert_eq!(exits, 2000);
    for n in &net.nodes {
        assert_eq!(n.cm.live_entries(), 0);
        assert_eq!(n.cm.poll_timeout(), None);
    }
}

#[test]
fn five_percent_loss_every_connection_established_and_torn_down() {
    for seed in 0..4 {
        let mut net = Net::new(2, 300 + seed);
        net.loss = 0.05;
        net.dup = 0.02;
        net.jitter = Duration::from_millis(1);
        net.nodes[1].cm.listen(sid()).unwrap();
        let ids: Vec<_> = (0..200).map(|_| net.connect(0, 1, &[])).collect();
        assert!(
            net.run_until(30 * MINUTE, |n| n.count(0, "ESTABLISHED") == 200
                && n.count(1, "ESTABLISHED") == 200),
            "seed {seed}: {} / {} established",
            net.count(0, "ESTABLISHED"),
            net.count(1, "ESTABLISHED")
        );
        assert_eq!(
            net.requests(1).len(),
            200,
            "seed {seed}: one request per connection"
        );
        for id in &ids {
            assert_eq!(
                net.seq_of(0, *id),
                ["CONNECT_RESPONSE", "ESTABLISHED"],
                "seed {seed}"
            );
        }
        let now = net.now;
        for id in &ids {
            net.nodes[0].disconnected.push(*id);
            net.nodes[0].cm.disconnect(now, *id, &[]).unwrap();
        }
        assert!(net.settle(60 * MINUTE), "seed {seed}");
        for id in &ids {
            assert_eq!(
                net.seq_of(0, *id)[2..],
                ["DISCONNECTED", "TIMEWAIT_EXIT"],
                "seed {seed}"
            );
        }
        for id in net.requests(1) {
            assert_eq!(
                net.seq_of(1, id),
                ["CONNECT_REQUEST", "ESTABLISHED", "DISCONNECTED", "TIMEWAIT_EXIT"],
                "seed {seed}"
            );
        }
        assert!(net.nodes[0].cm.stats().retransmitted > 0, "loss caused retries");
        assert_eq!(net.nodes[0].cm.live_entries() + net.nodes[1].cm.live_entries(), 0);
    }
}

#[test]
fn destroyed_ids_finish_quietly() {
    let mut net = Net::new(2, 14);
    net.nodes[1].cm.listen(sid()).unwrap();
    let id = net.connect(0, 1, &[]);
    assert!(net.run_until(MINUTE, |n| n.count(1, "ESTABLISHED") == 1));
    let before = net.nodes[0].events.len();
    let now = net.now;
    net.nodes[0].cm.destroy(now, id).unwrap();
    assert!(net.settle(10 * MINUTE));
    assert_eq!(net.nodes[0].events.len(), before, "no events after destroy");
    let server_id = net.requests(1)[0];
    assert_eq!(net.seq_of(1, server_id)[2..], ["DISCONNECTED", "TIMEWAIT_EXIT"]);
    assert_eq!(net.nodes[0].cm.live_entries() + net.nodes[1].cm.live_entries(), 0);
    assert_eq!(
        net.nodes[0].cm.destroy(now, id),
        Err(softverbs_engine::cm::CmError::UnknownId)
    );
}

#[test]
fn heavy_loss_duplication_and_reordering_report_each_event_once() {
    for seed in 0..8 {
        let mut net = Net::new(2, 400 + seed);
        net.loss = 0.2;
        net.dup = 0.2;
        net.jitter = Duration::from_millis(20);
        net.nodes[1].cm.listen(sid()).unwrap();
        let ids: Vec<_> = (0..50).map(|_| net.connect(0, 1, &[])).collect();
        assert!(
            net.run_until(60 * MINUTE, |n| n.count(0, "ESTABLISHED") == 50
                && n.count(1, "ESTABLISHED") == 50),
            "seed {seed}"
        );
        let now = net.now;
        for (k, id) in ids.iter().enumerate() {
            if k % 2 == 0 {
                net.nodes[0].disconnected.push(*id);
                net.nodes[0].cm.disconnect(now, *id, &[]).unwrap();
            } else {
                let (server, server_id) = net.server_side(*id);
                net.nodes[server].disconnected.push(server_id);
                net.nodes[server].cm.disconnect(now, server_id, &[]).unwrap();
            }
        }
        assert!(net.settle(60 * MINUTE), "seed {seed}");
        for id in &ids {
            assert_eq!(
                net.seq_of(0, *id),
                ["CONNECT_RESPONSE", "ESTABLISHED", "DISCONNECTED", "TIMEWAIT_EXIT"],
                "seed {seed}"
            );
        }
        assert_eq!(net.requests(1).len(), 50, "seed {seed}");
        for id in net.requests(1) {
            assert_eq!(
                net.seq_of(1, id),
                ["CONNECT_REQUEST", "ESTABLISHED", "DISCONNECTED", "TIMEWAIT_EXIT"],
                "seed {seed}"
            );
        }
        assert!(
            net.nodes[0].cm.stats().duplicates_answered + net.nodes[1].cm.stats().duplicates_answered > 0
        );
        assert_eq!(net.nodes[0].cm.live_entries() + net.nodes[1].cm.live_entries(), 0);
    }
}
