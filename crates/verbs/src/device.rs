//! Devices and process-wide settings.

use softverbs_device as core;
use softverbs_engine::Result;

use crate::context::Context;

/// A software RDMA device (one per network interface with an IP address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device(pub(crate) core::Device);

/// The devices of this host (`ibv_get_device_list`), configured from the environment (see
/// [`Config`](crate::Config)). Fails with EINVAL if a `SOFTVERBS_*` variable is malformed.
///
/// The first call also installs the logger `SOFTVERBS_LOG` asks for, if set and if the program
/// has no `tracing` subscriber of its own (see [`softverbs_device::log`]).
pub fn devices() -> Result<Vec<Device>> {
    softverbs_device::log::init_from_env();
    Ok(core::device_list()?.into_iter().map(Device).collect())
}

impl Device {
    /// Devices for an explicit configuration instead of the environment. Each call makes new
    /// devices with their own resource accounting.
    pub fn discover(config: &crate::Config) -> Result<Vec<Self>> {
        Ok(core::discover(config)?.into_iter().map(Device).collect())
    }

    /// `ibv_get_device_name`.
    pub fn name(&self) -> &str {
        self.0.name()
    }

    /// `ibv_get_device_guid`, as a number whose big-endian bytes are the GUID.
    pub fn guid(&self) -> u64 {
        self.0.guid()
    }

    /// The network interface the device runs on.
    pub fn netdev(&self) -> &str {
        self.0.netdev()
    }

    /// `ibv_open_device`.
    pub fn open(&self) -> Result<Context> {
        Context::open(&self.0)
    }
}

/// `enum ibv_fork_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForkStatus {
    /// Fork protection is off and needed.
    Disabled,
    /// Fork protection is on.
    Enabled,
    /// The device never pins memory, so `fork()` is always safe.
    Unneeded,
}

/// `ibv_fork_init`: nothing to do, since registered memory is never pinned or remapped by the
/// device; always succeeds.
pub fn fork_init() -> Result<()> {
    Ok(())
}

/// `ibv_is_fork_initialized`.
pub fn is_fork_initialized() -> ForkStatus {
    ForkStatus::Unneeded
}
