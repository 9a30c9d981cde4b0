//! `ibv_ud_pingpong`: ping-pong over a UD QP, option- and wire-compatible with rdma-core's.

use std::process::ExitCode;

use clap::Parser;
use softverbs_tools::cli::{self, PingPongArgs};
use softverbs_tools::pingpong::Transport;

/// Ping-pong test over an unreliable datagram (UD) queue pair. Messages must fit the port's
/// active MTU.
///
/// Without HOST, starts a server and waits for a connection; with HOST, connects to the server
/// at HOST. Both sides must use the same options.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    common: PingPongArgs,
}

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    cli::pingpong_main(Transport::Ud, &args.common, None, None)
}
