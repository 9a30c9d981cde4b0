//! ATOMIC WRITE and FLUSH (IBTA memory-placement extensions, as kernel rxe implements them):
//! both take a responder resource and complete on a zero-length READ RESPONSE; a duplicate is
//! answered again, never executed again; the responder checks QP and region rights, alignment,
//! length and range; the requester counts them against `max_rd_atomic`.

mod sim;

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use sim::*;
use softverbs_engine::types::{AccessFlags, EventType, QpType, Sge, WcOpcode, WcStatus};
use softverbs_engine::wr::{
    FlushSelect, Payload, RemoteAddr, SendLimits, SendOp, FLUSH_GLOBAL, FLUSH_PERSISTENT,
};
use softverbs_wire::Opcode;

fn atomic_write(wr_id: u64, remote: RemoteAddr, value: u64) -> softverbs_engine::wr::SendWr {
    wr(
        wr_id,
        SendOp::AtomicWrite {
            remote,
            value: value.to_ne_bytes(),
        },
        Payload::Sges(vec![]),
    )
}

fn flush(
    wr_id: u64,
    remote: RemoteAddr,
    len: u32,
    placement: u8,
    select: FlushSelect,
) -> softverbs_engine::wr::SendWr {
    wr(
        wr_id,
        SendOp::Flush {
            remote,
            len,
            placement,
            select,
        },
        Payload::Sges(vec![]),
    )
}

fn flush_access() -> AccessFlags {
    all_access() | AccessFlags::FLUSH_GLOBAL | AccessFlags::FLUSH_PERSISTENT
}

fn flush_opts() -> ConnOpts {
    ConnOpts {
        access: flush_access(),
        ..ConnOpts::default()
    }
}

/// A filter dropping the first `n` packets matching `pred`.
fn drop_first(n: usize, pred: impl Fn(&PacketInfo) -> bool + 'static) -> impl FnMut(&PacketInfo) -> Verdict {
    let mut left = n;
    move |p| {
        if left > 0 && pred(p) {
            left -= 1;
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    }
}

#[test]
fn atomic_write_stores_the_word_and_completes_on_an_empty_read_response() {
    let (mut sim, a, _b) = Sim::pair(1, QpType::Rc, &ConnOpts::default());
    sim.record();
    let remote = sim.mem(1).alloc_mr(1, 64, all_access());
    sim.mem(1).poke(remote.addr, &[0xEE; 64]);
    sim.post_send(a, atomic_write(1, remote.remote(8), 0x0102_0304_0506_0708));
    sim.run();
    let wcs = sim.take_send_cq(a);
    assert_ok_in_order(&wcs, &[1]);
    assert_eq!(wcs[0].opcode, WcOpcode::AtomicWrite);
    assert_eq!(sim.mem(1).peek_u64(remote.addr + 8), 0x0102_0304_0506_0708);
    assert_eq!(
        sim.mem(1).peek(remote.addr, 8),
        vec![0xEE; 8],
        "neighbours untouched"
    );
    assert_eq!(sim.mem(1).peek(remote.addr + 16, 8), vec![0xEE; 8]);
    let log = sim.log.as_ref().unwrap();
    let req = log.iter().find(|p| p.opcode == Opcode::RcAtomicWrite).unwrap();
    assert_eq!(req.payload_len, 8);
    let resp: Vec<_> = log.iter().filter(|p| p.opcode.is_response()).collect();
    assert_eq!(resp.len(), 1);
    assert_eq!(resp[0].opcode, Opcode::RcReadResponseOnly);
    assert_eq!((resp[0].payload_len, resp[0].psn), (0, req.psn));
}

#[test]
fn flush_range_and_whole_region_complete() {
    let (mut sim, a, _b) = Sim::pair(2, QpType::Rc, &flush_opts());
    sim.record();
    let remote = sim.mem(1).alloc_mr(1, 4096, flush_access());
    sim.post_send(
        a,
        flush(1, remote.remote(100), 1000, FLUSH_GLOBAL, FlushSelect::Range),
    );
    sim.post_send(
        a,
        flush(
            2,
            remote.remote(0),
            4096,
            FLUSH_GLOBAL | FLUSH_PERSISTENT,
            FlushSelect::Range,
        ),
    );
    // The whole region: the range is not looked at.
    sim.post_send(
        a,
        flush(
            3,
            remote.remote(1 << 20),
            1 << 30,
            FLUSH_PERSISTENT,
            FlushSelect::Mr,
        ),
    );
    sim.run();
    let wcs = sim.take_send_cq(a);
    assert_ok_in_order(&wcs, &[1, 2, 3]);
    assert!(wcs.iter().all(|w| w.opcode == WcOpcode::Flush));
    assert_eq!(sim.mem(1).flushes.get(), 3);
    let log = sim.log.as_ref().unwrap();
    assert_eq!(log.iter().filter(|p| p.opcode == Opcode::RcFlush).count(), 3);
    assert!(log
        .iter()
        .filter(|p| p.opcode.is_response())
        .all(|p| p.opcode == Opcode::RcReadResponseOnly && p.payload_len == 0));
}

#[test]
fn a_lost_atomic_write_response_is_replayed_not_reexecuted() {
    let (mut sim, a, b) = Sim::pair(3, QpType::Rc, &ConnOpts::default());
    let remote = sim.mem(1).alloc_mr(1, 64, all_access());
    sim.set_filter(drop_first(1, |p| p.opcode == Opcode::RcReadResponseOnly));
    sim.post_send(a, atomic_write(1, remote.remote(0), 111));
    // The response is lost; the target then stores a new value before the retry arrives.
    sim.run_until(Duration::from_millis(1), |s| s.stats.filtered == 1);
    assert_eq!(sim.mem(1).peek_u64(remote.addr), 111);
    sim.mem(1).poke_u64(remote.addr, 222);
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1]);
    assert_eq!(
        sim.mem(1).peek_u64(remote.addr),
        222,
        "the duplicate was not executed again"
    );
    assert_eq!(sim.mem(1).atomics.get(), 1);
    assert!(sim.qp(b).engine.counters().duplicates >= 1);
}

#[test]
fn a_lost_flush_response_is_replayed_not_reexecuted() {
    let (mut sim, a, b) = Sim::pair(4, QpType::Rc, &flush_opts());
    let remote = sim.mem(1).alloc_mr(1, 64, flush_access());
    sim.set_filter(drop_first(2, |p| p.opcode == Opcode::RcReadResponseOnly));
    sim.post_send(
        a,
        flush(1, remote.remote(0), 64, FLUSH_GLOBAL, FlushSelect::Range),
    );
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1]);
    assert_eq!(sim.mem(1).flushes.get(), 1);
    assert!(sim.qp(b).engine.counters().duplicates >= 2);
}

#[test]
fn duplicated_requests_execute_once() {
    let (mut sim, a, _b) = Sim::pair(5, QpType::Rc, &flush_opts());
    sim.net.dup_pct = 100.0;
    let remote = sim.mem(1).alloc_mr(1, 8 * 16, flush_access());
    for i in 0..16 {
        sim.post_send(a, atomic_write(2 * i, remote.remote(i * 8), 1000 + i));
        sim.post_send(
            a,
            flush(
                2 * i + 1,
                remote.remote(i * 8),
                8,
                FLUSH_GLOBAL,
                FlushSelect::Range,
            ),
        );
    }
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &(0..32).collect::<Vec<_>>());
    for i in 0..16 {
        assert_eq!(sim.mem(1).peek_u64(remote.addr + i * 8), 1000 + i);
    }
    assert_eq!(sim.mem(1).atomics.get(), 16);
    assert_eq!(sim.mem(1).flushes.get(), 16);
}

#[test]
fn max_rd_atomic_bounds_outstanding_atomic_writes_and_flushes() {
    let o = ConnOpts {
        max_rd_atomic: 2,
        ..flush_opts()
    };
    let (mut sim, a, _b) = Sim::pair(6, QpType::Rc, &o);
    sim.record();
    let remote = sim.mem(1).alloc_mr(1, 4096, flush_access());
    let hold = Rc::new(Cell::new(true));
    let h = hold.clone();
    sim.set_filter(move |p| {
        if h.get() && p.opcode.is_response() {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    for i in 0..6 {
        if i % 2 == 0 {
            sim.post_send(a, atomic_write(i, remote.remote(i * 8), i));
        } else {
            sim.post_send(
                a,
                flush(i, remote.remote(0), 64, FLUSH_GLOBAL, FlushSelect::Range),
            );
        }
    }
    sim.run_for(Duration::from_micros(500));
    let distinct = |sim: &Sim| {
        let mut psns: Vec<u32> = sim
            .log
            .as_ref()
            .unwrap()
            .iter()
            .filter(|p| p.from == a && (p.opcode == Opcode::RcAtomicWrite || p.opcode == Opcode::RcFlush))
            .map(|p| p.psn.value())
            .collect();
        psns.sort_unstable();
        psns.dedup();
        psns.len()
    };
    assert_eq!(distinct(&sim), 2, "only max_rd_atomic requests started");
    hold.set(false);
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[0, 1, 2, 3, 4, 5]);
    assert_eq!(distinct(&sim), 6);
}

#[test]
fn mixed_placement_traffic_under_loss() {
    for seed in seeds(&[11, 12, 13]) {
        let (mut sim, a, _b) = Sim::pair(
            seed,
            QpType::Rc,
            &ConnOpts {
                timeout: 8,
                ..flush_opts()
            },
        );
        sim.net = NetConfig::lossy(10.0);
        let local = sim.mem(0).alloc_mr(1, 4096, all_access());
        let remote = sim.mem(1).alloc_mr(1, 4096, flush_access());
        let data = sim.rng.bytes(2048);
        sim.mem(0).poke(local.addr, &data);
        let mut id = 0;
        for i in 0..32u64 {
            sim.post_send(a, write(id, remote.remote(i * 64), vec![local.sge(i * 64, 64)]));
            sim.post_send(a, atomic_write(id + 1, remote.remote(2048 + i * 8), i * 3));
            sim.post_send(
                a,
                flush(
                    id + 2,
                    remote.remote(i * 64),
                    64,
                    FLUSH_GLOBAL,
                    FlushSelect::Range,
                ),
            );
            id += 3;
        }
        sim.run();
        assert_ok_in_order(&sim.take_send_cq(a), &(0..id).collect::<Vec<_>>());
        assert_eq!(sim.mem(1).peek(remote.addr, 2048), data, "seed {seed}");
        for i in 0..32 {
            assert_eq!(
                sim.mem(1).peek_u64(remote.addr + 2048 + i * 8),
                i * 3,
                "seed {seed}"
            );
        }
        assert_eq!(sim.mem(1).atomics.get(), 32, "seed {seed}: each executed once");
        assert_eq!(sim.mem(1).flushes.get(), 32, "seed {seed}: each executed once");
    }
}

/// Runs one request that the responder refuses; returns the requester's completion status and
/// the responder's async events.
fn refused(
    seed: u64,
    o: ConnOpts,
    mr_access: AccessFlags,
    make: impl FnOnce(&sim::Mr) -> softverbs_engine::wr::SendWr,
) -> (WcStatus, Vec<EventType>, u64) {
    let (mut sim, a, b) = Sim::pair(seed, QpType::Rc, &o);
    let remote = sim.mem(1).alloc_mr(1, 64, mr_access);
    sim.mem(1).poke_u64(remote.addr, 77);
    let w = make(&remote);
    sim.post_send_unchecked(a, w);
    sim.run();
    let wcs = sim.take_send_cq(a);
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    let word = sim.mem(1).peek_u64(remote.addr);
    (wcs[0].status, sim.take_events(b), word)
}

#[test]
fn the_responder_checks_rights_alignment_and_range() {
    let no_write = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
    // ATOMIC WRITE to a region without remote write: access error, word unchanged.
    let (st, ev, word) = refused(20, ConnOpts::default(), no_write, |r| {
        atomic_write(1, r.remote(0), 5)
    });
    assert_eq!((st, word), (WcStatus::RemAccessErr, 77));
    assert_eq!(ev, vec![EventType::QpAccessErr]);
    // A QP without remote write: invalid request.
    let o = ConnOpts {
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        ..ConnOpts::default()
    };
    let (st, _, word) = refused(21, o, all_access(), |r| atomic_write(1, r.remote(0), 5));
    assert_eq!((st, word), (WcStatus::RemInvReqErr, 77));
    // Not 8-byte aligned (post_send refuses it; a peer may still send it).
    let (st, _, word) = refused(22, ConnOpts::default(), all_access(), |r| {
        atomic_write(1, r.remote(4), 5)
    });
    assert_eq!((st, word), (WcStatus::RemInvReqErr, 77));
    // Past the end of the region.
    let (st, _, _) = refused(23, ConnOpts::default(), all_access(), |r| {
        atomic_write(1, r.remote(64), 5)
    });
    assert_eq!(st, WcStatus::RemAccessErr);
    // No responder resources.
    let o = ConnOpts {
        max_dest_rd_atomic: 0,
        ..flush_opts()
    };
    let (st, _, _) = refused(24, o, flush_access(), |r| atomic_write(1, r.remote(0), 5));
    assert_eq!(st, WcStatus::RemInvReqErr);
    let (st, _, _) = refused(25, o, flush_access(), |r| {
        flush(1, r.remote(0), 8, FLUSH_GLOBAL, FlushSelect::Range)
    });
    assert_eq!(st, WcStatus::RemInvReqErr);

    // FLUSH: the region needs the right of each placement type asked for.
    let global_only = all_access() | AccessFlags::FLUSH_GLOBAL;
    let (st, ev, _) = refused(26, flush_opts(), global_only, |r| {
        flush(1, r.remote(0), 8, FLUSH_PERSISTENT, FlushSelect::Range)
    });
    assert_eq!(st, WcStatus::RemAccessErr);
    assert_eq!(ev, vec![EventType::QpAccessErr]);
    let (st, _, _) = refused(27, flush_opts(), global_only, |r| {
        flush(
            1,
            r.remote(0),
            8,
            FLUSH_GLOBAL | FLUSH_PERSISTENT,
            FlushSelect::Mr,
        )
    });
    assert_eq!(st, WcStatus::RemAccessErr);
    // A range reaching past the region.
    let (st, _, _) = refused(28, flush_opts(), flush_access(), |r| {
        flush(1, r.remote(32), 64, FLUSH_GLOBAL, FlushSelect::Range)
    });
    assert_eq!(st, WcStatus::RemAccessErr);
    // The QP must allow the placement type.
    let o = ConnOpts {
        access: all_access() | AccessFlags::FLUSH_GLOBAL,
        ..ConnOpts::default()
    };
    let (st, _, _) = refused(29, o, flush_access(), |r| {
        flush(1, r.remote(0), 8, FLUSH_PERSISTENT, FlushSelect::Range)
    });
    assert_eq!(st, WcStatus::RemInvReqErr);
    // An unknown placement type.
    let (st, _, _) = refused(30, flush_opts(), flush_access(), |r| {
        flush(1, r.remote(0), 8, 4, FlushSelect::Range)
    });
    assert_eq!(st, WcStatus::RemInvReqErr);
}

#[test]
fn post_send_checks_placement_requests() {
    let rc = SendLimits {
        qp_type: QpType::Rc,
        max_send_sge: 4,
        max_inline_data: 64,
        max_msg_sz: 1 << 31,
        ud_mtu: 1024,
        max_rd_atomic: 4,
        max_tso_header: 0,
    };
    let remote = RemoteAddr {
        addr: 0x1000,
        rkey: 9,
    };
    let at = |addr| RemoteAddr { addr, rkey: 9 };
    assert!(atomic_write(1, remote, 1).check(&rc).is_ok());
    assert!(
        flush(1, remote, 8, FLUSH_GLOBAL | FLUSH_PERSISTENT, FlushSelect::Mr)
            .check(&rc)
            .is_ok()
    );
    assert!(atomic_write(1, at(0x1004), 1).check(&rc).is_err(), "misaligned");
    let mut with_buffer = atomic_write(2, remote, 1);
    with_buffer.payload = Payload::Sges(vec![Sge {
        addr: 0,
        length: 8,
        lkey: 1,
    }]);
    assert!(with_buffer.check(&rc).is_err(), "a local buffer");
    assert!(
        flush(3, remote, 8, 0, FlushSelect::Range).check(&rc).is_err(),
        "no type"
    );
    assert!(
        flush(4, remote, 8, 8, FlushSelect::Range).check(&rc).is_err(),
        "unknown type"
    );
    let uc = SendLimits {
        qp_type: QpType::Uc,
        ..rc
    };
    assert!(atomic_write(5, remote, 1).check(&uc).is_err(), "UC");
    assert!(
        flush(5, remote, 8, FLUSH_GLOBAL, FlushSelect::Range)
            .check(&uc)
            .is_err(),
        "UC"
    );
    let no_rd = SendLimits {
        max_rd_atomic: 0,
        ..rc
    };
    assert!(
        atomic_write(6, remote, 1).check(&no_rd).is_err(),
        "max_rd_atomic 0"
    );
    assert!(flush(6, remote, 8, FLUSH_GLOBAL, FlushSelect::Range)
        .check(&no_rd)
        .is_err());
}
