//! `ibv_devices`: lists the RDMA devices and their node GUIDs, in rdma-core's layout.

use std::process::ExitCode;

use clap::Parser;
use softverbs::devices;
use softverbs_tools::cli;

/// List the RDMA devices of this host with their node GUIDs.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {}

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
