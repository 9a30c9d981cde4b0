//! An opened device (`ibv_open_device`): queries, async events and address resolution.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use softverbs_engine::qp_state::PortLimits;
use softverbs_engine::types::{
    AhAttr, EventType, Gid, GlobalRoute, WcFlags, WorkCompletion, GID_TYPE_ROCE_V2,
};
use softverbs_engine::{Error, Result};
use softverbs_wire::{GrhPacket, GrhRepr};

use crate::cq::Cq;
use crate::device::{Device, DeviceAttr, PortAttr, DEFAULT_PKEY};
use crate::dm::Dm;
use crate::pd::Pd;
use crate::qp::{Qp, Srq};
use crate::sync::EventQueue;
use crate::ufile::{UObject, Ufile};

/// Bytes at the start of a UD receive buffer reserved for the network header.
pub const GRH_LEN: usize = softverbs_wire::grh::HEADER_LEN;

/// The object an async event is about (`ibv_async_event.element`).
#[derive(Debug, Clone)]
pub enum EventElement {
    /// A CQ event.
    Cq(Arc<Cq>),
    /// A QP event.
    Qp(Arc<Qp>),
    /// A QP event for one `ibv_open_qp` handle of an XRC target, named by the token the front
    /// end gave [`Qp::open`].
    OpenedQp(Arc<Qp>, u64),
    /// An SRQ event.
    Srq(Arc<Srq>),
    /// A port event.
    Port(u8),
    /// A device event.
    Device,
}

/// An asynchronous event (`struct ibv_async_event`). Every event returned by
/// [`Context::get_async_event`] must be passed to [`Context::ack_async_event`].
#[derive(Debug, Clone)]
pub struct AsyncEvent {
    /// What the event is about.
    pub element: EventElement,
    /// The event.
    pub event_type: EventType,
}

/// An open context on a device.
#[derive(Debug)]
pub struct Context {
    device: Device,
    events: EventQueue<AsyncEvent>,
    ufile: Arc<Ufile>,
    /// Closed by [`Context::close`], as `ibv_close_device` closes the command fd.
    cmd_fd: parking_lot::Mutex<Option<OwnedFd>>,
    closed: AtomicBool,
}

impl Context {
    /// Opens the device (`ibv_open_device`).
    pub fn open(device: &Device) -> Result<Arc<Self>> {
        let (ufile, cmd_fd) = Ufile::create(device)?;
        Ok(Arc::new(Self {
            device: device.clone(),
            events: EventQueue::new()?,
            ufile,
            cmd_fd: parking_lot::Mutex::new(Some(cmd_fd)),
            closed: AtomicBool::new(false),
        }))
    }

    /// `ibv_import_device`: a second context over the objects of the context whose command fd
    /// `fd` duplicates (see [`Context::cmd_fd`]). The new context owns `fd`; on failure it is
    /// handed back. EINVAL if `fd` is not a command fd of this library, ENODEV if its objects
    /// live in another process.
    pub fn import(fd: OwnedFd) -> std::result::Result<Arc<Self>, (Error, OwnedFd)> {
        let ufile = match Ufile::find(fd.as_fd()) {
            Ok(u) => u,
            Err(e) => return Err((e, fd)),
        };
        let events = match EventQueue::new() {
            Ok(q) => q,
            Err(e) => return Err((e, fd)),
        };
        Ok(Arc::new(Self {
            device: ufile.device().clone(),
            events,
            ufile,
            cmd_fd: parking_lot::Mutex::new(Some(fd)),
            closed: AtomicBool::new(false),
        }))
    }

    /// The command file descriptor (`ibv_context.cmd_fd`): a descriptor this context owns whose
    /// duplicates [`Context::import`] accepts; -1 once the context is closed.
    pub fn cmd_fd(&self) -> RawFd {
        self.cmd_fd.lock().as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    /// A duplicate of the command file descriptor, for [`Context::import`] (in this process;
    /// the objects it names are this process's).
    pub fn dup_cmd_fd(&self) -> Result<OwnedFd> {
        match self.cmd_fd.lock().as_ref() {
            Some(f) => Ok(f.try_clone()?),
            None => Err(Error::invalid("the context is closed")),
        }
    }

    /// Whether two contexts share one object table (one was imported from the other's fd).
    pub fn shares_objects_with(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.ufile, &other.ufile)
    }

    /// `ibv_import_pd`: the PD `handle` names among this context's shared objects. EINVAL if
    /// there is none (or it was deallocated).
    pub fn import_pd(&self, handle: u32) -> Result<Arc<Pd>> {
        match self.ufile.lookup(handle) {
            Some(UObject::Pd(w)) => w.upgrade().filter(|p| !p.uses().is_retired()),
            _ => None,
        }
        .ok_or_else(|| {
            Error::invalid(format!(
                "handle {handle} names no protection domain of this context"
            ))
        })
    }

    /// `ibv_import_dm`: the device memory `handle` names among this context's shared objects.
    /// EINVAL if there is none (or it was freed).
    pub fn import_dm(&self, handle: u32) -> Result<Arc<Dm>> {
        match self.ufile.lookup(handle) {
            Some(UObject::Dm(w)) => w.upgrade().filter(|d| !d.uses().is_retired()),
            _ => None,
        }
        .ok_or_else(|| Error::invalid(format!("handle {handle} names no device memory of this context")))
    }

    pub(crate) fn ufile(&self) -> &Ufile {
        &self.ufile
    }

    /// Closes the context (`ibv_close_device`): drops undelivered async events. Objects created on
    /// the context stay valid until destroyed, as the man page leaves them to the caller.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.events.clear();
        self.cmd_fd.lock().take();
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> DeviceAttr {
        self.device.attr().clone()
    }

    /// `ibv_query_device_ex`: the extended attributes.
    pub fn query_device_ex(&self) -> crate::DeviceAttrEx {
        crate::DeviceAttrEx::new(self.device.attr().device_cap_flags)
    }

    fn check_port(&self, port: u8) -> Result<()> {
        if port == 0 || port > self.device.attr().phys_port_cnt {
            return Err(Error::invalid(format!(
                "port_num {port} is not a port of {}",
                self.device.name()
            )));
        }
        Ok(())
    }

    /// `ibv_query_port`.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        self.check_port(port)?;
        let mut attr = *self.device.port_attr();
        let c = self.device.counters();
        // The IBTA counters are 16 bits wide and saturate.
        attr.bad_pkey_cntr = c.rx_bad_pkey.min(0xFFFF) as u32;
        attr.qkey_viol_cntr = c.rx_bad_qkey.min(0xFFFF) as u32;
        Ok(attr)
    }

    /// `ibv_query_gid`: the GID at `index`; unused entries read as zero.
    pub fn query_gid(&self, port: u8, index: i32) -> Result<Gid> {
        self.check_port(port)?;
        usize::try_from(index)
            .ok()
            .and_then(|i| self.device.gid_table().get(i).copied())
            .ok_or_else(|| Error::invalid(format!("GID index {index} is outside the table")))
    }

    /// `ibv_query_gid_type`: every populated entry is a RoCE v2 GID; empty ones are EINVAL, as
    /// the kernel reports for unset entries.
    pub fn query_gid_type(&self, port: u8, index: i32) -> Result<u32> {
        if self.query_gid(port, index)?.is_zero() {
            return Err(Error::invalid(format!("GID index {index} is empty")));
        }
        Ok(GID_TYPE_ROCE_V2)
    }

    /// `ibv_query_pkey`.
    pub fn query_pkey(&self, port: u8, index: i32) -> Result<u16> {
        self.check_port(port)?;
        if index != 0 {
            return Err(Error::invalid(format!(
                "P_Key index {index} is outside the table (1 entry)"
            )));
        }
        Ok(DEFAULT_PKEY)
    }

    /// `ibv_get_pkey_index`: the index of `pkey` in the table.
    pub fn pkey_index(&self, port: u8, pkey: u16) -> Result<u16> {
        self.check_port(port)?;
        // Membership bit aside, 0xFFFF and 0x7FFF name the same default partition.
        if pkey & 0x7FFF == DEFAULT_PKEY & 0x7FFF {
            Ok(0)
        } else {
            Err(Error::invalid(format!("P_Key {pkey:#06x} is not in the table")))
        }
    }

    /// The limits `modify_qp` and `create_ah` check values against.
    pub fn port_limits(&self) -> PortLimits<'_> {
        let a = self.device.attr();
        PortLimits {
            phys_port_cnt: a.phys_port_cnt,
            pkey_tbl_len: self.device.port_attr().pkey_tbl_len,
            gid_table: self.device.gid_table(),
            max_mtu: self.device.port_attr().max_mtu,
            max_qp_init_rd_atom: self.device.limits().max_qp_init_rd_atom,
            max_qp_rd_atom: self.device.limits().max_qp_rd_atom,
        }
    }

    /// `ibv_get_async_event`: waits for the next async event (`timeout` `None` waits forever).
    /// Several threads may wait at once; each event goes to exactly one of them.
    pub fn get_async_event(&self, timeout: Option<Duration>) -> Result<AsyncEvent> {
        let ev = self.events.pop(timeout)?;
        match &ev.element {
            EventElement::Cq(cq) => cq.async_acks().delivered(),
            EventElement::Qp(qp) | EventElement::OpenedQp(qp, _) => qp.async_acks().delivered(),
            EventElement::Srq(srq) => srq.async_acks().delivered(),
            EventElement::Port(_) | EventElement::Device => {}
        }
        Ok(ev)
    }

    /// `ibv_ack_async_event`.
    pub fn ack_async_event(&self, ev: &AsyncEvent) {
        match &ev.element {
            EventElement::Cq(cq) => cq.async_acks().ack(1),
            EventElement::Qp(qp) | EventElement::OpenedQp(qp, _) => qp.async_acks().ack(1),
            EventElement::Srq(srq) => srq.async_acks().ack(1),
            EventElement::Port(_) | EventElement::Device => {}
        }
    }

    /// The async event file descriptor (`ibv_context.async_fd`): readable when an event is
    /// pending.
    pub fn async_fd(&self) -> RawFd {
        self.events.raw_fd()
    }

    /// The async event file descriptor, borrowed.
    pub fn async_fd_borrowed(&self) -> BorrowedFd<'_> {
        self.events.as_fd()
    }

    /// Number of undelivered async events.
    pub fn pending_async_events(&self) -> usize {
        self.events.len()
    }

    /// Queues an async event.
    pub(crate) fn raise(&self, element: EventElement, event_type: EventType) {
        if !self.closed.load(Ordering::Acquire) {
            tracing::debug!(?event_type, "async event");
            self.events.push(AsyncEvent { element, event_type });
        }
    }

    /// Drops undelivered events about an object that is being destroyed.
    pub(crate) fn forget_events(&self, pred: impl FnMut(&AsyncEvent) -> bool) {
        self.events.remove_where(pred);
    }

    /// A handle number for a new object (`ibv_*.handle`).
    pub(crate) fn next_handle(&self) -> u32 {
        self.ufile.next_handle()
    }

    /// `ibv_init_ah_from_wc`: the address vector that answers the sender of a UD receive
    /// completion. `grh` is the first 40 bytes of the receive buffer. RoCE v2 needs the GRH: it
    /// holds the IPv6 header, or the IPv4 header in its last 20 bytes.
    pub fn init_ah_from_wc(&self, port: u8, wc: &WorkCompletion, grh: &[u8]) -> Result<AhAttr> {
        self.check_port(port)?;
        if !wc.wc_flags.contains(WcFlags::GRH) {
            return Err(Error::invalid(
                "the work completion has no GRH (IBV_WC_GRH), which RoCE needs",
            ));
        }
        let grh = grh
            .get(..GRH_LEN)
            .ok_or_else(|| Error::invalid("the GRH buffer is shorter than 40 bytes"))?;
        let GrhRepr {
            src_addr: src,
            dst_addr: dst,
            traffic_class,
            flow_label,
            ..
        } = GrhRepr::parse(&GrhPacket::new_unchecked(grh)).map_err(|_| {
            Error::invalid("the GRH area holds neither an IPv6 header nor an IPv4 header at byte 20")
        })?;
        let local = Gid::from_ip(dst);
        let sgid_index = self
            .device
            .gid_table()
            .iter()
            .position(|g| *g == local)
            .ok_or_else(|| Error::invalid(format!("the GRH destination {dst} is not a GID of this port")))?;
        Ok(AhAttr {
            grh: GlobalRoute {
                dgid: Gid::from_ip(src),
                flow_label,
                sgid_index: sgid_index as u8,
                // The reply is a new packet: start with a full hop budget.
                hop_limit: 0xFF,
                traffic_class,
            },
            dlid: wc.slid,
            sl: wc.sl,
            src_path_bits: wc.dlid_path_bits,
            static_rate: 0,
            is_global: true,
            port_num: port,
        })
    }
}
