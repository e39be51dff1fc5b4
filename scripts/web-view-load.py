#!/usr/bin/env python3
"""What the web view costs routing (#37): `kvroute bench select` against a
kvroute (release) with and without 20 browsers' worth of pollers on its
web view, alternated in the same run so both see the machine alike.

Each poller does what a browser showing one page does: every 2 s (the
page's period) it reads that page's data; the 20 are spread over the fleet,
events (the fleet's data), index and decisions pages. The bench's
SelectWorker p50 / p99 per phase are printed, and the change of the p99
(target: at most 5 %).

    python3 scripts/web-view-load.py [--trace ../shared/data/traces/mooncake_fast25_conversation_trace.jsonl]
"""
import argparse
import json
import socket
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the page polls for each of its pages (app.js): a browser shows one.
PAGES = ["/ui/api/fleet?offset=0&limit=100&filter=", "/ui/api/index",
         "/ui/api/decisions?after={after}&limit=50", "/ui/api/fleet?offset=0&limit=100&filter="]


def poller(base: str, page: str, period: float, stop: threading.Event, counts: list) -> None:
    after = 0
    while not stop.is_set():
        started = time.perf_counter()
        for path in (page.format(after=after),):
            with urllib.request.urlopen(base + path, timeout=10) as response:
                body = response.read()
            if "decisions" in path:
                decisions = json.loads(body)["decisions"]
                if decisions:
                    after = decisions[-1]["seq"]
            counts.append(len(body))
        stop.wait(max(0.0, period - (time.perf_counter() - started)))


def bench(kvroute: str, addr: str, trace: str, seconds: int) -> dict:
    out = subprocess.run([kvroute, "bench", "select", "--addr", addr, "--trace", trace,
                          "--seconds", str(seconds), "--warm", "0"],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if line.startswith("{") and '"SelectWorker"' in line:
            return json.loads(line)
    raise RuntimeError(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(REPO / "tests/data/conversation_sample.jsonl"))
    ap.add_argument("--kvroute", default=str(REPO / "target/release/kvroute"))
    ap.add_argument("--browsers", type=int, default=20)
    ap.add_argument("--period", type=float, default=2.0, help="seconds between a browser's polls")
    ap.add_argument("--seconds", type=int, default=3, help="seconds per bench phase")
    ap.add_argument("--rounds", type=int, default=8, help="without-then-with rounds (the p99 of one varies by 10 %%)")
    args = ap.parse_args()

    grpc, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    server = subprocess.Popen([args.kvroute, "serve", "--grpc-addr", grpc, "--metrics-addr", metrics,
                               "--log-level", "warn"])
    try:
        time.sleep(1.5)
        # A first bench run registers the workers and warms the index.
        subprocess.run([args.kvroute, "bench", "select", "--addr", grpc, "--trace", args.trace,
                        "--seconds", "1"], capture_output=True, check=True)
        results = {"without": [], "with": []}
        polled = []
        for _ in range(args.rounds):
            for phase in ("without", "with"):
                stop = threading.Event()
                threads = []
                if phase == "with":
                    threads = [threading.Thread(target=poller, daemon=True,
                                                args=(f"http://{metrics}", PAGES[i % len(PAGES)],
                                                      args.period, stop, polled))
                               for i in range(args.browsers)]
                    for t in threads:
                        t.start()
                results[phase].append(bench(args.kvroute, grpc, args.trace, args.seconds))
                stop.set()
                for t in threads:
                    t.join()
        print(f"web view cost: kvroute bench select (query_only, block hashes), {args.rounds} rounds "
              f"of {args.seconds} s per phase per bench, alternated; 'with' = {args.browsers} browsers "
              f"polling the view every {args.period:g} s ({len(polled)} responses, "
              f"{statistics.mean(polled) / 1024 if polled else 0:.1f} KiB mean)")
        for phase in ("without", "with"):
            rs = results[phase]
            print(f"  {phase:>7}: calls/s {statistics.mean(r['calls_per_s'] for r in rs):9.0f}  "
                  f"p50 {statistics.median(r['p50_us'] for r in rs):7.0f} us  "
                  f"p99 {statistics.median(r['p99_us'] for r in rs):7.0f} us  "
                  "(p99 per round: " + ", ".join(f"{r['p99_us']:.0f}" for r in rs) + ")")
        change = (statistics.median(r["p99_us"] for r in results["with"])
                  / statistics.median(r["p99_us"] for r in results["without"]) - 1)
        print(f"  SelectWorker p99 change with the view polled: {change:+.1%} (target: at most +5 %)")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
