//! `ibv_ud_pingpong`: ping-pong over a UD QP, option- and wire-compatible with rdma-core's.

use std::process::ExitCode;

use clap::Parser;
use softverbs_tools::cli::{self, PingPongArgs};
use softverbs_tools::man;
use softverbs_tools::pingpong::Transport;

#[derive(Parser, Debug)]
#[command(
    name = "ibv_ud_pingpong",
    version,
    about = "ping-pong test over a UD queue pair",
    long_about = None,
    before_help = DESCRIPTION,
    after_help = man::SEE_LONG_HELP,
    after_long_help = man::sections(man::DEVICE_ENVIRONMENT, EXAMPLES, man::PINGPONG_EXIT_STATUS),
    help_template = man::PAGE_WITH_OPERANDS,
)]
struct Args {
    #[command(flatten)]
    common: PingPongArgs,
}

const DESCRIPTION: &str = concat!(
    "    Exchanges datagrams over unreliable datagram (UD) queue pairs between two processes, as\n",
    "    rdma-core's ibv_ud_pingpong does, and prints the bandwidth and the time per exchange. Without\n",
    "    HOST it is the server and waits for one client on TCP port --port; with HOST it is the\n",
    "    client. Both sides must be given the same options. A message must fit the port's active MTU\n",
    "    (the default size is 1024 bytes).",
);

const EXAMPLES: &[(&str, &str)] = &[(
    "ibv_ud_pingpong -d sv_lo -g 0 &\nibv_ud_pingpong -d sv_lo -g 0 127.0.0.1",
    "A server and a client on loopback.",
)];

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    cli::pingpong_main(Transport::Ud, &args.common, None, None)
}
