//! Thread domains and parent domains: `ibv_alloc_td`, `ibv_dealloc_td`,
//! `ibv_alloc_parent_domain` (freed with `ibv_dealloc_pd`), and the queue memory of CQs and QPs
//! created through a parent domain.
//!
//! A parent domain is an `SvPd` whose `core` is the inner PD and whose `parent` holds the core
//! parent domain and the application's allocator, so every verb that takes a PD accepts it.
//! Queue memory of objects created through it comes from the allocator
//! (`IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS`), or from the library when there is none or it
//! answers `IBV_ALLOCATOR_USE_DEFAULT`:
//! - a CQ's poll ring, the completions `ibv_poll_cq` and the `ibv_cq_ex` pollers stage before
//!   translating them into the caller's array (resource type [`RES_CQ`]);
//! - a QP's send and receive queue buffers ([`RES_QP_SQ`], [`RES_QP_RQ`]), sized as a HCA's
//!   WQE rings (one 64-byte-aligned stride per work request). As a driver writes WQEs into its
//!   ring for the HCA to fetch, each posted work request's data descriptor (its gather or
//!   scatter list, or its inline bytes) is written into the next slot of the ring, and what the
//!   device is handed is read back from that slot ([`QpQueues::stage_send`],
//!   [`QpQueues::stage_recv`]). The device keeps its own copy of outstanding work (it must, to
//!   retransmit), so the ring holds the most recent WQEs, as on an HCA;
//! - an SRQ's receive queue buffer ([`RES_SRQ`]) and a receive WQ's ([`RES_WQ`]), used the
//!   same way.
//!
//! `resource_type` is `(rdma_driver_id << 32) | code`; this library is not in the kernel's
//! driver list, so the upper half is `RDMA_DRIVER_UNKNOWN` (0). Under a thread domain the CQ's
//! poll ring is used without a lock: the application promised one thread at a time.

use std::ffi::{c_int, c_void};
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use softverbs_device::domain::{DomainUse, ParentDomain, Td};
use softverbs_device::qp::SendRequest;
use softverbs_engine::types::{QpCap, RecvWr, Sge, WorkCompletion};
use softverbs_engine::wr::Payload;
use softverbs_engine::Errno;

use crate::abi::*;
use crate::fail_null;
use crate::verbs::{context, destroy_boxed, errno_of, outer, SvCq, SvPd};

const EINVAL: c_int = Errno::EINVAL as c_int;
const ENOMEM: c_int = Errno::ENOMEM as c_int;

/// `IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS`.
const INIT_ATTR_ALLOCATORS: u32 = 1;
/// `IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT`.
const INIT_ATTR_PD_CONTEXT: u32 = 2;
/// `IBV_ALLOCATOR_USE_DEFAULT`: `(void *)-1`.
const ALLOCATOR_USE_DEFAULT: usize = usize::MAX;

/// Resource type of a QP's send queue buffer.
pub(crate) const RES_QP_SQ: u64 = 1;
/// Resource type of a QP's receive queue buffer.
pub(crate) const RES_QP_RQ: u64 = 2;
/// Resource type of a CQ's poll ring.
pub(crate) const RES_CQ: u64 = 3;
/// Resource type of an SRQ's receive queue buffer.
pub(crate) const RES_SRQ: u64 = 4;
/// Resource type of a receive work queue's buffer (`ibv_create_wq`).
pub(crate) const RES_WQ: u64 = 5;

/// Alignment of every queue buffer (a cache line, as WQE rings are).
const QUEUE_ALIGN: usize = 64;
/// Most completions a CQ's poll ring stages at once.
const CQ_RING_MAX: usize = 256;

/// `struct ibv_td`.
#[repr(C)]
pub(crate) struct ibv_td {
    pub(crate) context: *mut ibv_context,
}

/// `struct ibv_td_init_attr`.
#[repr(C)]
pub(crate) struct ibv_td_init_attr {
    pub(crate) comp_mask: u32,
}

/// The `alloc` callback of a parent domain.
pub(crate) type AllocFn = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, usize, u64) -> *mut c_void;
/// The `free` callback of a parent domain.
pub(crate) type FreeFn = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, *mut c_void, u64);

/// `struct ibv_parent_domain_init_attr`.
#[repr(C)]
pub(crate) struct ibv_parent_domain_init_attr {
    pub(crate) pd: *mut ibv_pd,
    pub(crate) td: *mut ibv_td,
    pub(crate) comp_mask: u32,
    pub(crate) alloc: Option<AllocFn>,
    pub(crate) free: Option<FreeFn>,
    pub(crate) pd_context: *mut c_void,
}

#[repr(C)]
struct SvTd {
    td: ibv_td,
    core: Arc<Td>,
}

/// What makes an `SvPd` a parent domain.
pub(crate) struct Parent {
    pub(crate) core: Arc<ParentDomain>,
    allocators: Option<(AllocFn, FreeFn)>,
    pd_context: *mut c_void,
}

/// `verbs_context.alloc_td`.
pub(crate) const ALLOC_TD: *const c_void = alloc_td as *const c_void;
/// `verbs_context.dealloc_td`.
pub(crate) const DEALLOC_TD: *const c_void = dealloc_td as *const c_void;
/// `verbs_context.alloc_parent_domain`.
pub(crate) const ALLOC_PARENT_DOMAIN: *const c_void = alloc_parent_domain as *const c_void;

/// `ibv_alloc_td`: EINVAL for a NULL attribute or a non-zero `comp_mask`.
unsafe extern "C" fn alloc_td(ctx: *mut ibv_context, attr: *mut ibv_td_init_attr) -> *mut ibv_td {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_null(EINVAL);
    };
    // SAFETY: `attr` is NULL or a readable `struct ibv_td_init_attr`.
    if attr.is_null() || unsafe { (*attr).comp_mask } != 0 {
        return fail_null(EINVAL);
    }
    match Td::alloc(&c.core) {
        Ok(core) => Box::into_raw(Box::new(SvTd {
            td: ibv_td { context: ctx },
            core,
        }))
        .cast(),
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// `ibv_dealloc_td`: EBUSY while a parent domain uses it.
unsafe extern "C" fn dealloc_td(td: *mut ibv_td) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    unsafe { destroy_boxed::<SvTd, _>(td, |t| t.core.dealloc()) }
}

/// `ibv_alloc_parent_domain`: EINVAL without a PD, with a PD that is itself a parent domain,
/// with unknown `comp_mask` bits, or with `ALLOCATORS` but a NULL `alloc` or `free`.
unsafe extern "C" fn alloc_parent_domain(
    ctx: *mut ibv_context,
    attr: *mut ibv_parent_domain_init_attr,
) -> *mut ibv_pd {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_null(EINVAL);
    };
    if attr.is_null() {
        return fail_null(EINVAL);
    }
    // SAFETY: `attr` is a readable `struct ibv_parent_domain_init_attr`.
    let a = unsafe { &*attr };
    if a.comp_mask & !(INIT_ATTR_ALLOCATORS | INIT_ATTR_PD_CONTEXT) != 0 {
        return fail_null(EINVAL);
    }
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(pd) = (unsafe { outer::<SvPd, _>(a.pd) }) else {
        return fail_null(EINVAL);
    };
    if pd.parent.is_some() {
        return fail_null(EINVAL);
    }
    // SAFETY: as above.
    let td = unsafe { outer::<SvTd, _>(a.td) };
    let allocators = if a.comp_mask & INIT_ATTR_ALLOCATORS != 0 {
        match (a.alloc, a.free) {
            (Some(al), Some(fr)) => Some((al, fr)),
            _ => return fail_null(EINVAL),
        }
    } else {
        None
    };
    let pd_context = if a.comp_mask & INIT_ATTR_PD_CONTEXT != 0 {
        a.pd_context
    } else {
        std::ptr::null_mut()
    };
    match ParentDomain::alloc(&c.core, &pd.core, td.map(|t| &t.core)) {
        Ok(core) => Box::into_raw(Box::new(SvPd {
            pd: ibv_pd {
                context: ctx,
                handle: pd.core.handle(),
            },
            core: pd.core.clone(),
            parent: Some(Parent {
                core,
                allocators,
                pd_context,
            }),
        }))
        .cast(),
        Err(e) => fail_null(errno_of(&e)),
    }
}

/// Who frees a queue buffer.
enum Owner {
    Library,
    App {
        free: FreeFn,
        pd: *mut ibv_pd,
        pd_context: *mut c_void,
    },
}

/// Zeroed memory for a queue, from the parent domain's allocator or the library's.
pub(crate) struct QueueBuf {
    ptr: *mut u8,
    resource_type: u64,
    owner: Owner,
}

impl QueueBuf {
    /// Allocates `size` bytes for `resource_type` through the parent domain `pd` (the pointer
    /// the application knows it by).
    ///
    /// # Safety
    /// `pd` must be the live parent domain `parent` belongs to.
    unsafe fn alloc(
        pd: *mut ibv_pd,
        parent: &Parent,
        size: usize,
        resource_type: u64,
    ) -> Result<Self, c_int> {
        if let Some((alloc, free)) = parent.allocators {
            // SAFETY: the application's callback, called with the arguments its contract names.
            let p = unsafe { alloc(pd, parent.pd_context, size, QUEUE_ALIGN, resource_type) };
            if p.is_null() {
                return Err(ENOMEM);
            }
            if p as usize != ALLOCATOR_USE_DEFAULT {
                if p as usize % QUEUE_ALIGN != 0 {
                    // SAFETY: `p` came from this allocator; hand it back.
                    unsafe { free(pd, parent.pd_context, p, resource_type) };
                    return Err(EINVAL);
                }
                return Ok(Self {
                    ptr: p.cast(),
                    resource_type,
                    owner: Owner::App {
                        free,
                        pd,
                        pd_context: parent.pd_context,
                    },
                });
            }
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: posix_memalign writes a pointer to `p`; the alignment is a power of two and a
        // multiple of the pointer size.
        if unsafe { libc::posix_memalign(&mut p, QUEUE_ALIGN, size.max(1)) } != 0 {
            return Err(ENOMEM);
        }
        // SAFETY: `p` holds `size` writable bytes; zero them as the allocator contract requires.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, size) };
        Ok(Self {
            ptr: p.cast(),
            resource_type,
            owner: Owner::Library,
        })
    }
}

impl Drop for QueueBuf {
    fn drop(&mut self) {
        match self.owner {
            // SAFETY: allocated by `posix_memalign` in `alloc`.
            Owner::Library => unsafe { libc::free(self.ptr.cast()) },
            // SAFETY: allocated by the application's `alloc`; the parent domain outlives every
            // object created through it (its deallocation is EBUSY until then), so `pd` is live.
            Owner::App { free, pd, pd_context } => unsafe {
                free(pd, pd_context, self.ptr.cast(), self.resource_type);
            },
        }
    }
}

/// A CQ's poll ring.
pub(crate) struct CqRing {
    buf: QueueBuf,
    entries: usize,
    /// `None` under a thread domain or for a single-threaded CQ.
    lock: Option<Mutex<()>>,
    _use: DomainUse,
}

/// A QP's queue buffers.
pub(crate) struct QpQueues {
    sq: WqeRing,
    rq: Option<WqeRing>,
    _use: DomainUse,
}

/// A ring of fixed-size WQE slots in a queue buffer.
struct WqeRing {
    buf: QueueBuf,
    stride: usize,
    slots: usize,
    /// The next slot; the lock also makes writing a slot and reading it back one step.
    next: Mutex<usize>,
}

/// Bytes before a slot's data descriptor: `wr_id`, the descriptor's kind and its count.
const WQE_HEADER: usize = 16;
/// Bytes per gather/scatter entry in a slot: address, length, key.
const WQE_SGE: usize = 16;
/// Descriptor kinds in a slot's header.
const KIND_SGES: u32 = 1;
const KIND_INLINE: u32 = 2;

impl WqeRing {
    fn new(buf: QueueBuf, stride: usize, slots: usize) -> Self {
        Self {
            buf,
            stride,
            slots,
            next: Mutex::new(0),
        }
    }

    /// Writes `bytes` into the next slot and returns what the slot then holds, or `None` (and
    /// leaves the ring alone) when they do not fit a slot.
    fn pass(&self, bytes: &[u8]) -> Option<Vec<u8>> {
        if bytes.len() > self.stride {
            return None;
        }
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let slot = *next % self.slots;
        *next = next.wrapping_add(1);
        // SAFETY: the buffer holds `slots * stride` bytes and `slot < slots`, `bytes.len() <=
        // stride`; the lock makes this thread the only one of the library using the slot.
        unsafe {
            let at = self.buf.ptr.add(slot * self.stride);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), at, bytes.len());
            let mut back = vec![0u8; bytes.len()];
            std::ptr::copy_nonoverlapping(at, back.as_mut_ptr(), bytes.len());
            Some(back)
        }
    }
}

/// A slot image: header, then the descriptor.
fn wqe(wr_id: u64, kind: u32, count: usize, body: impl IntoIterator<Item = u8>) -> Vec<u8> {
    let mut v = Vec::with_capacity(WQE_HEADER);
    v.extend_from_slice(&wr_id.to_le_bytes());
    v.extend_from_slice(&kind.to_le_bytes());
    v.extend_from_slice(&(count as u32).to_le_bytes());
    v.extend(body);
    v
}

fn sge_bytes(list: &[Sge]) -> impl Iterator<Item = u8> + '_ {
    list.iter().flat_map(|s| {
        let mut b = [0u8; WQE_SGE];
        b[..8].copy_from_slice(&s.addr.to_le_bytes());
        b[8..12].copy_from_slice(&s.length.to_le_bytes());
        b[12..].copy_from_slice(&s.lkey.to_le_bytes());
        b
    })
}

fn sges_from(body: &[u8]) -> Vec<Sge> {
    body.chunks_exact(WQE_SGE)
        .map(|c| Sge {
            addr: u64::from_le_bytes(c[..8].try_into().expect("8 bytes")),
            length: u32::from_le_bytes(c[8..12].try_into().expect("4 bytes")),
            lkey: u32::from_le_bytes(c[12..].try_into().expect("4 bytes")),
        })
        .collect()
}

impl QpQueues {
    /// Passes each send request's gather list or inline bytes through the send queue ring.
    /// Requests whose descriptor does not fit a slot (more than the requested capabilities;
    /// the device rejects them) and TSO requests go to the device unstaged.
    pub(crate) fn stage_send(&self, reqs: &mut [SendRequest]) {
        for r in reqs {
            let image = match &r.payload {
                Payload::Sges(list) => wqe(r.wr_id, KIND_SGES, list.len(), sge_bytes(list)),
                Payload::Inline(bytes) => wqe(r.wr_id, KIND_INLINE, bytes.len(), bytes.iter().copied()),
                Payload::Headed { .. } => continue,
            };
            let Some(back) = self.sq.pass(&image) else {
                continue;
            };
            let body = &back[WQE_HEADER..];
            r.payload = match &r.payload {
                Payload::Inline(_) => Payload::Inline(body.to_vec()),
                _ => Payload::Sges(sges_from(body)),
            };
        }
    }
}

/// What passes receive requests through a parent domain's queue buffer before they are posted.
pub(crate) trait StageRecv {
    /// Passes each request's scatter list through the buffer.
    fn stage_recv(&self, reqs: &mut [RecvWr]);
}

impl StageRecv for QpQueues {
    /// Through the receive queue ring (a QP on an SRQ has none; its requests are refused by
    /// the device anyway).
    fn stage_recv(&self, reqs: &mut [RecvWr]) {
        if let Some(rq) = &self.rq {
            rq.stage_recv(reqs);
        }
    }
}

impl WqeRing {
    /// Passes each receive request's scatter list through the ring; one with more entries than
    /// a slot holds goes to the device unstaged (which refuses it).
    fn stage_recv(&self, reqs: &mut [RecvWr]) {
        for r in reqs {
            let image = wqe(r.wr_id, KIND_SGES, r.sg_list.len(), sge_bytes(&r.sg_list));
            if let Some(back) = self.pass(&image) {
                r.sg_list = sges_from(&back[WQE_HEADER..]);
            }
        }
    }
}

/// The receive queue buffer of an SRQ or WQ created through a parent domain.
pub(crate) struct RecvQueue {
    rq: WqeRing,
    _use: DomainUse,
}

impl StageRecv for RecvQueue {
    /// Through the queue's ring.
    fn stage_recv(&self, reqs: &mut [RecvWr]) {
        self.rq.stage_recv(reqs);
    }
}

/// The receive queue buffer (of `resource_type`, [`RES_SRQ`] or [`RES_WQ`]) of `max_wr` requests
/// of `max_sge` entries for a queue created through `pd`, if `pd` is a parent domain (`None` for
/// a plain PD).
///
/// # Safety
/// `pd` must be NULL or a live PD of this library.
pub(crate) unsafe fn recv_queue(
    pd: *mut ibv_pd,
    max_wr: u32,
    max_sge: u32,
    resource_type: u64,
) -> Result<Option<RecvQueue>, c_int> {
    // SAFETY: per the contract.
    let Ok(parent) = (unsafe { parent_of(pd) }) else {
        return Ok(None);
    };
    let hold = parent.core.hold().map_err(|e| errno_of(&e))?;
    let stride = (WQE_HEADER + WQE_SGE * max_sge.max(1) as usize).div_ceil(QUEUE_ALIGN) * QUEUE_ALIGN;
    let slots = max_wr.max(1) as usize;
    // SAFETY: `pd` is the live parent domain `parent` belongs to.
    let buf = unsafe { QueueBuf::alloc(pd, parent, stride * slots, resource_type) }?;
    Ok(Some(RecvQueue {
        rq: WqeRing::new(buf, stride, slots),
        _use: hold,
    }))
}

/// The parent domain behind `pd`: EINVAL unless it is one.
///
/// # Safety
/// `pd` must be NULL or a live PD of this library.
pub(crate) unsafe fn parent_of<'a>(pd: *mut ibv_pd) -> Result<&'a Parent, c_int> {
    // SAFETY: per the contract.
    unsafe { outer::<SvPd, _>(pd) }
        .and_then(|p| p.parent.as_ref())
        .ok_or(EINVAL)
}

/// The poll ring of a CQ created in `ctx` through the parent domain `pd`. EINVAL if the parent
/// domain is of a context that does not share `ctx`'s objects.
///
/// # Safety
/// `pd` must be the live parent domain `parent` belongs to; `ctx` NULL or a live context.
pub(crate) unsafe fn cq_ring(
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    parent: &Parent,
    cqe: u32,
    single_threaded: bool,
) -> Result<CqRing, c_int> {
    // SAFETY: per the contract.
    let c = unsafe { context(ctx) }.ok_or(EINVAL)?;
    if !c.core.shares_objects_with(parent.core.pd().context()) {
        return Err(EINVAL);
    }
    let hold = parent.core.hold().map_err(|e| errno_of(&e))?;
    let entries = (cqe as usize).clamp(1, CQ_RING_MAX);
    // SAFETY: per the contract.
    let buf = unsafe { QueueBuf::alloc(pd, parent, entries * size_of::<WorkCompletion>(), RES_CQ) }?;
    let slots = buf.ptr.cast::<WorkCompletion>();
    for i in 0..entries {
        // SAFETY: the buffer holds `entries` slots and is 64-byte aligned, more than a
        // `WorkCompletion` needs; give every slot a valid value before slices are formed.
        unsafe { slots.add(i).write(WorkCompletion::default()) };
    }
    Ok(CqRing {
        buf,
        entries,
        lock: (!(single_threaded || parent.core.single_threaded())).then(Mutex::default),
        _use: hold,
    })
}

/// The queue buffers of a QP created through the parent domain `pd`: one 64-byte-aligned
/// stride per work request, sized for its gather list and inline data (receive queue: scatter
/// list); no receive buffer when the QP has no receive queue of its own.
///
/// # Safety
/// `pd` must be the live parent domain `parent` belongs to.
pub(crate) unsafe fn qp_queues(pd: *mut ibv_pd, parent: &Parent, cap: &QpCap) -> Result<QpQueues, c_int> {
    let hold = parent.core.hold().map_err(|e| errno_of(&e))?;
    let round = |n: usize| n.div_ceil(QUEUE_ALIGN) * QUEUE_ALIGN;
    let send_stride = round(
        (WQE_HEADER + WQE_SGE * cap.max_send_sge.max(1) as usize)
            .max(WQE_HEADER + cap.max_inline_data as usize)
            .max(64),
    );
    let recv_stride = round(WQE_HEADER + WQE_SGE * cap.max_recv_sge.max(1) as usize);
    let send_slots = cap.max_send_wr.max(1) as usize;
    let recv_slots = cap.max_recv_wr as usize;
    // SAFETY: per the contract.
    let sq = unsafe { QueueBuf::alloc(pd, parent, send_stride * send_slots, RES_QP_SQ) }?;
    let rq = if recv_slots > 0 {
        // SAFETY: per the contract.
        let buf = unsafe { QueueBuf::alloc(pd, parent, recv_stride * recv_slots, RES_QP_RQ) }?;
        Some(WqeRing::new(buf, recv_stride, recv_slots))
    } else {
        None
    };
    Ok(QpQueues {
        sq: WqeRing::new(sq, send_stride, send_slots),
        rq,
        _use: hold,
    })
}

/// Polls up to `n` completions of `c` through its poll ring, handing each to `emit` with its
/// index.
pub(crate) fn poll_through_ring(
    c: &SvCq,
    ring: &CqRing,
    n: usize,
    mut emit: impl FnMut(usize, &WorkCompletion),
) -> usize {
    let _guard = ring
        .lock
        .as_ref()
        .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()));
    // SAFETY: the ring holds `entries` initialised slots. Access is exclusive: under the lock,
    // or, without one, because the CQ belongs to a thread domain (or was created
    // single-threaded), whose contract is that one thread at a time uses it.
    let slots =
        unsafe { std::slice::from_raw_parts_mut(ring.buf.ptr.cast::<WorkCompletion>(), ring.entries) };
    let mut total = 0;
    while total < n {
        let want = (n - total).min(slots.len());
        let got = c.core.poll(&mut slots[..want]);
        for (i, w) in slots[..got].iter().enumerate() {
            emit(total + i, w);
        }
        total += got;
        if got < want {
            break;
        }
    }
    total
}
