//! Protection domains, memory regions and address handles.

use std::sync::Arc;

use softverbs_engine::qp_state::check_ah_attr;
use softverbs_engine::types::{AccessFlags, AhAttr, QpAttrMask, Sge, ACCESS_OPTIONAL_RANGE};
use softverbs_engine::{Error, Result};

use crate::context::Context;
use crate::device::Resource;
use crate::dm::{Dm, DmRange};
use crate::mem::MemoryBacking;
use crate::sync::UseCount;
use crate::ufile::UObject;

/// A protection domain (`ibv_alloc_pd`).
#[derive(Debug)]
pub struct Pd {
    ctx: Arc<Context>,
    handle: u32,
    uses: UseCount,
}

impl Pd {
    /// `ibv_alloc_pd`.
    pub fn alloc(ctx: &Arc<Context>) -> Result<Arc<Self>> {
        ctx.device().acquire(Resource::Pd)?;
        let pd = Arc::new(Self {
            ctx: ctx.clone(),
            handle: ctx.next_handle(),
            uses: UseCount::default(),
        });
        ctx.ufile().publish(pd.handle, UObject::Pd(Arc::downgrade(&pd)));
        Ok(pd)
    }

    /// `ibv_import_mr`: the MR `handle` names among the shared objects of this PD's context; it
    /// must have been registered on this PD. EINVAL otherwise (or if it was deregistered).
    pub fn import_mr(self: &Arc<Self>, handle: u32) -> Result<Arc<Mr>> {
        match self.ctx.ufile().lookup(handle) {
            Some(UObject::Mr(w)) => w
                .upgrade()
                .filter(|m| !m.uses.is_retired() && Arc::ptr_eq(&m.pd, self)),
            _ => None,
        }
        .ok_or_else(|| Error::invalid(format!("handle {handle} names no memory region of this PD")))
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The handle (`ibv_pd.handle`).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    pub(crate) fn uses(&self) -> &UseCount {
        &self.uses
    }

    /// `ibv_advise_mr`: prefetches the ranges of `sges`, which must lie in on-demand-paging
    /// regions of this PD. `advice` is `IBV_ADVISE_MR_ADVICE_PREFETCH` (0), `_PREFETCH_WRITE` (1)
    /// or `_PREFETCH_NO_FAULT` (2); `flags` may hold `IBV_ADVISE_MR_FLAG_FLUSH` (1). Errors as
    /// ibv_advise_mr(3): EOPNOTSUPP for an unknown advice; EINVAL for bad flags, an empty list or
    /// a region without ODP; ENOENT for an unknown lkey; EPERM for another PD's region or a
    /// write prefetch of a region without local write; EFAULT for a range outside its region or
    /// not mapped. Prefetching is synchronous here, so the flush flag changes nothing.
    pub fn advise_mr(&self, advice: u32, flags: u32, sges: &[Sge]) -> Result<()> {
        const FLAG_FLUSH: u32 = 1;
        const PREFETCH_WRITE: u32 = 1;
        const PREFETCH_NO_FAULT: u32 = 2;
        if advice > PREFETCH_NO_FAULT {
            return Err(Error::not_supported(format!("advice {advice} is not supported")));
        }
        if flags & !FLAG_FLUSH != 0 {
            return Err(Error::invalid(format!("flags {flags:#x} has unknown bits")));
        }
        if sges.is_empty() {
            return Err(Error::invalid("the scatter/gather list is empty"));
        }
        let keys = &self.ctx.device().node().keys;
        let mut ranges = Vec::with_capacity(sges.len());
        for sge in sges {
            let mr = keys
                .by_lkey(sge.lkey)
                .ok_or_else(|| os_error(libc_errno::ENOENT))?;
            if mr.pd().handle() != self.handle {
                return Err(os_error(libc_errno::EPERM));
            }
            if !mr.access().contains(AccessFlags::ON_DEMAND) {
                return Err(Error::invalid(
                    "the lkey does not name an on-demand-paging region",
                ));
            }
            if advice == PREFETCH_WRITE && !mr.access().contains(AccessFlags::LOCAL_WRITE) {
                return Err(os_error(libc_errno::EPERM));
            }
            let offset = sge
                .addr
                .checked_sub(mr.addr())
                .filter(|o| {
                    o.checked_add(u64::from(sge.length))
                        .is_some_and(|end| end <= mr.length())
                })
                .ok_or_else(|| os_error(libc_errno::EFAULT))?;
            ranges.push((mr, offset, u64::from(sge.length)));
        }
        // NO_FAULT only maps what is already present: nothing for a device without page tables.
        if advice != PREFETCH_NO_FAULT {
            for (mr, offset, len) in ranges {
                mr.backing()
                    .prefetch(offset, len, advice == PREFETCH_WRITE)
                    .map_err(|_| os_error(libc_errno::EFAULT))?;
            }
        }
        Ok(())
    }

    /// `ibv_dealloc_pd`: fails with EBUSY, changing nothing, while an MR, QP, SRQ or AH uses it.
    pub fn dealloc(&self) -> Result<()> {
        self.uses.retire("protection domain")?;
        self.ctx.ufile().withdraw(self.handle);
        self.ctx.device().release(Resource::Pd);
        Ok(())
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.ctx.device().release(Resource::Pd);
        }
    }
}

/// A registered memory region (`ibv_reg_mr`).
#[derive(Debug)]
pub struct Mr {
    pd: Arc<Pd>,
    backing: Arc<dyn MemoryBacking>,
    /// The device memory a region of `ibv_reg_dm_mr` lies in, and its offset there.
    dm: Option<(Arc<Dm>, u64)>,
    addr: u64,
    length: u64,
    iova: u64,
    access: AccessFlags,
    lkey: u32,
    rkey: u32,
    handle: u32,
    uses: UseCount,
}

impl Mr {
    /// `ibv_reg_mr`: registers the memory of `backing`, whose first byte local work requests
    /// address as `addr` and remote peers as `addr` too.
    ///
    /// `access` is the raw `ibv_access_flags` value. Remote write or atomic access without local
    /// write is EINVAL (`ibv_reg_mr(3)`); unknown flags are EINVAL, bits in the optional range are
    /// ignored; on-demand paging is accepted (`IBV_ACCESS_HUGETLB` only with it).
    pub fn register(
        pd: &Arc<Pd>,
        backing: Arc<dyn MemoryBacking>,
        addr: u64,
        access: u32,
    ) -> Result<Arc<Self>> {
        Self::register_iova(pd, backing, addr, addr, access)
    }

    /// `ibv_reg_mr_iova`: as [`Mr::register`], but remote peers address the region from `iova`.
    pub fn register_iova(
        pd: &Arc<Pd>,
        backing: Arc<dyn MemoryBacking>,
        addr: u64,
        iova: u64,
        access: u32,
    ) -> Result<Arc<Self>> {
        Self::register_inner(pd, backing, None, addr, iova, check_mr_access(access)?)
    }

    /// `ibv_reg_dm_mr`: registers `length` bytes of `dm` from `offset`. The region is zero
    /// based (local and remote addresses are byte offsets into it), so `access` must contain
    /// `IBV_ACCESS_ZERO_BASED`; EINVAL otherwise, or if the range is outside the DM or the DM
    /// was freed.
    pub fn register_dm(
        pd: &Arc<Pd>,
        dm: &Arc<Dm>,
        offset: u64,
        length: u64,
        access: u32,
    ) -> Result<Arc<Self>> {
        let access = check_mr_access(access)?;
        if !access.contains(AccessFlags::ZERO_BASED) {
            return Err(Error::invalid(
                "device memory registrations are zero based: IBV_ACCESS_ZERO_BASED is required",
            ));
        }
        if !pd.context().device().eq(dm.context().device()) {
            return Err(Error::invalid("the device memory belongs to another device"));
        }
        if offset.checked_add(length).is_none_or(|end| end > dm.length()) {
            return Err(Error::invalid(format!(
                "{length} bytes at offset {offset} are outside the {}-byte device memory",
                dm.length()
            )));
        }
        dm.uses().acquire("device memory")?;
        let backing = Arc::new(DmRange::new(dm.clone(), offset, length));
        let r = Self::register_inner(pd, backing, Some((dm.clone(), offset)), 0, 0, access);
        if r.is_err() {
            dm.uses().release();
        }
        r
    }

    fn register_inner(
        pd: &Arc<Pd>,
        backing: Arc<dyn MemoryBacking>,
        dm: Option<(Arc<Dm>, u64)>,
        addr: u64,
        iova: u64,
        access: AccessFlags,
    ) -> Result<Arc<Self>> {
        let length = backing.len();
        let device = pd.context().device();
        if length == 0 {
            return Err(Error::invalid("length is 0"));
        }
        if length > device.limits().max_mr_size {
            return Err(Error::invalid(format!(
                "length {length} exceeds max_mr_size {}",
                device.limits().max_mr_size
            )));
        }
        if addr.checked_add(length).is_none() || iova.checked_add(length).is_none() {
            return Err(Error::invalid("the region wraps around the address space"));
        }
        Self::insert(pd, backing, dm, addr, iova, access)
    }

    /// Implicit on-demand paging (`ibv_reg_mr(pd, NULL, SIZE_MAX, ...|IBV_ACCESS_ON_DEMAND)`):
    /// one region over the whole address space, addressed by absolute virtual address.
    /// `backing` must span all of it (`len() == u64::MAX`) and fail accesses to memory that is
    /// not mapped; `access` must include `IBV_ACCESS_ON_DEMAND` (EINVAL otherwise).
    pub fn register_implicit_odp(
        pd: &Arc<Pd>,
        backing: Arc<dyn MemoryBacking>,
        access: u32,
    ) -> Result<Arc<Self>> {
        let flags = check_mr_access(access)?;
        if !flags.contains(AccessFlags::ON_DEMAND) || backing.len() != u64::MAX {
            return Err(Error::invalid(
                "an implicit ODP region needs IBV_ACCESS_ON_DEMAND and covers the whole address space",
            ));
        }
        if flags.contains(AccessFlags::HUGETLB) {
            return Err(Error::invalid(
                "IBV_ACCESS_HUGETLB is only valid with explicit ODP",
            ));
        }
        Self::insert(pd, backing, None, 0, 0, flags)
    }

    fn insert(
        pd: &Arc<Pd>,
        backing: Arc<dyn MemoryBacking>,
        dm: Option<(Arc<Dm>, u64)>,
        addr: u64,
        iova: u64,
        access: AccessFlags,
    ) -> Result<Arc<Self>> {
        let device = pd.context().device();
        let length = backing.len();
        pd.uses.acquire("protection domain")?;
        if let Err(e) = device.acquire(Resource::Mr) {
            pd.uses.release();
            return Err(e);
        }
        let lkey = device.alloc_key();
        let rkey = device.alloc_key();
        let mr = Arc::new(Self {
            pd: pd.clone(),
            backing,
            dm,
            addr,
            length,
            iova,
            access,
            lkey,
            rkey,
            handle: pd.context().next_handle(),
            uses: UseCount::default(),
        });
        device.node().keys.insert(&mr);
        pd.context()
            .ufile()
            .publish(mr.handle, UObject::Mr(Arc::downgrade(&mr)));
        Ok(mr)
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// The memory.
    pub fn backing(&self) -> &Arc<dyn MemoryBacking> {
        &self.backing
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn length(&self) -> u64 {
        self.length
    }

    /// Address remote peers use for the first byte.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// Access rights.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Handle (`ibv_mr.handle`).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// The device memory the region lies in (`ibv_reg_dm_mr`), if any.
    pub fn dm(&self) -> Option<&Arc<Dm>> {
        self.dm.as_ref().map(|(d, _)| d)
    }

    /// Where the region's first byte is for alignment purposes (atomics need 8-byte aligned
    /// memory): its address, or for device memory its offset in the DM.
    pub fn align_base(&self) -> u64 {
        self.dm.as_ref().map_or(self.addr, |(_, off)| *off)
    }

    fn teardown(&self) {
        let device = self.pd.context().device();
        device.node().keys.remove(self.lkey, self.rkey);
        device.free_key(self.lkey);
        device.free_key(self.rkey);
        device.release(Resource::Mr);
        self.pd.uses.release();
        if let Some((dm, _)) = &self.dm {
            dm.uses().release();
        }
    }

    /// `ibv_dereg_mr`. (Memory windows, which would make it fail with EBUSY, are not offered.)
    pub fn dereg(&self) -> Result<()> {
        self.uses.retire("memory region")?;
        self.pd.context().ufile().withdraw(self.handle);
        self.teardown();
        Ok(())
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.teardown();
        }
    }
}

/// The errnos `ibv_advise_mr` returns beyond the common ones.
mod libc_errno {
    pub(super) const EPERM: i32 = 1;
    pub(super) const ENOENT: i32 = 2;
    pub(super) const EFAULT: i32 = 14;
}

/// An error carrying a specific errno.
fn os_error(errno: i32) -> Error {
    Error::Io(std::io::Error::from_raw_os_error(errno))
}

/// Validates raw `ibv_access_flags` for a memory region.
pub fn check_mr_access(raw: u32) -> Result<AccessFlags> {
    let unknown = raw & !AccessFlags::all().bits() & !ACCESS_OPTIONAL_RANGE;
    if unknown != 0 {
        return Err(Error::invalid(format!("access has unknown flags {unknown:#x}")));
    }
    // Optional-range bits are hints a device may ignore.
    let access = AccessFlags::from_bits_truncate(raw & !ACCESS_OPTIONAL_RANGE);
    if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
        && !access.contains(AccessFlags::LOCAL_WRITE)
    {
        return Err(Error::invalid(
            "IBV_ACCESS_REMOTE_WRITE or IBV_ACCESS_REMOTE_ATOMIC requires IBV_ACCESS_LOCAL_WRITE",
        ));
    }
    // On-demand paging is accepted: the device never pins, it reaches memory through the
    // current mapping on each access. The huge-page hint only means something for ODP.
    if access.contains(AccessFlags::HUGETLB) && !access.contains(AccessFlags::ON_DEMAND) {
        return Err(Error::invalid(
            "IBV_ACCESS_HUGETLB is only valid with IBV_ACCESS_ON_DEMAND",
        ));
    }
    Ok(access)
}

/// An address handle (`ibv_create_ah`).
#[derive(Debug)]
pub struct Ah {
    pd: Arc<Pd>,
    attr: AhAttr,
    handle: u32,
    uses: UseCount,
}

impl Ah {
    /// `ibv_create_ah`. RoCE addresses by GID, so `attr` must carry a GRH with a usable source
    /// GID index.
    pub fn create(pd: &Arc<Pd>, attr: &AhAttr) -> Result<Arc<Self>> {
        let ctx = pd.context();
        check_ah_attr(attr, &ctx.port_limits(), QpAttrMask::AV).map_err(|e| Error::invalid(e.to_string()))?;
        pd.uses.acquire("protection domain")?;
        if let Err(e) = ctx.device().acquire(Resource::Ah) {
            pd.uses.release();
            return Err(e);
        }
        Ok(Arc::new(Self {
            pd: pd.clone(),
            attr: attr.masked(),
            handle: ctx.next_handle(),
            uses: UseCount::default(),
        }))
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// The address vector.
    pub fn attr(&self) -> &AhAttr {
        &self.attr
    }

    /// Handle (`ibv_ah.handle`).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    fn teardown(&self) {
        self.pd.context().device().release(Resource::Ah);
        self.pd.uses.release();
    }

    /// `ibv_destroy_ah`.
    pub fn destroy(&self) -> Result<()> {
        self.uses.retire("address handle")?;
        self.teardown();
        Ok(())
    }
}

impl Drop for Ah {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.teardown();
        }
    }
}
