//! `ibv_xsrq_pingpong`: ping-pong over XRC into XRC shared receive queues, option- and
//! wire-compatible with rdma-core's.

use std::net::TcpStream;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use softverbs::Mtu;
use softverbs_tools::cli::{self, parse_c_int, parse_mtu};
use softverbs_tools::man;
use softverbs_tools::pingpong::{Role, DEFAULT_TCP_PORT};
use softverbs_tools::xsrq::{Config, XsrqPingPong};
use softverbs_tools::{OrFail, ToolError};

const TOOL: &str = "ibv_xsrq_pingpong";

#[derive(Parser, Debug)]
#[command(
    name = "ibv_xsrq_pingpong",
    version,
    about = "ping-pong test over XRC into shared receive queues",
    long_about = None,
    before_help = DESCRIPTION,
    after_help = man::SEE_LONG_HELP,
    after_long_help = man::sections(man::DEVICE_ENVIRONMENT, EXAMPLES, man::PINGPONG_EXIT_STATUS),
    help_template = man::PAGE_WITH_OPERANDS,
)]
struct Args {
    /// Listen on / connect to TCP port PORT
    #[arg(short = 'p', long = "port", default_value_t = DEFAULT_TCP_PORT, value_parser = parse_c_int::<u16>)]
    port: u16,
    /// Use RDMA device DEV (default: the first device found)
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    ib_dev: Option<String>,
    /// Use port PORT of the device
    #[arg(short = 'i', long = "ib-port", value_name = "PORT", default_value_t = 1, value_parser = parse_c_int::<u8>)]
    ib_port: u8,
    /// Size of the message to exchange
    #[arg(short = 's', long = "size", default_value_t = 4096, value_parser = parse_c_int::<u32>)]
    size: u32,
    /// Path MTU
    #[arg(short = 'm', long = "mtu", value_name = "SIZE", default_value = "1024", value_parser = parse_mtu)]
    mtu: Mtu,
    /// Number of clients (on the server only)
    #[arg(short = 'c', long = "clients", default_value_t = 1, value_parser = parse_c_int::<u32>)]
    clients: u32,
    /// Number of tests per client
    #[arg(short = 'n', long = "num_tests", default_value_t = 5, value_parser = parse_c_int::<u32>)]
    num_tests: u32,
    /// Service level
    #[arg(short = 'l', long = "sl", default_value_t = 0, value_parser = parse_c_int::<u8>)]
    sl: u8,
    /// Sleep on CQ events instead of busy polling
    #[arg(short = 'e', long = "events")]
    events: bool,
    /// Use on-demand paging
    #[arg(short = 'o', long = "odp")]
    odp: bool,
    /// Local port GID index (default: the first IPv4 GID, else the first GID)
    #[arg(short = 'g', long = "gid-idx", value_name = "INDEX", allow_negative_numbers = true, value_parser = parse_c_int::<i32>)]
    gid_idx: Option<i32>,
    /// Give up if the peer or a completion does not arrive within SECS (softverbs extension)
    #[arg(long = "timeout", value_name = "SECS", value_parser = |s: &str| s.parse::<f64>().map_err(|e| e.to_string()).and_then(|v| Duration::try_from_secs_f64(v).map_err(|e| e.to_string())))]
    timeout: Option<Duration>,
    /// Server to connect to; without it, wait for clients
    #[arg(value_name = "HOST")]
    servername: Option<String>,
}

fn run(args: &Args) -> Result<(), ToolError> {
    let cfg = Config {
        ib_port: args.ib_port,
        size: args.size as usize,
        mtu: args.mtu,
        // A client always has one server.
        num_clients: if args.servername.is_some() {
            1
        } else {
            args.clients
        },
        num_tests: args.num_tests,
        sl: args.sl,
        use_events: args.events,
        gid_index: args.gid_idx,
        timeout: args.timeout,
        odp: args.odp,
    };
    let dev = cli::find_device(args.ib_dev.as_deref())?;
    let ctx = dev
        .open()
        .or_fail(&format!("Couldn't get context for {}", dev.name()))?;
    let clients = cfg.num_clients;
    let pp = XsrqPingPong::new(&ctx, cfg)?;
    let (role, streams): (Role, Vec<TcpStream>) = match &args.servername {
        Some(host) => (Role::Client, vec![cli::connect(host, args.port, args.timeout)?]),
        None => (Role::Server, cli::accept_many(args.port, clients, args.timeout)?),
    };
    if let Some(t) = args.timeout {
        for s in &streams {
            s.set_read_timeout(Some(t)).or_fail("set the socket timeout")?;
        }
    }
    let stdout = std::io::stdout();
    pp.run(role, streams, &mut stdout.lock())?;
    Ok(())
}

const DESCRIPTION: &str = concat!(
    "    Exchanges messages over the extended reliable connected (XRC) transport, each client's\n",
    "    messages going into an XRC shared receive queue of the server, as rdma-core's\n",
    "    ibv_xsrq_pingpong does. Without HOST it is the server and waits for --clients clients on TCP\n",
    "    port --port; with HOST it is a client. Each client runs --num_tests exchanges of --size\n",
    "    bytes.",
);

const EXAMPLES: &[(&str, &str)] = &[
    ("ibv_xsrq_pingpong -d sv_lo -c 2 &\nibv_xsrq_pingpong -d sv_lo 127.0.0.1 &\nibv_xsrq_pingpong -d sv_lo 127.0.0.1", "A server and two clients on loopback."),
];

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => cli::fail(TOOL, &e),
    }
}
