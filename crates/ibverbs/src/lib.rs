//! The drop-in C ABI: `libibverbs.so.1` over the softverbs device.
//!
//! This is the only crate that talks to C, and so the only one allowed `unsafe`. It exports the
//! libibverbs entry points of rdma-core 44 with their C signatures and symbol versions; each is
//! a thin translation onto the core object model in `softverbs-device`, so C programs and the
//! safe Rust API share every rule.
//!
//! - [`abi`]: `repr(C)` mirrors of the `<infiniband/verbs.h>` structures.
//! - `symbols`: the export table. Every entry point is an internal Rust function; `global_asm!`
//!   gives it a versioned name (`ibv_alloc_pd@@IBVERBS_1.1`) with `.symver`, and `build.rs`
//!   passes a version script that declares the nodes, the soname and `-z now`.
//! - `verbs`: devices, contexts and the control verbs, a module per subject, with the pure
//!   struct conversions in `verbs::convert`; `datapath`: posting, polling, the extended CQ
//!   (`ibv_cq_ex`) and the extended QP work-request API (`ibv_wr_*`).
//!
//! - `cm`: the connection manager's C entry points, which `librdmacm.so.1` (`crates/rdmacm`)
//!   reaches through one private export, `softverbs_rdmacm_ops@@SOFTVERBS_PRIVATE_1`;
//!   `rsocket`: the rsocket entry points, reached through the same table.
//!
//! Each C object is the first field of a Rust-owned `repr(C)` box that also holds the `Arc` of
//! its core object, so a C pointer converts back to its box by a cast. The `ibv_context` is the
//! last field of a `verbs_context`, as the inline wrappers of `verbs.h` require.
//!
//! Build it with `crates/ibverbs/build-lib.sh` (or `cargo build --release -p
//! softverbs-ibverbs` and link `libibverbs.so.1` to `target/release/libibverbs.so`).
#![allow(unsafe_code)] // this crate is the C ABI
#![deny(unsafe_op_in_unsafe_fn)]
// Unit tests are linked without the version script, so the exports are not assembled there and
// the entry points look unused.
#![cfg_attr(test, allow(dead_code))]

pub mod abi;
mod clock;
mod cm;
mod counters;
mod cq_moderation;
mod datapath;
mod dm;
mod domain;
mod import;
mod memory;
mod odp;
mod rate_limit;
mod raw;
mod rsocket;
mod symbols;
mod tm;
mod verbs;

#[cfg(test)]
mod layout_tests;

use std::ffi::{c_char, c_int, c_void, CStr};

use softverbs_engine::rate;
use softverbs_engine::types::{EventType, WcStatus};

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
}

/// Sets `errno` to `e` and returns it: the failure convention of the verbs that return an
/// errno value. rdma-core leaves the same value in `errno` on every failing verb and programs
/// print `strerror(errno)`, so every such failure return goes through here.
pub(crate) fn fail(e: c_int) -> c_int {
    set_errno(e);
    e
}

/// Sets `errno` and returns NULL: the failure convention of the verbs that return objects.
pub(crate) fn fail_null<T>(e: c_int) -> *mut T {
    set_errno(e);
    std::ptr::null_mut()
}

/// Sets `errno` and returns -1: the failure convention of the `-1 on error` verbs.
pub(crate) fn fail_minus_one(e: c_int) -> c_int {
    set_errno(e);
    -1
}

/// `ibv_rate_to_mult`.
extern "C" fn ibv_rate_to_mult(rate: c_int) -> c_int {
    rate::rate_to_mult(rate)
}

/// `mult_to_ibv_rate`.
extern "C" fn mult_to_ibv_rate(mult: c_int) -> c_int {
    rate::mult_to_rate(mult)
}

/// `ibv_rate_to_mbps`.
extern "C" fn ibv_rate_to_mbps(rate: c_int) -> c_int {
    rate::rate_to_mbps(rate)
}

/// `mbps_to_ibv_rate`.
extern "C" fn mbps_to_ibv_rate(mbps: c_int) -> c_int {
    rate::mbps_to_rate(mbps)
}

/// `ibv_fork_init`: registered memory is never pinned, so fork is always safe.
extern "C" fn ibv_fork_init() -> c_int {
    0
}

/// `ibv_is_fork_initialized`: `IBV_FORK_UNNEEDED`.
extern "C" fn ibv_is_fork_initialized() -> c_int {
    2
}

/// `ibv_dofork_range` / `ibv_dontfork_range`: nothing is pinned, so there is nothing to do.
extern "C" fn ibv_fork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// Interns a text as a NUL-terminated C string with static lifetime.
fn c_text(s: &'static str) -> *const c_char {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static TEXTS: OnceLock<Mutex<HashMap<&'static str, &'static CStr>>> = OnceLock::new();
    let mut map = TEXTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    map.entry(s)
        .or_insert_with(|| {
            let owned = std::ffi::CString::new(s).expect("texts have no NUL");
            Box::leak(owned.into_boxed_c_str())
        })
        .as_ptr()
}

/// `ibv_wc_status_str`.
extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    let text = u32::try_from(status)
        .ok()
        .and_then(WcStatus::from_raw)
        .map_or("unknown", WcStatus::as_str);
    c_text(text)
}

/// `ibv_event_type_str`.
extern "C" fn ibv_event_type_str(event: c_int) -> *const c_char {
    let text = u32::try_from(event)
        .ok()
        .and_then(EventType::from_raw)
        .map_or("unknown", EventType::as_str);
    c_text(text)
}

/// `ibv_node_type_str`.
extern "C" fn ibv_node_type_str(node_type: c_int) -> *const c_char {
    c_text(match node_type {
        1 => "InfiniBand channel adapter",
        2 => "InfiniBand switch",
        3 => "InfiniBand router",
        4 => "iWARP NIC",
        5 => "usNIC",
        6 => "usNIC UDP",
        7 => "unspecified",
        _ => "unknown",
    })
}

/// `ibv_port_state_str`.
extern "C" fn ibv_port_state_str(state: c_int) -> *const c_char {
    c_text(match state {
        0 => "no state change (NOP)",
        1 => "down",
        2 => "init",
        3 => "armed",
        4 => "active",
        5 => "active defer",
        _ => "unknown",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(p: *const c_char) -> String {
        // SAFETY: the pointers come from `c_text`, which hands out leaked, NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned()
    }

    #[test]
    fn rate_helpers() {
        assert_eq!(ibv_rate_to_mult(5), 2);
        assert_eq!(mult_to_ibv_rate(2), 5);
        assert_eq!(ibv_rate_to_mbps(3), 10000);
        assert_eq!(mbps_to_ibv_rate(10000), 3);
    }

    #[test]
    fn strings() {
        assert_eq!(text(ibv_wc_status_str(5)), "Work Request Flushed Error");
        assert_eq!(text(ibv_wc_status_str(999)), "unknown");
        assert_eq!(ibv_wc_status_str(5), ibv_wc_status_str(5), "interned");
        assert_eq!(text(ibv_event_type_str(5)), "send queue drained");
        assert_eq!(text(ibv_node_type_str(1)), "InfiniBand channel adapter");
        assert_eq!(text(ibv_port_state_str(4)), "active");
        assert_eq!(ibv_fork_init(), 0);
        assert_eq!(ibv_is_fork_initialized(), 2);
    }
}
