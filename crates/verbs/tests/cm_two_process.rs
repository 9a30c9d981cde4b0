//! The connection manager between two processes of one host, over shared memory and over UDP
//! (`SOFTVERBS_SHM=0`): the test re-runs its own executable as a server and a client. Covers RC
//! with SEND/RECV and both disconnects, UD through SIDR, a rejection with private data, a
//! port nobody listens on, a server killed after the connection was established (DISCONNECTED
//! when the DREQ times out) or before it answered the REQ (REJECTED 8, as its host no longer
//! listens), a host where nothing answers (UNREACHABLE), and 1,000 connections
//! set up and torn down with nothing left behind.
//! As root, also across two network namespaces ("hosts") where the server is not the process
//! holding the standard RoCE port: the MADs from the other host are forwarded to it, and tshark
//! decodes every datagram to QP1 captured on the link as a CM MAD; and 40 connections, each used
//! both ways, while both hosts drop 5 % of the datagrams they receive (the CMs resend).

mod common;

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use softverbs::cm::{CmEvent, CmEventType as E, CmId, ConnParam, EventChannel, PortSpace};
use softverbs::*;

use common::cm::{expect, loopback as lo, res, Res, WAIT};

fn poll(cq: &CompletionQueue) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut wc = [WorkCompletion::default(); 1];
    loop {
        if cq.poll(&mut wc) == 1 {
            return wc[0];
        }
        assert!(Instant::now() < deadline, "no completion within 20 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn send(sge: Sge, ud: Option<UdAddress>) -> SendRequest {
    SendRequest {
        wr_id: 1,
        op: SendOp::Send {
            imm: None,
            invalidate: None,
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![sge]),
        ud,
        xrc_srqn: None,
    }
}

fn recv(qp: &QueuePair, r: &Res) {
    qp.post_recv(&[RecvWr {
        wr_id: 2,
        sg_list: vec![r.mr.sge(0..256).unwrap()],
    }])
    .unwrap();
}

/// How many connections the "many" scenario makes.
const MANY: usize = 1000;

/// The next event that is not a TIMEWAIT_EXIT (those of earlier connections may come between).
fn expect_skip(ch: &EventChannel, ty: E) -> CmEvent {
    loop {
        let ev = ch.get_event_timeout(WAIT).expect("an event within 20 s");
        if ev.event_type() != E::TimewaitExit {
            assert_eq!(ev.event_type(), ty, "status {}", ev.status());
            return ev;
        }
    }
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Waits until the CM of `ctx`'s device holds nothing but `ids` registered ids.
fn settle(ch: &EventChannel, ctx: &Context, ids: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        while let Ok(ev) = ch.get_event_timeout(Some(Duration::from_millis(10))) {
            assert_eq!(ev.event_type(), E::TimewaitExit);
        }
        let now = cm::cm_entries(ctx).unwrap();
        if now == (0, ids) {
            return;
        }
        assert!(Instant::now() < deadline, "CM entries and ids left: {now:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Serves `MANY` connections one after the other.
fn many_server(ip: Ipv4Addr) {
    let ch = EventChannel::new().unwrap();
    let listen = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
    listen.bind_addr(SocketAddr::from((ip, 0))).unwrap();
    listen.listen(16).unwrap();
    println!("port {}", listen.src_addr().unwrap().port());
    // A loopback bind attaches no device (as with the kernel's rdma_cm): the resources go on
    // the device the first request arrives on.
    let mut res = None;
    for _ in 0..MANY {
        let req = expect_skip(&ch, E::ConnectRequest);
        let id = req.id().clone();
        drop(req);
        let (_, pd, cq) = res.get_or_insert_with(|| {
            let ctx = id.context().unwrap();
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(16, None, 0).unwrap();
            (ctx, pd, cq)
        });
        id.create_qp(pd, &QpInit::new(QpType::Rc, cq)).unwrap();
        id.accept(&ConnParam::default()).unwrap();
        expect_skip(&ch, E::Established);
        expect_skip(&ch, E::Disconnected);
        id.disconnect().unwrap();
    }
    let (ctx, _, _) = res.expect("a connection");
    settle(&ch, &ctx, 1);
    drop(listen);
    assert_eq!(cm::live_ids(), 0);
    println!("ok");
}

/// Makes `MANY` connections one after the other, each set up, used for nothing and torn down;
/// nothing may be left at the end.
fn many_client(dst: SocketAddr) {
    let ch = EventChannel::new().unwrap();
    let mut res = None;
    let mut fds = 0;
    for i in 0..MANY {
        let id = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
        id.resolve_addr(None, dst, 2000).unwrap();
        expect_skip(&ch, E::AddrResolved);
        id.resolve_route(2000).unwrap();
        expect_skip(&ch, E::RouteResolved);
        let (ctx, pd, cq) = res.get_or_insert_with(|| {
            let ctx = id.context().unwrap();
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(16, None, 0).unwrap();
            (ctx, pd, cq)
        });
        let _ = ctx;
        let qp = id.create_qp(pd, &QpInit::new(QpType::Rc, cq)).unwrap();
        id.connect(&ConnParam::default()).unwrap();
        expect_skip(&ch, E::Established);
        assert_eq!(qp.state(), QpState::Rts);
        id.disconnect().unwrap();
        expect_skip(&ch, E::Disconnected);
        if i == 0 {
            fds = fd_count();
        }
    }
    let (ctx, _pd, _cq) = res.unwrap();
    settle(&ch, &ctx, 0);
    assert_eq!(cm::live_ids(), 0, "every id is gone");
    assert_eq!(fd_count(), fds, "no file descriptor leaked");
    println!("ok");
}

/// How many connections the lossy scenario makes across the namespaces.
const LOSSY: usize = 40;

/// Serves `LOSSY` connections: each brings a SEND from the client, then the client reads
/// "world" from the server (its address and key in the accept's private data) and
/// disconnects. Prints how many MADs its CM resent. Only the client's operations are
/// acknowledged to it, so it knows when all have landed before it disconnects (a QP leaves RTS
/// at the disconnect, and could then not answer a resent request whose ACK was lost).
fn lossy_server(ip: Ipv4Addr) {
    let ch = EventChannel::new().unwrap();
    let listen = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
    listen.bind_addr(SocketAddr::from((ip, 0))).unwrap();
    listen.listen(4).unwrap();
    println!("port {}", listen.src_addr().unwrap().port());
    let r = res(&listen);
    let world = r.pd.register(4096, AccessFlags::REMOTE_READ).unwrap();
    world.write(0, b"world").unwrap();
    let mut private_data = world.addr().to_be_bytes().to_vec();
    private_data.extend(world.rkey().to_be_bytes());
    let rw = ConnParam {
        responder_resources: 1,
        initiator_depth: 1,
        private_data,
        ..ConnParam::default()
    };
    for _ in 0..LOSSY {
        let req = expect_skip(&ch, E::ConnectRequest);
        let id = req.id().clone();
        drop(req);
        let qp = id.create_qp(&r.pd, &QpInit::new(QpType::Rc, &r.cq)).unwrap();
        recv(&qp, &r);
        id.accept(&rw).unwrap();
        expect_skip(&ch, E::Established);
        let wc = poll(&r.cq);
        assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 5));
        let mut hello = [0u8; 5];
        r.mr.read(0, &mut hello).unwrap();
        assert_eq!(&hello, b"hello");
        expect_skip(&ch, E::Disconnected);
        id.disconnect().unwrap();
    }
    let stats = cm::cm_stats(&listen.context().unwrap()).unwrap();
    println!("ok {}", stats.retransmitted);
}

/// Makes `LOSSY` connections to `dst`, each a SEND and a READ, then prints how many MADs its CM
/// resent.
fn lossy_client(dst: SocketAddr) {
    let ch = EventChannel::new().unwrap();
    let mut ctx = None;
    for _ in 0..LOSSY {
        let id = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
        id.resolve_addr(None, dst, 2000).unwrap();
        expect_skip(&ch, E::AddrResolved);
        id.resolve_route(2000).unwrap();
        expect_skip(&ch, E::RouteResolved);
        let r = res(&id);
        let qp = id.create_qp(&r.pd, &QpInit::new(QpType::Rc, &r.cq)).unwrap();
        id.connect(&ConnParam {
            responder_resources: 1,
            initiator_depth: 1,
            ..ConnParam::default()
        })
        .unwrap();
        let ev = expect_skip(&ch, E::Established);
        let data = &ev.conn().unwrap().private_data;
        let remote = RemoteAddr {
            addr: u64::from_be_bytes(data[..8].try_into().unwrap()),
            rkey: u32::from_be_bytes(data[8..12].try_into().unwrap()),
        };
        drop(ev);
        r.mr.write(100, b"hello").unwrap();
        qp.post_send(&[send(r.mr.sge(100..105).unwrap(), None)]).unwrap();
        assert_eq!(poll(&r.cq).status, WcStatus::Success);
        let mut read = send(r.mr.sge(0..5).unwrap(), None);
        read.op = SendOp::Read { remote };
        qp.post_send(&[read]).unwrap();
        assert_eq!(poll(&r.cq).status, WcStatus::Success);
        let mut got = [0u8; 5];
        r.mr.read(0, &mut got).unwrap();
        assert_eq!(&got, b"world");
        id.disconnect().unwrap();
        expect_skip(&ch, E::Disconnected);
        ctx.get_or_insert_with(|| id.context().unwrap());
    }
    let stats = cm::cm_stats(ctx.as_ref().unwrap()).unwrap();
    println!("ok {}", stats.retransmitted);
}

/// The server side of `scenario`: prints its port, then serves one client.
fn server(scenario: &str, ip: Ipv4Addr) {
    let ch = EventChannel::new().unwrap();
    let ps = if scenario == "ud" {
        PortSpace::Udp
    } else {
        PortSpace::Tcp
    };
    let listen = CmId::new(Some(&ch), ps).unwrap();
    listen.bind_addr(SocketAddr::from((ip, 0))).unwrap();
    listen.listen(4).unwrap();
    println!("port {}", listen.src_addr().unwrap().port());
    let req = expect(&ch, E::ConnectRequest);
    let id = req.id().clone();
    let data = match req.param() {
        cm::EventParam::Conn(c) => c.private_data.clone(),
        cm::EventParam::Ud(u) => u.private_data.clone(),
        cm::EventParam::None => panic!("no parameters"),
    };
    drop(req);
    assert_eq!(&data[..6], b"client");
    if scenario == "ghost" {
        println!("requested");
        // Killed here by the test, before answering.
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    match scenario {
        "reject" => {
            id.reject(b"go away").unwrap();
            // Stay until the client saw it (the REJ is answered from here if it is lost).
            std::thread::sleep(Duration::from_millis(500));
        }
        "ud" => {
            let r = res(&id);
            let qp = id.create_qp(&r.pd, &QpInit::new(QpType::Ud, &r.cq)).unwrap();
            recv(&qp, &r);
            id.accept(&ConnParam::default()).unwrap();
            let wc = poll(&r.cq);
            assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 40 + 5));
            let mut got = [0u8; 5];
            r.mr.read(40, &mut got).unwrap();
            assert_eq!(&got, b"hello");
        }
        _ => {
            let r = res(&id);
            let qp = id.create_qp(&r.pd, &QpInit::new(QpType::Rc, &r.cq)).unwrap();
            recv(&qp, &r);
            id.accept(&ConnParam {
                private_data: b"server".to_vec(),
                ..ConnParam::default()
            })
            .unwrap();
            expect(&ch, E::Established);
            let wc = poll(&r.cq);
            assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 5));
            if scenario == "vanish" {
                println!("established");
                // Killed here by the test.
                std::thread::sleep(Duration::from_secs(60));
                return;
            }
            r.mr.write(100, b"world").unwrap();
            qp.post_send(&[send(r.mr.sge(100..105).unwrap(), None)]).unwrap();
            assert_eq!(poll(&r.cq).status, WcStatus::Success);
            let ev = expect(&ch, E::Disconnected);
            assert_eq!(ev.status(), 0);
            drop(ev);
            id.disconnect().unwrap();
            expect(&ch, E::TimewaitExit);
        }
    }
    println!("ok");
}

/// The client side of `scenario` against `port`.
fn client(scenario: &str, dst: SocketAddr) {
    let ch = EventChannel::new().unwrap();
    let ps = if scenario == "ud" {
        PortSpace::Udp
    } else {
        PortSpace::Tcp
    };
    let id = CmId::new(Some(&ch), ps).unwrap();
    id.resolve_addr(None, dst, 2000).unwrap();
    expect(&ch, E::AddrResolved);
    id.resolve_route(2000).unwrap();
    expect(&ch, E::RouteResolved);
    let r = res(&id);
    let qp_type = if scenario == "ud" { QpType::Ud } else { QpType::Rc };
    let qp = id.create_qp(&r.pd, &QpInit::new(qp_type, &r.cq)).unwrap();
    recv(&qp, &r);
    id.connect(&ConnParam {
        private_data: b"client".to_vec(),
        ..ConnParam::default()
    })
    .unwrap();
    match scenario {
        "reject" => {
            let ev = expect(&ch, E::Rejected);
            assert_eq!(ev.status(), 28);
            assert_eq!(&ev.conn().unwrap().private_data[..7], b"go away");
        }
        "nobody" => {
            let ev = expect(&ch, E::Rejected);
            assert_eq!(ev.status(), 8);
        }
        "ghost" => {
            // The listener died before answering: this host's CM refuses the resent REQ.
            let ev = expect(&ch, E::Rejected);
            assert_eq!(ev.status(), 8);
        }
        "void" => {
            // Nothing at all answers at the address.
            let ev = expect(&ch, E::Unreachable);
            assert_eq!(ev.status(), -110, "the REQ timed out");
        }
        "ud" => {
            let ev = expect(&ch, E::Established);
            let ud = ev.ud().unwrap().clone();
            drop(ev);
            let ah = r.pd.create_ah(&ud.ah_attr).unwrap();
            r.mr.write(100, b"hello").unwrap();
            qp.post_send(&[send(
                r.mr.sge(100..105).unwrap(),
                Some(ah.ud_address(ud.qp_num, ud.qkey)),
            )])
            .unwrap();
            assert_eq!(poll(&r.cq).status, WcStatus::Success);
        }
        _ => {
            let ev = expect(&ch, E::Established);
            assert_eq!(&ev.conn().unwrap().private_data[..6], b"server");
            drop(ev);
            r.mr.write(100, b"hello").unwrap();
            qp.post_send(&[send(r.mr.sge(100..105).unwrap(), None)]).unwrap();
            assert_eq!(poll(&r.cq).status, WcStatus::Success);
            if scenario == "vanish" {
                // The peer is gone: the DREQ goes unanswered.
                let started = Instant::now();
                id.disconnect().unwrap();
                let ev = expect(&ch, E::Disconnected);
                assert_eq!(ev.status(), -110, "the DREQ timed out");
                assert!(started.elapsed() < Duration::from_secs(20));
            } else {
                let wc = poll(&r.cq);
                assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 5));
                let mut got = [0u8; 5];
                r.mr.read(0, &mut got).unwrap();
                assert_eq!(&got, b"world");
                id.disconnect().unwrap();
                expect(&ch, E::Disconnected);
            }
        }
    }
    // The MADs took the carrier under test (with nobody listening, this process's own CM
    // answered).
    let shm_packets = id.context().unwrap().counters().tx_shm_packets;
    match std::env::var("SOFTVERBS_SHM").as_deref() {
        Ok("0") => assert_eq!(shm_packets, 0),
        _ if matches!(scenario, "nobody" | "ghost") || !dst.ip().is_loopback() => {}
        _ => assert!(shm_packets > 0, "nothing went through shared memory"),
    }
    println!("ok");
}

fn spawn(shm: &str, args: &[&str], short_timeouts: bool) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(args).env("SOFTVERBS_SHM", shm).stdout(Stdio::piped());
    if short_timeouts {
        cmd.env("SOFTVERBS_CM_RESPONSE_TIMEOUT", "12")
            .env("SOFTVERBS_CM_PACKET_LIFETIME", "10")
            .env("SOFTVERBS_CM_RETRIES", "3");
    }
    cmd.spawn().unwrap()
}

fn wait(child: &mut Child, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.success();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_line(r: &mut impl BufRead) -> String {
    let mut s = String::new();
    r.read_line(&mut s).unwrap();
    s.trim().to_string()
}

fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn run(shm: &str, scenario: &str) -> bool {
    let short = matches!(scenario, "vanish" | "ghost");
    let mut srv = spawn(shm, &["--server", scenario], short);
    let mut out = BufReader::new(srv.stdout.take().unwrap());
    let line = read_line(&mut out);
    let port = line.strip_prefix("port ").and_then(|p| p.parse::<u16>().ok());
    let Some(port) = port else {
        let _ = srv.kill();
        let _ = srv.wait();
        return false;
    };
    if scenario == "nobody" {
        // The server stops listening: nobody is left on the port.
        stop(&mut srv);
    }
    let mut cli = spawn(shm, &["--client", scenario, &lo(port).to_string()], short);
    let mut ok = true;
    if scenario == "vanish" {
        ok = read_line(&mut out) == "established";
        stop(&mut srv);
    }
    if scenario == "ghost" {
        ok = read_line(&mut out) == "requested";
        stop(&mut srv);
    }
    ok &= wait(&mut cli, Duration::from_secs(180));
    if !matches!(scenario, "nobody" | "vanish" | "ghost") {
        ok &= wait(&mut srv, Duration::from_secs(30)) && read_line(&mut out) == "ok";
    }
    stop(&mut srv);
    stop(&mut cli);
    ok
}

/// Holds the standard RoCE port of its host (the first process to start a device driver takes
/// it) until killed, with a CM of its own running.
fn hold(ip: Ipv4Addr) {
    let ch = EventChannel::new().unwrap();
    let id = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
    id.bind_addr(SocketAddr::from((ip, 0))).unwrap();
    id.listen(1).unwrap();
    println!("ready");
    std::thread::sleep(Duration::from_secs(120));
}

/// Host A runs the holder of the standard port and then the server (another slot); the client
/// on host B sends every MAD to A's standard port, whose holder forwards them to the server.
fn across_hosts() {
    use common::netns::Hosts;
    const IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 78, 0, 1), Ipv4Addr::new(10, 78, 0, 2)];
    let hosts = Hosts::new("svcm", "h", IPS, false);
    let a = IPS[0].to_string();
    // Host B's side of the link, for tshark.
    let pcap = std::env::temp_dir().join(format!("softverbs-cm-{}.pcap", std::process::id()));
    let mut tcpdump = Command::new("ip")
        .args([
            "netns",
            "exec",
            &hosts.ns[1],
            "tcpdump",
            "-Z",
            "root",
            "--immediate-mode",
            "-i",
            &hosts.ifs[1],
            "-U",
            "-w",
        ])
        .arg(&pcap)
        .arg("udp")
        .stderr(Stdio::piped())
        .spawn()
        .expect("tcpdump (scripts/setup-deps installs it)");
    let mut err = BufReader::new(tcpdump.stderr.take().unwrap());
    assert!(read_line(&mut err).contains("listening on"), "tcpdump started");
    // Nothing runs on host A yet: the REQ goes unanswered.
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &hosts.ns[1]])
        .arg(std::env::current_exe().unwrap())
        .args(["--client", "void", &SocketAddr::from((IPS[0], 7471)).to_string()])
        .env("SOFTVERBS_INTERFACES", &hosts.ifs[1])
        .env("SOFTVERBS_CM_RESPONSE_TIMEOUT", "12")
        .env("SOFTVERBS_CM_PACKET_LIFETIME", "10")
        .env("SOFTVERBS_CM_RETRIES", "3");
    let mut void = common::netns::Peer::spawn(cmd);
    assert_eq!(
        void.line(Duration::from_secs(60)),
        "ok",
        "UNREACHABLE when nothing answers"
    );
    let mut holder = hosts.spawn(0, &["--hold", &a]);
    assert_eq!(holder.line(Duration::from_secs(20)), "ready");
    let mut srv = hosts.spawn(0, &["--server", "rc", &a]);
    let line = srv.line(Duration::from_secs(20));
    let port: u16 = line.strip_prefix("port ").unwrap().parse().unwrap();
    let dst = SocketAddr::from((IPS[0], port)).to_string();
    let mut cli = hosts.spawn(1, &["--client", "rc", &dst]);
    assert_eq!(cli.line(Duration::from_secs(60)), "ok", "the client finished");
    assert_eq!(srv.line(Duration::from_secs(30)), "ok", "the server finished");
    drop(holder);
    // The last packets are written (-U) by the time both sides are done.
    std::thread::sleep(Duration::from_millis(300));
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(tcpdump.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    );
    let _ = tcpdump.wait();
    check_capture(&pcap);
    let _ = std::fs::remove_file(&pcap);
}

/// Both hosts drop 5 % of the RoCE datagrams they receive (nftables): every connection is
/// still set up, used and torn down, the CMs resending what was lost.
fn across_hosts_with_loss() {
    use common::netns::Hosts;
    const IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 79, 0, 1), Ipv4Addr::new(10, 79, 0, 2)];
    let hosts = Hosts::new("svcl", "h", IPS, false);
    let base: u16 = std::env::var("SOFTVERBS_UDP_PORT").unwrap().parse().unwrap();
    for i in 0..2 {
        hosts.drop_incoming(i, 5, (base, base + 255));
    }
    // Short CM timeouts (16 ms, not Linux's 4 s) keep the resends quick; the retry count
    // stays the default 15.
    std::env::set_var("SOFTVERBS_CM_RESPONSE_TIMEOUT", "12");
    std::env::set_var("SOFTVERBS_CM_PACKET_LIFETIME", "10");
    let started = Instant::now();
    let mut srv = hosts.spawn(0, &["--server", "lossy", &IPS[0].to_string()]);
    let line = srv.line(Duration::from_secs(20));
    let port: u16 = line.strip_prefix("port ").unwrap().parse().unwrap();
    let dst = SocketAddr::from((IPS[0], port)).to_string();
    let mut cli = hosts.spawn(1, &["--client", "lossy", &dst]);
    let resent = |line: String, who: &str| -> u64 {
        let n = line.strip_prefix("ok ");
        n.unwrap_or_else(|| panic!("{who}: {line}")).parse().unwrap()
    };
    let c = resent(cli.line(Duration::from_secs(240)), "client");
    let s = resent(srv.line(Duration::from_secs(30)), "server");
    let dropped = [hosts.dropped(0), hosts.dropped(1)];
    println!(
        "  {LOSSY} connections under 5 % loss in {:?}: {dropped:?} datagrams dropped, \
         {c} + {s} MADs resent",
        started.elapsed()
    );
    assert!(dropped[0] > 0 && dropped[1] > 0, "both rules dropped datagrams");
    assert!(c + s > 0, "lost MADs were resent");
}

/// Wireshark decodes every datagram to or from QP1 on the link as a CM MAD (RoCEv2 UD SEND
/// ONLY, Q_Key 0x80010000), and the connection's whole exchange is there.
fn check_capture(pcap: &std::path::Path) {
    let base = std::env::var("SOFTVERBS_UDP_PORT").unwrap_or_else(|_| "4791".into());
    let out = Command::new("tshark")
        .arg("-r")
        .arg(pcap)
        .args(["-d", &format!("udp.port=={base},infiniband"), "-V"])
        .output()
        .expect("tshark (scripts/setup-deps installs it)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let frames: Vec<&str> = text
        .split("\nFrame ")
        .filter(|f| f.contains("Destination Queue Pair: 0x000001"))
        .collect();
    assert!(frames.len() >= 5, "{} QP1 frames", frames.len());
    for f in &frames {
        for needle in [
            "Opcode: Unreliable Datagram (UD) - SEND only (100)",
            "Queue Key: 0x0000000080010000",
            "Source Queue Pair: 0x00000001",
            "Management Class: 0x07",
        ] {
            assert!(f.contains(needle), "no {needle:?} in:\n{f}");
        }
        assert!(!f.contains("Malformed"), "malformed:\n{f}");
    }
    for kind in [
        "CM ConnectRequest",
        "CM ConnectReply",
        "CM ReadyToUse",
        "CM DisconnectRequest",
        "CM DisconnectReply",
    ] {
        assert!(frames.iter().any(|f| f.contains(kind)), "no {kind} on the link");
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("--server") if args[2] == "many" => return many_server(Ipv4Addr::LOCALHOST),
        Some("--server") if args[2] == "lossy" => return lossy_server(args[3].parse().unwrap()),
        Some("--client") if args[2] == "lossy" => return lossy_client(args[3].parse().unwrap()),
        Some("--client") if args[2] == "many" => return many_client(args[3].parse().unwrap()),
        Some("--server") => {
            let ip = args.get(3).map_or(Ipv4Addr::LOCALHOST, |a| a.parse().unwrap());
            return server(&args[2], ip);
        }
        Some("--client") => return client(&args[2], args[3].parse().unwrap()),
        Some("--hold") => return hold(args[2].parse().unwrap()),
        _ => {}
    }
    // A private base port, so the test does not depend on other softverbs processes of the
    // host; the children inherit it.
    std::env::set_var("SOFTVERBS_UDP_PORT", common::free_base_port().to_string());
    // `cargo test -- --list`: this harness has one test. Other arguments that are not options
    // select the cases whose names contain one of them.
    if args.iter().any(|a| a == "--list") {
        println!("cm_two_process: test");
        return;
    }
    let filters: Vec<&str> = args[1..]
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let selected = |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f));
    let mut failed = 0;
    let mut passed = 0;
    for shm in ["1", "0"] {
        for scenario in ["rc", "ud", "reject", "nobody", "vanish", "ghost", "many"] {
            let carrier = if shm == "0" { "udp" } else { "shared memory" };
            let name = format!("{scenario} over {carrier}");
            if !selected(&name) {
                continue;
            }
            let ok = run(shm, scenario);
            println!("test {name} ... {}", if ok { "ok" } else { "FAILED" });
            if ok {
                passed += 1;
            } else {
                failed += 1;
            }
        }
    }
    if nix::unistd::Uid::effective().is_root() {
        let cases: [(&str, fn()); 2] = [
            (
                "across hosts: UNREACHABLE, then RC forwarded to a second process",
                across_hosts,
            ),
            ("across hosts with 5 % loss both ways", across_hosts_with_loss),
        ];
        for (name, case) in cases.into_iter().filter(|(name, _)| selected(name)) {
            let ok = std::panic::catch_unwind(case).is_ok();
            println!("test {name} ... {}", if ok { "ok" } else { "FAILED" });
            if ok {
                passed += 1;
            } else {
                failed += 1;
            }
        }
    } else {
        println!("test rc across hosts ... skipped (needs root for network namespaces)");
    }
    println!("test result: {passed} passed; {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}
