//! Debian's rdmacm-utils between two processes over our `librdmacm.so.1` and
//! `libibverbs.so.1`: `rping`, `ucmatose`, `udaddy`, `rdma_server`/`rdma_client`, and perftest
//! with `-R`. Each pair runs in a network namespace of its own (root), so the fixed or default
//! ports these programs use cannot collide with anything else; every run is bounded.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A directory with `librdmacm.so.1` and `libibverbs.so.1`, the libraries cargo built for this
/// test run (the ibverbs one as a dev-dependency).
fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable path");
        let deps = exe.parent().expect("target/<profile>/deps");
        let dir = std::env::temp_dir().join(format!("softverbs-rdmacm-progs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (lib, name) in [
            ("librdmacm.so", "librdmacm.so.1"),
            ("libibverbs.so", "libibverbs.so.1"),
        ] {
            let target = deps.join(lib);
            assert!(target.exists(), "{} not built", target.display());
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&target, &link).unwrap();
        }
        dir
    })
}

/// One pair of programs at a time, so that a slow machine shared with other work does not push
/// them past their time limits.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn require(path: &str) {
    assert!(
        Path::new(path).exists(),
        "{path} is missing: run scripts/setup-deps (rdmacm-utils)"
    );
}

/// A network namespace with only its loopback up; removed on drop.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Self {
        let name = format!("svcm{tag}{}", std::process::id());
        for args in [
            vec!["netns", "add", &name],
            vec!["-n", &name, "link", "set", "lo", "up"],
        ] {
            let o = Command::new("ip").args(&args).output().expect("ip runs");
            assert!(
                o.status.success(),
                "ip {args:?} (needs root): {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        Self(name)
    }

    /// `program args` inside the namespace, over our libraries.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0, "env"])
            .arg(format!("LD_LIBRARY_PATH={}", lib_dir().display()))
            .arg("stdbuf")
            .arg("-oL")
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Waits for `child`, killing it after `limit`.
fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `server` then, once it listens, `client`, each bounded; the client is retried while the
/// server is not listening yet (it fails fast with a rejection and no output then). Returns both
/// outputs.
fn pair(ns: &Netns, server: (&str, &[&str]), client: (&str, &[&str])) -> (Output, Output) {
    let srv = ns.command(server.0, server.1).spawn().expect("spawn the server");
    let start = Instant::now();
    let cli = loop {
        std::thread::sleep(Duration::from_millis(300));
        let o = wait_bounded(
            ns.command(client.0, client.1).spawn().expect("spawn the client"),
            Duration::from_secs(30),
        );
        // Only a rejection with nothing done (the server is not listening yet) is retried.
        let rejected = String::from_utf8_lossy(&o.stderr).contains("REJECTED") && o.stdout.is_empty();
        if !rejected || start.elapsed() > Duration::from_secs(10) {
            break o;
        }
    };
    (wait_bounded(srv, Duration::from_secs(30)), cli)
}

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

/// Compiles `tests/c/<name>.c` against the system headers and our libraries, runs it in a
/// namespace of its own and expects it to print "ok".
fn c_program(name: &str, tag: &str) {
    let _serial = serial();
    require("/usr/include/rdma/rdma_cma.h");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let bin = lib_dir().join(name);
    let cc = Command::new("gcc")
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .arg(format!("-L{}", lib_dir().display()))
        .args(["-l:librdmacm.so.1", "-l:libibverbs.so.1", "-Wl,-z,now", "-Werror"])
        .output()
        .expect("gcc runs");
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    let ns = Netns::new(tag);
    let o = wait_bounded(
        ns.command(bin.to_str().unwrap(), &[]).spawn().expect("spawn"),
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "ok\n");
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
    let (s, c) = pair(&ns, (&path, &server), (&path, &client));
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

// ---- rsockets ---------------------------------------------------------------------------

/// `tests/c/rsocket_calls.c`: the errno of every failing rsocket call, socket options,
/// non-blocking connect, `rselect` and `rpoll` over an rsocket and a pipe, vectored and
/// message calls, half close, a refused connection, datagrams.
#[test]
fn c_program_rsocket_calls() {
    c_program("rsocket_calls", "rscalls");
}

/// A server started in `ns`, with its output collected by a thread.
struct Served {
    child: Child,
    lines: std::thread::JoinHandle<Vec<String>>,
}

impl Served {
    /// Starts `program args` and waits (at most 60 s) for a line of its output containing
    /// `ready`, which these programs print once they listen.
    fn start(ns: &Netns, program: &str, args: &[&str], ready: &str) -> Self {
        Self::spawn(ns.command(program, args), program, ready)
    }

    /// As [`Served::start`], for a command made by the caller.
    fn spawn(mut cmd: Command, program: &str, ready: &str) -> Self {
        use std::io::Read;
        let mut child = cmd.spawn().expect("spawn the server");
        let mut stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        let ready = ready.to_string();
        // Raw bytes, not lines: some prompts end without a newline.
        let lines = std::thread::spawn(move || {
            let (mut all, mut buf) = (Vec::new(), [0u8; 4096]);
            while let Ok(n @ 1..) = stdout.read(&mut buf) {
                all.extend_from_slice(&buf[..n]);
                if String::from_utf8_lossy(&all).contains(&ready) {
                    let _ = tx.send(());
                }
            }
            String::from_utf8_lossy(&all)
                .lines()
                .map(str::to_string)
                .collect()
        });
        let up = rx.recv_timeout(Duration::from_secs(60)).is_ok();
        let s = Self { child, lines };
        if !up {
            let (o, lines) = s.finish(Duration::ZERO);
            panic!("{program} never got ready: {lines}\n{}", text(&o));
        }
        s
    }

    /// Waits for the server to end (killing it after `limit`); its output and its stdout.
    fn finish(self, limit: Duration) -> (Output, String) {
        let o = wait_bounded(self.child, limit);
        let lines = self.lines.join().expect("reader").join("\n");
        (o, lines)
    }
}

/// A result row of rstream, riostream or udpong: the line whose first column is `name`.
fn row<'a>(out: &'a str, name: &str) -> Option<Vec<&'a str>> {
    out.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cols| cols.first() == Some(&name))
}

/// Runs `program` as server and client (`-s 127.0.0.1`) with `args` each, in `ns`; both must
/// succeed and print the result rows `rows`. Returns the client's output.
fn rsocket_pair(ns: &Netns, program: &str, args: &[&str], rows: &[&str], limit: Duration) -> String {
    let srv = Served::start(ns, program, args, "usec/xfer");
    let mut cargs = vec!["-s", "127.0.0.1"];
    cargs.extend_from_slice(args);
    let c = wait_bounded(
        ns.command(program, &cargs).spawn().expect("spawn the client"),
        limit,
    );
    let (s, sout) = srv.finish(Duration::from_secs(30));
    let cout = String::from_utf8_lossy(&c.stdout).into_owned();
    let what = format!("{program} {args:?}");
    assert!(
        c.status.success(),
        "{what} client: {}\nserver: {sout}\n{}",
        text(&c),
        text(&s)
    );
    assert!(s.status.success(), "{what} server: {sout}\n{}", text(&s));
    for r in rows {
        assert!(
            row(&cout, r).is_some(),
            "{what}: no {r} row from the client: {}",
            text(&c)
        );
        assert!(
            row(&sout, r).is_some(),
            "{what}: no {r} row from the server: {sout}"
        );
    }
    cout
}

/// rstream with 1,000 transfers of 4 KiB each way: non-blocking (its default), blocking,
/// through `rpoll` non-blocking, through `rpoll` blocking, and with keepalives.
#[test]
fn rstream_4k_transfers_in_every_mode() {
    let _serial = serial();
    require("/usr/bin/rstream");
    let ns = Netns::new("rstr");
    for mode in [
        &[][..],
        &["-T", "b"],
        &["-T", "a"],
        &["-T", "b", "-T", "a"],
        &["-k", "1"],
    ] {
        let mut args = vec!["-S", "4096", "-C", "1000"];
        args.extend_from_slice(mode);
        let out = rsocket_pair(
            &ns,
            "/usr/bin/rstream",
            &args,
            &["custom"],
            Duration::from_secs(120),
        );
        let cols = row(&out, "custom").unwrap();
        assert_eq!((cols[1], cols[2]), ("4k", "1k"), "{out}");
    }
}

/// rstream's default run: latency and bandwidth from 64 bytes to 1 MiB, data verified.
#[test]
fn rstream_default_sizes_verified() {
    let _serial = serial();
    require("/usr/bin/rstream");
    let ns = Netns::new("rsdef");
    rsocket_pair(
        &ns,
        "/usr/bin/rstream",
        &["-T", "v"],
        &[
            "64_lat", "4k_lat", "64k_lat", "1m_lat", "64_bw", "4k_bw", "64k_bw", "1m_bw",
        ],
        Duration::from_secs(900),
    );
}

/// rstream with large transfers, data verified: blocking through `rpoll` (sleeping waits),
/// and non-blocking with small socket buffers (the credit and buffer updates go round many
/// times per transfer).
#[test]
fn rstream_large_transfers_verified() {
    let _serial = serial();
    require("/usr/bin/rstream");
    let ns = Netns::new("rsbig");
    for args in [
        &["-S", "1000000", "-C", "20", "-T", "b", "-T", "a", "-T", "v"][..],
        &["-S", "300000", "-C", "20", "-B", "16384", "-T", "v"],
    ] {
        rsocket_pair(
            &ns,
            "/usr/bin/rstream",
            args,
            &["custom"],
            Duration::from_secs(120),
        );
    }
}

/// riostream: each side maps its buffer (`riomap`) and the other writes into it directly
/// (`riowrite`), data verified; non-blocking and blocking.
#[test]
fn riostream_direct_writes_verified() {
    let _serial = serial();
    require("/usr/bin/riostream");
    let ns = Netns::new("rio");
    for args in [
        &["-S", "4096", "-C", "200", "-T", "v"][..],
        &["-S", "1000000", "-C", "10", "-T", "v", "-T", "b"],
    ] {
        rsocket_pair(
            &ns,
            "/usr/bin/riostream",
            args,
            &["custom"],
            Duration::from_secs(120),
        );
    }
}

/// rcopy: a 4 MiB file of random bytes copied to the server, compared byte for byte.
#[test]
fn rcopy_copies_a_file_byte_for_byte() {
    let _serial = serial();
    require("/usr/bin/rcopy");
    let ns = Netns::new("rcopy");
    let dir = lib_dir().join("rcopy");
    std::fs::create_dir_all(&dir).unwrap();
    let (src, dst) = (dir.join("source"), dir.join("copy"));
    let mut data = vec![0u8; 4 << 20];
    let mut x = 0x2545_f491_4f6c_dd1du64 ^ u64::from(std::process::id());
    for b in &mut data {
        // xorshift: varied bytes, no pattern the copy could get right by accident.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    std::fs::write(&src, &data).unwrap();
    let _ = std::fs::remove_file(&dst);
    let srv = Served::start(&ns, "/usr/bin/rcopy", &[], "waiting for connection");
    let target = format!("127.0.0.1:{}", dst.display());
    let c = wait_bounded(
        ns.command("/usr/bin/rcopy", &[src.to_str().unwrap(), &target])
            .spawn()
            .expect("spawn the client"),
        Duration::from_secs(120),
    );
    // The server serves until it is stopped.
    let (s, sout) = srv.finish(Duration::from_millis(500));
    assert!(
        c.status.success(),
        "client: {}\nserver: {sout}\n{}",
        text(&c),
        text(&s)
    );
    let cout = String::from_utf8_lossy(&c.stdout);
    assert!(
        cout.contains("done") && cout.contains("4194304 bytes"),
        "{}",
        text(&c)
    );
    assert!(sout.contains("4194304 bytes"), "server: {sout}");
    let copy = std::fs::read(&dst).unwrap();
    assert_eq!(copy.len(), data.len());
    assert!(copy == data, "the copy differs from the source");
    let _ = std::fs::remove_dir_all(&dir);
}

/// udpong (datagram rsockets): a bandwidth run (the server counts what arrived), echoed
/// latency runs non-blocking and blocking. udpong resends a request whose echo takes more
/// than 1 ms, and each late echo costs every later request one more round trip, so on a
/// loaded machine its echo runs grow with the square of their count (its full default run,
/// 100,000 echoes per size, does not end, with kernel UDP sockets (`-T s`) as much as here):
/// the echo runs here are short.
#[test]
fn udpong_datagrams() {
    let _serial = serial();
    require("/usr/bin/udpong");
    let ns = Netns::new("udpong");
    let mut server = ns
        .command("/usr/bin/udpong", &["-b", "127.0.0.1"])
        .spawn()
        .expect("spawn the server");
    let mut outs = Vec::new();
    let mut failed = None;
    for args in [
        &["-S", "1024", "-C", "5000"][..],
        &["-S", "64", "-C", "30", "-T", "e"],
        &["-S", "1536", "-C", "30", "-T", "e", "-T", "b"],
    ] {
        let mut cargs = vec!["-s", "127.0.0.1"];
        cargs.extend_from_slice(args);
        let c = wait_bounded(
            ns.command("/usr/bin/udpong", &cargs)
                .spawn()
                .expect("spawn the client"),
            Duration::from_secs(120),
        );
        if !c.status.success() && failed.is_none() {
            failed = Some(format!("{args:?}: {}", text(&c)));
        }
        outs.push((args, c));
    }
    let _ = server.kill();
    let s = server.wait_with_output().expect("server output");
    if let Some(f) = failed {
        panic!("client {f}\nserver: {}", text(&s));
    }
    let served = String::from_utf8_lossy(&s.stdout);
    assert_eq!(
        served.matches("client login from 127.0.0.1").count(),
        3,
        "{}",
        text(&s)
    );
    for (args, c) in &outs {
        let out = String::from_utf8_lossy(&c.stdout);
        let cols = row(&out, "custom").unwrap_or_else(|| panic!("{args:?}: {}", text(c)));
        if args.contains(&"e") {
            // Every request was echoed: twice the count went across (udpong would write 1,000
            // and more in thousands).
            let want = 2 * args[3].parse::<u64>().unwrap();
            let want = if want >= 1000 {
                format!("{}k", want / 1000)
            } else {
                want.to_string()
            };
            assert_eq!(cols[2], want, "{args:?}: {out}");
        } else {
            let xfers: u64 = cols[2].trim_end_matches('k').parse().expect("a count");
            // Datagrams may be dropped when the server falls behind, as UDP's are.
            assert!(xfers > 0, "{args:?}: {out}");
        }
    }
}

/// rsockets against librdmacm on the kernel's own RDMA stack: rstream and riostream with data
/// verified, between kernel Soft-RoCE (`rdma_rxe` in a QEMU guest booted by `scripts/rxe-vm`,
/// running Debian's librdmacm over the kernel's `rdma_cm`) and ours on the host side of the
/// guest's tap device, each side as client and as server. Wherever a guest cannot boot (root,
/// qemu-system-x86, linux-image-amd64 and busybox-static, which scripts/setup-deps installs)
/// the test says why and passes, as `crates/ibverbs/tests/kernel_rxe.rs` does.
#[test]
fn rsockets_against_librdmacm_on_kernel_rxe() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    const TAP: &str = "rxetap0";
    const HOST: &str = "10.77.0.1";
    const GUEST: &str = "10.77.0.2";
    const BOOT: Duration = Duration::from_secs(180);
    const RUN: Duration = Duration::from_secs(120);
    let _serial = serial();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/rxe-vm");
    let check = Command::new(&script)
        .arg("check")
        .output()
        .expect("run scripts/rxe-vm");
    if !check.status.success() {
        eprintln!(
            "kernel rxe guest cannot run here, not tested: {}",
            String::from_utf8_lossy(&check.stderr)
        );
        return;
    }
    require("/usr/bin/rstream");
    require("/usr/bin/riostream");
    let ns = Netns::new("rsrxe");
    let args = ["-S", "4096", "-C", "100", "-T", "v"];
    // The guest is the client of our servers (retrying until they listen), then the server
    // of our clients.
    let guest = format!(
        "set -e
         modprobe rdma_ucm
         for p in rstream riostream; do
           echo STEP $p-client
           ok=; i=0
           while [ $i -lt 60 ]; do
             if timeout 60 $p -s {HOST} {a}; then ok=1; break; fi
             i=$((i + 1)); sleep 1
           done
           [ -n \"$ok\" ]
         done
         for p in rstream riostream; do
           echo STEP $p-server
           timeout 120 $p {a}
         done",
        a = args.join(" ")
    );
    struct Vm(Child);
    impl Drop for Vm {
        fn drop(&mut self) {
            // The script, `timeout` and QEMU: nothing is left running whatever happens.
            let pgid = nix::unistd::Pid::from_raw(self.0.id() as i32);
            let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
            let _ = self.0.wait();
        }
    }
    let mut vm = Vm(Command::new(&script)
        .args(["run", "--netns", &ns.0, "--tap", TAP])
        .args([
            "--host-ip",
            &format!("{HOST}/24"),
            "--guest-ip",
            &format!("{GUEST}/24"),
        ])
        .args(["--timeout", "900", "--", "sh", "-c", &guest])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("start scripts/rxe-vm"));
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = vm.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut log = String::new();
    let mut wait_for = |what: &str, limit: Duration| {
        let deadline = Instant::now() + limit;
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    log.push_str(&line);
                    log.push('\n');
                    // The console may put terminal escapes before a line.
                    if line.trim_end().ends_with(what) {
                        return;
                    }
                    assert!(
                        !line.contains("RXE-VM-EXIT"),
                        "the guest stopped before {what}:\n{log}"
                    );
                }
                Err(_) => panic!("no {what} from the guest within {limit:?}:\n{log}"),
            }
        }
    };
    let ours = |program: &str, extra: &[&str]| {
        let mut a: Vec<&str> = extra.to_vec();
        a.extend_from_slice(&args);
        let mut c = ns.command(program, &a);
        c.env("SOFTVERBS_INTERFACES", TAP);
        c
    };
    wait_for("RXE-VM-READY", BOOT);
    for p in ["rstream", "riostream"] {
        wait_for(&format!("STEP {p}-client"), RUN);
        let program = format!("/usr/bin/{p}");
        let srv = Served::spawn(ours(&program, &[]), &program, "usec/xfer");
        let (o, out) = srv.finish(RUN);
        assert!(
            o.status.success(),
            "{p} server of ours, librdmacm client on kernel rxe: {out}\n{}",
            text(&o)
        );
        assert!(row(&out, "custom").is_some(), "{p}: {out}");
    }
    for p in ["rstream", "riostream"] {
        wait_for(&format!("STEP {p}-server"), RUN);
        // Its result table's header: it listens.
        wait_for("usec/xfer", RUN);
        let program = format!("/usr/bin/{p}");
        let o = wait_bounded(ours(&program, &["-s", GUEST]).spawn().expect("spawn"), RUN);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "{p} client of ours, librdmacm server on kernel rxe: {}",
            text(&o)
        );
        assert!(row(&out, "custom").is_some(), "{p}: {out}");
    }
    wait_for("RXE-VM-EXIT 0", RUN);
}
