//! Shared-memory mailboxes between the processes of one user on one host.
//!
//! A process that wants to receive over shared memory creates an [`Inbox`]: a file of a
//! directory private to the user ([`private_dir`]), mapped shared, holding a doorbell and a
//! number of single-producer single-consumer rings of variable-length records. A process that
//! sends to it opens an [`Outbox`] on the file, which claims one ring for it alone; records are
//! written in place in the ring ([`Outbox::push`]) and read in place by the owner
//! ([`Inbox::poll`]), with no system call on either side while the owner is busy. An owner with
//! nothing to do sleeps on the doorbell futex ([`Inbox::wait`]) and costs no CPU; a sender rings
//! it only when the owner sleeps.
//!
//! Who can reach a mailbox: the directory is created with mode 0700 and must be owned by the
//! user, the file has mode 0600, and [`Outbox::open`] refuses a file that is not the user's
//! alone ([`Error::NotPrivate`]). Processes of other users therefore cannot read, write or map
//! it. A process of the same user can corrupt a ring; the owner validates every record header
//! against what was published and drops a corrupted ring's records ([`Inbox::corrupt`] counts
//! them) rather than read outside the ring.
//!
//! [`read_from_process`] and [`read_into_words`] copy straight out of another process of the
//! user (cross-memory attach), for payloads that move once between registered buffers.
//!
//! A [`StatBoard`] publishes a process's counters in a file of the same kind of private
//! directory, so that [`read_boards`] shows every process of the user, live.
//!
//! The crate knows nothing about RDMA: records are bytes. Its only `unsafe` code is the
//! offset-checked view of the mapping in `raw.rs` and the copy destination in `xfer.rs`.

mod mailbox;
mod raw;
mod ring;
mod stats;
mod xfer;

pub use stats::{read_boards, BoardSnapshot, StatBoard, COUNTERS, MAX_BLOCKS};
pub use xfer::{read_from_process, read_into_words};

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

pub use mailbox::{sweep, Inbox, Layout, Outbox, MAX_RINGS};

/// Why a mailbox operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error from the file system or the mapping.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The file or directory is not private to this user.
    #[error("not private to this user")]
    NotPrivate,
    /// Not a mailbox of this version, or a layout out of range.
    #[error("not a mailbox of this version, or a bad layout")]
    BadLayout,
    /// Every ring of the mailbox is claimed by a live sender.
    #[error("every ring of the mailbox is in use")]
    NoRing,
    /// A record larger than a ring can ever hold.
    #[error("a record of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The record's length.
        len: usize,
        /// The largest record the ring takes.
        max: usize,
    },
    /// A record header that does not match what the producer published.
    #[error("corrupted ring")]
    Corrupt,
}

/// The directory `name` under `/dev/shm` (or the temporary directory if there is none),
/// created with mode 0700. [`Error::NotPrivate`] if it exists but is not this user's alone.
pub fn private_dir(name: &str) -> Result<PathBuf, Error> {
    let base = Path::new("/dev/shm");
    let base = if base.is_dir() {
        base.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(name);
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e.into()),
    }
    let meta = std::fs::symlink_metadata(&dir)?;
    let uid = rustix::process::getuid().as_raw();
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(Error::NotPrivate);
    }
    Ok(dir)
}
