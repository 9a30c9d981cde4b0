//! Counter boards: each process publishes its devices' counters in a small shared file, so a
//! tool can show every process of the user at once, live, with no daemon and no call into the
//! processes.
//!
//! A board is a file of the user's private directory (as the mailboxes: mode 0700 directory,
//! 0600 file, checked on open), named after the owner's pid, mapped shared. It holds a header
//! (magic, pid, network namespace, start time, command name) and up to [`MAX_BLOCKS`] blocks,
//! one per device name, of [`COUNTERS`] 64-bit counters. The owner keeps its counters there
//! (they are ordinary atomic words, so counting costs what it costs in private memory) and
//! holds a shared `flock` on the file for its life; [`read_boards`] takes only boards whose
//! lock is held and removes the others, so a process that died leaves nothing for long.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::mailbox::{check_private, pid};
use crate::raw::Mapping;
use crate::Error;

const MAGIC: u64 = u64::from_le_bytes(*b"SVSTAT01");
const OFF_MAGIC: usize = 0;
const OFF_PID: usize = 8;
const OFF_NETNS: usize = 16;
const OFF_STARTED: usize = 24;
const OFF_COMM: usize = 32;
const OFF_BLOCKS: usize = 64;
const OFF_FIRST_BLOCK: usize = 128;
/// Bytes of a name (a device's, the command's), NUL-padded.
const NAME_LEN: usize = 32;
/// Counters of a block.
pub const COUNTERS: usize = 60;
const BLOCK_LEN: usize = NAME_LEN + 8 * COUNTERS;
/// Devices a board has room for.
pub const MAX_BLOCKS: usize = 16;
const FILE_LEN: usize = (OFF_FIRST_BLOCK + MAX_BLOCKS * BLOCK_LEN).div_ceil(4096) * 4096;

fn block_at(i: usize) -> usize {
    OFF_FIRST_BLOCK + i * BLOCK_LEN
}

/// Stores `name` (truncated to 32 bytes) in the four words at `offset`.
fn put_name(map: &Mapping, offset: usize, name: &str) {
    let mut bytes = [0u8; NAME_LEN];
    let n = name.len().min(NAME_LEN);
    bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
    for (i, chunk) in bytes.chunks_exact(8).enumerate() {
        let word = u64::from_ne_bytes(chunk.try_into().expect("8 bytes"));
        map.u64_at(offset + 8 * i).store(word, Ordering::Relaxed);
    }
}

fn get_name(map: &Mapping, offset: usize) -> String {
    let bytes: Vec<u8> = (0..NAME_LEN / 8)
        .flat_map(|i| map.u64_at(offset + 8 * i).load(Ordering::Relaxed).to_ne_bytes())
        .collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// This process's board. Dropping it removes the file.
#[derive(Debug)]
pub struct StatBoard {
    /// Holds a shared lock while the board lives: readers take only held boards.
    _lock: File,
    map: Mapping,
    path: PathBuf,
    /// Serialises the claiming of blocks by name.
    claims: std::sync::Mutex<()>,
}

impl StatBoard {
    /// Creates this process's board in `dir` (which should be private to the user), for a
    /// process in network namespace `netns` (an inode number) running `comm`. Boards of
    /// processes that are gone are removed first.
    pub fn create(dir: &Path, netns: u64, comm: &str) -> Result<Self, Error> {
        let _ = read_boards(dir);
        let path = dir.join(pid().to_string());
        // A file under this name was left by a process gone with the same pid.
        let _ = std::fs::remove_file(&path);
        let tmp = dir.join(format!(".new-{}", pid()));
        let _ = std::fs::remove_file(&tmp);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockShared).map_err(std::io::Error::from)?;
        file.set_len(FILE_LEN as u64)?;
        let map = Mapping::new(&file)?;
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        map.u64_at(OFF_PID).store(u64::from(pid()), Ordering::Relaxed);
        map.u64_at(OFF_NETNS).store(netns, Ordering::Relaxed);
        map.u64_at(OFF_STARTED).store(started, Ordering::Relaxed);
        put_name(&map, OFF_COMM, comm);
        // Last: a reader that sees the magic sees the rest.
        map.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
        if let Err(e) = std::fs::rename(&tmp, &path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
        Ok(Self {
            _lock: file,
            map,
            path,
            claims: std::sync::Mutex::new(()),
        })
    }

    /// The block of the device called `name`: the one already claimed for it, or a new one;
    /// `None` when all [`MAX_BLOCKS`] are taken by other names.
    pub fn block(&self, name: &str) -> Option<usize> {
        let _claim = self.claims.lock().unwrap_or_else(|p| p.into_inner());
        let used = self.map.u64_at(OFF_BLOCKS).load(Ordering::Acquire) as usize;
        let mut wanted = String::from(name);
        wanted.truncate(NAME_LEN);
        if let Some(i) = (0..used).find(|&i| get_name(&self.map, block_at(i)) == wanted) {
            return Some(i);
        }
        if used >= MAX_BLOCKS {
            return None;
        }
        put_name(&self.map, block_at(used), name);
        self.map
            .u64_at(OFF_BLOCKS)
            .store(used as u64 + 1, Ordering::Release);
        Some(used)
    }

    /// Counter `index` (below [`COUNTERS`]) of block `block` (one [`StatBoard::block`] gave).
    #[inline] // Every packet bumps several: across crates this must not be a call each.
    pub fn counter(&self, block: usize, index: usize) -> &AtomicU64 {
        assert!(
            block < MAX_BLOCKS && index < COUNTERS,
            "no counter {block}/{index}"
        );
        self.map.u64_at(block_at(block) + NAME_LEN + 8 * index)
    }
}

impl Drop for StatBoard {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What one process's board showed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoardSnapshot {
    /// The process.
    pub pid: u32,
    /// Its network namespace (inode number).
    pub netns: u64,
    /// When its board was made (seconds since the Unix epoch).
    pub started: u64,
    /// Its command name.
    pub comm: String,
    /// Each device's name and counters.
    pub devices: Vec<(String, Vec<u64>)>,
}

/// The boards in `dir` whose owners live, in pid order; boards nobody holds any more are
/// removed.
pub fn read_boards(dir: &Path) -> Vec<BoardSnapshot> {
    use rustix::fs::{flock, FlockOperation};
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name();
        let building = name.to_string_lossy().starts_with(".new-");
        let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) else {
            continue;
        };
        let Ok(meta) = file.metadata() else { continue };
        if check_private(&meta).is_err() || meta.len() != FILE_LEN as u64 {
            continue;
        }
        if flock(&file, FlockOperation::NonBlockingLockExclusive).is_ok() {
            // Its owner is gone (or it is being built and not yet locked: leave those).
            if !building {
                let _ = std::fs::remove_file(&path);
            }
            continue;
        }
        let Ok(map) = Mapping::new(&file) else { continue };
        if map.u64_at(OFF_MAGIC).load(Ordering::Acquire) != MAGIC {
            continue;
        }
        let used = (map.u64_at(OFF_BLOCKS).load(Ordering::Acquire) as usize).min(MAX_BLOCKS);
        let devices = (0..used)
            .map(|i| {
                let base = block_at(i);
                let counters = (0..COUNTERS)
                    .map(|c| map.u64_at(base + NAME_LEN + 8 * c).load(Ordering::Relaxed))
                    .collect();
                (get_name(&map, base), counters)
            })
            .collect();
        out.push(BoardSnapshot {
            pid: map.u64_at(OFF_PID).load(Ordering::Relaxed) as u32,
            netns: map.u64_at(OFF_NETNS).load(Ordering::Relaxed),
            started: map.u64_at(OFF_STARTED).load(Ordering::Relaxed),
            comm: get_name(&map, OFF_COMM),
            devices,
        });
    }
    out.sort_by_key(|b| b.pid);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("svstat-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir(&d).unwrap();
        d
    }

    #[test]
    fn a_board_is_read_live_and_removed_with_its_owner() {
        let d = dir("live");
        let board = StatBoard::create(&d, 42, "tester").unwrap();
        let lo = board.block("sv_lo").unwrap();
        let eth = board.block("sv_eth0").unwrap();
        assert_eq!(board.block("sv_lo"), Some(lo), "one block per name");
        assert_ne!(lo, eth);
        board.counter(lo, 0).fetch_add(5, Ordering::Relaxed);
        board.counter(eth, COUNTERS - 1).store(9, Ordering::Relaxed);
        let seen = read_boards(&d);
        assert_eq!(seen.len(), 1);
        let b = &seen[0];
        assert_eq!(
            (b.pid, b.netns, b.comm.as_str()),
            (std::process::id(), 42, "tester")
        );
        assert_eq!(b.devices[lo].0, "sv_lo");
        assert_eq!(b.devices[lo].1[0], 5);
        assert_eq!(b.devices[eth].1[COUNTERS - 1], 9);
        // Counting shows at once, without the owner doing anything else.
        board.counter(lo, 0).fetch_add(1, Ordering::Relaxed);
        assert_eq!(read_boards(&d)[0].devices[lo].1[0], 6);
        drop(board);
        assert!(read_boards(&d).is_empty());
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn blocks_run_out_by_name_not_by_use() {
        let d = dir("blocks");
        let board = StatBoard::create(&d, 1, "x").unwrap();
        for _ in 0..3 {
            for i in 0..MAX_BLOCKS {
                assert_eq!(board.block(&format!("dev{i}")), Some(i));
            }
        }
        assert_eq!(board.block("one too many"), None);
        drop(board);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_board_nobody_holds_is_swept() {
        let d = dir("sweep");
        // A board left by a process that is gone: the right size and magic, but unlocked.
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(d.join("999999"))
            .unwrap();
        f.set_len(FILE_LEN as u64).unwrap();
        let map = Mapping::new(&f).unwrap();
        map.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
        drop(map);
        drop(f);
        assert!(read_boards(&d).is_empty());
        assert!(!d.join("999999").exists(), "removed");
        let _ = std::fs::remove_dir_all(&d);
    }
}
