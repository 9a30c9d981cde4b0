//! The loopback demo: finds the built-in loopback device, connects two RC queue pairs and runs
//! SEND, RDMA WRITE, RDMA READ, atomics and a ping-pong between them, printing each step.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use softverbs::*;

/// Runs a loopback RDMA demo on the built-in software device.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Network interface whose device to use.
    #[arg(short, long, default_value = "lo")]
    interface: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softverbs-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<()> {
    let list = devices()?;
    println!("devices:");
    for d in &list {
        println!("  {:<16} guid {:016x}  on {}", d.name(), d.guid(), d.netdev());
    }
    let dev = list
        .iter()
        .find(|d| d.netdev() == args.interface)
        .ok_or_else(|| Error::NoDevice(format!("no device on interface {}", args.interface).into()))?;
    let ctx = dev.open()?;
    let attr = ctx.query_device();
    let port = ctx.query_port(1)?;
    println!(
        "opened {}: fw {}, max_qp {}, max_cqe {}, max_mr_size {}",
        dev.name(),
        attr.fw_ver,
        attr.max_qp,
        attr.max_cqe,
        attr.max_mr_size
    );
    println!(
        "port 1: {:?}, active MTU {} bytes, link layer Ethernet",
        port.state,
        port.active_mtu.bytes()
    );
    let sgid_index = (0..port.gid_tbl_len as i32)
        .find(|&i| ctx.query_gid(1, i).is_ok_and(|g| !g.is_zero()))
        .ok_or_else(|| Error::NoDevice("the port has no usable GID".into()))?;
    let gid = ctx.query_gid(1, sgid_index)?;
    println!("GID[{sgid_index}] {gid} ({})", gid.to_ip());

    let pd = ctx.alloc_pd()?;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
    let mr_a = pd.register(MSG * 2, access)?;
    let mr_b = pd.register(MSG * 2, access)?;
    println!("registered 2 x {} bytes: lkey {:#010x} rkey {:#010x}", mr_a.len(), mr_a.lkey(), mr_a.rkey());
    let cq_a = ctx.create_cq(256, None, 0)?;
    let cq_b = ctx.create_cq(256, None, 0)?;
    let mut init = QpInit::new(QpType::Rc, &cq_a);
    init.cap.max_send_wr = 64;
    init.cap.max_recv_wr = 64;
    let a = pd.create_qp(&init)?;
    let b = pd.create_qp(&QpInit { send_cq: &cq_b, recv_cq: &cq_b, ..init })?;
    for (me, peer) in [(&a, &b), (&b, &a)] {
        connect(me, peer.qp_num(), gid, sgid_index as u8, port.active_mtu)?;
    }
    println!("RC QP {:#08x} <-> RC QP {:#08x}: both {}", a.qp_num(), b.qp_num(), a.state());

    // SEND/RECV.
    let text = b"hello over RoCEv2";
    mr_a.write(0, text)?;
    b.post_recv(&[RecvWr { wr_id: 1, sg_list: vec![mr_b.sge(0..4096)?] }])?;
    a.post_send(&[signaled(1, SendOp::Send { imm: None, invalidate: None }, vec![mr_a.sge(0..text.len())?])])?;
    wait(&cq_a, 1)?;
    let r = wait(&cq_b, 1)?;
    let mut got = vec![0u8; r[0].byte_len as usize];
    mr_b.read(0, &mut got)?;
    println!("SEND: QP {:#x} received {} bytes: {:?}", b.qp_num(), r[0].byte_len, String::from_utf8_lossy(&got));

    // RDMA WRITE bandwidth, 64 KiB messages.
    let data: Vec<u8> = (0..MSG).map(|i| (i % 251) as u8).collect();
    mr_a.write(0, &data)?;
    let start = Instant::now();
    let mut done = 0;
    let mut posted = 0;
    while done < ITERS {
        while posted < ITERS && posted - done < 16 {
            let op = SendOp::Write { remote: mr_b.remote(0), imm: None };
            a.post_send(&[signaled(posted as u64, op, vec![mr_a.sge(0..MSG)?])])?;
            posted += 1;
        }
        done += wait(&cq_a, 1)?.len();
    }
    let secs = start.elapsed().as_secs_f64();
    if mr_b.to_vec()[..MSG] != data[..] {
        return Err(Error::invalid("RDMA WRITE data mismatch"));
    }
    println!(
        "RDMA WRITE: {ITERS} x {} KiB in {:.1} ms = {:.2} Gbit/s, data verified",
        MSG / 1024,
        secs * 1e3,
        (ITERS * MSG * 8) as f64 / secs / 1e9
    );

    // RDMA READ back and atomics.
    a.post_send(&[signaled(7, SendOp::Read { remote: mr_b.remote(0) }, vec![mr_a.sge(MSG..2 * MSG)?])])?;
    wait(&cq_a, 1)?;
    println!("RDMA READ: {} bytes read back, match: {}", MSG, mr_a.to_vec()[MSG..] == data[..]);
    mr_b.write(0, &0u64.to_ne_bytes())?;
    for i in 0..10 {
        a.post_send(&[signaled(i, SendOp::FetchAdd { remote: mr_b.remote(0), add: 5 }, vec![mr_a.sge(0..8)?])])?;
        wait(&cq_a, 1)?;
    }
    let cas = SendOp::CompareSwap { remote: mr_b.remote(0), compare: 50, swap: 1 };
    a.post_send(&[signaled(11, cas, vec![mr_a.sge(0..8)?])])?;
    wait(&cq_a, 1)?;
    println!("atomics: 10 x fetch-and-add 5, then compare-and-swap 50 -> 1: remote word is {}", mr_b.read_u64(0)?);

    // Ping-pong latency with 8-byte SENDs.
    let start = Instant::now();
    for i in 0..PINGS {
        b.post_recv(&[RecvWr { wr_id: i, sg_list: vec![mr_b.sge(0..8)?] }])?;
        a.post_recv(&[RecvWr { wr_id: i, sg_list: vec![mr_a.sge(0..8)?] }])?;
        a.post_send(&[signaled(i, SendOp::Send { imm: None, invalidate: None }, vec![mr_a.sge(8..16)?])])?;
        wait_recv(&cq_b)?;
        b.post_send(&[signaled(i, SendOp::Send { imm: None, invalidate: None }, vec![mr_b.sge(8..16)?])])?;
        wait_recv(&cq_a)?;
        drain(&cq_a);
        drain(&cq_b);
    }
    let rtt = start.elapsed().as_secs_f64() / PINGS as f64;
    println!("ping-pong: {PINGS} round trips of 8 bytes, {:.2} us one way", rtt / 2.0 * 1e6);
    println!("done: all objects are released as they go out of scope");
    Ok(())
}

const MSG: usize = 64 * 1024;
const ITERS: usize = 2000;
const PINGS: u64 = 2000;

fn signaled(wr_id: u64, op: SendOp, sges: Vec<Sge>) -> SendRequest {
    SendRequest { wr_id, op, flags: SendFlags::SIGNALED, payload: Payload::Sges(sges), ud: None }
}

/// Polls until at least `n` completions; fails on an unsuccessful one or after 10 s.
fn wait(cq: &CompletionQueue, n: usize) -> Result<Vec<WorkCompletion>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    let mut wc = [WorkCompletion::default(); 16];
    while got.len() < n {
        let k = cq.poll(&mut wc);
        for w in &wc[..k] {
            if w.status != WcStatus::Success {
                return Err(Error::invalid(format!("work request {} failed: {}", w.wr_id, w.status.as_str())));
            }
            got.push(*w);
        }
        if Instant::now() > deadline {
            return Err(Error::invalid("timed out waiting for completions"));
        }
    }
    Ok(got)
}

/// Polls until a receive completion arrives.
fn wait_recv(cq: &CompletionQueue) -> Result<()> {
    loop {
        if wait(cq, 1)?.iter().any(|w| w.opcode == WcOpcode::Recv) {
            return Ok(());
        }
    }
}

fn drain(cq: &CompletionQueue) {
    let mut wc = [WorkCompletion::default(); 16];
    while cq.poll(&mut wc) > 0 {}
}

/// Brings `qp` to RTS, connected to QP `dest` at `gid`.
fn connect(qp: &QueuePair, dest: u32, gid: Gid, sgid_index: u8, mtu: Mtu) -> Result<()> {
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
        ..Default::default()
    };
    qp.modify(
        &init,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )?;
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: mtu,
        dest_qp_num: dest,
        rq_psn: 0,
        max_dest_rd_atomic: 4,
        min_rnr_timer: 12,
        ah_attr: AhAttr {
            grh: GlobalRoute {
                dgid: gid,
                sgid_index,
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
    )?;
    let rts = QpAttr {
        qp_state: QpState::Rts,
        sq_psn: 0,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 4,
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
}
