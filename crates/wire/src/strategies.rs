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
