//! Flow rules on UD QPs (`ibv_create_flow(3)`: "flow steering rules apply to UD and raw packet
//! QPs"): a received RoCEv2 UD datagram whose outer headers match a rule is also delivered to
//! the rule's QP, over the in-process hand-over and over UDP.
//!
//! Every test takes `SERIAL`: the rules belong to the loopback device, which all tests of this
//! binary share, and a sniffer would otherwise see the other tests' datagrams.

mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;
use softverbs::*;

static SERIAL: Mutex<()> = Mutex::new(());

const QKEY: u32 = 0x1111_1111;
const EINVAL: i32 = 22;
const EOPNOTSUPP: i32 = 95;

/// One context with UD QPs on their own CQs, sharing a PD and a memory region.
struct Host {
    ctx: Context,
    pd: ProtectionDomain,
    mr: MemoryRegion,
    /// The next unused receive slot (1 KiB each) of `mr`.
    next_slot: std::cell::Cell<u64>,
}

/// Where sends are gathered from, past every receive slot.
const SEND_AT: usize = 1 << 19;

struct Ud {
    qp: QueuePair,
    cq: CompletionQueue,
}

impl Host {
    fn new() -> Self {
        let ctx = lo();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.register(1 << 20, AccessFlags::LOCAL_WRITE).unwrap();
        Self {
            ctx,
            pd,
            mr,
            next_slot: std::cell::Cell::new(0),
        }
    }

    /// A UD QP in RTS with Q_Key `QKEY` and 16 receives posted into slots of its own (the
    /// work request ID is the slot).
    fn qp(&self) -> Ud {
        let cq = self.ctx.create_cq(64, None, 0).unwrap();
        let qp = self.pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap();
        to_rts(&self.ctx, &qp, 0);
        let first = self.next_slot.get();
        self.next_slot.set(first + 16);
        let wrs: Vec<RecvWr> = (first..first + 16)
            .map(|id| RecvWr {
                wr_id: id,
                sg_list: vec![self.mr.sge(id as usize * 1024..(id as usize + 1) * 1024).unwrap()],
            })
            .collect();
        qp.post_recv(&wrs).unwrap();
        Ud { qp, cq }
    }

    /// An address handle towards `dgid` from the GID table entry that holds it.
    fn ah(&self, dgid: IpAddr) -> AddressHandle {
        let gid = Gid::from_ip(dgid);
        let sgid = (0..16)
            .find(|&i| self.ctx.query_gid(1, i).unwrap() == gid)
            .unwrap_or_else(|| panic!("no GID {dgid} on the loopback device"));
        let mut attr = ah_attr(&self.ctx);
        attr.grh.dgid = gid;
        attr.grh.sgid_index = sgid as u8;
        self.pd.create_ah(&attr).unwrap()
    }

    /// Sends `msg` from `from` to QP `dest` through `ah`, and waits for the send completion
    /// (in-process, the datagram has then been delivered).
    fn send(&self, from: &Ud, ah: &AddressHandle, dest: u32, msg: &[u8]) {
        self.mr.write(SEND_AT, msg).unwrap();
        let req = SendRequest {
            wr_id: 7,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![self.mr.sge(SEND_AT..SEND_AT + msg.len()).unwrap()]),
            ud: Some(ah.ud_address(dest, QKEY)),
            xrc_srqn: None,
        };
        from.qp.post_send(&[req]).unwrap();
        let wc = wait(&from.cq, 1);
        assert_eq!((wc[0].status, wc[0].opcode), (WcStatus::Success, WcOpcode::Send));
    }

    /// The payload of a receive completion (after the 40-byte GRH area).
    fn payload(&self, wc: &WorkCompletion) -> Vec<u8> {
        let mut b = vec![0u8; wc.byte_len as usize - 40];
        self.mr.read(wc.wr_id as usize * 1024 + 40, &mut b).unwrap();
        b
    }

    /// This process's UDP port (the source and destination port of its datagrams).
    fn port(&self) -> u16 {
        self.ctx.udp_status().expect("the UDP driver runs").1
    }
}

/// Waits (at most 10 s) for `n` completions; more than `n` fails.
fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < n {
        got.extend(drain(cq));
        assert!(Instant::now() < deadline, "timed out with {got:?}");
        std::thread::yield_now();
    }
    assert_eq!(got.len(), n, "more completions than expected: {got:?}");
    got
}

/// Completions that arrive within a short grace period (for "nothing arrives").
fn settle(cq: &CompletionQueue) -> Vec<WorkCompletion> {
    std::thread::sleep(Duration::from_millis(50));
    drain(cq)
}

fn normal(priority: u16, specs: Vec<FlowSpec>) -> FlowAttr {
    FlowAttr {
        flow_type: FlowType::Normal,
        priority,
        port: 1,
        flags: 0,
        specs,
        tag: None,
        drop: false,
    }
}

fn of_type(flow_type: FlowType) -> FlowAttr {
    FlowAttr {
        flow_type,
        ..normal(0, vec![])
    }
}

fn udp_dst(port: u16) -> FlowSpec {
    FlowSpec::Udp {
        val: PortFilter {
            dst_port: port,
            src_port: 0,
        },
        mask: PortFilter {
            dst_port: 0xFFFF,
            src_port: 0,
        },
    }
}

fn udp_src(port: u16) -> FlowSpec {
    FlowSpec::Udp {
        val: PortFilter {
            dst_port: 0,
            src_port: port,
        },
        mask: PortFilter {
            dst_port: 0,
            src_port: 0xFFFF,
        },
    }
}

fn ipv4_dst(ip: Ipv4Addr) -> FlowSpec {
    FlowSpec::Ipv4 {
        val: Ipv4Filter {
            dst_ip: ip,
            ..Default::default()
        },
        mask: Ipv4Filter {
            dst_ip: Ipv4Addr::BROADCAST,
            ..Default::default()
        },
    }
}

fn ipv6_dst(ip: Ipv6Addr) -> FlowSpec {
    FlowSpec::Ipv6 {
        val: Ipv6Filter {
            dst_ip: ip,
            ..Default::default()
        },
        mask: Ipv6Filter {
            dst_ip: Ipv6Addr::from([0xFF; 16]),
            ..Default::default()
        },
    }
}

fn recvs(wcs: &[WorkCompletion]) -> usize {
    wcs.iter()
        .filter(|w| w.status == WcStatus::Success && w.opcode == WcOpcode::Recv)
        .count()
}

#[test]
fn ipv4_rule_with_the_udp_port_gets_a_copy_beside_the_addressed_qp() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new();
    let (a, b, c, d) = (h.qp(), h.qp(), h.qp(), h.qp());
    let port = h.port();
    let lo4 = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let _fc =
        c.qp.create_flow(&normal(0, vec![ipv4_dst(Ipv4Addr::LOCALHOST), udp_dst(port)]))
            .unwrap();
    let _fd =
        d.qp.create_flow(&normal(0, vec![udp_dst(port.wrapping_add(1))]))
            .unwrap();
    // A rule on the addressed QP itself: it still gets one copy.
    let _fb = b.qp.create_flow(&normal(0, vec![udp_dst(port)])).unwrap();
    h.send(&a, &h.ah(lo4), b.qp.qp_num(), b"to b");
    let at_b = wait(&b.cq, 1);
    let at_c = wait(&c.cq, 1);
    assert_eq!(h.payload(&at_b[0]), b"to b");
    assert_eq!(h.payload(&at_c[0]), b"to b", "the rule's QP gets the datagram");
    assert_eq!(at_c[0].src_qp, a.qp.qp_num());
    assert_eq!(at_c[0].qp_num, c.qp.qp_num());
    assert!(at_c[0].wc_flags.contains(WcFlags::GRH));
    assert!(settle(&b.cq).is_empty(), "no second copy for the addressed QP");
    assert!(settle(&c.cq).is_empty(), "one copy per QP");
    assert!(settle(&d.cq).is_empty(), "another UDP port does not match");
}

#[test]
fn ipv6_rule_matches_only_ipv6_datagrams() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new();
    let (a, b, c) = (h.qp(), h.qp(), h.qp());
    let _fc =
        c.qp.create_flow(&normal(0, vec![ipv6_dst(Ipv6Addr::LOCALHOST), udp_dst(h.port())]))
            .unwrap();
    h.send(
        &a,
        &h.ah(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        b.qp.qp_num(),
        b"over v4",
    );
    wait(&b.cq, 1);
    assert!(
        settle(&c.cq).is_empty(),
        "an IPv4 datagram does not match an IPv6 spec"
    );
    h.send(
        &a,
        &h.ah(IpAddr::V6(Ipv6Addr::LOCALHOST)),
        b.qp.qp_num(),
        b"over v6",
    );
    assert_eq!(h.payload(&wait(&b.cq, 1)[0]), b"over v6");
    let at_c = wait(&c.cq, 1);
    assert_eq!(h.payload(&at_c[0]), b"over v6");
    let mut grh = [0u8; 40];
    h.mr.read(at_c[0].wr_id as usize * 1024, &mut grh).unwrap();
    let back = h.ctx.init_ah_from_wc(1, &at_c[0], &grh).unwrap();
    assert_eq!(
        back.grh.dgid,
        Gid::from(Ipv6Addr::LOCALHOST),
        "the GRH names the sender"
    );
}

#[test]
fn sniffer_sees_every_datagram_until_destroyed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new();
    let (a, b, s) = (h.qp(), h.qp(), h.qp());
    let sniffer = s.qp.create_flow(&of_type(FlowType::Sniffer)).unwrap();
    let ah = h.ah(IpAddr::V4(Ipv4Addr::LOCALHOST));
    h.send(&a, &ah, b.qp.qp_num(), b"one");
    h.send(&a, &ah, b.qp.qp_num(), b"two");
    // A datagram for a QP number nobody has goes out over UDP, comes back to this device and
    // is seen by the sniffer too.
    let nobody = (b.qp.qp_num() & 0xFF_0000) | 0xFFFE;
    h.send(&a, &ah, nobody, b"three");
    assert_eq!(recvs(&wait(&b.cq, 2)), 2);
    let seen: Vec<Vec<u8>> = wait(&s.cq, 3).iter().map(|w| h.payload(w)).collect();
    assert_eq!(seen, [b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]);
    drop(sniffer);
    h.send(&a, &ah, b.qp.qp_num(), b"four");
    assert_eq!(h.payload(&wait(&b.cq, 1)[0]), b"four");
    assert!(settle(&s.cq).is_empty(), "a destroyed rule delivers nothing");
}

#[test]
fn wrong_qkey_drops_the_copy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new();
    let (a, b, c) = (h.qp(), h.qp(), h.qp());
    c.qp.modify(
        &QpAttr {
            qkey: 0x2222,
            ..Default::default()
        },
        QpAttrMask::QKEY,
    )
    .unwrap();
    let _fc = c.qp.create_flow(&normal(0, vec![udp_dst(h.port())])).unwrap();
    h.send(&a, &h.ah(IpAddr::V4(Ipv4Addr::LOCALHOST)), b.qp.qp_num(), b"qkey");
    wait(&b.cq, 1);
    assert!(settle(&c.cq).is_empty(), "the copy fails the Q_Key check");
    assert_eq!(c.qp.counters().qkey_violations, 1);
    assert_eq!(b.qp.counters().qkey_violations, 0);
}

#[test]
fn priorities_and_the_default_rule() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new();
    let (a, b, first, second, default) = (h.qp(), h.qp(), h.qp(), h.qp(), h.qp());
    let port = h.port();
    let ah = h.ah(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let f1 = first.qp.create_flow(&normal(1, vec![udp_dst(port)])).unwrap();
    let f2 = second.qp.create_flow(&normal(2, vec![udp_dst(port)])).unwrap();
    let _fd = default.qp.create_flow(&of_type(FlowType::AllDefault)).unwrap();
    h.send(&a, &ah, b.qp.qp_num(), b"p1");
    wait(&b.cq, 1);
    assert_eq!(
        recvs(&wait(&first.cq, 1)),
        1,
        "the lowest priority value takes it"
    );
    assert!(settle(&second.cq).is_empty());
    assert!(settle(&default.cq).is_empty(), "a NORMAL rule took it");
    drop(f1);
    h.send(&a, &ah, b.qp.qp_num(), b"p2");
    wait(&b.cq, 1);
    assert_eq!(recvs(&wait(&second.cq, 1)), 1);
    assert!(settle(&default.cq).is_empty());
    drop(f2);
    h.send(&a, &ah, b.qp.qp_num(), b"dflt");
    wait(&b.cq, 1);
    assert_eq!(
        h.payload(&wait(&default.cq, 1)[0]),
        b"dflt",
        "no NORMAL rule took it"
    );
    assert!(settle(&first.cq).is_empty() && settle(&second.cq).is_empty());
}

#[test]
fn datagram_from_a_udp_socket_matches_by_its_source_port() {
    use softverbs_wire::{BthRepr, DethRepr, Opcode, PacketRepr, Psn};
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new();
    let (b, c, d) = (h.qp(), h.qp(), h.qp());
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let sport = sock.local_addr().unwrap().port();
    let _fc = c.qp.create_flow(&normal(0, vec![udp_src(sport)])).unwrap();
    let _fd =
        d.qp.create_flow(&normal(0, vec![udp_src(sport.wrapping_add(1))]))
            .unwrap();
    // A UD SEND ONLY as another stack would send it, to this process's own port.
    let repr = PacketRepr {
        deth: Some(DethRepr {
            qkey: QKEY,
            src_qpn: 0x1234,
        }),
        ..PacketRepr::new(BthRepr::new(Opcode::UdSendOnly, b.qp.qp_num(), Psn::new(7)), 6)
    };
    let mut pkt = vec![0u8; repr.buffer_len()];
    repr.emit_with_payload(&mut pkt, b"socket").unwrap();
    let dst = SocketAddr::from((Ipv4Addr::LOCALHOST, h.port()));
    softverbs_wire::icrc::fill(sock.local_addr().unwrap(), dst, &mut pkt).unwrap();
    sock.send_to(&pkt, dst).unwrap();
    assert_eq!(h.payload(&wait(&b.cq, 1)[0]), b"socket");
    let at_c = wait(&c.cq, 1);
    assert_eq!(
        (h.payload(&at_c[0]).as_slice(), at_c[0].src_qp),
        (&b"socket"[..], 0x1234)
    );
    // The same datagram went to both rules' tables at once: the other one has had its chance.
    assert!(settle(&d.cq).is_empty(), "another source port does not match");
}

#[test]
fn invalid_rules_are_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let h = Host::new();
    let u = h.qp();
    let errno = |attr: &FlowAttr| u.qp.create_flow(attr).unwrap_err().errno();
    assert_eq!(
        errno(&FlowAttr {
            port: 2,
            ..normal(0, vec![])
        }),
        EINVAL,
        "no port 2"
    );
    assert_eq!(
        errno(&FlowAttr {
            specs: vec![udp_dst(1)],
            ..of_type(FlowType::Sniffer)
        }),
        EINVAL,
        "a sniffer takes no specs"
    );
    assert_eq!(
        errno(&FlowAttr {
            flags: FLOW_FLAG_DONT_TRAP,
            ..of_type(FlowType::AllDefault)
        }),
        EINVAL
    );
    assert_eq!(
        errno(&FlowAttr {
            flags: 1 << 9,
            ..normal(0, vec![])
        }),
        EINVAL
    );
    assert_eq!(
        errno(&FlowAttr {
            tag: Some(5),
            ..normal(0, vec![])
        }),
        EOPNOTSUPP,
        "UD completions carry no flow tag"
    );
    assert_eq!(
        errno(&FlowAttr {
            drop: true,
            ..normal(0, vec![])
        }),
        EOPNOTSUPP
    );
    assert_eq!(
        errno(&FlowAttr {
            flags: FLOW_FLAG_EGRESS,
            ..normal(0, vec![])
        }),
        EOPNOTSUPP
    );
    let cq = h.ctx.create_cq(4, None, 0).unwrap();
    for t in [QpType::Rc, QpType::Uc] {
        let qp = h.pd.create_qp(&QpInit::new(t, &cq)).unwrap();
        assert_eq!(
            qp.create_flow(&normal(0, vec![])).unwrap_err().errno(),
            EINVAL,
            "{t:?}"
        );
    }
}
