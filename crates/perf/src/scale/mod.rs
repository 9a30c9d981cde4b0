//! `softverbs-scale`: many connected RC QPs in one process, or many processes sharing a device.
//!
//! One process (the default): N QPs on one device (sv_lo), connected in pairs to each other,
//! sharing one send CQ and one receive CQ. Reports the memory each idle connected QP costs
//! (resident set growth over N), the time to create and connect them and to destroy them, the
//! CPU the process uses while they are connected and idle, and the message rate of a burst in
//! which every QP sends K messages (RDMA WRITE or SEND) of S bytes to its partner, every one
//! signaled and checked, with the data verified on every QP.
//!
//! Several processes (`--processes P`): P/2 client/server pairs, each process the same binary
//! started again with a hidden `--role`, talking RoCEv2 over UDP through the device's per-process
//! slots, on a private base port so that the run does not meet other softverbs processes. The
//! parent relays the endpoints, measures the idle CPU of every connected process, then starts
//! every burst at once and reports the aggregate message rate.
//!
//! `--fill-slots`: processes that each hold one QP, started until the device refuses one, to
//! show how many processes with QPs a host has room for and what the next one gets (see
//! `fill.rs`).

mod args;
mod one_process;
mod processes;
mod report;
mod rig;
mod usage;

pub use args::{Role, ScaleArgs, ScaleOp};
pub(crate) use report::fig;
pub use report::{print_figures, Figure};
pub use usage::rss_bytes;

use crate::error::{bail, Result};

/// Runs what `args` asks for and returns the figures (also printed, except by a child).
pub fn run_scale(args: &ScaleArgs) -> Result<Vec<Figure>> {
    if args.size == 0 || args.iters == 0 || args.depth == 0 {
        bail!("--size, --iters and --depth must be at least 1");
    }
    let idle_ok = args.idle >= 0.0 && args.idle.is_finite();
    let timeout_ok = args.timeout > 0.0 && args.timeout.is_finite();
    if !(idle_ok && timeout_ok) {
        bail!("--idle must be >= 0 and --timeout positive");
    }
    if let Some(role) = args.role {
        match role {
            Role::Holder => crate::fill::holder(args)?,
            _ => processes::child(args, role)?,
        }
        return Ok(Vec::new());
    }
    let figures = match (args.fill_slots, args.processes) {
        (true, p) => crate::fill::fill(args, p.unwrap_or(300))?,
        (false, Some(p)) => processes::processes(args, p)?,
        (false, None) => one_process::one_process(args)?,
    };
    print_figures(&figures, args.json);
    Ok(figures)
}
