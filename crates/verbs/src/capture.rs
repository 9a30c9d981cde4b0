//! Packet captures of this process's RoCEv2 traffic, for Wireshark and tshark.
//!
//! A [`PacketCapture`] writes every packet the process sends and receives, over UDP, shared
//! memory or between devices of the process, to a pcap file: each packet as the RoCEv2
//! datagram it is (or stands for) on the wire, with IP and UDP headers and its ICRC. The
//! environment variable `SOFTVERBS_PCAP=FILE` starts one when the process opens its devices (a
//! `%p` in the name becomes the process ID), for programs that do not call this API, C programs
//! included.
//!
//! tshark decodes RoCEv2 on UDP port 4791; softverbs processes on one host use the ports above
//! it (4791 + slot), so name them: `tshark -r FILE -d udp.port==4791-5046,infiniband`.
//!
//! ```no_run
//! let capture = softverbs::PacketCapture::start("/tmp/rdma.pcap")?;
//! // ... traffic ...
//! let stats = capture.stop();
//! println!("{} packets out, {} in", stats.outgoing, stats.incoming);
//! # Ok::<(), softverbs::Error>(())
//! ```

use std::path::Path;
use std::sync::Arc;

pub use softverbs_device::capture::CaptureStats;
use softverbs_device::capture::{self, Capture};

/// A running packet capture of this process (at most one runs at a time; starting another
/// stops this one). It stops when dropped.
#[derive(Debug)]
pub struct PacketCapture {
    inner: Arc<Capture>,
}

impl PacketCapture {
    /// Starts writing every packet of this process to `path` (created, or truncated), in place
    /// of any capture running, the one `SOFTVERBS_PCAP` started included.
    pub fn start(path: impl AsRef<Path>) -> crate::Result<Self> {
        let inner = capture::start(path).map_err(crate::Error::Io)?;
        Ok(Self { inner })
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        self.inner.path()
    }

    /// What was written so far.
    pub fn stats(&self) -> CaptureStats {
        self.inner.stats()
    }

    /// Whether it still writes (false once another capture replaced it).
    pub fn is_running(&self) -> bool {
        self.inner.is_running()
    }

    /// Stops writing, closes the file and returns what was written.
    pub fn stop(self) -> CaptureStats {
        self.inner.stop();
        self.inner.stats()
    }
}

impl Drop for PacketCapture {
    fn drop(&mut self) {
        self.inner.stop();
    }
}

/// Stops the process's packet capture (for example the one `SOFTVERBS_PCAP` started), if one
/// runs, and returns what it wrote.
pub fn stop_capture() -> Option<CaptureStats> {
    capture::stop()
}

/// What the process's running packet capture has written, if one runs.
pub fn capture_stats() -> Option<CaptureStats> {
    capture::current().map(|c| c.stats())
}
