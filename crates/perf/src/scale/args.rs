//! The command line of `softverbs-scale`.

use clap::{Parser, ValueEnum};
use softverbs_tools::man;

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
