//! Asynchronous events: `ibv_get_async_event` and `ibv_ack_async_event`.

use std::ffi::c_int;
use std::ptr::addr_of_mut;

use softverbs_device::{AsyncEvent, EventElement};
use softverbs_engine::types::EventType;

use super::{bump_locked, context, errno_of, outer, SvCq, SvQp, SvSrq, EINVAL};
use crate::abi::*;
use crate::fail_minus_one;

/// `ibv_get_async_event`: 0, or -1 with errno (EAGAIN if `async_fd` is non-blocking).
pub(crate) unsafe extern "C" fn get_async_event(ctx: *mut ibv_context, event: *mut ibv_async_event) -> c_int {
    // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
    let Some(c) = (unsafe { context(ctx) }) else {
        return fail_minus_one(EINVAL);
    };
    if event.is_null() {
        return fail_minus_one(EINVAL);
    }
    let ev = match c.core.get_async_event(None) {
        Ok(ev) => ev,
        Err(e) => return fail_minus_one(errno_of(&e)),
    };
    let element = match &ev.element {
        EventElement::Cq(cq) => ibv_async_event_element {
            cq: cq.user_data() as *mut ibv_cq,
        },
        EventElement::Qp(qp) => ibv_async_event_element {
            qp: qp.user_data() as *mut ibv_qp,
        },
        // The token of an `ibv_open_qp` handle is its box.
        EventElement::OpenedQp(_, token) => ibv_async_event_element {
            qp: *token as *mut ibv_qp,
        },
        EventElement::Srq(srq) => ibv_async_event_element {
            srq: srq.user_data() as *mut ibv_srq,
        },
        EventElement::Port(p) => ibv_async_event_element {
            port_num: c_int::from(*p),
        },
        EventElement::Device => ibv_async_event_element { port_num: 0 },
    };
    // SAFETY: `event` is writable.
    unsafe {
        event.write(ibv_async_event {
            element,
            event_type: ev.event_type.raw(),
        });
    };
    0
}

/// `ibv_ack_async_event`.
pub(crate) unsafe extern "C" fn ack_async_event(event: *mut ibv_async_event) {
    if event.is_null() {
        return;
    }
    // SAFETY: `event` is the event `ibv_get_async_event` filled.
    let (element, raw_type) = unsafe { (std::ptr::read(&(*event).element), (*event).event_type) };
    let Some(event_type) = EventType::from_raw(raw_type) else {
        return;
    };
    use EventType as E;
    match event_type {
        E::CqErr => {
            // SAFETY: a CQ event's element is the CQ box, alive until the event is acknowledged.
            let cq = unsafe { element.cq };
            // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
            if let Some(c) = unsafe { outer::<SvCq, _>(cq) } {
                c.core.context().ack_async_event(&AsyncEvent {
                    element: EventElement::Cq(c.core.clone()),
                    event_type,
                });
                // SAFETY: `cq` is live.
                unsafe {
                    bump_locked(
                        addr_of_mut!((*cq).mutex),
                        addr_of_mut!((*cq).cond),
                        addr_of_mut!((*cq).async_events_completed),
                        1,
                    );
                }
            }
        }
        E::QpFatal
        | E::QpReqErr
        | E::QpAccessErr
        | E::CommEst
        | E::SqDrained
        | E::PathMig
        | E::PathMigErr
        | E::QpLastWqeReached => {
            // SAFETY: a QP event's element is the QP box, alive until the event is acknowledged.
            let qp = unsafe { element.qp };
            // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
            if let Some(q) = unsafe { outer::<SvQp, _>(qp) } {
                q.core.context().ack_async_event(&AsyncEvent {
                    element: EventElement::Qp(q.core.clone()),
                    event_type,
                });
                // SAFETY: `qp` is live.
                unsafe {
                    bump_locked(
                        addr_of_mut!((*qp).mutex),
                        addr_of_mut!((*qp).cond),
                        addr_of_mut!((*qp).events_completed),
                        1,
                    );
                }
            }
        }
        E::SrqErr | E::SrqLimitReached => {
            // SAFETY: an SRQ event's element is the SRQ box, alive until acknowledged.
            let srq = unsafe { element.srq };
            // SAFETY: the caller passes NULL or a live object of this library (the verbs API contract).
            if let Some(s) = unsafe { outer::<SvSrq, _>(srq) } {
                s.core.pd().context().ack_async_event(&AsyncEvent {
                    element: EventElement::Srq(s.core.clone()),
                    event_type,
                });
                // SAFETY: `srq` is live.
                unsafe {
                    bump_locked(
                        addr_of_mut!((*srq).mutex),
                        addr_of_mut!((*srq).cond),
                        addr_of_mut!((*srq).events_completed),
                        1,
                    );
                }
            }
        }
        _ => {}
    }
}
