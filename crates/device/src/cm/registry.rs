//! Which process of this host listens on a service ID.
//!
//! Processes of one host share their GIDs (the host's addresses), so a MAD addressed to a GID's
//! QP1 must still reach the right process. Replies carry the receiver's communication ID or
//! SIDR request ID, whose top byte is the owning process's slot (`CmConfig::id_tag`); requests
//! carry a service ID, which this registry maps to the listener's slot. A listener keeps an
//! exclusive `flock` on a file named after the service ID, holding its slot: the file is valid
//! exactly while someone holds the lock, so a crashed listener leaves nothing stale behind.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use nix::fcntl::{Flock, FlockArg};
use softverbs_engine::{Error, Result};

/// The directory of this user's listener files, in this network namespace and for this base
/// port; `None` if it cannot be made private.
fn dir(base_port: u16) -> Option<PathBuf> {
    let uid = nix::unistd::getuid().as_raw();
    let dir = softverbs_shm::private_dir(&format!("softverbs-cm-{uid}")).ok()?;
    let netns = std::fs::metadata("/proc/self/ns/net").map_or(0, |m| m.ino());
    Some(dir.join(format!("{netns}-{base_port}")))
}

fn path(base_port: u16, service_id: u64) -> Option<PathBuf> {
    let d = dir(base_port)?;
    Some(d.with_file_name(format!("{}-{service_id:016x}", d.file_name()?.to_string_lossy())))
}

/// A registered listener; unregisters when dropped.
#[derive(Debug)]
pub(crate) struct Listening {
    lock: Option<Flock<File>>,
    path: PathBuf,
}

impl Drop for Listening {
    fn drop(&mut self) {
        // Unlinked under the lock: a process that locks the inode later finds the path gone.
        let _ = std::fs::remove_file(&self.path);
        self.lock.take();
    }
}

/// Registers this process (slot `slot`) as the host's listener on `service_id`.
/// EADDRINUSE if another listener holds it.
///
/// Files that listeners which died left behind (for any service ID, namespace or base port)
/// are removed first, so that they cannot pile up in `/dev/shm` when nobody looks their
/// service IDs up again.
pub(crate) fn listen(base_port: u16, service_id: u64, slot: u8) -> Result<Listening> {
    let path =
        path(base_port, service_id).ok_or_else(|| Error::invalid("no private directory for CM listeners"))?;
    if let Some(dir) = path.parent() {
        sweep(dir);
    }
    for _ in 0..8 {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)?;
        // A lookup holds a shared lock for a moment: only a lock held on for a while is a
        // listener.
        let mut file = file;
        let mut tries = 0;
        let mut held = loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(h) => break h,
                Err((f, _)) if tries < 5 => {
                    tries += 1;
                    file = f;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(_) => return Err(Error::Io(std::io::Error::from_raw_os_error(98))),
            }
        };
        // The previous holder may have unlinked the file between our open and our lock.
        let same = std::fs::metadata(&path)
            .ok()
            .zip(held.metadata().ok())
            .is_some_and(|(a, b)| a.ino() == b.ino() && a.dev() == b.dev());
        if !same {
            continue;
        }
        held.set_len(0)?;
        held.write_all(&[slot])?;
        return Ok(Listening {
            lock: Some(held),
            path,
        });
    }
    Err(Error::busy("the listener registry keeps changing"))
}

/// The slot of the process listening on `service_id` on this host, if any.
pub(crate) fn lookup(base_port: u16, service_id: u64) -> Option<u8> {
    let path = path(base_port, service_id)?;
    let file = File::open(&path).ok()?;
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        // Nobody holds it: left by a listener that died. Removed under the lock; a listener
        // that opened it meanwhile finds the path gone once it holds its lock, and retries.
        Ok(_stale) => {
            let _ = std::fs::remove_file(&path);
            None
        }
        Err((mut file, _)) => {
            let mut b = [0u8; 1];
            (file.read(&mut b).ok()? == 1).then_some(b[0])
        }
    }
}

/// Removes the files in `dir` that nobody holds a lock on (their listeners died), as
/// [`lookup`] does for one; returns how many.
fn sweep(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let Ok(file) = File::open(e.path()) else { continue };
        if let Ok(_stale) = Flock::lock(file, FlockArg::LockSharedNonblock) {
            removed += usize::from(std::fs::remove_file(e.path()).is_ok());
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_listener_per_service_and_nothing_left_behind() {
        // A base port no other test uses, so the names are this test's own.
        let base = 40_000 + (std::process::id() % 20_000) as u16;
        let sid = 0x0106_0000 | u64::from(std::process::id() as u16);
        assert_eq!(lookup(base, sid), None);
        let held = listen(base, sid, 7).unwrap();
        assert_eq!(lookup(base, sid), Some(7));
        assert_eq!(listen(base, sid, 8).unwrap_err().errno(), 98, "EADDRINUSE");
        drop(held);
        assert_eq!(lookup(base, sid), None);
        // A listener that died leaves its file: unlocked, so it counts as no listener and is
        // cleaned up.
        let p = path(base, sid).unwrap();
        std::fs::write(&p, [5u8]).unwrap();
        assert_eq!(lookup(base, sid), None);
        assert!(!p.exists(), "the leftover was removed");
        let again = listen(base, sid, 9).unwrap();
        assert_eq!(lookup(base, sid), Some(9));
        drop(again);
    }

    #[test]
    fn listening_removes_what_dead_listeners_left() {
        let base = 40_000 + ((std::process::id() + 7) % 20_000) as u16;
        let sid = 0x0106_0000 | u64::from(std::process::id() as u16);
        // Left by listeners on other service IDs that died: never looked up again.
        let stale: Vec<PathBuf> = (1..=3).map(|i| path(base, sid + i).unwrap()).collect();
        for p in &stale {
            std::fs::write(p, [5u8]).unwrap();
        }
        let live = listen(base, sid + 10, 4).unwrap();
        let held = listen(base, sid, 7).unwrap();
        assert!(stale.iter().all(|p| !p.exists()), "leftovers removed");
        assert_eq!(lookup(base, sid + 10), Some(4), "a live listener is kept");
        drop((held, live));
    }
}
