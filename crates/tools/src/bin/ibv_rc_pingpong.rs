//! `ibv_rc_pingpong`: ping-pong over an RC QP, option- and wire-compatible with rdma-core's.

use std::process::ExitCode;

use clap::Parser;
use softverbs::Mtu;
use softverbs_tools::cli::{self, parse_mtu, PingPongArgs};
use softverbs_tools::man;
use softverbs_tools::pingpong::Transport;

#[derive(Parser, Debug)]
#[command(
    name = "ibv_rc_pingpong",
    version,
    about = "ping-pong test over an RC queue pair",
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

const DESCRIPTION: &str = concat!(
    "    Exchanges messages over a reliable connected (RC) queue pair between two processes, on one\n",
    "    host or two, as rdma-core's ibv_rc_pingpong does, and prints the bandwidth and the time per\n",
    "    exchange. Without HOST it is the server and waits for one client on TCP port --port; with\n",
    "    HOST it is the client. The two exchange their QP numbers, PSNs and GIDs over that TCP\n",
    "    connection, then send --iters messages of --size bytes each way. Both sides must be given\n",
    "    the same options. Its wire protocol is rdma-core's, so either side may be rdma-core's\n",
    "    program (on softverbs' libibverbs.so.1, kernel Soft-RoCE or a RoCE NIC).",
);

const EXAMPLES: &[(&str, &str)] = &[
    (
        "ibv_rc_pingpong -d sv_lo -g 0 &\nibv_rc_pingpong -d sv_lo -g 0 127.0.0.1",
        "A server and a client on loopback (GID 0 of sv_lo is ::ffff:127.0.0.1).",
    ),
    (
        "ibv_rc_pingpong -d sv_eth0 -e -s 65536 -n 100 server.example",
        "A client that sleeps on completion events, with 64 KiB messages.",
    ),
    (
        "ibv_rc_pingpong -O -P   (on both sides)",
        "Messages in memory reached through an implicit on-demand-paging region, prefetched.",
    ),
];

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
