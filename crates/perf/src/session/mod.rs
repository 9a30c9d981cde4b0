//! The two roles and how they talk: the client drives the run phase by phase, the server
//! follows; plus the loopback modes that start both from one command.

mod client;
mod loopback;
mod server;

use std::time::{Duration, Instant};

pub(crate) use client::client;
pub(crate) use loopback::{announced_server, loopback};
pub(crate) use server::{listen, server};

use crate::cli::{Args, Format, Params};
use crate::endpoint::{Endpoint, Info, Side};
use crate::error::Result;
use crate::oob::Oob;

/// Protocol identifier in the client's `HELLO`.
const PROTOCOL: &str = "softverbs-perf/1";

/// Where the server process or thread is, for the header.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PeerKind {
    /// Another process (possibly another host): RoCEv2 over UDP.
    Process,
    /// A thread of this process: the device's in-memory path.
    Thread,
}

impl PeerKind {
    fn describe(self) -> &'static str {
        match self {
            Self::Process => "other process (RoCEv2 over UDP)",
            Self::Thread => "thread of this process (in-memory path)",
        }
    }
}

fn format_of(args: &Args) -> Format {
    if args.json {
        Format::Json
    } else if args.csv {
        Format::Csv
    } else {
        Format::Table
    }
}

/// CPU time (user + system) of this process so far, in seconds.
fn cpu_seconds() -> Result<f64> {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_SELF)?;
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    Ok(secs(u.user_time()) + secs(u.system_time()))
}

/// Stays idle for `secs`; returns (CPU seconds used, wall seconds).
fn idle(secs: f64) -> Result<(f64, f64)> {
    let (c0, t0) = (cpu_seconds()?, Instant::now());
    std::thread::sleep(Duration::from_secs_f64(secs));
    Ok((cpu_seconds()? - c0, t0.elapsed().as_secs_f64()))
}

/// The connection setup both roles share: resources, endpoint exchange, QPs to RTS.
fn handshake(oob: &mut Oob, side: Side, params: &Params, args: &Args) -> Result<(Endpoint, Info)> {
    let mut ep = Endpoint::create(
        side,
        params,
        args.device.as_deref(),
        args.gid_index,
        oob.local_ip()?,
    )?;
    let remote = match side {
        Side::Client => {
            oob.send(&format!("EP {}", ep.info().encode()))?;
            Info::decode(&oob.expect("EP")?)?
        }
        Side::Server => {
            let r = Info::decode(&oob.expect("EP")?)?;
            oob.send(&format!("EP {}", ep.info().encode()))?;
            r
        }
    };
    ep.connect(&remote)?;
    // Both sides are at RTS before the client sends anything.
    match side {
        Side::Client => {
            oob.send("READY")?;
            oob.expect("READY")?;
        }
        Side::Server => {
            oob.expect("READY")?;
            oob.send("READY")?;
        }
    }
    Ok((ep, remote))
}
