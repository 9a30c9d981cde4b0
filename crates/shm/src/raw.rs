//! The one place that turns offsets of a shared mapping into Rust values.
//!
//! A mailbox file is mapped `MAP_SHARED` by its owner and by the processes that send to it.
//! Everything above this module works with offsets; these accessors check every offset against
//! the mapping's length and alignment (with real checks, not debug assertions) before touching
//! memory, so an offset computed from a corrupted header can panic but never reach outside the
//! mapping.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::{MmapOptions, MmapRaw};

/// A shared, writable mapping of a whole file.
#[derive(Debug)]
pub(crate) struct Mapping {
    map: MmapRaw,
}

impl Mapping {
    /// Maps all of `file` (opened for reading and writing) shared.
    pub(crate) fn new(file: &File) -> io::Result<Self> {
        let map = MmapOptions::new().map_raw(file)?;
        Ok(Self { map })
    }

    /// The mapping's length in bytes.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Panics unless `offset..offset + len` lies in the mapping and `offset` is a multiple of
    /// `align` (a power of two).
    #[inline]
    fn check(&self, offset: usize, len: usize, align: usize) {
        // Inlined into every access (several per record); the panic is kept out of line.
        match offset.checked_add(len) {
            Some(end) if end <= self.len() && offset % align == 0 => {}
            _ => self.bad_offset(offset, len, align),
        }
    }

    #[cold]
    #[inline(never)]
    fn bad_offset(&self, offset: usize, len: usize, align: usize) -> ! {
        panic!(
            "{offset}+{len} (alignment {align}) outside a {}-byte mapping or misaligned",
            self.len()
        )
    }

    /// The 64-bit atomic word at `offset`.
    #[inline]
    pub(crate) fn u64_at(&self, offset: usize) -> &AtomicU64 {
        self.check(offset, 8, 8);
        // SAFETY: the word lies inside the mapping (checked above), which stays mapped while
        // `self` lives (the returned reference borrows `self`); the mapping is page-aligned and
        // `offset` a multiple of 8, so the address is aligned for `AtomicU64`. Every process
        // reaches this word only through atomic operations, so there is no non-atomic access
        // to race with.
        unsafe { &*self.map.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    /// The 32-bit atomic word at `offset` (also a futex word).
    #[inline]
    pub(crate) fn u32_at(&self, offset: usize) -> &AtomicU32 {
        self.check(offset, 4, 4);
        // SAFETY: as in `u64_at`: in bounds, 4-aligned, alive while `self` is, and accessed
        // atomically by every process.
        unsafe { &*self.map.as_ptr().add(offset).cast::<AtomicU32>() }
    }

    /// Runs `f` on the bytes at `offset..offset + len`.
    ///
    /// The ring protocol gives these bytes to the caller alone: a record is read only between
    /// the producer's release of the tail past it and the consumer's release of the head past
    /// it, and written only before that. A process that breaks the protocol can only be one of
    /// the same user (the file is private to the user), which could as well write this
    /// process's memory through `ptrace`.
    #[inline]
    pub(crate) fn with_bytes<R>(&self, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        self.check(offset, len, 1);
        // SAFETY: in bounds and mapped while `self` lives (the slice does not escape `f`); the
        // protocol above keeps other writers away from these bytes for the slice's lifetime.
        f(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset), len) })
    }

    /// Runs `f` on the bytes at `offset..offset + len`, to write them (see `with_bytes`).
    #[inline]
    pub(crate) fn with_bytes_mut<R>(&self, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        self.check(offset, len, 1);
        // SAFETY: in bounds and mapped while `self` lives; by the ring protocol the region
        // belongs to this producer alone until it publishes it, and no other slice of this
        // process covers it (a producer holds `&mut` of its ring state while filling).
        f(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(offset), len) })
    }
}
