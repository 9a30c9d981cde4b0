//! Acceptance: rdma-core's own binaries (ibverbs-utils and perftest), unmodified, run against
//! our `libibverbs.so.1` with only `LD_LIBRARY_PATH` set. Two-process tests run a server and a
//! client on 127.0.0.1 over device `sv_lo`, using the GID index of `::ffff:127.0.0.1`; every
//! run is bounded by a timeout, and the runs are serialised so they do not compete for CPU.
//! A run that times out reports which process hung, its threads' kernel state and (with gdb
//! installed) stacks, and what every process printed, its stdout line-buffered by `stdbuf`.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn spawn(program: &str, args: &[String]) -> Child {
    require(program);
    // Line-buffered stdout (stdbuf execs the program, so the pid stays the program's): a
    // process killed on a time-out still shows how far it got.
    let mut c = if Path::new(STDBUF).exists() {
        let mut c = command(STDBUF);
        c.arg("-oL").arg(program);
        c
    } else {
        command(program)
    };
    c.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c.spawn().unwrap_or_else(|e| panic!("spawn {program}: {e}"))
}

const STDBUF: &str = "/usr/bin/stdbuf";

/// A pipe drained by a thread, so a chatty child never blocks on it.
fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut buf);
        }
        buf
    })
}

/// What the kernel says each thread of `pid` is doing, and, if gdb is installed, the stacks.
fn diagnose(pid: u32) -> String {
    let mut report = String::new();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"));
    for task in tasks.into_iter().flatten().flatten() {
        let dir = task.path();
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        // The state is the field after the parenthesised name.
        let stat = read("stat");
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next()
            .unwrap_or("?");
        report += &format!(
            "  thread {} {:?}: state {state}, wchan {}, syscall {}\n",
            task.file_name().to_string_lossy(),
            read("comm"),
            read("wchan"),
            read("syscall"),
        );
    }
    if Path::new("/usr/bin/gdb").exists() {
        let gdb = std::process::Command::new("/usr/bin/gdb")
            .args(["-p", &pid.to_string(), "-batch", "-ex", "thread apply all bt"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        if let Ok(mut gdb) = gdb {
            let out = drain(gdb.stdout.take());
            let start = Instant::now();
            while gdb.try_wait().ok().flatten().is_none() && start.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = gdb.kill();
            let _ = gdb.wait();
            report += &String::from_utf8_lossy(&out.join().unwrap_or_default());
        }
    }
    report
}

/// Waits for every `(role, child)` until all exit or `limit` has passed. On a time-out it
/// panics with a report that names each process still running, with its threads' state and
/// stacks, and shows what every process printed; all of them are killed first.
fn wait_all(children: Vec<(String, Child)>, limit: Duration) -> Vec<Output> {
    let start = Instant::now();
    let mut runs: Vec<_> = children
        .into_iter()
        .map(|(role, mut child)| {
            let out = drain(child.stdout.take());
            let err = drain(child.stderr.take());
            (role, child, out, err)
        })
        .collect();
    let mut hung = Vec::new();
    loop {
        let running: Vec<usize> = (0..runs.len())
            .filter(|&i| runs[i].1.try_wait().expect("wait").is_none())
            .collect();
        if running.is_empty() {
            break;
        }
        if start.elapsed() > limit {
            for i in running {
                let (role, child, ..) = &runs[i];
                hung.push(format!(
                    "{role} (pid {}) still runs:\n{}",
                    child.id(),
                    diagnose(child.id())
                ));
            }
            for (_, child, ..) in &mut runs {
                let _ = child.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let outputs: Vec<(String, Output)> = runs
        .into_iter()
        .map(|(role, mut child, out, err)| {
            let status = child.wait().expect("wait");
            let stdout = out.join().unwrap_or_default();
            let stderr = err.join().unwrap_or_default();
            (
                role,
                Output {
                    status,
                    stdout,
                    stderr,
                },
            )
        })
        .collect();
    if !hung.is_empty() {
        let mut report = format!("timed out after {limit:?}\n{}", hung.join("\n"));
        for (role, o) in &outputs {
            let (out, err) = text(o);
            report += &format!("\n-- {role} ({:?}) stdout:\n{out}\nstderr:\n{err}", o.status);
        }
        panic!("{report}");
    }
    outputs.into_iter().map(|(_, o)| o).collect()
}

/// Runs `program args` as server and `program args 127.0.0.1` as client; both must exit 0.
fn pair(program: &str, args: &[&str]) -> (Output, Output) {
    pair_of(program, program, args)
}

/// Runs `server args` and `client args 127.0.0.1`; both must exit 0.
fn pair_of(program: &str, client_program: &str, args: &[&str]) -> (Output, Output) {
    let (s, mut c) = server_and_clients(program, client_program, args, 1);
    (c.remove(0), s)
}

/// Runs `server args` and `clients` processes `client args 127.0.0.1`; all must exit 0.
fn server_and_clients(
    program: &str,
    client_program: &str,
    args: &[&str],
    clients: usize,
) -> (Output, Vec<Output>) {
    let _serial = serial();
    for _ in 1..PERFTEST_ATTEMPTS {
        let (s, cs) = server_and_clients_once(program, client_program, args, clients);
        if !cs.iter().chain([&s]).any(perftest_clock_failed) {
            return checked_run(program, args, s, cs);
        }
    }
    let (s, cs) = server_and_clients_once(program, client_program, args, clients);
    checked_run(program, args, s, cs)
}

/// One run of [`server_and_clients`], unchecked.
fn server_and_clients_once(
    program: &str,
    client_program: &str,
    args: &[&str],
    clients: usize,
) -> (Output, Vec<Output>) {
    let port = free_port().to_string();
    let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    args.extend(["-p".into(), port.clone()]);
    let server = spawn(program, &args);
    let start = Instant::now();
    while !listening(port.parse().unwrap()) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{program} server never listened on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut cargs = args.clone();
    cargs.push("127.0.0.1".into());
    let mut children = vec![(format!("server {program}"), server)];
    children.extend((0..clients).map(|i| {
        (
            format!("client {i} {client_program}"),
            spawn(client_program, &cargs),
        )
    }));
    let mut outputs = wait_all(children, LIMIT);
    let cs = outputs.split_off(1);
    (outputs.remove(0), cs)
}

/// The outputs of a server and its clients, which must all have exited 0.
fn checked_run(program: &str, args: &[&str], s: Output, cs: Vec<Output>) -> (Output, Vec<Output>) {
    let (sout, serr) = text(&s);
    let mut report = format!(
        "{program} {args:?}\n-- server ({:?}) stdout:\n{sout}\nstderr:\n{serr}",
        s.status
    );
    for (i, c) in cs.iter().enumerate() {
        let (cout, cerr) = text(c);
        report += &format!(
            "\n-- client {i} ({:?}) stdout:\n{cout}\nstderr:\n{cerr}",
            c.status
        );
    }
    assert!(
        s.status.success() && cs.iter().all(|c| c.status.success()),
        "{report}"
    );
    for o in cs.iter().chain([&s]) {
        assert!(!text(o).1.contains("version information"), "{report}");
    }
    (s, cs)
}

fn pingpong(program: &str, extra: &[&str]) {
    let gid = gid_index();
    let mut args = vec!["-d", "sv_lo", "-g", gid.as_str(), "-n", "50", "-c"];
    args.extend_from_slice(extra);
    let (c, s) = pair(program, &args);
    for o in [&c, &s] {
        let (out, _) = text(o);
        assert!(out.contains("iters in"), "{program}: {out}");
        assert!(out.contains("GID ::ffff:127.0.0.1"), "{program}: {out}");
    }
}

/// A perftest run: the client prints the results table (and so does the server of the send and
/// write tests).
fn perftest(program: &str, server_prints_table: bool) {
    perftest_with(program, server_prints_table, &[]);
}

/// A perftest run with extra options (e.g. `-c XRC`).
fn perftest_with(program: &str, server_prints_table: bool, extra: &[&str]) {
    let gid = gid_index();
    let mut args = vec!["-d", "sv_lo", "-x", gid.as_str(), "-n", "50", "-F"];
    args.extend_from_slice(extra);
    let (c, s) = pair(program, &args);
    let has_table = |o: &Output| {
        let (out, _) = text(o);
        let mut lines = out.lines().skip_while(|l| !l.trim_start().starts_with("#bytes"));
        lines.next().is_some()
            && lines.next().is_some_and(|l| {
                l.split_whitespace()
                    .next()
                    .is_some_and(|n| n.parse::<u64>().is_ok())
            })
    };
    assert!(has_table(&c), "{program} client: {}", text(&c).0);
    if server_prints_table {
        assert!(has_table(&s), "{program} server: {}", text(&s).0);
    }
}

/// Only a failed run whose output shows perftest's own clock calibration failing is started
/// again; any other failure, and a run that passed, are taken as they are.
#[test]
fn only_perftest_clock_calibration_failures_are_retried() {
    use std::os::unix::process::ExitStatusExt;
    let out = |code: i32, stdout: &str, stderr: &str| Output {
        status: std::process::ExitStatus::from_raw(code << 8),
        stdout: stdout.into(),
        stderr: stderr.into(),
    };
    let calibration = "Correlation coefficient r^2: 0.859318 < 0.9\nCan't produce a report\n";
    assert!(perftest_clock_failed(&out(1, calibration, "")));
    assert!(perftest_clock_failed(&out(1, "", calibration)));
    assert!(!perftest_clock_failed(&out(1, "Couldn't post send\n", "")));
    assert!(!perftest_clock_failed(&out(0, calibration, "")));
}

/// A run that times out names the process that hung, with its threads, and shows what each
/// process printed, so that an intermittent hang can be told apart from a slow run.
#[test]
fn a_timed_out_run_names_the_hung_process() {
    let sh = |script: &str| {
        std::process::Command::new("/bin/sh")
            .args(["-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let children = vec![
        ("server".to_string(), sh("echo waiting; exec sleep 60")),
        ("client 0".to_string(), sh("echo done")),
    ];
    let start = Instant::now();
    let panic = std::panic::catch_unwind(|| wait_all(children, Duration::from_secs(1)))
        .expect_err("the server outlives the limit");
    assert!(
        start.elapsed() < Duration::from_secs(50),
        "the hung process was killed"
    );
    let report = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(report.contains("server (pid "), "{report}");
    assert!(report.contains("still runs"), "{report}");
    assert!(report.contains("\"sleep\""), "its threads: {report}");
    assert!(!report.contains("client 0 (pid "), "the client exited: {report}");
    assert!(report.contains("waiting") && report.contains("done"), "{report}");
}

#[test]
fn ibv_devices_lists_sv_lo() {
    let _serial = serial();
    require("/usr/bin/ibv_devices");
    let o = run_bounded(command("/usr/bin/ibv_devices"), LIMIT);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("sv_lo"), "{out}");
    assert!(err.is_empty(), "{err}");
}

#[test]
fn ibv_devinfo_verbose() {
    let _serial = serial();
    require("/usr/bin/ibv_devinfo");
    let mut c = command("/usr/bin/ibv_devinfo");
    c.arg("-v");
    let o = run_bounded(c, LIMIT);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    for want in [
        "hca_id:\tsv_lo",
        "PORT_ACTIVE",
        "link_layer:\t\tEthernet",
        "::ffff:127.0.0.1, RoCE v2",
        "max_qp:",
        // IBV_DEVICE_XRC in device_cap_flags, and the SRQ limits XRC SRQs count against.
        "\t\t\t\t\tXRC\n",
        // tm_caps of ibv_query_device_ex.
        "\tmax_num_tags:\t\t\t4096\n",
        "\t\t\t\t\tIBV_TM_CAP_RC\n",
        // On-demand paging, explicit and implicit, and the completion clock.
        "ODP_SUPPORT\n",
        "ODP_SUPPORT_IMPLICIT",
        "completion timestamp_mask:\t\t\t0xffffffffffffffff",
        "hca_core_clock:\t\t\t1000000kHZ",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    let max_srq: u32 = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("max_srq:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no max_srq in:\n{out}"));
    assert!(max_srq > 0, "{out}");
    assert!(!err.contains("version information"), "{err}");
}

/// Our Rust `ibv_devinfo -v` prints what rdma-core's prints over our library, line for line
/// (extended capabilities included: ODP, the completion clock, `device_cap_flags_ex`, TSO, RSS,
/// tag matching, device memory), apart from its own packet counters.
#[test]
fn rust_and_c_ibv_devinfo_verbose_agree() {
    let _serial = serial();
    require("/usr/bin/ibv_devinfo");
    let run = |program: &str| {
        let mut c = command(program);
        c.args(["-v", "-d", "sv_lo"]);
        let o = run_bounded(c, LIMIT);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{program}: {out}{err}");
        out
    };
    let c = run("/usr/bin/ibv_devinfo");
    let rust = run(&rust_tool("ibv_devinfo"));
    let ours: Vec<&str> = rust
        .lines()
        .take_while(|l| *l != "\tsoftverbs counters:")
        .collect();
    let theirs: Vec<&str> = c.lines().collect();
    assert!(theirs.iter().any(|l| l.contains("ODP_SUPPORT_IMPLICIT")), "{c}");
    assert!(
        theirs
            .iter()
            .any(|l| l.contains("maximum available device memory")),
        "{c}"
    );
    for (i, (a, b)) in theirs.iter().zip(&ours).enumerate() {
        assert_eq!(a, b, "line {i} differs\n-- rdma-core:\n{c}\n-- ours:\n{rust}");
    }
    assert_eq!(theirs.len(), ours.len(), "-- rdma-core:\n{c}\n-- ours:\n{rust}");
}

#[test]
fn ibv_asyncwatch_waits_for_events() {
    let _serial = serial();
    require("/usr/bin/ibv_asyncwatch");
    require("stdbuf");
    let mut c = command("stdbuf");
    c.args(["-o0", "/usr/bin/ibv_asyncwatch", "-d", "sv_lo"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let still_running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let o = child.wait_with_output().unwrap();
    let (out, err) = text(&o);
    assert!(still_running, "ibv_asyncwatch exited early: {out}{err}");
    assert!(out.contains("sv_lo: async event FD"), "{out}{err}");
}

#[test]
fn ibv_rc_pingpong() {
    pingpong("/usr/bin/ibv_rc_pingpong", &[]);
}

#[test]
fn ibv_rc_pingpong_events() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-e"]);
}

#[test]
fn ibv_rc_pingpong_new_send_api() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-N"]);
}

/// `-t`: completions carry the device clock; each side prints the spread of the intervals
/// between its receive completions, which must be consistent with the measured time per
/// iteration (one receive per iteration).
#[test]
fn ibv_rc_pingpong_completion_timestamps() {
    let gid = gid_index();
    let args = ["-d", "sv_lo", "-g", gid.as_str(), "-n", "200", "-c", "-t"];
    let (c, s) = pair("/usr/bin/ibv_rc_pingpong", &args);
    for o in [&c, &s] {
        let (out, _) = text(o);
        let value = |key: &str| -> f64 {
            out.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_start_matches('=').trim().parse().ok())
                .unwrap_or_else(|| panic!("no {key:?} in:\n{out}"))
        };
        // "200 iters in 0.03 seconds = 146.12 usec/iter"
        let usec_per_iter: f64 = out
            .lines()
            .find(|l| l.ends_with(" usec/iter"))
            .and_then(|l| l.rsplit(" = ").next())
            .and_then(|v| v.trim_end_matches(" usec/iter").parse().ok())
            .unwrap_or_else(|| panic!("no usec/iter in:\n{out}"));
        let (max, min, avg) = (
            value("Max receive completion clock cycles"),
            value("Min receive completion clock cycles"),
            value("Average receive completion clock cycles"),
        );
        assert!(0.0 < min && min <= avg && avg <= max, "{out}");
        // hca_core_clock is 1 GHz: cycles are nanoseconds.
        let avg_usec = avg / 1000.0;
        assert!(
            avg_usec > usec_per_iter / 3.0 && avg_usec < usec_per_iter * 3.0,
            "average interval {avg_usec} us against {usec_per_iter} us per iteration:\n{out}"
        );
    }
}

/// `-t -e`: with events, the tool polls once per CQ event with `ibv_start_poll` and treats an
/// empty CQ as fatal, while one pass consumes up to two completions; an event raised for a
/// completion that pass already consumed must not reach it.
#[test]
fn ibv_rc_pingpong_completion_timestamps_with_events() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-t", "-e", "-n", "300"]);
}

/// The other combinations of the new verbs with events and with each other.
#[test]
fn ibv_rc_pingpong_combined_options() {
    for extra in [
        &["-j", "-t", "-e"][..],
        &["-o", "-t", "-e"],
        &["-O", "-P", "-e"],
        &["-N", "-t", "-e"],
        &["-j", "-N"],
        &["-j", "-t"],
        &["-o", "-N"],
    ] {
        pingpong("/usr/bin/ibv_rc_pingpong", extra);
    }
}

/// `-o`: the buffer is an explicit on-demand-paging region.
#[test]
fn ibv_rc_pingpong_odp() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-o"]);
}

/// `-O`: one implicit ODP region over the whole address space, addressed by absolute address.
#[test]
fn ibv_rc_pingpong_implicit_odp() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-O"]);
}

/// `-P` with `-o` and with `-O`: `ibv_advise_mr` prefetches the buffer before use.
#[test]
fn ibv_rc_pingpong_odp_prefetch() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-o", "-P"]);
    pingpong("/usr/bin/ibv_rc_pingpong", &["-O", "-P"]);
}

#[test]
fn ibv_srq_pingpong_odp() {
    pingpong("/usr/bin/ibv_srq_pingpong", &["-o"]);
}

/// `-j`: the buffers are device memory (`ibv_alloc_dm`, `ibv_reg_dm_mr`, zero-based SGEs), and
/// `-c` checks the received bytes through `ibv_memcpy_from_dm`.
#[test]
fn ibv_rc_pingpong_device_memory() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-j"]);
}

#[test]
fn ibv_uc_pingpong() {
    pingpong("/usr/bin/ibv_uc_pingpong", &[]);
}

#[test]
fn ibv_ud_pingpong() {
    pingpong("/usr/bin/ibv_ud_pingpong", &[]);
}

#[test]
fn ibv_srq_pingpong() {
    pingpong("/usr/bin/ibv_srq_pingpong", &[]);
}

/// rdma-core's XRC ping-pong: each process opens the XRC domain of `/tmp/xrc_domain`, creates
/// an XRC SRQ, an XRC_RECV and an XRC_SEND QP, and exchanges SRQ numbers over TCP.
fn xsrq_pingpong(extra: &[&str]) {
    let gid = gid_index();
    let mut args = vec!["-d", "sv_lo", "-g", gid.as_str(), "-n", "50"];
    args.extend_from_slice(extra);
    let (c, s) = pair("/usr/bin/ibv_xsrq_pingpong", &args);
    let (cout, _) = text(&c);
    let (sout, _) = text(&s);
    for out in [&cout, &sout] {
        assert!(out.contains("success"), "{out}");
        assert!(out.contains("GID ::ffff:127.0.0.1"), "{out}");
    }
    // Each side printed its own SRQ number, and the other side saw the same one.
    let srqn = |out: &str, who: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(who))
            .and_then(|l| l.split("SRQN ").nth(1))
            .and_then(|l| l.split(',').next())
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no {who} SRQN in {out}"))
    };
    assert_eq!(srqn(&cout, "local:"), srqn(&sout, "remote:"));
    assert_eq!(srqn(&sout, "local:"), srqn(&cout, "remote:"));
}

#[test]
fn ibv_xsrq_pingpong() {
    xsrq_pingpong(&[]);
}

/// With several clients the server reaches client `i`'s SRQ through the target QP of client
/// `(i + n) % clients`, another process: every client's target must deliver into the SRQs of
/// the other clients sharing the domain of `/tmp/xrc_domain`.
#[test]
fn ibv_xsrq_pingpong_several_clients() {
    let gid = gid_index();
    for (clients, extra) in [
        ("3", &["-n", "200"][..]),
        ("2", &["-e", "-s", "5000", "-m", "256"][..]),
    ] {
        let mut args = vec!["-d", "sv_lo", "-g", gid.as_str(), "-c", clients];
        args.extend_from_slice(extra);
        let n: usize = clients.parse().unwrap();
        let (s, cs) = server_and_clients(
            "/usr/bin/ibv_xsrq_pingpong",
            "/usr/bin/ibv_xsrq_pingpong",
            &args,
            n,
        );
        let (sout, _) = text(&s);
        assert!(sout.contains("success"), "{sout}");
        // The server printed one remote SRQ number per client, each that client's own.
        for c in &cs {
            let (cout, _) = text(c);
            assert!(cout.contains("success"), "{cout}");
            let local = cout
                .lines()
                .find(|l| l.trim_start().starts_with("local:"))
                .and_then(|l| l.split("SRQN ").nth(1))
                .and_then(|l| l.split(',').next())
                .unwrap_or_else(|| panic!("no SRQN in {cout}"));
            assert!(
                sout.lines()
                    .any(|l| l.trim_start().starts_with("remote:") && l.contains(&format!("SRQN {local},"))),
                "client SRQN {local} unknown to the server:\n{sout}"
            );
        }
    }
}

/// `-o`: the buffers are on-demand-paging regions, reached through XRC QPs and SRQs
/// (`xrc_odp_caps`); with and without events.
#[test]
fn ibv_xsrq_pingpong_odp() {
    xsrq_pingpong(&["-o"]);
    xsrq_pingpong(&["-o", "-e"]);
}

#[test]
fn ibv_xsrq_pingpong_events_and_small_mtu() {
    xsrq_pingpong(&["-e", "-m", "256", "-s", "3000"]);
}

#[test]
fn ib_send_bw() {
    perftest("/usr/bin/ib_send_bw", true);
}

/// A UC flood of 64 KiB messages between two processes on loopback: nothing may be lost on the
/// way (the server waits for every message), so this hangs if the receiver's socket overflows or
/// the packets of a message are reordered on the host.
#[test]
fn ib_send_bw_uc_flood_loses_nothing() {
    let gid = gid_index();
    let (c, s) = pair(
        "/usr/bin/ib_send_bw",
        &[
            "-d",
            "sv_lo",
            "-x",
            gid.as_str(),
            "-c",
            "UC",
            "-s",
            "65536",
            "-n",
            "2000",
            "-F",
        ],
    );
    for o in [&c, &s] {
        let (out, _) = text(o);
        assert!(out.contains(" 65536      2000 "), "{out}");
    }
}

#[test]
fn ib_send_lat() {
    perftest("/usr/bin/ib_send_lat", true);
}

#[test]
fn ib_write_bw() {
    perftest("/usr/bin/ib_write_bw", true);
}

#[test]
fn ib_write_lat() {
    perftest("/usr/bin/ib_write_lat", true);
}

#[test]
fn ib_read_bw() {
    perftest("/usr/bin/ib_read_bw", true);
}

#[test]
fn ib_read_lat() {
    perftest("/usr/bin/ib_read_lat", false);
}

#[test]
fn ib_atomic_bw() {
    perftest("/usr/bin/ib_atomic_bw", true);
}

#[test]
fn ib_atomic_lat() {
    perftest("/usr/bin/ib_atomic_lat", false);
}

/// softverbs' own Rust tool `name`, which `cargo test --workspace` builds beside this test.
fn rust_tool(name: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().and_then(|d| d.parent()).unwrap().join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace (cargo test --workspace builds it)",
        path.display()
    );
    path.to_string_lossy().into_owned()
}

/// rdma-core's C ibv_rc_pingpong and softverbs' Rust one, in both roles: the same TCP exchange
/// and the same packets on the wire.
fn c_and_rust_rc_pingpong(c_is_server: bool) {
    c_and_rust_rc_pingpong_with(c_is_server, &[]);
}

/// As [`c_and_rust_rc_pingpong`], both sides with the options `extra` too.
fn c_and_rust_rc_pingpong_with(c_is_server: bool, extra: &[&str]) {
    let gid = gid_index();
    let rust = rust_tool("ibv_rc_pingpong");
    let mut args = vec!["-d", "sv_lo", "-g", gid.as_str(), "-n", "100", "-s", "8192", "-c"];
    args.extend_from_slice(extra);
    let (server, client) = if c_is_server {
        ("/usr/bin/ibv_rc_pingpong", rust.as_str())
    } else {
        (rust.as_str(), "/usr/bin/ibv_rc_pingpong")
    };
    let (c, s) = pair_of(server, client, &args);
    for o in [&c, &s] {
        let (out, _) = text(o);
        assert!(out.contains("1638400 bytes in"), "{extra:?}: {out}");
        assert!(out.contains("100 iters in"), "{extra:?}: {out}");
        assert!(!out.contains("invalid data"), "{extra:?}: {out}");
        let ts = extra.contains(&"-t");
        for key in ["Max", "Min", "Average"] {
            let line = format!("{key} receive completion clock cycles = ");
            assert_eq!(out.contains(&line), ts, "{extra:?}: {out}");
        }
    }
}

/// The C and Rust ibv_rc_pingpong in both roles with on-demand paging (explicit, implicit,
/// prefetched), completion timestamps and device memory: each option changes only where the
/// buffer lives and what is printed, never the wire.
#[test]
fn c_and_rust_rc_pingpong_odp_timestamps_and_device_memory() {
    for extra in [&["-o", "-e"][..], &["-O", "-P"], &["-t"], &["-j", "-t", "-e"]] {
        for c_is_server in [true, false] {
            c_and_rust_rc_pingpong_with(c_is_server, extra);
        }
    }
}

#[test]
fn c_server_rust_client_rc_pingpong() {
    c_and_rust_rc_pingpong(true);
}

#[test]
fn rust_server_c_client_rc_pingpong() {
    c_and_rust_rc_pingpong(false);
}

/// rdma-core's C ibv_xsrq_pingpong and softverbs' Rust one, in both roles.
fn c_and_rust_xsrq_pingpong(c_is_server: bool) {
    c_and_rust_xsrq_pingpong_with(c_is_server, &[]);
}

/// As [`c_and_rust_xsrq_pingpong`], both sides with the options `extra` too.
fn c_and_rust_xsrq_pingpong_with(c_is_server: bool, extra: &[&str]) {
    let gid = gid_index();
    let rust = rust_tool("ibv_xsrq_pingpong");
    let mut args = vec!["-d", "sv_lo", "-g", gid.as_str(), "-n", "100", "-s", "6000"];
    args.extend_from_slice(extra);
    let (server, client) = if c_is_server {
        ("/usr/bin/ibv_xsrq_pingpong", rust.as_str())
    } else {
        (rust.as_str(), "/usr/bin/ibv_xsrq_pingpong")
    };
    let (c, s) = pair_of(server, client, &args);
    for o in [&c, &s] {
        let (out, _) = text(o);
        assert!(out.contains("SRQN") && out.contains("success"), "{out}");
    }
}

#[test]
fn c_server_rust_client_xsrq_pingpong() {
    c_and_rust_xsrq_pingpong(true);
}

#[test]
fn rust_server_c_client_xsrq_pingpong() {
    c_and_rust_xsrq_pingpong(false);
}

/// `-o` on both sides, in both roles.
#[test]
fn c_and_rust_xsrq_pingpong_odp() {
    for c_is_server in [true, false] {
        c_and_rust_xsrq_pingpong_with(c_is_server, &["-o"]);
    }
}

/// perftest over XRC (`-c XRC`): XRC domains from files, XRC SRQs, XRC_SEND and XRC_RECV QPs,
/// and, in its default mode, `ibv_wr_set_xrc_srqn`.
#[test]
fn perftest_over_xrc() {
    for (program, server_table) in [
        ("/usr/bin/ib_send_bw", true),
        ("/usr/bin/ib_write_bw", true),
        ("/usr/bin/ib_read_bw", true),
        ("/usr/bin/ib_atomic_bw", false),
        ("/usr/bin/ib_send_lat", true),
    ] {
        perftest_with(program, server_table, &["-c", "XRC"]);
    }
    // Several XRC pairs each way: one SRQ per side, shared by every target.
    perftest_with("/usr/bin/ib_send_bw", true, &["-c", "XRC", "-q", "3", "-b"]);
}

/// As [`perftest_over_xrc`], through `ibv_post_send` with `qp_type.xrc.remote_srqn`.
#[test]
fn perftest_over_xrc_old_post_send() {
    perftest_with(
        "/usr/bin/ib_write_bw",
        true,
        &["-c", "XRC", "--use_old_post_send"],
    );
}

/// perftest's raw Ethernet bandwidth test between two processes on sv_lo: the client's raw QP
/// sends UDP frames out of the loopback interface, the server's flow (destination MAC, IPs and
/// UDP ports) steers them to its raw QP. Both report a non-empty table of iterations. They run
/// in a namespace of their own, whose loopback carries nothing else.
#[test]
fn raw_ethernet_bw() {
    let _serial = serial();
    require("/usr/bin/raw_ethernet_bw");
    let ns = Netns::new("rawbw");
    let program = "ip";
    let (sport, dport) = (free_port().to_string(), free_port().to_string());
    let args = |role: &str, secs: &str| -> Vec<String> {
        [
            "netns",
            "exec",
            &ns.0,
            "/usr/bin/raw_ethernet_bw",
            "-d",
            "sv_lo",
            role,
            "-B",
            "00:00:00:00:00:00",
            "-E",
            "00:00:00:00:00:00",
            "-J",
            "127.0.0.1",
            "-j",
            "127.0.0.1",
            "-K",
            &dport,
            "-k",
            &sport,
            "-D",
            secs,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let run = || {
        let server = spawn(program, &args("--server", "6"));
        // The server receives for six seconds; the client starts well inside them.
        std::thread::sleep(Duration::from_secs(1));
        let client = spawn(program, &args("--client", "2"));
        let mut outputs = wait_all(vec![("server".into(), server), ("client".into(), client)], LIMIT);
        let c = outputs.remove(1);
        (c, outputs.remove(0))
    };
    let mut attempt = 1;
    let (c, s) = loop {
        let (c, s) = run();
        if attempt == PERFTEST_ATTEMPTS || !(perftest_clock_failed(&c) || perftest_clock_failed(&s)) {
            break (c, s);
        }
        attempt += 1;
    };
    let iterations = |o: &Output| {
        let (out, err) = text(o);
        assert!(o.status.success(), "{out}\n{err}");
        let mut lines = out.lines().skip_while(|l| !l.trim_start().starts_with("#bytes"));
        lines.next();
        let row: Vec<u64> = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .take(2)
            .filter_map(|n| n.parse().ok())
            .collect();
        assert_eq!(row.len(), 2, "no results row:\n{out}");
        row[1]
    };
    let (sent, received) = (iterations(&c), iterations(&s));
    assert!(sent > 0 && received > 0, "sent {sent}, received {received}");
    assert!(received <= sent, "sent {sent}, received {received}");
}
