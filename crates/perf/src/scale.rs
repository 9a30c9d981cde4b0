//! `softverbs-scale`: many connected RC QPs in one process, or many processes sharing a device.
//!
//! One process (the default): N QPs on one device (sv_lo), connected in pairs to each other,
//! sharing one send CQ and one receive CQ. Reports the memory each idle connected QP costs
//! (resident set growth over N), the time to create and connect them and to destroy them, the
//! CPU the process uses while they are connected and idle, and the message rate of a burst in
//! which every QP sends K messages (RDMA WRITE or SEND) of S bytes to its partner, every one
//! signaled and checked, with the data verified on every QP.
//!
//! Several processes (`--processes P`): P/2 client/server pairs, each process the same binary
//! started again with a hidden `--role`, talking RoCEv2 over UDP through the device's per-process
//! slots, on a private base port so that the run does not meet other softverbs processes. The
//! parent relays the endpoints, measures the idle CPU of every connected process, then starts
//! every burst at once and reports the aggregate message rate.
//!
//! `--fill-slots`: processes that each hold one QP, started until the device refuses one, to
//! show how many processes with QPs a host has room for and what the next one gets (see
//! `fill.rs`).

use std::process::Command;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use softverbs::{
    AccessFlags, AhAttr, CompletionQueue, Context, Gid, GlobalRoute, MemoryRegion, Mtu, Payload,
    ProtectionDomain, QpAttr, QpAttrMask, QpCap, QpInit, QpState, QpType, QueuePair, RecvWr, RemoteAddr,
    SendFlags, SendOp, SendRequest, WcOpcode, WcStatus, WorkCompletion,
};
use softverbs_tools::man;

use crate::endpoint::{pattern, pattern_byte, split_wr_id, wr_id, Info};
use crate::error::{bail, Error, Result};
use crate::procs::{self, free_base_port, num, open_device, Children, Pipe};

/// The operation of the burst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScaleOp {
    /// RDMA WRITE into the partner's memory.
    Write,
    /// SEND into receive WRs the partner keeps posted.
    Send,
}

/// The role of a process started by `--processes` (internal).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    /// The side whose endpoint is relayed first.
    Server,
    /// The other side.
    Client,
    /// A process of `--fill-slots`, holding one QP.
    Holder,
}

const SCALE_DESCRIPTION: &str = concat!(
    "    Measures softverbs at scale on one host: by default --qps connected RC QPs in one process\n",
    "    (created and connected in pairs, the memory each idle QP takes, a burst of --iters messages\n",
    "    on every QP, and the CPU the idle process uses); with --processes, that many processes in\n",
    "    pairs sharing the device, each with its own QPs. Results are printed as \"name value\" lines\n",
    "    (or one JSON object with --json).",
);

const SCALE_EXAMPLES: &[(&str, &str)] = &[
    ("softverbs-scale", "10,000 QPs in one process."),
    (
        "SOFTVERBS_LIMITS=max_qp=65536 softverbs-scale --qps 60000 --iters 20 --idle 1",
        "60,000 QPs, above the default QP limit.",
    ),
    (
        "softverbs-scale --processes 64 --qps 4",
        "64 processes in 32 pairs, four QPs each.",
    ),
];

const SCALE_EXIT_STATUS: &str = "0 when every QP or process completed its burst; 1 when one failed or --timeout passed (the error is printed); 2 when an argument is invalid.";

/// Many connected RC QPs in one process, or many processes sharing the device.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "softverbs-scale",
    version,
    about = "many QPs or many processes on one softverbs device",
    long_about = None,
    before_help = SCALE_DESCRIPTION,
    after_help = man::SEE_LONG_HELP,
    after_long_help = man::sections(man::DEVICE_ENVIRONMENT, SCALE_EXAMPLES, SCALE_EXIT_STATUS),
    help_template = man::PAGE,
)]
pub struct ScaleArgs {
    /// QPs: in one process (default 10000, connected in pairs), or per process with
    /// --processes (default 1).
    #[arg(short = 'q', long)]
    pub qps: Option<u32>,

    /// Messages each QP sends in the burst.
    #[arg(short = 'n', long, default_value_t = 100)]
    pub iters: u32,

    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 64)]
    pub size: u32,

    /// Outstanding messages per QP.
    #[arg(short = 't', long, default_value_t = 4)]
    pub depth: u32,

    /// The operation of the burst.
    #[arg(long, value_enum, default_value_t = ScaleOp::Write)]
    pub test: ScaleOp,

    /// RC ACK timeout exponent of every QP (4.096 us * 2^N; 14 is 67 ms, perftest's default).
    /// Every message of a burst is queued behind all those in flight on every QP (and in
    /// every process), so the default is the smallest N from 14 up that allows 10 us for each
    /// of them: with a shorter timeout, a loaded host retransmits, and may give up.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=31))]
    pub ack_timeout: Option<u8>,

    /// Seconds of each idle-CPU window (0 skips them).
    #[arg(long, default_value_t = 3.0)]
    pub idle: f64,

    /// Run this many processes (an even number, 2..=254) in pairs instead of one process.
    #[arg(short = 'P', long)]
    pub processes: Option<u32>,

    /// Start processes that each hold one QP until the device refuses one (at most
    /// --processes, default 300): shows how many processes with QPs a host has room for, the
    /// errno the next one gets, and that a slot freed by an exit serves the next process.
    #[arg(long)]
    pub fill_slots: bool,

    /// Device (name or interface).
    #[arg(short = 'd', long, default_value = "sv_lo")]
    pub device: String,

    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,

    /// Print the results as one JSON object instead of `name value` lines.
    #[arg(long)]
    pub json: bool,

    /// Internal: this process is one side of a pair started by --processes.
    #[arg(long, value_enum, hide = true)]
    pub role: Option<Role>,
}

/// One reported figure.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    /// Name, e.g. `bytes_per_qp`.
    pub name: std::borrow::Cow<'static, str>,
    /// Value.
    pub value: f64,
    /// Unit, e.g. `B` or `s` (empty for counts).
    pub unit: &'static str,
}

pub(crate) fn fig(name: &'static str, value: f64, unit: &'static str) -> Figure {
    Figure {
        name: name.into(),
        value,
        unit,
    }
}

/// Prints `figures` as `name value unit` lines or as one JSON object.
pub fn print_figures(figures: &[Figure], json: bool) {
    if json {
        let body: Vec<String> = figures
            .iter()
            .map(|f| format!("\"{}\": {}", f.name, json_num(f.value)))
            .collect();
        println!("{{{}}}", body.join(", "));
    } else {
        for f in figures {
            println!("{:<28} {:>16} {}", f.name, trim_num(f.value), f.unit);
        }
    }
}

fn json_num(v: f64) -> String {
    if v.is_finite() {
        trim_num(v)
    } else {
        "null".to_string()
    }
}

fn trim_num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v:.4}")
    }
}

/// Runs what `args` asks for and returns the figures (also printed, except by a child).
pub fn run_scale(args: &ScaleArgs) -> Result<Vec<Figure>> {
    if args.size == 0 || args.iters == 0 || args.depth == 0 {
        bail!("--size, --iters and --depth must be at least 1");
    }
    let idle_ok = args.idle >= 0.0 && args.idle.is_finite();
    let timeout_ok = args.timeout > 0.0 && args.timeout.is_finite();
    if !(idle_ok && timeout_ok) {
        bail!("--idle must be >= 0 and --timeout positive");
    }
    if let Some(role) = args.role {
        match role {
            Role::Holder => crate::fill::holder(args)?,
            _ => child(args, role)?,
        }
        return Ok(Vec::new());
    }
    let figures = match (args.fill_slots, args.processes) {
        (true, p) => crate::fill::fill(args, p.unwrap_or(300))?,
        (false, Some(p)) => processes(args, p)?,
        (false, None) => one_process(args)?,
    };
    print_figures(&figures, args.json);
    Ok(figures)
}

// ---------------------------------------------------------------------------------------------
// Process figures

/// Resident set size of this process in bytes (`/proc/self/statm`, field 2).
pub fn rss_bytes() -> Result<u64> {
    let s = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::msg(format!("bad /proc/self/statm: {s:?}")))?;
    Ok(pages * page_size())
}

fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map_or(4096, |v| v as u64)
}

/// A `kB` field of `/proc/self/status` (e.g. `VmHWM`, `RssAnon`), in bytes.
fn status_bytes(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(kb * 1024)
    })
}

/// CPU seconds (user + system, every thread) of this process so far. `getrusage` rather than
/// `/proc/self/stat`, whose clock ticks are too coarse for a few seconds of near-idleness.
fn cpu_seconds() -> Result<f64> {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_SELF)?;
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    Ok(secs(u.user_time()) + secs(u.system_time()))
}

/// Context switches (voluntary + involuntary) of every thread of this process but the
/// calling one: while the caller sleeps, each is a wake-up of a library thread.
fn other_threads_switches() -> u64 {
    let me = nix::unistd::gettid().as_raw().to_string();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str() != Some(me.as_str()))
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        .map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}

/// Sleeps `secs`; returns the CPU used meanwhile as a percentage of one core, and the wake-ups
/// of the other threads (the library's) per second.
fn idle_percent(secs: f64) -> Result<(f64, f64)> {
    let (c0, w0, t0) = (cpu_seconds()?, other_threads_switches(), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (cpu, wall) = (cpu_seconds()? - c0, t0.elapsed().as_secs_f64());
    let wakeups = other_threads_switches().saturating_sub(w0) as f64;
    Ok((100.0 * cpu / wall, wakeups / wall))
}

// ---------------------------------------------------------------------------------------------
// The RDMA side of one process

/// What a QP's burst sends where.
#[derive(Debug, Clone, Copy)]
struct Target {
    /// The partner's memory region (WRITE target).
    addr: u64,
    rkey: u32,
    /// The slot index in the partner's `dst` area this QP's messages land in.
    slot: usize,
}

/// The resources of one process: QPs sharing two CQs and one memory region laid out as
/// `src` (one `size`-byte slot per QP, a pattern) then `dst` (one slot per QP, zeroed).
struct Rig {
    _ctx: Context,
    _pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    mr: MemoryRegion,
    qps: Vec<QueuePair>,
    gid: Gid,
    gid_index: u8,
    mtu: Mtu,
    size: usize,
    iters: u32,
    depth: u32,
    op: ScaleOp,
    seed: u8,
    ack_timeout: u8,
}

impl Rig {
    /// Everything but the QPs: context, PD, the two shared CQs sized for `nqps` QPs, the region.
    fn new(args: &ScaleArgs, nqps: usize, seed: u8) -> Result<Self> {
        let (ctx, gid, gid_index) = open_device(&args.device)?;
        let attr = ctx.query_device();
        if nqps as u64 > u64::from(attr.max_qp) {
            bail!(
                "{nqps} QPs exceed the device's max_qp {} (raise it with SOFTVERBS_LIMITS=max_qp=N)",
                attr.max_qp
            );
        }
        let mtu = ctx.query_port(1)?.active_mtu;
        let pd = ctx.alloc_pd()?;
        let cqe = |per_qp: u32| -> Result<i32> {
            let n = (nqps as u64 * u64::from(per_qp)).max(1);
            if n > u64::from(attr.max_cqe) {
                bail!(
                    "a shared CQ of {n} entries exceeds max_cqe {} (lower --depth or raise it with \
                     SOFTVERBS_LIMITS=max_cqe=N)",
                    attr.max_cqe
                );
            }
            Ok(n as i32)
        };
        let send_cq = ctx.create_cq(cqe(args.depth)?, None, 0)?;
        let recv_depth = recv_depth(args);
        let recv_cq = ctx.create_cq(cqe(recv_depth.max(1))?, None, 0)?;
        let size = args.size as usize;
        let len = 2 * nqps * size;
        let mr = pd.register(
            len,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )?;
        mr.write(0, &pattern(seed, nqps * size))?;
        mr.write(nqps * size, &vec![0u8; nqps * size])?;
        Ok(Self {
            _ctx: ctx,
            _pd: pd,
            send_cq,
            recv_cq,
            mr,
            qps: Vec::with_capacity(nqps),
            gid,
            gid_index,
            mtu,
            size,
            iters: args.iters,
            depth: args.depth,
            op: args.test,
            seed,
            ack_timeout: ack_timeout(args, nqps as u64),
        })
    }

    /// Creates the QPs (RESET state).
    fn create_qps(&mut self, n: usize, recv_depth: u32) -> Result<()> {
        let mut init = QpInit::new(QpType::Rc, &self.send_cq);
        init.recv_cq = &self.recv_cq;
        init.cap = QpCap {
            max_send_wr: self.depth,
            max_recv_wr: recv_depth.max(1),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        for i in 0..n {
            let qp = self
                ._pd
                .create_qp(&init)
                .map_err(|e| Error::msg(format!("creating QP {i}: {e}")))?;
            self.qps.push(qp);
        }
        Ok(())
    }

    fn slot_len(&self) -> usize {
        self.mr.len() / 2
    }

    /// Brings QP `q` to RTS connected to `dest` (QP number, PSN) at `dgid`; its own PSN is `psn`.
    fn connect(&self, q: usize, psn: u32, dest: (u32, u32), dgid: Gid, mtu: Mtu) -> Result<()> {
        let qp = &self.qps[q];
        qp.modify(
            &QpAttr {
                qp_state: QpState::Init,
                port_num: 1,
                qp_access_flags: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
                ..Default::default()
            },
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
        )?;
        qp.modify(
            &QpAttr {
                qp_state: QpState::Rtr,
                path_mtu: mtu,
                dest_qp_num: dest.0,
                rq_psn: dest.1,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 1,
                ah_attr: AhAttr {
                    grh: GlobalRoute {
                        dgid,
                        sgid_index: self.gid_index,
                        hop_limit: 64,
                        ..Default::default()
                    },
                    is_global: true,
                    port_num: 1,
                    ..Default::default()
                },
                ..Default::default()
            },
            QpAttrMask::STATE
                | QpAttrMask::AV
                | QpAttrMask::PATH_MTU
                | QpAttrMask::DEST_QPN
                | QpAttrMask::RQ_PSN
                | QpAttrMask::MAX_DEST_RD_ATOMIC
                | QpAttrMask::MIN_RNR_TIMER,
        )?;
        qp.modify(
            &QpAttr {
                qp_state: QpState::Rts,
                sq_psn: psn,
                timeout: self.ack_timeout,
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
        )?;
        Ok(())
    }

    /// This side's endpoint for the peer process.
    fn info(&self, psns: &[u32]) -> Info {
        Info {
            gid: self.gid,
            addr: self.mr.addr(),
            rkey: self.mr.rkey(),
            len: self.mr.len() as u64,
            mtu: self.mtu.bytes(),
            qps: self.qps.iter().zip(psns).map(|(q, &p)| (q.qp_num(), p)).collect(),
        }
    }

    /// Posts one receive WR for QP `q` into its `dst` slot.
    fn post_recv(&self, q: usize) -> Result<()> {
        let off = self.slot_len() + q * self.size;
        let sge = self.mr.sge(off..off + self.size)?;
        self.qps[q].post_recv(&[RecvWr {
            wr_id: q as u64,
            sg_list: vec![sge],
        }])?;
        Ok(())
    }

    /// Posts message `k` of QP `q` to `t`.
    fn post_send(&self, q: usize, k: u64, t: &Target) -> Result<()> {
        let off = q * self.size;
        let sge = self.mr.sge(off..off + self.size)?;
        let op = match self.op {
            ScaleOp::Write => SendOp::Write {
                remote: RemoteAddr {
                    addr: t.addr + (self.slot_len() + t.slot * self.size) as u64,
                    rkey: t.rkey,
                },
                imm: None,
            },
            ScaleOp::Send => SendOp::Send {
                imm: None,
                invalidate: None,
            },
        };
        self.qps[q].post_send(&[SendRequest {
            wr_id: wr_id(q, k),
            op,
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![sge]),
            ud: None,
            xrc_srqn: None,
        }])?;
        Ok(())
    }

    /// Every QP sends `iters` messages to its target, at most `depth` outstanding; with SEND,
    /// also consumes the `iters` messages each QP receives. Every completion must be a success
    /// of the right kind and length. Returns (messages sent, seconds).
    fn burst(&self, targets: &[Target], deadline: Instant) -> Result<(u64, f64)> {
        let n = self.qps.len();
        let iters = u64::from(self.iters);
        let mut posted = vec![0u64; n];
        let mut sent = vec![0u64; n];
        let mut received = vec![0u64; n];
        let want = n as u64 * iters;
        let (mut sent_total, mut recv_total) = (0u64, 0u64);
        let recv_want = if self.op == ScaleOp::Send { want } else { 0 };
        let t0 = Instant::now();
        for (q, t) in targets.iter().enumerate() {
            while posted[q] < iters.min(u64::from(self.depth)) {
                self.post_send(q, posted[q], t)?;
                posted[q] += 1;
            }
        }
        let mut wcs = vec![WorkCompletion::default(); 512];
        let mut spins = 0u32;
        while sent_total < want || recv_total < recv_want {
            let mut progressed = false;
            let got = self.send_cq.poll(&mut wcs);
            for wc in &wcs[..got] {
                check(wc, send_opcode(self.op), 0)?;
                let (q, k) = split_wr_id(wc.wr_id);
                if q >= n || k != sent[q] {
                    bail!(
                        "completion for QP {q} message {k} out of order (expected {})",
                        sent.get(q).copied().unwrap_or(0)
                    );
                }
                sent[q] += 1;
                sent_total += 1;
                if posted[q] < iters {
                    self.post_send(q, posted[q], &targets[q])?;
                    posted[q] += 1;
                }
            }
            progressed |= got > 0;
            if recv_want > 0 {
                let got = self.recv_cq.poll(&mut wcs);
                for wc in &wcs[..got] {
                    check(wc, WcOpcode::Recv, self.size)?;
                    let q = wc.wr_id as usize;
                    if q >= n {
                        bail!("receive completion with a bad id {}", wc.wr_id);
                    }
                    received[q] += 1;
                    recv_total += 1;
                    // Keep the queue as deep as it started while more messages come.
                    if received[q] + u64::from(recv_depth_of(self.depth)) <= iters {
                        self.post_recv(q)?;
                    }
                }
                progressed |= got > 0;
            }
            if progressed {
                spins = 0;
            } else {
                spins += 1;
                if spins % 1024 == 0 {
                    if Instant::now() > deadline {
                        bail!(
                            "timed out: {sent_total} of {want} sends and {recv_total} of {recv_want} \
                             receives completed"
                        );
                    }
                    std::thread::yield_now();
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        if let Some(q) = (0..n).find(|&q| sent[q] != iters || (recv_want > 0 && received[q] != iters)) {
            bail!(
                "QP {q}: {} sends and {} receives completed, expected {iters}",
                sent[q],
                received[q]
            );
        }
        Ok((sent_total, secs))
    }

    /// Checks every `dst` slot against what its sender sent: slot `r` holds the `peer_seed`
    /// pattern at the sender's `src` slot `from(r)`. Returns the number of slots checked.
    fn verify(&self, peer_seed: u8, from: impl Fn(usize) -> usize) -> Result<usize> {
        let n = self.qps.len();
        let mut got = vec![0u8; n * self.size];
        self.mr.read(self.slot_len(), &mut got)?;
        for r in 0..n {
            let s = from(r);
            for j in 0..self.size {
                let want = pattern_byte(peer_seed, s * self.size + j);
                let g = got[r * self.size + j];
                if g != want {
                    bail!("data of QP {r}: byte {j} is {g:#04x}, expected {want:#04x}");
                }
            }
        }
        Ok(n)
    }

    /// Transport counters summed over the QPs: (packets sent, retransmitted, ACK timeouts,
    /// RNR NAKs received, sequence NAKs received, duplicates, receive drops).
    fn counters(&self) -> [u64; 7] {
        self.qps.iter().fold([0; 7], |mut a, qp| {
            let c = qp.counters();
            for (x, y) in a.iter_mut().zip([
                c.tx_packets,
                c.retransmits,
                c.timeouts,
                c.rnr_naks_received,
                c.seq_naks_received,
                c.duplicates,
                c.rx_dropped,
            ]) {
                *x += y;
            }
            a
        })
    }

    /// [`Rig::burst`], with the transport counters in the error if it fails.
    fn burst_explained(&self, targets: &[Target], deadline: Instant) -> Result<(u64, f64)> {
        self.burst(targets, deadline).map_err(|e| {
            let c = self.counters();
            Error::msg(format!(
                "{e} (over all QPs: {} packets sent, {} retransmitted, {} ACK timeouts, {} RNR NAKs, \
                 {} sequence NAKs, {} duplicates, {} receive drops)",
                c[0], c[1], c[2], c[3], c[4], c[5], c[6]
            ))
        })
    }

    /// Posts the initial receive WRs (SEND bursts).
    fn post_initial_recvs(&self) -> Result<()> {
        if self.op == ScaleOp::Send {
            let k = recv_depth_of(self.depth).min(self.iters);
            for q in 0..self.qps.len() {
                for _ in 0..k {
                    self.post_recv(q)?;
                }
            }
        }
        Ok(())
    }
}

/// The ACK timeout exponent: `--ack-timeout`, or one that allows 10 us for each of the
/// messages `qps` QPs (over all processes) keep in flight, and at least 67 ms.
fn ack_timeout(args: &ScaleArgs, qps: u64) -> u8 {
    args.ack_timeout.unwrap_or_else(|| {
        let need_us = qps.saturating_mul(u64::from(args.depth)).saturating_mul(10);
        (14..31)
            .find(|&t| (4.096 * (1u64 << t) as f64) >= need_us as f64)
            .unwrap_or(31)
    })
}

/// Receive WRs kept posted per QP for SEND: twice the send depth, so that a sender whose
/// previous messages completed rarely finds the receiver not yet topped up (it would meet an
/// RNR NAK and retry, which is correct but slow).
fn recv_depth_of(depth: u32) -> u32 {
    depth.saturating_mul(2)
}

fn recv_depth(args: &ScaleArgs) -> u32 {
    match args.test {
        ScaleOp::Send => recv_depth_of(args.depth),
        ScaleOp::Write => 0,
    }
}

/// The completion opcode of a burst's sends.
fn send_opcode(op: ScaleOp) -> WcOpcode {
    match op {
        ScaleOp::Write => WcOpcode::RdmaWrite,
        ScaleOp::Send => WcOpcode::Send,
    }
}

/// A completion must be a success of `opcode`; receives must carry `len` bytes.
fn check(wc: &WorkCompletion, opcode: WcOpcode, len: usize) -> Result<()> {
    if wc.status != WcStatus::Success {
        bail!(
            "work request {:#x} of QP {:#x} completed with {:?}",
            wc.wr_id,
            wc.qp_num,
            wc.status
        );
    }
    if wc.opcode != opcode {
        bail!("completion opcode {:?}, expected {opcode:?}", wc.opcode);
    }
    if opcode == WcOpcode::Recv && wc.byte_len as usize != len {
        bail!("received {} bytes, expected {len}", wc.byte_len);
    }
    Ok(())
}

/// A random 24-bit PSN per QP.
fn psns(n: usize) -> Vec<u32> {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    let s = RandomState::new();
    (0..n)
        .map(|i| {
            let mut h = s.build_hasher();
            h.write_usize(i);
            (h.finish() & 0xFF_FFFF) as u32
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// One process

fn one_process(args: &ScaleArgs) -> Result<Vec<Figure>> {
    let n = args.qps.unwrap_or(10_000) as usize;
    if n < 2 || n % 2 != 0 {
        bail!("--qps must be an even number of at least 2 (the QPs are connected in pairs)");
    }
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout);
    let mut rig = Rig::new(args, n, 0x5A)?;
    let rss0 = rss_bytes()?;
    let anon0 = status_bytes("RssAnon");
    let t0 = Instant::now();
    rig.create_qps(n, recv_depth(args))?;
    let create_s = t0.elapsed().as_secs_f64();
    let psn = psns(n);
    let (gid, mtu) = (rig.gid, rig.mtu);
    for q in 0..n {
        let p = q ^ 1;
        rig.connect(q, psn[q], (rig.qps[p].qp_num(), psn[p]), gid, mtu)?;
    }
    let create_connect_s = t0.elapsed().as_secs_f64();
    let rss1 = rss_bytes()?;
    let anon1 = status_bytes("RssAnon");
    let per_qp = rss1.saturating_sub(rss0) as f64 / n as f64;
    let anon_per_qp = match (anon0, anon1) {
        (Some(a), Some(b)) => b.saturating_sub(a) as f64 / n as f64,
        _ => f64::NAN,
    };
    let (idle_connected, wakeups_connected) = if args.idle > 0.0 {
        idle_percent(args.idle)?
    } else {
        (f64::NAN, f64::NAN)
    };
    rig.post_initial_recvs()?;
    let (addr, rkey) = (rig.mr.addr(), rig.mr.rkey());
    let targets: Vec<Target> = (0..n)
        .map(|q| Target {
            addr,
            rkey,
            slot: q ^ 1,
        })
        .collect();
    let (msgs, secs) = rig.burst_explained(&targets, deadline)?;
    let c = rig.counters();
    // QP q's messages land in slot q ^ 1, so slot r holds what QP r ^ 1 sent.
    let verified = rig.verify(rig.seed, |r| r ^ 1)?;
    let (idle_after, wakeups_after) = if args.idle > 0.0 {
        idle_percent(args.idle)?
    } else {
        (f64::NAN, f64::NAN)
    };
    let threads = procs::thread_count();
    let hwm = status_bytes("VmHWM").map_or(f64::NAN, |b| b as f64);
    let rss_connected = rss_bytes()?;
    let t1 = Instant::now();
    let qps = std::mem::take(&mut rig.qps);
    drop(qps);
    let destroy_s = t1.elapsed().as_secs_f64();
    let rss_destroyed = rss_bytes()?;
    Ok(vec![
        fig("qps", n as f64, ""),
        fig("create_s", create_s, "s"),
        fig("create_connect_s", create_connect_s, "s"),
        fig("bytes_per_qp", per_qp, "B"),
        fig("anon_bytes_per_qp", anon_per_qp, "B"),
        fig("rss_before_qps", rss0 as f64, "B"),
        fig("rss_connected", rss1 as f64, "B"),
        fig("idle_cpu_connected", idle_connected, "% of a core"),
        fig("idle_wakeups_connected", wakeups_connected, "/s"),
        fig("messages", msgs as f64, ""),
        fig("message_size", args.size as f64, "B"),
        fig("burst_s", secs, "s"),
        fig("msg_rate", msgs as f64 / secs, "msg/s"),
        fig("completions_ok", msgs as f64, ""),
        fig("qps_verified", verified as f64, ""),
        fig("packets_sent", c[0] as f64, ""),
        fig("ack_timeout_exp", f64::from(rig.ack_timeout), ""),
        fig("retransmits", c[1] as f64, ""),
        fig("ack_timeouts", c[2] as f64, ""),
        fig("rnr_naks", c[3] as f64, ""),
        fig("seq_naks", c[4] as f64, ""),
        fig("idle_cpu_after_traffic", idle_after, "% of a core"),
        fig("idle_wakeups_after_traffic", wakeups_after, "/s"),
        fig("threads", threads, ""),
        fig("rss_after_traffic", rss_connected as f64, "B"),
        fig("vm_hwm", hwm, "B"),
        fig("destroy_s", destroy_s, "s"),
        fig("rss_destroyed", rss_destroyed as f64, "B"),
    ])
}

// ---------------------------------------------------------------------------------------------
// Several processes

fn processes(args: &ScaleArgs, p: u32) -> Result<Vec<Figure>> {
    if p < 2 || p % 2 != 0 || p > 254 {
        bail!("--processes must be an even number from 2 to 254");
    }
    let qps = args.qps.unwrap_or(1);
    if qps == 0 {
        bail!("--qps must be at least 1");
    }
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout);
    let mut env: Vec<(String, String)> = Vec::new();
    if std::env::var_os("SOFTVERBS_UDP_PORT").is_none() {
        // A private range: every child takes a slot above it, none meets another run.
        let slots = p as u16 + 1;
        env.push(("SOFTVERBS_UDP_PORT".into(), free_base_port(slots)?.to_string()));
        env.push(("SOFTVERBS_UDP_SLOTS".into(), slots.to_string()));
    }
    let exe = std::env::current_exe()?;
    let t_spawn = Instant::now();
    let cmds = (0..p as usize).map(|i| {
        let role = if i % 2 == 0 { "server" } else { "client" };
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--role",
            role,
            "--qps",
            &qps.to_string(),
            "--iters",
            &args.iters.to_string(),
            "--size",
            &args.size.to_string(),
            "--depth",
            &args.depth.to_string(),
            "--device",
            &args.device,
            "--timeout",
            &args.timeout.to_string(),
            "--ack-timeout",
            &ack_timeout(args, u64::from(p) * u64::from(qps)).to_string(),
            "--test",
            match args.test {
                ScaleOp::Write => "write",
                ScaleOp::Send => "send",
            },
        ])
        .envs(env.iter().map(|(k, v)| (k, v)));
        cmd
    });
    let mut ch = Children::spawn(cmds, deadline)?;
    // Each pair learns the other's endpoint; all connect.
    let eps = ch.gather("EP")?;
    for pair in 0..p as usize / 2 {
        let (s, c) = (2 * pair, 2 * pair + 1);
        let (es, ec) = (eps[s].clone(), eps[c].clone());
        ch.send(s, &format!("PEER {ec}"))?;
        ch.send(c, &format!("PEER {es}"))?;
    }
    let ready = ch.gather("READY")?;
    let setup_s = t_spawn.elapsed().as_secs_f64();
    let rss: Vec<f64> = ready.iter().map(|r| num(r, 0)).collect::<Result<_>>()?;
    // Idle: every process connected, none sending.
    let (idle, wakeups): (Vec<f64>, Vec<f64>) = if args.idle > 0.0 {
        ch.send_all(&format!("IDLE {}", args.idle))?;
        let r = ch.gather("IDLECPU")?;
        (
            r.iter().map(|r| num(r, 0)).collect::<Result<_>>()?,
            r.iter().map(|r| num(r, 1)).collect::<Result<_>>()?,
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let t_go = Instant::now();
    ch.send_all("GO")?;
    let done = ch.gather("SENT")?;
    let wall = t_go.elapsed().as_secs_f64();
    let msgs: f64 = done.iter().map(|r| num(r, 0)).sum::<Result<f64>>()?;
    let retransmits: f64 = done.iter().map(|r| num(r, 2)).sum::<Result<f64>>()?;
    let timeouts: f64 = done.iter().map(|r| num(r, 3)).sum::<Result<f64>>()?;
    let per_proc_rate: f64 = done
        .iter()
        .map(|r| Ok(num(r, 0)? / num(r, 1)?))
        .sum::<Result<f64>>()?;
    // Every sender's messages are acknowledged, so every receiver can check its memory.
    ch.send_all("VERIFY")?;
    let verified: f64 = ch
        .gather("VERIFIED")?
        .iter()
        .map(|r| num(r, 0))
        .sum::<Result<f64>>()?;
    ch.send_all("EXIT")?;
    ch.gather("BYE")?;
    let max = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::max);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let expected = f64::from(p) * f64::from(qps) * f64::from(args.iters);
    if msgs != expected {
        bail!("{msgs} messages completed, expected {expected}");
    }
    Ok(vec![
        fig("processes", f64::from(p), ""),
        fig("qps_per_process", f64::from(qps), ""),
        fig("setup_s", setup_s, "s"),
        fig("rss_per_process_mean", mean(&rss), "B"),
        fig("rss_per_process_max", max(&rss), "B"),
        fig(
            "idle_cpu_per_process_mean",
            if idle.is_empty() { f64::NAN } else { mean(&idle) },
            "% of a core",
        ),
        fig(
            "idle_cpu_per_process_max",
            if idle.is_empty() { f64::NAN } else { max(&idle) },
            "% of a core",
        ),
        fig(
            "idle_wakeups_per_process_max",
            if wakeups.is_empty() {
                f64::NAN
            } else {
                max(&wakeups)
            },
            "/s",
        ),
        fig("messages", msgs, ""),
        fig("message_size", f64::from(args.size), "B"),
        fig("burst_wall_s", wall, "s"),
        fig("msg_rate", msgs / wall, "msg/s"),
        fig("msg_rate_sum_of_processes", per_proc_rate, "msg/s"),
        fig("completions_ok", msgs, ""),
        fig("qps_verified", verified, ""),
        fig(
            "ack_timeout_exp",
            f64::from(ack_timeout(args, u64::from(p) * u64::from(qps))),
            "",
        ),
        fig("retransmits", retransmits, ""),
        fig("ack_timeouts", timeouts, ""),
    ])
}

/// One side of a pair: reads the parent's commands on stdin, answers on stdout.
fn child(args: &ScaleArgs, role: Role) -> Result<()> {
    let n = args.qps.unwrap_or(1) as usize;
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout);
    let seed = match role {
        Role::Server => 0x3C,
        Role::Client => 0xA5,
        Role::Holder => bail!("a holder is not one side of a pair"),
    };
    let peer_seed = 0x3C ^ 0xA5 ^ seed;
    let mut rig = Rig::new(args, n, seed)?;
    rig.create_qps(n, recv_depth(args))?;
    let psn = psns(n);
    let mut io = Pipe::stdio();
    io.say(&format!("EP {}", rig.info(&psn).encode()))?;
    let peer = Info::decode(&io.expect("PEER")?)?;
    if peer.qps.len() != n || peer.len < rig.mr.len() as u64 {
        bail!("the peer's endpoint does not match this one's");
    }
    let mtu = Mtu::largest_within(rig.mtu.bytes().min(peer.mtu)).unwrap_or(Mtu::Mtu256);
    for (q, &dest) in peer.qps.iter().enumerate() {
        rig.connect(q, psn[q], dest, peer.gid, mtu)?;
    }
    rig.post_initial_recvs()?;
    io.say(&format!("READY {}", rss_bytes()?))?;
    loop {
        let cmd = io.line()?;
        if let Some(secs) = cmd.strip_prefix("IDLE ") {
            let secs: f64 = secs.parse().map_err(|_| Error::msg("bad IDLE"))?;
            let (cpu, wakeups) = idle_percent(secs)?;
            io.say(&format!("IDLECPU {cpu} {wakeups}"))?;
        } else if cmd == "GO" {
            break;
        } else {
            bail!("unexpected command {cmd:?}");
        }
    }
    let targets: Vec<Target> = (0..n)
        .map(|q| Target {
            addr: peer.addr,
            rkey: peer.rkey,
            slot: q,
        })
        .collect();
    let (msgs, secs) = rig.burst_explained(&targets, deadline)?;
    let c = rig.counters();
    io.say(&format!("SENT {msgs} {secs} {} {}", c[1], c[2]))?;
    io.expect("VERIFY")?;
    let verified = rig.verify(peer_seed, |r| r)?;
    io.say(&format!("VERIFIED {verified}"))?;
    io.expect("EXIT")?;
    drop(std::mem::take(&mut rig.qps));
    io.say("BYE")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The only test of this crate's library that opens a device: it points the process at a
    /// private UDP port range and the loopback interface before the first device listing.
    fn args(qps: u32, test: ScaleOp) -> ScaleArgs {
        static ENV: std::sync::Once = std::sync::Once::new();
        ENV.call_once(|| {
            std::env::set_var("SOFTVERBS_INTERFACES", "lo");
            std::env::set_var("SOFTVERBS_UDP_PORT", free_base_port(2).unwrap().to_string());
            std::env::set_var("SOFTVERBS_UDP_SLOTS", "1");
        });
        ScaleArgs::parse_from(["softverbs-scale", "-q", &qps.to_string(), "-n", "3", "-s", "40"])
            .with_test(test)
    }

    impl ScaleArgs {
        fn with_test(mut self, test: ScaleOp) -> Self {
            self.test = test;
            self
        }
    }

    /// A pair-connected rig of `n` QPs after a burst of `op`.
    fn rig_after_burst(n: usize, op: ScaleOp) -> Rig {
        let a = args(n as u32, op);
        let mut rig = Rig::new(&a, n, 0x11).unwrap();
        rig.create_qps(n, recv_depth(&a)).unwrap();
        let psn = psns(n);
        let (gid, mtu) = (rig.gid, rig.mtu);
        for q in 0..n {
            rig.connect(q, psn[q], (rig.qps[q ^ 1].qp_num(), psn[q ^ 1]), gid, mtu)
                .unwrap();
        }
        rig.post_initial_recvs().unwrap();
        let targets: Vec<Target> = (0..n)
            .map(|q| Target {
                addr: rig.mr.addr(),
                rkey: rig.mr.rkey(),
                slot: q ^ 1,
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        let (msgs, _) = rig.burst(&targets, deadline).unwrap();
        assert_eq!(msgs, 3 * n as u64);
        rig
    }

    #[test]
    fn verification_catches_one_wrong_byte() {
        for op in [ScaleOp::Write, ScaleOp::Send] {
            let rig = rig_after_burst(6, op);
            assert_eq!(rig.verify(0x11, |r| r ^ 1).unwrap(), 6);
            // Slots read as if each QP had received its own data: wrong everywhere.
            assert!(rig.verify(0x11, |r| r).is_err());
            let off = rig.slot_len() + 5 * 40 + 39;
            let mut b = [0u8];
            rig.mr.read(off, &mut b).unwrap();
            rig.mr.write(off, &[b[0] ^ 1]).unwrap();
            let e = rig.verify(0x11, |r| r ^ 1).unwrap_err();
            assert!(e.message().contains("QP 5: byte 39"), "{e}");
        }
    }

    #[test]
    fn a_burst_to_a_bad_rkey_fails_instead_of_counting() {
        let a = args(2, ScaleOp::Write);
        let mut rig = Rig::new(&a, 2, 0x22).unwrap();
        rig.create_qps(2, 0).unwrap();
        let psn = psns(2);
        let (gid, mtu) = (rig.gid, rig.mtu);
        for q in 0..2 {
            rig.connect(q, psn[q], (rig.qps[q ^ 1].qp_num(), psn[q ^ 1]), gid, mtu)
                .unwrap();
        }
        let bad = Target {
            addr: rig.mr.addr(),
            rkey: rig.mr.rkey() ^ 0x100,
            slot: 1,
        };
        let e = rig
            .burst(&[bad, bad], Instant::now() + Duration::from_secs(60))
            .unwrap_err();
        assert!(e.message().contains("completed with"), "{e}");
    }
}
