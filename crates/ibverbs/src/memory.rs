//! Registered C memory: a [`MemoryBacking`] over the application's raw bytes.

use std::sync::atomic::{AtomicU64, Ordering};

use softverbs_device::MemoryBacking;
use softverbs_engine::memory::AtomicOp;

/// The bytes `[base, base + len)` of the application, as registered with `ibv_reg_mr`.
///
/// The application promises (`ibv_reg_mr(3)`) that the range stays mapped until the region is
/// deregistered; the device reaches it only through its key table, from which deregistration
/// removes the region.
#[derive(Debug)]
pub(crate) struct RawMemory {
    base: usize,
    len: u64,
}

impl RawMemory {
    /// A backing over `len` bytes at `base`.
    pub(crate) fn new(base: *mut u8, len: u64) -> Self {
        Self {
            base: base as usize,
            len,
        }
    }

    fn ptr(&self, offset: u64) -> *mut u8 {
        (self.base + offset as usize) as *mut u8
    }
}

impl MemoryBacking for RawMemory {
    fn len(&self) -> u64 {
        self.len
    }

    fn read(&self, offset: u64, dst: &mut [u8]) {
        // SAFETY: the device passes offsets with `offset + dst.len() <= len`, the range was
        // registered by the application as readable memory, and `dst` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(offset), dst.as_mut_ptr(), dst.len()) };
    }

    fn write(&self, offset: u64, src: &[u8]) {
        // SAFETY: as in `read`; the region was registered with local write access, which the
        // key table checks before any write reaches the backing.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr(offset), src.len()) };
    }

    fn atomic(&self, offset: u64, op: AtomicOp) -> u64 {
        let p = self.ptr(offset).cast::<u64>();
        // SAFETY: the device checks that the word is 8-byte aligned and inside the region; an
        // `AtomicU64` has the layout of a `u64`, and RDMA atomics are only atomic with respect
        // to other atomic accesses, as here.
        let word = unsafe { AtomicU64::from_ptr(p) };
        match op {
            AtomicOp::FetchAdd { add } => word.fetch_add(add, Ordering::SeqCst),
            AtomicOp::Store { value } => word.swap(value, Ordering::SeqCst),
            AtomicOp::CompareSwap { compare, swap } => {
                match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(v) | Err(v) => v,
                }
            }
        }
    }
}

/// Copies `len` bytes at application address `addr` (an inline send's data).
///
/// # Safety
/// `addr..addr + len` must be readable, as `ibv_post_send(3)` requires of inline data.
pub(crate) unsafe fn copy_in(addr: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    if len > 0 {
        // SAFETY: the caller guarantees the range is readable; `v` has `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(addr as usize as *const u8, v.as_mut_ptr(), len) };
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_memory_reads_writes_and_atomics() {
        let mut buf = vec![0u64; 4];
        let m = RawMemory::new(buf.as_mut_ptr().cast(), 32);
        m.write(3, &[1, 2, 3]);
        let mut out = [0u8; 3];
        m.read(3, &mut out);
        assert_eq!(out, [1, 2, 3]);
        assert_eq!(m.atomic(8, AtomicOp::FetchAdd { add: 5 }), 0);
        assert_eq!(m.atomic(8, AtomicOp::CompareSwap { compare: 5, swap: 9 }), 5);
        assert_eq!(m.atomic(8, AtomicOp::CompareSwap { compare: 5, swap: 1 }), 9);
        let _ = m;
        assert_eq!(buf[1], 9);
    }
}
