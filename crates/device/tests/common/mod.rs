//! Helpers shared by the device's integration tests.
#![allow(dead_code)]

use std::net::UdpSocket;
use std::sync::Arc;

use softverbs_device::*;
use softverbs_engine::types::*;

/// A base port whose next `span` ports are free now, so that a test neither takes the standard
/// RoCE range nor depends on which other softverbs processes run on the host.
pub(crate) fn free_base_port(span: u16) -> u16 {
    let free =
        |port: u16| UdpSocket::bind(("0.0.0.0", port)).is_ok() && UdpSocket::bind(("::", port)).is_ok();
    let seed = std::process::id() as u16;
    (0..1000u16)
        .map(|i| 20_000 + (seed.wrapping_add(i.wrapping_mul(97)) % 40_000))
        .find(|&base| (base..=base + span).all(free))
        .expect("a free range of UDP ports")
}

/// A QP of `qp_type` with one WR and one SGE each way on `cq`.
pub(crate) fn qp_init(cq: &Arc<Cq>, qp_type: QpType) -> QpInitAttr {
    QpInitAttr {
        qp_type,
        send_cq: Some(cq.clone()),
        recv_cq: Some(cq.clone()),
        srq: None,
        cap: QpCap {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        max_tso_header: 0,
    }
}
