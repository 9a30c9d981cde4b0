//! Protection domains, memory regions and address handles.

use std::sync::Arc;

use softverbs_engine::qp_state::check_ah_attr;
use softverbs_engine::types::{AccessFlags, AhAttr, QpAttrMask, ACCESS_OPTIONAL_RANGE};
use softverbs_engine::{Error, Result};

use crate::context::Context;
use crate::device::Resource;
use crate::mem::MemoryBacking;
use crate::sync::UseCount;

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
        Ok(Arc::new(Self {
            ctx: ctx.clone(),
            handle: ctx.next_handle(),
            uses: UseCount::default(),
        }))
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

    /// `ibv_dealloc_pd`: fails with EBUSY, changing nothing, while an MR, QP, SRQ or AH uses it.
    pub fn dealloc(&self) -> Result<()> {
        self.uses.retire("protection domain")?;
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
    /// ignored, and on-demand paging is EOPNOTSUPP.
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

    fn teardown(&self) {
        let device = self.pd.context().device();
        device.node().keys.remove(self.lkey, self.rkey);
        device.free_key(self.lkey);
        device.free_key(self.rkey);
        device.release(Resource::Mr);
        self.pd.uses.release();
    }

    /// `ibv_dereg_mr`. (Memory windows, which would make it fail with EBUSY, are not offered.)
    pub fn dereg(&self) -> Result<()> {
        self.uses.retire("memory region")?;
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
    if access.contains(AccessFlags::ON_DEMAND) {
        return Err(Error::not_supported(
            "IBV_ACCESS_ON_DEMAND: on-demand paging is not supported",
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
