//! The `softverbs-scale` command: see `softverbs_perf::scale`.

use std::process::ExitCode;

use clap::Parser;
use softverbs_perf::scale::{run_scale, ScaleArgs};

fn main() -> ExitCode {
    let args = ScaleArgs::parse();
    match run_scale(&args) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softverbs-scale: {e}");
            ExitCode::FAILURE
        }
    }
}
