//! Faults between processes: the test re-runs its own executable as its peers.
//!
//! - A peer killed (`SIGKILL`) or frozen (`SIGSTOP`) in the middle of a transfer, for RC, UC
//!   and UD: RC ends in `IBV_WC_RETRY_EXC_ERR` and then flush errors, within the QP's retry
//!   budget (retry_cnt + 1 ACK timeouts) plus slack; UC and UD senders keep completing at the
//!   pace of a live peer's; and the survivor destroys everything, with no thread or file
//!   descriptor left over.
//! - The process holding the standard (base) UDP port dies while a standard peer (a plain UDP
//!   socket sending RoCEv2 to the base port, as rxe would) sends to the others: another
//!   process takes the port over, whether its application busy-polls or sleeps, and every
//!   process is reached again.
//! - Processes killed or exiting without destroying anything (QPs, an XRC domain on a file
//!   with an SRQ, a CM listener, multicast joins, their mailboxes): the next one gets the same
//!   slot, opens the domain with `O_EXCL`, listens on the same port and accepts a connection,
//!   joins the group and gets its traffic, and nothing piles up in `/dev/shm`.
//!
//! Every case runs over shared memory and again over UDP (`SOFTVERBS_SHM=0`), on a private
//! base port. Every wait is bounded; no figure of speed is asserted.

mod common;

use std::collections::BTreeSet;
use std::io::BufRead;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::Peer;
use nix::sys::signal::Signal;
use softverbs::cm::{CmEventType as E, CmId, ConnParam, EventChannel, PortSpace};
use softverbs::*;

const ALL: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);
/// Each side's region.
const BUF: usize = 4 << 20;
/// RC ACK timeout exponent: 4.096 us x 2^14 = 67 ms.
const TIMEOUT: u8 = 14;
/// RC retries before RETRY_EXC_ERR.
const RETRY: u8 = 3;
/// How much later than the retry budget an RC error may come on a loaded host: the budget is
/// counted from the last acknowledgement, and the progress thread may be scheduled late.
const SLACK: Duration = Duration::from_secs(10);
/// Work requests kept in flight.
const DEPTH: usize = 64;
/// The bound of every wait for a peer's line.
const LINE: Duration = Duration::from_secs(60);
/// Queue sizes of both sides.
const QUEUE: u32 = 512;
/// The UD Q_Key.
const QKEY: u32 = 0x1111_1111;

fn limit_of_budget() -> Duration {
    let timeout = Duration::from_nanos(4096 << TIMEOUT);
    timeout * (u32::from(RETRY) + 1) + SLACK
}

/// Message size per transport: UD is bounded by the MTU.
fn msg_len(t: QpType) -> usize {
    match t {
        QpType::Ud => 1024,
        QpType::Uc => 16 << 10,
        _ => 64 << 10,
    }
}

fn qp_type_of(name: &str) -> QpType {
    match name {
        "rc" => QpType::Rc,
        "uc" => QpType::Uc,
        "ud" => QpType::Ud,
        other => panic!("unknown QP type {other}"),
    }
}

/// One side: a context on sv_lo, a PD, a CQ, a QP and a region.
struct Side {
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    pd: ProtectionDomain,
    ctx: Context,
}

impl Side {
    fn new(t: QpType) -> Self {
        let ctx = common::lo();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4096, None, 0).unwrap();
        let mut init = QpInit::new(t, &cq);
        init.cap.max_send_wr = QUEUE;
        init.cap.max_recv_wr = QUEUE;
        let qp = pd.create_qp(&init).unwrap();
        let mr = pd.register(BUF, ALL).unwrap();
        Self { cq, qp, mr, pd, ctx }
    }

    fn info(&self) -> String {
        format!("{} {} {}", self.qp.qp_num(), self.mr.addr(), self.mr.rkey())
    }

    fn connect(&self, peer: u32) {
        match self.qp.qp_type() {
            QpType::Rc => common::connect_rc(
                &self.ctx,
                &self.qp,
                peer,
                &common::RcPath {
                    access: ALL - AccessFlags::LOCAL_WRITE,
                    mtu: Mtu::Mtu4096,
                    psn: 0x10,
                    rd_atomic: 4,
                    timeout: TIMEOUT,
                    retry_cnt: RETRY,
                },
            ),
            _ => common::to_rts(&self.ctx, &self.qp, peer),
        }
    }

    fn post_recvs(&self, ids: std::ops::Range<u64>) {
        let len = msg_len(self.qp.qp_type()) + 40;
        let wrs: Vec<RecvWr> = ids
            .map(|id| RecvWr {
                wr_id: id,
                sg_list: vec![self.mr.sge(0..len).unwrap()],
            })
            .collect();
        self.qp.post_recv(&wrs).unwrap();
    }
}

fn parse_info(line: &str) -> (u32, u64, u32) {
    let v: Vec<u64> = line.split_whitespace().map(|t| t.parse().unwrap()).collect();
    (v[0] as u32, v[1], v[2] as u32)
}

/// The peer of the fault cases: receives (reposting its receives) until killed, or until its
/// stdin closes.
fn receiver(t: QpType) {
    let s = Side::new(t);
    println!("{}", s.info());
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let (parent, ..) = parse_info(&line);
    s.connect(parent);
    s.post_recvs(0..u64::from(QUEUE));
    println!("ready");
    // Ends the process once the parent is gone, whatever it was doing.
    std::thread::spawn(|| {
        for _ in std::io::stdin().lock().lines() {}
        std::process::exit(0);
    });
    let mut wc = [WorkCompletion::default(); 64];
    loop {
        let n = s.cq.poll(&mut wc);
        for w in &wc[..n] {
            if w.opcode == WcOpcode::Recv || w.opcode == WcOpcode::RecvRdmaWithImm {
                s.post_recvs(w.wr_id..w.wr_id + 1);
            }
        }
        if n == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// The parent's side of a transfer to a peer.
struct Sender {
    s: Side,
    ah: Option<AddressHandle>,
    peer: (u32, u64, u32),
    next: u64,
    in_flight: usize,
}

impl Sender {
    /// The `i`-th request: RC alternates SEND and WRITE, UC too, UD sends.
    fn request(&self, i: u64) -> SendRequest {
        let t = self.s.qp.qp_type();
        let len = msg_len(t);
        let at = (i as usize % 8) * len;
        let remote = RemoteAddr {
            addr: self.peer.1 + at as u64,
            rkey: self.peer.2,
        };
        let op = match (t, i % 2) {
            (QpType::Ud, _) | (_, 0) => SendOp::Send {
                imm: None,
                invalidate: None,
            },
            _ => SendOp::Write { remote, imm: None },
        };
        SendRequest {
            wr_id: i,
            op,
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![self.s.mr.sge(at..at + len).unwrap()]),
            ud: self.ah.as_ref().map(|ah| ah.ud_address(self.peer.0, QKEY)),
            xrc_srqn: None,
        }
    }

    /// Keeps `DEPTH` requests in flight until `posts` have been posted in all; returns the
    /// completions that arrive meanwhile and up to `limit` later (all of them, if they come).
    fn run(&mut self, posts: u64, limit: Duration) -> Vec<(WorkCompletion, Instant)> {
        let end = self.next + posts;
        let deadline = Instant::now() + limit;
        let mut got = Vec::new();
        let mut wc = [WorkCompletion::default(); 64];
        while (self.next < end || self.in_flight > 0) && Instant::now() < deadline {
            while self.next < end && self.in_flight < DEPTH {
                let r = self.request(self.next);
                self.s.qp.post_send(&[r]).unwrap();
                self.next += 1;
                self.in_flight += 1;
            }
            let n = self.s.cq.poll(&mut wc);
            let now = Instant::now();
            for w in &wc[..n] {
                got.push((*w, now));
            }
            self.in_flight -= n;
        }
        got
    }
}

/// Threads and open file descriptors of this process, by name and target.
fn resources() -> (Vec<String>, Vec<String>) {
    let mut threads: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .map(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .unwrap_or_default()
                .trim()
                .to_string()
        })
        .collect();
    threads.sort();
    let mut fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|f| std::fs::read_link(f.path()).ok())
        .map(|p| p.display().to_string())
        // The listing's own descriptor.
        .filter(|p| !p.starts_with("/proc/"))
        .collect();
    fds.sort();
    (threads, fds)
}

/// Waits (bounded) until this process holds no more threads and descriptors than `base`.
fn assert_nothing_left(base: &(Vec<String>, Vec<String>), what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = resources();
        if now.0.len() <= base.0.len() && now.1.len() <= base.1.len() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: threads {:?} -> {:?}, descriptors {:?} -> {:?}",
            base.0,
            now.0,
            base.1,
            now.1
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `f` on a thread and fails if it does not return within `limit` (a hang in teardown).
fn bounded<T: Send + 'static>(what: &str, limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not return within {limit:?}"))
}

fn spawn_self(args: &[&str], env: &[(&str, String)]) -> Peer {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Peer::spawn(cmd)
}

/// A transfer of transport `t` to a peer that receives `sig` once 100 messages completed.
fn fault(t: QpType, sig: Signal) {
    let base = resources();
    let name = format!("{t:?}").to_lowercase();
    let s = Side::new(t);
    let mut p = spawn_self(&["--receiver", &name], &[]);
    let peer = parse_info(&p.line(LINE));
    p.say(&s.info());
    s.connect(peer.0);
    assert_eq!(p.line(LINE), "ready");
    let ah = (t == QpType::Ud).then(|| s.pd.create_ah(&common::ah_attr(&s.ctx)).unwrap());
    let mut tx = Sender {
        s,
        ah,
        peer,
        next: 0,
        in_flight: 0,
    };
    // A live peer: every message completes.
    let before = tx.run(200, Duration::from_secs(120));
    assert_eq!(before.len(), 200, "{t:?}: 200 completions before the fault");
    assert!(
        before.iter().all(|(w, _)| w.status == WcStatus::Success),
        "{before:?}"
    );
    p.signal(sig);
    let at = Instant::now();
    match t {
        QpType::Rc => {
            let after = tx.run(2 * DEPTH as u64, limit_of_budget() + Duration::from_secs(30));
            assert_eq!(after.len(), 2 * DEPTH, "every request completes: {after:?}");
            let first_err = after
                .iter()
                .position(|(w, _)| w.status != WcStatus::Success)
                .expect("an error completion");
            let (err, when) = after[first_err];
            assert_eq!(err.status, WcStatus::RetryExcErr, "{after:?}");
            assert!(
                after[first_err + 1..]
                    .iter()
                    .all(|(w, _)| w.status == WcStatus::WrFlushErr),
                "then flush errors: {after:?}"
            );
            let took = when.duration_since(at);
            assert!(
                took <= limit_of_budget(),
                "RETRY_EXC_ERR after {took:?}, budget {:?}",
                limit_of_budget() - SLACK
            );
            assert_eq!(tx.s.qp.state(), QpState::Err);
            println!("  {t:?} {sig:?}: RETRY_EXC_ERR after {took:?}");
        }
        _ => {
            // The sender's completions keep coming (a frozen receiver's queue overflows and
            // the datagrams are lost, as on a network).
            let n = if t == QpType::Ud { 3000 } else { 1000 };
            let after = tx.run(n, Duration::from_secs(60));
            assert_eq!(after.len() as u64, n, "{t:?} {sig:?}: every send completes");
            assert!(after.iter().all(|(w, _)| w.status == WcStatus::Success));
            println!("  {t:?} {sig:?}: {n} sends completed in {:?}", at.elapsed());
        }
    }
    // Everything torn down with the peer still dead or frozen.
    bounded("teardown", Duration::from_secs(30), move || drop(tx));
    drop(p);
    assert_nothing_left(&base, "after the teardown");
}

// ---------------------------------------------------------------------------------------------
// The standard port changes hands

/// A member of the takeover scenario: a UD QP that reports every datagram it gets, and when
/// its process takes the standard port over. `busy` polls all the time; otherwise the
/// application sleeps on a completion channel and the library's threads do the work.
fn member(busy: bool) {
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq(1024, (!busy).then_some(&ch), 0).unwrap();
    let mut init = QpInit::new(QpType::Ud, &cq);
    init.cap.max_recv_wr = 1024;
    let qp = pd.create_qp(&init).unwrap();
    common::to_rts(&ctx, &qp, 0);
    let mr = pd.register(1024 * 128, AccessFlags::LOCAL_WRITE).unwrap();
    let post = |i: u64| {
        qp.post_recv(&[RecvWr {
            wr_id: i,
            sg_list: vec![mr.sge((i as usize) * 128..(i as usize + 1) * 128).unwrap()],
        }])
        .unwrap();
    };
    (0..1024).for_each(post);
    let holds = || ctx.udp_status().unwrap().2;
    println!("{} {}", qp.qp_num(), holds());
    std::thread::spawn(|| {
        for _ in std::io::stdin().lock().lines() {}
        std::process::exit(0);
    });
    let mut held = holds();
    let mut wc = [WorkCompletion::default(); 32];
    if !busy {
        cq.req_notify(false).unwrap();
    }
    loop {
        if !busy {
            if let Ok(ev) = ch.get_cq_event_timeout(Some(Duration::from_millis(100))) {
                ev.ack();
                cq.req_notify(false).unwrap();
            }
        }
        let n = cq.poll(&mut wc);
        for w in &wc[..n] {
            let seq = mr.read_u64(w.wr_id as usize * 128 + 40).unwrap();
            println!("got {seq}");
            post(w.wr_id);
        }
        if holds() != held {
            held = !held;
            println!("holder {held}");
        }
    }
}

/// The standard peer: UD SEND ONLY datagrams to the base port, as a stack that knows nothing
/// of slots sends them.
struct StandardPeer {
    sock: UdpSocket,
    dst: SocketAddr,
    seq: u64,
}

impl StandardPeer {
    fn send(&mut self, qpn: u32) -> u64 {
        use softverbs_wire::{BthRepr, DethRepr, Opcode, PacketRepr, Psn};
        self.seq += 1;
        let bth = BthRepr::new(Opcode::UdSendOnly, qpn, Psn::new(self.seq as u32));
        let repr = PacketRepr {
            deth: Some(DethRepr {
                qkey: QKEY,
                src_qpn: 0x1234,
            }),
            ..PacketRepr::new(bth, 8)
        };
        let mut pkt = vec![0u8; repr.buffer_len()];
        repr.emit_with_payload(&mut pkt, &self.seq.to_ne_bytes()).unwrap();
        softverbs_wire::icrc::fill(self.sock.local_addr().unwrap(), self.dst, &mut pkt).unwrap();
        self.sock.send_to(&pkt, self.dst).unwrap();
        self.seq
    }
}

/// A running member process.
struct Member {
    p: Peer,
    qpn: u32,
    got: BTreeSet<u64>,
    holder: bool,
}

impl Member {
    fn start(busy: bool, base: u16) -> Self {
        let mut p = spawn_self(
            &["--member", if busy { "busy" } else { "idle" }],
            &[("SOFTVERBS_UDP_PORT", base.to_string())],
        );
        let l = p.line(LINE);
        let (qpn, holder) = l.split_once(' ').unwrap();
        Self {
            p,
            qpn: qpn.parse().unwrap(),
            got: BTreeSet::new(),
            holder: holder == "true",
        }
    }

    fn read(&mut self) {
        while let Some(l) = self.p.try_line(Duration::ZERO) {
            if let Some(seq) = l.strip_prefix("got ") {
                self.got.insert(seq.parse().unwrap());
            } else if let Some(h) = l.strip_prefix("holder ") {
                self.holder = h == "true";
            }
        }
    }
}

/// Sends to every member every 5 ms until each got a datagram sent from `from` on and
/// exactly one holds the base port (or `limit` passes).
fn reach_all(std_peer: &mut StandardPeer, members: &mut [&mut Member], limit: Duration) -> bool {
    let from = std_peer.seq + 1;
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        for m in members.iter() {
            std_peer.send(m.qpn);
        }
        std::thread::sleep(Duration::from_millis(5));
        for m in members.iter_mut() {
            m.read();
        }
        let reached = members.iter().all(|m| m.got.range(from..).next().is_some());
        let holders = members.iter().filter(|m| m.holder).count();
        if reached && holders == 1 {
            return true;
        }
    }
    false
}

fn standard_port_changes_hands() {
    // A base port of its own: this process takes no part (it is the standard peer).
    let base = common::free_base_port();
    let mut std_peer = StandardPeer {
        sock: UdpSocket::bind("127.0.0.1:0").unwrap(),
        dst: SocketAddr::from((Ipv4Addr::LOCALHOST, base)),
        seq: 0,
    };
    let mut first = Member::start(false, base);
    assert!(first.holder, "the first process takes the base port");
    let mut busy = Member::start(true, base);
    assert!(!busy.holder);
    assert!(
        reach_all(&mut std_peer, &mut [&mut first, &mut busy], LINE),
        "forwarded to both"
    );
    // The holder dies during traffic; the busy-polling survivor takes over.
    first.p.signal(Signal::SIGKILL);
    let killed = Instant::now();
    assert!(
        reach_all(&mut std_peer, &mut [&mut busy], LINE),
        "the busy-polling survivor took the port over: holder {}, got {:?}",
        busy.holder,
        busy.got.last()
    );
    let busy_took = killed.elapsed();
    drop(first);
    let mut idle = Member::start(false, base);
    assert!(!idle.holder);
    assert!(
        reach_all(&mut std_peer, &mut [&mut busy, &mut idle], LINE),
        "forwarded to the newcomer"
    );
    busy.p.signal(Signal::SIGKILL);
    let killed = Instant::now();
    assert!(
        reach_all(&mut std_peer, &mut [&mut idle], LINE),
        "the sleeping survivor took the port over"
    );
    println!(
        "  taken over and reached within {busy_took:?} (busy-polling), {:?} (sleeping)",
        killed.elapsed()
    );
    drop(busy);
    let mut late = Member::start(true, base);
    assert!(
        reach_all(&mut std_peer, &mut [&mut idle, &mut late], LINE),
        "and forwards to the next one"
    );
}

// ---------------------------------------------------------------------------------------------
// Processes that leave without cleaning up

/// What the litter scenario names: fixed ones (the next process must be able to use them
/// again) and per-round ones (they must not pile up).
struct Names {
    cm_port: u16,
    group: Ipv4Addr,
    xrc_file: std::path::PathBuf,
    round_cm_port: u16,
    round_group: Ipv4Addr,
    round_xrc_file: std::path::PathBuf,
}

impl Names {
    fn args(&self) -> Vec<String> {
        vec![
            self.cm_port.to_string(),
            self.group.to_string(),
            self.xrc_file.display().to_string(),
            self.round_cm_port.to_string(),
            self.round_group.to_string(),
            self.round_xrc_file.display().to_string(),
        ]
    }
}

/// A process that takes one of everything, says so, serves one CM connection and one
/// multicast datagram, then dies the way it is told (`kill`: waits to be killed; `exit`:
/// leaves with `exit(0)`, destroying nothing).
fn litter(args: &[String]) {
    let cm_port: u16 = args[0].parse().unwrap();
    let group: Ipv4Addr = args[1].parse().unwrap();
    let round_cm_port: u16 = args[3].parse().unwrap();
    let round_group: Ipv4Addr = args[4].parse().unwrap();
    let how = &args[6];
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256, None, 0).unwrap();
    let mr = pd.register(1 << 16, ALL).unwrap();
    let rc = pd.create_qp(&QpInit::new(QpType::Rc, &cq)).unwrap();
    common::to_rts(&ctx, &rc, rc.qp_num());
    let mut init = QpInit::new(QpType::Ud, &cq);
    init.cap.max_recv_wr = 64;
    let ud = pd.create_qp(&init).unwrap();
    common::to_rts(&ctx, &ud, 0);
    ud.post_recv(&common::recv_wrs(&mr, 0..64, 1024)).unwrap();
    let (slot, ..) = ctx.udp_status().unwrap();
    // XRC: the fixed file with O_EXCL fails if a dead holder still counted.
    let open = |p: &str| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(p)
            .unwrap()
    };
    let xf = open(&args[2]);
    let xrcd = ctx.open_xrcd(Some(xf.as_fd()), O_CREAT | O_EXCL).unwrap();
    let srq = xrcd
        .create_srq(
            &pd,
            &cq,
            &SrqAttr {
                max_wr: 16,
                max_sge: 1,
                srq_limit: 0,
            },
        )
        .unwrap();
    let rf = open(&args[5]);
    let round_xrcd = ctx.open_xrcd(Some(rf.as_fd()), O_CREAT).unwrap();
    // Multicast: a verbs attach to both groups, and a CM join of the per-round one.
    let gid = |ip: Ipv4Addr| Gid::from(ip);
    ud.attach_mcast(&gid(group), 0).unwrap();
    ud.attach_mcast(&gid(round_group), 0).unwrap();
    // The CM: a listener on the fixed port (that serves the parent) and one on the round's.
    let ch = EventChannel::new().unwrap();
    let listen = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
    listen.bind_addr(common::cm::loopback(cm_port)).unwrap();
    listen.listen(4).unwrap();
    let round_listen = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
    round_listen
        .bind_addr(common::cm::loopback(round_cm_port))
        .unwrap();
    round_listen.listen(4).unwrap();
    let join = CmId::new(Some(&ch), PortSpace::Udp).unwrap();
    // Resolving the group from a loopback source ties the id to sv_lo (a bind alone to a
    // loopback address attaches no device, as with the kernel's rdma_cm).
    join.resolve_addr(
        Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
        SocketAddr::from((round_group, 0)),
        2000,
    )
    .unwrap();
    drop(common::cm::expect(&ch, E::AddrResolved));
    join.join_multicast(std::net::IpAddr::V4(round_group)).unwrap();
    let joined = ch.get_event_timeout(common::cm::WAIT).unwrap();
    assert_eq!(joined.event_type(), E::MulticastJoin);
    drop(joined);
    println!("ready {slot} {}", ud.qp_num());
    // One connection from the parent.
    let req = common::cm::expect(&ch, E::ConnectRequest);
    let id = req.id().clone();
    drop(req);
    let cq2 = ctx.create_cq(16, None, 0).unwrap();
    id.create_qp(&pd, &QpInit::new(QpType::Rc, &cq2)).unwrap();
    id.accept(&ConnParam::default()).unwrap();
    drop(common::cm::expect(&ch, E::Established));
    println!("connected");
    // One multicast datagram of the fixed group (over shared memory only: see the parent).
    let mut wc = [WorkCompletion::default(); 4];
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut mcast = carrier() == "udp";
    while Instant::now() < deadline && !mcast {
        mcast = cq.poll(&mut wc) > 0 && wc[0].status == WcStatus::Success;
        std::thread::sleep(Duration::from_millis(1));
    }
    println!("mcast {mcast}");
    let keep = (
        ctx,
        pd,
        cq,
        cq2,
        mr,
        rc,
        ud,
        xrcd,
        srq,
        round_xrcd,
        listen,
        round_listen,
        join,
        id,
        ch,
    );
    if how == "exit" {
        std::mem::forget(keep);
        std::process::exit(0);
    }
    let mut stdin = std::io::stdin().lock().lines();
    let _ = stdin.next();
    drop(keep);
}

/// The softverbs files in `/dev/shm` (names, recursively) that concern one of `ports` (the base
/// port and the slots of this test's processes) or one of `inodes` (the XRC domain files).
/// Only exact ports: other tests' processes may run on bases near ours.
fn shm_files(ports: &[u16], inodes: &[u64]) -> BTreeSet<String> {
    let netns = std::fs::metadata("/proc/self/ns/net")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    let ours = |name: &str| {
        // <netns>-<port>[-...]
        let mine = name
            .strip_prefix(&format!("{netns}-"))
            .and_then(|r| r.split(['-', '.']).next())
            .and_then(|p| p.parse::<u16>().ok())
            .is_some_and(|p| ports.contains(&p));
        mine || inodes.iter().any(|i| name.ends_with(&format!("-{i}")))
    };
    let mut out = BTreeSet::new();
    let mut dirs = vec![std::path::PathBuf::from("/dev/shm")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() && name.starts_with("softverbs") {
                dirs.push(e.path());
            } else if !ft.is_dir() && ours(&name) {
                out.insert(e.path().display().to_string());
            }
        }
    }
    out
}

fn leftovers_do_not_hurt_the_next_process() {
    let base: u16 = std::env::var("SOFTVERBS_UDP_PORT").unwrap().parse().unwrap();
    // This process: the CM client and multicast sender, on the same base port.
    let ctx = common::lo();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None, 0).unwrap();
    let mr = pd.register(4096, ALL).unwrap();
    let ud = pd.create_qp(&QpInit::new(QpType::Ud, &cq)).unwrap();
    common::to_rts(&ctx, &ud, 0);
    let dir = std::env::temp_dir().join(format!("svfaults{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tcp_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let group = Ipv4Addr::new(239, 77, (std::process::id() % 200) as u8, 1);
    let fixed = (tcp_port(), dir.join("xrc-fixed"));
    let mut inodes = Vec::new();
    let (own_slot, ..) = ctx.udp_status().unwrap();
    let mut ports = vec![base, base + u16::from(own_slot)];
    let before = shm_files(&ports, &[]);
    let mut slot = None;
    let mut last = BTreeSet::new();
    let (mut counts, mut first_left) = (vec![before.len()], 0);
    for round in 0..6u8 {
        let names = Names {
            cm_port: fixed.0,
            group,
            xrc_file: fixed.1.clone(),
            round_cm_port: tcp_port(),
            round_group: Ipv4Addr::new(239, 78, (std::process::id() % 200) as u8, round + 1),
            round_xrc_file: dir.join(format!("xrc-{round}")),
        };
        let how = if round % 2 == 0 { "kill" } else { "exit" };
        let mut args: Vec<String> = vec!["--litter".into()];
        args.extend(names.args());
        args.push(how.into());
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut p = spawn_self(&argv, &[]);
        let ready = p.line(LINE);
        let v: Vec<&str> = ready.split_whitespace().collect();
        assert_eq!(v.first(), Some(&"ready"), "round {round}: {ready}");
        let s: u8 = v[1].parse().unwrap();
        assert_eq!(
            *slot.get_or_insert(s),
            s,
            "round {round}: the next process gets the same slot"
        );
        if round == 0 {
            ports.push(base + u16::from(s));
        }
        // A connection to the listener on the fixed port.
        let ch = EventChannel::new().unwrap();
        let id = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
        id.resolve_addr(None, common::cm::loopback(names.cm_port), 2000)
            .unwrap();
        drop(common::cm::expect(&ch, E::AddrResolved));
        id.resolve_route(2000).unwrap();
        drop(common::cm::expect(&ch, E::RouteResolved));
        let ccq = ctx.create_cq(16, None, 0).unwrap();
        id.create_qp(&pd, &QpInit::new(QpType::Rc, &ccq)).unwrap();
        id.connect(&ConnParam::default()).unwrap();
        drop(common::cm::expect(&ch, E::Established));
        assert_eq!(p.line(LINE), "connected", "round {round}");
        // A multicast datagram to the fixed group (processes of one host get each other's
        // multicast through their mailboxes only).
        let mut attr = common::ah_attr(&ctx);
        attr.grh.dgid = Gid::from(group);
        let ah = pd.create_ah(&attr).unwrap();
        let send = SendRequest {
            wr_id: 1,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![mr.sge(0..8).unwrap()]),
            ud: Some(ah.ud_address(0xFF_FFFF, QKEY)),
            xrc_srqn: None,
        };
        let over_shm = carrier() == "shm";
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut heard = None;
        while heard.is_none() && Instant::now() < deadline {
            ud.post_send(std::slice::from_ref(&send)).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            common::drain(&cq);
            heard = p.try_line(Duration::ZERO);
            if !over_shm {
                break;
            }
        }
        let heard = heard.unwrap_or_else(|| p.line(LINE));
        if over_shm {
            assert_eq!(
                heard, "mcast true",
                "round {round}: the new member gets the group's traffic"
            );
        }
        // The client's side goes first, cleanly; then the server dies without cleaning up.
        id.disconnect().unwrap();
        drop((id, ccq, ah));
        drop(ch);
        if how == "kill" {
            p.signal(Signal::SIGKILL);
        }
        assert!(p.wait_exit(LINE).is_some(), "round {round}: the process ended");
        drop(p);
        for f in [&names.xrc_file, &names.round_xrc_file] {
            inodes.push(std::os::unix::fs::MetadataExt::ino(
                &std::fs::metadata(f).unwrap(),
            ));
        }
        inodes.dedup();
        let now = shm_files(&ports, &inodes);
        counts.push(now.len());
        if round >= 2 {
            // What a dead process leaves until the next one cleans up: it does not grow
            // round by round.
            assert!(
                now.len() <= first_left,
                "round {round}: /dev/shm grows ({counts:?} files): {last:?} -> {now:?}"
            );
        } else {
            first_left = first_left.max(now.len());
        }
        last = now;
        let _ = std::fs::remove_file(&names.round_xrc_file);
    }
    drop((ud, mr, cq, pd, ctx));
    let _ = std::fs::remove_dir_all(&dir);
    println!("  files in /dev/shm before and after each round: {counts:?}");
}

// ---------------------------------------------------------------------------------------------

/// The carrier between the processes in this run: `shm` (the default) or `udp`
/// (`SOFTVERBS_SHM=0`).
fn carrier() -> &'static str {
    if std::env::var("SOFTVERBS_SHM").is_ok_and(|v| v == "0") {
        "udp"
    } else {
        "shm"
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--receiver") {
        receiver(qp_type_of(&args[i + 1]));
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--member") {
        member(args[i + 1] == "busy");
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--litter") {
        litter(&args[i + 1..]);
        return;
    }
    // Before any device exists: this process and its peers use a private base port.
    std::env::set_var("SOFTVERBS_UDP_PORT", common::free_base_port().to_string());
    let rerun_over_udp = carrier() == "shm";
    let udp_run = rerun_over_udp.then(|| {
        Command::new(std::env::current_exe().unwrap())
            .args(args.iter().skip(1))
            .env("SOFTVERBS_SHM", "0")
            .env("SOFTVERBS_UDP_PORT", common::free_base_port().to_string())
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap()
    });
    // The library's threads start with the first QP: count from there.
    drop(Side::new(QpType::Ud));
    let filter = args.iter().skip(1).find(|a| !a.starts_with('-')).cloned();
    let mut tests: Vec<(String, Box<dyn Fn()>)> = Vec::new();
    for t in [QpType::Rc, QpType::Uc, QpType::Ud] {
        for sig in [Signal::SIGKILL, Signal::SIGSTOP] {
            let name = format!(
                "{}_peer_{}",
                format!("{t:?}").to_lowercase(),
                &format!("{sig:?}")[3..].to_lowercase()
            );
            tests.push((name, Box::new(move || fault(t, sig))));
        }
    }
    tests.push((
        "standard_port_changes_hands".into(),
        Box::new(standard_port_changes_hands),
    ));
    tests.push((
        "leftovers_do_not_hurt_the_next_process".into(),
        Box::new(leftovers_do_not_hurt_the_next_process),
    ));
    let mut failed = 0;
    let mut total = 0;
    for (name, t) in &tests {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        total += 1;
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(t)).is_ok();
        println!(
            "test faults::{}::{name} ... {}",
            carrier(),
            if ok { "ok" } else { "FAILED" }
        );
        failed += usize::from(!ok);
    }
    if let Some(out) = udp_run {
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines() {
            println!("{line}");
            if line.starts_with("test ") {
                total += 1;
                failed += usize::from(!line.ends_with(" ok"));
            }
        }
        if !out.status.success() && !text.contains("FAILED") {
            failed += 1;
        }
    }
    if rerun_over_udp {
        println!("{} passed, {} failed", total - failed, failed);
    }
    std::process::exit(i32::from(failed > 0));
}
