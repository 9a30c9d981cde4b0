//! `softverbs-stat` watching two other processes (an `ibv_rc_pingpong` server and client):
//! both are listed with their QPs, and their counters grow between refreshes; drops are shown by
//! reason; `--watch` ends after `--count` refreshes or, cleanly, on SIGINT.

use std::io::Read;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use softverbs::*;

const STAT: &str = env!("CARGO_BIN_EXE_softverbs-stat");
const BOUND: Duration = Duration::from_secs(60);

/// Kills and reaps its processes when dropped, whatever the test did.
struct Reaper(Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits for `child` to exit (at most [`BOUND`]) and returns its status code and output.
fn finish(mut child: Child) -> (Option<i32>, String) {
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + BOUND;
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("softverbs-stat ran past {BOUND:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (code, reader.join().unwrap())
}

fn stat(args: &[&str]) -> Child {
    Command::new(STAT)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// A TCP port nobody listens on now (the kernel's choice, so not one another test holds).
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Each refresh of `--watch` output: its rows, as columns, by pid.
fn refreshes(out: &str) -> Vec<Vec<Vec<String>>> {
    let mut all: Vec<Vec<Vec<String>>> = Vec::new();
    for line in out.lines() {
        if line.starts_with("Every ") {
            all.push(Vec::new());
        } else if let Some(cur) = all.last_mut() {
            let cols: Vec<String> = line.split_whitespace().map(String::from).collect();
            if cols.first().is_some_and(|c| c.parse::<u32>().is_ok()) {
                cur.push(cols);
            }
        }
    }
    all
}

fn row(refresh: &[Vec<String>], pid: u32) -> Option<&Vec<String>> {
    refresh.iter().find(|r| r[0] == pid.to_string())
}

#[test]
fn watch_shows_two_processes_whose_counters_grow_between_refreshes() {
    let port = free_port().to_string();
    let pingpong = |host: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ibv_rc_pingpong"));
        cmd.args(["-d", "sv_lo", "-g", "0", "-p", &port, "-n", "100000000"]);
        cmd.args(host);
        cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
    };
    let mut procs = Reaper(vec![pingpong(None)]);
    // The client retries until the server listens.
    let deadline = Instant::now() + BOUND;
    loop {
        let mut client = pingpong(Some("127.0.0.1"));
        std::thread::sleep(Duration::from_millis(300));
        if client.try_wait().unwrap().is_none() {
            procs.0.push(client);
            break;
        }
        assert!(Instant::now() < deadline, "the pingpong client never connected");
    }
    let pids: Vec<u32> = procs.0.iter().map(Child::id).collect();
    // Both are under way once each has sent packets on its board.
    loop {
        let seen = host_counters();
        let busy = |pid: u32| {
            seen.iter().any(|p| {
                p.pid == pid
                    && p.devices
                        .iter()
                        .any(|(d, c)| d == "sv_lo" && c.tx_packets > 0 && c.qps > 0)
            })
        };
        if pids.iter().all(|&p| busy(p)) {
            break;
        }
        assert!(Instant::now() < deadline, "the pingpongs did not start: {seen:?}");
        std::thread::sleep(Duration::from_millis(50));
    }

    let (code, out) = finish(stat(&["--watch", "0.3", "--count", "3", "-d", "sv_lo"]));
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.lines().nth(1).is_some_and(|h| h.contains("drops by reason")),
        "{out}"
    );
    let r = refreshes(&out);
    assert_eq!(r.len(), 3, "three refreshes:\n{out}");
    for pid in pids {
        let first = row(&r[0], pid).unwrap_or_else(|| panic!("{pid} is not listed:\n{out}"));
        let last = row(&r[2], pid).unwrap_or_else(|| panic!("{pid} is not listed:\n{out}"));
        assert_eq!(first[1], "ibv_rc_pingpong", "{out}");
        assert!(first[3].parse::<u64>().unwrap() >= 1, "QPs: {first:?}");
        for col in [4, 5] {
            let (a, b): (u64, u64) = (first[col].parse().unwrap(), last[col].parse().unwrap());
            assert!(b > a, "column {col} of {pid} did not grow: {a} then {b}\n{out}");
        }
        // Rates are shown from the second refresh on.
        assert!(last[8].ends_with("B/s") && last[9].ends_with("B/s"), "{last:?}");
    }
}

#[test]
fn watch_ends_cleanly_on_sigint() {
    let child = stat(&["--watch", "0.2"]);
    let pid = child.id();
    // Let it refresh a few times, then interrupt it as Ctrl-C would.
    std::thread::sleep(Duration::from_millis(1000));
    kill(Pid::from_raw(pid as i32), Signal::SIGINT).unwrap();
    let (code, out) = finish(child);
    assert_eq!(code, Some(0), "SIGINT ends it with status 0:\n{out}");
    let n = out.lines().filter(|l| l.starts_with("Every 0.2s")).count();
    assert!(n >= 2, "it refreshed ({n}):\n{out}");
    // The last refresh is whole: its header and at least one line under it.
    let last = out.rsplit("Every 0.2s").next().unwrap();
    assert!(last.lines().count() >= 3, "{out}");
}

/// Two UC QPs of this process: a SEND to one with no receive posted is dropped, and
/// softverbs-stat shows the drop under its reason.
#[test]
fn drops_are_shown_by_reason() {
    let dev = devices()
        .unwrap()
        .into_iter()
        .find(|d| d.netdev() == "lo")
        .expect("a loopback device");
    let ctx = dev.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None, 0).unwrap();
    let a = pd.create_qp(&QpInit::new(QpType::Uc, &cq)).unwrap();
    let b = pd.create_qp(&QpInit::new(QpType::Uc, &cq)).unwrap();
    let sgid = (0..16)
        .find(|&i| ctx.query_gid(1, i).unwrap() == Gid::from(Ipv4Addr::LOCALHOST))
        .unwrap() as u8;
    let attr = |dest: u32, state: QpState| QpAttr {
        qp_state: state,
        port_num: 1,
        path_mtu: Mtu::Mtu1024,
        dest_qp_num: dest,
        ah_attr: AhAttr {
            grh: GlobalRoute {
                dgid: Gid::from(Ipv4Addr::LOCALHOST),
                sgid_index: sgid,
                hop_limit: 64,
                ..Default::default()
            },
            is_global: true,
            port_num: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    for (qp, dest) in [(&a, b.qp_num()), (&b, a.qp_num())] {
        let init = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
        qp.modify(&attr(dest, QpState::Init), init).unwrap();
        let rtr = QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN;
        qp.modify(&attr(dest, QpState::Rtr), rtr).unwrap();
        qp.modify(&attr(dest, QpState::Rts), QpAttrMask::STATE | QpAttrMask::SQ_PSN)
            .unwrap();
    }
    let before = ctx.counters().rx_no_recv_wqe;
    let mr = pd.register(64, AccessFlags::LOCAL_WRITE).unwrap();
    a.post_send(&[SendRequest {
        wr_id: 1,
        op: SendOp::Send {
            imm: None,
            invalidate: None,
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![mr.sge(0..16).unwrap()]),
        ud: None,
        xrc_srqn: None,
    }])
    .unwrap();
    let deadline = Instant::now() + BOUND;
    while ctx.counters().rx_no_recv_wqe == before {
        assert!(
            Instant::now() < deadline,
            "the SEND was not dropped: {:?}",
            ctx.counters()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let c = ctx.counters();
    assert!(c.rx_dropped >= c.rx_no_recv_wqe, "{c:?}");

    let (code, out) = finish(stat(&["--once", "-d", "sv_lo"]));
    assert_eq!(code, Some(0), "{out}");
    let me = std::process::id().to_string();
    let line = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some(me.as_str()))
        .unwrap_or_else(|| panic!("this process is not listed:\n{out}"));
    let shown: u64 = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("no_recv_wqe="))
        .unwrap_or_else(|| panic!("no no_recv_wqe drop in {line:?}"))
        .parse()
        .unwrap();
    assert!(shown > before, "{line}");
}
