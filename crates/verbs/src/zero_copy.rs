//! Registering memory the program owns, without a copy.
//!
//! [`ProtectionDomain::register`] allocates the region's memory itself, as atomic words, and the
//! program reads and writes it through copying accessors. Here the program brings the memory:
//!
//! - [`ProtectionDomain::register_owned`] takes a `Vec<u8>`, `Box<[u8]>`, `bytes::BytesMut` or
//!   `memmap2::MmapMut` (anonymous, huge pages, a file) by value, and [`OwnedRegion::dereg`]
//!   hands it back, with whatever the device and the program wrote into it, without a copy.
//! - [`ProtectionDomain::scoped`] lends a `&mut [u8]` for the duration of a closure;
//!   [`ProtectionDomain::register_borrowed`] is the `unsafe` form without a closure.
//!
//! # What may touch the bytes, and when
//!
//! The device reads and writes a registered region from its own threads at any time: a peer's
//! RDMA WRITE lands whenever it arrives, a receive fills its buffer when a message comes, and
//! nothing in the type system says when. Handing out `&[u8]`/`&mut [u8]` of such memory while
//! the device may write it would be a data race, which is why [`MemoryRegion`]'s accessors
//! copy. These regions follow one rule, enforced at run time by a state word per region (see
//! the `raw` module for the argument in full):
//!
//! - The device's accesses, and the copying accessors every region has (through `Deref` to
//!   [`MemoryRegion`]: [`MemoryRegion::read`], [`MemoryRegion::write`], ...), are atomic
//!   accesses in a fixed grid: they never race with each other.
//! - Slices exist only inside guards. [`OwnedRegion::local`] gives `&[u8]` while the device
//!   keeps reading (a SEND from the region proceeds) but every write to the region is refused;
//!   [`OwnedRegion::local_mut`] gives `&mut [u8]` while every access is refused. A guard waits
//!   for the accesses it excludes that are already under way (each is one bounded copy), and a
//!   refused access fails as an access to unregistered memory does: a local work request
//!   completes with `IBV_WC_LOC_PROT_ERR`, a peer's request is NAKed (`IBV_WC_REM_ACCESS_ERR`
//!   at the peer), a copying write returns an error. Nothing blocks on a guard, so holding one
//!   never deadlocks the device, and nothing is lost silently.
//! - Dropping or deregistering a region first deregisters it, then refuses every later access
//!   and waits for those in progress; only then is the buffer handed back or freed. This holds
//!   even if memory windows still hold the region (where [`MemoryRegion::dereg`] is EBUSY).
//!
//! So a correct program, which touches a buffer only while no work request uses it and no peer
//! is told to write it, gets slices without a copy and never sees a refusal; an incorrect one
//! gets error completions, not undefined behaviour.
//!
//! The region's bytes are also reached by address from other processes: payloads of at least
//! 8 KiB that this process sends (or returns for a peer's READ) to a peer on this host over
//! shared memory are copied once, by the peer, straight out of this memory (ARCHITECTURE.md,
//! "Payloads move once"), as they are for the C library's memory. Those are reads by the
//! kernel for another process: they cannot make this process's accesses racy, but a buffer
//! changed or freed while such a work request is outstanding changes what the peer receives.
//! That is the usual verbs rule (a posted buffer belongs to the device until its completion),
//! and the async API (`softverbs::aio`, feature `tokio`) makes the type system hold it: a
//! work request there owns its buffer.
//!
//! ```
//! use softverbs::{devices, AccessFlags};
//!
//! let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").unwrap().open()?;
//! let pd = ctx.alloc_pd()?;
//! let v = vec![0u8; 1 << 16];
//! let at = v.as_ptr() as u64;
//! let mut mr = pd.register_owned(v, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
//! assert_eq!(mr.addr(), at, "the region is the vector's own memory");
//! mr.local_mut()[..5].copy_from_slice(b"hello"); // no copy, no peer access meanwhile
//! mr.write(5, b", world")?; // a copying write, allowed at any time
//! let v = mr.dereg().map_err(|(_, e)| e)?;
//! assert_eq!(&v[..12], b"hello, world");
//! # Ok::<(), softverbs::Error>(())
//! ```

mod raw;

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use softverbs_device::mem::{MemoryBacking, Unmapped};
use softverbs_engine::memory::AtomicOp;
use softverbs_engine::types::AccessFlags;
use softverbs_engine::{Error, Result};

use crate::pd::{MemoryRegion, ProtectionDomain};
pub use raw::StableBuffer;
use raw::{ExclusiveLock, RawBytes, SharedLock};

impl MemoryBacking for RawBytes {
    fn len(&self) -> u64 {
        Self::len(self) as u64
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), Unmapped> {
        Self::read(self, usize::try_from(offset).map_err(|_| Unmapped)?, dst)
    }

    fn write(&self, offset: u64, src: &[u8]) -> Result<(), Unmapped> {
        Self::write(self, usize::try_from(offset).map_err(|_| Unmapped)?, src)
    }

    fn atomic(&self, offset: u64, op: AtomicOp) -> Result<u64, Unmapped> {
        Self::atomic(self, usize::try_from(offset).map_err(|_| Unmapped)?, op)
    }

    fn host_addr(&self) -> Option<u64> {
        Self::host_addr(self)
    }

    fn copy_from_process(
        &self,
        offset: u64,
        len: u64,
        pid: i32,
        remote: &[(u64, usize)],
    ) -> Result<(), Unmapped> {
        let offset = usize::try_from(offset).map_err(|_| Unmapped)?;
        let len = usize::try_from(len).map_err(|_| Unmapped)?;
        Self::copy_from_process(self, offset, len, pid, remote)
    }
}

/// Why [`ProtectionDomain::register_owned`] failed, with the buffer handed back.
pub struct RegisterError<B> {
    /// The registration's error (EINVAL for a length of 0 or bad access flags, ENOMEM at the
    /// device's limits).
    pub error: Error,
    /// The buffer, unchanged.
    pub buffer: B,
}

impl<B> std::fmt::Debug for RegisterError<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisterError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<B> std::fmt::Display for RegisterError<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<B> std::error::Error for RegisterError<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<B> From<RegisterError<B>> for Error {
    fn from(e: RegisterError<B>) -> Self {
        e.error
    }
}

/// A memory region over a buffer it owns (`ibv_reg_mr` of the buffer's own memory, no copy),
/// from [`ProtectionDomain::register_owned`].
///
/// It dereferences to [`MemoryRegion`] for keys, scatter/gather elements and the copying
/// accessors; [`OwnedRegion::local`] and [`OwnedRegion::local_mut`] give slices of the bytes
/// themselves (see the [module documentation](self) for when the device is kept out), and
/// [`OwnedRegion::dereg`] hands the buffer back. Dropping the region deregisters it and drops
/// the buffer, once the device can no longer reach it.
pub struct OwnedRegion<B: StableBuffer> {
    mr: MemoryRegion,
    raw: Arc<RawBytes>,
    /// Boxed, so that moving the region never moves (or retags) the buffer's handle; `None`
    /// once handed back.
    buf: Option<Box<B>>,
}

impl<B: StableBuffer> std::fmt::Debug for OwnedRegion<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedRegion")
            .field("mr", &self.mr)
            .finish_non_exhaustive()
    }
}

impl<B: StableBuffer> OwnedRegion<B> {
    fn new(pd: &ProtectionDomain, buf: B, access: AccessFlags) -> Result<Self, RegisterError<B>> {
        let mut boxed = Box::new(buf);
        let Some(raw) = raw::raw_of_owned(&mut *boxed) else {
            return Err(RegisterError {
                error: Error::invalid("the buffer has no address"),
                buffer: *boxed,
            });
        };
        let raw = Arc::new(raw);
        match pd.register_backing(raw.clone(), raw.addr(), access) {
            Ok(mr) => Ok(Self {
                mr,
                raw,
                buf: Some(boxed),
            }),
            Err(error) => {
                raw.retire();
                Err(RegisterError {
                    error,
                    buffer: *boxed,
                })
            }
        }
    }

    /// The bytes, shared: device reads (and copying reads) go on while the guard lives;
    /// device writes, atomics, payload copies into the region and copying writes are refused.
    /// Waits for writes in progress.
    pub fn local(&self) -> LocalRef<'_> {
        LocalRef(self.raw.lock_shared())
    }

    /// The bytes, exclusively: every device access to the region fails while the guard lives
    /// (see the [module documentation](self)). Waits for accesses in progress.
    pub fn local_mut(&mut self) -> LocalMut<'_> {
        LocalMut(self.raw.lock_exclusive())
    }

    /// `ibv_dereg_mr`, handing the buffer back with its contents. EBUSY while memory windows
    /// are bound to the region, in which case the region comes back unchanged.
    pub fn dereg(mut self) -> std::result::Result<B, (Self, Error)> {
        if let Err(e) = self.mr.dereg_in_place() {
            return Err((self, e));
        }
        self.raw.retire();
        Ok(*self.buf.take().expect("the buffer is held until handed back"))
    }
}

impl<B: StableBuffer> Deref for OwnedRegion<B> {
    type Target = MemoryRegion;

    fn deref(&self) -> &MemoryRegion {
        &self.mr
    }
}

impl<B: StableBuffer> Drop for OwnedRegion<B> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            // EBUSY (windows still bound) leaves the core region alive in its windows, but it
            // reaches the bytes only through `raw`, retired here first.
            let _ = self.mr.dereg_in_place();
            self.raw.retire();
            drop(buf);
        }
    }
}

/// A memory region over memory it borrows, from [`ProtectionDomain::scoped`] or
/// [`ProtectionDomain::register_borrowed`]. Dereferences to [`MemoryRegion`]; deregistered
/// when dropped, after which the borrow may end.
#[derive(Debug)]
pub struct BorrowedRegion<'a> {
    mr: MemoryRegion,
    raw: Arc<RawBytes>,
    _borrow: std::marker::PhantomData<&'a mut [u8]>,
}

impl BorrowedRegion<'_> {
    fn new(pd: &ProtectionDomain, raw: RawBytes, access: AccessFlags) -> Result<Self> {
        let raw = Arc::new(raw);
        match pd.register_backing(raw.clone(), raw.addr(), access) {
            Ok(mr) => Ok(Self {
                mr,
                raw,
                _borrow: std::marker::PhantomData,
            }),
            Err(e) => {
                raw.retire();
                Err(e)
            }
        }
    }

    /// As [`OwnedRegion::local`].
    pub fn local(&self) -> LocalRef<'_> {
        LocalRef(self.raw.lock_shared())
    }

    /// As [`OwnedRegion::local_mut`].
    pub fn local_mut(&mut self) -> LocalMut<'_> {
        LocalMut(self.raw.lock_exclusive())
    }

    /// `ibv_dereg_mr` with its result: EBUSY while memory windows are bound to the region,
    /// in which case the region comes back unchanged (dropping it instead still cuts the
    /// device off the memory).
    pub fn dereg(mut self) -> std::result::Result<(), (Self, Error)> {
        match self.mr.dereg_in_place() {
            Ok(()) => {
                self.raw.retire();
                Ok(())
            }
            Err(e) => Err((self, e)),
        }
    }
}

impl Deref for BorrowedRegion<'_> {
    type Target = MemoryRegion;

    fn deref(&self) -> &MemoryRegion {
        &self.mr
    }
}

impl Drop for BorrowedRegion<'_> {
    fn drop(&mut self) {
        let _ = self.mr.dereg_in_place();
        self.raw.retire();
    }
}

/// Shared access to a region's bytes ([`OwnedRegion::local`]): dereferences to `[u8]`.
#[derive(Debug)]
pub struct LocalRef<'a>(SharedLock<'a>);

impl Deref for LocalRef<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.slice()
    }
}

/// Exclusive access to a region's bytes ([`OwnedRegion::local_mut`]): dereferences to
/// `mut [u8]`.
#[derive(Debug)]
pub struct LocalMut<'a>(ExclusiveLock<'a>);

impl Deref for LocalMut<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.slice()
    }
}

impl DerefMut for LocalMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0.slice_mut()
    }
}
