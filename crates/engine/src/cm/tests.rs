//! Direct checks of single exchanges; the simulated network tests are in `tests/cm.rs`.

use super::*;
use softverbs_wire::cm::{rej_reason, service_id, DreqRepr, PortSpace, RtuRepr};
use std::net::{IpAddr, Ipv4Addr};

fn gid(last: u8) -> Gid {
    Gid::from_ip(IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)))
}

fn engine(last: u8) -> CmEngine {
    CmEngine::new(
        CmConfig {
            local_gid: gid(last),
            ca_guid: u64::from(last),
            ..CmConfig::default()
        },
        u64::from(last),
    )
}

fn sent(cm: &mut CmEngine) -> Vec<(Gid, CmMessage)> {
    std::iter::from_fn(|| cm.poll_transmit())
        .map(|t| (t.dest, CmMessage::parse(&t.mad).unwrap().1))
        .collect()
}

/// Delivers everything `from` sends to `to` (once) and returns what was delivered.
fn pass(now: Instant, from: &mut CmEngine, to: &mut CmEngine) -> Vec<CmMessage> {
    let src = from.config().local_gid;
    let mut out = Vec::new();
    while let Some(t) = from.poll_transmit() {
        assert_eq!(t.dest, to.config().local_gid);
        to.handle_mad(now, src, &t.mad);
        out.push(CmMessage::parse(&t.mad).unwrap().1);
    }
    out
}

/// Engines 1 and 2, 2 listening on port 7174 of the TCP port space; 1 connected to it, and
/// 2 handed the REQ. Returns the client's id and the REQ.
fn requested(t0: Instant) -> (CmEngine, CmEngine, CommId, [u8; MAD_LEN]) {
    let (mut a, mut b) = (engine(1), engine(2));
    let sid = service_id(PortSpace::Tcp, 7174);
    b.listen(sid).unwrap();
    let params = ConnectParams {
        service_id: sid,
        ..ConnectParams::default()
    };
    let id = a.connect(t0, gid(2), &params, &[]).unwrap();
    let req_mad = a.poll_transmit().unwrap().mad;
    b.handle_mad(t0, gid(1), &req_mad);
    (a, b, id, req_mad)
}

#[test]
fn timeout_conversion() {
    assert_eq!(cm_timeout(0), Duration::from_millis(1));
    assert_eq!(cm_timeout(8), Duration::from_millis(1));
    assert_eq!(cm_timeout(16), Duration::from_millis(256));
    assert_eq!(cm_timeout(20), Duration::from_millis(4096));
    assert_eq!(cm_timeout(24), Duration::from_millis(65536));
    assert_eq!(cm_timeout(31), Duration::from_millis(1 << 23));
}

#[test]
fn api_errors() {
    let mut a = engine(1);
    let sid = service_id(PortSpace::Tcp, 1);
    a.listen(sid).unwrap();
    assert_eq!(a.listen(sid), Err(CmError::AddressInUse));
    assert_eq!(CmError::AddressInUse.errno(), 98);
    a.unlisten(sid).unwrap();
    assert_eq!(a.unlisten(sid), Err(CmError::UnknownId));
    let too_long = [0u8; 93];
    assert_eq!(
        a.connect(Instant::ZERO, gid(2), &ConnectParams::default(), &too_long),
        Err(CmError::PrivateDataTooLong)
    );
    let id = a
        .connect(Instant::ZERO, gid(2), &ConnectParams::default(), &[])
        .unwrap();
    assert_eq!(a.establish(id), Err(CmError::InvalidState));
    assert_eq!(
        a.accept(Instant::ZERO, id, &AcceptParams::default(), &[]),
        Err(CmError::InvalidState)
    );
    assert_eq!(a.disconnect(Instant::ZERO, id, &[]), Err(CmError::InvalidState));
    assert_eq!(a.establish(CommId(id.0 ^ 1)), Err(CmError::UnknownId));
    assert_eq!(a.live_entries(), 1);
}

#[test]
fn malformed_mads_are_counted_and_dropped() {
    let mut a = engine(1);
    a.handle_mad(Instant::ZERO, gid(2), &[0u8; 100]);
    a.handle_mad(Instant::ZERO, gid(2), &[0u8; MAD_LEN]);
    assert_eq!(a.stats().malformed, 2);
    assert!(a.poll_transmit().is_none() && a.poll_event().is_none());
}

#[test]
fn dreq_for_an_unknown_connection_gets_a_drep() {
    let mut a = engine(1);
    let dreq = DreqRepr {
        local_comm_id: 0x55,
        remote_comm_id: 0x66,
        remote_qpn: 0x11,
        private_data: [0; private_data_len::DREQ],
    };
    let mut mad = [0u8; MAD_LEN];
    CmMessage::Dreq(dreq).emit(0xAB, 0, &mut mad).unwrap();
    a.handle_mad(Instant::ZERO, gid(2), &mad);
    let out = sent(&mut a);
    let [(dest, CmMessage::Drep(drep))] = &out[..] else {
        panic!("{out:?}")
    };
    assert_eq!(*dest, gid(2));
    assert_eq!((drep.local_comm_id, drep.remote_comm_id), (0x66, 0x55));
    assert!(a.poll_event().is_none());
    assert_eq!(a.live_entries(), 0);
}

#[test]
fn sidr_without_listener_gets_status_1() {
    let mut a = engine(1);
    let mut b = engine(2);
    let sid = service_id(PortSpace::Udp, 7174);
    let id = a.sidr_request(Instant::ZERO, gid(2), sid, 0xFFFF, b"x").unwrap();
    pass(Instant::ZERO, &mut a, &mut b);
    let replies = pass(Instant::ZERO, &mut b, &mut a);
    assert!(
        matches!(&replies[..], [CmMessage::SidrRep(r)] if r.status == sidr_status::UNSUPPORTED && r.service_id == sid)
    );
    let Some(CmEvent::SidrReply { id: got, rep }) = a.poll_event() else {
        panic!("no reply event")
    };
    assert_eq!((got, rep.status), (id, 1));
    assert_eq!(a.live_entries() + b.live_entries(), 0);
}

#[test]
fn duplicates_are_answered_from_the_stored_reply() {
    let t0 = Instant::ZERO;
    let (mut a, mut b, id, req_mad) = requested(t0);
    let Some(CmEvent::ConnectRequest { id: server, .. }) = b.poll_event() else {
        panic!("no request")
    };
    // A duplicate before the application answered: an MRA for the REQ, then the same MRA.
    b.handle_mad(t0, gid(1), &req_mad);
    b.handle_mad(t0, gid(1), &req_mad);
    let out = sent(&mut b);
    assert_eq!(out.len(), 2);
    assert!(
        matches!(&out[0].1, CmMessage::Mra(m) if m.message_mraed == MessageKind::Req && m.service_timeout == 24)
    );
    assert_eq!(out[0], out[1]);
    assert!(b.poll_event().is_none(), "a duplicate is never reported");
    // After the accept, a duplicate REQ gets the REP again.
    b.accept(
        t0,
        server,
        &AcceptParams {
            local_qpn: 0x42,
            ..AcceptParams::default()
        },
        &[],
    )
    .unwrap();
    let rep_mad = b.poll_transmit().unwrap().mad;
    b.handle_mad(t0, gid(1), &req_mad);
    assert_eq!(b.poll_transmit().unwrap().mad, rep_mad);
    // The client: REP, establish (RTU), then a duplicate REP is answered by the same RTU.
    a.handle_mad(t0, gid(2), &rep_mad);
    assert!(matches!(a.poll_event(), Some(CmEvent::ConnectResponse { rep, .. }) if rep.local_qpn == 0x42));
    a.establish(id).unwrap();
    let rtu = a.poll_transmit().unwrap().mad;
    assert!(
        matches!(CmMessage::parse(&rtu).unwrap().1, CmMessage::Rtu(RtuRepr { local_comm_id, .. }) if local_comm_id == id.0)
    );
    a.handle_mad(t0, gid(2), &rep_mad);
    assert_eq!(a.poll_transmit().unwrap().mad, rtu);
    assert_eq!(a.poll_event(), Some(CmEvent::Established { id }));
    assert_eq!(a.poll_event(), None);
    b.handle_mad(t0, gid(1), &rtu);
    b.handle_mad(t0, gid(1), &rtu);
    assert_eq!(b.poll_event(), Some(CmEvent::Established { id: server }));
    assert_eq!(b.poll_event(), None);
    assert_eq!(b.stats().ignored, 1, "the second RTU");
}

#[test]
fn stale_comm_id_in_timewait() {
    let t0 = Instant::ZERO;
    let (mut a, mut b, id, req_mad) = requested(t0);
    let Some(CmEvent::ConnectRequest { id: server, .. }) = b.poll_event() else {
        panic!()
    };
    b.accept(t0, server, &AcceptParams::default(), &[]).unwrap();
    pass(t0, &mut b, &mut a);
    a.poll_event();
    a.establish(id).unwrap();
    pass(t0, &mut a, &mut b);
    b.disconnect(t0, server, &[]).unwrap();
    pass(t0, &mut b, &mut a);
    a.disconnect(t0, id, &[]).unwrap();
    pass(t0, &mut a, &mut b);
    // The server is in timewait; the old REQ (same comm ID) arrives late.
    while b.poll_event().is_some() {}
    b.handle_mad(t0, gid(1), &req_mad);
    let out = sent(&mut b);
    assert!(matches!(&out[..], [(_, CmMessage::Rej(r))] if r.reason == rej_reason::STALE_CONN));
    assert!(b.poll_event().is_none());
    // After timewait the server forgets everything.
    let end = b.poll_timeout().unwrap();
    b.handle_timeout(end);
    assert_eq!(b.poll_event(), Some(CmEvent::TimewaitExit { id: server }));
    assert_eq!(b.live_entries(), 0);
}

#[test]
fn requester_giving_up_is_found_by_ca_guid_and_dreq_must_name_our_qp() {
    let (mut a, mut b) = (engine(1), engine(2));
    let sid = service_id(PortSpace::Tcp, 7174);
    b.listen(sid).unwrap();
    let t0 = Instant::ZERO;
    let params = ConnectParams {
        service_id: sid,
        local_qpn: 0x33,
        ..ConnectParams::default()
    };
    let id = a.connect(t0, gid(2), &params, &[]).unwrap();
    pass(t0, &mut a, &mut b);
    let Some(CmEvent::ConnectRequest { id: server, .. }) = b.poll_event() else {
        panic!()
    };
    // The requester gives up before any reply: a REJ TIMEOUT without our ID, with its GUID.
    a.destroy(t0, id).unwrap();
    let out = pass(t0, &mut a, &mut b);
    let [CmMessage::Rej(rej)] = &out[..] else {
        panic!("{out:?}")
    };
    assert_eq!(
        (rej.reason, rej.remote_comm_id, rej.ari_length),
        (rej_reason::TIMEOUT, 0, 8)
    );
    assert_eq!(&rej.ari[..8], &1u64.to_be_bytes());
    assert!(matches!(b.poll_event(), Some(CmEvent::Rejected { id, reason: 4, .. }) if id == server));
    assert_eq!(a.live_entries(), 0);

    // A DREQ that names another QP than ours is not for us.
    let id = a.connect(t0, gid(2), &params, &[]).unwrap();
    pass(t0, &mut a, &mut b);
    let Some(CmEvent::ConnectRequest { id: server, .. }) = b.poll_event() else {
        panic!()
    };
    b.accept(
        t0,
        server,
        &AcceptParams {
            local_qpn: 0x44,
            ..AcceptParams::default()
        },
        &[],
    )
    .unwrap();
    pass(t0, &mut b, &mut a);
    a.poll_event();
    a.establish(id).unwrap();
    pass(t0, &mut a, &mut b);
    assert_eq!(b.poll_event(), Some(CmEvent::Established { id: server }));
    a.disconnect(t0, id, &[]).unwrap();
    let mut dreq = a.poll_transmit().unwrap().mad;
    let CmMessage::Dreq(d) = CmMessage::parse(&dreq).unwrap().1 else {
        panic!()
    };
    assert_eq!(d.remote_qpn, 0x44);
    dreq[24 + 10] ^= 1; // remote QPN 0x45
    b.handle_mad(t0, gid(1), &dreq);
    assert_eq!(b.poll_event(), None);
    assert!(b.poll_transmit().is_none());
}

#[test]
fn id_tag_fills_the_top_byte_of_chosen_ids() {
    let mut cm = CmEngine::new(
        CmConfig {
            local_gid: gid(1),
            id_tag: 0x2A,
            ..CmConfig::default()
        },
        7,
    );
    let now = Instant(0);
    for _ in 0..32 {
        let id = cm.connect(now, gid(2), &ConnectParams::default(), &[]).unwrap();
        assert_eq!(id.0 >> 24, 0x2A);
        let sidr = cm
            .sidr_request(now, gid(2), service_id(PortSpace::Udp, 1), 0xFFFF, &[])
            .unwrap();
        assert_eq!(sidr.request_id >> 24, 0x2A);
    }
    // The REQ carries the tagged ID, so the peer's replies name this process.
    let reqs = sent(&mut cm);
    assert!(reqs
        .iter()
        .any(|(_, m)| matches!(m, CmMessage::Req(r) if r.local_comm_id >> 24 == 0x2A)));
}

#[test]
fn ece_values_travel_in_the_req_and_rep() {
    let t0 = Instant::ZERO;
    let (mut a, mut b) = (engine(1), engine(2));
    let sid = service_id(PortSpace::Tcp, 7175);
    b.listen(sid).unwrap();
    let offered = Ece {
        vendor_id: 0x02c9,
        options: 0x1234_5678,
    };
    let params = ConnectParams {
        service_id: sid,
        ece: offered,
        ..ConnectParams::default()
    };
    let id = a.connect(t0, gid(2), &params, &[]).unwrap();
    let req_mad = a.poll_transmit().unwrap().mad;
    // As Linux: the vendor ID in the REQ, the options in the header's attribute modifier.
    let (header, msg) = CmMessage::parse(&req_mad).unwrap();
    assert_eq!(header.attr_mod, 0x1234_5678);
    assert!(matches!(msg, CmMessage::Req(r) if r.vendor_id == 0x02c9));
    b.handle_mad(t0, gid(1), &req_mad);
    let Some(CmEvent::ConnectRequest { id: server, ece, .. }) = b.poll_event() else {
        panic!("no request")
    };
    assert_eq!(ece, offered);
    let answered = Ece {
        vendor_id: 0x15b3,
        options: 7,
    };
    b.accept(
        t0,
        server,
        &AcceptParams {
            ece: answered,
            ..AcceptParams::default()
        },
        &[],
    )
    .unwrap();
    pass(t0, &mut b, &mut a);
    assert!(
        matches!(a.poll_event(), Some(CmEvent::ConnectResponse { id: got, ece, .. }) if got == id && ece == answered)
    );
}

/// The REQ Linux 6.1's rdma_cm sends for `rping -c` from 10.77.0.2 to 10.77.0.1 (captured from
/// the `scripts/rxe-vm` guest; decoded field by field in `crates/wire/tests/cm_linux.rs`).
const LINUX_REQ: &str =
    "010702030000000000000002e17cb3ab0010000000000000abb37ce1000000000000000001061c06505400ff\
fe12345600000000000000000000120100000001000000a02e9764a7ffff37f0ffffffff00000000000000000000ffff\
0a4d000200000000000000000000ffff0a4d00012a5ee000004000980000000000000000000000000000000000000000\
000000000000000000000000000000000000000000000000004099180000000000000000000000000a4d000200000000\
00000000000000000a4d0001";

fn from_hex(hex: &str) -> [u8; MAD_LEN] {
    let mut out = [0u8; MAD_LEN];
    for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap();
    }
    out
}

fn tid_of(mad: &[u8; MAD_LEN]) -> u64 {
    CmMessage::parse(mad).unwrap().0.transaction_id
}

#[test]
fn replies_carry_the_transaction_id_linux_uses() {
    let t0 = Instant::ZERO;
    let (mut a, mut b, id, req_mad) = requested(t0);
    let req_tid = tid_of(&req_mad);
    let Some(CmEvent::ConnectRequest { id: server, .. }) = b.poll_event() else {
        panic!("no request")
    };
    // The responder's MRA, REP and the requester's RTU are in the REQ's transaction.
    b.handle_mad(t0, gid(1), &req_mad);
    assert_eq!(tid_of(&b.poll_transmit().unwrap().mad), req_tid, "MRA");
    b.accept(t0, server, &AcceptParams::default(), &[]).unwrap();
    let rep = b.poll_transmit().unwrap().mad;
    assert_eq!(tid_of(&rep), req_tid, "REP");
    a.handle_mad(t0, gid(2), &rep);
    a.poll_event();
    a.establish(id).unwrap();
    let rtu = a.poll_transmit().unwrap().mad;
    assert_eq!(tid_of(&rtu), req_tid, "RTU");
    b.handle_mad(t0, gid(1), &rtu);
    while b.poll_event().is_some() {}
    // The responder's DREQ starts a transaction of its own; the DREP answers in it.
    b.disconnect(t0, server, &[]).unwrap();
    let dreq = b.poll_transmit().unwrap().mad;
    let dreq_tid = tid_of(&dreq);
    assert_ne!(dreq_tid, req_tid, "DREQ");
    a.handle_mad(t0, gid(2), &dreq);
    a.disconnect(t0, id, &[]).unwrap();
    assert_eq!(tid_of(&a.poll_transmit().unwrap().mad), dreq_tid, "DREP");
}

#[test]
fn requester_giving_up_after_a_lost_rep_ends_the_responder_as_linux_does() {
    let t0 = Instant::ZERO;
    let (mut a, mut b, id, _) = requested(t0);
    let Some(CmEvent::ConnectRequest { id: server, .. }) = b.poll_event() else {
        panic!("no request")
    };
    b.accept(t0, server, &AcceptParams::default(), &[]).unwrap();
    let _lost_rep = b.poll_transmit().unwrap();
    a.destroy(t0, id).unwrap();
    let rej = a.poll_transmit().unwrap().mad;
    // The byte layout Linux sends from REQ_SENT: no message rejected (2 in the top bits of
    // byte 8), 8 bytes of ARI (the length in the top 7 bits of byte 9), reason 4, the CA GUID.
    let data = &rej[24..];
    assert_eq!(&data[0..8], &[&id.0.to_be_bytes()[..], &[0; 4]].concat()[..]);
    assert_eq!((data[8], data[9]), (0x80, 8 << 1));
    assert_eq!(&data[10..12], &rej_reason::TIMEOUT.to_be_bytes());
    assert_eq!(&data[12..20], &1u64.to_be_bytes());
    // The responder waiting for the RTU takes it, and stops resending its REP.
    b.handle_mad(t0, gid(1), &rej);
    assert!(matches!(b.poll_event(), Some(CmEvent::Rejected { id, reason: 4, .. }) if id == server));
    let later = t0 + Duration::from_secs(10);
    b.handle_timeout(later);
    assert!(b.poll_transmit().is_none(), "no REP after the requester gave up");
}

#[test]
fn requester_destroying_after_the_rep_rejects_it() {
    let t0 = Instant::ZERO;
    let (mut a, mut b, id, _) = requested(t0);
    let Some(CmEvent::ConnectRequest { id: server, .. }) = b.poll_event() else {
        panic!("no request")
    };
    b.accept(t0, server, &AcceptParams::default(), &[]).unwrap();
    pass(t0, &mut b, &mut a);
    a.poll_event();
    a.destroy(t0, id).unwrap();
    let out = pass(t0, &mut a, &mut b);
    let [CmMessage::Rej(rej)] = &out[..] else {
        panic!("{out:?}")
    };
    // As Linux from REP_RCVD: the consumer rejects the REP.
    assert_eq!(
        (rej.reason, rej.message_rejected, rej.local_comm_id),
        (rej_reason::CONSUMER_DEFINED, MessageKind::Rep, id.0)
    );
    assert!(matches!(b.poll_event(), Some(CmEvent::Rejected { id, reason: 28, .. }) if id == server));
}

#[test]
fn linux_req_is_answered_in_its_transaction() {
    let t0 = Instant::ZERO;
    let mut b = CmEngine::new(
        CmConfig {
            local_gid: Gid::from_ip(IpAddr::V4(Ipv4Addr::new(10, 77, 0, 1))),
            ca_guid: 0xb40f_24ff_fefe_d520,
            ..CmConfig::default()
        },
        9,
    );
    b.listen(service_id(PortSpace::Tcp, 7174)).unwrap();
    let linux = Gid::from_ip(IpAddr::V4(Ipv4Addr::new(10, 77, 0, 2)));
    b.handle_mad(t0, linux, &from_hex(LINUX_REQ));
    let Some(CmEvent::ConnectRequest { id, source, req, .. }) = b.poll_event() else {
        panic!("Linux's REQ is a request")
    };
    assert_eq!(source, linux);
    assert_eq!((req.local_qpn, req.starting_psn), (0x12, 0x2e_9764));
    assert_eq!(req.primary_path.local_ack_timeout, 19);
    b.accept(
        t0,
        id,
        &AcceptParams {
            local_qpn: 0x01_0012,
            starting_psn: 0x6a_877e,
            responder_resources: 1,
            initiator_depth: 1,
            rnr_retry_count: 7,
            ..AcceptParams::default()
        },
        &[],
    )
    .unwrap();
    let t = b.poll_transmit().unwrap();
    assert_eq!(t.dest, linux);
    // Header: Linux's TID (its MAD agent's and comm ID's), REP 0x0013.
    assert_eq!(&t.mad[8..18], &[0, 0, 0, 2, 0xe1, 0x7c, 0xb3, 0xab, 0x00, 0x13]);
    let rep = &t.mad[24..];
    assert_eq!(&rep[0..4], &id.0.to_be_bytes());
    assert_eq!(&rep[4..8], &[0xab, 0xb3, 0x7c, 0xe1], "Linux's comm ID");
    assert_eq!(&rep[12..15], &[0x01, 0x00, 0x12], "QPN");
    assert_eq!(&rep[20..23], &[0x6a, 0x87, 0x7e], "the PSN this side expects");
    assert_eq!((rep[24], rep[25], rep[27]), (1, 1, 7 << 5));
    assert_eq!(&rep[28..36], &0xb40f_24ff_fefe_d520u64.to_be_bytes());
    // Linux's RTU completes it.
    let rtu = RtuRepr {
        local_comm_id: 0xabb3_7ce1,
        remote_comm_id: id.0,
        private_data: [0; private_data_len::RTU],
    };
    let mut mad = [0u8; MAD_LEN];
    CmMessage::Rtu(rtu)
        .emit(0x0000_0002_e17c_b3ab, 0, &mut mad)
        .unwrap();
    b.handle_mad(t0, linux, &mad);
    assert_eq!(b.poll_event(), Some(CmEvent::Established { id }));
}
