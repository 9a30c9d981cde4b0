#!/usr/bin/env bash
# Builds the drop-in libibverbs.so.1 and prints the directory to put in LD_LIBRARY_PATH.
# Usage: crates/ibverbs/build-lib.sh            (release build)
#        LD_LIBRARY_PATH=$(crates/ibverbs/build-lib.sh) ibv_devinfo
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p softverbs-ibverbs >&2
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
dir="${target_dir:-target}/release"
ln -sf libibverbs.so "$dir/libibverbs.so.1"
echo "$dir"
