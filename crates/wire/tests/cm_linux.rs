//! The CM MADs Linux sends, byte for byte: captured with tcpdump on the tap of the
//! `scripts/rxe-vm` guest (Debian's 6.1 kernel: `ib_cm` and `rdma_cm` over `rdma_rxe`, driven by
//! rdma-core's librdmacm) while it talked to softverbs. Trailing zero bytes are left out of the
//! hex; each MAD is 256 bytes.
//!
//! Every message must parse, re-emit to exactly the same bytes (so each bit Linux sets lies in
//! a field this crate knows, at the same place, and nothing Linux leaves zero is written), and
//! decode to the values read off the capture by hand.

use std::net::{IpAddr, Ipv4Addr};

use softverbs_wire::cm::{
    attr, rej_reason, service_id, sidr_status, CmMessage, CmaHeaderPacket, CmaHeaderRepr, MessageKind,
    PortSpace, CMA_HEADER_LEN, RDMA_UDP_QKEY,
};
use softverbs_wire::mad::MAD_LEN;

/// The REQ of `rping -c` in the guest (the active side is the kernel).
const REQ: &str = "010702030000000000000002e17cb3ab0010000000000000abb37ce1000000000000000001061c06505400ff\
fe12345600000000000000000000120100000001000000a02e9764a7ffff37f0ffffffff00000000000000000000ffff\
0a4d000200000000000000000000ffff0a4d00012a5ee000004000980000000000000000000000000000000000000000\
000000000000000000000000000000000000000000000000004099180000000000000000000000000a4d000200000000\
00000000000000000a4d0001";
/// The kernel's REP to a REQ of softverbs (comm ID 0x0105abbf).
const REP: &str = "01070203000000000f92b9440105abbf0013000000000000acb37ce10105abbf000000000000110000000000\
567c2600010178e0505400fffe123456";
/// The kernel's RTU after softverbs' REP.
const RTU: &str = "010702030000000000000002e17cb3ab0014000000000000abb37ce101a0364c";
/// The kernel's DREQ (the QP of softverbs' side is 0x010012: slot 1).
const DREQ: &str = "010702030000000000000002e17cb3ab0015000000000000abb37ce101a0364c010012";
/// The kernel's DREP to softverbs' DREQ.
const DREP: &str = "01070203000000000f92b9440105abbf0016000000000000acb37ce10105abbf";
/// The kernel's REJ of a REQ for a port nobody listens on.
const REJ_NO_LISTENER: &str = "010702030000000089dafe5d0153a12f0012000000000000000000000153a12f00000008";
/// The kernel's MRA for a duplicate REQ while its application had not answered yet.
const MRA: &str = "01070203000000003e33e14b02672428001100000000000091b37ce10267242800c0";
/// The kernel's REJ from `rdma_reject` (after that MRA).
const REJ_CONSUMER: &str = "01070203000000003e33e14b02672428001200000000000091b37ce1026724280000001c";
/// The SIDR_REQ of `udaddy -s` in the guest.
const SIDR_REQ: &str =
    "010702030000000000000002e17cb3a70017000000000000a7b37ce1ffff00000000000001111c0600409a70\
0000000000000000000000000a4d00020000000000000000000000000a4d0001";
/// The kernel's SIDR_REP to a SIDR_REQ of softverbs.
const SIDR_REP: &str =
    "0107020300000000b8d2f6a401acbd75001800000000000001acbd7500000000000013000000000001111c06\
01234567";

fn mad(hex: &str) -> [u8; MAD_LEN] {
    let mut out = [0u8; MAD_LEN];
    assert!(hex.len() % 2 == 0 && hex.len() <= 2 * MAD_LEN);
    for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap();
    }
    out
}

/// Parses `hex`, checks the round trip and returns the transaction ID and the message.
fn parsed(hex: &str, attr_id: u16) -> (u64, CmMessage) {
    let bytes = mad(hex);
    let (header, msg) = CmMessage::parse(&bytes).expect("Linux's MAD parses");
    assert_eq!(header.attr_id, attr_id);
    assert_eq!(msg.attr_id(), attr_id);
    assert_eq!(header.attr_mod, 0, "no ECE options in these");
    let mut again = [0xAAu8; MAD_LEN];
    msg.emit(header.transaction_id, header.attr_mod, &mut again)
        .unwrap();
    assert_eq!(
        again[..],
        bytes[..],
        "re-emitted {attr_id:#06x} differs from Linux's"
    );
    (header.transaction_id, msg)
}

fn ip(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 77, 0, last))
}

fn v4_gid(last: u8) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[10] = 0xFF;
    g[11] = 0xFF;
    g[12..].copy_from_slice(&[10, 77, 0, last]);
    g
}

#[test]
fn linux_req() {
    let (tid, msg) = parsed(REQ, attr::REQ);
    // Linux: the MAD agent's high TID, then the local comm ID as stored (byte-swapped).
    assert_eq!(tid, 0x0000_0002_e17c_b3ab);
    let CmMessage::Req(r) = msg else { panic!() };
    assert_eq!(r.local_comm_id, 0xabb3_7ce1);
    assert_eq!(r.service_id, service_id(PortSpace::Tcp, 7174));
    assert_eq!(r.local_ca_guid, 0x5054_00ff_fe12_3456);
    assert_eq!(
        (r.local_qkey, r.local_qpn, r.local_eecn, r.remote_eecn),
        (0, 0x12, 0, 0)
    );
    assert_eq!((r.responder_resources, r.initiator_depth), (1, 1));
    // rdma_cm's CM response timeouts and retries.
    assert_eq!(
        (
            r.remote_cm_response_timeout,
            r.local_cm_response_timeout,
            r.max_cm_retries
        ),
        (20, 20, 15)
    );
    assert_eq!((r.transport_type, r.extended_transport_type), (0, 0));
    assert!(!r.e2e_flow_control && !r.srq && !r.rdc_exists);
    // The PSN the requester expects first; Linux's responder sends from there.
    assert_eq!(r.starting_psn, 0x2e_9764);
    assert_eq!((r.retry_count, r.rnr_retry_count), (7, 7));
    assert_eq!((r.pkey, r.path_mtu), (0xFFFF, 3));
    let p = r.primary_path;
    // RoCE beyond one hop: permissive LIDs, not subnet local.
    assert_eq!(
        (p.local_lid, p.remote_lid, p.subnet_local),
        (0xFFFF, 0xFFFF, false)
    );
    assert_eq!((p.local_gid, p.remote_gid), (v4_gid(2), v4_gid(1)));
    // RoCEv2: (source port * 31 + destination port) of the rdma_cm ports, 20 bits.
    assert_eq!(p.flow_label, (0x9918 * 31 + 7174) & 0xF_FFFF);
    assert_eq!((p.packet_rate, p.traffic_class, p.hop_limit, p.sl), (0, 0, 64, 0));
    // Linux 6.1's RoCE packet lifetime is 18: ACK timeout 19.
    assert_eq!(p.local_ack_timeout, 19);
    assert_eq!(r.alternate_path, Default::default());
    let hdr =
        CmaHeaderRepr::parse(&CmaHeaderPacket::new_unchecked(&r.private_data[..CMA_HEADER_LEN])).unwrap();
    assert_eq!((hdr.port, hdr.src_addr, hdr.dst_addr), (0x9918, ip(2), ip(1)));
    assert!(r.private_data[CMA_HEADER_LEN..].iter().all(|&b| b == 0));
}

#[test]
fn linux_rep_rtu_dreq_drep() {
    let (_, msg) = parsed(REP, attr::REP);
    let CmMessage::Rep(r) = msg else { panic!() };
    assert_eq!((r.local_comm_id, r.remote_comm_id), (0xacb3_7ce1, 0x0105_abbf));
    assert_eq!((r.local_qkey, r.local_qpn, r.local_eecn), (0, 0x11, 0));
    // The PSN the responder expects first; the requester's send queue starts there.
    assert_eq!(r.starting_psn, 0x56_7c26);
    assert_eq!((r.responder_resources, r.initiator_depth), (1, 1));
    // rxe's local CA ACK delay.
    assert_eq!(r.target_ack_delay, 15);
    assert_eq!((r.failover_accepted, r.e2e_flow_control), (0, false));
    assert_eq!((r.rnr_retry_count, r.srq, r.vendor_id), (7, false, 0));
    assert_eq!(r.local_ca_guid, 0x5054_00ff_fe12_3456);

    let (rtu_tid, msg) = parsed(RTU, attr::RTU);
    let CmMessage::Rtu(r) = msg else { panic!() };
    assert_eq!((r.local_comm_id, r.remote_comm_id), (0xabb3_7ce1, 0x01a0_364c));
    // The requester's RTU and DREQ carry the REQ's transaction ID.
    let (dreq_tid, msg) = parsed(DREQ, attr::DREQ);
    assert_eq!(rtu_tid, dreq_tid);
    let CmMessage::Dreq(d) = msg else { panic!() };
    assert_eq!((d.local_comm_id, d.remote_comm_id), (0xabb3_7ce1, 0x01a0_364c));
    assert_eq!(
        d.remote_qpn, 0x01_0012,
        "the peer's QP, as the DREQ's receiver checks it"
    );

    let (drep_tid, msg) = parsed(DREP, attr::DREP);
    // The DREP answers softverbs' DREQ in its transaction.
    assert_eq!(drep_tid, 0x0f92_b944_0105_abbf);
    let CmMessage::Drep(d) = msg else { panic!() };
    assert_eq!((d.local_comm_id, d.remote_comm_id), (0xacb3_7ce1, 0x0105_abbf));
}

#[test]
fn linux_rej_and_mra() {
    let (tid, msg) = parsed(REJ_NO_LISTENER, attr::REJ);
    // In the REQ's transaction, naming only the requester's ID.
    assert_eq!(tid, 0x89da_fe5d_0153_a12f);
    let CmMessage::Rej(r) = msg else { panic!() };
    assert_eq!((r.local_comm_id, r.remote_comm_id), (0, 0x0153_a12f));
    assert_eq!(r.message_rejected, MessageKind::Req);
    assert_eq!((r.reason, r.ari_length), (rej_reason::INVALID_SERVICE_ID, 0));

    let (mra_tid, msg) = parsed(MRA, attr::MRA);
    let CmMessage::Mra(m) = msg else { panic!() };
    assert_eq!((m.local_comm_id, m.remote_comm_id), (0x91b3_7ce1, 0x0267_2428));
    assert_eq!(m.message_mraed, MessageKind::Req);
    // rdma_cm's MRA setting: 24 (about 68.7 s).
    assert_eq!(m.service_timeout, 24);

    let (rej_tid, msg) = parsed(REJ_CONSUMER, attr::REJ);
    assert_eq!(
        mra_tid, rej_tid,
        "the responder's messages carry the REQ's transaction ID"
    );
    let CmMessage::Rej(r) = msg else { panic!() };
    assert_eq!((r.local_comm_id, r.remote_comm_id), (0x91b3_7ce1, 0x0267_2428));
    assert_eq!(r.message_rejected, MessageKind::Req);
    assert_eq!(r.reason, rej_reason::CONSUMER_DEFINED);
    assert!(r.private_data.iter().all(|&b| b == 0));
}

#[test]
fn linux_sidr() {
    let (_, msg) = parsed(SIDR_REQ, attr::SIDR_REQ);
    let CmMessage::SidrReq(r) = msg else { panic!() };
    assert_eq!(r.request_id, 0xa7b3_7ce1);
    assert_eq!(r.pkey, 0xFFFF);
    assert_eq!(r.service_id, service_id(PortSpace::Udp, 7174));
    let hdr =
        CmaHeaderRepr::parse(&CmaHeaderPacket::new_unchecked(&r.private_data[..CMA_HEADER_LEN])).unwrap();
    assert_eq!((hdr.port, hdr.src_addr, hdr.dst_addr), (0x9a70, ip(2), ip(1)));

    let (tid, msg) = parsed(SIDR_REP, attr::SIDR_REP);
    assert_eq!(tid, 0xb8d2_f6a4_01ac_bd75, "the SIDR_REQ's transaction");
    let CmMessage::SidrRep(r) = msg else { panic!() };
    assert_eq!(r.request_id, 0x01ac_bd75);
    assert_eq!(
        (r.status, r.info_length, r.vendor_id),
        (sidr_status::SUCCESS, 0, 0)
    );
    assert_eq!(r.qpn, 0x13);
    assert_eq!(r.service_id, service_id(PortSpace::Udp, 7174));
    assert_eq!(r.qkey, RDMA_UDP_QKEY);
}
