//! The C ABI of raw packet QPs: `ibv_create_flow`/`ibv_destroy_flow`, receive work queues
//! (`ibv_create_wq`, `ibv_modify_wq`, `wq->post_recv`, `ibv_destroy_wq`), indirection tables
//! and RSS QPs (`ibv_create_qp_ex` with `IND_TABLE | RX_HASH`). These verbs are inline wrappers
//! in `verbs.h` that call the `verbs_context` slots filled with the functions here. Only struct
//! and errno translation happens here; the rules are the core's.

use std::ffi::{c_int, c_uint, c_void};
use std::mem::size_of;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use softverbs_device::flow::{Flow, FlowAttr, FlowType};
use softverbs_device::qp::Qp;
use softverbs_device::wq::{RwqIndTable, RxHashConf, Wq, WqState, MAX_LOG_IND_TBL_SIZE};
use softverbs_device::Device;
use softverbs_engine::steering::{EthFilter, FlowSpec, Ipv4Filter, Ipv6Filter, PortFilter};
use softverbs_engine::types::QpType;
use softverbs_engine::Errno;

use crate::abi::*;
use crate::datapath::post_recv_list;
use crate::verbs::{box_qp, context, destroy_boxed, errno_of, outer, NewQp, SvCq, SvPd, SvQp};
use crate::{fail, fail_null};

const EINVAL: c_int = Errno::EINVAL as c_int;
const EOPNOTSUPP: c_int = Errno::EOPNOTSUPP as c_int;

/// `IBV_QP_INIT_ATTR_IND_TABLE`.
pub(crate) const QP_INIT_ATTR_IND_TABLE: u32 = 1 << 4;
/// `IBV_QP_INIT_ATTR_RX_HASH`.
pub(crate) const QP_INIT_ATTR_RX_HASH: u32 = 1 << 5;

/// `struct ibv_flow`.
#[repr(C)]
pub(crate) struct ibv_flow {
    comp_mask: u32,
    context: *mut ibv_context,
    handle: u32,
}

/// `struct ibv_rwq_ind_table`.
#[repr(C)]
pub(crate) struct ibv_rwq_ind_table {
    context: *mut ibv_context,
    ind_tbl_handle: c_int,
    ind_tbl_num: c_int,
    comp_mask: u32,
}

/// `struct ibv_rwq_ind_table_init_attr`.
#[repr(C)]
pub(crate) struct ibv_rwq_ind_table_init_attr {
    log_ind_tbl_size: u32,
    ind_tbl: *mut *mut ibv_wq,
    comp_mask: u32,
}

/// `struct ibv_wq_init_attr`.
#[repr(C)]
pub(crate) struct ibv_wq_init_attr {
    wq_context: *mut c_void,
    wq_type: c_uint,
    max_wr: u32,
    max_sge: u32,
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    comp_mask: u32,
    create_flags: u32,
}

/// `struct ibv_wq_attr`.
#[repr(C)]
pub(crate) struct ibv_wq_attr {
    attr_mask: u32,
    wq_state: c_uint,
    curr_wq_state: c_uint,
    flags: u32,
    flags_mask: u32,
}

// The layouts gcc gives these structs (verbs.h of rdma-core 44).
const _: () = assert!(size_of::<ibv_flow>() == 24);
const _: () = assert!(size_of::<ibv_rwq_ind_table>() == 24);
const _: () = assert!(size_of::<ibv_rwq_ind_table_init_attr>() == 24);
const _: () = assert!(size_of::<ibv_wq_init_attr>() == 48);
const _: () = assert!(size_of::<ibv_wq_attr>() == 20);
const _: () = assert!(size_of::<ibv_wq>() == 152);

#[repr(C)]
struct SvFlow {
    flow: ibv_flow,
    core: Arc<Flow>,
}

#[repr(C)]
struct SvWq {
    wq: ibv_wq,
    core: Arc<Wq>,
    /// Its receive queue buffer from a parent domain's allocator, if created through one.
    queue: Option<crate::domain::RecvQueue>,
}

#[repr(C)]
struct SvIndTable {
    table: ibv_rwq_ind_table,
    core: Arc<RwqIndTable>,
}

static NEXT_HANDLE: AtomicU32 = AtomicU32::new(1);

/// Fills the raw packet and RSS fields of `ibv_query_device_ex`.
pub(crate) fn fill_device_attr_ex(device: &Device, ex: &mut ibv_device_attr_ex) {
    let r = device.rss_caps();
    ex.rss_caps = ibv_rss_caps {
        supported_qpts: r.supported_qpts,
        max_rwq_indirection_tables: r.max_rwq_indirection_tables,
        max_rwq_indirection_table_size: r.max_rwq_indirection_table_size,
        rx_hash_fields_mask: r.rx_hash_fields_mask,
        rx_hash_function: r.rx_hash_function,
    };
    ex.max_wq_type_rq = r.max_wq_type_rq;
    let t = device.tso_caps();
    ex.tso_caps = ibv_tso_caps {
        max_tso: t.max_tso,
        supported_qpts: t.supported_qpts,
    };
    // No VLAN stripping, FCS scatter, checksum offload or delay drop.
    ex.raw_packet_caps = 0;
}

/// `IBV_FLOW_SPEC_*` and the size of each spec struct.
mod spec {
    pub(super) const ETH: u32 = 0x20;
    pub(super) const IPV4: u32 = 0x30;
    pub(super) const IPV6: u32 = 0x31;
    pub(super) const IPV4_EXT: u32 = 0x32;
    pub(super) const TCP: u32 = 0x40;
    pub(super) const UDP: u32 = 0x41;
    pub(super) const INNER: u32 = 0x100;
    pub(super) const ACTION_TAG: u32 = 0x1000;
    pub(super) const ACTION_DROP: u32 = 0x1001;
    pub(super) const ACTION_COUNT: u32 = 0x1003;

    /// The size of the spec struct of `t`, or `None` for a type the device does not offer.
    pub(super) fn size(t: u32) -> Option<usize> {
        Some(match t {
            ETH => 40,
            IPV4 => 24,
            IPV4_EXT => 32,
            IPV6 => 88,
            TCP | UDP => 16,
            ACTION_TAG => 12,
            ACTION_DROP => 8,
            ACTION_COUNT => 16,
            _ => return None,
        })
    }
}

fn be16(b: &[u8], o: usize) -> u16 {
    u16::from_be_bytes([b[o], b[o + 1]])
}

fn ne32(b: &[u8], o: usize) -> u32 {
    u32::from_ne_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn v4(b: &[u8], o: usize) -> Ipv4Addr {
    Ipv4Addr::new(b[o], b[o + 1], b[o + 2], b[o + 3])
}

fn eth_filter(b: &[u8]) -> EthFilter {
    EthFilter {
        dst_mac: b[0..6].try_into().unwrap_or_default(),
        src_mac: b[6..12].try_into().unwrap_or_default(),
        ether_type: be16(b, 12),
        vlan_tag: be16(b, 14),
    }
}

fn ipv4_filter(b: &[u8], ext: bool) -> Ipv4Filter {
    let mut f = Ipv4Filter {
        src_ip: v4(b, 0),
        dst_ip: v4(b, 4),
        ..Default::default()
    };
    if ext {
        (f.proto, f.tos, f.ttl, f.flags) = (b[8], b[9], b[10], b[11]);
    }
    f
}

fn ipv6_filter(b: &[u8]) -> Ipv6Filter {
    let addr = |o: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&b[o..o + 16]).unwrap_or_default());
    Ipv6Filter {
        src_ip: addr(0),
        dst_ip: addr(16),
        flow_label: u32::from_be_bytes([b[32], b[33], b[34], b[35]]),
        next_hdr: b[36],
        traffic_class: b[37],
        hop_limit: b[38],
    }
}

fn port_filter(b: &[u8]) -> PortFilter {
    PortFilter {
        dst_port: be16(b, 0),
        src_port: be16(b, 2),
    }
}

/// Decodes `struct ibv_flow_attr` and the specs packed behind it (walked by each spec's
/// `size`, since applications pack them), with the `counters` of an
/// `IBV_FLOW_SPEC_ACTION_COUNT` spec (NULL without one).
fn flow_attr(bytes: &[u8]) -> Result<(FlowAttr, *mut c_void), c_int> {
    let comp_mask = ne32(bytes, 0);
    if comp_mask != 0 {
        return Err(EINVAL);
    }
    let flow_type = FlowType::from_raw(ne32(bytes, 4)).ok_or(EINVAL)?;
    let priority = u16::from_ne_bytes([bytes[10], bytes[11]]);
    let (num_specs, port, flags) = (bytes[12], bytes[13], ne32(bytes, 16));
    let mut attr = FlowAttr {
        flow_type,
        priority,
        port,
        flags,
        specs: Vec::new(),
        tag: None,
        drop: false,
    };
    let mut counters: *mut c_void = null_mut();
    let mut off = 20;
    for _ in 0..num_specs {
        let rest = &bytes[off.min(bytes.len())..];
        if rest.len() < 8 {
            return Err(EINVAL);
        }
        let (t, size) = (ne32(rest, 0), usize::from(u16::from_ne_bytes([rest[4], rest[5]])));
        if t & spec::INNER != 0 && t < spec::ACTION_TAG {
            return Err(EOPNOTSUPP); // no tunnels, so no inner headers
        }
        let need = spec::size(t).ok_or(EINVAL)?;
        if size < need || size > rest.len() {
            return Err(EINVAL);
        }
        let s = &rest[..size];
        match t {
            spec::ETH => attr.specs.push(FlowSpec::Eth {
                val: eth_filter(&s[6..22]),
                mask: eth_filter(&s[22..38]),
            }),
            spec::IPV4 => attr.specs.push(FlowSpec::Ipv4 {
                val: ipv4_filter(&s[8..16], false),
                mask: ipv4_filter(&s[16..24], false),
            }),
            spec::IPV4_EXT => attr.specs.push(FlowSpec::Ipv4 {
                val: ipv4_filter(&s[8..20], true),
                mask: ipv4_filter(&s[20..32], true),
            }),
            spec::IPV6 => attr.specs.push(FlowSpec::Ipv6 {
                val: ipv6_filter(&s[8..48]),
                mask: ipv6_filter(&s[48..88]),
            }),
            spec::TCP => attr.specs.push(FlowSpec::Tcp {
                val: port_filter(&s[6..10]),
                mask: port_filter(&s[10..14]),
            }),
            spec::UDP => attr.specs.push(FlowSpec::Udp {
                val: port_filter(&s[6..10]),
                mask: port_filter(&s[10..14]),
            }),
            spec::ACTION_TAG => attr.tag = Some(ne32(s, 8)),
            spec::ACTION_COUNT => {
                let p = usize::from_ne_bytes(s[8..16].try_into().expect("8 bytes")) as *mut c_void;
                // One counters object per rule.
                if p.is_null() || !counters.is_null() {
                    return Err(EINVAL);
                }
                counters = p;
            }
            _ => attr.drop = true,
        }
        off += size;
    }
    Ok((attr, counters))
}

/// The `ibv_create_flow` op.
pub(crate) unsafe extern "C" fn create_flow(qp: *mut ibv_qp, attr: *mut c_void) -> *mut ibv_flow {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(q) = (unsafe { outer::<SvQp, _>(qp) }) else {
        return fail_null(EINVAL);
    };
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_flow_attr` (20 bytes) whose `size` (at offset 8)
    // counts it and the specs behind it.
    let size = usize::from(unsafe { attr.cast::<u8>().add(8).cast::<u16>().read_unaligned() });
    if size < 20 {
        return fail_null(EINVAL);
    }
    // SAFETY: as above: `size` readable bytes.
    let bytes = unsafe { std::slice::from_raw_parts(attr.cast::<u8>(), size) };
    let (fa, counters) = match flow_attr(bytes) {
        Ok(a) => a,
        Err(e) => return fail_null(e),
    };
    // SAFETY: a counters spec carries NULL or a live counters object of this library.
    let counters = unsafe { crate::counters::counters_of(counters) };
    match Flow::create_counted(&q.core, &fa, counters.as_ref()) {
        Ok(core) => Box::into_raw(Box::new(SvFlow {
            flow: ibv_flow {
                comp_mask: 0,
                // SAFETY: `qp` is live.
                context: unsafe { (*qp).context },
                handle: NEXT_HANDLE.fetch_add(1, Ordering::Relaxed),
            },
            core,
        }))
        .cast(),
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// The `ibv_destroy_flow` op.
pub(crate) unsafe extern "C" fn destroy_flow(flow: *mut ibv_flow) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvFlow, _>(flow, |f| f.core.destroy()) }
}

/// `wq->post_recv` (`ibv_post_wq_recv`).
unsafe extern "C" fn wq_post_recv(
    wq: *mut ibv_wq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(w) = (unsafe { outer::<SvWq, _>(wq) }) else {
        return fail(EINVAL);
    };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { post_recv_list(wr, bad, w.queue.as_ref(), |reqs| w.core.post_recv(reqs)) }
}

/// The `create_wq` op: receive WQs (`IBV_WQT_RQ`) without creation flags. The actual
/// `max_wr`/`max_sge` are written back.
pub(crate) unsafe extern "C" fn create_wq(ctx: *mut ibv_context, attr: *mut ibv_wq_init_attr) -> *mut ibv_wq {
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a live `struct ibv_wq_init_attr`.
    let a = unsafe { &mut *attr };
    if a.wq_type != 0 {
        return fail_null(EINVAL);
    }
    if a.comp_mask & !1 != 0 {
        return fail_null(EINVAL);
    }
    if a.comp_mask & 1 != 0 && a.create_flags != 0 {
        return fail_null(EOPNOTSUPP);
    }
    // SAFETY: the caller passes NULL or live objects of this library (the verbs API contract).
    let (pd, cq) = unsafe { (outer::<SvPd, _>(a.pd), outer::<SvCq, _>(a.cq)) };
    let (Some(pd), Some(cq)) = (pd, cq) else {
        return fail_null(EINVAL);
    };
    // SAFETY: `a.pd` is a live PD of this library (checked above).
    let queue = match unsafe { crate::domain::recv_queue(a.pd, a.max_wr, a.max_sge, crate::domain::RES_WQ) } {
        Ok(q) => q,
        Err(e) => return fail_null(e),
    };
    let core = match Wq::create(&pd.core, &cq.core, a.max_wr, a.max_sge) {
        Ok(w) => w,
        Err(e) => return fail_null(errno_of(&e)),
    };
    (a.max_wr, a.max_sge) = core.caps();
    let wq = ibv_wq {
        context: ctx,
        wq_context: a.wq_context,
        pd: a.pd,
        cq: a.cq,
        wq_num: core.wq_num(),
        handle: NEXT_HANDLE.fetch_add(1, Ordering::Relaxed),
        state: WqState::Reset as c_uint,
        wq_type: 0,
        post_recv: wq_post_recv as *const c_void,
        mutex: pthread_mutex_t([0; 40]),
        cond: pthread_cond_t([0; 48]),
        events_completed: 0,
        comp_mask: 0,
    };
    Box::into_raw(Box::new(SvWq { wq, core, queue })).cast()
}

/// The `modify_wq` op: `IBV_WQ_ATTR_STATE` and `IBV_WQ_ATTR_CURR_STATE`; flags are
/// EOPNOTSUPP.
pub(crate) unsafe extern "C" fn modify_wq(wq: *mut ibv_wq, attr: *mut ibv_wq_attr) -> c_int {
    const STATE: u32 = 1;
    const CURR_STATE: u32 = 2;
    const FLAGS: u32 = 4;
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(w) = (unsafe { outer::<SvWq, _>(wq) }) else {
        return fail(EINVAL);
    };
    if attr.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_wq_attr`.
    let a = unsafe { &*attr };
    if a.attr_mask & !(STATE | CURR_STATE | FLAGS) != 0 {
        return fail(EINVAL);
    }
    if a.attr_mask & FLAGS != 0 && a.flags_mask != 0 {
        return fail(EOPNOTSUPP);
    }
    if a.attr_mask & STATE == 0 {
        return 0;
    }
    let Some(state) = WqState::from_raw(a.wq_state) else {
        return fail(EINVAL);
    };
    let cur = if a.attr_mask & CURR_STATE != 0 {
        match WqState::from_raw(a.curr_wq_state) {
            Some(s) => Some(s),
            None => return fail(EINVAL),
        }
    } else {
        None
    };
    match w.core.modify(state, cur) {
        Ok(()) => {
            // SAFETY: `wq` is live; keep the public state in step.
            unsafe { (*wq).state = state as c_uint };
            0
        }
        Err(e) => fail(errno_of(&e)),
    }
}

/// The `destroy_wq` op: EBUSY while an indirection table names the WQ.
pub(crate) unsafe extern "C" fn destroy_wq(wq: *mut ibv_wq) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvWq, _>(wq, |w| w.core.destroy()) }
}

/// The `create_rwq_ind_table` op.
pub(crate) unsafe extern "C" fn create_rwq_ind_table(
    ctx: *mut ibv_context,
    attr: *mut ibv_rwq_ind_table_init_attr,
) -> *mut ibv_rwq_ind_table {
    // SAFETY: the caller passes NULL or a live context of this library.
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_null(EINVAL);
    };
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_rwq_ind_table_init_attr`.
    let a = unsafe { &*attr };
    if a.comp_mask != 0 || a.log_ind_tbl_size > MAX_LOG_IND_TBL_SIZE || a.ind_tbl.is_null() {
        return fail_null(EINVAL);
    }
    let n = 1usize << a.log_ind_tbl_size;
    // SAFETY: `ind_tbl` holds `1 << log_ind_tbl_size` WQ pointers (ibv_create_rwq_ind_table(3)).
    let ptrs = unsafe { std::slice::from_raw_parts(a.ind_tbl, n) };
    let mut wqs = Vec::with_capacity(n);
    for &p in ptrs {
        // SAFETY: each entry is NULL or a live WQ of this library.
        match unsafe { outer::<SvWq, _>(p) } {
            Some(w) => wqs.push(w.core.clone()),
            None => return fail_null(EINVAL),
        }
    }
    match RwqIndTable::create(&c.core, a.log_ind_tbl_size, &wqs) {
        Ok(core) => {
            let h = core.handle() as c_int;
            Box::into_raw(Box::new(SvIndTable {
                table: ibv_rwq_ind_table {
                    context: ctx,
                    ind_tbl_handle: h,
                    ind_tbl_num: h,
                    comp_mask: 0,
                },
                core,
            }))
            .cast()
        }
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// The `destroy_rwq_ind_table` op: EBUSY while an RSS QP uses the table.
pub(crate) unsafe extern "C" fn destroy_rwq_ind_table(table: *mut ibv_rwq_ind_table) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvIndTable, _>(table, |t| t.core.destroy()) }
}

/// `create_qp_ex` with an indirection table: a receive-only RAW_PACKET QP with
/// `PD | IND_TABLE | RX_HASH` and a Toeplitz `rx_hash_conf`.
///
/// # Safety
/// `a` is the caller's live `struct ibv_qp_init_attr_ex`.
pub(crate) unsafe fn create_rss_qp(a: &mut ibv_qp_init_attr_ex) -> *mut ibv_qp {
    let needed = IBV_QP_INIT_ATTR_PD | QP_INIT_ATTR_IND_TABLE | QP_INIT_ATTR_RX_HASH;
    if a.comp_mask & !(needed | IBV_QP_INIT_ATTR_CREATE_FLAGS) != 0
        || (a.comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 && a.create_flags != 0)
    {
        return fail_null(EOPNOTSUPP);
    }
    if a.comp_mask & needed != needed || a.qp_type != QpType::RawPacket.raw() {
        return fail_null(EINVAL);
    }
    // An RSS QP only receives, through its WQs.
    let c = a.cap;
    if c.max_send_wr != 0 || c.max_recv_wr != 0 || c.max_inline_data != 0 || !a.srq.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: the caller passes NULL or live objects of this library (the verbs API contract).
    let (pd, table) = unsafe { (outer::<SvPd, _>(a.pd), outer::<SvIndTable, _>(a.rwq_ind_tbl)) };
    let (Some(pd), Some(table)) = (pd, table) else {
        return fail_null(EINVAL);
    };
    let h = &a.rx_hash_conf;
    let key = if h.rx_hash_key.is_null() {
        &[][..]
    } else {
        // SAFETY: `rx_hash_key` points at `rx_hash_key_len` readable bytes.
        unsafe { std::slice::from_raw_parts(h.rx_hash_key, usize::from(h.rx_hash_key_len)) }
    };
    let conf = match RxHashConf::new(h.rx_hash_function, key, h.rx_hash_fields_mask) {
        Ok(c) => c,
        Err(e) => return fail_null(errno_of(&e)),
    };
    let core = match Qp::create_rss(&pd.core, &table.core, conf) {
        Ok(q) => q,
        Err(e) => return fail_null(errno_of(&e)),
    };
    let n = NewQp {
        pd: a.pd,
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: null_mut(),
        cap: &mut a.cap,
        qp_type: a.qp_type,
        sq_sig_all: false,
        max_tso_header: 0,
    };
    // SAFETY: `n.pd` is live and `n.cap` points into the caller's attributes.
    let b = unsafe { box_qp(&n, core, None) };
    // SAFETY: `b` is live.
    unsafe { (*b).qp.comp_mask = u64::from(a.comp_mask) };
    b.cast()
}
