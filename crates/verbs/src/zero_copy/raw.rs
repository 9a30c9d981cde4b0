//! The `unsafe` half of zero-copy registration: the bytes of application memory reached through
//! a raw pointer, by the device and by the application, without data races.
//!
//! This is the only module of the safe API that may use `unsafe` (see ARCHITECTURE.md,
//! "Registered memory"). Everything here serves one type, [`RawBytes`], and the argument for
//! its soundness is written once, here:
//!
//! - **Validity.** A `RawBytes` is made from memory that stays allocated, at one address, until
//!   [`RawBytes::retire`] has returned: an owned buffer ([`StableBuffer`]) that the region
//!   keeps (boxed, never touched) until then, or a borrow the region cannot outlive (the
//!   contract of [`ProtectionDomain::register_borrowed`]; [`ProtectionDomain::scoped`] keeps it
//!   by construction).
//! - **No data race between device threads.** Every access the device makes (and every copying
//!   accessor of the application) is atomic, in a fixed grid: the 8-byte aligned words that lie
//!   wholly inside the memory are only ever accessed as `AtomicU64`, the at most 7 bytes before
//!   the first and after the last such word only as `AtomicU8`. Which size a byte is accessed
//!   with depends on its address alone, so two atomic accesses of different sizes never
//!   overlap. Partial updates of a word are one compare-and-swap.
//! - **No data race with the application's references.** Slices (`&[u8]`, `&mut [u8]`) exist
//!   only inside a guard. Every counted access first registers in the state word and gives up
//!   (the device turns that into a protection error) if a guard excludes it; a guard announces
//!   itself in the same word and then waits until the accesses it excludes that were already
//!   in progress have left. The Acquire/Release operations on the word order every device
//!   access before or after the guard's lifetime, so no atomic access is concurrent with a
//!   non-atomic one. A shared guard ([`RawBytes::lock_shared`]) excludes writes; an exclusive
//!   one ([`RawBytes::lock_exclusive`]) excludes everything; [`RawBytes::retire`] excludes
//!   everything forever, after which the memory may be freed.
//! - **The kernel as a device.** A payload copied from another process
//!   ([`RawBytes::copy_from_process`]) is written by the kernel (`process_vm_readv(2)`), inside a
//!   counted write and through a raw `iovec`, never through a Rust reference: like DMA by a NIC.
//!   Other processes may also read the memory by address (the payload of a SEND or READ
//!   response this process posted for a shared-memory peer, see ARCHITECTURE.md); a read by
//!   another process cannot make this one's accesses racy, and [`RawBytes::host_addr`] stops
//!   offering the address while an exclusive guard is held or after retirement.
//!
//! [`ProtectionDomain::register_borrowed`]: crate::ProtectionDomain::register_borrowed
//! [`ProtectionDomain::scoped`]: crate::ProtectionDomain::scoped

#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use softverbs_device::mem::Unmapped;
use softverbs_engine::memory::AtomicOp;
use softverbs_engine::types::AccessFlags;
use softverbs_engine::Result;

use super::{BorrowedRegion, OwnedRegion};
use crate::pd::ProtectionDomain;

/// Memory whose bytes stay at one address while the value is moved, so that a device may be
/// handed their address: what [`ProtectionDomain::register_owned`] takes.
///
/// Implemented for `Vec<u8>`, `Box<[u8]>`, `bytes::BytesMut` and `memmap2::MmapMut`
/// (anonymous, huge-page or file-backed mappings).
///
/// # Safety
///
/// [`StableBuffer::as_raw`] must return a pointer to `len` bytes, valid for reads and writes,
/// that stay allocated and at that address until the value is dropped, even if the value is
/// moved meanwhile, provided no other method of the value is called; and nothing else may read
/// or write those bytes meanwhile (no other handle to them may exist). The region keeps the
/// value boxed and calls nothing on it until it hands it back or drops it.
///
/// [`ProtectionDomain::register_owned`]: crate::ProtectionDomain::register_owned
pub unsafe trait StableBuffer: Send + 'static {
    /// The first byte and the length. Called once, when the buffer is registered.
    fn as_raw(&mut self) -> (*mut u8, usize);
}

// SAFETY: a vector's heap buffer does not move when the vector does, and `as_mut_ptr` makes no
// intermediate reference to it (its documentation guarantees this for the aliasing model);
// only the vector (which the region keeps and does not use) frees or reallocates it.
unsafe impl StableBuffer for Vec<u8> {
    fn as_raw(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: the box's allocation does not move when the box does; the region keeps the box inside
// another box, so moving the region never retags it.
unsafe impl StableBuffer for Box<[u8]> {
    fn as_raw(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: a `BytesMut` owns its range of a heap buffer exclusively (views split off it cover
// other ranges), and the range does not move when the handle does.
unsafe impl StableBuffer for bytes::BytesMut {
    fn as_raw(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: a mapping stays at its address until it is unmapped, which only dropping the
// `MmapMut` does. (For a file mapping, memmap2's own constructor is `unsafe`: its caller
// promised that nothing else modifies the file meanwhile.)
unsafe impl StableBuffer for memmap2::MmapMut {
    fn as_raw(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// The state word: accesses in progress, guards held, and retirement.
const WRITER: u64 = 1;
const WRITERS: u64 = (1 << 20) - 1;
const READER: u64 = 1 << 20;
const READERS: u64 = WRITERS << 20;
const SHARED_GUARD: u64 = 1 << 40;
const SHARED_GUARDS: u64 = WRITERS << 40;
const EXCLUSIVE: u64 = 1 << 62;
const GONE: u64 = 1 << 63;

/// `len` bytes at a raw address, reached by atomic accesses in a fixed grid or through guards
/// (see the module documentation).
#[derive(Debug)]
pub(crate) struct RawBytes {
    base: NonNull<u8>,
    len: usize,
    /// Bytes before the first 8-byte aligned address (at most `len`).
    head: usize,
    /// 8-byte aligned words after them that lie wholly inside the memory.
    words: usize,
    state: AtomicU64,
}

// SAFETY: the pointer is only dereferenced through the atomic accesses and guards of this
// module, which are free of data races from any thread (module documentation).
unsafe impl Send for RawBytes {}
// SAFETY: as for `Send`: shared use from several threads is what the state word arbitrates.
unsafe impl Sync for RawBytes {}

/// A counted access in progress; leaves on drop.
struct Access<'a> {
    state: &'a AtomicU64,
    one: u64,
}

impl Drop for Access<'_> {
    fn drop(&mut self) {
        self.state.fetch_sub(self.one, Ordering::Release);
    }
}

/// Waits a moment for accesses in progress to leave (each is one bounded copy).
fn pause(spins: &mut u32) {
    *spins += 1;
    if *spins < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

impl RawBytes {
    /// The bytes at `base`.
    ///
    /// # Safety
    /// `base` must point to `len` bytes valid for reads and writes that stay allocated until
    /// [`RawBytes::retire`] has returned, and that nothing but this `RawBytes` accesses
    /// meanwhile.
    unsafe fn new(base: NonNull<u8>, len: usize) -> Self {
        let head = base.as_ptr().align_offset(8).min(len);
        let words = (len - head) / 8;
        Self {
            base,
            len,
            head,
            words,
            state: AtomicU64::new(0),
        }
    }

    /// Address of the first byte.
    pub(crate) fn addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Starts a counted access; refused while a guard excludes it or once retired.
    fn enter(&self, write: bool) -> Result<Access<'_>, Unmapped> {
        let (one, excluded) = if write {
            (WRITER, EXCLUSIVE | GONE | SHARED_GUARDS)
        } else {
            (READER, EXCLUSIVE | GONE)
        };
        let access = Access {
            state: &self.state,
            one,
        };
        let before = self.state.fetch_add(one, Ordering::Acquire);
        if before & excluded != 0 {
            // `access` leaves again as it drops.
            return Err(Unmapped);
        }
        Ok(access)
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), Unmapped> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Unmapped),
        }
    }

    /// The word `index` of the grid (`index < words`).
    fn word(&self, index: usize) -> &AtomicU64 {
        debug_assert!(index < self.words);
        // SAFETY: `head + 8 * index + 8 <= len`, so the word lies inside the memory, which is
        // valid while `self` is (callers are inside an entered access, so it is not retired);
        // `head` makes it 8-byte aligned. Bytes of grid words are only accessed as this
        // `AtomicU64` outside guards, and guards exclude these accesses (module docs).
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(self.head + 8 * index).cast()) }
    }

    /// The edge byte at `offset` (before the first or after the last grid word).
    fn edge(&self, offset: usize) -> &AtomicU8 {
        debug_assert!(offset < self.head || offset >= self.head + 8 * self.words);
        debug_assert!(offset < self.len);
        // SAFETY: `offset < len`, inside the memory; edge bytes are only accessed as this
        // `AtomicU8` outside guards, which exclude these accesses (module docs).
        unsafe { AtomicU8::from_ptr(self.base.as_ptr().add(offset)) }
    }

    /// Copies bytes at `offset` into `dst` (a counted read).
    pub(crate) fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), Unmapped> {
        self.check(offset, dst.len())?;
        let _access = self.enter(false)?;
        let grid_end = self.head + 8 * self.words;
        let mut at = offset;
        let mut out = 0;
        while out < dst.len() {
            if at < self.head || at >= grid_end {
                dst[out] = self.edge(at).load(Ordering::Relaxed);
                at += 1;
                out += 1;
                continue;
            }
            let start = (at - self.head) % 8;
            let n = (8 - start).min(dst.len() - out);
            let word = self
                .word((at - self.head) / 8)
                .load(Ordering::Relaxed)
                .to_ne_bytes();
            dst[out..out + n].copy_from_slice(&word[start..start + n]);
            at += n;
            out += n;
        }
        Ok(())
    }

    /// Copies `src` to `offset` (a counted write).
    pub(crate) fn write(&self, offset: usize, src: &[u8]) -> Result<(), Unmapped> {
        self.check(offset, src.len())?;
        let _access = self.enter(true)?;
        let grid_end = self.head + 8 * self.words;
        let mut at = offset;
        let mut done = 0;
        while done < src.len() {
            if at < self.head || at >= grid_end {
                self.edge(at).store(src[done], Ordering::Relaxed);
                at += 1;
                done += 1;
                continue;
            }
            let start = (at - self.head) % 8;
            let n = (8 - start).min(src.len() - done);
            let word = self.word((at - self.head) / 8);
            if n == 8 {
                let v = u64::from_ne_bytes(src[done..done + 8].try_into().expect("8 bytes"));
                word.store(v, Ordering::Relaxed);
            } else {
                let mut bits = [0u8; 8];
                let mut mask = [0u8; 8];
                bits[start..start + n].copy_from_slice(&src[done..done + n]);
                mask[start..start + n].fill(0xFF);
                let (bits, mask) = (u64::from_ne_bytes(bits), u64::from_ne_bytes(mask));
                // One read-modify-write: the other bytes of the word are left as they are.
                let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                    Some((old & !mask) | bits)
                });
            }
            at += n;
            done += n;
        }
        Ok(())
    }

    /// Applies `op` to the 8-byte aligned word at `offset` (a counted write); the old value.
    pub(crate) fn atomic(&self, offset: usize, op: AtomicOp) -> Result<u64, Unmapped> {
        self.check(offset, 8)?;
        if offset < self.head || (offset - self.head) % 8 != 0 {
            return Err(Unmapped);
        }
        let _access = self.enter(true)?;
        let word = self.word((offset - self.head) / 8);
        Ok(match op {
            AtomicOp::FetchAdd { add } => word.fetch_add(add, Ordering::SeqCst),
            AtomicOp::Store { value } => word.swap(value, Ordering::SeqCst),
            AtomicOp::CompareSwap { compare, swap } => {
                match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(v) | Err(v) => v,
                }
            }
        })
    }

    /// The address other processes may copy payloads from: none while an exclusive guard is
    /// held or once retired.
    pub(crate) fn host_addr(&self) -> Option<u64> {
        (self.state.load(Ordering::Acquire) & (EXCLUSIVE | GONE) == 0).then(|| self.addr())
    }

    /// Copies `len` bytes at `remote` ((address, length) in order) of process `pid` to
    /// `offset`, with one `process_vm_readv(2)` (a counted write).
    pub(crate) fn copy_from_process(
        &self,
        offset: usize,
        len: usize,
        pid: i32,
        remote: &[(u64, usize)],
    ) -> Result<(), Unmapped> {
        self.check(offset, len)?;
        let total = remote.iter().try_fold(0usize, |t, r| t.checked_add(r.1));
        if total != Some(len) || remote.len() > 1024 {
            return Err(Unmapped);
        }
        if len == 0 {
            return Ok(());
        }
        let _access = self.enter(true)?;
        let local = libc::iovec {
            // SAFETY: `offset + len <= self.len` (checked above): inside the memory.
            iov_base: unsafe { self.base.as_ptr().add(offset) }.cast(),
            iov_len: len,
        };
        let remote: Vec<libc::iovec> = remote
            .iter()
            .map(|&(base, len)| libc::iovec {
                iov_base: base as usize as *mut libc::c_void,
                iov_len: len,
            })
            .collect();
        // SAFETY: the local iovec covers `len` bytes inside the memory, valid while this
        // counted write is in progress; the kernel writes them as a device would (no Rust
        // reference to them exists: guards are excluded meanwhile, module docs). The remote
        // iovecs are addresses in the other process, which the kernel checks (a bad one is an
        // error, never a write here).
        let got = unsafe {
            libc::process_vm_readv(pid, &local, 1, remote.as_ptr(), remote.len() as libc::c_ulong, 0)
        };
        if got == len as isize {
            Ok(())
        } else {
            Err(Unmapped)
        }
    }

    /// A shared guard: the bytes as a slice, while device (and copying) writes are refused;
    /// reads go on. Waits for writes in progress.
    pub(crate) fn lock_shared(&self) -> SharedLock<'_> {
        let mut cur = self.state.load(Ordering::Relaxed);
        loop {
            assert!(
                cur & SHARED_GUARDS != SHARED_GUARDS,
                "too many shared guards of one region"
            );
            match self.state.compare_exchange_weak(
                cur,
                cur + SHARED_GUARD,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        let mut spins = 0;
        while self.state.load(Ordering::Acquire) & WRITERS != 0 {
            pause(&mut spins);
        }
        SharedLock { bytes: self }
    }

    /// An exclusive guard: the bytes as a mutable slice, while every counted access is
    /// refused. Waits for accesses in progress. The caller must hold the only handle that may
    /// take guards (a `&mut` of the region), so no shared guard is alive.
    pub(crate) fn lock_exclusive(&self) -> ExclusiveLock<'_> {
        self.state.fetch_or(EXCLUSIVE, Ordering::Acquire);
        let mut spins = 0;
        while self.state.load(Ordering::Acquire) & (READERS | WRITERS) != 0 {
            pause(&mut spins);
        }
        ExclusiveLock { bytes: self }
    }

    /// Refuses every later access and waits for those in progress: afterwards nothing here
    /// touches the memory again, and it may be freed.
    pub(crate) fn retire(&self) {
        self.state.fetch_or(GONE, Ordering::Acquire);
        let mut spins = 0;
        while self.state.load(Ordering::Acquire) & (READERS | WRITERS) != 0 {
            pause(&mut spins);
        }
    }
}

/// A shared guard of [`RawBytes`].
#[derive(Debug)]
pub(crate) struct SharedLock<'a> {
    bytes: &'a RawBytes,
}

impl SharedLock<'_> {
    pub(crate) fn slice(&self) -> &[u8] {
        // SAFETY: the memory is valid (not retired: the region that owns this `RawBytes` is
        // borrowed by the guard), and while the guard lives no write reaches it: counted writes
        // are refused and those in progress have left (module docs); reads are atomic or
        // through other shared slices, which do not race with this one.
        unsafe { std::slice::from_raw_parts(self.bytes.base.as_ptr(), self.bytes.len) }
    }
}

impl Drop for SharedLock<'_> {
    fn drop(&mut self) {
        self.bytes.state.fetch_sub(SHARED_GUARD, Ordering::Release);
    }
}

/// An exclusive guard of [`RawBytes`].
#[derive(Debug)]
pub(crate) struct ExclusiveLock<'a> {
    bytes: &'a RawBytes,
}

impl ExclusiveLock<'_> {
    pub(crate) fn slice(&self) -> &[u8] {
        // SAFETY: as in `slice_mut`, for a shared view.
        unsafe { std::slice::from_raw_parts(self.bytes.base.as_ptr(), self.bytes.len) }
    }

    pub(crate) fn slice_mut(&mut self) -> &mut [u8] {
        // SAFETY: the memory is valid (the region is mutably borrowed by the guard, so not
        // retired), every counted access is refused and those in progress have left (module
        // docs), and the region's `&mut` borrow rules out any other guard: this is the only
        // access, and `&mut self` makes it unique.
        unsafe { std::slice::from_raw_parts_mut(self.bytes.base.as_ptr(), self.bytes.len) }
    }
}

impl Drop for ExclusiveLock<'_> {
    fn drop(&mut self) {
        self.bytes.state.fetch_and(!EXCLUSIVE, Ordering::Release);
    }
}

/// Registers the memory of `buf`, boxed so that moving the region never moves it.
pub(crate) fn raw_of_owned<B: StableBuffer>(buf: &mut B) -> Option<RawBytes> {
    let (ptr, len) = buf.as_raw();
    let base = NonNull::new(ptr)?;
    // SAFETY: `StableBuffer`'s contract: the bytes stay valid at this address while the value
    // lives and nothing else touches them; the region keeps the value (untouched) until it has
    // retired this `RawBytes`.
    Some(unsafe { RawBytes::new(base, len) })
}

impl ProtectionDomain {
    /// `ibv_reg_mr` of memory this program lends to the device, without a copy: the region
    /// reaches `buf` by address until it is dropped (or deregistered).
    ///
    /// Access rules are as for [`ProtectionDomain::register_owned`]: the region's copying
    /// accessors, its guards ([`BorrowedRegion::local`], [`BorrowedRegion::local_mut`]) and
    /// the device never race. Dropping the region deregisters it, then waits for device
    /// accesses in progress and refuses every later one, so once it is gone the borrow may end.
    /// [`ProtectionDomain::scoped`] is the safe form.
    ///
    /// # Safety
    ///
    /// The returned region must be dropped (or [`BorrowedRegion::dereg`]istered) before `'a`
    /// ends: it must not be leaked (`std::mem::forget`, a reference cycle, a `static`), since
    /// dropping it is what stops the device. (Rust cannot check this: a leaked value never runs
    /// its destructor, and the borrow checker then lets the buffer be used or freed while the
    /// device still writes it.)
    ///
    /// ```
    /// # use softverbs::{devices, AccessFlags};
    /// # let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").unwrap().open()?;
    /// # let pd = ctx.alloc_pd()?;
    /// let mut buf = [0u8; 256];
    /// // SAFETY: the region is dropped at the end of this block, before `buf` is used again.
    /// # #[allow(unsafe_code)]
    /// {
    ///     let mr = unsafe { pd.register_borrowed(&mut buf, AccessFlags::LOCAL_WRITE)? };
    ///     mr.write(0, b"lent")?;
    /// }
    /// assert_eq!(&buf[..4], b"lent");
    /// # Ok::<(), softverbs::Error>(())
    /// ```
    pub unsafe fn register_borrowed<'a>(
        &self,
        buf: &'a mut [u8],
        access: AccessFlags,
    ) -> Result<BorrowedRegion<'a>> {
        let len = buf.len();
        let base = NonNull::new(buf.as_mut_ptr()).expect("slices are never null");
        // SAFETY: `buf` is borrowed mutably for `'a`, so nothing else touches it, and the
        // caller promises the region is dropped (which retires the bytes) before `'a` ends.
        let raw = unsafe { RawBytes::new(base, len) };
        BorrowedRegion::new(self, raw, access)
    }

    /// Registers `buf` for the duration of `f`, without a copy, and deregisters it when `f`
    /// returns (or panics): the safe form of [`ProtectionDomain::register_borrowed`]. Returns
    /// `f`'s result, or the registration's error.
    ///
    /// ```
    /// # use softverbs::{devices, AccessFlags};
    /// # let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").unwrap().open()?;
    /// # let pd = ctx.alloc_pd()?;
    /// let mut buf = vec![0u8; 4096];
    /// let lkey = pd.scoped(&mut buf, AccessFlags::LOCAL_WRITE, |mr| {
    ///     mr.local_mut()[..5].copy_from_slice(b"hello");
    ///     mr.lkey()
    /// })?;
    /// assert_ne!(lkey, 0);
    /// assert_eq!(&buf[..5], b"hello");
    /// # Ok::<(), softverbs::Error>(())
    /// ```
    pub fn scoped<R>(
        &self,
        buf: &mut [u8],
        access: AccessFlags,
        f: impl FnOnce(&mut BorrowedRegion<'_>) -> R,
    ) -> Result<R> {
        // SAFETY: the region lives in this frame only; `f` gets a reference to it (it cannot
        // leak what it does not own), and it is dropped, at the latest while unwinding, before
        // this function returns and the borrow of `buf` ends.
        let mut region = unsafe { self.register_borrowed(buf, access)? };
        Ok(f(&mut region))
    }

    /// Registers memory the region takes ownership of, without a copy; see [`OwnedRegion`].
    ///
    /// On failure (a length of 0, invalid access flags, device limits) the buffer comes back
    /// in the error.
    pub fn register_owned<B: StableBuffer>(
        &self,
        buf: B,
        access: AccessFlags,
    ) -> std::result::Result<OwnedRegion<B>, super::RegisterError<B>> {
        OwnedRegion::new(self, buf, access)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn over(v: &mut [u8]) -> RawBytes {
        let base = NonNull::new(v.as_mut_ptr()).unwrap();
        // SAFETY: the tests keep `v` alive and untouched while the `RawBytes` lives.
        unsafe { RawBytes::new(base, v.len()) }
    }

    proptest::proptest! {
        /// Reads and writes at any alignment and length behave like a plain byte array.
        #[test]
        fn behaves_like_a_byte_array(
            skew in 0usize..8,
            len in 1usize..120,
            ops in proptest::collection::vec((0usize..120, 0usize..60, proptest::prelude::any::<u8>()), 1..20),
        ) {
            let mut store = vec![0u8; len + 8];
            let mut model = vec![0u8; len];
            {
                let raw = over(&mut store[skew..skew + len]);
                for (off, n, v) in ops {
                    let off = off % len;
                    let n = n.min(len - off);
                    let data: Vec<u8> = (0..n).map(|i| v.wrapping_add(i as u8)).collect();
                    raw.write(off, &data).unwrap();
                    model[off..off + n].copy_from_slice(&data);
                    let mut got = vec![0u8; n];
                    raw.read(off, &mut got).unwrap();
                    proptest::prop_assert_eq!(&got[..], &model[off..off + n]);
                }
                let mut all = vec![0u8; len];
                raw.read(0, &mut all).unwrap();
                proptest::prop_assert_eq!(&all, &model);
                raw.retire();
            }
            proptest::prop_assert_eq!(&store[skew..skew + len], &model[..]);
        }
    }

    #[test]
    fn bounds_alignment_and_atomics() {
        let mut store = [0u8; 40];
        let raw = over(&mut store[3..35]);
        let mut b = [0u8; 4];
        assert_eq!(raw.read(30, &mut b), Err(Unmapped), "past the end");
        assert_eq!(raw.write(usize::MAX, &b), Err(Unmapped), "overflow");
        let aligned = (8 - (raw.addr() % 8) as usize) % 8;
        assert_eq!(raw.atomic(aligned, AtomicOp::FetchAdd { add: 5 }), Ok(0));
        assert_eq!(
            raw.atomic(aligned, AtomicOp::CompareSwap { compare: 5, swap: 9 }),
            Ok(5)
        );
        assert_eq!(
            raw.atomic(aligned + 1, AtomicOp::Store { value: 1 }),
            Err(Unmapped)
        );
        let mut w = [0u8; 8];
        raw.read(aligned, &mut w).unwrap();
        assert_eq!(u64::from_ne_bytes(w), 9);
        raw.retire();
    }

    #[test]
    fn guards_exclude_what_they_must() {
        let mut v = vec![7u8; 64];
        let raw = over(&mut v);
        let mut b = [0u8; 8];
        {
            let shared = raw.lock_shared();
            assert_eq!(shared.slice()[..4], [7; 4]);
            assert!(raw.read(0, &mut b).is_ok(), "reads go on under a shared guard");
            assert_eq!(raw.write(0, &b), Err(Unmapped), "writes are refused");
            assert_eq!(raw.atomic(0, AtomicOp::FetchAdd { add: 1 }), Err(Unmapped));
            assert_eq!(raw.copy_from_process(0, 0, 0, &[]), Ok(()), "nothing to copy");
            assert!(raw.host_addr().is_some());
        }
        assert!(raw.write(0, &[1]).is_ok());
        {
            let mut excl = raw.lock_exclusive();
            excl.slice_mut()[1] = 2;
            assert_eq!(raw.read(0, &mut b), Err(Unmapped), "reads are refused too");
            assert_eq!(raw.host_addr(), None, "no address for other processes meanwhile");
        }
        raw.read(0, &mut b).unwrap();
        assert_eq!(b[..3], [1, 2, 7]);
        raw.retire();
        assert_eq!(raw.read(0, &mut b), Err(Unmapped), "nothing after retirement");
        assert_eq!(raw.host_addr(), None);
    }

    #[test]
    fn a_guard_waits_for_writes_in_progress_and_sees_them_whole() {
        // Writers fill 4 KiB blocks with one byte value each; a snapshot under a guard must
        // never show a block half written.
        let mut v = vec![0u8; 64 * 1024];
        let raw = over(&mut v);
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let raw = &raw;
            let stop = &stop;
            for t in 0..2u8 {
                s.spawn(move || {
                    let mut k = 0u8;
                    while !stop.load(Ordering::Relaxed) {
                        k = k.wrapping_add(1);
                        let block = [k ^ (t * 0x55); 4096];
                        let at = (usize::from(k) % 16) * 4096;
                        let _ = raw.write(at, &block);
                    }
                });
            }
            for _ in 0..200 {
                let g = raw.lock_shared();
                for block in g.slice().chunks(4096) {
                    assert!(block.iter().all(|&b| b == block[0]), "a torn block");
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        raw.retire();
    }

    #[test]
    fn copies_from_a_process_into_the_grid() {
        let src: Vec<u8> = (0..100u8).collect();
        let me = std::process::id() as i32;
        let a = src.as_ptr() as u64;
        let mut store = [0u8; 50];
        {
            let raw = over(&mut store[1..41]);
            raw.copy_from_process(2, 30, me, &[(a + 10, 20), (a + 50, 10)])
                .unwrap();
            assert_eq!(
                raw.copy_from_process(0, 8, me, &[(a, 4)]),
                Err(Unmapped),
                "lengths differ"
            );
            assert_eq!(
                raw.copy_from_process(0, 8, me, &[(8, 8)]),
                Err(Unmapped),
                "unmapped source"
            );
            assert_eq!(
                raw.copy_from_process(35, 8, me, &[(a, 8)]),
                Err(Unmapped),
                "past the end"
            );
            raw.retire();
        }
        assert_eq!(&store[3..23], &src[10..30]);
        assert_eq!(&store[23..33], &src[50..60]);
        assert!(store[..3].iter().chain(&store[33..]).all(|&b| b == 0));
    }
}
