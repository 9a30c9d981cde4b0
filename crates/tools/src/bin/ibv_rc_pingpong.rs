//! `ibv_rc_pingpong`: ping-pong over an RC QP, option- and wire-compatible with rdma-core's.

use std::process::ExitCode;

use clap::Parser;
use softverbs::Mtu;
use softverbs_tools::cli::{self, parse_mtu, PingPongArgs};
use softverbs_tools::pingpong::Transport;

/// Ping-pong test over a reliable connected (RC) queue pair.
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
    /// Use on-demand paging
    #[arg(short = 'o', long = "odp")]
    odp: bool,
    /// Use implicit on-demand paging (one region over the whole address space)
    #[arg(short = 'O', long = "iodp")]
    iodp: bool,
    /// Prefetch an ODP MR (ibv_advise_mr)
    #[arg(short = 'P', long = "prefetch")]
    prefetch: bool,
    /// Get completions with timestamps and print receive completion clock statistics
    #[arg(short = 't', long = "ts")]
    ts: bool,
    /// Keep the message buffer in device memory
    #[arg(short = 'j', long = "dm")]
    dm: bool,
    /// Use the new post-send WR API (accepted: softverbs has one posting path, with the same
    /// effect)
    #[arg(short = 'N', long = "new_send")]
    new_send: bool,
}

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    let mut cfg = args.common.config(Transport::Rc, Some(args.mtu), None);
    // -O implies -o, as in rdma-core; the consistency checks are the run's (Config::validate).
    cfg.odp = args.odp || args.iodp;
    cfg.implicit_odp = args.iodp;
    cfg.prefetch = args.prefetch;
    cfg.timestamps = args.ts;
    cfg.device_memory = args.dm;
    // -N selects libibverbs' ibv_wr_* posting API in C; the safe API posts one way, identically
    // on the wire, so it needs nothing here.
    let _ = args.new_send;
    cli::pingpong_main_with(&args.common, cfg)
}
