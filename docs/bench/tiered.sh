#!/bin/bash
# The tiered-store benchmark of docs/benchmarks.md section 2: a coli synth model whose routed
# experts (12.9 GB) are over 4x the expert cache, LRU vs learned pins vs prefetch, direct I/O (disk-bound) and
# cold/warm page cache. Usage: docs/bench/tiered.sh MODEL_DIR [RAM]
set -u
M=${1:?model dir}; RAM=${2:-4G}
COLI=${COLI:-target/release/coli}
export COLI_STATE_DIR=$(mktemp -d /tmp/coli-bench-state.XXXX)
run() { echo "== $1"; shift; setsid docs/bench/runbench.sh "$COLI" bench --model "$M" --ram "$RAM" --threads 2 "$@"; }
run "LRU only, direct I/O" --direct-io --no-learn --no-prefetch --prompt-tokens 32 --gen-tokens 32
run "warm-up run that fills the usage history (not measured)" --direct-io --no-prefetch --prompt-tokens 32 --gen-tokens 64 > /dev/null
run "LRU + learned pins, direct I/O" --direct-io --no-prefetch --prompt-tokens 32 --gen-tokens 32
run "LRU + learned pins + prefetch, direct I/O" --direct-io --prompt-tokens 32 --gen-tokens 32
run "LRU + learned pins + prefetch, cold page cache (buffered)" --cold --prompt-tokens 32 --gen-tokens 32
run "LRU + learned pins + prefetch, warm page cache (buffered)" --prompt-tokens 32 --gen-tokens 32
