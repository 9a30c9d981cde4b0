//! Compares every `repr(C)` mirror with the system `<infiniband/verbs.h>`: a C program compiled
//! with gcc prints `sizeof` and `offsetof` of each structure and field, and each must equal the
//! Rust `size_of`/`offset_of!`.

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::process::Command;

use crate::abi::*;
use crate::dm::ibv_alloc_dm_attr;
use crate::domain::{ibv_parent_domain_init_attr, ibv_td, ibv_td_init_attr};

/// (C expression, Rust value) pairs: `sizeof(struct x)` and `offsetof(struct x, f)`.
type Checks = Vec<(String, usize)>;

macro_rules! layout {
    ($checks:ident, $ty:ident { $($field:ident $(= $cname:literal)?),* $(,)? }) => {{
        $checks.push((format!("sizeof(struct {})", stringify!($ty)), size_of::<$ty>()));
        $(
            #[allow(unused_mut, unused_assignments)]
            let mut c = stringify!($field);
            $( c = $cname; )?
            $checks.push((format!("offsetof(struct {}, {})", stringify!($ty), c), offset_of!($ty, $field)));
        )*
    }};
}

fn checks() -> Checks {
    let mut v = Checks::new();
    layout!(
        v,
        ibv_device {
            _ops,
            node_type,
            transport_type,
            name,
            dev_name,
            dev_path,
            ibdev_path
        }
    );
    layout!(
        v,
        ibv_context_ops {
            _compat_query_device,
            _compat_query_port,
            alloc_mw,
            bind_mw,
            dealloc_mw,
            poll_cq,
            req_notify_cq,
            post_srq_recv,
            post_send,
            post_recv,
            _compat_async_event
        }
    );
    layout!(
        v,
        ibv_context {
            device,
            ops,
            cmd_fd,
            async_fd,
            num_comp_vectors,
            mutex,
            abi_compat
        }
    );
    layout!(v, verbs_context {
        query_port, advise_mr, alloc_null_mr, read_counters, attach_counters_point_flow,
        create_counters, destroy_counters, reg_dm_mr, alloc_dm, free_dm, modify_flow_action_esp,
        destroy_flow_action, create_flow_action_esp, modify_qp_rate_limit, alloc_parent_domain,
        dealloc_td, alloc_td, modify_cq, post_srq_ops, destroy_rwq_ind_table,
        create_rwq_ind_table, destroy_wq, modify_wq, create_wq, query_rt_values, create_cq_ex,
        priv_ = "priv", query_device_ex, ibv_destroy_flow, ABI_placeholder2, ibv_create_flow,
        ABI_placeholder1, open_qp, create_qp_ex, get_srq_num, create_srq_ex, open_xrcd,
        close_xrcd, _ABI_placeholder3, sz, context
    });
    layout!(
        v,
        ibv_device_attr {
            fw_ver,
            node_guid,
            sys_image_guid,
            max_mr_size,
            page_size_cap,
            vendor_id,
            vendor_part_id,
            hw_ver,
            max_qp,
            max_qp_wr,
            device_cap_flags,
            max_sge,
            max_sge_rd,
            max_cq,
            max_cqe,
            max_mr,
            max_pd,
            max_qp_rd_atom,
            max_ee_rd_atom,
            max_res_rd_atom,
            max_qp_init_rd_atom,
            max_ee_init_rd_atom,
            atomic_cap,
            max_ee,
            max_rdd,
            max_mw,
            max_raw_ipv6_qp,
            max_raw_ethy_qp,
            max_mcast_grp,
            max_mcast_qp_attach,
            max_total_mcast_qp_attach,
            max_ah,
            max_fmr,
            max_map_per_fmr,
            max_srq,
            max_srq_wr,
            max_srq_sge,
            max_pkeys,
            local_ca_ack_delay,
            phys_port_cnt
        }
    );
    layout!(
        v,
        ibv_odp_caps {
            general_caps,
            per_transport_caps
        }
    );
    layout!(
        v,
        ibv_tso_caps {
            max_tso,
            supported_qpts
        }
    );
    layout!(
        v,
        ibv_rss_caps {
            supported_qpts,
            max_rwq_indirection_tables,
            max_rwq_indirection_table_size,
            rx_hash_fields_mask,
            rx_hash_function
        }
    );
    layout!(
        v,
        ibv_packet_pacing_caps {
            qp_rate_limit_min,
            qp_rate_limit_max,
            supported_qpts
        }
    );
    layout!(
        v,
        ibv_tm_caps {
            max_rndv_hdr_size,
            max_num_tags,
            flags,
            max_ops,
            max_sge
        }
    );
    layout!(
        v,
        ibv_cq_moderation_caps {
            max_cq_count,
            max_cq_period
        }
    );
    layout!(
        v,
        ibv_pci_atomic_caps {
            fetch_add,
            swap,
            compare_swap
        }
    );
    layout!(
        v,
        ibv_device_attr_ex {
            orig_attr,
            comp_mask,
            odp_caps,
            completion_timestamp_mask,
            hca_core_clock,
            device_cap_flags_ex,
            tso_caps,
            rss_caps,
            max_wq_type_rq,
            packet_pacing_caps,
            raw_packet_caps,
            tm_caps,
            cq_mod_caps,
            max_dm_size,
            pci_atomic_caps,
            xrc_odp_caps,
            phys_port_cnt_ex
        }
    );
    layout!(v, ibv_query_device_ex_input { comp_mask });
    layout!(
        v,
        ibv_port_attr {
            state,
            max_mtu,
            active_mtu,
            gid_tbl_len,
            port_cap_flags,
            max_msg_sz,
            bad_pkey_cntr,
            qkey_viol_cntr,
            pkey_tbl_len,
            lid,
            sm_lid,
            lmc,
            max_vl_num,
            sm_sl,
            subnet_timeout,
            init_type_reply,
            active_width,
            active_speed,
            phys_state,
            link_layer,
            flags,
            port_cap_flags2
        }
    );
    v.push(("sizeof(union ibv_gid)".into(), size_of::<ibv_gid>()));
    v.push(("_Alignof(union ibv_gid)".into(), std::mem::align_of::<ibv_gid>()));
    layout!(
        v,
        ibv_global_route {
            dgid,
            flow_label,
            sgid_index,
            hop_limit,
            traffic_class
        }
    );
    layout!(
        v,
        ibv_ah_attr {
            grh,
            dlid,
            sl,
            src_path_bits,
            static_rate,
            is_global,
            port_num
        }
    );
    layout!(
        v,
        ibv_qp_cap {
            max_send_wr,
            max_recv_wr,
            max_send_sge,
            max_recv_sge,
            max_inline_data
        }
    );
    layout!(
        v,
        ibv_qp_attr {
            qp_state,
            cur_qp_state,
            path_mtu,
            path_mig_state,
            qkey,
            rq_psn,
            sq_psn,
            dest_qp_num,
            qp_access_flags,
            cap,
            ah_attr,
            alt_ah_attr,
            pkey_index,
            alt_pkey_index,
            en_sqd_async_notify,
            sq_draining,
            max_rd_atomic,
            max_dest_rd_atomic,
            min_rnr_timer,
            port_num,
            timeout,
            retry_cnt,
            rnr_retry,
            alt_port_num,
            alt_timeout,
            rate_limit
        }
    );
    layout!(
        v,
        ibv_qp_init_attr {
            qp_context,
            send_cq,
            recv_cq,
            srq,
            cap,
            qp_type,
            sq_sig_all
        }
    );
    layout!(
        v,
        ibv_rx_hash_conf {
            rx_hash_function,
            rx_hash_key_len,
            rx_hash_key,
            rx_hash_fields_mask
        }
    );
    layout!(
        v,
        ibv_qp_init_attr_ex {
            qp_context,
            send_cq,
            recv_cq,
            srq,
            cap,
            qp_type,
            sq_sig_all,
            comp_mask,
            pd,
            xrcd,
            create_flags,
            max_tso_header,
            rwq_ind_tbl,
            rx_hash_conf,
            source_qpn,
            send_ops_flags
        }
    );
    layout!(v, ibv_sge { addr, length, lkey });
    layout!(
        v,
        ibv_mw_bind_info {
            mr,
            addr,
            length,
            mw_access_flags
        }
    );
    layout!(v, ibv_send_wr {
        wr_id, next, sg_list, num_sge, opcode, send_flags, imm_data, wr,
        remote_srqn = "qp_type.xrc.remote_srqn", ext = "bind_mw"
    });
    v.push((
        "offsetof(struct ibv_send_wr, wr.rdma.rkey)".into(),
        offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_rdma, rkey),
    ));
    v.push((
        "offsetof(struct ibv_send_wr, wr.atomic.compare_add)".into(),
        offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_atomic, compare_add),
    ));
    v.push((
        "offsetof(struct ibv_send_wr, wr.atomic.swap)".into(),
        offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_atomic, swap),
    ));
    v.push((
        "offsetof(struct ibv_send_wr, wr.atomic.rkey)".into(),
        offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_atomic, rkey),
    ));
    v.push((
        "offsetof(struct ibv_send_wr, wr.ud.remote_qpn)".into(),
        offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_ud, remote_qpn),
    ));
    v.push((
        "offsetof(struct ibv_send_wr, wr.ud.remote_qkey)".into(),
        offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_ud, remote_qkey),
    ));
    v.push((
        "offsetof(struct ibv_send_wr, tso.mss)".into(),
        offset_of!(ibv_send_wr, ext) + offset_of!(ibv_send_wr_tso, mss),
    ));
    layout!(
        v,
        ibv_recv_wr {
            wr_id,
            next,
            sg_list,
            num_sge
        }
    );
    layout!(
        v,
        ibv_wc {
            wr_id,
            status,
            opcode,
            vendor_err,
            byte_len,
            imm_data,
            qp_num,
            src_qp,
            wc_flags,
            pkey_index,
            slid,
            sl,
            dlid_path_bits
        }
    );
    layout!(v, ibv_pd { context, handle });
    layout!(
        v,
        ibv_mr {
            context,
            pd,
            addr,
            length,
            handle,
            lkey,
            rkey
        }
    );
    layout!(v, ibv_comp_channel { context, fd, refcnt });
    layout!(
        v,
        ibv_cq {
            context,
            channel,
            cq_context,
            handle,
            cqe,
            mutex,
            cond,
            comp_events_completed,
            async_events_completed
        }
    );
    layout!(v, ibv_poll_cq_attr { comp_mask });
    layout!(
        v,
        ibv_cq_ex {
            context,
            channel,
            cq_context,
            handle,
            cqe,
            mutex,
            cond,
            comp_events_completed,
            async_events_completed,
            comp_mask,
            status,
            wr_id,
            start_poll,
            next_poll,
            end_poll,
            read_opcode,
            read_vendor_err,
            read_byte_len,
            read_imm_data,
            read_qp_num,
            read_src_qp,
            read_wc_flags,
            read_slid,
            read_sl,
            read_dlid_path_bits,
            read_completion_ts,
            read_cvlan,
            read_flow_tag,
            read_tm_info,
            read_completion_wallclock_ns
        }
    );
    layout!(
        v,
        ibv_cq_init_attr_ex {
            cqe,
            cq_context,
            channel,
            comp_vector,
            wc_flags,
            comp_mask,
            flags,
            parent_domain
        }
    );
    layout!(
        v,
        ibv_srq_attr {
            max_wr,
            max_sge,
            srq_limit
        }
    );
    layout!(v, ibv_srq_init_attr { srq_context, attr });
    layout!(
        v,
        ibv_tm_cap {
            max_num_tags,
            max_ops
        }
    );
    layout!(
        v,
        ibv_ops_wr {
            wr_id,
            next,
            opcode,
            flags,
            tm
        }
    );
    for (c, rust) in [
        ("tm.unexpected_cnt", offset_of!(ibv_ops_wr, tm.unexpected_cnt)),
        ("tm.handle", offset_of!(ibv_ops_wr, tm.handle)),
        ("tm.add.recv_wr_id", offset_of!(ibv_ops_wr, tm.add.recv_wr_id)),
        ("tm.add.sg_list", offset_of!(ibv_ops_wr, tm.add.sg_list)),
        ("tm.add.num_sge", offset_of!(ibv_ops_wr, tm.add.num_sge)),
        ("tm.add.tag", offset_of!(ibv_ops_wr, tm.add.tag)),
        ("tm.add.mask", offset_of!(ibv_ops_wr, tm.add.mask)),
    ] {
        v.push((format!("offsetof(struct ibv_ops_wr, {c})"), rust));
    }
    layout!(v, ibv_wc_tm_info { tag, priv_ = "priv" });
    layout!(
        v,
        ibv_srq_init_attr_ex {
            srq_context,
            attr,
            comp_mask,
            srq_type,
            pd,
            xrcd,
            cq,
            tm_cap
        }
    );
    layout!(
        v,
        ibv_srq {
            context,
            srq_context,
            pd,
            handle,
            mutex,
            cond,
            events_completed
        }
    );
    layout!(
        v,
        ibv_qp {
            context,
            qp_context,
            pd,
            send_cq,
            recv_cq,
            srq,
            handle,
            qp_num,
            state,
            qp_type,
            mutex,
            cond,
            events_completed
        }
    );
    layout!(v, ibv_data_buf { addr, length });
    layout!(
        v,
        ibv_qp_ex {
            qp_base,
            comp_mask,
            wr_id,
            wr_flags,
            wr_atomic_cmp_swp,
            wr_atomic_fetch_add,
            wr_bind_mw,
            wr_local_inv,
            wr_rdma_read,
            wr_rdma_write,
            wr_rdma_write_imm,
            wr_send,
            wr_send_imm,
            wr_send_inv,
            wr_send_tso,
            wr_set_ud_addr,
            wr_set_xrc_srqn,
            wr_set_inline_data,
            wr_set_inline_data_list,
            wr_set_sge,
            wr_set_sge_list,
            wr_start,
            wr_complete,
            wr_abort,
            wr_atomic_write
        }
    );
    layout!(v, ibv_ah { context, pd, handle });
    layout!(v, ibv_xrcd { context });
    layout!(
        v,
        ibv_xrcd_init_attr {
            comp_mask,
            fd,
            oflags
        }
    );
    layout!(
        v,
        ibv_qp_open_attr {
            comp_mask,
            qp_num,
            xrcd,
            qp_context,
            qp_type
        }
    );
    layout!(v, ibv_async_event { element, event_type });
    layout!(
        v,
        ibv_gid_entry {
            gid,
            gid_index,
            port_num,
            gid_type,
            ndev_ifindex
        }
    );
    layout!(v, ibv_mw { context, pd, rkey, handle, mw_type = "type" });
    layout!(
        v,
        ibv_dm {
            context,
            memcpy_to_dm,
            memcpy_from_dm,
            comp_mask,
            handle
        }
    );
    layout!(
        v,
        ibv_alloc_dm_attr {
            length,
            log_align_req,
            comp_mask
        }
    );
    layout!(v, ibv_td { context });
    layout!(v, ibv_td_init_attr { comp_mask });
    layout!(
        v,
        ibv_parent_domain_init_attr {
            pd,
            td,
            comp_mask,
            alloc,
            free,
            pd_context
        }
    );
    layout!(
        v,
        ibv_wq {
            context,
            wq_context,
            pd,
            cq,
            wq_num,
            handle,
            state,
            wq_type,
            post_recv,
            mutex,
            cond,
            events_completed,
            comp_mask
        }
    );
    layout!(v, ibv_values_ex { comp_mask, raw_clock });
    v.push(("sizeof(struct timespec)".into(), size_of::<timespec>()));
    v.push(("sizeof(pthread_mutex_t)".into(), size_of::<pthread_mutex_t>()));
    v.push(("sizeof(pthread_cond_t)".into(), size_of::<pthread_cond_t>()));
    v.push((
        "sizeof(struct _compat_ibv_port_attr)".into(),
        COMPAT_PORT_ATTR_SIZE,
    ));
    v
}

#[test]
fn mirrors_match_the_system_header() {
    if !std::path::Path::new("/usr/include/infiniband/verbs.h").exists() {
        panic!("libibverbs-dev is not installed (scripts/setup-deps installs it)");
    }
    let checks = checks();
    let dir = std::env::temp_dir().join(format!("sv-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\n\
         struct _compat_ibv_port_attr { enum ibv_port_state state; enum ibv_mtu max_mtu; \
         enum ibv_mtu active_mtu; int gid_tbl_len; uint32_t port_cap_flags; uint32_t max_msg_sz; \
         uint32_t bad_pkey_cntr; uint32_t qkey_viol_cntr; uint16_t pkey_tbl_len; uint16_t lid; \
         uint16_t sm_lid; uint8_t lmc; uint8_t max_vl_num; uint8_t sm_sl; uint8_t subnet_timeout; \
         uint8_t init_type_reply; uint8_t active_width; uint8_t active_speed; uint8_t phys_state; \
         uint8_t link_layer; uint8_t flags; };\nint main(void) {\n",
    );
    for (expr, _) in &checks {
        c.push_str(&format!(
            "  printf(\"%s=%zu\\n\", \"{expr}\", (size_t)({expr}));\n"
        ));
    }
    c.push_str("  return 0;\n}\n");
    std::fs::write(dir.join("layout.c"), c).unwrap();
    let exe = dir.join("layout");
    let out = Command::new("gcc")
        .arg(dir.join("layout.c"))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("gcc runs");
    assert!(
        out.status.success(),
        "gcc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(&exe).output().unwrap();
    let c_values: BTreeMap<String, usize> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.rsplit_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().unwrap()))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    let mut bad = Vec::new();
    for (expr, rust) in &checks {
        let c = c_values[expr];
        if c != *rust {
            bad.push(format!("{expr}: C {c}, Rust {rust}"));
        }
    }
    assert!(bad.is_empty(), "layout mismatches:\n{}", bad.join("\n"));
    assert!(checks.len() > 300, "{} checks", checks.len());
    // The offsets the inline wrappers in verbs.h depend on.
    assert_eq!(
        size_of::<verbs_context>() - offset_of!(verbs_context, context),
        328
    );
    assert_eq!(offset_of!(verbs_context, context), 320);
}
