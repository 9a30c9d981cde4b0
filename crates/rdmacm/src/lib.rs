//! The drop-in C ABI of the RDMA connection manager: `librdmacm.so.1`.
//!
//! It exports every symbol of rdma-core 44's `librdmacm.so.1` at its version (nodes RDMACM_1.0
//! to 1.3), so programs linked against Debian's library load and bind (`-z now`) against it.
//! The connection-manager and rsocket semantics live in the device core
//! (`softverbs_device::cm`, `softverbs_device::rsocket`), and their C entry points in this
//! workspace's `libibverbs.so.1`, beside the verbs objects the ids refer to (one core per
//! process); this library forwards to them through the private table `softverbs_rdmacm_ops`.
//! Under a `libibverbs.so.1` without that table every call fails with -1 and `errno` ENOSYS.
//!
//! - [`abi`]: `repr(C)` mirrors of the `<rdma/rdma_cma.h>` structures, checked against the
//!   system header by the unit tests.
//! - `entry`: the entry points: forwarding and the table lookup.
//! - `symbols`: the export table (`.symver` trampolines, as in `crates/ibverbs`).
#![allow(unsafe_code)] // this crate is a C ABI
#![deny(unsafe_op_in_unsafe_fn)]
// Unit tests are linked without the version script, so the exports are not assembled there and
// the entry points look unused.
#![cfg_attr(test, allow(dead_code))]

pub mod abi;
mod entry;
mod symbols;

#[cfg(test)]
mod layout_tests;

use std::ffi::c_int;

/// Sets the calling thread's `errno`.
fn set_errno(e: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
}

/// librdmacm's failure convention: `errno` set, -1 returned.
fn fail(e: c_int) -> c_int {
    set_errno(e);
    -1
}
