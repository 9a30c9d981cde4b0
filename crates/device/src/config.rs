//! Device configuration: which interfaces become devices, the UDP port and the resource limits.
//!
//! With no configuration every interface with an IP address becomes a device. The environment
//! variables below override that; they are read by [`Config::from_env`].
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `SOFTVERBS_INTERFACES` | comma-separated interface names that become devices | every interface with an address |
//! | `SOFTVERBS_UDP_PORT` | UDP port of RoCEv2 | 4791 |
//! | `SOFTVERBS_UDP_SLOTS` | how many ports above it processes may take, one each (1..=255); a process that finds none free cannot create QPs (ENOMEM) | 255 |
//! | `SOFTVERBS_LIMITS` | comma-separated `name=value` overrides of [`Limits`] fields, e.g. `max_qp=64,max_cqe=1024` | see [`Limits::default`] |
//! | `SOFTVERBS_SHM` | `0` turns off the shared-memory driver between processes of one user on one host (read when the process starts its drivers) | on |
//! | `SOFTVERBS_GSO` | runs of equal-sized packets to one destination leave as one UDP GSO send, which the kernel (or the NIC) cuts into the datagrams single sends would give, their IPv4 IDs numbered 0, 1, ... as the ICRCs assume; by default towards every destination; `loopback`: only towards loopback addresses; `0`: never, one datagram per packet in `sendmmsg` calls (read when the process starts its drivers) | every destination |
//! | `SOFTVERBS_CM_RESPONSE_TIMEOUT`, `SOFTVERBS_CM_RETRIES`, `SOFTVERBS_CM_PACKET_LIFETIME` | the connection manager's CM response timeout and packet lifetime (4.096 us x 2^n) and resends before giving up (read when a device's CM starts) | 20, 15, 16 |
//! | `SOFTVERBS_PCAP` | a file to capture every packet of the process to (`%p`: the process ID), see [`crate::capture`] (read when the process's devices are first listed) | none |
//! | `SOFTVERBS_LOG` | a log filter in `RUST_LOG` syntax; events go to stderr, see [`crate::log`] (read by the front ends when they first list devices) | off |

use softverbs_engine::{Error, Result};

/// The standard RoCEv2 UDP destination port.
pub const ROCE_UDP_PORT: u16 = 4791;

/// Resource limits of a device. Each is reported by `query_device` and enforced by the verbs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Maximum number of QPs.
    pub max_qp: u32,
    /// Maximum depth of a send or receive queue.
    pub max_qp_wr: u32,
    /// Maximum scatter/gather entries per WR.
    pub max_sge: u32,
    /// Maximum number of CQs.
    pub max_cq: u32,
    /// Maximum entries of one CQ.
    pub max_cqe: u32,
    /// Maximum number of MRs.
    pub max_mr: u32,
    /// Largest MR in bytes.
    pub max_mr_size: u64,
    /// Maximum number of memory windows.
    pub max_mw: u32,
    /// Maximum number of PDs.
    pub max_pd: u32,
    /// Responder resources (incoming READ/atomic) per QP.
    pub max_qp_rd_atom: u8,
    /// Outstanding READ/atomic operations a QP may initiate.
    pub max_qp_init_rd_atom: u8,
    /// Maximum number of SRQs.
    pub max_srq: u32,
    /// Maximum depth of an SRQ.
    pub max_srq_wr: u32,
    /// Maximum scatter entries per SRQ WR.
    pub max_srq_sge: u32,
    /// Maximum number of address handles.
    pub max_ah: u32,
    /// Maximum number of multicast groups.
    pub max_mcast_grp: u32,
    /// Maximum QPs attached to one multicast group.
    pub max_mcast_qp_attach: u32,
    /// Maximum attachments over all groups.
    pub max_total_mcast_qp_attach: u32,
    /// Maximum inline data per send WR.
    pub max_inline_data: u32,
    /// Total device memory (`ibv_alloc_dm`) per device, in bytes (`max_dm_size`); 0 offers none.
    pub max_dm_size: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_qp: 16384,
            max_qp_wr: 16384,
            max_sge: 32,
            max_cq: 16384,
            max_cqe: (1 << 20) - 1,
            max_mr: 65536,
            max_mr_size: 1 << 40,
            max_mw: 65536,
            max_pd: 65536,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_srq: 16384,
            max_srq_wr: 16384,
            max_srq_sge: 32,
            max_ah: 65536,
            max_mcast_grp: 8192,
            max_mcast_qp_attach: 56,
            max_total_mcast_qp_attach: 8192 * 56,
            max_inline_data: 512,
            max_dm_size: 256 * 1024,
        }
    }
}

impl Limits {
    /// Sets one limit by its `query_device` field name.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        let bad = |what: &str| Error::invalid(format!("SOFTVERBS_LIMITS: {name}={value}: {what}"));
        let v: u64 = value.trim().parse().map_err(|_| bad("not a number"))?;
        if v == 0 {
            return Err(bad("a limit must be at least 1"));
        }
        let u32v = || {
            u32::try_from(v)
                .ok()
                .filter(|v| *v <= i32::MAX as u32)
                .ok_or_else(|| bad("too large"))
        };
        let u8v = || u8::try_from(v).map_err(|_| bad("must be at most 255"));
        match name.trim() {
            "max_qp" => self.max_qp = u32v()?,
            "max_qp_wr" => self.max_qp_wr = u32v()?,
            "max_sge" => self.max_sge = u32v()?,
            "max_cq" => self.max_cq = u32v()?,
            "max_cqe" => self.max_cqe = u32v()?,
            "max_mr" => self.max_mr = u32v()?,
            "max_mr_size" => self.max_mr_size = v,
            "max_mw" => self.max_mw = u32v()?,
            "max_pd" => self.max_pd = u32v()?,
            "max_qp_rd_atom" => self.max_qp_rd_atom = u8v()?,
            "max_qp_init_rd_atom" => self.max_qp_init_rd_atom = u8v()?,
            "max_srq" => self.max_srq = u32v()?,
            "max_srq_wr" => self.max_srq_wr = u32v()?,
            "max_srq_sge" => self.max_srq_sge = u32v()?,
            "max_ah" => self.max_ah = u32v()?,
            "max_mcast_grp" => self.max_mcast_grp = u32v()?,
            "max_mcast_qp_attach" => self.max_mcast_qp_attach = u32v()?,
            "max_total_mcast_qp_attach" => self.max_total_mcast_qp_attach = u32v()?,
            "max_inline_data" => self.max_inline_data = u32v()?,
            "max_dm_size" => self.max_dm_size = v,
            _ => {
                return Err(Error::invalid(format!(
                    "SOFTVERBS_LIMITS: unknown limit {name:?}"
                )))
            }
        }
        Ok(())
    }

    /// Applies a `name=value,name=value` list.
    pub fn apply_list(&mut self, list: &str) -> Result<()> {
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = item
                .split_once('=')
                .ok_or_else(|| Error::invalid(format!("SOFTVERBS_LIMITS: {item:?} is not name=value")))?;
            self.set(name, value)?;
        }
        Ok(())
    }
}

/// Everything that decides which devices exist and how they behave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Interfaces that become devices; `None` means every interface with an address.
    pub interfaces: Option<Vec<String>>,
    /// UDP port of RoCEv2.
    pub udp_port: u16,
    /// How many ports above `udp_port` processes may take as their slots (1..=255).
    pub udp_slots: u8,
    /// Resource limits.
    pub limits: Limits,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            interfaces: None,
            udp_port: ROCE_UDP_PORT,
            udp_slots: 255,
            limits: Limits::default(),
        }
    }
}

impl Config {
    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the configuration through `get`, which returns a variable's value if set.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut cfg = Self::default();
        if let Some(list) = get("SOFTVERBS_INTERFACES") {
            let names: Vec<String> = list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            cfg.interfaces = Some(names);
        }
        if let Some(port) = get("SOFTVERBS_UDP_PORT") {
            cfg.udp_port = port.trim().parse().ok().filter(|p| *p != 0).ok_or_else(|| {
                Error::invalid(format!("SOFTVERBS_UDP_PORT: {port:?} is not a port number"))
            })?;
        }
        if let Some(n) = get("SOFTVERBS_UDP_SLOTS") {
            cfg.udp_slots = n
                .trim()
                .parse()
                .ok()
                .filter(|n| *n != 0)
                .ok_or_else(|| Error::invalid(format!("SOFTVERBS_UDP_SLOTS: {n:?} is not in 1..=255")))?;
        }
        if let Some(list) = get("SOFTVERBS_LIMITS") {
            cfg.limits.apply_list(&list)?;
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn defaults_without_environment() {
        assert_eq!(Config::from_vars(|_| None).unwrap(), Config::default());
    }

    #[test]
    fn overrides() {
        let cfg = Config::from_vars(vars(&[
            ("SOFTVERBS_INTERFACES", "lo, eth0,"),
            ("SOFTVERBS_UDP_PORT", "5000"),
            ("SOFTVERBS_UDP_SLOTS", "7"),
            ("SOFTVERBS_LIMITS", "max_qp=3, max_cqe=100,max_qp_rd_atom=4"),
        ]))
        .unwrap();
        assert_eq!(cfg.interfaces, Some(vec!["lo".into(), "eth0".into()]));
        assert_eq!(cfg.udp_port, 5000);
        assert_eq!(cfg.udp_slots, 7);
        assert_eq!(
            (cfg.limits.max_qp, cfg.limits.max_cqe, cfg.limits.max_qp_rd_atom),
            (3, 100, 4)
        );
    }

    #[test]
    fn bad_values_are_named() {
        for (k, v, needle) in [
            ("SOFTVERBS_UDP_PORT", "0", "SOFTVERBS_UDP_PORT"),
            ("SOFTVERBS_UDP_PORT", "70000", "SOFTVERBS_UDP_PORT"),
            ("SOFTVERBS_UDP_SLOTS", "0", "SOFTVERBS_UDP_SLOTS"),
            ("SOFTVERBS_UDP_SLOTS", "256", "SOFTVERBS_UDP_SLOTS"),
            ("SOFTVERBS_LIMITS", "max_qp", "not name=value"),
            ("SOFTVERBS_LIMITS", "max_bogus=1", "max_bogus"),
            ("SOFTVERBS_LIMITS", "max_qp=0", "at least 1"),
            ("SOFTVERBS_LIMITS", "max_qp_rd_atom=300", "255"),
            ("SOFTVERBS_LIMITS", "max_cq=abc", "not a number"),
        ] {
            let e = Config::from_vars(vars(&[(k, v)])).unwrap_err();
            assert_eq!(e.errno(), 22);
            assert!(e.to_string().contains(needle), "{e}");
        }
    }
}
