//! The drop-in C ABI: `libibverbs.so.1` over the softverbs device.
//!
//! This is the only crate that talks to C, and so the only one allowed `unsafe`. It exports the
//! libibverbs entry points with their C signatures; each is a thin translation onto the core
//! object model in `softverbs-device`, so C programs and the safe Rust API share every rule.
//!
//! Exported so far: the process-wide helpers that need no device objects (static-rate
//! conversions, fork support and the `*_str` helpers). The object verbs, the `ibv_context.ops`
//! table and symbol versioning follow with the drop-in library.
#![allow(unsafe_code)] // exporting unmangled symbols is an unsafe attribute

use std::ffi::{c_char, c_int, CStr};

use softverbs_engine::rate;
use softverbs_engine::types::{EventType, WcStatus};

/// `ibv_rate_to_mult`.
#[no_mangle]
pub extern "C" fn ibv_rate_to_mult(rate: c_int) -> c_int {
    rate::rate_to_mult(rate)
}

/// `mult_to_ibv_rate`.
#[no_mangle]
pub extern "C" fn mult_to_ibv_rate(mult: c_int) -> c_int {
    rate::mult_to_rate(mult)
}

/// `ibv_rate_to_mbps`.
#[no_mangle]
pub extern "C" fn ibv_rate_to_mbps(rate: c_int) -> c_int {
    rate::rate_to_mbps(rate)
}

/// `mbps_to_ibv_rate`.
#[no_mangle]
pub extern "C" fn mbps_to_ibv_rate(mbps: c_int) -> c_int {
    rate::mbps_to_rate(mbps)
}

/// `ibv_fork_init`: registered memory is never pinned, so fork is always safe.
#[no_mangle]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

/// `ibv_is_fork_initialized`: `IBV_FORK_UNNEEDED`.
#[no_mangle]
pub extern "C" fn ibv_is_fork_initialized() -> c_int {
    2
}

/// Interns a status or event text as a NUL-terminated C string with static lifetime.
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
#[no_mangle]
pub extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    let text = u32::try_from(status)
        .ok()
        .and_then(WcStatus::from_raw)
        .map_or("unknown", WcStatus::as_str);
    c_text(text)
}

/// `ibv_event_type_str`.
#[no_mangle]
pub extern "C" fn ibv_event_type_str(event: c_int) -> *const c_char {
    let text = u32::try_from(event)
        .ok()
        .and_then(EventType::from_raw)
        .map_or("unknown", EventType::as_str);
    c_text(text)
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
        assert_eq!(ibv_fork_init(), 0);
        assert_eq!(ibv_is_fork_initialized(), 2);
    }
}
