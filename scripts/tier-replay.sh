#!/usr/bin/env bash
# The cache-tier replay of docs/TIERS.md: both Mooncake traces, 4 and 8
# workers, engines with a host tier four times their device cache, routed
# device-only, tier-aware (kvroute's defaults) and with Dynamo's weights.
#
#   scripts/tier-replay.sh [--num-blocks N] [--host-load-ms-per-block MS] [--seed S]
#
# Defaults: the short device of the docs' first table (4,096 blocks, host
# 16,384). --num-blocks 16384 gives the second. Extra flags go to every
# `kvroute replay` run; `--policy kvroute --tier-savings host=S` in place of
# the three policies is one point of the sweep. Needs the full traces in
# ../shared/data/traces (or TRACES=dir) and a release build (~1 min a row).
set -euo pipefail
cd "$(dirname "$0")/.."
traces=${TRACES:-../shared/data/traces}
blocks=4096
args=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --num-blocks) blocks=$2; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
cargo build --release -q -p kvroute-tools
bin=target/release/kvroute-tools
policy=(--policy tiers)
[[ " ${args[*]} " == *" --policy "* ]] && policy=()
echo "| trace | workers | policy | TTFT p50 ms | TTFT p99 ms | reuse device | reuse host |"
echo "|---|---|---|---|---|---|---|"
for trace in conversation synthetic; do
    for workers in 4 8; do
        "$bin" replay --trace "$traces/mooncake_fast25_${trace}_trace.jsonl" \
            --workers "$workers" --num-blocks "$blocks" --host-blocks $((4 * blocks)) \
            --json "${policy[@]}" "${args[@]}" |
            python3 -c '
import json, sys
trace, workers = sys.argv[1:3]
for line in sys.stdin:
    r = json.loads(line)
    t, host = r["ttft_ms"], r.get("host_reuse_ratio", 0.0)
    print("| %s | %s | %s | %.1f | %.0f | %.3f | %.3f |" % (
        trace, workers, r["policy"], t["p50"], t["p99"], r["reuse_ratio"] - host, host))
' "$trace" "$workers"
    done
done
