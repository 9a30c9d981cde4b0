//! A process's mailbox: one file in a directory private to the user, holding a doorbell and a
//! fixed number of rings, each claimed by one sending process at a time.
//!
//! Header (offsets in bytes): magic (0), version (8), ring count (12), ring capacity (16), the
//! owner's pid (24), "closed" (28: set when the owner drops the mailbox, or when a new owner of
//! the path replaces the file a dead one left, so that senders still mapping it look again);
//! the doorbell futex word (64) and the owner's "sleeping" word (128), each in
//! its own cache line, and beside the latter the "active" word (136: a bit per ring ever
//! claimed, so the owner looks only at those); then one claim word per ring (192..): 0 when free, else the sender's pid
//! in the high half and a per-process number below. Rings start at the first page boundary
//! after the claim words.
//!
//! Waking: the owner announces it is about to sleep (`sleeping` = 1), looks at every ring once
//! more, and waits on the doorbell futex; a sender stores its tail, then reads `sleeping`, and
//! rings the doorbell (increment and wake) only if it is set. Both sides use sequentially
//! consistent operations for these two words and the tails, so one of them always sees the
//! other: no record is left unannounced while the owner sleeps, and a busy owner costs senders
//! no system call.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rustix::thread::futex;

use crate::raw::Mapping;
use crate::ring::{self, Consumer, Producer, RING_HEADER};
use crate::Error;

const MAGIC: u64 = u64::from_le_bytes(*b"SVSHMBX1");
const VERSION: u32 = 1;
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_RINGS: usize = 12;
const OFF_CAP: usize = 16;
const OFF_PID: usize = 24;
const OFF_CLOSED: usize = 28;
const OFF_BELL: usize = 64;
const OFF_SLEEPING: usize = 128;
const OFF_ACTIVE: usize = 136;
const OFF_CLAIMS: usize = 192;
const PAGE: usize = 4096;
/// At most this many rings (senders at once) per mailbox (one bit each in the "active" word).
pub const MAX_RINGS: u32 = 64;

/// How a mailbox is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Rings, one per concurrent sender.
    pub rings: u32,
    /// Data bytes per ring: a power of two, at least 4096.
    pub ring_capacity: usize,
}

impl Layout {
    fn rings_at(&self) -> usize {
        (OFF_CLAIMS + 8 * self.rings as usize).div_ceil(PAGE) * PAGE
    }

    fn ring_stride(&self) -> usize {
        RING_HEADER + self.ring_capacity
    }

    fn ring_base(&self, i: usize) -> usize {
        self.rings_at() + i * self.ring_stride()
    }

    /// The file's size.
    pub fn file_size(&self) -> usize {
        self.ring_base(self.rings as usize)
    }

    /// The largest record a ring takes.
    pub fn max_record(&self) -> usize {
        ring::max_record(self.ring_capacity)
    }

    fn check(&self) -> Result<(), Error> {
        let ok = (1..=MAX_RINGS).contains(&self.rings)
            && self.ring_capacity.is_power_of_two()
            && (4096..=1 << 30).contains(&self.ring_capacity);
        if ok {
            Ok(())
        } else {
            Err(Error::BadLayout)
        }
    }
}

fn uid() -> u32 {
    rustix::process::getuid().as_raw()
}

pub(crate) fn pid() -> u32 {
    rustix::process::getpid().as_raw_nonzero().get() as u32
}

/// Whether process `pid` exists (a process of another user counts as existing).
fn alive(pid: u32) -> bool {
    let Some(p) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) else {
        return false;
    };
    !matches!(
        rustix::process::test_kill_process(p),
        Err(rustix::io::Errno::SRCH)
    )
}

/// Checks that `meta` is a regular file of this user that no one else may read or write.
pub(crate) fn check_private(meta: &std::fs::Metadata) -> Result<(), Error> {
    if !meta.is_file() || meta.uid() != uid() || meta.permissions().mode() & 0o077 != 0 {
        return Err(Error::NotPrivate);
    }
    Ok(())
}

/// What a mailbox being built is called until it is complete.
const TMP_MARK: &str = ".new-";
/// A half-built mailbox older than this, that nobody holds, was abandoned.
const TMP_ABANDONED: Duration = Duration::from_secs(60);

/// Removes from `dir` the mailboxes whose owners are gone (nobody holds the lock an owner
/// keeps for its life), after marking each closed for senders that still map it. Returns how
/// many it removed.
pub fn sweep(dir: &Path) -> usize {
    use rustix::fs::{flock, FlockOperation};
    use std::os::unix::fs::FileExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let path = e.path();
        let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) else {
            continue;
        };
        let Ok(meta) = file.metadata() else { continue };
        if check_private(&meta).is_err() {
            continue;
        }
        let building = path.to_string_lossy().contains(TMP_MARK);
        if building
            && meta
                .modified()
                .map_or(true, |m| m.elapsed().unwrap_or_default() < TMP_ABANDONED)
        {
            continue;
        }
        if flock(&file, FlockOperation::NonBlockingLockExclusive).is_err() {
            continue; // its owner lives
        }
        if meta.len() >= OFF_CLOSED as u64 + 4 {
            let _ = file.write_all_at(&1u32.to_ne_bytes(), OFF_CLOSED as u64);
        }
        if std::fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The receiving end: the mailbox this process owns. Dropping it removes the file.
///
/// Any thread may poll it (one at a time: [`Inbox::poll`] serialises them, so records of one
/// ring are handed over in order) and one may sleep in [`Inbox::wait`] meanwhile.
#[derive(Debug)]
pub struct Inbox {
    /// Holds a shared lock for as long as the mailbox lives: senders test it to learn whether
    /// the owner still runs (a lock dies with its process; a pid may be reused).
    _lock: File,
    map: Mapping,
    layout: Layout,
    /// The ring consumers and the ring to look at first.
    rings: Mutex<(Vec<Consumer>, usize)>,
    path: PathBuf,
    corrupt: AtomicU64,
}

impl Inbox {
    /// Creates the mailbox file at `path` (mode 0600; the directory should be private to the
    /// user too), replacing one a dead owner left there.
    ///
    /// Mailboxes of processes that ended without dropping theirs (any exit but an orderly
    /// teardown) are removed from the directory first, so they cannot pile up.
    pub fn create(path: &Path, layout: Layout) -> Result<Self, Error> {
        layout.check()?;
        if let Some(dir) = path.parent() {
            sweep(dir);
        }
        // A file left here belongs to an owner that is gone: tell its senders; the rename
        // below replaces it.
        if let Ok(old) = Outbox::map_mailbox(path) {
            old.u32_at(OFF_CLOSED).store(1, Ordering::Release);
        }
        // Built under a temporary name and locked before it appears under its own, so that a
        // sweep never takes a mailbox being made for a dead one.
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!("{TMP_MARK}{}", pid()));
        let tmp = PathBuf::from(tmp);
        let _ = std::fs::remove_file(&tmp);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockShared).map_err(std::io::Error::from)?;
        file.set_len(layout.file_size() as u64)?;
        let map = Mapping::new(&file)?;
        map.u64_at(OFF_CAP)
            .store(layout.ring_capacity as u64, Ordering::Relaxed);
        map.u32_at(OFF_RINGS).store(layout.rings, Ordering::Relaxed);
        map.u32_at(OFF_VERSION).store(VERSION, Ordering::Relaxed);
        map.u32_at(OFF_PID).store(pid(), Ordering::Relaxed);
        // Last: a sender that sees the magic sees the rest.
        map.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
        if let Err(e) = std::fs::rename(&tmp, path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
        let rings = (0..layout.rings as usize)
            .map(|i| Consumer::attach(&map, layout.ring_base(i), layout.ring_capacity))
            .collect();
        Ok(Self {
            _lock: file,
            map,
            layout,
            rings: Mutex::new((rings, 0)),
            path: path.to_path_buf(),
            corrupt: AtomicU64::new(0),
        })
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Records that were not valid (each dropped its ring's unread records).
    pub fn corrupt(&self) -> u64 {
        self.corrupt.load(Ordering::Relaxed)
    }

    /// Hands up to `max` records to `f`, taking the rings in turn so that no sender starves
    /// the others. Returns how many it handed over. Another thread polling meanwhile waits.
    pub fn poll(&self, max: usize, mut f: impl FnMut(&[u8])) -> usize {
        // Only rings a sender ever claimed can hold records.
        let active = self.map.u64_at(OFF_ACTIVE).load(Ordering::SeqCst);
        if active == 0 {
            return 0;
        }
        let mut guard = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        let (rings, next) = &mut *guard;
        let n = rings.len();
        let active = if n < 64 { active & ((1 << n) - 1) } else { active };
        let claimed = active.count_ones() as usize;
        let mut got = 0;
        // Claimed rings found empty in a row: the scan ends once every one was.
        let mut idle = 0;
        while got < max && idle < claimed {
            // The next claimed ring at or after `next`, wrapping: only those are looked at.
            let above = active & (u64::MAX << *next);
            let i = if above != 0 { above } else { active }.trailing_zeros() as usize;
            *next = (i + 1) % n;
            match rings[i].pop(&self.map, &mut f) {
                Ok(Some(())) => {
                    got += 1;
                    idle = 0;
                }
                Ok(None) => idle += 1,
                Err(_) => {
                    self.corrupt.fetch_add(1, Ordering::Relaxed);
                    idle += 1;
                }
            }
        }
        got
    }

    /// Whether no record waits in any ring (read from the shared words, so it never waits for
    /// a polling thread).
    pub fn is_empty(&self) -> bool {
        let active = self.map.u64_at(OFF_ACTIVE).load(Ordering::SeqCst);
        (0..self.layout.rings as usize)
            .filter(|i| active & (1 << i) != 0)
            .all(|i| ring::is_empty(&self.map, self.layout.ring_base(i)))
    }

    /// Sleeps until a sender rings the doorbell or `timeout` passes; returns at once if a
    /// record already waits. Returns whether one may wait now.
    pub fn wait(&self, timeout: Duration) -> bool {
        let bell = self.map.u32_at(OFF_BELL);
        let sleeping = self.map.u32_at(OFF_SLEEPING);
        let seen = bell.load(Ordering::SeqCst);
        sleeping.store(1, Ordering::SeqCst);
        if self.is_empty() {
            let ts = rustix::time::Timespec {
                tv_sec: timeout.as_secs() as i64,
                tv_nsec: i64::from(timeout.subsec_nanos()),
            };
            // A changed doorbell (EAGAIN), a wake-up, a signal or the timeout: all end the wait.
            let _ = futex::wait(bell, futex::Flags::empty(), seen, Some(&ts));
        }
        sleeping.store(0, Ordering::SeqCst);
        !self.is_empty()
    }
}

impl Inbox {
    /// Ends a [`Inbox::wait`] of another thread early (rings this mailbox's own doorbell).
    pub fn wake(&self) {
        ring_bell(&self.map);
    }
}

/// Increments the doorbell and wakes its sleeper.
fn ring_bell(map: &Mapping) {
    let bell = map.u32_at(OFF_BELL);
    bell.fetch_add(1, Ordering::SeqCst);
    let _ = futex::wake(bell, futex::Flags::empty(), 1);
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.map.u32_at(OFF_CLOSED).store(1, Ordering::Release);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The sending end: a ring claimed in another process's mailbox. Dropping it frees the ring.
#[derive(Debug)]
pub struct Outbox {
    file: File,
    map: Mapping,
    ring: Producer,
    slot: usize,
    claim: u64,
    max_record: usize,
}

impl Outbox {
    /// Opens the mailbox at `path` and claims a free ring (or one whose sender died).
    /// [`Error::NotPrivate`] if the file is not this user's alone, [`Error::NoRing`] if every
    /// ring is taken, [`Error::BadLayout`] if it is not a mailbox of this version.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let (file, map) = Self::open_mailbox(path)?;
        if map.u32_at(OFF_CLOSED).load(Ordering::Acquire) != 0 {
            return Err(Error::BadLayout);
        }
        let layout = Layout {
            rings: map.u32_at(OFF_RINGS).load(Ordering::Relaxed),
            ring_capacity: map.u64_at(OFF_CAP).load(Ordering::Relaxed) as usize,
        };
        layout.check()?;
        if layout.file_size() != map.len() {
            return Err(Error::BadLayout);
        }
        let claim = next_claim();
        let slot = (0..layout.rings as usize)
            .find(|&i| {
                let word = map.u64_at(OFF_CLAIMS + 8 * i);
                let cur = word.load(Ordering::Acquire);
                let free = cur == 0 || !alive((cur >> 32) as u32);
                free && word
                    .compare_exchange(cur, claim, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            })
            .ok_or(Error::NoRing)?;
        map.u64_at(OFF_ACTIVE).fetch_or(1 << slot, Ordering::SeqCst);
        let ring = Producer::attach(&map, layout.ring_base(slot), layout.ring_capacity);
        Ok(Self {
            file,
            map,
            ring,
            slot,
            claim,
            max_record: layout.max_record(),
        })
    }

    /// Opens and maps the mailbox file at `path` after checking that it is private and of
    /// this version.
    fn open_mailbox(path: &Path) -> Result<(File, Mapping), Error> {
        let file: File = OpenOptions::new().read(true).write(true).open(path)?;
        let meta = file.metadata()?;
        check_private(&meta)?;
        if (meta.len() as usize) < OFF_CLAIMS {
            return Err(Error::BadLayout);
        }
        let map = Mapping::new(&file)?;
        if map.u64_at(OFF_MAGIC).load(Ordering::Acquire) != MAGIC
            || map.u32_at(OFF_VERSION).load(Ordering::Relaxed) != VERSION
        {
            return Err(Error::BadLayout);
        }
        Ok((file, map))
    }

    fn map_mailbox(path: &Path) -> Result<Mapping, Error> {
        Self::open_mailbox(path).map(|(_, m)| m)
    }

    /// Whether the owner dropped this mailbox, or a new owner of its path replaced it: open
    /// the path again to reach whoever owns it now. One load from shared memory.
    pub fn is_closed(&self) -> bool {
        self.map.u32_at(OFF_CLOSED).load(Ordering::Acquire) != 0
    }

    /// The largest record this mailbox takes.
    pub fn max_record(&self) -> usize {
        self.max_record
    }

    /// Whether the mailbox's owner still runs (it holds a shared lock on the file while it
    /// lives; two system calls).
    pub fn owner_alive(&self) -> bool {
        use rustix::fs::{flock, FlockOperation};
        match flock(&self.file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {
                let _ = flock(&self.file, FlockOperation::Unlock);
                false
            }
            Err(_) => true,
        }
    }

    /// Appends a record of `len` bytes that `fill` writes in place, and rings the doorbell if
    /// the owner sleeps. `Ok(false)` if the ring is full now.
    pub fn push(&mut self, len: usize, fill: impl FnOnce(&mut [u8])) -> Result<bool, Error> {
        if !self.ring.push(&self.map, len, fill)? {
            return Ok(false);
        }
        if self.map.u32_at(OFF_SLEEPING).load(Ordering::SeqCst) != 0 {
            ring_bell(&self.map);
        }
        Ok(true)
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        let _ = self.map.u64_at(OFF_CLAIMS + 8 * self.slot).compare_exchange(
            self.claim,
            0,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

/// A claim word unique among this process's outboxes: the pid above, a counter below.
fn next_claim() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    (u64::from(pid()) << 32) | (NEXT.fetch_add(1, Ordering::Relaxed) & 0xFFFF_FFFF)
}
