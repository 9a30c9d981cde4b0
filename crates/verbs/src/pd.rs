//! Protection domains, memory regions and address handles.

use std::ops::Range;
use std::sync::Arc;

use softverbs_device as core;
use softverbs_device::mem::AtomicBuffer;
use softverbs_device::qp::UdAddress;
use softverbs_engine::types::{AccessFlags, AhAttr, Sge, SrqAttr, WorkCompletion};
use softverbs_engine::wr::RemoteAddr;
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

    /// `ibv_reg_mr`: allocates and registers `len` zeroed bytes. Remote write or atomic access
    /// without local write is EINVAL; a length of 0 is EINVAL.
    pub fn register(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        self.register_buffer(Arc::new(AtomicBuffer::new(len)), access)
    }

    /// `ibv_reg_mr` of a copy of `bytes`.
    pub fn register_bytes(&self, bytes: &[u8], access: AccessFlags) -> Result<MemoryRegion> {
        self.register_buffer(Arc::new(AtomicBuffer::from_bytes(bytes)), access)
    }

    fn register_buffer(&self, buf: Arc<AtomicBuffer>, access: AccessFlags) -> Result<MemoryRegion> {
        let addr = buf.addr();
        let core = core::Mr::register(&self.0.core, buf.clone(), addr, access.bits())?;
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

    /// `ibv_advise_mr`: prefetches ranges of on-demand-paging regions of this PD (`advice`
    /// `IBV_ADVISE_MR_ADVICE_PREFETCH` 0, `_PREFETCH_WRITE` 1, `_PREFETCH_NO_FAULT` 2; `flags`
    /// `IBV_ADVISE_MR_FLAG_FLUSH` 1), with the errnos of ibv_advise_mr(3).
    pub fn advise_mr(&self, advice: u32, flags: u32, sges: &[Sge]) -> Result<()> {
        self.0.core.advise_mr(advice, flags, sges)
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

/// A registered memory region (`ibv_reg_mr`), deregistered when dropped.
///
/// The device reads and writes the region from its own threads at any time, so the bytes are
/// reached through copying accessors rather than slices: the memory is made of atomic words,
/// which makes that sharing free of data races.
#[derive(Debug)]
pub struct MemoryRegion {
    core: Arc<core::Mr>,
    buf: Arc<AtomicBuffer>,
    _pd: ProtectionDomain,
}

impl MemoryRegion {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.core.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.core.rkey()
    }

    /// Address of the first byte, as work requests and peers address it.
    pub fn addr(&self) -> u64 {
        self.core.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.byte_len()
    }

    /// Whether the region is empty (never: empty regions cannot be registered).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Access rights.
    pub fn access(&self) -> AccessFlags {
        self.core.access()
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::invalid(format!(
                "{len} bytes at offset {offset} are outside the {}-byte region",
                self.len()
            )));
        }
        Ok(())
    }

    /// Copies bytes at `offset` into `dst`; EINVAL if out of bounds.
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

    /// A copy of the whole region.
    pub fn to_vec(&self) -> Vec<u8> {
        self.buf.to_vec()
    }

    /// Sets every byte to `value`.
    pub fn fill(&self, value: u8) {
        self.buf.fill(value);
    }

    /// The 8-byte word at `offset` (8-byte aligned) in host order, as atomics see it.
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        self.check(offset, 8)?;
        if offset % 8 != 0 {
            return Err(Error::invalid(format!("offset {offset} is not 8-byte aligned")));
        }
        Ok(self.buf.load_u64(offset))
    }

    /// A scatter/gather element for `range` of this region; EINVAL if it is out of bounds.
    pub fn sge(&self, range: Range<usize>) -> Result<Sge> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::invalid(format!(
                "range {range:?} is outside the {}-byte region",
                self.len()
            )));
        }
        let length = u32::try_from(range.len()).map_err(|_| Error::invalid("an SGE holds at most 4 GiB"))?;
        Ok(Sge {
            addr: self.addr() + range.start as u64,
            length,
            lkey: self.lkey(),
        })
    }

    /// The remote address of `offset` in this region, for a peer's RDMA or atomic request.
    pub fn remote(&self, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr() + offset as u64,
            rkey: self.rkey(),
        }
    }
}

impl Drop for MemoryRegion {
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

    /// The UD destination of a send through this AH (`ibv_send_wr.wr.ud`).
    pub fn ud_address(&self, remote_qpn: u32, remote_qkey: u32) -> UdAddress {
        UdAddress {
            ah: self.core.clone(),
            remote_qpn,
            remote_qkey,
        }
    }
}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        let r = self.core.destroy();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}
