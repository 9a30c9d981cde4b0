//! Memory windows (`ibv_alloc_mw`, `ibv_bind_mw`, `ibv_dealloc_mw`).
//!
//! A window's binding changes only when its QP's requester reaches a BIND_MW or LOCAL_INV work
//! request, or when a SEND with Invalidate arrives; the engine asks for that through its memory
//! trait, which the key table implements with `Mw::execute_bind` and `Mw::execute_invalidate`.
//! The rules themselves are the engine's ([`Window`]).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use softverbs_engine::memory::MemError;
use softverbs_engine::mw::{inc_rkey, MrInfo, MwBind, MwType, Window};
use softverbs_engine::types::SendFlags;
use softverbs_engine::wr::{Payload, SendOp};
use softverbs_engine::{Error, Result};

use crate::device::Resource;
use crate::mem::KeyTable;
use crate::pd::{Mr, Pd};
use crate::qp::{Qp, SendRequest};
use crate::sync::UseCount;

/// The state of a window: the engine's view, and the region it keeps registered while bound.
#[derive(Debug)]
pub(crate) struct MwState {
    pub(crate) window: Window,
    pub(crate) mr: Option<Arc<Mr>>,
}

/// A memory window (`ibv_alloc_mw`).
#[derive(Debug)]
pub struct Mw {
    pd: Arc<Pd>,
    handle: u32,
    mw_type: MwType,
    /// The rkey as `ibv_mw.rkey` shows it: for a type 1 window, `ibv_bind_mw` sets it when it
    /// posts the bind, before the bind executes.
    posted_rkey: AtomicU32,
    state: Mutex<MwState>,
    uses: UseCount,
}

/// A bind of a type 1 window (`struct ibv_mw_bind`).
#[derive(Debug, Clone)]
pub struct Type1Bind {
    /// Returned in the completion.
    pub wr_id: u64,
    /// `IBV_SEND_SIGNALED`, `IBV_SEND_FENCE`.
    pub send_flags: SendFlags,
    /// The region; `None` (with `addr` and `length` 0) unbinds.
    pub mr: Option<Arc<Mr>>,
    /// First byte of the window, as the region's rkey addresses it.
    pub addr: u64,
    /// Length of the window.
    pub length: u64,
    /// `mw_access_flags`.
    pub access: u32,
}

impl Mw {
    /// `ibv_alloc_mw`: a window of `IBV_MW_TYPE_1` or `IBV_MW_TYPE_2` (any other type is
    /// EINVAL), unbound; ENOMEM beyond `max_mw`.
    pub fn alloc(pd: &Arc<Pd>, mw_type: u32) -> Result<Arc<Self>> {
        let mw_type = MwType::from_raw(mw_type)
            .ok_or_else(|| Error::invalid(format!("memory window type {mw_type}")))?;
        let device = pd.context().device();
        pd.uses().acquire("protection domain")?;
        if let Err(e) = device.acquire(Resource::Mw) {
            pd.uses().release();
            return Err(e);
        }
        let rkey = device.alloc_mw_key();
        let mw = Arc::new(Self {
            pd: pd.clone(),
            handle: pd.context().next_handle(),
            mw_type,
            posted_rkey: AtomicU32::new(rkey),
            state: Mutex::new(MwState {
                window: Window::new(mw_type, pd.handle(), rkey),
                mr: None,
            }),
            uses: UseCount::default(),
        });
        device.node().keys.insert_mw(rkey, &mw);
        Ok(mw)
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// Handle (`ibv_mw.handle`).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// Type.
    pub fn mw_type(&self) -> MwType {
        self.mw_type
    }

    /// The rkey `ibv_mw.rkey` shows: the allocation's, then for a type 1 window the one the
    /// latest `ibv_bind_mw` posted. (A type 2 window's key is chosen by each BIND_MW request.)
    pub fn rkey(&self) -> u32 {
        self.posted_rkey.load(Ordering::Acquire)
    }

    /// The key remote peers must use now (that of the latest executed bind), and whether the
    /// window is bound.
    pub fn current(&self) -> (u32, bool) {
        let st = self.state.lock();
        (st.window.rkey, st.window.target.is_some())
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, MwState> {
        self.state.lock()
    }

    /// `ibv_bind_mw`: posts a bind of this type 1 window on `qp` and returns the window's new
    /// rkey (`ibv_inc_rkey` of the previous one), which [`Mw::rkey`] shows from now on. The
    /// bind executes in send-queue order; a bind that breaks a rule completes with
    /// `IBV_WC_MW_BIND_ERR`.
    ///
    /// What `ibv_bind_mw` checks at once: a type 2 window is EINVAL, an address or length
    /// without a region is EINVAL, a region of another PD is EPERM, and posting errors are
    /// those of `ibv_post_send`.
    pub fn bind(&self, qp: &Qp, bind: &Type1Bind) -> Result<u32> {
        if self.mw_type != MwType::Type1 {
            return Err(Error::invalid(
                "ibv_bind_mw binds type 1 windows; type 2 windows are bound with IBV_WR_BIND_MW",
            ));
        }
        if bind.mr.is_none() && (bind.addr != 0 || bind.length != 0) {
            return Err(Error::invalid("an address or length without a memory region"));
        }
        if let Some(mr) = &bind.mr {
            if !Arc::ptr_eq(&mr.pd(), &self.pd) {
                return Err(Error::permission(
                    "the memory region and the window belong to different PDs",
                ));
            }
        }
        if !Arc::ptr_eq(qp.context().device().node(), self.pd.context().device().node()) {
            return Err(Error::invalid(
                "the QP and the window belong to different devices",
            ));
        }
        let old = self.rkey();
        let new = inc_rkey(old);
        let req = SendRequest {
            wr_id: bind.wr_id,
            op: SendOp::BindMw(MwBind {
                mw_rkey: old,
                new_rkey: new,
                mr_lkey: bind.mr.as_ref().map_or(0, |m| m.lkey()),
                addr: bind.addr,
                length: bind.length,
                access: softverbs_engine::types::AccessFlags::from_bits_retain(bind.access),
            }),
            flags: bind.send_flags,
            payload: Payload::Sges(Vec::new()),
            ud: None,
            xrc_srqn: None,
        };
        qp.post_send(std::slice::from_ref(&req))?;
        self.posted_rkey.store(new, Ordering::Release);
        Ok(new)
    }

    /// Executes a bind the engine reached (see [`Window::check_bind`]). The region stays
    /// registered (its dereg is EBUSY) while the window is bound to it.
    pub(crate) fn execute_bind(
        &self,
        keys: &KeyTable,
        qpn: u32,
        qp_pd: u32,
        bind: &MwBind,
    ) -> Result<(), MemError> {
        let mut st = self.state.lock();
        if self.uses.is_retired() {
            return Err(MemError::BadKey);
        }
        let mr = keys.by_lkey(bind.mr_lkey);
        let map = mr.as_ref().map(|m| m.mapping().read());
        let info = map.as_ref().map(|m| MrInfo {
            pd: m.pd.handle(),
            access: m.access,
            iova: m.iova,
            length: m.length,
        });
        let target = st.window.check_bind(qpn, qp_pd, bind, info.as_ref())?;
        let mr = match (target, mr.as_ref()) {
            (Some(_), Some(m)) => {
                // Fails only if the region was deregistered after the lookup.
                m.uses().acquire("memory region").map_err(|_| MemError::BadKey)?;
                Some(m.clone())
            }
            _ => None,
        };
        drop(map);
        if let Some(old) = std::mem::replace(&mut st.mr, mr) {
            old.uses().release();
        }
        st.window.apply_bind(bind, target);
        Ok(())
    }

    /// Executes a LOCAL_INV, or a received SEND with Invalidate (see
    /// [`Window::check_invalidate`]).
    pub(crate) fn execute_invalidate(&self, qpn: u32, pd: u32, rkey: u32) -> Result<(), MemError> {
        let mut st = self.state.lock();
        st.window.check_invalidate(qpn, pd, rkey)?;
        Self::unbind(&mut st);
        Ok(())
    }

    /// Invalidates the window if it is a type 2 window bound to QP `qpn` (being destroyed).
    pub(crate) fn release_qp(&self, qpn: u32) {
        let mut st = self.state.lock();
        if st.window.target.is_some_and(|t| t.qpn == Some(qpn)) {
            Self::unbind(&mut st);
        }
    }

    fn unbind(st: &mut MwState) {
        st.window.invalidate();
        if let Some(mr) = st.mr.take() {
            mr.uses().release();
        }
    }

    fn teardown(&self) {
        let key = {
            let mut st = self.state.lock();
            Self::unbind(&mut st);
            st.window.rkey
        };
        let device = self.pd.context().device();
        device.node().keys.remove_mw(key);
        device.free_mw_key(key);
        device.release(Resource::Mw);
        self.pd.uses().release();
    }

    /// `ibv_dealloc_mw`: unbinds the window if it is bound and frees it. EINVAL if it was
    /// already deallocated.
    pub fn dealloc(&self) -> Result<()> {
        self.uses.retire("memory window")?;
        self.teardown();
        Ok(())
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.teardown();
        }
    }
}
