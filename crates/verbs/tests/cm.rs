//! The RDMA connection manager in one process, over the loopback device: events in
//! `rdma_cm(7)` order, the QP transitions, private data, SIDR, multicast and teardown.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use softverbs::cm::{CmEventType as E, CmId, ConnParam, EventChannel, PortSpace, RDMA_UDP_QKEY};
use softverbs::*;

mod common;

use common::cm::{expect, loopback as lo, res, Res};

/// The tests share the loopback device's CM; the leak count needs it to itself.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn listener(ch: &EventChannel, ps: PortSpace) -> (CmId, u16) {
    let id = CmId::new(Some(ch), ps).unwrap();
    id.bind_addr(lo(0)).unwrap();
    id.listen(16).unwrap();
    let port = id.src_addr().unwrap().port();
    assert_ne!(port, 0, "an ephemeral port was chosen");
    (id, port)
}

fn resolved(ch: &EventChannel, ps: PortSpace, port: u16) -> CmId {
    let id = CmId::new(Some(ch), ps).unwrap();
    id.resolve_addr(None, lo(port), 2000).unwrap();
    expect(ch, E::AddrResolved);
    id.resolve_route(2000).unwrap();
    expect(ch, E::RouteResolved);
    id
}

fn qp(id: &CmId, r: &Res, qp_type: QpType) -> QueuePair {
    id.create_qp(&r.pd, &QpInit::new(qp_type, &r.cq)).unwrap()
}

fn poll(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    let mut wc = [WorkCompletion::default(); 8];
    while got.len() < n {
        assert!(Instant::now() < deadline, "only {} of {n} completions", got.len());
        let k = cq.poll(&mut wc);
        got.extend_from_slice(&wc[..k]);
        if k == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    got
}

fn send(payload: Sge, ud: Option<UdAddress>) -> SendRequest {
    SendRequest {
        wr_id: 1,
        op: SendOp::Send {
            imm: None,
            invalidate: None,
        },
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![payload]),
        ud,
        xrc_srqn: None,
    }
}

#[test]
fn rc_events_in_order_with_send_and_disconnect() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let (_listen, port) = listener(&ch, PortSpace::Tcp);
    let client = resolved(&ch, PortSpace::Tcp, port);
    assert_eq!(client.dst_addr(), Some(lo(port)));
    let cr = res(&client);
    let cqp = qp(&client, &cr, QpType::Rc);
    assert_eq!(
        cqp.state(),
        QpState::Init,
        "rdma_create_qp leaves a connected QP in INIT"
    );
    let max = client
        .context()
        .unwrap()
        .query_device()
        .max_qp_init_rd_atom
        .min(255) as u8;
    client
        .connect(&ConnParam {
            private_data: b"hello".to_vec(),
            responder_resources: 2,
            initiator_depth: 0xFF,
            ..ConnParam::default()
        })
        .unwrap();

    let req = expect(&ch, E::ConnectRequest);
    let conn = req.conn().unwrap().clone();
    assert_eq!(conn.private_data.len(), 56, "the whole REQ user area");
    assert_eq!(&conn.private_data[..5], b"hello");
    assert_eq!(
        conn.responder_resources, max,
        "swapped: the peer's initiator depth, 0xFF = device max"
    );
    assert_eq!(conn.initiator_depth, 2, "swapped: the peer's responder resources");
    assert_eq!(conn.qp_num, cqp.qp_num());
    assert!(req.listen_id().is_some());
    let server = req.id().clone();
    assert_eq!(server.src_addr().unwrap().port(), port);
    assert_eq!(
        server.dst_addr().unwrap().port(),
        client.src_addr().unwrap().port()
    );
    drop(req);
    let sr = res(&server);
    let sqp = qp(&server, &sr, QpType::Rc);
    sqp.post_recv(&[RecvWr {
        wr_id: 9,
        sg_list: vec![sr.mr.sge(0..64).unwrap()],
    }])
    .unwrap();
    server
        .accept(&ConnParam {
            private_data: b"welcome".to_vec(),
            responder_resources: 1,
            initiator_depth: 1,
            ..ConnParam::default()
        })
        .unwrap();
    assert_eq!(sqp.state(), QpState::Rts, "RTR and RTS before the REP");
    // Both ESTABLISHED events, the client's carrying the REP's private data.
    let mut seen = 0;
    for _ in 0..2 {
        let ev = expect(&ch, E::Established);
        if ev.id().same_as(&client) {
            let c = ev.conn().unwrap();
            assert_eq!(c.private_data.len(), 196);
            assert_eq!(&c.private_data[..7], b"welcome");
            assert_eq!(c.qp_num, sqp.qp_num());
            seen |= 1;
        } else {
            assert!(ev.id().same_as(&server));
            seen |= 2;
        }
    }
    assert_eq!(seen, 3);
    assert_eq!(cqp.state(), QpState::Rts);
    let attr = cqp.query();
    assert_eq!(attr.dest_qp_num, sqp.qp_num());
    assert_eq!(attr.max_rd_atomic, 1, "clamped to what the passive side granted");

    cr.mr.write(0, b"over the CM").unwrap();
    cqp.post_send(&[send(cr.mr.sge(0..11).unwrap(), None)]).unwrap();
    assert_eq!(poll(&cr.cq, 1)[0].status, WcStatus::Success);
    let wc = poll(&sr.cq, 1)[0];
    assert_eq!((wc.status, wc.wr_id, wc.byte_len), (WcStatus::Success, 9, 11));
    let mut got = [0u8; 11];
    sr.mr.read(0, &mut got).unwrap();
    assert_eq!(&got, b"over the CM");

    client.disconnect().unwrap();
    assert_eq!(cqp.state(), QpState::Err, "rdma_disconnect moves the QP to ERR");
    let ev = expect(&ch, E::Disconnected);
    assert!(ev.id().same_as(&server));
    drop(ev);
    assert_eq!(sqp.state(), QpState::Rts, "DISCONNECTED does not touch the QP");
    server.disconnect().unwrap();
    let ev = expect(&ch, E::Disconnected);
    assert!(ev.id().same_as(&client));
    drop(ev);
    let mut exits = 0;
    while exits < 2 {
        expect(&ch, E::TimewaitExit);
        exits += 1;
    }
}

#[test]
fn reject_delivers_private_data_and_fails_the_qp() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let (_listen, port) = listener(&ch, PortSpace::Tcp);
    let client = resolved(&ch, PortSpace::Tcp, port);
    let cr = res(&client);
    let cqp = qp(&client, &cr, QpType::Rc);
    client.connect(&ConnParam::default()).unwrap();
    let req = expect(&ch, E::ConnectRequest);
    req.id().reject(b"not today").unwrap();
    drop(req);
    let ev = expect(&ch, E::Rejected);
    assert!(ev.id().same_as(&client));
    assert_eq!(ev.status(), 28, "consumer defined");
    let c = ev.conn().unwrap();
    assert_eq!(c.private_data.len(), 148);
    assert_eq!(&c.private_data[..9], b"not today");
    assert_eq!(cqp.state(), QpState::Err, "REJECTED moves the QP to ERR");
    // Too much private data for a REJ.
    assert_eq!(client.reject(&[0; 149]).unwrap_err().errno(), 22);
}

#[test]
fn nobody_listening_is_rejected_with_reason_8() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    // A port that was listened on and is free again.
    let port = {
        let (l, port) = listener(&ch, PortSpace::Tcp);
        drop(l);
        port
    };
    let client = resolved(&ch, PortSpace::Tcp, port);
    let cr = res(&client);
    let _qp = qp(&client, &cr, QpType::Rc);
    client.connect(&ConnParam::default()).unwrap();
    let ev = expect(&ch, E::Rejected);
    assert_eq!(ev.status(), 8, "invalid service ID");
}

#[test]
fn conn_param_and_private_data_limits() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let (_listen, port) = listener(&ch, PortSpace::Tcp);
    let client = resolved(&ch, PortSpace::Tcp, port);
    let cr = res(&client);
    let _qp = qp(&client, &cr, QpType::Rc);
    let too_long = ConnParam {
        private_data: vec![1; 57],
        ..ConnParam::default()
    };
    assert_eq!(
        client.connect(&too_long).unwrap_err().errno(),
        22,
        "56 bytes after the CMA header"
    );
    let too_deep = ConnParam {
        initiator_depth: 200,
        ..ConnParam::default()
    };
    assert_eq!(
        client.connect(&too_deep).unwrap_err().errno(),
        22,
        "beyond the device limit"
    );
    client
        .connect(&ConnParam {
            private_data: vec![7; 56],
            ..ConnParam::default()
        })
        .unwrap();
    let req = expect(&ch, E::ConnectRequest);
    assert_eq!(req.conn().unwrap().private_data, vec![7; 56]);
    assert_eq!(req.conn().unwrap().retry_count, 7);
    let server = req.id().clone();
    drop(req);
    assert_eq!(
        server
            .accept(&ConnParam {
                private_data: vec![0; 197],
                ..ConnParam::default()
            })
            .unwrap_err()
            .errno(),
        22
    );
    // Unknown source address: ADDR_ERROR with -ENODEV.
    let lost = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
    lost.resolve_addr(Some(SocketAddr::from(([192, 0, 2, 1], 0))), lo(port), 2000)
        .unwrap();
    let ev = expect(&ch, E::AddrError);
    assert_eq!(ev.status(), -19);
}

#[test]
fn channel_fd_is_readable_exactly_when_an_event_is_pending() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let fd = ch.as_fd().as_raw_fd();
    let readable = || {
        let mut p = [nix::poll::PollFd::new(ch.as_fd(), nix::poll::PollFlags::POLLIN)];
        nix::poll::poll(&mut p, nix::poll::PollTimeout::ZERO).unwrap() == 1
    };
    assert!(!readable());
    let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL).unwrap();
    nix::fcntl::fcntl(
        fd,
        nix::fcntl::FcntlArg::F_SETFL(
            nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK,
        ),
    )
    .unwrap();
    assert_eq!(
        ch.get_event().unwrap_err().errno(),
        11,
        "EAGAIN when non-blocking"
    );
    let id = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
    id.resolve_addr(None, lo(9), 2000).unwrap();
    assert!(readable());
    let ev = ch.get_event().unwrap();
    assert_eq!(ev.event_type(), E::AddrResolved);
    assert!(!readable());
    assert_eq!(id.event_counts(), (1, 0), "delivered, not yet acknowledged");
    drop(ev);
    assert_eq!(id.event_counts(), (1, 1));
}

#[test]
fn ud_via_sidr_exchanges_a_datagram() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let (_listen, port) = listener(&ch, PortSpace::Udp);
    let client = resolved(&ch, PortSpace::Udp, port);
    let cr = res(&client);
    let cqp = qp(&client, &cr, QpType::Ud);
    assert_eq!(cqp.state(), QpState::Rts, "UD QPs are ready at creation");
    assert_eq!(cqp.query().qkey, RDMA_UDP_QKEY);
    client
        .connect(&ConnParam {
            private_data: b"sidr".to_vec(),
            ..ConnParam::default()
        })
        .unwrap();
    let req = expect(&ch, E::ConnectRequest);
    let ud = req.ud().unwrap();
    assert_eq!(ud.private_data.len(), 180);
    assert_eq!(&ud.private_data[..4], b"sidr");
    let server = req.id().clone();
    drop(req);
    let sr = res(&server);
    let sqp = qp(&server, &sr, QpType::Ud);
    sqp.post_recv(&[RecvWr {
        wr_id: 5,
        sg_list: vec![sr.mr.sge(0..128).unwrap()],
    }])
    .unwrap();
    server
        .accept(&ConnParam {
            private_data: b"ok".to_vec(),
            ..ConnParam::default()
        })
        .unwrap();
    let ev = expect(&ch, E::Established);
    assert!(ev.id().same_as(&client));
    let ud = ev.ud().unwrap().clone();
    drop(ev);
    assert_eq!((ud.qp_num, ud.qkey), (sqp.qp_num(), RDMA_UDP_QKEY));
    assert_eq!(&ud.private_data[..2], b"ok");
    let ah = cr.pd.create_ah(&ud.ah_attr).unwrap();
    cr.mr.write(0, b"datagram").unwrap();
    cqp.post_send(&[send(
        cr.mr.sge(0..8).unwrap(),
        Some(ah.ud_address(ud.qp_num, ud.qkey)),
    )])
    .unwrap();
    assert_eq!(poll(&cr.cq, 1)[0].status, WcStatus::Success);
    let wc = poll(&sr.cq, 1)[0];
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 8 + 40));
    let mut got = [0u8; 8];
    sr.mr.read(40, &mut got).unwrap();
    assert_eq!(&got, b"datagram");
    assert_eq!(
        ch.pending(),
        0,
        "the passive side reports nothing after accepting"
    );
}

#[test]
fn sidr_to_nobody_is_unreachable() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let port = {
        let (l, port) = listener(&ch, PortSpace::Udp);
        drop(l);
        port
    };
    let client = resolved(&ch, PortSpace::Udp, port);
    client.connect(&ConnParam::default()).unwrap();
    let ev = expect(&ch, E::Unreachable);
    assert_eq!(ev.status(), 1, "SIDR status UNSUPPORTED");
}

#[test]
fn multicast_join_delivers_a_datagram() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let group = IpAddr::V4(Ipv4Addr::new(239, 1, 2, (std::process::id() % 200) as u8 + 1));
    // Resolving the group from a loopback source binds the id to sv_lo (a bind alone to a
    // loopback address attaches no device, as with the kernel's rdma_cm; mckey does this).
    let rx = CmId::new(Some(&ch), PortSpace::Udp).unwrap();
    rx.resolve_addr(Some(lo(0)), SocketAddr::new(group, 0), 2000)
        .unwrap();
    drop(expect(&ch, E::AddrResolved));
    let rr = res(&rx);
    let rqp = qp(&rx, &rr, QpType::Ud);
    rqp.post_recv(&[RecvWr {
        wr_id: 3,
        sg_list: vec![rr.mr.sge(0..128).unwrap()],
    }])
    .unwrap();
    assert_eq!(
        CmId::new(Some(&ch), PortSpace::Tcp)
            .unwrap()
            .join_multicast(group)
            .unwrap_err()
            .errno(),
        22
    );
    rx.join_multicast(group).unwrap();
    let ev = expect(&ch, E::MulticastJoin);
    let ud = ev.ud().unwrap().clone();
    drop(ev);
    assert_eq!((ud.qp_num, ud.qkey), (0xFF_FFFF, RDMA_UDP_QKEY));
    assert_eq!(ud.ah_attr.grh.dgid, Gid::from_ip(group));

    let tx = CmId::new(Some(&ch), PortSpace::Udp).unwrap();
    tx.resolve_addr(Some(lo(0)), SocketAddr::new(group, 0), 2000)
        .unwrap();
    drop(expect(&ch, E::AddrResolved));
    let tr = res(&tx);
    let tqp = qp(&tx, &tr, QpType::Ud);
    // A send-only member: the event comes, the QP stays out of the group.
    tx.join_multicast_ex(group, true).unwrap();
    drop(expect(&ch, E::MulticastJoin));
    tqp.post_recv(&[RecvWr {
        wr_id: 8,
        sg_list: vec![tr.mr.sge(1024..1152).unwrap()],
    }])
    .unwrap();
    let ah = tr.pd.create_ah(&ud.ah_attr).unwrap();
    tr.mr.write(0, b"to the group").unwrap();
    tqp.post_send(&[send(
        tr.mr.sge(0..12).unwrap(),
        Some(ah.ud_address(ud.qp_num, ud.qkey)),
    )])
    .unwrap();
    let wc = poll(&rr.cq, 1)[0];
    assert_eq!(
        (wc.status, wc.wr_id, wc.byte_len),
        (WcStatus::Success, 3, 12 + 40)
    );
    let mut got = [0u8; 12];
    rr.mr.read(40, &mut got).unwrap();
    assert_eq!(&got, b"to the group");
    let recvs = poll(&tr.cq, 1);
    assert_eq!(
        recvs[0].opcode,
        WcOpcode::Send,
        "the sender's own completion only"
    );
    std::thread::sleep(Duration::from_millis(50));
    let mut wc = [WorkCompletion::default(); 4];
    assert_eq!(tr.cq.poll(&mut wc), 0, "nothing reached the send-only member");
    tx.leave_multicast(group).unwrap();
    rx.leave_multicast(group).unwrap();
}

#[test]
fn synchronous_ids_block_until_their_result() {
    let _alone = serial();
    let listen = CmId::new(None, PortSpace::Tcp).unwrap();
    listen.bind_addr(lo(0)).unwrap();
    listen.listen(4).unwrap();
    let port = listen.src_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let id = listen.get_request().unwrap();
        let r = res(&id);
        let _qp = qp(&id, &r, QpType::Rc);
        id.accept(&ConnParam::default()).unwrap();
        (id, r, _qp)
    });
    let client = CmId::new(None, PortSpace::Tcp).unwrap();
    client.resolve_addr(None, lo(port), 2000).unwrap();
    client.resolve_route(2000).unwrap();
    let r = res(&client);
    let cqp = qp(&client, &r, QpType::Rc);
    client.connect(&ConnParam::default()).unwrap();
    assert_eq!(cqp.state(), QpState::Rts, "connect returned once established");
    let (_sid, _r, sqp) = server.join().unwrap();
    assert_eq!(sqp.state(), QpState::Rts);
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn a_thousand_connections_leave_nothing_behind() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let (listen, port) = listener(&ch, PortSpace::Tcp);
    // The listener is bound to a loopback address, which attaches no device: the context of
    // sv_lo, where the connections run, comes from an id resolved towards it.
    let probe = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
    probe.resolve_addr(None, lo(port), 2000).unwrap();
    drop(expect(&ch, E::AddrResolved));
    let ctx = probe.context().unwrap();
    drop(probe);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None, 0).unwrap();
    // Contexts and driver threads exist before counting. Other tests' rejections are
    // remembered for a while (to answer retries): only what this test added must go.
    let fds = fd_count();
    let (entries_before, _) = softverbs::cm::cm_entries(&ctx).unwrap();
    for i in 0..1000 {
        let client = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
        client.resolve_addr(None, lo(port), 2000).unwrap();
        expect(&ch, E::AddrResolved);
        client.resolve_route(2000).unwrap();
        expect(&ch, E::RouteResolved);
        let _cqp = client.create_qp(&pd, &QpInit::new(QpType::Rc, &cq)).unwrap();
        client.connect(&ConnParam::default()).unwrap();
        let req = expect(&ch, E::ConnectRequest);
        let server = req.id().clone();
        drop(req);
        let _sqp = server.create_qp(&pd, &QpInit::new(QpType::Rc, &cq)).unwrap();
        server.accept(&ConnParam::default()).unwrap();
        expect(&ch, E::Established);
        expect(&ch, E::Established);
        if i % 2 == 0 {
            client.disconnect().unwrap();
            expect(&ch, E::Disconnected);
        }
        // Destroyed with their handles: the rest of the protocol runs on its own.
    }
    // Timewait (512 ms) and the peers' retries end in bounded time.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // Undelivered events (DISCONNECTED of destroyed ids) are dropped with their ids.
        while let Ok(ev) = ch.get_event_timeout(Some(Duration::from_millis(10))) {
            assert!(
                matches!(ev.event_type(), E::Disconnected | E::TimewaitExit),
                "{:?}",
                ev.event_type()
            );
        }
        let (entries, ids) = softverbs::cm::cm_entries(&ctx).unwrap();
        if entries <= entries_before && ids == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{entries} CM entries and {ids} ids left"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(fd_count(), fds, "no file descriptor leaked");
    // Nothing is pending: the progress thread sleeps (no busy loop).
    let cpu = || {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<u64> = after
            .split(' ')
            .skip(11)
            .take(2)
            .map(|v| v.parse().unwrap())
            .collect();
        f[0] + f[1]
    };
    let before = cpu();
    std::thread::sleep(Duration::from_secs(1));
    let ticks = cpu() - before;
    assert!(ticks <= 10, "{ticks} clock ticks of CPU in an idle second");
    drop(listen);
    assert_eq!(softverbs::cm::live_ids(), 0, "every id is gone");
}

#[test]
fn an_id_without_a_qp_gets_connect_response_and_establishes() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let (_listen, port) = listener(&ch, PortSpace::Tcp);
    let client = resolved(&ch, PortSpace::Tcp, port);
    let cr = res(&client);
    // The application owns the QP (rping -q): rdma_init_qp_attr and ibv_modify_qp.
    let own = cr.pd.create_qp(&QpInit::new(QpType::Rc, &cr.cq)).unwrap();
    let (attr, mask) = client.init_qp_attr(QpState::Init).unwrap();
    own.modify(&attr, mask).unwrap();
    client
        .connect(&ConnParam {
            qp_num: own.qp_num(),
            ..ConnParam::default()
        })
        .unwrap();
    let req = expect(&ch, E::ConnectRequest);
    assert_eq!(req.conn().unwrap().qp_num, own.qp_num());
    let server = req.id().clone();
    drop(req);
    let sr = res(&server);
    let sqp = qp(&server, &sr, QpType::Rc);
    sqp.post_recv(&[RecvWr {
        wr_id: 4,
        sg_list: vec![sr.mr.sge(0..64).unwrap()],
    }])
    .unwrap();
    server.accept(&ConnParam::default()).unwrap();
    let ev = expect(&ch, E::ConnectResponse);
    assert!(ev.id().same_as(&client));
    assert_eq!(ev.conn().unwrap().qp_num, sqp.qp_num());
    drop(ev);
    assert_eq!(
        server.accept(&ConnParam::default()).unwrap_err().errno(),
        22,
        "accepted once"
    );
    for state in [QpState::Rtr, QpState::Rts] {
        let (attr, mask) = client.init_qp_attr(state).unwrap();
        own.modify(&attr, mask).unwrap();
    }
    client.establish().unwrap();
    // Only the passive side hears of it (rdma_establish(3)); the active side is connected.
    let ev = expect(&ch, E::Established);
    assert!(ev.id().same_as(&server));
    drop(ev);
    assert!(
        ch.get_event_timeout(Some(Duration::from_millis(200))).is_err(),
        "no ESTABLISHED for the side that called rdma_establish"
    );
    cr.mr.write(0, b"own qp").unwrap();
    own.post_send(&[send(cr.mr.sge(0..6).unwrap(), None)]).unwrap();
    assert_eq!(poll(&cr.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(poll(&sr.cq, 1)[0].byte_len, 6);
}

#[test]
fn ipv6_connection_over_loopback() {
    let _alone = serial();
    let v6 = |port| SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
    if softverbs::cm::source_for(v6(1).ip()).is_err() {
        eprintln!("no IPv6 loopback here: skipped");
        return;
    }
    let ch = EventChannel::new().unwrap();
    let listen = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
    listen.bind_addr(v6(0)).unwrap();
    listen.listen(4).unwrap();
    let port = listen.src_addr().unwrap().port();
    let client = CmId::new(Some(&ch), PortSpace::Tcp).unwrap();
    client.resolve_addr(None, v6(port), 2000).unwrap();
    expect(&ch, E::AddrResolved);
    assert_eq!(client.src_addr().unwrap().ip(), v6(0).ip());
    client.resolve_route(2000).unwrap();
    expect(&ch, E::RouteResolved);
    let cr = res(&client);
    let _cqp = qp(&client, &cr, QpType::Rc);
    client.connect(&ConnParam::default()).unwrap();
    let req = expect(&ch, E::ConnectRequest);
    let server = req.id().clone();
    drop(req);
    assert_eq!(server.dst_addr().unwrap().ip(), v6(0).ip(), "from the CMA header");
    let sr = res(&server);
    let _sqp = qp(&server, &sr, QpType::Rc);
    server.accept(&ConnParam::default()).unwrap();
    expect(&ch, E::Established);
    expect(&ch, E::Established);
}

#[test]
fn migrate_moves_the_id_and_its_pending_events() {
    let _alone = serial();
    let (ch1, ch2) = (EventChannel::new().unwrap(), EventChannel::new().unwrap());
    let id = CmId::new(Some(&ch1), PortSpace::Tcp).unwrap();
    id.resolve_addr(None, lo(9), 2000).unwrap();
    expect(&ch1, E::AddrResolved);
    id.resolve_route(2000).unwrap();
    assert_eq!(ch1.pending(), 1);
    id.migrate(Some(&ch2)).unwrap();
    assert_eq!((ch1.pending(), ch2.pending()), (0, 1), "the pending event moved");
    let ev = expect(&ch2, E::RouteResolved);
    assert!(ev.id().same_as(&id));
}

/// rping's pattern: the server RDMA READs the client's buffer and RDMA WRITEs into it, which
/// the QP transitions allow only with responder resources negotiated.
#[test]
fn rdma_read_and_write_with_negotiated_resources() {
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let (_listen, port) = listener(&ch, PortSpace::Tcp);
    let client = resolved(&ch, PortSpace::Tcp, port);
    let cr = res(&client);
    let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    let cmr = cr.pd.register(4096, remote).unwrap();
    let cqp = qp(&client, &cr, QpType::Rc);
    let rw = ConnParam {
        responder_resources: 1,
        initiator_depth: 1,
        ..ConnParam::default()
    };
    client.connect(&rw).unwrap();
    let req = expect(&ch, E::ConnectRequest);
    let server = req.id().clone();
    drop(req);
    let sr = res(&server);
    let sqp = qp(&server, &sr, QpType::Rc);
    server.accept(&rw).unwrap();
    expect(&ch, E::Established);
    expect(&ch, E::Established);
    assert!(cqp.query().qp_access_flags.contains(AccessFlags::REMOTE_READ));
    assert_eq!(cqp.query().max_dest_rd_atomic, 1);
    assert_eq!(sqp.query().max_rd_atomic, 1);

    cmr.write(0, b"read me").unwrap();
    let op = |wr_id, op| SendRequest {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        payload: Payload::Sges(vec![sr.mr.sge(0..7).unwrap()]),
        ud: None,
        xrc_srqn: None,
    };
    sqp.post_send(&[op(
        1,
        SendOp::Read {
            remote: cmr.remote(0),
        },
    )])
    .unwrap();
    assert_eq!(poll(&sr.cq, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 7];
    sr.mr.read(0, &mut got).unwrap();
    assert_eq!(&got, b"read me");
    sr.mr.write(0, b"written").unwrap();
    sqp.post_send(&[op(
        2,
        SendOp::Write {
            remote: cmr.remote(100),
            imm: None,
        },
    )])
    .unwrap();
    assert_eq!(poll(&sr.cq, 1)[0].status, WcStatus::Success);
    cmr.read(100, &mut got).unwrap();
    assert_eq!(&got, b"written");
}

#[test]
fn ece_values_are_exchanged_and_can_be_refused() {
    use softverbs::cm::Ece;
    let _alone = serial();
    let ch = EventChannel::new().unwrap();
    let (_listen, port) = listener(&ch, PortSpace::Tcp);
    // Offered, and accepted with values of the server's own.
    let client = resolved(&ch, PortSpace::Tcp, port);
    let cr = res(&client);
    let _cqp = qp(&client, &cr, QpType::Rc);
    let offered = Ece {
        vendor_id: 0x02c9,
        options: 0xA5,
    };
    client.set_local_ece(offered);
    client.connect(&ConnParam::default()).unwrap();
    let req = expect(&ch, E::ConnectRequest);
    let server = req.id().clone();
    drop(req);
    assert_eq!(server.remote_ece(), offered);
    let sr = res(&server);
    let _sqp = qp(&server, &sr, QpType::Rc);
    let answered = Ece {
        vendor_id: 0x02c9,
        options: 0x5A,
    };
    server.set_local_ece(answered);
    server.accept(&ConnParam::default()).unwrap();
    for _ in 0..2 {
        expect(&ch, E::Established);
    }
    assert_eq!(client.remote_ece(), answered);
    // Refused: the client sees reason 35.
    let other = resolved(&ch, PortSpace::Tcp, port);
    let or = res(&other);
    let _oqp = qp(&other, &or, QpType::Rc);
    other.set_local_ece(offered);
    other.connect(&ConnParam::default()).unwrap();
    let req = expect(&ch, E::ConnectRequest);
    req.id().reject_ece(b"no").unwrap();
    drop(req);
    let ev = expect(&ch, E::Rejected);
    assert!(ev.id().same_as(&other));
    assert_eq!(ev.status(), 35, "vendor option not supported");
}
