//! `ibv_uc_pingpong`: ping-pong over a UC QP, option- and wire-compatible with rdma-core's.

use std::process::ExitCode;

use clap::Parser;
use softverbs::Mtu;
use softverbs_tools::cli::{self, parse_mtu, PingPongArgs};
use softverbs_tools::man;
use softverbs_tools::pingpong::Transport;

#[derive(Parser, Debug)]
#[command(
    name = "ibv_uc_pingpong",
    version,
    about = "ping-pong test over a UC queue pair",
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
}

const DESCRIPTION: &str = concat!(
    "    Exchanges messages over an unreliable connected (UC) queue pair between two processes, as\n",
    "    rdma-core's ibv_uc_pingpong does, and prints the bandwidth and the time per exchange. Without\n",
    "    HOST it is the server and waits for one client on TCP port --port; with HOST it is the\n",
    "    client. Both sides must be given the same options. UC does not resend: on a lossy path a lost\n",
    "    message ends the run (use --timeout to bound it).",
);

const EXAMPLES: &[(&str, &str)] = &[(
    "ibv_uc_pingpong -d sv_lo -g 0 &\nibv_uc_pingpong -d sv_lo -g 0 127.0.0.1",
    "A server and a client on loopback.",
)];

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    cli::pingpong_main(Transport::Uc, &args.common, Some(args.mtu), None)
}
