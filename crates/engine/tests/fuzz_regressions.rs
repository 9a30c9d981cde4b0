//! Engine bugs the `engine_qp` fuzz target found, each reproduced with packets built by hand
//! (the inputs themselves are replayed from `fuzz/regressions/engine_qp` by
//! `engine_fuzz_corpus.rs`).

mod sim;

use std::time::Duration;

use sim::*;
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{DropReason, RxMeta};
use softverbs_engine::types::{Mtu, QpType, Sge, WcStatus};
use softverbs_engine::wr::RemoteAddr;
use softverbs_wire::{AethRepr, AethSyndrome, BthRepr, Opcode, PacketRepr, Psn, RethRepr, RocePacket};

/// A connected RC pair; returns the simulator and the responder under test.
fn rc_pair() -> (Sim, QpId, QpId) {
    Sim::pair(1, QpType::Rc, &ConnOpts::default())
}

/// Feeds `repr` (with a zeroed payload) to QP `to` as if it came from its peer; returns the
/// engine's verdict and the opcodes and PSNs it sent in answer.
fn feed(sim: &mut Sim, to: QpId, repr: PacketRepr) -> (Result<(), DropReason>, Vec<(Opcode, Psn)>) {
    let mut data = vec![0u8; repr.buffer_len()];
    repr.emit(&mut data).expect("a consistent packet");
    let pkt = RocePacket::parse(&data).expect("parses");
    let meta = RxMeta {
        sgid: sim.nodes[1 - to.node].gid,
        dgid: sim.nodes[to.node].gid,
        traffic_class: 0,
        hop_limit: 64,
    };
    let now = Instant(sim.now.0);
    let node = &mut sim.nodes[to.node];
    let qp = node.qps.get_mut(&to.qpn).expect("QP exists");
    let verdict = qp.engine.handle_packet(now, &pkt, &meta, &node.mem, None);
    let mut out = Vec::new();
    while let Some(tx) = qp.engine.poll_transmit(now, &node.mem) {
        let p = RocePacket::parse(&tx.data).expect("the engine emits packets that parse");
        out.push((p.opcode(), p.repr.bth.psn));
    }
    (verdict, out)
}

fn read_request(dest_qpn: u32, psn: u32, va: u64, rkey: u32, dma_len: u32) -> PacketRepr {
    let mut repr = PacketRepr::new(BthRepr::new(Opcode::RcReadRequest, dest_qpn, Psn::new(psn)), 0);
    repr.bth.ack_req = true;
    repr.reth = Some(RethRepr { va, rkey, dma_len });
    repr
}

/// A zero-length READ checks neither key nor address (C9-88), so its resource may name any
/// address; a duplicate of it asking for bytes past the end of the address space overflowed the
/// "part of the original" check (a panic in debug builds). It is now dropped like any duplicate
/// that asks for more than the original.
#[test]
fn duplicate_of_a_zero_length_read_at_the_top_of_memory_is_dropped() {
    let o = ConnOpts::default();
    let (mut sim, _a, b) = rc_pair();
    let top = u64::MAX - 3;
    let (verdict, out) = feed(&mut sim, b, read_request(b.qpn, o.psn_a, top, 0xBAD, 0));
    assert_eq!(verdict, Ok(()));
    assert_eq!(out, vec![(Opcode::RcReadResponseOnly, Psn::new(o.psn_a))]);
    let (verdict, out) = feed(&mut sim, b, read_request(b.qpn, o.psn_a, top, 0xBAD, 100));
    assert_eq!(verdict, Err(DropReason::BadPsn));
    assert!(out.is_empty(), "{out:?}");
    // A duplicate inside the original is still answered.
    let (verdict, out) = feed(&mut sim, b, read_request(b.qpn, o.psn_a, top, 0xBAD, 0));
    assert_eq!(verdict, Ok(()));
    assert_eq!(out, vec![(Opcode::RcReadResponseOnly, Psn::new(o.psn_a))]);
}

/// A READ into a scatter entry whose address lies near the end of the address space, its
/// first response lost: the second is placed first, 256 bytes into the entry, and the
/// address of that byte overflowed (a panic in debug builds; in release the write wrapped to
/// the bottom of the address space). The entry is out of range, so the READ fails with a
/// local protection error.
#[test]
fn read_response_into_an_entry_past_the_end_of_memory_is_a_protection_error() {
    let o = ConnOpts {
        mtu: Mtu::Mtu256,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(2, QpType::Rc, &o);
    let src = sim.mem(1).alloc_mr(1, 512, all_access());
    let dst = sim.mem(0).alloc_mr(1, 512, all_access());
    let mut first = true;
    sim.set_filter(move |p| {
        if p.opcode == Opcode::RcReadResponseFirst && std::mem::take(&mut first) {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    let top = Sge {
        addr: u64::MAX - 100,
        length: 512,
        lkey: dst.lkey,
    };
    sim.post_send(a, read(1, src.remote(0), vec![top]));
    sim.run_until(Duration::from_millis(100), |s| s.send_cq_len(a) > 0);
    let wcs = sim.take_send_cq(a);
    assert_wc(&wcs[0], 1, WcStatus::LocProtErr);
    let _ = b;
}

/// A READ of remote bytes near the end of the address space whose first response arrived
/// (from a peer that should have refused it) and whose second did not: resuming it at the
/// second packet computed the remote address of its byte 256 with an overflow (a panic in
/// debug builds). The resumed request now carries the wrapped address, which the responder
/// refuses like any range that is not in a region.
#[test]
fn resuming_a_read_of_the_top_of_memory_does_not_overflow() {
    let o = ConnOpts {
        mtu: Mtu::Mtu256,
        timeout: 8,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(3, QpType::Rc, &o);
    sim.record();
    // The requests never reach b: its answer is forged below.
    sim.set_filter(|p| {
        if p.from.node == 0 {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    let dst = sim.mem(0).alloc_mr(1, 512, all_access());
    let remote = RemoteAddr {
        addr: u64::MAX - 10,
        rkey: 0x1234,
    };
    sim.post_send(a, read(1, remote, vec![dst.sge(0, 512)]));
    let mut repr = PacketRepr::new(
        BthRepr::new(Opcode::RcReadResponseFirst, a.qpn, Psn::new(o.psn_a)),
        256,
    );
    repr.aeth = Some(AethRepr {
        syndrome: AethSyndrome::ACK_UNLIMITED,
        msn: 1,
    });
    let (verdict, _) = feed(&mut sim, a, repr);
    assert_eq!(verdict, Ok(()));
    // The retransmission timer resends the READ from its second packet.
    sim.advance(Duration::from_millis(5));
    let resent: Vec<Psn> = sim
        .log
        .as_ref()
        .expect("recording")
        .iter()
        .filter(|p| p.opcode == Opcode::RcReadRequest)
        .map(|p| p.psn)
        .collect();
    assert_eq!(resent.first(), Some(&Psn::new(o.psn_a)), "{resent:?}");
    assert!(resent.contains(&Psn::new(o.psn_a + 1)), "{resent:?}");
    let _ = b;
}

/// A message's PSNs are all reserved when it starts, but only a window of them is sent at
/// once. An ACK for one of the others (a stale one from before the QP was reset, or a forged
/// one) was taken as acknowledging packets never sent: the window base jumped past them and
/// the requester went on sending from there, skipping PSNs (the fuzz target saw PSN 144 sent
/// when 128 was next). Responses are now accepted only for PSNs a request was sent for.
#[test]
fn ack_for_a_psn_not_sent_yet_is_dropped() {
    let o = ConnOpts {
        mtu: Mtu::Mtu256,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(4, QpType::Rc, &o);
    const PACKETS: u32 = 200;
    let len = PACKETS * 256;
    let src = sim.mem(0).alloc_mr(1, u64::from(len), all_access());
    let dst = sim.mem(1).alloc_mr(1, u64::from(len), all_access());
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    sim.mem(0).poke(src.addr, &data);
    sim.record();
    // Nothing reaches b until the forged ACKs were seen.
    sim.set_filter(|p| {
        if p.from.node == 0 {
            Verdict::Drop
        } else {
            Verdict::Pass
        }
    });
    sim.post_send(a, write(1, dst.remote(0), vec![src.sge(0, len)]));
    let sent = sim
        .log
        .as_ref()
        .expect("recording")
        .iter()
        .filter(|p| p.from.node == 0)
        .count() as u32;
    assert!(
        sent > 0 && sent < PACKETS,
        "{sent} of {PACKETS} packets sent at once"
    );
    for unsent in [sent, PACKETS - 1] {
        let mut ack = PacketRepr::new(
            BthRepr::new(Opcode::RcAcknowledge, a.qpn, Psn::new(o.psn_a + unsent)),
            0,
        );
        ack.aeth = Some(AethRepr {
            syndrome: AethSyndrome::ACK_UNLIMITED,
            msn: 1,
        });
        let (verdict, out) = feed(&mut sim, a, ack);
        assert_eq!(
            verdict,
            Err(DropReason::UnexpectedResponse),
            "ACK of PSN +{unsent}"
        );
        assert!(out.is_empty(), "{out:?}");
    }
    assert!(sim.take_send_cq(a).is_empty());
    // The real transfer then completes with every byte, every PSN sent in order.
    sim.clear_filter();
    sim.run_until(Duration::from_secs(5), |s| s.send_cq_len(a) > 0);
    let wcs = sim.take_send_cq(a);
    assert_wc(&wcs[0], 1, WcStatus::Success);
    assert_eq!(sim.mem(1).peek(dst.addr, len as usize), data);
    let mut high = o.psn_a;
    for p in sim
        .log
        .as_ref()
        .expect("recording")
        .iter()
        .filter(|p| p.from.node == 0)
    {
        let off = Psn::new(high).distance(p.psn);
        assert!(
            off == 0 || p.psn.is_before(Psn::new(high)),
            "PSN {:?} sent after {high}",
            p.psn
        );
        if off == 0 {
            high += 1;
        }
    }
    assert_eq!(high, o.psn_a + PACKETS);
    let _ = b;
}
