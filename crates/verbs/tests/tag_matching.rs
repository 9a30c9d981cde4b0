//! Tag-matching SRQs (`IBV_SRQT_TM`) through the safe API, between two RC QPs on the loopback
//! device: the client is an ordinary QP that sends TMH-framed SENDs; the server's QP receives
//! through a tag-matching SRQ whose CQ gets every completion.

mod common;

use std::time::{Duration, Instant};

use common::*;
use softverbs::*;

const ALL_ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ);
const LEN: usize = 1 << 16;

const NO_TAG: u8 = 0;
const RNDV: u8 = 1;
const FIN: u8 = 2;
const EAGER: u8 = 3;

/// A TMH as `tm_types.h` lays it out: opcode, 3 reserved bytes, app_ctx and tag big-endian.
fn tmh(op: u8, app_ctx: u32, tag: u64) -> Vec<u8> {
    let mut h = vec![op, 0, 0, 0];
    h.extend_from_slice(&app_ctx.to_be_bytes());
    h.extend_from_slice(&tag.to_be_bytes());
    h
}

/// An RVH: va, rkey, len, big-endian.
fn rvh(va: u64, rkey: u32, len: u32) -> Vec<u8> {
    let mut h = va.to_be_bytes().to_vec();
    h.extend_from_slice(&rkey.to_be_bytes());
    h.extend_from_slice(&len.to_be_bytes());
    h
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

struct Tm {
    /// The client: an ordinary RC QP with its own receive queue (for FIN messages).
    client_cq: CompletionQueue,
    client: QueuePair,
    client_mr: MemoryRegion,
    /// The server: an RC QP on the tag-matching SRQ, whose CQ is `cq`.
    cq: CompletionQueue,
    srq: SharedReceiveQueue,
    server: QueuePair,
    mr: MemoryRegion,
    unexpected_mr: MemoryRegion,
    server_cq: CompletionQueue,
    cpd: ProtectionDomain,
    spd: ProtectionDomain,
    ctx: (Context, Context),
}

fn connect(ctx: &Context, qp: &QueuePair, dest: u32, mtu: Mtu) {
    let path = RcPath {
        access: ALL_ACCESS - AccessFlags::LOCAL_WRITE,
        mtu,
        psn: 1,
        rd_atomic: 4,
        timeout: 14,
        retry_cnt: 7,
    };
    connect_rc(ctx, qp, dest, &path);
}

fn setup(tm: TmCap) -> Tm {
    let cctx = lo();
    let sctx = lo();
    let cpd = cctx.alloc_pd().unwrap();
    let client_cq = cctx.create_cq(64, None, 0).unwrap();
    let mut init = QpInit::new(QpType::Rc, &client_cq);
    init.cap.max_send_sge = 2;
    let client = cpd.create_qp(&init).unwrap();
    let client_mr = cpd.register(LEN, ALL_ACCESS).unwrap();

    let spd = sctx.alloc_pd().unwrap();
    let cq = sctx.create_cq(256, None, 0).unwrap();
    let server_cq = sctx.create_cq(4, None, 0).unwrap();
    let srq = spd
        .create_tm_srq(
            &SrqAttr {
                max_wr: 32,
                max_sge: 1,
                srq_limit: 0,
            },
            &cq,
            tm,
        )
        .unwrap();
    assert!(srq.is_tm());
    let mut init = QpInit::new(QpType::Rc, &server_cq);
    init.srq = Some(&srq);
    // The SRQ takes over the send queue for rendezvous READs: none is needed of its own.
    init.cap.max_send_wr = 0;
    let server = spd.create_qp(&init).unwrap();
    let mr = spd.register(LEN, ALL_ACCESS).unwrap();
    let unexpected_mr = spd.register(LEN, ALL_ACCESS).unwrap();
    connect(&cctx, &client, server.qp_num(), Mtu::Mtu1024);
    connect(&sctx, &server, client.qp_num(), Mtu::Mtu1024);
    Tm {
        client_cq,
        client,
        client_mr,
        cq,
        srq,
        server,
        mr,
        unexpected_mr,
        server_cq,
        cpd,
        spd,
        ctx: (cctx, sctx),
    }
}

fn caps() -> TmCap {
    TmCap {
        max_num_tags: 16,
        max_ops: 16,
    }
}

fn add(recv_wr_id: u64, sge: Sge, tag: u64, mask: u64) -> SrqOp {
    SrqOp {
        wr_id: 1000 + recv_wr_id,
        kind: SrqOpKind::Add {
            recv_wr_id,
            sg_list: vec![sge],
            tag,
            mask,
        },
        flags: OpsFlags::SIGNALED,
        unexpected_cnt: 0,
    }
}

fn poll_n(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    let mut wc = [WorkCompletion::default(); 8];
    while got.len() < n && Instant::now() < deadline {
        let k = cq.poll(&mut wc[..(n - got.len()).min(8)]);
        got.extend_from_slice(&wc[..k]);
    }
    assert_eq!(got.len(), n, "completions: {got:?}");
    got
}

impl Tm {
    /// Posts one operation and returns its handle.
    fn op(&self, op: SrqOp) -> u32 {
        let (handles, r) = self.srq.post_ops(std::slice::from_ref(&op));
        r.unwrap();
        handles[0]
    }

    /// Adds a signaled tag into `mr[range]` and reaps its `IBV_WC_TM_ADD`.
    fn add_tag(&self, recv_wr_id: u64, range: std::ops::Range<usize>, tag: u64, mask: u64) -> u32 {
        let h = self.op(add(recv_wr_id, self.mr.sge(range).unwrap(), tag, mask));
        let wc = poll_n(&self.cq, 1)[0];
        assert_eq!(
            (wc.opcode, wc.status, wc.wr_id),
            (WcOpcode::TmAdd, WcStatus::Success, 1000 + recv_wr_id)
        );
        h
    }

    /// The client sends `bytes` (copied into its region at `at`) as one SEND, and waits for
    /// its completion.
    fn send(&self, at: usize, bytes: &[u8]) {
        self.client_mr.write(at, bytes).unwrap();
        self.client
            .post_send(&[SendRequest {
                wr_id: 7,
                op: SendOp::Send {
                    imm: None,
                    invalidate: None,
                },
                flags: SendFlags::SIGNALED,
                payload: Payload::Sges(vec![self.client_mr.sge(at..at + bytes.len()).unwrap()]),
                ud: None,
                xrc_srqn: None,
            }])
            .unwrap();
        let wc = poll_n(&self.client_cq, 1)[0];
        assert_eq!((wc.opcode, wc.status), (WcOpcode::Send, WcStatus::Success));
    }

    /// Another client QP, connected to another server QP on the same SRQ.
    fn another_pair(&self) -> (QueuePair, QueuePair) {
        let client = self
            .cpd
            .create_qp(&QpInit::new(QpType::Rc, &self.client_cq))
            .unwrap();
        let mut init = QpInit::new(QpType::Rc, &self.server_cq);
        init.srq = Some(&self.srq);
        let server = self.spd.create_qp(&init).unwrap();
        connect(&self.ctx.0, &client, server.qp_num(), Mtu::Mtu1024);
        connect(&self.ctx.1, &server, client.qp_num(), Mtu::Mtu1024);
        (client, server)
    }

    fn post_unexpected(&self, ids: std::ops::Range<u64>) {
        let wrs: Vec<RecvWr> = ids
            .map(|i| RecvWr {
                wr_id: i,
                sg_list: vec![self
                    .unexpected_mr
                    .sge(i as usize * 4096..(i as usize + 1) * 4096)
                    .unwrap()],
            })
            .collect();
        self.srq.post_recv(&wrs).unwrap();
    }

    fn read(&self, mr: &MemoryRegion, range: std::ops::Range<usize>) -> Vec<u8> {
        let mut v = vec![0; range.len()];
        mr.read(range.start, &mut v).unwrap();
        v
    }
}

#[test]
fn capabilities_and_creation_checks() {
    let ctx = lo();
    let caps = ctx.tm_caps();
    assert!(caps.flags.contains(TmCapFlags::RC));
    assert!(caps.max_num_tags > 0 && caps.max_ops > 0 && caps.max_sge > 0);
    assert!(caps.max_rndv_hdr_size >= 32, "TMH and RVH must fit");
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None, 0).unwrap();
    let attr = SrqAttr {
        max_wr: 8,
        max_sge: 1,
        srq_limit: 0,
    };
    let einval = |tm: TmCap| {
        let e = pd.create_tm_srq(&attr, &cq, tm).unwrap_err();
        assert_eq!(e.errno(), libc_einval(), "{tm:?}: {e}");
    };
    einval(TmCap {
        max_num_tags: 0,
        max_ops: 4,
    });
    einval(TmCap {
        max_num_tags: caps.max_num_tags + 1,
        max_ops: 4,
    });
    einval(TmCap {
        max_num_tags: 4,
        max_ops: 0,
    });
    einval(TmCap {
        max_num_tags: 4,
        max_ops: caps.max_ops + 1,
    });
    let srq = pd.create_tm_srq(&attr, &cq, caps_small()).unwrap();
    // Tag matching is for RC QPs.
    let mut init = QpInit::new(QpType::Ud, &cq);
    init.srq = Some(&srq);
    assert_eq!(pd.create_qp(&init).unwrap_err().errno(), libc_einval());
    init.qp_type = QpType::Rc;
    pd.create_qp(&init).unwrap();
    // A plain SRQ has no tag list.
    let plain = pd.create_srq(&attr).unwrap();
    let (_, r) = plain.post_ops(&[SrqOp {
        wr_id: 1,
        kind: SrqOpKind::Sync,
        flags: OpsFlags::SIGNALED,
        unexpected_cnt: 0,
    }]);
    assert_eq!(r.unwrap_err().error.errno(), libc_einval());
}

fn caps_small() -> TmCap {
    TmCap {
        max_num_tags: 4,
        max_ops: 4,
    }
}

fn libc_einval() -> i32 {
    22
}

fn libc_enomem() -> i32 {
    12
}

#[test]
fn eager_message_matches_a_tag_and_lands_without_its_header() {
    let t = setup(caps());
    t.add_tag(1, 0..4096, 0x1234, 0xFFFF);
    let data = pattern(200, 1);
    let mut msg = tmh(EAGER, 0xabcd, 0xFF_1234);
    msg.extend_from_slice(&data);
    t.send(0, &msg);
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(wc.opcode, WcOpcode::TmRecv);
    assert_eq!(wc.wr_id, 1);
    assert_eq!(wc.wc_flags, WcFlags::TM_MATCH | WcFlags::TM_DATA_VALID);
    assert_eq!(wc.byte_len, 200);
    assert_eq!(wc.qp_num, t.server.qp_num());
    assert_eq!(
        wc.tm_info,
        TmInfo {
            tag: 0xFF_1234,
            priv_data: 0xabcd
        }
    );
    assert_eq!(t.read(&t.mr, 0..200), data);
    assert_eq!(t.srq.tm_tags(), 0, "a matched tag is consumed");
}

#[test]
fn multi_packet_eager_reports_match_then_data() {
    let t = setup(caps());
    t.add_tag(5, 0..8192, 77, u64::MAX);
    let data = pattern(3000, 9);
    let mut msg = tmh(EAGER, 1, 77);
    msg.extend_from_slice(&data);
    t.send(0, &msg);
    let wcs = poll_n(&t.cq, 2);
    assert_eq!(
        (wcs[0].opcode, wcs[0].wr_id, wcs[0].wc_flags),
        (WcOpcode::TmRecv, 5, WcFlags::TM_MATCH)
    );
    assert_eq!(
        (wcs[1].opcode, wcs[1].wr_id, wcs[1].wc_flags, wcs[1].byte_len),
        (WcOpcode::TmRecv, 5, WcFlags::TM_DATA_VALID, 3000)
    );
    assert_eq!(t.read(&t.mr, 0..3000), data);
}

#[test]
fn earliest_posted_tag_wins_under_masks() {
    let t = setup(caps());
    t.add_tag(1, 0..1024, 0x100, 0xF00); // any tag 0x1xx
    t.add_tag(2, 1024..2048, 0x123, u64::MAX);
    let mut msg = tmh(EAGER, 0, 0x123);
    msg.extend_from_slice(b"first");
    t.send(0, &msg);
    let mut msg = tmh(EAGER, 0, 0x123);
    msg.extend_from_slice(b"second");
    t.send(0, &msg);
    let wcs = poll_n(&t.cq, 2);
    assert_eq!((wcs[0].wr_id, wcs[1].wr_id), (1, 2), "posting order");
    assert_eq!(t.read(&t.mr, 0..5), b"first");
    assert_eq!(t.read(&t.mr, 1024..1030), b"second");
}

#[test]
fn no_tag_messages_go_whole_to_an_srq_buffer() {
    let t = setup(caps());
    t.add_tag(1, 0..1024, 0x1234, u64::MAX);
    t.post_unexpected(0..1);
    let mut msg = tmh(NO_TAG, 3, 0x1234);
    msg.extend_from_slice(b"untagged");
    t.send(0, &msg);
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!(
        (wc.status, wc.opcode, wc.wr_id),
        (WcStatus::Success, WcOpcode::TmNoTag, 0)
    );
    assert_eq!(wc.byte_len as usize, msg.len());
    assert!(!wc.wc_flags.intersects(WcFlags::TM_MATCH | WcFlags::TM_DATA_VALID));
    assert_eq!(t.read(&t.unexpected_mr, 0..msg.len()), msg, "with its TMH");
    assert_eq!(t.srq.tm_tags(), 1, "the tag is untouched");
}

#[test]
fn unexpected_messages_and_the_sync_phase() {
    let t = setup(caps());
    t.post_unexpected(0..4);
    // Nothing matches: the whole message, TMH included, goes to an SRQ buffer.
    let mut msg = tmh(EAGER, 9, 42);
    msg.extend_from_slice(b"early bird");
    t.send(0, &msg);
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!(
        (wc.status, wc.opcode, wc.wr_id),
        (WcStatus::Success, WcOpcode::Recv, 0)
    );
    assert_eq!(wc.byte_len as usize, msg.len());
    assert!(wc.wc_flags.contains(WcFlags::TM_SYNC_REQ));
    assert_eq!(wc.tm_info.tag, 42);
    assert_eq!(t.read(&t.unexpected_mr, 0..msg.len()), msg);

    // Software that has not seen it (count 0) adds a tag for 42: held back, SYNC_REQ.
    t.op(add(1, t.mr.sge(0..1024).unwrap(), 42, u64::MAX));
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!(wc.opcode, WcOpcode::TmAdd);
    assert!(wc.wc_flags.contains(WcFlags::TM_SYNC_REQ));
    // So a second message for 42 is unexpected too, rather than overtaking the first.
    t.send(0, &msg);
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!((wc.opcode, wc.wr_id), (WcOpcode::Recv, 1));

    // Software reports both: the held-back tag becomes eligible.
    t.op(SrqOp {
        wr_id: 50,
        kind: SrqOpKind::Sync,
        flags: OpsFlags::SIGNALED | OpsFlags::TM_SYNC,
        unexpected_cnt: 2,
    });
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!(
        (wc.opcode, wc.wr_id, wc.status),
        (WcOpcode::TmSync, 50, WcStatus::Success)
    );
    assert!(!wc.wc_flags.contains(WcFlags::TM_SYNC_REQ));
    let mut msg = tmh(EAGER, 0, 42);
    msg.extend_from_slice(b"third");
    t.send(0, &msg);
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!(
        (wc.opcode, wc.wr_id, wc.wc_flags),
        (WcOpcode::TmRecv, 1, WcFlags::TM_MATCH | WcFlags::TM_DATA_VALID)
    );
    assert_eq!(t.read(&t.mr, 0..5), b"third");
}

#[test]
fn fin_and_headerless_messages_are_ordinary_receives() {
    let t = setup(caps());
    t.add_tag(1, 0..1024, 0, 0); // matches every tagged message
    t.post_unexpected(0..2);
    t.send(0, b"short");
    let mut fin = tmh(FIN, 0, 0);
    fin.extend_from_slice(&rvh(1, 2, 3));
    t.send(0, &fin);
    let wcs = poll_n(&t.cq, 2);
    assert_eq!(
        (wcs[0].opcode, wcs[0].wr_id, wcs[0].byte_len),
        (WcOpcode::Recv, 0, 5)
    );
    assert_eq!(
        (wcs[1].opcode, wcs[1].wr_id, wcs[1].byte_len),
        (WcOpcode::Recv, 1, 32)
    );
    assert!(
        wcs.iter().all(|w| !w.wc_flags.contains(WcFlags::TM_SYNC_REQ)),
        "not unexpected"
    );
    assert_eq!(t.srq.tm_tags(), 1);
}

#[test]
fn tag_del_after_consume_is_tm_err() {
    let t = setup(caps());
    let consumed = t.add_tag(1, 0..1024, 5, u64::MAX);
    let kept = t.add_tag(2, 1024..2048, 6, u64::MAX);
    assert_ne!(consumed, kept);
    let mut msg = tmh(EAGER, 0, 5);
    msg.extend_from_slice(b"x");
    t.send(0, &msg);
    assert_eq!(poll_n(&t.cq, 1)[0].wr_id, 1);
    let del = |wr_id, handle| SrqOp {
        wr_id,
        kind: SrqOpKind::Del { handle },
        flags: OpsFlags::SIGNALED,
        unexpected_cnt: 0,
    };
    t.op(del(10, consumed));
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!(
        (wc.opcode, wc.wr_id, wc.status),
        (WcOpcode::TmDel, 10, WcStatus::TmErr)
    );
    t.op(del(11, kept));
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!(
        (wc.opcode, wc.wr_id, wc.status),
        (WcOpcode::TmDel, 11, WcStatus::Success)
    );
    assert_eq!(t.srq.tm_tags(), 0);
    // A deleted tag no longer matches.
    t.post_unexpected(0..1);
    let mut msg = tmh(EAGER, 0, 6);
    msg.extend_from_slice(b"y");
    t.send(0, &msg);
    assert_eq!(poll_n(&t.cq, 1)[0].opcode, WcOpcode::Recv);
    // A handle outside the list is refused at once.
    let (_, r) = t.srq.post_ops(&[del(12, 16)]);
    assert_eq!(r.unwrap_err().error.errno(), libc_einval());
}

#[test]
fn at_most_max_ops_outstanding_and_the_list_size() {
    let t = setup(TmCap {
        max_num_tags: 3,
        max_ops: 2,
    });
    let sge = t.mr.sge(0..64).unwrap();
    let mut unsignaled = add(2, sge, 2, u64::MAX);
    unsignaled.flags = OpsFlags::empty();
    // One signaled and one unsignaled operation: both outstanding until a completion is polled.
    let (handles, r) = t.srq.post_ops(&[
        add(1, sge, 1, u64::MAX),
        unsignaled.clone(),
        add(3, sge, 3, u64::MAX),
    ]);
    let e = r.unwrap_err();
    assert_eq!((e.index, e.error.errno()), (2, libc_enomem()));
    assert_eq!(handles.len(), 2);
    assert_eq!(t.srq.tm_tags(), 2, "the refused operation did nothing");
    // Polling the first completion reaps the first operation only.
    assert_eq!(poll_n(&t.cq, 1)[0].wr_id, 1001);
    t.op(add(3, sge, 3, u64::MAX));
    let (_, r) = t.srq.post_ops(&[add(4, sge, 4, u64::MAX)]);
    assert_eq!(r.unwrap_err().error.errno(), libc_enomem());
    // The completion of the third reaps the unsignaled second with it.
    assert_eq!(poll_n(&t.cq, 1)[0].wr_id, 1003);
    // Now the list (3 tags) is full.
    let (_, r) = t.srq.post_ops(&[add(4, sge, 4, u64::MAX)]);
    let e = r.unwrap_err();
    assert_eq!(e.error.errno(), libc_enomem());
    assert_eq!(t.srq.tm_tags(), 3);
}

#[test]
fn rendezvous_reads_the_senders_buffer_and_sends_fin() {
    let t = setup(caps());
    let data = pattern(20_000, 3);
    t.client_mr.write(32_768, &data).unwrap();
    // The client waits for FIN on its own receive queue.
    t.client
        .post_recv(&[RecvWr {
            wr_id: 99,
            sg_list: vec![t.client_mr.sge(60_000..60_064).unwrap()],
        }])
        .unwrap();
    t.add_tag(4, 0..LEN, 0x77, u64::MAX);
    let mut req = tmh(RNDV, 0x55, 0x77);
    let va = t.client_mr.addr() + 32_768;
    req.extend_from_slice(&rvh(va, t.client_mr.rkey(), data.len() as u32));
    req.extend_from_slice(b"metadata");
    t.send(0, &req);
    let wcs = poll_n(&t.cq, 2);
    assert_eq!(
        (wcs[0].opcode, wcs[0].wr_id, wcs[0].status),
        (WcOpcode::TmRecv, 4, WcStatus::Success)
    );
    assert_eq!(wcs[0].wc_flags, WcFlags::TM_MATCH);
    assert_eq!(
        wcs[0].tm_info,
        TmInfo {
            tag: 0x77,
            priv_data: 0x55
        }
    );
    assert_eq!(
        (wcs[1].opcode, wcs[1].wr_id, wcs[1].status),
        (WcOpcode::TmRecv, 4, WcStatus::Success)
    );
    assert_eq!(wcs[1].wc_flags, WcFlags::TM_DATA_VALID);
    assert_eq!(wcs[1].byte_len as usize, data.len());
    assert_eq!(t.read(&t.mr, 0..data.len()), data);
    // FIN: the request's TMH and RVH with the FIN opcode.
    let wc = poll_n(&t.client_cq, 1)[0];
    assert_eq!(
        (wc.opcode, wc.wr_id, wc.status, wc.byte_len),
        (WcOpcode::Recv, 99, WcStatus::Success, 32)
    );
    let mut fin = tmh(FIN, 0x55, 0x77);
    fin.extend_from_slice(&rvh(va, t.client_mr.rkey(), data.len() as u32));
    assert_eq!(t.read(&t.client_mr, 60_000..60_032), fin);
    assert_eq!(t.server.query().qp_state, QpState::Rts);
}

#[test]
fn rendezvous_into_a_small_buffer_is_left_to_software() {
    let t = setup(caps());
    t.add_tag(4, 0..100, 0x77, u64::MAX);
    let mut req = tmh(RNDV, 1, 0x77);
    req.extend_from_slice(&rvh(t.client_mr.addr(), t.client_mr.rkey(), 5000));
    t.send(0, &req);
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!(
        (wc.opcode, wc.wr_id, wc.status),
        (WcOpcode::TmRecv, 4, WcStatus::TmRndvIncomplete)
    );
    assert_eq!(wc.wc_flags, WcFlags::TM_MATCH | WcFlags::TM_DATA_VALID);
    assert_eq!(t.read(&t.mr, 0..32), req, "the headers are in the buffer");
    assert_eq!(t.srq.tm_tags(), 0);
}

#[test]
fn unexpected_rendezvous_requests_go_to_software_whole() {
    let t = setup(caps());
    t.post_unexpected(0..1);
    let mut req = tmh(RNDV, 1, 0x99);
    req.extend_from_slice(&rvh(t.client_mr.addr(), t.client_mr.rkey(), 5000));
    req.extend_from_slice(b"meta");
    t.send(0, &req);
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!(
        (wc.opcode, wc.wr_id, wc.byte_len as usize),
        (WcOpcode::Recv, 0, req.len())
    );
    assert_eq!(t.read(&t.unexpected_mr, 0..req.len()), req);
}

#[test]
fn qps_on_one_srq_share_its_tag_list() {
    let t = setup(caps());
    let (client2, server2) = t.another_pair();
    t.add_tag(1, 0..1024, 9, u64::MAX);
    t.add_tag(2, 1024..2048, 9, u64::MAX);
    // A message on the second connection takes the first tag, one on the first the second.
    let mut msg = tmh(EAGER, 0, 9);
    msg.extend_from_slice(b"via two");
    t.client_mr.write(0, &msg).unwrap();
    client2
        .post_send(&[SendRequest {
            wr_id: 1,
            op: SendOp::Send {
                imm: None,
                invalidate: None,
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(vec![t.client_mr.sge(0..msg.len()).unwrap()]),
            ud: None,
            xrc_srqn: None,
        }])
        .unwrap();
    assert_eq!(poll_n(&t.client_cq, 1)[0].status, WcStatus::Success);
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.qp_num), (1, server2.qp_num()));
    let mut msg = tmh(EAGER, 0, 9);
    msg.extend_from_slice(b"via one");
    t.send(4096, &msg);
    let wc = poll_n(&t.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.qp_num), (2, t.server.qp_num()));
    assert_eq!(t.read(&t.mr, 0..7), b"via two");
    assert_eq!(t.read(&t.mr, 1024..1031), b"via one");
    assert!(
        t.server_cq.poll(&mut [WorkCompletion::default(); 4]) == 0,
        "nothing on the QPs' own CQ"
    );
}
