//! XRC domains (`ibv_open_xrcd`): name spaces for XRC SRQs and target QPs.
//!
//! A domain opened on a file is keyed by the file's inode (`st_dev`, `st_ino`). In one process
//! every open of the same inode on a device shares one [`XrcDomain`]. Between processes there is
//! no daemon: each holder of a domain keeps a shared `flock` on a registry file named after the
//! device and the inode, so "the domain exists on this host" is "someone holds that lock". That
//! is all the processes need to agree on (`O_CREAT`, `O_EXCL`, EAGAIN); the SRQs and QPs in a
//! domain are per process anyway, as every XRC peer addresses them by number.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use parking_lot::Mutex;
use softverbs_engine::{Error, Result};

use crate::context::Context;
use crate::qp::Srq;
use crate::sync::UseCount;

/// `O_CREAT` as `ibv_xrcd_init_attr.oflags` takes it.
pub const O_CREAT: i32 = 0o100;
/// `O_EXCL` as `ibv_xrcd_init_attr.oflags` takes it.
pub const O_EXCL: i32 = 0o200;

/// The inode a domain is keyed by.
pub(crate) type InodeKey = (u64, u64);

/// The domains of one device in this process, by inode.
pub(crate) type DomainTable = Mutex<HashMap<InodeKey, Weak<XrcDomain>>>;

/// One XRC domain as this process sees it: the XRC SRQs created in it, by SRQ number.
#[derive(Debug)]
pub struct XrcDomain {
    id: u64,
    inode: Option<InodeKey>,
    srqs: Mutex<HashMap<u32, Weak<Srq>>>,
    /// The shared lock that announces the domain to other processes, and the registry file's
    /// path (inode domains only).
    host_lock: Option<(Flock<File>, PathBuf)>,
}

impl Drop for XrcDomain {
    /// The last holder on the host removes the registry file: holding the exclusive lock, no
    /// other process has the domain, and one that opened the file meanwhile sees it gone once
    /// it gets its lock, and starts again.
    fn drop(&mut self) {
        if let Some((lock, path)) = self.host_lock.take() {
            if lock.relock(FlockArg::LockExclusiveNonblock).is_ok() {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

impl XrcDomain {
    /// A number unique among the domains of this process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The inode the domain is keyed by (`None` for an anonymous domain).
    pub fn inode(&self) -> Option<(u64, u64)> {
        self.inode
    }

    /// The XRC SRQ numbered `srqn`, if it is in this domain and alive.
    pub fn srq(&self, srqn: u32) -> Option<Arc<Srq>> {
        self.srqs.lock().get(&srqn).and_then(Weak::upgrade)
    }

    pub(crate) fn add_srq(&self, srqn: u32, srq: &Arc<Srq>) {
        self.srqs.lock().insert(srqn, Arc::downgrade(srq));
    }

    pub(crate) fn remove_srq(&self, srqn: u32) {
        self.srqs.lock().remove(&srqn);
    }
}

fn next_domain_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Where the host-wide registry files live.
fn registry_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

/// The registry file of `key` on `device`.
fn registry_path(device: &str, key: InodeKey) -> PathBuf {
    registry_dir().join(format!("{REGISTRY_PREFIX}{device}-{}-{}", key.0, key.1))
}

/// Removes the registry files nobody holds a lock on: processes that died with a domain open
/// leave theirs behind, one per domain file, which would otherwise pile up in `/dev/shm`.
/// Removed under the exclusive lock, as the last holder removes its file: a process that opened
/// one meanwhile finds the path gone once it holds its lock, and starts again.
fn sweep_registry() {
    for e in std::fs::read_dir(registry_dir()).into_iter().flatten().flatten() {
        if !e.file_name().to_string_lossy().starts_with(REGISTRY_PREFIX) {
            continue;
        }
        let Ok(file) = File::open(e.path()) else { continue };
        if let Ok(_stale) = Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The start of every registry file's name.
const REGISTRY_PREFIX: &str = "softverbs-xrcd-";

/// Opens the registry file at `path`, created readable and writable by every user (so domains
/// can be shared between users, as files can).
fn registry_file(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o666)
        .open(path)
        // Another user's umask may have left it read-only to us; a lock needs no write access.
        .or_else(|_| File::open(path))
        .map_err(Error::Io)
}

/// An error carrying an OS errno.
fn os(e: Errno) -> Error {
    Error::Io(std::io::Error::from_raw_os_error(e as i32))
}

/// Announces a domain to the host, or finds it announced. Returns the held shared lock, or
/// EAGAIN (no domain and no `O_CREAT`) or EINVAL (a domain exists and `O_EXCL`).
///
/// The last holder removes the file ([`XrcDomain`]'s drop), so a lock is only good if the path
/// still names the locked file once it is held; otherwise the file was removed meanwhile and
/// the lookup starts again.
fn join_host_domain(path: &Path, oflags: i32) -> Result<Flock<File>> {
    loop {
        let file = registry_file(path)?;
        let (held, created) = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(held) => (held, true),
            Err((file, Errno::EWOULDBLOCK)) => {
                // Blocking: another process may hold the exclusive lock only for its own
                // check, or to remove the file.
                (
                    Flock::lock(file, FlockArg::LockShared).map_err(|(_, e)| os(e))?,
                    false,
                )
            }
            Err((_, e)) => return Err(os(e)),
        };
        let same = nix::sys::stat::stat(path).ok().is_some_and(|p| {
            nix::sys::stat::fstat(held.as_fd().as_raw_fd())
                .is_ok_and(|f| (f.st_dev, f.st_ino) == (p.st_dev, p.st_ino))
        });
        if !same {
            continue;
        }
        if created {
            // Nobody holds it: no process has this domain.
            if oflags & O_CREAT == 0 {
                return Err(Error::WouldBlock);
            }
            held.relock(FlockArg::LockShared).map_err(os)?;
        } else if oflags & O_EXCL != 0 {
            return Err(Error::invalid("the XRC domain exists and O_EXCL is set"));
        }
        return Ok(held);
    }
}

/// One handle on an XRC domain (`struct ibv_xrcd`).
#[derive(Debug)]
pub struct Xrcd {
    ctx: Arc<Context>,
    domain: Arc<XrcDomain>,
    handle: u32,
    uses: UseCount,
}

impl Xrcd {
    /// `ibv_open_xrcd`: `fd` `None` (-1) creates an anonymous domain. Otherwise the domain of
    /// the file's inode is opened: EBADF for a bad fd, EAGAIN if none exists and `oflags` lacks
    /// `O_CREAT`, EINVAL if one exists and `oflags` has `O_EXCL`.
    pub fn open(ctx: &Arc<Context>, fd: Option<RawFd>, oflags: i32) -> Result<Arc<Self>> {
        let domain = match fd {
            None => Arc::new(XrcDomain {
                id: next_domain_id(),
                inode: None,
                srqs: Mutex::new(HashMap::new()),
                host_lock: None,
            }),
            Some(fd) => {
                let st = nix::sys::stat::fstat(fd).map_err(|_| os(Errno::EBADF))?;
                let key = (st.st_dev, st.st_ino);
                let device = ctx.device();
                let mut table = device.xrc_domains().lock();
                match table.get(&key).and_then(Weak::upgrade) {
                    Some(d) if oflags & O_EXCL != 0 => {
                        drop(d);
                        return Err(Error::invalid("the XRC domain exists and O_EXCL is set"));
                    }
                    Some(d) => d,
                    None => {
                        let path = registry_path(device.name(), key);
                        sweep_registry();
                        let lock = join_host_domain(&path, oflags)?;
                        let d = Arc::new(XrcDomain {
                            id: next_domain_id(),
                            inode: Some(key),
                            srqs: Mutex::new(HashMap::new()),
                            host_lock: Some((lock, path)),
                        });
                        table.retain(|_, w| w.strong_count() > 0);
                        table.insert(key, Arc::downgrade(&d));
                        d
                    }
                }
            }
        };
        Ok(Arc::new(Self {
            ctx: ctx.clone(),
            domain,
            handle: ctx.next_handle(),
            uses: UseCount::default(),
        }))
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The domain this handle opens.
    pub fn domain(&self) -> &Arc<XrcDomain> {
        &self.domain
    }

    /// Handle (`ibv_xrcd` has none in C, but objects are numbered alike).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// Whether two handles open the same domain.
    pub fn same_domain(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.domain, &other.domain)
    }

    pub(crate) fn uses(&self) -> &UseCount {
        &self.uses
    }

    /// `ibv_close_xrcd`: EBUSY while SRQs or QPs created or opened through this handle exist.
    /// The last handle of a domain (host-wide) destroys it.
    pub fn close(&self) -> Result<()> {
        self.uses.retire("XRC domain")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_files_nobody_holds_are_swept() {
        let name =
            |tag: &str| registry_dir().join(format!("{REGISTRY_PREFIX}test{}-{tag}", std::process::id()));
        let (stale, live) = (name("stale"), name("live"));
        std::fs::write(&stale, b"").unwrap();
        std::fs::write(&live, b"").unwrap();
        let held = Flock::lock(File::open(&live).unwrap(), FlockArg::LockShared).unwrap();
        sweep_registry();
        assert!(!stale.exists(), "left by a process that died: removed");
        assert!(live.exists(), "a holder's file stays");
        drop(held);
        let _ = std::fs::remove_file(&live);
    }
}
