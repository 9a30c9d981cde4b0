//! Protection domains, memory regions and address handles.

use std::ops::{DerefMut, Range};
use std::sync::Arc;

use softverbs_device as core;
use softverbs_engine::types::{AccessFlags, AhAttr, Sge, SrqAttr, WorkCompletion};
use softverbs_engine::{Error, Result};

use crate::context::Context;
use crate::qp::{QpInit, QueuePair, SharedReceiveQueue};

#[derive(Debug)]
pub(crate) struct PdInner {
    pub(crate) core: Arc<core::Pd>,
    pub(crate) ctx: Context,
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // Every MR, QP, SRQ and AH holds a handle to its PD, so none is left.
        let r = self.core.dealloc();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// A protection domain (`ibv_alloc_pd`). Cheap to clone; deallocated with its last handle.
#[derive(Debug, Clone)]
pub struct ProtectionDomain(pub(crate) Arc<PdInner>);

/// Memory that can be registered: its bytes stay at the same address however the owner moves.
pub trait RegisterableBuffer: DerefMut<Target = [u8]> + Send + 'static {}
impl RegisterableBuffer for Vec<u8> {}
impl RegisterableBuffer for Box<[u8]> {}
impl RegisterableBuffer for &'static mut [u8] {}

impl ProtectionDomain {
    pub(crate) fn alloc(ctx: &Context) -> Result<Self> {
        Ok(Self(Arc::new(PdInner {
            core: core::Pd::alloc(ctx.core())?,
            ctx: ctx.clone(),
        })))
    }

    pub(crate) fn core(&self) -> &Arc<core::Pd> {
        &self.0.core
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.0.ctx
    }

    /// `ibv_reg_mr`: registers `buf`, which the region owns until dropped. Remote write or
    /// atomic access without local write is EINVAL; an empty buffer is EINVAL.
    pub fn register<B: RegisterableBuffer>(
        &self,
        mut buf: B,
        access: AccessFlags,
    ) -> Result<MemoryRegion<B>> {
        let addr = buf.as_mut_ptr() as u64;
        let core = core::Mr::register(&self.0.core, addr, buf.len() as u64, access.bits())?;
        Ok(MemoryRegion {
            core,
            buf,
            _pd: self.clone(),
        })
    }

    /// `ibv_create_qp`: see [`QueuePair::cap`] for the capabilities actually granted.
    pub fn create_qp(&self, init: &QpInit<'_>) -> Result<QueuePair> {
        QueuePair::create(self, init)
    }

    /// `ibv_create_srq`: see [`SharedReceiveQueue::query`] for the actual sizes.
    pub fn create_srq(&self, attr: &SrqAttr) -> Result<SharedReceiveQueue> {
        SharedReceiveQueue::create(self, attr)
    }

    /// `ibv_create_ah`.
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        Ok(AddressHandle {
            core: core::Ah::create(&self.0.core, attr)?,
            _pd: self.clone(),
        })
    }

    /// `ibv_create_ah_from_wc`: an AH answering the sender of a UD receive completion; `grh` is
    /// the first 40 bytes of its receive buffer.
    pub fn create_ah_from_wc(&self, wc: &WorkCompletion, grh: &[u8], port: u8) -> Result<AddressHandle> {
        let attr = self.0.ctx.init_ah_from_wc(port, wc, grh)?;
        self.create_ah(&attr)
    }
}

/// A registered memory region owning its buffer (`ibv_reg_mr`). Deregistered when dropped.
#[derive(Debug)]
pub struct MemoryRegion<B: RegisterableBuffer> {
    core: Arc<core::Mr>,
    buf: B,
    _pd: ProtectionDomain,
}

impl<B: RegisterableBuffer> MemoryRegion<B> {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.core.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.core.rkey()
    }

    /// Address of the first byte, as peers address it.
    pub fn addr(&self) -> u64 {
        self.core.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the region is empty (never: empty regions cannot be registered).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Access rights.
    pub fn access(&self) -> AccessFlags {
        self.core.access()
    }

    /// The registered bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// The registered bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// A scatter/gather element for `range` of this region; EINVAL if it is out of bounds.
    pub fn sge(&self, range: Range<usize>) -> Result<Sge> {
        if range.start > range.end || range.end > self.buf.len() {
            return Err(Error::invalid(format!(
                "range {range:?} is outside the {}-byte region",
                self.buf.len()
            )));
        }
        let length = u32::try_from(range.len()).map_err(|_| Error::invalid("an SGE holds at most 4 GiB"))?;
        Ok(Sge {
            addr: self.addr() + range.start as u64,
            length,
            lkey: self.lkey(),
        })
    }
}

impl<B: RegisterableBuffer> Drop for MemoryRegion<B> {
    fn drop(&mut self) {
        let r = self.core.dereg();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// An address handle (`ibv_create_ah`). Destroyed when dropped.
#[derive(Debug)]
pub struct AddressHandle {
    core: Arc<core::Ah>,
    _pd: ProtectionDomain,
}

impl AddressHandle {
    /// The address vector.
    pub fn attr(&self) -> &AhAttr {
        self.core.attr()
    }
}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        let r = self.core.destroy();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}
