//! Debian's rdmacm-utils between two processes over our `librdmacm.so.1` and
//! `libibverbs.so.1`: `rping`, `ucmatose`, `udaddy`, `rdma_server`/`rdma_client`, and perftest
//! with `-R`. Each pair runs in a network namespace of its own (root), so the fixed or default
//! ports these programs use cannot collide with anything else; every run is bounded.

mod common;
#[path = "../../ibverbs/tests/common/perftest_clock.rs"]
mod perftest_clock;

use common::*;
use perftest_clock::{perftest_clock_failed, PERFTEST_ATTEMPTS};
use std::time::Duration;

#[test]
fn rping_ten_verified_pings() {
    let _serial = serial();
    require("/usr/bin/rping");
    let ns = Netns::new("rping");
    let (s, c) = pair(
        &ns,
        ("/usr/bin/rping", &["-s", "-a", "127.0.0.1", "-C", "10", "-v"]),
        ("/usr/bin/rping", &["-c", "-a", "127.0.0.1", "-C", "10", "-v"]),
    );
    assert!(c.status.success(), "client: {}\nserver: {}", text(&c), text(&s));
    let out = String::from_utf8_lossy(&c.stdout);
    for i in 0..10 {
        assert!(
            out.contains(&format!("ping data: rdma-ping-{i}: ")),
            "client: {}",
            text(&c)
        );
    }
    let sout = String::from_utf8_lossy(&s.stdout);
    // The server reads each ping with RDMA READ and prints it.
    assert_eq!(
        sout.matches("server ping data: rdma-ping-").count(),
        10,
        "server: {}",
        text(&s)
    );
}

/// `rping -q`: each side creates and moves its own QP (`rdma_init_qp_attr`), so the client
/// answers CONNECT_RESPONSE with `rdma_establish`, which reports no event of its own (an extra
/// ESTABLISHED would wake rping's client out of turn).
#[test]
fn rping_with_qps_the_programs_own() {
    let _serial = serial();
    require("/usr/bin/rping");
    let ns = Netns::new("rpingq");
    let (s, c) = pair(
        &ns,
        (
            "/usr/bin/rping",
            &["-s", "-q", "-a", "127.0.0.1", "-C", "10", "-V", "-S", "2000"],
        ),
        (
            "/usr/bin/rping",
            &["-c", "-q", "-a", "127.0.0.1", "-C", "10", "-V", "-S", "2000"],
        ),
    );
    assert!(c.status.success(), "client: {}\nserver: {}", text(&c), text(&s));
    assert!(s.status.success(), "server: {}", text(&s));
}

/// Runs `program` as server and client (`-s 127.0.0.1`) with 20 connections and 50 messages
/// each way on every one; both must report their transfers complete.
fn twenty_connections(program: &str, tag: &str) {
    let _serial = serial();
    require(program);
    let ns = Netns::new(tag);
    let (s, c) = pair(
        &ns,
        (program, &["-c", "20", "-C", "50"]),
        (program, &["-s", "127.0.0.1", "-c", "20", "-C", "50"]),
    );
    for (who, o) in [("server", &s), ("client", &c)] {
        assert!(o.status.success(), "{who}: {}", text(o));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains("data transfers complete") && out.contains("return status 0"),
            "{who}: {}",
            text(o)
        );
    }
}

#[test]
fn ucmatose_server_and_client() {
    twenty_connections("/usr/bin/ucmatose", "ucma");
}

#[test]
fn udaddy_sidr_server_and_client() {
    twenty_connections("/usr/bin/udaddy", "udaddy");
}

#[test]
fn rdma_server_and_rdma_client_synchronous_api() {
    let _serial = serial();
    require("/usr/bin/rdma_server");
    let ns = Netns::new("rsrv");
    let (s, c) = pair(
        &ns,
        ("/usr/bin/rdma_server", &[]),
        ("/usr/bin/rdma_client", &["-s", "127.0.0.1"]),
    );
    for (who, o) in [("rdma_server", &s), ("rdma_client", &c)] {
        assert!(o.status.success(), "{who}: {}", text(o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("end 0"),
            "{who}: {}",
            text(o)
        );
    }
}

/// `tests/c/cm_calls.c`, compiled against the system headers: devices, options, QP attributes,
/// addresses and ports, a rejection with private data both ways, in one process.
#[test]
fn c_program_connection_manager_calls() {
    c_program("cm_calls", "calls");
}

/// perftest's `program` with `-R`: its control connection and then the measured QPs are set
/// up through the connection manager. The server listens again right after an exchange with
/// the client over the control connection, so the client's second request must not be
/// rejected for arriving first.
fn perftest_over_rdma_cm(program: &str, tag: &str, args: &[&str]) {
    let _serial = serial();
    let path = format!("/usr/bin/{program}");
    require(&path);
    let ns = Netns::new(tag);
    let mut server: Vec<&str> = vec!["-d", "sv_lo", "-R"];
    server.extend_from_slice(args);
    let mut client = server.clone();
    client.push("127.0.0.1");
    let mut attempt = 1;
    let (s, c) = loop {
        let (s, c) = pair(&ns, (&path, &server), (&path, &client));
        // Either side's calibration may fail (the other then fails to meet it): run again.
        if attempt < PERFTEST_ATTEMPTS && (perftest_clock_failed(&s) || perftest_clock_failed(&c)) {
            println!("{program}: perftest's clock calibration failed; again");
            attempt += 1;
            continue;
        }
        break (s, c);
    };
    for (who, o) in [("server", &s), ("client", &c)] {
        assert!(o.status.success(), "{program} {who}: {}", text(o));
    }
    // The result table: a header naming the columns, then one line per size with the
    // iteration count given.
    let out = String::from_utf8_lossy(&c.stdout);
    assert!(out.contains("#bytes"), "{program} client: {}", text(&c));
    let rows = out
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some("200"))
        .count();
    assert_eq!(rows, 1, "{program} client: {}", text(&c));
}

#[test]
fn perftest_send_bw_with_rdma_cm() {
    perftest_over_rdma_cm("ib_send_bw", "psbw", &["-n", "200"]);
}

#[test]
fn perftest_write_bw_with_rdma_cm() {
    perftest_over_rdma_cm("ib_write_bw", "pwbw", &["-n", "200"]);
}

#[test]
fn perftest_read_bw_with_rdma_cm() {
    perftest_over_rdma_cm("ib_read_bw", "prbw", &["-n", "200"]);
}

#[test]
fn perftest_send_lat_with_rdma_cm() {
    perftest_over_rdma_cm("ib_send_lat", "pslat", &["-n", "200", "-s", "8"]);
}

/// `cmtime`: 200 connections set up and torn down, each step timed. The server serves until
/// it is stopped; the client must report every step.
#[test]
fn cmtime_two_hundred_connections() {
    let _serial = serial();
    require("/usr/bin/cmtime");
    let ns = Netns::new("cmtime");
    let mut srv = ns
        .command("/usr/bin/cmtime", &["-b", "127.0.0.1", "-c", "200"])
        .spawn()
        .expect("spawn the server");
    std::thread::sleep(Duration::from_millis(300));
    let c = wait_bounded(
        ns.command("/usr/bin/cmtime", &["-s", "127.0.0.1", "-c", "200"])
            .spawn()
            .expect("spawn the client"),
        Duration::from_secs(60),
    );
    let _ = srv.kill();
    let s = srv.wait_with_output().expect("server output");
    assert!(c.status.success(), "client: {}\nserver: {}", text(&c), text(&s));
    let out = String::from_utf8_lossy(&c.stdout);
    for step in [
        "create id",
        "resolve addr",
        "resolve route",
        "create qp",
        "connect",
        "disconnect",
        "destroy",
    ] {
        let row = out
            .lines()
            .find(|l| l.split(':').next().map(str::trim) == Some(step))
            .unwrap_or_else(|| panic!("no {step} row: {}", text(&c)));
        let numbers: Vec<f64> = row
            .split(':')
            .nth(1)
            .unwrap()
            .split_whitespace()
            .map(|v| v.parse().expect("a number"))
            .collect();
        assert_eq!(numbers.len(), 4, "{row}");
    }
}

/// `mckey`: a receiving process joins a multicast group, then a sending process joins it and
/// sends 10 datagrams to the group; the receiver must get all of them.
#[test]
fn mckey_multicast_between_two_processes() {
    use std::io::{BufRead, BufReader};
    let _serial = serial();
    require("/usr/bin/mckey");
    let ns = Netns::new("mckey");
    let common = ["-m", "239.1.2.3", "-b", "127.0.0.1", "-C", "10"];
    let mut receiver = ns
        .command("/usr/bin/mckey", &common)
        .spawn()
        .expect("spawn the receiver");
    // Only once it has joined (it says so) is the group's traffic its own.
    let stdout = receiver.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.contains("receiving data transfers") {
                let _ = tx.send(());
            }
            lines.push(line);
        }
        lines
    });
    let joined = rx.recv_timeout(Duration::from_secs(20)).is_ok();
    let sender = joined.then(|| {
        let mut args = common.to_vec();
        args.push("-s");
        wait_bounded(
            ns.command("/usr/bin/mckey", &args)
                .spawn()
                .expect("spawn the sender"),
            Duration::from_secs(30),
        )
    });
    let r = wait_bounded(receiver, Duration::from_secs(30));
    let lines = reader.join().expect("reader").join("\n");
    assert!(joined, "the receiver never joined: {lines}\n{}", text(&r));
    let s = sender.expect("sent");
    assert!(s.status.success(), "sender: {}", text(&s));
    assert!(r.status.success(), "receiver: {lines}\n{}", text(&r));
    assert!(
        lines.contains("data transfers complete") && lines.contains("return status 0"),
        "receiver: {lines}"
    );
}
