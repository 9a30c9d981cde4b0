//! Wireshark's InfiniBand dissector as an independent check of the CM wire format.
//!
//! Builds a pcap of CM MADs framed exactly as they go on the wire (Ethernet, IPv4, UDP 4791,
//! BTH UD SEND ONLY to QP1, DETH with the GSI Q_Key and source QP 1, the 256-byte MAD, ICRC)
//! and checks that `tshark -V` decodes every packet as the right CM attribute with the right
//! field values, and reports no malformed packet; Python's zlib checks every ICRC. tshark and
//! python3 must be installed (`scripts/setup-deps`); the test fails, rather than skips,
//! without them.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::process::Command;

use softverbs_wire::cm::{
    private_data_len, rej_reason, service_id, sidr_status, CmMessage, CmPathRepr, CmaHeaderPacket,
    CmaHeaderRepr, DrepRepr, DreqRepr, MessageKind, PortSpace, RejRepr, RepRepr, ReqRepr, RtuRepr,
    SidrRepRepr, SidrReqRepr, ARI_LEN, RDMA_UDP_QKEY,
};
use softverbs_wire::deth::GSI_QKEY;
use softverbs_wire::mad::MAD_LEN;
use softverbs_wire::{icrc, BthRepr, DethRepr, Opcode, PacketRepr, Psn, ROCE_UDP_PORT};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

/// One Ethernet frame carrying `msg` as a GSI MAD from `src` to `dst`.
fn frame(src: Ipv4Addr, dst: Ipv4Addr, tid: u64, msg: &CmMessage) -> Vec<u8> {
    let mut mad = [0u8; MAD_LEN];
    msg.emit(tid, 0, &mut mad).unwrap();
    let mut repr = PacketRepr::new(BthRepr::new(Opcode::UdSendOnly, 1, Psn::new(0x42)), MAD_LEN);
    repr.bth.pkey = 0xFFFF;
    repr.deth = Some(DethRepr {
        qkey: GSI_QKEY,
        src_qpn: 1,
    });
    let mut roce = vec![0u8; repr.buffer_len()];
    repr.emit_with_payload(&mut roce, &mad).unwrap();
    let src_sock = SocketAddr::V4(SocketAddrV4::new(src, 49152));
    let dst_sock = SocketAddr::V4(SocketAddrV4::new(dst, ROCE_UDP_PORT));
    icrc::fill(src_sock, dst_sock, &mut roce).unwrap();
    assert!(icrc::verify(src_sock, dst_sock, &roce));

    let mut f = Vec::new();
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1, 0x08, 0x00]);
    f.extend_from_slice(&icrc::ipv4_header(src, dst, roce.len()));
    f.extend_from_slice(&icrc::udp_header(49152, ROCE_UDP_PORT, roce.len()));
    f.extend_from_slice(&roce);
    f
}

fn pcap(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&4u16.to_le_bytes());
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(&65535u32.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes()); // Ethernet
    for (i, f) in frames.iter().enumerate() {
        out.extend_from_slice(&u32::try_from(i + 1).unwrap().to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        let len = u32::try_from(f.len()).unwrap().to_le_bytes();
        out.extend_from_slice(&len);
        out.extend_from_slice(&len);
        out.extend_from_slice(f);
    }
    out
}

fn gid(ip: Ipv4Addr) -> [u8; 16] {
    ip.to_ipv6_mapped().octets()
}

fn messages() -> Vec<(Ipv4Addr, Ipv4Addr, CmMessage)> {
    let mut req_pd = [0u8; private_data_len::REQ];
    CmaHeaderRepr {
        port: 50000,
        src_addr: CLIENT.into(),
        dst_addr: SERVER.into(),
    }
    .emit(&mut CmaHeaderPacket::new_unchecked(&mut req_pd[..]));
    let req = ReqRepr {
        local_comm_id: 0x1122_3344,
        service_id: service_id(PortSpace::Tcp, 7174),
        local_ca_guid: 0x0002_00ff_fe00_0001,
        local_qpn: 0x00_1234,
        responder_resources: 4,
        initiator_depth: 3,
        remote_cm_response_timeout: 20,
        starting_psn: 0xAB_CDEF,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xFFFF,
        path_mtu: 3,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        primary_path: CmPathRepr {
            local_lid: 0xFFFF,
            remote_lid: 0xFFFF,
            local_gid: gid(CLIENT),
            remote_gid: gid(SERVER),
            flow_label: 0x1_2345,
            hop_limit: 64,
            local_ack_timeout: 17,
            ..CmPathRepr::default()
        },
        private_data: req_pd,
        ..ReqRepr::default()
    };
    let rep = RepRepr {
        local_comm_id: 0x5566_7788,
        remote_comm_id: 0x1122_3344,
        local_qpn: 0x00_5678,
        starting_psn: 0x12_3456,
        responder_resources: 3,
        initiator_depth: 4,
        target_ack_delay: 15,
        rnr_retry_count: 7,
        local_ca_guid: 0x0002_00ff_fe00_0002,
        ..RepRepr::default()
    };
    let mut rej_pd = [0u8; private_data_len::REJ];
    rej_pd[..4].copy_from_slice(b"nope");
    vec![
        (CLIENT, SERVER, CmMessage::Req(req)),
        (SERVER, CLIENT, CmMessage::Rep(rep)),
        (
            CLIENT,
            SERVER,
            CmMessage::Rtu(RtuRepr {
                local_comm_id: 0x1122_3344,
                remote_comm_id: 0x5566_7788,
                private_data: [0; private_data_len::RTU],
            }),
        ),
        (
            SERVER,
            CLIENT,
            CmMessage::Rej(RejRepr {
                local_comm_id: 0x5566_7788,
                remote_comm_id: 0x1122_3344,
                message_rejected: MessageKind::Req,
                ari_length: 0,
                reason: rej_reason::CONSUMER_DEFINED,
                ari: [0; ARI_LEN],
                private_data: rej_pd,
            }),
        ),
        (
            CLIENT,
            SERVER,
            CmMessage::Dreq(DreqRepr {
                local_comm_id: 0x1122_3344,
                remote_comm_id: 0x5566_7788,
                remote_qpn: 0x00_5678,
                private_data: [0; private_data_len::DREQ],
            }),
        ),
        (
            SERVER,
            CLIENT,
            CmMessage::Drep(DrepRepr {
                local_comm_id: 0x5566_7788,
                remote_comm_id: 0x1122_3344,
                private_data: [0; private_data_len::DREP],
            }),
        ),
        (
            CLIENT,
            SERVER,
            CmMessage::SidrReq(SidrReqRepr {
                request_id: 0x0BAD_CAFE,
                pkey: 0xFFFF,
                service_id: service_id(PortSpace::Udp, 7174),
                private_data: [0; private_data_len::SIDR_REQ],
            }),
        ),
        (
            SERVER,
            CLIENT,
            CmMessage::SidrRep(SidrRepRepr {
                request_id: 0x0BAD_CAFE,
                status: sidr_status::SUCCESS,
                info_length: 0,
                vendor_id: 0,
                qpn: 0x00_9ABC,
                service_id: service_id(PortSpace::Udp, 7174),
                qkey: RDMA_UDP_QKEY,
                info: [0; ARI_LEN],
                private_data: [0; private_data_len::SIDR_REP],
            }),
        ),
    ]
}

/// The `-V` text of each frame.
fn dissect(pcap_bytes: &[u8]) -> Vec<String> {
    let dir = std::env::temp_dir().join(format!("softverbs-cm-tshark-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cm.pcap");
    std::fs::write(&path, pcap_bytes).unwrap();
    let out = match Command::new("tshark").arg("-r").arg(&path).arg("-V").output() {
        Ok(out) => out,
        Err(e) => panic!("tshark could not be run ({e}); install it with scripts/setup-deps"),
    };
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        out.status.success(),
        "tshark failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let frames: Vec<String> = text
        .split("\nFrame ")
        .map(str::to_owned)
        .filter(|f| f.contains("bytes on wire"))
        .collect();
    frames
}

/// Checks every frame's ICRC with an implementation independent of this crate (Python's
/// zlib over the masked IPv4/UDP/BTH fields): tshark 4.0 displays the ICRC but does not check it.
const ICRC_CHECK: &str = r#"
import struct, sys, zlib
data = open(sys.argv[1], "rb").read()
off, good, bad = 24, 0, 0
while off < len(data):
    incl = struct.unpack_from("<I", data, off + 8)[0]
    frame = bytearray(data[off + 16 : off + 16 + incl])
    off += 16 + incl
    ip = frame[14:34]
    ip[1] = 0xFF; ip[8] = 0xFF; ip[10:12] = b"\xff\xff"
    udp = frame[34:42]
    udp[6:8] = b"\xff\xff"
    roce = bytearray(frame[42:-4])
    roce[4] = 0xFF
    crc = zlib.crc32(b"\xff" * 8 + bytes(ip) + bytes(udp) + bytes(roce)) & 0xFFFFFFFF
    if crc == struct.unpack("<I", frame[-4:])[0]:
        good += 1
    else:
        bad += 1
print(good, bad)
"#;

fn independent_icrc_check(pcap_bytes: &[u8]) -> (usize, usize) {
    let dir = std::env::temp_dir().join(format!("softverbs-cm-icrc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cm.pcap");
    std::fs::write(&path, pcap_bytes).unwrap();
    let out = match Command::new("python3")
        .arg("-c")
        .arg(ICRC_CHECK)
        .arg(&path)
        .output()
    {
        Ok(out) => out,
        Err(e) => panic!("python3 could not be run ({e}); install it with scripts/setup-deps"),
    };
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let mut it = text.split_whitespace().map(|n| n.parse().unwrap());
    (it.next().unwrap(), it.next().unwrap())
}

fn expect(frame: &str, needles: &[&str]) {
    for n in needles {
        assert!(frame.contains(n), "tshark output lacks {n:?}:\n{frame}");
    }
    for bad in ["Malformed", "Expert Info", "Bad", "Unknown"] {
        assert!(!frame.contains(bad), "tshark reports {bad:?}:\n{frame}");
    }
}

#[test]
fn tshark_decodes_cm_mads() {
    let msgs = messages();
    let frames: Vec<Vec<u8>> = msgs
        .iter()
        .enumerate()
        .map(|(i, (s, d, m))| frame(*s, *d, 0x1000 + i as u64, m))
        .collect();
    let capture = pcap(&frames);
    assert_eq!(
        independent_icrc_check(&capture),
        (msgs.len(), 0),
        "ICRCs good, bad"
    );
    let mut corrupted = frames.clone();
    let last = corrupted[0].len() - 1;
    corrupted[0][last] ^= 1;
    assert_eq!(
        independent_icrc_check(&pcap(&corrupted)),
        (msgs.len() - 1, 1),
        "the check can fail"
    );
    let text = dissect(&capture);
    assert_eq!(text.len(), msgs.len(), "one dissection per frame");
    for f in &text {
        expect(
            f,
            &[
                "Opcode: Unreliable Datagram (UD) - SEND only (100)",
                "Partition Key: 65535",
                "Destination Queue Pair: 0x000001",
                "Queue Key: 0x0000000080010000",
                "Source Queue Pair: 0x00000001",
                "Base Version: 0x01",
                "Management Class: 0x07",
                "Class Version: 0x02",
                "Method: Send() (0x03)",
                "Invariant CRC: 0x",
            ],
        );
    }
    expect(
        &text[0],
        &[
            "CM ConnectRequest",
            "Local Communication ID: 0x11223344",
            "Protocol: 0x06",
            "Destination Port: 0x1c06",
            "Local CA GUID: 0x000200fffe000001",
            "Local QPN: 0x001234",
            "Responder Resources: 0x04",
            "Initiator Depth: 0x03",
            "Remote CM Response Timeout: 0x14",
            "Starting PSN: 0xabcdef",
            "Retry Count: 0x7",
            "Path Packet Payload MTU: 0x3",
            "Max CM Retries: 0xf",
            "Primary Local Port GID: 10.0.0.1",
            "Primary Remote Port GID: 10.0.0.2",
            "Primary Hop Limit: 0x40",
            "Primary Local ACK Timeout: 0x11",
            "IP CM IP Version: 0x4",
            "IP CM Source Port: 0xc350",
            "IP CM Source IP: 10.0.0.1",
            "IP CM Destination IP: 10.0.0.2",
        ],
    );
    expect(
        &text[1],
        &[
            "CM ConnectReply",
            "Local Communication ID: 0x55667788",
            "Remote Communication ID: 0x11223344",
            "Local QPN: 0x005678",
            "Starting PSN: 0x123456",
        ],
    );
    let ids = |local: &str, remote: &str| {
        [
            format!("Local Communication ID: 0x{local}"),
            format!("Remote Communication ID: 0x{remote}"),
        ]
    };
    let [l, r] = ids("11223344", "55667788");
    expect(&text[2], &["CM ReadyToUse", &l, &r]);
    let [l, r] = ids("55667788", "11223344");
    expect(&text[3], &["CM ConnectReject", &l, &r, "Reason: 0x001c"]);
    let [l, r] = ids("11223344", "55667788");
    expect(
        &text[4],
        &["CM DisconnectRequest", &l, &r, "Remote QPN/EECN: 0x005678"],
    );
    let [l, r] = ids("55667788", "11223344");
    expect(&text[5], &["CM DisconnectReply", &l, &r]);
    // Wireshark 4.0 names the SIDR attributes without decoding their fields; the data
    // area's layout is checked by hand in the crate's unit tests.
    expect(
        &text[6],
        &[
            "CM ServiceIDResReq ",
            "Attribute ID: 0x0017",
            "MAD Data Payload: 0badcafeffff0000000000000111",
        ],
    );
    expect(
        &text[7],
        &[
            "CM ServiceIDResReqResp",
            "Attribute ID: 0x0018",
            "MAD Data Payload: 0badcafe00000000009abc000000000001111c0601234567",
        ],
    );
}
