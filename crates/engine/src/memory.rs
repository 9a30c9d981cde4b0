//! How the engine reaches registered memory: through the [`Memory`] trait, which the device
//! implements over its memory-region table. Keys, protection domains, bounds and access rights
//! are checked there, for every access, as an HCA checks them.
//!
//! Memory windows are bound and invalidated by send-queue operations the requester executes in
//! order, and by the responder for SEND with Invalidate; the trait carries those too, so the
//! engine never holds key state itself. The rules of windows are pure functions of
//! [`Window`], shared by every implementation of the trait.

pub use crate::mw::{MwBind, MwType, Window, WindowTarget};
use crate::types::{AccessFlags, WcStatus};

/// The right an access needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Gather for a send or write (lkey; always allowed).
    LocalRead,
    /// Scatter into a receive or read response buffer (lkey, `IBV_ACCESS_LOCAL_WRITE`).
    LocalWrite,
    /// Remote read (rkey, `IBV_ACCESS_REMOTE_READ`).
    RemoteRead,
    /// Remote write (rkey, `IBV_ACCESS_REMOTE_WRITE`).
    RemoteWrite,
    /// Remote atomic (rkey, `IBV_ACCESS_REMOTE_ATOMIC`).
    RemoteAtomic,
    /// Remote FLUSH with these placement type bits (rkey; `IBV_ACCESS_FLUSH_GLOBAL` for bit 0,
    /// `IBV_ACCESS_FLUSH_PERSISTENT` for bit 1).
    Flush(u8),
}

impl Access {
    /// Whether the key is an rkey (remote access) rather than an lkey.
    pub fn is_remote(self) -> bool {
        matches!(
            self,
            Self::RemoteRead | Self::RemoteWrite | Self::RemoteAtomic | Self::Flush(_)
        )
    }

    /// The region access flags this access needs.
    pub fn required_flags(self) -> AccessFlags {
        match self {
            Self::LocalRead => AccessFlags::empty(),
            Self::LocalWrite => AccessFlags::LOCAL_WRITE,
            Self::RemoteRead => AccessFlags::REMOTE_READ,
            Self::RemoteWrite => AccessFlags::REMOTE_WRITE,
            Self::RemoteAtomic => AccessFlags::REMOTE_ATOMIC,
            Self::Flush(placement) => {
                let mut f = AccessFlags::empty();
                if placement & crate::wr::FLUSH_GLOBAL != 0 {
                    f |= AccessFlags::FLUSH_GLOBAL;
                }
                if placement & crate::wr::FLUSH_PERSISTENT != 0 {
                    f |= AccessFlags::FLUSH_PERSISTENT;
                }
                f
            }
        }
    }
}

/// A key with the protection domain and right it is used with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRef {
    /// The lkey or rkey.
    pub key: u32,
    /// The protection domain of the QP making the access.
    pub pd: u32,
    /// The number of the QP making the access (a type 2 window is only usable by its QP).
    pub qpn: u32,
    /// The right needed.
    pub access: Access,
}

/// Why a memory access was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemError {
    /// No region has this key.
    BadKey,
    /// The region belongs to another protection domain.
    WrongPd,
    /// The range is not inside the region.
    OutOfRange,
    /// The region lacks the access right.
    NoAccess,
    /// An atomic address is not 8-byte aligned.
    Misaligned,
    /// A type 2 window used by, or invalidated from, a QP it is not bound to.
    WrongQp,
    /// A window in the wrong state for the operation (bound when it must be free, a type 1
    /// window invalidated, an rkey naming an older binding).
    BadState,
    /// A bind request that breaks a rule of the verbs (IBTA C10-72..75 and friends).
    InvalidBind,
    /// The range is in the region but not mapped in memory (an on-demand-paging region over
    /// addresses the application never mapped): a protection error, never a crash.
    Unmapped,
}

impl MemError {
    /// The status a local (lkey) failure completes with.
    pub fn local_status(self) -> WcStatus {
        match self {
            Self::NoAccess => WcStatus::LocAccessErr,
            _ => WcStatus::LocProtErr,
        }
    }
}

/// An atomic operation on a host-order 64-bit word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Compare and swap.
    CompareSwap {
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Fetch and add.
    FetchAdd {
        /// Addend.
        add: u64,
    },
    /// An 8-byte store (ATOMIC WRITE); the word is replaced as a whole.
    Store {
        /// The new value, as the bytes in memory read in host order.
        value: u64,
    },
}

impl AtomicOp {
    /// The new value of a word holding `old`.
    pub fn apply(self, old: u64) -> u64 {
        match self {
            Self::CompareSwap { compare, swap } => {
                if old == compare {
                    swap
                } else {
                    old
                }
            }
            Self::FetchAdd { add } => old.wrapping_add(add),
            Self::Store { value } => value,
        }
    }
}

/// A received payload left in the sender's memory (see [`crate::transport::RxData`]): the
/// device knows where it is; the engine only passes it to [`Memory::write_external`].
pub trait ExternalPayload {
    /// Its length in bytes.
    fn len(&self) -> u64;
    /// Whether it has no byte.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes from `offset` into `dst` now.
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemError>;
    /// The implementation, for a [`Memory`] that can place it better than by reading it.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Registered memory as the engine sees it.
pub trait Memory {
    /// Copies `dst.len()` bytes at `addr` of the region named by `key` into `dst`.
    fn read(&self, key: KeyRef, addr: u64, dst: &mut [u8]) -> Result<(), MemError>;
    /// Copies `src` to `addr` of the region named by `key`.
    fn write(&self, key: KeyRef, addr: u64, src: &[u8]) -> Result<(), MemError>;
    /// Checks that `len` bytes at `addr` may be accessed, without touching them.
    fn check(&self, key: KeyRef, addr: u64, len: u64) -> Result<(), MemError>;
    /// Performs `op` atomically on the 8-byte word at `addr`; returns the original value.
    fn atomic(&self, key: KeyRef, addr: u64, op: AtomicOp) -> Result<u64, MemError>;
    /// Executes a BIND_MW work request posted on QP `qpn` of protection domain `pd` (see
    /// [`Window::check_bind`] for the rules).
    fn bind_mw(&self, qpn: u32, pd: u32, bind: &MwBind) -> Result<(), MemError>;
    /// Invalidates the type 2 window named by `rkey`, for a LOCAL_INV posted on QP `qpn`, or a
    /// SEND with Invalidate it received (see [`Window::invalidate`]).
    fn invalidate(&self, qpn: u32, pd: u32, rkey: u32) -> Result<(), MemError>;
    /// FLUSH: checks the key and its right (`key.access` is [`Access::Flush`]) and, unless
    /// `whole_region`, that `len` bytes at `addr` lie in the region; then makes every earlier
    /// store to the region visible (a store fence).
    fn flush(&self, key: KeyRef, addr: u64, len: u64, whole_region: bool) -> Result<(), MemError>;
    /// Copies `len` bytes from `offset` of `src` to `addr` of the region named by `key`. The
    /// copy may be deferred, but must be done before the caller's outputs leave (the device
    /// copies a batch's payloads at once) and before any other access through this `Memory`.
    fn write_external(
        &self,
        key: KeyRef,
        addr: u64,
        src: &dyn ExternalPayload,
        offset: u64,
        len: u64,
    ) -> Result<(), MemError> {
        self.check(key, addr, len)?;
        let mut buf = vec![0u8; len as usize];
        src.read(offset, &mut buf)?;
        self.write(key, addr, &buf)
    }
    /// Checks that `len` bytes at `addr` may be accessed, and says where they are in this
    /// process's memory if another process of the host may copy them from there (ordinary
    /// memory, contiguous). `None`: the bytes must travel in the packet.
    fn locate(&self, key: KeyRef, addr: u64, len: u64) -> Result<Option<u64>, MemError> {
        self.check(key, addr, len).map(|()| None)
    }
}
