//! Pacing towards receivers on this host.
//!
//! UDP has no flow control: on loopback a sender that outruns the receiving process overflows
//! the receiver's socket buffer and the kernel drops datagrams. Over RC that costs
//! retransmissions; over UC and UD the messages are simply lost, although nothing left the host.
//! A sender on the same host can see the receiver's queue, though (`/proc/net/udp`, per network
//! namespace), so every so many bytes sent to a local port it looks, and while that queue is
//! more than half full it waits for the receiver to catch up (bounded, so a stopped receiver
//! costs at most a short delay before the datagrams go out and are lost as on a real network).
//! Reading the table walks the host's whole UDP hash table (about 0.1 ms), so the next look
//! comes only after as many bytes as could fill half the room the last look found. A receiver
//! that did not drain within one wait (stopped, say) counts as stalled: later looks that find
//! its queue still full send at once, until a look finds room again, so a frozen receiver costs
//! its senders one wait, not one every few megabytes.

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
    /// Per destination: bytes sent since the last look, and how many may go before the next.
    sent: Mutex<HashMap<(bool, u16), (usize, usize)>>,
    /// Destinations whose last wait ended with the queue still full.
    stalled: Mutex<std::collections::HashSet<(bool, u16)>>,
}

impl Pacer {
    /// A pacer for receivers whose socket buffer holds `rcvbuf` bytes.
    pub(crate) fn new(rcvbuf: usize) -> Self {
        Self {
            rcvbuf: rcvbuf.max(64 << 10),
            sent: Mutex::new(HashMap::new()),
            stalled: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// Called before `bytes` go to the local UDP `port`: waits while its queue is too full.
    pub(crate) fn before_send(&self, v6: bool, port: u16, bytes: usize) {
        if bytes < MIN_PACED {
            return;
        }
        let high = self.rcvbuf / 2;
        let low = self.rcvbuf / 4;
        let check = {
            let mut sent = self.sent.lock();
            let (n, budget) = sent.entry((v6, port)).or_insert((0, self.rcvbuf / 8));
            *n += bytes;
            if *n >= *budget {
                *n = 0;
                true
            } else {
                false
            }
        };
        if !check {
            return;
        }
        let Some(q) = queued(v6, port) else { return };
        // Queued datagrams take more memory than their bytes (the table counts that), and
        // other senders may fill the same queue: half the room left, at least an eighth.
        let budget = (high.saturating_sub(q) / 2).max(self.rcvbuf / 8);
        if let Some(e) = self.sent.lock().get_mut(&(v6, port)) {
            e.1 = budget;
        }
        if q <= high {
            self.stalled.lock().remove(&(v6, port));
            return;
        }
        if self.stalled.lock().contains(&(v6, port)) {
            return;
        }
        let start = Instant::now();
        while start.elapsed() < MAX_WAIT {
            std::thread::sleep(POLL);
            if queued(v6, port).is_none_or(|q| q <= low) {
                return;
            }
        }
        self.stalled.lock().insert((v6, port));
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
    fn looks_less_often_while_the_receiver_has_room() {
        // Nobody listens on this port: its queue is empty, so after the first look the next
        // comes after half the room up to the high mark (a quarter buffer), not an eighth.
        let port = std::net::UdpSocket::bind("127.0.0.1:0")
            .and_then(|s| s.local_addr())
            .expect("a free port")
            .port();
        let pacer = Pacer::new(1 << 20);
        let budget = || pacer.sent.lock().get(&(false, port)).copied();
        pacer.before_send(false, port, (1 << 20) / 8);
        assert_eq!(budget(), Some((0, (1 << 20) / 4)), "looked once, with room");
        pacer.before_send(false, port, (1 << 20) / 8);
        assert_eq!(budget(), Some(((1 << 20) / 8, (1 << 20) / 4)), "no look yet");
        pacer.before_send(false, port, 100);
        assert_eq!(
            budget().map(|b| b.0),
            Some((1 << 20) / 8),
            "small sends are not counted"
        );
    }

    #[test]
    fn a_receiver_that_does_not_drain_costs_one_wait() {
        // A socket that never reads, its queue filled beyond half its buffer.
        let rx = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let port = rx.local_addr().expect("addr").port();
        let rcvbuf = 64 << 10;
        nix::sys::socket::setsockopt(&rx, nix::sys::socket::sockopt::RcvBuf, &rcvbuf).expect("rcvbuf");
        let start = Instant::now();
        while queued(false, port).unwrap_or(0) <= rcvbuf / 2 && start.elapsed() < Duration::from_secs(5) {
            let _ = tx.send_to(&[7u8; 1000], ("127.0.0.1", port));
        }
        let pacer = Pacer::new(rcvbuf);
        let waited = |bytes| {
            let t = Instant::now();
            pacer.before_send(false, port, bytes);
            t.elapsed()
        };
        assert!(
            waited(rcvbuf) >= MAX_WAIT,
            "the first look waits for the receiver"
        );
        for _ in 0..5 {
            assert!(
                waited(rcvbuf) < MAX_WAIT / 2,
                "a stalled receiver is not waited for again"
            );
        }
        // Once it drains, it is paced again.
        let mut buf = [0u8; 2000];
        rx.set_nonblocking(true).expect("nonblocking");
        while rx.recv(&mut buf).is_ok() {}
        let _ = waited(rcvbuf);
        assert!(pacer.stalled.lock().is_empty(), "room again: no longer stalled");
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
