//! Which processes of this host have QPs in a multicast group.
//!
//! Between hosts a multicast datagram reaches every member through the network. Between the
//! processes of one host it would have to be looped back by the kernel to sockets that joined
//! the group, which needs a multicast route on the sending interface (none on `lo`) and
//! group-bound sockets beside the slot ports. Instead each process that has a QP attached to a
//! group says so here, and a sender copies its multicast packets into each member process's
//! mailbox (the shared-memory driver), as for unicast to a local peer.
//!
//! A member keeps an exclusive `flock` on a file named after the network namespace, the base
//! port, the group, its slot and the device, in a directory private to the user: the file is valid exactly
//! while the lock is held, so a member that died leaves nothing that counts.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use nix::fcntl::{Flock, FlockArg};
use softverbs_engine::types::Gid;

/// The directory of this user's membership files, and the prefix of the names for `group` in
/// this network namespace and for this base port.
fn prefix(base_port: u16, group: &Gid) -> Option<(PathBuf, String)> {
    let uid = nix::unistd::getuid().as_raw();
    let dir = softverbs_shm::private_dir(&format!("softverbs-mcast-{uid}")).ok()?;
    let netns = std::fs::metadata("/proc/self/ns/net").map_or(0, |m| m.ino());
    let hex: String = group.0.iter().map(|b| format!("{b:02x}")).collect();
    Some((dir, format!("{netns}-{base_port}-{hex}-")))
}

/// This process's membership of one group; ends when dropped.
#[derive(Debug)]
pub(crate) struct Membership {
    lock: Option<Flock<File>>,
    path: PathBuf,
}

impl Drop for Membership {
    fn drop(&mut self) {
        // Unlinked under the lock, so a lookup never sees a live name without its lock.
        let _ = std::fs::remove_file(&self.path);
        self.lock.take();
    }
}

/// Records the process with UDP slot `slot` as a member of `group` through its device of
/// interface `ifindex`. `None` if the directory or the file cannot be made (the process then
/// gets the group's traffic only over the network).
///
/// Files that members which died left behind (of any group) are removed first, so that they
/// cannot pile up when nobody sends to their groups again.
pub(crate) fn join(base_port: u16, group: &Gid, slot: u8, ifindex: u32) -> Option<Membership> {
    let (dir, prefix) = prefix(base_port, group)?;
    sweep(&dir);
    let path = dir.join(format!("{prefix}{slot}.{ifindex}"));
    for _ in 0..8 {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .ok()?;
        // Only this process uses its slot, so the lock is free unless a lookup holds it for a
        // moment.
        let mut file = file;
        let mut lock = None;
        for _ in 0..100 {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(l) => {
                    lock = Some(l);
                    break;
                }
                Err((f, _)) => {
                    file = f;
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
            }
        }
        let lock = lock?;
        // A lookup that found the file stale (a dead member's, before we locked it) unlinks
        // it under its lock: a lock on a file no longer at the path announces nothing.
        let same = std::fs::metadata(&path)
            .ok()
            .zip(lock.metadata().ok())
            .is_some_and(|(a, b)| a.ino() == b.ino() && a.dev() == b.dev());
        if same {
            return Some(Membership {
                lock: Some(lock),
                path,
            });
        }
    }
    None
}

/// Removes the membership files in `dir` that nobody holds (their members died).
fn sweep(dir: &std::path::Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(file) = File::open(e.path()) else { continue };
        if let Ok(_stale) = Flock::lock(file, FlockArg::LockSharedNonblock) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The slots of the processes of this host that are members of `group`. Files left by members
/// that died are removed.
pub(crate) fn members(base_port: u16, group: &Gid) -> Vec<u8> {
    let Some((dir, prefix)) = prefix(base_port, group) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut slots = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(slot) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|s| s.split('.').next())
            .and_then(|s| s.parse::<u8>().ok())
        else {
            continue;
        };
        let Ok(file) = File::open(entry.path()) else {
            continue;
        };
        match Flock::lock(file, FlockArg::LockSharedNonblock) {
            // Nobody holds it: its member died.
            Ok(_stale) => {
                let _ = std::fs::remove_file(entry.path());
            }
            Err(_) => slots.push(slot),
        }
    }
    slots.sort_unstable();
    slots.dedup();
    slots
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_the_live_holders() {
        // A base port and group of this test only.
        let base = 30_000 + (std::process::id() % 20_000) as u16;
        let group = Gid::from_ip("239.9.8.7".parse().unwrap());
        assert!(members(base, &group).is_empty());
        let a = join(base, &group, 3, 1).unwrap();
        let b = join(base, &group, 9, 1).unwrap();
        let b2 = join(base, &group, 9, 2).unwrap();
        assert_eq!(members(base, &group), vec![3, 9], "a process counts once");
        let other = Gid::from_ip("239.9.8.6".parse().unwrap());
        assert!(members(base, &other).is_empty(), "groups are apart");
        drop(a);
        assert_eq!(members(base, &group), vec![9]);
        // A member that died leaves an unlocked file: not a member, and cleaned up.
        let (dir, prefix) = prefix(base, &group).unwrap();
        let stale = dir.join(format!("{prefix}5.1"));
        std::fs::write(&stale, b"").unwrap();
        assert_eq!(members(base, &group), vec![9]);
        assert!(!stale.exists());
        drop(b);
        assert_eq!(members(base, &group), vec![9]);
        drop(b2);
        assert!(members(base, &group).is_empty());
    }

    #[test]
    fn joining_removes_what_dead_members_of_any_group_left() {
        let base = 30_000 + ((std::process::id() + 11) % 20_000) as u16;
        let gone = Gid::from_ip("239.9.8.5".parse().unwrap());
        let (dir, prefix) = prefix(base, &gone).unwrap();
        // A member of a group nobody sends to any more died.
        let stale = dir.join(format!("{prefix}4.1"));
        std::fs::write(&stale, b"").unwrap();
        let group = Gid::from_ip("239.9.8.4".parse().unwrap());
        let m = join(base, &group, 3, 1).unwrap();
        assert!(!stale.exists(), "the leftover was removed");
        assert_eq!(members(base, &group), vec![3]);
        drop(m);
    }
}
