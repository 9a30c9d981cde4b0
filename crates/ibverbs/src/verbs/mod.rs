//! Devices, contexts and the control verbs, one module per subject.
//!
//! Every C object handed out is the first field of a `repr(C)` box defined in [`objects`]
//! (`SvPd`, `SvCq`, ...), next to the `Arc` of its core object; converting a C pointer back is a
//! cast. Contexts are the exception: the `ibv_context` is the last field of a `verbs_context`,
//! which is the first field of `SvContext`. [`convert`] holds the pure translations between C
//! structures and core types, with no pointers and no `unsafe`.
//!
//! Return conventions follow the man pages: object constructors return NULL and set `errno`;
//! `ibv_query_gid`, `ibv_get_cq_event`, `ibv_get_async_event` and `ibv_init_ah_from_wc`
//! return -1 and set `errno`; the others return the errno value and, as rdma-core does, leave it
//! in `errno` too (every such failure returns through `crate::fail`).

use std::ffi::c_int;

use softverbs_engine::{Errno, Error};

mod ah;
mod convert;
mod cq;
mod device;
mod event;
mod mr;
mod mw;
mod objects;
mod pd;
mod qp;
mod query;
mod rereg;
mod srq;
mod unsupported;
mod xrc;

// The export table in `symbols` names the entry points through these; it is not assembled in
// unit tests, where some of them are then unused.
#[cfg_attr(test, allow(unused_imports))]
pub(crate) use {
    ah::*, convert::*, cq::*, device::*, event::*, mr::*, mw::*, objects::*, pd::*, qp::*, query::*,
    rereg::*, srq::*, unsupported::*, xrc::*,
};

pub(crate) const EINVAL: c_int = Errno::EINVAL as c_int;
pub(crate) const EOPNOTSUPP: c_int = Errno::EOPNOTSUPP as c_int;
pub(crate) const ENOSYS: c_int = Errno::ENOSYS as c_int;

/// The errno value of a core error.
pub(crate) fn errno_of(e: &Error) -> c_int {
    e.errno()
}
