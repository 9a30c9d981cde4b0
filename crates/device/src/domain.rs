//! Thread domains (`ibv_alloc_td`) and parent domains (`ibv_alloc_parent_domain`).
//!
//! A thread domain is the application's promise that objects created under it are used by one
//! thread at a time, which lets the library skip its own locks on them. A parent domain wraps a
//! PD (and optionally a thread domain) and is used wherever a PD is; objects created through it
//! belong to the inner PD. Teardown follows the usual rules: the inner PD and the thread domain
//! are busy while a parent domain uses them, and a parent domain is busy while a CQ or QP
//! created through it exists.

use std::sync::Arc;

use softverbs_engine::{Error, Result};

use crate::context::Context;
use crate::pd::Pd;
use crate::sync::UseCount;

/// A thread domain (`struct ibv_td`).
#[derive(Debug)]
pub struct Td {
    ctx: Arc<Context>,
    uses: UseCount,
}

impl Td {
    /// `ibv_alloc_td`.
    pub fn alloc(ctx: &Arc<Context>) -> Result<Arc<Self>> {
        Ok(Arc::new(Self {
            ctx: ctx.clone(),
            uses: UseCount::default(),
        }))
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// `ibv_dealloc_td`: EBUSY, changing nothing, while a parent domain uses it.
    pub fn dealloc(&self) -> Result<()> {
        self.uses.retire("thread domain")
    }
}

/// A parent domain: a PD plus an optional thread domain.
#[derive(Debug)]
pub struct ParentDomain {
    pd: Arc<Pd>,
    td: Option<Arc<Td>>,
    uses: UseCount,
}

impl ParentDomain {
    /// `ibv_alloc_parent_domain`: EINVAL if `pd` or `td` is of another context or destroyed.
    pub fn alloc(ctx: &Arc<Context>, pd: &Arc<Pd>, td: Option<&Arc<Td>>) -> Result<Arc<Self>> {
        if !ctx.shares_objects_with(pd.context()) {
            return Err(Error::invalid("the PD belongs to another context"));
        }
        if td.is_some_and(|t| !Arc::ptr_eq(t.context(), ctx)) {
            return Err(Error::invalid("the thread domain belongs to another context"));
        }
        pd.uses().acquire("protection domain")?;
        if let Some(t) = td {
            if let Err(e) = t.uses.acquire("thread domain") {
                pd.uses().release();
                return Err(e);
            }
        }
        Ok(Arc::new(Self {
            pd: pd.clone(),
            td: td.cloned(),
            uses: UseCount::default(),
        }))
    }

    /// The inner PD, which objects created through the parent domain belong to.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// The thread domain, if any.
    pub fn td(&self) -> Option<&Arc<Td>> {
        self.td.as_ref()
    }

    /// Whether objects created through it are used by one thread at a time.
    pub fn single_threaded(&self) -> bool {
        self.td.is_some()
    }

    /// Records a CQ or QP created through the parent domain; it stays busy until the returned
    /// guard is dropped. EINVAL if the parent domain was deallocated.
    pub fn hold(self: &Arc<Self>) -> Result<DomainUse> {
        self.uses.acquire("parent domain")?;
        Ok(DomainUse(self.clone()))
    }

    fn teardown(&self) {
        self.pd.uses().release();
        if let Some(t) = &self.td {
            t.uses.release();
        }
    }

    /// `ibv_dealloc_pd` on a parent domain: EBUSY, changing nothing, while a CQ or QP created
    /// through it exists.
    pub fn dealloc(&self) -> Result<()> {
        self.uses.retire("parent domain")?;
        self.teardown();
        Ok(())
    }
}

impl Drop for ParentDomain {
    fn drop(&mut self) {
        if !self.uses.is_retired() {
            self.teardown();
        }
    }
}

/// A CQ's or QP's use of a parent domain (see [`ParentDomain::hold`]).
#[derive(Debug)]
pub struct DomainUse(Arc<ParentDomain>);

impl DomainUse {
    /// The parent domain.
    pub fn domain(&self) -> &Arc<ParentDomain> {
        &self.0
    }
}

impl Drop for DomainUse {
    fn drop(&mut self) {
        self.0.uses.release();
    }
}
