//! Thread domains (`ibv_alloc_td`); parent domains are [`ProtectionDomain`]s made by
//! [`ProtectionDomain::alloc_parent_domain`](crate::ProtectionDomain::alloc_parent_domain).

use std::sync::Arc;

use softverbs_device as core;
use softverbs_engine::Result;

use crate::context::Context;

#[derive(Debug)]
struct TdInner {
    core: Arc<core::Td>,
    _ctx: Context,
}

impl Drop for TdInner {
    fn drop(&mut self) {
        // Parent domains hold a handle to their thread domain, so none is left.
        let r = self.core.dealloc();
        debug_assert!(r.is_ok(), "{r:?}");
    }
}

/// A thread domain (`struct ibv_td`): a marker that objects of parent domains created with it
/// are used by one thread at a time. Cheap to clone; deallocated with its last handle.
#[derive(Debug, Clone)]
pub struct ThreadDomain(Arc<TdInner>);

impl ThreadDomain {
    pub(crate) fn alloc(ctx: &Context) -> Result<Self> {
        Ok(Self(Arc::new(TdInner {
            core: core::Td::alloc(ctx.core())?,
            _ctx: ctx.clone(),
        })))
    }

    pub(crate) fn core(&self) -> &Arc<core::Td> {
        &self.0.core
    }
}
