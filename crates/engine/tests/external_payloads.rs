//! Payloads left in the sender's memory (the shared-memory carrier's single copy): large SEND,
//! WRITE and READ transfers stay byte-exact under loss, duplication, reordering and corruption
//! when the packets carry where their payload is instead of the bytes, and the engine decides
//! exactly as with bytes in the packet (same completions, same lengths).

mod sim;

use sim::*;
use softverbs_engine::types::{Mtu, WcStatus};

const MIB: u64 = 1 << 20;

/// [`lossy_pair`] with payloads left in memory on both sides.
fn pair(seed: u64, loss: f64, mtu: Mtu) -> (Sim, QpId, QpId) {
    let (mut sim, a, b) = lossy_pair(seed, loss, mtu);
    for (node, qp) in [(0, a), (1, b)] {
        sim.mem(node).external.set(true);
        sim.qp_mut(qp).engine.set_external_payloads(true);
    }
    (sim, a, b)
}

/// One transfer of `len` bytes of kind `op`; checks bytes and completions, and that the
/// payloads did stay in memory.
fn transfer(seed: u64, loss: f64, mtu: Mtu, op: &str, len: u64) {
    let (mut sim, a, b) = pair(seed, loss, mtu);
    let amr = sim.mem(0).alloc_mr(1, len, all_access());
    let bmr = sim.mem(1).alloc_mr(1, len, all_access());
    let data = sim.rng.bytes(len as usize);
    let ctx = format!("seed {seed} loss {loss} {op} {len}");
    let (check_node, check_addr) = match op {
        "write" => {
            sim.mem(0).poke(amr.addr, &data);
            sim.post_send(a, write(1, bmr.remote(0), vec![amr.sge(0, len as u32)]));
            (1, bmr.addr)
        }
        "read" => {
            sim.mem(1).poke(bmr.addr, &data);
            sim.post_send(a, read(1, bmr.remote(0), vec![amr.sge(0, len as u32)]));
            (0, amr.addr)
        }
        "send" => {
            // Gathered from three pieces and scattered over four receive buffers of odd sizes.
            sim.mem(0).poke(amr.addr, &data);
            let third = len / 3;
            let gather = vec![
                amr.sge(0, third as u32),
                amr.sge(third, third as u32),
                amr.sge(2 * third, (len - 2 * third) as u32),
            ];
            let q = len / 4 - 3;
            let scatter = vec![
                bmr.sge(0, q as u32),
                bmr.sge(q, q as u32),
                bmr.sge(2 * q, q as u32),
                bmr.sge(3 * q, (len - 3 * q) as u32),
            ];
            sim.post_recv(b, recv(9, scatter));
            sim.post_send(a, send(1, gather));
            (1, bmr.addr)
        }
        _ => unreachable!(),
    };
    sim.run();
    let s = sim.take_send_cq(a);
    assert_eq!(s.len(), 1, "{ctx}: {s:?}");
    assert_wc(&s[0], 1, WcStatus::Success);
    assert_eq!(u64::from(s[0].byte_len), len, "{ctx}");
    if op == "send" {
        let r = sim.take_recv_cq(b);
        assert_ok_in_order(&r, &[9]);
        assert_eq!(u64::from(r[0].byte_len), len, "{ctx}");
    }
    assert!(
        sim.mem(check_node).peek(check_addr, len as usize) == data,
        "{ctx}: bytes differ"
    );
    // Every full packet (a short last one carries its bytes).
    let packets = len / u64::from(mtu.bytes());
    assert!(
        sim.stats.external >= packets,
        "{ctx}: only {} of at least {packets} packets left their payload in memory",
        sim.stats.external
    );
    if loss == 0.0 {
        assert_eq!(sim.qp(a).engine.counters().retransmits, 0, "{ctx}");
    }
    assert_eq!(sim.stats.bad_icrc, sim.stats.corrupted, "{ctx}");
}

#[test]
fn large_transfers_stay_byte_exact_with_payloads_in_memory() {
    for seed in seeds(&[1, 0xC0FFEE, 42]) {
        for loss in [0.0, 1.0, 10.0] {
            for op in ["write", "read", "send"] {
                transfer(seed, loss, Mtu::Mtu4096, op, MIB);
            }
        }
    }
    // A length that is no multiple of the MTU, and a small MTU.
    for op in ["write", "read", "send"] {
        transfer(5, 5.0, Mtu::Mtu1024, op, 100_003);
    }
}

#[test]
fn small_messages_and_small_packets_carry_their_bytes() {
    let (mut sim, a, _b) = pair(3, 0.0, Mtu::Mtu4096);
    let len = 8192 + 512;
    let amr = sim.mem(0).alloc_mr(1, len, all_access());
    let bmr = sim.mem(1).alloc_mr(1, len, all_access());
    let data = sim.rng.bytes(len as usize);
    sim.mem(0).poke(amr.addr, &data);
    // Below the message threshold: bytes.
    sim.post_send(a, write(1, bmr.remote(0), vec![amr.sge(0, 4096)]));
    // Above it, but the last packet is too small to be worth a copy of its own.
    sim.post_send(a, write(2, bmr.remote(0), vec![amr.sge(0, len as u32)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
    assert_eq!(
        sim.stats.external, 2,
        "only the two full packets of the second WRITE"
    );
    assert_eq!(sim.mem(1).peek(bmr.addr, len as usize), data);
}

#[test]
fn too_many_gather_pieces_in_one_packet_fall_back_to_bytes() {
    let (mut sim, a, _b) = pair(4, 0.0, Mtu::Mtu4096);
    let amr = sim.mem(0).alloc_mr(1, 65536, all_access());
    let bmr = sim.mem(1).alloc_mr(1, 65536, all_access());
    let data = sim.rng.bytes(65536);
    sim.mem(0).poke(amr.addr, &data);
    // 16 pieces of 4 KiB that touch: one range per packet, all stay in memory.
    let sges: Vec<_> = (0..16).map(|i| amr.sge(i * 4096, 4096)).collect();
    sim.post_send(a, write(1, bmr.remote(0), sges));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1]);
    assert_eq!(sim.stats.external, 16);
    assert_eq!(sim.mem(1).peek(bmr.addr, 65536), data);
    // 16 pieces of 1,000 bytes 1,600 apart: the first 4 KiB packet spans five of them, more
    // than a packet may name, so it carries its bytes.
    let sges: Vec<_> = (0..16).map(|i| amr.sge(i * 1600, 1000)).collect();
    sim.post_send(a, write(2, bmr.remote(0), sges));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[2]);
    let expect: Vec<u8> = (0..16u64)
        .flat_map(|i| data[(i * 1600) as usize..(i * 1600 + 1000) as usize].to_vec())
        .collect();
    assert_eq!(sim.mem(1).peek(bmr.addr, expect.len()), expect);
    assert!(
        sim.stats.external < 16 + 3,
        "packets of five pieces carry bytes: {}",
        sim.stats.external
    );
}
