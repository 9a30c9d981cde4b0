//! The ping-pong programs' logic, run as server and client threads of this process over a real
//! TCP connection on 127.0.0.1 (the QPs talk through softverbs' in-process fabric), plus the
//! same programs as two processes talking RoCEv2 over UDP.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use softverbs::*;
use softverbs_tools::pingpong::{self, Config, Dest, PingPong, Report, Role, Transport, DONE, WIRE_LEN};

/// Busy-polling pairs compete for the CPUs; running them one at a time keeps each quick.
static SERIAL: Mutex<()> = Mutex::new(());

const BOUND: Duration = Duration::from_secs(30);

fn lo() -> Context {
    devices()
        .unwrap()
        .into_iter()
        .find(|d| d.netdev() == "lo")
        .expect("a loopback device")
        .open()
        .unwrap()
}

struct Side {
    report: Report,
    output: String,
}

fn side(cfg: Config, role: Role, stream: impl FnOnce() -> TcpStream) -> Result<Side, String> {
    let ctx = lo();
    let pp = PingPong::new(&ctx, cfg).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    pp.print_local(&mut out).map_err(|e| e.to_string())?;
    let s = stream();
    s.set_read_timeout(Some(BOUND)).unwrap();
    let report = pp.run(role, s, &mut out).map_err(|e| e.to_string())?;
    Ok(Side {
        report,
        output: String::from_utf8(out).unwrap(),
    })
}

/// Runs a server thread and a client thread with the same configuration.
fn pair(cfg: &Config) -> (Side, Side) {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (scfg, ccfg) = (cfg.clone(), cfg.clone());
    let server = thread::spawn(move || side(scfg, Role::Server, move || listener.accept().unwrap().0));
    let client = thread::spawn(move || side(ccfg, Role::Client, move || TcpStream::connect(addr).unwrap()));
    let deadline = Instant::now() + BOUND;
    for h in [&server, &client] {
        while !h.is_finished() {
            assert!(
                Instant::now() < deadline,
                "the ping-pong did not finish within {BOUND:?}"
            );
            thread::sleep(Duration::from_millis(5));
        }
    }
    let s = server.join().unwrap().unwrap_or_else(|e| panic!("server: {e}"));
    let c = client.join().unwrap().unwrap_or_else(|e| panic!("client: {e}"));
    (s, c)
}

fn config(t: Transport, events: bool) -> Config {
    let mut cfg = Config::new(t);
    cfg.iters = 300;
    cfg.check = true;
    cfg.use_events = events;
    cfg.timeout = Some(Duration::from_secs(20));
    cfg
}

/// Everything a correct run shows on both sides.
fn assert_good_run(cfg: &Config, s: &Side, c: &Side) {
    let iters = u64::from(cfg.iters);
    for (who, side) in [("server", s), ("client", c)] {
        let r = &side.report;
        assert!(
            r.sends >= iters && r.recvs >= iters,
            "{who}: {} sends, {} receives",
            r.sends,
            r.recvs
        );
        assert_eq!(r.bytes, cfg.size as u64 * iters * 2);
        assert_eq!(r.local.len(), cfg.num_qp as usize);
        assert_eq!(r.remote.len(), cfg.num_qp as usize);
        if cfg.use_events {
            assert!(r.cq_events > 0, "{who} slept on no completion event");
        } else {
            assert_eq!(r.cq_events, 0);
        }
        let lines: Vec<&str> = side.output.lines().collect();
        let locals = lines
            .iter()
            .filter(|l| l.starts_with("  local address:  LID 0x0000, QPN 0x"))
            .count();
        let remotes = lines
            .iter()
            .filter(|l| l.starts_with("  remote address: LID 0x0000, QPN 0x"))
            .count();
        assert_eq!(
            (locals, remotes),
            (cfg.num_qp as usize, cfg.num_qp as usize),
            "{who}:\n{}",
            side.output
        );
        assert!(
            side.output.contains("GID ::ffff:127.0.0.1"),
            "{who}:\n{}",
            side.output
        );
        let summary = format!("{} bytes in ", r.bytes);
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&summary) && l.ends_with(" Mbit/sec")),
            "{who}:\n{}",
            side.output
        );
        let iters_line = format!("{} iters in ", cfg.iters);
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&iters_line) && l.ends_with(" usec/iter")),
            "{who}:\n{}",
            side.output
        );
        assert!(!side.output.contains("invalid data"), "{who}:\n{}", side.output);
    }
    // Each side learned exactly what the other announced (QPN and random PSN).
    assert_eq!(s.report.remote, c.report.local);
    assert_eq!(c.report.remote, s.report.local);
    assert!(s.report.checked, "the server checks the data with -c");
    assert!(!c.report.checked, "only the server checks");
    assert!(s.report.invalid_pages.is_empty());
}

fn run_and_check(cfg: Config) {
    let (s, c) = pair(&cfg);
    assert_good_run(&cfg, &s, &c);
}

mod threads {
    use super::*;

    #[test]
    fn rc_polling() {
        run_and_check(config(Transport::Rc, false));
    }

    #[test]
    fn rc_events() {
        run_and_check(config(Transport::Rc, true));
    }

    #[test]
    fn uc_polling() {
        run_and_check(config(Transport::Uc, false));
    }

    #[test]
    fn uc_events() {
        run_and_check(config(Transport::Uc, true));
    }

    #[test]
    fn ud_polling() {
        run_and_check(config(Transport::Ud, false));
    }

    #[test]
    fn ud_events() {
        run_and_check(config(Transport::Ud, true));
    }

    #[test]
    fn srq_polling() {
        run_and_check(config(Transport::Srq, false));
    }

    #[test]
    fn srq_events() {
        run_and_check(config(Transport::Srq, true));
    }

    #[test]
    fn rc_multi_page_message_with_small_rx_depth_and_mtu() {
        let mut cfg = config(Transport::Rc, false);
        cfg.size = 3 * pingpong::CHECK_PAGE_SIZE + 100;
        cfg.rx_depth = 1;
        cfg.mtu = Mtu::Mtu256;
        cfg.iters = 50;
        run_and_check(cfg);
    }

    #[test]
    fn uc_multi_packet_messages_with_events() {
        let mut cfg = config(Transport::Uc, true);
        cfg.size = 10_000;
        cfg.mtu = Mtu::Mtu4096;
        cfg.rx_depth = 7;
        run_and_check(cfg);
    }

    #[test]
    fn ud_message_of_a_whole_mtu() {
        let mut cfg = config(Transport::Ud, false);
        cfg.size = 4096;
        cfg.iters = 100;
        run_and_check(cfg);
    }

    #[test]
    fn srq_with_few_qps_and_the_smallest_rx_depth() {
        let mut cfg = config(Transport::Srq, true);
        cfg.num_qp = 3;
        cfg.rx_depth = 3;
        cfg.size = 64;
        run_and_check(cfg);
    }

    #[test]
    fn explicit_gid_index_is_announced() {
        let ctx = lo();
        let idx = (0..16)
            .find(|&i| ctx.query_gid(1, i).unwrap() == Gid::from(std::net::Ipv4Addr::LOCALHOST))
            .unwrap();
        let mut cfg = config(Transport::Rc, false);
        cfg.gid_index = Some(idx);
        cfg.iters = 20;
        let (s, c) = pair(&cfg);
        assert_good_run(&cfg, &s, &c);
        assert_eq!(s.report.local[0].gid, Gid::from(std::net::Ipv4Addr::LOCALHOST));
    }

    #[test]
    fn check_reports_the_pages_a_client_without_the_pattern_left_unwritten() {
        // As with rdma-core, only a client started with -c writes the pattern.
        let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut cfg = config(Transport::Rc, false);
        cfg.size = 2 * pingpong::CHECK_PAGE_SIZE;
        cfg.iters = 10;
        let mut unchecked = cfg.clone();
        unchecked.check = false;
        let server = thread::spawn(move || side(cfg, Role::Server, move || listener.accept().unwrap().0));
        let client = side(unchecked, Role::Client, move || TcpStream::connect(addr).unwrap()).unwrap();
        let server = server.join().unwrap().unwrap();
        assert_eq!(server.report.invalid_pages, vec![0, 1]);
        assert!(
            server
                .output
                .contains("invalid data in page 0\ninvalid data in page 1\n"),
            "{}",
            server.output
        );
        assert!(client.report.invalid_pages.is_empty());
    }

    #[test]
    fn rc_on_demand_paging() {
        let mut cfg = config(Transport::Rc, false);
        cfg.odp = true;
        run_and_check(cfg);
    }

    #[test]
    fn rc_on_demand_paging_prefetched_with_events() {
        let mut cfg = config(Transport::Rc, true);
        cfg.odp = true;
        cfg.prefetch = true;
        run_and_check(cfg);
    }

    #[test]
    fn rc_implicit_on_demand_paging_prefetched() {
        let mut cfg = config(Transport::Rc, false);
        cfg.odp = true;
        cfg.implicit_odp = true;
        cfg.prefetch = true;
        cfg.size = 2 * pingpong::CHECK_PAGE_SIZE + 10;
        run_and_check(cfg);
    }

    #[test]
    fn srq_on_demand_paging() {
        let mut cfg = config(Transport::Srq, false);
        cfg.odp = true;
        run_and_check(cfg);
    }

    #[test]
    fn rc_device_memory() {
        let mut cfg = config(Transport::Rc, true);
        cfg.device_memory = true;
        cfg.size = 3 * pingpong::CHECK_PAGE_SIZE;
        run_and_check(cfg);
    }

    /// With -j the server checks what arrived in device memory: a client without -c sends its
    /// 0x7b filler, which overwrites the zeroed device memory at every checked byte (had
    /// nothing arrived, the zeros would pass the check; `rc_device_memory` shows the copy out
    /// of device memory, as the server's own buffer starts as 0x7b).
    #[test]
    fn device_memory_receives_what_the_client_sent() {
        let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut cfg = config(Transport::Rc, false);
        cfg.device_memory = true;
        cfg.size = 2 * pingpong::CHECK_PAGE_SIZE;
        cfg.iters = 10;
        let mut unchecked = cfg.clone();
        unchecked.check = false;
        let server = thread::spawn(move || side(cfg, Role::Server, move || listener.accept().unwrap().0));
        side(unchecked, Role::Client, move || TcpStream::connect(addr).unwrap()).unwrap();
        let server = server.join().unwrap().unwrap();
        assert_eq!(server.report.invalid_pages, vec![0, 1], "{}", server.output);
    }

    /// -t: every receive after the first yields a gap between completion timestamps; the
    /// statistics are printed after the summary as rdma-core prints them, and agree with the
    /// measured time per iteration (the clock counts nanoseconds).
    #[test]
    fn rc_completion_timestamps() {
        for events in [false, true] {
            let mut cfg = config(Transport::Rc, events);
            cfg.timestamps = true;
            let (s, c) = pair(&cfg);
            assert_good_run(&cfg, &s, &c);
            for side in [&s, &c] {
                let clock = side.report.recv_clock.expect("receive clock statistics");
                assert_eq!(clock.samples, cfg.iters - 1);
                let avg = clock.total as f64 / f64::from(clock.samples);
                assert!(
                    0 < clock.min && clock.min as f64 <= avg && avg <= clock.max as f64,
                    "{clock:?}"
                );
                let per_iter_ns = side.report.elapsed.as_nanos() as f64 / f64::from(cfg.iters);
                assert!(
                    avg > per_iter_ns / 3.0 && avg < per_iter_ns * 3.0,
                    "{avg} ns between receives, {per_iter_ns} ns per iteration"
                );
                let lines: Vec<&str> = side.output.lines().collect();
                let at = lines
                    .iter()
                    .position(|l| l.ends_with(" usec/iter"))
                    .expect("summary");
                assert_eq!(
                    lines[at + 1..at + 4],
                    [
                        format!("Max receive completion clock cycles = {}", clock.max),
                        format!("Min receive completion clock cycles = {}", clock.min),
                        format!("Average receive completion clock cycles = {avg:.6}"),
                    ],
                    "{}",
                    side.output
                );
            }
        }
        // Without -t nothing is measured or printed.
        let (s, _) = pair(&config(Transport::Rc, false));
        assert!(s.report.recv_clock.is_none());
        assert!(!s.output.contains("clock cycles"), "{}", s.output);
    }

    #[test]
    fn rdma_core_consistency_checks() {
        let refused = |f: &dyn Fn(&mut Config), t: Transport| {
            let mut cfg = config(t, false);
            f(&mut cfg);
            PingPong::new(&lo(), cfg).unwrap_err().message().to_string()
        };
        let odp_dm = |c: &mut Config| {
            c.odp = true;
            c.device_memory = true;
        };
        assert_eq!(
            refused(&odp_dm, Transport::Rc),
            "DM memory region can't be on demand"
        );
        let prefetch = |c: &mut Config| c.prefetch = true;
        assert_eq!(
            refused(&prefetch, Transport::Rc),
            "prefetch is valid only with on-demand memory region"
        );
        let ts = |c: &mut Config| c.timestamps = true;
        assert!(refused(&ts, Transport::Uc).contains("only ibv_rc_pingpong"));
        let odp = |c: &mut Config| c.odp = true;
        assert!(refused(&odp, Transport::Ud).contains("on-demand paging"));
    }

    #[test]
    fn ud_size_above_the_mtu_is_refused() {
        let mut cfg = config(Transport::Ud, false);
        cfg.size = 8192;
        let err = PingPong::new(&lo(), cfg).unwrap_err();
        assert!(err.message().contains("larger than the port MTU"), "{err}");
    }

    #[test]
    fn srq_needs_a_receive_per_qp() {
        let mut cfg = config(Transport::Srq, false);
        cfg.num_qp = 8;
        cfg.rx_depth = 4;
        assert!(PingPong::new(&lo(), cfg).is_err());
    }
}

/// The peer end of the socket written by hand, byte for byte as rdma-core's C client does it,
/// so the exchange is checked against the C format rather than against this crate's own encoder.
mod c_wire_protocol {
    use super::*;

    /// A QP with the C client's setup, in INIT with receives posted.
    struct CPeer {
        _pd: ProtectionDomain,
        cq: CompletionQueue,
        qp: QueuePair,
        mr: MemoryRegion,
    }

    fn c_peer(ctx: &Context, size: usize) -> CPeer {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64, None, 0).unwrap();
        let mut init = QpInit::new(QpType::Rc, &cq);
        init.cap.max_send_wr = 1;
        init.cap.max_recv_wr = 32;
        let qp = pd.create_qp(&init).unwrap();
        let attr = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            ..Default::default()
        };
        qp.modify(
            &attr,
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
        )
        .unwrap();
        let mr = pd.register(size, AccessFlags::LOCAL_WRITE).unwrap();
        mr.fill(0x7b);
        let wrs: Vec<RecvWr> = (0..32)
            .map(|_| RecvWr {
                wr_id: 1,
                sg_list: vec![mr.sge(0..size).unwrap()],
            })
            .collect();
        qp.post_recv(&wrs).unwrap();
        CPeer { _pd: pd, cq, qp, mr }
    }

    fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
        let deadline = Instant::now() + BOUND;
        let mut wc = [WorkCompletion::default(); 1];
        loop {
            if cq.poll(&mut wc) == 1 {
                assert_eq!(wc[0].status, WcStatus::Success, "{:?}", wc[0]);
                return wc[0];
            }
            assert!(Instant::now() < deadline, "no completion");
        }
    }

    #[test]
    fn server_talks_to_a_hand_written_c_style_client() {
        let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let size = 4096;
        let iters = 10;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut cfg = config(Transport::Rc, false);
        cfg.iters = iters;
        cfg.size = size;
        let server = thread::spawn(move || side(cfg, Role::Server, move || listener.accept().unwrap().0));

        let ctx = lo();
        let me = c_peer(&ctx, size);
        let sgid = (0..16)
            .find(|&i| ctx.query_gid(1, i).unwrap() == Gid::from(std::net::Ipv4Addr::LOCALHOST))
            .unwrap();
        let gid = ctx.query_gid(1, sgid).unwrap();
        let my_psn = 0x00c0de_u32;
        // sprintf(msg, "%04x:%06x:%06x:%s", lid, qpn, psn, wire_gid), sent with its NUL.
        let wire_gid: String = gid.0.iter().map(|b| format!("{b:02x}")).collect();
        let text = format!("{:04x}:{:06x}:{:06x}:{}", 0, me.qp.qp_num(), my_psn, wire_gid);
        let mut msg = text.into_bytes();
        msg.push(0);
        assert_eq!(msg.len(), 52);
        let mut sock = TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(BOUND)).unwrap();
        sock.write_all(&msg).unwrap();
        let mut answer = [0u8; 52];
        sock.read_exact(&mut answer).unwrap();
        sock.write_all(b"done\0").unwrap();
        // sscanf(msg, "%x:%x:%x:%s", ...)
        assert_eq!(answer[51], 0, "NUL-terminated");
        let text = std::str::from_utf8(&answer[..51]).unwrap();
        let f: Vec<&str> = text.split(':').collect();
        assert_eq!(f.len(), 4, "{text}");
        assert_eq!(
            (f[0].len(), f[1].len(), f[2].len(), f[3].len()),
            (4, 6, 6, 32),
            "{text}"
        );
        let qpn = u32::from_str_radix(f[1], 16).unwrap();
        let psn = u32::from_str_radix(f[2], 16).unwrap();
        let mut rgid = [0u8; 16];
        for (i, b) in rgid.iter_mut().enumerate() {
            *b = u8::from_str_radix(&f[3][2 * i..2 * i + 2], 16).unwrap();
        }
        assert_eq!(Gid(rgid), Gid::from(std::net::Ipv4Addr::LOCALHOST));

        // pp_connect_ctx as the C client does it, then the ping-pong with the check pattern.
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: Mtu::Mtu1024,
            dest_qp_num: qpn,
            rq_psn: psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: AhAttr {
                grh: GlobalRoute {
                    dgid: Gid(rgid),
                    sgid_index: sgid as u8,
                    hop_limit: 1,
                    ..Default::default()
                },
                is_global: true,
                port_num: 1,
                ..Default::default()
            },
            ..Default::default()
        };
        me.qp
            .modify(
                &rtr,
                QpAttrMask::STATE
                    | QpAttrMask::AV
                    | QpAttrMask::PATH_MTU
                    | QpAttrMask::DEST_QPN
                    | QpAttrMask::RQ_PSN
                    | QpAttrMask::MAX_DEST_RD_ATOMIC
                    | QpAttrMask::MIN_RNR_TIMER,
            )
            .unwrap();
        let rts = QpAttr {
            qp_state: QpState::Rts,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: my_psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        me.qp
            .modify(
                &rts,
                QpAttrMask::STATE
                    | QpAttrMask::TIMEOUT
                    | QpAttrMask::RETRY_CNT
                    | QpAttrMask::RNR_RETRY
                    | QpAttrMask::SQ_PSN
                    | QpAttrMask::MAX_QP_RD_ATOMIC,
            )
            .unwrap();
        // The C client's -c pattern: buf[i] = i / page_size % sizeof(char), i.e. 0 per page.
        me.mr.write(0, &[0]).unwrap();
        let send = SendRequest {
            wr_id: 2,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![me.mr.sge(0..size).unwrap()]),
            ud: None,
            xrc_srqn: None,
        };
        let (mut sent, mut received) = (0, 0);
        let mut posted = 32;
        while sent < iters || received < iters {
            me.qp.post_send(std::slice::from_ref(&send)).unwrap();
            let mut need = (true, true);
            while need.0 || need.1 {
                let w = wait_one(&me.cq);
                match w.wr_id {
                    2 => {
                        need.0 = false;
                        sent += 1;
                    }
                    _ => {
                        need.1 = false;
                        received += 1;
                        posted -= 1;
                    }
                }
            }
            if posted < 4 {
                let wrs: Vec<RecvWr> = (0..28)
                    .map(|_| RecvWr {
                        wr_id: 1,
                        sg_list: vec![me.mr.sge(0..size).unwrap()],
                    })
                    .collect();
                me.qp.post_recv(&wrs).unwrap();
                posted += 28;
            }
        }
        let s = server.join().unwrap().unwrap_or_else(|e| panic!("server: {e}"));
        assert_eq!(
            s.report.remote[0],
            Dest {
                lid: 0,
                qpn: me.qp.qp_num(),
                psn: my_psn,
                gid
            }
        );
        assert!(s.report.invalid_pages.is_empty(), "{}", s.output);
        assert!(
            s.output
                .contains(&format!("PSN 0x{my_psn:06x}, GID ::ffff:127.0.0.1")),
            "{}",
            s.output
        );
    }

    #[test]
    fn client_sends_its_address_then_done() {
        let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        // A C-style server that reads the client's message, answers with a QP that will never
        // reply, and checks the "done" handshake; the client then times out in the loop.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut cfg = config(Transport::Uc, false);
        cfg.timeout = Some(Duration::from_millis(300));
        let client =
            thread::spawn(move || side(cfg, Role::Client, move || TcpStream::connect(addr).unwrap()));
        let (mut sock, _) = listener.accept().unwrap();
        sock.set_read_timeout(Some(BOUND)).unwrap();
        let mut msg = [0u8; WIRE_LEN];
        sock.read_exact(&mut msg).unwrap();
        let theirs = Dest::from_wire(&msg).unwrap();
        assert_eq!(theirs.gid, Gid::from(std::net::Ipv4Addr::LOCALHOST));
        let ctx = lo();
        let peer = c_peer(&ctx, 64);
        let mine = Dest {
            lid: 0,
            qpn: peer.qp.qp_num(),
            psn: 5,
            gid: theirs.gid,
        };
        sock.write_all(&mine.to_wire()).unwrap();
        let mut done = [0u8; 5];
        sock.read_exact(&mut done).unwrap();
        assert_eq!(&done, DONE);
        let err = client
            .join()
            .unwrap()
            .err()
            .expect("nobody answers, so the client times out");
        assert!(err.contains("timed out"), "{err}");
    }
}

/// The binaries as two processes on 127.0.0.1, talking RoCEv2 over UDP.
mod two_processes {
    use super::*;

    fn bin(t: Transport) -> &'static str {
        match t {
            Transport::Rc => env!("CARGO_BIN_EXE_ibv_rc_pingpong"),
            Transport::Uc => env!("CARGO_BIN_EXE_ibv_uc_pingpong"),
            Transport::Ud => env!("CARGO_BIN_EXE_ibv_ud_pingpong"),
            Transport::Srq => env!("CARGO_BIN_EXE_ibv_srq_pingpong"),
        }
    }

    /// A child whose stdout lines arrive on a channel; killed when dropped.
    struct Proc {
        child: Child,
        lines: mpsc::Receiver<String>,
        stderr: thread::JoinHandle<String>,
    }

    impl Proc {
        fn spawn(t: Transport, args: &[String]) -> Self {
            let mut child = Command::new(bin(t))
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let (tx, lines) = mpsc::channel();
            let out = child.stdout.take().unwrap();
            thread::spawn(move || {
                for l in BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
            let mut err = child.stderr.take().unwrap();
            let stderr = thread::spawn(move || {
                let mut s = String::new();
                let _ = err.read_to_string(&mut s);
                s
            });
            Self { child, lines, stderr }
        }

        /// Waits for the exit (killing the process at `deadline`); returns status, stdout, stderr.
        fn finish(mut self, deadline: Instant) -> (Option<i32>, String, String) {
            let status = loop {
                if let Some(st) = self.child.try_wait().unwrap() {
                    break st.code();
                }
                if Instant::now() > deadline {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break None;
                }
                thread::sleep(Duration::from_millis(10));
            };
            let mut out = String::new();
            while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
                out.push_str(&l);
                out.push('\n');
            }
            let err = std::mem::replace(&mut self.stderr, thread::spawn(String::new))
                .join()
                .unwrap();
            (status, out, err)
        }
    }

    impl Drop for Proc {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn two_process_run(t: Transport, events: bool) {
        two_process_run_with(t, events, &[]);
    }

    /// Runs server and client with `-c`, `-e` if `events` and `extra`; returns both outputs.
    fn two_process_run_with(t: Transport, events: bool, extra: &[&str]) -> (String, String) {
        let port = free_port();
        // -c on both sides: the client writes the pattern, the server checks it.
        let mut common: Vec<String> = [
            "-d",
            "sv_lo",
            "-p",
            &port.to_string(),
            "-n",
            "200",
            "-c",
            "--timeout",
            "20",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if events {
            common.push("-e".into());
        }
        common.extend(extra.iter().map(|s| s.to_string()));
        let deadline = Instant::now() + BOUND;
        let server = Proc::spawn(t, &common);
        // The server prints its address right before it listens.
        let first = server.lines.recv_timeout(BOUND).expect("the server started");
        assert!(first.contains("local address"), "{first}");
        let mut client_args = common.clone();
        client_args.push("127.0.0.1".into());
        let (client_status, client_out, client_err) = loop {
            let client = Proc::spawn(t, &client_args);
            let (st, out, err) = client.finish(deadline);
            // The listen() may not have happened yet: a refused connection is retried.
            if st == Some(1) && err.contains("Couldn't connect") && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(100));
                continue;
            }
            break (st, out, err);
        };
        let (server_status, mut server_out, server_err) = server.finish(deadline);
        server_out.insert_str(0, &format!("{first}\n"));
        let ctx = format!(
            "{t:?} events={events} {extra:?}\nserver {server_status:?}:\n{server_out}{server_err}\nclient {client_status:?}:\n{client_out}{client_err}"
        );
        assert_eq!((server_status, client_status), (Some(0), Some(0)), "{ctx}");
        for out in [&server_out, &client_out] {
            assert!(out.contains("remote address:"), "{ctx}");
            assert!(out.contains(" bytes in ") && out.contains(" Mbit/sec"), "{ctx}");
            assert!(
                out.contains("200 iters in ") && out.contains(" usec/iter"),
                "{ctx}"
            );
        }
        assert!(!server_out.contains("invalid data"), "{ctx}");
        // -P reports a failed prefetch and goes on; it must not fail here.
        for err in [&server_err, &client_err] {
            assert!(!err.contains("Couldn't prefetch"), "{ctx}");
        }
        (server_out, client_out)
    }

    /// The options of rdma-core's ibv_rc_pingpong beyond the basic ones (and ibv_srq_pingpong's
    /// -o), alone and combined, as two processes.
    #[test]
    fn rc_odp_timestamps_and_device_memory_as_two_processes() {
        let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        for extra in [
            &["-o"][..],
            &["-O"],
            &["-o", "-P"],
            &["-O", "-P", "-N"],
            &["-t"],
            &["-j"],
            &["-j", "-t"],
            &["-o", "-t"],
        ] {
            for events in [false, true] {
                let (s, c) = two_process_run_with(Transport::Rc, events, extra);
                let ts = extra.contains(&"-t");
                for out in [&s, &c] {
                    for key in ["Max", "Min", "Average"] {
                        let line = format!("{key} receive completion clock cycles = ");
                        assert_eq!(out.contains(&line), ts, "{extra:?}:\n{out}");
                    }
                }
            }
        }
        two_process_run_with(Transport::Srq, false, &["-o"]);
    }

    /// rdma-core's checks of incompatible options, before anything is opened.
    #[test]
    fn rc_refuses_inconsistent_options() {
        for (args, msg) in [
            (&["-o", "-j"][..], "DM memory region can't be on demand"),
            (&["-O", "-j"], "DM memory region can't be on demand"),
            (&["-P"], "prefetch is valid only with on-demand memory region"),
        ] {
            let out = Command::new(bin(Transport::Rc))
                .args(["-d", "sv_lo", "-p", &free_port().to_string(), "--timeout", "5"])
                .args(args)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
            assert!(err.contains(msg), "{args:?}: {err}");
        }
    }

    #[test]
    fn pingpongs_as_two_processes() {
        let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        for t in [Transport::Rc, Transport::Uc, Transport::Ud, Transport::Srq] {
            for events in [false, true] {
                two_process_run(t, events);
            }
        }
    }
}
