//! Tag matching between two processes over RoCEv2/UDP: this process receives through a
//! tag-matching SRQ; the peer (this executable re-run with `--peer`) is an ordinary RC QP that
//! sends an eager message spanning several packets, an unexpected tagged message and a
//! rendezvous request for 1 MiB of its memory, which the device here READs across the process
//! boundary before sending the FIN the peer waits for. QP numbers and keys go over the child's
//! stdin and stdout.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::{connect_rc, RcPath};
use softverbs::*;
use softverbs_wire::tm::{RvhRepr, TmHeaders, TmhOpcode, TmhRepr, RVH_LEN, TMH_LEN};

const ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ);
const LEN: usize = 1 << 20;
const EAGER_LEN: usize = 3000;
const WAIT: Duration = Duration::from_secs(30);

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

fn headers(opcode: TmhOpcode, tag: u64, rvh: Option<RvhRepr>) -> Vec<u8> {
    let h = TmHeaders {
        tmh: TmhRepr {
            opcode,
            app_ctx: 0x5150,
            tag,
        },
        rvh,
    };
    let mut b = vec![0; h.buffer_len()];
    h.emit(&mut b).unwrap();
    b
}

fn connect(ctx: &Context, qp: &QueuePair, dest: u32) {
    let path = RcPath {
        access: ACCESS - AccessFlags::LOCAL_WRITE,
        mtu: Mtu::Mtu1024,
        psn: 0xFF_FFF0,
        rd_atomic: 8,
        timeout: 14,
        retry_cnt: 7,
    };
    connect_rc(ctx, qp, dest, &path);
}

fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + WAIT;
    let mut got = Vec::new();
    let mut wc = [WorkCompletion::default(); 8];
    while got.len() < n && Instant::now() < deadline {
        let k = cq.poll(&mut wc[..(n - got.len()).min(8)]);
        got.extend_from_slice(&wc[..k]);
    }
    got
}

fn send(qp: &QueuePair, cq: &CompletionQueue, mr: &MemoryRegion, at: usize, bytes: &[u8]) {
    mr.write(at, bytes).unwrap();
    qp.post_send(&[SendRequest {
        wr_id: at as u64,
        op: SendOp::Send {
            imm: None,
            invalidate: None,
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![mr.sge(at..at + bytes.len()).unwrap()]),
        ud: None,
        xrc_srqn: None,
    }])
    .unwrap();
    let c = wait(cq, 1);
    assert_eq!(c.len(), 1, "the SEND did not complete");
    assert_eq!(c[0].status, WcStatus::Success);
}

/// The peer: an ordinary RC QP. Reads our QPN, answers with its QPN, address and R_Key, waits
/// for "go", sends, and reports whether the FIN message came back right.
fn peer() {
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines().map(|l| l.unwrap());
    let server_qpn: u32 = lines.next().unwrap().trim().parse().unwrap();
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None, 0).unwrap();
    let qp = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    let mr = pd.register(2 * LEN, ACCESS).unwrap();
    mr.write(0, &pattern(LEN, 3)).unwrap();
    println!("{} {} {}", qp.qp_num(), mr.addr(), mr.rkey());
    std::io::stdout().flush().unwrap();
    connect(&ctx, &qp, server_qpn);
    // The FIN of the rendezvous arrives as an ordinary SEND.
    qp.post_recv(&[RecvWr {
        wr_id: 77,
        sg_list: vec![mr.sge(LEN + 8192..LEN + 8192 + 64).unwrap()],
    }])
    .unwrap();
    assert_eq!(lines.next().unwrap(), "go");
    let base = LEN;
    let mut eager = headers(TmhOpcode::Eager, 1, None);
    eager.extend_from_slice(&pattern(EAGER_LEN, 5));
    send(&qp, &cq, &mr, base, &eager);
    let mut unexpected = headers(TmhOpcode::Eager, 99, None);
    unexpected.extend_from_slice(b"nobody waits for this");
    send(&qp, &cq, &mr, base + 4096, &unexpected);
    let rvh = RvhRepr {
        va: mr.addr(),
        rkey: mr.rkey(),
        len: LEN as u32,
    };
    let request = headers(TmhOpcode::Rndv, 2, Some(rvh));
    send(&qp, &cq, &mr, base + 6144, &request);
    let c = wait(&cq, 1);
    let mut fin = vec![0; TMH_LEN + RVH_LEN];
    mr.read(LEN + 8192, &mut fin).unwrap();
    let ok = c.len() == 1
        && c[0].wr_id == 77
        && c[0].status == WcStatus::Success
        && c[0].byte_len as usize == fin.len()
        && fin == headers(TmhOpcode::Fin, 2, Some(rvh));
    println!("fin {ok}");
    // Stay until told: the server may still be acknowledging.
    let _ = lines.next();
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
        l.trim().to_string()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tag_matching_between_processes() {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None, 0).unwrap();
    let srq = pd
        .create_tm_srq(
            &SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            },
            &cq,
            TmCap {
                max_num_tags: 8,
                max_ops: 8,
            },
        )
        .unwrap();
    let qp_cq = ctx.create_cq(4, None, 0).unwrap();
    let mut init = QpInit::new(QpType::Rc, &qp_cq);
    init.srq = Some(&srq);
    init.cap.max_send_wr = 0;
    let qp = pd.create_qp(&init).unwrap();
    let mr = pd.register(2 * LEN, ACCESS).unwrap();

    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg("--peer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    writeln!(stdin, "{}", qp.qp_num()).unwrap();
    let mut p = Peer { child, stdin, stdout };
    let info: Vec<u64> = p.line().split_whitespace().map(|t| t.parse().unwrap()).collect();
    let (peer_qpn, peer_addr) = (info[0] as u32, info[1]);
    connect(&ctx, &qp, peer_qpn);
    assert!(ctx.udp_status().is_some(), "the UDP driver runs");

    let add = |recv_wr_id: u64, range: std::ops::Range<usize>, tag: u64| SrqOp {
        wr_id: 100 + recv_wr_id,
        kind: SrqOpKind::Add {
            recv_wr_id,
            sg_list: vec![mr.sge(range).unwrap()],
            tag,
            mask: u64::MAX,
        },
        flags: OpsFlags::SIGNALED,
        unexpected_cnt: 0,
    };
    let (_, r) = srq.post_ops(&[add(1, LEN..LEN + 4096, 1), add(2, 0..LEN, 2)]);
    r.unwrap();
    let c = wait(&cq, 2);
    assert!(
        c.iter()
            .all(|w| w.opcode == WcOpcode::TmAdd && w.status == WcStatus::Success),
        "{c:?}"
    );
    srq.post_recv(&[RecvWr {
        wr_id: 50,
        sg_list: vec![mr.sge(LEN + 8192..LEN + 12288).unwrap()],
    }])
    .unwrap();
    writeln!(p.stdin, "go").unwrap();

    // Eager, over three packets: the match at once, the data when complete.
    let c = wait(&cq, 2);
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!(
        (c[0].opcode, c[0].wr_id, c[0].wc_flags),
        (WcOpcode::TmRecv, 1, WcFlags::TM_MATCH)
    );
    assert_eq!(
        (c[1].opcode, c[1].wr_id, c[1].wc_flags, c[1].byte_len as usize),
        (WcOpcode::TmRecv, 1, WcFlags::TM_DATA_VALID, EAGER_LEN)
    );
    assert_eq!(c[1].tm_info.priv_data, 0x5150);
    let mut got = vec![0; EAGER_LEN];
    mr.read(LEN, &mut got).unwrap();
    assert_eq!(got, pattern(EAGER_LEN, 5), "eager data, without its header");

    // Unexpected: whole, into the SRQ buffer.
    let c = wait(&cq, 1);
    assert_eq!(c.len(), 1);
    assert_eq!(
        (c[0].opcode, c[0].wr_id, c[0].status),
        (WcOpcode::Recv, 50, WcStatus::Success)
    );
    assert!(c[0].wc_flags.contains(WcFlags::TM_SYNC_REQ));
    let mut got = vec![0; c[0].byte_len as usize];
    mr.read(LEN + 8192, &mut got).unwrap();
    assert_eq!(&got[..TMH_LEN], &headers(TmhOpcode::Eager, 99, None)[..]);
    assert_eq!(&got[TMH_LEN..], b"nobody waits for this");

    // Rendezvous: MATCH when the request arrives, DATA_VALID once 1 MiB was READ from the peer.
    let c = wait(&cq, 2);
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!(
        (c[0].wr_id, c[0].wc_flags, c[0].status),
        (2, WcFlags::TM_MATCH, WcStatus::Success)
    );
    assert_eq!(
        (c[1].wr_id, c[1].wc_flags, c[1].status, c[1].byte_len as usize),
        (2, WcFlags::TM_DATA_VALID, WcStatus::Success, LEN)
    );
    let mut got = vec![0; LEN];
    mr.read(0, &mut got).unwrap();
    assert!(
        got == pattern(LEN, 3),
        "the rendezvous data is the peer's buffer at {peer_addr:#x}"
    );
    assert_eq!(p.line(), "fin true", "the peer got the FIN message");
    // The READ responses (1 MiB at MTU 1024) came over UDP from the other process.
    let counters = ctx.counters();
    assert!(counters.rx_packets >= (LEN / 1024) as u64, "{counters:?}");
    assert_eq!((counters.rx_bad_icrc, counters.rx_malformed), (0, 0));
    assert_eq!(qp.state(), QpState::Rts);
    writeln!(p.stdin, "done").unwrap();
}

fn main() {
    if std::env::args().any(|a| a == "--peer") {
        peer();
        return;
    }
    // Before any device exists, so that this process and the peer (which inherits the
    // environment) use the same private base port.
    std::env::set_var("SOFTVERBS_UDP_PORT", common::free_base_port().to_string());
    let ok = std::panic::catch_unwind(tag_matching_between_processes).is_ok();
    println!(
        "test tm_two_process::tag_matching_between_processes ... {}",
        if ok { "ok" } else { "FAILED" }
    );
    std::process::exit(i32::from(!ok));
}
