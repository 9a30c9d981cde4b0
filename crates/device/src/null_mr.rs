//! The memory behind a null MR (`ibv_alloc_null_mr`): writes are discarded and reads give
//! zeros, so a receive can drop the parts of a message the application does not want and a
//! send can transmit zeros without memory behind them.

use softverbs_engine::memory::AtomicOp;

use crate::mem::{MemoryBacking, Unmapped};

/// Backing of a null MR: the whole address space, holding nothing.
#[derive(Debug, Default)]
pub struct NullMemory;

impl MemoryBacking for NullMemory {
    fn len(&self) -> u64 {
        u64::MAX
    }

    fn read(&self, _offset: u64, dst: &mut [u8]) -> Result<(), Unmapped> {
        dst.fill(0);
        Ok(())
    }

    fn write(&self, _offset: u64, _src: &[u8]) -> Result<(), Unmapped> {
        Ok(())
    }

    fn atomic(&self, _offset: u64, _op: AtomicOp) -> Result<u64, Unmapped> {
        // The word reads as zero before and after.
        Ok(0)
    }
}
