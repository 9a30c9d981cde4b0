//! Two processes on one host talking RoCEv2 over UDP: the test re-runs its own executable as
//! the peer (`--peer`), exchanging QP numbers, PSNs and memory keys over the child's stdin and
//! stdout, as the pingpong tools do over TCP.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use softverbs::*;

const ALL: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);
const LEN: usize = 1 << 20;

/// One side: a context, an RC QP and a 1 MiB region.
struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    gid_index: u8,
}

/// What a side tells its peer.
#[derive(Debug, Clone, Copy)]
struct Info {
    qpn: u32,
    addr: u64,
    rkey: u32,
}

impl Info {
    fn line(&self) -> String {
        format!("{} {} {}\n", self.qpn, self.addr, self.rkey)
    }

    fn parse(line: &str) -> Self {
        let v: Vec<u64> = line
            .split_whitespace()
            .map(|t| t.parse().expect("number"))
            .collect();
        Self {
            qpn: v[0] as u32,
            addr: v[1],
            rkey: v[2] as u32,
        }
    }
}

fn side(qp_type: QpType) -> Side {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024, None, 0).unwrap();
    let mut init = QpInit::new(qp_type, &cq);
    init.cap.max_send_wr = 256;
    init.cap.max_recv_wr = 256;
    let qp = pd.create_qp(&init).unwrap();
    let mr = pd.register(LEN, ALL).unwrap();
    let gid_index = (0..16)
        .find(|&i| ctx.query_gid(1, i).unwrap() == Gid::from(Ipv4Addr::LOCALHOST))
        .unwrap() as u8;
    Side {
        ctx,
        pd,
        cq,
        qp,
        mr,
        gid_index,
    }
}

impl Side {
    fn info(&self) -> Info {
        Info {
            qpn: self.qp.qp_num(),
            addr: self.mr.addr(),
            rkey: self.mr.rkey(),
        }
    }

    /// RC/UC: INIT, RTR (to `peer`) and RTS with `retry_cnt` retries: with 7, an ACK timeout
    /// of 268 ms (a loaded host may leave a process unscheduled for a good part of the 134 ms
    /// that 7 retries of 16.8 ms give), with fewer 16.8 ms (the tests of a vanished peer).
    fn connect(&self, peer: u32, retry_cnt: u8) {
        let qp = &self.qp;
        let init = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: ALL - AccessFlags::LOCAL_WRITE,
            qkey: 0x11,
            ..Default::default()
        };
        let extra = if qp.qp_type() == QpType::Ud {
            QpAttrMask::QKEY
        } else {
            QpAttrMask::ACCESS_FLAGS
        };
        qp.modify(
            &init,
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | extra,
        )
        .unwrap();
        if qp.qp_type() == QpType::Ud {
            qp.modify(
                &QpAttr {
                    qp_state: QpState::Rtr,
                    ..Default::default()
                },
                QpAttrMask::STATE,
            )
            .unwrap();
            qp.modify(
                &QpAttr {
                    qp_state: QpState::Rts,
                    ..Default::default()
                },
                QpAttrMask::STATE | QpAttrMask::SQ_PSN,
            )
            .unwrap();
            return;
        }
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: Mtu::Mtu4096,
            dest_qp_num: peer,
            rq_psn: 0xFF_FFF0, // wraps around during the test
            max_dest_rd_atomic: 16,
            min_rnr_timer: 1,
            ah_attr: AhAttr {
                grh: GlobalRoute {
                    dgid: Gid::from(Ipv4Addr::LOCALHOST),
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
        qp.modify(
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
            sq_psn: 0xFF_FFF0,
            timeout: if retry_cnt >= 7 { 16 } else { 12 },
            retry_cnt,
            rnr_retry: 7,
            max_rd_atomic: 16,
            ..Default::default()
        };
        qp.modify(
            &rts,
            QpAttrMask::STATE
                | QpAttrMask::SQ_PSN
                | QpAttrMask::TIMEOUT
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::MAX_QP_RD_ATOMIC,
        )
        .unwrap();
    }

    fn wait(&self, n: usize, limit: Duration) -> Vec<WorkCompletion> {
        let deadline = Instant::now() + limit;
        let mut got = Vec::new();
        let mut wc = [WorkCompletion::default(); 32];
        while got.len() < n && Instant::now() < deadline {
            let k = self.cq.poll(&mut wc);
            got.extend_from_slice(&wc[..k]);
        }
        got
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

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The peer process: reads a command and the parent's info, answers with its own, then does
/// what the command says.
fn peer() {
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines().map(|l| l.unwrap());
    let cmd = lines.next().unwrap();
    let qp_type = if cmd.starts_with("ud") {
        QpType::Ud
    } else {
        QpType::Rc
    };
    let s = side(qp_type);
    let parent = Info::parse(&lines.next().unwrap());
    s.mr.write(0, &pattern(7)).unwrap();
    print!("{}", s.info().line());
    std::io::stdout().flush().unwrap();
    s.connect(parent.qpn, 7);
    match cmd.as_str() {
        // Receive one SEND, then stay passive while the parent reads and writes our memory.
        "rc" => {
            s.qp.post_recv(&[RecvWr {
                wr_id: 1,
                sg_list: vec![s.mr.sge(0..LEN).unwrap()],
            }])
            .unwrap();
            let c = s.wait(1, Duration::from_secs(20));
            assert_eq!(c.len(), 1, "no SEND arrived");
            assert_eq!((c[0].status, c[0].byte_len), (WcStatus::Success, LEN as u32));
            let ok = s.mr.to_vec() == pattern(1);
            println!("recv {ok}");
            // Now do nothing at all until told to check: one-sided operations must progress.
            let line = lines.next().unwrap();
            assert_eq!(line, "check");
            println!("mem {}", s.mr.to_vec()[..LEN / 2] == pattern(2)[..LEN / 2]);
        }
        // Stay silent: the parent kills us mid-transfer.
        "victim" => {
            let _ = lines.next();
        }
        "ud" => {
            s.qp.post_recv(&[RecvWr {
                wr_id: 1,
                sg_list: vec![s.mr.sge(0..4096).unwrap()],
            }])
            .unwrap();
            println!("ready");
            let c = s.wait(1, Duration::from_secs(20));
            let mut payload = [0u8; 5];
            s.mr.read(40, &mut payload).unwrap();
            println!(
                "ud {} {} {}",
                c.len(),
                c.first().map_or(0, |w| w.src_qp),
                String::from_utf8_lossy(&payload)
            );
        }
        "mw-send-inv" | "mw-local-inv" => mw_peer(&s, &cmd, &mut lines),
        other => panic!("unknown command {other}"),
    }
}

/// The window the memory-window tests expose: 64 KiB at offset 4096 of the peer's target.
const WINDOW: std::ops::Range<usize> = 4096..4096 + 65536;

/// The peer of the memory-window tests: binds a type 2 window over part of a region that has
/// no remote rights of its own, tells the parent where it is, then invalidates it (LOCAL_INV
/// when told to, or through the parent's SEND with Invalidate) and reports what it sees.
fn mw_peer(s: &Side, cmd: &str, lines: &mut impl Iterator<Item = String>) {
    let target =
        s.pd.register(LEN, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)
            .unwrap();
    let mw = s.pd.alloc_mw(MwType::Type2).unwrap();
    let rkey = inc_rkey(mw.rkey());
    let addr = target.addr() + WINDOW.start as u64;
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    s.qp.post_send(&[mw.bind_request(100, rkey, &target, addr, WINDOW.len() as u64, access)])
        .unwrap();
    let c = s.wait(1, Duration::from_secs(20));
    assert_eq!((c[0].status, c[0].opcode), (WcStatus::Success, WcOpcode::BindMw));
    s.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: vec![s.mr.sge(0..64).unwrap()],
    }])
    .unwrap();
    println!("window {addr} {rkey}");
    // What the parent wrote through the window, and nothing outside it.
    let written = |target: &MemoryRegion| {
        let mem = target.to_vec();
        mem[WINDOW] == pattern(3)[..WINDOW.len()]
            && mem[..WINDOW.start].iter().all(|&b| b == 0)
            && mem[WINDOW.end..].iter().all(|&b| b == 0)
    };
    assert_eq!(lines.next().unwrap(), "check");
    println!("mem {}", written(&target));
    if cmd == "mw-local-inv" {
        assert_eq!(lines.next().unwrap(), "invalidate");
        s.qp.post_send(&[req(101, SendOp::LocalInv { rkey }, vec![])])
            .unwrap();
        let c = s.wait(1, Duration::from_secs(20));
        let ok = c[0].status == WcStatus::Success && c[0].opcode == WcOpcode::LocalInv;
        println!("inv {ok} true {}", mw.current().1);
    } else {
        // The receive completes only after the window was invalidated.
        let c = s.wait(1, Duration::from_secs(20));
        let with_inv = c[0].wc_flags.contains(WcFlags::WITH_INV) && c[0].imm_data == rkey;
        println!(
            "inv {} {with_inv} {}",
            c[0].status == WcStatus::Success,
            mw.current().1
        );
    }
    assert_eq!(lines.next().unwrap(), "check");
    println!("mem {}", written(&target));
}

/// A remote WRITE and READ through a type 2 window of another process work; after the window is
/// invalidated (by the peer's LOCAL_INV, or by our SEND with Invalidate) a WRITE through it
/// fails with a remote access error and leaves the memory as it was.
fn mw_between_processes(cmd: &str) {
    let s = side(QpType::Rc);
    let (mut p, peer) = Peer::spawn(cmd, s.info());
    s.connect(peer.qpn, 7);
    let w: Vec<u64> = p.line()["window ".len()..]
        .split(' ')
        .map(|t| t.parse().unwrap())
        .collect();
    let remote = RemoteAddr {
        addr: w[0],
        rkey: w[1] as u32,
    };
    let n = WINDOW.len();
    s.mr.write(0, &pattern(3)[..n]).unwrap();
    let write = |wr_id| {
        req(
            wr_id,
            SendOp::Write { remote, imm: None },
            vec![s.mr.sge(0..n).unwrap()],
        )
    };
    s.qp.post_send(&[write(1)]).unwrap();
    let read = req(2, SendOp::Read { remote }, vec![s.mr.sge(n..2 * n).unwrap()]);
    s.qp.post_send(&[read]).unwrap();
    let c = s.wait(2, Duration::from_secs(30));
    let got: Vec<_> = c.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(got, [(1, WcStatus::Success), (2, WcStatus::Success)]);
    let mut back = vec![0u8; n];
    s.mr.read(n, &mut back).unwrap();
    assert_eq!(back, pattern(3)[..n], "READ through the window is byte-exact");
    writeln!(p.stdin, "check").unwrap();
    assert_eq!(
        p.line(),
        "mem true",
        "WRITE landed in the window and nowhere else"
    );
    if cmd == "mw-local-inv" {
        writeln!(p.stdin, "invalidate").unwrap();
    } else {
        let inv = SendOp::Send {
            imm: None,
            invalidate: Some(remote.rkey),
        };
        s.qp.post_send(&[req(3, inv, vec![s.mr.sge(0..16).unwrap()])])
            .unwrap();
        let c = s.wait(1, Duration::from_secs(30));
        assert_eq!(c[0].status, WcStatus::Success);
    }
    assert_eq!(p.line(), "inv true true false", "invalidated, reported, unbound");
    s.mr.write(0, &pattern(4)[..n]).unwrap();
    s.qp.post_send(&[write(4)]).unwrap();
    let c = s.wait(1, Duration::from_secs(30));
    assert_eq!((c[0].wr_id, c[0].status), (4, WcStatus::RemAccessErr));
    writeln!(p.stdin, "check").unwrap();
    assert_eq!(p.line(), "mem true", "the target memory is untouched");
}

fn mw_send_with_invalidate_between_processes() {
    mw_between_processes("mw-send-inv");
}

fn mw_local_invalidate_between_processes() {
    mw_between_processes("mw-local-inv");
}

struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(cmd: &str, me: Info) -> (Self, Info) {
        Self::spawn_with(cmd, me, &[])
    }

    /// [`Peer::spawn`] with extra environment variables for the peer.
    fn spawn_with(cmd: &str, me: Info, env: &[(&str, &str)]) -> (Self, Info) {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .arg("--peer")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        write!(stdin, "{cmd}\n{}", me.line()).unwrap();
        let mut p = Self { child, stdin, stdout };
        let info = Info::parse(&p.line());
        (p, info)
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.stdout.read_line(&mut l).unwrap();
        l.trim().to_string()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rc_between_processes() {
    let s = side(QpType::Rc);
    let (mut p, peer) = Peer::spawn("rc", s.info());
    s.connect(peer.qpn, 7);
    assert!(s.ctx.udp_status().is_some(), "the UDP driver runs");
    // SEND 1 MiB.
    s.mr.write(0, &pattern(1)).unwrap();
    s.qp.post_send(&[req(
        1,
        SendOp::Send {
            imm: None,
            invalidate: None,
        },
        vec![s.mr.sge(0..LEN).unwrap()],
    )])
    .unwrap();
    let c = s.wait(1, Duration::from_secs(20));
    assert_eq!(c[0].status, WcStatus::Success);
    assert_eq!(p.line(), "recv true", "the peer got the SEND byte-exact");
    // RDMA READ 1 MiB from the passive peer, then WRITE half of it.
    s.qp.post_send(&[req(
        2,
        SendOp::Read {
            remote: RemoteAddr {
                addr: peer.addr,
                rkey: peer.rkey,
            },
        },
        vec![s.mr.sge(0..LEN).unwrap()],
    )])
    .unwrap();
    let c = s.wait(1, Duration::from_secs(20));
    assert_eq!(c[0].status, WcStatus::Success, "{c:?}");
    // The peer wrote pattern(1) into its region by receiving our SEND.
    assert_eq!(s.mr.to_vec(), pattern(1), "READ is byte-exact");
    s.mr.write(0, &pattern(2)).unwrap();
    s.qp.post_send(&[req(
        3,
        SendOp::Write {
            remote: RemoteAddr {
                addr: peer.addr,
                rkey: peer.rkey,
            },
            imm: None,
        },
        vec![s.mr.sge(0..LEN / 2).unwrap()],
    )])
    .unwrap();
    assert_eq!(s.wait(1, Duration::from_secs(20))[0].status, WcStatus::Success);
    // Atomics on the peer's first word.
    let faa = SendOp::FetchAdd {
        remote: RemoteAddr {
            addr: peer.addr + 8 * 1024,
            rkey: peer.rkey,
        },
        add: 1,
    };
    s.qp.post_send(&[req(4, faa, vec![s.mr.sge(LEN - 8..LEN).unwrap()])])
        .unwrap();
    assert_eq!(s.wait(1, Duration::from_secs(20))[0].status, WcStatus::Success);
    writeln!(p.stdin, "check").unwrap();
    let expect_first_half_is_pattern2 = p.line();
    // The atomic changed one word of the written half.
    assert_eq!(expect_first_half_is_pattern2, "mem false");
    let counters = s.ctx.counters();
    // 256 SEND + 128 WRITE packets out, 256 READ responses in, each ICRC checked.
    assert!(
        counters.tx_packets >= 384 && counters.rx_packets >= 256,
        "{counters:?}"
    );
    // The carrier this run asked for carried them.
    if carrier() == "shm" {
        assert!(counters.tx_shm_packets >= 384, "{counters:?}");
        // The SEND's and WRITE's payloads stayed in our memory for the peer to copy, and the
        // READ responses' payloads were copied straight out of the peer's.
        assert!(counters.tx_payloads_in_memory >= 384, "{counters:?}");
        assert!(counters.rx_payload_copies >= 1, "{counters:?}");
    } else {
        assert_eq!(counters.tx_shm_packets, 0, "{counters:?}");
        assert_eq!(
            (counters.tx_payloads_in_memory, counters.rx_payload_copies),
            (0, 0),
            "{counters:?}"
        );
    }
    assert_eq!(counters.rx_payload_copy_failures, 0, "{counters:?}");
    assert_eq!(
        (
            counters.rx_bad_icrc,
            counters.rx_icrc_unverified,
            counters.rx_malformed
        ),
        (0, 0, 0)
    );
}

fn peer_killed_gives_retry_exceeded() {
    let s = side(QpType::Rc);
    let (mut p, peer) = Peer::spawn("victim", s.info());
    s.connect(peer.qpn, 3);
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    let start = Instant::now();
    let remote = RemoteAddr {
        addr: peer.addr,
        rkey: peer.rkey,
    };
    s.qp.post_send(&[
        req(
            1,
            SendOp::Write { remote, imm: None },
            vec![s.mr.sge(0..LEN).unwrap()],
        ),
        req(
            2,
            SendOp::Write { remote, imm: None },
            vec![s.mr.sge(0..8).unwrap()],
        ),
    ])
    .unwrap();
    let c = s.wait(2, Duration::from_secs(10));
    // timeout 12 = 16.8 ms per try, 1 + 3 tries.
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!(c[0].status, WcStatus::RetryExcErr);
    assert_eq!(c[1].status, WcStatus::WrFlushErr);
    assert_eq!(s.qp.state(), QpState::Err);
}

fn ud_between_processes() {
    ud_to_peer(IpAddr::V4(Ipv4Addr::LOCALHOST));
}

/// The same over IPv6 (`::1`), whose ICRC a receiver can always verify.
fn ud_between_processes_over_ipv6() {
    ud_to_peer(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST));
}

fn ud_to_peer(ip: IpAddr) {
    let s = side(QpType::Ud);
    let (mut p, peer) = Peer::spawn("ud", s.info());
    s.connect(0, 0);
    assert_eq!(p.line(), "ready");
    let mut attr = common::ah_attr(&s.ctx);
    let gid = Gid::from_ip(ip);
    let Some(index) = (0..16).find(|&i| s.ctx.query_gid(1, i).unwrap() == gid) else {
        panic!("the loopback device has no GID for {ip}");
    };
    attr.grh.dgid = gid;
    attr.grh.sgid_index = index as u8;
    let before = s.ctx.counters();
    let ah = s.pd.create_ah(&attr).unwrap();
    s.mr.write(0, b"hello").unwrap();
    let r = SendRequest {
        ud: Some(ah.ud_address(peer.qpn, 0x11)),
        ..req(
            1,
            SendOp::Send {
                imm: None,
                invalidate: None,
            },
            vec![s.mr.sge(0..5).unwrap()],
        )
    };
    s.qp.post_send(&[r]).unwrap();
    assert_eq!(p.line(), format!("ud 1 {} hello", s.qp.qp_num()));
    let after = s.ctx.counters();
    assert_eq!(after.tx_unroutable, before.tx_unroutable, "sent");
    assert_eq!(
        after.tx_shm_packets - before.tx_shm_packets,
        u64::from(carrier() == "shm"),
        "through the carrier this run asked for"
    );
}

/// A peer on the other carrier (shared memory off where it is on here, and the reverse): the
/// side with the driver finds no mailbox to use, so both directions go over UDP, and work.
fn rc_with_a_peer_on_the_other_carrier() {
    let s = side(QpType::Rc);
    let other = if carrier() == "shm" { "0" } else { "1" };
    let (mut p, peer) = Peer::spawn_with("rc", s.info(), &[("SOFTVERBS_SHM", other)]);
    s.connect(peer.qpn, 7);
    let before = s.ctx.counters();
    s.mr.write(0, &pattern(1)).unwrap();
    let send = req(
        1,
        SendOp::Send {
            imm: None,
            invalidate: None,
        },
        vec![s.mr.sge(0..LEN).unwrap()],
    );
    s.qp.post_send(&[send]).unwrap();
    assert_eq!(s.wait(1, Duration::from_secs(20))[0].status, WcStatus::Success);
    assert_eq!(p.line(), "recv true", "the peer got the SEND byte-exact");
    let read = req(
        2,
        SendOp::Read {
            remote: RemoteAddr {
                addr: peer.addr,
                rkey: peer.rkey,
            },
        },
        vec![s.mr.sge(0..LEN).unwrap()],
    );
    s.qp.post_send(&[read]).unwrap();
    assert_eq!(s.wait(1, Duration::from_secs(20))[0].status, WcStatus::Success);
    // The peer's buffer holds what the SEND put there.
    assert!(s.mr.to_vec() == pattern(1), "READ is byte-exact");
    let after = s.ctx.counters();
    assert_eq!(
        after.tx_shm_packets, before.tx_shm_packets,
        "nothing went through shared memory"
    );
    assert!(
        after.rx_packets - before.rx_packets >= (LEN / 4096) as u64,
        "{after:?}"
    );
}

/// A standard peer (one that knows nothing of slots) sends to the base port (4791 unless
/// configured; here a private one); the process holding that port forwards the packet to the
/// slot that owns the destination QP.
fn standard_port_forwarding() {
    use softverbs_wire::{BthRepr, DethRepr, Opcode, PacketRepr, Psn};
    let s = side(QpType::Ud);
    let (slot, _, holds_standard_port) = s.ctx.udp_status().expect("the UDP driver runs");
    assert!(
        holds_standard_port,
        "this process (slot {slot}) holds the base port, which nobody else uses"
    );
    let (mut p, peer) = Peer::spawn("ud", s.info());
    assert_ne!(peer.qpn >> 16, u32::from(slot), "the peer has its own slot");
    assert_eq!(p.line(), "ready");
    // Build a UD SEND ONLY as a foreign stack would and send it from a plain UDP socket.
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let bth = BthRepr::new(Opcode::UdSendOnly, peer.qpn, Psn::new(7));
    let repr = PacketRepr {
        deth: Some(DethRepr {
            qkey: 0x11,
            src_qpn: 0x1234,
        }),
        ..PacketRepr::new(bth, 5)
    };
    let mut pkt = vec![0u8; repr.buffer_len()];
    repr.emit_with_payload(&mut pkt, b"hello").unwrap();
    let base: u16 = std::env::var("SOFTVERBS_UDP_PORT").unwrap().parse().unwrap();
    let dst = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, base));
    softverbs_wire::icrc::fill(sock.local_addr().unwrap(), dst, &mut pkt).unwrap();
    sock.send_to(&pkt, dst).unwrap();
    assert_eq!(
        p.line(),
        "ud 1 4660 hello",
        "delivered to the peer's slot with the original source QP"
    );
}

/// The carrier between the processes in this run: `shm` (the default) or `udp`
/// (`SOFTVERBS_SHM=0`).
fn carrier() -> &'static str {
    if std::env::var("SOFTVERBS_SHM").is_ok_and(|v| v == "0") {
        "udp"
    } else {
        "shm"
    }
}

fn main() {
    if std::env::args().any(|a| a == "--peer") {
        peer();
        return;
    }
    // Before any device exists, so that this process and its peers (which inherit the
    // environment) use the same private base port.
    std::env::set_var("SOFTVERBS_UDP_PORT", common::free_base_port().to_string());
    // Every test runs twice: over shared memory here, then over UDP in a copy of this
    // process with the shared-memory driver off (the carrier is chosen once per process).
    let rerun_over_udp = carrier() == "shm";
    let udp_run = rerun_over_udp.then(|| {
        std::process::Command::new(std::env::current_exe().unwrap())
            .env("SOFTVERBS_SHM", "0")
            .env("SOFTVERBS_UDP_PORT", common::free_base_port().to_string())
            .output()
            .unwrap()
    });
    let tests: [(&str, fn()); 8] = [
        ("standard_port_forwarding", standard_port_forwarding),
        ("rc_between_processes", rc_between_processes),
        (
            "rc_with_a_peer_on_the_other_carrier",
            rc_with_a_peer_on_the_other_carrier,
        ),
        (
            "peer_killed_gives_retry_exceeded",
            peer_killed_gives_retry_exceeded,
        ),
        ("ud_between_processes", ud_between_processes),
        ("ud_between_processes_over_ipv6", ud_between_processes_over_ipv6),
        (
            "mw_send_with_invalidate_between_processes",
            mw_send_with_invalidate_between_processes,
        ),
        (
            "mw_local_invalidate_between_processes",
            mw_local_invalidate_between_processes,
        ),
    ];
    let mut failed = 0;
    for (name, t) in tests {
        let ok = std::panic::catch_unwind(t).is_ok();
        println!(
            "test two_process::{}::{name} ... {}",
            carrier(),
            if ok { "ok" } else { "FAILED" }
        );
        failed += usize::from(!ok);
    }
    let mut total = tests.len();
    if let Some(out) = udp_run {
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines().filter(|l| l.starts_with("test ")) {
            println!("{line}");
            total += 1;
            failed += usize::from(!line.ends_with(" ok"));
        }
        if !out.status.success() {
            // What failed says why on stderr.
            eprintln!("the UDP run failed:\n{}", String::from_utf8_lossy(&out.stderr));
            failed += usize::from(!text.contains("FAILED"));
        }
    }
    if rerun_over_udp {
        println!("{} passed, {} failed", total - failed, failed);
    }
    std::process::exit(i32::from(failed > 0));
}
