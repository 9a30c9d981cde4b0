//! `ibv_devinfo`: prints device and port attributes in rdma-core's layout, plus (with `-v`) the
//! softverbs counters of every process of this user that uses the device.

use std::fmt::Write as _;
use std::net::Ipv6Addr;
use std::process::ExitCode;

use clap::Parser;
use softverbs::{
    devices, odp, AtomicCap, Context, CounterSnapshot, Device, Mtu, OdpCaps, PortState, TmCapFlags,
};
use softverbs_tools::cli;

/// Print the attributes of the RDMA devices.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Use RDMA device DEV (default: all devices)
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    ib_dev: Option<String>,
    /// Use port PORT of the device (default: all ports)
    #[arg(short = 'i', long = "ib-port", value_name = "PORT", value_parser = parse_port)]
    ib_port: Option<u8>,
    /// Print only the device names
    #[arg(short = 'l', long = "list")]
    list: bool,
    /// Print all the attributes of the device(s)
    #[arg(short = 'v', long = "verbose")]
    verbose: bool,
}

fn parse_port(s: &str) -> Result<u8, String> {
    let p: u8 = cli::parse_c_int(s)?;
    if p == 0 {
        return Err("ports are numbered from 1".into());
    }
    Ok(p)
}

fn main() -> ExitCode {
    let args: Args = cli::parse_args();
    let list = match devices() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ibv_devinfo: Failed to get the RDMA device list: {e}");
            return ExitCode::from(255);
        }
    };
    if args.list {
        println!(
            "{} HCA{} found:",
            list.len(),
            if list.len() == 1 { "" } else { "s" }
        );
        for d in &list {
            println!("\t{}", d.name());
        }
        println!();
        return ExitCode::SUCCESS;
    }
    let selected: Vec<&Device> = match &args.ib_dev {
        Some(name) => match list.iter().find(|d| d.name() == name) {
            Some(d) => vec![d],
            None => {
                eprintln!("IB device '{name}' wasn't found");
                return ExitCode::from(255);
            }
        },
        None if list.is_empty() => {
            eprintln!("No IB devices found");
            return ExitCode::from(255);
        }
        None => list.iter().collect(),
    };
    // As rdma-core, the exit status ORs the per-device results.
    let mut status = 0u8;
    for d in selected {
        match print_device(d, args.ib_port, args.verbose) {
            Ok(text) => print!("{text}"),
            Err((code, msg)) => {
                eprintln!("{msg}");
                status |= code;
            }
        }
    }
    ExitCode::from(status)
}

/// Writes one formatted line; `String` formatting cannot fail.
macro_rules! emit {
    ($out:expr) => {
        $out.push('\n')
    };
    ($out:expr, $($arg:tt)*) => {
        let _ = writeln!($out, $($arg)*);
    };
}

/// The report of one device, or the exit code and message rdma-core would give.
fn print_device(dev: &Device, port_filter: Option<u8>, verbose: bool) -> Result<String, (u8, String)> {
    let ctx = dev
        .open()
        .map_err(|e| (1, format!("Failed to open device {}: {e}", dev.name())))?;
    let a = ctx.query_device();
    if port_filter.is_some_and(|p| p > a.phys_port_cnt) {
        return Err((4, "Invalid port requested for device".to_string()));
    }
    let mut o = String::new();
    emit!(o, "hca_id:\t{}", dev.name());
    // RoCE devices report the InfiniBand transport (IBV_TRANSPORT_IB = 0).
    emit!(o, "\ttransport:\t\t\tInfiniBand (0)");
    if !a.fw_ver.is_empty() {
        emit!(o, "\tfw_ver:\t\t\t\t{}", a.fw_ver);
    }
    emit!(o, "\tnode_guid:\t\t\t{}", guid_str(a.node_guid));
    emit!(o, "\tsys_image_guid:\t\t\t{}", guid_str(a.sys_image_guid));
    emit!(o, "\tvendor_id:\t\t\t0x{:04x}", a.vendor_id);
    emit!(o, "\tvendor_part_id:\t\t\t{}", a.vendor_part_id);
    emit!(o, "\thw_ver:\t\t\t\t0x{:X}", a.hw_ver);
    emit!(o, "\tphys_port_cnt:\t\t\t{}", a.phys_port_cnt);
    if verbose {
        emit!(o, "\tmax_mr_size:\t\t\t0x{:x}", a.max_mr_size);
        emit!(o, "\tpage_size_cap:\t\t\t0x{:x}", a.page_size_cap);
        emit!(o, "\tmax_qp:\t\t\t\t{}", a.max_qp);
        emit!(o, "\tmax_qp_wr:\t\t\t{}", a.max_qp_wr);
        emit!(o, "\tdevice_cap_flags:\t\t0x{:08x}", a.device_cap_flags);
        for name in cap_flag_names(a.device_cap_flags) {
            emit!(o, "\t\t\t\t\t{name}");
        }
        emit!(o, "\tmax_sge:\t\t\t{}", a.max_sge);
        emit!(o, "\tmax_sge_rd:\t\t\t{}", a.max_sge_rd);
        emit!(o, "\tmax_cq:\t\t\t\t{}", a.max_cq);
        emit!(o, "\tmax_cqe:\t\t\t{}", a.max_cqe);
        emit!(o, "\tmax_mr:\t\t\t\t{}", a.max_mr);
        emit!(o, "\tmax_pd:\t\t\t\t{}", a.max_pd);
        emit!(o, "\tmax_qp_rd_atom:\t\t\t{}", a.max_qp_rd_atom);
        emit!(o, "\tmax_ee_rd_atom:\t\t\t{}", a.max_ee_rd_atom);
        emit!(o, "\tmax_res_rd_atom:\t\t{}", a.max_res_rd_atom);
        emit!(o, "\tmax_qp_init_rd_atom:\t\t{}", a.max_qp_init_rd_atom);
        emit!(o, "\tmax_ee_init_rd_atom:\t\t{}", a.max_ee_init_rd_atom);
        emit!(
            o,
            "\tatomic_cap:\t\t\t{} ({})",
            atomic_cap_str(a.atomic_cap),
            a.atomic_cap.raw()
        );
        emit!(o, "\tmax_ee:\t\t\t\t{}", a.max_ee);
        emit!(o, "\tmax_rdd:\t\t\t{}", a.max_rdd);
        emit!(o, "\tmax_mw:\t\t\t\t{}", a.max_mw);
        emit!(o, "\tmax_raw_ipv6_qp:\t\t{}", a.max_raw_ipv6_qp);
        emit!(o, "\tmax_raw_ethy_qp:\t\t{}", a.max_raw_ethy_qp);
        emit!(o, "\tmax_mcast_grp:\t\t\t{}", a.max_mcast_grp);
        emit!(o, "\tmax_mcast_qp_attach:\t\t{}", a.max_mcast_qp_attach);
        emit!(o, "\tmax_total_mcast_qp_attach:\t{}", a.max_total_mcast_qp_attach);
        emit!(o, "\tmax_ah:\t\t\t\t{}", a.max_ah);
        emit!(o, "\tmax_fmr:\t\t\t{}", a.max_fmr);
        if a.max_fmr != 0 {
            emit!(o, "\tmax_map_per_fmr:\t\t{}", a.max_map_per_fmr);
        }
        emit!(o, "\tmax_srq:\t\t\t{}", a.max_srq);
        if a.max_srq != 0 {
            emit!(o, "\tmax_srq_wr:\t\t\t{}", a.max_srq_wr);
            emit!(o, "\tmax_srq_sge:\t\t\t{}", a.max_srq_sge);
        }
        emit!(o, "\tmax_pkeys:\t\t\t{}", a.max_pkeys);
        emit!(o, "\tlocal_ca_ack_delay:\t\t{}", a.local_ca_ack_delay);
        print_extended_caps(&mut o, &ctx);
    }
    for port in 1..=a.phys_port_cnt {
        if port_filter.is_some_and(|p| p != port) {
            continue;
        }
        print_port(&mut o, &ctx, port, verbose)?;
    }
    if verbose {
        // Not an rdma-core field: the device's counters summed over every process of this user
        // in this network namespace (their counter boards), kept apart from the C layout.
        let (processes, c) = softverbs::device_counters(ctx.device().name());
        emit!(o, "\tsoftverbs counters:");
        emit!(o, "\t\tprocesses:\t\t{processes}");
        for (name, value) in CounterSnapshot::NAMES.iter().zip(c.values()) {
            // Values line up at the fourth tab stop, as rdma-core's fields do.
            let tabs = "\t".repeat((31 - name.len()).max(8) / 8);
            emit!(o, "\t\t{name}:{tabs}{value}");
        }
        emit!(o);
    }
    Ok(o)
}

fn print_port(o: &mut String, ctx: &Context, port: u8, verbose: bool) -> Result<(), (u8, String)> {
    let p = ctx
        .query_port(port)
        .map_err(|e| (1, format!("Failed to query port {port} props: {e}")))?;
    emit!(o, "\t\tport:\t{port}");
    emit!(
        o,
        "\t\t\tstate:\t\t\t{} ({})",
        port_state_str(p.state),
        p.state.raw()
    );
    emit!(
        o,
        "\t\t\tmax_mtu:\t\t{} ({})",
        mtu_str(p.max_mtu),
        p.max_mtu.raw()
    );
    emit!(
        o,
        "\t\t\tactive_mtu:\t\t{} ({})",
        mtu_str(p.active_mtu),
        p.active_mtu.raw()
    );
    emit!(o, "\t\t\tsm_lid:\t\t\t{}", p.sm_lid);
    emit!(o, "\t\t\tport_lid:\t\t{}", p.lid);
    emit!(o, "\t\t\tport_lmc:\t\t0x{:02x}", p.lmc);
    emit!(o, "\t\t\tlink_layer:\t\t{}", link_layer_str(p.link_layer));
    if verbose {
        emit!(o, "\t\t\tmax_msg_sz:\t\t0x{:x}", p.max_msg_sz);
        emit!(o, "\t\t\tport_cap_flags:\t\t0x{:08x}", p.port_cap_flags);
        emit!(o, "\t\t\tport_cap_flags2:\t0x{:04x}", p.port_cap_flags2);
        emit!(
            o,
            "\t\t\tmax_vl_num:\t\t{} ({})",
            vl_str(p.max_vl_num),
            p.max_vl_num
        );
        emit!(o, "\t\t\tbad_pkey_cntr:\t\t0x{:x}", p.bad_pkey_cntr);
        emit!(o, "\t\t\tqkey_viol_cntr:\t\t0x{:x}", p.qkey_viol_cntr);
        emit!(o, "\t\t\tsm_sl:\t\t\t{}", p.sm_sl);
        emit!(o, "\t\t\tpkey_tbl_len:\t\t{}", p.pkey_tbl_len);
        emit!(o, "\t\t\tgid_tbl_len:\t\t{}", p.gid_tbl_len);
        emit!(o, "\t\t\tsubnet_timeout:\t\t{}", p.subnet_timeout);
        emit!(o, "\t\t\tinit_type_reply:\t{}", p.init_type_reply);
        emit!(
            o,
            "\t\t\tactive_width:\t\t{}X ({})",
            width_str(p.active_width),
            p.active_width
        );
        emit!(
            o,
            "\t\t\tactive_speed:\t\t{} ({})",
            speed_str(p.active_speed),
            p.active_speed
        );
        // Printed for the InfiniBand transport, which RoCE devices report.
        emit!(
            o,
            "\t\t\tphys_state:\t\t{} ({})",
            phys_state_str(p.phys_state),
            p.phys_state
        );
        for i in 0..p.gid_tbl_len {
            let idx = i as i32;
            let gid = ctx
                .query_gid(port, idx)
                .map_err(|e| (1, format!("Failed to query gid to port {port}, index {i}: {e}")))?;
            // rdma-core skips entries whose interface id (lower 64 bits) is zero.
            if gid.interface_id() == 0 {
                continue;
            }
            // softverbs reports `enum ibv_gid_type` values (IB 0, RoCE v1 1, RoCE v2 2).
            let kind = match ctx.query_gid_type(port, idx) {
                Ok(0) => "IB",
                Ok(1) => "RoCE v1",
                Ok(2) => "RoCE v2",
                _ => "Invalid gid type",
            };
            // RoCE v2 entries are printed as IPv6 text (inet_ntop), e.g. ::ffff:127.0.0.1.
            emit!(o, "\t\t\tGID[{i:3}]:\t\t{}, {kind}", Ipv6Addr::from(gid.0));
        }
    }
    emit!(o);
    Ok(())
}

/// The ibv_device_attr_ex part of `-v`, in the layout of rdma-core 44's `ibv_devinfo`.
fn print_extended_caps(o: &mut String, ctx: &Context) {
    let ex = ctx.query_device_ex();
    print_odp_caps(o, &ex.odp_caps);
    if ex.completion_timestamp_mask != 0 {
        emit!(
            o,
            "\tcompletion timestamp_mask:\t\t\t0x{:016x}",
            ex.completion_timestamp_mask
        );
    } else {
        emit!(o, "\tcompletion_timestamp_mask not supported");
    }
    if ex.hca_core_clock != 0 {
        emit!(o, "\thca_core_clock:\t\t\t{}kHZ", ex.hca_core_clock);
    } else {
        emit!(o, "\tcore clock not supported");
    }
    // raw_packet_caps (VLAN stripping, FCS scatter, checksum offloads) are none here, and
    // rdma-core prints nothing for none.
    emit!(o, "\tdevice_cap_flags_ex:\t\t0x{:X}", ex.device_cap_flags_ex);
    // rdma-core 44 names two of the upper 32 bits; the FLUSH and ATOMIC WRITE bits are newer.
    let upper = ex.device_cap_flags_ex & 0xffff_ffff_0000_0000;
    const RAW_SCATTER_FCS: u64 = 1 << 34;
    const PCI_WRITE_END_PADDING: u64 = 1 << 36;
    if upper & RAW_SCATTER_FCS != 0 {
        emit!(o, "\t\t\t\t\tRAW_SCATTER_FCS");
    }
    if upper & PCI_WRITE_END_PADDING != 0 {
        emit!(o, "\t\t\t\t\tPCI_WRITE_END_PADDING");
    }
    let unknown = upper & !(RAW_SCATTER_FCS | PCI_WRITE_END_PADDING);
    if unknown != 0 {
        emit!(o, "\t\t\t\t\tUnknown flags: 0x{unknown:X}");
    }
    let tso = ctx.tso_caps();
    emit!(o, "\ttso_caps:");
    emit!(o, "\t\tmax_tso:\t\t\t{}", tso.max_tso);
    if tso.max_tso != 0 {
        emit!(o, "\t\tsupported_qp:");
        print_qp_types(o, tso.supported_qpts);
    }
    let rss = ctx.rss_caps();
    emit!(o, "\trss_caps:");
    emit!(
        o,
        "\t\tmax_rwq_indirection_tables:\t\t\t{}",
        rss.max_rwq_indirection_tables
    );
    emit!(
        o,
        "\t\tmax_rwq_indirection_table_size:\t\t\t{}",
        rss.max_rwq_indirection_table_size
    );
    emit!(o, "\t\trx_hash_function:\t\t\t\t0x{:x}", rss.rx_hash_function);
    emit!(
        o,
        "\t\trx_hash_fields_mask:\t\t\t\t0x{:X}",
        rss.rx_hash_fields_mask
    );
    if rss.supported_qpts != 0 {
        emit!(o, "\t\tsupported_qp:");
        print_qp_types(o, rss.supported_qpts);
    }
    emit!(o, "\tmax_wq_type_rq:\t\t\t{}", rss.max_wq_type_rq);
    let ex = ctx.query_device_ex();
    let pacing = ex.packet_pacing_caps;
    emit!(o, "\tpacket_pacing_caps:");
    emit!(o, "\t\tqp_rate_limit_min:\t{}kbps", pacing.qp_rate_limit_min);
    emit!(o, "\t\tqp_rate_limit_max:\t{}kbps", pacing.qp_rate_limit_max);
    if pacing.supported_qpts != 0 {
        emit!(o, "\t\tsupported_qp:");
        print_qp_types(o, pacing.supported_qpts);
    }
    let tm = ctx.tm_caps();
    if tm.max_num_tags != 0 {
        emit!(o, "\tmax_rndv_hdr_size:\t\t{}", tm.max_rndv_hdr_size);
        emit!(o, "\tmax_num_tags:\t\t\t{}", tm.max_num_tags);
        emit!(o, "\tmax_ops:\t\t\t{}", tm.max_ops);
        emit!(o, "\tmax_sge:\t\t\t{}", tm.max_sge);
        emit!(o, "\tflags:");
        if tm.flags.contains(TmCapFlags::RC) {
            emit!(o, "\t\t\t\t\tIBV_TM_CAP_RC");
        }
    } else {
        emit!(o, "\ttag matching not supported");
    }
    let (max_cq_count, max_cq_period) = ex.cq_mod_caps;
    if max_cq_count != 0 && max_cq_period != 0 {
        emit!(o, "\n\tcq moderation caps:");
        emit!(o, "\t\tmax_cq_count:\t{max_cq_count}");
        emit!(o, "\t\tmax_cq_period:\t{max_cq_period} us\n");
    }
    if ctx.max_dm_size() != 0 {
        emit!(
            o,
            "\tmaximum available device memory:\t{}Bytes\n",
            ctx.max_dm_size()
        );
    }
    emit!(o, "\tnum_comp_vectors:\t\t{}", ctx.num_comp_vectors());
}

/// `odp_caps` and `xrc_odp_caps`.
fn print_odp_caps(o: &mut String, caps: &OdpCaps) {
    emit!(o, "\tgeneral_odp_caps:");
    if caps.general_caps & odp::SUPPORT != 0 {
        emit!(o, "\t\t\t\t\tODP_SUPPORT");
    }
    if caps.general_caps & odp::SUPPORT_IMPLICIT != 0 {
        emit!(o, "\t\t\t\t\tODP_SUPPORT_IMPLICIT");
    }
    let unknown = caps.general_caps & !(odp::SUPPORT | odp::SUPPORT_IMPLICIT);
    if unknown != 0 {
        emit!(o, "\t\t\t\t\tUnknown flags: 0x{unknown:X}");
    }
    for (name, t) in [
        ("rc", caps.rc_odp_caps),
        ("uc", caps.uc_odp_caps),
        ("ud", caps.ud_odp_caps),
        ("xrc", caps.xrc_odp_caps),
    ] {
        emit!(o, "\t{name}_odp_caps:");
        if t == 0 {
            emit!(o, "\t\t\t\t\tNO SUPPORT");
            continue;
        }
        let names = [
            (odp::SEND, "SUPPORT_SEND"),
            (odp::RECV, "SUPPORT_RECV"),
            (odp::WRITE, "SUPPORT_WRITE"),
            (odp::READ, "SUPPORT_READ"),
            (odp::ATOMIC, "SUPPORT_ATOMIC"),
            (odp::SRQ_RECV, "SUPPORT_SRQ"),
        ];
        for (bit, n) in names {
            if t & bit != 0 {
                emit!(o, "\t\t\t\t\t{n}");
            }
        }
        // FLUSH and ATOMIC WRITE on ODP regions are newer than rdma-core 44's names.
        let unknown = t & !names.iter().fold(0, |acc, (b, _)| acc | b);
        if unknown != 0 {
            emit!(o, "\t\t\t\t\tUnknown flags: 0x{unknown:X}");
        }
    }
}

/// The QP types of a `supported_qpts` mask (a bit per `ibv_qp_type`).
fn print_qp_types(o: &mut String, qpts: u32) {
    const RAW_PACKET: u32 = 1 << 8;
    const UD: u32 = 1 << 4;
    if qpts & RAW_PACKET != 0 {
        emit!(o, "\t\t\t\t\tSUPPORT_RAW_PACKET");
    }
    if qpts & UD != 0 {
        emit!(o, "\t\t\t\t\tSUPPORT_UD");
    }
    if qpts & !(RAW_PACKET | UD) != 0 {
        emit!(o, "\t\t\t\t\tUnknown flags: 0x{:X}", qpts & !(RAW_PACKET | UD));
    }
}

/// A GUID as four groups of four hex digits; `guid` is the number whose big-endian bytes are the
/// GUID (be64toh of the C field).
fn guid_str(guid: u64) -> String {
    format!(
        "{:04x}:{:04x}:{:04x}:{:04x}",
        (guid >> 48) & 0xffff,
        (guid >> 32) & 0xffff,
        (guid >> 16) & 0xffff,
        guid & 0xffff
    )
}

/// `enum ibv_device_cap_flags` names, in bit order, followed by any unknown bits.
fn cap_flag_names(flags: u32) -> Vec<String> {
    const NAMES: &[(u32, &str)] = &[
        (1, "RESIZE_MAX_WR"),
        (1 << 1, "BAD_PKEY_CNTR"),
        (1 << 2, "BAD_QKEY_CNTR"),
        (1 << 3, "RAW_MULTI"),
        (1 << 4, "AUTO_PATH_MIG"),
        (1 << 5, "CHANGE_PHY_PORT"),
        (1 << 6, "UD_AV_PORT_ENFORCE"),
        (1 << 7, "CURR_QP_STATE_MOD"),
        (1 << 8, "SHUTDOWN_PORT"),
        (1 << 9, "INIT_TYPE"),
        (1 << 10, "PORT_ACTIVE_EVENT"),
        (1 << 11, "SYS_IMAGE_GUID"),
        (1 << 12, "RC_RNR_NAK_GEN"),
        (1 << 13, "SRQ_RESIZE"),
        (1 << 14, "N_NOTIFY_CQ"),
        (1 << 17, "MEM_WINDOW"),
        (1 << 18, "UD_IP_CSUM"),
        (1 << 20, "XRC"),
        (1 << 21, "MEM_MGT_EXTENSIONS"),
        (1 << 23, "MEM_WINDOW_TYPE_2A"),
        (1 << 24, "MEM_WINDOW_TYPE_2B"),
        (1 << 25, "RC_IP_CSUM"),
        (1 << 26, "RAW_IP_CSUM"),
        (1 << 29, "MANAGED_FLOW_STEERING"),
    ];
    let mut out: Vec<String> = NAMES
        .iter()
        .filter(|(b, _)| flags & b != 0)
        .map(|(_, n)| n.to_string())
        .collect();
    let known = NAMES.iter().fold(0, |acc, (b, _)| acc | b);
    if flags & !known != 0 {
        out.push(format!("Unknown flags: 0x{:X}", flags & !known));
    }
    out
}

fn port_state_str(s: PortState) -> &'static str {
    match s {
        PortState::Down => "PORT_DOWN",
        PortState::Init => "PORT_INIT",
        PortState::Armed => "PORT_ARMED",
        PortState::Active => "PORT_ACTIVE",
        _ => "invalid state",
    }
}

fn mtu_str(m: Mtu) -> String {
    m.bytes().to_string()
}

fn atomic_cap_str(c: AtomicCap) -> &'static str {
    match c {
        AtomicCap::None => "ATOMIC_NONE",
        AtomicCap::Hca => "ATOMIC_HCA",
        AtomicCap::Glob => "ATOMIC_GLOB",
    }
}

fn link_layer_str(l: u8) -> &'static str {
    match l {
        0 | 1 => "InfiniBand",
        2 => "Ethernet",
        _ => "Unknown",
    }
}

fn vl_str(n: u8) -> &'static str {
    match n {
        1 => "1",
        2 => "2",
        3 => "4",
        4 => "8",
        5 => "15",
        _ => "invalid value",
    }
}

fn width_str(w: u8) -> &'static str {
    match w {
        1 => "1",
        2 => "4",
        4 => "8",
        8 => "12",
        16 => "2",
        _ => "invalid width",
    }
}

fn speed_str(s: u8) -> &'static str {
    match s {
        1 => "2.5 Gbps",
        2 => "5.0 Gbps",
        4 | 8 => "10.0 Gbps",
        16 => "14.0 Gbps",
        32 => "25.0 Gbps",
        64 => "50.0 Gbps",
        128 => "100.0 Gbps",
        _ => "invalid speed",
    }
}

fn phys_state_str(s: u8) -> &'static str {
    match s {
        1 => "SLEEP",
        2 => "POLLING",
        3 => "DISABLED",
        4 => "PORT_CONFIGURATION TRAINNING",
        5 => "LINK_UP",
        6 => "LINK_ERROR_RECOVERY",
        7 => "PHY TEST",
        _ => "invalid physical state",
    }
}
