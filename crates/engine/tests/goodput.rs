//! Goodput under loss: a 16 MiB RC WRITE or SEND on a 10 Gbit/s simulated link with 10 us of
//! one-way latency, at 0 %, 1 % and 10 % random loss, with the ACK timeout rdma_cm programs
//! get (14: 67 ms). Recovery must keep the link busy (at 1 % loss at least half the lossless
//! goodput, at 10 % at least a tenth), a lossless run must retransmit nothing, and the bytes
//! must arrive exact.

mod sim;

use std::time::Duration;

use sim::*;
use softverbs_engine::types::{Mtu, QpType, WcStatus};

const LEN: u64 = 16 << 20;
const SEEDS: [u64; 2] = [3, 0xBAD_5EED];

/// What one transfer did.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// Payload bytes per second of virtual time, from posting to the completion.
    goodput: f64,
    retransmits: u64,
    timeouts: u64,
}

fn transfer(seed: u64, loss: f64, mtu: Mtu, op: &str) -> Run {
    let o = ConnOpts {
        mtu,
        timeout: 14,
        ..ConnOpts::default()
    };
    let (mut sim, a, b) = Sim::pair(seed, QpType::Rc, &o);
    sim.net = NetConfig {
        latency_ns: 10_000,
        link_gbps: 10,
        loss_pct: loss,
        ..NetConfig::default()
    };
    sim.max_steps = 20_000_000;
    let amr = sim.mem(0).alloc_mr(1, LEN, all_access());
    let bmr = sim.mem(1).alloc_mr(1, LEN, all_access());
    let data = sim.rng.bytes(LEN as usize);
    sim.mem(0).poke(amr.addr, &data);
    match op {
        "write" => sim.post_send(a, write(1, bmr.remote(0), vec![amr.sge(0, LEN as u32)])),
        "send" => {
            sim.post_recv(b, recv(9, vec![bmr.sge(0, LEN as u32)]));
            sim.post_send(a, send(1, vec![amr.sge(0, LEN as u32)]));
        }
        _ => unreachable!(),
    }
    let start = sim.now;
    sim.run_until(Duration::from_secs(600), |s| s.send_cq_len(a) > 0);
    let elapsed = sim.now.0 - start.0;
    let s = sim.take_send_cq(a);
    assert_wc(&s[0], 1, WcStatus::Success);
    if op == "send" {
        sim.run_until(Duration::from_secs(1), |s| s.recv_cq_len(b) > 0);
        assert_ok_in_order(&sim.take_recv_cq(b), &[9]);
    }
    assert!(
        sim.mem(1).peek(bmr.addr, LEN as usize) == data,
        "seed {seed} loss {loss} {op}: bytes differ"
    );
    let c = sim.qp(a).engine.counters();
    Run {
        goodput: LEN as f64 / (elapsed as f64 / 1e9),
        retransmits: c.retransmits,
        timeouts: c.timeouts,
    }
}

fn check(op: &str, mtu: Mtu, seeds_: &[u64]) {
    for seed in seeds(seeds_) {
        let clean = transfer(seed, 0.0, mtu, op);
        assert_eq!(
            (clean.retransmits, clean.timeouts),
            (0, 0),
            "seed {seed} {op}: a lossless run resends nothing"
        );
        for (loss, floor) in [(1.0, 0.5), (10.0, 0.1)] {
            let r = transfer(seed, loss, mtu, op);
            let ratio = r.goodput / clean.goodput;
            println!(
                "{op} {mtu:?} seed {seed}: {loss} % loss: {:.2} Gbit/s of {:.2} ({ratio:.2}), \
                 {} retransmits, {} timeouts",
                r.goodput * 8e-9,
                clean.goodput * 8e-9,
                r.retransmits,
                r.timeouts
            );
            assert!(
                ratio >= floor,
                "seed {seed} {op} {mtu:?} at {loss} % loss: goodput {ratio:.3} of lossless, below {floor}"
            );
        }
    }
}

#[test]
fn write_keeps_goodput_under_loss() {
    check("write", Mtu::Mtu4096, &SEEDS);
}

#[test]
fn send_keeps_goodput_under_loss() {
    check("send", Mtu::Mtu4096, &SEEDS);
}

#[test]
fn write_at_mtu_1024_keeps_goodput_under_loss() {
    check("write", Mtu::Mtu1024, &SEEDS[..1]);
}
