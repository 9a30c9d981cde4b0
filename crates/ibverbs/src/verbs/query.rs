//! Device, port, GID and P_Key queries, and the sysfs helpers.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::mem::size_of;

use softverbs_engine::types::Gid;

use super::{context, device_attr_c, errno_of, gid_entry, port_attr_c, EINVAL};
use crate::abi::*;
use crate::{fail, fail_minus_one};

pub(crate) const ENODATA: c_int = libc::ENODATA;

/// `IBV_GID_TYPE_SYSFS_ROCE_V2` of `enum ibv_gid_type_sysfs` (what `ibv_query_gid_type` gives).
pub(crate) const GID_SYSFS_TYPE_ROCE_V2: c_uint = 1;

/// `ibv_query_device`.
pub(crate) unsafe extern "C" fn query_device(ctx: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail(EINVAL);
    };
    if attr.is_null() {
        return fail(EINVAL);
    }
    // SAFETY: the caller passes a writable `struct ibv_device_attr`.
    unsafe { attr.write(device_attr_c(&c.core.query_device())) };
    0
}

/// The `query_device_ex` op behind the `ibv_query_device_ex` inline wrapper.
pub(crate) unsafe extern "C" fn query_device_ex(
    ctx: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail(EINVAL);
    };
    // SAFETY: `input` is NULL or a readable input struct.
    if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
        return fail(EINVAL);
    }
    if attr.is_null() || attr_size < size_of::<ibv_device_attr>() {
        return fail(EINVAL);
    }
    let orig = device_attr_c(&c.core.query_device());
    // SAFETY: all-zero is a valid `ibv_device_attr_ex` (integers and plain structs only).
    let mut ex: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
    ex.orig_attr = orig;
    crate::clock::fill_device_attr_ex(&mut ex, &c.core.query_device_ex());
    ex.phys_port_cnt_ex = u32::from(orig.phys_port_cnt);
    ex.tm_caps = crate::tm::tm_caps_c(&c.core.device().tm_caps());
    ex.max_dm_size = c.core.device().limits().max_dm_size;
    crate::raw::fill_device_attr_ex(c.core.device(), &mut ex);
    let n = attr_size.min(size_of::<ibv_device_attr_ex>());
    // SAFETY: the caller's buffer holds `attr_size` bytes; we copy at most that many.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (&ex as *const ibv_device_attr_ex).cast::<u8>(),
            attr.cast::<u8>(),
            n,
        );
    };
    0
}

/// Writes at most `len` bytes of the port attributes.
pub(crate) unsafe fn query_port_into(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail(EINVAL);
    };
    if attr.is_null() {
        return fail(EINVAL);
    }
    match c.core.query_port(port) {
        Ok(p) => {
            let a = port_attr_c(&p);
            let n = len.min(size_of::<ibv_port_attr>());
            // SAFETY: the caller's buffer holds at least `len` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (&a as *const ibv_port_attr).cast::<u8>(),
                    attr.cast::<u8>(),
                    n,
                );
            };
            0
        }
        Err(e) => fail(errno_of(&e)),
    }
}

/// `ibv_query_port@@IBVERBS_1.1`: the buffer is the 48-byte `struct _compat_ibv_port_attr`.
pub(crate) unsafe extern "C" fn query_port_compat(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { query_port_into(ctx, port, attr, COMPAT_PORT_ATTR_SIZE) }
}

/// The `query_port` op of `verbs_context`, behind the `ibv_query_port` inline wrapper.
pub(crate) unsafe extern "C" fn query_port_ex(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    // SAFETY: the caller's pointers satisfy the verbs API contract, which is what the callee requires.
    unsafe { query_port_into(ctx, port, attr, len) }
}

/// `ibv_query_gid`: 0, or -1 with errno.
pub(crate) unsafe extern "C" fn query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    if gid.is_null() {
        return fail_minus_one(EINVAL);
    }
    match c.core.query_gid(port, index) {
        Ok(g) => {
            // SAFETY: the caller passes a writable `union ibv_gid`.
            unsafe { gid.write(ibv_gid { raw: g.0 }) };
            0
        }
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

/// `ibv_query_gid_type` (IBVERBS_PRIVATE_34): the sysfs GID type; 0, or -1 with errno.
pub(crate) unsafe extern "C" fn query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: c_uint,
    ty: *mut c_uint,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    match c.core.query_gid(port, index.min(i32::MAX as u32) as i32) {
        Ok(_) if !ty.is_null() => {
            // SAFETY: the caller passes a writable enum.
            unsafe { ty.write(GID_SYSFS_TYPE_ROCE_V2) };
            0
        }
        Ok(_) => fail_minus_one(EINVAL),
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

/// `_ibv_query_gid_ex`: 0 or an errno (ENODATA for an empty entry).
pub(crate) unsafe extern "C" fn query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail(EINVAL);
    };
    if flags != 0 || entry.is_null() || entry_size < size_of::<ibv_gid_entry>() {
        return fail(EINVAL);
    }
    let Ok(port) = u8::try_from(port) else {
        return fail(EINVAL);
    };
    match c.core.query_gid(port, index.min(i32::MAX as u32) as i32) {
        Ok(g) if g.is_zero() => fail(ENODATA),
        Ok(g) => {
            // SAFETY: the caller's entry holds at least `sizeof(struct ibv_gid_entry)` bytes.
            unsafe { entry.write(gid_entry(c.core.device().ifindex(), port, index, g)) };
            0
        }
        Err(e) => fail(errno_of(&e)),
    }
}

/// `_ibv_query_gid_table`: the number of valid entries written, or a negative errno.
pub(crate) unsafe extern "C" fn query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return -(fail(EINVAL) as isize);
    };
    if flags != 0 || entries.is_null() || entry_size < size_of::<ibv_gid_entry>() {
        return -(fail(EINVAL) as isize);
    }
    let table = c.core.device().gid_table();
    let valid: Vec<(usize, Gid)> = table
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, g)| !g.is_zero())
        .collect();
    if valid.len() > max_entries {
        return -(fail(EINVAL) as isize);
    }
    for (n, (i, g)) in valid.iter().enumerate() {
        // SAFETY: the caller's array has `max_entries` entries of `entry_size` bytes each.
        unsafe {
            entries
                .cast::<u8>()
                .add(n * entry_size)
                .cast::<ibv_gid_entry>()
                .write_unaligned(gid_entry(c.core.device().ifindex(), 1, *i as u32, *g));
        }
    }
    valid.len() as isize
}

/// `ibv_query_pkey`: 0, or -1 with errno.
pub(crate) unsafe extern "C" fn query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    match c.core.query_pkey(port, index) {
        Ok(k) if !pkey.is_null() => {
            // SAFETY: the caller passes a writable `__be16`.
            unsafe { pkey.write(k.to_be()) };
            0
        }
        Ok(_) => fail_minus_one(EINVAL),
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

/// `ibv_get_pkey_index`: the index, or -1 with errno.
pub(crate) unsafe extern "C" fn get_pkey_index(ctx: *mut ibv_context, port: u8, pkey: u16) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    match c.core.pkey_index(port, u16::from_be(pkey)) {
        Ok(i) => c_int::from(i),
        Err(e) => fail_minus_one(errno_of(&e)),
    }
}

/// `ibv_get_sysfs_path`.
pub(crate) extern "C" fn get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// `ibv_read_sysfs_file`: reads `dir/file` into `buf`, dropping a trailing newline; the
/// length, or -1 if it cannot be read (our devices have no sysfs entries).
pub(crate) unsafe extern "C" fn read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
        return fail_minus_one(EINVAL);
    }
    // SAFETY: the caller passes NUL-terminated strings.
    let (dir, file) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
    let path = format!("{}/{}", dir.to_string_lossy(), file.to_string_lossy());
    let data = match std::fs::read(&path) {
        Ok(d) => d,
        Err(e) => return fail_minus_one(e.raw_os_error().unwrap_or(libc::ENOENT)),
    };
    let mut n = data.len().min(size - 1);
    if n > 0 && data[n - 1] == b'\n' {
        n -= 1;
    }
    // SAFETY: `buf` holds `size` bytes and `n < size`.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
    n as c_int
}

/// `ibv_read_ibdev_sysfs_file` (IBVERBS_PRIVATE_34): our devices have no sysfs directory.
pub(crate) extern "C" fn read_ibdev_sysfs_file(_buf: *mut c_char, _size: usize, _dev: *mut c_void) -> c_int {
    fail_minus_one(libc::ENOENT)
}
