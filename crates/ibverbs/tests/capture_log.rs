//! Packet captures and logs of an unmodified C program: rdma-core's `ibv_rc_pingpong` over our
//! `libibverbs.so.1`, server and client each with `SOFTVERBS_PCAP` (one file per process,
//! `%p`), over shared memory and over UDP; and with and without `SOFTVERBS_LOG`.

mod common;
#[path = "../../verbs/tests/common/pcap.rs"]
mod pcap;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::*;

const LIMIT: Duration = Duration::from_secs(120);
const PINGPONG: &str = "/usr/bin/ibv_rc_pingpong";
/// Iterations, and the message size (4 packets at the tool's default MTU of 1024).
const ITERS: usize = 50;
const SIZE: usize = 4096;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The GID index of `::ffff:127.0.0.1` on sv_lo.
fn gid_index() -> String {
    static INDEX: OnceLock<String> = OnceLock::new();
    INDEX
        .get_or_init(|| {
            require("/usr/bin/ibv_devinfo");
            let mut c = command("/usr/bin/ibv_devinfo");
            c.args(["-v", "-d", "sv_lo"]);
            let (out, err) = text(&run_bounded(c, LIMIT));
            out.lines()
                .find(|l| l.contains("::ffff:127.0.0.1"))
                .and_then(|l| l.split('[').nth(1))
                .and_then(|l| l.split(']').next())
                .map(|i| i.trim().to_string())
                .unwrap_or_else(|| panic!("no ::ffff:127.0.0.1 GID on sv_lo:\n{out}{err}"))
        })
        .clone()
}

/// A base UDP port whose slots are free now (so that the capture's ports are known and no
/// other softverbs process on the host is involved).
fn free_base_port() -> u16 {
    let free = |port: u16| {
        std::net::UdpSocket::bind(("0.0.0.0", port)).is_ok()
            && std::net::UdpSocket::bind(("::", port)).is_ok()
    };
    let seed = std::process::id() as u16;
    (0..1000u16)
        .map(|i| 20_000 + (seed.wrapping_add(i.wrapping_mul(101)) % 40_000))
        .find(|&base| (base..base + 8).all(free))
        .expect("a free range of UDP ports")
}

/// Runs the ping-pong server and client with `env` (both must succeed); (server, client).
fn pingpong(env: &HashMap<&str, String>) -> (Output, Output) {
    require(PINGPONG);
    let gid = gid_index();
    let port = free_port().to_string();
    let n = ITERS.to_string();
    let size = SIZE.to_string();
    let args = [
        "-d",
        "sv_lo",
        "-g",
        gid.as_str(),
        "-n",
        &n,
        "-s",
        &size,
        "-p",
        &port,
    ];
    let spawn = |extra: &[&str]| {
        let mut c = command(PINGPONG);
        c.args(args)
            .args(extra)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c.spawn().expect("spawn ibv_rc_pingpong")
    };
    let server = spawn(&[]);
    let start = Instant::now();
    while !listening(port.parse().unwrap()) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the server never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let client = spawn(&["127.0.0.1"]);
    let c = wait_bounded(client, LIMIT);
    let s = wait_bounded(server, LIMIT);
    for (who, o) in [("server", &s), ("client", &c)] {
        let (out, err) = text(o);
        assert!(
            o.status.success() && out.contains("iters in"),
            "{who}:\n{out}\n{err}"
        );
    }
    (s, c)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("softverbs-c-capture-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Both processes capture; every frame decodes with good checksums and ICRCs, and each side's
/// SENDs are in both files: as outgoing in the sender's, as incoming in the receiver's.
fn capture(shm: bool) {
    let _serial = serial();
    let dir = scratch(if shm { "shm" } else { "udp" });
    let base = free_base_port();
    let mut env = HashMap::new();
    env.insert("SOFTVERBS_PCAP", dir.join("%p.pcap").display().to_string());
    env.insert("SOFTVERBS_UDP_PORT", base.to_string());
    if !shm {
        env.insert("SOFTVERBS_SHM", "0".to_string());
    }
    pingpong(&env);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "one capture per process: {files:?}");
    let ports = base..=base + 255;
    let a = pcap::check(&files[0], ports.clone());
    let b = pcap::check(&files[1], ports);
    let sends = |frames: &[pcap::Frame], outgoing: bool| {
        frames
            .iter()
            .filter(|f| f.outgoing == outgoing && matches!(f.opcode, 0..=2 | 4))
            .count()
    };
    let per_side = ITERS * SIZE / 1024;
    for (name, f) in [("first", &a), ("second", &b)] {
        // Over UDP a lost packet would be resent: at least every SEND packet once.
        assert!(
            sends(f, true) >= per_side,
            "{name}: {} SEND packets sent",
            sends(f, true)
        );
        assert!(
            sends(f, false) >= per_side,
            "{name}: {} SEND packets received",
            sends(f, false)
        );
    }
    let count =
        |frames: &[pcap::Frame], outgoing: bool| frames.iter().filter(|f| f.outgoing == outgoing).count();
    if shm {
        // Shared memory loses nothing: one side's packets out are the other's packets in.
        assert_eq!(count(&a, true), count(&b, false));
        assert_eq!(count(&b, true), count(&a, false));
    }
    if shm {
        // The bytes each side sent are the bytes the other received.
        let payload =
            |frames: &[pcap::Frame], outgoing: bool| pcap::send_payload(frames, |f| f.outgoing == outgoing);
        assert_eq!(payload(&a, true).len(), ITERS * SIZE);
        pcap::assert_same_bytes(&payload(&a, true), &payload(&b, false), "first to second");
        pcap::assert_same_bytes(&payload(&b, true), &payload(&a, false), "second to first");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ibv_rc_pingpong_capture_over_shared_memory() {
    capture(true);
}

#[test]
fn ibv_rc_pingpong_capture_over_udp() {
    capture(false);
}

/// librdmacm's `rping` (our `librdmacm.so.1`): the connection manager's MADs on QP1 are in both
/// captures (REQ, REP, RTU, and the DREQ/DREP of the disconnect), decoded by tshark, with the
/// SENDs, READs and WRITEs of the pings; the client logs its CM events.
#[test]
fn rping_capture_shows_the_connection_manager() {
    let _serial = serial();
    require("/usr/bin/rping");
    let dir = scratch("rping");
    let base = free_base_port();
    let port = (20_000 + std::process::id() % 20_000).to_string();
    let spawn = |side: &str, log: bool| {
        let mut c = command("/usr/bin/rping");
        c.args([side, "-a", "127.0.0.1", "-p", &port, "-C", "3", "-v"])
            .env("SOFTVERBS_UDP_PORT", base.to_string())
            .env("SOFTVERBS_PCAP", dir.join(format!("{}-%p.pcap", &side[1..])));
        if log {
            c.env("SOFTVERBS_LOG", "debug");
        }
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c.spawn().expect("spawn rping")
    };
    let server = spawn("-s", false);
    let start = Instant::now();
    // The client is retried while the server does not listen yet (a rejection, nothing done).
    let (client, pid) = loop {
        std::thread::sleep(Duration::from_millis(300));
        let child = spawn("-c", true);
        let pid = child.id();
        let o = wait_bounded(child, LIMIT);
        let rejected = String::from_utf8_lossy(&o.stderr).contains("REJECTED") && o.stdout.is_empty();
        if !rejected || start.elapsed() > Duration::from_secs(10) {
            break (o, pid);
        }
        let _ = std::fs::remove_file(dir.join(format!("c-{pid}.pcap")));
    };
    let server = wait_bounded(server, LIMIT);
    for (who, o) in [("server", &server), ("client", &client)] {
        let (out, err) = text(o);
        assert!(o.status.success(), "{who}:\n{out}\n{err}");
    }
    let (_, err) = text(&client);
    for needle in [
        "CM event",
        "AddrResolved",
        "RouteResolved",
        "Established",
        "from=RTR to=RTS",
    ] {
        assert!(err.contains(needle), "client stderr lacks {needle:?}:\n{err}");
    }
    let server_file = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("s-"))
        .expect("the server's capture");
    let ports = base..=base + 255;
    for path in [server_file, dir.join(format!("c-{pid}.pcap"))] {
        let frames = pcap::check(&path, ports.clone());
        let cm: Vec<u16> = frames
            .iter()
            .filter_map(|f| f.mad)
            .filter(|m| m.0 == 7)
            .map(|m| m.1)
            .collect();
        // REQ, REP, RTU; DREQ or DREP.
        for attr in [0x10, 0x13, 0x14] {
            assert!(cm.contains(&attr), "{}: CM attributes {cm:x?}", path.display());
        }
        assert!(
            cm.contains(&0x15) || cm.contains(&0x16),
            "{}: {cm:x?}",
            path.display()
        );
        // Each ping: a SEND, a READ request and a WRITE at least.
        let ops = |op: u8| frames.iter().filter(|f| f.opcode == op).count();
        assert!(
            ops(4) >= 3 && ops(12) >= 3 && ops(10) >= 3,
            "{}: {frames:?}",
            path.display()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `SOFTVERBS_LOG=debug`: each process logs its QP's way to RTS on stderr.
#[test]
fn ibv_rc_pingpong_logs_with_softverbs_log() {
    let _serial = serial();
    let mut env = HashMap::new();
    env.insert("SOFTVERBS_LOG", "debug".to_string());
    env.insert("SOFTVERBS_UDP_PORT", free_base_port().to_string());
    let (s, c) = pingpong(&env);
    for (who, o) in [("server", &s), ("client", &c)] {
        let (_, err) = text(o);
        for needle in [
            "UDP driver up",
            "QP state change",
            "from=RESET to=INIT",
            "from=INIT to=RTR",
            "from=RTR to=RTS",
        ] {
            assert!(err.contains(needle), "{who}: stderr lacks {needle:?}:\n{err}");
        }
    }
}

/// Without `SOFTVERBS_LOG` softverbs writes nothing to stderr.
#[test]
fn ibv_rc_pingpong_is_silent_without_softverbs_log() {
    let _serial = serial();
    let mut env = HashMap::new();
    env.insert("SOFTVERBS_UDP_PORT", free_base_port().to_string());
    let (s, c) = {
        // The test's own environment must not turn logs on.
        assert!(std::env::var_os("SOFTVERBS_LOG").is_none_or(|v| v.is_empty()));
        pingpong(&env)
    };
    for (who, o) in [("server", &s), ("client", &c)] {
        let (_, err) = text(o);
        assert!(err.is_empty(), "{who}: stderr:\n{err}");
    }
}
