//! Driving the fabric: draining QPs, sending and delivering packets, virtual time.

use std::cmp::Reverse;
use std::net::SocketAddr;
use std::time::Duration;

use softverbs_engine::time::Instant;
use softverbs_engine::transport::{Completion, RecvSource, Rx, RxMeta, Transmit, WorkQueue};
use softverbs_engine::types::QpState;
use softverbs_wire::{icrc, RocePacket, MULTICAST_QPN, ROCE_UDP_PORT};

use super::net::{sport, InFlight, SimExternal};
use super::{Node, PacketInfo, QpId, Sim, Verdict, XrcDomainSrqs};

impl Sim {
    /// Drains one QP's outputs: packets onto the network, completions into its CQs, events.
    pub fn pump(&mut self, id: QpId) {
        let now = self.now;
        let mut txs = Vec::new();
        {
            let node = &mut self.nodes[id.node];
            let Some(qp) = node.qps.get_mut(&id.qpn) else {
                return;
            };
            // A spinning engine would never stop producing packets at one instant.
            for n in 0.. {
                let Some(tx) = qp.engine.poll_transmit(now, &node.mem) else {
                    break;
                };
                assert!(
                    n < 1_000_000,
                    "QP {id:?} produced a million packets without time passing"
                );
                txs.push(tx);
            }
            while let Some(Completion { queue, wc }) = qp.engine.poll_completion() {
                let cq = match queue {
                    WorkQueue::Send => qp.send_cq,
                    WorkQueue::Recv => qp.recv_cq,
                    WorkQueue::XrcSrq(srqn) => {
                        node.srqs
                            .iter()
                            .find_map(|s| s.xrc.filter(|x| x.srqn == srqn))
                            .expect("completion for an existing XRC SRQ")
                            .cq
                    }
                    WorkQueue::Internal => {
                        qp.internal.push(wc);
                        continue;
                    }
                };
                node.cqs[cq].push(wc);
            }
            while let Some(ev) = qp.engine.poll_event() {
                qp.events.push(ev);
            }
            if qp.engine.take_error_transition() {
                if self.trace {
                    eprintln!("{:>12} QP {id:?} entered ERR", now.0);
                }
                qp.attr.qp_state = QpState::Err;
                qp.attr.cur_qp_state = QpState::Err;
            }
        }
        for tx in txs {
            self.send(id, tx);
        }
    }

    /// Puts a packet on the network: ICRC, filter, faults, scheduling.
    fn send(&mut self, from: QpId, tx: Transmit) {
        let src_node = &self.nodes[from.node];
        if !src_node.up {
            self.stats.node_down += 1;
            return;
        }
        let src_gid = src_node.gid;
        let mut data = tx.data;
        let src = SocketAddr::new(src_gid.to_ip(), sport(from.qpn));
        let dst = SocketAddr::new(tx.dest.dgid.to_ip(), ROCE_UDP_PORT);
        icrc::fill(src, dst, &mut data).expect("source and destination of one IP family");
        let parsed = RocePacket::parse(&data).expect("the engine emits well-formed packets");
        let payload_len = tx.external.map_or(parsed.payload.len(), |e| e.len as usize);
        self.stats.sent += 1;
        self.stats.external += u64::from(tx.external.is_some());
        self.stats.payload_bytes += payload_len as u64;
        // Serialise on the sender's egress link.
        let wire_bits = (data.len() as u64 + 8 + 40 + 14 + 4 + 20) * 8;
        let link = &mut self.nodes[from.node].link_free;
        let depart = (*link).max(self.now.0) + wire_bits.checked_div(self.net.link_gbps).unwrap_or(0);
        *link = depart;
        let targets: Vec<usize> = if tx.dest.dgid.is_multicast() {
            (0..self.nodes.len())
                .filter(|&n| {
                    self.nodes[n]
                        .qps
                        .values()
                        .any(|q| q.mcast.contains(&tx.dest.dgid))
                })
                .collect()
        } else {
            self.nodes
                .iter()
                .position(|n| n.gid == tx.dest.dgid)
                .into_iter()
                .collect()
        };
        if targets.is_empty() {
            self.stats.no_route += 1;
        }
        for to_node in targets {
            let info = PacketInfo {
                from,
                to_node,
                opcode: parsed.opcode(),
                xrc_srqn: parsed.repr.xrceth.map(|x| x.srqn),
                psn: parsed.repr.bth.psn,
                dest_qpn: parsed.repr.bth.dest_qpn,
                ack_req: parsed.repr.bth.ack_req,
                solicited: parsed.repr.bth.solicited,
                syndrome: parsed.repr.aeth.map(|a| a.syndrome),
                payload_len,
                time: self.now,
            };
            if let Some(log) = &mut self.log {
                log.push(info);
            }
            let mut extra = 0;
            match self.filter.as_mut().map_or(Verdict::Pass, |f| f(&info)) {
                Verdict::Pass => {}
                Verdict::Drop => {
                    self.stats.filtered += 1;
                    self.trace_pkt("filter-drop", &info);
                    continue;
                }
                Verdict::Delay(d) => extra = d,
            }
            if data.len() > self.net.link_mtu {
                self.stats.mtu_dropped += 1;
                self.trace_pkt("mtu-drop", &info);
                continue;
            }
            let key = (from, to_node, info.opcode.as_u8(), info.psn.value());
            let spare =
                self.net.max_burst != 0 && self.bursts.get(&key).is_some_and(|&n| n >= self.net.max_burst);
            if !spare && self.rng.chance(self.net.loss_pct) {
                *self.bursts.entry(key).or_default() += 1;
                self.stats.lost += 1;
                self.trace_pkt("lost", &info);
                continue;
            }
            let copies = if self.rng.chance(self.net.dup_pct) {
                self.stats.duplicated += 1;
                2
            } else {
                1
            };
            // Copies that arrive intact and on time.
            let mut good = 0;
            for _ in 0..copies {
                let mut bytes = data.clone();
                let mut bad = false;
                if !spare && self.rng.chance(self.net.corrupt_pct) {
                    bad = true;
                    self.stats.corrupted += 1;
                    // Any byte but BTH byte 4 (FECN, BECN, reserved): switches may change that
                    // one, so the ICRC deliberately does not cover it.
                    let mut i = self.rng.below(bytes.len() as u64 - 1) as usize;
                    if i >= 4 {
                        i += 1;
                    }
                    bytes[i] ^= 1 << self.rng.below(8);
                }
                let mut at = depart + self.net.latency_ns + extra;
                if !spare && self.rng.chance(self.net.reorder_pct) {
                    bad = true;
                    self.stats.reordered += 1;
                    at += self.rng.below(self.net.reorder_max_ns + 1);
                }
                good += u32::from(!bad);
                self.trace_pkt("send", &info);
                self.seq += 1;
                self.queue.push(Reverse(InFlight {
                    at,
                    seq: self.seq,
                    to_node,
                    src,
                    dst,
                    meta_tc: tx.dest.traffic_class,
                    meta_hop: tx.dest.hop_limit,
                    sgid: src_gid,
                    dgid: tx.dest.dgid,
                    data: bytes,
                    ext: tx.external.map(|e| (from.node, e)),
                }));
            }
            // Corrupted or late counts as a mishap unless an intact, timely copy went too.
            if good == 0 {
                *self.bursts.entry(key).or_default() += 1;
            } else {
                self.bursts.remove(&key);
            }
        }
    }

    fn trace_pkt(&self, what: &str, p: &PacketInfo) {
        if self.trace {
            eprintln!(
                "{:>12} {what:<11} {:?} -> node {} qp {:#x} {:<28} psn {:>8} ackreq {} {:?} len {}",
                self.now.0,
                p.from,
                p.to_node,
                p.dest_qpn,
                p.opcode.name(),
                p.psn.value(),
                p.ack_req as u8,
                p.syndrome,
                p.payload_len
            );
        }
    }

    /// Delivers one packet to its node: ICRC check, parse, route to QP(s), engine, pump.
    fn deliver(&mut self, f: InFlight) {
        if !self.nodes[f.to_node].up {
            self.stats.node_down += 1;
            return;
        }
        if !icrc::verify(f.src, f.dst, &f.data) {
            self.stats.bad_icrc += 1;
            if self.trace {
                eprintln!(
                    "{:>12} bad-icrc    node {} {:02x?}",
                    self.now.0,
                    f.to_node,
                    &f.data[..12.min(f.data.len())]
                );
            }
            return;
        }
        let Ok(mut pkt) = RocePacket::parse(&f.data) else {
            self.stats.malformed += 1;
            return;
        };
        // A payload left in the sender's memory is read now, as a receiver copying it does.
        let ext = f.ext.map(|(from, e)| {
            let mem = &self.nodes[from].mem;
            let bytes: Vec<u8> = e
                .ranges()
                .iter()
                .flat_map(|&(a, l)| mem.peek(a, l as usize))
                .collect();
            pkt.repr.payload_len = bytes.len();
            pkt.repr.bth.pad_count = softverbs_wire::pad_count_for(bytes.len());
            SimExternal(bytes)
        });
        let dest_qpn = pkt.repr.bth.dest_qpn;
        let node = &self.nodes[f.to_node];
        let qpns: Vec<u32> = if dest_qpn == MULTICAST_QPN {
            node.qps
                .iter()
                .filter(|(_, q)| q.mcast.contains(&f.dgid))
                .map(|(&n, _)| n)
                .collect()
        } else if node.qps.contains_key(&dest_qpn) {
            vec![dest_qpn]
        } else {
            Vec::new()
        };
        if qpns.is_empty() {
            self.stats.no_qp += 1;
            return;
        }
        self.stats.delivered += 1;
        let meta = RxMeta {
            sgid: f.sgid,
            dgid: f.dgid,
            traffic_class: f.meta_tc,
            hop_limit: f.meta_hop,
        };
        let now = self.now;
        for qpn in qpns {
            let node = &mut self.nodes[f.to_node];
            let Node { mem, qps, srqs, .. } = node;
            let qp = qps.get_mut(&qpn).expect("routed QP exists");
            let mut domain;
            let srq = match (qp.srq, qp.xrcd) {
                (Some(i), _) => Some(&mut srqs[i] as &mut dyn RecvSource),
                (None, Some(xrcd)) => {
                    domain = XrcDomainSrqs {
                        srqs,
                        xrcd,
                        selected: None,
                    };
                    Some(&mut domain as &mut dyn RecvSource)
                }
                (None, None) => None,
            };
            let rx = match &ext {
                Some(e) => Rx::external(&pkt, e),
                None => Rx::new(&pkt),
            };
            if self.hold_acks {
                qp.engine.hold_acks();
                let id = QpId { node: f.to_node, qpn };
                if !self.acking.contains(&id) {
                    self.acking.push(id);
                }
            }
            let result = qp.engine.handle_rx(now, &rx, &meta, mem, srq);
            if self.trace {
                eprintln!(
                    "{:>12} deliver     node {} qp {:#x} {:<28} psn {:>8} {:?} -> {:?}",
                    now.0,
                    f.to_node,
                    qpn,
                    pkt.opcode().name(),
                    pkt.repr.bth.psn.value(),
                    pkt.repr.aeth.map(|a| a.syndrome),
                    result
                );
            }
            if let Err(reason) = result {
                qp.drops.push(reason);
                self.stats.engine_dropped += 1;
            }
            self.pump(QpId { node: f.to_node, qpn });
        }
    }

    fn all_qps(&self) -> Vec<QpId> {
        self.nodes
            .iter()
            .enumerate()
            .flat_map(|(node, n)| n.qps.keys().map(move |&qpn| QpId { node, qpn }))
            .collect()
    }

    /// The next instant anything happens: a delivery or an engine timeout.
    pub fn next_event(&self) -> Option<Instant> {
        let delivery = self.queue.peek().map(|Reverse(f)| Instant(f.at));
        let timer = self
            .nodes
            .iter()
            .filter(|n| n.up)
            .flat_map(|n| n.qps.values())
            .filter_map(|q| q.engine.poll_timeout())
            .min();
        match (delivery, timer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// One step: jump to the next event, deliver what is due, fire due timers. False when
    /// nothing is left to happen.
    pub fn step(&mut self) -> bool {
        let Some(next) = self.next_event() else {
            return false;
        };
        self.steps += 1;
        assert!(
            self.steps <= self.max_steps,
            "simulation exceeded {} steps (livelock?)",
            self.max_steps
        );
        self.now = self.now.max(next);
        while self.queue.peek().is_some_and(|Reverse(f)| f.at <= self.now.0) {
            let Reverse(f) = self.queue.pop().expect("peeked");
            self.deliver(f);
        }
        // The end of the batch: one ACK per QP that held one.
        for id in std::mem::take(&mut self.acking) {
            if let Some(qp) = self.nodes[id.node].qps.get_mut(&id.qpn) {
                qp.engine.release_acks();
                self.pump(id);
            }
        }
        let now = self.now;
        for id in self.all_qps() {
            if !self.nodes[id.node].up {
                continue;
            }
            let due = self.qp(id).engine.poll_timeout().is_some_and(|t| t <= now);
            if due {
                if self.trace {
                    eprintln!("{:>12} timeout     {id:?}", now.0);
                }
                self.qp_mut(id).engine.handle_timeout(now);
                self.pump(id);
            }
        }
        true
    }

    /// Runs until nothing is left to happen (capped at an hour of virtual time).
    pub fn run(&mut self) {
        self.run_for(Duration::from_secs(3600));
    }

    /// Runs until idle or until `d` of virtual time has passed, whichever is first.
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        while self.next_event().is_some_and(|t| t <= end) {
            self.step();
        }
    }

    /// Runs until `cond` holds; panics if the fabric goes idle first or `limit` passes.
    pub fn run_until(&mut self, limit: Duration, mut cond: impl FnMut(&mut Self) -> bool) {
        let end = self.now + limit;
        while !cond(self) {
            match self.next_event() {
                Some(t) if t <= end => {
                    self.step();
                }
                Some(_) => panic!("condition not reached within {limit:?} of virtual time"),
                None => panic!(
                    "fabric went idle before the condition held (virtual time {} ns)",
                    self.now.0
                ),
            }
        }
    }

    /// Lets virtual time pass (timers fire on the way).
    pub fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        while self.next_event().is_some_and(|t| t <= end) {
            self.step();
        }
        self.now = end;
    }
}
