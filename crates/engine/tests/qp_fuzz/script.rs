//! The byte format of a fuzz script: a [`Setup`] and then [`Action`]s until the bytes run out.
//!
//! Every structure has one `io` method that either reads itself from the bytes (missing bytes
//! read as zero) or appends itself to them, so the fuzzer's decoder and the corpus generator's
//! encoder cannot disagree. Fields are raw bytes and words; the harness maps them onto meaningful
//! choices (a region, a PSN near the expected one, a state) by taking them modulo the number of
//! choices, so nearly every mutation is still a meaningful script.

/// Reads or writes the fields of a script, in order.
pub(crate) trait Io {
    /// Whether fields are being read (and must be overwritten).
    fn reading(&self) -> bool;
    fn u8(&mut self, v: &mut u8);
    fn u16(&mut self, v: &mut u16) {
        let mut b = v.to_le_bytes();
        self.u8(&mut b[0]);
        self.u8(&mut b[1]);
        *v = u16::from_le_bytes(b);
    }
    fn u32(&mut self, v: &mut u32) {
        let mut b = v.to_le_bytes();
        for x in &mut b {
            self.u8(x);
        }
        *v = u32::from_le_bytes(b);
    }
    fn u64(&mut self, v: &mut u64) {
        let mut b = v.to_le_bytes();
        for x in &mut b {
            self.u8(x);
        }
        *v = u64::from_le_bytes(b);
    }
    /// A byte string of at most 255 bytes, length first.
    fn bytes(&mut self, v: &mut Vec<u8>) {
        let mut n = v.len().min(255) as u8;
        self.u8(&mut n);
        if self.reading() {
            v.clear();
            v.resize(usize::from(n), 0);
        }
        for x in v.iter_mut().take(usize::from(n)) {
            self.u8(x);
        }
    }
}

/// Reads a script from fuzz bytes.
pub(crate) struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    pub(crate) fn done(&self) -> bool {
        self.pos >= self.data.len()
    }
}

impl Io for Reader<'_> {
    fn reading(&self) -> bool {
        true
    }

    fn u8(&mut self, v: &mut u8) {
        *v = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
    }
}

/// Writes a script (the corpus generator).
#[derive(Default)]
pub(crate) struct Writer(pub(crate) Vec<u8>);

impl Io for Writer {
    fn reading(&self) -> bool {
        false
    }

    fn u8(&mut self, v: &mut u8) {
        self.0.push(*v);
    }
}

/// Encodes a whole script.
pub(crate) fn encode(setup: &Setup, actions: &[Action]) -> Vec<u8> {
    let mut w = Writer::default();
    setup.clone().io(&mut w);
    for a in actions {
        a.clone().io(&mut w);
    }
    w.0
}

macro_rules! fields {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $f:ident : $t:tt),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub(crate) struct $name { $($(#[$fm])* pub(crate) $f: fields!(@ty $t)),* }
        impl $name {
            pub(crate) fn io<I: Io>(&mut self, io: &mut I) {
                $(fields!(@io io, self.$f, $t);)*
            }
        }
    };
    (@ty u8) => { u8 };
    (@ty u16) => { u16 };
    (@ty u32) => { u32 };
    (@ty u64) => { u64 };
    (@ty bytes) => { Vec<u8> };
    (@ty $t:ident) => { $t };
    (@io $io:ident, $e:expr, u8) => { $io.u8(&mut $e) };
    (@io $io:ident, $e:expr, u16) => { $io.u16(&mut $e) };
    (@io $io:ident, $e:expr, u32) => { $io.u32(&mut $e) };
    (@io $io:ident, $e:expr, u64) => { $io.u64(&mut $e) };
    (@io $io:ident, $e:expr, bytes) => { $io.bytes(&mut $e) };
    (@io $io:ident, $e:expr, $t:ident) => { $e.io($io) };
}

fields! {
    /// What the two QPs are and how they are reached.
    Setup {
        /// 0 RC, 1 UC, 2 UD, 3 XRC (an XRC_SEND on node 0, an XRC_RECV on node 1).
        transport: u8,
        /// Bit 0: IPv6 GIDs (a bad ICRC is then dropped; over IPv4 the device cannot verify
        /// every ICRC and delivers a mismatch as unverified). Bit 1: `sq_sig_all`. Bit 2: QP 1
        /// receives from an SRQ; bit 3: QP 0 does (not XRC). Bit 4: configured timers only
        /// (`set_adaptive_retransmit(false)`, as for a lossless carrier).
        flags: u8,
    }
}

fields! {
    /// A scatter/gather entry. `region`'s low nibble picks the key (modulo 8: regions 0..=4, an
    /// rkey used as lkey, an unknown key, region 5), its high nibble the address (modulo 4: the key's
    /// region plus `off` (signed), the top of the address space minus `off`, `off` itself, the
    /// next region plus `off`).
    SgeSpec { region: u8, off: u16, len: u32 }
}

fields! {
    /// A remote address. `region`'s low nibble picks the key (modulo 10: regions 0..=4, window
    /// 0 or 1, an lkey used as rkey, an unknown key, region 5), its high nibble the address as for
    /// [`SgeSpec`] (a window's base is its first byte, or 0 if zero-based).
    RemoteSpec { region: u8, off: u16, len: u32 }
}

fields! {
    /// A memory window bind: window (bit 2: an unknown window), region (modulo 7: regions
    /// 0..=4, an unknown key, region 5), range, rights, tag.
    MwSpec { mw: u8, region: u8, off: u16, len: u16, access: u8, tag: u8 }
}

fields! {
    /// RESET (if needed) -> INIT -> RTR -> RTS, with exactly the required attributes.
    Connect {
        /// 0, 1, or both (PSNs then matched).
        qp: u8,
        /// 0 INIT, 1 RTR, otherwise RTS.
        upto: u8,
        mtu: u8,
        /// Send PSN of QP 0 and of QP 1.
        psn0: u32,
        psn1: u32,
        timeout: u8,
        retry: u8,
        rnr_retry: u8,
        min_rnr: u8,
        max_rd: u8,
        max_dest_rd: u8,
        access: u8,
        qkey: u32,
    }
}

fields! {
    /// Any `ibv_modify_qp`, validated by the engine's state table as the device does.
    Modify {
        qp: u8,
        state: u8,
        cur_state: u8,
        mask: u32,
        access: u8,
        pkey_index: u8,
        port: u8,
        qkey: u32,
        /// 0 the peer's GID, 1 our own, 2 zero, 3 multicast, otherwise an unknown unicast.
        dgid: u8,
        sgid_index: u8,
        mtu: u8,
        timeout: u8,
        retry: u8,
        rnr_retry: u8,
        rq_psn: u32,
        sq_psn: u32,
        max_rd: u8,
        max_dest_rd: u8,
        min_rnr: u8,
        /// Even: the peer's QP number; odd: `sq_psn` as a number.
        dest_qpn: u8,
        notify: u8,
        mig: u8,
    }
}

fields! {
    /// A modify with only the state (SQD with the drain notification if `notify` is odd). SQE
    /// is forced from RTS for UC and UD, as an HCA enters it on a send error (the engine never
    /// does: its send errors go to ERR, as rxe's).
    SetState { qp: u8, state: u8, notify: u8 }
}

fields! {
    /// `ibv_post_send` of any opcode, checked as the device checks it.
    PostSend {
        qp: u8,
        /// Modulo 12: SEND, SEND_WITH_IMM, SEND_WITH_INV, WRITE, WRITE_WITH_IMM, READ,
        /// CMP_AND_SWP, FETCH_AND_ADD, BIND_MW, LOCAL_INV, ATOMIC_WRITE, FLUSH.
        op: u8,
        /// Bit 0 FENCE, 1 SIGNALED, 2 SOLICITED, 3 INLINE.
        flags: u8,
        nsge: u8,
        sge0: SgeSpec,
        sge1: SgeSpec,
        sge2: SgeSpec,
        sge3: SgeSpec,
        remote: RemoteSpec,
        imm: u32,
        /// Compare, add or swap operand, the ATOMIC WRITE value, FLUSH placement and
        /// selectivity (low bits).
        value: u64,
        compare: u64,
        /// UD destination: bits 0-1 QPN (peer, own, multicast, unknown), 2-3 Q_Key (peer's,
        /// the QP's own, unknown), 4-5 GID (peer, own, unknown).
        ud: u8,
        /// XRC SRQ: 0 and 1 the target's SRQs, 2 unknown, 3 none.
        xrc: u8,
        mw: MwSpec,
        /// Inline data: length and fill byte.
        inline_len: u8,
        fill: u8,
    }
}

fields! {
    /// `ibv_post_recv` (or `ibv_post_srq_recv` for QPs on an SRQ; for XRC, SRQ `srq` of the
    /// target).
    PostRecv { qp: u8, nsge: u8, sge0: SgeSpec, sge1: SgeSpec, sge2: SgeSpec, sge3: SgeSpec, srq: u8 }
}

fields! {
    /// The network between the QPs: what happens to the oldest packet QP `dir` sent.
    WireOp {
        dir: u8,
        /// Modulo 7: deliver, drop, deliver a copy, move to the back, corrupt a byte then
        /// deliver (ICRC refilled if `count` is odd), deliver `count % 64 + 1`, deliver both
        /// ways until both are quiet.
        op: u8,
        pos: u16,
        xor: u8,
        count: u8,
    }
}

fields! {
    /// A packet built with the wire reprs, then mutated, delivered to QP `qp`.
    Inject {
        qp: u8,
        /// Index into the opcode table.
        opcode: u8,
        /// Modulo 5: the receive PSN the QP should expect next, its `rq_psn`, the next PSN it
        /// sends, the first it sent, raw. `psn` is then a signed 16-bit delta (raw: the PSN).
        psn_base: u8,
        psn: u32,
        /// Modulo 8: 7 is an unknown destination QP; otherwise the QP's number.
        dest: u8,
        /// Bit 0 AckReq, 1 solicited, 2 a foreign P_Key, 3 MigReq, 4 FECN, 5 BECN.
        bth: u8,
        /// RETH target (in the receiving node's memory); `len` 0 means the payload length,
        /// otherwise `len - 1`.
        reth: RemoteSpec,
        aeth: u8,
        msn: u32,
        /// Atomic ETH target.
        atomic: RemoteSpec,
        swap: u64,
        compare: u64,
        /// DETH: Q_Key (even: the QP's own), source QPN (even: the peer's).
        qkey: u8,
        src_qpn: u32,
        /// XRCETH: 0 and 1 the target's SRQs, otherwise unknown.
        xrc: u8,
        /// IETH: 0 and 1 the node's windows, 2 a region's rkey, otherwise unknown.
        ieth: u8,
        imm: u32,
        feth_placement: u8,
        feth_select: u8,
        /// Payload length modulo path MTU + 65 (bit 15 set: ATOMIC WRITE takes it as is,
        /// otherwise 8 bytes), and fill byte.
        len: u16,
        fill: u8,
        /// A byte flipped after emitting (`mut_xor` 0: none).
        mut_pos: u16,
        mut_xor: u8,
        /// Modulo 4: 3 leaves the ICRC zero; otherwise it is filled in.
        icrc: u8,
    }
}

fields! {
    /// Arbitrary bytes delivered to QP `qp` (ICRC filled in if `icrc` is odd).
    InjectRaw { qp: u8, icrc: u8, data: bytes }
}

fields! {
    /// Time passes. Modulo 6: `amount` ns, us, 100 us; to the next deadline; a spurious
    /// `handle_timeout` without time passing; run the network and the timers until quiet.
    Advance { mode: u8, amount: u16 }
}

fields! {
    /// `ibv_dereg_mr` of a region of node `node`.
    Dereg { node: u8, region: u8 }
}

/// One step of a script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    Connect(Connect),
    Modify(Modify),
    SetState(SetState),
    PostSend(PostSend),
    PostRecv(PostRecv),
    Wire(WireOp),
    Inject(Inject),
    InjectRaw(InjectRaw),
    Advance(Advance),
    Dereg(Dereg),
}

impl Action {
    const KINDS: u8 = 10;

    fn tag(&self) -> u8 {
        match self {
            Self::Connect(_) => 0,
            Self::Modify(_) => 1,
            Self::SetState(_) => 2,
            Self::PostSend(_) => 3,
            Self::PostRecv(_) => 4,
            Self::Wire(_) => 5,
            Self::Inject(_) => 6,
            Self::InjectRaw(_) => 7,
            Self::Advance(_) => 8,
            Self::Dereg(_) => 9,
        }
    }

    pub(crate) fn io<I: Io>(&mut self, io: &mut I) {
        let mut tag = self.tag();
        io.u8(&mut tag);
        if io.reading() {
            *self = match tag % Self::KINDS {
                0 => Self::Connect(Connect::default()),
                1 => Self::Modify(Modify::default()),
                2 => Self::SetState(SetState::default()),
                3 => Self::PostSend(PostSend::default()),
                4 => Self::PostRecv(PostRecv::default()),
                5 => Self::Wire(WireOp::default()),
                6 => Self::Inject(Inject::default()),
                7 => Self::InjectRaw(InjectRaw::default()),
                8 => Self::Advance(Advance::default()),
                _ => Self::Dereg(Dereg::default()),
            };
        }
        match self {
            Self::Connect(a) => a.io(io),
            Self::Modify(a) => a.io(io),
            Self::SetState(a) => a.io(io),
            Self::PostSend(a) => a.io(io),
            Self::PostRecv(a) => a.io(io),
            Self::Wire(a) => a.io(io),
            Self::Inject(a) => a.io(io),
            Self::InjectRaw(a) => a.io(io),
            Self::Advance(a) => a.io(io),
            Self::Dereg(a) => a.io(io),
        }
    }
}
