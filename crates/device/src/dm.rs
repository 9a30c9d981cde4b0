//! Device memory (`ibv_alloc_dm`): memory the device owns, which the application reaches with
//! `ibv_memcpy_{to,from}_dm` and registers as zero-based memory regions (`ibv_reg_dm_mr`).
//!
//! On a HCA this is on-chip memory; here it is an [`AtomicBuffer`] the device owns, so the
//! device's threads and the application's copies can touch it concurrently without data races.
//! The total allocated per device is limited by `max_dm_size`.

use std::sync::Arc;

use softverbs_engine::memory::AtomicOp;
use softverbs_engine::{Error, Result};

use crate::context::Context;
use crate::mem::{AtomicBuffer, MemoryBacking, Unmapped};
use crate::sync::UseCount;
use crate::ufile::UObject;

/// The largest `log_align_req` honoured: every allocation starts on a 4 KiB boundary of the
/// device's memory.
pub const MAX_LOG_ALIGN: u32 = 12;

/// A device memory allocation (`struct ibv_dm`).
#[derive(Debug)]
pub struct Dm {
    ctx: Arc<Context>,
    buf: AtomicBuffer,
    handle: u32,
    uses: UseCount,
}

impl Dm {
    /// `ibv_alloc_dm`: `length` bytes, zeroed. EOPNOTSUPP if the device offers no device memory
    /// (`max_dm_size` 0); EINVAL for a length of 0, a length above `max_dm_size` or an alignment
    /// above 2^[`MAX_LOG_ALIGN`]; ENOMEM when the device's device memory is used up.
    pub fn alloc(ctx: &Arc<Context>, length: u64, log_align_req: u32) -> Result<Arc<Self>> {
        let device = ctx.device();
        let max = device.limits().max_dm_size;
        if max == 0 {
            return Err(Error::not_supported(
                "the device has no device memory (max_dm_size 0)",
            ));
        }
        if length == 0 {
            return Err(Error::invalid("length is 0"));
        }
        if length > max {
            return Err(Error::invalid(format!(
                "length {length} exceeds max_dm_size {max}"
            )));
        }
        if log_align_req > MAX_LOG_ALIGN {
            return Err(Error::invalid(format!(
                "log_align_req {log_align_req} exceeds the supported {MAX_LOG_ALIGN}"
            )));
        }
        device.acquire_dm_bytes(length)?;
        let dm = Arc::new(Self {
            ctx: ctx.clone(),
            buf: AtomicBuffer::new(length as usize),
            handle: ctx.next_handle(),
            uses: UseCount::default(),
        });
        ctx.ufile().publish(dm.handle, UObject::Dm(Arc::downgrade(&dm)));
        Ok(dm)
    }

    /// The context it was allocated on.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Length in bytes.
    pub fn length(&self) -> u64 {
        self.buf.byte_len() as u64
    }

    /// Handle (`ibv_dm.handle`), which `ibv_import_dm` takes.
    pub fn handle(&self) -> u32 {
        self.handle
    }

    pub(crate) fn uses(&self) -> &UseCount {
        &self.uses
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<usize> {
        if self.uses.is_retired() {
            return Err(Error::invalid("the device memory has been freed"));
        }
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.length())
        {
            return Err(Error::invalid(format!(
                "{len} bytes at offset {offset} are outside the {}-byte device memory",
                self.length()
            )));
        }
        Ok(offset as usize)
    }

    /// `ibv_memcpy_to_dm`: copies `src` to `offset`. EINVAL if the range is outside the DM.
    pub fn memcpy_to(&self, offset: u64, src: &[u8]) -> Result<()> {
        let off = self.check_range(offset, src.len())?;
        self.buf.write_bytes(off, src);
        Ok(())
    }

    /// `ibv_memcpy_from_dm`: copies the bytes at `offset` into `dst`. EINVAL if the range is
    /// outside the DM.
    pub fn memcpy_from(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let off = self.check_range(offset, dst.len())?;
        self.buf.read_bytes(off, dst);
        Ok(())
    }

    /// `ibv_free_dm`: EBUSY, changing nothing, while a memory region uses it.
    pub fn free(&self) -> Result<()> {
        self.uses.retire("device memory")?;
        self.ctx.ufile().withdraw(self.handle);
        self.ctx.device().release_dm_bytes(self.length());
        Ok(())
    }
}

impl Drop for Dm {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.ctx.device().release_dm_bytes(self.length());
        }
    }
}

/// The part of a DM a memory region covers.
#[derive(Debug)]
pub(crate) struct DmRange {
    dm: Arc<Dm>,
    offset: u64,
    len: u64,
}

impl DmRange {
    pub(crate) fn new(dm: Arc<Dm>, offset: u64, len: u64) -> Self {
        Self { dm, offset, len }
    }
}

impl MemoryBacking for DmRange {
    fn len(&self) -> u64 {
        self.len
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), Unmapped> {
        self.dm.buf.read_bytes((self.offset + offset) as usize, dst);
        Ok(())
    }

    fn write(&self, offset: u64, src: &[u8]) -> Result<(), Unmapped> {
        self.dm.buf.write_bytes((self.offset + offset) as usize, src);
        Ok(())
    }

    fn atomic(&self, offset: u64, op: AtomicOp) -> Result<u64, Unmapped> {
        self.dm.buf.atomic(self.offset + offset, op)
    }
}
