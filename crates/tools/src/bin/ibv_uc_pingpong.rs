//! `ibv_uc_pingpong`: ping-pong over a UC QP, option- and wire-compatible with rdma-core's.

use std::process::ExitCode;

use clap::Parser;
use softverbs::Mtu;
use softverbs_tools::cli::{self, parse_mtu, PingPongArgs};
use softverbs_tools::pingpong::Transport;

/// Ping-pong test over an unreliable connected (UC) queue pair.
///
/// Without HOST, starts a server and waits for a connection; with HOST, connects to the server
/// at HOST. Both sides must use the same options.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    common: PingPongArgs,
    /// Path MTU
    #[arg(short = 'm', long = "mtu", value_name = "SIZE", default_value = "1024", value_parser = parse_mtu)]
    mtu: Mtu,
}

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    cli::pingpong_main(Transport::Uc, &args.common, Some(args.mtu), None)
}
