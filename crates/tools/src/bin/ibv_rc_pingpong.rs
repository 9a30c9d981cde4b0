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
    /// Use on-demand paging (not supported)
    #[arg(short = 'o', long = "odp")]
    odp: bool,
    /// Use implicit on-demand paging (not supported)
    #[arg(short = 'O', long = "iodp")]
    iodp: bool,
    /// Prefetch an ODP MR (not supported)
    #[arg(short = 'P', long = "prefetch")]
    prefetch: bool,
    /// Get completions with timestamps (not supported)
    #[arg(short = 't', long = "ts")]
    ts: bool,
    /// Use device memory (not supported)
    #[arg(short = 'j', long = "dm")]
    dm: bool,
    /// Use the new post-send WR API (accepted: softverbs has one posting path, with the same
    /// effect)
    #[arg(short = 'N', long = "new_send")]
    new_send: bool,
}

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    let tool = Transport::Rc.tool_name();
    // The same consistency checks as rdma-core, then the features this device lacks.
    if (args.odp || args.iodp) && args.dm {
        eprintln!("{tool}: device memory regions cannot be on-demand (-o/-O with -j)");
        return ExitCode::FAILURE;
    }
    if args.prefetch && !(args.odp || args.iodp) {
        eprintln!("{tool}: -P (prefetch) needs an on-demand memory region (-o or -O)");
        return ExitCode::FAILURE;
    }
    if args.odp || args.iodp {
        return cli::unsupported(tool, "on-demand paging (-o/-O/-P)");
    }
    if args.ts {
        return cli::unsupported(tool, "completion timestamps (-t)");
    }
    if args.dm {
        return cli::unsupported(tool, "device memory (-j)");
    }
    // -N selects libibverbs' ibv_wr_* posting API in C; the safe API posts one way, identically
    // on the wire, so it needs nothing here.
    let _ = args.new_send;
    cli::pingpong_main(Transport::Rc, &args.common, Some(args.mtu), None)
}
