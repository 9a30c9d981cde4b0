//! Packet captures, checked with tshark and an independent ICRC check: between two processes
//! (the parent through [`PacketCapture`], the peer through `SOFTVERBS_PCAP`), over shared
//! memory and over UDP (the whole run is repeated with `SOFTVERBS_SHM=0`); between two QPs of
//! one process, also from three threads at once into one file; and of a process killed while it
//! captures. Every frame decodes as RRoCE with
//! good checksums and ICRCs, and the capture holds exactly the packets the process counted.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::{lo_counters, pcap};
use softverbs::*;

const LEN: usize = 1 << 20;
const SEND_LEN: usize = 256 << 10;
const WRITE_LEN: usize = 64 << 10;
const SEND: SendOp = SendOp::Send {
    imm: None,
    invalidate: None,
};

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

struct Side {
    ctx: Context,
    _pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side(ctx: Context) -> Side {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256, None, 0).unwrap();
    let mut init = QpInit::new(QpType::Rc, &cq);
    init.cap.max_send_wr = 64;
    init.cap.max_recv_wr = 64;
    let qp = pd.create_qp(&init).unwrap();
    let all = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let mr = pd.register(LEN, all).unwrap();
    Side {
        ctx,
        _pd: pd,
        cq,
        qp,
        mr,
    }
}

impl Side {
    fn info(&self) -> String {
        format!("{} {} {}\n", self.qp.qp_num(), self.mr.addr(), self.mr.rkey())
    }

    /// RESET -> INIT -> RTR -> RTS towards QP `dest` at 127.0.0.1 (MTU 1024).
    fn connect(&self, dest: u32) {
        self.qp
            .modify(
                &QpAttr {
                    qp_state: QpState::Init,
                    port_num: 1,
                    qp_access_flags: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
                    ..Default::default()
                },
                QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
            )
            .unwrap();
        common::to_rtr(&self.ctx, &self.qp, dest);
        self.qp
            .modify(
                &QpAttr {
                    qp_state: QpState::Rts,
                    sq_psn: 1,
                    // 1 s: a loaded machine may not run a process for a while.
                    timeout: 18,
                    retry_cnt: 7,
                    rnr_retry: 7,
                    max_rd_atomic: 1,
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

    fn wait(&self, n: usize) -> Vec<WorkCompletion> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut got = Vec::new();
        let mut wc = [WorkCompletion::default(); 16];
        while got.len() < n && Instant::now() < deadline {
            let k = self.cq.poll(&mut wc);
            got.extend_from_slice(&wc[..k]);
            if k == 0 {
                // Several pollers share two cores with the threads that move the packets.
                std::thread::yield_now();
            }
        }
        assert_eq!(got.len(), n, "completions in time");
        for c in &got {
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
        }
        got
    }

    fn post(&self, wr_id: u64, op: SendOp, range: std::ops::Range<usize>) {
        self.qp
            .post_send(&[SendRequest {
                wr_id,
                op,
                flags: SendFlags::SIGNALED,
                payload: Payload::Sges(vec![self.mr.sge(range).unwrap()]),
                ud: None,
                xrc_srqn: None,
            }])
            .unwrap();
    }
}

/// What a capture must hold given the counters since `from`: (outgoing, incoming).
fn expected(from: &CounterSnapshot, now: &CounterSnapshot) -> (u64, u64) {
    let sent = (now.tx_packets - from.tx_packets) - (now.tx_acks_coalesced - from.tx_acks_coalesced);
    let received = (now.rx_packets - from.rx_packets) + (now.rx_bad_icrc - from.rx_bad_icrc);
    (sent, received)
}

/// Waits (bounded) until the capture's figures match the counters (packets still in flight
/// when the traffic ended are counted and captured by then); returns both.
fn settle(from: &CounterSnapshot, stats: impl Fn() -> CaptureStats) -> ((u64, u64), CaptureStats) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (e, s) = (expected(from, &lo_counters()), stats());
        if e == (s.outgoing, s.incoming) || Instant::now() > deadline {
            return (e, s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn base_port() -> u16 {
    std::env::var("SOFTVERBS_UDP_PORT").unwrap().parse().unwrap()
}

/// The slots' ports, on which tshark must decode RoCEv2.
fn ports() -> std::ops::RangeInclusive<u16> {
    base_port()..=base_port() + 255
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("softverbs-capture-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The peer process: captures through `SOFTVERBS_PCAP`, receives a SEND and serves a WRITE and
/// a READ, then reports its counters and the capture's figures.
fn peer() {
    let s = side(common::lo());
    let start = lo_counters();
    assert!(capture_stats().is_some(), "SOFTVERBS_PCAP started a capture");
    let mut lines = std::io::stdin().lock().lines().map(|l| l.unwrap());
    let parent: Vec<u64> = lines
        .next()
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    s.mr.write(0, &pattern(9, LEN)).unwrap();
    print!("{}", s.info());
    s.connect(parent[0] as u32);
    s.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: vec![s.mr.sge(LEN - SEND_LEN..LEN).unwrap()],
    }])
    .unwrap();
    println!("ready");
    std::io::stdout().flush().unwrap();
    let c = s.wait(1);
    assert_eq!(c[0].byte_len, SEND_LEN as u32);
    assert_eq!(lines.next().unwrap(), "done");
    let ((out, inc), stats) = settle(&start, || capture_stats().unwrap());
    println!("stats {out} {inc} {} {}", stats.outgoing, stats.incoming);
    std::io::stdout().flush().unwrap();
    // Exits without stopping the capture: the file is whole all the same.
}

struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn line(&mut self) -> String {
        let mut l = String::new();
        self.stdout.read_line(&mut l).unwrap();
        assert!(!l.is_empty(), "the peer exited early");
        l.trim_end().to_string()
    }
}

/// The parent and a peer process, each capturing: RC SEND, WRITE and READ between them.
fn two_processes() {
    let dir = scratch("two");
    let s = side(common::lo());
    let capture = PacketCapture::start(dir.join("parent.pcap")).unwrap();
    let start = lo_counters();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg("--peer")
        .env("SOFTVERBS_PCAP", dir.join("peer-%p.pcap"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let peer_file = dir.join(format!("peer-{}.pcap", child.id()));
    let mut p = Peer {
        stdin: child.stdin.take().unwrap(),
        stdout: BufReader::new(child.stdout.take().unwrap()),
        child,
    };
    p.stdin.write_all(s.info().as_bytes()).unwrap();
    let info: Vec<u64> = p.line().split_whitespace().map(|t| t.parse().unwrap()).collect();
    s.connect(info[0] as u32);
    assert_eq!(p.line(), "ready");
    let (addr, rkey) = (info[1], info[2] as u32);
    s.mr.write(0, &pattern(1, SEND_LEN + WRITE_LEN)).unwrap();
    s.post(1, SEND, 0..SEND_LEN);
    let write = SendOp::Write {
        remote: RemoteAddr { addr, rkey },
        imm: None,
    };
    s.post(2, write, SEND_LEN..SEND_LEN + WRITE_LEN);
    let read = SendOp::Read {
        remote: RemoteAddr {
            addr: addr + (LEN / 2) as u64,
            rkey,
        },
    };
    s.post(3, read, LEN - WRITE_LEN..LEN);
    s.wait(3);
    assert_eq!(
        s.mr.to_vec()[LEN - WRITE_LEN..],
        pattern(9, LEN)[LEN / 2..LEN / 2 + WRITE_LEN]
    );
    p.stdin.write_all(b"done\n").unwrap();
    let reported: Vec<u64> = p.line()["stats ".len()..]
        .split(' ')
        .map(|t| t.parse().unwrap())
        .collect();
    assert!(p.child.wait().unwrap().success());
    let ((out, inc), stats) = settle(&start, || capture.stats());
    let stats_after = capture.stop();
    assert_eq!(stats_after.lost, 0);
    assert_eq!(
        (stats.outgoing, stats.incoming),
        (out, inc),
        "parent: capture against counters"
    );
    assert_eq!(reported[..2], reported[2..], "peer: capture against counters");

    let parent = pcap::check(&dir.join("parent.pcap"), ports());
    let peer = pcap::check(&peer_file, ports());
    let count = |frames: &[pcap::Frame], outgoing: bool| {
        frames.iter().filter(|f| f.outgoing == outgoing).count() as u64
    };
    assert_eq!((count(&parent, true), count(&parent, false)), (out, inc));
    assert_eq!(
        (count(&peer, true), count(&peer, false)),
        (reported[2], reported[3])
    );
    // 256 SEND packets at MTU 1024, 64 WRITE packets, one READ request at least.
    assert!(out > 256 + 64, "{out} packets sent");
    println!(
        "  ({}: parent {out} out {inc} in, peer {} out {} in)",
        carrier(),
        reported[2],
        reported[3]
    );
    if carrier() == "shm" {
        // Shared memory loses nothing: what one side sent is what the other received, and the
        // SEND's payload (left in the sender's memory by the carrier) is in the capture.
        assert_eq!((out, inc), (reported[3], reported[2]));
        let sent = pcap::send_payload(&peer, |f| !f.outgoing);
        pcap::assert_same_bytes(&sent, &pattern(1, SEND_LEN), "the SEND's payload as received");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two QPs of one process: each packet once, as outgoing, and nothing else.
fn in_process() {
    let dir = scratch("local");
    let path = dir.join("local.pcap");
    let ctx = common::lo();
    let a = side(ctx);
    let b = side(common::lo());
    let capture = PacketCapture::start(&path).unwrap();
    let start = lo_counters();
    a.connect(b.qp.qp_num());
    b.connect(a.qp.qp_num());
    b.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: vec![b.mr.sge(0..WRITE_LEN).unwrap()],
    }])
    .unwrap();
    a.mr.write(0, &pattern(3, WRITE_LEN)).unwrap();
    a.post(1, SEND, 0..WRITE_LEN);
    a.wait(1);
    b.wait(1);
    let ((out, inc), stats) = settle(&start, || capture.stats());
    assert_eq!(
        inc,
        lo_counters().rx_packets - start.rx_packets,
        "no packet left the process"
    );
    capture.stop();
    assert_eq!(stats.incoming, 0);
    assert_eq!(stats.outgoing, out);
    assert_eq!(out, inc, "every packet sent was received here");
    let frames = pcap::check(&path, ports());
    assert_eq!(frames.len() as u64, out);
    assert!(frames.iter().all(|f| f.outgoing));
    let payload = pcap::send_payload(&frames, |_| true);
    pcap::assert_same_bytes(&payload, &pattern(3, WRITE_LEN), "the SEND's payload");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Three threads, each with a pair of QPs, send at once: their records interleave in one file
/// and every one is whole.
fn threads_share_one_file() {
    let dir = scratch("threads");
    let path = dir.join("threads.pcap");
    let capture = PacketCapture::start(&path).unwrap();
    let start = lo_counters();
    std::thread::scope(|scope| {
        for t in 0..3u8 {
            scope.spawn(move || {
                let a = side(common::lo());
                let b = side(common::lo());
                a.connect(b.qp.qp_num());
                b.connect(a.qp.qp_num());
                a.mr.write(0, &pattern(t, WRITE_LEN)).unwrap();
                for i in 0..8 {
                    b.qp.post_recv(&[RecvWr {
                        wr_id: i,
                        sg_list: vec![b.mr.sge(0..WRITE_LEN).unwrap()],
                    }])
                    .unwrap();
                    a.post(i, SEND, 0..WRITE_LEN);
                    a.wait(1);
                    b.wait(1);
                }
            });
        }
    });
    let ((out, _), stats) = settle(&start, || capture.stats());
    capture.stop();
    assert_eq!(stats.outgoing, out);
    let frames = pcap::check(&path, ports());
    assert_eq!(frames.len() as u64, out);
    assert!(out >= 3 * 8 * 64, "{out} packets");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The peer of [`killed_while_capturing`]: SENDs between two of its own QPs until killed.
fn sender_until_killed() {
    let a = side(common::lo());
    let b = side(common::lo());
    a.connect(b.qp.qp_num());
    b.connect(a.qp.qp_num());
    for i in 0.. {
        b.qp.post_recv(&[RecvWr {
            wr_id: i,
            sg_list: vec![b.mr.sge(0..WRITE_LEN).unwrap()],
        }])
        .unwrap();
        a.post(i, SEND, 0..WRITE_LEN);
        a.wait(1);
        b.wait(1);
        if i == 20 {
            println!("running");
            std::io::stdout().flush().unwrap();
        }
    }
}

/// A process killed (SIGKILL) in the middle of its traffic leaves a file of whole records.
fn killed_while_capturing() {
    let dir = scratch("killed");
    let path = dir.join("killed.pcap");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg("--sender")
        .env("SOFTVERBS_PCAP", &path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut l = String::new();
    out.read_line(&mut l).unwrap();
    assert_eq!(l.trim(), "running");
    std::thread::sleep(Duration::from_millis(200));
    child.kill().unwrap();
    child.wait().unwrap();
    let frames = pcap::check(&path, ports());
    assert!(frames.len() > 20 * 64, "{} frames", frames.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Without `SOFTVERBS_PCAP` nothing is captured; a file that cannot be created is reported on
/// the log and traffic goes on.
fn env_var_off_and_unwritable() {
    assert!(capture_stats().is_none(), "no capture without SOFTVERBS_PCAP");
    let err = PacketCapture::start(Path::new("/nonexistent-dir/x.pcap")).unwrap_err();
    assert_eq!(err.errno(), nix::libc::ENOENT, "{err}");
    assert!(capture_stats().is_none());
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
    if std::env::args().any(|a| a == "--sender") {
        sender_until_killed();
        return;
    }
    // No capture may run but the ones the tests start.
    std::env::remove_var("SOFTVERBS_PCAP");
    std::env::set_var("SOFTVERBS_UDP_PORT", common::free_base_port().to_string());
    let rerun_over_udp = carrier() == "shm";
    let udp_run = rerun_over_udp.then(|| {
        Command::new(std::env::current_exe().unwrap())
            .env("SOFTVERBS_SHM", "0")
            .env("SOFTVERBS_UDP_PORT", common::free_base_port().to_string())
            .output()
            .unwrap()
    });
    let tests: [(&str, fn()); 5] = [
        ("env_var_off_and_unwritable", env_var_off_and_unwritable),
        ("two_processes", two_processes),
        ("in_process", in_process),
        ("threads_share_one_file", threads_share_one_file),
        ("killed_while_capturing", killed_while_capturing),
    ];
    let mut failed = 0;
    for (name, t) in tests {
        let ok = std::panic::catch_unwind(t).is_ok();
        println!(
            "test capture::{}::{name} ... {}",
            carrier(),
            if ok { "ok" } else { "FAILED" }
        );
        failed += usize::from(!ok);
    }
    let mut total = tests.len();
    if let Some(out) = udp_run {
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text
            .lines()
            .filter(|l| l.starts_with("test ") || l.starts_with("  ("))
        {
            println!("{line}");
            total += usize::from(line.starts_with("test "));
            failed += usize::from(line.starts_with("test ") && !line.ends_with(" ok"));
        }
        if !out.status.success() && !text.contains("FAILED") {
            eprintln!(
                "the UDP run failed:\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            failed += 1;
        }
        if text.contains("FAILED") {
            eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        }
    }
    if rerun_over_udp {
        println!("{} passed, {} failed", total - failed, failed);
    }
    std::process::exit(i32::from(failed > 0));
}
