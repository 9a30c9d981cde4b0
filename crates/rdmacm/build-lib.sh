#!/usr/bin/env bash
# Builds the drop-in librdmacm.so.1 next to libibverbs.so.1 and prints that directory, for
# LD_LIBRARY_PATH. Usage: LD_LIBRARY_PATH=$(crates/rdmacm/build-lib.sh) rping -s
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=$(crates/ibverbs/build-lib.sh)
cargo build --release -p softverbs-rdmacm >&2
ln -sf librdmacm.so "$dir/librdmacm.so.1"
echo "$dir"
