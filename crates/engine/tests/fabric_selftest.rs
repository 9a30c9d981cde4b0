//! The simulated fabric itself: the memory model refuses what an HCA refuses, and a run is a
//! pure function of its seed.

mod sim;

use sim::*;
use softverbs_engine::memory::{Access, AtomicOp, KeyRef, MemError, Memory};
use softverbs_engine::types::{AccessFlags, QpType};

#[test]
fn memory_checks_keys_pd_rights_bounds_and_alignment() {
    let m = SimMemory::new(0);
    let rw = m.alloc_mr(1, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    let ro = m.alloc_mr(1, 4096, AccessFlags::REMOTE_READ);
    assert_ne!(rw.lkey, rw.rkey);
    let k = |key, pd, access| KeyRef {
        key,
        pd,
        qpn: 0,
        access,
    };
    let mut buf = [0u8; 16];
    assert_eq!(
        m.write(k(rw.rkey, 1, Access::RemoteWrite), rw.addr, &[1; 16]),
        Ok(())
    );
    assert_eq!(
        m.read(k(rw.lkey, 1, Access::LocalRead), rw.addr, &mut buf),
        Ok(())
    );
    assert_eq!(buf, [1; 16]);
    // An lkey is not an rkey and vice versa.
    assert_eq!(
        m.write(k(rw.lkey, 1, Access::RemoteWrite), rw.addr, &[1]),
        Err(MemError::BadKey)
    );
    assert_eq!(
        m.write(k(rw.rkey, 1, Access::LocalWrite), rw.addr, &[1]),
        Err(MemError::BadKey)
    );
    assert_eq!(
        m.write(k(rw.rkey, 2, Access::RemoteWrite), rw.addr, &[1]),
        Err(MemError::WrongPd)
    );
    assert_eq!(
        m.read(k(rw.rkey, 1, Access::RemoteRead), rw.addr, &mut buf),
        Err(MemError::NoAccess)
    );
    assert_eq!(
        m.write(k(ro.lkey, 1, Access::LocalWrite), ro.addr, &[1]),
        Err(MemError::NoAccess)
    );
    assert_eq!(
        m.check(k(rw.rkey, 1, Access::RemoteWrite), rw.addr + 4090, 7),
        Err(MemError::OutOfRange)
    );
    assert_eq!(
        m.check(k(rw.rkey, 1, Access::RemoteWrite), rw.addr - 1, 1),
        Err(MemError::OutOfRange)
    );
    assert_eq!(
        m.check(k(rw.rkey, 1, Access::RemoteWrite), u64::MAX - 2, 8),
        Err(MemError::OutOfRange)
    );
    assert_eq!(
        m.check(k(rw.rkey, 1, Access::RemoteWrite), rw.addr + 4096, 0),
        Ok(())
    );
    let at = m.alloc_mr(1, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC);
    let op = AtomicOp::FetchAdd { add: 1 };
    assert_eq!(
        m.atomic(k(at.rkey, 1, Access::RemoteAtomic), at.addr + 4, op),
        Err(MemError::Misaligned)
    );
    assert_eq!(
        m.atomic(k(at.rkey, 1, Access::RemoteAtomic), at.addr + 8, op),
        Ok(0)
    );
    assert_eq!(
        m.atomic(k(at.rkey, 1, Access::RemoteAtomic), at.addr + 8, op),
        Ok(1)
    );
    assert_eq!(
        m.atomic(k(rw.rkey, 1, Access::RemoteAtomic), rw.addr, op),
        Err(MemError::NoAccess)
    );
    m.dereg(&rw);
    assert_eq!(
        m.read(k(rw.lkey, 1, Access::LocalRead), rw.addr, &mut buf),
        Err(MemError::BadKey)
    );
}

#[test]
#[should_panic(expected = "need LOCAL_WRITE")]
fn remote_write_without_local_write_cannot_be_registered() {
    SimMemory::new(0).alloc_mr(1, 64, AccessFlags::REMOTE_WRITE);
}

fn lossy_run(seed: u64) -> (Vec<(u32, u32, u64)>, NetStats, u64) {
    let (mut sim, a, _b) = Sim::pair(
        seed,
        QpType::Rc,
        &ConnOpts {
            timeout: 8,
            ..ConnOpts::default()
        },
    );
    sim.net = NetConfig::lossy(10.0);
    sim.record();
    let l = sim.mem(0).alloc_mr(1, 1 << 18, all_access());
    let r = sim.mem(1).alloc_mr(1, 1 << 18, all_access());
    sim.post_send(a, write(1, r.remote(0), vec![l.sge(0, 1 << 17)]));
    sim.post_send(a, read(2, r.remote(0), vec![l.sge(1 << 17, 1 << 17)]));
    sim.run();
    assert_ok_in_order(&sim.take_send_cq(a), &[1, 2]);
    let log = sim
        .log
        .take()
        .unwrap()
        .iter()
        .map(|p| (p.psn.value(), u32::from(p.opcode.as_u8()), p.time.0))
        .collect();
    (log, sim.stats, sim.now.0)
}

#[test]
fn a_run_is_a_pure_function_of_its_seed() {
    let seed = seed_override().unwrap_or(77);
    let first = lossy_run(seed);
    assert_eq!(lossy_run(seed), first);
    assert_ne!(lossy_run(seed ^ 1).0, first.0);
}

#[test]
fn rng_draws_are_uniform_enough() {
    let mut rng = Rng::new(1);
    let hits = (0..100_000).filter(|_| rng.chance(10.0)).count();
    assert!((9_500..10_500).contains(&hits), "{hits}");
    let mut buckets = [0u32; 10];
    for _ in 0..100_000 {
        buckets[rng.below(10) as usize] += 1;
    }
    assert!(
        buckets.iter().all(|&b| (9_500..10_500).contains(&b)),
        "{buckets:?}"
    );
}
