//! Registered memory: what backs a memory region, and the device's key table through which the
//! engine reaches it.
//!
//! A region's bytes live behind a [`MemoryBacking`]. The safe Rust API uses [`AtomicBuffer`],
//! memory made of atomic words, so the device may read and write it from any thread while the
//! application holds the region, without `unsafe` and without data races. The C ABI provides a
//! backing over the application's raw memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::RwLock;
use softverbs_engine::memory::{AtomicOp, KeyRef, MemError, Memory};
use softverbs_engine::mw::{key_index, MwBind};

use crate::mw::Mw;
use crate::pd::{Mapping, Mr};
use crate::sync::NumberHash;

/// An access reached memory that is not mapped (or not with the needed protection) in the
/// process: possible for on-demand-paging regions, which are not pinned and may cover memory
/// the application never mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unmapped;

/// The bytes of a memory region, addressed by offset from its start.
///
/// Implementations must tolerate concurrent calls: the device accesses a region from its
/// progress thread while the application may access it too. Offsets passed in are always
/// within `len()`. An access to memory that is not there fails with [`Unmapped`] rather than
/// faulting.
pub trait MemoryBacking: Send + Sync + std::fmt::Debug {
    /// Length in bytes.
    fn len(&self) -> u64;
    /// Whether the region has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies bytes at `offset` into `dst`.
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), Unmapped>;
    /// Copies `src` to `offset`.
    fn write(&self, offset: u64, src: &[u8]) -> Result<(), Unmapped>;
    /// Atomically applies `op` to the 8-byte word at `offset` (8-byte aligned); returns the old
    /// value.
    fn atomic(&self, offset: u64, op: AtomicOp) -> Result<u64, Unmapped>;
    /// Makes `len` bytes at `offset` present, for writing too if `write` (`ibv_advise_mr`
    /// prefetch); fails if part of the range is not mapped. Memory that is always present has
    /// nothing to do.
    fn prefetch(&self, offset: u64, len: u64, write: bool) -> Result<(), Unmapped> {
        let _ = (offset, len, write);
        Ok(())
    }
    /// Where the first byte is in this process's memory, if the bytes are ordinary memory
    /// that another process of the user may copy straight out of, and that
    /// [`MemoryBacking::copy_from_process`] can fill. `None` (the default): payloads to and
    /// from the region travel as bytes.
    fn host_addr(&self) -> Option<u64> {
        None
    }
    /// Copies `len` bytes at `remote` ((address, length) in order) of process `pid` to
    /// `offset`, with one system call. Only backings with a [`MemoryBacking::host_addr`]
    /// support it.
    fn copy_from_process(
        &self,
        offset: u64,
        len: u64,
        pid: i32,
        remote: &[(u64, usize)],
    ) -> Result<(), Unmapped> {
        let _ = (offset, len, pid, remote);
        Err(Unmapped)
    }
}

/// Memory made of atomic 64-bit words: safe to share between the application and the device.
///
/// Whole words are copied with relaxed atomic loads and stores (plain moves on common
/// hardware); partial words at the edges are updated with atomic read-modify-write, so writes to
/// different bytes of one word never clobber each other.
#[derive(Debug)]
pub struct AtomicBuffer {
    words: Box<[AtomicU64]>,
    len: usize,
}

impl AtomicBuffer {
    /// A zeroed buffer of `len` bytes.
    pub fn new(len: usize) -> Self {
        let words = (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect();
        Self { words, len }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let b = Self::new(bytes.len());
        b.write_bytes(0, bytes);
        b
    }

    /// Length in bytes.
    pub fn byte_len(&self) -> usize {
        self.len
    }

    /// Address of the first byte, which names the buffer in scatter/gather lists.
    pub fn addr(&self) -> u64 {
        self.words.as_ptr() as u64
    }

    /// Copies `dst.len()` bytes at `offset` into `dst`. Panics if out of bounds.
    pub fn read_bytes(&self, offset: usize, dst: &mut [u8]) {
        assert!(offset + dst.len() <= self.len, "read past the end of the buffer");
        // Whole words move as fixed-size 8-byte copies (a plain load and store each); only the
        // unaligned edges go word by word below.
        let head = ((8 - offset % 8) % 8).min(dst.len());
        if dst.len() - head >= 8 {
            let (h, rest) = dst.split_at_mut(head);
            let whole = rest.len() / 8 * 8;
            let (mid, tail) = rest.split_at_mut(whole);
            self.read_edge(offset, h);
            for (chunk, w) in mid.chunks_exact_mut(8).zip(&self.words[(offset + head) / 8..]) {
                chunk.copy_from_slice(&w.load(Ordering::Relaxed).to_ne_bytes());
            }
            self.read_edge(offset + head + whole, tail);
            return;
        }
        self.read_edge(offset, dst);
    }

    fn read_edge(&self, offset: usize, dst: &mut [u8]) {
        let mut pos = offset;
        let mut out = 0;
        while out < dst.len() {
            let word = self.words[pos / 8].load(Ordering::Relaxed).to_ne_bytes();
            let start = pos % 8;
            let n = (8 - start).min(dst.len() - out);
            dst[out..out + n].copy_from_slice(&word[start..start + n]);
            out += n;
            pos += n;
        }
    }

    /// Copies `src` to `offset`. Panics if out of bounds.
    pub fn write_bytes(&self, offset: usize, src: &[u8]) {
        assert!(offset + src.len() <= self.len, "write past the end of the buffer");
        let head = ((8 - offset % 8) % 8).min(src.len());
        if src.len() - head >= 8 {
            let (h, rest) = src.split_at(head);
            let whole = rest.len() / 8 * 8;
            let (mid, tail) = rest.split_at(whole);
            self.write_edge(offset, h);
            for (chunk, w) in mid.chunks_exact(8).zip(&self.words[(offset + head) / 8..]) {
                w.store(
                    u64::from_ne_bytes(chunk.try_into().expect("8 bytes")),
                    Ordering::Relaxed,
                );
            }
            self.write_edge(offset + head + whole, tail);
            return;
        }
        self.write_edge(offset, src);
    }

    fn write_edge(&self, offset: usize, src: &[u8]) {
        let mut pos = offset;
        let mut done = 0;
        while done < src.len() {
            let start = pos % 8;
            let n = (8 - start).min(src.len() - done);
            let w = &self.words[pos / 8];
            if n == 8 {
                let v = u64::from_ne_bytes(src[done..done + 8].try_into().expect("8 bytes"));
                w.store(v, Ordering::Relaxed);
            } else {
                let mut bytes = [0u8; 8];
                let mut mask = [0u8; 8];
                bytes[start..start + n].copy_from_slice(&src[done..done + n]);
                mask[start..start + n].fill(0xFF);
                let (bits, mask) = (u64::from_ne_bytes(bytes), u64::from_ne_bytes(mask));
                // Clear then set only our bytes: other bytes of the word are left alone.
                w.fetch_and(!mask, Ordering::Relaxed);
                w.fetch_or(bits, Ordering::Relaxed);
            }
            done += n;
            pos += n;
        }
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.read_bytes(0, &mut v);
        v
    }

    /// Sets every byte to `value`.
    pub fn fill(&self, value: u8) {
        let word = u64::from_ne_bytes([value; 8]);
        for w in self.words.iter() {
            w.store(word, Ordering::Relaxed);
        }
    }

    /// The 8-byte word at `offset` (8-byte aligned), in host order.
    pub fn load_u64(&self, offset: usize) -> u64 {
        assert!(
            offset % 8 == 0 && offset + 8 <= self.len,
            "unaligned or out of bounds"
        );
        self.words[offset / 8].load(Ordering::SeqCst)
    }
}

impl MemoryBacking for AtomicBuffer {
    fn len(&self) -> u64 {
        self.len as u64
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), Unmapped> {
        self.read_bytes(offset as usize, dst);
        Ok(())
    }

    fn write(&self, offset: u64, src: &[u8]) -> Result<(), Unmapped> {
        self.write_bytes(offset as usize, src);
        Ok(())
    }

    fn host_addr(&self) -> Option<u64> {
        Some(self.addr())
    }

    fn copy_from_process(
        &self,
        offset: u64,
        len: u64,
        pid: i32,
        remote: &[(u64, usize)],
    ) -> Result<(), Unmapped> {
        softverbs_shm::read_into_words(pid, &self.words, offset as usize, len as usize, remote)
            .map_err(|_| Unmapped)
    }

    fn atomic(&self, offset: u64, op: AtomicOp) -> Result<u64, Unmapped> {
        let w = &self.words[offset as usize / 8];
        Ok(match op {
            AtomicOp::FetchAdd { add } => w.fetch_add(add, Ordering::SeqCst),
            AtomicOp::Store { value } => w.swap(value, Ordering::SeqCst),
            AtomicOp::CompareSwap { compare, swap } => {
                match w.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(v) | Err(v) => v,
                }
            }
        })
    }
}

/// The device's memory regions and windows by key.
#[derive(Debug, Default)]
pub(crate) struct KeyTable {
    lkeys: RwLock<HashMap<u32, Weak<Mr>, NumberHash>>,
    rkeys: RwLock<HashMap<u32, Weak<Mr>, NumberHash>>,
    /// Windows by key index (bits 8..32): the tag changes with every bind.
    windows: RwLock<HashMap<u32, Weak<Mw>, NumberHash>>,
}

/// Where an access lands: the region's memory, the offset into it, and where the region's first
/// byte is for alignment purposes ([`Mr::align_base`]).
type Place<'a> = (&'a dyn MemoryBacking, u64, u64);

impl KeyTable {
    pub(crate) fn insert(&self, mr: &Arc<Mr>) {
        self.lkeys.write().insert(mr.lkey(), Arc::downgrade(mr));
        self.rkeys.write().insert(mr.rkey(), Arc::downgrade(mr));
    }

    pub(crate) fn remove(&self, lkey: u32, rkey: u32) {
        self.lkeys.write().remove(&lkey);
        self.rkeys.write().remove(&rkey);
    }

    pub(crate) fn insert_mw(&self, rkey: u32, mw: &Arc<Mw>) {
        self.windows.write().insert(key_index(rkey), Arc::downgrade(mw));
    }

    pub(crate) fn remove_mw(&self, rkey: u32) {
        self.windows.write().remove(&key_index(rkey));
    }

    /// Invalidates the type 2 windows bound to QP `qpn`, which is being destroyed.
    pub(crate) fn release_qp_windows(&self, qpn: u32) {
        let windows: Vec<Arc<Mw>> = self.windows.read().values().filter_map(Weak::upgrade).collect();
        for mw in windows {
            mw.release_qp(qpn);
        }
    }

    /// The live region with local key `lkey`.
    pub(crate) fn by_lkey(&self, lkey: u32) -> Option<Arc<Mr>> {
        self.lkeys.read().get(&lkey).and_then(Weak::upgrade)
    }

    fn window(&self, rkey: u32) -> Option<Arc<Mw>> {
        self.windows.read().get(&key_index(rkey)).and_then(Weak::upgrade)
    }

    /// Resolves an access and runs `f` on the memory it lands in, with the checks and the
    /// access under the region's lock (and the window's, for a window key): a concurrent
    /// re-registration or invalidation happens wholly before or after it.
    fn with_place<R>(
        &self,
        key: KeyRef,
        addr: u64,
        len: u64,
        f: impl FnOnce(Place<'_>) -> R,
    ) -> Result<R, MemError> {
        self.with_mapping(key, addr, len, |mr, map, offset| {
            f((map.backing.as_ref(), offset, mr.align_base_in(map)))
        })
    }

    /// [`KeyTable::with_place`], handing `f` the region, its mapping and the offset.
    fn with_mapping<R>(
        &self,
        key: KeyRef,
        addr: u64,
        len: u64,
        f: impl FnOnce(&Arc<Mr>, &Mapping, u64) -> R,
    ) -> Result<R, MemError> {
        let table = if key.access.is_remote() {
            &self.rkeys
        } else {
            &self.lkeys
        };
        let mr = table.read().get(&key.key).and_then(Weak::upgrade);
        if let Some(mr) = mr {
            let map = mr.mapping().read();
            let offset = resolve_region(&map, key, addr, len)?;
            return Ok(f(&mr, &map, offset));
        }
        if !key.access.is_remote() {
            return Err(MemError::BadKey);
        }
        let mw = self.window(key.key).ok_or(MemError::BadKey)?;
        let st = mw.lock();
        let (_, iova) = st.window.resolve(key, addr, len)?;
        // A bound window holds its region, which cannot be re-registered meanwhile.
        let mr = st.mr.as_ref().ok_or(MemError::BadState)?;
        let map = mr.mapping().read();
        let offset = iova.checked_sub(map.iova).ok_or(MemError::OutOfRange)?;
        if offset.checked_add(len).is_none_or(|end| end > map.length) {
            return Err(MemError::OutOfRange);
        }
        Ok(f(mr, &map, offset))
    }
}

/// Where a later copy lands: the region, the memory it maps, the offset into it.
pub(crate) type CopyPlace = (Arc<Mr>, Arc<dyn MemoryBacking>, u64);

impl KeyTable {
    /// Resolves an access for a copy done later ([`crate::remote`]): the region, the memory
    /// it maps now and the offset into it, checked as any access is.
    pub(crate) fn place_for_copy(&self, key: KeyRef, addr: u64, len: u64) -> Result<CopyPlace, MemError> {
        self.with_mapping(key, addr, len, |mr, map, offset| {
            (mr.clone(), map.backing.clone(), offset)
        })
    }
}

impl KeyTable {
    /// [`KeyTable::place_for_copy`] in region `mr`, which `key` names.
    pub(crate) fn place_in(
        &self,
        mr: &Mr,
        key: KeyRef,
        addr: u64,
        len: u64,
    ) -> Result<(Arc<dyn MemoryBacking>, u64), MemError> {
        let map = mr.mapping().read();
        let offset = resolve_region(&map, key, addr, len)?;
        Ok((map.backing.clone(), offset))
    }
}

/// Checks an access to a region: PD, right and bounds; returns the offset into it.
fn resolve_region(map: &Mapping, key: KeyRef, addr: u64, len: u64) -> Result<u64, MemError> {
    if map.pd.handle() != key.pd {
        return Err(MemError::WrongPd);
    }
    if !map.access.contains(key.access.required_flags()) {
        return Err(MemError::NoAccess);
    }
    // Local keys use virtual addresses, remote keys the region's I/O virtual address.
    let base = if key.access.is_remote() {
        map.iova
    } else {
        map.addr
    };
    let offset = addr.checked_sub(base).ok_or(MemError::OutOfRange)?;
    if offset.checked_add(len).is_none_or(|end| end > map.length) {
        return Err(MemError::OutOfRange);
    }
    Ok(offset)
}

impl Memory for KeyTable {
    fn read(&self, key: KeyRef, addr: u64, dst: &mut [u8]) -> Result<(), MemError> {
        self.with_place(key, addr, dst.len() as u64, |(b, offset, _)| b.read(offset, dst))?
            .map_err(|_| MemError::Unmapped)
    }

    fn write(&self, key: KeyRef, addr: u64, src: &[u8]) -> Result<(), MemError> {
        self.with_place(key, addr, src.len() as u64, |(b, offset, _)| b.write(offset, src))?
            .map_err(|_| MemError::Unmapped)
    }

    fn check(&self, key: KeyRef, addr: u64, len: u64) -> Result<(), MemError> {
        self.with_place(key, addr, len, |_| ())
    }

    fn atomic(&self, key: KeyRef, addr: u64, op: AtomicOp) -> Result<u64, MemError> {
        self.with_place(key, addr, 8, |(b, offset, base)| {
            // Alignment is of the address in the region's own memory.
            if (base + offset) % 8 != 0 {
                return Err(MemError::Misaligned);
            }
            b.atomic(offset, op).map_err(|_| MemError::Unmapped)
        })?
    }

    fn flush(&self, key: KeyRef, addr: u64, len: u64, whole_region: bool) -> Result<(), MemError> {
        if whole_region {
            let table = if key.access.is_remote() {
                &self.rkeys
            } else {
                &self.lkeys
            };
            let mr = table.read().get(&key.key).and_then(Weak::upgrade);
            match mr {
                Some(mr) => {
                    let map = mr.mapping().read();
                    if map.pd.handle() != key.pd {
                        return Err(MemError::WrongPd);
                    }
                    if !map.access.contains(key.access.required_flags()) {
                        return Err(MemError::NoAccess);
                    }
                }
                // Windows grant no FLUSH right.
                None if self.window(key.key).is_some() => return Err(MemError::NoAccess),
                None => return Err(MemError::BadKey),
            }
        } else {
            self.with_place(key, addr, len, |_| ())?;
        }
        // The device's stores are plain stores into ordinary memory: making them globally
        // visible (and, for memory that is not persistent, "persistent" as far as it can be)
        // is a full fence.
        std::sync::atomic::fence(Ordering::SeqCst);
        Ok(())
    }

    fn bind_mw(&self, qpn: u32, pd: u32, bind: &MwBind) -> Result<(), MemError> {
        let mw = self.window(bind.mw_rkey).ok_or(MemError::BadKey)?;
        mw.execute_bind(self, qpn, pd, bind)
    }

    fn invalidate(&self, qpn: u32, pd: u32, rkey: u32) -> Result<(), MemError> {
        let mw = self.window(rkey).ok_or(MemError::BadKey)?;
        mw.execute_invalidate(qpn, pd, rkey)
    }

    fn locate(&self, key: KeyRef, addr: u64, len: u64) -> Result<Option<u64>, MemError> {
        self.with_place(key, addr, len, |(b, offset, _)| b.host_addr().map(|a| a + offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unaligned_reads_and_writes_round_trip() {
        let b = AtomicBuffer::new(37);
        let data: Vec<u8> = (0..37).collect();
        b.write_bytes(0, &data);
        assert_eq!(b.to_vec(), data);
        b.write_bytes(3, &[0xAA; 11]);
        let mut expect = data.clone();
        expect[3..14].fill(0xAA);
        assert_eq!(b.to_vec(), expect);
        let mut out = [0u8; 5];
        b.read_bytes(30, &mut out);
        assert_eq!(out, [30, 31, 32, 33, 34]);
    }

    proptest::proptest! {
        /// Reads and writes at any offset and length behave like a plain byte array.
        #[test]
        fn behaves_like_a_byte_array(len in 1usize..200, ops in proptest::collection::vec((0usize..200, 0usize..100, proptest::prelude::any::<u8>()), 1..20)) {
            let b = AtomicBuffer::new(len);
            let mut model = vec![0u8; len];
            for (off, n, v) in ops {
                let off = off % len;
                let n = n.min(len - off);
                let data: Vec<u8> = (0..n).map(|i| v.wrapping_add(i as u8)).collect();
                b.write_bytes(off, &data);
                model[off..off + n].copy_from_slice(&data);
                let mut got = vec![0u8; n];
                b.read_bytes(off, &mut got);
                proptest::prop_assert_eq!(&got[..], &model[off..off + n]);
            }
            proptest::prop_assert_eq!(b.to_vec(), model);
        }
    }

    #[test]
    fn partial_word_writes_from_threads_do_not_clobber() {
        let b = Arc::new(AtomicBuffer::new(8));
        let handles: Vec<_> = (0..8u8)
            .map(|i| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        b.write_bytes(i as usize, &[i + 1]);
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(b.to_vec(), vec![1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn atomics_are_atomic() {
        let b = Arc::new(AtomicBuffer::new(16));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        b.atomic(8, AtomicOp::FetchAdd { add: 1 }).unwrap();
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(b.load_u64(8), 4000);
        assert_eq!(
            b.atomic(
                8,
                AtomicOp::CompareSwap {
                    compare: 4000,
                    swap: 7
                }
            ),
            Ok(4000)
        );
        assert_eq!(b.atomic(8, AtomicOp::CompareSwap { compare: 1, swap: 9 }), Ok(7));
        assert_eq!(b.load_u64(8), 7);
    }
}
