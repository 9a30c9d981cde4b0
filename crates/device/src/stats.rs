//! Device counters: what each device of this process counted, and what every process of the
//! user on this host counted.
//!
//! A device's counters live on this process's counter board (`softverbs_shm::StatBoard`, a
//! shared file of the user's private directory) when it could be made, in private memory
//! otherwise; counting is an atomic add either way. [`host_counters`] reads the boards of every
//! live process of the user, which is how `ibv_devinfo -v` and `softverbs-stat` show
//! device-wide figures without a daemon.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use softverbs_engine::transport::DropReason;
use softverbs_shm::StatBoard;

/// Declares the counters: the [`Counter`] names, [`NodeCounters`]' accessors and the fields of
/// [`CounterSnapshot`], in board order (append only: the order is the board's layout).
macro_rules! counters {
    ($($(#[$doc:meta])* $field:ident,)*) => {
        /// A snapshot of a device's counters.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct CounterSnapshot {
            $($(#[$doc])* pub $field: u64,)*
        }

        impl CounterSnapshot {
            /// The counters' names, in the order of [`CounterSnapshot::values`].
            pub const NAMES: &'static [&'static str] = &[$(stringify!($field),)*];

            /// The values, in the order of [`CounterSnapshot::NAMES`].
            pub fn values(&self) -> Vec<u64> {
                vec![$(self.$field,)*]
            }

            /// From values in board order (missing ones are 0).
            fn from_words(w: &[u64]) -> Self {
                let mut it = w.iter().copied();
                Self { $($field: it.next().unwrap_or(0),)* }
            }
        }

        impl NodeCounters {
            $(
                $(#[$doc])*
                pub fn $field(&self) -> &AtomicU64 {
                    self.word(Index::$field as usize)
                }
            )*

            /// The current values.
            pub fn snapshot(&self) -> CounterSnapshot {
                CounterSnapshot { $($field: self.$field().load(Ordering::Relaxed),)* }
            }
        }

        #[allow(non_camel_case_types)]
        enum Index { $($field,)* }

        const COUNT: usize = [$(stringify!($field),)*].len();
    };
}

counters! {
    /// Packets handed to the fabric.
    tx_packets,
    /// Packets received.
    rx_packets,
    /// Received packets that did not parse (bad header, length, opcode).
    rx_malformed,
    /// Received packets for a QP number that does not exist.
    rx_unknown_qp,
    /// Received packets a QP dropped, for any of the reasons counted from `rx_not_receiving` to
    /// `rx_qp_malformed` (their sum).
    rx_dropped,
    /// Received packets with a P_Key not in the table.
    rx_bad_pkey,
    /// Received datagrams with the wrong Q_Key.
    rx_bad_qkey,
    /// Received packets with a bad ICRC (dropped).
    rx_bad_icrc,
    /// Received IPv4 packets whose ICRC could not be checked (sent with a non-zero IP ID).
    rx_icrc_unverified,
    /// Sent packets no node was listening for.
    tx_unroutable,
    /// Packets sent to another process of this host through shared memory (counted in
    /// `tx_packets` too).
    tx_shm_packets,
    /// Of those, packets whose payload stayed in registered memory for the receiver to copy.
    tx_payloads_in_memory,
    /// Copies straight out of a sending process's memory (each covers one or more packets).
    rx_payload_copies,
    /// Such copies that failed (the QP concerned moved to the error state).
    rx_payload_copy_failures,
    /// Bytes of the packets handed to the fabric (BTH to ICRC).
    tx_bytes,
    /// Bytes of the packets received (BTH to ICRC).
    rx_bytes,
    /// QPs of this device now.
    qps,
    /// Request packets resent by reliable QPs.
    retransmits,
    /// Retransmission timer expiries of reliable QPs.
    timeouts,
    /// Sequence-error NAKs received by reliable QPs.
    seq_naks,
    /// RNR NAKs received by reliable QPs.
    rnr_naks,
    /// Dropped by a QP: it was not in a state that receives (RESET, INIT, ERROR, ...).
    rx_not_receiving,
    /// Dropped by a QP: an opcode its transport does not take (e.g. an RDMA READ on UC).
    rx_wrong_transport,
    /// Dropped by a QP: a PSN outside the expected window, or a duplicate with nothing to
    /// answer.
    rx_bad_psn,
    /// Dropped by a QP: a response matching no outstanding request.
    rx_unexpected_response,
    /// Dropped by a QP: a UD or UC message with no receive WQE posted.
    rx_no_recv_wqe,
    /// Dropped by a QP: the rest of a UC message it had abandoned.
    rx_uc_message_dropped,
    /// Dropped by a QP: structurally invalid for its transport (e.g. bad lengths).
    rx_qp_malformed,
    /// Positive ACKs counted in `tx_packets` that never left: a later ACK of the same QP
    /// replaced them while they waited to be sent (ACKs are cumulative).
    tx_acks_coalesced,
    /// Sequence-error NAKs sent by reliable QPs (requests that arrived past a hole in the
    /// PSN sequence).
    seq_naks_sent,
    /// Datagrams the kernel dropped because one of the process's UDP sockets was full
    /// (`SO_RXQ_OVFL`), counted on the UDP driver's block ([`UDP_BLOCK`]).
    rx_socket_drops,
    /// Datagrams the holder of the standard RoCE port forwarded to the process of their QP's
    /// slot ([`UDP_BLOCK`]).
    forwarded,
    /// Of those, the ones that went through the receiver's shared-memory mailbox.
    forwarded_shm,
    /// Datagrams the holder of the standard port could not forward: the receiver's mailbox
    /// stayed full, or the UDP send failed ([`UDP_BLOCK`]).
    forward_drops,
    /// Tail probes sent by reliable QPs: the newest packet in flight sent again, asking for
    /// an acknowledgement, after a few round trips without one (not in `retransmits`).
    tail_probes,
}

impl NodeCounters {
    /// Counts a packet a QP dropped for `reason`: P_Key and Q_Key mismatches have counters of
    /// their own, every other reason counts in `rx_dropped` and in the reason's counter.
    pub fn count_drop(&self, reason: DropReason) {
        let bump = |c: &AtomicU64| {
            c.fetch_add(1, Ordering::Relaxed);
        };
        let by_reason = match reason {
            DropReason::BadPkey => return bump(self.rx_bad_pkey()),
            DropReason::BadQkey => return bump(self.rx_bad_qkey()),
            DropReason::NotReceiving => self.rx_not_receiving(),
            DropReason::WrongTransport => self.rx_wrong_transport(),
            DropReason::BadPsn => self.rx_bad_psn(),
            DropReason::UnexpectedResponse => self.rx_unexpected_response(),
            DropReason::NoReceiveWqe => self.rx_no_recv_wqe(),
            DropReason::UcMessageDropped => self.rx_uc_message_dropped(),
            DropReason::Malformed => self.rx_qp_malformed(),
        };
        bump(self.rx_dropped());
        bump(by_reason);
    }
}

/// The name of the counter block of the process's UDP driver, which counts what belongs to no
/// one device: its sockets' overflows and the forwarding of the standard port's datagrams.
/// `softverbs-stat` shows it beside the devices.
pub const UDP_BLOCK: &str = "udp";

/// The counters of one device of this process.
pub struct NodeCounters {
    words: Words,
}

enum Words {
    Own(Box<[AtomicU64]>),
    Board(Arc<StatBoard>, usize),
}

impl NodeCounters {
    /// Counters of the device called `name`: on this process's board when it has one with room
    /// (devices of one name share a block), in private memory otherwise.
    pub(crate) fn new(name: &str) -> Self {
        let words = match board() {
            Some(b) => match b.block(name) {
                Some(block) => Words::Board(b.clone(), block),
                None => Words::own(),
            },
            None => Words::own(),
        };
        Self { words }
    }

    #[inline]
    fn word(&self, i: usize) -> &AtomicU64 {
        match &self.words {
            Words::Own(w) => &w[i],
            Words::Board(b, block) => b.counter(*block, i),
        }
    }
}

impl Default for NodeCounters {
    fn default() -> Self {
        Self { words: Words::own() }
    }
}

impl Words {
    fn own() -> Self {
        Self::Own((0..COUNT).map(|_| AtomicU64::new(0)).collect())
    }
}

impl std::fmt::Debug for NodeCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.snapshot().fmt(f)
    }
}

/// This process's counter board, made with the first device (none if the private directory
/// cannot be used).
fn board() -> Option<&'static Arc<StatBoard>> {
    static BOARD: OnceLock<Option<Arc<StatBoard>>> = OnceLock::new();
    BOARD
        .get_or_init(|| {
            let dir = softverbs_shm::private_dir(&board_dir_name()).ok()?;
            let netns = netns_inode();
            let comm = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
            StatBoard::create(&dir, netns, comm.trim()).ok().map(Arc::new)
        })
        .as_ref()
}

fn board_dir_name() -> String {
    format!("softverbs-stat-{}", nix::unistd::getuid().as_raw())
}

fn netns_inode() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/net").map_or(0, |m| m.ino())
}

/// What one process of this host counted, per device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessCounters {
    /// The process.
    pub pid: u32,
    /// Its command name.
    pub comm: String,
    /// Whether it runs in this process's network namespace.
    pub same_netns: bool,
    /// Each device's name and counters.
    pub devices: Vec<(String, CounterSnapshot)>,
}

/// The counters of every live process of this user on this host (this one included), in pid
/// order: what `ibv_devinfo -v` sums per device and `softverbs-stat` shows.
pub fn host_counters() -> Vec<ProcessCounters> {
    let Ok(dir) = softverbs_shm::private_dir(&board_dir_name()) else {
        return Vec::new();
    };
    let netns = netns_inode();
    softverbs_shm::read_boards(&dir)
        .into_iter()
        .map(|b| ProcessCounters {
            pid: b.pid,
            comm: b.comm,
            same_netns: b.netns == netns,
            devices: b
                .devices
                .into_iter()
                .map(|(name, words)| (name, CounterSnapshot::from_words(&words)))
                .collect(),
        })
        .collect()
}

/// The sum of `device`'s counters over every process of this user in this network namespace
/// (the device is the same there: the same interface), and how many processes use it.
pub fn device_wide(device: &str) -> (usize, CounterSnapshot) {
    let mut sum = vec![0u64; COUNT];
    let mut processes = 0;
    for p in host_counters().iter().filter(|p| p.same_netns) {
        for (name, c) in &p.devices {
            if name == device {
                processes += 1;
                for (s, v) in sum.iter_mut().zip(c.values()) {
                    *s += v;
                }
            }
        }
    }
    (processes, CounterSnapshot::from_words(&sum))
}

const _: () = assert!(
    COUNT <= softverbs_shm::COUNTERS,
    "the board has room for every counter"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_published_and_summed_by_device() {
        let a = NodeCounters::new("sv_stattest");
        let b = NodeCounters::new("sv_stattest");
        a.tx_packets().fetch_add(3, Ordering::Relaxed);
        b.rx_bytes().fetch_add(100, Ordering::Relaxed);
        // Devices of one name share their block.
        assert_eq!(a.snapshot().rx_bytes, 100);
        let me = host_counters()
            .into_iter()
            .find(|p| p.pid == std::process::id())
            .expect("this process's board");
        let (_, c) = me.devices.iter().find(|(n, _)| n == "sv_stattest").unwrap();
        assert_eq!((c.tx_packets, c.rx_bytes), (3, 100));
        assert!(me.same_netns);
        let (processes, sum) = device_wide("sv_stattest");
        assert_eq!((processes, sum.tx_packets), (1, 3));
        a.count_drop(DropReason::BadPsn);
        a.count_drop(DropReason::BadPsn);
        a.count_drop(DropReason::NoReceiveWqe);
        a.count_drop(DropReason::BadQkey);
        let c = device_wide("sv_stattest").1;
        assert_eq!(
            (
                c.rx_dropped,
                c.rx_bad_psn,
                c.rx_no_recv_wqe,
                c.rx_bad_qkey,
                c.rx_not_receiving
            ),
            (3, 2, 1, 1, 0),
            "QP drops by reason, summed in rx_dropped; Q_Key drops apart"
        );
        assert_eq!(
            CounterSnapshot::NAMES.len(),
            CounterSnapshot::default().values().len()
        );
    }
}
