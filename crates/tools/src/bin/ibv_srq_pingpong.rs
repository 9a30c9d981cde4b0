//! `ibv_srq_pingpong`: ping-pong over several RC QPs sharing one SRQ, option- and
//! wire-compatible with rdma-core's.

use std::process::ExitCode;

use clap::Parser;
use softverbs::Mtu;
use softverbs_tools::cli::{self, parse_c_int, parse_mtu, PingPongArgs};
use softverbs_tools::pingpong::Transport;

/// Ping-pong test over RC queue pairs that receive from one shared receive queue (SRQ).
///
/// Without HOST, starts a server and waits for a connection; with HOST, connects to the server
/// at HOST. Both sides must use the same options. -n counts exchanges over all QPs together.
#[derive(Parser, Debug)]
#[command(version)]
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

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    let mut cfg = args
        .common
        .config(Transport::Srq, Some(args.mtu), Some(args.num_qp));
    cfg.odp = args.odp;
    cli::pingpong_main_with(&args.common, cfg)
}
