//! Raw packet QPs over a veth pair between two network namespaces (created and removed by the
//! test): crafted Ethernet/IPv4/UDP frames arrive byte-exact at the peer's UDP socket and
//! sniffer; flows steer by spec, priority, DROP and TAG; RSS spreads frames over WQs by the
//! Toeplitz hash; without CAP_NET_RAW raw QPs are EPERM. Needs root and iproute2, setpriv.

#[path = "raw/frames.rs"]
mod frames;

mod common;

use std::io::BufRead;
use std::net::{Ipv4Addr, UdpSocket};
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::{Hosts, Peer};
use frames::*;
use softverbs::*;

const IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 78, 0, 1), Ipv4Addr::new(10, 78, 0, 2)];
/// Frames for steering go to an address the peer does not own, so its IP stack drops them
/// silently instead of answering.
const NOT_LOCAL: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 99);
const SLOT: usize = 2048;
const LIMIT: Duration = Duration::from_secs(30);
/// The key of the Microsoft RSS verification suite.
const MS_KEY: [u8; 40] = [
    0x6d, 0x5a, 0x56, 0xda, 0x25, 0x5b, 0x0e, 0xc2, 0x41, 0x67, 0x25, 0x3d, 0x43, 0xa3, 0x8f, 0xb0, 0xd0,
    0xca, 0x2b, 0xcb, 0xae, 0x7b, 0x30, 0xb4, 0x77, 0xcb, 0x2d, 0xa3, 0x80, 0x30, 0xf2, 0x0c, 0x6a, 0x42,
    0xb7, 0x3b, 0xbe, 0xac, 0x01, 0xfa,
];

/// A raw packet QP in RTS with receive slots of `SLOT` bytes in one MR.
struct RawNode {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    mr: MemoryRegion,
    qps: Vec<QueuePair>,
}

fn raw_qp(pd: &ProtectionDomain, cq: &CompletionQueue) -> Result<QueuePair> {
    let mut init = QpInit::new(QpType::RawPacket, cq);
    init.cap.max_send_wr = 64;
    init.cap.max_recv_wr = 128;
    let qp = pd.create_qp(&init)?;
    let attr = |s| QpAttr {
        qp_state: s,
        port_num: 1,
        ..Default::default()
    };
    qp.modify(&attr(QpState::Init), QpAttrMask::STATE | QpAttrMask::PORT)?;
    qp.modify(&attr(QpState::Rtr), QpAttrMask::STATE)?;
    qp.modify(&attr(QpState::Rts), QpAttrMask::STATE)?;
    Ok(qp)
}

impl RawNode {
    fn new(ctx: Context, nqps: usize) -> Self {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(1024, None, 0).unwrap();
        let mr = pd.register(SLOT * 512, AccessFlags::LOCAL_WRITE).unwrap();
        let qps = (0..nqps).map(|_| raw_qp(&pd, &cq).unwrap()).collect();
        Self { ctx, pd, cq, mr, qps }
    }

    fn in_namespace(nqps: usize) -> Self {
        let dev = devices().unwrap().into_iter().next().expect("the veth device");
        Self::new(dev.open().unwrap(), nqps)
    }

    /// Posts `n` receives on QP `q`, in slots `first..first + n` (wr_id = slot).
    fn post_recvs(&self, q: usize, first: usize, n: usize) {
        let wrs: Vec<RecvWr> = (first..first + n)
            .map(|s| RecvWr {
                wr_id: s as u64,
                sg_list: vec![self.mr.sge(s * SLOT..(s + 1) * SLOT).unwrap()],
            })
            .collect();
        self.qps[q].post_recv(&wrs).unwrap();
    }

    /// Sends `frame` from slot 400 + `i` and waits for the completion.
    fn send(&self, q: usize, i: usize, frame: &[u8]) {
        let s = 400 + i % 100;
        self.mr.write(s * SLOT, frame).unwrap();
        self.qps[q]
            .post_send(&[SendRequest {
                wr_id: s as u64,
                op: SendOp::Send {
                    imm: None,
                    invalidate: None,
                },
                flags: SendFlags::SIGNALED,
                payload: Payload::Sges(vec![self.mr.sge(s * SLOT..s * SLOT + frame.len()).unwrap()]),
                ud: None,
                xrc_srqn: None,
            }])
            .unwrap();
        let wc = self.wait(1, LIMIT).pop().expect("a send completion");
        assert_eq!(
            (wc.status, wc.opcode, wc.wr_id),
            (WcStatus::Success, WcOpcode::Send, s as u64)
        );
    }

    /// Up to `n` completions, waiting at most `limit`.
    fn wait(&self, n: usize, limit: Duration) -> Vec<WorkCompletion> {
        let deadline = Instant::now() + limit;
        let mut out = Vec::new();
        let mut wc = [WorkCompletion::default(); 16];
        while out.len() < n && Instant::now() < deadline {
            let k = self.cq.poll(&mut wc);
            out.extend_from_slice(&wc[..k]);
            if k == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        out
    }

    fn frame(&self, wc: &WorkCompletion) -> Vec<u8> {
        let s = wc.wr_id as usize;
        self.mr.to_vec()[s * SLOT..s * SLOT + wc.byte_len as usize].to_vec()
    }
}

fn eth_spec(dst_mac: [u8; 6]) -> FlowSpec {
    FlowSpec::Eth {
        val: EthFilter {
            dst_mac,
            ether_type: 0x0800,
            ..Default::default()
        },
        mask: EthFilter {
            dst_mac: [0xFF; 6],
            ether_type: 0xFFFF,
            ..Default::default()
        },
    }
}

fn udp_spec(port: Option<u16>) -> FlowSpec {
    FlowSpec::Udp {
        val: PortFilter {
            dst_port: port.unwrap_or(0),
            src_port: 0,
        },
        mask: PortFilter {
            dst_port: if port.is_some() { 0xFFFF } else { 0 },
            src_port: 0,
        },
    }
}

fn normal(priority: u16, specs: Vec<FlowSpec>, tag: Option<u32>, drop: bool) -> FlowAttr {
    FlowAttr {
        flow_type: FlowType::Normal,
        priority,
        port: 1,
        flags: 0,
        specs,
        tag,
        drop,
    }
}

fn of_type(flow_type: FlowType) -> FlowAttr {
    FlowAttr {
        flow_type,
        priority: 0,
        port: 1,
        flags: 0,
        specs: Vec::new(),
        tag: None,
        drop: false,
    }
}

const TSO_MSS: usize = 1000;
const TSO_DATA: usize = 3500;
const TSO_SEQ: u32 = 0xFFFF_FE00;

fn tso_data() -> Vec<u8> {
    (0..TSO_DATA as u32).map(|i| (i * 31 % 253) as u8).collect()
}

/// Sender side: reads `<dst mac hex> <scenario>` and sends that scenario's frames.
fn role_send(ifname: &str) {
    let mut node = RawNode::in_namespace(1);
    let mut init = QpInit::new(QpType::RawPacket, &node.cq);
    init.cap.max_send_wr = 8;
    let tso_qp = node.pd.create_qp_tso(&init, 128).unwrap();
    for (s, mask) in [
        (QpState::Init, QpAttrMask::STATE | QpAttrMask::PORT),
        (QpState::Rtr, QpAttrMask::STATE),
        (QpState::Rts, QpAttrMask::STATE),
    ] {
        let attr = QpAttr {
            qp_state: s,
            port_num: 1,
            ..Default::default()
        };
        tso_qp.modify(&attr, mask).unwrap();
    }
    node.qps.push(tso_qp);
    let me = mac_of(ifname);
    let mut stdin = std::io::stdin().lock().lines();
    println!("ready");
    while let Some(Ok(l)) = stdin.next() {
        let v: Vec<&str> = l.split_whitespace().collect();
        let dst: [u8; 6] = unhex(v[0]).try_into().unwrap();
        match v[1] {
            "udp" => {
                let port: u16 = v[2].parse().unwrap();
                let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
                let f = udp_frame(dst, me, (IPS[0], 40_000), (IPS[1], port), &payload);
                node.send(0, 0, &f);
                println!("sent {}", hex(&f));
            }
            "steer" => {
                for (i, port) in [7001u16, 7002, 7003, 7004].into_iter().enumerate() {
                    let f = udp_frame(dst, me, (IPS[0], 5000), (NOT_LOCAL, port), b"steer");
                    node.send(0, i, &f);
                }
                node.send(0, 9, &experimental_frame(dst, me, &[0xEE; 50]));
                // A multicast MAC: MC_DEFAULT as well as ALL_DEFAULT.
                let mcast = [0x01, 0x00, 0x5e, 0x00, 0x00, 0x42];
                node.send(0, 10, &experimental_frame(mcast, me, &[0xEF; 50]));
                println!("sent 6");
            }
            "tso" => {
                // PSH and FIN belong on the last segment only, CWR on the first only.
                let hdr = tcp_header(dst, me, (IPS[0], 33_000), (NOT_LOCAL, 7200), TSO_SEQ, 0x80 | 0x19);
                node.mr.write(300 * SLOT, &tso_data()).unwrap();
                node.qps[1]
                    .post_send(&[SendRequest {
                        wr_id: 0x750,
                        op: SendOp::Tso { mss: TSO_MSS as u16 },
                        flags: SendFlags::SIGNALED,
                        payload: Payload::Headed {
                            header: hdr,
                            sges: vec![node.mr.sge(300 * SLOT..300 * SLOT + TSO_DATA).unwrap()],
                        },
                        ud: None,
                        xrc_srqn: None,
                    }])
                    .unwrap();
                let wc = node.wait(1, LIMIT).pop().expect("a TSO completion");
                assert_eq!(
                    (wc.status, wc.opcode, wc.wr_id),
                    (WcStatus::Success, WcOpcode::Tso, 0x750)
                );
                println!("sent tso");
            }
            "rss" => {
                for i in 0..64u16 {
                    let f = udp_frame(dst, me, (IPS[0], 10_000 + i * 97), (NOT_LOCAL, 7100), b"rss");
                    node.send(0, usize::from(i), &f);
                }
                println!("sent 64");
            }
            other => panic!("unknown scenario {other}"),
        }
    }
}

/// Receiver of the first scenario: a UDP socket and a sniffer raw QP.
fn role_observe(_ifname: &str) {
    let sock = UdpSocket::bind((IPS[1], 0)).unwrap();
    sock.set_read_timeout(Some(LIMIT)).unwrap();
    let port = sock.local_addr().unwrap().port();
    let node = RawNode::in_namespace(1);
    node.post_recvs(0, 0, 64);
    let _sniffer = node.qps[0].create_flow(&of_type(FlowType::Sniffer)).unwrap();
    println!("ready {port}");
    let mut buf = [0u8; 2048];
    let (n, from) = sock.recv_from(&mut buf).unwrap();
    println!("udp {} {}", from, hex(&buf[..n]));
    let deadline = Instant::now() + LIMIT;
    loop {
        assert!(
            Instant::now() < deadline,
            "the sniffer saw no frame to port {port}"
        );
        for wc in node.wait(1, Duration::from_millis(100)) {
            assert_eq!(wc.status, WcStatus::Success);
            let f = node.frame(&wc);
            if f.len() > 37 && f[12..14] == [8, 0] && udp_dst_port(&f) == port {
                println!("frame {}", hex(&f));
                return;
            }
        }
    }
}

/// Receiver of the steering scenario: four raw QPs with NORMAL, DROP, DONT_TRAP, ALL_DEFAULT
/// and MC_DEFAULT rules.
fn role_steer(ifname: &str) {
    let node = RawNode::in_namespace(4);
    let me = mac_of(ifname);
    for q in 0..4 {
        node.post_recvs(q, q * 100, 32);
    }
    let mut dont_trap = normal(0, vec![udp_spec(Some(7003))], Some(0x44), false);
    dont_trap.flags = FLOW_FLAG_DONT_TRAP;
    let flows = [
        // QP 0: port 7001 at priority 1, tagged.
        node.qps[0].create_flow(&normal(
            1,
            vec![eth_spec(me), udp_spec(Some(7001))],
            Some(0x11),
            false,
        )),
        // Port 7002 dropped at priority 0, ahead of QP 1's catch-all.
        node.qps[1].create_flow(&normal(0, vec![udp_spec(Some(7002))], None, true)),
        // QP 1: port 7003 at priority 1, and every other UDP frame at priority 2.
        node.qps[1].create_flow(&normal(1, vec![udp_spec(Some(7003))], Some(0x22), false)),
        node.qps[1].create_flow(&normal(2, vec![udp_spec(None)], Some(0x33), false)),
        // QP 2: whatever no NORMAL rule took; QP 3: such frames if multicast.
        node.qps[2].create_flow(&of_type(FlowType::AllDefault)),
        node.qps[3].create_flow(&of_type(FlowType::McDefault)),
        // QP 3 also sees port 7003 first, without taking it from the rules behind.
        node.qps[3].create_flow(&dont_trap),
    ]
    .map(Result::unwrap);
    println!("ready");
    let mut stdin = std::io::stdin().lock().lines();
    assert_eq!(stdin.next().unwrap().unwrap(), "collect");
    let mut got = node.wait(7, LIMIT);
    // Anything else would arrive right behind.
    got.extend(node.wait(usize::MAX, Duration::from_millis(500)));
    let mut per_qp = vec![Vec::new(); 4];
    for wc in &got {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        let q = node.qps.iter().position(|qp| qp.qp_num() == wc.qp_num).unwrap();
        let f = node.frame(wc);
        let what = if f[12..14] == [8, 0] {
            udp_dst_port(&f).to_string()
        } else if f[0] & 1 != 0 {
            format!("mc-{}", hex(&f[12..14]))
        } else {
            hex(&f[12..14])
        };
        per_qp[q].push(format!("{what}:{:#x}", wc.flow_tag));
    }
    drop(flows);
    println!("steered {:?}", per_qp);
}

/// Receiver of the RSS scenario: four WQs behind an RSS QP hashing IPv4 addresses and UDP
/// ports with the Microsoft key.
fn role_rss(_ifname: &str) {
    let dev = devices().unwrap().into_iter().next().expect("the veth device");
    let ctx = dev.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256, None, 0).unwrap();
    let mr = pd.register(SLOT * 256, AccessFlags::LOCAL_WRITE).unwrap();
    let wqs: Vec<WorkQueue> = (0..4).map(|_| pd.create_wq(&cq, 64, 1).unwrap()).collect();
    for (i, wq) in wqs.iter().enumerate() {
        wq.modify(WqState::Rdy, Some(WqState::Reset)).unwrap();
        let wrs: Vec<RecvWr> = (i * 64..(i + 1) * 64)
            .map(|s| RecvWr {
                wr_id: s as u64,
                sg_list: vec![mr.sge(s * SLOT..(s + 1) * SLOT).unwrap()],
            })
            .collect();
        wq.post_recv(&wrs).unwrap();
    }
    let table = ctx
        .create_rwq_ind_table(2, &wqs.iter().collect::<Vec<_>>())
        .unwrap();
    let fields = RxHashFields::SRC_IPV4
        | RxHashFields::DST_IPV4
        | RxHashFields::SRC_PORT_UDP
        | RxHashFields::DST_PORT_UDP;
    let conf = RxHashConf::new(RX_HASH_FUNC_TOEPLITZ, &MS_KEY, fields.bits()).unwrap();
    let qp = pd.create_rss_qp(&table, conf).unwrap();
    let _flow = qp
        .create_flow(&normal(0, vec![udp_spec(Some(7100))], Some(7), false))
        .unwrap();
    println!("ready");
    let mut stdin = std::io::stdin().lock().lines();
    assert_eq!(stdin.next().unwrap().unwrap(), "collect");
    let deadline = Instant::now() + LIMIT;
    let mut got = Vec::new();
    let mut wc = [WorkCompletion::default(); 16];
    while got.len() < 64 && Instant::now() < deadline {
        let k = cq.poll(&mut wc);
        got.extend_from_slice(&wc[..k]);
    }
    let mut used = [0usize; 4];
    let mut mismatches = 0;
    for wc in &got {
        assert_eq!((wc.status, wc.flow_tag), (WcStatus::Success, 7), "{wc:?}");
        let q = wqs.iter().position(|w| w.wq_num() == wc.qp_num).unwrap();
        let s = wc.wr_id as usize;
        let f = &mr.to_vec()[s * SLOT..s * SLOT + wc.byte_len as usize];
        // The hash input by hand: source and destination address, then the ports.
        let mut input = Vec::new();
        input.extend_from_slice(&f[26..34]);
        input.extend_from_slice(&f[34..38]);
        let expected = toeplitz(&MS_KEY, &input) as usize & 3;
        mismatches += usize::from(expected != q);
        used[q] += 1;
    }
    println!("rss {} mismatches {mismatches} per-wq {used:?}", got.len());
}

/// Receiver of the TSO scenario: a raw QP with a TCP rule; checks every segment's headers.
fn role_tso(_ifname: &str) {
    let node = RawNode::in_namespace(1);
    node.post_recvs(0, 0, 16);
    let tcp = FlowSpec::Tcp {
        val: PortFilter {
            dst_port: 7200,
            src_port: 0,
        },
        mask: PortFilter {
            dst_port: 0xFFFF,
            src_port: 0,
        },
    };
    let _flow = node.qps[0]
        .create_flow(&normal(0, vec![tcp], None, false))
        .unwrap();
    println!("ready");
    let mut stdin = std::io::stdin().lock().lines();
    assert_eq!(stdin.next().unwrap().unwrap(), "collect");
    let mut got = node.wait(4, LIMIT);
    got.extend(node.wait(usize::MAX, Duration::from_millis(300)));
    let mut report = Vec::new();
    let mut joined = Vec::new();
    for (i, wc) in got.iter().enumerate() {
        let f = node.frame(wc);
        let seq = u32::from_be_bytes([f[38], f[39], f[40], f[41]]);
        let id = u16::from_be_bytes([f[18], f[19]]);
        report.push(format!(
            "{}:{}:{:#x}:{:#x}:{}",
            f.len() - 54,
            ipv4_tcp_valid(&f),
            seq.wrapping_sub(TSO_SEQ),
            f[47],
            id.wrapping_sub(0x4242) as usize == i
        ));
        joined.extend_from_slice(&f[54..]);
    }
    println!("tso {} data {}", report.join(" "), joined == tso_data());
}

/// Without CAP_NET_RAW (run under setpriv): raw and RSS QPs are EPERM, other QPs work.
fn role_noperm(_ifname: &str) {
    assert!(!has_cap_net_raw());
    let ctx = devices()
        .unwrap()
        .into_iter()
        .find(|d| d.netdev() == "lo")
        .unwrap()
        .open()
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None, 0).unwrap();
    let raw = pd.create_qp(&QpInit::new(QpType::RawPacket, &cq)).unwrap_err();
    let rc = pd.create_qp(&QpInit::new(QpType::Rc, &cq));
    let wq = pd.create_wq(&cq, 4, 1).unwrap();
    let table = ctx.create_rwq_ind_table(0, &[&wq]).unwrap();
    let conf = RxHashConf::new(RX_HASH_FUNC_TOEPLITZ, &MS_KEY, 3).unwrap();
    let rss = pd.create_rss_qp(&table, conf).unwrap_err();
    println!("raw {} rss {} rc {}", raw.errno(), rss.errno(), rc.is_ok());
}

fn frames_cross_the_veth_byte_exact() {
    let hosts = Hosts::new("svr", "o", IPS, false);
    let mut b = hosts.spawn(1, &["--role", "observe", &hosts.ifs[1]]);
    let mut a = hosts.spawn(0, &["--role", "send", &hosts.ifs[0]]);
    let port: u16 = b.line(LIMIT).strip_prefix("ready ").unwrap().parse().unwrap();
    assert_eq!(a.line(LIMIT), "ready");
    a.say(&format!("{} udp {port}", hex(&mac_of_ns(&hosts, 1))));
    let sent = unhex(a.line(LIMIT).strip_prefix("sent ").unwrap());
    let udp = b.line(LIMIT);
    let v: Vec<&str> = udp.split_whitespace().collect();
    assert_eq!(v[1], format!("{}:40000", IPS[0]), "the datagram's source");
    assert_eq!(
        unhex(v[2]),
        sent[42..],
        "the UDP payload, through the peer's IP stack"
    );
    let frame = unhex(b.line(LIMIT).strip_prefix("frame ").unwrap());
    assert_eq!(frame, sent, "the whole frame, byte-exact");
    println!(
        "  {}-byte frame: payload via UDP socket, frame via sniffer QP",
        sent.len()
    );
}

fn mac_of_ns(hosts: &Hosts, i: usize) -> [u8; 6] {
    let out = Command::new("ip")
        .args(["netns", "exec", &hosts.ns[i], "cat"])
        .arg(format!("/sys/class/net/{}/address", hosts.ifs[i]))
        .output()
        .unwrap();
    let s = String::from_utf8(out.stdout).unwrap();
    let v: Vec<u8> = s
        .trim()
        .split(':')
        .map(|x| u8::from_str_radix(x, 16).unwrap())
        .collect();
    v.try_into().unwrap()
}

fn flows_steer_by_spec_priority_drop_and_tag() {
    let hosts = Hosts::new("svr", "s", IPS, false);
    let mut b = hosts.spawn(1, &["--role", "steer", &hosts.ifs[1]]);
    let mut a = hosts.spawn(0, &["--role", "send", &hosts.ifs[0]]);
    assert_eq!(b.line(LIMIT), "ready");
    assert_eq!(a.line(LIMIT), "ready");
    a.say(&format!("{} steer", hex(&mac_of_ns(&hosts, 1))));
    assert_eq!(a.line(LIMIT), "sent 6");
    b.say("collect");
    // 7001 -> QP 0 (tag 0x11); 7002 dropped (priority 0 beats QP 1's catch-all); 7003 -> QP 3
    // by its DONT_TRAP rule and QP 1 by its priority-1 rule, 7004 by QP 1's priority-2 one; the
    // 0x88b5 frames -> ALL_DEFAULT, the multicast one to MC_DEFAULT as well.
    assert_eq!(
        b.line(LIMIT),
        r#"steered [["7001:0x11"], ["7003:0x22", "7004:0x33"], ["88b5:0x0", "mc-88b5:0x0"], ["7003:0x44", "mc-88b5:0x0"]]"#
    );
}

fn rss_spreads_frames_by_toeplitz_hash() {
    let hosts = Hosts::new("svr", "r", IPS, false);
    let mut b = hosts.spawn(1, &["--role", "rss", &hosts.ifs[1]]);
    let mut a = hosts.spawn(0, &["--role", "send", &hosts.ifs[0]]);
    assert_eq!(b.line(LIMIT), "ready");
    assert_eq!(a.line(LIMIT), "ready");
    a.say(&format!("{} rss", hex(&mac_of_ns(&hosts, 1))));
    assert_eq!(a.line(LIMIT), "sent 64");
    b.say("collect");
    let l = b.line(LIMIT);
    assert!(l.starts_with("rss 64 mismatches 0 "), "{l}");
    let per: Vec<usize> = l
        .split('[')
        .nth(1)
        .unwrap()
        .trim_end_matches(']')
        .split(", ")
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(per.iter().all(|&n| n > 0), "64 flows use all four WQs: {l}");
    println!("  {l}");
}

fn tso_cuts_a_tcp_payload_into_checked_segments() {
    let hosts = Hosts::new("svr", "t", IPS, false);
    let mut b = hosts.spawn(1, &["--role", "tso", &hosts.ifs[1]]);
    let mut a = hosts.spawn(0, &["--role", "send", &hosts.ifs[0]]);
    assert_eq!(b.line(LIMIT), "ready");
    assert_eq!(a.line(LIMIT), "ready");
    a.say(&format!("{} tso", hex(&mac_of_ns(&hosts, 1))));
    assert_eq!(a.line(LIMIT), "sent tso");
    b.say("collect");
    // (payload bytes : checksums and length valid : sequence offset : TCP flags : IPv4 ID + i)
    assert_eq!(
        b.line(LIMIT),
        "tso 1000:true:0x0:0x90:true 1000:true:0x3e8:0x10:true 1000:true:0x7d0:0x10:true \
         500:true:0xbb8:0x19:true data true"
    );
}

fn eperm_without_cap_net_raw() {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("setpriv");
    cmd.args(["--inh-caps=-all", "--bounding-set=-net_raw"])
        .arg(exe)
        .args(["--role", "noperm", "lo"]);
    let mut p = Peer::spawn(cmd);
    assert_eq!(p.line(LIMIT), "raw 1 rss 1 rc true");
}

/// In this process, on the loopback device: a frame sent by one raw QP reaches another through
/// an ETH rule, once, tagged; and the argument checks.
fn loopback_and_argument_checks() {
    let ctx = devices()
        .unwrap()
        .into_iter()
        .find(|d| d.netdev() == "lo")
        .unwrap()
        .open()
        .unwrap();
    assert_ne!(
        ctx.query_device().device_cap_flags & (1 << 29),
        0,
        "MANAGED_FLOW_STEERING"
    );
    let caps = ctx.rss_caps();
    assert_eq!(caps.supported_qpts, 1 << 8);
    assert_eq!(caps.rx_hash_function, RX_HASH_FUNC_TOEPLITZ);
    assert_eq!(caps.rx_hash_fields_mask, 0xFF);
    let node = RawNode::new(ctx, 2);
    node.post_recvs(1, 0, 32);
    // The loopback interface is shared with every other program on the host: a source MAC of
    // this process keeps others' frames out of the rule.
    let pid = std::process::id().to_be_bytes();
    let src_mac = [0x02, 0x5f, pid[0], pid[1], pid[2], pid[3]];
    let spec = FlowSpec::Eth {
        val: EthFilter {
            src_mac,
            ether_type: 0x88B5,
            ..Default::default()
        },
        mask: EthFilter {
            src_mac: [0xFF; 6],
            ether_type: 0xFFFF,
            ..Default::default()
        },
    };
    let flow = node.qps[1]
        .create_flow(&normal(3, vec![spec], Some(0xABC), false))
        .unwrap();
    // A packet socket sees all of the interface's traffic, and a flood from other programs can
    // overflow it before steering: a lost frame is sent again, each attempt distinct.
    let mut got = Vec::new();
    let mut f = Vec::new();
    for attempt in 0..5u8 {
        f = experimental_frame([0x02, 0, 0, 0, 0, 0x42], src_mac, &[b'r', b'a', b'w', attempt]);
        node.send(0, usize::from(attempt), &f);
        got = node.wait(1, Duration::from_secs(3));
        if !got.is_empty() {
            break;
        }
    }
    got.extend(node.wait(usize::MAX, Duration::from_millis(300)));
    assert_eq!(got.len(), 1, "exactly one copy: {got:?}");
    assert_eq!(node.frame(&got[0]), f);
    assert_eq!(
        (got[0].opcode, got[0].flow_tag, got[0].byte_len as usize),
        (WcOpcode::Recv, 0xABC, f.len())
    );
    drop(flow);

    let errno = |r: Result<Flow>| r.unwrap_err().errno();
    let mut bad = normal(0, vec![], None, false);
    bad.port = 2;
    assert_eq!(errno(node.qps[0].create_flow(&bad)), 22, "port 2");
    let mut bad = of_type(FlowType::Sniffer);
    bad.flags = FLOW_FLAG_DONT_TRAP;
    assert_eq!(errno(node.qps[0].create_flow(&bad)), 22, "DONT_TRAP on a sniffer");
    let mut bad = normal(0, vec![], None, false);
    bad.flags = FLOW_FLAG_EGRESS;
    assert_eq!(errno(node.qps[0].create_flow(&bad)), 95, "egress");
    assert_eq!(
        errno(node.qps[0].create_flow(&normal(0, vec![], Some(1), true))),
        22,
        "tag and drop"
    );
    let ud = node.pd.create_qp(&QpInit::new(QpType::Ud, &node.cq)).unwrap();
    assert_eq!(
        errno(ud.create_flow(&normal(0, vec![], Some(1), false))),
        95,
        "UD completions carry no flow tag"
    );
    let rc = node.pd.create_qp(&QpInit::new(QpType::Rc, &node.cq)).unwrap();
    assert_eq!(errno(rc.create_flow(&normal(0, vec![], None, false))), 22, "RC");

    // A raw QP sends only whole frames, in RTS, with plain SEND.
    let short = node.qps[0].post_send(&[SendRequest {
        wr_id: 1,
        op: SendOp::Send {
            imm: None,
            invalidate: None,
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Inline(vec![0; 10]),
        ud: None,
        xrc_srqn: None,
    }]);
    assert_eq!(
        short.unwrap_err().error.errno(),
        22,
        "a frame shorter than an Ethernet header"
    );
    let hdr = tcp_header(
        [2; 6],
        [4; 6],
        (Ipv4Addr::LOCALHOST, 1),
        (Ipv4Addr::LOCALHOST, 2),
        0,
        0x10,
    );
    let tso = |mss| SendRequest {
        wr_id: 2,
        op: SendOp::Tso { mss },
        flags: SendFlags::SIGNALED,
        payload: Payload::Headed {
            header: hdr.clone(),
            sges: vec![],
        },
        ud: None,
        xrc_srqn: None,
    };
    assert_eq!(
        node.qps[0].post_send(&[tso(100)]).unwrap_err().error.errno(),
        22,
        "TSO on a QP without max_tso_header"
    );
    assert_eq!(node.ctx.tso_caps().supported_qpts, 1 << 8);
    let mut init = QpInit::new(QpType::Rc, &node.cq);
    assert_eq!(
        node.pd.create_qp_tso(&init, 64).unwrap_err().errno(),
        22,
        "TSO on RC"
    );
    init.qp_type = QpType::RawPacket;
    assert_eq!(
        node.pd.create_qp_tso(&init, 4096).unwrap_err().errno(),
        22,
        "too large a header"
    );

    // WQs, tables, RSS configuration.
    let wq = node.pd.create_wq(&node.cq, 5, 1).unwrap();
    assert_eq!(wq.caps(), (8, 1));
    assert_eq!(wq.state(), WqState::Reset);
    assert_eq!(
        wq.modify(WqState::Rdy, Some(WqState::Rdy)).unwrap_err().errno(),
        22
    );
    wq.modify(WqState::Rdy, None).unwrap();
    wq.modify(WqState::Err, None).unwrap();
    assert_eq!(wq.modify(WqState::Rdy, None).unwrap_err().errno(), 22, "ERR->RDY");
    // In ERR, a posted receive completes flushed at once.
    wq.post_recv(&[RecvWr {
        wr_id: 77,
        sg_list: vec![node.mr.sge(0..64).unwrap()],
    }])
    .unwrap();
    let wc = node.wait(1, LIMIT).pop().unwrap();
    assert_eq!(
        (wc.wr_id, wc.status, wc.qp_num),
        (77, WcStatus::WrFlushErr, wq.wq_num())
    );
    wq.modify(WqState::Reset, None).unwrap();
    let ctx = &node.ctx;
    assert_eq!(
        ctx.create_rwq_ind_table(1, &[&wq]).unwrap_err().errno(),
        22,
        "size mismatch"
    );
    assert_eq!(
        ctx.create_rwq_ind_table(9, &[&wq]).unwrap_err().errno(),
        22,
        "too large"
    );
    let table = ctx.create_rwq_ind_table(1, &[&wq, &wq]).unwrap();
    assert_eq!(
        RxHashConf::new(RX_HASH_FUNC_TOEPLITZ, &MS_KEY[..20], 3)
            .unwrap_err()
            .errno(),
        22
    );
    assert_eq!(
        RxHashConf::new(2, &MS_KEY, 3).unwrap_err().errno(),
        22,
        "not Toeplitz"
    );
    assert_eq!(
        RxHashConf::new(1, &MS_KEY, 0x5).unwrap_err().errno(),
        22,
        "IPv4 with IPv6"
    );
    let rss = node
        .pd
        .create_rss_qp(&table, RxHashConf::new(1, &MS_KEY, 0x3).unwrap())
        .unwrap();
    let flow = rss
        .create_flow(&normal(0, vec![udp_spec(Some(9))], None, false))
        .unwrap();
    drop((flow, rss, table));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--role") {
        let ifname = &args[i + 2];
        match args[i + 1].as_str() {
            "send" => role_send(ifname),
            "observe" => role_observe(ifname),
            "steer" => role_steer(ifname),
            "rss" => role_rss(ifname),
            "tso" => role_tso(ifname),
            "noperm" => role_noperm(ifname),
            r => panic!("unknown role {r}"),
        }
        return;
    }
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "the raw packet tests need root (CI runs as root)"
    );
    let tests: [(&str, fn()); 6] = [
        ("loopback_and_argument_checks", loopback_and_argument_checks),
        (
            "frames_cross_the_veth_byte_exact",
            frames_cross_the_veth_byte_exact,
        ),
        (
            "flows_steer_by_spec_priority_drop_and_tag",
            flows_steer_by_spec_priority_drop_and_tag,
        ),
        (
            "rss_spreads_frames_by_toeplitz_hash",
            rss_spreads_frames_by_toeplitz_hash,
        ),
        (
            "tso_cuts_a_tcp_payload_into_checked_segments",
            tso_cuts_a_tcp_payload_into_checked_segments,
        ),
        ("eperm_without_cap_net_raw", eperm_without_cap_net_raw),
    ];
    let mut failed = 0;
    for (name, t) in tests {
        let ok = std::panic::catch_unwind(t).is_ok();
        println!("test raw_packet::{name} ... {}", if ok { "ok" } else { "FAILED" });
        failed += usize::from(!ok);
    }
    println!("{} passed, {} failed", tests.len() - failed, failed);
    std::process::exit(i32::from(failed > 0));
}
