//! The ping-pong tests of rdma-core (`ibv_rc_pingpong`, `ibv_uc_pingpong`, `ibv_ud_pingpong`,
//! `ibv_srq_pingpong`) on the safe softverbs API, wire-compatible with the C programs.
//!
//! The flow follows rdma-core's examples:
//! 1. [`PingPong::new`] creates the resources, moves the QPs to INIT, posts `rx_depth` receives
//!    and picks a random 24-bit PSN per QP.
//! 2. [`PingPong::run`] exchanges addresses over the given stream. Each address travels as the
//!    ASCII text `LLLL:QQQQQQ:PPPPPP:GGGG...` (hex LID, QPN, PSN and the 16 GID bytes as 32 hex
//!    digits) plus a NUL: [`WIRE_LEN`] bytes. The client sends first; the server reads, connects
//!    its QPs, answers, and waits for the client's `"done"` (5 bytes with the NUL). SRQ mode
//!    always sends [`SRQ_WIRE_COUNT`] addresses each way, zero-filled past `num_qp`, as the C
//!    program does.
//! 3. The client sends first; each side sends its next message once its previous send and the
//!    peer's answer have completed, until `iters` sends and receives are done. Then the summary
//!    is printed and, with `check`, the server verifies the received bytes.
//!
//! `ibv_rc_pingpong`'s buffer options change only where the buffer lives, never the wire: an
//! on-demand-paging region (`-o`), host memory reached through an implicit ODP region (`-O`),
//! either prefetched with `ibv_advise_mr` (`-P`), or device memory (`-j`) that the client
//! fills by copying its buffer in and the server copies out before checking. With `-t` the CQ
//! records completion timestamps and each side prints the spread of the gaps between its
//! receive completions, in device clock cycles, after the summary.
//!
//! The data check is rdma-core's: the client writes 0 at the start of every page of its buffer
//! and the server, whose buffer starts filled with `0x7b`, checks those bytes. That is all the C
//! client writes, so a stricter check would reject a C peer.

use std::io::{Read, Write};
use std::net::Ipv6Addr;
use std::time::{Duration, Instant};

use softverbs::{
    odp, AccessFlags, AddressHandle, AhAttr, CompletionChannel, CompletionQueue, Context, DeviceMemory,
    Error, Gid, GlobalRoute, HostBuffer, ImplicitOdpRegion, MemoryRegion, Mtu, Payload, PortAttr,
    ProtectionDomain, QpAttr, QpAttrMask, QpCap, QpInit, QpState, QpType, QueuePair, RecvWr, SendFlags,
    SendOp, SendRequest, Sge, SharedReceiveQueue, SrqAttr, Timestamps, WcStatus, WorkCompletion,
};

use crate::{OrFail, ToolError};

/// The TCP port the server listens on by default.
pub const DEFAULT_TCP_PORT: u16 = 18515;
/// Bytes of one address message: `"%04x:%06x:%06x:%s"` with a 32-digit GID, plus the NUL.
pub const WIRE_LEN: usize = 4 + 1 + 6 + 1 + 6 + 1 + 32 + 1;
/// Addresses each side of `ibv_srq_pingpong` sends, whatever the number of QPs in use.
pub const SRQ_WIRE_COUNT: usize = 256;
/// The handshake that ends the exchange, NUL included.
pub const DONE: &[u8; 5] = b"done\0";
/// Page size of the data check (the C programs use the host's; Linux on x86-64 and most arm64
/// systems use 4 KiB, and both sides must agree).
pub const CHECK_PAGE_SIZE: usize = 4096;
/// Room for the GRH that precedes every UD receive.
pub const UD_GRH_LEN: usize = 40;
/// The Q_Key of `ibv_ud_pingpong`.
pub const UD_QKEY: u32 = 0x1111_1111;

const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;
/// Initial buffer contents, as the C programs fill it, so the check can tell received bytes.
const FILL: u8 = 0x7b;

/// Which of the four ping-pong programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// `ibv_rc_pingpong`: one RC QP.
    Rc,
    /// `ibv_uc_pingpong`: one UC QP.
    Uc,
    /// `ibv_ud_pingpong`: one UD QP and an address handle.
    Ud,
    /// `ibv_srq_pingpong`: `num_qp` RC QPs receiving from one SRQ.
    Srq,
}

impl Transport {
    fn qp_type(self) -> QpType {
        match self {
            Self::Rc | Self::Srq => QpType::Rc,
            Self::Uc => QpType::Uc,
            Self::Ud => QpType::Ud,
        }
    }

    /// The program name, e.g. `ibv_rc_pingpong`.
    pub fn tool_name(self) -> &'static str {
        match self {
            Self::Rc => "ibv_rc_pingpong",
            Self::Uc => "ibv_uc_pingpong",
            Self::Ud => "ibv_ud_pingpong",
            Self::Srq => "ibv_srq_pingpong",
        }
    }

    /// The default message size of the C program.
    pub fn default_size(self) -> usize {
        match self {
            Self::Ud => 1024,
            _ => 4096,
        }
    }
}

/// Which end of the TCP exchange this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Listens, answers the client's address, receives first.
    Server,
    /// Connects to the server, sends first.
    Client,
}

/// One QP's address as the peers exchange it (`struct pingpong_dest`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dest {
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// QP number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// GID.
    pub gid: Gid,
}

impl Dest {
    /// An all-zero address, as the C program sends for unused SRQ slots.
    pub const ZERO: Self = Self {
        lid: 0,
        qpn: 0,
        psn: 0,
        gid: Gid::ZERO,
    };

    /// The wire message: `"%04x:%06x:%06x:<32 hex GID digits>"` and a NUL.
    pub fn to_wire(&self) -> [u8; WIRE_LEN] {
        let gid: String = self.gid.0.iter().map(|b| format!("{b:02x}")).collect();
        let text = format!(
            "{:04x}:{:06x}:{:06x}:{gid}",
            self.lid,
            self.qpn & 0xff_ffff,
            self.psn & 0xff_ffff
        );
        debug_assert_eq!(text.len(), WIRE_LEN - 1);
        let mut msg = [0u8; WIRE_LEN];
        msg[..text.len()].copy_from_slice(text.as_bytes());
        msg
    }

    /// Parses a wire message (text up to the first NUL).
    pub fn from_wire(msg: &[u8]) -> Result<Self, ToolError> {
        let (v, gid) = parse_wire(msg, &[0xffff, 0xff_ffff, 0xff_ffff])?;
        Ok(Self {
            lid: v[0] as u16,
            qpn: v[1],
            psn: v[2],
            gid,
        })
    }

    /// The GID as `inet_ntop(AF_INET6)` writes it, e.g. `::ffff:127.0.0.1`.
    pub fn gid_text(&self) -> String {
        Ipv6Addr::from(self.gid.0).to_string()
    }

    /// The line the programs print for an address; `label` is `local` or `remote`.
    fn line(&self, label: &str, transport: Transport) -> String {
        let pad = if label == "local" { "  " } else { " " };
        // ibv_ud_pingpong has a colon before "GID" in its local line; keep the format identical.
        let sep = if transport == Transport::Ud && label == "local" {
            ":"
        } else {
            ","
        };
        format!(
            "  {label} address:{pad}LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}{sep} GID {}",
            self.lid,
            self.qpn,
            self.psn,
            self.gid_text()
        )
    }
}

/// What a run does: the command-line options of the C programs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Which program.
    pub transport: Transport,
    /// Port of the device (`-i`).
    pub ib_port: u8,
    /// Message size in bytes (`-s`).
    pub size: usize,
    /// Path MTU (`-m`; unused by UD).
    pub mtu: Mtu,
    /// Receives kept posted (`-r`).
    pub rx_depth: u32,
    /// Messages each way (`-n`).
    pub iters: u32,
    /// Service level (`-l`).
    pub sl: u8,
    /// Sleep on completion events instead of busy polling (`-e`).
    pub use_events: bool,
    /// Local GID index (`-g`); `None` picks one, since a RoCE path always needs a GID.
    pub gid_index: Option<i32>,
    /// Check the received data on the server (`-c`).
    pub check: bool,
    /// QPs sharing the SRQ (`-q`, SRQ only).
    pub num_qp: u32,
    /// Give up when no completion arrives for this long (`None`: wait forever, as the C programs).
    pub timeout: Option<Duration>,
    /// Register the buffer for on-demand paging (`-o`; RC and SRQ).
    pub odp: bool,
    /// Reach the buffer through an implicit on-demand-paging region over the whole address
    /// space (`-O`, RC; implies `odp`).
    pub implicit_odp: bool,
    /// Prefetch the buffer with `ibv_advise_mr` after registering it (`-P`, RC; needs `odp`).
    pub prefetch: bool,
    /// Completion timestamps, and the receive completion clock statistics (`-t`, RC).
    pub timestamps: bool,
    /// Keep the buffer in device memory (`-j`, RC).
    pub device_memory: bool,
}

impl Config {
    /// The C program's defaults: port 1, 4096 bytes (1024 for UD), MTU 1024, 500 receives,
    /// 1000 iterations, SL 0, polling, 16 QPs for SRQ.
    pub fn new(transport: Transport) -> Self {
        Self {
            transport,
            ib_port: 1,
            size: transport.default_size(),
            mtu: Mtu::Mtu1024,
            rx_depth: 500,
            iters: 1000,
            sl: 0,
            use_events: false,
            gid_index: None,
            check: false,
            num_qp: if transport == Transport::Srq { 16 } else { 1 },
            timeout: None,
            odp: false,
            implicit_odp: false,
            prefetch: false,
            timestamps: false,
            device_memory: false,
        }
    }

    /// Whether the buffer is registered for on-demand paging (`-o`, or `-O` which implies it).
    fn on_demand(&self) -> bool {
        self.odp || self.implicit_odp
    }

    fn validate(&self) -> Result<(), ToolError> {
        // rdma-core's consistency checks, with its messages.
        if self.on_demand() && self.device_memory {
            return Err(ToolError::new("DM memory region can't be on demand"));
        }
        if self.prefetch && !self.on_demand() {
            return Err(ToolError::new(
                "prefetch is valid only with on-demand memory region",
            ));
        }
        let rc_only = [
            (self.implicit_odp, "implicit on-demand paging"),
            (self.prefetch, "prefetch"),
            (self.timestamps, "completion timestamps"),
            (self.device_memory, "device memory"),
        ];
        for (on, what) in rc_only {
            if on && self.transport != Transport::Rc {
                return Err(ToolError::new(format!("only ibv_rc_pingpong offers {what}")));
            }
        }
        if self.odp && !matches!(self.transport, Transport::Rc | Transport::Srq) {
            return Err(ToolError::new(
                "only ibv_rc_pingpong and ibv_srq_pingpong offer on-demand paging",
            ));
        }
        if self.size == 0 {
            return Err(ToolError::new("the message size must be at least 1 byte"));
        }
        if u32::try_from(self.size + UD_GRH_LEN).is_err() {
            return Err(ToolError::new(format!("message size {} is too large", self.size)));
        }
        if self.rx_depth == 0 {
            return Err(ToolError::new("rx-depth must be at least 1"));
        }
        if self.transport == Transport::Srq {
            if self.num_qp == 0 {
                return Err(ToolError::new("num-qp must be at least 1"));
            }
            if self.num_qp > self.rx_depth {
                return Err(ToolError::new(format!(
                    "rx-depth {} is too small for {} QPs: each QP needs at least one receive",
                    self.rx_depth, self.num_qp
                )));
            }
            if self.num_qp as usize >= SRQ_WIRE_COUNT {
                return Err(ToolError::new(format!(
                    "num-qp {} must be below {SRQ_WIRE_COUNT}",
                    self.num_qp
                )));
            }
        } else if self.num_qp != 1 {
            return Err(ToolError::new("only ibv_srq_pingpong uses more than one QP"));
        }
        Ok(())
    }
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct Report {
    /// Bytes counted as rdma-core counts them: `size * iters * 2`.
    pub bytes: u64,
    /// Time from the first send to the last completion needed.
    pub elapsed: Duration,
    /// Iterations asked for.
    pub iters: u32,
    /// Send completions seen.
    pub sends: u64,
    /// Receive completions seen.
    pub recvs: u64,
    /// Completion events taken (with `use_events`).
    pub cq_events: u64,
    /// Whether this side checked the data (the server with `check`).
    pub checked: bool,
    /// Pages whose check byte was wrong (empty if unchecked or all good).
    pub invalid_pages: Vec<usize>,
    /// This side's addresses.
    pub local: Vec<Dest>,
    /// The peer's addresses (one per QP in use).
    pub remote: Vec<Dest>,
    /// The receive completion clock statistics (with `timestamps`; `None` without, or with
    /// fewer than two receives).
    pub recv_clock: Option<RecvClock>,
}

/// Clock cycles between consecutive receive completions, from their completion timestamps
/// (`ibv_rc_pingpong -t`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecvClock {
    /// The longest gap.
    pub max: u64,
    /// The shortest gap (rdma-core starts it at `0xffffffff`, so longer gaps leave that).
    pub min: u64,
    /// The sum of the gaps.
    pub total: u64,
    /// How many gaps were measured.
    pub samples: u32,
}

impl RecvClock {
    /// The three lines rdma-core prints after the summary (without a final newline).
    pub fn lines(&self) -> String {
        format!(
            "Max receive completion clock cycles = {}\nMin receive completion clock cycles = {}\nAverage receive completion clock cycles = {:.6}",
            self.max,
            self.min,
            self.total as f64 / f64::from(self.samples)
        )
    }
}

/// Folds receive completion timestamps into [`RecvClock`] as rdma-core does.
#[derive(Debug, Clone, Copy)]
struct RecvClockMeter {
    /// `completion_timestamp_mask`: where the clock wraps.
    mask: u64,
    prev: Option<u64>,
    clock: RecvClock,
}

impl RecvClockMeter {
    fn new(mask: u64) -> Self {
        Self {
            mask,
            prev: None,
            clock: RecvClock {
                max: 0,
                min: 0xffff_ffff,
                total: 0,
                samples: 0,
            },
        }
    }

    fn record(&mut self, ts: u64) {
        if let Some(prev) = self.prev {
            // The clock may have wrapped at the mask since the previous completion.
            let delta = if ts >= prev {
                ts - prev
            } else {
                (self.mask - prev).wrapping_add(ts).wrapping_add(1)
            };
            let c = &mut self.clock;
            c.max = c.max.max(delta);
            c.min = c.min.min(delta);
            c.total = c.total.wrapping_add(delta);
            c.samples += 1;
        }
        self.prev = Some(ts);
    }

    fn result(&self) -> Option<RecvClock> {
        (self.clock.samples > 0).then_some(self.clock)
    }
}

/// The send/receive buffer: where it lives and how work requests name it.
#[derive(Debug)]
enum Buffer {
    /// Registered memory (`ibv_reg_mr`, on demand with `-o`).
    Mr(MemoryRegion),
    /// Device memory (`-j`), registered zero based. The program fills and checks `host` and
    /// copies it to and from the device, as rdma-core does.
    Device {
        mr: MemoryRegion,
        dm: DeviceMemory,
        host: Vec<u8>,
    },
    /// Host memory reached through an implicit on-demand-paging region (`-O`).
    Implicit {
        region: ImplicitOdpRegion,
        buf: HostBuffer,
    },
}

impl Buffer {
    fn len(&self) -> usize {
        match self {
            Self::Mr(mr) => mr.len(),
            Self::Device { mr, .. } => mr.len(),
            Self::Implicit { buf, .. } => buf.len(),
        }
    }

    fn sge(&self, range: std::ops::Range<usize>) -> softverbs::Result<Sge> {
        match self {
            Self::Mr(mr) | Self::Device { mr, .. } => mr.sge(range),
            Self::Implicit { region, buf } => region.sge(buf, range),
        }
    }

    /// Writes `bytes` at `offset` of what the program sees (the host copy for device memory).
    fn write(&mut self, offset: usize, bytes: &[u8]) -> softverbs::Result<()> {
        match self {
            Self::Mr(mr) => mr.write(offset, bytes),
            Self::Device { host, .. } => {
                host[offset..offset + bytes.len()].copy_from_slice(bytes);
                Ok(())
            }
            Self::Implicit { buf, .. } => buf.write(offset, bytes),
        }
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> softverbs::Result<()> {
        match self {
            Self::Mr(mr) => mr.read(offset, dst),
            Self::Device { host, .. } => {
                dst.copy_from_slice(&host[offset..offset + dst.len()]);
                Ok(())
            }
            Self::Implicit { buf, .. } => buf.read(offset, dst),
        }
    }
}

impl Report {
    /// The two summary lines of the C programs (without a final newline):
    /// `<bytes> bytes in <s> seconds = <Mbit/s> Mbit/sec` and
    /// `<iters> iters in <s> seconds = <us> usec/iter`.
    pub fn summary(&self) -> String {
        // The C programs measure whole microseconds with gettimeofday.
        let usec = self.elapsed.as_micros() as f64;
        format!(
            "{} bytes in {:.2} seconds = {:.2} Mbit/sec\n{} iters in {:.2} seconds = {:.2} usec/iter",
            self.bytes,
            usec / 1e6,
            self.bytes as f64 * 8.0 / usec,
            self.iters,
            usec / 1e6,
            usec / f64::from(self.iters)
        )
    }
}

/// Parses the address message the rdma-core pingpong programs exchange: text up to the first
/// NUL, hexadecimal fields separated by `:`, each at most its entry of `maxes`, then the GID as
/// 32 hexadecimal digits.
pub(crate) fn parse_wire(msg: &[u8], maxes: &[u32]) -> Result<(Vec<u32>, Gid), ToolError> {
    let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
    let bad = || {
        ToolError::new(format!(
            "malformed address message {:?}",
            String::from_utf8_lossy(&msg[..end])
        ))
    };
    let text = std::str::from_utf8(&msg[..end]).map_err(|_| bad())?;
    let fields: Vec<&str> = text.splitn(maxes.len() + 1, ':').collect();
    if fields.len() != maxes.len() + 1 {
        return Err(bad());
    }
    let values = fields
        .iter()
        .zip(maxes)
        .map(|(f, &max)| {
            u32::from_str_radix(f, 16)
                .ok()
                .filter(|v| *v <= max)
                .ok_or_else(bad)
        })
        .collect::<Result<Vec<u32>, ToolError>>()?;
    let g = fields[maxes.len()];
    if g.len() != 32 || !g.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    let mut gid = [0u8; 16];
    for (i, b) in gid.iter_mut().enumerate() {
        *b = u8::from_str_radix(&g[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok((values, Gid(gid)))
}

/// One side of a ping-pong: every verbs object it uses, created and in INIT with receives posted.
#[derive(Debug)]
pub struct PingPong {
    // Fields drop in declaration order, and the order matters: the QPs must go before the MR,
    // as in the C programs' teardown: a live QP whose receive buffer was already deregistered
    // would NAK a late packet of the peer and fail its run.
    qps: Vec<QueuePair>,
    ah: Option<AddressHandle>,
    srq: Option<SharedReceiveQueue>,
    cq: CompletionQueue,
    channel: Option<CompletionChannel>,
    buf: Buffer,
    pd: ProtectionDomain,
    ctx: Context,
    cfg: Config,
    /// `completion_timestamp_mask`, with `timestamps`.
    ts_mask: Option<u64>,
    port: PortAttr,
    sgid_index: u8,
    local: Vec<Dest>,
    routs: u32,
}

impl PingPong {
    /// Creates the resources on `ctx` as the C program's `pp_init_ctx` does, posts `rx_depth`
    /// receives, arms the CQ when using events and chooses this side's addresses.
    pub fn new(ctx: &Context, cfg: Config) -> Result<Self, ToolError> {
        cfg.validate()?;
        let t = cfg.transport;
        let port = ctx
            .query_port(cfg.ib_port)
            .or_fail(&format!("Couldn't query port {}", cfg.ib_port))?;
        if t == Transport::Ud && cfg.size > port.active_mtu.bytes() as usize {
            return Err(ToolError::new(format!(
                "Requested size {} is larger than the port MTU ({})",
                cfg.size,
                port.active_mtu.bytes()
            )));
        }
        let channel = if cfg.use_events {
            Some(
                ctx.create_comp_channel()
                    .or_fail("Couldn't create completion channel")?,
            )
        } else {
            None
        };
        let pd = ctx.alloc_pd().or_fail("Couldn't allocate PD")?;
        let ts_mask = check_device(ctx, &cfg)?;
        let buf = alloc_buffer(ctx, &pd, &cfg)?;
        let cqe = i32::try_from(cfg.rx_depth + if t == Transport::Srq { cfg.num_qp } else { 1 })
            .unwrap_or(i32::MAX);
        let cq = if ts_mask.is_some() {
            let ts = Timestamps {
                raw: true,
                wallclock: false,
            };
            ctx.create_cq_with_timestamps(cqe, channel.as_ref(), 0, ts)
        } else {
            ctx.create_cq(cqe, channel.as_ref(), 0)
        }
        .or_fail("Couldn't create CQ")?;
        let srq = if t == Transport::Srq {
            let attr = SrqAttr {
                max_wr: cfg.rx_depth,
                max_sge: 1,
                srq_limit: 0,
            };
            Some(pd.create_srq(&attr).or_fail("Couldn't create SRQ")?)
        } else {
            None
        };
        let mut qps = Vec::new();
        for i in 0..cfg.num_qp {
            let init = QpInit {
                qp_type: t.qp_type(),
                send_cq: &cq,
                recv_cq: &cq,
                srq: srq.as_ref(),
                cap: QpCap {
                    max_send_wr: 1,
                    max_recv_wr: if srq.is_some() { 0 } else { cfg.rx_depth },
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 0,
                },
                sq_sig_all: false,
            };
            qps.push(pd.create_qp(&init).or_fail(&format!("Couldn't create QP[{i}]"))?);
        }
        for (i, qp) in qps.iter().enumerate() {
            to_init(qp, &cfg).or_fail(&format!("Failed to modify QP[{i}] to INIT"))?;
        }
        let sgid_index = pick_gid(ctx, cfg.ib_port, cfg.gid_index)?;
        let gid = ctx
            .query_gid(cfg.ib_port, i32::from(sgid_index))
            .or_fail(&format!("Couldn't read the GID of index {sgid_index}"))?;
        let local = qps
            .iter()
            .map(|qp| Dest {
                lid: port.lid,
                qpn: qp.qp_num(),
                psn: random_psn(),
                gid,
            })
            .collect();
        let mut pp = Self {
            cfg,
            ctx: ctx.clone(),
            channel,
            pd,
            buf,
            ts_mask,
            cq,
            srq,
            qps,
            ah: None,
            port,
            sgid_index,
            local,
            routs: 0,
        };
        pp.routs = pp.post_recv(pp.cfg.rx_depth);
        if pp.routs < pp.cfg.rx_depth {
            return Err(ToolError::new(format!("Couldn't post receive ({})", pp.routs)));
        }
        if pp.channel.is_some() {
            pp.cq
                .req_notify(false)
                .or_fail("Couldn't request CQ notification")?;
        }
        Ok(pp)
    }

    /// This side's addresses, one per QP.
    pub fn local_dests(&self) -> &[Dest] {
        &self.local
    }

    /// The GID index this side uses.
    pub fn sgid_index(&self) -> u8 {
        self.sgid_index
    }

    /// Prints the `  local address: ...` lines.
    pub fn print_local(&self, out: &mut dyn Write) -> Result<(), ToolError> {
        for d in &self.local {
            writeln!(out, "{}", d.line("local", self.cfg.transport)).or_fail("write")?;
        }
        out.flush().or_fail("write")
    }

    /// Exchanges addresses over `stream` as `role`, connects, runs the ping-pong and prints the
    /// remote addresses, the summary and (server with `check`) any invalid pages to `out`.
    pub fn run<S: Read + Write>(
        mut self,
        role: Role,
        mut stream: S,
        out: &mut dyn Write,
    ) -> Result<Report, ToolError> {
        let remote = match role {
            Role::Client => {
                self.send_dests(&mut stream)?;
                let remote = self.read_dests(&mut stream)?;
                stream
                    .write_all(DONE)
                    .or_fail("Couldn't write the done message")?;
                stream.flush().or_fail("Couldn't write the done message")?;
                remote
            }
            Role::Server => {
                let remote = self.read_dests(&mut stream)?;
                self.connect(&remote)
                    .map_err(|e| ToolError::new(format!("Couldn't connect to remote QP: {e}")))?;
                self.send_dests(&mut stream)?;
                let mut done = [0u8; DONE.len()];
                stream
                    .read_exact(&mut done)
                    .or_fail("Couldn't read the done message")?;
                if &done != DONE {
                    return Err(ToolError::new(format!(
                        "expected \"done\" from the client, got {done:?}"
                    )));
                }
                remote
            }
        };
        drop(stream);
        for d in &remote {
            writeln!(out, "{}", d.line("remote", self.cfg.transport)).or_fail("write")?;
        }
        out.flush().or_fail("write")?;
        if role == Role::Client {
            self.connect(&remote)?;
        }
        let mut report = self.ping_pong(role, &remote)?;
        report.remote = remote;
        writeln!(out, "{}", report.summary()).or_fail("write")?;
        if let Some(c) = &report.recv_clock {
            writeln!(out, "{}", c.lines()).or_fail("write")?;
        }
        for page in &report.invalid_pages {
            writeln!(out, "invalid data in page {page}").or_fail("write")?;
        }
        out.flush().or_fail("write")?;
        Ok(report)
    }

    fn send_dests<S: Write>(&self, stream: &mut S) -> Result<(), ToolError> {
        let count = if self.cfg.transport == Transport::Srq {
            SRQ_WIRE_COUNT
        } else {
            1
        };
        let mut bytes = Vec::with_capacity(count * WIRE_LEN);
        for i in 0..count {
            bytes.extend_from_slice(&self.local.get(i).copied().unwrap_or(Dest::ZERO).to_wire());
        }
        stream.write_all(&bytes).or_fail("Couldn't send local address")?;
        stream.flush().or_fail("Couldn't send local address")
    }

    fn read_dests<S: Read>(&self, stream: &mut S) -> Result<Vec<Dest>, ToolError> {
        let count = if self.cfg.transport == Transport::Srq {
            SRQ_WIRE_COUNT
        } else {
            1
        };
        let mut dests = Vec::with_capacity(count);
        for i in 0..count {
            let mut msg = [0u8; WIRE_LEN];
            stream
                .read_exact(&mut msg)
                .or_fail(&format!("Couldn't read remote address [{i}]"))?;
            dests.push(Dest::from_wire(&msg)?);
        }
        dests.truncate(self.qps.len());
        Ok(dests)
    }

    /// Brings the QPs to RTS towards `remote` (`pp_connect_ctx`); for UD, creates the AH.
    fn connect(&mut self, remote: &[Dest]) -> Result<(), ToolError> {
        let cfg = &self.cfg;
        for (i, (qp, (me, dest))) in self.qps.iter().zip(self.local.iter().zip(remote)).enumerate() {
            if dest.gid.interface_id() == 0 {
                // The C programs fall back to a LID-routed path, which RoCE does not have.
                return Err(ToolError::new(format!(
                    "the peer's GID for QP[{i}] is zero; RoCE needs a GID: run the peer with -g <gid index>"
                )));
            }
            let av = AhAttr {
                grh: GlobalRoute {
                    dgid: dest.gid,
                    sgid_index: self.sgid_index,
                    hop_limit: 1,
                    ..Default::default()
                },
                dlid: dest.lid,
                sl: cfg.sl,
                src_path_bits: 0,
                static_rate: 0,
                is_global: true,
                port_num: cfg.ib_port,
            };
            match cfg.transport {
                Transport::Ud => {
                    modify(
                        qp,
                        QpAttr {
                            qp_state: QpState::Rtr,
                            ..Default::default()
                        },
                        QpAttrMask::STATE,
                        "RTR",
                    )?;
                    let rts = QpAttr {
                        qp_state: QpState::Rts,
                        sq_psn: me.psn,
                        ..Default::default()
                    };
                    modify(qp, rts, QpAttrMask::STATE | QpAttrMask::SQ_PSN, "RTS")?;
                    self.ah = Some(self.pd.create_ah(&av).or_fail("Failed to create AH")?);
                }
                Transport::Uc => {
                    let rtr = QpAttr {
                        qp_state: QpState::Rtr,
                        path_mtu: cfg.mtu,
                        dest_qp_num: dest.qpn,
                        rq_psn: dest.psn,
                        ah_attr: av,
                        ..Default::default()
                    };
                    let mask = QpAttrMask::STATE
                        | QpAttrMask::AV
                        | QpAttrMask::PATH_MTU
                        | QpAttrMask::DEST_QPN
                        | QpAttrMask::RQ_PSN;
                    modify(qp, rtr, mask, "RTR")?;
                    let rts = QpAttr {
                        qp_state: QpState::Rts,
                        sq_psn: me.psn,
                        ..Default::default()
                    };
                    modify(qp, rts, QpAttrMask::STATE | QpAttrMask::SQ_PSN, "RTS")?;
                }
                Transport::Rc | Transport::Srq => {
                    let rtr = QpAttr {
                        qp_state: QpState::Rtr,
                        path_mtu: cfg.mtu,
                        dest_qp_num: dest.qpn,
                        rq_psn: dest.psn,
                        max_dest_rd_atomic: 1,
                        min_rnr_timer: 12,
                        ah_attr: av,
                        ..Default::default()
                    };
                    let mask = QpAttrMask::STATE
                        | QpAttrMask::AV
                        | QpAttrMask::PATH_MTU
                        | QpAttrMask::DEST_QPN
                        | QpAttrMask::RQ_PSN
                        | QpAttrMask::MAX_DEST_RD_ATOMIC
                        | QpAttrMask::MIN_RNR_TIMER;
                    modify(qp, rtr, mask, "RTR")?;
                    let rts = QpAttr {
                        qp_state: QpState::Rts,
                        timeout: 14,
                        retry_cnt: 7,
                        rnr_retry: 7,
                        sq_psn: me.psn,
                        max_rd_atomic: 1,
                        ..Default::default()
                    };
                    let mask = QpAttrMask::STATE
                        | QpAttrMask::TIMEOUT
                        | QpAttrMask::RETRY_CNT
                        | QpAttrMask::RNR_RETRY
                        | QpAttrMask::SQ_PSN
                        | QpAttrMask::MAX_QP_RD_ATOMIC;
                    modify(qp, rts, mask, "RTS")?;
                }
            }
        }
        Ok(())
    }

    /// Offset of the message in the buffer (after the GRH room for UD).
    fn data_offset(&self) -> usize {
        if self.cfg.transport == Transport::Ud {
            UD_GRH_LEN
        } else {
            0
        }
    }

    /// Posts up to `n` receives (to the SRQ in SRQ mode); returns how many were posted.
    fn post_recv(&self, n: u32) -> u32 {
        if n == 0 {
            return 0;
        }
        // UD receives take the GRH too, so they cover the whole buffer.
        let Ok(sge) = self.buf.sge(0..self.buf.len()) else {
            return 0;
        };
        let wrs: Vec<RecvWr> = (0..n)
            .map(|_| RecvWr {
                wr_id: RECV_WRID,
                sg_list: vec![sge],
            })
            .collect();
        let r = match &self.srq {
            Some(srq) => srq.post_recv(&wrs),
            None => self.qps[0].post_recv(&wrs),
        };
        match r {
            Ok(()) => n,
            Err(e) => e.index as u32,
        }
    }

    fn post_send(&self, qp_index: usize, remote: &[Dest]) -> Result<(), ToolError> {
        let off = self.data_offset();
        let sge = self
            .buf
            .sge(off..off + self.cfg.size)
            .or_fail("Couldn't post send")?;
        let ud = self
            .ah
            .as_ref()
            .map(|ah| ah.ud_address(remote[qp_index].qpn, UD_QKEY));
        // The C programs send inline when the QP allows it; that changes nothing on the wire,
        // so the gather list is always used here.
        let wr = SendRequest {
            wr_id: SEND_WRID,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![sge]),
            ud,
            xrc_srqn: None,
        };
        self.qps[qp_index].post_send(&[wr]).or_fail("Couldn't post send")
    }

    /// The main loop (after both sides are connected).
    fn ping_pong(&mut self, role: Role, remote: &[Dest]) -> Result<Report, ToolError> {
        let iters = u64::from(self.cfg.iters);
        let off = self.data_offset();
        let nqp = self.qps.len();
        let mut pending = vec![RECV_WRID; nqp];
        if role == Role::Client {
            if self.cfg.check {
                for i in (0..self.cfg.size).step_by(CHECK_PAGE_SIZE) {
                    self.buf.write(off + i, &[0]).or_fail("write the check pattern")?;
                }
            }
            if let Buffer::Device { dm, host, .. } = &self.buf {
                dm.copy_to(0, host).or_fail("Copy to dm buffer failed")?;
            }
            for (i, p) in pending.iter_mut().enumerate() {
                self.post_send(i, remote)?;
                *p = RECV_WRID | SEND_WRID;
            }
        }
        // SRQ mode refills once no more than one receive per QP is left; the others at one.
        let refill_at = if self.cfg.transport == Transport::Srq {
            self.cfg.num_qp
        } else {
            1
        };
        let mut wc = vec![
            WorkCompletion::default();
            if nqp > 1 {
                nqp + self.cfg.rx_depth as usize
            } else {
                2
            }
        ];
        let (mut scnt, mut rcnt, mut cq_events) = (0u64, 0u64, 0u64);
        let mut recv_clock = self.ts_mask.map(RecvClockMeter::new);
        let start = Instant::now();
        let mut last_progress = start;
        while rcnt < iters || scnt < iters {
            if let Some(ch) = &self.channel {
                let ev = match ch.get_cq_event_timeout(self.cfg.timeout) {
                    Ok(ev) => ev,
                    Err(Error::WouldBlock) => return Err(self.stalled(scnt, rcnt)),
                    Err(e) => return Err(ToolError::new(format!("Failed to get cq_event: {e}"))),
                };
                cq_events += 1;
                if !ev.cq().same_as(&self.cq) {
                    return Err(ToolError::new("CQ event for an unknown CQ"));
                }
                self.cq
                    .req_notify(false)
                    .or_fail("Couldn't request CQ notification")?;
                ev.ack();
            }
            let ne = loop {
                let ne = self.cq.poll(&mut wc);
                if ne > 0 || self.channel.is_some() {
                    break ne;
                }
                if let Some(limit) = self.cfg.timeout {
                    if last_progress.elapsed() > limit {
                        return Err(self.stalled(scnt, rcnt));
                    }
                }
                std::hint::spin_loop();
            };
            if ne > 0 {
                last_progress = Instant::now();
            }
            for w in &wc[..ne] {
                if w.status != WcStatus::Success {
                    return Err(ToolError::new(format!(
                        "Failed status {} ({}) for wr_id {}",
                        w.status.as_str(),
                        w.status.raw(),
                        w.wr_id
                    )));
                }
                let qp_index = if nqp > 1 {
                    self.qps
                        .iter()
                        .position(|q| q.qp_num() == w.qp_num)
                        .ok_or_else(|| ToolError::new(format!("Couldn't find QPN {:06x}", w.qp_num)))?
                } else {
                    0
                };
                match w.wr_id {
                    SEND_WRID => scnt += 1,
                    RECV_WRID => {
                        self.routs -= 1;
                        if self.routs <= refill_at {
                            self.routs += self.post_recv(self.cfg.rx_depth - self.routs);
                            if self.routs < self.cfg.rx_depth {
                                return Err(ToolError::new(format!(
                                    "Couldn't post receive ({})",
                                    self.routs
                                )));
                            }
                        }
                        rcnt += 1;
                        if let Some(m) = &mut recv_clock {
                            m.record(w.timestamp);
                        }
                    }
                    other => return Err(ToolError::new(format!("Completion for unknown wr_id {other}"))),
                }
                pending[qp_index] &= !w.wr_id;
                if scnt < iters && pending[qp_index] == 0 {
                    self.post_send(qp_index, remote)?;
                    pending[qp_index] = RECV_WRID | SEND_WRID;
                }
            }
        }
        let elapsed = start.elapsed();
        let checked = role == Role::Server && self.cfg.check;
        let mut invalid_pages = Vec::new();
        if checked {
            if let Buffer::Device { dm, host, .. } = &mut self.buf {
                dm.copy_from(0, host).or_fail("Copy from DM buffer failed")?;
            }
            for i in (0..self.cfg.size).step_by(CHECK_PAGE_SIZE) {
                let mut b = [0u8];
                self.buf.read(off + i, &mut b).or_fail("read the received data")?;
                if b[0] != 0 {
                    invalid_pages.push(i / CHECK_PAGE_SIZE);
                }
            }
        }
        Ok(Report {
            bytes: self.cfg.size as u64 * iters * 2,
            elapsed,
            iters: self.cfg.iters,
            sends: scnt,
            recvs: rcnt,
            cq_events,
            checked,
            invalid_pages,
            local: self.local.clone(),
            remote: Vec::new(),
            recv_clock: recv_clock.and_then(|m| m.result()),
        })
    }

    fn stalled(&self, scnt: u64, rcnt: u64) -> ToolError {
        ToolError::new(format!(
            "timed out after {:?} without a completion ({scnt} sends and {rcnt} receives of {} completed)",
            self.cfg.timeout.unwrap_or_default(),
            self.cfg.iters
        ))
    }

    /// The context the resources live on.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The port attributes queried at creation.
    pub fn port(&self) -> &PortAttr {
        &self.port
    }
}

/// The device checks of rdma-core for the chosen features, with its messages; returns the
/// completion timestamp mask when timestamps are asked for.
fn check_device(ctx: &Context, cfg: &Config) -> Result<Option<u64>, ToolError> {
    if !(cfg.on_demand() || cfg.timestamps || cfg.device_memory) {
        return Ok(None);
    }
    let ex = ctx.query_device_ex();
    if cfg.on_demand() {
        let caps = ex.odp_caps;
        let (transport_caps, needed, what) = match cfg.transport {
            Transport::Srq => (
                caps.rc_odp_caps,
                odp::SEND | odp::SRQ_RECV,
                "RC send, receive and srq",
            ),
            _ => (caps.rc_odp_caps, odp::SEND | odp::RECV, "RC send and receive"),
        };
        if caps.general_caps & odp::SUPPORT == 0 || transport_caps & needed != needed {
            return Err(ToolError::new(format!(
                "The device isn't ODP capable or does not support {what} with ODP"
            )));
        }
        if cfg.implicit_odp && caps.general_caps & odp::SUPPORT_IMPLICIT == 0 {
            return Err(ToolError::new("The device doesn't support implicit ODP"));
        }
    }
    if cfg.device_memory {
        let max = ctx.max_dm_size();
        if max == 0 {
            return Err(ToolError::new("Device doesn't support dm allocation"));
        }
        if max < cfg.size as u64 {
            return Err(ToolError::new("Device memory is insufficient"));
        }
    }
    if cfg.timestamps {
        if ex.completion_timestamp_mask == 0 {
            return Err(ToolError::new("The device isn't completion timestamp capable"));
        }
        return Ok(Some(ex.completion_timestamp_mask));
    }
    Ok(None)
}

/// Allocates and registers the buffer as `cfg` asks (`pp_init_ctx`), filled with [`FILL`]
/// where the program sees it, and prefetches it with `prefetch`.
fn alloc_buffer(ctx: &Context, pd: &ProtectionDomain, cfg: &Config) -> Result<Buffer, ToolError> {
    let len = cfg.size
        + if cfg.transport == Transport::Ud {
            UD_GRH_LEN
        } else {
            0
        };
    let mut access = AccessFlags::LOCAL_WRITE;
    if cfg.on_demand() {
        access |= AccessFlags::ON_DEMAND;
    }
    let buf = if cfg.device_memory {
        let dm = ctx.alloc_dm(len as u64, 0).or_fail("Dev mem allocation failed")?;
        let mr = pd
            .register_dm(&dm, 0, len as u64, access | AccessFlags::ZERO_BASED)
            .or_fail("Couldn't register MR")?;
        // The device memory itself starts as allocated; only the program's copy is filled.
        Buffer::Device {
            mr,
            dm,
            host: vec![FILL; len],
        }
    } else if cfg.implicit_odp {
        let buf = HostBuffer::new(len).or_fail("Couldn't allocate work buf.")?;
        buf.fill(FILL);
        let region = pd.register_implicit_odp(access).or_fail("Couldn't register MR")?;
        Buffer::Implicit { region, buf }
    } else {
        let mr = pd.register(len, access).or_fail("Couldn't register MR")?;
        mr.fill(FILL);
        Buffer::Mr(mr)
    };
    if cfg.prefetch {
        const PREFETCH_WRITE: u32 = 1;
        const FLAG_FLUSH: u32 = 1;
        let r = buf
            .sge(0..cfg.size)
            .and_then(|sge| pd.advise_mr(PREFETCH_WRITE, FLAG_FLUSH, &[sge]));
        if let Err(e) = r {
            // As rdma-core: a failed prefetch is reported and the run goes on.
            eprintln!("Couldn't prefetch MR({}). Continue anyway", e.errno());
        }
    }
    Ok(buf)
}

/// Runs one side: [`PingPong::new`], prints the local addresses, then [`PingPong::run`].
pub fn run<S: Read + Write>(
    ctx: &Context,
    cfg: Config,
    role: Role,
    stream: S,
    out: &mut dyn Write,
) -> Result<Report, ToolError> {
    let pp = PingPong::new(ctx, cfg)?;
    pp.print_local(out)?;
    pp.run(role, stream, out)
}

fn modify(qp: &QueuePair, attr: QpAttr, mask: QpAttrMask, state: &str) -> Result<(), ToolError> {
    qp.modify(&attr, mask)
        .or_fail(&format!("Failed to modify QP to {state}"))
}

fn to_init(qp: &QueuePair, cfg: &Config) -> softverbs::Result<()> {
    let mut attr = QpAttr {
        qp_state: QpState::Init,
        pkey_index: 0,
        port_num: cfg.ib_port,
        ..Default::default()
    };
    let mut mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT;
    if cfg.transport == Transport::Ud {
        attr.qkey = UD_QKEY;
        mask |= QpAttrMask::QKEY;
    } else {
        // No remote access: the ping-pong only sends.
        attr.qp_access_flags = AccessFlags::empty();
        mask |= QpAttrMask::ACCESS_FLAGS;
    }
    qp.modify(&attr, mask)
}

/// The GID index to use: the one asked for, or (when none is, or a negative one) the first
/// IPv4-mapped entry of the port, else its first populated entry. rdma-core's programs send a
/// zero GID without `-g`, which RoCE cannot route, so choosing one makes `-g` optional here.
pub(crate) fn pick_gid(ctx: &Context, port: u8, asked: Option<i32>) -> Result<u8, ToolError> {
    if let Some(i) = asked.filter(|i| *i >= 0) {
        ctx.query_gid(port, i)
            .or_fail(&format!("can't read sgid of index {i}"))?;
        return u8::try_from(i).map_err(|_| ToolError::new(format!("GID index {i} is out of range")));
    }
    let len = ctx
        .query_port(port)
        .or_fail("Couldn't get port info")?
        .gid_tbl_len;
    let gids: Vec<(u8, Gid)> = (0..len.min(256))
        .filter_map(|i| Some((i as u8, ctx.query_gid(port, i as i32).ok()?)))
        .filter(|(_, g)| g.interface_id() != 0)
        .collect();
    gids.iter()
        .find(|(_, g)| g.0[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff])
        .or_else(|| gids.first())
        .map(|(i, _)| *i)
        .ok_or_else(|| ToolError::new(format!("port {port} has no usable GID")))
}

/// A random 24-bit PSN, as the C programs draw with `lrand48() & 0xffffff`.
pub(crate) fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // Falling back to the clock only matters if the kernel has no random source at all.
    if getrandom::getrandom(&mut b).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        b = (nanos ^ std::process::id().rotate_left(12)).to_ne_bytes();
    }
    u32::from_ne_bytes(b) & 0xff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_matches_the_c_programs() {
        let d = Dest {
            lid: 0,
            qpn: 0x11,
            psn: 0xabcdef,
            gid: Gid::from(std::net::Ipv4Addr::LOCALHOST),
        };
        let msg = d.to_wire();
        assert_eq!(msg.len(), 52);
        assert_eq!(&msg[..51], b"0000:000011:abcdef:00000000000000000000ffff7f000001");
        assert_eq!(msg[51], 0);
        assert_eq!(Dest::from_wire(&msg).unwrap(), d);
        assert_eq!(d.gid_text(), "::ffff:127.0.0.1");
        assert_eq!(Dest::ZERO.gid_text(), "::");
    }

    #[test]
    fn malformed_messages_are_refused() {
        for bad in [
            &b"zzzz:000011:abcdef:00000000000000000000ffff7f000001\0"[..],
            b"0000:000011\0",
            b"\0",
        ] {
            assert!(Dest::from_wire(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn address_lines() {
        let d = Dest {
            lid: 0,
            qpn: 0x11,
            psn: 0x10,
            gid: Gid::ZERO,
        };
        assert_eq!(
            d.line("local", Transport::Rc),
            "  local address:  LID 0x0000, QPN 0x000011, PSN 0x000010, GID ::"
        );
        assert_eq!(
            d.line("local", Transport::Ud),
            "  local address:  LID 0x0000, QPN 0x000011, PSN 0x000010: GID ::"
        );
        assert_eq!(
            d.line("remote", Transport::Ud),
            "  remote address: LID 0x0000, QPN 0x000011, PSN 0x000010, GID ::"
        );
    }

    #[test]
    fn receive_clock_gaps_as_rdma_core_counts_them() {
        let mut m = RecvClockMeter::new(0xffff);
        assert_eq!(m.result(), None);
        m.record(100);
        assert_eq!(m.result(), None, "one receive has no gap");
        m.record(130);
        m.record(0xfff0);
        // Wrapped at the mask: 0xffff - 0xfff0 + 5 + 1.
        m.record(5);
        let c = m.result().unwrap();
        assert_eq!(
            (c.max, c.min, c.total, c.samples),
            (0xfff0 - 130, 21, 30 + 0xfff0 - 130 + 21, 3)
        );
        let lines = RecvClock {
            max: 7,
            min: 2,
            total: 10,
            samples: 4,
        }
        .lines();
        assert_eq!(
            lines,
            "Max receive completion clock cycles = 7\nMin receive completion clock cycles = 2\nAverage receive completion clock cycles = 2.500000"
        );
    }

    #[test]
    fn summary_lines() {
        let r = Report {
            bytes: 8192000,
            elapsed: Duration::from_micros(1_500_000),
            iters: 1000,
            sends: 1000,
            recvs: 1000,
            cq_events: 0,
            checked: false,
            invalid_pages: vec![],
            local: vec![],
            remote: vec![],
            recv_clock: None,
        };
        assert_eq!(
            r.summary(),
            "8192000 bytes in 1.50 seconds = 43.69 Mbit/sec\n1000 iters in 1.50 seconds = 1500.00 usec/iter"
        );
    }
}
