//! `ibv_asyncwatch`: prints a device's async events as they arrive.

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use softverbs_tools::man;
use softverbs_tools::{asyncwatch, cli, OrFail, ToolError};

#[derive(Parser, Debug)]
#[command(
    name = "ibv_asyncwatch",
    version,
    about = "display asynchronous events",
    long_about = None,
    before_help = DESCRIPTION,
    after_help = man::SEE_LONG_HELP,
    after_long_help = man::sections(man::DEVICE_ENVIRONMENT, EXAMPLES, EXIT_STATUS),
    help_template = man::PAGE,
)]
struct Args {
    /// Use RDMA device DEV (default: the first device found)
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    ib_dev: Option<String>,
    /// Exit after N events (softverbs extension)
    #[arg(long = "count", value_name = "N", value_parser = cli::parse_c_int::<u64>)]
    count: Option<u64>,
    /// Exit after SECS seconds (softverbs extension)
    #[arg(long = "timeout", value_name = "SECS")]
    timeout: Option<f64>,
}

const DESCRIPTION: &str = concat!(
    "    Opens an RDMA device and prints one line per asynchronous event it reports (port, QP, CQ,\n",
    "    SRQ and device events: IBV_EVENT_PORT_ACTIVE, IBV_EVENT_QP_FATAL, ...), naming the object it\n",
    "    is about, until killed, as rdma-core's ibv_asyncwatch does. --count and --timeout end it\n",
    "    earlier.",
);

const EXAMPLES: &[(&str, &str)] = &[
    ("ibv_asyncwatch -d sv_lo", "Watches sv_lo until interrupted."),
    (
        "ibv_asyncwatch -d sv_lo --count 1 --timeout 10",
        "Waits at most 10 seconds for one event.",
    ),
];

const EXIT_STATUS: &str = "\
0 after --count events or --timeout seconds (without them it runs until a signal ends it);
1 when no device matches, the device cannot be opened or an argument is invalid.";

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => cli::fail("ibv_asyncwatch", &e),
    }
}

fn run(args: &Args) -> Result<(), ToolError> {
    let timeout = match args.timeout {
        Some(s) => Some(Duration::try_from_secs_f64(s).or_fail("--timeout")?),
        None => None,
    };
    let dev = cli::find_device(args.ib_dev.as_deref())?;
    let ctx = dev
        .open()
        .or_fail(&format!("Couldn't get context for {}", dev.name()))?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    writeln!(out, "{}: async event FD {}", dev.name(), ctx.as_fd().as_raw_fd()).or_fail("write")?;
    out.flush().or_fail("write")?;
    asyncwatch::watch(&ctx, args.count, timeout, &mut out)?;
    Ok(())
}
