//! `ibv_srq_pingpong`: ping-pong over several RC QPs sharing one SRQ, option- and
//! wire-compatible with rdma-core's.

use std::process::ExitCode;

use clap::Parser;
use softverbs::Mtu;
use softverbs_tools::cli::{self, parse_c_int, parse_mtu, PingPongArgs};
use softverbs_tools::man;
use softverbs_tools::pingpong::Transport;

#[derive(Parser, Debug)]
#[command(
    name = "ibv_srq_pingpong",
    version,
    about = "ping-pong test over RC queue pairs sharing a receive queue",
    long_about = None,
    before_help = DESCRIPTION,
    after_help = man::SEE_LONG_HELP,
    after_long_help = man::sections(man::DEVICE_ENVIRONMENT, EXAMPLES, man::PINGPONG_EXIT_STATUS),
    help_template = man::PAGE_WITH_OPERANDS,
)]
struct Args {
    #[command(flatten)]
    common: PingPongArgs,
    /// Path MTU
    #[arg(short = 'm', long = "mtu", value_name = "SIZE", default_value = "1024", value_parser = parse_mtu)]
    mtu: Mtu,
    /// Number of QPs to use
    #[arg(short = 'q', long = "num-qp", value_name = "NUM", default_value_t = 16, value_parser = parse_c_int::<u32>)]
    num_qp: u32,
    /// Use on-demand paging
    #[arg(short = 'o', long = "odp")]
    odp: bool,
}

const DESCRIPTION: &str = concat!(
    "    Exchanges messages over --num-qp RC queue pairs whose receives all come from one shared\n",
    "    receive queue (SRQ), as rdma-core's ibv_srq_pingpong does, and prints the bandwidth and the\n",
    "    time per exchange. Without HOST it is the server and waits for one client on TCP port\n",
    "    --port; with HOST it is the client. Both sides must be given the same options. --iters counts\n",
    "    the exchanges over all QPs together.",
);

const EXAMPLES: &[(&str, &str)] = &[
    (
        "ibv_srq_pingpong -d sv_lo -g 0 &\nibv_srq_pingpong -d sv_lo -g 0 127.0.0.1",
        "A server and a client on loopback, with 16 QPs.",
    ),
    (
        "ibv_srq_pingpong -q 4 -o   (on both sides)",
        "Four QPs, receiving into on-demand-paging memory.",
    ),
];

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    let mut cfg = args
        .common
        .config(Transport::Srq, Some(args.mtu), Some(args.num_qp));
    cfg.odp = args.odp;
    cli::pingpong_main_with(&args.common, cfg)
}
