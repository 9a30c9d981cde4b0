//! The packet driver of raw packet QPs: one `AF_PACKET` socket per device, bound to the
//! device's interface, that sends whole Ethernet frames and hands every received frame to the
//! device's flow steering ([`crate::flow`]). Opening it needs CAP_NET_RAW, as raw QPs do.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Weak};
use std::time::Duration;

use nix::ifaddrs::getifaddrs;
use nix::sys::socket::{
    bind, recvfrom, send, setsockopt, socket, sockopt, AddressFamily, LinkAddr, MsgFlags, SockFlag,
    SockProtocol, SockType,
};
use parking_lot::Mutex;
use softverbs_engine::{Error, Result};

use crate::flow::Steering;

/// `CAP_NET_RAW` (linux/capability.h).
const CAP_NET_RAW: u32 = 13;
/// `PACKET_OUTGOING`: a frame this host sent, seen by a packet socket.
const PACKET_OUTGOING: u8 = 4;
/// Ethernet header plus one VLAN tag, on top of the interface MTU.
const L2_OVERHEAD: u32 = 18;

/// Whether the calling thread has CAP_NET_RAW in its effective set (what the kernel checks
/// for raw packet QPs and flows, and for packet sockets).
pub fn has_cap_net_raw() -> bool {
    let status = std::fs::read_to_string("/proc/thread-self/status")
        .or_else(|_| std::fs::read_to_string("/proc/self/status"))
        .unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_NET_RAW) != 0)
}

/// Fails with EPERM unless the caller has CAP_NET_RAW.
pub(crate) fn require_cap_net_raw(what: &str) -> Result<()> {
    if has_cap_net_raw() {
        Ok(())
    } else {
        Err(Error::PermissionDenied(
            format!("{what} needs CAP_NET_RAW").into(),
        ))
    }
}

/// `struct ibv_tso_caps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TsoCaps {
    /// Largest TCP payload of one `IBV_WR_TSO`.
    pub max_tso: u32,
    /// QP types that can send TSO (a bit per `ibv_qp_type`).
    pub supported_qpts: u32,
}

impl crate::device::Device {
    /// TSO: raw packet QPs, up to `softverbs_engine::tso::MAX_TSO` bytes per work request.
    pub fn tso_caps(&self) -> TsoCaps {
        TsoCaps {
            max_tso: softverbs_engine::tso::MAX_TSO,
            supported_qpts: 1 << softverbs_engine::types::QpType::RawPacket.raw(),
        }
    }
}

/// One device's packet socket, its steering table and its receive thread. It lives while a
/// raw QP of the device does; the receive thread ends shortly after.
#[derive(Debug)]
pub(crate) struct RawPort {
    fd: OwnedFd,
    max_frame: u32,
    pub(crate) steering: Steering,
}

/// The device's port, if one is open (held weakly: raw QPs own it).
#[derive(Debug, Default)]
pub(crate) struct RawSlot(Mutex<Weak<RawPort>>);

impl RawSlot {
    /// The open port, or a new one on `ifname`.
    pub(crate) fn get_or_open(&self, ifname: &str) -> Result<Arc<RawPort>> {
        let mut slot = self.0.lock();
        if let Some(p) = slot.upgrade() {
            return Ok(p);
        }
        let port = RawPort::open(ifname).map_err(|e| {
            if e.raw_os_error() == Some(nix::errno::Errno::EPERM as i32) {
                Error::PermissionDenied(format!("a packet socket on {ifname}: {e}").into())
            } else {
                Error::Io(e)
            }
        })?;
        *slot = Arc::downgrade(&port);
        Ok(port)
    }
}

/// The link-layer address of `ifname` as `getifaddrs` reports it (`sll_ifindex` set,
/// `sll_protocol` 0, so binding to it keeps the socket's protocol).
fn link_addr(ifname: &str) -> io::Result<LinkAddr> {
    getifaddrs()?
        .filter(|a| a.interface_name == ifname)
        .find_map(|a| a.address.and_then(|s| s.as_link_addr().copied()))
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{ifname} has no link address")))
}

impl RawPort {
    fn open(ifname: &str) -> io::Result<Arc<Self>> {
        let addr = link_addr(ifname)?;
        let fd = socket(
            AddressFamily::Packet,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::EthAll,
        )?;
        bind(fd.as_raw_fd(), &addr)?;
        // A bounded wait lets the receive thread notice that the port was dropped.
        setsockopt(
            &fd,
            sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(0, 200_000),
        )?;
        let _ = setsockopt(&fd, sockopt::RcvBuf, &(4 << 20));
        let port = Arc::new(Self {
            fd,
            max_frame: crate::netif::read_mtu(ifname) + L2_OVERHEAD,
            steering: Steering::default(),
        });
        let weak = Arc::downgrade(&port);
        std::thread::Builder::new()
            .name(format!("sv-raw-{ifname}"))
            .spawn(move || receive_loop(&weak))?;
        Ok(port)
    }

    /// The largest frame the interface carries (MTU plus Ethernet and VLAN headers).
    pub(crate) fn max_frame(&self) -> u32 {
        self.max_frame
    }

    /// Sends one whole frame out of the interface.
    pub(crate) fn send(&self, frame: &[u8]) -> io::Result<()> {
        send(self.fd.as_raw_fd(), frame, MsgFlags::empty())?;
        Ok(())
    }
}

fn receive_loop(port: &Weak<RawPort>) {
    let mut buf = vec![0u8; 65_536];
    loop {
        let Some(p) = port.upgrade() else { return };
        match recvfrom::<LinkAddr>(p.fd.as_raw_fd(), &mut buf) {
            Ok((n, from)) => {
                let outgoing = from.is_some_and(|a| a.pkttype() == PACKET_OUTGOING);
                p.steering.steer(&buf[..n], outgoing);
            }
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
            Err(e) => {
                tracing::warn!("packet socket receive failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}
