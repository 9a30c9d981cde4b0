//! The command file of a context (`ibv_context.cmd_fd`) and the object table behind it.
//!
//! With a kernel device, `cmd_fd` is an open `/dev/infiniband/uverbsN`: one "ufile" holding the
//! user context and its object table, and `pd->handle`, `mr->handle` and `dm->handle` are IDs in
//! that table. A descriptor passed on by `dup`, `SCM_RIGHTS` or `fork` names the same ufile, so
//! `ibv_import_device` on it gives a second context over the same objects.
//!
//! Here the descriptor is a memfd the context owns. A memfd has an inode of its own (unlike an
//! eventfd, whose inode every eventfd shares), so `fstat` on any duplicate of it finds the ufile
//! in a process-wide registry keyed by (st_dev, st_ino). The memfd also holds a short marker, so
//! a descriptor of this library whose ufile lives in another process is told apart from a
//! foreign descriptor.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::stat::fstat;
use nix::sys::uio::{pread, pwrite};
use softverbs_engine::{Error, Result};

use crate::device::Device;
use crate::dm::Dm;
use crate::pd::{Mr, Pd};

/// What the memfd of every command file starts with.
const MARKER: &[u8] = b"softverbs ufile\n";

/// An object a handle names.
#[derive(Debug, Clone)]
pub(crate) enum UObject {
    Pd(Weak<Pd>),
    Mr(Weak<Mr>),
    Dm(Weak<Dm>),
}

/// One ufile: the device, the handle counter and the table of shareable objects.
#[derive(Debug)]
pub(crate) struct Ufile {
    device: Device,
    next_handle: AtomicU32,
    objects: Mutex<HashMap<u32, UObject>>,
    key: (u64, u64),
}

type Registry = Mutex<HashMap<(u64, u64), Weak<Ufile>>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

fn inode_of(fd: BorrowedFd<'_>) -> Result<(u64, u64)> {
    let st = fstat(fd.as_raw_fd()).map_err(std::io::Error::from)?;
    Ok((st.st_dev, st.st_ino))
}

impl Ufile {
    /// A new ufile for `device` and the memfd that names it.
    pub(crate) fn create(device: &Device) -> Result<(Arc<Self>, OwnedFd)> {
        let fd =
            memfd_create(c"softverbs-cmd", MemFdCreateFlag::MFD_CLOEXEC).map_err(std::io::Error::from)?;
        pwrite(&fd, MARKER, 0).map_err(std::io::Error::from)?;
        let key = inode_of(fd.as_fd())?;
        let ufile = Arc::new(Self {
            device: device.clone(),
            next_handle: AtomicU32::new(1),
            objects: Mutex::default(),
            key,
        });
        let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        reg.retain(|_, w| w.strong_count() > 0);
        reg.insert(key, Arc::downgrade(&ufile));
        Ok((ufile, fd))
    }

    /// The ufile a duplicate of a command fd names. EINVAL if `fd` is not a command fd of this
    /// library, ENODEV if it is one whose objects live in another process, EBADF if it is not
    /// open.
    pub(crate) fn find(fd: BorrowedFd<'_>) -> Result<Arc<Self>> {
        let key = inode_of(fd)?;
        let found = registry()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .and_then(Weak::upgrade);
        if let Some(u) = found {
            return Ok(u);
        }
        let mut head = [0u8; MARKER.len()];
        match pread(fd, &mut head, 0) {
            Ok(n) if n == MARKER.len() && head == MARKER => Err(Error::NoDevice(
                "the command fd belongs to a softverbs context of another process".into(),
            )),
            _ => Err(Error::invalid(
                "the fd is not the command fd of a softverbs context",
            )),
        }
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// A handle for a new object, unique in this ufile.
    pub(crate) fn next_handle(&self) -> u32 {
        self.next_handle.fetch_add(1, Ordering::Relaxed)
    }

    /// Makes `obj` reachable by `handle` from every context of this ufile.
    pub(crate) fn publish(&self, handle: u32, obj: UObject) {
        let mut t = self.objects.lock().unwrap_or_else(|p| p.into_inner());
        t.retain(|_, o| match o {
            UObject::Pd(w) => w.strong_count() > 0,
            UObject::Mr(w) => w.strong_count() > 0,
            UObject::Dm(w) => w.strong_count() > 0,
        });
        t.insert(handle, obj);
    }

    /// Removes a destroyed object from the table.
    pub(crate) fn withdraw(&self, handle: u32) {
        self.objects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&handle);
    }

    /// The object `handle` names.
    pub(crate) fn lookup(&self, handle: u32) -> Option<UObject> {
        self.objects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&handle)
            .cloned()
    }
}

impl Drop for Ufile {
    fn drop(&mut self) {
        let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        if reg.get(&self.key).is_some_and(|w| w.strong_count() == 0) {
            reg.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd_with(bytes: &[u8]) -> OwnedFd {
        let fd = memfd_create(c"test", MemFdCreateFlag::MFD_CLOEXEC).unwrap();
        pwrite(&fd, bytes, 0).unwrap();
        fd
    }

    #[test]
    fn a_command_fd_of_another_process_is_enodev() {
        // A memfd with the marker but no ufile here is what a descriptor passed from another
        // process looks like.
        let e = Ufile::find(memfd_with(MARKER).as_fd()).unwrap_err();
        assert_eq!(e.errno(), 19);
    }

    #[test]
    fn other_descriptors_are_einval() {
        let e = Ufile::find(memfd_with(b"something else").as_fd()).unwrap_err();
        assert_eq!(e.errno(), 22);
        let null = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(Ufile::find(null.as_fd()).unwrap_err().errno(), 22);
    }
}
