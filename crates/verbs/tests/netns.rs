//! Two hosts in network namespaces joined by a veth pair, created and removed by the test:
//! RC traffic across them, the same under 5 % loss of the receiver's incoming RoCE packets (an
//! nftables `numgen random` rule), and a capture that tshark decodes and an independent ICRC
//! implementation (Python's zlib) checks. Needs root and iproute2, nftables, tcpdump, tshark and
//! python3 (installed by scripts/setup-deps).

mod common;

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::netns::Hosts;
use softverbs::*;

/// The two hosts' addresses on the veth pair.
const IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 77, 0, 1), Ipv4Addr::new(10, 77, 0, 2)];

const ALL: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);
const LEN: usize = 1 << 20;
const FIRST_PSN: u32 = 0xFF_FFFA;

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// Runs a command to completion, failing on a non-zero exit.
/// The side running inside a namespace.
struct Node {
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    gid_index: u8,
    _ctx: Context,
    _pd: ProtectionDomain,
}

impl Node {
    fn new() -> Self {
        let dev = devices().unwrap().into_iter().next().expect("the veth device");
        let ctx = dev.open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(1024, None, 0).unwrap();
        let mut init = QpInit::new(QpType::Rc, &cq);
        init.cap.max_send_wr = 64;
        init.cap.max_recv_wr = 64;
        let qp = pd.create_qp(&init).unwrap();
        let mr = pd.register(LEN, ALL).unwrap();
        let gid_index = (0..16)
            .find(|&i| ctx.query_gid(1, i).is_ok_and(|g| g.to_ip().is_ipv4()))
            .expect("an IPv4 GID") as u8;
        let gid = ctx.query_gid(1, i32::from(gid_index)).unwrap();
        println!("{} {} {} {}", qp.qp_num(), mr.addr(), mr.rkey(), gid.to_ip());
        Self {
            cq,
            qp,
            mr,
            gid_index,
            _ctx: ctx,
            _pd: pd,
        }
    }

    fn connect(&self, line: &str) -> (u64, u32) {
        let v: Vec<&str> = line.split_whitespace().collect();
        let (qpn, addr, rkey) = (
            v[0].parse().unwrap(),
            v[1].parse().unwrap(),
            v[2].parse().unwrap(),
        );
        let ip: IpAddr = v[3].parse().unwrap();
        let init = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: ALL - AccessFlags::LOCAL_WRITE,
            ..Default::default()
        };
        self.qp
            .modify(
                &init,
                QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
            )
            .unwrap();
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: Mtu::Mtu1024,
            dest_qp_num: qpn,
            rq_psn: FIRST_PSN,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 1,
            ah_attr: AhAttr {
                grh: GlobalRoute {
                    dgid: Gid::from_ip(ip),
                    sgid_index: self.gid_index,
                    hop_limit: 64,
                    ..Default::default()
                },
                is_global: true,
                port_num: 1,
                ..Default::default()
            },
            ..Default::default()
        };
        self.qp
            .modify(
                &rtr,
                QpAttrMask::STATE
                    | QpAttrMask::AV
                    | QpAttrMask::PATH_MTU
                    | QpAttrMask::DEST_QPN
                    | QpAttrMask::RQ_PSN
                    | QpAttrMask::MAX_DEST_RD_ATOMIC
                    | QpAttrMask::MIN_RNR_TIMER,
            )
            .unwrap();
        let rts = QpAttr {
            qp_state: QpState::Rts,
            sq_psn: FIRST_PSN,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
            ..Default::default()
        };
        self.qp
            .modify(
                &rts,
                QpAttrMask::STATE
                    | QpAttrMask::SQ_PSN
                    | QpAttrMask::TIMEOUT
                    | QpAttrMask::RETRY_CNT
                    | QpAttrMask::RNR_RETRY
                    | QpAttrMask::MAX_QP_RD_ATOMIC,
            )
            .unwrap();
        (addr, rkey)
    }

    fn wait_one(&self) -> WorkCompletion {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut wc = [WorkCompletion::default(); 1];
        while Instant::now() < deadline {
            if self.cq.poll(&mut wc) == 1 {
                assert_eq!(wc[0].status, WcStatus::Success, "{:?}", wc[0]);
                return wc[0];
            }
        }
        panic!("no completion within 60 s");
    }
}

fn req(wr_id: u64, op: SendOp, sges: Vec<Sge>) -> SendRequest {
    SendRequest {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(sges),
        ud: None,
        xrc_srqn: None,
    }
}

/// Role run inside a namespace. The server receives a SEND and stays passive; the client sends,
/// reads the server's memory back, then writes into it.
fn role(which: &str, len: usize) {
    let node = Node::new();
    let mut stdin = std::io::stdin().lock().lines();
    let peer = stdin.next().unwrap().unwrap();
    let (addr, rkey) = node.connect(&peer);
    let remote = RemoteAddr { addr, rkey };
    match which {
        "server" => {
            node.qp
                .post_recv(&[RecvWr {
                    wr_id: 1,
                    sg_list: vec![node.mr.sge(0..len).unwrap()],
                }])
                .unwrap();
            let wc = node.wait_one();
            println!(
                "recv {} {}",
                wc.byte_len,
                node.mr.to_vec()[..len] == pattern(1)[..len]
            );
            assert_eq!(stdin.next().unwrap().unwrap(), "check");
            println!("mem {}", node.mr.to_vec()[..len] == pattern(2)[..len]);
        }
        _ => {
            node.mr.write(0, &pattern(1)).unwrap();
            node.qp
                .post_send(&[req(
                    1,
                    SendOp::Send {
                        imm: None,
                        invalidate: None,
                    },
                    vec![node.mr.sge(0..len).unwrap()],
                )])
                .unwrap();
            node.wait_one();
            // The server checks what the SEND left in its buffer before the WRITE below
            // overwrites it: wait until the parent heard from it.
            assert_eq!(stdin.next().unwrap().unwrap(), "go");
            node.mr.fill(0);
            node.qp
                .post_send(&[req(
                    2,
                    SendOp::Read { remote },
                    vec![node.mr.sge(0..len).unwrap()],
                )])
                .unwrap();
            node.wait_one();
            let read_ok = node.mr.to_vec()[..len] == pattern(1)[..len];
            node.mr.write(0, &pattern(2)).unwrap();
            node.qp
                .post_send(&[req(
                    3,
                    SendOp::Write { remote, imm: None },
                    vec![node.mr.sge(0..len).unwrap()],
                )])
                .unwrap();
            node.wait_one();
            let c = node.qp.counters();
            println!(
                "done {read_ok} {} {} {}",
                c.retransmits, c.timeouts, c.tail_probes
            );
        }
    }
}

/// Connects a server in host 1 and a client in host 0 and checks the whole exchange.
fn exchange(hosts: &Hosts, len: usize) -> String {
    let mut server = hosts.spawn(1, &["--role", &format!("server:{len}")]);
    let mut client = hosts.spawn(0, &["--role", &format!("client:{len}")]);
    let limit = Duration::from_secs(30);
    let s_info = server.line(limit);
    let c_info = client.line(limit);
    server.say(&c_info);
    client.say(&s_info);
    assert_eq!(
        server.line(limit),
        format!("recv {len} true"),
        "SEND arrived byte-exact"
    );
    client.say("go");
    let done = client.line(limit);
    assert!(done.starts_with("done true"), "READ was byte-exact: {done}");
    server.say("check");
    assert_eq!(server.line(limit), "mem true", "WRITE arrived byte-exact");
    done
}

fn over_veth() {
    let hosts = Hosts::new("sv", "v", IPS, true);
    exchange(&hosts, LEN);
}

fn five_percent_loss() {
    let hosts = Hosts::new("sv", "l", IPS, true);
    // Drop 5 % of the receiver's incoming RoCE packets. The sender's GSO batches are cut into
    // datagrams on the link first: the exchange is only a few dozen batches, and with whole
    // batches dropped about one run in 40 lost nothing that had to be sent again.
    hosts.segment_on_the_link();
    hosts.drop_incoming(1, 5, (4791, 5046));
    let start = Instant::now();
    let done = exchange(&hosts, LEN);
    let count = |i: usize| -> u64 { done.split_whitespace().nth(i).unwrap().parse().unwrap() };
    // A lost tail may come back as a tail probe alone (the newest packet sent again), which is
    // counted apart from the retransmissions.
    let (retransmits, probes) = (count(2), count(4));
    assert!(
        retransmits + probes > 0,
        "losses were recovered by retransmissions or tail probes: {done}"
    );
    assert!(hosts.dropped(1) > 0, "the rule dropped packets");
    println!("  5 % loss: 3 MiB byte-exact in {:?} ({done})", start.elapsed());
}

fn capture_decodes_and_icrc_agrees() {
    let hosts = Hosts::new("sv", "c", IPS, true);
    // With SOFTVERBS_GSO=1 the multi-packet messages leave as GSO batches, which a veth
    // passes on whole: the kernel's own segmentation gives the datagrams checked here, their
    // IPv4 IDs numbered from 0 within each batch, as the ICRCs must cover.
    hosts.segment_on_the_link();
    let gso = [("SOFTVERBS_GSO", "1")];
    let dir = std::env::temp_dir().join(format!("svcap{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pcap = dir.join("roce.pcap");
    let mut dump = Command::new("ip")
        .args([
            "netns",
            "exec",
            &hosts.ns[0],
            "tcpdump",
            "-Z",
            "root",
            "--immediate-mode",
            "-i",
            &hosts.ifs[0],
            "-U",
            "-w",
        ])
        .arg(&pcap)
        .arg("udp")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until tcpdump is capturing.
    let mut err = BufReader::new(dump.stderr.take().unwrap());
    let mut l = String::new();
    err.read_line(&mut l).unwrap();
    assert!(l.contains("listening"), "{l}");
    let len = 5000;
    let mut server = hosts.spawn_with(1, &["--role", &format!("server:{len}")], &gso);
    let mut client = hosts.spawn_with(0, &["--role", &format!("client:{len}")], &gso);
    let limit = Duration::from_secs(30);
    let s_info = server.line(limit);
    let c_info = client.line(limit);
    server.say(&c_info);
    client.say(&s_info);
    assert_eq!(server.line(limit), format!("recv {len} true"));
    client.say("go");
    client.line(limit);
    server.say("check");
    server.line(limit);
    std::thread::sleep(Duration::from_millis(200));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dump.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    dump.wait().unwrap();

    let s_qpn: u32 = s_info.split_whitespace().next().unwrap().parse().unwrap();
    let c_qpn: u32 = c_info.split_whitespace().next().unwrap().parse().unwrap();
    // Both namespaces' processes hold slot 1: every packet goes to port 4792.
    let port = 4791 + (s_qpn >> 16);
    let out = Command::new("tshark")
        .args(["-r"])
        .arg(&pcap)
        .args([
            "-o",
            &format!("infiniband.rroce.port:{port}"),
            "--disable-protocol",
            "rpcordma",
            "-T",
            "fields",
            "-E",
            "separator=,",
        ])
        .args([
            "-e",
            "infiniband.bth.opcode",
            "-e",
            "infiniband.bth.destqp",
            "-e",
            "infiniband.bth.psn",
            "-e",
            "ip.dst",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let num = |x: &str| match x.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16).unwrap(),
        None => x.parse().unwrap(),
    };
    let rows: Vec<(u32, u32, u32, Ipv4Addr)> = text
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (num(f[0]), num(f[1]), num(f[2]), f[3].parse().unwrap())
        })
        .collect();
    assert!(!rows.is_empty(), "tshark decoded no RoCE packet: {text}");
    let to_server: Vec<_> = rows.iter().filter(|r| r.3 == hosts.ips[1]).collect();
    let to_client: Vec<_> = rows.iter().filter(|r| r.3 == hosts.ips[0]).collect();
    assert!(
        to_server.iter().all(|r| r.1 == s_qpn),
        "requests name the server's QP"
    );
    assert!(
        to_client.iter().all(|r| r.1 == c_qpn),
        "responses name the client's QP"
    );
    assert_eq!(to_server.len() + to_client.len(), rows.len());
    // A retransmission (a slow machine can time an ACK out) repeats PSNs: keep first copies.
    let mut seen = std::collections::HashSet::new();
    let to_server: Vec<_> = to_server.into_iter().filter(|r| seen.insert(r.2)).collect();
    let opcodes: Vec<u32> = to_server.iter().map(|r| r.0).collect();
    // 5000 bytes at MTU 1024: SEND FIRST, 3 x MIDDLE, LAST; then READ REQUEST; WRITE FIRST..LAST.
    assert_eq!(&opcodes[..5], &[0, 1, 1, 1, 2], "SEND segmentation: {opcodes:?}");
    assert!(opcodes.contains(&12), "RDMA READ request");
    assert!(
        opcodes.contains(&6) && opcodes.contains(&8),
        "RDMA WRITE first and last"
    );
    let psns: Vec<u32> = to_server.iter().map(|r| r.2).collect();
    assert_eq!(psns[0], FIRST_PSN, "the first PSN is the one set at RTS");
    assert!(
        psns.windows(2)
            .all(|w| (w[1].wrapping_sub(w[0]) & 0xFF_FFFF) < 16),
        "PSNs advance and wrap: {psns:x?}"
    );
    assert!(
        psns.contains(&0xFF_FFFF) && psns.iter().any(|&p| p < 16),
        "the PSNs wrapped through zero: {psns:x?}"
    );
    let back: Vec<u32> = to_client.iter().map(|r| r.0).collect();
    assert!(back.contains(&17), "ACKs come back: {back:?}");
    assert!(
        back.contains(&13) && back.contains(&15),
        "READ responses come back: {back:?}"
    );

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/netns/icrc_check.py");
    let out = Command::new("python3").arg(script).arg(&pcap).output().unwrap();
    let verdict = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let field = |i: usize| -> usize { verdict.split_whitespace().nth(i).unwrap().parse().unwrap() };
    assert!(
        field(1) == rows.len() && verdict.ends_with("mismatched 0"),
        "{verdict} of {} packets",
        rows.len()
    );
    // The segments after the first of each batch carry IDs 1, 2, ...: their ICRCs were
    // checked against them.
    assert!(field(3) > 0, "no packet with a non-zero IPv4 ID: {verdict}");
    println!(
        "  capture: {} packets decoded by tshark, ICRC {verdict} by zlib",
        rows.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--role") {
        let (which, len) = args[i + 1].split_once(':').unwrap();
        role(which, len.parse().unwrap());
        return;
    }
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "the namespace tests need root (CI runs as root)"
    );
    let tests: [(&str, fn()); 3] = [
        ("over_veth", over_veth),
        ("five_percent_loss", five_percent_loss),
        ("capture_decodes_and_icrc_agrees", capture_decodes_and_icrc_agrees),
    ];
    let mut failed = 0;
    for (name, t) in tests {
        let ok = std::panic::catch_unwind(t).is_ok();
        println!("test netns::{name} ... {}", if ok { "ok" } else { "FAILED" });
        failed += usize::from(!ok);
    }
    println!("{} passed, {} failed", tests.len() - failed, failed);
    std::process::exit(i32::from(failed > 0));
}
