//! Engine throughput on one core: two QP engines hand packets to each other in memory (no
//! loss, no ICRC), so the figures are the cost of the requester, responder and completer
//! themselves; plus the ICRC over 4 KiB packets, which a driver pays per packet on top.
//!
//! `cargo bench -p softverbs-engine --bench engine -- --warm-up-time 1 --measurement-time 3`

#![allow(missing_docs)]

// The test fabric's memory model (its region table is what the device's looks like).
#[path = "../tests/sim/mod.rs"]
mod sim;

use std::hint::black_box;
use std::net::SocketAddr;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use sim::{all_access, recv, send, write, Mr, SimMemory};
use softverbs_engine::time::Instant;
use softverbs_engine::transport::{QpConfig, QpEngine, RxMeta};
use softverbs_engine::types::{AccessFlags, AhAttr, Gid, GlobalRoute, Mtu, QpAttr, QpState, QpType};
use softverbs_wire::{icrc, BthRepr, Opcode, PacketRepr, Psn, RethRepr, RocePacket};

/// Two connected RC engines, each with its own memory.
struct Pair {
    a: QpEngine,
    b: QpEngine,
    ma: SimMemory,
    mb: SimMemory,
    now: Instant,
    meta: RxMeta,
}

fn rc_engine(qpn: u32, dest: u32, mtu: Mtu) -> QpEngine {
    let mut e = QpEngine::new(QpConfig {
        qp_type: QpType::Rc,
        qpn,
        pd: 1,
        sq_sig_all: false,
        has_srq: false,
    });
    let mut attr = QpAttr {
        qp_state: QpState::Init,
        qp_access_flags: all_access(),
        port_num: 1,
        ..QpAttr::default()
    };
    e.set_attr(Instant::ZERO, &attr);
    attr.qp_state = QpState::Rtr;
    attr.path_mtu = mtu;
    attr.dest_qp_num = dest;
    attr.rq_psn = 0x100;
    attr.max_dest_rd_atomic = 16;
    attr.min_rnr_timer = 12;
    attr.ah_attr = AhAttr {
        grh: GlobalRoute {
            dgid: Gid::from(std::net::Ipv4Addr::new(10, 0, 0, 2)),
            hop_limit: 64,
            ..GlobalRoute::default()
        },
        is_global: true,
        port_num: 1,
        ..AhAttr::default()
    };
    e.set_attr(Instant::ZERO, &attr);
    attr.qp_state = QpState::Rts;
    attr.sq_psn = 0x100;
    attr.timeout = 14;
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;
    attr.max_rd_atomic = 16;
    e.set_attr(Instant::ZERO, &attr);
    e
}

impl Pair {
    fn new(mtu: Mtu) -> Self {
        let gid = Gid::from(std::net::Ipv4Addr::new(10, 0, 0, 1));
        Self {
            a: rc_engine(0x11, 0x12, mtu),
            b: rc_engine(0x12, 0x11, mtu),
            ma: SimMemory::new(0),
            mb: SimMemory::new(1),
            now: Instant(1),
            meta: RxMeta {
                sgid: gid,
                dgid: gid,
                traffic_class: 0,
                hop_limit: 64,
            },
        }
    }

    /// Moves packets both ways until neither engine has anything to send; returns the number
    /// of packets a sent and the completions a produced.
    fn run(&mut self) -> (u64, usize) {
        let (mut packets, mut completions) = (0, 0);
        loop {
            let mut moved = false;
            while let Some(tx) = self.a.poll_transmit(self.now, &self.ma) {
                let pkt = RocePacket::parse(&tx.data).expect("valid");
                let _ = self.b.handle_packet(self.now, &pkt, &self.meta, &self.mb, None);
                packets += 1;
                moved = true;
            }
            while let Some(tx) = self.b.poll_transmit(self.now, &self.mb) {
                let pkt = RocePacket::parse(&tx.data).expect("valid");
                let _ = self.a.handle_packet(self.now, &pkt, &self.meta, &self.ma, None);
                moved = true;
            }
            while self.a.poll_completion().is_some() {
                completions += 1;
            }
            while self.b.poll_completion().is_some() {}
            self.now.0 += 100;
            if !moved {
                return (packets, completions);
            }
        }
    }
}

const BATCH: u64 = 64;

fn rc_write_4k(c: &mut Criterion) {
    let mut g = c.benchmark_group("rc_write_4KiB");
    for mtu in [Mtu::Mtu4096, Mtu::Mtu1024] {
        let packets_per_msg = u64::from(4096 / mtu.bytes());
        g.throughput(Throughput::Elements(BATCH * packets_per_msg));
        g.bench_function(format!("mtu{}_packets", mtu.bytes()), |bench| {
            let mut p = Pair::new(mtu);
            let src = p.ma.alloc_mr(1, BATCH * 4096, AccessFlags::LOCAL_WRITE);
            let dst = p.mb.alloc_mr(1, BATCH * 4096, all_access());
            bench.iter(|| {
                for i in 0..BATCH {
                    let mut w = write(i, dst.remote(i * 4096), vec![src.sge(i * 4096, 4096)]);
                    // One signaled completion per batch, as a streaming application would.
                    if i + 1 < BATCH {
                        w.flags = Default::default();
                    }
                    p.a.post_send(w);
                }
                let (packets, completions) = p.run();
                assert_eq!((packets, completions), (BATCH * packets_per_msg, 1));
            });
        });
    }
    g.finish();
}

fn rc_send_64b(c: &mut Criterion) {
    let mut g = c.benchmark_group("rc_send_64B");
    g.throughput(Throughput::Elements(BATCH));
    g.bench_function("packets", |bench| {
        let mut p = Pair::new(Mtu::Mtu1024);
        let src: Mr = p.ma.alloc_mr(1, 64, AccessFlags::empty());
        let dst: Mr = p.mb.alloc_mr(1, BATCH * 64, AccessFlags::LOCAL_WRITE);
        bench.iter(|| {
            for i in 0..BATCH {
                p.b.post_recv(recv(i, vec![dst.sge(i * 64, 64)]));
                let mut s = send(i, vec![src.sge(0, 64)]);
                if i + 1 < BATCH {
                    s.flags = Default::default();
                }
                p.a.post_send(s);
            }
            let (packets, completions) = p.run();
            assert_eq!((packets, completions), (BATCH, 1));
        });
    });
    g.finish();
}

fn icrc_4k(c: &mut Criterion) {
    let mut g = c.benchmark_group("icrc_4KiB_packet");
    let mut repr = PacketRepr::new(BthRepr::new(Opcode::RcWriteOnly, 0x11, Psn::new(7)), 4096);
    repr.reth = Some(RethRepr {
        va: 0x1000,
        rkey: 0xabcd,
        dma_len: 4096,
    });
    let mut buf = vec![0u8; repr.buffer_len()];
    repr.emit_with_payload(&mut buf, &[0xA5; 4096]).unwrap();
    g.throughput(Throughput::Bytes(buf.len() as u64));
    for (name, src, dst) in [
        ("ipv4", "10.0.0.1:49152", "10.0.0.2:4791"),
        ("ipv6", "[fd00::1]:49152", "[fd00::2]:4791"),
    ] {
        let (src, dst): (SocketAddr, SocketAddr) = (src.parse().unwrap(), dst.parse().unwrap());
        g.bench_function(format!("fill_{name}"), |bench| {
            bench.iter_batched_ref(
                || buf.clone(),
                |b| icrc::fill(src, dst, black_box(b)).unwrap(),
                BatchSize::SmallInput,
            );
        });
        icrc::fill(src, dst, &mut buf).unwrap();
        g.bench_function(format!("verify_{name}"), |bench| {
            bench.iter(|| assert!(icrc::verify(src, dst, black_box(&buf))));
        });
    }
    g.finish();
}

criterion_group!(benches, rc_write_4k, rc_send_64b, icrc_4k);
criterion_main!(benches);
