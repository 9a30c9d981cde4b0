//! proptest strategies producing valid representations.

use proptest::prelude::*;
use std::vec::Vec;

use crate::opcode::OPCODE_TABLE;
use crate::{
    AethRepr, AethSyndrome, AtomicAckEthRepr, AtomicEthRepr, BthRepr, DethRepr, FethRepr, Header, IethRepr,
    ImmDtRepr, Ipv4Repr, Ipv6Repr, NakCode, Opcode, PacketRepr, Psn, RethRepr, UdpRepr, XrcEthRepr,
};

pub(crate) fn opcode() -> impl Strategy<Value = Opcode> {
    proptest::sample::select(OPCODE_TABLE.iter().map(|i| i.opcode).collect::<Vec<_>>())
}

pub(crate) fn bth() -> impl Strategy<Value = BthRepr> {
    (
        opcode(),
        any::<[bool; 5]>(),
        0..4u8,
        any::<u16>(),
        0..1u32 << 24,
        0..Psn::MODULUS,
    )
        .prop_map(
            |(opcode, [solicited, migreq, fecn, becn, ack_req], pad_count, pkey, dest_qpn, psn)| BthRepr {
                opcode,
                solicited,
                migreq,
                pad_count,
                pkey,
                fecn,
                becn,
                dest_qpn,
                ack_req,
                psn: Psn::new(psn),
            },
        )
}

pub(crate) fn reth() -> impl Strategy<Value = RethRepr> {
    any::<(u64, u32, u32)>().prop_map(|(va, rkey, dma_len)| RethRepr { va, rkey, dma_len })
}

pub(crate) fn deth() -> impl Strategy<Value = DethRepr> {
    (any::<u32>(), 0..1u32 << 24).prop_map(|(qkey, src_qpn)| DethRepr { qkey, src_qpn })
}

pub(crate) fn aeth() -> impl Strategy<Value = AethRepr> {
    let syndrome = prop_oneof![
        (0..32u8).prop_map(|credits| AethSyndrome::Ack { credits }),
        (0..32u8).prop_map(|timer| AethSyndrome::RnrNak { timer }),
        (0..32u8).prop_map(|code| AethSyndrome::Nak(NakCode::from(code))),
    ];
    (syndrome, 0..1u32 << 24).prop_map(|(syndrome, msn)| AethRepr { syndrome, msn })
}

pub(crate) fn atomic_eth() -> impl Strategy<Value = AtomicEthRepr> {
    any::<(u64, u32, u64, u64)>().prop_map(|(va, rkey, swap_add, compare)| AtomicEthRepr {
        va,
        rkey,
        swap_add,
        compare,
    })
}

/// A consistent packet repr with its payload. The pad count stays random
/// (not derived from the payload length) because peers may send any.
pub(crate) fn packet() -> impl Strategy<Value = (PacketRepr, Vec<u8>)> {
    (
        bth(),
        deth(),
        reth(),
        atomic_eth(),
        aeth(),
        (any::<(u64, u32, u32)>(), 0..16u8, 0..4u8, 0..1u32 << 24),
        proptest::collection::vec(any::<u8>(), 0..80),
    )
        .prop_map(
            |(
                mut bth,
                deth,
                reth,
                atomic_eth,
                aeth,
                ((orig, imm_data, rkey), placement, selectivity, srqn),
                mut payload,
            )| {
                let op = bth.opcode;
                if !op.has_payload() {
                    payload.clear();
                    bth.pad_count = 0;
                }
                let has = |h| op.headers().contains(h);
                let repr = PacketRepr {
                    bth,
                    deth: has(Header::Deth).then_some(deth),
                    xrceth: has(Header::XrcEth).then_some(XrcEthRepr { srqn }),
                    feth: has(Header::Feth).then_some(FethRepr {
                        placement,
                        selectivity,
                    }),
                    reth: has(Header::Reth).then_some(reth),
                    atomic_eth: has(Header::AtomicEth).then_some(atomic_eth),
                    aeth: has(Header::Aeth).then_some(aeth),
                    atomic_ack_eth: has(Header::AtomicAckEth).then_some(AtomicAckEthRepr { orig }),
                    imm_dt: has(Header::ImmDt).then_some(ImmDtRepr { imm_data }),
                    ieth: has(Header::Ieth).then_some(IethRepr { rkey }),
                    payload_len: payload.len(),
                };
                (repr, payload)
            },
        )
}

pub(crate) fn ipv4() -> impl Strategy<Value = Ipv4Repr> {
    (
        any::<([u8; 4], [u8; 4], u8, u16)>(),
        0..=usize::from(u16::MAX) - crate::ipv4::HEADER_LEN,
        any::<(u8, u8, bool)>(),
    )
        .prop_map(
            |((src, dst, protocol, ident), payload_len, (tos, ttl, dont_frag))| Ipv4Repr {
                src_addr: src.into(),
                dst_addr: dst.into(),
                protocol,
                payload_len,
                tos,
                ident,
                dont_frag,
                ttl,
            },
        )
}

pub(crate) fn ipv6() -> impl Strategy<Value = Ipv6Repr> {
    (
        any::<([u8; 16], [u8; 16], u8, u8)>(),
        0..=usize::from(u16::MAX),
        any::<u8>(),
        0..1u32 << 20,
    )
        .prop_map(
            |((src, dst, next_header, hop_limit), payload_len, traffic_class, flow_label)| Ipv6Repr {
                src_addr: src.into(),
                dst_addr: dst.into(),
                next_header,
                payload_len,
                hop_limit,
                traffic_class,
                flow_label,
            },
        )
}

pub(crate) fn udp() -> impl Strategy<Value = UdpRepr> {
    (
        any::<(u16, u16)>(),
        0..=usize::from(u16::MAX) - crate::udp::HEADER_LEN,
    )
        .prop_map(|((src_port, dst_port), payload_len)| UdpRepr {
            src_port,
            dst_port,
            payload_len,
        })
}

fn bytes<const N: usize>() -> impl Strategy<Value = [u8; N]> {
    proptest::collection::vec(any::<u8>(), N).prop_map(|v| {
        let mut a = [0u8; N];
        a.copy_from_slice(&v);
        a
    })
}

pub(crate) fn mad() -> impl Strategy<Value = crate::MadRepr> {
    (any::<(u8, u8, bool, u16, u16, u64, u16, u32)>(), 0..0x80u8).prop_map(
        |(
            (mgmt_class, class_version, response, status, class_specific, transaction_id, attr_id, attr_mod),
            method,
        )| {
            crate::MadRepr {
                mgmt_class,
                class_version,
                response,
                method,
                status,
                class_specific,
                transaction_id,
                attr_id,
                attr_mod,
            }
        },
    )
}

pub(crate) fn cm_path() -> impl Strategy<Value = crate::cm::CmPathRepr> {
    (
        any::<(u16, u16, [u8; 16], [u8; 16], u8, u8, bool)>(),
        (0..1u32 << 20, 0..64u8, 0..16u8, 0..32u8),
    )
        .prop_map(
            |(
                (local_lid, remote_lid, local_gid, remote_gid, traffic_class, hop_limit, subnet_local),
                (flow_label, packet_rate, sl, local_ack_timeout),
            )| crate::cm::CmPathRepr {
                local_lid,
                remote_lid,
                local_gid,
                remote_gid,
                flow_label,
                packet_rate,
                traffic_class,
                hop_limit,
                sl,
                subnet_local,
                local_ack_timeout,
            },
        )
}

pub(crate) fn cm_req() -> impl Strategy<Value = crate::cm::ReqRepr> {
    (
        (
            any::<(u32, u64, u64, u32, u8, u8)>(),
            any::<(bool, u16, bool, bool, bool)>(),
        ),
        (
            0..1u32 << 24,
            0..1u32 << 24,
            0..1u32 << 24,
            0..1u32 << 24,
            0..1u32 << 24,
        ),
        (0..32u8, 0..4u8, 0..32u8, 0..8u8, 0..16u8, 0..8u8, 0..16u8, 0..8u8),
        (cm_path(), cm_path(), bytes::<92>()),
    )
        .prop_map(
            |(
                (
                    (
                        local_comm_id,
                        service_id,
                        local_ca_guid,
                        local_qkey,
                        responder_resources,
                        initiator_depth,
                    ),
                    (e2e_flow_control, pkey, rdc_exists, srq, sap_supported),
                ),
                (vendor_id, local_qpn, local_eecn, remote_eecn, starting_psn),
                (
                    remote_cm_response_timeout,
                    transport_type,
                    local_cm_response_timeout,
                    retry_count,
                    path_mtu,
                    rnr_retry_count,
                    max_cm_retries,
                    extended_transport_type,
                ),
                (primary_path, alternate_path, private_data),
            )| crate::cm::ReqRepr {
                local_comm_id,
                vendor_id,
                service_id,
                local_ca_guid,
                local_qkey,
                local_qpn,
                responder_resources,
                local_eecn,
                initiator_depth,
                remote_eecn,
                remote_cm_response_timeout,
                transport_type,
                e2e_flow_control,
                starting_psn,
                local_cm_response_timeout,
                retry_count,
                pkey,
                path_mtu,
                rdc_exists,
                rnr_retry_count,
                max_cm_retries,
                srq,
                extended_transport_type,
                primary_path,
                alternate_path,
                sap_supported,
                private_data,
            },
        )
}

fn message_kind() -> impl Strategy<Value = crate::cm::MessageKind> {
    use crate::cm::MessageKind;
    proptest::sample::select(std::vec![MessageKind::Req, MessageKind::Rep, MessageKind::Other])
}

pub(crate) fn cm_rep() -> impl Strategy<Value = crate::cm::RepRepr> {
    (
        any::<(u32, u32, u32, u8, u8, bool, bool, u64)>(),
        (0..1u32 << 24, 0..1u32 << 24, 0..1u32 << 24, 0..1u32 << 24),
        (0..32u8, 0..4u8, 0..8u8),
        bytes::<196>(),
    )
        .prop_map(
            |(
                (
                    local_comm_id,
                    remote_comm_id,
                    local_qkey,
                    responder_resources,
                    initiator_depth,
                    e2e_flow_control,
                    srq,
                    local_ca_guid,
                ),
                (local_qpn, local_eecn, starting_psn, vendor_id),
                (target_ack_delay, failover_accepted, rnr_retry_count),
                private_data,
            )| crate::cm::RepRepr {
                local_comm_id,
                remote_comm_id,
                local_qkey,
                local_qpn,
                local_eecn,
                starting_psn,
                vendor_id,
                responder_resources,
                initiator_depth,
                target_ack_delay,
                failover_accepted,
                e2e_flow_control,
                rnr_retry_count,
                srq,
                local_ca_guid,
                private_data,
            },
        )
}

/// Any CM message.
pub(crate) fn cm_message() -> impl Strategy<Value = crate::cm::CmMessage> {
    use crate::cm::*;
    prop_oneof![
        cm_req().prop_map(CmMessage::Req),
        cm_rep().prop_map(CmMessage::Rep),
        (any::<(u32, u32)>(), message_kind(), 0..32u8, bytes::<222>()).prop_map(
            |((local_comm_id, remote_comm_id), message_mraed, service_timeout, private_data)| {
                CmMessage::Mra(MraRepr {
                    local_comm_id,
                    remote_comm_id,
                    message_mraed,
                    service_timeout,
                    private_data,
                })
            }
        ),
        (
            any::<(u32, u32, u16)>(),
            message_kind(),
            0..=72u8,
            bytes::<72>(),
            bytes::<148>()
        )
            .prop_map(
                |(
                    (local_comm_id, remote_comm_id, reason),
                    message_rejected,
                    ari_length,
                    ari,
                    private_data,
                )| {
                    CmMessage::Rej(RejRepr {
                        local_comm_id,
                        remote_comm_id,
                        message_rejected,
                        ari_length,
                        reason,
                        ari,
                        private_data,
                    })
                }
            ),
        (any::<(u32, u32)>(), bytes::<224>()).prop_map(|((local_comm_id, remote_comm_id), private_data)| {
            CmMessage::Rtu(RtuRepr {
                local_comm_id,
                remote_comm_id,
                private_data,
            })
        }),
        (any::<(u32, u32)>(), 0..1u32 << 24, bytes::<220>()).prop_map(
            |((local_comm_id, remote_comm_id), remote_qpn, private_data)| {
                CmMessage::Dreq(DreqRepr {
                    local_comm_id,
                    remote_comm_id,
                    remote_qpn,
                    private_data,
                })
            }
        ),
        (any::<(u32, u32)>(), bytes::<224>()).prop_map(|((local_comm_id, remote_comm_id), private_data)| {
            CmMessage::Drep(DrepRepr {
                local_comm_id,
                remote_comm_id,
                private_data,
            })
        }),
        (any::<(u32, u16, u64)>(), bytes::<216>()).prop_map(
            |((request_id, pkey, service_id), private_data)| {
                CmMessage::SidrReq(SidrReqRepr {
                    request_id,
                    pkey,
                    service_id,
                    private_data,
                })
            }
        ),
        (
            any::<(u32, u8, u64, u32)>(),
            (0..=72u8, 0..1u32 << 24, 0..1u32 << 24),
            bytes::<72>(),
            bytes::<136>()
        )
            .prop_map(
                |(
                    (request_id, status, service_id, qkey),
                    (info_length, vendor_id, qpn),
                    info,
                    private_data,
                )| {
                    CmMessage::SidrRep(SidrRepRepr {
                        request_id,
                        status,
                        info_length,
                        vendor_id,
                        qpn,
                        service_id,
                        qkey,
                        info,
                        private_data,
                    })
                }
            ),
    ]
}

pub(crate) fn cma_header() -> impl Strategy<Value = crate::cm::CmaHeaderRepr> {
    use core::net::IpAddr;
    prop_oneof![
        any::<(u16, [u8; 4], [u8; 4])>().prop_map(|(port, s, d)| crate::cm::CmaHeaderRepr {
            port,
            src_addr: IpAddr::from(s),
            dst_addr: IpAddr::from(d),
        }),
        any::<(u16, [u8; 16], [u8; 16])>().prop_map(|(port, s, d)| crate::cm::CmaHeaderRepr {
            port,
            src_addr: IpAddr::from(s),
            dst_addr: IpAddr::from(d),
        }),
    ]
}
