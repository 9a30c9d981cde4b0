//! Protection domains, memory regions and address handles.

use std::sync::Arc;

use parking_lot::RwLock;
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
                .filter(|m| !m.uses.is_retired() && Arc::ptr_eq(&m.pd(), self)),
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

/// `IBV_REREG_MR_CHANGE_TRANSLATION`.
pub const REREG_CHANGE_TRANSLATION: u32 = 1;
/// `IBV_REREG_MR_CHANGE_PD`.
pub const REREG_CHANGE_PD: u32 = 1 << 1;
/// `IBV_REREG_MR_CHANGE_ACCESS`.
pub const REREG_CHANGE_ACCESS: u32 = 1 << 2;

/// What a region maps: everything `ibv_rereg_mr` may change.
#[derive(Debug, Clone)]
pub(crate) struct Mapping {
    pub(crate) pd: Arc<Pd>,
    pub(crate) backing: Arc<dyn MemoryBacking>,
    pub(crate) addr: u64,
    pub(crate) length: u64,
    pub(crate) iova: u64,
    pub(crate) access: AccessFlags,
}

/// A new translation for [`Mr::rereg`]: the memory, the address local work requests use for its
/// first byte, and the address remote peers use.
#[derive(Debug, Clone)]
pub struct Translation {
    /// The memory.
    pub backing: Arc<dyn MemoryBacking>,
    /// Virtual address of the first byte.
    pub addr: u64,
    /// I/O virtual address of the first byte.
    pub iova: u64,
}

/// Why `ibv_rereg_mr` failed, in the two classes its return value tells apart.
#[derive(Debug, thiserror::Error)]
pub enum ReregError {
    /// The arguments were refused before anything was tried (`IBV_REREG_MR_ERR_INPUT`); the
    /// region is unchanged.
    #[error("{0}")]
    Input(Error),
    /// The re-registration itself failed (`IBV_REREG_MR_ERR_CMD`); here too the region is left
    /// as it was.
    #[error("{0}")]
    Command(Error),
}

impl From<ReregError> for Error {
    fn from(e: ReregError) -> Self {
        match e {
            ReregError::Input(e) | ReregError::Command(e) => e,
        }
    }
}

/// A registered memory region (`ibv_reg_mr`).
///
/// Its mapping sits behind a lock because `ibv_rereg_mr` changes it in place, keeping the keys;
/// every access checks and copies under that lock, so an access never sees half a change.
#[derive(Debug)]
pub struct Mr {
    map: RwLock<Mapping>,
    /// The device memory a region of `ibv_reg_dm_mr` lies in, and its offset there.
    dm: Option<(Arc<Dm>, u64)>,
    lkey: u32,
    rkey: u32,
    handle: u32,
    /// Memory windows bound to the region (dereg and rereg are EBUSY while any is).
    uses: UseCount,
    /// A null MR (`ibv_alloc_null_mr`): no memory to re-register.
    null: std::sync::atomic::AtomicBool,
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
        let access = check_mr_access(access)?;
        let t = Translation { backing, addr, iova };
        check_translation(pd, &t)?;
        Self::insert(pd, t, None, access)
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
        let t = Translation {
            backing: Arc::new(DmRange::new(dm.clone(), offset, length)),
            addr: 0,
            iova: 0,
        };
        check_translation(pd, &t)?;
        dm.uses().acquire("device memory")?;
        let r = Self::insert(pd, t, Some((dm.clone(), offset)), access);
        if r.is_err() {
            dm.uses().release();
        }
        r
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
        let t = Translation {
            backing,
            addr: 0,
            iova: 0,
        };
        Self::insert(pd, t, None, flags)
    }

    /// `ibv_alloc_null_mr`: a region over the whole address space whose writes are discarded
    /// and whose reads give zeros. Only its lkey is meant to be used: it grants local write
    /// (receives and RDMA reads may land in it) and no remote access, so its rkey is refused.
    pub fn alloc_null(pd: &Arc<Pd>) -> Result<Arc<Self>> {
        let t = Translation {
            backing: Arc::new(crate::null_mr::NullMemory),
            addr: 0,
            iova: 0,
        };
        let mr = Self::insert(pd, t, None, AccessFlags::LOCAL_WRITE)?;
        mr.null.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(mr)
    }

    fn insert(
        pd: &Arc<Pd>,
        t: Translation,
        dm: Option<(Arc<Dm>, u64)>,
        access: AccessFlags,
    ) -> Result<Arc<Self>> {
        let device = pd.context().device();
        pd.uses.acquire("protection domain")?;
        if let Err(e) = device.acquire(Resource::Mr) {
            pd.uses.release();
            return Err(e);
        }
        let lkey = device.alloc_key();
        let rkey = device.alloc_key();
        let mr = Arc::new(Self {
            map: RwLock::new(Mapping {
                pd: pd.clone(),
                length: t.backing.len(),
                backing: t.backing,
                addr: t.addr,
                iova: t.iova,
                access,
            }),
            dm,
            lkey,
            rkey,
            handle: pd.context().next_handle(),
            uses: UseCount::default(),
            null: std::sync::atomic::AtomicBool::new(false),
        });
        device.node().keys.insert(&mr);
        pd.context()
            .ufile()
            .publish(mr.handle, UObject::Mr(Arc::downgrade(&mr)));
        Ok(mr)
    }

    /// The PD.
    pub fn pd(&self) -> Arc<Pd> {
        self.map.read().pd.clone()
    }

    /// The memory.
    pub fn backing(&self) -> Arc<dyn MemoryBacking> {
        self.map.read().backing.clone()
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.map.read().addr
    }

    /// Length in bytes.
    pub fn length(&self) -> u64 {
        self.map.read().length
    }

    /// Address remote peers use for the first byte.
    pub fn iova(&self) -> u64 {
        self.map.read().iova
    }

    /// Access rights.
    pub fn access(&self) -> AccessFlags {
        self.map.read().access
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
        self.align_base_in(&self.map.read())
    }

    /// [`Mr::align_base`] under a lock already held.
    pub(crate) fn align_base_in(&self, map: &Mapping) -> u64 {
        self.dm.as_ref().map_or(map.addr, |(_, off)| *off)
    }

    /// Whether the region is still registered (not deregistered).
    pub(crate) fn is_registered(&self) -> bool {
        !self.uses.is_retired()
    }

    pub(crate) fn mapping(&self) -> &RwLock<Mapping> {
        &self.map
    }

    pub(crate) fn uses(&self) -> &UseCount {
        &self.uses
    }

    /// `ibv_rereg_mr`: changes the translation, PD and/or access rights of the region in place,
    /// as `flags` (`IBV_REREG_MR_CHANGE_*`) say; the keys stay. `pd` and `translation` are
    /// needed when their flag is set and ignored otherwise, as is `access`.
    ///
    /// Unknown or no flags, or a flag without its argument, are input errors (EINVAL).
    /// Re-registering a deregistered region or with invalid access flags (`ibv_reg_mr(3)`
    /// rules) or a PD of another device is EINVAL; turning on-demand paging on or off without a
    /// new translation is EOPNOTSUPP; while memory windows are bound to the region it is EBUSY.
    /// On any error the region is unchanged.
    pub fn rereg(
        &self,
        flags: u32,
        pd: Option<&Arc<Pd>>,
        translation: Option<Translation>,
        access: u32,
    ) -> Result<(), ReregError> {
        use ReregError::{Command, Input};
        let known = REREG_CHANGE_TRANSLATION | REREG_CHANGE_PD | REREG_CHANGE_ACCESS;
        if flags == 0 || flags & !known != 0 {
            return Err(Input(Error::invalid(format!(
                "flags {flags:#x}: none or unknown"
            ))));
        }
        let new_pd = match (flags & REREG_CHANGE_PD != 0, pd) {
            (true, None) => return Err(Input(Error::invalid("IBV_REREG_MR_CHANGE_PD without a PD"))),
            (true, Some(p)) => Some(p),
            (false, _) => None,
        };
        let translation = match (flags & REREG_CHANGE_TRANSLATION != 0, translation) {
            (true, None) => {
                return Err(Input(Error::invalid(
                    "IBV_REREG_MR_CHANGE_TRANSLATION without an address and length",
                )))
            }
            (true, Some(t)) if t.backing.is_empty() => {
                return Err(Input(Error::invalid(
                    "IBV_REREG_MR_CHANGE_TRANSLATION: length is 0",
                )))
            }
            (true, t) => t,
            (false, _) => None,
        };
        let new_access = if flags & REREG_CHANGE_ACCESS != 0 {
            Some(check_mr_access(access).map_err(Command)?)
        } else {
            None
        };
        if self.null.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Input(Error::invalid("a null MR has no memory to re-register")));
        }
        let mut map = self.map.write();
        if self.uses.is_retired() {
            return Err(Command(Error::invalid("the memory region has been deregistered")));
        }
        let bound = self.uses.count();
        if bound > 0 {
            return Err(Command(Error::busy(format!(
                "{bound} memory window(s) are bound to the region"
            ))));
        }
        if let Some(a) = new_access {
            // Whether the memory is pinned or paged on demand is a property of the translation
            // (the C library reaches the two differently): it changes only with a new one.
            if a.contains(AccessFlags::ON_DEMAND) != map.access.contains(AccessFlags::ON_DEMAND)
                && translation.is_none()
            {
                return Err(Command(Error::not_supported(
                    "IBV_ACCESS_ON_DEMAND changes only together with the translation",
                )));
            }
        }
        if let Some(p) = new_pd {
            if !Arc::ptr_eq(p.context().device().node(), map.pd.context().device().node()) {
                return Err(Command(Error::invalid("the PD belongs to another device")));
            }
        }
        if translation.is_some() && self.dm.is_some() {
            return Err(Command(Error::not_supported(
                "a region of device memory cannot be given another translation",
            )));
        }
        let pd_for_checks = new_pd.unwrap_or(&map.pd).clone();
        if let Some(t) = &translation {
            check_translation(&pd_for_checks, t).map_err(Command)?;
        }
        if let Some(p) = new_pd {
            if !Arc::ptr_eq(p, &map.pd) {
                p.uses.acquire("protection domain").map_err(Command)?;
                let old = std::mem::replace(&mut map.pd, p.clone());
                old.uses.release();
            }
        }
        if let Some(t) = translation {
            map.length = t.backing.len();
            map.backing = t.backing;
            map.addr = t.addr;
            map.iova = t.iova;
        }
        if let Some(a) = new_access {
            map.access = a;
        }
        Ok(())
    }

    fn teardown(&self) {
        let map = self.map.read();
        let device = map.pd.context().device();
        device.node().keys.remove(self.lkey, self.rkey);
        device.free_key(self.lkey);
        device.free_key(self.rkey);
        device.release(Resource::Mr);
        map.pd.uses.release();
        if let Some((dm, _)) = &self.dm {
            dm.uses().release();
        }
    }

    /// `ibv_dereg_mr`: EBUSY, changing nothing, while memory windows are bound to the region
    /// (`ibv_alloc_mw(3)`).
    pub fn dereg(&self) -> Result<()> {
        self.uses.retire("memory region")?;
        // A payload copy into the region holds its mapping for reading and checks that the
        // region is still registered (`remote::Pending::flush`): once this returns, none is in
        // progress or can start, so the application may free the memory.
        drop(self.map.write());
        self.pd().context().ufile().withdraw(self.handle);
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

/// Checks a region's memory against the device limits.
fn check_translation(pd: &Arc<Pd>, t: &Translation) -> Result<()> {
    let length = t.backing.len();
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
    if t.addr.checked_add(length).is_none() || t.iova.checked_add(length).is_none() {
        return Err(Error::invalid("the region wraps around the address space"));
    }
    Ok(())
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
