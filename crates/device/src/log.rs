//! Logs: softverbs reports what happens to connections on [`tracing`]: QP state changes,
//! connection-manager events, errors (error completions, QPs that fail), retransmissions and
//! dropped packets with their reasons. Nothing is logged unless asked for.
//!
//! A program that installs a `tracing` subscriber of its own gets these events through it (their
//! targets are the crates' paths, `softverbs_device::...`). For any other program, C programs
//! included, `SOFTVERBS_LOG` installs one that writes to stderr: its value is a filter in
//! `RUST_LOG` syntax, e.g. `SOFTVERBS_LOG=debug`, `SOFTVERBS_LOG=info,softverbs_device::qp=trace`.
//! The front ends call [`init_from_env`] when they list devices: the C library in
//! `ibv_get_device_list` (and when librdmacm first reaches it), the Rust API in `devices()`.
//!
//! Without a subscriber an event costs a load and a branch at its call site (`tracing` caches
//! that no one listens), and nothing is formatted.

use std::sync::OnceLock;

/// The environment variable with the filter (see the [module documentation](self)).
pub const ENV: &str = "SOFTVERBS_LOG";

/// Installs a subscriber that writes the events `SOFTVERBS_LOG` selects to stderr, once per
/// process, if the variable is set and not empty and no global subscriber is installed yet.
/// Returns whether this process logs through it.
pub fn init_from_env() -> bool {
    static DONE: OnceLock<bool> = OnceLock::new();
    *DONE.get_or_init(|| {
        let Some(spec) = std::env::var_os(ENV) else {
            return false;
        };
        let spec = spec.to_string_lossy();
        if spec.trim().is_empty() {
            return false;
        }
        let filter = tracing_subscriber::EnvFilter::builder().parse_lossy(spec.as_ref());
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_thread_names(true)
            .try_init()
            .is_ok()
    })
}
