//! Protection domains, memory regions and address handles.

use std::ops::Range;
use std::sync::Arc;

use softverbs_device as core;
use softverbs_device::mem::{AtomicBuffer, MemoryBacking};
use softverbs_device::qp::{SendRequest, UdAddress};
use softverbs_engine::memory::AtomicOp;
use softverbs_engine::mw::{MwBind, MwType};
use softverbs_engine::tm::TmCap;
use softverbs_engine::types::{AccessFlags, AhAttr, SendFlags, Sge, SrqAttr, WorkCompletion};
use softverbs_engine::wr::{Payload, RemoteAddr, SendOp};
use softverbs_engine::{Error, Result};

use crate::context::Context;
use crate::cq::CompletionQueue;
use crate::dm::DeviceMemory;
use crate::domain::ThreadDomain;
use crate::host::{AddressSpace, HostBuffer};
use crate::qp::{QpInit, QueuePair, SharedReceiveQueue};

/// What a [`ProtectionDomain`] handle is.
#[derive(Debug)]
pub(crate) enum PdKind {
    /// Allocated here: deallocated with the last handle.
    Own,
    /// Imported from another context's handle (`ibv_import_pd`): dropping only unimports.
    Imported,
    /// A parent domain over `inner` (and a thread domain).
    Parent {
        core: Arc<core::ParentDomain>,
        _inner: ProtectionDomain,
        td: Option<ThreadDomain>,
    },
}

#[derive(Debug)]
pub(crate) struct PdInner {
    pub(crate) core: Arc<core::Pd>,
    pub(crate) ctx: Context,
    pub(crate) kind: PdKind,
}

impl Drop for PdInner {
    fn drop(&mut self) {
        let r = match &self.kind {
            // Every MR, QP, SRQ and AH holds a handle to its PD, so none is left, except in
            // another context that imported it: then the core frees it with the last user.
            PdKind::Own => match self.core.dealloc() {
                Err(e) if e.errno() == 16 => Ok(()),
                r => r,
            },
            PdKind::Imported => Ok(()),
            // Its QPs hold handles to it too.
            PdKind::Parent { core, .. } => core.dealloc(),
        };
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
            kind: PdKind::Own,
        })))
    }

    pub(crate) fn import(ctx: &Context, handle: u32) -> Result<Self> {
        Ok(Self(Arc::new(PdInner {
            core: ctx.core().import_pd(handle)?,
            ctx: ctx.clone(),
            kind: PdKind::Imported,
        })))
    }

    /// `ibv_alloc_parent_domain`: a PD handle over this PD (and `td`), usable wherever a PD is.
    /// QPs created through it record the parent domain, and it stays alive while they exist;
    /// with a thread domain, they are meant for one thread at a time. The safe API manages
    /// queue memory itself, so there are no allocator callbacks. EINVAL on a parent domain or
    /// a thread domain of another context.
    pub fn alloc_parent_domain(&self, td: Option<&ThreadDomain>) -> Result<Self> {
        if matches!(self.0.kind, PdKind::Parent { .. }) {
            return Err(softverbs_engine::Error::invalid(
                "a parent domain cannot be the PD of another parent domain",
            ));
        }
        let core = core::ParentDomain::alloc(self.0.ctx.core(), &self.0.core, td.map(|t| t.core()))?;
        Ok(Self(Arc::new(PdInner {
            core: self.0.core.clone(),
            ctx: self.0.ctx.clone(),
            kind: PdKind::Parent {
                core,
                _inner: self.clone(),
                td: td.cloned(),
            },
        })))
    }

    /// Whether this handle is a parent domain.
    pub fn is_parent_domain(&self) -> bool {
        matches!(self.0.kind, PdKind::Parent { .. })
    }

    /// The thread domain of a parent domain.
    pub fn thread_domain(&self) -> Option<&ThreadDomain> {
        match &self.0.kind {
            PdKind::Parent { td, .. } => td.as_ref(),
            _ => None,
        }
    }

    pub(crate) fn parent_core(&self) -> Option<&Arc<core::ParentDomain>> {
        match &self.0.kind {
            PdKind::Parent { core, .. } => Some(core),
            _ => None,
        }
    }

    /// Whether this handle was imported from another context (`ibv_import_pd`); dropping it
    /// then leaves the PD to its owner.
    pub fn is_imported(&self) -> bool {
        matches!(self.0.kind, PdKind::Imported)
    }

    /// The handle (`ibv_pd.handle`), which [`Context::import_pd`] takes in a context imported
    /// from this one; a parent domain has its inner PD's.
    pub fn handle(&self) -> u32 {
        self.0.core.handle()
    }

    /// `ibv_import_mr`: the MR `handle` names, registered on this PD in a context sharing this
    /// one's objects. Dropping the returned region only unimports it. EINVAL if there is no
    /// such region.
    pub fn import_mr(&self, handle: u32) -> Result<MemoryRegion> {
        let core = self.0.core.import_mr(handle)?;
        Ok(MemoryRegion {
            mem: core.backing().clone(),
            core,
            imported: true,
            _dm: None,
            pd: self.clone(),
            deregistered: false,
        })
    }

    /// `ibv_reg_dm_mr`: registers `length` bytes of `dm` from `offset`. The region is zero
    /// based, so `access` must contain [`AccessFlags::ZERO_BASED`] (EINVAL otherwise), and its
    /// [`MemoryRegion::addr`] is 0.
    pub fn register_dm(
        &self,
        dm: &DeviceMemory,
        offset: u64,
        length: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        let core = core::Mr::register_dm(&self.0.core, dm.core(), offset, length, access.bits())?;
        Ok(MemoryRegion {
            mem: core.backing().clone(),
            core,
            imported: false,
            _dm: Some(dm.clone()),
            pd: self.clone(),
            deregistered: false,
        })
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
        self.register_backing(buf, addr, access)
    }

    /// Registers `mem`, whose first byte work requests and peers address as `addr`.
    pub(crate) fn register_backing(
        &self,
        mem: Arc<dyn MemoryBacking>,
        addr: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        let core = core::Mr::register(&self.0.core, mem.clone(), addr, access.bits())?;
        Ok(MemoryRegion {
            core,
            mem,
            imported: false,
            _dm: None,
            pd: self.clone(),
            deregistered: false,
        })
    }

    /// `ibv_reg_mr(pd, NULL, SIZE_MAX, access)` with `IBV_ACCESS_ON_DEMAND`: an implicit
    /// on-demand-paging region over the whole address space. Its lkey and rkey reach every
    /// live [`HostBuffer`] by address; an access to memory no buffer holds fails as it does on
    /// an unmapped page. `access` must contain [`AccessFlags::ON_DEMAND`] (EINVAL otherwise).
    pub fn register_implicit_odp(&self, access: AccessFlags) -> Result<ImplicitOdpRegion> {
        let mem: Arc<dyn MemoryBacking> = Arc::new(AddressSpace);
        let core = core::Mr::register_implicit_odp(&self.0.core, mem.clone(), access.bits())?;
        Ok(ImplicitOdpRegion(MemoryRegion {
            core,
            mem,
            imported: false,
            _dm: None,
            pd: self.clone(),
            deregistered: false,
        }))
    }

    /// `ibv_alloc_null_mr`: a region whose writes are discarded and whose reads give zeros, at
    /// any address (its [`MemoryRegion::sge`] accepts any range from 0). Use its lkey in
    /// scatter/gather lists, e.g. to drop parts of received messages; it has no remote access.
    pub fn alloc_null_mr(&self) -> Result<MemoryRegion> {
        Ok(MemoryRegion {
            core: core::Mr::alloc_null(&self.0.core)?,
            mem: Arc::new(core::null_mr::NullMemory),
            imported: false,
            _dm: None,
            pd: self.clone(),
            deregistered: false,
        })
    }

    /// `ibv_alloc_mw`: an unbound memory window of `mw_type`; ENOMEM beyond `max_mw`.
    pub fn alloc_mw(&self, mw_type: MwType) -> Result<MemoryWindow> {
        Ok(MemoryWindow {
            core: core::Mw::alloc(&self.0.core, mw_type.raw())?,
            _pd: self.clone(),
        })
    }

    /// `ibv_create_qp`: see [`QueuePair::cap`] for the capabilities actually granted.
    pub fn create_qp(&self, init: &QpInit<'_>) -> Result<QueuePair> {
        QueuePair::create(self, init)
    }

    /// `ibv_create_srq`: see [`SharedReceiveQueue::query`] for the actual sizes.
    pub fn create_srq(&self, attr: &SrqAttr) -> Result<SharedReceiveQueue> {
        SharedReceiveQueue::create(self, attr, None)
    }

    /// `ibv_create_srq_ex` with `IBV_SRQT_TM`: a tag-matching SRQ whose completions, and those
    /// of the RC QPs attached to it, go to `cq`. Tags are managed with
    /// [`SharedReceiveQueue::post_ops`]; unexpected-message buffers are posted with
    /// [`SharedReceiveQueue::post_recv`]. EINVAL when `tm` is 0 or beyond
    /// [`Context::tm_caps`](crate::Context::tm_caps).
    pub fn create_tm_srq(
        &self,
        attr: &SrqAttr,
        cq: &CompletionQueue,
        tm: TmCap,
    ) -> Result<SharedReceiveQueue> {
        SharedReceiveQueue::create(self, attr, Some((cq, tm)))
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
/// which makes that sharing free of data races. The safe API registers memory it allocates
/// itself ([`ProtectionDomain::register`], or [`ProtectionDomain::register_bytes`] for a
/// copy of existing bytes); [`HostBuffer`]s reached through an implicit on-demand-paging
/// region are the one kind of application memory work requests address directly.
///
/// What a work request names ([`MemoryRegion::sge`]), what a peer is sent so that it can
/// reach the region ([`MemoryRegion::remote`]), and the other kinds of region:
///
/// ```
/// use softverbs::*;
///
/// let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").expect("loopback").open()?;
/// let pd = ctx.alloc_pd()?;
/// let mut mr = pd.register(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
/// mr.write(100, b"bytes")?;
/// let sge = mr.sge(100..105)?; // for local work requests: checked by lkey, as an HCA does
/// assert_eq!((sge.addr, sge.length, sge.lkey), (mr.addr() + 100, 5, mr.lkey()));
/// let remote = mr.remote(100); // for a peer's RDMA WRITE: tell it the address and rkey
/// assert_eq!((remote.addr, remote.rkey), (mr.addr() + 100, mr.rkey()));
/// assert_eq!(mr.sge(4000..5000).unwrap_err().errno(), 22, "outside the region: EINVAL");
/// // Remote write without local write is EINVAL, as ibv_reg_mr(3) says.
/// assert_eq!(pd.register(64, AccessFlags::REMOTE_WRITE).unwrap_err().errno(), 22);
///
/// // ibv_rereg_mr: new rights, same keys, so peers need not be told again.
/// let rkey = mr.rkey();
/// mr.rereg(Rereg { access: Some(mr.access() | AccessFlags::REMOTE_READ), ..Default::default() })?;
/// assert_eq!(mr.rkey(), rkey);
/// mr.dereg().map_err(|(_, e)| e)?; // or just drop it
///
/// let copy = pd.register_bytes(b"hello", AccessFlags::empty())?;
/// assert_eq!(copy.to_vec(), b"hello");
///
/// // Device memory (ibv_alloc_dm), registered zero-based.
/// let dm = ctx.alloc_dm(4096, 3)?;
/// dm.copy_to(0, b"on the device")?;
/// let dm_mr = pd.register_dm(&dm, 0, 4096, AccessFlags::ZERO_BASED | AccessFlags::LOCAL_WRITE)?;
/// assert_eq!((dm_mr.addr(), dm_mr.len()), (0, 4096));
///
/// // Implicit on-demand paging: one region whose keys reach every live HostBuffer.
/// let odp = pd.register_implicit_odp(AccessFlags::ON_DEMAND | AccessFlags::LOCAL_WRITE)?;
/// let buf = HostBuffer::new(1 << 20)?;
/// let sge = odp.sge(&buf, 0..4096)?;
/// assert_eq!((sge.addr, sge.lkey), (buf.addr(), odp.lkey()));
/// pd.advise_mr(0, 1, &[sge])?; // IBV_ADVISE_MR_ADVICE_PREFETCH, IBV_ADVISE_MR_FLAG_FLUSH
///
/// // A null region: writes through it are dropped (e.g. the part of a message not wanted).
/// let null = pd.alloc_null_mr()?;
/// assert_eq!(null.sge(0..1 << 30)?.lkey, null.lkey());
/// # Ok::<(), softverbs::Error>(())
/// ```
#[derive(Debug)]
pub struct MemoryRegion {
    core: Arc<core::Mr>,
    mem: Arc<dyn MemoryBacking>,
    /// Imported (`ibv_import_mr`): dropping only unimports.
    imported: bool,
    /// The device memory of a DM region, freed after the region.
    _dm: Option<DeviceMemory>,
    pd: ProtectionDomain,
    deregistered: bool,
}

/// What [`MemoryRegion::rereg`] changes (`IBV_REREG_MR_CHANGE_*`): each `Some` field is a change.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rereg<'a> {
    /// `IBV_REREG_MR_CHANGE_PD`: move the region to this PD.
    pub pd: Option<&'a ProtectionDomain>,
    /// `IBV_REREG_MR_CHANGE_TRANSLATION`: register a new zeroed buffer of this many bytes
    /// instead (the old contents are not copied).
    pub len: Option<usize>,
    /// `IBV_REREG_MR_CHANGE_ACCESS`: the new access rights.
    pub access: Option<AccessFlags>,
}

impl MemoryRegion {
    /// `ibv_rereg_mr`: changes what `change` names, in place; the keys stay, so peers keep
    /// using the same rkey. No change at all, a length of 0 or invalid access flags are EINVAL;
    /// while memory windows are bound to the region it is EBUSY. On error nothing changes.
    pub fn rereg(&mut self, change: Rereg<'_>) -> Result<()> {
        let mut flags = 0;
        let buf = change.len.map(|len| Arc::new(AtomicBuffer::new(len)));
        let translation = buf.as_ref().map(|b| {
            flags |= core::pd::REREG_CHANGE_TRANSLATION;
            core::Translation {
                backing: b.clone(),
                addr: b.addr(),
                iova: b.addr(),
            }
        });
        if change.pd.is_some() {
            flags |= core::pd::REREG_CHANGE_PD;
        }
        if change.access.is_some() {
            flags |= core::pd::REREG_CHANGE_ACCESS;
        }
        self.core.rereg(
            flags,
            change.pd.map(|p| p.core()),
            translation,
            change.access.unwrap_or_default().bits(),
        )?;
        if let Some(b) = buf {
            self.mem = b;
        }
        if let Some(p) = change.pd {
            self.pd = p.clone();
        }
        Ok(())
    }

    /// `ibv_dereg_mr` with its result: EBUSY while memory windows are bound to the region, in
    /// which case the region is handed back unchanged. (Dropping a region whose windows are
    /// still bound leaves it registered until the last window lets go of it.)
    pub fn dereg(mut self) -> std::result::Result<(), (Self, Error)> {
        match self.core.dereg() {
            Ok(()) => {
                self.deregistered = true;
                Ok(())
            }
            Err(e) => Err((self, e)),
        }
    }

    /// [`MemoryRegion::dereg`] for a region whose memory its owner releases next: EBUSY while
    /// windows are bound; deregistering twice does nothing.
    pub(crate) fn dereg_in_place(&mut self) -> Result<()> {
        if self.imported || self.deregistered {
            return Ok(());
        }
        self.core.dereg()?;
        self.deregistered = true;
        Ok(())
    }

    /// The PD.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

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
        self.mem.len() as usize
    }

    /// The handle (`ibv_mr.handle`), which [`ProtectionDomain::import_mr`] takes.
    pub fn handle(&self) -> u32 {
        self.core.handle()
    }

    /// Whether this region was imported from another context (`ibv_import_mr`).
    pub fn is_imported(&self) -> bool {
        self.imported
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
        self.mem.read(offset as u64, dst).map_err(unmapped)
    }

    /// Copies `src` to `offset`; EINVAL if out of bounds.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        self.mem.write(offset as u64, src).map_err(unmapped)
    }

    /// A copy of the whole region (memory the safe API registers is always present; bytes of
    /// an imported on-demand region that are not mapped read as zero).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        let _ = self.mem.read(0, &mut v);
        v
    }

    /// Sets every byte to `value` (unmapped pages of an imported on-demand region stay so).
    pub fn fill(&self, value: u8) {
        // In bounded chunks, so a large region needs no copy of its size.
        let chunk = vec![value; self.len().min(1 << 16)];
        let mut off = 0;
        while off < self.len() {
            let n = chunk.len().min(self.len() - off);
            let _ = self.mem.write(off as u64, &chunk[..n]);
            off += n;
        }
    }

    /// The 8-byte word at `offset` (8-byte aligned) in host order, as atomics see it.
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        self.check(offset, 8)?;
        if (self.core.align_base() + offset as u64) % 8 != 0 {
            return Err(Error::invalid(format!("offset {offset} is not 8-byte aligned")));
        }
        // Adding 0 atomically reads the word as the device's atomics see it.
        self.mem
            .atomic(offset as u64, AtomicOp::FetchAdd { add: 0 })
            .map_err(unmapped)
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
        if self.imported || self.deregistered {
            return;
        }
        // EBUSY means windows are still bound: the core region then lives on in them (with
        // its memory) and is torn down when the last one is unbound or deallocated.
        let r = self.core.dereg();
        debug_assert!(r.is_ok() || r.as_ref().is_err_and(|e| e.errno() == 16), "{r:?}");
    }
}

/// An implicit on-demand-paging region ([`ProtectionDomain::register_implicit_odp`]),
/// deregistered when dropped. It has no memory of its own: work requests name
/// [`HostBuffer`] bytes by address with its keys.
#[derive(Debug)]
pub struct ImplicitOdpRegion(MemoryRegion);

impl ImplicitOdpRegion {
    /// The PD.
    pub fn pd(&self) -> &ProtectionDomain {
        self.0.pd()
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.0.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.0.rkey()
    }

    /// Access rights (with [`AccessFlags::ON_DEMAND`]).
    pub fn access(&self) -> AccessFlags {
        self.0.access()
    }

    /// A scatter/gather element for `range` of `buf` with this region's lkey.
    pub fn sge(&self, buf: &HostBuffer, range: Range<usize>) -> Result<Sge> {
        buf.sge(range, self.lkey())
    }

    /// The remote address of `offset` in `buf`, for a peer's RDMA or atomic request.
    pub fn remote(&self, buf: &HostBuffer, offset: usize) -> RemoteAddr {
        RemoteAddr {
            addr: buf.addr() + offset as u64,
            rkey: self.rkey(),
        }
    }
}

/// A bind of a type 1 window (`struct ibv_mw_bind`).
#[derive(Debug, Clone, Copy)]
pub struct MwBindInfo<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// `IBV_SEND_SIGNALED`, `IBV_SEND_FENCE`.
    pub send_flags: SendFlags,
    /// The region; `None` with `addr` and `length` 0 unbinds the window.
    pub mr: Option<&'a MemoryRegion>,
    /// First byte of the window (an address of the region).
    pub addr: u64,
    /// Length.
    pub length: u64,
    /// Remote rights, and `ZERO_BASED` for type 2 windows.
    pub access: AccessFlags,
}

/// A memory window (`ibv_alloc_mw`). Deallocated (and so unbound) when dropped.
///
/// Type 1 windows are bound with [`MemoryWindow::bind`]; type 2 windows with a BIND_MW work
/// request ([`MemoryWindow::bind_request`]) and freed with LOCAL_INV or the peer's SEND with
/// Invalidate.
///
/// A window grants a peer access to part of a region, and can be revoked without touching
/// the region (which itself needs only [`AccessFlags::MW_BIND`], no remote rights):
///
/// ```
/// use std::net::Ipv4Addr;
/// use std::time::{Duration, Instant};
/// use softverbs::*;
///
/// let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").expect("loopback").open()?;
/// let pd = ctx.alloc_pd()?;
/// let (cq_a, cq_b) = (ctx.create_cq(16, None, 0)?, ctx.create_cq(16, None, 0)?);
/// let a = pd.create_qp(&QpInit::new(QpType::Rc, &cq_a))?;
/// let b = pd.create_qp(&QpInit::new(QpType::Rc, &cq_b))?;
/// // a and b are connected as in the example of QueuePair.
/// # let gid = Gid::from(Ipv4Addr::LOCALHOST);
/// # let sgid_index = (0..).find(|&i| ctx.query_gid(1, i).is_ok_and(|g| g == gid)).unwrap() as u8;
/// # for (qp, peer) in [(&a, b.qp_num()), (&b, a.qp_num())] {
/// #     use QpAttrMask as M;
/// #     let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
/// #     let init =
/// #         QpAttr { qp_state: QpState::Init, port_num: 1, qp_access_flags: access, ..Default::default() };
/// #     qp.modify(&init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS)?;
/// #     let grh = GlobalRoute { dgid: gid, sgid_index, hop_limit: 64, ..Default::default() };
/// #     let ah_attr = AhAttr { is_global: true, port_num: 1, grh, ..Default::default() };
/// #     let rtr = QpAttr {
/// #         qp_state: QpState::Rtr, ah_attr, path_mtu: Mtu::Mtu1024, dest_qp_num: peer,
/// #         max_dest_rd_atomic: 1, min_rnr_timer: 12, ..Default::default()
/// #     };
/// #     qp.modify(&rtr, M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN
/// #         | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER)?;
/// #     let rts = QpAttr {
/// #         qp_state: QpState::Rts, timeout: 14, retry_cnt: 7, rnr_retry: 7, max_rd_atomic: 1,
/// #         ..Default::default()
/// #     };
/// #     qp.modify(&rts, M::STATE | M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY
/// #         | M::MAX_QP_RD_ATOMIC)?;
/// # }
/// let target = pd.register(8192, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
/// let source = pd.register(64, AccessFlags::LOCAL_WRITE)?;
/// source.write(0, b"through a window")?;
/// let one = |cq: &CompletionQueue| {
///     let mut wc = [WorkCompletion::default()];
///     let deadline = Instant::now() + Duration::from_secs(20);
///     while cq.poll(&mut wc) == 0 {
///         assert!(Instant::now() < deadline, "no completion");
///     }
///     wc[0]
/// };
/// let write = |wr_id, addr, rkey| SendRequest {
///     wr_id,
///     op: SendOp::Write { remote: RemoteAddr { addr, rkey }, imm: None },
///     flags: SendFlags::SIGNALED,
///     payload: Payload::Sges(vec![source.sge(0..16).unwrap()]),
///     ud: None,
///     xrc_srqn: None,
/// };
///
/// // Type 1: bound by a verb (ibv_bind_mw), answering to the rkey it returns.
/// let w1 = pd.alloc_mw(MwType::Type1)?;
/// let at = target.addr() + 1024;
/// let rkey = w1.bind(&b, &MwBindInfo {
///     wr_id: 1,
///     send_flags: SendFlags::SIGNALED,
///     mr: Some(&target),
///     addr: at,
///     length: 1024,
///     access: AccessFlags::REMOTE_WRITE,
/// })?;
/// assert_eq!(one(&cq_b).opcode, WcOpcode::BindMw);
/// a.post_send(&[write(2, at, rkey)])?;
/// assert_eq!(one(&cq_a).status, WcStatus::Success);
/// let mut got = [0u8; 16];
/// target.read(1024, &mut got)?;
/// assert_eq!(&got, b"through a window");
///
/// // Type 2: bound by a work request, with a key whose low 8 bits the binder picks, and
/// // invalidated by another.
/// let w2 = pd.alloc_mw(MwType::Type2)?;
/// let key = inc_rkey(w2.rkey());
/// let at = target.addr() + 4096;
/// b.post_send(&[w2.bind_request(3, key, &target, at, 4096, AccessFlags::REMOTE_WRITE)])?;
/// assert_eq!(one(&cq_b).opcode, WcOpcode::BindMw);
/// assert_eq!(w2.current(), (key, true));
/// a.post_send(&[write(4, at, key)])?;
/// assert_eq!(one(&cq_a).status, WcStatus::Success);
/// b.post_send(&[SendRequest {
///     wr_id: 5,
///     op: SendOp::LocalInv { rkey: key },
///     flags: SendFlags::SIGNALED,
///     payload: Payload::Sges(vec![]),
///     ud: None,
///     xrc_srqn: None,
/// }])?;
/// assert_eq!(one(&cq_b).opcode, WcOpcode::LocalInv);
/// assert!(!w2.current().1);
/// // The revoked key no longer opens anything.
/// a.post_send(&[write(6, at, key)])?;
/// assert_eq!(one(&cq_a).status, WcStatus::RemAccessErr);
/// # Ok::<(), softverbs::Error>(())
/// ```
#[derive(Debug)]
pub struct MemoryWindow {
    core: Arc<core::Mw>,
    _pd: ProtectionDomain,
}

impl MemoryWindow {
    /// The rkey `ibv_mw.rkey` holds: for a type 1 window, the one the latest
    /// [`MemoryWindow::bind`] returned.
    pub fn rkey(&self) -> u32 {
        self.core.rkey()
    }

    /// The rkey the window answers to now, and whether it is bound (the binding changes when
    /// the bind or invalidation executes, not when it is posted).
    pub fn current(&self) -> (u32, bool) {
        self.core.current()
    }

    /// The type.
    pub fn mw_type(&self) -> MwType {
        self.core.mw_type()
    }

    /// `ibv_bind_mw`: posts a bind of this type 1 window on `qp` and returns its new rkey.
    /// A type 2 window is EINVAL, an address or length without a region EINVAL, a region of
    /// another PD EPERM; a bind that breaks a rule when it executes completes with
    /// `IBV_WC_MW_BIND_ERR`.
    pub fn bind(&self, qp: &QueuePair, info: &MwBindInfo<'_>) -> Result<u32> {
        self.core.bind(
            qp.core(),
            &core::Type1Bind {
                wr_id: info.wr_id,
                send_flags: info.send_flags,
                mr: info.mr.map(|m| m.core.clone()),
                addr: info.addr,
                length: info.length,
                access: info.access.bits(),
            },
        )
    }

    /// An `IBV_WR_BIND_MW` work request binding this (type 2) window to `length` bytes of `mr`
    /// at `addr`, after which it answers to `new_rkey` (only its low 8 bits are used: see
    /// [`inc_rkey`](crate::inc_rkey)).
    pub fn bind_request(
        &self,
        wr_id: u64,
        new_rkey: u32,
        mr: &MemoryRegion,
        addr: u64,
        length: u64,
        access: AccessFlags,
    ) -> SendRequest {
        SendRequest {
            wr_id,
            op: SendOp::BindMw(MwBind {
                mw_rkey: self.core.rkey(),
                new_rkey,
                mr_lkey: mr.lkey(),
                addr,
                length,
                access,
            }),
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(Vec::new()),
            ud: None,
            xrc_srqn: None,
        }
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        let r = self.core.dealloc();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// An address handle (`ibv_create_ah`). Destroyed when dropped.
///
/// UD QPs are not connected: every send names its destination, an address handle (the path
/// to a GID) plus the remote QP number and Q_Key ([`AddressHandle::ud_address`]). A receive
/// buffer starts with 40 bytes for the GRH, which tells who sent it and so how to answer
/// ([`ProtectionDomain::create_ah_from_wc`]). A multicast group is a GID too: QPs that
/// [`attach_mcast`](crate::QueuePair::attach_mcast) it each get one copy of what is sent to
/// it with QP number `0xFFFFFF`. Here a datagram, its answer, and a multicast datagram:
///
/// ```
/// use std::net::Ipv4Addr;
/// use std::time::{Duration, Instant};
/// use softverbs::*;
///
/// const QKEY: u32 = 0x1111_1111;
/// let ctx = devices()?.into_iter().find(|d| d.netdev() == "lo").expect("loopback").open()?;
/// let pd = ctx.alloc_pd()?;
/// let (send_cq, recv_cq) = (ctx.create_cq(16, None, 0)?, ctx.create_cq(16, None, 0)?);
/// let mr = pd.register(8192, AccessFlags::LOCAL_WRITE)?;
/// let init = QpInit { recv_cq: &recv_cq, ..QpInit::new(QpType::Ud, &send_cq) };
/// let (a, b) = (pd.create_qp(&init)?, pd.create_qp(&init)?);
/// for qp in [&a, &b] {
///     use QpAttrMask as M;
///     let init = QpAttr { qp_state: QpState::Init, port_num: 1, qkey: QKEY, ..Default::default() };
///     qp.modify(&init, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY)?;
///     qp.modify(&QpAttr { qp_state: QpState::Rtr, ..Default::default() }, M::STATE)?;
///     qp.modify(&QpAttr { qp_state: QpState::Rts, ..Default::default() }, M::STATE | M::SQ_PSN)?;
/// }
/// let wait = |cq: &CompletionQueue| {
///     let mut wc = [WorkCompletion::default()];
///     let deadline = Instant::now() + Duration::from_secs(20);
///     while cq.poll(&mut wc) == 0 {
///         assert!(Instant::now() < deadline, "no completion");
///     }
///     assert_eq!(wc[0].status, WcStatus::Success);
///     wc[0]
/// };
/// let send = |qp: &QueuePair, to: UdAddress, at: usize, len: usize| {
///     qp.post_send(&[SendRequest {
///         wr_id: 0,
///         op: SendOp::Send { imm: None, invalidate: None },
///         flags: SendFlags::SIGNALED,
///         payload: Payload::Sges(vec![mr.sge(at..at + len)?]),
///         ud: Some(to),
///         xrc_srqn: None,
///     }])?;
///     Ok::<_, Error>(wait(&send_cq))
/// };
///
/// // a to b, through an AH for 127.0.0.1.
/// let gid = Gid::from(Ipv4Addr::LOCALHOST);
/// let sgid_index = (0..).find(|&i| ctx.query_gid(1, i).is_ok_and(|g| g == gid)).unwrap() as u8;
/// let to_lo = AhAttr {
///     is_global: true,
///     port_num: 1,
///     grh: GlobalRoute { dgid: gid, sgid_index, hop_limit: 64, ..Default::default() },
///     ..Default::default()
/// };
/// let ah = pd.create_ah(&to_lo)?;
/// b.post_recv(&[RecvWr { wr_id: 1, sg_list: vec![mr.sge(0..1024)?] }])?;
/// mr.write(4096, b"ping")?;
/// assert_eq!(send(&a, ah.ud_address(b.qp_num(), QKEY), 4096, 4)?.opcode, WcOpcode::Send);
/// let got = wait(&recv_cq);
/// assert_eq!((got.wr_id, got.byte_len, got.src_qp), (1, 40 + 4, a.qp_num()));
///
/// // b answers whoever sent it, from the completion and the GRH.
/// let mut grh = [0u8; 40];
/// mr.read(0, &mut grh)?;
/// let reply = pd.create_ah_from_wc(&got, &grh, 1)?;
/// a.post_recv(&[RecvWr { wr_id: 2, sg_list: vec![mr.sge(1024..2048)?] }])?;
/// send(&b, reply.ud_address(got.src_qp, QKEY), 4096, 4)?;
/// assert_eq!(wait(&recv_cq).wr_id, 2);
///
/// // Multicast: b joins 239.1.1.1; a sends to the group.
/// let group = Gid::from(Ipv4Addr::new(239, 1, 1, 1));
/// b.attach_mcast(&group, 0)?;
/// b.post_recv(&[RecvWr { wr_id: 3, sg_list: vec![mr.sge(2048..3072)?] }])?;
/// let to_group = pd.create_ah(&AhAttr { grh: GlobalRoute { dgid: group, ..to_lo.grh }, ..to_lo })?;
/// send(&a, to_group.ud_address(0xFF_FFFF, QKEY), 4096, 4)?;
/// assert_eq!(wait(&recv_cq).wr_id, 3);
/// b.detach_mcast(&group, 0)?;
/// # Ok::<(), softverbs::Error>(())
/// ```
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

/// The error for an access to memory that is not mapped (imported on-demand regions), or
/// whose bytes a guard of a zero-copy region keeps from this access.
fn unmapped(_: softverbs_device::mem::Unmapped) -> Error {
    Error::invalid("the memory is not mapped, or a guard of the region excludes this access")
}
