//! Calls that answer "not supported": the 1.0 compatibility entry points and the generic stubs
//! the export table points unoffered verbs at.

use std::ffi::{c_int, c_void};

use super::{ENOSYS, EOPNOTSUPP};
use crate::abi::*;
use crate::{fail, fail_null, set_errno};

/// `ibv_resolve_eth_l2_from_gid`: RoCE v2 is routed over UDP; there is no L2 to resolve.
pub(crate) extern "C" fn resolve_eth_l2_from_gid(
    _ctx: *mut ibv_context,
    _attr: *mut ibv_ah_attr,
    _mac: *mut u8,
    _vid: *mut u16,
) -> c_int {
    fail(EOPNOTSUPP)
}

/// Pointer-returning verbs that are not offered: NULL with EOPNOTSUPP.
pub(crate) extern "C" fn null_eopnotsupp() -> *mut c_void {
    fail_null(EOPNOTSUPP)
}

/// Errno-returning verbs that are not offered.
pub(crate) extern "C" fn eopnotsupp() -> c_int {
    fail(EOPNOTSUPP)
}

/// Calls with nothing to do.
pub(crate) extern "C" fn nothing() {}

/// The rdma-core 1.0 compatibility entry points take pre-1.1 structures, which no program
/// built against a current header passes: NULL with ENOSYS.
pub(crate) extern "C" fn compat_null() -> *mut c_void {
    fail_null(ENOSYS)
}

/// As [`compat_null`], for the int-returning ones: -1 with ENOSYS.
pub(crate) extern "C" fn compat_fail() -> c_int {
    set_errno(ENOSYS);
    -1
}
