//! Reliable delivery on a bad network: 1 MiB WRITE, READ and SEND transfers arrive byte-exact,
//! with in-order completions, under 0 %, 1 % and 10 % loss plus duplication, reordering and
//! corruption, for several seeds; and a property test over random operation sequences.

mod sim;

use proptest::prelude::*;
use sim::*;
use softverbs_engine::types::{Mtu, QpType, WcStatus};

const MIB: u64 = 1 << 20;
const LOSSES: [f64; 3] = [0.0, 1.0, 10.0];
const SEEDS: [u64; 4] = [1, 0xC0FFEE, 0x5EED_0003, 42];

/// Runs one 1 MiB transfer of kind `op` and checks the bytes and completions.
fn one_mib(seed: u64, loss: f64, mtu: Mtu, op: &str) {
    let (mut sim, a, b) = lossy_pair(seed, loss, mtu);
    let amr = sim.mem(0).alloc_mr(1, MIB, all_access());
    let bmr = sim.mem(1).alloc_mr(1, MIB, all_access());
    let data = sim.rng.bytes(MIB as usize);
    let (check_node, check_addr) = match op {
        "write" => {
            sim.mem(0).poke(amr.addr, &data);
            sim.post_send(a, write(1, bmr.remote(0), vec![amr.sge(0, MIB as u32)]));
            (1, bmr.addr)
        }
        "read" => {
            sim.mem(1).poke(bmr.addr, &data);
            sim.post_send(a, read(1, bmr.remote(0), vec![amr.sge(0, MIB as u32)]));
            (0, amr.addr)
        }
        "send" => {
            sim.mem(0).poke(amr.addr, &data);
            // Four receives of 256 KiB scatter the message.
            let sges = (0..4).map(|i| bmr.sge(i * MIB / 4, (MIB / 4) as u32)).collect();
            sim.post_recv(b, recv(9, sges));
            sim.post_send(a, send(1, vec![amr.sge(0, MIB as u32)]));
            (1, bmr.addr)
        }
        _ => unreachable!(),
    };
    sim.run();
    let s = sim.take_send_cq(a);
    assert_eq!(s.len(), 1, "seed {seed} loss {loss} {op}: {s:?}");
    assert_wc(&s[0], 1, WcStatus::Success);
    assert_eq!(s[0].byte_len, MIB as u32);
    if op == "send" {
        let r = sim.take_recv_cq(b);
        assert_ok_in_order(&r, &[9]);
        assert_eq!(r[0].byte_len, MIB as u32);
    }
    assert!(
        sim.mem(check_node).peek(check_addr, MIB as usize) == data,
        "seed {seed} loss {loss} {op}: bytes differ"
    );
    if loss == 0.0 {
        assert_eq!(sim.qp(a).engine.counters().retransmits, 0);
        assert_eq!(sim.qp(a).engine.counters().timeouts, 0);
    }
    assert_eq!(
        sim.stats.bad_icrc, sim.stats.corrupted,
        "every corrupted packet is caught by the ICRC"
    );
}

#[test]
fn one_mib_write_is_byte_exact_under_loss() {
    for seed in seeds(&SEEDS) {
        for loss in LOSSES {
            one_mib(seed, loss, Mtu::Mtu4096, "write");
        }
    }
    one_mib(7, 10.0, Mtu::Mtu1024, "write");
}

#[test]
fn one_mib_read_is_byte_exact_under_loss() {
    for seed in seeds(&SEEDS) {
        for loss in LOSSES {
            one_mib(seed, loss, Mtu::Mtu4096, "read");
        }
    }
    one_mib(7, 10.0, Mtu::Mtu1024, "read");
}

#[test]
fn one_mib_send_is_byte_exact_under_loss() {
    for seed in seeds(&SEEDS) {
        for loss in LOSSES {
            one_mib(seed, loss, Mtu::Mtu4096, "send");
        }
    }
    one_mib(7, 10.0, Mtu::Mtu1024, "send");
}

#[test]
fn mixed_traffic_both_ways_under_ten_percent_loss() {
    for seed in seeds(&[3, 4]) {
        let (mut sim, a, b) = lossy_pair(seed, 10.0, Mtu::Mtu1024);
        let amr = sim.mem(0).alloc_mr(1, 4 * MIB, all_access());
        let bmr = sim.mem(1).alloc_mr(1, 4 * MIB, all_access());
        let da = sim.rng.bytes(MIB as usize);
        let db = sim.rng.bytes(MIB as usize);
        sim.mem(0).poke(amr.addr, &da);
        sim.mem(1).poke(bmr.addr, &db);
        let chunk = 64 * 1024u64;
        for i in 0..16u64 {
            let off = i * chunk;
            // a writes its chunk i into b's second MiB and reads b's chunk i into its second MiB.
            sim.post_send(
                a,
                write(i * 10, bmr.remote(MIB + off), vec![amr.sge(off, chunk as u32)]),
            );
            sim.post_send(
                a,
                read(
                    i * 10 + 1,
                    bmr.remote(off),
                    vec![amr.sge(MIB + off, chunk as u32)],
                ),
            );
            sim.post_send(
                a,
                fetch_add(i * 10 + 2, bmr.remote(3 * MIB), 1, amr.sge(3 * MIB + i * 8, 8)),
            );
            // b sends its chunk i to a.
            sim.post_recv(a, recv(i, vec![amr.sge(2 * MIB + off, chunk as u32)]));
            sim.post_send(b, send(100 + i, vec![bmr.sge(off, chunk as u32)]));
        }
        sim.run();
        let ids: Vec<u64> = (0..16).flat_map(|i| [i * 10, i * 10 + 1, i * 10 + 2]).collect();
        assert_ok_in_order(&sim.take_send_cq(a), &ids);
        assert_ok_in_order(&sim.take_send_cq(b), &(100..116).collect::<Vec<_>>());
        assert_ok_in_order(&sim.take_recv_cq(a), &(0..16).collect::<Vec<_>>());
        assert!(sim.mem(1).peek(bmr.addr + MIB, MIB as usize) == da);
        assert!(sim.mem(0).peek(amr.addr + MIB, MIB as usize) == db);
        assert!(sim.mem(0).peek(amr.addr + 2 * MIB, MIB as usize) == db);
        // Each fetch-add executed exactly once, in order.
        assert_eq!(sim.mem(1).peek_u64(bmr.addr + 3 * MIB), 16);
        for i in 0..16 {
            assert_eq!(sim.mem(0).peek_u64(amr.addr + 3 * MIB + i * 8), i);
        }
    }
}

#[test]
fn transfers_across_the_psn_wrap_under_loss() {
    for seed in seeds(&[21, 22, 23]) {
        let o = ConnOpts {
            mtu: Mtu::Mtu1024,
            timeout: 8,
            psn_a: 0xFF_FF80,
            psn_b: 0xFF_FFF0,
            ..ConnOpts::default()
        };
        let (mut sim, a, b) = Sim::pair(seed, QpType::Rc, &o);
        sim.net = NetConfig::lossy(10.0);
        let len = 256 * 1024u64;
        let amr = sim.mem(0).alloc_mr(1, 4 * len, all_access());
        let bmr = sim.mem(1).alloc_mr(1, 4 * len, all_access());
        let da = sim.rng.bytes(len as usize);
        let db = sim.rng.bytes(len as usize);
        sim.mem(0).poke(amr.addr, &da);
        sim.mem(1).poke(bmr.addr, &db);
        sim.post_send(a, write(1, bmr.remote(len), vec![amr.sge(0, len as u32)]));
        sim.post_send(a, read(2, bmr.remote(0), vec![amr.sge(len, len as u32)]));
        sim.post_recv(b, recv(3, vec![bmr.sge(2 * len, len as u32)]));
        sim.post_send(a, send(3, vec![amr.sge(0, len as u32)]));
        sim.post_recv(a, recv(4, vec![amr.sge(2 * len, len as u32)]));
        sim.post_send(b, send(4, vec![bmr.sge(0, len as u32)]));
        sim.run();
        assert_ok_in_order(&sim.take_send_cq(a), &[1, 2, 3]);
        assert_ok_in_order(&sim.take_send_cq(b), &[4]);
        assert!(sim.mem(1).peek(bmr.addr + len, len as usize) == da);
        assert!(sim.mem(0).peek(amr.addr + len, len as usize) == db);
        assert!(sim.mem(1).peek(bmr.addr + 2 * len, len as usize) == da);
        assert!(sim.mem(0).peek(amr.addr + 2 * len, len as usize) == db);
        assert!(sim.qp(a).engine.counters().retransmits > 0);
    }
}

#[test]
fn bad_icrc_packets_are_dropped_and_counted() {
    let (mut sim, a, b) = Sim::pair(
        11,
        QpType::Rc,
        &ConnOpts {
            timeout: 8,
            ..ConnOpts::default()
        },
    );
    sim.net.corrupt_pct = 20.0;
    let amr = sim.mem(0).alloc_mr(1, MIB, all_access());
    let bmr = sim.mem(1).alloc_mr(1, MIB, all_access());
    let data = sim.rng.bytes(MIB as usize);
    sim.mem(0).poke(amr.addr, &data);
    sim.post_send(a, write(1, bmr.remote(0), vec![amr.sge(0, MIB as u32)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1]);
    assert!(sim.mem(1).peek(bmr.addr, MIB as usize) == data);
    assert!(sim.stats.corrupted > 50);
    assert_eq!(sim.stats.bad_icrc, sim.stats.corrupted);
    let _ = b;
}

#[test]
fn regression_zero_length_write_behind_reads_under_loss() {
    // Found by the property test below: the last WQE never completed.
    let ops = [
        Op::Write {
            src: 0,
            dst: 0,
            len: 1281,
        },
        Op::Read { src: 0, len: 18177 },
        Op::Write {
            src: 0,
            dst: 0,
            len: 4609,
        },
        Op::Read { src: 0, len: 32513 },
        Op::Write {
            src: 0,
            dst: 0,
            len: 0,
        },
    ];
    check_workload(5253672705217672669, 0.5600925605285829, Mtu::Mtu256, &ops);
}

/// One operation of the random workload.
#[derive(Debug, Clone)]
enum Op {
    /// WRITE `len` bytes of the source pattern at `src` to the write area at `dst`.
    Write { src: u32, dst: u32, len: u32 },
    /// READ `len` bytes of the (constant) read area at `src`.
    Read { src: u32, len: u32 },
    /// SEND `len` bytes of the source pattern at `src`.
    Send { src: u32, len: u32, imm: Option<u32> },
    /// FETCH_ADD on word `word`.
    FetchAdd { word: u8, add: u64 },
    /// CMP_SWP on word `word`.
    CmpSwp { word: u8, compare: u64, swap: u64 },
}

const AREA: u32 = 256 * 1024;

fn op_strategy() -> impl Strategy<Value = Op> {
    let len = prop_oneof![0..64u32, 64..5000u32, 5000..40_000u32];
    prop_oneof![
        (0..AREA / 2, 0..AREA / 2, len.clone()).prop_map(|(src, dst, len)| Op::Write { src, dst, len }),
        (0..AREA / 2, len.clone()).prop_map(|(src, len)| Op::Read { src, len }),
        (0..AREA / 2, len, any::<Option<u32>>()).prop_map(|(src, len, imm)| Op::Send { src, len, imm }),
        (0..4u8, 0..1000u64).prop_map(|(word, add)| Op::FetchAdd { word, add }),
        (0..4u8, 0..3u64, any::<u64>()).prop_map(|(word, compare, swap)| Op::CmpSwp { word, compare, swap }),
    ]
}

/// Runs `ops` from QP a to QP b and checks everything against a sequential model.
fn check_workload(seed: u64, loss: f64, mtu: Mtu, ops: &[Op]) {
    let (mut sim, a, b) = lossy_pair(seed, loss, mtu);
    // a: source pattern | read results (one slot per op) | atomic results
    // b: write area | read area (constant) | receive slots | atomic words
    let n = ops.len() as u64;
    let amr = sim
        .mem(0)
        .alloc_mr(1, u64::from(AREA) + n * 40_000 + n * 8, all_access());
    let bmr = sim
        .mem(1)
        .alloc_mr(1, 2 * u64::from(AREA) + n * 40_000 + 32, all_access());
    let pattern = sim.rng.bytes(AREA as usize);
    let read_area = sim.rng.bytes(AREA as usize);
    sim.mem(0).poke(amr.addr, &pattern);
    sim.mem(1).poke(bmr.addr + u64::from(AREA), &read_area);
    let (res, recvs, words) = (
        u64::from(AREA),
        2 * u64::from(AREA),
        2 * u64::from(AREA) + n * 40_000,
    );
    let mut write_area = vec![0u8; AREA as usize];
    let mut atomic = [0u64; 4];
    let mut expect_recv = Vec::new();
    let mut expect_atomic = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let i = i as u64;
        match *op {
            Op::Write { src, dst, len } => {
                write_area[dst as usize..(dst + len) as usize]
                    .copy_from_slice(&pattern[src as usize..(src + len) as usize]);
                sim.post_send(
                    a,
                    write(i, bmr.remote(u64::from(dst)), vec![amr.sge(u64::from(src), len)]),
                );
            }
            Op::Read { src, len } => {
                sim.post_send(
                    a,
                    read(
                        i,
                        bmr.remote(u64::from(AREA + src)),
                        vec![amr.sge(res + i * 40_000, len)],
                    ),
                );
            }
            Op::Send { src, len, imm } => {
                sim.post_recv(b, recv(i, vec![bmr.sge(recvs + i * 40_000, 40_000)]));
                expect_recv.push((i, len, imm));
                let mut w = send(i, vec![amr.sge(u64::from(src), len)]);
                w.op = softverbs_engine::wr::SendOp::Send {
                    imm,
                    invalidate: None,
                };
                sim.post_send(a, w);
            }
            Op::FetchAdd { word, add } => {
                let w = &mut atomic[word as usize];
                expect_atomic.push((i, *w));
                *w = w.wrapping_add(add);
                let result = amr.sge(u64::from(AREA) + n * 40_000 + i * 8, 8);
                sim.post_send(
                    a,
                    fetch_add(i, bmr.remote(words + u64::from(word) * 8), add, result),
                );
            }
            Op::CmpSwp { word, compare, swap } => {
                let w = &mut atomic[word as usize];
                expect_atomic.push((i, *w));
                if *w == compare {
                    *w = swap;
                }
                let result = amr.sge(u64::from(AREA) + n * 40_000 + i * 8, 8);
                sim.post_send(
                    a,
                    cmp_swp(i, bmr.remote(words + u64::from(word) * 8), compare, swap, result),
                );
            }
        }
    }
    sim.run();
    let ids: Vec<u64> = (0..n).collect();
    assert_ok_in_order(&sim.take_send_cq(a), &ids);
    let r = sim.take_recv_cq(b);
    assert_eq!(
        r.iter()
            .map(|w| (w.wr_id, w.status, w.byte_len, w.imm_data))
            .collect::<Vec<_>>(),
        expect_recv
            .iter()
            .map(|&(i, len, imm)| (i, WcStatus::Success, len, imm.unwrap_or(0)))
            .collect::<Vec<_>>()
    );
    assert!(
        sim.mem(1).peek(bmr.addr, AREA as usize) == write_area,
        "write area"
    );
    for (i, op) in ops.iter().enumerate() {
        let i = i as u64;
        match *op {
            Op::Read { src, len } => {
                let got = sim.mem(0).peek(amr.addr + res + i * 40_000, len as usize);
                assert!(got == read_area[src as usize..(src + len) as usize], "read {i}");
            }
            Op::Send { src, len, .. } => {
                let got = sim.mem(1).peek(bmr.addr + recvs + i * 40_000, len as usize);
                assert!(got == pattern[src as usize..(src + len) as usize], "send {i}");
            }
            _ => {}
        }
    }
    for (i, before) in expect_atomic {
        assert_eq!(
            sim.mem(0)
                .peek_u64(amr.addr + u64::from(AREA) + n * 40_000 + i * 8),
            before,
            "atomic {i}"
        );
    }
    for (w, v) in atomic.iter().enumerate() {
        assert_eq!(sim.mem(1).peek_u64(bmr.addr + words + w as u64 * 8), *v);
    }
}

proptest! {
    // 24 cases by default; PROPTEST_CASES raises it for a longer run.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(24),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_operations_under_random_loss_match_a_sequential_model(
        seed in any::<u64>(),
        loss in prop_oneof![Just(0.0), 0.0..12.0f64],
        mtu in prop_oneof![Just(Mtu::Mtu256), Just(Mtu::Mtu1024), Just(Mtu::Mtu4096)],
        ops in proptest::collection::vec(op_strategy(), 1..24),
    ) {
        check_workload(seed, loss, mtu, &ops);
    }
}

/// Many seeds of everything above. The suite runs a few (4 scenarios each, so it stays quick in
/// a debug build); `SOFTVERBS_SIM_STRESS=<n>` runs n, e.g. 8000 with
/// `cargo test --release -p softverbs-engine --test lossy_transfers stress`. Failures are
/// collected and listed with their seeds at the end.
#[test]
fn stress_many_seeds() {
    let n: u64 = std::env::var("SOFTVERBS_SIM_STRESS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    // SOFTVERBS_SIM_STRESS_FROM=<i> skips to iteration i (to replay a failure quickly).
    let from: u64 = std::env::var("SOFTVERBS_SIM_STRESS_FROM")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut rng = sim::Rng::new(0xDEAD_BEEF);
    let mut failures = Vec::new();
    for i in 0..n {
        let seed = rng.next_u64();
        let loss = [1.0, 5.0, 10.0][i as usize % 3];
        let mtu = [Mtu::Mtu256, Mtu::Mtu1024, Mtu::Mtu4096][i as usize % 4 % 3];
        let ops: Vec<Op> = (0..30)
            .map(|_| match rng.below(5) {
                0 => Op::Write {
                    src: rng.below(1000) as u32,
                    dst: rng.below(100_000) as u32,
                    len: rng.below(30_000) as u32,
                },
                1 => Op::Read {
                    src: rng.below(100_000) as u32,
                    len: rng.below(30_000) as u32,
                },
                2 => Op::Send {
                    src: rng.below(1000) as u32,
                    len: rng.below(30_000) as u32,
                    imm: Some(rng.next_u64() as u32),
                },
                3 => Op::FetchAdd {
                    word: rng.below(4) as u8,
                    add: rng.below(100),
                },
                _ => Op::CmpSwp {
                    word: rng.below(4) as u8,
                    compare: rng.below(3),
                    swap: rng.below(3),
                },
            })
            .collect();
        if i < from {
            continue;
        }
        for op in ["write", "read", "send", "workload"] {
            let what = format!("stress {i}: seed {seed} loss {loss} {mtu:?} {op}");
            eprintln!("{what}");
            let ops = ops.clone();
            let result = std::panic::catch_unwind(move || {
                if op == "workload" {
                    check_workload(seed, loss, mtu, &ops);
                } else {
                    one_mib(seed, loss, mtu, op);
                }
            });
            if result.is_err() {
                eprintln!("FAILED {what}");
                failures.push(what);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
