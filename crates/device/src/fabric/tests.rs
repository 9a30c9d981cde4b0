use super::outbox::{same_link, Run, ACK_LEN, OUTBOX_PACKETS};
use super::*;
use softverbs_engine::transport::ExternalRanges;

use softverbs_engine::transport::Dest;
use softverbs_wire::{BthPacket, BthRepr, Opcode, Psn};

/// An endpoint that records what the fabric hands it (no QP behind it: the fabric needs
/// nothing of a QP but the `Endpoint` trait).
#[derive(Debug, Default)]
struct Probe {
    qpn: u32,
    got: Mutex<Vec<(Vec<u8>, RxMeta)>>,
    released: Mutex<Vec<u64>>,
}

impl Endpoint for Probe {
    fn number(&self) -> u32 {
        self.qpn
    }

    fn receive_packet(
        &self,
        _now: Instant,
        pkt: &ParsedPacket<'_>,
        _ext: Option<&dyn ExternalPayload>,
        meta: &RxMeta,
        _pending: &Pending,
        _more: bool,
    ) -> Received {
        let mut got = self.got.lock();
        got.push((pkt.payload.to_vec(), *meta));
        Received {
            txs: Vec::new(),
            ticket: Some(got.len() as u64),
            dropped: None,
            ack_held: false,
        }
    }

    fn end_batch(&self, _now: Instant) -> (Vec<Transmit>, u64) {
        unreachable!("a probe holds no ACK")
    }

    fn release_ticket(&self, ticket: u64) {
        self.released.lock().push(ticket);
    }

    fn fail_ticket(&self, _ticket: u64) {
        unreachable!("no payload is left in memory in these tests")
    }

    fn next_deadline(&self) -> Option<Instant> {
        None
    }

    fn on_timeout(&self, _now: Instant) {}

    type Steering = ();

    fn steer(_: &(), _: &ParsedPacket<'_>, _: &RxMeta, _: (u16, u16), _: usize, _: &mut Vec<Arc<Self>>) {}
}

/// An RC SEND ONLY to `qpn` carrying `payload` (4 bytes, so no pad), with a zero ICRC.
fn send_only(qpn: u32, payload: [u8; 4]) -> Vec<u8> {
    let mut p = vec![0u8; 12];
    BthRepr::new(Opcode::RcSendOnly, qpn, Psn::new(1)).emit(&mut BthPacket::new_unchecked(&mut p[..]));
    p.extend_from_slice(&payload);
    p.extend_from_slice(&[0; 4]);
    p
}

fn to(dgid: Gid, data: Vec<u8>) -> Transmit {
    Transmit {
        dest: Dest {
            dgid,
            sgid_index: 0,
            traffic_class: 5,
            hop_limit: 7,
            flow_label: 0,
        },
        data,
        external: None,
    }
}

#[test]
fn an_outbox_keeps_the_last_ack_per_qp_and_each_payload_note_with_its_packet() {
    let gid = Gid::from_ip("10.0.0.1".parse().unwrap());
    let peer = Gid::from_ip("10.0.0.2".parse().unwrap());
    let fabric = Fabric::<Probe>::new().unwrap();
    let node = fabric.add_node(NodeCounters::default(), &[gid], 1);
    let route = Route {
        sgid: gid,
        dgid: peer,
        dest_qpn: 0x11,
        traffic_class: 0,
        hop_limit: 64,
        ifindex: 1,
        ports: (4792, 4793),
    };
    let run = || Run {
        from: Arc::clone(&node),
        route,
        local_host: false,
        packets: Vec::new(),
        exts: Vec::new(),
    };
    let mut ext = ExternalRanges::default();
    assert!(ext.push(0x1000, 2048));
    let notes = |r: &Run<Probe>| -> Vec<Option<ExternalRanges>> {
        (0..r.packets.len())
            .map(|i| r.exts.get(i).copied().flatten())
            .collect()
    };
    let mut out = Outbox::default();

    // Requests only: queued as they are; a payload note stays with its packet.
    let mut reqs = run();
    reqs.push(send_only(0x11, [1; 4]), None);
    reqs.push(ack(0x12, 1, false), None);
    reqs.push(send_only(0x11, [2; 4]), Some(ext));
    reqs.push(send_only(0x11, [3; 4]), None);
    out.push(reqs);
    assert_eq!(out.packets, 4);
    assert_eq!(
        out.runs[0].exts,
        [None, None, Some(ext)],
        "trailing packets without notes need no entry"
    );

    // A later ACK to QP 0x12 replaces the waiting one; within a run only the last to each QP
    // stays.
    let mut acks = run();
    acks.push(ack(0x12, 2, false), None);
    acks.push(ack(0x13, 1, false), None);
    acks.push(ack(0x12, 3, false), None);
    out.push(acks);
    let waiting: Vec<Vec<u8>> = out.runs.iter().flat_map(|r| r.packets.clone()).collect();
    assert_eq!(
        waiting,
        [
            send_only(0x11, [1; 4]),
            send_only(0x11, [2; 4]),
            send_only(0x11, [3; 4]),
            ack(0x13, 1, false),
            ack(0x12, 3, false)
        ]
    );
    assert_eq!(
        notes(&out.runs[0]),
        [None, Some(ext), None],
        "the note moved with its packet"
    );
    assert_eq!(out.packets, 5);
    assert_eq!(out.bytes, 3 * send_only(0x11, [0; 4]).len() + 2 * ACK_LEN);
    assert_eq!(node.counters.tx_acks_coalesced().load(Ordering::Relaxed), 2);

    // Runs along one link join with their notes where they were.
    let mut a = run();
    a.push(send_only(0x11, [4; 4]), None);
    let mut b = run();
    b.push(send_only(0x11, [5; 4]), None);
    b.push(send_only(0x11, [6; 4]), Some(ext));
    a.append(b);
    assert_eq!(a.packets.len(), 3);
    assert_eq!(notes(&a), [None, None, Some(ext)]);
    let mut c = run();
    c.push(send_only(0x11, [7; 4]), None);
    a.append(c);
    assert_eq!(notes(&a), [None, None, Some(ext), None]);
}

#[test]
fn routes_between_nodes_through_the_in_process_driver() {
    let gid = |s: &str| Gid::from_ip(s.parse().unwrap());
    let (ga, gb, group) = (gid("10.0.0.1"), gid("10.0.0.2"), gid("ff0e::1"));
    let fabric = Fabric::<Probe>::new().unwrap();
    let a = fabric.add_node(NodeCounters::default(), &[ga], 1);
    let b = fabric.add_node(NodeCounters::default(), &[gb], 1);
    let probe = Arc::new(Probe {
        qpn: 0x11,
        ..Probe::default()
    });
    b.add_qp(&probe);
    b.mcast.lock().groups.entry(group).or_default().insert(0x11);

    fabric.send_all(
        &a,
        vec![
            to(gb, send_only(0x11, *b"one.")),
            // No such QP here, and no UDP driver yet: counted as unroutable.
            to(gb, send_only(0x12, *b"lost")),
            to(group, send_only(MULTICAST_QPN, *b"all.")),
        ],
    );
    // The progress thread may be driving the node at the same time (then this drive
    // returns at once and that thread delivers): wait, bounded, for both packets.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while probe.released.lock().len() < 2 && std::time::Instant::now() < deadline {
        fabric.drive(fabric.now());
        std::thread::yield_now();
    }

    let meta = |dgid| RxMeta {
        sgid: ga,
        dgid,
        traffic_class: 5,
        hop_limit: 7,
    };
    assert_eq!(
        *probe.got.lock(),
        [(b"one.".to_vec(), meta(gb)), (b"all.".to_vec(), meta(group))],
        "in order, with the sender's addresses"
    );
    assert_eq!(
        *probe.released.lock(),
        [1, 2],
        "every ticket released after its send"
    );
    let (ca, cb) = (a.counters.snapshot(), b.counters.snapshot());
    assert_eq!((ca.tx_packets, ca.tx_unroutable), (3, 1));
    assert_eq!((cb.rx_packets, cb.rx_unknown_qp), (2, 0));
}

/// A packet for a QP of another process (no such node here, and no UDP driver: counted as
/// unroutable once it is sent).
fn away(qpn: u32, payload: [u8; 4]) -> Transmit {
    to(Gid::from_ip("10.9.9.9".parse().unwrap()), send_only(qpn, payload))
}

#[test]
fn posted_packets_wait_for_the_next_poll_of_a_busy_poller() {
    let fabric = Fabric::<Probe>::new().unwrap();
    // However slow this host: a poll and the posts after it are always one burst.
    fabric.burst_after_poll.store(u64::MAX, Ordering::Relaxed);
    let a = fabric.add_node(
        NodeCounters::default(),
        &[Gid::from_ip("10.0.0.4".parse().unwrap())],
        1,
    );
    let qp = Arc::new(Probe::default());
    let unroutable = || a.counters.snapshot().tx_unroutable;
    let post = |payload: &[u8; 4], ticket: u64, hold: Hold| {
        fabric.send_then_release(
            &a,
            vec![away(0x20_0011, *payload)],
            vec![(qp.clone(), ticket)],
            hold,
            None,
        );
    };

    // No application has polled: nothing would send them, so they go at once.
    post(b"now.", 1, Hold::Posted);
    assert_eq!((unroutable(), qp.released.lock().clone()), (1, vec![1]));

    // After a poll the first post goes at once (the program may sleep next); the rest of
    // the burst waits for the next poll, and so do their completions.
    fabric.polled(fabric.now());
    post(b"1st.", 2, Hold::Posted);
    assert_eq!((unroutable(), qp.released.lock().clone()), (2, vec![1, 2]));
    post(b"one.", 3, Hold::Posted);
    post(b"two.", 4, Hold::Posted);
    assert_eq!(unroutable(), 2, "held back");
    assert_eq!(*qp.released.lock(), [1, 2], "completions wait for their packets");
    fabric.progress(fabric.now());
    assert_eq!(unroutable(), 4, "sent by the poll");
    assert_eq!(*qp.released.lock(), [1, 2, 3, 4]);

    // Responses wait only during a receive pass.
    let released = || qp.released.lock().clone();
    post(b"rsp.", 5, Hold::InPass);
    assert_eq!(unroutable(), 5);
    {
        let _pass = ReceivePass::new(&fabric);
        post(b"rsp.", 6, Hold::InPass);
        assert_eq!(unroutable(), 5, "until the pass ends");
    }
    assert_eq!((unroutable(), released()), (6, vec![1, 2, 3, 4, 5, 6]));

    // Packets that may not wait (timers, ...) take the waiting ones with them, in order.
    post(b"1st.", 7, Hold::Posted);
    post(b"pst.", 8, Hold::Posted);
    assert_eq!(unroutable(), 7, "the second post waits");
    post(b"now.", 9, Hold::No);
    assert_eq!(unroutable(), 9);
    assert_eq!(released(), (1..=9).collect::<Vec<u64>>());

    // A full batch does not wait.
    let burst: Vec<Transmit> = (0..OUTBOX_PACKETS).map(|_| away(0x20_0011, *b"many")).collect();
    fabric.send_then_release(&a, burst, vec![(qp.clone(), 10)], Hold::Posted, None);
    assert_eq!(unroutable(), 9 + OUTBOX_PACKETS as u64);
    assert_eq!(released().last(), Some(&10));

    // Nothing to send: the completions wait behind the packets that wait, if any.
    post(b"one.", 11, Hold::Posted);
    fabric.send_then_release(&a, Vec::new(), vec![(qp.clone(), 12)], Hold::Posted, None);
    assert_eq!(released().last(), Some(&10), "held behind 11's packet");
    fabric.polled(fabric.now());
    assert_eq!(unroutable(), 10 + OUTBOX_PACKETS as u64);
    assert_eq!(released().last(), Some(&12));
    fabric.send_then_release(&a, Vec::new(), vec![(qp.clone(), 13)], Hold::Posted, None);
    assert_eq!(released().last(), Some(&13), "nothing waits: released at once");
}

/// A lone packet for another process's mailbox goes straight into its ring, counted as the
/// general path counts it; behind packets waiting in the outbox it keeps its place; to a slot
/// with no mailbox it goes over UDP.
#[test]
fn a_lone_packet_for_a_mailbox_goes_straight_into_its_ring() {
    let fabric = Fabric::<Probe>::new().unwrap();
    fabric.burst_after_poll.store(u64::MAX, Ordering::Relaxed);
    let base = crate::udp::tests::free_base_port();
    let own = fabric.start_udp(base, 3).expect("a UDP slot").slot();
    assert!(
        fabric.shm.get().is_some(),
        "the shared-memory driver runs (SOFTVERBS_SHM unset)"
    );
    let here = Gid::from_ip("127.0.0.1".parse().unwrap());
    let a = fabric.add_node(NodeCounters::default(), &[here], 1);
    // Another process's mailbox, on another slot: a second driver of this process stands in.
    let (peer_slot, empty_slot) = match own {
        1 => (2, 3),
        2 => (3, 1),
        _ => (1, 2),
    };
    let peer = Shm::start(base + u16::from(peer_slot), fabric.epoch).expect("a second mailbox");
    let qpn = |slot: u8| (u32::from(slot) << 16) | 0x11;
    let qp = Arc::new(Probe::default());
    let send = |dgid: Gid, slot: u8, payload: &[u8; 4], ticket: u64, hold: Hold| {
        fabric.send_then_release(
            &a,
            vec![to(dgid, send_only(qpn(slot), *payload))],
            vec![(qp.clone(), ticket)],
            hold,
            None,
        );
    };
    let received = || {
        let mut batch = PacketBatch::default();
        peer.recv(&mut batch);
        batch
            .iter()
            .map(|(data, _)| data[12..16].to_vec())
            .collect::<Vec<_>>()
    };
    let released = || qp.released.lock().clone();

    send(here, peer_slot, b"one.", 1, Hold::Posted);
    assert_eq!(received(), [b"one.".to_vec()], "in the ring at once");
    assert_eq!(released(), [1]);
    let c = a.counters.snapshot();
    assert_eq!((c.tx_packets, c.tx_shm_packets, c.tx_unroutable), (1, 1, 0));
    assert_eq!(c.tx_bytes, send_only(0, [0; 4]).len() as u64);

    // A burst over UDP (to an address of this host that no node of the fabric has) waits in
    // the outbox after the first post; a lone packet for the mailbox then goes behind it.
    let elsewhere = Gid::from_ip("127.0.0.2".parse().unwrap());
    fabric.polled(fabric.now());
    send(elsewhere, peer_slot, b"udp1", 2, Hold::Posted);
    send(elsewhere, peer_slot, b"udp2", 3, Hold::Posted);
    // The second post waits, unless a receive thread's upkeep (every 200 us while packets
    // wait) has sent it already: either way it is released before what follows it.
    assert!(released().starts_with(&[1, 2]) && released().len() <= 3);
    send(here, peer_slot, b"two.", 4, Hold::No);
    assert_eq!(released(), [1, 2, 3, 4], "the waiting packet left first");
    assert_eq!(received(), [b"two.".to_vec()]);
    let c = a.counters.snapshot();
    assert_eq!((c.tx_packets, c.tx_shm_packets, c.tx_unroutable), (4, 2, 0));

    // No mailbox on that slot: over UDP, as the general path sends it.
    send(here, empty_slot, b"nomb", 5, Hold::No);
    assert_eq!(released(), [1, 2, 3, 4, 5]);
    let c = a.counters.snapshot();
    assert_eq!((c.tx_packets, c.tx_shm_packets, c.tx_unroutable), (5, 2, 0));
    assert!(received().is_empty());
}

/// A positive ACK (or, with `nak`, a sequence-error NAK) to `qpn` for `psn`.
fn ack(qpn: u32, psn: u32, nak: bool) -> Vec<u8> {
    use softverbs_wire::aeth::{AethRepr, AethSyndrome, NakCode};
    use softverbs_wire::PacketRepr;
    let mut repr = PacketRepr::new(BthRepr::new(Opcode::RcAcknowledge, qpn, Psn::new(psn)), 0);
    let syndrome = if nak {
        AethSyndrome::Nak(NakCode::PsnSequenceError)
    } else {
        AethSyndrome::ACK_UNLIMITED
    };
    repr.aeth = Some(AethRepr { syndrome, msn: psn });
    let mut buf = vec![0u8; repr.buffer_len()];
    repr.emit(&mut buf).unwrap();
    buf
}

#[test]
fn the_outbox_keeps_the_newest_ack_of_each_qp() {
    let fabric = Fabric::<Probe>::new().unwrap();
    let a = fabric.add_node(
        NodeCounters::default(),
        &[Gid::from_ip("10.0.0.5".parse().unwrap())],
        1,
    );
    let peer = Gid::from_ip("10.9.9.8".parse().unwrap());
    let run = |packets: Vec<Vec<u8>>| {
        fabric
            .route(&a, packets.into_iter().map(|p| to(peer, p)).collect())
            .into_iter()
            .next()
            .expect("one run")
    };
    let mut out = Outbox::default();
    out.push(run(vec![
        ack(0x20_0011, 1, false),
        send_only(0x20_0011, *b"req."),
        ack(0x20_0012, 7, false),
    ]));
    out.push(run(vec![
        ack(0x20_0011, 2, true),
        ack(0x20_0011, 3, false),
        ack(0x20_0011, 4, false),
    ]));
    let left: Vec<Vec<u8>> = out.runs.iter().flat_map(|r| r.packets.clone()).collect();
    assert_eq!(
        left,
        [
            send_only(0x20_0011, *b"req."),
            ack(0x20_0012, 7, false),
            ack(0x20_0011, 2, true),
            ack(0x20_0011, 4, false),
        ],
        "requests, NAKs and other QPs' ACKs stay, in order; one ACK per QP, the newest"
    );
    assert_eq!(out.packets, 4);
    assert_eq!(out.bytes, left.iter().map(Vec::len).sum::<usize>());
}

#[test]
fn runs_to_one_process_form_one_link() {
    let g = Gid::from_ip("10.9.9.7".parse().unwrap());
    let route = |dest_qpn, dgid| Route {
        sgid: Gid::ZERO,
        dgid,
        dest_qpn,
        traffic_class: 0,
        hop_limit: 64,
        ifindex: 1,
        ports: (4792, 4793),
    };
    assert!(same_link(&route(0x02_0011, g), &route(0x02_0012, g)));
    assert!(!same_link(&route(0x02_0011, g), &route(0x02_0011, Gid::ZERO)));
    assert!(!same_link(&route(0x02_0011, g), &route(MULTICAST_QPN, g)));
    assert!(same_link(&route(MULTICAST_QPN, g), &route(MULTICAST_QPN, g)));
    let other_port = Route {
        ports: (4792, 4794),
        ..route(0x03_0011, g)
    };
    assert!(!same_link(&route(0x02_0011, g), &other_port));
}

/// A QP1 handler that records the MADs it gets and has one timer.
#[derive(Default)]
struct GsiProbe {
    got: Mutex<Vec<(Vec<u8>, Gid)>>,
    deadline: Mutex<Option<Instant>>,
    fired: Mutex<u32>,
}

impl Gsi for GsiProbe {
    fn receive(&self, _now: Instant, pkt: &ParsedPacket<'_>, meta: &RxMeta) -> Vec<Transmit> {
        self.got.lock().push((pkt.payload.to_vec(), meta.sgid));
        Vec::new()
    }

    fn next_deadline(&self) -> Option<Instant> {
        *self.deadline.lock()
    }

    fn on_timeout(&self, _now: Instant) -> Vec<Transmit> {
        *self.fired.lock() += 1;
        self.deadline.lock().take();
        Vec::new()
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

#[test]
fn qp1_packets_reach_the_gsi_handler_and_its_timer_runs() {
    let gid = |s: &str| Gid::from_ip(s.parse().unwrap());
    let (ga, gb) = (gid("10.0.1.1"), gid("10.0.1.2"));
    let fabric = Fabric::<Probe>::new().unwrap();
    let _a = fabric.add_node(NodeCounters::default(), &[ga], 1);
    let b = fabric.add_node(NodeCounters::default(), &[gb], 1);
    let a_to_b = RxMeta {
        sgid: ga,
        dgid: gb,
        traffic_class: 0,
        hop_limit: 64,
    };
    // Without a handler, QP1 is an unknown QP.
    b.inject(&send_only(1, *b"none"), a_to_b, None);
    // The progress thread may be driving the node at that moment and handle the packet
    // itself: wait (bounded) for whoever handles it.
    let settle = |done: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done() && std::time::Instant::now() < deadline {
            fabric.drive(fabric.now());
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    settle(&|| b.counters.snapshot().rx_unknown_qp == 1);
    assert_eq!(b.counters.snapshot().rx_unknown_qp, 1);

    let probe = Arc::new(GsiProbe::default());
    let p = probe.clone();
    b.gsi(move || p);
    b.inject(&send_only(1, *b"mad!"), a_to_b, None);
    // QP1 of a softverbs process (its slot in bits 16..24) is QP1 too.
    b.inject(&send_only(0x03_0001, *b"mad2"), a_to_b, None);
    settle(&|| probe.got.lock().len() >= 2);
    assert_eq!(
        *probe.got.lock(),
        [(b"mad!".to_vec(), ga), (b"mad2".to_vec(), ga)]
    );
    assert!(is_gsi_qpn(1) && is_gsi_qpn(0x05_0001) && !is_gsi_qpn(0x11) && !is_gsi_qpn(MULTICAST_QPN));

    // The progress thread runs the handler's timer.
    *probe.deadline.lock() = Some(fabric.now() + Duration::from_millis(20));
    fabric.schedule(fabric.now() + Duration::from_millis(20));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while *probe.fired.lock() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(*probe.fired.lock(), 1, "the timer fired once");
}

#[test]
fn the_progress_thread_ends_with_its_fabric() {
    let fabric = Fabric::<Probe>::new().unwrap();
    let node = fabric.add_node(
        NodeCounters::default(),
        &[Gid::from_ip("10.0.0.3".parse().unwrap())],
        1,
    );
    let wake = fabric.wake.clone();
    // Nodes own the fabric: it lives until the last one is gone.
    drop(fabric);
    assert!(!wake.closed.load(Ordering::Acquire));
    drop(node);
    // The progress thread may hold the fabric for the rest of a pass; then it is dropped
    // there.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while Arc::strong_count(&wake) > 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(wake.closed.load(Ordering::Acquire), "the fabric was dropped");
    assert_eq!(Arc::strong_count(&wake), 1, "the progress thread ended");
}

#[test]
fn full_qpn_table_fails_instead_of_spinning() {
    let mut t = QpnTable::new(FIRST_QPN, FIRST_QPN + 3);
    let got: Vec<u32> = (0..4).map(|_| t.alloc().expect("a free index")).collect();
    assert_eq!(got, [0x11, 0x12, 0x13, 0x14]);
    assert_eq!(t.alloc(), None, "every index is in use");
    t.free(0x13);
    assert_eq!(t.alloc(), Some(0x13), "a freed index is found again");
    assert_eq!(t.alloc(), None);
}

#[test]
fn deadline_scheduled_during_a_pass_is_kept() {
    let w = WakeUp::new();
    w.begin_pass();
    // A QP sets a deadline while the progress thread runs the timers (after it read that
    // QP), and the pass finds only a later one elsewhere.
    w.schedule(100);
    let (guard, target) = w.end_pass(500);
    drop(guard);
    assert_eq!(target, 100, "the scheduled deadline survives the pass");
    assert_eq!(w.load(), 100);
    // A later deadline never replaces an earlier one.
    w.schedule(300);
    assert_eq!(w.load(), 100);
    // The next pass starts afresh: what is due is in the QPs' state, which it reads.
    w.begin_pass();
    let (guard, target) = w.end_pass(u64::MAX);
    drop(guard);
    assert_eq!(target, u64::MAX);
    w.begin_pass();
    let (guard, target) = w.end_pass(700);
    drop(guard);
    assert_eq!(target, 700);
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn repeated_device_listing_does_not_grow() {
    let per_call = crate::device::device_list().unwrap().len();
    // Warm up allocator pools before measuring.
    for _ in 0..1000 {
        crate::device::device_list().unwrap();
    }
    let rss = rss_bytes();
    for _ in 0..40_000 {
        crate::device::device_list().unwrap();
    }
    // Live nodes: the registry's devices plus the ones other tests of this process hold.
    let nodes = crate::device::device_list().unwrap()[0]
        .node()
        .fabric()
        .node_count();
    assert!(
        nodes <= per_call + 64,
        "{nodes} nodes registered after 40,000 listings"
    );
    let grown = rss_bytes().saturating_sub(rss);
    assert!(grown < 4 << 20, "RSS grew by {grown} bytes over 40,000 listings");
}
