//! XRC domains shared between processes: a target QP that executes requests for an SRQ of
//! another process.
//!
//! An XRC domain opened on a file is one domain for every process of the host, and any of its
//! target QPs serves any of its SRQs (`ibv_xsrq_pingpong` with several clients relies on it).
//! SRQs, CQs and memory live in the process that created them, so when a request's XRCETH names
//! an SRQ numbered in another process's slot (bits 16..24), the target relays what the engine
//! asks of that SRQ to its owner: selecting it (its PD), taking or returning a WQE, memory reads,
//! writes, checks, atomics and flushes under its PD, and finally the completion for its CQ. The
//! engine runs unchanged in the target's process; only its [`RecvSource`] and [`Memory`] reach
//! further, and the owner checks every key as it checks its own traffic.
//!
//! Each process that has an XRC SRQ in a file-backed domain serves a Unix stream socket named
//! after its network namespace and UDP slot port, in a directory private to the user (mode
//! 0700, checked to be ours): another user can neither connect nor replace the socket, and the
//! server also refuses peers whose credentials name another user. Calls are synchronous, bounded
//! by [`CALL_TIMEOUT`]; a peer that does not answer is treated as having no such SRQ (the
//! requester gets a remote access NAK) or no WQE (RNR).
//!
//! [`RecvSource`]: softverbs_engine::transport::RecvSource

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use softverbs_engine::memory::{Access, AtomicOp, KeyRef, MemError, Memory, MwBind};
use softverbs_engine::types::{RecvWr, WorkCompletion};

use crate::mem::KeyTable;
use crate::xrc::InodeKey;

mod codec;
mod server;

use codec::{read_frame, status_of, write_frame, Dec, Enc, Op};
pub(crate) use server::export;

/// How long a call waits for the owner of an SRQ.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Marks a PD number as another process's: bit 31, the owner's slot in bits 23..31 and its PD
/// handle below. The engine only compares and passes PD numbers, so a remote SRQ's PD travels
/// through it unchanged and [`XrcMemory`] knows where each access goes.
const REMOTE_PD: u32 = 1 << 31;
const PD_SLOT_SHIFT: u32 = 23;
const PD_MASK: u32 = (1 << PD_SLOT_SHIFT) - 1;

fn encode_pd(slot: u8, pd: u32) -> Option<u32> {
    (pd <= PD_MASK).then_some(REMOTE_PD | (u32::from(slot) << PD_SLOT_SHIFT) | pd)
}

fn decode_pd(pd: u32) -> Option<(u8, u32)> {
    (pd & REMOTE_PD != 0).then_some((((pd >> PD_SLOT_SHIFT) & 0xFF) as u8, pd & PD_MASK))
}

/// The directory of this user's relay sockets, created private; `None` if it exists but is not
/// private to us (then nothing is served or trusted there).
fn socket_dir() -> Option<PathBuf> {
    let uid = nix::unistd::getuid().as_raw();
    softverbs_shm::private_dir(&format!("softverbs-xrc-{uid}"))
        .inspect_err(|e| tracing::warn!("XRC relay directory unusable: {e}"))
        .ok()
}

/// The socket of the process whose UDP slot port is `port`, in this network namespace.
fn socket_path(port: u16) -> Option<PathBuf> {
    let netns = std::fs::metadata("/proc/self/ns/net").map_or(0, |m| m.ino());
    Some(socket_dir()?.join(format!("{netns}-{port}")))
}

/// This process's UDP slot and base port, if the UDP driver runs.
fn own_slot() -> Option<(u8, u16)> {
    let (slot, port, _) = crate::device::process_udp_status()?;
    Some((slot, port - u16::from(slot)))
}

/// The slot port of the process owning `srqn`, if that is another process.
pub(crate) fn owner_port(srqn: u32) -> Option<u16> {
    let (own, base) = own_slot()?;
    let slot = crate::udp::slot_of(srqn);
    (slot != own && slot != 0).then(|| base.checked_add(u16::from(slot)))?
}

/// A connection to one SRQ owner (`None` until connected, or after a failure).
type Connection = Arc<Mutex<Option<UnixStream>>>;

/// Connections to the owners of remote SRQs, by slot port; each carries one call at a time.
fn peers() -> &'static Mutex<HashMap<u16, Connection>> {
    static PEERS: OnceLock<Mutex<HashMap<u16, Connection>>> = OnceLock::new();
    PEERS.get_or_init(Default::default)
}

/// Sends `body` to the process at `port` and returns its answer (`None` for a one-way call).
/// Any failure drops the connection, so the next call starts afresh.
fn call(port: u16, op: Op, body: Enc) -> Option<Vec<u8>> {
    let conn = peers().lock().entry(port).or_default().clone();
    let mut conn = conn.lock();
    let result = (|| -> std::io::Result<Option<Vec<u8>>> {
        if conn.is_none() {
            let path = socket_path(port).ok_or(std::io::ErrorKind::PermissionDenied)?;
            let s = UnixStream::connect(path)?;
            s.set_read_timeout(Some(CALL_TIMEOUT))?;
            s.set_write_timeout(Some(CALL_TIMEOUT))?;
            *conn = Some(s);
        }
        let s = conn.as_mut().expect("connected");
        let mut frame = vec![op as u8];
        frame.extend_from_slice(&body.0);
        write_frame(s, &frame)?;
        if op.one_way() {
            return Ok(Some(Vec::new()));
        }
        read_frame(s).map(Some)
    })();
    match result {
        Ok(answer) => answer,
        Err(e) => {
            tracing::debug!(port, ?op, "XRC relay call failed: {e}");
            *conn = None;
            None
        }
    }
}

/// Names one XRC domain of one device to its other processes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DomainRef<'a> {
    /// The device's name.
    pub device: &'a str,
    /// The domain's inode.
    pub inode: InodeKey,
}

impl DomainRef<'_> {
    fn enc(&self, srqn: u32) -> Enc {
        Enc::default()
            .str(self.device)
            .u64(self.inode.0)
            .u64(self.inode.1)
            .u32(srqn)
    }

    /// Asks the owner of `srqn` (at `port`) for that SRQ's PD, as a PD number [`XrcMemory`]
    /// routes to the owner. `None` if it has no such SRQ in this domain or does not answer.
    pub(crate) fn select(&self, port: u16, srqn: u32) -> Option<u32> {
        let answer = call(port, Op::Select, self.enc(srqn))?;
        let mut d = Dec(&answer);
        if d.u8()? != 1 {
            return None;
        }
        encode_pd(crate::udp::slot_of(srqn), d.u32()?)
    }

    /// Takes the next WQE of the remote SRQ `srqn`.
    pub(crate) fn take(&self, port: u16, srqn: u32) -> Option<RecvWr> {
        let answer = call(port, Op::Take, self.enc(srqn))?;
        let mut d = Dec(&answer);
        if d.u8()? != 1 {
            return None;
        }
        d.recv_wr()
    }

    /// Returns a WQE taken for a message that was abandoned.
    pub(crate) fn put_back(&self, port: u16, srqn: u32, wr: &RecvWr) {
        call(port, Op::PutBack, self.enc(srqn).recv_wr(wr));
    }

    /// Hands a completion to the remote SRQ's CQ.
    pub(crate) fn complete(&self, port: u16, srqn: u32, wc: &WorkCompletion) {
        call(port, Op::Complete, self.enc(srqn).wc(wc));
    }
}

/// The memory an XRC target's engine reaches: this process's regions, and those of the other
/// processes whose SRQs it serves (by the PD number [`DomainRef::select`] gave).
pub(crate) struct XrcMemory<'a> {
    /// This process's regions on the target's device.
    pub local: &'a KeyTable,
    /// The target's device.
    pub device: &'a str,
}

impl XrcMemory<'_> {
    /// Where a key's access goes: `None` for local memory, else the owner's port and the key
    /// with the owner's own PD number.
    fn remote(&self, key: KeyRef) -> Option<Option<(u16, KeyRef)>> {
        let Some((slot, pd)) = decode_pd(key.pd) else {
            return Some(None);
        };
        let (_, base) = own_slot()?;
        let port = base.checked_add(u16::from(slot))?;
        Some(Some((port, KeyRef { pd, ..key })))
    }

    fn enc(&self, key: KeyRef) -> Enc {
        Enc::default().str(self.device).key(key)
    }
}

impl Memory for XrcMemory<'_> {
    fn read(&self, key: KeyRef, addr: u64, dst: &mut [u8]) -> Result<(), MemError> {
        match self.remote(key).ok_or(MemError::BadKey)? {
            None => self.local.read(key, addr, dst),
            Some((port, key)) => {
                let body = self.enc(key).u64(addr).u32(dst.len() as u32);
                let answer = call(port, Op::Read, body).ok_or(MemError::BadKey)?;
                let mut d = Dec(&answer);
                status_of(d.u8().ok_or(MemError::BadKey)?)?;
                let data = d
                    .bytes()
                    .filter(|b| b.len() == dst.len())
                    .ok_or(MemError::BadKey)?;
                dst.copy_from_slice(data);
                Ok(())
            }
        }
    }

    fn write(&self, key: KeyRef, addr: u64, src: &[u8]) -> Result<(), MemError> {
        match self.remote(key).ok_or(MemError::BadKey)? {
            None => self.local.write(key, addr, src),
            Some((port, key)) => {
                let answer =
                    call(port, Op::Write, self.enc(key).u64(addr).bytes(src)).ok_or(MemError::BadKey)?;
                status_of(Dec(&answer).u8().ok_or(MemError::BadKey)?)
            }
        }
    }

    fn check(&self, key: KeyRef, addr: u64, len: u64) -> Result<(), MemError> {
        match self.remote(key).ok_or(MemError::BadKey)? {
            None => self.local.check(key, addr, len),
            Some((port, key)) => {
                let answer =
                    call(port, Op::Check, self.enc(key).u64(addr).u64(len)).ok_or(MemError::BadKey)?;
                status_of(Dec(&answer).u8().ok_or(MemError::BadKey)?)
            }
        }
    }

    fn atomic(&self, key: KeyRef, addr: u64, op: AtomicOp) -> Result<u64, MemError> {
        match self.remote(key).ok_or(MemError::BadKey)? {
            None => self.local.atomic(key, addr, op),
            Some((port, key)) => {
                let (kind, a, b) = match op {
                    AtomicOp::CompareSwap { compare, swap } => (0, compare, swap),
                    AtomicOp::FetchAdd { add } => (1, add, 0),
                    AtomicOp::Store { value } => (2, value, 0),
                };
                let body = self.enc(key).u64(addr).u8(kind).u64(a).u64(b);
                let answer = call(port, Op::Atomic, body).ok_or(MemError::BadKey)?;
                let mut d = Dec(&answer);
                status_of(d.u8().ok_or(MemError::BadKey)?)?;
                d.u64().ok_or(MemError::BadKey)
            }
        }
    }

    fn bind_mw(&self, qpn: u32, pd: u32, bind: &MwBind) -> Result<(), MemError> {
        // A target has no send queue: binds are posted by initiators, in their own process.
        self.local.bind_mw(qpn, pd, bind)
    }

    fn invalidate(&self, qpn: u32, pd: u32, rkey: u32) -> Result<(), MemError> {
        let probe = KeyRef {
            key: rkey,
            pd,
            qpn,
            access: Access::RemoteWrite,
        };
        match self.remote(probe).ok_or(MemError::BadKey)? {
            None => self.local.invalidate(qpn, pd, rkey),
            Some((port, key)) => {
                let answer = call(port, Op::Invalidate, self.enc(key)).ok_or(MemError::BadKey)?;
                status_of(Dec(&answer).u8().ok_or(MemError::BadKey)?)
            }
        }
    }

    fn flush(&self, key: KeyRef, addr: u64, len: u64, whole_region: bool) -> Result<(), MemError> {
        match self.remote(key).ok_or(MemError::BadKey)? {
            None => self.local.flush(key, addr, len, whole_region),
            Some((port, key)) => {
                let body = self.enc(key).u64(addr).u64(len).u8(u8::from(whole_region));
                let answer = call(port, Op::Flush, body).ok_or(MemError::BadKey)?;
                status_of(Dec(&answer).u8().ok_or(MemError::BadKey)?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_pd_numbers_round_trip_and_never_look_local() {
        let pd = encode_pd(7, 42).expect("small handle");
        assert_ne!(pd & REMOTE_PD, 0);
        assert_eq!(decode_pd(pd), Some((7, 42)));
        assert_eq!(decode_pd(42), None, "a local PD number is not remote");
        assert_eq!(
            encode_pd(1, PD_MASK + 1),
            None,
            "handles too large to encode are refused"
        );
    }
}
