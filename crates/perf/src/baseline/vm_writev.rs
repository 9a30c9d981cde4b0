//! `process_vm_writev` bandwidth: one process copies a buffer into another's, the single-copy
//! transfer that shared-memory transports (UCX's CMA, for instance) are built on.

use std::io::{BufRead, IoSlice};
use std::time::Instant;

use nix::sys::uio::{process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;

use crate::{check_duration, PeerChild, Result, VmWritevArgs, PEER_TIMEOUT};

/// The byte every copy writes; the target checks it at the end.
const FILL: u8 = 0x5a;

pub(crate) fn run(a: &VmWritevArgs) -> Result<()> {
    if a.size == 0 {
        return Err("--size must be at least 1".into());
    }
    if a.target {
        return target(a.size);
    }
    let duration = check_duration(a.duration)?;
    let mut peer = PeerChild::spawn(&[
        "vm-writev".into(),
        "--target".into(),
        "--size".into(),
        a.size.to_string(),
    ])?;
    let line = peer.line(PEER_TIMEOUT)?;
    let (pid, base) = parse_target(&line).ok_or_else(|| format!("bad target line {line:?}"))?;
    let src = vec![FILL; a.size];
    let local = [IoSlice::new(&src)];
    let remote = [RemoteIoVec { base, len: a.size }];
    let copy = || -> Result<()> {
        let n = process_vm_writev(pid, &local, &remote).map_err(|e| format!("process_vm_writev: {e}"))?;
        if n == a.size {
            Ok(())
        } else {
            Err(format!("process_vm_writev copied {n} of {} bytes", a.size))
        }
    };
    // The first copy faults the target's pages in.
    copy()?;
    let start = Instant::now();
    let mut copies = 0u64;
    while start.elapsed() < duration {
        copy()?;
        copies += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    peer.send_line("check")?;
    let verdict = peer.line(PEER_TIMEOUT)?;
    if verdict != "OK" {
        return Err(format!("the target's buffer is wrong: {verdict}"));
    }
    peer.finish(PEER_TIMEOUT)?;
    let bytes = copies * a.size as u64;
    println!("bytes,copies,seconds,gbps");
    println!(
        "{bytes},{copies},{secs:.6},{:.3}",
        bytes as f64 * 8.0 / secs / 1e9
    );
    Ok(())
}

fn parse_target(line: &str) -> Option<(Pid, usize)> {
    let mut f = line.strip_prefix("TARGET ")?.split_whitespace();
    let pid = f.next()?.parse().ok()?;
    let base = usize::from_str_radix(f.next()?.strip_prefix("0x")?, 16).ok()?;
    Some((Pid::from_raw(pid), base))
}

/// The target: announces its buffer, then waits for `check` and verifies what was copied in.
fn target(size: usize) -> Result<()> {
    let buf = vec![0u8; size];
    println!("TARGET {} {:#x}", std::process::id(), buf.as_ptr() as usize);
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    // The writer changed the buffer behind the compiler's back; black_box keeps it from
    // assuming the zeros it wrote are still there.
    let buf = std::hint::black_box(buf);
    if buf.iter().all(|&b| b == FILL) {
        println!("OK");
    } else {
        println!("BAD");
    }
    Ok(())
}
