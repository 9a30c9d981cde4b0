//! Pure translations between the C structures and the core's types: no pointers, no `unsafe`.

#![forbid(unsafe_code)]

use std::ffi::{c_char, c_int};

use softverbs_device::{DeviceAttr, PortAttr};
use softverbs_engine::types::{
    AccessFlags, AhAttr, Gid, GlobalRoute, MigState, Mtu, QpAttr, QpAttrMask, QpCap, QpState, SrqAttr,
    WcFlags, WcOpcode, WcStatus, WorkCompletion,
};

use super::EINVAL;
use crate::abi::*;

/// `IBV_GID_TYPE_ROCE_V2` of `enum ibv_gid_type` (the `ibv_gid_entry` enum).
pub(crate) const GID_ENTRY_TYPE_ROCE_V2: u32 = 2;

/// Copies `s` into a NUL-padded C char array, truncated to leave the final NUL.
pub(crate) fn copy_str(dst: &mut [c_char], s: &str) {
    let max = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(max)) {
        *d = b as c_char;
    }
}

/// The core device attributes as `struct ibv_device_attr` (GUIDs in network byte order).
pub(crate) fn device_attr_c(a: &DeviceAttr) -> ibv_device_attr {
    let mut fw_ver = [0 as c_char; 64];
    copy_str(&mut fw_ver, &a.fw_ver);
    let i = |v: u32| v.min(i32::MAX as u32) as c_int;
    ibv_device_attr {
        fw_ver,
        node_guid: a.node_guid.to_be(),
        sys_image_guid: a.sys_image_guid.to_be(),
        max_mr_size: a.max_mr_size,
        page_size_cap: a.page_size_cap,
        vendor_id: a.vendor_id,
        vendor_part_id: a.vendor_part_id,
        hw_ver: a.hw_ver,
        max_qp: i(a.max_qp),
        max_qp_wr: i(a.max_qp_wr),
        device_cap_flags: a.device_cap_flags,
        max_sge: i(a.max_sge),
        max_sge_rd: i(a.max_sge_rd),
        max_cq: i(a.max_cq),
        max_cqe: i(a.max_cqe),
        max_mr: i(a.max_mr),
        max_pd: i(a.max_pd),
        max_qp_rd_atom: i(a.max_qp_rd_atom),
        max_ee_rd_atom: i(a.max_ee_rd_atom),
        max_res_rd_atom: i(a.max_res_rd_atom),
        max_qp_init_rd_atom: i(a.max_qp_init_rd_atom),
        max_ee_init_rd_atom: i(a.max_ee_init_rd_atom),
        atomic_cap: a.atomic_cap.raw(),
        max_ee: i(a.max_ee),
        max_rdd: i(a.max_rdd),
        max_mw: i(a.max_mw),
        max_raw_ipv6_qp: i(a.max_raw_ipv6_qp),
        max_raw_ethy_qp: i(a.max_raw_ethy_qp),
        max_mcast_grp: i(a.max_mcast_grp),
        max_mcast_qp_attach: i(a.max_mcast_qp_attach),
        max_total_mcast_qp_attach: i(a.max_total_mcast_qp_attach),
        max_ah: i(a.max_ah),
        max_fmr: i(a.max_fmr),
        max_map_per_fmr: i(a.max_map_per_fmr),
        max_srq: i(a.max_srq),
        max_srq_wr: i(a.max_srq_wr),
        max_srq_sge: i(a.max_srq_sge),
        max_pkeys: a.max_pkeys,
        local_ca_ack_delay: a.local_ca_ack_delay,
        phys_port_cnt: a.phys_port_cnt,
    }
}

/// The core port attributes as `struct ibv_port_attr`.
pub(crate) fn port_attr_c(p: &PortAttr) -> ibv_port_attr {
    ibv_port_attr {
        state: p.state.raw(),
        max_mtu: p.max_mtu.raw(),
        active_mtu: p.active_mtu.raw(),
        gid_tbl_len: p.gid_tbl_len as c_int,
        port_cap_flags: p.port_cap_flags,
        max_msg_sz: p.max_msg_sz,
        bad_pkey_cntr: p.bad_pkey_cntr,
        qkey_viol_cntr: p.qkey_viol_cntr,
        pkey_tbl_len: p.pkey_tbl_len,
        lid: p.lid,
        sm_lid: p.sm_lid,
        lmc: p.lmc,
        max_vl_num: p.max_vl_num,
        sm_sl: p.sm_sl,
        subnet_timeout: p.subnet_timeout,
        init_type_reply: p.init_type_reply,
        active_width: p.active_width,
        active_speed: p.active_speed,
        phys_state: p.phys_state,
        link_layer: p.link_layer,
        flags: p.flags,
        port_cap_flags2: p.port_cap_flags2,
    }
}

/// The `ibv_gid_entry` of a RoCE v2 GID on the netdev `ifindex`.
pub(crate) fn gid_entry(ifindex: u32, port: u8, index: u32, gid: Gid) -> ibv_gid_entry {
    ibv_gid_entry {
        gid: ibv_gid { raw: gid.0 },
        gid_index: index,
        port_num: u32::from(port),
        gid_type: GID_ENTRY_TYPE_ROCE_V2,
        ndev_ifindex: ifindex,
    }
}

/// The core address vector as `struct ibv_ah_attr`.
pub(crate) fn ah_attr_c(a: &AhAttr) -> ibv_ah_attr {
    ibv_ah_attr {
        grh: ibv_global_route {
            dgid: ibv_gid { raw: a.grh.dgid.0 },
            flow_label: a.grh.flow_label,
            sgid_index: a.grh.sgid_index,
            hop_limit: a.grh.hop_limit,
            traffic_class: a.grh.traffic_class,
        },
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: u8::from(a.is_global),
        port_num: a.port_num,
    }
}

/// `struct ibv_ah_attr` to the core address vector.
pub(crate) fn ah_attr_core(a: &ibv_ah_attr) -> AhAttr {
    AhAttr {
        grh: GlobalRoute {
            dgid: Gid(a.grh.dgid.raw),
            flow_label: a.grh.flow_label,
            sgid_index: a.grh.sgid_index,
            hop_limit: a.grh.hop_limit,
            traffic_class: a.grh.traffic_class,
        },
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: a.is_global != 0,
        port_num: a.port_num,
    }
}

/// The core QP capabilities as `struct ibv_qp_cap`.
pub(crate) fn cap_c(c: &QpCap) -> ibv_qp_cap {
    ibv_qp_cap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

/// `struct ibv_qp_cap` to the core capabilities.
pub(crate) fn cap_core(c: &ibv_qp_cap) -> QpCap {
    QpCap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

/// Converts the attributes named by `mask`; an enum value out of range in a masked field is
/// EINVAL, fields outside the mask are ignored.
pub(crate) fn qp_attr_core(a: &ibv_qp_attr, mask: QpAttrMask) -> Result<QpAttr, c_int> {
    fn pick<T>(v: Option<T>, masked: bool, default: T) -> Result<T, c_int> {
        match v {
            Some(v) => Ok(v),
            None if masked => Err(EINVAL),
            None => Ok(default),
        }
    }
    let d = QpAttr::default();
    Ok(QpAttr {
        qp_state: pick(
            QpState::from_raw(a.qp_state),
            mask.contains(QpAttrMask::STATE),
            d.qp_state,
        )?,
        cur_qp_state: pick(
            QpState::from_raw(a.cur_qp_state),
            mask.contains(QpAttrMask::CUR_STATE),
            d.cur_qp_state,
        )?,
        path_mtu: pick(
            Mtu::from_raw(a.path_mtu),
            mask.contains(QpAttrMask::PATH_MTU),
            d.path_mtu,
        )?,
        path_mig_state: pick(
            MigState::from_raw(a.path_mig_state),
            mask.contains(QpAttrMask::PATH_MIG_STATE),
            d.path_mig_state,
        )?,
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: AccessFlags::from_bits_retain(a.qp_access_flags),
        cap: cap_core(&a.cap),
        ah_attr: ah_attr_core(&a.ah_attr),
        alt_ah_attr: ah_attr_core(&a.alt_ah_attr),
        pkey_index: a.pkey_index,
        alt_pkey_index: a.alt_pkey_index,
        en_sqd_async_notify: a.en_sqd_async_notify != 0,
        sq_draining: a.sq_draining != 0,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        alt_port_num: a.alt_port_num,
        alt_timeout: a.alt_timeout,
        rate_limit: a.rate_limit,
    })
}

/// The core QP attributes as `struct ibv_qp_attr`.
pub(crate) fn qp_attr_c(a: &QpAttr) -> ibv_qp_attr {
    ibv_qp_attr {
        qp_state: a.qp_state.raw(),
        cur_qp_state: a.cur_qp_state.raw(),
        path_mtu: a.path_mtu.raw(),
        path_mig_state: a.path_mig_state.raw(),
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: a.qp_access_flags.bits(),
        cap: cap_c(&a.cap),
        ah_attr: ah_attr_c(&a.ah_attr),
        alt_ah_attr: ah_attr_c(&a.alt_ah_attr),
        pkey_index: a.pkey_index,
        alt_pkey_index: a.alt_pkey_index,
        en_sqd_async_notify: u8::from(a.en_sqd_async_notify),
        sq_draining: u8::from(a.sq_draining),
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        alt_port_num: a.alt_port_num,
        alt_timeout: a.alt_timeout,
        rate_limit: a.rate_limit,
    }
}

/// `struct ibv_wc` to a core completion; unknown enum values become a general error / receive.
pub(crate) fn wc_core(wc: &ibv_wc) -> WorkCompletion {
    WorkCompletion {
        wr_id: wc.wr_id,
        status: WcStatus::from_raw(wc.status).unwrap_or(WcStatus::GeneralErr),
        opcode: WcOpcode::from_raw(wc.opcode).unwrap_or(WcOpcode::Recv),
        vendor_err: wc.vendor_err,
        byte_len: wc.byte_len,
        imm_data: wc.imm_data,
        qp_num: wc.qp_num,
        src_qp: wc.src_qp,
        wc_flags: WcFlags::from_bits_truncate(wc.wc_flags),
        pkey_index: wc.pkey_index,
        slid: wc.slid,
        sl: wc.sl,
        dlid_path_bits: wc.dlid_path_bits,
        ..WorkCompletion::default()
    }
}

/// `struct ibv_srq_attr` to the core's.
pub(crate) fn srq_attr_core(a: &ibv_srq_attr) -> SrqAttr {
    SrqAttr {
        max_wr: a.max_wr,
        max_sge: a.max_sge,
        srq_limit: a.srq_limit,
    }
}

/// The core's SRQ attributes as `struct ibv_srq_attr`.
pub(crate) fn srq_attr_c(a: &SrqAttr) -> ibv_srq_attr {
    ibv_srq_attr {
        max_wr: a.max_wr,
        max_sge: a.max_sge,
        srq_limit: a.srq_limit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_attr_enums_are_checked_only_when_masked() {
        let mut a = ibv_qp_attr {
            qp_state: 99,
            path_mtu: 42,
            ..Default::default()
        };
        assert_eq!(qp_attr_core(&a, QpAttrMask::STATE).unwrap_err(), EINVAL);
        assert!(qp_attr_core(&a, QpAttrMask::QKEY).is_ok());
        a.qp_state = QpState::Init.raw();
        assert_eq!(
            qp_attr_core(&a, QpAttrMask::STATE | QpAttrMask::PATH_MTU).unwrap_err(),
            EINVAL
        );
        let core = qp_attr_core(&a, QpAttrMask::STATE).unwrap();
        assert_eq!(core.qp_state, QpState::Init);
        assert_eq!(qp_attr_c(&core).qp_state, QpState::Init.raw());
    }
}
