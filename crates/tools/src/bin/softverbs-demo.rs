//! The loopback demo: two processes on the built-in loopback device connect RC queue pairs over
//! RoCEv2/UDP and run SEND, RDMA WRITE, RDMA READ, atomics and a ping-pong, printing each step.
//! The second process is this program started again with `--peer`; the two exchange QP
//! numbers and memory keys over a pipe, as the pingpong tools do over TCP.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use softverbs::*;
use softverbs_tools::man;

#[derive(Parser, Debug)]
#[command(
    name = "softverbs-demo",
    version,
    about = "an RDMA demonstration on the software device",
    long_about = None,
    before_help = DESCRIPTION,
    after_help = man::SEE_LONG_HELP,
    after_long_help = man::sections(man::DEVICE_ENVIRONMENT, EXAMPLES, EXIT_STATUS),
    help_template = man::PAGE,
)]
struct Args {
    /// Network interface whose device to use.
    #[arg(short, long, default_value = "lo")]
    interface: String,
    /// Run both sides in this process (in-memory fabric) instead of two processes over UDP.
    #[arg(long)]
    in_process: bool,
    /// Internal: run as the second process.
    #[arg(long, hide = true)]
    peer: bool,
}

const MSG: usize = 64 * 1024;
const ITERS: usize = 2000;
const PINGS: u64 = 2000;
const ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

const DESCRIPTION: &str = concat!(
    "    Runs SEND, RDMA WRITE, RDMA READ, atomics and a ping-pong between two RC queue pairs and\n",
    "    prints each step with its throughput or latency. By default the second side is this program\n",
    "    started again as a second process, and the two talk RoCEv2 over UDP (or shared memory) on the\n",
    "    device of --interface; with --in-process both sides run in this process.",
);

const EXAMPLES: &[(&str, &str)] = &[
    ("softverbs-demo", "Two processes on the loopback device."),
    ("SOFTVERBS_SHM=0 softverbs-demo", "The same over UDP only."),
    ("softverbs-demo --in-process", "Both sides in one process."),
];

const EXIT_STATUS: &str =
    "0 when every step succeeded; 1 when one failed (the error is printed); 2 when an argument is invalid.";

fn main() -> ExitCode {
    let args = Args::parse();
    let result = if args.peer { peer(&args) } else { run(&args) };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softverbs-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One side: a context, an RC QP with its CQ, and a registered region.
struct Side {
    ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    gid: Gid,
    sgid_index: u8,
    mtu: Mtu,
    _pd: ProtectionDomain,
}

impl Side {
    fn open(interface: &str) -> Result<Self> {
        let dev = devices()?
            .into_iter()
            .find(|d| d.netdev() == interface)
            .ok_or_else(|| Error::NoDevice(format!("no device on interface {interface}").into()))?;
        let ctx = dev.open()?;
        let port = ctx.query_port(1)?;
        let sgid_index = (0..port.gid_tbl_len as i32)
            .find(|&i| ctx.query_gid(1, i).is_ok_and(|g| !g.is_zero()))
            .ok_or_else(|| Error::NoDevice("the port has no usable GID".into()))?;
        let gid = ctx.query_gid(1, sgid_index)?;
        let pd = ctx.alloc_pd()?;
        let mr = pd.register(MSG * 2, ACCESS)?;
        let cq = ctx.create_cq(256, None, 0)?;
        let mut init = QpInit::new(QpType::Rc, &cq);
        init.cap.max_send_wr = 64;
        init.cap.max_recv_wr = 64;
        let qp = pd.create_qp(&init)?;
        Ok(Self {
            ctx,
            cq,
            qp,
            mr,
            gid,
            sgid_index: sgid_index as u8,
            mtu: port.active_mtu,
            _pd: pd,
        })
    }

    /// What the peer needs: QP number, region address and key.
    fn info(&self) -> String {
        format!("{} {} {}", self.qp.qp_num(), self.mr.addr(), self.mr.rkey())
    }

    /// Brings the QP to RTS, connected to the peer described by `info`; returns the peer's
    /// region.
    fn connect(&self, info: &str) -> Result<RemoteAddr> {
        let v: Vec<u64> = info.split_whitespace().filter_map(|t| t.parse().ok()).collect();
        if v.len() != 3 {
            return Err(Error::invalid(format!("bad peer info {info:?}")));
        }
        let init = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: ACCESS - AccessFlags::LOCAL_WRITE,
            ..Default::default()
        };
        self.qp.modify(
            &init,
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
        )?;
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: self.mtu,
            dest_qp_num: v[0] as u32,
            rq_psn: 0,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            ah_attr: AhAttr {
                grh: GlobalRoute {
                    dgid: self.gid,
                    sgid_index: self.sgid_index,
                    hop_limit: 64,
                    ..Default::default()
                },
                is_global: true,
                port_num: 1,
                ..Default::default()
            },
            ..Default::default()
        };
        self.qp.modify(
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
            max_rd_atomic: 16,
            ..Default::default()
        };
        self.qp.modify(
            &rts,
            QpAttrMask::STATE
                | QpAttrMask::SQ_PSN
                | QpAttrMask::TIMEOUT
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::MAX_QP_RD_ATOMIC,
        )?;
        Ok(RemoteAddr {
            addr: v[1],
            rkey: v[2] as u32,
        })
    }

    fn send(&self, wr_id: u64, op: SendOp, range: std::ops::Range<usize>) -> Result<()> {
        let req = SendRequest {
            wr_id,
            op,
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![self.mr.sge(range)?]),
            ud: None,
            xrc_srqn: None,
        };
        Ok(self.qp.post_send(&[req])?)
    }

    fn recv(&self, wr_id: u64, range: std::ops::Range<usize>) -> Result<()> {
        Ok(self.qp.post_recv(&[RecvWr {
            wr_id,
            sg_list: vec![self.mr.sge(range)?],
        }])?)
    }

    /// Polls until `n` completions; fails on an unsuccessful one or after 10 s.
    fn wait(&self, n: usize) -> Result<Vec<WorkCompletion>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        let mut wc = [WorkCompletion::default(); 16];
        while got.len() < n {
            let k = self.cq.poll(&mut wc);
            for w in &wc[..k] {
                if w.status != WcStatus::Success {
                    return Err(Error::invalid(format!(
                        "work request {} failed: {}",
                        w.wr_id,
                        w.status.as_str()
                    )));
                }
                got.push(*w);
            }
            if Instant::now() > deadline {
                return Err(Error::invalid("timed out waiting for completions"));
            }
        }
        Ok(got)
    }

    /// Polls until a receive completes.
    fn wait_recv(&self) -> Result<()> {
        while !self.wait(1)?.iter().any(|w| w.opcode == WcOpcode::Recv) {}
        Ok(())
    }
}

/// The second side: answers SENDs for the ping-pong and otherwise stays passive.
fn peer(args: &Args) -> Result<()> {
    let s = Side::open(&args.interface)?;
    let mut lines = std::io::stdin().lock().lines();
    println!("{}", s.info());
    let parent = lines
        .next()
        .and_then(|l| l.ok())
        .ok_or_else(|| Error::invalid("no peer info"))?;
    s.connect(&parent)?;
    s.recv(0, 0..4096)?;
    for i in 0..=PINGS {
        s.wait_recv()?;
        s.recv(i + 1, 0..4096)?;
        if i > 0 {
            s.send(
                i,
                SendOp::Send {
                    imm: None,
                    invalidate: None,
                },
                8..16,
            )?;
        }
    }
    Ok(())
}

fn run(args: &Args) -> Result<()> {
    let list = devices()?;
    println!("devices:");
    for d in &list {
        println!("  {:<16} guid {:016x}  on {}", d.name(), d.guid(), d.netdev());
    }
    let a = Side::open(&args.interface)?;
    let attr = a.ctx.query_device();
    println!(
        "opened {}: fw {}, max_qp {}, max_cqe {}",
        a.ctx.device().name(),
        attr.fw_ver,
        attr.max_qp,
        attr.max_cqe
    );
    println!(
        "port 1: active, MTU {} bytes, GID[{}] {} ({})",
        a.mtu.bytes(),
        a.sgid_index,
        a.gid,
        a.gid.to_ip()
    );

    // The other side: a second process over UDP, or a second QP in this process.
    let (remote, mut talk): (RemoteAddr, Box<dyn FnMut() -> Result<()>>) =
        if args.in_process {
            let b = Side::open(&args.interface)?;
            let remote = a.connect(&b.info())?;
            b.connect(&a.info())?;
            println!(
                "RC QP {:#08x} <-> RC QP {:#08x} in this process (in-memory fabric)",
                a.qp.qp_num(),
                b.qp.qp_num()
            );
            b.recv(0, 0..4096)?;
            let mut i = 0;
            (
                remote,
                Box::new(move || {
                    b.wait_recv()?;
                    i += 1;
                    b.recv(i, 0..4096)?;
                    if i > 1 {
                        b.send(
                            i,
                            SendOp::Send {
                                imm: None,
                                invalidate: None,
                            },
                            8..16,
                        )?;
                    }
                    Ok(())
                }),
            )
        } else {
            let exe = std::env::current_exe().map_err(Error::Io)?;
            let mut child = Command::new(exe)
                .args(["--peer", "--interface", &args.interface])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .map_err(Error::Io)?;
            let mut stdin = child.stdin.take().expect("piped");
            let mut out = BufReader::new(child.stdout.take().expect("piped"));
            let mut info = String::new();
            out.read_line(&mut info).map_err(Error::Io)?;
            writeln!(stdin, "{}", a.info()).map_err(Error::Io)?;
            let remote = a.connect(&info)?;
            let (slot, port, _) = a.ctx.udp_status().unwrap_or_default();
            println!(
            "RC QP {:#08x} (pid {}, UDP port {port}, slot {slot}) <-> RC QP {:#08x} (pid {}) over RoCEv2/UDP",
            a.qp.qp_num(),
            std::process::id(),
            info.split_whitespace().next().and_then(|q| q.parse::<u32>().ok()).unwrap_or(0),
            child.id()
        );
            // The peer process answers by itself.
            std::mem::forget(child);
            (remote, Box::new(|| Ok(())))
        };

    // SEND/RECV: the peer posted a receive; the first SEND only wakes it.
    let text = b"hello over RoCEv2";
    a.mr.write(0, text)?;
    a.send(
        1,
        SendOp::Send {
            imm: None,
            invalidate: None,
        },
        0..text.len(),
    )?;
    talk()?;
    a.wait(1)?;
    println!("SEND: {} bytes sent and received", text.len());

    // RDMA WRITE bandwidth, 64 KiB messages, up to 16 outstanding.
    let data: Vec<u8> = (0..MSG).map(|i| (i % 251) as u8).collect();
    a.mr.write(0, &data)?;
    let start = Instant::now();
    let (mut done, mut posted) = (0, 0);
    while done < ITERS {
        while posted < ITERS && posted - done < 16 {
            a.send(posted as u64, SendOp::Write { remote, imm: None }, 0..MSG)?;
            posted += 1;
        }
        done += a.wait(1)?.len();
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "RDMA WRITE: {ITERS} x {} KiB in {:.1} ms = {:.2} Gbit/s",
        MSG / 1024,
        secs * 1e3,
        (ITERS * MSG * 8) as f64 / secs / 1e9
    );

    // RDMA READ the peer's memory back and compare.
    a.send(7, SendOp::Read { remote }, MSG..2 * MSG)?;
    a.wait(1)?;
    println!(
        "RDMA READ: {} bytes read back from the peer, identical: {}",
        MSG,
        a.mr.to_vec()[MSG..] == data[..]
    );

    // Atomics on a word of the peer's region (its last 8 bytes).
    let word = RemoteAddr {
        addr: remote.addr + (2 * MSG - 8) as u64,
        rkey: remote.rkey,
    };
    a.mr.write(0, &0u64.to_ne_bytes())?;
    a.send(
        8,
        SendOp::CompareSwap {
            remote: word,
            compare: 0,
            swap: 0,
        },
        0..8,
    )?;
    a.wait(1)?;
    let before = a.mr.read_u64(0)?;
    for i in 0..10 {
        a.send(i, SendOp::FetchAdd { remote: word, add: 5 }, 0..8)?;
        a.wait(1)?;
    }
    a.send(
        11,
        SendOp::CompareSwap {
            remote: word,
            compare: before.wrapping_add(50),
            swap: 42,
        },
        0..8,
    )?;
    a.wait(1)?;
    a.send(12, SendOp::Read { remote: word }, 0..8)?;
    a.wait(1)?;
    println!(
        "atomics: 10 x fetch-and-add 5, then compare-and-swap: the peer's word is now {}",
        a.mr.read_u64(0)?
    );

    // Ping-pong latency with 8-byte SENDs.
    let start = Instant::now();
    for i in 0..PINGS {
        a.recv(i, 0..8)?;
        a.send(
            i,
            SendOp::Send {
                imm: None,
                invalidate: None,
            },
            8..16,
        )?;
        talk()?;
        a.wait_recv()?;
    }
    let rtt = start.elapsed().as_secs_f64() / PINGS as f64;
    println!(
        "ping-pong: {PINGS} round trips of 8 bytes, {:.2} us one way",
        rtt / 2.0 * 1e6
    );
    let c = a.ctx.counters();
    println!(
        "device counters: {} packets sent, {} received, {} dropped",
        c.tx_packets,
        c.rx_packets,
        c.rx_dropped + c.rx_bad_icrc + c.rx_malformed
    );
    println!("done: all objects are released as they go out of scope");
    Ok(())
}
