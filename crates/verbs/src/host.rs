//! Application memory that implicit on-demand-paging regions reach by address.
//!
//! An implicit ODP region (`ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_ON_DEMAND)`) covers the
//! whole address space: work requests name any address with its lkey, and an access succeeds
//! if that memory is mapped. A safe program has no raw memory to offer, so [`HostBuffer`]s are
//! what is mapped: each is an allocation at a fixed address, reachable through every implicit
//! region from its creation until it is dropped (as `malloc`ed memory is reachable until freed).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Weak};

use parking_lot::RwLock;
use softverbs_device::mem::{AtomicBuffer, MemoryBacking, Unmapped};
use softverbs_engine::memory::AtomicOp;
use softverbs_engine::types::Sge;
use softverbs_engine::{Error, Result};

/// The live host buffers by the address of their first byte.
static MAPPED: RwLock<BTreeMap<u64, Weak<AtomicBuffer>>> = RwLock::new(BTreeMap::new());

/// A buffer of application memory at a fixed address, zeroed at creation. Implicit ODP
/// regions ([`ProtectionDomain::register_implicit_odp`](crate::ProtectionDomain::register_implicit_odp))
/// reach it by that address while it lives.
#[derive(Debug)]
pub struct HostBuffer {
    buf: Arc<AtomicBuffer>,
}

impl HostBuffer {
    /// `len` zeroed bytes; EINVAL for 0 (an empty allocation has no address of its own).
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid("a host buffer needs at least one byte"));
        }
        let buf = Arc::new(AtomicBuffer::new(len));
        MAPPED.write().insert(buf.addr(), Arc::downgrade(&buf));
        Ok(Self { buf })
    }

    /// The memory itself, for registrations the core makes (`riomap`).
    pub(crate) fn backing(&self) -> Arc<AtomicBuffer> {
        self.buf.clone()
    }

    /// The address of the first byte, as work requests name it.
    pub fn addr(&self) -> u64 {
        self.buf.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.byte_len()
    }

    /// Whether it has no bytes (never: empty buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::invalid(format!(
                "{len} bytes at offset {offset} are outside the {}-byte buffer",
                self.len()
            )));
        }
        Ok(())
    }

    /// Copies the bytes at `offset` into `dst`; EINVAL if out of bounds.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        self.buf.read_bytes(offset, dst);
        Ok(())
    }

    /// Copies `src` to `offset`; EINVAL if out of bounds.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        self.buf.write_bytes(offset, src);
        Ok(())
    }

    /// Sets every byte to `value`.
    pub fn fill(&self, value: u8) {
        self.buf.fill(value);
    }

    /// A copy of the contents.
    pub fn to_vec(&self) -> Vec<u8> {
        self.buf.to_vec()
    }

    /// A scatter/gather element for `range` of this buffer with `lkey` (an implicit region's);
    /// EINVAL if the range is outside the buffer or longer than an SGE holds.
    pub fn sge(&self, range: Range<usize>, lkey: u32) -> Result<Sge> {
        if range.start > range.end {
            return Err(Error::invalid(format!("range {range:?} is reversed")));
        }
        self.check(range.start, range.len())?;
        let length = u32::try_from(range.len()).map_err(|_| Error::invalid("an SGE holds at most 4 GiB"))?;
        Ok(Sge {
            addr: self.addr() + range.start as u64,
            length,
            lkey,
        })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // From now on the address is unmapped; an access the device already resolved finishes
        // on its own reference.
        let mut mapped = MAPPED.write();
        if mapped
            .get(&self.buf.addr())
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.buf)))
        {
            mapped.remove(&self.buf.addr());
        }
    }
}

/// The whole address space as implicit ODP regions see it: a byte is mapped if a live
/// [`HostBuffer`] holds it. An access must lie within one buffer.
#[derive(Debug, Default)]
pub(crate) struct AddressSpace;

impl AddressSpace {
    /// The buffer holding `len` bytes at `addr`, and the offset of `addr` in it.
    fn find(addr: u64, len: u64) -> std::result::Result<(Arc<AtomicBuffer>, u64), Unmapped> {
        let mapped = MAPPED.read();
        let (start, w) = mapped.range(..=addr).next_back().ok_or(Unmapped)?;
        let buf = w.upgrade().ok_or(Unmapped)?;
        let offset = addr - start;
        if offset
            .checked_add(len)
            .is_none_or(|end| end > buf.byte_len() as u64)
        {
            return Err(Unmapped);
        }
        Ok((buf, offset))
    }
}

impl MemoryBacking for AddressSpace {
    fn len(&self) -> u64 {
        u64::MAX
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), Unmapped> {
        let (buf, at) = Self::find(offset, dst.len() as u64)?;
        buf.read(at, dst)
    }

    fn write(&self, offset: u64, src: &[u8]) -> std::result::Result<(), Unmapped> {
        let (buf, at) = Self::find(offset, src.len() as u64)?;
        buf.write(at, src)
    }

    fn atomic(&self, offset: u64, op: AtomicOp) -> std::result::Result<u64, Unmapped> {
        let (buf, at) = Self::find(offset, 8)?;
        buf.atomic(at, op)
    }

    fn prefetch(&self, offset: u64, len: u64, _write: bool) -> std::result::Result<(), Unmapped> {
        // Host buffers are always present: prefetching only checks that the range is mapped.
        Self::find(offset, len).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_space_maps_exactly_the_live_buffers() {
        let space = AddressSpace;
        let b = HostBuffer::new(100).unwrap();
        let at = b.addr();
        space.write(at + 10, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 3];
        b.read(10, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
        assert_eq!(space.read(at + 98, &mut out), Err(Unmapped), "past the end");
        assert_eq!(space.prefetch(at, 100, true), Ok(()));
        assert_eq!(space.prefetch(at, 101, true), Err(Unmapped));
        drop(b);
        assert_eq!(space.read(at, &mut out), Err(Unmapped), "after the drop");
        assert!(HostBuffer::new(0).is_err());
    }
}
