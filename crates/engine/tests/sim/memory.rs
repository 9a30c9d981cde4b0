//! Registered memory: regions, windows and the checks an HCA makes.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use softverbs_engine::memory::{AtomicOp, KeyRef, MemError, Memory};
use softverbs_engine::mw::{key_index, MrInfo, MwBind, MwType, Window};
use softverbs_engine::types::{AccessFlags, Sge};
use softverbs_engine::wr::RemoteAddr;

/// One registered memory region, as `ibv_reg_mr` returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mr {
    pub lkey: u32,
    pub rkey: u32,
    pub pd: u32,
    pub access: AccessFlags,
    pub addr: u64,
    pub len: u64,
}

impl Mr {
    /// An SGE over `len` bytes at `offset` into the region.
    pub fn sge(&self, offset: u64, len: u32) -> Sge {
        Sge {
            addr: self.addr + offset,
            length: len,
            lkey: self.lkey,
        }
    }

    /// The remote address of `offset` into the region.
    pub fn remote(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr + offset,
            rkey: self.rkey,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Region {
    mr: Mr,
    valid: bool,
}

/// A node's memory: one growing byte array at a node-specific base address, and the table of
/// regions registered over it. Every access is checked as an HCA checks it.
#[derive(Debug)]
pub struct SimMemory {
    base: u64,
    bytes: RefCell<Vec<u8>>,
    regions: RefCell<Vec<Region>>,
    /// Memory windows, by key index.
    windows: RefCell<BTreeMap<u32, Window>>,
    key_salt: u32,
    /// Accesses refused, by reason (for tests that assert a check happened).
    pub refused: RefCell<Vec<MemError>>,
    /// Atomics executed.
    pub atomics: Cell<u64>,
    /// FLUSHes executed.
    pub flushes: Cell<u64>,
    /// Payloads may stay here for the receiver to fetch ([`Memory::locate`] answers).
    pub external: Cell<bool>,
}

impl SimMemory {
    pub fn new(node: usize) -> Self {
        Self {
            // Distinct per node, so an address used on the wrong node fails loudly.
            base: 0x10_0000_0000 + (node as u64) * 0x1_0000_0000,
            bytes: RefCell::new(Vec::new()),
            regions: RefCell::new(Vec::new()),
            windows: RefCell::new(BTreeMap::new()),
            key_salt: 0x5A00_0000 ^ ((node as u32) << 16),
            refused: RefCell::new(Vec::new()),
            atomics: Cell::new(0),
            flushes: Cell::new(0),
            external: Cell::new(false),
        }
    }

    /// Allocates `len` zeroed bytes, 64-byte aligned; returns the address.
    pub fn alloc(&self, len: u64) -> u64 {
        let mut b = self.bytes.borrow_mut();
        let start = b.len().next_multiple_of(64);
        b.resize(start + len as usize, 0);
        self.base + start as u64
    }

    /// Registers `[addr, addr + len)` (as `ibv_reg_mr`). Remote write or atomic access needs
    /// local write too, as the verbs require.
    pub fn reg(&self, pd: u32, addr: u64, len: u64, access: AccessFlags) -> Mr {
        assert!(
            access.contains(AccessFlags::LOCAL_WRITE)
                || !access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC),
            "ibv_reg_mr: REMOTE_WRITE/REMOTE_ATOMIC need LOCAL_WRITE (EINVAL)"
        );
        assert!(addr >= self.base && addr + len <= self.base + self.bytes.borrow().len() as u64);
        let mut regions = self.regions.borrow_mut();
        let n = regions.len() as u32 + 1;
        let lkey = self.key_salt | (n << 4) | 0x1;
        let rkey = self.key_salt | (n << 4) | 0x2;
        let mr = Mr {
            lkey,
            rkey,
            pd,
            access,
            addr,
            len,
        };
        regions.push(Region { mr, valid: true });
        mr
    }

    /// Allocates and registers a region.
    pub fn alloc_mr(&self, pd: u32, len: u64, access: AccessFlags) -> Mr {
        let addr = self.alloc(len);
        self.reg(pd, addr, len, access)
    }

    /// Deregisters a region: its keys stop working.
    pub fn dereg(&self, mr: &Mr) {
        for r in self.regions.borrow_mut().iter_mut() {
            if r.mr.lkey == mr.lkey {
                r.valid = false;
            }
        }
    }

    /// Allocates a memory window (as `ibv_alloc_mw`); returns its rkey.
    pub fn alloc_mw(&self, pd: u32, mw_type: MwType) -> u32 {
        let mut w = self.windows.borrow_mut();
        // Window keys have the top bit set: region keys never do, so the two cannot collide.
        let rkey = 0x8000_0000 | (self.key_salt & 0x00FF_0000) | ((w.len() as u32 + 1) << 8);
        w.insert(key_index(rkey), Window::new(mw_type, pd, rkey));
        rkey
    }

    /// A window's state, by any of its keys.
    pub fn window(&self, rkey: u32) -> Window {
        self.windows.borrow()[&key_index(rkey)]
    }

    /// Reads memory directly (the application's view).
    pub fn peek(&self, addr: u64, len: usize) -> Vec<u8> {
        let off = (addr - self.base) as usize;
        self.bytes.borrow()[off..off + len].to_vec()
    }

    /// Writes memory directly (the application's view).
    pub fn poke(&self, addr: u64, data: &[u8]) {
        let off = (addr - self.base) as usize;
        self.bytes.borrow_mut()[off..off + data.len()].copy_from_slice(data);
    }

    pub fn peek_u64(&self, addr: u64) -> u64 {
        u64::from_ne_bytes(self.peek(addr, 8).try_into().unwrap())
    }

    pub fn poke_u64(&self, addr: u64, v: u64) {
        self.poke(addr, &v.to_ne_bytes());
    }

    /// Finds the region for `key` and checks PD, right and bounds; returns the byte offset.
    fn resolve(&self, key: KeyRef, addr: u64, len: u64) -> Result<usize, MemError> {
        let result = (|| {
            if key.access.is_remote() && key.key & 0x8000_0000 != 0 {
                // A window: its rules, then the region it is bound to (bound regions stay).
                let w = *self
                    .windows
                    .borrow()
                    .get(&key_index(key.key))
                    .ok_or(MemError::BadKey)?;
                let (lkey, iova) = w.resolve(key, addr, len)?;
                if !self.regions.borrow().iter().any(|r| r.valid && r.mr.lkey == lkey) {
                    return Err(MemError::BadKey);
                }
                // Sim regions are addressed by their virtual address (iova = addr).
                return Ok((iova - self.base) as usize);
            }
            let regions = self.regions.borrow();
            let r = regions
                .iter()
                .find(|r| {
                    r.valid
                        && if key.access.is_remote() {
                            r.mr.rkey == key.key
                        } else {
                            r.mr.lkey == key.key
                        }
                })
                .ok_or(MemError::BadKey)?;
            if r.mr.pd != key.pd {
                return Err(MemError::WrongPd);
            }
            if !r.mr.access.contains(key.access.required_flags()) {
                return Err(MemError::NoAccess);
            }
            if len == WHOLE_REGION {
                return Ok((r.mr.addr - self.base) as usize);
            }
            let end = addr.checked_add(len).ok_or(MemError::OutOfRange)?;
            if addr < r.mr.addr || end > r.mr.addr + r.mr.len {
                return Err(MemError::OutOfRange);
            }
            Ok((addr - self.base) as usize)
        })();
        if let Err(e) = result {
            self.refused.borrow_mut().push(e);
        }
        result
    }
}

impl Memory for SimMemory {
    fn read(&self, key: KeyRef, addr: u64, dst: &mut [u8]) -> Result<(), MemError> {
        let off = self.resolve(key, addr, dst.len() as u64)?;
        dst.copy_from_slice(&self.bytes.borrow()[off..off + dst.len()]);
        Ok(())
    }

    fn write(&self, key: KeyRef, addr: u64, src: &[u8]) -> Result<(), MemError> {
        let off = self.resolve(key, addr, src.len() as u64)?;
        self.bytes.borrow_mut()[off..off + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn check(&self, key: KeyRef, addr: u64, len: u64) -> Result<(), MemError> {
        self.resolve(key, addr, len).map(|_| ())
    }

    fn locate(&self, key: KeyRef, addr: u64, len: u64) -> Result<Option<u64>, MemError> {
        let off = self.resolve(key, addr, len)?;
        Ok(self.external.get().then_some(self.base + off as u64))
    }

    fn atomic(&self, key: KeyRef, addr: u64, op: AtomicOp) -> Result<u64, MemError> {
        if addr % 8 != 0 {
            self.refused.borrow_mut().push(MemError::Misaligned);
            return Err(MemError::Misaligned);
        }
        let off = self.resolve(key, addr, 8)?;
        let mut b = self.bytes.borrow_mut();
        let old = u64::from_ne_bytes(b[off..off + 8].try_into().unwrap());
        b[off..off + 8].copy_from_slice(&op.apply(old).to_ne_bytes());
        self.atomics.set(self.atomics.get() + 1);
        Ok(old)
    }

    fn bind_mw(&self, qpn: u32, pd: u32, bind: &MwBind) -> Result<(), MemError> {
        let mut windows = self.windows.borrow_mut();
        let w = windows
            .get_mut(&key_index(bind.mw_rkey))
            .ok_or(MemError::BadKey)?;
        let mr = self
            .regions
            .borrow()
            .iter()
            .find(|r| r.valid && r.mr.lkey == bind.mr_lkey)
            .map(|r| MrInfo {
                pd: r.mr.pd,
                access: r.mr.access,
                iova: r.mr.addr,
                length: r.mr.len,
            });
        let result = w.check_bind(qpn, pd, bind, mr.as_ref());
        match result {
            Ok(target) => {
                w.apply_bind(bind, target);
                Ok(())
            }
            Err(e) => {
                self.refused.borrow_mut().push(e);
                Err(e)
            }
        }
    }

    fn invalidate(&self, qpn: u32, pd: u32, rkey: u32) -> Result<(), MemError> {
        let mut windows = self.windows.borrow_mut();
        let w = windows.get_mut(&key_index(rkey)).ok_or(MemError::BadKey)?;
        if let Err(e) = w.check_invalidate(qpn, pd, rkey) {
            self.refused.borrow_mut().push(e);
            return Err(e);
        }
        w.invalidate();
        Ok(())
    }

    fn flush(&self, key: KeyRef, addr: u64, len: u64, whole_region: bool) -> Result<(), MemError> {
        self.resolve(key, addr, if whole_region { WHOLE_REGION } else { len })?;
        self.flushes.set(self.flushes.get() + 1);
        Ok(())
    }
}

/// A length `resolve` takes as "the whole region, any address" (a FLUSH of the whole MR).
const WHOLE_REGION: u64 = u64::MAX;
