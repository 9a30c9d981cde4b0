//! An XRC domain shared by two processes through its file: this process's target QP executes
//! requests for an SRQ of the other process (this executable re-run with `--peer`), as
//! `ibv_xsrq_pingpong` with several clients needs. SEND (several packets, with immediate data,
//! first finding no receive: RNR), WRITE, READ and atomics reach the peer's SRQ, memory and CQ
//! with the peer's keys; an SRQ of the peer outside the domain is a remote access error.

mod common;

use std::io::{BufRead, Write};
use std::os::fd::AsFd;
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::Peer;
use softverbs::*;

/// How long the peer may take to answer.
const LIMIT: Duration = Duration::from_secs(30);

const REMOTE: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);
const LEN: usize = 64 * 1024;
/// Where the peer's region holds what: a pattern to READ, the WRITE target, the atomic word and
/// the receive buffer.
const READ_AT: usize = 0;
const WRITE_AT: usize = 8192;
const ATOMIC_AT: usize = 16384;
const RECV_AT: usize = 32768;
const SEND_LEN: usize = 5000;
const WRITE_LEN: usize = 3000;
const IMM: u32 = 0x1234_5678;

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    while out.len() < n {
        out.extend(common::drain(cq));
        assert!(Instant::now() < deadline, "only {} of {n} completions", out.len());
        std::thread::yield_now();
    }
    out
}

/// The peer: opens the domain of the file named on its command line (it must exist: the
/// test process created it), creates an XRC SRQ in it and one in an anonymous domain, prints
/// both numbers and its region, posts a receive when told, and reports what arrived.
fn peer(path: &str) {
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines().map(|l| l.unwrap());
    let ctx = common::lo();
    let file = std::fs::File::open(path).unwrap();
    let x = ctx.open_xrcd(Some(file.as_fd()), 0).unwrap();
    let other = ctx.open_xrcd(None, 0).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None, 0).unwrap();
    let attr = SrqAttr {
        max_wr: 8,
        max_sge: 1,
        srq_limit: 0,
    };
    let srq = x.create_srq(&pd, &cq, &attr).unwrap();
    let outside = other.create_srq(&pd, &cq, &attr).unwrap();
    let mr = pd.register(LEN, REMOTE).unwrap();
    mr.write(READ_AT, &pattern(4096, 7)).unwrap();
    println!(
        "{} {} {} {}",
        srq.srq_num(),
        outside.srq_num(),
        mr.addr(),
        mr.rkey()
    );
    std::io::stdout().flush().unwrap();
    assert_eq!(lines.next().unwrap(), "post");
    srq.post_recv(&[RecvWr {
        wr_id: 42,
        sg_list: vec![mr.sge(RECV_AT..RECV_AT + 8192).unwrap()],
    }])
    .unwrap();
    let wc = wait(&cq, 1)[0];
    let data = mr.to_vec();
    println!(
        "recv {:?} {:?} {} {} {:x} {} {} write {} atomic {}",
        wc.status,
        wc.opcode,
        wc.wr_id,
        wc.byte_len,
        wc.imm_data,
        wc.qp_num,
        data[RECV_AT..RECV_AT + SEND_LEN] == pattern(SEND_LEN, 11)[..],
        data[WRITE_AT..WRITE_AT + WRITE_LEN] == pattern(WRITE_LEN, 9)[..],
        mr.read_u64(ATOMIC_AT).unwrap(),
    );
    std::io::stdout().flush().unwrap();
    // Stay until told: the initiator may still be waiting for the last acknowledgement.
    let _ = lines.next();
}

fn target_serves_another_processes_srq() {
    let path = std::env::temp_dir().join(format!("softverbs-xrc2p-{}", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    let ctx = common::lo();
    let x = ctx.open_xrcd(Some(file.as_fd()), O_CREAT).unwrap();
    let tgt = x.create_recv_qp().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None, 0).unwrap();
    let ini = pd.create_qp(&QpInit::new(QpType::XrcSend, &cq)).unwrap();
    common::xrc_up(&ctx, &ini, tgt.qp_num());
    common::xrc_up(&ctx, &tgt, ini.qp_num());
    let mr = pd.register(LEN, REMOTE).unwrap();
    mr.write(0, &pattern(SEND_LEN, 11)).unwrap();
    mr.write(8192, &pattern(WRITE_LEN, 9)).unwrap();

    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.arg("--peer").arg(&path);
    let mut p = Peer::spawn(cmd);
    let info: Vec<u64> = p
        .line(LIMIT)
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    let (srqn, outside, addr, rkey) = (info[0] as u32, info[1] as u32, info[2], info[3] as u32);
    assert_ne!(
        srqn >> 16,
        tgt.qp_num() >> 16,
        "the SRQ is numbered in the peer's slot"
    );
    let remote = |off: usize| RemoteAddr {
        addr: addr + off as u64,
        rkey,
    };
    let req = |wr_id, op, off: usize, len: usize, srqn| SendRequest {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![mr.sge(off..off + len).unwrap()]),
        ud: None,
        xrc_srqn: Some(srqn),
    };
    let reqs = [
        req(
            1,
            SendOp::Write {
                remote: remote(WRITE_AT),
                imm: None,
            },
            8192,
            WRITE_LEN,
            srqn,
        ),
        req(
            2,
            SendOp::Read {
                remote: remote(READ_AT),
            },
            16384,
            4096,
            srqn,
        ),
        req(
            3,
            SendOp::FetchAdd {
                remote: remote(ATOMIC_AT),
                add: 5,
            },
            24576,
            8,
            srqn,
        ),
        req(
            4,
            SendOp::CompareSwap {
                remote: remote(ATOMIC_AT),
                compare: 5,
                swap: 12,
            },
            24584,
            8,
            srqn,
        ),
    ];
    ini.post_send(&reqs).unwrap();
    let wcs = wait(&cq, 4);
    for (wc, id) in wcs.iter().zip(1..) {
        assert_eq!((wc.wr_id, wc.status), (id, WcStatus::Success), "{wcs:?}");
    }
    assert_eq!(mr.to_vec()[16384..16384 + 4096], pattern(4096, 7)[..], "READ");
    assert_eq!(mr.read_u64(24576).unwrap(), 0, "fetch-add returned the old value");
    assert_eq!(
        mr.read_u64(24584).unwrap(),
        5,
        "compare-swap returned the old value"
    );

    // A SEND before the peer posted a receive: RNR, retried until it has one.
    let send = req(
        5,
        SendOp::Send {
            imm: Some(IMM),
            invalidate: None,
        },
        0,
        SEND_LEN,
        srqn,
    );
    ini.post_send(&[send]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(common::drain(&cq).is_empty(), "the SEND waits for a receive");
    p.say("post");
    let wc = wait(&cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success));
    let report = p.line(LIMIT);
    assert_eq!(
        report,
        format!(
            "recv Success Recv 42 {SEND_LEN} {IMM:x} {} true write true atomic 12",
            tgt.qp_num()
        ),
        "the peer's completion and memory"
    );
    let counters = ctx.counters();
    assert_eq!((counters.rx_bad_icrc, counters.rx_malformed), (0, 0));

    // An SRQ of the peer outside the domain: remote access error, the initiator fails.
    let bad = req(
        6,
        SendOp::Send {
            imm: None,
            invalidate: None,
        },
        0,
        16,
        outside,
    );
    ini.post_send(&[bad]).unwrap();
    let wc = wait(&cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (6, WcStatus::RemAccessErr));
    p.say("done");
    drop(p);
    std::fs::remove_file(path).unwrap();
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--peer") {
        peer(&args[i + 1]);
        return;
    }
    // Before any device exists, so that this process and the peer (which inherits the
    // environment) use the same private base port.
    std::env::set_var("SOFTVERBS_UDP_PORT", common::free_base_port().to_string());
    let ok = std::panic::catch_unwind(target_serves_another_processes_srq).is_ok();
    println!(
        "test xrc_two_process::target_serves_another_processes_srq ... {}",
        if ok { "ok" } else { "FAILED" }
    );
    std::process::exit(i32::from(!ok));
}
