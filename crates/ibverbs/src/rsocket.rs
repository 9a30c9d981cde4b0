//! The rsocket entry points (`<rdma/rsocket.h>`), reached by `librdmacm.so.1` through the
//! private table `softverbs_rdmacm_ops`. They live in this library for the same reason as the
//! connection manager's: the sockets are built on this library's copy of the core.
//!
//! An rsocket is known to C by a number that is a file descriptor the core socket owns (its
//! CM event channel, or its UDP socket), as in librdmacm, so it never equals another
//! descriptor of the process and `rpoll`/`rselect` can take both kinds in one call. This
//! file keeps the table from numbers to sockets and translates C buffers, addresses and
//! errnos; the semantics are `softverbs_device::rsocket`'s.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::mem::size_of;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libc::{fd_set, iovec, msghdr, nfds_t, off_t, pollfd, sockaddr, socklen_t, ssize_t, timeval};
use softverbs_device::rsocket::{self as rs, PollEntry, PollTarget, Shutdown, Socket};
use softverbs_engine::Error;

use crate::cm::{sock_addr, sockaddr_len, store_addr};
use crate::memory::RawMemory;
use crate::{fail_minus_one, set_errno};

/// The open rsockets by number.
static SOCKETS: Mutex<Option<HashMap<c_int, Socket>>> = Mutex::new(None);

fn table() -> std::sync::MutexGuard<'static, Option<HashMap<c_int, Socket>>> {
    SOCKETS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The socket numbered `s` (a clone: calls run without the table locked).
fn lookup(s: c_int) -> Option<Socket> {
    table().as_ref().and_then(|t| t.get(&s).cloned())
}

fn insert(sock: Socket) -> c_int {
    let n = sock.number();
    table().get_or_insert_with(HashMap::new).insert(n, sock);
    n
}

fn err(e: &Error) -> c_int {
    fail_minus_one(e.errno())
}

fn err_ssize(e: &Error) -> ssize_t {
    set_errno(e.errno());
    -1
}

/// Runs `f` on socket `s`, or fails with EBADF.
fn with<R>(s: c_int, bad: R, f: impl FnOnce(&Socket) -> R) -> R {
    match lookup(s) {
        Some(sock) => f(&sock),
        None => {
            set_errno(libc::EBADF);
            bad
        }
    }
}

/// A C address of `len` bytes as a socket address: EINVAL if too short for its family,
/// EAFNOSUPPORT for families other than IPv4 and IPv6.
///
/// # Safety
/// `addr` is NULL or points at `len` readable bytes.
unsafe fn read_addr(addr: *const sockaddr, len: socklen_t) -> Result<SocketAddr, Error> {
    let e = |n| Error::Io(std::io::Error::from_raw_os_error(n));
    if addr.is_null() || (len as usize) < size_of::<libc::sa_family_t>() {
        return Err(e(libc::EINVAL));
    }
    // SAFETY: at least the family field is readable (checked above).
    let family = c_int::from(unsafe { (*addr).sa_family });
    let need = match family {
        libc::AF_INET => size_of::<libc::sockaddr_in>(),
        libc::AF_INET6 => size_of::<libc::sockaddr_in6>(),
        _ => return Err(e(libc::EAFNOSUPPORT)),
    };
    if (len as usize) < need {
        return Err(e(libc::EINVAL));
    }
    // SAFETY: `len` bytes are readable and cover the family's struct.
    unsafe { sock_addr(addr) }.ok_or_else(|| e(libc::EAFNOSUPPORT))
}

/// Writes `a` to a C address buffer of `*len` bytes as `accept(2)` does: truncated to the
/// buffer, `*len` set to the address's full size. Nothing is written if either is NULL.
///
/// # Safety
/// `out` and `len` are NULL or valid; `out` has `*len` writable bytes.
unsafe fn write_addr(a: SocketAddr, out: *mut sockaddr, len: *mut socklen_t) {
    if out.is_null() || len.is_null() {
        return;
    }
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    store_addr(&mut st, Some(a));
    let full = sockaddr_len(&a);
    // SAFETY: `len` is valid (checked non-NULL); the copy stays within the caller's `*len`
    // bytes and within `st`.
    unsafe {
        let n = (*len).min(full) as usize;
        std::ptr::copy_nonoverlapping(
            (&st as *const libc::sockaddr_storage).cast::<u8>(),
            out.cast::<u8>(),
            n,
        );
        *len = full;
    }
}

/// The bytes of a C buffer (empty for a NULL one of length 0).
///
/// # Safety
/// `buf` points at `len` readable bytes that are not written meanwhile, or `len` is 0.
unsafe fn bytes<'a>(buf: *const c_void, len: usize) -> Option<&'a [u8]> {
    if len == 0 {
        return Some(&[]);
    }
    if buf.is_null() {
        return None;
    }
    // SAFETY: the caller's buffer of `len` bytes.
    Some(unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) })
}

/// As [`bytes`], writable.
///
/// # Safety
/// `buf` points at `len` writable bytes no one else uses meanwhile, or `len` is 0.
unsafe fn bytes_mut<'a>(buf: *mut c_void, len: usize) -> Option<&'a mut [u8]> {
    if len == 0 {
        return Some(&mut []);
    }
    if buf.is_null() {
        return None;
    }
    // SAFETY: the caller's buffer of `len` bytes.
    Some(unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) })
}

/// The buffers of an iovec array.
///
/// # Safety
/// `iov` points at `n` iovecs, each naming readable memory.
unsafe fn iovecs<'a>(iov: *const iovec, n: c_int) -> Option<Vec<&'a [u8]>> {
    if n < 0 || (n > 0 && iov.is_null()) {
        return None;
    }
    let mut v = Vec::with_capacity(n as usize);
    for i in 0..n as usize {
        // SAFETY: the caller's array of `n` iovecs.
        let e = unsafe { &*iov.add(i) };
        // SAFETY: each iovec names `iov_len` readable bytes.
        v.push(unsafe { bytes(e.iov_base, e.iov_len) }?);
    }
    Some(v)
}

/// As [`iovecs`], writable.
///
/// # Safety
/// `iov` points at `n` iovecs, each naming writable memory used by no one else meanwhile.
unsafe fn iovecs_mut<'a>(iov: *const iovec, n: c_int) -> Option<Vec<&'a mut [u8]>> {
    if n < 0 || (n > 0 && iov.is_null()) {
        return None;
    }
    let mut v = Vec::with_capacity(n as usize);
    for i in 0..n as usize {
        // SAFETY: the caller's array of `n` iovecs.
        let e = unsafe { &*iov.add(i) };
        // SAFETY: each iovec names `iov_len` writable bytes.
        v.push(unsafe { bytes_mut(e.iov_base, e.iov_len) }?);
    }
    Some(v)
}

fn efault_ssize() -> ssize_t {
    set_errno(libc::EFAULT);
    -1
}

fn done(r: Result<usize, Error>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => err_ssize(&e),
    }
}

pub(crate) unsafe extern "C" fn rsocket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    match Socket::new(domain, ty, protocol) {
        Ok(s) => insert(s),
        Err(e) => err(&e),
    }
}

pub(crate) unsafe extern "C" fn rbind(s: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    with(s, -1, |sock| {
        // SAFETY: the caller passes `len` bytes at `addr`.
        match unsafe { read_addr(addr, len) }.and_then(|a| sock.bind(a)) {
            Ok(()) => 0,
            Err(e) => err(&e),
        }
    })
}

pub(crate) unsafe extern "C" fn rlisten(s: c_int, backlog: c_int) -> c_int {
    with(s, -1, |sock| match sock.listen(backlog) {
        Ok(()) => 0,
        Err(e) => err(&e),
    })
}

pub(crate) unsafe extern "C" fn raccept(s: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    with(s, -1, |sock| match sock.accept() {
        Ok((new, peer)) => {
            if let Some(p) = peer {
                // SAFETY: the caller's address buffer and length, or NULL.
                unsafe { write_addr(p, addr, len) };
            }
            insert(new)
        }
        Err(e) => err(&e),
    })
}

pub(crate) unsafe extern "C" fn rconnect(s: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    with(s, -1, |sock| {
        // SAFETY: the caller passes `len` bytes at `addr`.
        match unsafe { read_addr(addr, len) }.and_then(|a| sock.connect(a)) {
            Ok(()) => 0,
            Err(e) => err(&e),
        }
    })
}

pub(crate) unsafe extern "C" fn rshutdown(s: c_int, how: c_int) -> c_int {
    with(s, -1, |sock| {
        match Shutdown::from_raw(how).and_then(|h| sock.shutdown(h)) {
            Ok(()) => 0,
            Err(e) => err(&e),
        }
    })
}

pub(crate) unsafe extern "C" fn rclose(s: c_int) -> c_int {
    let sock = table().as_mut().and_then(|t| t.remove(&s));
    match sock {
        Some(sock) => {
            sock.close();
            0
        }
        None => fail_minus_one(libc::EBADF),
    }
}

pub(crate) unsafe extern "C" fn rrecv(s: c_int, buf: *mut c_void, len: usize, flags: c_int) -> ssize_t {
    with(s, -1, |sock| {
        // SAFETY: the caller's buffer of `len` bytes.
        let Some(b) = (unsafe { bytes_mut(buf, len) }) else {
            return efault_ssize();
        };
        done(sock.recv(b, flags))
    })
}

pub(crate) unsafe extern "C" fn rrecvfrom(
    s: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    src: *mut sockaddr,
    srclen: *mut socklen_t,
) -> ssize_t {
    with(s, -1, |sock| {
        // SAFETY: the caller's buffer of `len` bytes.
        let Some(b) = (unsafe { bytes_mut(buf, len) }) else {
            return efault_ssize();
        };
        match sock.recv_from(b, flags) {
            Ok((n, from)) => {
                if let Some(a) = from {
                    // SAFETY: the caller's address buffer and length, or NULL.
                    unsafe { write_addr(a, src, srclen) };
                }
                n as ssize_t
            }
            Err(e) => err_ssize(&e),
        }
    })
}

pub(crate) unsafe extern "C" fn rrecvmsg(s: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    with(s, -1, |sock| {
        // SAFETY: NULL or the caller's message header.
        let Some(m) = (unsafe { msg.as_mut() }) else {
            return efault_ssize();
        };
        if !m.msg_control.is_null() && m.msg_controllen > 0 {
            set_errno(libc::EOPNOTSUPP);
            return -1;
        }
        // SAFETY: the header's iovec array of `msg_iovlen` entries.
        let Some(mut bufs) = (unsafe { iovecs_mut(m.msg_iov, m.msg_iovlen as c_int) }) else {
            return efault_ssize();
        };
        match sock.recv_vectored(&mut bufs, flags) {
            Ok((n, from)) => {
                m.msg_flags = 0;
                match from {
                    Some(a) if !m.msg_name.is_null() => {
                        // SAFETY: `msg_name` has `msg_namelen` writable bytes.
                        unsafe { write_addr(a, m.msg_name.cast(), &mut m.msg_namelen) };
                    }
                    _ => m.msg_namelen = 0,
                }
                n as ssize_t
            }
            Err(e) => err_ssize(&e),
        }
    })
}

pub(crate) unsafe extern "C" fn rsend(s: c_int, buf: *const c_void, len: usize, flags: c_int) -> ssize_t {
    with(s, -1, |sock| {
        // SAFETY: the caller's buffer of `len` bytes.
        let Some(b) = (unsafe { bytes(buf, len) }) else {
            return efault_ssize();
        };
        done(sock.send(b, flags))
    })
}

pub(crate) unsafe extern "C" fn rsendto(
    s: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    dst: *const sockaddr,
    dstlen: socklen_t,
) -> ssize_t {
    with(s, -1, |sock| {
        // SAFETY: the caller's buffer of `len` bytes.
        let Some(b) = (unsafe { bytes(buf, len) }) else {
            return efault_ssize();
        };
        let to = if dst.is_null() {
            None
        } else {
            // SAFETY: `dstlen` bytes at `dst`.
            match unsafe { read_addr(dst, dstlen) } {
                Ok(a) => Some(a),
                Err(e) => return err_ssize(&e),
            }
        };
        done(sock.send_to(b, flags, to))
    })
}

pub(crate) unsafe extern "C" fn rsendmsg(s: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    with(s, -1, |sock| {
        // SAFETY: NULL or the caller's message header.
        let Some(m) = (unsafe { msg.as_ref() }) else {
            return efault_ssize();
        };
        if !m.msg_control.is_null() && m.msg_controllen > 0 {
            set_errno(libc::EOPNOTSUPP);
            return -1;
        }
        let to = if m.msg_name.is_null() {
            None
        } else {
            // SAFETY: `msg_namelen` bytes at `msg_name`.
            match unsafe { read_addr(m.msg_name.cast(), m.msg_namelen) } {
                Ok(a) => Some(a),
                Err(e) => return err_ssize(&e),
            }
        };
        // SAFETY: the header's iovec array of `msg_iovlen` entries.
        let Some(bufs) = (unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) }) else {
            return efault_ssize();
        };
        done(sock.send_msg(&bufs, flags, to))
    })
}

pub(crate) unsafe extern "C" fn rread(s: c_int, buf: *mut c_void, count: usize) -> ssize_t {
    // SAFETY: the caller's arguments, as for `rrecv`.
    unsafe { rrecv(s, buf, count, 0) }
}

pub(crate) unsafe extern "C" fn rreadv(s: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    with(s, -1, |sock| {
        // SAFETY: the caller's iovec array of `n` entries.
        let Some(mut bufs) = (unsafe { iovecs_mut(iov, n) }) else {
            return efault_ssize();
        };
        done(sock.recv_vectored(&mut bufs, 0).map(|(n, _)| n))
    })
}

pub(crate) unsafe extern "C" fn rwrite(s: c_int, buf: *const c_void, count: usize) -> ssize_t {
    // SAFETY: the caller's arguments, as for `rsend`.
    unsafe { rsend(s, buf, count, 0) }
}

pub(crate) unsafe extern "C" fn rwritev(s: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    with(s, -1, |sock| {
        // SAFETY: the caller's iovec array of `n` entries.
        let Some(bufs) = (unsafe { iovecs(iov, n) }) else {
            return efault_ssize();
        };
        done(sock.send_vectored(&bufs, 0))
    })
}

/// A `poll(2)` timeout in milliseconds as a duration (negative: forever).
fn timeout_of(ms: c_int) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

/// `rpoll` over `fds`, which may mix rsockets and other descriptors.
///
/// # Safety
/// `fds` points at `n` pollfds (or `n` is 0).
unsafe fn poll_fds(fds: *mut pollfd, n: usize, timeout: Option<Duration>) -> Result<usize, Error> {
    if n == 0 {
        let entries: &mut [PollEntry<'_>] = &mut [];
        return rs::poll(entries, timeout);
    }
    if fds.is_null() {
        return Err(Error::Io(std::io::Error::from_raw_os_error(libc::EFAULT)));
    }
    // SAFETY: the caller's array of `n` pollfds.
    let fds = unsafe { std::slice::from_raw_parts_mut(fds, n) };
    let sockets: Vec<Option<Socket>> = fds.iter().map(|p| lookup(p.fd)).collect();
    let mut entries: Vec<PollEntry<'_>> = fds
        .iter()
        .zip(&sockets)
        .map(|(p, s)| {
            let target = match s {
                Some(s) => PollTarget::Socket(s),
                None if p.fd < 0 => PollTarget::None,
                // SAFETY: the number goes to poll(2) and nothing else; poll(2) reports a
                // descriptor that is not open as POLLNVAL, as plain poll does.
                None => PollTarget::Fd(unsafe { BorrowedFd::borrow_raw(p.fd) }),
            };
            PollEntry::new(target, p.events)
        })
        .collect();
    let r = rs::poll(&mut entries, timeout)?;
    for (p, e) in fds.iter_mut().zip(&entries) {
        p.revents = e.revents;
    }
    Ok(r)
}

pub(crate) unsafe extern "C" fn rpoll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    // SAFETY: the caller's array of `n` pollfds.
    match unsafe { poll_fds(fds, n as usize, timeout_of(timeout)) } {
        Ok(k) => k as c_int,
        Err(e) => err(&e),
    }
}

pub(crate) unsafe extern "C" fn rselect(
    nfds: c_int,
    readfds: *mut fd_set,
    writefds: *mut fd_set,
    exceptfds: *mut fd_set,
    timeout: *mut timeval,
) -> c_int {
    if !(0..=libc::FD_SETSIZE as c_int).contains(&nfds) {
        return fail_minus_one(libc::EINVAL);
    }
    // SAFETY: NULL or the caller's sets of at least `nfds` descriptors (FD_SETSIZE).
    let (r, w, x) = unsafe { (readfds.as_mut(), writefds.as_mut(), exceptfds.as_mut()) };
    let isset = |set: &Option<&mut fd_set>, fd| {
        // SAFETY: `fd` is below FD_SETSIZE and the set is valid.
        set.as_ref()
            .is_some_and(|s| unsafe { libc::FD_ISSET(fd, &**s as *const fd_set) })
    };
    let mut fds: Vec<pollfd> = Vec::new();
    for fd in 0..nfds {
        let mut events = 0;
        if isset(&r, fd) {
            events |= libc::POLLIN;
        }
        if isset(&w, fd) {
            events |= libc::POLLOUT;
        }
        if events != 0 || isset(&x, fd) {
            fds.push(pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    let to = match timeout.is_null() {
        true => None,
        false => {
            // SAFETY: the caller's timeval.
            let t = unsafe { &*timeout };
            if t.tv_sec < 0 || t.tv_usec < 0 {
                return fail_minus_one(libc::EINVAL);
            }
            Some(Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64))
        }
    };
    // SAFETY: our own array.
    let ready = match unsafe { poll_fds(fds.as_mut_ptr(), fds.len(), to) } {
        Ok(k) => k,
        Err(e) => return err(&e),
    };
    let mut count = 0;
    for (set, on) in [(r, libc::POLLIN | libc::POLLHUP), (w, libc::POLLOUT), (x, 0)] {
        let Some(set) = set else { continue };
        // SAFETY: a valid set.
        unsafe { libc::FD_ZERO(set) };
        if ready == 0 {
            continue;
        }
        for p in &fds {
            let hit = if on == 0 {
                p.revents & !(libc::POLLIN | libc::POLLOUT | libc::POLLHUP) != 0
            } else {
                p.revents & on != 0
            };
            if hit {
                // SAFETY: `p.fd` is below FD_SETSIZE (it came from the set).
                unsafe { libc::FD_SET(p.fd, set) };
                count += 1;
            }
        }
    }
    count
}

pub(crate) unsafe extern "C" fn rgetpeername(s: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    with(s, -1, |sock| match sock.peer_addr() {
        Ok(a) if !addr.is_null() && !len.is_null() => {
            // SAFETY: the caller's buffer and length.
            unsafe { write_addr(a, addr, len) };
            0
        }
        Ok(_) => fail_minus_one(libc::EFAULT),
        Err(e) => err(&e),
    })
}

pub(crate) unsafe extern "C" fn rgetsockname(s: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    with(s, -1, |sock| match sock.local_addr() {
        Ok(a) if !addr.is_null() && !len.is_null() => {
            // SAFETY: the caller's buffer and length.
            unsafe { write_addr(a, addr, len) };
            0
        }
        Ok(_) => fail_minus_one(libc::EFAULT),
        Err(e) => err(&e),
    })
}

pub(crate) unsafe extern "C" fn rsetsockopt(
    s: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    with(s, -1, |sock| {
        // SAFETY: `len` bytes at `val`.
        let Some(v) = (unsafe { bytes(val, len as usize) }) else {
            return fail_minus_one(libc::EFAULT);
        };
        match sock.setsockopt(level, name, v) {
            Ok(()) => 0,
            Err(e) => err(&e),
        }
    })
}

pub(crate) unsafe extern "C" fn rgetsockopt(
    s: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    with(s, -1, |sock| {
        if val.is_null() || len.is_null() {
            return fail_minus_one(libc::EFAULT);
        }
        match sock.getsockopt(level, name) {
            Ok(v) => {
                // SAFETY: `len` is valid; `val` has `*len` writable bytes. As getsockopt(2),
                // the value is truncated to the buffer and `*len` says how much was written.
                unsafe {
                    let n = (*len as usize).min(v.len());
                    std::ptr::copy_nonoverlapping(v.as_ptr(), val.cast::<u8>(), n);
                    *len = n as socklen_t;
                }
                0
            }
            Err(e) => err(&e),
        }
    })
}

pub(crate) unsafe extern "C" fn rfcntl(s: c_int, cmd: c_int, arg: c_int) -> c_int {
    with(s, -1, |sock| match sock.fcntl(cmd, arg) {
        Ok(v) => v,
        Err(e) => err(&e),
    })
}

pub(crate) unsafe extern "C" fn riomap(
    s: c_int,
    buf: *mut c_void,
    len: usize,
    prot: c_int,
    _flags: c_int,
    offset: off_t,
) -> off_t {
    with(s, -1, |sock| {
        if buf.is_null() || len == 0 || prot & !(libc::PROT_WRITE | libc::PROT_NONE) != 0 {
            return off_t::from(fail_minus_one(libc::EINVAL));
        }
        // The application keeps the buffer mapped until `riounmap` (rsocket(7)); the region
        // is reached only through the key table, from which unmapping removes it.
        let backing = Arc::new(RawMemory::new(buf.cast(), len as u64));
        let at = u64::try_from(offset).ok();
        match sock.iomap(backing, buf as u64, prot & libc::PROT_WRITE != 0, at) {
            Ok(o) => o as off_t,
            Err(e) => off_t::from(err(&e)),
        }
    })
}

pub(crate) unsafe extern "C" fn riounmap(s: c_int, buf: *mut c_void, len: usize) -> c_int {
    with(s, -1, |sock| match sock.iounmap(buf as u64, len as u64) {
        Ok(()) => 0,
        Err(e) => err(&e),
    })
}

pub(crate) unsafe extern "C" fn riowrite(
    s: c_int,
    buf: *const c_void,
    count: usize,
    offset: off_t,
    flags: c_int,
) -> usize {
    with(s, usize::MAX, |sock| {
        // SAFETY: the caller's buffer of `count` bytes.
        let Some(b) = (unsafe { bytes(buf, count) }) else {
            set_errno(libc::EFAULT);
            return usize::MAX;
        };
        let Ok(at) = u64::try_from(offset) else {
            set_errno(libc::EINVAL);
            return usize::MAX;
        };
        match sock.iowrite(b, at, flags) {
            Ok(n) => n,
            Err(e) => {
                set_errno(e.errno());
                usize::MAX
            }
        }
    })
}
