//! softverbs-perf: a perftest-style benchmark for the softverbs software RoCEv2 device.
//!
//! It measures SEND, RDMA WRITE, RDMA READ and atomics (fetch-and-add, compare-and-swap)
//! between two RC endpoints: bandwidth and message rate (many work requests in flight, over one
//! or several QPs), latency (ping-pong for SEND and WRITE, single outstanding round trips for
//! READ and atomics), and the CPU that connected but idle processes use. The two sides exchange
//! QP numbers, PSNs, GIDs, rkeys and addresses over TCP, as perftest does; `--loopback` starts
//! both in one command, as two processes talking RoCEv2 over UDP or as two threads.
//!
//! ```text
//! softverbs-perf                       # server, waits on TCP port 18515
//! softverbs-perf 192.0.2.1 --test read # client
//! softverbs-perf --loopback --test send --lat -s 8
//! ```
//!
//! The binary is a thin wrapper around [`run`]; the result types and the statistics are public
//! so that the figures can be reused (see [`stats`]). The `softverbs-scale` binary ([`scale`])
//! measures thousands of connected QPs in one process and many processes on one device.

pub mod cli;
pub mod error;
pub mod plot;
pub mod scale;
pub mod stats;

mod bw;
mod endpoint;
mod lat;
mod oob;
mod session;

pub use cli::{Args, AtomicKind, Connection, Format, Metric, Params, TestKind};
pub use error::{Error, Result};
pub use stats::{BwRow, IdleRow, LatRow, Row};

/// Runs what `args` asks for: the loopback pair, a client (with a host) or a server. Returns
/// the rows the client printed (none for a server). With `--plot`, also writes the chart.
pub fn run(args: &Args) -> Result<Vec<Row>> {
    // Validate before anything starts, so that a bad option fails here rather than in a peer.
    Params::from_args(args)?;
    if args.plot.is_some() && !args.loopback && args.host.is_none() {
        error::bail!("--plot needs results: give a server to connect to, or --loopback");
    }
    let mut rows = measure(args)?;
    if let Some(path) = &args.plot {
        if args.loopback && !args.bw && !args.lat {
            let lat = Args {
                lat: true,
                ..args.clone()
            };
            Params::from_args(&lat)?;
            rows.extend(measure(&lat)?);
        }
        let title = format!(
            "softverbs-perf: {} over {}, {} QP{}",
            args.test.name(),
            args.connection.name(),
            args.qps,
            if args.qps == 1 { "" } else { "s" }
        );
        let svg = plot::sweep_svg(&rows, &title)?;
        std::fs::write(path, svg).map_err(|e| Error::msg(format!("writing {}: {e}", path.display())))?;
    }
    Ok(rows)
}

fn measure(args: &Args) -> Result<Vec<Row>> {
    if args.announce {
        session::announced_server(args)?;
        return Ok(Vec::new());
    }
    if args.loopback {
        return session::loopback(args);
    }
    match &args.host {
        Some(host) => session::client(args, host, args.port, session::PeerKind::Process),
        None => {
            let listener = session::listen(args.port)?;
            session::server(args, &listener, false)?;
            Ok(Vec::new())
        }
    }
}
