//! Writes the seed scripts of the `engine_qp` target into `corpus/engine_qp/` (run from the
//! `fuzz` directory): connected RC, UC, UD and XRC transfers of every opcode, RNR, NAKs,
//! losses and timeouts, memory windows, state changes in the middle of a transfer, every
//! opcode injected, and hostile packets. Each script is run through the harness first, so a
//! seed that breaks an invariant is reported here rather than by the fuzzer.

#[path = "../../crates/engine/tests/sim/mod.rs"]
mod sim;

#[path = "../../crates/engine/tests/qp_fuzz/mod.rs"]
mod qp_fuzz;

use std::fs;
use std::path::Path;

use qp_fuzz::script::{
    encode, Action, Advance, Connect, Dereg, Inject, InjectRaw, Modify, MwSpec, PostRecv, PostSend,
    RemoteSpec, SetState, Setup, SgeSpec, WireOp,
};

const RC: u8 = 0;
const UC: u8 = 1;
const UD: u8 = 2;
const XRC: u8 = 3;

const IPV6: u8 = 1;
const SIG_ALL: u8 = 2;
const SRQ1: u8 = 4;
const FIXED_TIMERS: u8 = 16;
const FAITHFUL: u8 = 32;

// Send opcodes (PostSend::op).
const SEND: u8 = 0;
const SEND_IMM: u8 = 1;
const SEND_INV: u8 = 2;
const WRITE: u8 = 3;
const WRITE_IMM: u8 = 4;
const READ: u8 = 5;
const CMP_SWP: u8 = 6;
const FETCH_ADD: u8 = 7;
const BIND_MW: u8 = 8;
const LOCAL_INV: u8 = 9;
const ATOMIC_WRITE: u8 = 10;
const FLUSH: u8 = 11;

const SIGNALED: u8 = 2;

// Regions (see the harness): 0 every right (512 B), 1 local write (512 B), 2 remote read only
// (128 B), 3 another PD (128 B), 4 local/remote write and remote read (1 KiB); 5 and 6 are
// the windows when remote, 6 an unknown lkey, 7 an unknown rkey.
fn sge(region: u8, off: u16, len: u32) -> SgeSpec {
    SgeSpec { region, off, len }
}

fn remote(region: u8, off: u16, len: u32) -> RemoteSpec {
    RemoteSpec { region, off, len }
}

fn setup(transport: u8, flags: u8) -> Setup {
    Setup { transport, flags }
}

fn conn() -> Connect {
    Connect {
        qp: 2,
        upto: 2,
        mtu: 0,
        psn0: 0x10,
        psn1: 0xFF_FFF0,
        timeout: 10,
        retry: 7,
        rnr_retry: 7,
        min_rnr: 1,
        max_rd: 16,
        max_dest_rd: 16,
        access: 0x7F,
        qkey: 0x1234,
    }
}

fn connect() -> Action {
    Action::Connect(conn())
}

fn connect_with(f: impl FnOnce(&mut Connect)) -> Action {
    let mut c = conn();
    f(&mut c);
    Action::Connect(c)
}

fn post(qp: u8, op: u8, sges: &[SgeSpec], remote: RemoteSpec) -> PostSend {
    let mut p = PostSend {
        qp,
        op,
        flags: SIGNALED,
        nsge: sges.len() as u8,
        remote,
        imm: 0x0102_0304,
        value: 5,
        compare: 0,
        ..PostSend::default()
    };
    let mut it = sges.iter().cloned();
    p.sge0 = it.next().unwrap_or_default();
    p.sge1 = it.next().unwrap_or_default();
    p.sge2 = it.next().unwrap_or_default();
    p.sge3 = it.next().unwrap_or_default();
    p
}

fn send(qp: u8, op: u8, sges: &[SgeSpec], r: RemoteSpec) -> Action {
    Action::PostSend(post(qp, op, sges, r))
}

fn send_with(qp: u8, op: u8, sges: &[SgeSpec], r: RemoteSpec, f: impl FnOnce(&mut PostSend)) -> Action {
    let mut p = post(qp, op, sges, r);
    f(&mut p);
    Action::PostSend(p)
}

fn recv(qp: u8, sges: &[SgeSpec]) -> Action {
    recv_srq(qp, 0, sges)
}

fn recv_srq(qp: u8, srq: u8, sges: &[SgeSpec]) -> Action {
    let mut it = sges.iter().cloned();
    Action::PostRecv(PostRecv {
        qp,
        nsge: sges.len() as u8,
        sge0: it.next().unwrap_or_default(),
        sge1: it.next().unwrap_or_default(),
        sge2: it.next().unwrap_or_default(),
        sge3: it.next().unwrap_or_default(),
        srq,
    })
}

fn wire(dir: u8, op: u8, count: u8) -> Action {
    Action::Wire(WireOp {
        dir,
        op,
        pos: 0,
        xor: 0,
        count,
    })
}

fn deliver(dir: u8) -> Action {
    wire(dir, 0, 0)
}

fn drop_pkt(dir: u8) -> Action {
    wire(dir, 1, 0)
}

fn dup(dir: u8) -> Action {
    wire(dir, 2, 0)
}

fn reorder(dir: u8) -> Action {
    wire(dir, 3, 0)
}

fn corrupt(dir: u8, pos: u16, refill: bool) -> Action {
    Action::Wire(WireOp {
        dir,
        op: 4,
        pos,
        xor: 0x40,
        count: u8::from(refill),
    })
}

fn pump() -> Action {
    wire(0, 6, 0)
}

fn run() -> Action {
    Action::Advance(Advance { mode: 5, amount: 0 })
}

fn micros(n: u16) -> Action {
    Action::Advance(Advance { mode: 1, amount: n })
}

fn to_deadline() -> Action {
    Action::Advance(Advance { mode: 3, amount: 0 })
}

fn tick() -> Action {
    Action::Advance(Advance { mode: 4, amount: 0 })
}

fn state(qp: u8, s: u8, notify: bool) -> Action {
    Action::SetState(SetState {
        qp,
        state: s,
        notify: u8::from(notify),
    })
}

const RESET: u8 = 0;
const RTS: u8 = 3;
const SQD: u8 = 4;
const SQE: u8 = 5;
const ERR: u8 = 6;

fn inject(qp: u8, opcode: u8, f: impl FnOnce(&mut Inject)) -> Action {
    let mut i = Inject {
        qp,
        opcode,
        psn_base: 0,
        bth: 1,
        aeth: 0x1F,
        reth: remote(0, 0, 0),
        atomic: remote(0, 8, 0),
        len: 64,
        fill: 0x33,
        ..Inject::default()
    };
    f(&mut i);
    Action::Inject(i)
}

/// Node 0 binds its window `mw` over `len` bytes at `off` of `region` with rights `access`
/// and key tag `tag` (a BIND_MW on QP 0).
fn bind(mw: u8, region: u8, off: u16, len: u16, access: u8, tag: u8) -> Action {
    send_with(0, BIND_MW, &[], remote(0, 0, 0), |p| {
        p.mw = MwSpec {
            mw,
            region,
            off,
            len,
            access,
            tag,
        }
    })
}

/// Node 0 invalidates its window `mw` (a LOCAL_INV on QP 0).
fn local_inv(mw: u8) -> Action {
    send_with(0, LOCAL_INV, &[], remote(0, 0, 0), |p| p.mw.mw = mw)
}

/// An ACKNOWLEDGE at QP 0, `psn` past the first PSN it sent, with AETH syndrome `aeth`.
fn ack(psn: u32, aeth: u8) -> Action {
    inject(0, op_index(0x11), |i| {
        i.psn_base = 3;
        i.psn = psn;
        i.aeth = aeth;
    })
}

/// Index of an opcode byte in the wire's opcode table.
fn op_index(byte: u8) -> u8 {
    softverbs_wire::OPCODE_TABLE
        .iter()
        .position(|i| i.opcode.as_u8() == byte)
        .expect("known opcode") as u8
}

fn scripts() -> Vec<(&'static str, Setup, Vec<Action>)> {
    let mut v = Vec::new();
    let whole = remote(0, 0, 0);
    // RC: every operation, completed.
    v.push((
        "rc_send_write_read",
        setup(RC, FAITHFUL),
        vec![
            connect(),
            recv(1, &[sge(4, 0, 1024)]),
            recv(1, &[sge(1, 0, 512), sge(4, 0, 512)]),
            send(0, SEND, &[sge(4, 0, 1000)], whole.clone()),
            send(0, SEND_IMM, &[sge(4, 100, 300), sge(0, 0, 200)], whole.clone()),
            send(0, WRITE, &[sge(4, 0, 700)], remote(4, 16, 0)),
            recv(1, &[sge(1, 0, 64)]),
            send(0, WRITE_IMM, &[sge(0, 0, 300)], remote(0, 0, 0)),
            send(0, READ, &[sge(4, 0, 1000)], remote(4, 0, 0)),
            pump(),
            send(1, READ, &[sge(4, 8, 128)], remote(2, 0, 0)),
            run(),
        ],
    ));
    v.push((
        "rc_atomics",
        setup(RC, SIG_ALL),
        vec![
            connect(),
            send_with(0, CMP_SWP, &[sge(1, 0, 8)], remote(0, 8, 0), |p| {
                p.compare = 0;
                p.value = 7;
            }),
            send(0, FETCH_ADD, &[sge(1, 8, 8)], remote(0, 16, 0)),
            send(0, ATOMIC_WRITE, &[], remote(0, 24, 0)),
            send_with(0, FLUSH, &[], remote(0, 0, 64), |p| p.value = 1),
            send_with(0, FLUSH, &[], remote(0, 0, 64), |p| p.value = 3 | 4),
            pump(),
            // A lost ATOMIC ACK: the duplicate request is answered from the responder's cache.
            send(0, FETCH_ADD, &[sge(1, 16, 8)], remote(0, 16, 0)),
            deliver(0),
            drop_pkt(1),
            run(),
        ],
    ));
    v.push((
        "rc_multi_packet_read_with_loss",
        setup(RC, FAITHFUL),
        vec![
            connect_with(|c| c.timeout = 8),
            send(0, READ, &[sge(4, 0, 1024)], remote(4, 0, 0)),
            deliver(0),
            drop_pkt(1),
            deliver(1),
            deliver(1),
            reorder(1),
            pump(),
            run(),
            send(0, READ, &[sge(4, 0, 1000)], remote(4, 0, 0)),
            send(0, SEND, &[sge(0, 0, 10)], whole.clone()),
            recv(1, &[sge(1, 0, 10)]),
            deliver(0),
            deliver(0),
            drop_pkt(1),
            pump(),
            run(),
        ],
    ));
    v.push((
        "rc_loss_go_back_n",
        setup(RC, FAITHFUL),
        vec![
            connect_with(|c| c.timeout = 8),
            recv(1, &[sge(4, 0, 1024)]),
            recv(1, &[sge(1, 0, 512)]),
            send(0, SEND, &[sge(4, 0, 1024)], whole.clone()),
            send(0, SEND, &[sge(1, 0, 512)], whole.clone()),
            deliver(0),
            drop_pkt(0),
            wire(0, 5, 20),
            pump(),
            dup(0),
            run(),
        ],
    ));
    // A 32 KiB SEND and READ at the 256-byte MTU: 128 packets, a full window, AckReq every
    // half window, a loss in the middle of it.
    v.push((
        "rc_full_window",
        setup(RC, FAITHFUL),
        vec![
            connect_with(|c| c.timeout = 8),
            recv(1, &[sge(7, 0, 32768)]),
            send(0, SEND, &[sge(7, 0, 32768)], whole.clone()),
            wire(0, 5, 49),
            drop_pkt(0),
            run(),
            send(0, READ, &[sge(7, 0, 32768)], remote(9, 0, 0)),
            deliver(0),
            wire(1, 5, 63),
            drop_pkt(1),
            run(),
            send(0, WRITE, &[sge(7, 0, 16384), sge(7, 0, 16384)], remote(9, 0, 0)),
            run(),
        ],
    ));
    v.push((
        "uc_large_messages",
        setup(UC, 0),
        vec![
            connect(),
            recv(1, &[sge(7, 0, 32768)]),
            send(0, SEND, &[sge(7, 0, 32768)], whole.clone()),
            send(0, WRITE_IMM, &[sge(7, 0, 32768)], remote(9, 0, 0)),
            recv(1, &[sge(1, 0, 8)]),
            pump(),
        ],
    ));
    v.push((
        "rc_timeout_retry_exceeded",
        setup(RC, FIXED_TIMERS),
        vec![
            connect_with(|c| {
                c.timeout = 5;
                c.retry = 2;
            }),
            recv(1, &[sge(1, 0, 512)]),
            send(0, SEND, &[sge(4, 0, 500)], whole.clone()),
            wire(0, 5, 10),
            drop_pkt(1),
            to_deadline(),
            to_deadline(),
            to_deadline(),
            to_deadline(),
            to_deadline(),
            run(),
        ],
    ));
    v.push((
        "rc_rnr_then_receive",
        setup(RC, FAITHFUL),
        vec![
            connect_with(|c| c.min_rnr = 3),
            send(0, SEND, &[sge(4, 0, 300)], whole.clone()),
            pump(),
            micros(100),
            recv(1, &[sge(1, 0, 512)]),
            run(),
        ],
    ));
    v.push((
        "rc_rnr_retry_exceeded",
        setup(RC, 0),
        vec![
            connect_with(|c| {
                c.rnr_retry = 1;
                c.min_rnr = 1;
            }),
            send(0, SEND, &[sge(4, 0, 300)], whole.clone()),
            run(),
        ],
    ));
    v.push((
        "rc_remote_access_errors",
        setup(RC, 0),
        vec![
            connect(),
            // Region 2 has no remote write: NAK, RemAccessErr, QP_ACCESS_ERR at the responder.
            send(0, WRITE, &[sge(4, 0, 100)], remote(2, 0, 0)),
            pump(),
            connect(),
            // Another PD.
            send(0, WRITE, &[sge(4, 0, 100)], remote(3, 0, 0)),
            pump(),
            connect(),
            // Out of bounds.
            send(0, READ, &[sge(4, 0, 100)], remote(0, 500, 0)),
            pump(),
        ],
    ));
    v.push((
        "rc_invalid_request",
        setup(RC, 0),
        vec![
            // QP 1 grants only local write: a READ is an invalid request.
            connect_with(|c| c.access = 1),
            send(0, READ, &[sge(4, 0, 100)], remote(4, 0, 0)),
            pump(),
            connect_with(|c| c.access = 1),
            recv(1, &[sge(1, 0, 100)]),
            // Too long for the receive: LocLenErr at the responder, a NAK at the requester.
            send(0, SEND, &[sge(4, 0, 300)], whole.clone()),
            pump(),
        ],
    ));
    v.push((
        "rc_local_errors",
        setup(RC, 0),
        vec![
            connect(),
            // An unknown lkey: LocProtErr, then everything behind it flushed.
            send(0, SEND, &[sge(6, 0, 100)], whole.clone()),
            send(0, SEND, &[sge(4, 0, 100)], whole.clone()),
            pump(),
            connect(),
            // A READ into a region without local write.
            send(0, READ, &[sge(2, 0, 100)], remote(4, 0, 0)),
            pump(),
            connect(),
            // A bind naming an unknown region.
            bind(0, 5, 0, 64, 2, 1),
            pump(),
            send(0, SEND, &[sge(4, 0, 100)], whole.clone()),
        ],
    ));
    v.push((
        "rc_memory_windows",
        setup(RC, 0),
        vec![
            connect(),
            // Node 0 binds its type 1 window over region 0 (write) and its type 2 window over
            // region 4 (write, atomic); QP 1 writes through them; QP 0 invalidates one, QP 1's
            // SEND with Invalidate the other.
            bind(0, 0, 64, 128, 2 | 1, 7),
            bind(1, 0, 256, 256, 2 | 4, 9),
            pump(),
            send(1, WRITE, &[sge(4, 0, 100)], remote(5, 0, 0)),
            send(1, WRITE, &[sge(4, 0, 100)], remote(6, 0, 0)),
            send(1, FETCH_ADD, &[sge(1, 0, 8)], remote(6, 8, 0)),
            pump(),
            recv(0, &[sge(1, 0, 100)]),
            send_with(1, SEND_INV, &[sge(4, 0, 16)], whole.clone(), |p| p.mw.mw = 1),
            pump(),
            bind(1, 0, 0, 64, 2, 11),
            local_inv(1),
            pump(),
            // The window is gone: the write is a remote access error.
            send(1, WRITE, &[sge(4, 0, 100)], remote(6, 0, 0)),
            pump(),
        ],
    ));
    v.push((
        "rc_sqd_and_drain",
        setup(RC, 0),
        vec![
            connect(),
            recv(1, &[sge(1, 0, 512)]),
            recv(1, &[sge(1, 0, 512)]),
            send(0, SEND, &[sge(4, 0, 512)], whole.clone()),
            deliver(0),
            state(0, SQD, true),
            send(0, SEND, &[sge(4, 0, 200)], whole.clone()),
            pump(),
            Action::Modify(Modify {
                qp: 0,
                state: SQD,
                mask: 1 | (1 << 9) | (1 << 10),
                timeout: 12,
                retry: 3,
                ..Modify::default()
            }),
            state(0, RTS, false),
            pump(),
            state(1, SQD, false),
            state(1, RTS, false),
            run(),
        ],
    ));
    v.push((
        "rc_state_change_mid_transfer",
        setup(RC, 0),
        vec![
            connect(),
            recv(1, &[sge(4, 0, 1024)]),
            send(0, SEND, &[sge(4, 0, 1024)], whole.clone()),
            send(0, READ, &[sge(1, 0, 512)], remote(4, 0, 0)),
            deliver(0),
            deliver(0),
            state(1, ERR, false),
            pump(),
            run(),
            connect(),
            recv(1, &[sge(4, 0, 1024)]),
            send(0, SEND, &[sge(4, 0, 1024)], whole.clone()),
            deliver(0),
            state(0, RESET, false),
            pump(),
            connect(),
            send(0, WRITE, &[sge(4, 0, 900)], remote(4, 0, 0)),
            deliver(0),
            connect_with(|c| c.qp = 1),
            pump(),
            run(),
            // Posts to a QP in ERR complete at once.
            state(0, ERR, false),
            send(0, SEND, &[sge(4, 0, 10)], whole.clone()),
            recv(0, &[sge(1, 0, 10)]),
        ],
    ));
    v.push((
        "rc_srq",
        setup(RC, SRQ1),
        vec![
            connect(),
            recv(1, &[sge(1, 0, 256)]),
            recv(1, &[sge(1, 256, 256)]),
            send(0, SEND, &[sge(4, 0, 200)], whole.clone()),
            send(0, SEND, &[sge(4, 0, 250)], whole.clone()),
            run(),
            send(0, SEND, &[sge(4, 0, 10)], whole.clone()),
            pump(),
            state(1, ERR, false),
        ],
    ));
    v.push((
        "rc_injected_naks",
        setup(RC, 0),
        vec![
            connect(),
            send(0, SEND, &[sge(4, 0, 1024)], whole.clone()),
            send(0, READ, &[sge(1, 0, 512)], remote(4, 0, 0)),
            // A sequence NAK, an RNR NAK, a duplicate ACK, then a remote operational error.
            ack(1, 0x60),
            ack(2, 0x20 | 4),
            micros(200),
            ack(0, 0x1F),
            inject(0, op_index(0x10), |i| {
                i.psn_base = 2;
                i.psn = 0xFFFF;
            }),
            ack(3, 0x63),
            pump(),
        ],
    ));
    v.push((
        "rc_injected_requests",
        setup(RC, 0),
        vec![
            connect(),
            recv(1, &[sge(1, 0, 512)]),
            // In-sequence WRITE, SEND, READ, atomics, then duplicates, a PSN past the hole and
            // a P_Key from another partition.
            inject(1, op_index(0x0A), |i| i.len = 100),
            inject(1, op_index(0x04), |i| i.len = 200),
            inject(1, op_index(0x0C), |i| i.reth = remote(4, 0, 1001)),
            inject(1, op_index(0x13), |i| i.swap = 9),
            inject(1, op_index(0x14), |i| i.swap = 1),
            inject(1, op_index(0x14), |i| {
                i.psn = 0xFFFF;
                i.swap = 1;
            }),
            inject(1, op_index(0x0C), |i| {
                i.psn = (-5i16) as u16 as u32;
                i.reth = remote(4, 0, 1001);
            }),
            inject(1, op_index(0x0A), |i| i.psn = 5),
            inject(1, op_index(0x0A), |i| i.bth = 4),
            inject(1, op_index(0x1D), |i| i.reth = remote(0, 32, 9)),
            inject(1, op_index(0x1C), |i| {
                i.reth = remote(0, 0, 65);
                i.feth_placement = 1;
            }),
            pump(),
        ],
    ));
    // Every opcode once at a freshly connected QP 1 with a receive posted: RC, then XRC.
    let every = |rx: Action| -> Vec<Action> {
        (0..softverbs_wire::OPCODE_TABLE.len() as u8)
            .flat_map(|k| [connect(), rx.clone(), inject(1, k, |i| i.len = 256)])
            .collect()
    };
    v.push(("rc_every_opcode", setup(RC, 0), every(recv(1, &[sge(1, 0, 512)]))));
    v.push((
        "xrc_every_opcode",
        setup(XRC, 0),
        every(recv_srq(1, 0, &[sge(1, 0, 512)])),
    ));
    // A responder in RTR: its first packet raises COMM_EST; then RTS by a plain modify.
    v.push((
        "rc_comm_est",
        setup(RC, 0),
        vec![
            connect_with(|c| c.qp = 0),
            connect_with(|c| {
                c.qp = 1;
                c.upto = 1;
            }),
            recv(1, &[sge(1, 0, 64)]),
            send(0, SEND, &[sge(4, 0, 64)], whole.clone()),
            pump(),
            Action::Modify(Modify {
                qp: 1,
                state: RTS,
                mask: 1 | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 13) | (1 << 16),
                sq_psn: 0xFF_FFF0,
                timeout: 14,
                max_rd: 2,
                ..Modify::default()
            }),
            send(1, READ, &[sge(1, 0, 256)], remote(0, 0, 0)),
            run(),
        ],
    ));
    v.push((
        "hostile_packets",
        setup(RC, IPV6),
        vec![
            connect(),
            recv(1, &[sge(1, 0, 512)]),
            send(0, SEND, &[sge(4, 0, 500)], whole.clone()),
            // A flipped bit: over IPv6 the ICRC drops it; refilled, the engine sees it.
            corrupt(0, 30, false),
            corrupt(0, 13, true),
            inject(1, op_index(0x04), |i| i.icrc = 3),
            inject(1, op_index(0x04), |i| i.dest = 7),
            Action::InjectRaw(InjectRaw {
                qp: 1,
                icrc: 1,
                data: vec![0x04, 0, 0xFF, 0xFF, 0, 0, 1, 0x22, 0, 0, 0, 0],
            }),
            Action::InjectRaw(InjectRaw {
                qp: 1,
                icrc: 0,
                data: vec![0xFF; 40],
            }),
            run(),
        ],
    ));
    v.push((
        "ipv4_unverified",
        setup(RC, 0),
        vec![
            connect(),
            recv(1, &[sge(1, 0, 512)]),
            send(0, SEND, &[sge(4, 0, 500)], whole.clone()),
            corrupt(0, 40, false),
            corrupt(0, 5, false),
            inject(1, op_index(0x04), |i| {
                i.icrc = 3;
                i.mut_pos = 3;
                i.mut_xor = 0x80;
            }),
            run(),
        ],
    ));
    // UC.
    v.push((
        "uc_transfers",
        setup(UC, 0),
        vec![
            connect(),
            recv(1, &[sge(4, 0, 1024)]),
            recv(1, &[sge(4, 0, 1024)]),
            recv(1, &[sge(4, 0, 1024)]),
            send(0, SEND, &[sge(4, 0, 1000)], whole.clone()),
            send(0, WRITE_IMM, &[sge(4, 0, 600)], remote(4, 0, 0)),
            send(0, WRITE, &[sge(4, 0, 600)], remote(0, 0, 0)),
            // A lost middle packet: the message is dropped, the next one resynchronises.
            deliver(0),
            drop_pkt(0),
            pump(),
            send(0, SEND, &[sge(4, 0, 100)], whole.clone()),
            dup(0),
            pump(),
            bind(1, 0, 0, 64, 2, 3),
            local_inv(1),
            state(0, SQE, false),
            send(0, SEND, &[sge(4, 0, 100)], whole.clone()),
            state(0, RTS, false),
            state(0, SQD, true),
            state(0, RTS, false),
            recv(1, &[sge(4, 0, 1024)]),
            pump(),
            state(1, RESET, false),
        ],
    ));
    // UD.
    v.push((
        "ud_datagrams",
        setup(UD, 0),
        vec![
            connect(),
            recv(1, &[sge(1, 0, 512)]),
            recv(1, &[sge(1, 0, 100)]),
            recv(1, &[sge(1, 0, 512)]),
            recv(0, &[sge(1, 0, 512)]),
            send(0, SEND, &[sge(4, 0, 400)], whole.clone()),
            send(0, SEND_IMM, &[sge(4, 0, 200)], whole.clone()),
            // Own Q_Key (top bit), an unknown Q_Key, an unknown QP, a datagram nobody routes.
            send_with(0, SEND, &[sge(4, 0, 10)], whole.clone(), |p| p.ud = 1 << 2),
            send_with(0, SEND, &[sge(4, 0, 10)], whole.clone(), |p| p.ud = 2 << 2),
            send_with(0, SEND, &[sge(4, 0, 10)], whole.clone(), |p| p.ud = 3),
            send_with(0, SEND, &[sge(4, 0, 10)], whole.clone(), |p| p.ud = 2 << 4),
            send(1, SEND, &[sge(4, 0, 10)], whole.clone()),
            pump(),
            inject(1, op_index(0x64), |i| i.bth = 4),
            inject(1, op_index(0x64), |i| i.qkey = 1),
            state(0, SQE, false),
            state(0, RTS, false),
            state(0, SQD, false),
            state(0, RTS, false),
            state(1, ERR, false),
            state(0, RESET, false),
        ],
    ));
    v.push((
        "ud_srq_ipv6",
        setup(UD, SRQ1 | IPV6),
        vec![
            connect(),
            recv(1, &[sge(1, 0, 512)]),
            recv(1, &[sge(4, 0, 100), sge(1, 0, 100)]),
            send(0, SEND, &[sge(4, 0, 140)], whole.clone()),
            send(0, SEND, &[sge(4, 0, 50)], whole.clone()),
            pump(),
            state(1, ERR, false),
        ],
    ));
    // XRC.
    v.push((
        "xrc_transfers",
        setup(XRC, FAITHFUL),
        vec![
            connect(),
            recv_srq(1, 0, &[sge(1, 0, 512)]),
            recv_srq(1, 1, &[sge(3, 0, 128)]),
            send(0, SEND, &[sge(4, 0, 500)], whole.clone()),
            send_with(0, SEND_IMM, &[sge(4, 0, 100)], whole.clone(), |p| p.xrc = 1),
            send(0, WRITE, &[sge(4, 0, 700)], remote(4, 0, 0)),
            send(0, READ, &[sge(1, 0, 500)], remote(4, 0, 0)),
            send(0, CMP_SWP, &[sge(1, 0, 8)], remote(0, 0, 0)),
            run(),
            // PD 2's SRQ with PD 1's region, then an SRQ outside the domain.
            send_with(0, WRITE, &[sge(4, 0, 100)], remote(4, 0, 0), |p| p.xrc = 1),
            pump(),
            connect(),
            send_with(0, SEND, &[sge(4, 0, 10)], whole.clone(), |p| p.xrc = 2),
            pump(),
            connect(),
            send(0, SEND, &[sge(4, 0, 10)], whole.clone()),
            run(),
            recv_srq(1, 0, &[sge(1, 0, 512)]),
            run(),
            state(0, SQD, true),
            pump(),
        ],
    ));
    v.push((
        "dereg_in_flight",
        setup(RC, 0),
        vec![
            connect(),
            send(0, READ, &[sge(4, 0, 1024)], remote(4, 0, 0)),
            deliver(0),
            Action::Dereg(Dereg { node: 0, region: 4 }),
            pump(),
            send(0, WRITE, &[sge(0, 0, 64)], remote(4, 0, 0)),
            Action::Dereg(Dereg { node: 1, region: 4 }),
            pump(),
        ],
    ));
    v.push((
        "modify_everything",
        setup(RC, 0),
        vec![
            Action::Modify(Modify {
                qp: 0,
                state: 1,
                mask: 1 | (1 << 3) | (1 << 4) | (1 << 5),
                access: 0xFF,
                port: 1,
                ..Modify::default()
            }),
            Action::Modify(Modify {
                qp: 0,
                state: 1,
                mask: 1 | (1 << 3) | (1 << 4) | (1 << 5),
                access: 0x0F,
                port: 1,
                ..Modify::default()
            }),
            Action::Modify(Modify {
                qp: 0,
                state: 2,
                mask: 1 | (1 << 7) | (1 << 8) | (1 << 12) | (1 << 15) | (1 << 17) | (1 << 20),
                mtu: 4,
                rq_psn: 0xFF_FFF0,
                max_dest_rd: 4,
                min_rnr: 31,
                ..Modify::default()
            }),
            Action::Modify(Modify {
                qp: 0,
                state: 3,
                cur_state: 2,
                mask: 1 | 2 | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 13) | (1 << 16),
                sq_psn: 0xFF_FFFE,
                timeout: 0,
                dest_qpn: 0,
                retry: 7,
                rnr_retry: 7,
                max_rd: 1,
                ..Modify::default()
            }),
            connect_with(|c| {
                c.qp = 1;
                c.mtu = 4;
                c.psn0 = 0xFF_FFFE;
            }),
            send(0, READ, &[sge(4, 0, 1024)], remote(4, 0, 0)),
            send(0, READ, &[sge(1, 0, 8)], remote(4, 0, 0)),
            pump(),
            tick(),
            micros(1000),
            run(),
        ],
    ));
    v
}

/// Inputs that made the engine break an invariant, written out as scripts (each has a test of
/// its own in `crates/engine/tests/fuzz_regressions.rs`).
fn regressions() -> Vec<(&'static str, Setup, Vec<Action>)> {
    let mut v = Vec::new();
    v.push((
        "duplicate_read_past_the_address_space",
        setup(RC, 0),
        vec![
            connect(),
            // A zero-length READ checks no key or address; its duplicate asks for more.
            inject(1, op_index(0x0C), |i| i.reth = remote(0x18, 3, 1)),
            inject(1, op_index(0x0C), |i| {
                i.psn = 0xFFFF;
                i.reth = remote(0x18, 3, 100);
            }),
            pump(),
        ],
    ));
    v.push((
        "read_response_scattered_past_the_end_of_memory",
        setup(RC, 0),
        vec![
            connect(),
            // The local entry lies 100 bytes below the top of the address space; the second
            // response, placed first, lands 256 bytes into it.
            send(0, READ, &[sge(0x10, 100, 512)], remote(4, 0, 0)),
            deliver(0),
            drop_pkt(1),
            deliver(1),
            pump(),
        ],
    ));
    v.push((
        "read_resumed_at_the_top_of_memory",
        setup(RC, 0),
        vec![
            connect_with(|c| c.timeout = 8),
            // A READ of the last 10 bytes of the address space and beyond; the request is
            // lost, a forged first response arrives, the timer resumes it at byte 256.
            send(0, READ, &[sge(4, 0, 512)], remote(0x10, 10, 0)),
            drop_pkt(0),
            inject(0, op_index(0x0D), |i| {
                i.psn_base = 3;
                i.len = 256;
            }),
            to_deadline(),
            pump(),
        ],
    ));
    v
}

fn main() -> std::io::Result<()> {
    // `ONLY=<name>` runs one script (with `QP_FUZZ_TRACE=1`, step by step); `VERBOSE=1` prints
    // what each reached.
    let only = std::env::var("ONLY").ok();
    let mut total = qp_fuzz::Coverage::default();
    for (dir, set) in [
        ("corpus/engine_qp", scripts()),
        ("regressions/engine_qp", regressions()),
    ] {
        let dir = Path::new(dir);
        fs::create_dir_all(dir)?;
        for (name, setup, actions) in set {
            if only.as_deref().is_some_and(|o| o != name) {
                continue;
            }
            let bytes = encode(&setup, &actions);
            let cov = qp_fuzz::run(&bytes);
            if std::env::var_os("VERBOSE").is_some() {
                println!(
                    "{name}: {:?} {:?} {:?}",
                    cov.completions, cov.events, cov.counters
                );
            }
            total.merge(&cov);
            fs::write(dir.join(name), &bytes)?;
        }
    }
    println!("{total:?}");
    Ok(())
}
