//! Helpers of the connection manager tests (one process and two).

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use softverbs::cm::{CmEvent, CmEventType, CmId, EventChannel};
use softverbs::*;

/// How long a test waits for one CM event.
pub(crate) const WAIT: Option<Duration> = Some(Duration::from_secs(20));

/// `127.0.0.1:port`.
pub(crate) fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// The next event on `ch`, which must be of type `ty`.
pub(crate) fn expect(ch: &EventChannel, ty: CmEventType) -> CmEvent {
    let ev = ch.get_event_timeout(WAIT).expect("an event within 20 s");
    assert_eq!(ev.event_type(), ty, "status {}", ev.status());
    ev
}

/// A PD, a CQ and a small region on an id's device.
pub(crate) struct Res {
    pub(crate) pd: ProtectionDomain,
    pub(crate) cq: CompletionQueue,
    pub(crate) mr: MemoryRegion,
}

/// [`Res`] on `id`'s device.
pub(crate) fn res(id: &CmId) -> Res {
    let ctx = id.context().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None, 0).unwrap();
    let mr = pd.register(4096, AccessFlags::LOCAL_WRITE).unwrap();
    Res { pd, cq, mr }
}
