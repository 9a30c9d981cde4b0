//! Pacing towards receivers on this host.
//!
//! UDP has no flow control: on loopback a sender that outruns the receiving process overflows
//! the receiver's socket buffer and the kernel drops datagrams. Over RC that costs
//! retransmissions; over UC and UD the messages are simply lost, although nothing left the host.
//! A sender on the same host can see the receiver's queue, though (`/proc/net/udp`, per network
//! namespace), so every so many bytes sent to a local port it looks, and while that queue is
//! more than half full it waits for the receiver to catch up (bounded, so a stopped receiver
//! costs at most a short delay before the datagrams go out and are lost as on a real network).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Longest wait for one receiver to drain before sending anyway.
const MAX_WAIT: Duration = Duration::from_millis(200);
/// Re-check interval while waiting.
const POLL: Duration = Duration::from_micros(50);
/// Smaller sends (ACKs, small messages) are never held back: they cannot fill a buffer alone,
/// and an ACK held back would slow the peer down.
const MIN_PACED: usize = 1024;

/// Per-destination byte counters between looks at the receiver's queue.
#[derive(Debug)]
pub(crate) struct Pacer {
    /// The receive buffer a softverbs socket gets (our own; peers run the same code).
    rcvbuf: usize,
    sent: Mutex<HashMap<(bool, u16), usize>>,
}

impl Pacer {
    /// A pacer for receivers whose socket buffer holds `rcvbuf` bytes.
    pub(crate) fn new(rcvbuf: usize) -> Self {
        Self {
            rcvbuf: rcvbuf.max(64 << 10),
            sent: Mutex::new(HashMap::new()),
        }
    }

    /// Called before `bytes` go to the local UDP `port`: waits while its queue is too full.
    pub(crate) fn before_send(&self, v6: bool, port: u16, bytes: usize) {
        if bytes < MIN_PACED {
            return;
        }
        let check = {
            let mut sent = self.sent.lock();
            let n = sent.entry((v6, port)).or_insert(0);
            *n += bytes;
            if *n >= self.rcvbuf / 8 {
                *n = 0;
                true
            } else {
                false
            }
        };
        if !check {
            return;
        }
        let high = self.rcvbuf / 2;
        let low = self.rcvbuf / 4;
        let Some(q) = queued(v6, port) else { return };
        if q <= high {
            return;
        }
        let start = Instant::now();
        while start.elapsed() < MAX_WAIT {
            std::thread::sleep(POLL);
            if queued(v6, port).is_none_or(|q| q <= low) {
                return;
            }
        }
        tracing::debug!(port, "a local receiver does not drain its socket; sending anyway");
    }
}

/// Bytes waiting in the receive queues of the sockets bound to `port` in this network
/// namespace; `None` if the table cannot be read.
fn queued(v6: bool, port: u16) -> Option<usize> {
    let path = if v6 { "/proc/net/udp6" } else { "/proc/net/udp" };
    let text = std::fs::read_to_string(path).ok()?;
    Some(rx_queue(&text, port))
}

/// Sums the `rx_queue` column of `/proc/net/udp{,6}` rows whose local port is `port`.
fn rx_queue(table: &str, port: u16) -> usize {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let mut cols = line.split_whitespace();
            let local = cols.nth(1)?;
            let queues = cols.nth(2)?;
            let p = u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?;
            if p != port {
                return None;
            }
            usize::from_str_radix(queues.split(':').nth(1)?, 16).ok()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
  101: 00000000:12B8 00000000:0000 07 00000000:00012C00 00:00000000 00000000     0        0 1234 2 0000000000000000 0
  102: 0100007F:12B8 00000000:0000 07 00000000:00000100 00:00000000 00000000     0        0 1235 2 0000000000000000 0
  103: 00000000:12B7 00000000:0000 07 00000000:0FFFFFFF 00:00000000 00000000     0        0 1236 2 0000000000000000 0
";

    #[test]
    fn sums_the_queues_of_one_port() {
        assert_eq!(rx_queue(TABLE, 4792), 0x12C00 + 0x100);
        assert_eq!(rx_queue(TABLE, 4791), 0x0FFF_FFFF);
        assert_eq!(rx_queue(TABLE, 4793), 0);
    }

    #[test]
    fn reads_this_hosts_table() {
        // A socket of our own with a datagram waiting shows up with a non-zero queue.
        let rx = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let port = rx.local_addr().expect("addr").port();
        tx.send_to(&[7u8; 1000], ("127.0.0.1", port)).expect("send");
        let start = Instant::now();
        while queued(false, port).unwrap_or(0) == 0 && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(queued(false, port).expect("table readable") >= 1000);
        let mut buf = [0u8; 2000];
        let _ = rx.recv(&mut buf).expect("recv");
        assert_eq!(queued(false, port), Some(0));
    }
}
