//! Network interfaces as the device sees them: name, index, link state, MTU, MAC and addresses.

use std::collections::BTreeMap;
use std::net::IpAddr;

use nix::ifaddrs::getifaddrs;
use nix::net::if_::InterfaceFlags;

use softverbs_engine::Result;

/// One network interface with at least one IP address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Kernel interface name, e.g. `eth0`.
    pub name: String,
    /// Kernel interface index.
    pub index: u32,
    /// Administratively up and carrier present.
    pub running: bool,
    /// The loopback interface.
    pub loopback: bool,
    /// Link MTU in bytes.
    pub mtu: u32,
    /// Hardware address, if the link has one.
    pub mac: Option<[u8; 6]>,
    /// IP addresses, in the kernel's order.
    pub addrs: Vec<IpAddr>,
}

/// Lists the interfaces that have at least one IP address, ordered by interface index.
pub fn interfaces() -> Result<Vec<Interface>> {
    let mut by_name: BTreeMap<String, Interface> = BTreeMap::new();
    for ifa in getifaddrs().map_err(std::io::Error::from)? {
        let entry = by_name
            .entry(ifa.interface_name.clone())
            .or_insert_with(|| Interface {
                name: ifa.interface_name.clone(),
                index: nix::net::if_::if_nametoindex(ifa.interface_name.as_str()).unwrap_or(0),
                running: false,
                loopback: false,
                mtu: read_mtu(&ifa.interface_name),
                mac: None,
                addrs: Vec::new(),
            });
        entry.running =
            ifa.flags.contains(InterfaceFlags::IFF_UP) && ifa.flags.contains(InterfaceFlags::IFF_RUNNING);
        entry.loopback = ifa.flags.contains(InterfaceFlags::IFF_LOOPBACK);
        let Some(addr) = ifa.address else { continue };
        if let Some(sin) = addr.as_sockaddr_in() {
            entry.addrs.push(IpAddr::V4(sin.ip()));
        } else if let Some(sin6) = addr.as_sockaddr_in6() {
            entry.addrs.push(IpAddr::V6(sin6.ip()));
        } else if let Some(link) = addr.as_link_addr() {
            entry.mac = link.addr();
        }
    }
    let mut list: Vec<Interface> = by_name.into_values().filter(|i| !i.addrs.is_empty()).collect();
    list.sort_by_key(|i| (i.index, i.name.clone()));
    Ok(list)
}

/// The interface MTU from sysfs; 1500 if it cannot be read (the Ethernet default).
pub(crate) fn read_mtu(name: &str) -> u32 {
    std::fs::read_to_string(format!("/sys/class/net/{name}/mtu"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(1500)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_listed_with_its_addresses() {
        let list = interfaces().unwrap();
        let lo = list
            .iter()
            .find(|i| i.loopback)
            .expect("every Linux host has a loopback interface");
        assert!(
            lo.addrs.contains(&IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
            "{lo:?}"
        );
        assert!(lo.mtu >= 1500);
        assert!(list.windows(2).all(|w| w[0].index <= w[1].index));
        assert!(list.iter().all(|i| !i.addrs.is_empty()));
    }
}
