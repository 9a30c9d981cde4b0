//! What this process uses: resident memory, CPU time and the wake-ups of its threads.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Resident set size of this process in bytes (`/proc/self/statm`, field 2).
pub fn rss_bytes() -> Result<u64> {
    let s = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::msg(format!("bad /proc/self/statm: {s:?}")))?;
    Ok(pages * page_size())
}

fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map_or(4096, |v| v as u64)
}

/// A `kB` field of `/proc/self/status` (e.g. `VmHWM`, `RssAnon`), in bytes.
pub(super) fn status_bytes(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(kb * 1024)
    })
}

/// CPU seconds (user + system, every thread) of this process so far. `getrusage` rather than
/// `/proc/self/stat`, whose clock ticks are too coarse for a few seconds of near-idleness.
fn cpu_seconds() -> Result<f64> {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_SELF)?;
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    Ok(secs(u.user_time()) + secs(u.system_time()))
}

/// Context switches (voluntary + involuntary) of every thread of this process but the
/// calling one: while the caller sleeps, each is a wake-up of a library thread.
fn other_threads_switches() -> u64 {
    let me = nix::unistd::gettid().as_raw().to_string();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str() != Some(me.as_str()))
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        .map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}

/// Sleeps `secs`; returns the CPU used meanwhile as a percentage of one core, and the wake-ups
/// of the other threads (the library's) per second.
pub(super) fn idle_percent(secs: f64) -> Result<(f64, f64)> {
    let (c0, w0, t0) = (cpu_seconds()?, other_threads_switches(), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (cpu, wall) = (cpu_seconds()? - c0, t0.elapsed().as_secs_f64());
    let wakeups = other_threads_switches().saturating_sub(w0) as f64;
    Ok((100.0 * cpu / wall, wakeups / wall))
}
