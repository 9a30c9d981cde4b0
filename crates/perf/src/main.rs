//! The `softverbs-perf` command: see the crate documentation of `softverbs_perf`.

use std::process::ExitCode;

use clap::Parser;
use softverbs_perf::{run, Args};

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softverbs-perf: {e}");
            ExitCode::FAILURE
        }
    }
}
