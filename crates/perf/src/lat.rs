//! Latency runs: one operation at a time. SEND and WRITE are ping-pongs between the two sides
//! (WRITE as perftest does it: each side polls the last byte of the buffer the peer writes);
//! READ and atomics are single outstanding round trips from the client.

use std::time::Instant;

use softverbs::{SendRequest, WcOpcode, WorkCompletion};

use crate::bw::{check_wc, SqTrack, Watchdog, STALL};
use crate::cli::TestKind;
use crate::endpoint::{split_wr_id, Endpoint, Info};
use crate::error::{bail, Result};

/// The ping-pong counter of iteration `i`: never 0 (the cleared buffer) and different from
/// the previous iteration's.
pub(crate) fn counter(i: u64) -> u8 {
    (i % 255) as u8 + 1
}

/// One side of a latency run; also used by the server for the ping-pong tests.
pub(crate) struct Pinger<'a> {
    ep: &'a mut Endpoint,
    remote: &'a Info,
    size: usize,
    sq: SqTrack,
    wcs: Vec<WorkCompletion>,
    /// Receive completions not yet consumed by `wait_recv`.
    recvs: u64,
    /// Whether the READ/atomic in flight has completed.
    op_done: bool,
    /// Length of a received message that was not `size`.
    pub(crate) bad_len: Option<u32>,
    dog: Watchdog,
    /// The request posted each time, built once (see [`Endpoint::refill`]).
    wr: Option<SendRequest>,
}

impl<'a> Pinger<'a> {
    pub(crate) fn new(ep: &'a mut Endpoint, remote: &'a Info, size: usize) -> Self {
        Self {
            ep,
            remote,
            size,
            sq: SqTrack::default(),
            wcs: vec![WorkCompletion::default(); 16],
            recvs: 0,
            op_done: false,
            bad_len: None,
            wr: None,
            dog: Watchdog::new(STALL),
        }
    }

    /// Polls the CQ once (which also drives the device), recording what completed.
    fn poll(&mut self) -> Result<()> {
        let k = self.ep.poll(&mut self.wcs)?;
        if k == 0 {
            return self.dog.check("waiting for the peer (a lost UC message?)");
        }
        for wc in &self.wcs[..k] {
            check_wc(self.ep, wc)?;
            if wc.opcode == WcOpcode::Recv {
                self.recvs += 1;
                self.ep.recvs_posted[0] -= 1;
                if wc.byte_len as usize != self.size {
                    self.bad_len.get_or_insert(wc.byte_len);
                }
            } else {
                let (_, idx) = split_wr_id(wc.wr_id);
                self.sq.done = self.sq.done.max(idx + 1);
                self.op_done = true;
            }
        }
        Ok(())
    }

    /// Posts the next operation; `counter` for write ping-pong. Every `cq_mod`-th WR is
    /// signaled (READ and atomics always are, the client waits for them).
    fn post(&mut self, counter: Option<u8>) -> Result<()> {
        let depth = u64::from(self.ep.params.tx_depth);
        while self.sq.outstanding() >= depth {
            self.poll()?;
        }
        let always = matches!(self.ep.params.test, TestKind::Read | TestKind::Atomic);
        let cq_mod = u64::from(self.ep.params.cq_mod.max(1));
        let k = self.sq.posted;
        let signaled = always || (k + 1) % cq_mod == 0;
        let wr = match &mut self.wr {
            Some(wr) => {
                self.ep
                    .refill(wr, self.remote, 0, k, self.size, signaled, counter)?;
                wr
            }
            none => none.insert(self.ep.request(self.remote, 0, k, self.size, signaled, counter)?),
        };
        self.op_done = false;
        self.ep.qps[0].post_send(std::slice::from_ref(wr))?;
        self.sq.posted += 1;
        Ok(())
    }

    fn wait_recv(&mut self) -> Result<()> {
        while self.recvs == 0 {
            self.poll()?;
        }
        self.recvs -= 1;
        self.dog.progress();
        Ok(())
    }

    fn wait_byte(&mut self, v: u8) -> Result<()> {
        while self.ep.dst_last_byte(self.size) != v {
            self.poll()?;
        }
        self.dog.progress();
        Ok(())
    }

    fn wait_op(&mut self) -> Result<()> {
        while !self.op_done {
            self.poll()?;
        }
        self.dog.progress();
        Ok(())
    }

    /// The client: `iters` timed iterations; returns each one's round trip in nanoseconds.
    pub(crate) fn client(&mut self, iters: u64) -> Result<Vec<f64>> {
        let mut samples = Vec::with_capacity(iters as usize);
        let test = self.ep.params.test;
        for i in 0..iters {
            let t0 = Instant::now();
            match test {
                // The receive is posted again within the iteration, as perftest's loop does
                // (its samples are the times between consecutive sends).
                TestKind::Send => {
                    self.post(None)?;
                    self.wait_recv()?;
                    self.ep.fill_recvs(0, 1)?;
                }
                TestKind::Write => {
                    let v = counter(i);
                    self.post(Some(v))?;
                    self.wait_byte(v)?;
                }
                TestKind::Read | TestKind::Atomic => {
                    self.post(None)?;
                    self.wait_op()?;
                }
            }
            samples.push(t0.elapsed().as_nanos() as f64);
        }
        self.finish()?;
        Ok(samples)
    }

    /// The server of a SEND or WRITE ping-pong: answers `iters` messages.
    pub(crate) fn server(&mut self, iters: u64) -> Result<()> {
        let test = self.ep.params.test;
        for i in 0..iters {
            match test {
                TestKind::Send => {
                    self.wait_recv()?;
                    self.ep.fill_recvs(0, 1)?;
                    self.post(None)?;
                }
                TestKind::Write => {
                    let v = counter(i);
                    self.wait_byte(v)?;
                    self.post(Some(v))?;
                }
                _ => bail!("the server has no part in a {} latency test", test.name()),
            }
        }
        self.finish()
    }

    /// Waits until every signaled WR has completed, so the send queue is quiet for the next
    /// run; puts the pattern back where write ping-pong put its counter.
    fn finish(&mut self) -> Result<()> {
        // Unsignaled WRs at the tail complete without notice; the last signaled one is enough.
        let cq_mod = u64::from(self.ep.params.cq_mod.max(1));
        let always = matches!(self.ep.params.test, TestKind::Read | TestKind::Atomic);
        let last_signaled = if always {
            self.sq.posted
        } else {
            self.sq.posted / cq_mod * cq_mod
        };
        while self.sq.done < last_signaled {
            self.poll()?;
        }
        if self.ep.params.test == TestKind::Write && self.size as u32 > self.ep.params.inline {
            self.ep.restore_src(self.size)?;
        }
        Ok(())
    }
}
