//! Contexts and asynchronous events.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Weak};
use std::time::Duration;

use softverbs_device as core;
use softverbs_engine::tm::TmCaps;
use softverbs_engine::types::{AhAttr, EventType, Gid, WorkCompletion};
use softverbs_engine::Result;

use crate::cq::{CompletionChannel, CompletionQueue, CqInner};
use crate::device::Device;
use crate::dm::DeviceMemory;
use crate::domain::ThreadDomain;
use crate::pd::ProtectionDomain;
use crate::qp::{QpInner, QueuePair, SharedReceiveQueue, SrqInner};
use crate::{DeviceAttr, DeviceAttrEx, PortAttr, Timestamps};

/// Objects async events can be about, so an event can hand back the caller's own handle.
#[derive(Debug)]
pub(crate) enum Target {
    Cq(Weak<CqInner>),
    Qp(Weak<QpInner>),
    Srq(Weak<SrqInner>),
}

#[derive(Debug)]
pub(crate) struct CtxInner {
    pub(crate) core: Arc<core::Context>,
    pub(crate) targets: parking_lot::Mutex<HashMap<usize, Target>>,
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        self.core.close();
    }
}

/// An open device context (`ibv_open_device`). Cheap to clone; closed when the last clone and
/// every object created from it are gone.
#[derive(Debug, Clone)]
pub struct Context(pub(crate) Arc<CtxInner>);

/// What an async event is about, as the caller's own handle.
#[derive(Debug, Clone)]
pub enum AsyncEventTarget {
    /// A completion queue.
    Cq(CompletionQueue),
    /// A queue pair.
    Qp(QueuePair),
    /// A shared receive queue.
    Srq(SharedReceiveQueue),
    /// A port.
    Port(u8),
    /// The device.
    Device,
}

/// An async event. It is acknowledged (`ibv_ack_async_event`) when dropped; because it holds the
/// object it is about, that object cannot be destroyed before the acknowledgement.
#[derive(Debug)]
pub struct AsyncEvent {
    ctx: Arc<core::Context>,
    event: core::AsyncEvent,
    target: AsyncEventTarget,
}

impl AsyncEvent {
    /// The event type.
    pub fn event_type(&self) -> EventType {
        self.event.event_type
    }

    /// The object the event is about.
    pub fn target(&self) -> &AsyncEventTarget {
        &self.target
    }
}

impl Drop for AsyncEvent {
    fn drop(&mut self) {
        self.ctx.ack_async_event(&self.event);
    }
}

fn key<T>(a: &Arc<T>) -> usize {
    Arc::as_ptr(a) as usize
}

impl Context {
    pub(crate) fn open(device: &core::Device) -> Result<Self> {
        Ok(Self(Arc::new(CtxInner {
            core: core::Context::open(device)?,
            targets: Default::default(),
        })))
    }

    pub(crate) fn core(&self) -> &Arc<core::Context> {
        &self.0.core
    }

    pub(crate) fn register_target(&self, ptr: usize, t: Target) {
        self.0.targets.lock().insert(ptr, t);
    }

    pub(crate) fn unregister_target(&self, ptr: usize) {
        self.0.targets.lock().remove(&ptr);
    }

    /// The device.
    pub fn device(&self) -> Device {
        Device(self.0.core.device().clone())
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> DeviceAttr {
        self.0.core.query_device()
    }

    /// The tag-matching capabilities (`ibv_query_device_ex`'s `tm_caps`).
    pub fn tm_caps(&self) -> TmCaps {
        self.0.core.device().tm_caps()
    }

    /// `ibv_query_port`: EINVAL for a port the device does not have.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        self.0.core.query_port(port)
    }

    /// `ibv_query_gid`: EINVAL for a bad port or index; unused entries are zero.
    pub fn query_gid(&self, port: u8, index: i32) -> Result<Gid> {
        self.0.core.query_gid(port, index)
    }

    /// `ibv_query_gid_type`: `IBV_GID_TYPE_ROCE_V2` for every populated entry.
    pub fn query_gid_type(&self, port: u8, index: i32) -> Result<u32> {
        self.0.core.query_gid_type(port, index)
    }

    /// `ibv_query_pkey`.
    pub fn query_pkey(&self, port: u8, index: i32) -> Result<u16> {
        self.0.core.query_pkey(port, index)
    }

    /// `ibv_get_pkey_index`.
    pub fn pkey_index(&self, port: u8, pkey: u16) -> Result<u16> {
        self.0.core.pkey_index(port, pkey)
    }

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        ProtectionDomain::alloc(self)
    }

    /// `ibv_alloc_dm`: `length` bytes of device memory, zeroed. EINVAL for 0 bytes, more than
    /// `max_dm_size` or `log_align_req` above 12; ENOMEM when the device's device memory is
    /// used up.
    pub fn alloc_dm(&self, length: u64, log_align_req: u32) -> Result<DeviceMemory> {
        DeviceMemory::alloc(self, length, log_align_req)
    }

    /// `max_dm_size` of `ibv_query_device_ex`: the device memory of the whole device.
    pub fn max_dm_size(&self) -> u64 {
        self.0.core.device().limits().max_dm_size
    }

    /// `ibv_context.num_comp_vectors`: the completion vectors a CQ may name.
    pub fn num_comp_vectors(&self) -> u32 {
        softverbs_device::cq::NUM_COMP_VECTORS
    }

    /// `ibv_alloc_td`.
    pub fn alloc_td(&self) -> Result<ThreadDomain> {
        ThreadDomain::alloc(self)
    }

    /// The command file descriptor (`ibv_context.cmd_fd`), owned by the context.
    pub fn cmd_fd(&self) -> RawFd {
        self.0.core.cmd_fd()
    }

    /// `ibv_import_device(dup(cmd_fd))`: a second context over this context's objects, in
    /// which [`Context::import_pd`], [`Context::import_dm`] and
    /// [`ProtectionDomain::import_mr`] find them by handle.
    pub fn import_shared(&self) -> Result<Self> {
        Self::import_device(self.0.core.dup_cmd_fd()?)
    }

    /// `ibv_import_device`: a context over the objects of the context whose command fd `fd`
    /// duplicates; the new context owns `fd` (it is closed on failure too). EINVAL if `fd` is
    /// not such a descriptor, ENODEV if its objects live in another process.
    pub fn import_device(fd: OwnedFd) -> Result<Self> {
        let core = core::Context::import(fd).map_err(|(e, _fd)| e)?;
        Ok(Self(Arc::new(CtxInner {
            core,
            targets: Default::default(),
        })))
    }

    /// `ibv_import_pd`: the PD `handle` names in this context's shared objects. Dropping the
    /// returned handle only unimports it; the PD lives until its owner drops it. EINVAL if
    /// there is no such PD.
    pub fn import_pd(&self, handle: u32) -> Result<ProtectionDomain> {
        ProtectionDomain::import(self, handle)
    }

    /// `ibv_import_dm`: the device memory `handle` names in this context's shared objects.
    /// Dropping the returned handle only unimports it. EINVAL if there is none.
    pub fn import_dm(&self, handle: u32) -> Result<DeviceMemory> {
        DeviceMemory::import(self, handle)
    }

    /// `ibv_create_comp_channel`.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::create(self)
    }

    /// `ibv_create_cq`: at least `cqe` entries; see [`CompletionQueue::cqe`] for the actual size.
    pub fn create_cq(
        &self,
        cqe: i32,
        channel: Option<&CompletionChannel>,
        comp_vector: i32,
    ) -> Result<CompletionQueue> {
        CompletionQueue::create(self, cqe, channel, comp_vector)
    }

    /// `ibv_create_cq_ex` with `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP` and/or `_WALLCLOCK`: as
    /// [`Context::create_cq`], and every completion carries the clocks in `ts`
    /// ([`WorkCompletion::timestamp`] in ticks of [`DeviceAttrEx::hca_core_clock`] kHz,
    /// [`WorkCompletion::wallclock_ns`]).
    pub fn create_cq_with_timestamps(
        &self,
        cqe: i32,
        channel: Option<&CompletionChannel>,
        comp_vector: i32,
        ts: Timestamps,
    ) -> Result<CompletionQueue> {
        let cq = CompletionQueue::create(self, cqe, channel, comp_vector)?;
        cq.core().set_timestamps(ts);
        Ok(cq)
    }

    /// `ibv_query_device_ex`: capability bits beyond `ibv_device_attr`, on-demand paging and the
    /// completion clock.
    pub fn query_device_ex(&self) -> DeviceAttrEx {
        self.0.core.query_device_ex()
    }

    /// `ibv_query_rt_values_ex` with `IBV_VALUES_MASK_RAW_CLOCK`: the completion clock now, in
    /// the ticks completion timestamps use.
    pub fn query_raw_clock(&self) -> u64 {
        softverbs_device::attr_ex::raw_clock()
    }

    /// `ibv_init_ah_from_wc`: the address vector answering the sender of a UD receive.
    pub fn init_ah_from_wc(&self, port: u8, wc: &WorkCompletion, grh: &[u8]) -> Result<AhAttr> {
        self.0.core.init_ah_from_wc(port, wc, grh)
    }

    /// `ibv_get_async_event`: blocks until an event arrives (several threads may wait; each
    /// event goes to one of them). EAGAIN if the fd was made non-blocking and none is pending.
    pub fn get_async_event(&self) -> Result<AsyncEvent> {
        self.get_async_event_timeout(None)
    }

    /// As [`Context::get_async_event`], giving up with [`Error::WouldBlock`](crate::Error) after
    /// `timeout` (`None` waits forever).
    pub fn get_async_event_timeout(&self, timeout: Option<Duration>) -> Result<AsyncEvent> {
        loop {
            let event = self.0.core.get_async_event(timeout)?;
            let target = {
                let targets = self.0.targets.lock();
                let find = |ptr: usize| targets.get(&ptr);
                match &event.element {
                    core::EventElement::Cq(cq) => match find(key(cq)) {
                        Some(Target::Cq(w)) => w.upgrade().map(|i| AsyncEventTarget::Cq(CompletionQueue(i))),
                        _ => None,
                    },
                    // An `ibv_open_qp` handle is registered under its token.
                    core::EventElement::OpenedQp(_, token) => match find(*token as usize) {
                        Some(Target::Qp(w)) => w.upgrade().map(|i| AsyncEventTarget::Qp(QueuePair(i))),
                        _ => None,
                    },
                    core::EventElement::Qp(qp) => match find(key(qp)) {
                        Some(Target::Qp(w)) => w.upgrade().map(|i| AsyncEventTarget::Qp(QueuePair(i))),
                        _ => None,
                    },
                    core::EventElement::Srq(srq) => match find(key(srq)) {
                        Some(Target::Srq(w)) => {
                            w.upgrade().map(|i| AsyncEventTarget::Srq(SharedReceiveQueue(i)))
                        }
                        _ => None,
                    },
                    core::EventElement::Port(p) => Some(AsyncEventTarget::Port(*p)),
                    core::EventElement::Device => Some(AsyncEventTarget::Device),
                }
            };
            match target {
                Some(target) => {
                    return Ok(AsyncEvent {
                        ctx: self.0.core.clone(),
                        event,
                        target,
                    })
                }
                // The object's last handle is being dropped on another thread, which is waiting
                // for this very acknowledgement: acknowledge and look for the next event.
                None => self.0.core.ack_async_event(&event),
            }
        }
    }

    /// Packet counters of the device (sent, received, and dropped by reason).
    pub fn counters(&self) -> crate::CounterSnapshot {
        self.0.core.device().counters()
    }

    /// Datagrams with the forwarding header that this process dropped because they did not
    /// come from the holder of the standard RoCE port (forgeries by other local senders). Per
    /// process, like the UDP endpoint.
    pub fn forged_forwards(&self) -> u64 {
        self.0.core.device().forged_forwards()
    }

    /// This process's UDP endpoint as (slot, UDP port, whether it holds the standard RoCE
    /// port); `None` until the first QP exists or if no port could be bound.
    pub fn udp_status(&self) -> Option<(u8, u16, bool)> {
        self.0.core.device().udp_status()
    }

    /// Undelivered async events.
    pub fn pending_async_events(&self) -> usize {
        self.0.core.pending_async_events()
    }
}

impl AsFd for Context {
    /// The async event fd (`ibv_context.async_fd`), readable while an event is pending.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.core.async_fd_borrowed()
    }
}
