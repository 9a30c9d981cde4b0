//! `softverbs-soak`: two processes that exchange every kind of traffic for a given time, with
//! objects created and destroyed all along, and the evidence that nothing was lost, damaged,
//! leaked or hung.
//!
//! Each side (a child process, optionally in a network namespace of its own: `--netns`) has
//! `--qps` RC, UC and UD QPs connected to the other side's. Every QP keeps `--depth` work
//! requests in flight, each signaled, cycling through its transport's operations: RC does
//! SEND, SEND with immediate, RDMA WRITE, an RDMA READ of what that WRITE wrote, RDMA WRITE
//! with immediate, fetch-and-add and compare-and-swap; UC does SEND, SEND with immediate,
//! WRITE and WRITE with immediate; UD does SEND and SEND with immediate. What is checked:
//!
//! - every send completion arrives and is successful (all transports);
//! - RC: every message arrives, in order, byte-exact (the receiver checks each SEND and each
//!   WRITE with immediate's data), every READ returns exactly what the WRITE before it wrote,
//!   and every atomic returns the value the previous ones left;
//! - UC, UD: what arrives is byte-exact and in order; the receiver counts it (with loss on, the
//!   rest was lost);
//! - meanwhile each side creates and destroys PDs, MRs, CQs, QPs (connected to each other and
//!   used) and AHs every `--churn-ms`;
//! - each side's resident set, open descriptors and threads are sampled every `--sample`
//!   seconds; the first sample after the warm-up and the last must be within the bounds given.
//!
//! Results are `name value unit` lines (or one JSON object); the exit status is non-zero if a
//! check failed. `scripts/soak` runs it for ten minutes between two network namespaces that
//! drop a share of each other's datagrams.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;
use softverbs::{
    AccessFlags, AddressHandle, AhAttr, CompletionQueue, Context, Gid, GlobalRoute, MemoryRegion, Mtu,
    Payload, ProtectionDomain, QpAttr, QpAttrMask, QpInit, QpState, QpType, QueuePair, RecvWr, RemoteAddr,
    SendFlags, SendOp, SendRequest, Sge, UdAddress, WcOpcode, WcStatus, WorkCompletion,
};

use crate::endpoint::{split_wr_id, wr_id};
use crate::error::{bail, Error, Result};
use crate::procs::{self, open_device, Children};
use crate::scale::{print_figures, rss_bytes, Figure};

/// Two processes, every operation, objects churned, for a given time.
#[derive(Parser, Debug, Clone)]
#[command(name = "softverbs-soak", version, about, long_about = None)]
pub struct SoakArgs {
    /// Seconds of traffic.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,

    /// QPs of each transport (RC, UC, UD) per side.
    #[arg(short = 'q', long, default_value_t = 2)]
    pub qps: u32,

    /// Largest message in bytes (UD: at most the path MTU).
    #[arg(short = 's', long, default_value_t = 16384)]
    pub size: u32,

    /// Work requests in flight per QP.
    #[arg(short = 't', long, default_value_t = 8)]
    pub depth: u32,

    /// The transports that carry traffic (their QPs exist either way).
    #[arg(long, value_delimiter = ',', default_value = "rc,uc,ud")]
    pub transports: Vec<String>,

    /// Seconds between samples of each side's memory, descriptors and threads.
    #[arg(long, default_value_t = 2.0)]
    pub sample: f64,

    /// Seconds before the first sample that counts (default: a tenth of the run, at least 2).
    #[arg(long)]
    pub warmup: Option<f64>,

    /// Milliseconds between object churn cycles (0: no churn).
    #[arg(long, default_value_t = 20)]
    pub churn_ms: u64,

    /// RC ACK timeout exponent (4.096 us * 2^N; 16 is 268 ms).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u8).range(1..=31))]
    pub ack_timeout: u8,

    /// Device (name or interface) of both sides, unless --interfaces names one per side.
    #[arg(short = 'd', long, default_value = "sv_lo")]
    pub device: String,

    /// Run the two sides in these network namespaces (`ip netns exec`; two names).
    #[arg(long, value_delimiter = ',')]
    pub netns: Vec<String>,

    /// The interface of each side (two names): its only device (`SOFTVERBS_INTERFACES`).
    #[arg(long, value_delimiter = ',')]
    pub interfaces: Vec<String>,

    /// Largest growth of a side's resident set from the first counted sample to the last.
    #[arg(long, default_value_t = 32 << 20)]
    pub max_rss_growth: u64,

    /// Largest growth of a side's open descriptors: the fewest open in the later half of the
    /// samples against the fewest in the earlier half (object churn holds descriptors briefly, so
    /// a single sample may catch one in flight; a leak raises every later sample).
    #[arg(long, default_value_t = 0)]
    pub max_fd_growth: u64,

    /// Print the results as one JSON object instead of `name value` lines.
    #[arg(long)]
    pub json: bool,

    /// Internal: this process is side 0 or 1.
    #[arg(long, hide = true)]
    pub role: Option<u8>,
}

/// The UD Q_Key.
const QKEY: u32 = 0x50AC;
/// First PSNs.
const PSN: u32 = 0xFF_F000;
/// Receives kept posted per QP, per in-flight request on the other side.
const RECV_PER_DEPTH: usize = 2;
/// Slots for WRITE and READ per RC and UC QP at the receiving side.
const WRITE_SLOTS: usize = 8;
/// Slots for WRITE with immediate: more than the receives posted, so an RC sender (stopped by
/// RNR when the receiver lags) never overwrites one not yet checked.
const IMM_SLOTS: usize = 64;
// UC and UD have no flow control: a sender posts a message only as far ahead of what the
// receiver last said it got (its credit, written by RDMA WRITE into the sender's memory) as
// the receiver keeps receives posted, as an application over them must. Without that it fills
// the receiver's socket buffer, and everything queued behind (RC included) waits for the
// receiver to drain it; and what is lost is lost to the network, not to missing receives.

/// A credit that does not move for this long (everything in the window was lost, or the
/// credits were) lets the sender go on by half a window.
const CREDIT_STALL: Duration = Duration::from_millis(100);
/// A receiver writes its credits at least this often while messages come.
const CREDIT_EVERY: Duration = Duration::from_millis(2);

/// Runs what `args` asks for and returns the figures (printed too, except by a side).
pub fn run_soak(args: &SoakArgs) -> Result<Vec<Figure>> {
    if args.qps == 0 || args.depth == 0 || args.size < 64 {
        bail!("--qps and --depth must be at least 1, --size at least 64");
    }
    if !(args.duration > 0.0 && args.sample > 0.0) {
        bail!("--duration and --sample must be positive");
    }
    if !(args.netns.is_empty() || args.netns.len() == 2)
        || !(args.interfaces.is_empty() || args.interfaces.len() == 2)
    {
        bail!("--netns and --interfaces take two names, one per side");
    }
    if let Some(side) = args.role {
        return side_main(args, side).map(|()| Vec::new());
    }
    let figures = parent(args)?;
    print_figures(&figures, args.json);
    Ok(figures)
}

// ---------------------------------------------------------------------------------------------
// Layout and contents

/// Where things are in a side's one region.
#[derive(Debug, Clone, Copy)]
struct Layout {
    /// QPs of each transport.
    n: usize,
    /// Largest message.
    size: usize,
    depth: usize,
    recvs: usize,
}

impl Layout {
    /// QPs: `n` of each transport, and the RC QP that carries the receivers' credits.
    fn qps(&self) -> usize {
        3 * self.n + 1
    }

    /// The QP index of the credit carrier.
    fn ctl(&self) -> usize {
        3 * self.n
    }

    /// The local buffer of in-flight request `slot` of QP `q`.
    fn send_at(&self, q: usize, slot: usize) -> usize {
        (q * self.depth + slot) * self.size
    }

    /// Receive buffer `slot` of QP `q` (40 bytes more, for UD's GRH area).
    fn recv_at(&self, q: usize, slot: usize) -> usize {
        self.qps() * self.depth * self.size + (q * self.recvs + slot) * (self.size + 40)
    }

    fn exposed_base(&self) -> usize {
        self.recv_at(self.qps(), 0)
    }

    /// WRITE (and READ) slot `slot` of RC or UC QP `q` (`q < 2n`), for the peer.
    fn write_at(&self, q: usize, slot: usize) -> usize {
        self.exposed_base() + (q * (WRITE_SLOTS + IMM_SLOTS) + slot) * self.size
    }

    /// WRITE-with-immediate slot `slot` of QP `q`.
    fn imm_at(&self, q: usize, slot: usize) -> usize {
        self.write_at(q, WRITE_SLOTS + slot)
    }

    /// The fetch-and-add word of RC QP `q`, and the compare-and-swap word after it.
    fn atomic_at(&self, q: usize) -> usize {
        self.write_at(2 * self.n, 0) + 16 * q
    }

    /// Where the peer's receiver writes how far it got on UC or UD QP `q` (the sequence number
    /// after the last message it received), which bounds what this side sends on it.
    fn credit_at(&self, q: usize) -> usize {
        self.atomic_at(self.n) + 8 * q
    }

    fn len(&self) -> usize {
        self.credit_at(self.qps())
    }
}

/// The transport of QP index `q`.
fn kind(l: &Layout, q: usize) -> QpType {
    if q == l.ctl() {
        return QpType::Rc;
    }
    match q / l.n {
        0 => QpType::Rc,
        1 => QpType::Uc,
        _ => QpType::Ud,
    }
}

/// The operations each transport cycles through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Send,
    SendImm,
    Write,
    Read,
    WriteImm,
    FetchAdd,
    CompSwap,
}

const RC_OPS: [Op; 7] = [
    Op::Send,
    Op::SendImm,
    Op::Write,
    Op::Read,
    Op::WriteImm,
    Op::FetchAdd,
    Op::CompSwap,
];
const UC_OPS: [Op; 4] = [Op::Send, Op::SendImm, Op::Write, Op::WriteImm];
const UD_OPS: [Op; 2] = [Op::Send, Op::SendImm];

fn ops(t: QpType) -> &'static [Op] {
    match t {
        QpType::Rc => &RC_OPS,
        QpType::Uc => &UC_OPS,
        _ => &UD_OPS,
    }
}

/// Request `seq`'s operation on a QP of transport `t`, and which round of its cycle it is in.
fn op_of(t: QpType, seq: u64) -> (Op, u64) {
    let o = ops(t);
    (o[(seq % o.len() as u64) as usize], seq / o.len() as u64)
}

/// The length of request `seq`'s message: from 16 bytes (its header) to `max`.
fn msg_len(seq: u64, max: usize) -> usize {
    16 + (seq.wrapping_mul(7919) % (max as u64 - 15)) as usize
}

/// Message `seq` of QP `q` from side `side`: a header (`q`, `seq`), then words of a mix of
/// the four (cheap to make and to compare, so that checking every byte costs little).
fn content(side: u8, q: usize, seq: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    out.extend_from_slice(&(q as u64).to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    let mut x = (u64::from(side) << 56) ^ ((q as u64) << 40) ^ seq ^ 0x9E37_79B9_7F4A_7C15;
    while out.len() < len {
        // splitmix64
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Checks `bytes` against message `seq` of QP `q` from `side`.
fn check_content(bytes: &[u8], side: u8, q: usize, seq: u64) -> bool {
    bytes == content(side, q, seq, bytes.len())
}

// ---------------------------------------------------------------------------------------------
// One side

/// What a side tells the other.
#[derive(Debug, Clone)]
struct Endpoint {
    gid: Gid,
    addr: u64,
    rkey: u32,
    mtu: u32,
    qpns: Vec<u32>,
}

impl Endpoint {
    fn encode(&self) -> String {
        let qpns: Vec<String> = self.qpns.iter().map(u32::to_string).collect();
        format!(
            "{} {} {} {} {}",
            self.gid.to_ip(),
            self.addr,
            self.rkey,
            self.mtu,
            qpns.join(" ")
        )
    }

    fn decode(s: &str) -> Result<Self> {
        let v: Vec<&str> = s.split_whitespace().collect();
        let bad = || Error::msg(format!("bad endpoint {s:?}"));
        if v.len() < 4 {
            return Err(bad());
        }
        let ip: IpAddr = v[0].parse().map_err(|_| bad())?;
        Ok(Self {
            gid: Gid::from_ip(ip),
            addr: v[1].parse().map_err(|_| bad())?,
            rkey: v[2].parse().map_err(|_| bad())?,
            mtu: v[3].parse().map_err(|_| bad())?,
            qpns: v[4..]
                .iter()
                .map(|q| q.parse().map_err(|_| bad()))
                .collect::<Result<_>>()?,
        })
    }
}

/// Per-transport tallies of one side.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    /// Requests posted and completed successfully.
    posted: u64,
    completed: u64,
    /// Message bytes of the completed requests.
    bytes: u64,
    /// Messages this side sent that consume a receive at the peer (SEND, SEND with immediate,
    /// WRITE with immediate).
    to_receive: u64,
    /// Messages received (and checked).
    received: u64,
    /// READs and atomics whose results were checked.
    checked: u64,
}

/// The traffic state of one QP.
#[derive(Debug, Default, Clone, Copy)]
struct QpTraffic {
    next: u64,
    done: u64,
    /// The last sequence number received (in order on every transport here).
    last_rx: Option<u64>,
    /// UC/UD sender: the credit last seen, when it last moved, and the floor it is taken to be
    /// at least (raised when it stalls).
    credit: u64,
    credit_moved: Option<Instant>,
    floor: u64,
    /// UC/UD receiver: the credit last written to the peer.
    credit_sent: u64,
}

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    gid_index: u8,
    gid: Gid,
    scq: CompletionQueue,
    rcq: CompletionQueue,
    mr: MemoryRegion,
    qps: Vec<QueuePair>,
    l: Layout,
    id: u8,
    ud_size: usize,
    errors: u64,
}

impl Side {
    fn error(&mut self, what: String) {
        self.errors += 1;
        if self.errors <= 10 {
            eprintln!("softverbs-soak side {}: {what}", self.id);
        }
    }

    fn connect(&self, q: usize, peer: &Endpoint, mtu: Mtu, ack_timeout: u8) -> Result<()> {
        let qp = &self.qps[q];
        let t = kind(&self.l, q);
        if t == QpType::Ud {
            return ud_to_rts(qp, PSN);
        }
        connect_qp(qp, self.gid_index, peer.gid, peer.qpns[q], mtu, ack_timeout)
    }

    fn post_recv(&self, q: usize, slot: usize) -> Result<()> {
        let at = self.l.recv_at(q, slot);
        self.qps[q].post_recv(&[RecvWr {
            wr_id: wr_id(q, slot as u64),
            sg_list: vec![self.mr.sge(at..at + self.l.size + 40)?],
        }])?;
        Ok(())
    }
}

/// INIT (with [`QKEY`]), RTR and RTS (first PSN `sq_psn`) of a UD QP.
fn ud_to_rts(qp: &QueuePair, sq_psn: u32) -> Result<()> {
    qp.modify(
        &QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qkey: QKEY,
            ..Default::default()
        },
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY,
    )?;
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rtr,
            ..Default::default()
        },
        QpAttrMask::STATE,
    )?;
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rts,
            sq_psn,
            ..Default::default()
        },
        QpAttrMask::STATE | QpAttrMask::SQ_PSN,
    )?;
    Ok(())
}

/// INIT, RTR and RTS of an RC or UC QP towards `dest` at `dgid`.
fn connect_qp(qp: &QueuePair, gid_index: u8, dgid: Gid, dest: u32, mtu: Mtu, ack_timeout: u8) -> Result<()> {
    let rc = qp.qp_type() == QpType::Rc;
    let access = AccessFlags::REMOTE_WRITE
        | if rc {
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC
        } else {
            AccessFlags::empty()
        };
    qp.modify(
        &QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: access,
            ..Default::default()
        },
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
    )?;
    let mut mask =
        QpAttrMask::STATE | QpAttrMask::AV | QpAttrMask::PATH_MTU | QpAttrMask::DEST_QPN | QpAttrMask::RQ_PSN;
    if rc {
        mask |= QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER;
    }
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: mtu,
            dest_qp_num: dest,
            rq_psn: PSN,
            max_dest_rd_atomic: 8,
            min_rnr_timer: 1,
            ah_attr: ah_attr(dgid, gid_index),
            ..Default::default()
        },
        mask,
    )?;
    let mut mask = QpAttrMask::STATE | QpAttrMask::SQ_PSN;
    if rc {
        mask |= QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC;
    }
    qp.modify(
        &QpAttr {
            qp_state: QpState::Rts,
            sq_psn: PSN,
            timeout: ack_timeout,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 8,
            ..Default::default()
        },
        mask,
    )?;
    Ok(())
}

/// A signaled request of one gather entry.
fn signaled(wr_id: u64, op: SendOp, sge: Sge, ud: Option<UdAddress>) -> SendRequest {
    SendRequest {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![sge]),
        ud,
        xrc_srqn: None,
    }
}

fn ah_attr(dgid: Gid, sgid_index: u8) -> AhAttr {
    AhAttr {
        grh: GlobalRoute {
            dgid,
            sgid_index,
            hop_limit: 64,
            ..Default::default()
        },
        is_global: true,
        port_num: 1,
        ..Default::default()
    }
}

/// Commands from the parent, read by a thread (so that the traffic loop can poll for them).
fn commands() -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        loop {
            let mut l = String::new();
            match stdin.read_line(&mut l) {
                Ok(1..) => {
                    if tx.send(l.trim().to_string()).is_err() {
                        return;
                    }
                }
                // The parent went away: nothing left to do.
                _ => std::process::exit(1),
            }
        }
    });
    rx
}

fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn expect(cmds: &mpsc::Receiver<String>, tag: &str) -> Result<String> {
    let line = cmds
        .recv_timeout(Duration::from_secs(600))
        .map_err(|_| Error::msg(format!("no {tag} from the parent")))?;
    line.strip_prefix(tag)
        .map(|r| r.trim().to_string())
        .ok_or_else(|| Error::msg(format!("expected {tag}, got {line:?}")))
}

/// One sample: seconds since the start, resident set, descriptors, threads.
type Sample = (f64, f64, f64, f64);

fn sample(start: Instant) -> Result<Sample> {
    Ok((
        start.elapsed().as_secs_f64(),
        rss_bytes()? as f64,
        procs::fd_count(),
        procs::thread_count(),
    ))
}

fn side_main(args: &SoakArgs, id: u8) -> Result<()> {
    let start = Instant::now();
    let cmds = commands();
    let device = match args.interfaces.get(usize::from(id)) {
        Some(ifname) => ifname.clone(),
        None => args.device.clone(),
    };
    let (ctx, gid, gid_index) = open_device(&device)?;
    let port = ctx.query_port(1)?;
    let n = args.qps as usize;
    let depth = args.depth as usize;
    let l = Layout {
        n,
        size: args.size as usize,
        depth,
        recvs: RECV_PER_DEPTH * depth,
    };
    let pd = ctx.alloc_pd()?;
    let scq = ctx.create_cq((l.qps() * depth * 2) as i32, None, 0)?;
    let rcq = ctx.create_cq((l.qps() * l.recvs * 2) as i32, None, 0)?;
    let all = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC;
    let mr = pd.register(l.len(), all)?;
    let mut qps = Vec::new();
    for q in 0..l.qps() {
        let mut init = QpInit::new(kind(&l, q), &scq);
        init.recv_cq = &rcq;
        init.cap.max_send_wr = depth as u32;
        init.cap.max_recv_wr = l.recvs as u32;
        qps.push(pd.create_qp(&init)?);
    }
    let s = Side {
        ud_size: (port.active_mtu.bytes() as usize).min(l.size),
        ctx,
        pd,
        gid_index,
        gid,
        scq,
        rcq,
        mr,
        qps,
        l,
        id,
        errors: 0,
    };
    let me = Endpoint {
        gid,
        addr: s.mr.addr(),
        rkey: s.mr.rkey(),
        mtu: port.active_mtu.bytes(),
        qpns: s.qps.iter().map(QueuePair::qp_num).collect(),
    };
    say(&format!("EP {}", me.encode()));
    let peer = Endpoint::decode(&expect(&cmds, "PEER")?)?;
    if peer.qpns.len() != s.qps.len() {
        bail!("the peer has {} QPs, this side {}", peer.qpns.len(), s.qps.len());
    }
    let mtu = Mtu::largest_within(me.mtu.min(peer.mtu)).unwrap_or(Mtu::Mtu256);
    let mut s = s;
    s.ud_size = s.ud_size.min(mtu.bytes() as usize);
    for q in 0..s.qps.len() {
        s.connect(q, &peer, mtu, args.ack_timeout)?;
        for slot in 0..s.l.recvs {
            s.post_recv(q, slot)?;
        }
    }
    let ah = s.pd.create_ah(&ah_attr(peer.gid, s.gid_index))?;
    say("READY");
    expect(&cmds, "GO")?;
    let run = Traffic::new(&s, peer, ah);
    run.go(s, args, &cmds, start)
}

/// The traffic of one side.
struct Traffic {
    peer: Endpoint,
    ah: AddressHandle,
    st: Vec<QpTraffic>,
    tally: BTreeMap<&'static str, Tally>,
    peer_id: u8,
    /// Credit WRITEs posted and completed on the control QP.
    ctl_next: u64,
    ctl_done: u64,
    credits_at: Instant,
}

fn tname(t: QpType) -> &'static str {
    match t {
        QpType::Rc => "rc",
        QpType::Uc => "uc",
        _ => "ud",
    }
}

impl Traffic {
    fn new(s: &Side, peer: Endpoint, ah: AddressHandle) -> Self {
        Self {
            peer,
            ah,
            st: vec![QpTraffic::default(); s.qps.len()],
            tally: ["rc", "uc", "ud"]
                .into_iter()
                .map(|k| (k, Tally::default()))
                .collect(),
            peer_id: 1 - s.id,
            ctl_next: 0,
            ctl_done: 0,
            credits_at: Instant::now(),
        }
    }

    /// The request `seq` of QP `q`.
    fn request(&self, s: &Side, q: usize, seq: u64) -> Result<(SendRequest, bool, usize)> {
        let t = kind(&s.l, q);
        let (op, round) = op_of(t, seq);
        let max = if t == QpType::Ud { s.ud_size } else { s.l.size };
        let len = msg_len(seq, max);
        let local = s.l.send_at(q, (seq % s.l.depth as u64) as usize);
        let remote = |at: usize| RemoteAddr {
            addr: self.peer.addr + at as u64,
            rkey: self.peer.rkey,
        };
        let write_slot = s.l.write_at(q, (round % WRITE_SLOTS as u64) as usize);
        let (op, len, consumes) = match op {
            Op::Send => (
                SendOp::Send {
                    imm: None,
                    invalidate: None,
                },
                len,
                true,
            ),
            Op::SendImm => (
                SendOp::Send {
                    imm: Some(seq as u32),
                    invalidate: None,
                },
                len,
                true,
            ),
            Op::Write => (
                SendOp::Write {
                    remote: remote(write_slot),
                    imm: None,
                },
                len,
                false,
            ),
            // What the WRITE just before it wrote.
            Op::Read => (
                SendOp::Read {
                    remote: remote(write_slot),
                },
                msg_len(seq - 1, max),
                false,
            ),
            Op::WriteImm => (
                SendOp::Write {
                    remote: remote(s.l.imm_at(q, (round % IMM_SLOTS as u64) as usize)),
                    imm: Some(seq as u32),
                },
                len,
                true,
            ),
            Op::FetchAdd => (
                SendOp::FetchAdd {
                    remote: remote(s.l.atomic_at(q)),
                    add: 1,
                },
                8,
                false,
            ),
            // One of each atomic per cycle, executed in order by the peer: the n-th finds n.
            Op::CompSwap => (
                SendOp::CompareSwap {
                    remote: remote(s.l.atomic_at(q) + 8),
                    compare: round,
                    swap: round + 1,
                },
                8,
                false,
            ),
        };
        if !matches!(
            op,
            SendOp::Read { .. } | SendOp::FetchAdd { .. } | SendOp::CompareSwap { .. }
        ) {
            s.mr.write(local, &content(s.id, q, seq, len))?;
        }
        let req = signaled(
            wr_id(q, seq),
            op,
            s.mr.sge(local..local + len)?,
            (t == QpType::Ud).then(|| self.ah.ud_address(self.peer.qpns[q], QKEY)),
        );
        Ok((req, consumes, len))
    }

    /// Posts what the QPs have room for.
    fn post(&mut self, s: &mut Side, transports: &[String]) -> Result<()> {
        let now = Instant::now();
        for q in 0..s.l.ctl() {
            let t = kind(&s.l, q);
            if !transports.iter().any(|n| n == tname(t)) {
                continue;
            }
            let mut limit = u64::MAX;
            if t != QpType::Rc {
                let st = &mut self.st[q];
                let credit = s.mr.read_u64(s.l.credit_at(q))?;
                if credit != st.credit || st.credit_moved.is_none() {
                    st.credit = credit;
                    st.credit_moved = Some(now);
                    st.floor = st.floor.max(credit);
                } else if st
                    .credit_moved
                    .is_some_and(|m| now.duration_since(m) >= CREDIT_STALL)
                {
                    st.floor += s.l.recvs as u64 / 2;
                    st.credit_moved = Some(now);
                }
                limit = st.floor + s.l.recvs as u64;
            }
            while self.st[q].next < limit && self.st[q].next - self.st[q].done < s.l.depth as u64 {
                let seq = self.st[q].next;
                let (req, consumes, _) = self.request(s, q, seq)?;
                s.qps[q].post_send(&[req])?;
                self.st[q].next += 1;
                let t = self.tally.get_mut(tname(kind(&s.l, q))).expect("three tallies");
                t.posted += 1;
                t.to_receive += u64::from(consumes);
            }
        }
        Ok(())
    }

    /// Handles send completions; returns how many.
    fn send_completions(&mut self, s: &mut Side) -> usize {
        let mut wc = [WorkCompletion::default(); 64];
        let n = s.scq.poll(&mut wc);
        for w in &wc[..n] {
            let (q, seq) = split_wr_id(w.wr_id);
            if q >= s.qps.len() {
                s.error(format!("a send completion of unknown QP {q}"));
                continue;
            }
            let t = kind(&s.l, q);
            if q == s.l.ctl() {
                self.ctl_done += 1;
                if w.status != WcStatus::Success {
                    s.error(format!("credit WRITE {seq}: {:?}", w.status));
                }
                continue;
            }
            if w.status != WcStatus::Success {
                let c = s.qps[q].counters();
                s.error(format!("{t:?} QP {q} request {seq}: {:?} ({c:?})", w.status));
                self.st[q].done += 1;
                continue;
            }
            if seq != self.st[q].done {
                s.error(format!(
                    "{t:?} QP {q}: completion of {seq}, expected {}",
                    self.st[q].done
                ));
            }
            self.st[q].done = seq + 1;
            let max = if t == QpType::Ud { s.ud_size } else { s.l.size };
            let local = s.l.send_at(q, (seq % s.l.depth as u64) as usize);
            let (op, round) = op_of(t, seq);
            let tally = self.tally.get_mut(tname(t)).expect("three tallies");
            tally.completed += 1;
            match op {
                Op::Read => {
                    let len = msg_len(seq - 1, max);
                    let mut got = vec![0u8; len];
                    let ok = s.mr.read(local, &mut got).is_ok() && check_content(&got, s.id, q, seq - 1);
                    tally.bytes += len as u64;
                    tally.checked += 1;
                    if !ok {
                        s.error(format!(
                            "RC QP {q}: READ {seq} differs from what WRITE {} wrote",
                            seq - 1
                        ));
                    }
                }
                Op::FetchAdd | Op::CompSwap => {
                    // The n-th of its kind finds the word at n (see `request`).
                    let got = s.mr.read_u64(local).unwrap_or(u64::MAX);
                    tally.bytes += 8;
                    tally.checked += 1;
                    if got != round {
                        s.error(format!(
                            "RC QP {q}: {op:?} {seq} returned {got}, expected {round}"
                        ));
                    }
                }
                _ => tally.bytes += msg_len(seq, max) as u64,
            }
        }
        n
    }

    /// Handles receive completions (checking each message) and posts the receives again.
    fn recv_completions(&mut self, s: &mut Side) -> usize {
        let mut wc = [WorkCompletion::default(); 64];
        let n = s.rcq.poll(&mut wc);
        for w in &wc[..n] {
            let (q, slot) = split_wr_id(w.wr_id);
            if q >= s.qps.len() {
                s.error(format!("a receive completion of unknown QP {q}"));
                continue;
            }
            let t = kind(&s.l, q);
            if w.status != WcStatus::Success {
                s.error(format!("{t:?} QP {q}: receive {:?}", w.status));
                continue;
            }
            let at = s.l.recv_at(q, slot as usize);
            let skip = if t == QpType::Ud { 40 } else { 0 };
            let (seq, ok) = if w.opcode == WcOpcode::RecvRdmaWithImm {
                let seq = self.expand(q, w.imm_data);
                let (_, round) = op_of(t, seq);
                let max = s.l.size;
                let len = msg_len(seq, max);
                // UC senders do not wait for the receiver: a later WRITE may have replaced
                // this one's bytes already. RC senders are held back by the receives.
                let ok = t == QpType::Uc || {
                    let mut got = vec![0u8; len];
                    let imm_at = s.l.imm_at(q, (round % IMM_SLOTS as u64) as usize);
                    s.mr.read(imm_at, &mut got).is_ok() && check_content(&got, self.peer_id, q, seq)
                };
                (seq, ok && op_of(t, seq).0 == Op::WriteImm)
            } else {
                let len = (w.byte_len as usize).saturating_sub(skip);
                let mut got = vec![0u8; len];
                let read = s.mr.read(at + skip, &mut got).is_ok() && len >= 16;
                let seq = if read {
                    u64::from_le_bytes(got[8..16].try_into().expect("8 bytes"))
                } else {
                    0
                };
                let max = if t == QpType::Ud { s.ud_size } else { s.l.size };
                let imm_ok = match op_of(t, seq).0 {
                    Op::Send => !w.wc_flags.contains(softverbs::WcFlags::WITH_IMM),
                    Op::SendImm => {
                        w.wc_flags.contains(softverbs::WcFlags::WITH_IMM) && w.imm_data == seq as u32
                    }
                    _ => false,
                };
                let ok =
                    read && imm_ok && len == msg_len(seq, max) && check_content(&got, self.peer_id, q, seq);
                (seq, ok)
            };
            let st = &mut self.st[q];
            // In order on every transport (UC and UD may skip what was lost); RC skips nothing.
            let in_order = match st.last_rx {
                None => true,
                Some(last) => seq > last,
            };
            let next_expected = match st.last_rx {
                None => (0..).find(|&k| consumes(t, k)).unwrap_or(0),
                Some(last) => (last + 1..).find(|&k| consumes(t, k)).unwrap_or(last + 1),
            };
            st.last_rx = Some(seq);
            if !ok || !in_order || (t == QpType::Rc && seq != next_expected) {
                s.error(format!(
                    "{t:?} QP {q}: message {seq} damaged or out of order (ok {ok}, after {:?})",
                    next_expected
                ));
            }
            self.tally.get_mut(tname(t)).expect("three tallies").received += 1;
            if let Err(e) = s.post_recv(q, slot as usize) {
                s.error(format!("{t:?} QP {q}: post_recv: {e}"));
            }
        }
        n
    }

    /// Writes the UC and UD receivers' credits into the peer's memory (RDMA WRITE over the
    /// control QP), at most every [`CREDIT_EVERY`] and for the QPs whose credit moved.
    fn send_credits(&mut self, s: &mut Side) -> Result<()> {
        if self.credits_at.elapsed() < CREDIT_EVERY {
            return Ok(());
        }
        self.credits_at = Instant::now();
        let ctl = s.l.ctl();
        for q in s.l.n..ctl {
            let credit = self.st[q].last_rx.map_or(0, |l| l + 1);
            if credit == self.st[q].credit_sent || self.ctl_next - self.ctl_done >= s.l.depth as u64 {
                continue;
            }
            let local = s.l.send_at(ctl, (self.ctl_next % s.l.depth as u64) as usize);
            s.mr.write(local, &credit.to_le_bytes())?;
            let remote = RemoteAddr {
                addr: self.peer.addr + s.l.credit_at(q) as u64,
                rkey: self.peer.rkey,
            };
            s.qps[ctl].post_send(&[signaled(
                wr_id(ctl, self.ctl_next),
                SendOp::Write { remote, imm: None },
                s.mr.sge(local..local + 8)?,
                None,
            )])?;
            self.ctl_next += 1;
            self.st[q].credit_sent = credit;
        }
        Ok(())
    }

    /// The sequence number whose low 32 bits the immediate carries: the one after the last
    /// received that matches (messages are never 2^32 apart).
    fn expand(&self, q: usize, imm: u32) -> u64 {
        let base = self.st[q].last_rx.map_or(0, |l| l + 1);
        let hi = base & !0xFFFF_FFFF;
        let cand = hi | u64::from(imm);
        if cand >= base {
            cand
        } else {
            cand + (1 << 32)
        }
    }

    fn go(
        mut self,
        mut side: Side,
        args: &SoakArgs,
        cmds: &mpsc::Receiver<String>,
        start: Instant,
    ) -> Result<()> {
        let s = &mut side;
        let run_start = Instant::now();
        let end = run_start + Duration::from_secs_f64(args.duration);
        let warmup = Duration::from_secs_f64(args.warmup.unwrap_or((args.duration / 10.0).max(2.0)));
        let every = Duration::from_secs_f64(args.sample);
        let mut samples: Vec<Sample> = Vec::new();
        let mut next_sample = run_start + warmup.min(Duration::from_secs_f64(args.duration * 0.5));
        let churn_every = Duration::from_millis(args.churn_ms);
        let mut next_churn = run_start;
        let mut churned = 0u64;
        let mut churn_errors = 0u64;
        while Instant::now() < end {
            self.post(s, &args.transports)?;
            let got = self.send_completions(s) + self.recv_completions(s);
            self.send_credits(s)?;
            let now = Instant::now();
            if args.churn_ms > 0 && now >= next_churn {
                if let Err(e) = churn(s, churned) {
                    churn_errors += 1;
                    if churn_errors <= 5 {
                        eprintln!("softverbs-soak side {}: churn cycle {churned}: {e}", s.id);
                    }
                }
                churned += 1;
                next_churn = now + churn_every;
            }
            if now >= next_sample {
                samples.push(sample(start)?);
                next_sample = now + every;
            }
            if got == 0 {
                std::thread::yield_now();
            }
        }
        samples.push(sample(start)?);
        // Every request posted completes (RC waits for its acknowledgements, bounded by the
        // retry budget); the receives go on until the parent says both sides are done.
        let drain_until = Instant::now() + Duration::from_secs(120);
        while (self.st.iter().any(|st| st.done < st.next) || self.ctl_done < self.ctl_next)
            && Instant::now() < drain_until
        {
            if self.send_completions(s) + self.recv_completions(s) == 0 {
                std::thread::yield_now();
            }
        }
        let outstanding: u64 =
            self.st.iter().map(|st| st.next - st.done).sum::<u64>() + (self.ctl_next - self.ctl_done);
        if outstanding > 0 {
            s.error(format!("{outstanding} requests never completed"));
            for (q, st) in self.st.iter().enumerate() {
                if st.done < st.next {
                    let (qp, t) = (&s.qps[q], kind(&s.l, q));
                    eprintln!(
                        "softverbs-soak side {}: {t:?} QP {q} ({:#x}, {:?}): requests {}..{} outstanding, {:?}",
                        s.id,
                        qp.qp_num(),
                        qp.state(),
                        st.done,
                        st.next,
                        qp.counters()
                    );
                }
            }
        }
        say("DRAINED");
        loop {
            match cmds.try_recv() {
                Ok(c) if c == "FINAL" => break,
                Ok(c) => bail!("unexpected command {c:?}"),
                Err(_) => {
                    if self.recv_completions(s) == 0 {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            }
        }
        // The last UC and UD messages may still be on the way.
        let quiet_from = Instant::now();
        while quiet_from.elapsed() < Duration::from_millis(500) {
            if self.recv_completions(s) == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let mut rc = (0u64, 0u64, 0u64);
        for (q, qp) in s.qps.iter().enumerate() {
            if kind(&s.l, q) == QpType::Rc {
                let c = qp.counters();
                rc.0 += c.retransmits;
                rc.1 += c.timeouts;
                rc.2 += c.rnr_naks_received;
            }
        }
        let mut line = format!(
            "RESULT errors={} churned={churned} churn_errors={churn_errors} retransmits={} timeouts={} wall={} \
             credits={}",
            s.errors,
            rc.0,
            rc.1,
            run_start.elapsed().as_secs_f64(),
            self.ctl_done
        );
        line += &format!(" rnr_naks={}", rc.2);
        for (k, t) in &self.tally {
            line += &format!(
                " {k}_posted={} {k}_completed={} {k}_bytes={} {k}_to_receive={} {k}_received={} {k}_checked={}",
                t.posted, t.completed, t.bytes, t.to_receive, t.received, t.checked
            );
        }
        let c = s.ctx.counters();
        line += &format!(" rx_dropped={} rx_packets={}", c.rx_dropped, c.rx_packets);
        let body: Vec<String> = samples
            .iter()
            .map(|(t, r, f, th)| format!("{t:.1}:{r}:{f}:{th}"))
            .collect();
        // One line: the parent reads one answer per side at a time.
        say(&format!("{line} samples={}", body.join(",")));
        expect(cmds, "EXIT")?;
        // Everything is destroyed, with the peer still there.
        let t0 = Instant::now();
        drop(self);
        let Side {
            qps,
            mr,
            scq,
            rcq,
            pd,
            ctx,
            ..
        } = side;
        drop((qps, mr, scq, rcq, pd, ctx));
        say(&format!("BYE {}", t0.elapsed().as_secs_f64()));
        Ok(())
    }
}

/// Whether request `k` of transport `t` consumes a receive at the peer.
fn consumes(t: QpType, k: u64) -> bool {
    matches!(op_of(t, k).0, Op::Send | Op::SendImm | Op::WriteImm)
}

/// One cycle of object churn: a PD, an MR of a size that varies, a CQ, and by turns two RC QPs
/// connected to each other (a WRITE between them, checked), a UD QP and an AH (a datagram to
/// itself, checked), or a UC QP left in INIT; all destroyed again.
fn churn(s: &Side, n: u64) -> Result<()> {
    let pd = s.ctx.alloc_pd()?;
    let len = 4096usize << (n % 6);
    let all = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let mr = pd.register(len, all)?;
    let cq = s.ctx.create_cq(16, None, 0)?;
    let wait = |cq: &CompletionQueue, k: usize| -> Result<Vec<WorkCompletion>> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut got = Vec::new();
        let mut wc = [WorkCompletion::default(); 4];
        while got.len() < k {
            if Instant::now() > deadline {
                bail!("churn: {} of {k} completions within 30 s", got.len());
            }
            let m = cq.poll(&mut wc);
            got.extend_from_slice(&wc[..m]);
        }
        Ok(got)
    };
    match n % 3 {
        0 => {
            let a = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
            let b = pd.create_qp(&QpInit::new(QpType::Rc, &cq))?;
            connect_qp(&a, s.gid_index, s.gid, b.qp_num(), Mtu::Mtu1024, 16)?;
            connect_qp(&b, s.gid_index, s.gid, a.qp_num(), Mtu::Mtu1024, 16)?;
            let bytes = content(s.id, 0, n, 256);
            mr.write(0, &bytes)?;
            let write = SendOp::Write {
                remote: mr.remote(len / 2),
                imm: None,
            };
            a.post_send(&[signaled(1, write, mr.sge(0..256)?, None)])?;
            let c = wait(&cq, 1)?;
            let mut got = vec![0u8; 256];
            mr.read(len / 2, &mut got)?;
            if c[0].status != WcStatus::Success || got != bytes {
                bail!("churn: the WRITE between two new QPs failed: {:?}", c[0].status);
            }
            drop(a);
            drop(b);
        }
        1 => {
            let mut init = QpInit::new(QpType::Ud, &cq);
            init.cap.max_recv_wr = 1;
            let qp = pd.create_qp(&init)?;
            ud_to_rts(&qp, 0)?;
            let ah = pd.create_ah(&ah_attr(s.gid, s.gid_index))?;
            qp.post_recv(&[RecvWr {
                wr_id: 2,
                sg_list: vec![mr.sge(1024..1024 + 40 + 64)?],
            }])?;
            let bytes = content(s.id, 1, n, 64);
            mr.write(0, &bytes)?;
            let send = SendOp::Send {
                imm: None,
                invalidate: None,
            };
            let to = ah.ud_address(qp.qp_num(), QKEY);
            qp.post_send(&[signaled(1, send, mr.sge(0..64)?, Some(to))])?;
            let c = wait(&cq, 2)?;
            let mut got = vec![0u8; 64];
            mr.read(1024 + 40, &mut got)?;
            if c.iter().any(|w| w.status != WcStatus::Success) || got != bytes {
                bail!("churn: a datagram to itself failed: {c:?}");
            }
            drop(ah);
            drop(qp);
        }
        _ => {
            let ch = s.ctx.create_comp_channel()?;
            let cq2 = s.ctx.create_cq(8, Some(&ch), 0)?;
            let mut init = QpInit::new(QpType::Uc, &cq);
            init.recv_cq = &cq2;
            let qp = pd.create_qp(&init)?;
            qp.modify(
                &QpAttr {
                    qp_state: QpState::Init,
                    port_num: 1,
                    qp_access_flags: AccessFlags::REMOTE_WRITE,
                    ..Default::default()
                },
                QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
            )?;
            drop(qp);
            drop(cq2);
            drop(ch);
        }
    }
    drop(cq);
    drop(mr);
    drop(pd);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The parent

fn pairs(s: &str) -> BTreeMap<String, f64> {
    s.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

fn parent(args: &SoakArgs) -> Result<Vec<Figure>> {
    let exe = std::env::current_exe()?;
    let deadline = Instant::now() + Duration::from_secs_f64(args.duration) + Duration::from_secs(900);
    let mut env: Vec<(String, String)> = Vec::new();
    if args.netns.is_empty() && std::env::var_os("SOFTVERBS_UDP_PORT").is_none() {
        // Both on this host: a private range of ports, so that the run meets no other.
        env.push(("SOFTVERBS_UDP_PORT".into(), procs::free_base_port(3)?.to_string()));
    }
    let cmds = (0..2u8).map(|id| {
        let mut cmd = match args.netns.get(usize::from(id)) {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        cmd.args([
            "--role",
            &id.to_string(),
            "--duration",
            &args.duration.to_string(),
            "--qps",
            &args.qps.to_string(),
            "--size",
            &args.size.to_string(),
            "--depth",
            &args.depth.to_string(),
            "--sample",
            &args.sample.to_string(),
            "--churn-ms",
            &args.churn_ms.to_string(),
            "--ack-timeout",
            &args.ack_timeout.to_string(),
            "--device",
            &args.device,
            "--transports",
            &args.transports.join(","),
        ]);
        if let Some(w) = args.warmup {
            cmd.args(["--warmup", &w.to_string()]);
        }
        if let Some(ifname) = args.interfaces.get(usize::from(id)) {
            cmd.args(["--interfaces", &args.interfaces.join(",")]);
            cmd.env("SOFTVERBS_INTERFACES", ifname);
        }
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        cmd
    });
    let mut ch = Children::spawn(cmds, deadline)?;
    let eps = ch.gather("EP")?;
    ch.send(0, &format!("PEER {}", eps[1]))?;
    ch.send(1, &format!("PEER {}", eps[0]))?;
    ch.gather("READY")?;
    ch.send_all("GO")?;
    ch.gather("DRAINED")?;
    ch.send_all("FINAL")?;
    let lines = ch.gather("RESULT")?;
    let results: Vec<BTreeMap<String, f64>> = lines.iter().map(|r| pairs(r)).collect();
    let samples: Vec<Vec<Sample>> = lines
        .iter()
        .map(|l| {
            let list = l
                .split_whitespace()
                .find_map(|w| w.strip_prefix("samples="))
                .unwrap_or("");
            list.split(',')
                .filter_map(|s| {
                    let v: Vec<f64> = s.split(':').filter_map(|x| x.parse().ok()).collect();
                    (v.len() == 4).then(|| (v[0], v[1], v[2], v[3]))
                })
                .collect()
        })
        .collect();
    ch.send_all("EXIT")?;
    let byes = ch.gather("BYE")?;
    let teardown: Vec<f64> = byes.iter().map(|b| b.parse().unwrap_or(f64::NAN)).collect();
    drop(ch);
    evaluate(args, &results, &samples, &teardown)
}

/// The checks and the figures of a run.
fn evaluate(
    args: &SoakArgs,
    results: &[BTreeMap<String, f64>],
    samples: &[Vec<Sample>],
    teardown: &[f64],
) -> Result<Vec<Figure>> {
    let get = |i: usize, k: &str| results[i].get(k).copied().unwrap_or(f64::NAN);
    let mut failures = Vec::new();
    let mut figs = Vec::new();
    let fig = |name: String, value: f64, unit: &'static str| Figure {
        name: name.into(),
        value,
        unit,
    };
    let wall = get(0, "wall").max(get(1, "wall"));
    figs.push(fig("duration_s".into(), wall, "s"));
    let mut ops = 0.0;
    let mut bytes = 0.0;
    for i in 0..2 {
        for k in ["errors", "churn_errors"] {
            if get(i, k) != 0.0 {
                failures.push(format!("side {i}: {k} {}", get(i, k)));
            }
        }
    }
    for t in ["rc", "uc", "ud"] {
        let mut sent = 0.0;
        let mut received = 0.0;
        for i in 0..2 {
            let (posted, completed) = (get(i, &format!("{t}_posted")), get(i, &format!("{t}_completed")));
            if posted != completed {
                failures.push(format!("side {i}: {t} {posted} posted, {completed} completed"));
            }
            ops += completed;
            bytes += get(i, &format!("{t}_bytes"));
            let to = get(i, &format!("{t}_to_receive"));
            let got = get(1 - i, &format!("{t}_received"));
            if t == "rc" && to != got {
                failures.push(format!(
                    "RC: side {i} sent {to} messages to receive, side {} got {got}",
                    1 - i
                ));
            }
            if got > to {
                failures.push(format!("{t}: side {} received {got} of {to} sent", 1 - i));
            }
            sent += to;
            received += got;
        }
        figs.push(fig(
            format!("{t}_requests"),
            get(0, &format!("{t}_completed")) + get(1, &format!("{t}_completed")),
            "",
        ));
        figs.push(fig(format!("{t}_messages_sent"), sent, ""));
        figs.push(fig(format!("{t}_messages_received"), received, ""));
        if t != "rc" {
            figs.push(fig(
                format!("{t}_delivered"),
                if sent > 0.0 { received / sent } else { f64::NAN },
                "",
            ));
        }
    }
    let checked = get(0, "rc_checked") + get(1, "rc_checked");
    figs.push(fig("rc_reads_and_atomics_checked".into(), checked, ""));
    figs.push(fig("requests_per_s".into(), ops / wall, "/s"));
    figs.push(fig("throughput".into(), bytes * 8.0 / wall / 1e9, "Gbit/s"));
    for (name, key) in [
        ("rc_retransmits", "retransmits"),
        ("rc_timeouts", "timeouts"),
        ("rc_rnr_naks", "rnr_naks"),
        ("credit_writes", "credits"),
        ("churn_cycles", "churned"),
    ] {
        figs.push(fig(name.into(), get(0, key) + get(1, key), ""));
    }
    if args.churn_ms > 0 && get(0, "churned").min(get(1, "churned")) < 1.0 {
        failures.push("no churn cycle ran".into());
    }
    for (i, s) in samples.iter().enumerate() {
        let (Some(first), Some(last)) = (s.first(), s.last()) else {
            failures.push(format!("side {i}: no samples"));
            continue;
        };
        figs.push(fig(format!("side{i}_samples"), s.len() as f64, ""));
        figs.push(fig(format!("side{i}_rss_first"), first.1, "B"));
        figs.push(fig(format!("side{i}_rss_last"), last.1, "B"));
        figs.push(fig(
            format!("side{i}_rss_max"),
            s.iter().map(|x| x.1).fold(0.0, f64::max),
            "B",
        ));
        let (early, late) = fd_floors(s);
        figs.push(fig(format!("side{i}_fds_first"), first.2, ""));
        figs.push(fig(format!("side{i}_fds_last"), last.2, ""));
        figs.push(fig(format!("side{i}_fds_floor_early"), early, ""));
        figs.push(fig(format!("side{i}_fds_floor_late"), late, ""));
        figs.push(fig(format!("side{i}_threads_first"), first.3, ""));
        figs.push(fig(format!("side{i}_threads_last"), last.3, ""));
        if last.1 - first.1 > args.max_rss_growth as f64 {
            failures.push(format!("side {i}: RSS grew from {} to {} bytes", first.1, last.1));
        }
        if late - early > args.max_fd_growth as f64 {
            failures.push(format!(
                "side {i}: descriptors grew from {early} to {late} (fewest open per half of the run)"
            ));
        }
        if last.3 > first.3 {
            failures.push(format!("side {i}: threads grew from {} to {}", first.3, last.3));
        }
        figs.push(fig(format!("side{i}_teardown_s"), teardown[i], "s"));
    }
    if !failures.is_empty() {
        print_figures(&figs, args.json);
        bail!("{}", failures.join("; "));
    }
    Ok(figs)
}

/// The fewest descriptors open in the earlier and in the later half of a side's samples (the
/// middle sample of an odd count belongs to both).
fn fd_floors(s: &[Sample]) -> (f64, f64) {
    let floor = |part: &[Sample]| part.iter().map(|x| x.2).fold(f64::INFINITY, f64::min);
    let half = s.len().div_ceil(2);
    (floor(&s[..half]), floor(&s[s.len() - half..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contents_differ_by_side_qp_and_message() {
        let a = content(0, 1, 7, 100);
        assert!(check_content(&a, 0, 1, 7));
        assert!(!check_content(&a, 1, 1, 7));
        assert!(!check_content(&a, 0, 2, 7));
        assert!(!check_content(&a, 0, 1, 8));
        let mut b = a.clone();
        b[60] ^= 1;
        assert!(!check_content(&b, 0, 1, 7), "one wrong byte is caught");
        assert_eq!(&a[8..16], &7u64.to_le_bytes(), "the header names the message");
    }

    #[test]
    fn every_transport_cycles_through_its_operations() {
        assert_eq!(op_of(QpType::Rc, 3), (Op::Read, 0));
        assert_eq!(op_of(QpType::Rc, 7 + 2), (Op::Write, 1));
        assert_eq!(op_of(QpType::Uc, 7), (Op::WriteImm, 1));
        assert_eq!(op_of(QpType::Ud, 5), (Op::SendImm, 2));
        // A READ reads back what the WRITE before it wrote: the same slot.
        assert_eq!(op_of(QpType::Rc, 2).1, op_of(QpType::Rc, 3).1);
        assert!((0..1000).all(|s| (16..=64).contains(&msg_len(s, 64))));
    }

    fn result(rc_to: f64, rc_got: f64, errors: f64) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        for (k, v) in [
            ("wall", 10.0),
            ("errors", errors),
            ("churn_errors", 0.0),
            ("churned", 5.0),
            ("retransmits", 0.0),
            ("timeouts", 0.0),
        ] {
            m.insert(k.to_string(), v);
        }
        for t in ["rc", "uc", "ud"] {
            for (k, v) in [
                ("posted", 10.0),
                ("completed", 10.0),
                ("bytes", 100.0),
                ("checked", 0.0),
            ] {
                m.insert(format!("{t}_{k}"), v);
            }
            m.insert(format!("{t}_to_receive"), if t == "rc" { rc_to } else { 10.0 });
            m.insert(format!("{t}_received"), if t == "rc" { rc_got } else { 8.0 });
        }
        m
    }

    #[test]
    fn a_run_fails_on_a_lost_rc_message_an_error_or_a_leak() {
        let args = SoakArgs::parse_from(["softverbs-soak"]);
        let flat = vec![(1.0, 1e6, 10.0, 4.0), (2.0, 1e6, 10.0, 4.0)];
        let samples = vec![flat.clone(), flat.clone()];
        let run = |results: [BTreeMap<String, f64>; 2], samples: &[Vec<Sample>]| {
            evaluate(&args, &results, samples, &[0.0, 0.0])
        };
        let ok = run([result(5.0, 5.0, 0.0), result(5.0, 5.0, 0.0)], &samples);
        assert!(ok.is_ok(), "{:?}", ok.err());
        let lost = run([result(5.0, 5.0, 0.0), result(5.0, 4.0, 0.0)], &samples);
        assert!(lost.unwrap_err().message().contains("RC: side 0 sent 5"));
        let err = run([result(5.0, 5.0, 1.0), result(5.0, 5.0, 0.0)], &samples);
        assert!(err.unwrap_err().message().contains("errors"));
        let leaky = vec![flat.clone(), vec![(1.0, 1e6, 10.0, 4.0), (2.0, 1e6, 11.0, 4.0)]];
        let fds = run([result(5.0, 5.0, 0.0), result(5.0, 5.0, 0.0)], &leaky);
        assert!(fds.unwrap_err().message().contains("descriptors grew"));
        // A descriptor held by churn at one sample is not a leak; one held ever after is.
        let at = |fds: [f64; 4]| {
            fds.iter()
                .enumerate()
                .map(|(t, &f)| (t as f64, 1e6, f, 4.0))
                .collect()
        };
        let transient = vec![at([11.0, 10.0, 10.0, 10.0]), at([10.0, 10.0, 11.0, 10.0])];
        let ok = run([result(5.0, 5.0, 0.0), result(5.0, 5.0, 0.0)], &transient);
        assert!(ok.is_ok(), "{:?}", ok.err());
        let held = vec![flat.clone(), at([10.0, 11.0, 11.0, 11.0])];
        let fds = run([result(5.0, 5.0, 0.0), result(5.0, 5.0, 0.0)], &held);
        assert!(fds.unwrap_err().message().contains("descriptors grew"));
    }
}
