#!/usr/bin/env python3
"""Router replicas in the replay: one router against N replicas that share
booked load after a sync delay (synced), never (unsynced), or decide in the
replicated log's order (ordered, issue 35). Prints one table per trace and
fleet: TTFT p50 / p99, reuse, and for ordered runs the decisions some
replica made differently (0 means every replica booked every request alike).

    python3 scripts/replica-replay.py --trace ../shared/data/traces/mooncake_fast25_conversation_trace.jsonl \
        [--trace ...] [--fleets 8x4,4x1] [--replicas 2,3,5] [--delays 1,10,50] [--jobs 2]

Runs `kvroute-tools replay --json` (build it first: cargo build --release -p
kvroute-tools); each run is one process, `--jobs` at a time.
"""

import argparse
import concurrent.futures
import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def replay(tools: str, trace: Path, workers: int, speedup: float, extra: list[str]) -> dict:
    argv = [tools, "replay", "--trace", str(trace), "--workers", str(workers),
            "--speedup", str(speedup), "--policy", "kvroute", "--json", *extra]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, action="append", required=True)
    ap.add_argument("--fleets", default="8x4,4x1", help="workers x speedup, comma separated")
    ap.add_argument("--replicas", default="2,3,5")
    ap.add_argument("--delays", default="1,10,50", help="sync delays, ms")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--tools", default=str(REPO / "target/release/kvroute-tools"))
    args = ap.parse_args()
    fleets = [tuple(f.split("x")) for f in args.fleets.split(",")]
    counts = [int(n) for n in args.replicas.split(",")]
    delays = [d for d in args.delays.split(",")]

    runs = []
    for trace in args.trace:
        for workers, speedup in fleets:
            key = (trace, int(workers), float(speedup))
            runs.append((key, "one router", []))
            for n in counts:
                base = ["--router-replicas", str(n)]
                runs.append((key, f"{n} unsynced", base + ["--no-replica-sync"]))
                for d in delays:
                    runs.append((key, f"{n} synced {d} ms", base + ["--replica-sync-delay-ms", d]))
                    runs.append((key, f"{n} ordered {d} ms",
                                 base + ["--replica-sync-delay-ms", d, "--ordered-decisions"]))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda run: replay(args.tools, *run[0], run[2]), runs))

    table = {}
    for (key, label, _), report in zip(runs, results):
        table.setdefault(key, []).append((label, report))
    for (trace, workers, speedup), rows in table.items():
        print(f"\n{trace.name}, {workers} workers, speedup {speedup:g}")
        print(f"  {'routers':<22} {'TTFT p50':>9} {'p99':>7} {'reuse':>6}  differing decisions")
        for label, r in rows:
            ttft = r["ttft_ms"]
            differing = r.get("divergent_decisions", "")
            print(f"  {label:<22} {ttft['p50']:>9.0f} {ttft['p99']:>7.0f} {r['reuse_ratio']:>6.3f}  {differing}")


if __name__ == "__main__":
    main()
