//! Registered C memory: a [`MemoryBacking`] over the application's raw bytes.

use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;
use softverbs_device::{MemoryBacking, Unmapped};
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

    /// The address of `len` bytes at `offset`, if they lie inside the region. Every accessor
    /// checks here, whatever its caller checked: a wrong offset is an error, never a stray
    /// access to the application's memory.
    fn span(&self, offset: u64, len: u64) -> Result<*mut u8, Unmapped> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok((self.base + offset as usize) as *mut u8),
            _ => Err(Unmapped),
        }
    }
}

impl MemoryBacking for RawMemory {
    fn len(&self) -> u64 {
        self.len
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), Unmapped> {
        let at = self.span(offset, dst.len() as u64)?;
        // SAFETY: `span` checked that the bytes lie inside the range the application
        // registered as readable memory (and keeps mapped until it deregisters it), and `dst`
        // is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(at, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn write(&self, offset: u64, src: &[u8]) -> Result<(), Unmapped> {
        let at = self.span(offset, src.len() as u64)?;
        // SAFETY: as in `read`; the region was registered with local write access, which the
        // key table checks before any write reaches the backing.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), at, src.len()) };
        Ok(())
    }

    fn host_addr(&self) -> Option<u64> {
        Some(self.base as u64)
    }

    fn copy_from_process(
        &self,
        offset: u64,
        len: u64,
        pid: i32,
        remote: &[(u64, usize)],
    ) -> Result<(), Unmapped> {
        let at = self.span(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: `span` checked that the bytes lie inside the region, registered with local
        // write access (checked by the key table), which the application keeps mapped until it
        // is deregistered (and deregistration waits for a copy in progress). The slice is only
        // the destination of the kernel's copy; no Rust reference to these bytes exists
        // meanwhile.
        let dst = unsafe { std::slice::from_raw_parts_mut(at, len as usize) };
        softverbs_shm::read_from_process(pid, dst, remote).map_err(|_| Unmapped)
    }

    fn atomic(&self, offset: u64, op: AtomicOp) -> Result<u64, Unmapped> {
        let at = self.span(offset, 8)?;
        if at as usize % 8 != 0 {
            return Err(Unmapped);
        }
        // SAFETY: the word is 8-byte aligned and inside the region (both checked just above),
        // which the application keeps mapped and writable while it is registered.
        Ok(unsafe { atomic_at(at.cast(), op) })
    }
}

/// Applies `op` to the word at `p`; returns the old value.
///
/// # Safety
/// `p` must be an 8-byte aligned, mapped and writable word.
unsafe fn atomic_at(p: *mut u64, op: AtomicOp) -> u64 {
    // SAFETY: the caller guarantees the word; an `AtomicU64` has the layout of a `u64`, and RDMA
    // atomics are only atomic with respect to other atomic accesses, as here.
    let word = unsafe { AtomicU64::from_ptr(p) };
    {
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

/// The memory of an on-demand-paging region: `[base, base + len)` of this process, which need
/// not be mapped (an implicit region covers the whole address space). Nothing is pinned, and
/// every access goes through the mapping of the moment.
///
/// Reads and writes use `process_vm_readv`/`process_vm_writev` on our own pid: the kernel
/// copies through the page tables and reports an unmapped or write-protected page as a short
/// transfer or EFAULT instead of a fault, which the device turns into a protection error.
/// Atomics need the word itself: it is first checked to be mapped writable in
/// `/proc/self/maps`.
#[derive(Debug)]
pub(crate) struct OdpMemory {
    base: u64,
    len: u64,
}

impl OdpMemory {
    /// A region of `len` bytes at virtual address `base` (0 and `u64::MAX` for implicit ODP).
    pub(crate) fn new(base: u64, len: u64) -> Self {
        Self { base, len }
    }

    /// The address of `len` bytes at `offset`, if they lie inside the region.
    fn addr(&self, offset: u64, len: u64) -> Result<usize, Unmapped> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Unmapped);
        }
        usize::try_from(self.base.checked_add(offset).ok_or(Unmapped)?).map_err(|_| Unmapped)
    }
}

/// Largest single `process_vm_*` transfer: the kernel caps one call's iovec total anyway.
const VM_CHUNK: usize = 1 << 30;

fn vm_read(addr: usize, dst: &mut [u8]) -> Result<(), Unmapped> {
    let mut done = 0;
    while done < dst.len() {
        let n = (dst.len() - done).min(VM_CHUNK);
        let remote = [RemoteIoVec {
            base: addr + done,
            len: n,
        }];
        let mut local = [IoSliceMut::new(&mut dst[done..done + n])];
        match process_vm_readv(Pid::this(), &mut local, &remote) {
            Ok(0) | Err(_) => return Err(Unmapped),
            Ok(got) => done += got,
        }
    }
    Ok(())
}

fn vm_write(addr: usize, src: &[u8]) -> Result<(), Unmapped> {
    let mut done = 0;
    while done < src.len() {
        let n = (src.len() - done).min(VM_CHUNK);
        let remote = [RemoteIoVec {
            base: addr + done,
            len: n,
        }];
        let local = [IoSlice::new(&src[done..done + n])];
        match process_vm_writev(Pid::this(), &local, &remote) {
            Ok(0) | Err(_) => return Err(Unmapped),
            Ok(got) => done += got,
        }
    }
    Ok(())
}

/// Whether `[addr, addr + len)` lies in mappings of this process that are readable, and
/// writable too if `write`, per `/proc/self/maps`.
fn mapped(addr: u64, len: u64, write: bool) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let end = addr.saturating_add(len);
    let mut at = addr;
    // Mappings are listed in address order; walk them over the range.
    for line in maps.lines() {
        let mut cols = line.split_whitespace();
        let (Some(range), Some(perms)) = (cols.next(), cols.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        if hi <= at {
            continue;
        }
        let ok = perms.starts_with('r') && (!write || perms.as_bytes().get(1) == Some(&b'w'));
        if lo > at || !ok {
            return false;
        }
        at = hi;
        if at >= end {
            return true;
        }
    }
    false
}

impl MemoryBacking for OdpMemory {
    fn len(&self) -> u64 {
        self.len
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), Unmapped> {
        vm_read(self.addr(offset, dst.len() as u64)?, dst)
    }

    fn write(&self, offset: u64, src: &[u8]) -> Result<(), Unmapped> {
        vm_write(self.addr(offset, src.len() as u64)?, src)
    }

    fn atomic(&self, offset: u64, op: AtomicOp) -> Result<u64, Unmapped> {
        let addr = self.addr(offset, 8)?;
        if addr % 8 != 0 || !mapped(addr as u64, 8, true) {
            return Err(Unmapped);
        }
        // SAFETY: the word is 8-byte aligned (the device checks) and was just found mapped
        // writable; an application unmapping registered memory while a peer targets it is
        // outside the verbs contract.
        Ok(unsafe { atomic_at(addr as *mut u64, op) })
    }

    fn prefetch(&self, offset: u64, len: u64, write: bool) -> Result<(), Unmapped> {
        let addr = self.addr(offset, len)?;
        if !mapped(addr as u64, len, write) {
            return Err(Unmapped);
        }
        // Touch one byte per page through the kernel, which faults the pages in.
        let page = 4096u64;
        let mut byte = [0u8; 1];
        let mut at = addr as u64;
        let end = (addr as u64).saturating_add(len);
        while at < end {
            vm_read(at as usize, &mut byte)?;
            at = (at / page + 1) * page;
        }
        Ok(())
    }
}

/// Copies `len` bytes at application address `addr` (an inline send's data).
///
/// # Safety
/// `addr..addr + len` must be readable, as `ibv_post_send(3)` requires of inline data.
pub(crate) unsafe fn copy_in(addr: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::new();
    // SAFETY: per the contract.
    unsafe { append_in(&mut v, addr, len) };
    v
}

/// Appends `len` bytes at application address `addr` to `out`.
///
/// # Safety
/// `addr..addr + len` must be readable.
pub(crate) unsafe fn append_in(out: &mut Vec<u8>, addr: u64, len: usize) {
    if len == 0 {
        return;
    }
    out.reserve(len);
    // SAFETY: the caller guarantees the source range is readable; `reserve` made room for `len`
    // more bytes past `out.len()`, which the copy initialises before the length covers them.
    unsafe {
        std::ptr::copy_nonoverlapping(addr as usize as *const u8, out.as_mut_ptr().add(out.len()), len);
        out.set_len(out.len() + len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_memory_reads_writes_and_atomics() {
        let mut buf = vec![0u64; 4];
        let m = RawMemory::new(buf.as_mut_ptr().cast(), 32);
        m.write(3, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 3];
        m.read(3, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
        assert_eq!(m.atomic(8, AtomicOp::FetchAdd { add: 5 }), Ok(0));
        assert_eq!(m.atomic(8, AtomicOp::CompareSwap { compare: 5, swap: 9 }), Ok(5));
        assert_eq!(m.atomic(8, AtomicOp::CompareSwap { compare: 5, swap: 1 }), Ok(9));
        let _ = m;
        assert_eq!(buf[1], 9);
    }

    #[test]
    fn raw_memory_refuses_what_lies_outside_the_region() {
        // The region is the middle 16 bytes of 32; the guards around it must never change.
        let mut buf = [0xAAu8; 32];
        let base = buf.as_mut_ptr().wrapping_add(8);
        let m = RawMemory::new(base, 16);
        let mut out = [0u8; 4];
        assert_eq!(m.read(13, &mut out), Err(Unmapped), "runs past the end");
        assert_eq!(m.write(13, &[1; 4]), Err(Unmapped));
        assert_eq!(
            m.write(u64::MAX - 1, &[1; 4]),
            Err(Unmapped),
            "offset + len overflows"
        );
        assert_eq!(m.atomic(12, AtomicOp::Store { value: 1 }), Err(Unmapped));
        assert_eq!(
            m.copy_from_process(10, 8, std::process::id() as i32, &[]),
            Err(Unmapped)
        );
        m.write(12, &[1; 4]).unwrap();
        let _ = m;
        assert_eq!(buf[..8], [0xAA; 8]);
        assert_eq!(buf[20..24], [1; 4]);
        assert_eq!(buf[24..], [0xAA; 8]);
    }

    #[test]
    fn odp_memory_turns_faults_into_errors() {
        let mut buf = vec![0u64; 4];
        let implicit = OdpMemory::new(0, u64::MAX);
        let at = buf.as_mut_ptr() as u64;
        implicit.write(at + 3, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 3];
        implicit.read(at + 3, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
        assert_eq!(implicit.atomic(at + 8, AtomicOp::FetchAdd { add: 4 }), Ok(0));
        assert_eq!(implicit.atomic(at + 8, AtomicOp::Store { value: 11 }), Ok(4));
        implicit.prefetch(at, 32, true).unwrap();
        // Page 0 is never mapped; neither is the top of the address space.
        assert_eq!(implicit.read(16, &mut out), Err(Unmapped));
        assert_eq!(implicit.write(16, &out), Err(Unmapped));
        assert_eq!(implicit.atomic(16, AtomicOp::FetchAdd { add: 1 }), Err(Unmapped));
        assert_eq!(implicit.prefetch(16, 8, false), Err(Unmapped));
        assert_eq!(implicit.read(u64::MAX - 16, &mut out), Err(Unmapped));
        // Read-only memory: readable, not writable.
        static RODATA: [u8; 8] = [7; 8];
        let ro = RODATA.as_ptr() as u64;
        implicit.read(ro, &mut out).unwrap();
        assert_eq!(out, [7; 3]);
        assert_eq!(implicit.write(ro, &[0]), Err(Unmapped));
        assert_eq!(implicit.prefetch(ro, 8, true), Err(Unmapped));
        assert_eq!(RODATA, [7; 8]);
        let _ = implicit;
        assert_eq!(buf[1], 11);
        assert_eq!(buf[0].to_ne_bytes()[3..6], [1, 2, 3]);
    }
}
