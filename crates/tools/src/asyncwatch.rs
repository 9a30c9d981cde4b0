//! `ibv_asyncwatch`: prints the async events of a device as they arrive.

use std::io::Write;
use std::time::{Duration, Instant};

use softverbs::{AsyncEvent, AsyncEventTarget, Context, Error, EventType};

use crate::{OrFail, ToolError};

/// The C enumerator name of an event type, e.g. `IBV_EVENT_PORT_ACTIVE`.
pub fn event_name(t: EventType) -> &'static str {
    match t {
        EventType::CqErr => "IBV_EVENT_CQ_ERR",
        EventType::QpFatal => "IBV_EVENT_QP_FATAL",
        EventType::QpReqErr => "IBV_EVENT_QP_REQ_ERR",
        EventType::QpAccessErr => "IBV_EVENT_QP_ACCESS_ERR",
        EventType::CommEst => "IBV_EVENT_COMM_EST",
        EventType::SqDrained => "IBV_EVENT_SQ_DRAINED",
        EventType::PathMig => "IBV_EVENT_PATH_MIG",
        EventType::PathMigErr => "IBV_EVENT_PATH_MIG_ERR",
        EventType::DeviceFatal => "IBV_EVENT_DEVICE_FATAL",
        EventType::PortActive => "IBV_EVENT_PORT_ACTIVE",
        EventType::PortErr => "IBV_EVENT_PORT_ERR",
        EventType::LidChange => "IBV_EVENT_LID_CHANGE",
        EventType::PkeyChange => "IBV_EVENT_PKEY_CHANGE",
        EventType::SmChange => "IBV_EVENT_SM_CHANGE",
        EventType::SrqErr => "IBV_EVENT_SRQ_ERR",
        EventType::SrqLimitReached => "IBV_EVENT_SRQ_LIMIT_REACHED",
        EventType::QpLastWqeReached => "IBV_EVENT_QP_LAST_WQE_REACHED",
        EventType::ClientReregister => "IBV_EVENT_CLIENT_REREGISTER",
        EventType::GidChange => "IBV_EVENT_GID_CHANGE",
        EventType::WqFatal => "IBV_EVENT_WQ_FATAL",
    }
}

/// What an event is about: `port N` exactly as rdma-core prints port events, and the object for
/// the others (rdma-core prints the port-number member of the C union for those, which is
/// meaningless, so this says which object it is instead).
pub fn describe_target(target: &AsyncEventTarget) -> String {
    match target {
        AsyncEventTarget::Port(p) => format!("port {p}"),
        AsyncEventTarget::Qp(qp) => format!("QP 0x{:06x}", qp.qp_num()),
        AsyncEventTarget::Cq(_) => "CQ".to_string(),
        AsyncEventTarget::Srq(_) => "SRQ".to_string(),
        AsyncEventTarget::Device => "device".to_string(),
    }
}

/// One output line (without the newline): `  event_type <NAME> (<number>), <object>`.
pub fn describe(ev: &AsyncEvent) -> String {
    let t = ev.event_type();
    format!(
        "  event_type {} ({}), {}",
        event_name(t),
        t.raw(),
        describe_target(ev.target())
    )
}

/// Prints each async event of `ctx` to `out` (acknowledging it) until `count` events were seen or
/// `timeout` has passed since the start; with neither, forever. Returns how many were printed.
pub fn watch(
    ctx: &Context,
    count: Option<u64>,
    timeout: Option<Duration>,
    out: &mut dyn Write,
) -> Result<u64, ToolError> {
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut seen = 0;
    while count.is_none_or(|c| seen < c) {
        let wait = match deadline {
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Some(left),
                _ => break,
            },
            None => None,
        };
        let ev = match ctx.get_async_event_timeout(wait) {
            Ok(ev) => ev,
            Err(Error::WouldBlock) if deadline.is_some() => break,
            Err(e) => return Err(ToolError::new(format!("Failed to get an async event: {e}"))),
        };
        writeln!(out, "{}", describe(&ev)).or_fail("write")?;
        out.flush().or_fail("write")?;
        // Dropping the event acknowledges it (ibv_ack_async_event).
        drop(ev);
        seen += 1;
    }
    Ok(seen)
}
