//! Null memory regions (`ibv_alloc_null_mr`): an lkey that discards every byte written through
//! it and reads as zeros, over the whole address space, never exposed to remote peers.

use std::sync::Arc;

use softverbs_engine::memory::AtomicOp;
use softverbs_engine::types::AccessFlags;
use softverbs_engine::Result;

use crate::mem::{MemoryBacking, Unmapped};
use crate::pd::{Mr, Pd};

/// The memory of a null MR: every address exists, writes vanish, reads give zeros.
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
        Ok(0)
    }
}

impl Mr {
    /// `ibv_alloc_null_mr`: a region of `pd` over the whole address space whose lkey scatter
    /// lists may name anywhere; only local access is granted, so its rkey reaches nothing
    /// (remote access errors) and no window can be bound to it.
    pub fn alloc_null(pd: &Arc<Pd>) -> Result<Arc<Self>> {
        Self::insert_whole_space(pd, Arc::new(NullMemory), AccessFlags::LOCAL_WRITE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_memory_discards_writes_and_reads_zeros() {
        let m = NullMemory;
        m.write(12345, &[1, 2, 3]).unwrap();
        let mut out = [7u8; 5];
        m.read(12345, &mut out).unwrap();
        assert_eq!(out, [0; 5]);
        assert_eq!(m.len(), u64::MAX);
    }
}
