//! The extended CQ (`ibv_cq_ex`): `start_poll`, `next_poll`, `end_poll` and the `read_*`
//! accessors over the core's completions.

use super::*;

/// The box of an `ibv_cq_ex`.
unsafe fn cq_ex<'a>(cq: *mut ibv_cq_ex) -> &'a SvCq {
    // SAFETY: every `ibv_cq_ex` this library hands out is the first field of a live `SvCq`,
    // and the extended pollers are only installed there.
    unsafe { outer::<SvCq, _>(cq) }.expect("the CQ pollers are called with their own CQ")
}

/// Takes the next completion into `cur` and the public `status`/`wr_id`; ENOENT if none.
unsafe fn poll_one(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    let c = unsafe { cq_ex(cq) };
    let mut one = [WorkCompletion::default()];
    let got = match &c.ring {
        // A parent domain's CQ stages its completions in the allocated ring here too.
        Some(ring) => crate::domain::poll_through_ring(c, ring, 1, |_, w| one[0] = *w),
        None => c.core.poll(&mut one),
    };
    if got == 0 {
        return ENOENT;
    }
    c.cur.set(one[0]);
    // SAFETY: `cq` is live; these two fields are read directly by the inline wrappers.
    unsafe {
        (*cq).status = one[0].status.raw();
        (*cq).wr_id = one[0].wr_id;
    }
    0
}

unsafe extern "C" fn start_poll(cq: *mut ibv_cq_ex, _attr: *mut ibv_poll_cq_attr) -> c_int {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { poll_one(cq) }
}

unsafe extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { poll_one(cq) }
}

unsafe extern "C" fn end_poll(_cq: *mut ibv_cq_ex) {}

/// The completion the extended CQ's readers report.
pub(crate) unsafe fn current(cq: *mut ibv_cq_ex) -> WorkCompletion {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }
}

unsafe fn cur(cq: *mut ibv_cq_ex) -> WorkCompletion {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cq_ex(cq) }.cur.get()
}

/// The completion `start_poll`/`next_poll` fetched, for readers defined elsewhere.
///
/// # Safety
/// `cq` must be a live extended CQ of this library.
pub(crate) unsafe fn current_wc(cq: *mut ibv_cq_ex) -> WorkCompletion {
    // SAFETY: as the caller guarantees.
    unsafe { cur(cq) }
}

unsafe extern "C" fn read_opcode(cq: *mut ibv_cq_ex) -> c_uint {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.opcode.raw()
}
unsafe extern "C" fn read_vendor_err(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.vendor_err
}
unsafe extern "C" fn read_byte_len(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.byte_len
}
unsafe extern "C" fn read_imm_data(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.imm_data
}
unsafe extern "C" fn read_qp_num(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.qp_num
}
unsafe extern "C" fn read_src_qp(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.src_qp
}
unsafe extern "C" fn read_wc_flags(cq: *mut ibv_cq_ex) -> c_uint {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.wc_flags.bits()
}
unsafe extern "C" fn read_slid(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    u32::from(unsafe { cur(cq) }.slid)
}
unsafe extern "C" fn read_sl(cq: *mut ibv_cq_ex) -> u8 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.sl
}
unsafe extern "C" fn read_dlid_path_bits(cq: *mut ibv_cq_ex) -> u8 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.dlid_path_bits
}
unsafe extern "C" fn read_flow_tag(cq: *mut ibv_cq_ex) -> u32 {
    // SAFETY: the pointer is a live object of this library, as the verbs API requires.
    unsafe { cur(cq) }.flow_tag
}

/// Fills the extended pollers of a new CQ.
pub(crate) fn install_cq_ex_ops(b: *mut SvCq) {
    // SAFETY: `b` is the live box `new_cq` just made, not yet shared.
    let cq = unsafe { &mut (*b).cq };
    cq.start_poll = Some(start_poll);
    cq.next_poll = Some(next_poll);
    cq.end_poll = Some(end_poll);
    cq.read_opcode = Some(read_opcode);
    cq.read_vendor_err = Some(read_vendor_err);
    cq.read_byte_len = Some(read_byte_len);
    cq.read_imm_data = Some(read_imm_data);
    cq.read_qp_num = Some(read_qp_num);
    cq.read_src_qp = Some(read_src_qp);
    cq.read_wc_flags = Some(read_wc_flags);
    cq.read_slid = Some(read_slid);
    cq.read_sl = Some(read_sl);
    cq.read_dlid_path_bits = Some(read_dlid_path_bits);
    cq.read_flow_tag = Some(read_flow_tag);
    cq.read_completion_ts = Some(crate::clock::read_completion_ts);
    cq.read_completion_wallclock_ns = Some(crate::clock::read_completion_wallclock_ns);
}

/// The `create_cq_ex` op: the standard completion fields and the completion timestamps (raw
/// and wall clock) and flow tags; tag matching and parent domains are EOPNOTSUPP.
pub(crate) unsafe extern "C" fn create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_cq_init_attr_ex`.
    let a = unsafe { &*attr };
    if a.comp_mask & !(CQ_INIT_ATTR_MASK_FLAGS | CQ_INIT_ATTR_MASK_PD) != 0
        || a.wc_flags
            & !(WC_STANDARD_FLAGS | WC_TIMESTAMP_FLAGS | WC_EX_WITH_FLOW_TAG | IBV_WC_EX_WITH_TM_INFO)
            != 0
    {
        return fail_null(EOPNOTSUPP);
    }
    let cqe = c_int::try_from(a.cqe).unwrap_or(c_int::MAX);
    let vector = c_int::try_from(a.comp_vector).unwrap_or(c_int::MAX);
    let ring = if a.comp_mask & CQ_INIT_ATTR_MASK_PD != 0 {
        let single =
            a.comp_mask & CQ_INIT_ATTR_MASK_FLAGS != 0 && a.flags & CREATE_CQ_ATTR_SINGLE_THREADED != 0;
        // SAFETY: the caller passes NULL or a live PD of this library (the verbs API contract).
        let made = unsafe { crate::domain::parent_of(a.parent_domain) }
            // SAFETY: `parent_domain` is the live parent domain just found.
            .and_then(|p| unsafe { crate::domain::cq_ring(ctx, a.parent_domain, p, a.cqe, single) });
        match made {
            Ok(r) => Some(r),
            Err(e) => return fail_null(e),
        }
    } else {
        None
    };
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    match unsafe { verbs::new_cq(ctx, cqe, a.cq_context, a.channel, vector) } {
        Ok(b) => {
            // SAFETY: `b` is live; record which fields the caller asked for, and its poll ring.
            unsafe {
                (*b).cq.comp_mask = a.comp_mask;
                (*b).ring = ring;
            }
            // SAFETY: `b` is live and not yet shared.
            unsafe { &(*b).core }.set_timestamps(softverbs_device::Timestamps {
                raw: a.wc_flags & (1 << 7) != 0,
                wallclock: a.wc_flags & (1 << 11) != 0,
            });
            if a.wc_flags & IBV_WC_EX_WITH_TM_INFO != 0 {
                // SAFETY: as above, and not yet shared.
                unsafe { (*b).cq.read_tm_info = Some(crate::tm::read_tm_info) };
            }
            b.cast()
        }
        Err(e) => fail_null(e),
    }
}
