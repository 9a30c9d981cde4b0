//! `ibv_xsrq_pingpong`: its logic as server and client threads over a real TCP connection, and
//! the binary as two processes talking RoCEv2 over UDP on 127.0.0.1.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use softverbs::*;
use softverbs_tools::pingpong::Role;
use softverbs_tools::xsrq::{Config, Dest, XsrqPingPong, WIRE_LEN};

/// Busy-polling pairs compete for the CPUs; running them one at a time keeps each quick.
static SERIAL: Mutex<()> = Mutex::new(());

const BOUND: Duration = Duration::from_secs(60);

fn lo() -> Context {
    devices()
        .unwrap()
        .into_iter()
        .find(|d| d.netdev() == "lo")
        .expect("a loopback device")
        .open()
        .unwrap()
}

fn config(events: bool, odp: bool) -> Config {
    Config {
        num_tests: 40,
        use_events: events,
        odp,
        size: 3000,
        mtu: Mtu::Mtu512,
        timeout: Some(Duration::from_secs(20)),
        ..Config::default()
    }
}

/// The addresses (local, remote), the receives completed and the printed output of one side.
type SideResult = Result<(Vec<(Dest, Dest)>, u64, String), String>;

fn side(cfg: Config, role: Role, stream: impl FnOnce() -> TcpStream) -> SideResult {
    let ctx = lo();
    let pp = XsrqPingPong::new(&ctx, cfg).map_err(|e| e.to_string())?;
    let s = stream();
    s.set_read_timeout(Some(BOUND)).unwrap();
    let mut out = Vec::new();
    let r = pp.run(role, vec![s], &mut out).map_err(|e| e.to_string())?;
    Ok((r.dests, r.recvs, String::from_utf8(out).unwrap()))
}

#[test]
fn server_and_client_threads() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Polling, events, and an on-demand-paging buffer (-o).
    for (events, odp) in [(false, false), (true, false), (false, true)] {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || {
            side(config(events, odp), Role::Server, move || {
                listener.accept().unwrap().0
            })
        });
        let client = thread::spawn(move || {
            side(config(events, odp), Role::Client, move || {
                TcpStream::connect(addr).unwrap()
            })
        });
        let deadline = Instant::now() + BOUND;
        while !(server.is_finished() && client.is_finished()) {
            assert!(
                Instant::now() < deadline,
                "the ping-pong did not finish within {BOUND:?}"
            );
            thread::sleep(Duration::from_millis(5));
        }
        let (sd, sn, sout) = server.join().unwrap().unwrap_or_else(|e| panic!("server: {e}"));
        let (cd, cn, cout) = client.join().unwrap().unwrap_or_else(|e| panic!("client: {e}"));
        assert_eq!((sn, cn), (40, 40));
        // What one side sent is what the other received.
        assert_eq!((sd[0].0, sd[0].1), (cd[0].1, cd[0].0));
        assert_ne!(sd[0].0.srqn, cd[0].0.srqn);
        // The client prints its address first, the server the client's first.
        assert!(
            cout.starts_with("   local:") && cout.ends_with("success\n"),
            "{cout}"
        );
        assert!(
            sout.starts_with("  remote:") && sout.ends_with("success\n"),
            "{sout}"
        );
        assert!(sout.contains(&format!("SRQN {:06x}", cd[0].0.srqn)), "{sout}");
    }
}

#[test]
fn a_malformed_address_is_refused() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut buf = [b'z'; WIRE_LEN];
        buf[WIRE_LEN - 1] = 0;
        std::io::Write::write_all(&mut s, &buf).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let e = side(config(false, false), Role::Server, move || {
        listener.accept().unwrap().0
    })
    .unwrap_err();
    assert!(e.contains("malformed address"), "{e}");
    peer.join().unwrap();
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `program args` with a bounded wait; returns (status, stdout, stderr).
fn run_bounded(mut cmd: Command, deadline: Instant) -> (Option<i32>, String, String) {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let o = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let e = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(10));
    };
    (status, o.join().unwrap(), e.join().unwrap())
}

/// Runs a server and `clients` client processes of the Rust tool; each must print its SRQ
/// numbers and succeed.
fn run_processes(clients: usize, extra: &[&str]) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bin = env!("CARGO_BIN_EXE_ibv_xsrq_pingpong");
    let port = free_port().to_string();
    let count = clients.to_string();
    let mut args: Vec<String> = [
        "-d",
        "sv_lo",
        "-p",
        &port,
        "-n",
        "50",
        "-c",
        &count,
        "--timeout",
        "30",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let deadline = Instant::now() + BOUND;
    let mut scmd = Command::new(bin);
    scmd.args(&args);
    let server = thread::spawn(move || run_bounded(scmd, deadline));
    let mut cargs = args.clone();
    cargs.push("127.0.0.1".into());
    let client_threads: Vec<_> = (0..clients)
        .map(|_| {
            let cargs = cargs.clone();
            thread::spawn(move || loop {
                let mut ccmd = Command::new(bin);
                ccmd.args(&cargs);
                let r = run_bounded(ccmd, deadline);
                // The server may not listen yet: a refused connection is retried.
                if r.0 == Some(1) && r.2.contains("Couldn't connect") && Instant::now() < deadline {
                    thread::sleep(Duration::from_millis(100));
                    continue;
                }
                break r;
            })
        })
        .collect();
    let results: Vec<_> = client_threads.into_iter().map(|t| t.join().unwrap()).collect();
    let server = server.join().unwrap();
    let ctx = format!("{clients} clients {extra:?}\nserver {server:?}\nclients {results:?}");
    assert_eq!(server.0, Some(0), "{ctx}");
    for r in &results {
        assert_eq!(r.0, Some(0), "{ctx}");
    }
    for out in std::iter::once(&server.1).chain(results.iter().map(|r| &r.1)) {
        assert!(out.contains("SRQN") && out.ends_with("success\n"), "{ctx}");
        assert!(out.contains("GID ::ffff:127.0.0.1"), "{ctx}");
    }
}

#[test]
fn two_processes() {
    run_processes(1, &[]);
    run_processes(1, &["-e", "-s", "5000", "-m", "256"]);
    run_processes(1, &["-o"]);
}

/// With several clients the server reaches client `i`'s SRQ through the target QP of another
/// client process, which relays into the SRQ's owner (every client shares the domain).
#[test]
fn several_client_processes_share_the_domain() {
    run_processes(3, &[]);
    run_processes(2, &["-e", "-s", "5000", "-m", "256"]);
}
