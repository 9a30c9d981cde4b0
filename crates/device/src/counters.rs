//! Counters objects (`ibv_create_counters`): packet and byte counts of the flows they are
//! bound to, laid out by the counter points attached before binding
//! (`ibv_attach_counters_point_flow` in its static mode, then `IBV_FLOW_SPEC_ACTION_COUNT`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use softverbs_engine::{Error, Result};

use crate::context::Context;
use crate::sync::UseCount;

/// `enum ibv_counter_description`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterDesc {
    /// `IBV_COUNTER_PACKETS`.
    Packets,
    /// `IBV_COUNTER_BYTES`.
    Bytes,
}

impl CounterDesc {
    /// From the C value; `None` for a description this device does not count (ENOTSUP).
    pub fn from_raw(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Packets),
            1 => Some(Self::Bytes),
            _ => None,
        }
    }
}

/// `IBV_READ_COUNTERS_ATTR_PREFER_CACHED`.
pub const READ_COUNTERS_PREFER_CACHED: u32 = 1;

/// A counters object.
#[derive(Debug)]
pub struct Counters {
    ctx: Arc<Context>,
    /// (description, index) of each attached point.
    points: Mutex<Vec<(CounterDesc, u32)>>,
    packets: AtomicU64,
    bytes: AtomicU64,
    /// Flows bound to the object.
    uses: UseCount,
}

impl Counters {
    /// `ibv_create_counters`: cleared counters with no points yet.
    pub fn create(ctx: &Arc<Context>) -> Arc<Self> {
        Arc::new(Self {
            ctx: ctx.clone(),
            points: Mutex::new(Vec::new()),
            packets: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            uses: UseCount::default(),
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// `ibv_attach_counters_point_flow` with no flow (the static mode): `desc` will be read at
    /// `index`; several points at one index add up. EBUSY once a flow is bound.
    pub fn attach_point(&self, desc: CounterDesc, index: u32) -> Result<()> {
        let mut points = self.points.lock();
        if self.uses.count() != 0 {
            return Err(Error::busy(
                "the counters are bound to a flow: no more points can be attached",
            ));
        }
        points.push((desc, index));
        Ok(())
    }

    /// Binds a flow (at its creation); the points are fixed from now on.
    pub(crate) fn bind(&self) -> Result<()> {
        let _points = self.points.lock();
        self.uses.acquire("counters")
    }

    /// Unbinds a flow (at its destruction).
    pub(crate) fn unbind(&self) {
        self.uses.release();
    }

    /// Counts one frame of `len` bytes taken by a bound flow.
    pub(crate) fn count(&self, len: usize) {
        self.packets.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(len as u64, Ordering::Relaxed);
    }

    /// `ibv_read_counters`: fills `out` by the attached points (indexes beyond it are left out,
    /// slots without a point read 0). `flags` may only hold
    /// [`READ_COUNTERS_PREFER_CACHED`] (EINVAL otherwise); the counts are always current, so
    /// it changes nothing.
    pub fn read(&self, out: &mut [u64], flags: u32) -> Result<()> {
        if flags & !READ_COUNTERS_PREFER_CACHED != 0 {
            return Err(Error::invalid(format!("unknown read flags {flags:#x}")));
        }
        out.fill(0);
        let (packets, bytes) = (
            self.packets.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        );
        for &(desc, index) in self.points.lock().iter() {
            if let Some(slot) = out.get_mut(index as usize) {
                *slot += match desc {
                    CounterDesc::Packets => packets,
                    CounterDesc::Bytes => bytes,
                };
            }
        }
        Ok(())
    }

    /// `ibv_destroy_counters`: EBUSY while a flow is bound.
    pub fn destroy(&self) -> Result<()> {
        self.uses.retire("counters")
    }
}
