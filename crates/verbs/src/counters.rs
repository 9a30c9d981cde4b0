//! Flow counters (`ibv_create_counters`, `ibv_attach_counters_point_flow`,
//! `ibv_read_counters`).

use std::sync::Arc;

use softverbs_device as core;
use softverbs_engine::{Error, Result};

use crate::context::Context;

pub use core::counters::READ_COUNTERS_PREFER_CACHED;
pub use core::CounterDesc;

/// A counters object; destroyed when dropped (or by [`Counters::destroy`]).
///
/// Attach its points with [`Counters::attach_point`], then bind it to flows with
/// [`QueuePair::create_flow_counted`](crate::QueuePair::create_flow_counted); every frame those
/// flows take is counted.
#[derive(Debug)]
pub struct Counters {
    pub(crate) core: Arc<core::Counters>,
    _ctx: Context,
    destroyed: bool,
}

impl Context {
    /// `ibv_create_counters`: cleared counters without points.
    pub fn create_counters(&self) -> Counters {
        Counters {
            core: core::Counters::create(self.core()),
            _ctx: self.clone(),
            destroyed: false,
        }
    }
}

impl Counters {
    /// `ibv_attach_counters_point_flow` in the static mode: `desc` is read at `index` of
    /// [`Counters::read`]; points at the same index add up. EBUSY once bound to a flow.
    pub fn attach_point(&self, desc: CounterDesc, index: u32) -> Result<()> {
        self.core.attach_point(desc, index)
    }

    /// `ibv_read_counters`: `out[i]` is the sum of the points at index `i`. `flags` may hold
    /// only [`READ_COUNTERS_PREFER_CACHED`] (EINVAL otherwise).
    pub fn read(&self, out: &mut [u64], flags: u32) -> Result<()> {
        self.core.read(out, flags)
    }

    /// `ibv_destroy_counters`: EBUSY (and the counters back) while a flow is bound.
    pub fn destroy(mut self) -> std::result::Result<(), (Self, Error)> {
        match self.core.destroy() {
            Ok(()) => {
                self.destroyed = true;
                Ok(())
            }
            Err(e) => Err((self, e)),
        }
    }
}

impl Drop for Counters {
    fn drop(&mut self) {
        if !self.destroyed {
            // EBUSY: bound flows keep the object alive; it goes with the last of them.
            let _ = self.core.destroy();
        }
    }
}
