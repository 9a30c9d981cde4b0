//! Hostile datagrams during a transfer: in a private network namespace (so that nothing else
//! sends there), a server and a client move tens of MiB over RC (RDMA WRITE, SEND and READ,
//! every byte checked) over UDP on `::1`, while a third process blasts the server's UDP ports
//! with garbage: random bytes, truncated and oversized datagrams, packets to the live QP with
//! a bad ICRC, old PSNs or a wrong P_Key, UD datagrams with a wrong Q_Key, packets to QP
//! numbers nobody has, and forged forwarding wrappers; the same random and truncated kinds
//! over IPv4, whose ICRC a receiver cannot always check.
//!
//! The transfer must complete byte-exact, and the server's counters must account for the
//! garbage by reason: for each counter, what was sent of the kinds it counts, less what the
//! kernel dropped in the namespace (`/proc/net/snmp` and `snmp6`: UDP `InErrors`, receive
//! buffer overflows included). The server's resident set must not grow from one blast to the
//! next. Needs root (network namespaces).

mod common;

use std::collections::BTreeMap;
use std::io::BufRead;
use std::net::{Ipv6Addr, SocketAddr, UdpSocket};
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::{Namespace, Peer};
use softverbs::*;
use softverbs_wire::{BthRepr, DethRepr, Opcode, PacketRepr, Psn, RethRepr, RocePacket};

const ALL: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);
/// The region the client writes and reads back.
const AREA: usize = 16 << 20;
/// One work request's bytes.
const CHUNK: usize = 1 << 20;
/// SENDs per round.
const SENDS: usize = 4;
/// Receives the server keeps posted.
const RECVS: usize = 8;
/// First PSN in both directions.
const PSN0: u32 = 0x10_0000;
/// The UD Q_Key.
const QKEY: u32 = 0x1111_1111;
/// Datagrams of each kind per blast.
const PER_KIND: u64 = 2000;
/// Blasts.
const BLASTS: usize = 3;
const LINE: Duration = Duration::from_secs(120);

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) >> 7).wrapping_add(seed) as u8)
        .collect()
}

/// The device (sv_lo of the namespace) and the GID index of `::1`.
fn open() -> (Context, u8) {
    let ctx = common::lo();
    let gid = Gid::from_ip(Ipv6Addr::LOCALHOST.into());
    let index = (0..16)
        .find(|&i| ctx.query_gid(1, i).unwrap() == gid)
        .expect("a ::1 GID") as u8;
    (ctx, index)
}

fn connect(ctx: &Context, gid_index: u8, qp: &QueuePair, dest: u32) {
    let mut ah = common::ah_attr(ctx);
    ah.grh.dgid = Gid::from_ip(Ipv6Addr::LOCALHOST.into());
    ah.grh.sgid_index = gid_index;
    qp.modify(
        &QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: ALL - AccessFlags::LOCAL_WRITE,
            ..Default::default()
        },
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )
    .unwrap();
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: Mtu::Mtu4096,
            dest_qp_num: dest,
            rq_psn: PSN0,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 1,
            ah_attr: ah,
            ..Default::default()
        },
        QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER,
    )
    .unwrap();
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rts,
            sq_psn: PSN0,
            // 268 ms, 7 retries: the garbage costs the server time, and the kernel may drop
            // real packets with it (recovered by retransmission).
            timeout: 16,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
            ..Default::default()
        },
        QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC,
    )
    .unwrap();
}

/// Lines from stdin on a channel, so that a role can poll for commands.
fn commands() -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines() {
            if tx.send(l.unwrap_or_default()).is_err() {
                return;
            }
        }
        // The parent is gone.
        std::process::exit(0);
    });
    rx
}

fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    s.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
}

/// The server: the target of the transfer and of the garbage.
fn server() {
    let (ctx, gid_index) = open();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4096, None, 0).unwrap();
    let mut init = QpInit::new(QpType::Rc, &cq);
    init.cap.max_send_wr = 256;
    init.cap.max_recv_wr = 256;
    let rc = pd.create_qp(&init).unwrap();
    let ud_cq = ctx.create_cq(64, None, 0).unwrap();
    let mut ud_init = QpInit::new(QpType::Ud, &ud_cq);
    ud_init.cap.max_recv_wr = 16;
    let ud = pd.create_qp(&ud_init).unwrap();
    common::to_rts(&ctx, &ud, 0);
    let area = pd.register(AREA, ALL).unwrap();
    let recv = pd.register(RECVS * CHUNK, AccessFlags::LOCAL_WRITE).unwrap();
    ud.post_recv(&common::recv_wrs(&recv, 0..16, 256)).unwrap();
    let (slot, port, holds) = ctx.udp_status().unwrap();
    println!(
        "info {} {} {} {} {port} {} {slot}",
        rc.qp_num(),
        ud.qp_num(),
        area.addr(),
        area.rkey(),
        u8::from(holds)
    );
    let cmds = commands();
    let client: u32 = cmds.recv().unwrap().parse().unwrap();
    connect(&ctx, gid_index, &rc, client);
    let post = |i: usize| {
        rc.post_recv(&[RecvWr {
            wr_id: i as u64,
            sg_list: vec![recv.sge(i * CHUNK..(i + 1) * CHUNK).unwrap()],
        }])
        .unwrap();
    };
    (0..RECVS).for_each(post);
    println!("ready");
    let mut wc = [WorkCompletion::default(); 16];
    loop {
        let n = cq.poll(&mut wc);
        for w in &wc[..n] {
            let i = w.wr_id as usize;
            let mut got = vec![0u8; CHUNK];
            recv.read(i * CHUNK, &mut got).unwrap();
            let seed = u64::from_le_bytes(got[..8].try_into().unwrap());
            let ok = w.status == WcStatus::Success
                && w.byte_len as usize == CHUNK
                && got[8..] == pattern(seed, CHUNK)[8..];
            println!("send {seed} {ok}");
            post(i);
        }
        match cmds.try_recv() {
            Ok(c) if c == "check" => {
                let c = ctx.counters();
                let q = rc.counters();
                println!(
                    "counters bad_icrc={} malformed={} unknown_qp={} bad_pkey={} bad_qkey={} unverified={} \
                     rx_dropped={} forged={} duplicates={} rx_packets={} rss={}",
                    c.rx_bad_icrc,
                    c.rx_malformed,
                    c.rx_unknown_qp,
                    c.rx_bad_pkey,
                    c.rx_bad_qkey,
                    c.rx_icrc_unverified,
                    c.rx_dropped,
                    ctx.forged_forwards(),
                    q.duplicates,
                    c.rx_packets,
                    rss()
                );
            }
            Ok(_) | Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
        }
        if n == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// The client: rounds of WRITE, SEND and READ back until told to stop.
fn client() {
    let (ctx, gid_index) = open();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4096, None, 0).unwrap();
    let mut init = QpInit::new(QpType::Rc, &cq);
    init.cap.max_send_wr = 256;
    let qp = pd.create_qp(&init).unwrap();
    let out = pd.register(AREA, ALL).unwrap();
    let back = pd.register(AREA, ALL).unwrap();
    let sends = pd.register(SENDS * CHUNK, ALL).unwrap();
    println!("info {}", qp.qp_num());
    let cmds = commands();
    let info = cmds.recv().unwrap();
    let v: Vec<u64> = info.split_whitespace().map(|t| t.parse().unwrap()).collect();
    connect(&ctx, gid_index, &qp, v[0] as u32);
    let remote = |off: usize| RemoteAddr {
        addr: v[1] + off as u64,
        rkey: v[2] as u32,
    };
    let req = |wr_id: u64, op: SendOp, sge: Sge| SendRequest {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![sge]),
        ud: None,
        xrc_srqn: None,
    };
    let mut round = 0u64;
    loop {
        out.write(0, &pattern(round, AREA)).unwrap();
        let mut wrs = Vec::new();
        for k in 0..AREA / CHUNK {
            let r = k * CHUNK;
            wrs.push(req(
                1,
                SendOp::Write {
                    remote: remote(r),
                    imm: None,
                },
                out.sge(r..r + CHUNK).unwrap(),
            ));
        }
        for k in 0..SENDS {
            let seed = round * 100 + k as u64;
            let mut bytes = pattern(seed, CHUNK);
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            sends.write(k * CHUNK, &bytes).unwrap();
            let send = SendOp::Send {
                imm: None,
                invalidate: None,
            };
            wrs.push(req(2, send, sends.sge(k * CHUNK..(k + 1) * CHUNK).unwrap()));
        }
        back.fill(0);
        for k in 0..AREA / CHUNK {
            let r = k * CHUNK;
            wrs.push(req(
                3,
                SendOp::Read { remote: remote(r) },
                back.sge(r..r + CHUNK).unwrap(),
            ));
        }
        qp.post_send(&wrs).unwrap();
        let deadline = Instant::now() + LINE;
        let mut done = Vec::new();
        let mut wc = [WorkCompletion::default(); 64];
        while done.len() < wrs.len() && Instant::now() < deadline {
            let n = cq.poll(&mut wc);
            done.extend_from_slice(&wc[..n]);
        }
        let ok = done.len() == wrs.len()
            && done.iter().all(|w| w.status == WcStatus::Success)
            && back.to_vec() == out.to_vec();
        if !ok {
            let bad: Vec<_> = done
                .iter()
                .filter(|w| w.status != WcStatus::Success)
                .take(4)
                .collect();
            eprintln!(
                "round {round}: {} of {} completions, errors {bad:?}",
                done.len(),
                wrs.len()
            );
        }
        println!("round {round} {ok}");
        round += 1;
        if !ok || cmds.try_recv().is_ok() {
            let c = qp.counters();
            println!(
                "done {round} retransmits={} timeouts={}",
                c.retransmits, c.timeouts
            );
            return;
        }
    }
}

/// A tiny deterministic generator (xorshift64*), seeded per blast.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// What the blaster aims at.
#[derive(Debug, Clone, Copy)]
struct Target {
    rc_qpn: u32,
    ud_qpn: u32,
    addr: u64,
    rkey: u32,
    port: u16,
    base: u16,
    slot: u8,
}

impl Target {
    fn parse(v: &[&str]) -> Self {
        Self {
            rc_qpn: v[0].parse().unwrap(),
            ud_qpn: v[1].parse().unwrap(),
            addr: v[2].parse().unwrap(),
            rkey: v[3].parse().unwrap(),
            port: v[4].parse().unwrap(),
            base: v[5].parse().unwrap(),
            slot: v[6].parse().unwrap(),
        }
    }

    fn line(&self) -> String {
        format!(
            "{} {} {} {} {} {} {}",
            self.rc_qpn, self.ud_qpn, self.addr, self.rkey, self.port, self.base, self.slot
        )
    }
}

/// A WRITE ONLY of `len` poison bytes into the live region.
fn poison_write(t: &Target, psn: u32, len: usize, pkey: u16) -> PacketRepr {
    let mut bth = BthRepr::new(Opcode::RcWriteOnly, t.rc_qpn, Psn::new(psn));
    bth.pkey = pkey;
    PacketRepr {
        reth: Some(RethRepr {
            va: t.addr,
            rkey: t.rkey,
            dma_len: len as u32,
        }),
        ..PacketRepr::new(bth, len)
    }
}

fn emit(repr: &PacketRepr, fill: u8) -> Vec<u8> {
    let mut pkt = vec![0u8; repr.buffer_len()];
    repr.emit_with_payload(&mut pkt, &vec![fill; repr.payload_len])
        .unwrap();
    pkt
}

/// A PSN well behind anything the live QP expects (the transfer moves its expected PSN by
/// well under 2^21): a duplicate, acknowledged again but never executed.
fn old_psn(rng: &mut Rng) -> u32 {
    PSN0.wrapping_sub(0x20_0000 + rng.below(0x10_0000) as u32) & 0xFF_FFFF
}

/// Blasts `PER_KIND` datagrams of every kind at the target and prints what the server's
/// counters must show for them.
fn blaster(t: Target, seed: u64) {
    let v4 = UdpSocket::bind("127.0.0.1:0").unwrap();
    let v6 = UdpSocket::bind("[::1]:0").unwrap();
    let to4 = SocketAddr::from(([127, 0, 0, 1], t.port));
    let to6 = SocketAddr::from((Ipv6Addr::LOCALHOST, t.port));
    let base6 = SocketAddr::from((Ipv6Addr::LOCALHOST, t.base));
    let mut rng = Rng(seed | 1);
    let mut expect: BTreeMap<&str, u64> = BTreeMap::new();
    let live = [t.rc_qpn, t.ud_qpn];
    // Over IPv4 the ICRC of a sender's datagram may not be checkable; what is left is decided
    // by the packet itself: does it parse, and to which QP.
    let v4_class = |bytes: &[u8]| match RocePacket::parse(bytes) {
        Err(_) => Some("malformed"),
        Ok(p) => {
            let q = p.repr.bth.dest_qpn;
            (!live.contains(&q) && q & 0xFFFF != 1 && q != 0xFF_FFFF).then_some("unknown_qp")
        }
    };
    let kinds = 11u64;
    let mut sent = 0u64;
    for i in 0..PER_KIND * kinds {
        let (bytes, to, counter): (Vec<u8>, SocketAddr, &str) = match i % kinds {
            // Random bytes, 0..1500 of them.
            0 => {
                let len = rng.below(1501) as usize;
                (rng.bytes(len), to6, "bad_icrc")
            }
            // A valid packet to the live QP, cut short anywhere.
            1 => {
                let mut p = emit(&poison_write(&t, PSN0, 1024, 0xFFFF), 0xEE);
                icrc(&v6, to6, &mut p);
                let len = 1 + rng.below(p.len() as u64 - 1) as usize;
                p.truncate(len);
                (p, to6, "bad_icrc")
            }
            // Random bytes beyond any MTU, up to the largest datagram.
            2 => {
                let len = 9000 + rng.below(56_000) as usize;
                (rng.bytes(len), to6, "bad_icrc")
            }
            // The live QP at an expected PSN, with a bad ICRC: must never reach it.
            3 => {
                let mut p = emit(
                    &poison_write(&t, PSN0 + rng.below(0x8000) as u32, 4096, 0xFFFF),
                    0xEE,
                );
                icrc(&v6, to6, &mut p);
                let n = p.len();
                p[n - 1 - rng.below(4) as usize] ^= 1 + rng.below(255) as u8;
                (p, to6, "bad_icrc")
            }
            // The live QP with an old PSN and a good ICRC: a duplicate.
            4 => {
                let mut p = emit(&poison_write(&t, old_psn(&mut rng), 4096, 0xFFFF), 0xEE);
                icrc(&v6, to6, &mut p);
                (p, to6, "duplicates")
            }
            // The live QP with a P_Key of another partition (any PSN).
            5 => {
                let psn = PSN0 + rng.below(0x8000) as u32;
                let mut p = emit(&poison_write(&t, psn, 4096, 0x1234), 0xEE);
                icrc(&v6, to6, &mut p);
                (p, to6, "bad_pkey")
            }
            // The live UD QP with the wrong Q_Key.
            6 => {
                let repr = PacketRepr {
                    deth: Some(DethRepr {
                        qkey: QKEY ^ (1 + rng.below(0xFFFF) as u32),
                        src_qpn: 0x1234,
                    }),
                    ..PacketRepr::new(BthRepr::new(Opcode::UdSendOnly, t.ud_qpn, Psn::new(1)), 64)
                };
                let mut p = emit(&repr, 0xEE);
                icrc(&v6, to6, &mut p);
                (p, to6, "bad_qkey")
            }
            // A QP number of the server's slot that nobody has, small and oversized.
            7 => {
                let qpn = (u32::from(t.slot) << 16) | (0xF000 + rng.below(0xF00) as u32);
                let len = if rng.below(2) == 0 { 256 } else { 16_000 };
                let repr = PacketRepr {
                    reth: Some(RethRepr {
                        va: t.addr,
                        rkey: t.rkey,
                        dma_len: len as u32,
                    }),
                    ..PacketRepr::new(BthRepr::new(Opcode::RcWriteOnly, qpn, Psn::new(PSN0)), len)
                };
                let mut p = emit(&repr, 0xEE);
                icrc(&v6, to6, &mut p);
                (p, to6, "unknown_qp")
            }
            // A forwarding wrapper from a socket that is not the standard port, around a
            // packet for the live QP, to the slot port or the base port.
            8 => {
                let mut p = Vec::from(*b"SVFW");
                p.extend_from_slice(&Ipv6Addr::LOCALHOST.octets());
                p.extend_from_slice(&t.base.to_be_bytes());
                p.extend_from_slice(&Ipv6Addr::LOCALHOST.octets());
                let mut inner = emit(&poison_write(&t, PSN0, 512, 0xFFFF), 0xEE);
                icrc(&v6, to6, &mut inner);
                p.extend_from_slice(&inner);
                let to = if t.base != 0 && rng.below(2) == 0 {
                    base6
                } else {
                    to6
                };
                (p, to, "forged")
            }
            // Random bytes over IPv4.
            9 => loop {
                let len = rng.below(1501) as usize;
                let b = rng.bytes(len);
                if b.starts_with(b"SVFW") {
                    continue;
                }
                if let Some(c) = v4_class(&b) {
                    break (b, to4, c);
                }
            },
            // A valid packet to the live QP cut within its headers, over IPv4.
            _ => {
                let p = emit(&poison_write(&t, PSN0, 64, 0xFFFF), 0xEE);
                let len = 1 + rng.below(31) as usize;
                (p[..len].to_vec(), to4, "malformed")
            }
        };
        let sock = if to.is_ipv4() { &v4 } else { &v6 };
        sock.send_to(&bytes, to).unwrap();
        *expect.entry(counter).or_default() += 1;
        if to.is_ipv4() {
            *expect.entry("unverified").or_default() += 1;
        }
        sent += 1;
        // Bursts that the server can keep up with, mostly.
        if sent % 64 == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let body: Vec<String> = expect.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("expect total={sent} {}", body.join(" "));
}

fn icrc(from: &UdpSocket, to: SocketAddr, p: &mut [u8]) {
    softverbs_wire::icrc::fill(from.local_addr().unwrap(), to, p).unwrap();
}

/// `k=v` pairs of a line.
fn pairs(line: &str) -> BTreeMap<String, u64> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().unwrap()))
        .collect()
}

/// UDP datagrams the kernel dropped in namespace `ns` (IPv4 and IPv6 `InErrors`, which count
/// receive buffer overflows).
fn kernel_drops(ns: &str) -> u64 {
    let read = |f: &str| {
        let out = Command::new("ip")
            .args(["netns", "exec", ns, "cat", f])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let snmp = read("/proc/net/snmp");
    let udp: Vec<&str> = snmp.lines().filter(|l| l.starts_with("Udp:")).collect();
    let names: Vec<&str> = udp[0].split_whitespace().collect();
    let values: Vec<&str> = udp[1].split_whitespace().collect();
    let v4: u64 = values[names.iter().position(|n| *n == "InErrors").unwrap()]
        .parse()
        .unwrap();
    let v6: u64 = read("/proc/net/snmp6")
        .lines()
        .find_map(|l| l.strip_prefix("Udp6InErrors"))
        .map_or(0, |v| v.trim().parse().unwrap());
    v4 + v6
}

/// Which server counters count which kinds of the blaster (they count nothing of the real
/// traffic in a namespace of its own, except duplicates and unverified ICRCs, see below).
const COUNTERS: [&str; 8] = [
    "bad_icrc",
    "malformed",
    "unknown_qp",
    "bad_pkey",
    "bad_qkey",
    "forged",
    "duplicates",
    "unverified",
];

/// The two processes of the transfer, and what they reported.
struct Pair {
    server: Peer,
    client: Peer,
    rounds: u64,
    sends: u64,
}

impl Pair {
    /// Reads what the two have said; fails on any bad round or SEND. Returns the server's
    /// counters if it printed them.
    fn progress(&mut self) -> Option<BTreeMap<String, u64>> {
        while let Some(l) = self.client.try_line(Duration::ZERO) {
            assert!(l.ends_with(" true"), "the client's round failed: {l}");
            self.rounds += 1;
        }
        let mut counters = None;
        while let Some(l) = self.server.try_line(Duration::ZERO) {
            if let Some(c) = l.strip_prefix("counters ") {
                counters = Some(pairs(c));
            } else {
                assert!(l.ends_with(" true"), "a SEND arrived damaged: {l}");
                self.sends += 1;
            }
        }
        counters
    }

    /// The server's counters now.
    fn counters(&mut self) -> BTreeMap<String, u64> {
        self.server.say("check");
        let deadline = Instant::now() + LINE;
        loop {
            if let Some(c) = self.progress() {
                return c;
            }
            assert!(Instant::now() < deadline, "no counters from the server");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the client to complete `n` rounds in all.
    fn rounds_done(&mut self, n: u64, what: &str) {
        let deadline = Instant::now() + LINE;
        while self.rounds < n {
            self.progress();
            assert!(Instant::now() < deadline, "the transfer stalled: {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn hostile_datagrams_during_a_transfer() {
    let ns = Namespace::new("svhostile");
    let spawn = |role: &str| {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &ns.0])
            .arg(std::env::current_exe().unwrap())
            .args(["--role", role])
            .env("SOFTVERBS_INTERFACES", "lo")
            .env("SOFTVERBS_SHM", "0")
            .env("SOFTVERBS_UDP_PORT", "4791");
        Peer::spawn(cmd)
    };
    let mut server = spawn("server");
    let info = server.line(LINE);
    let v: Vec<&str> = info.split_whitespace().skip(1).collect();
    // rc_qpn ud_qpn addr rkey port holds_base slot
    let target = Target {
        rc_qpn: v[0].parse().unwrap(),
        ud_qpn: v[1].parse().unwrap(),
        addr: v[2].parse().unwrap(),
        rkey: v[3].parse().unwrap(),
        port: v[4].parse().unwrap(),
        // The base port is aimed at too if the server holds it (it started first).
        base: if v[5] == "1" { 4791 } else { 0 },
        slot: v[6].parse().unwrap(),
    };
    assert_ne!(
        target.base, 0,
        "the server, first in its namespace, holds the base port"
    );
    let mut client = spawn("client");
    let cinfo = client.line(LINE);
    server.say(cinfo.split_whitespace().nth(1).unwrap());
    assert_eq!(server.line(LINE), "ready");
    client.say(&format!("{} {} {}", target.rc_qpn, target.addr, target.rkey));
    let mut pair = Pair {
        server,
        client,
        rounds: 0,
        sends: 0,
    };
    // A first round, then the counters before any garbage.
    pair.rounds_done(1, "before any garbage");
    let mut before = pair.counters();
    let mut rss = Vec::new();
    for blast in 0..BLASTS {
        let drops_before = kernel_drops(&ns.0);
        let rounds_before = pair.rounds;
        let mut b = spawn("blaster");
        b.say(&format!("{} {}", target.line(), blast + 1));
        let expect = pairs(b.line(LINE).strip_prefix("expect ").unwrap());
        drop(b);
        // Two more rounds with the garbage queued or past.
        pair.rounds_done(rounds_before + 2, &format!("after blast {}", blast + 1));
        // Counters until everything sent was counted or dropped by the kernel, or until they
        // stop moving.
        let total = expect["total"];
        let counted_of = |c: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>| -> u64 {
            COUNTERS
                .iter()
                .filter(|k| **k != "unverified")
                .map(|k| c[*k] - before[*k])
                .sum()
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut last: Option<BTreeMap<String, u64>> = None;
        let (after, drops) = loop {
            let c = pair.counters();
            let drops = kernel_drops(&ns.0) - drops_before;
            let still = last
                .as_ref()
                .is_some_and(|l| counted_of(l, &before) == counted_of(&c, &before));
            if counted_of(&c, &before) + drops >= total || still || Instant::now() >= deadline {
                break (c, drops);
            }
            last = Some(c);
            std::thread::sleep(Duration::from_millis(500));
        };
        let delta = |k: &str| after[k] - before[k];
        let counted = counted_of(&after, &before);
        println!(
            "  blast {}: {total} datagrams, {counted} counted, {drops} dropped by the kernel; {:?}",
            blast + 1,
            COUNTERS.iter().map(|k| (*k, delta(k))).collect::<Vec<_>>()
        );
        assert!(
            counted + drops >= total,
            "counted {counted} + kernel {drops} < sent {total}: {expect:?}"
        );
        for k in COUNTERS {
            let sent = expect.get(k).copied().unwrap_or(0);
            let got = delta(k);
            // Retransmissions of the transfer are duplicates too.
            let exact = k != "duplicates";
            assert!(
                got + drops >= sent && (!exact || got <= sent),
                "{k}: sent {sent}, counted {got}, kernel drops {drops}"
            );
        }
        rss.push(after["rss"]);
        before = after;
    }
    pair.client.say("stop");
    let deadline = Instant::now() + LINE;
    let done = loop {
        let l = pair.client.line(LINE);
        if l.starts_with("done") {
            break l;
        }
        assert!(l.ends_with(" true"), "{l}");
        pair.rounds += 1;
        assert!(Instant::now() < deadline);
    };
    pair.progress();
    let rounds = pair.rounds;
    assert!(rounds > 2 * BLASTS as u64, "{rounds} rounds");
    // Every round's SENDs but perhaps the last one's were verified by now.
    assert!(
        pair.sends >= SENDS as u64 * (rounds - 1),
        "{} SENDs verified in {rounds} rounds",
        pair.sends
    );
    // 16 MiB written, 4 MiB sent and 16 MiB read back per round.
    println!(
        "  {rounds} rounds ({} MiB moved byte-exact), {done}; server RSS after each blast {:?} MiB",
        rounds * 36,
        rss.iter().map(|r| r >> 20).collect::<Vec<_>>()
    );
    // Flat: the garbage leaves nothing behind.
    let growth = rss.last().unwrap().saturating_sub(rss[0]);
    assert!(
        growth < 8 << 20,
        "the server's RSS grew by {growth} bytes: {rss:?}"
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--role") {
        match args[i + 1].as_str() {
            "server" => server(),
            "client" => client(),
            _ => {
                let mut l = String::new();
                std::io::stdin().read_line(&mut l).unwrap();
                let v: Vec<&str> = l.split_whitespace().collect();
                blaster(Target::parse(&v), v[7].parse().unwrap());
            }
        }
        return;
    }
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "the hostile-datagram test needs root (network namespaces)"
    );
    let tests: [(&str, fn()); 1] = [(
        "hostile_datagrams_during_a_transfer",
        hostile_datagrams_during_a_transfer,
    )];
    let mut failed = 0;
    for (name, t) in tests {
        let ok = std::panic::catch_unwind(t).is_ok();
        println!("test hostile::{name} ... {}", if ok { "ok" } else { "FAILED" });
        failed += usize::from(!ok);
    }
    println!("{} passed, {} failed", tests.len() - failed, failed);
    std::process::exit(i32::from(failed > 0));
}
