//! Device memory (`ibv_alloc_dm`).

use std::sync::Arc;

use softverbs_device as core;
use softverbs_engine::Result;

use crate::context::Context;

#[derive(Debug)]
struct DmInner {
    core: Arc<core::Dm>,
    imported: bool,
    _ctx: Context,
}

impl Drop for DmInner {
    fn drop(&mut self) {
        if !self.imported {
            // Every region of it holds a handle, so none is left; a region registered in a
            // context that imported it keeps the core DM alive until it is gone.
            let r = match self.core.free() {
                Err(e) if e.errno() == 16 => Ok(()),
                r => r,
            };
            debug_assert!(r.is_ok(), "{r:?}");
        }
    }
}

/// Memory of the device (`struct ibv_dm`), reached by copies and registered with
/// [`ProtectionDomain::register_dm`](crate::ProtectionDomain::register_dm). Cheap to clone;
/// freed with its last handle and last region.
#[derive(Debug, Clone)]
pub struct DeviceMemory(Arc<DmInner>);

impl DeviceMemory {
    pub(crate) fn alloc(ctx: &Context, length: u64, log_align_req: u32) -> Result<Self> {
        Ok(Self(Arc::new(DmInner {
            core: core::Dm::alloc(ctx.core(), length, log_align_req)?,
            imported: false,
            _ctx: ctx.clone(),
        })))
    }

    pub(crate) fn import(ctx: &Context, handle: u32) -> Result<Self> {
        Ok(Self(Arc::new(DmInner {
            core: ctx.core().import_dm(handle)?,
            imported: true,
            _ctx: ctx.clone(),
        })))
    }

    pub(crate) fn core(&self) -> &Arc<core::Dm> {
        &self.0.core
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.0.core.length()
    }

    /// Whether it has no bytes (never: empty allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The handle (`ibv_dm.handle`), which [`Context::import_dm`] takes.
    pub fn handle(&self) -> u32 {
        self.0.core.handle()
    }

    /// `ibv_memcpy_to_dm`: copies `src` to `offset`; EINVAL if outside.
    pub fn copy_to(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.0.core.memcpy_to(offset, src)
    }

    /// `ibv_memcpy_from_dm`: copies the bytes at `offset` into `dst`; EINVAL if outside.
    pub fn copy_from(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.0.core.memcpy_from(offset, dst)
    }
}
