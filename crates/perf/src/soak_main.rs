//! The `softverbs-soak` command: see `softverbs_perf::soak`.

use std::process::ExitCode;

use clap::Parser;
use softverbs_perf::soak::{run_soak, SoakArgs};

fn main() -> ExitCode {
    let args = SoakArgs::parse();
    match run_soak(&args) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softverbs-soak: {e}");
            ExitCode::FAILURE
        }
    }
}
