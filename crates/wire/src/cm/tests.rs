//! Byte layouts checked by hand against IBTA Vol. 1 Tables 106-120, and
//! round trips.

use super::*;
use crate::mad::{HEADER_LEN, MAD_LEN};
use crate::strategies;
use proptest::prelude::*;

/// A zeroed data area with `bytes` written at `offset`, for each pair.
fn area(parts: &[(usize, &[u8])]) -> [u8; DATA_LEN] {
    let mut a = [0u8; DATA_LEN];
    for (at, bytes) in parts {
        a[*at..*at + bytes.len()].copy_from_slice(bytes);
    }
    a
}

fn v4_gid(last: u8) -> [u8; 16] {
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, last]
}

fn pd<const N: usize>(prefix: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a[..prefix.len()].copy_from_slice(prefix);
    a
}

pub(crate) fn sample_req() -> ReqRepr {
    ReqRepr {
        local_comm_id: 0x1122_3344,
        vendor_id: 0xAB_CDEF,
        service_id: service_id(PortSpace::Tcp, 7174),
        local_ca_guid: 0x0102_0304_0506_0708,
        local_qkey: 0x0A0B_0C0D,
        local_qpn: 0x11,
        responder_resources: 4,
        initiator_depth: 3,
        remote_cm_response_timeout: 20,
        transport_type: 0,
        e2e_flow_control: true,
        starting_psn: 0x12_3456,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xFFFF,
        path_mtu: 3,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: true,
        primary_path: CmPathRepr {
            local_lid: 0xFFFF,
            remote_lid: 0xFFFF,
            local_gid: v4_gid(1),
            remote_gid: v4_gid(2),
            flow_label: 0x1_2345,
            packet_rate: 2,
            traffic_class: 0x28,
            hop_limit: 64,
            sl: 5,
            subnet_local: true,
            local_ack_timeout: 17,
        },
        sap_supported: true,
        private_data: pd(&[0xde, 0xad]),
        ..ReqRepr::default()
    }
}

#[test]
fn req_layout() {
    let expected = area(&[
        (0, &[0x11, 0x22, 0x33, 0x44]),
        (5, &[0xAB, 0xCD, 0xEF]),
        (8, &[0, 0, 0, 0, 0x01, 0x06, 0x1C, 0x06]),
        (16, &[1, 2, 3, 4, 5, 6, 7, 8]),
        (28, &[0x0A, 0x0B, 0x0C, 0x0D]),
        (32, &[0, 0, 0x11, 4]),
        (39, &[3]),
        // remote timeout 20 = 10100, RC 00, flow control 1
        (43, &[0b1010_0001]),
        (44, &[0x12, 0x34, 0x56]),
        // local timeout 20 = 10100, retry 111
        (47, &[0b1010_0111]),
        (48, &[0xFF, 0xFF]),
        // MTU 0011, RDC 0, RNR 111 | max retries 1111, SRQ 1, extended 000
        (50, &[0b0011_0111, 0b1111_1000]),
        (52, &[0xFF, 0xFF, 0xFF, 0xFF]),
        (56, &v4_gid(1)),
        (72, &v4_gid(2)),
        // flow label 0x12345 in the top 20 bits, rate 2 in the low 6
        (88, &[0x12, 0x34, 0x50, 0x02]),
        (92, &[0x28, 64]),
        // SL 0101, subnet local 1 | ACK timeout 10001
        (94, &[0b0101_1000, 0b1000_1000]),
        // SAP supported: byte 139, bit 5 (from the MSB)
        (139, &[0b0000_0100]),
        (140, &[0xde, 0xad]),
    ]);
    let repr = sample_req();
    let mut buf = [0x5au8; DATA_LEN];
    repr.emit(&mut ReqPacket::new_unchecked(&mut buf));
    assert_eq!(buf, expected);
    let view = ReqPacket::new_checked(&expected[..]).unwrap();
    assert_eq!(view.primary_path().flow_label(), 0x1_2345);
    assert_eq!(view.starting_psn(), 0x12_3456);
    assert_eq!(ReqRepr::parse(&view), Ok(repr));
    assert_eq!(ReqPacket::new_checked(&expected[..DATA_LEN - 1]), Err(Error));
}

#[test]
fn rep_layout() {
    let repr = RepRepr {
        local_comm_id: 0xA1A2_A3A4,
        remote_comm_id: 0x1122_3344,
        local_qkey: 0x0123_4567,
        local_qpn: 0x00_2233,
        local_eecn: 0x44_5566,
        starting_psn: 0xAB_CDEF,
        vendor_id: 0x12_3456,
        responder_resources: 2,
        initiator_depth: 1,
        target_ack_delay: 15,
        failover_accepted: 2,
        e2e_flow_control: true,
        rnr_retry_count: 6,
        srq: true,
        local_ca_guid: 0x1112_1314_1516_1718,
        private_data: pd(&[7; 196]),
    };
    let expected = area(&[
        (0, &[0xA1, 0xA2, 0xA3, 0xA4, 0x11, 0x22, 0x33, 0x44]),
        (8, &[0x01, 0x23, 0x45, 0x67]),
        // QPN, vendor high | EECN, vendor middle | PSN, vendor low
        (
            12,
            &[
                0x00, 0x22, 0x33, 0x12, 0x44, 0x55, 0x66, 0x34, 0xAB, 0xCD, 0xEF, 0x56,
            ],
        ),
        (24, &[2, 1]),
        // ACK delay 01111, failover 10, flow control 1 | RNR 110, SRQ 1
        (26, &[0b0111_1101, 0b1101_0000]),
        (28, &[0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18]),
        (36, &[7; 196]),
    ]);
    let mut buf = [0x5au8; DATA_LEN];
    repr.emit(&mut RepPacket::new_unchecked(&mut buf));
    assert_eq!(buf, expected);
    assert_eq!(
        RepRepr::parse(&RepPacket::new_checked(&expected[..]).unwrap()),
        Ok(repr)
    );
}

#[test]
fn mra_rej_layout() {
    let mra = MraRepr {
        local_comm_id: 1,
        remote_comm_id: 2,
        message_mraed: MessageKind::Rep,
        service_timeout: 24,
        private_data: pd(&[9]),
    };
    let expected = area(&[
        (0, &[0, 0, 0, 1, 0, 0, 0, 2]),
        // message 01 in the top two bits | timeout 11000 in the top five
        (8, &[0b0100_0000, 0b1100_0000, 9]),
    ]);
    let mut buf = [0x5au8; DATA_LEN];
    mra.emit(&mut MraPacket::new_unchecked(&mut buf));
    assert_eq!(buf, expected);
    assert_eq!(
        MraRepr::parse(&MraPacket::new_checked(&expected[..]).unwrap()),
        Ok(mra)
    );
    let mut bad = expected;
    bad[8] = 0xC0;
    assert_eq!(
        MraRepr::parse(&MraPacket::new_checked(&bad[..]).unwrap()),
        Err(Error)
    );

    let rej = RejRepr {
        local_comm_id: 0,
        remote_comm_id: 0x1122_3344,
        message_rejected: MessageKind::Req,
        ari_length: 3,
        reason: rej_reason::CONSUMER_DEFINED,
        ari: pd(&[1, 2, 3]),
        private_data: pd(b"no"),
    };
    let expected = area(&[
        (4, &[0x11, 0x22, 0x33, 0x44]),
        // message 00 | ARI length 0000011 in the top seven bits | reason 28
        (8, &[0, 0b0000_0110, 0, 28]),
        (12, &[1, 2, 3]),
        (84, b"no"),
    ]);
    let mut buf = [0x5au8; DATA_LEN];
    rej.emit(&mut RejPacket::new_unchecked(&mut buf));
    assert_eq!(buf, expected);
    assert_eq!(
        RejRepr::parse(&RejPacket::new_checked(&expected[..]).unwrap()),
        Ok(rej)
    );
    let mut bad = expected;
    bad[9] = 73 << 1;
    assert_eq!(
        RejRepr::parse(&RejPacket::new_checked(&bad[..]).unwrap()),
        Err(Error)
    );
}

#[test]
fn rtu_dreq_drep_layout() {
    let rtu = RtuRepr {
        local_comm_id: 0x0102_0304,
        remote_comm_id: 0x0506_0708,
        private_data: pd(&[0xEE]),
    };
    let expected = area(&[(0, &[1, 2, 3, 4, 5, 6, 7, 8, 0xEE])]);
    let mut buf = [0u8; DATA_LEN];
    rtu.emit(&mut RtuPacket::new_unchecked(&mut buf));
    assert_eq!(buf, expected);
    assert_eq!(
        RtuRepr::parse(&RtuPacket::new_checked(&expected[..]).unwrap()),
        Ok(rtu)
    );

    let dreq = DreqRepr {
        local_comm_id: 0x0102_0304,
        remote_comm_id: 0x0506_0708,
        remote_qpn: 0x12_3456,
        private_data: pd(&[0xEE]),
    };
    let expected = area(&[(0, &[1, 2, 3, 4, 5, 6, 7, 8, 0x12, 0x34, 0x56, 0, 0xEE])]);
    let mut buf = [0x5au8; DATA_LEN];
    dreq.emit(&mut DreqPacket::new_unchecked(&mut buf));
    assert_eq!(buf, expected);
    assert_eq!(
        DreqRepr::parse(&DreqPacket::new_checked(&expected[..]).unwrap()),
        Ok(dreq)
    );

    let drep = DrepRepr {
        local_comm_id: 0x0506_0708,
        remote_comm_id: 0x0102_0304,
        private_data: pd(&[0xEE]),
    };
    let expected = area(&[(0, &[5, 6, 7, 8, 1, 2, 3, 4, 0xEE])]);
    let mut buf = [0x5au8; DATA_LEN];
    drep.emit(&mut DrepPacket::new_unchecked(&mut buf));
    assert_eq!(buf, expected);
    assert_eq!(
        DrepRepr::parse(&DrepPacket::new_checked(&expected[..]).unwrap()),
        Ok(drep)
    );
}

#[test]
fn sidr_layout() {
    let req = SidrReqRepr {
        request_id: 0xCAFE_F00D,
        pkey: 0xFFFF,
        service_id: service_id(PortSpace::Udp, 7174),
        private_data: pd(&[0, 0x40]),
    };
    let expected = area(&[
        (0, &[0xCA, 0xFE, 0xF0, 0x0D, 0xFF, 0xFF]),
        (8, &[0, 0, 0, 0, 0x01, 0x11, 0x1C, 0x06]),
        (16, &[0, 0x40]),
    ]);
    let mut buf = [0x5au8; DATA_LEN];
    req.emit(&mut SidrReqPacket::new_unchecked(&mut buf));
    assert_eq!(buf, expected);
    assert_eq!(
        SidrReqRepr::parse(&SidrReqPacket::new_checked(&expected[..]).unwrap()),
        Ok(req)
    );

    let rep = SidrRepRepr {
        request_id: 0xCAFE_F00D,
        status: sidr_status::SUCCESS,
        info_length: 0,
        vendor_id: 0x12_3456,
        qpn: 0x00_0042,
        service_id: service_id(PortSpace::Udp, 7174),
        qkey: RDMA_UDP_QKEY,
        info: [0; ARI_LEN],
        private_data: pd(&[0x77]),
    };
    let expected = area(&[
        (0, &[0xCA, 0xFE, 0xF0, 0x0D, 0, 0, 0x12, 0x34, 0, 0, 0x42, 0x56]),
        (12, &[0, 0, 0, 0, 0x01, 0x11, 0x1C, 0x06]),
        (20, &[0x01, 0x23, 0x45, 0x67]),
        (96, &[0x77]),
    ]);
    let mut buf = [0x5au8; DATA_LEN];
    rep.emit(&mut SidrRepPacket::new_unchecked(&mut buf));
    assert_eq!(buf, expected);
    assert_eq!(
        SidrRepRepr::parse(&SidrRepPacket::new_checked(&expected[..]).unwrap()),
        Ok(rep)
    );
}

#[test]
fn whole_mad() {
    let msg = CmMessage::Req(sample_req());
    let mut mad = [0u8; MAD_LEN];
    msg.emit(0x0000_0001_1122_3344, 0, &mut mad).unwrap();
    assert_eq!(&mad[..4], &[1, 0x07, 2, 0x03]);
    assert_eq!(&mad[16..18], &[0, 0x10]);
    let (header, parsed) = CmMessage::parse(&mad).unwrap();
    assert_eq!(header.transaction_id, 0x0000_0001_1122_3344);
    assert_eq!(parsed, msg);
    // Short buffers, other classes, versions, methods and attributes are refused.
    assert_eq!(CmMessage::parse(&mad[..MAD_LEN - 1]), Err(Error));
    assert!(msg.emit(0, 0, &mut [0u8; MAD_LEN - 1]).is_err());
    for (at, value) in [
        (0, 2),
        (1, 0x81),
        (2, 1),
        (3, 0x83),
        (3, 0x01),
        (17, 0x19),
        (17, 0x01),
    ] {
        let mut bad = mad;
        bad[at] = value;
        assert_eq!(CmMessage::parse(&bad), Err(Error), "byte {at} = {value:#x}");
    }
    // A longer receive buffer parses the same.
    let mut long = [0u8; MAD_LEN + 40];
    long[..MAD_LEN].copy_from_slice(&mad);
    assert_eq!(CmMessage::parse(&long).unwrap().1, msg);
    assert_eq!(HEADER_LEN + DATA_LEN, MAD_LEN);
}

#[test]
fn cma_header_layout() {
    let repr = CmaHeaderRepr {
        port: 0xC001,
        src_addr: "10.0.0.1".parse().unwrap(),
        dst_addr: "10.0.0.2".parse().unwrap(),
    };
    let mut expected = [0u8; CMA_HEADER_LEN];
    expected[1] = 0x40;
    expected[2..4].copy_from_slice(&[0xC0, 0x01]);
    expected[16..20].copy_from_slice(&[10, 0, 0, 1]);
    expected[32..36].copy_from_slice(&[10, 0, 0, 2]);
    let mut buf = [0x5au8; CMA_HEADER_LEN];
    repr.emit(&mut CmaHeaderPacket::new_unchecked(&mut buf));
    assert_eq!(buf, expected);
    assert_eq!(
        CmaHeaderRepr::parse(&CmaHeaderPacket::new_checked(&expected[..]).unwrap()),
        Ok(repr)
    );
    let mut bad = expected;
    bad[1] = 0x50;
    assert_eq!(
        CmaHeaderRepr::parse(&CmaHeaderPacket::new_unchecked(&bad[..])),
        Err(Error)
    );
    bad[1] = 0x40;
    bad[0] = 1;
    assert_eq!(
        CmaHeaderRepr::parse(&CmaHeaderPacket::new_unchecked(&bad[..])),
        Err(Error)
    );

    let v6 = CmaHeaderRepr {
        port: 1,
        src_addr: "fe80::1".parse().unwrap(),
        dst_addr: "fe80::2".parse().unwrap(),
    };
    v6.emit(&mut CmaHeaderPacket::new_unchecked(&mut buf));
    assert_eq!(buf[1], 0x60);
    assert_eq!(&buf[4..6], &[0xfe, 0x80]);
    assert_eq!(
        CmaHeaderRepr::parse(&CmaHeaderPacket::new_unchecked(&buf[..])),
        Ok(v6)
    );
}

#[test]
fn service_ids() {
    assert_eq!(service_id(PortSpace::Tcp, 7471), 0x0000_0000_0106_1D2F);
    assert_eq!(service_id(PortSpace::Udp, 7174), 0x0000_0000_0111_1C06);
    assert_eq!(service_id(PortSpace::Ib, 1), 0x0000_0000_013F_0001);
    assert_eq!(service_id(PortSpace::Ipoib, 2), 0x0000_0000_0002_0002);
    assert_eq!(service_id_parts(0x0106_1D2F), Some((PortSpace::Tcp, 7471)));
    assert_eq!(service_id_parts(0x0107_1D2F), None);
    assert_eq!(service_id_parts(0x1_0106_1D2F), None);
}

proptest! {
    #[test]
    fn message_round_trip(msg in strategies::cm_message(), tid in any::<u64>(), attr_mod in any::<u32>()) {
        let mut mad = [0x33u8; MAD_LEN];
        msg.emit(tid, attr_mod, &mut mad).unwrap();
        let (header, parsed) = CmMessage::parse(&mad).unwrap();
        prop_assert_eq!(parsed, msg);
        prop_assert_eq!(header.transaction_id, tid);
        prop_assert_eq!(header.attr_mod, attr_mod);
        prop_assert_eq!(header.attr_id, msg.attr_id());
        // Emission does not depend on the buffer's old contents.
        let mut again = [0u8; MAD_LEN];
        msg.emit(tid, attr_mod, &mut again).unwrap();
        prop_assert_eq!(&again[..], &mad[..]);
    }

    #[test]
    fn cma_header_round_trip(repr in strategies::cma_header()) {
        let mut buf = [0u8; CMA_HEADER_LEN];
        repr.emit(&mut CmaHeaderPacket::new_unchecked(&mut buf));
        prop_assert_eq!(CmaHeaderRepr::parse(&CmaHeaderPacket::new_unchecked(&buf)), Ok(repr));
    }

    #[test]
    fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), attr in 0x10u16..0x19) {
        let mut bytes = bytes;
        if bytes.len() >= 24 {
            bytes[..4].copy_from_slice(&[1, 0x07, 2, 3]);
            bytes[16..18].copy_from_slice(&attr.to_be_bytes());
        }
        let _ = CmMessage::parse(&bytes);
    }
}
