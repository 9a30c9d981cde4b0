//! `ibv_devices`: lists the RDMA devices and their node GUIDs, in rdma-core's layout.

use std::process::ExitCode;

use clap::Parser;
use softverbs::devices;
use softverbs_tools::cli;
use softverbs_tools::man;

#[derive(Parser, Debug)]
#[command(
    name = "ibv_devices",
    version,
    about = "list RDMA devices",
    long_about = None,
    before_help = DESCRIPTION,
    after_help = man::SEE_LONG_HELP,
    after_long_help = man::sections(man::DEVICE_ENVIRONMENT, EXAMPLES, EXIT_STATUS),
    help_template = man::PAGE,
)]
struct Args {}

const DESCRIPTION: &str = concat!(
    "    Lists the RDMA devices of this host with their node GUIDs, in the layout of rdma-core's\n",
    "    ibv_devices. softverbs has one device per network interface with an IP address, named\n",
    "    sv_<interface> (sv_lo for loopback), so every host has at least one.",
);

const EXAMPLES: &[(&str, &str)] = &[
    ("ibv_devices", "Lists every device."),
    (
        "SOFTVERBS_INTERFACES=lo ibv_devices",
        "Lists only the loopback device.",
    ),
];

const EXIT_STATUS: &str =
    "0 when the devices were listed; 1 when the list cannot be read or an argument is invalid.";

fn main() -> ExitCode {
    let _args: Args = cli::parse_args();
    let list = match devices() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ibv_devices: Failed to get the RDMA device list: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Column layout of rdma-core: 4 spaces, the name left-aligned in 16, a tab, then the GUID.
    println!("    {:<16}\t   node GUID", "device");
    println!("    {:<16}\t----------------", "------");
    for d in &list {
        // guid() is the number whose big-endian bytes are the GUID, i.e. ntohll() of the C value.
        println!("    {:<16}\t{:016x}", d.name(), d.guid());
    }
    ExitCode::SUCCESS
}
