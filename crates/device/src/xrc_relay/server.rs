//! The serving side: this process's file-backed domains, reachable by the targets of others.

use std::collections::HashMap;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, OnceLock, Weak};

use nix::sys::socket::{getsockopt, sockopt};
use parking_lot::Mutex;
use softverbs_engine::memory::{AtomicOp, Memory};

use super::codec::{read_frame, status_byte, write_frame, Dec, Enc, Op, MAX_FRAME};
use super::{own_slot, socket_path};
use crate::device::Device;
use crate::xrc::{InodeKey, XrcDomain};

/// What this process serves: its file-backed domains (by device and inode) and the devices
/// whose memory they reach.
#[derive(Default)]
struct Exports {
    domains: HashMap<(String, InodeKey), Weak<XrcDomain>>,
    devices: HashMap<String, Device>,
    serving: bool,
}

fn exports() -> &'static Mutex<Exports> {
    static EXPORTS: OnceLock<Mutex<Exports>> = OnceLock::new();
    EXPORTS.get_or_init(Default::default)
}

/// Makes the SRQs of `domain` (a file-backed domain on `device`) reachable from target QPs of
/// the other processes sharing it; starts the server on first use.
pub(crate) fn export(device: &Device, domain: &Arc<XrcDomain>) {
    let Some(inode) = domain.inode() else { return };
    let mut ex = exports().lock();
    ex.domains.retain(|_, d| d.strong_count() > 0);
    ex.domains
        .insert((device.name().to_string(), inode), Arc::downgrade(domain));
    ex.devices
        .entry(device.name().to_string())
        .or_insert_with(|| device.clone());
    if ex.serving {
        return;
    }
    let Some((slot, base)) = own_slot() else { return };
    let Some(path) = socket_path(base + u16::from(slot)) else {
        return;
    };
    // The slot's port is ours, so a socket left at this path belongs to a process that died.
    let _ = std::fs::remove_file(&path);
    if let Some(dir) = path.parent() {
        sweep(dir);
    }
    let listener = match UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(path = %path.display(), "XRC relay not served: {e}");
            return;
        }
    };
    ex.serving = true;
    let spawned = std::thread::Builder::new()
        .name("softverbs-xrc".into())
        .spawn(move || accept_loop(&listener));
    if spawned.is_err() {
        ex.serving = false;
    }
}

/// A socket file younger than this is left alone by [`sweep`]: its server may be between
/// binding and listening.
const SWEEP_MIN_AGE: std::time::Duration = std::time::Duration::from_secs(10);

/// Removes the sockets in `dir` that nobody serves any more (their processes died, in any
/// network namespace or slot), which nothing else would remove when no process takes their
/// slot in their namespace again.
fn sweep(dir: &std::path::Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().unwrap_or_default() >= SWEEP_MIN_AGE);
        if !old {
            continue;
        }
        let refused = matches!(
            UnixStream::connect(e.path()),
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused
        );
        if refused {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn accept_loop(listener: &UnixListener) {
    let uid = nix::unistd::getuid().as_raw();
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        // The directory already keeps other users out; their credentials are checked anyway.
        match getsockopt(&stream, sockopt::PeerCredentials) {
            Ok(c) if c.uid() == uid => {}
            _ => continue,
        }
        let _ = std::thread::Builder::new()
            .name("softverbs-xrc".into())
            .spawn(move || serve(stream));
    }
}

fn serve(mut stream: UnixStream) {
    while let Ok(frame) = read_frame(&mut stream) {
        let mut d = Dec(&frame);
        let Some(op) = d.u8().and_then(Op::from_u8) else {
            return;
        };
        let answer = handle(op, &mut d);
        if op.one_way() {
            continue;
        }
        if write_frame(&mut stream, &answer.unwrap_or_else(|| Enc::default().u8(0)).0).is_err() {
            return;
        }
    }
}

fn handle(op: Op, d: &mut Dec<'_>) -> Option<Enc> {
    match op {
        Op::Select | Op::Take | Op::PutBack | Op::Complete => {
            let device = d.str()?.to_string();
            let inode = (d.u64()?, d.u64()?);
            let srqn = d.u32()?;
            let domain = exports().lock().domains.get(&(device, inode))?.upgrade()?;
            let Some(srq) = domain.srq(srqn) else {
                return Some(Enc::default().u8(0));
            };
            match op {
                Op::Select => Some(Enc::default().u8(1).u32(srq.pd().handle())),
                Op::Take => Some(match srq.take() {
                    Some(wr) => Enc::default().u8(1).recv_wr(&wr),
                    None => Enc::default().u8(0),
                }),
                Op::PutBack => {
                    srq.put_back(d.recv_wr()?);
                    None
                }
                _ => {
                    let wc = d.wc()?;
                    if let Some(cq) = srq.xrc_cq() {
                        if cq.push(wc).is_err() {
                            tracing::warn!(srqn, "CQ overrun on a relayed XRC completion");
                        }
                    }
                    None
                }
            }
        }
        _ => {
            let device = exports().lock().devices.get(d.str()?)?.clone();
            let keys = &device.node().keys;
            let key = d.key()?;
            let enc = Enc::default();
            Some(match op {
                Op::Read => {
                    let (addr, len) = (d.u64()?, d.u32()? as usize);
                    if len > MAX_FRAME / 2 {
                        return None;
                    }
                    let mut buf = vec![0u8; len];
                    match keys.read(key, addr, &mut buf) {
                        Ok(()) => enc.u8(0).bytes(&buf),
                        Err(e) => enc.u8(status_byte(Err(e))),
                    }
                }
                Op::Write => {
                    let addr = d.u64()?;
                    enc.u8(status_byte(keys.write(key, addr, d.bytes()?)))
                }
                Op::Check => enc.u8(status_byte(keys.check(key, d.u64()?, d.u64()?))),
                Op::Atomic => {
                    let addr = d.u64()?;
                    let (kind, a, b) = (d.u8()?, d.u64()?, d.u64()?);
                    let op = match kind {
                        0 => AtomicOp::CompareSwap { compare: a, swap: b },
                        1 => AtomicOp::FetchAdd { add: a },
                        2 => AtomicOp::Store { value: a },
                        _ => return None,
                    };
                    match keys.atomic(key, addr, op) {
                        Ok(v) => enc.u8(0).u64(v),
                        Err(e) => enc.u8(status_byte(Err(e))),
                    }
                }
                Op::Invalidate => enc.u8(status_byte(keys.invalidate(key.qpn, key.pd, key.key))),
                Op::Flush => {
                    let (addr, len, whole) = (d.u64()?, d.u64()?, d.u8()? != 0);
                    enc.u8(status_byte(keys.flush(key, addr, len, whole)))
                }
                _ => return None,
            })
        }
    }
}
