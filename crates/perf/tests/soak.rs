//! Runs of the `softverbs-soak` binary: on one host (its two processes over shared memory) and
//! for 30 s between two network namespaces that drop 3 % of the datagrams each receives. The
//! binary fails on any failed or missing completion, any RC message lost or damaged, any damaged
//! UC or UD message, a failed churn cycle, and growth of either side's descriptors, threads or
//! resident set beyond the bounds given; the tests check that it succeeds and that its figures
//! show the traffic, the churn and the loss. No figure is compared with a speed.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

mod common;

/// The resident-set bound given to the binary: the first counted sample against the last.
const RSS_GROWTH: &str = "33554432";

/// One run at a time: each side busy-polls, and two runs at once on a small loaded host would
/// only starve each other.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn soak(args: &[&str], timeout: Duration) -> HashMap<String, f64> {
    let _serial = serial();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_softverbs-soak"));
    // An RC budget of 8.6 s without progress (8 x 1.07 s): a debug build on a loaded host may
    // leave a side unscheduled for a while, and the test is about data, not speed.
    cmd.args(args)
        .args(["--ack-timeout", "18"])
        .args(["--max-rss-growth", RSS_GROWTH, "--max-fd-growth", "0"])
        .env_remove("SOFTVERBS_UDP_PORT")
        .env_remove("SOFTVERBS_SHM");
    let (status, out, err) = common::run_bounded(cmd, timeout);
    eprintln!("{out}{err}");
    assert!(status.success(), "softverbs-soak {args:?} failed:\n{out}\n{err}");
    out.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.to_string(), w.next()?.parse().ok()?))
        })
        .collect()
}

fn get(m: &HashMap<String, f64>, k: &str) -> f64 {
    *m.get(k).unwrap_or_else(|| panic!("no figure {k} in {m:?}"))
}

/// What every run must show: traffic on every transport, every RC message received, READs and
/// atomics checked, objects churned, samples taken.
fn common_checks(m: &HashMap<String, f64>) {
    for t in ["rc", "uc", "ud"] {
        assert!(get(m, &format!("{t}_requests")) > 0.0, "{t} traffic");
        assert!(
            get(m, &format!("{t}_messages_received")) > 0.0,
            "{t} messages arrived"
        );
    }
    assert_eq!(get(m, "rc_messages_sent"), get(m, "rc_messages_received"));
    assert!(get(m, "rc_reads_and_atomics_checked") > 0.0);
    assert!(get(m, "churn_cycles") > 0.0);
    for side in 0..2 {
        assert!(get(m, &format!("side{side}_samples")) >= 2.0);
        // Churn holds descriptors briefly, so single samples may differ; the floors may not.
        assert!(
            get(m, &format!("side{side}_fds_floor_late")) <= get(m, &format!("side{side}_fds_floor_early"))
        );
    }
}

#[test]
fn soak_on_one_host() {
    let m = soak(
        &[
            "--duration",
            "8",
            "--sample",
            "1",
            "--warmup",
            "2",
            "--interfaces",
            "lo,lo",
        ],
        Duration::from_secs(300),
    );
    common_checks(&m);
}

#[test]
fn soak_between_two_lossy_hosts() {
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "the two-host soak needs root (network namespaces)"
    );
    let hosts = common::LossyHosts::new("k", 30);
    let (ns, ifs) = (hosts.ns.join(","), hosts.ifs.join(","));
    let m = soak(
        &[
            "--duration",
            "30",
            "--sample",
            "2",
            "--warmup",
            "5",
            "--netns",
            &ns,
            "--interfaces",
            &ifs,
        ],
        Duration::from_secs(600),
    );
    common_checks(&m);
    // The loss was on: datagrams dropped both ways, RC recovered them, UC and UD lost some.
    assert!(hosts.dropped(0) > 0 && hosts.dropped(1) > 0);
    assert!(get(&m, "rc_retransmits") > 0.0, "RC resent what was lost");
    assert!(get(&m, "ud_delivered") < 1.0 && get(&m, "uc_delivered") < 1.0);
}
