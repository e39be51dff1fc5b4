#!/usr/bin/env python3
"""What kvroute's endpoint picker adds behind a real Envoy, and where the time goes.

Why: kvroute as Envoy's ext_proc picker reads every request body, renders
and tokenizes its chat as the engine will, and picks an engine before Envoy
forwards it. This script measures what that costs a client, against the
same Envoy routing round robin, on prompts shaped like real conversation
traffic; the behaviour itself is tested by tests/python/test_gateway.py,
whose helpers (tests/python/gateway/, conftest.py) this reuses.

How, all on loopback:
* engines: one process serving four OpenAI-style engines (one port each)
  that answer every chat completion at once, without tokenizing. They are
  registered with kvroute over gRPC (RegisterWorker, `endpoint` their
  ip:port) in KV_EVENTS_MODE_APPROXIMATE: they publish nothing, and kvroute
  predicts their caches from its own picks, so a conversation's later turns
  are really routed by prefix at no cost to the engine;
* kvroute: the release binary, `serve --ext-proc-addr` with Qwen3's
  tokenizer (`scripts/tokenizer_cases.py --fetch qwen3` fetches it);
* Envoy 1.40 (gateway/fetch_envoy.py), one worker thread, two listeners over
  the same engines: A asks kvroute (ext_proc, override_host on its pick, the
  test's configuration), B has no ext_proc and routes round robin;
* requests: chats made from a Mooncake conversation trace (JSONL with
  hash_ids, one id per 512-token block). Each block id gives a deterministic
  text of --tokens-per-block words (one Qwen3 token each, about), the last
  block shortened as the trace's input_length says; the first block is the
  system message and the rest alternate user / assistant (a closing "go on"
  when they end on the assistant). So requests sharing leading blocks share
  leading messages, a conversation's next turn extends the previous
  messages, and kvroute applies the chat template. A trace shorter than the
  run is cycled with new text on each pass (no reuse across passes).

Phases:
1. open loop at --rate requests/s, --rounds x --secs per path, B then A in
   each round with the same requests: latency at the client to the whole
   (non-streamed, max_tokens 1) response; A - B is what kvroute adds;
2. where A's time goes, from kvroute's /metrics scraped around the A phases:
   kvroute_epp_pick_seconds{part=wait|parse|tokenize|select}, and
   kvroute_epp_prompt_tokens_total{source=cached|tokenized} for the share of
   prompt ids served from the prompt (segment) cache. kvroute times the
   template and the tokenizer together as `tokenize`, so a calibration sends
   a few new chats twice in a row: the second time every id is cached and
   `tokenize` is the template (plus cache lookups) alone. The rest of the
   added time (body transfer to kvroute and back, the ext_proc messages,
   Envoy's filter) is the added mean less the parts;
3. saturation: closed loop through A with 1 ... 32 clients (new trace
   requests), then 16 clients replaying chats already cached, and B.

    .venv/bin/python scripts/epp-bench.py [--trace FILE] [--rate 100]
        [--secs 15] [--rounds 2] [--tokens-per-block 512] [--json]

The default run (the committed 300-request sample) takes about 90 seconds.
Everything (load generator, Envoy, kvroute, engines) shares this machine's
cores: the figures are this machine's, and the output says how many.
"""

import argparse
import asyncio
import ctypes
import hashlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))
from conftest import free_ports, kvroute_protos  # noqa: E402
from gateway import envoy_config  # noqa: E402
from gateway.fetch_envoy import VERSION as ENVOY_VERSION, envoy_binary  # noqa: E402

MODEL = "qwen3"
ENGINES = 4
BLOCK_SIZE = 16                    # the engines' KV block, in tokens (vLLM's default)
TRACE_BLOCK = 512                  # tokens per hash id in the Mooncake traces
REQUEST_TIMEOUT = 30.0             # seconds; a request taking longer counts as failed
ADDED_P50_TARGET_MS, ADDED_P99_TARGET_MS = 2.0, 10.0
SATURATION_CLIENTS = (1, 4, 16, 32)
CALIBRATION_CHATS = 40

# Common English words, one Qwen3 token each with their leading space.
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name "
         "team minute idea kid body information back parent face others level office door "
         "health person art war history party result change morning reason research girl "
         "guy moment air teacher force education").split()
POOL_WORDS = 1 << 18


# ---------------------------------------------------------------- engines

ENGINE_ANSWER = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode()
ENGINE_REPLY = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(ENGINE_ANSWER)).encode() + b"\r\n\r\n" + ENGINE_ANSWER)


async def read_message(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 message's head, its body read past (content-length or
    chunked: Envoy forwards a body chunked once ext_proc has seen it)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
    if length:
        await reader.readexactly(int(length.group(1)))
    elif re.search(rb"(?i)\r\ntransfer-encoding:\s*chunked", head):
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return head


async def engine_connection(reader, writer) -> None:
    try:
        while True:
            await read_message(reader)
            writer.write(ENGINE_REPLY)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def serve_engines(ports: list[int]) -> None:
    servers = [await asyncio.start_server(engine_connection, "127.0.0.1", port)
               for port in ports]
    print("READY", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


# ---------------------------------------------------------------- chats from the trace

class Chats:
    """The trace's requests as chat bodies, made on demand (slices of one
    word pool, so making a body costs microseconds, not the client's core).

    Request i is trace line i mod n on pass i // n; a block's text depends
    on (pass, hash id) only, so shared ids give shared messages within a
    pass and nothing is shared across passes. Negative i are passes of
    their own (warm-up, calibration).
    """

    def __init__(self, trace: Path, words_per_block: int) -> None:
        with open(trace) as f:
            self.rows = [(r["hash_ids"], r["input_length"]) for r in map(json.loads, f)]
        self.words_per_block = words_per_block
        import random
        words = random.Random(0).choices(WORDS, k=POOL_WORDS)
        self.pool = "".join(" " + w for w in words)
        self.starts = list(itertools.accumulate((len(w) + 1 for w in words), initial=0))

    def __len__(self) -> int:
        return len(self.rows)

    def blocks(self, i: int) -> list[tuple[tuple[int, int], int]]:
        """Request i's blocks: ((pass, hash id), words)."""
        ids, input_length = self.rows[i % len(self.rows)]
        last = input_length - TRACE_BLOCK * (len(ids) - 1)
        words = [self.words_per_block] * len(ids)
        words[-1] = max(1, round(self.words_per_block * min(last, TRACE_BLOCK) / TRACE_BLOCK))
        return [((i // len(self.rows), h), w) for h, w in zip(ids, words)]

    def text(self, key: tuple[int, int], words: int) -> str:
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        k = int.from_bytes(digest, "little") % (POOL_WORDS - words)
        return f"Block {key[1]} of pass {key[0]}." + self.pool[self.starts[k]:self.starts[k + words]]

    def body(self, i: int) -> bytes:
        blocks = self.blocks(i)
        roles = ["system"] + ["user" if k % 2 == 0 else "assistant" for k in range(len(blocks) - 1)]
        # The texts are ASCII words: JSON needs no escaping.
        messages = [f'{{"role":"{role}","content":"{self.text(key, words)}"}}'
                    for role, (key, words) in zip(roles, blocks)]
        if roles[-1] != "user":
            messages.append('{"role":"user","content":"go on"}')
        return (f'{{"model":"{MODEL}","max_tokens":1,"messages":['
                + ",".join(messages) + "]}").encode()


def prefix_reuse(chats: Chats, indices) -> tuple[float, float]:
    """The share of the requests' words in blocks an earlier request of the
    sequence already had (the trace's ids are prefix-chained): what a cache
    of unbounded size would serve; over all words, and on average per
    request."""
    seen, reused, total, shares = set(), 0, 0, []
    for i in indices:
        blocks = chats.blocks(i)
        again = sum(words for key, words in blocks if key in seen)
        words = sum(words for _, words in blocks)
        reused, total = reused + again, total + words
        shares.append(again / words)
        seen.update(key for key, _ in blocks)
    return reused / max(total, 1), mean(shares)


# ---------------------------------------------------------------- load generator

class Pool:
    """Keep-alive HTTP/1.1 connections to one port, opened as needed."""

    def __init__(self, port: int) -> None:
        self.port, self.idle = port, []

    async def post(self, body: bytes) -> int:
        """The response's status once it is read whole."""
        reader, writer = (self.idle.pop() if self.idle
                          else await asyncio.open_connection("127.0.0.1", self.port))
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
                         b"content-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            head = await read_message(reader)
            status = int(head.split(b" ", 2)[1])
        except BaseException:
            writer.close()
            raise
        if status == 200:
            self.idle.append((reader, writer))
        else:
            writer.close()
        return status


class Phase:
    """Latencies (s) of the requests that succeeded, and the failures."""

    def __init__(self) -> None:
        self.latencies, self.failed, self.lags, self.elapsed = [], 0, [], 0.0
        self.by_request: dict[int, float] = {}

    async def send(self, pool: Pool, body: bytes, request: int | None = None) -> None:
        started = time.perf_counter()
        try:
            status = await asyncio.wait_for(pool.post(body), REQUEST_TIMEOUT)
        except (OSError, EOFError, asyncio.TimeoutError, asyncio.LimitOverrunError,
                ValueError, IndexError):
            status = 0
        if status == 200:
            self.latencies.append(time.perf_counter() - started)
            if request is not None:
                self.by_request[request] = self.latencies[-1]
        else:
            self.failed += 1


async def open_loop(port: int, chats: Chats, indices: range, rate: float) -> Phase:
    """Sends request i of `indices` at start + k / rate, whatever the answers."""
    pool, phase, tasks = Pool(port), Phase(), []
    start = time.perf_counter()
    for k, i in enumerate(indices):
        due = start + k / rate
        if (delay := due - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        phase.lags.append(max(time.perf_counter() - due, 0.0))
        tasks.append(asyncio.create_task(phase.send(pool, chats.body(i), i)))
    await asyncio.gather(*tasks)
    phase.elapsed = time.perf_counter() - start
    return phase


async def closed_loop(port: int, clients: int, secs: float, next_body) -> Phase:
    """`clients` each sending their next request when the last is answered."""
    pool, phase = Pool(port), Phase()
    stop = time.perf_counter() + secs

    async def client() -> None:
        while time.perf_counter() < stop:
            await phase.send(pool, next_body())

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    phase.elapsed = time.perf_counter() - start
    return phase


async def sequential(port: int, chats: Chats, indices) -> Phase:
    pool, phase = Pool(port), Phase()
    for i in indices:
        await phase.send(pool, chats.body(i))
    return phase


def quantile(values: list[float], q: float) -> float:
    """Nearest rank."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(q * len(values) + 0.5) - 1))]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


# ---------------------------------------------------------------- kvroute's metrics

SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'(\w+)="([^"]*)"')


class Metrics:
    """One scrape of kvroute's /metrics; `b - a` gives what happened between."""

    def __init__(self, samples: dict) -> None:
        self.samples = samples  # (name, frozenset(labels)) -> value

    @classmethod
    def scrape(cls, addr: str) -> "Metrics":
        text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
        samples = {}
        for line in text.splitlines():
            if (m := SAMPLE.match(line)) and not line.startswith("#"):
                samples[(m[1], frozenset(LABEL.findall(m[2] or "")))] = float(m[3])
        return cls(samples)

    def __sub__(self, earlier: "Metrics") -> "Metrics":
        return Metrics({k: v - earlier.samples.get(k, 0.0) for k, v in self.samples.items()})

    def value(self, name: str, **labels: str) -> float:
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def histogram(self, name: str, **labels: str) -> dict:
        """count, mean and the bucket bounds holding the p50 and p99 (ms)."""
        want = set(labels.items())
        count = self.value(name + "_count", **labels)
        if count <= 0:
            return {"count": 0}
        buckets = sorted((float(dict(ls)["le"]), v) for (n, ls), v in self.samples.items()
                         if n == name + "_bucket" and want <= ls)

        def bound(q: float) -> float:
            return next((le for le, v in buckets if v >= q * count), float("inf")) * 1e3

        return {"count": int(count), "mean_ms": self.mean(name, **labels) * 1e3,
                "p50_le_ms": bound(0.5), "p99_le_ms": bound(0.99)}

    def mean(self, name: str, **labels: str) -> float:
        """A histogram's mean (sum / count)."""
        count = self.value(name + "_count", **labels)
        return self.value(name + "_sum", **labels) / count if count > 0 else float("nan")

    def pick_part(self, part: str) -> dict:
        return self.histogram("kvroute_epp_pick_seconds", part=part)

    def prompt_ids(self) -> tuple[float, float]:
        """(cached, tokenized) prompt ids."""
        return (self.value("kvroute_epp_prompt_tokens_total", source="cached"),
                self.value("kvroute_epp_prompt_tokens_total", source="tokenized"))


# ---------------------------------------------------------------- the processes

def die_with_parent() -> None:
    """In a child: SIGTERM when the bench dies, however it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_port(port: int, secs: float = 30) -> None:
    deadline = time.time() + secs
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


class Stack:
    """Engines, kvroute and Envoy, each with a log in `work`; stopped (and
    reaped) on leaving, whatever happened."""

    def __init__(self, args, work: Path) -> None:
        self.args, self.work, self.procs = args, work, {}
        ports = free_ports(ENGINES + 6)
        self.engine_ports = ports[:ENGINES]
        self.grpc, self.metrics, self.ext_proc = (f"127.0.0.1:{p}" for p in ports[ENGINES:ENGINES + 3])
        self.port_a, self.port_b, self.admin = ports[ENGINES + 3:]

    def spawn(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "wb")
        p = subprocess.Popen(argv, stderr=log, stdout=kw.pop("stdout", log),
                             preexec_fn=die_with_parent, **kw)
        self.procs[name] = p
        return p

    def __enter__(self) -> "Stack":
        try:
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def start(self) -> None:
        args = self.args
        engines = self.spawn("engines", [sys.executable, __file__, "--serve-engines",
                                         ",".join(map(str, self.engine_ports))],
                             stdout=subprocess.PIPE)
        if engines.stdout.readline().strip() != b"READY":
            raise RuntimeError(f"the engines did not start: {self.tail('engines')}")
        self.spawn("kvroute", [
            args.kvroute, "serve", "--grpc-addr", self.grpc, "--metrics-addr", self.metrics,
            "--ext-proc-addr", self.ext_proc, "--epp-tokenizer", f"{MODEL}={args.tokenizer}",
            "--log-level", "warn"])
        self.register_engines()
        wait_port(int(self.ext_proc.rsplit(":", 1)[1]))
        endpoints = [f"127.0.0.1:{p}" for p in self.engine_ports]
        config = {
            "admin": {"address": envoy_config.socket_address(f"127.0.0.1:{self.admin}")},
            "static_resources": {
                "listeners": [
                    envoy_config.listener("picker", f"127.0.0.1:{self.port_a}",
                                          epp_cluster="kvroute_epp"),
                    envoy_config.listener("round_robin", f"127.0.0.1:{self.port_b}",
                                          epp_cluster=None, cluster="engines_rr"),
                ],
                "clusters": [
                    envoy_config.engines_cluster(endpoints),
                    envoy_config.round_robin_cluster("engines_rr", endpoints),
                    envoy_config.epp_cluster("kvroute_epp", self.ext_proc, health_checked=False),
                ],
            },
        }
        path = envoy_config.write(config, self.work / "envoy.json")
        envoy = str(envoy_binary())
        envoy_config.validate(envoy, path)
        self.spawn("envoy", [envoy, "-c", str(path), "--concurrency", "1",
                             "--log-level", "error"])
        wait_port(self.port_a)
        wait_port(self.port_b)

    def register_engines(self) -> None:
        import grpc
        pb = kvroute_protos(self.work / "pb")
        with grpc.insecure_channel(self.grpc) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=30)
            except grpc.FutureTimeoutError:
                raise RuntimeError(f"kvroute did not start: {self.tail('kvroute')}") from None
            workers = pb.workers_grpc.WorkersStub(channel)
            for k, port in enumerate(self.engine_ports):
                workers.RegisterWorker(pb.workers_pb2.RegisterWorkerRequest(
                    worker_id=k + 1, model=MODEL, endpoint=f"127.0.0.1:{port}",
                    block_size=BLOCK_SIZE, dp_size=1,
                    total_kv_blocks=65536,              # 1M tokens cached per engine
                    max_num_batched_tokens=1 << 20,     # never the bottleneck here
                    lease_ttl_secs=3600,
                    kv_events=pb.common_pb2.KV_EVENTS_MODE_APPROXIMATE,
                ), timeout=10)

    def tail(self, name: str, lines: int = 20) -> str:
        text = (self.work / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def __exit__(self, *_) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()


# ---------------------------------------------------------------- the run

def phase_figures(p: Phase) -> dict:
    return {"ok": len(p.latencies), "failed": p.failed,
            "p50_ms": quantile(p.latencies, 0.5) * 1e3, "p99_ms": quantile(p.latencies, 0.99) * 1e3,
            "mean_ms": mean(p.latencies) * 1e3,
            "rps": len(p.latencies) / p.elapsed if p.elapsed else float("nan")}


async def measure(args, stack: Stack, chats: Chats) -> dict:
    log = (lambda *a: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    # Warm-up: connections, Envoy's clusters, kvroute's code; a pass of its own.
    n = len(chats)
    for port in (stack.port_a, stack.port_b):
        warm = await open_loop(port, chats, range(-40, 0), 40)
        if warm.failed:
            raise RuntimeError(f"{warm.failed} of 40 warm-up requests failed on :{port}\n"
                               f"kvroute: {stack.tail('kvroute')}\nenvoy: {stack.tail('envoy')}")

    # 1. Open loop, B then A per round, the same requests.
    per_round = int(args.rate * args.secs)
    a, b = Phase(), Phase()
    before = Metrics.scrape(stack.metrics)
    for r in range(args.rounds):
        indices = range(r * per_round, (r + 1) * per_round)
        for name, port, total in (("B", stack.port_b, b), ("A", stack.port_a, a)):
            log(f"round {r + 1}/{args.rounds}: {name}, {per_round} requests at {args.rate:g}/s")
            got = await open_loop(port, chats, indices, args.rate)
            total.latencies += got.latencies
            total.by_request.update(got.by_request)
            total.failed += got.failed
            total.lags += got.lags
            total.elapsed += got.elapsed
    a_metrics = Metrics.scrape(stack.metrics) - before
    sent = range(args.rounds * per_round)

    # 2. Calibration: new chats sent twice in a row, one at a time.
    log(f"calibration: {CALIBRATION_CHATS} new chats, twice each")
    calibration_pass = range(-2 * n, -2 * n + min(CALIBRATION_CHATS, n))
    s0 = Metrics.scrape(stack.metrics)
    await sequential(stack.port_a, chats, calibration_pass)
    s1 = Metrics.scrape(stack.metrics)
    await sequential(stack.port_a, chats, calibration_pass)
    s2 = Metrics.scrape(stack.metrics)
    first, again = s1 - s0, s2 - s1

    # 3. Saturation: new requests (continuing the sequence), then replays.
    fresh = itertools.count(len(sent))
    saturation = {}
    for clients in SATURATION_CLIENTS:
        log(f"saturation through A: {clients} clients")
        saturation[clients] = phase_figures(await closed_loop(
            stack.port_a, clients, args.saturation_secs, lambda: chats.body(next(fresh))))
    last = next(fresh)
    replay = itertools.cycle(range(max(0, last - 200), last))  # still in the prompt cache
    log("saturation through A, cached chats; then B")
    cached_saturation = phase_figures(await closed_loop(
        stack.port_a, 16, args.saturation_secs, lambda: chats.body(next(replay))))
    b_saturation = phase_figures(await closed_loop(
        stack.port_b, 16, args.saturation_secs, lambda: chats.body(next(fresh))))

    cached, tokenized = a_metrics.prompt_ids()
    first_cached, first_tokenized = first.prompt_ids()
    again_cached, again_tokenized = again.prompt_ids()
    first_tok, again_tok = first.pick_part("tokenize"), again.pick_part("tokenize")
    reuse, per_request = prefix_reuse(chats, sent)
    bodies = [len(chats.body(i)) for i in range(0, len(sent), max(1, len(sent) // 500))]
    return {
        "trace": str(args.trace), "trace_requests": n, "requests_per_path": len(sent),
        "rate": args.rate, "secs": args.secs, "rounds": args.rounds,
        "saturation_secs": args.saturation_secs,
        "words_per_block": args.tokens_per_block, "mean_body_kib": mean(bodies) / 1024,
        "cores": os.cpu_count(), "envoy": ENVOY_VERSION, "envoy_workers": 1, "engines": ENGINES,
        "a": phase_figures(a), "b": phase_figures(b),
        "client_send_lag_p99_ms": quantile(a.lags + b.lags, 0.99) * 1e3,
        "parts": {p: a_metrics.pick_part(p) for p in ("wait", "parse", "tokenize", "select")},
        "picks": a_metrics.value("kvroute_epp_requests_total", outcome="routed"),
        "not_routed": {dict(ls).get("outcome"): v for (nm, ls), v in a_metrics.samples.items()
                       if nm == "kvroute_epp_requests_total" and v
                       and dict(ls).get("outcome") != "routed"},
        "prompt_ids": {"cached": cached, "tokenized": tokenized,
                       "cached_share": cached / max(cached + tokenized, 1),
                       "per_request": (cached + tokenized) / max(a_metrics.value(
                           "kvroute_epp_requests_total", outcome="routed"), 1),
                       "trace_prefix_reuse": reuse, "trace_prefix_reuse_per_request": per_request},
        "overlap_on_chosen_engine": a_metrics.mean("kvroute_routing_overlap_ratio"),
        "calibration": {
            "chats": len(calibration_pass),
            "first_tokenize_ms": first_tok.get("mean_ms"),
            "first_new_ids": first_tokenized, "first_cached_ids": first_cached,
            "again_tokenize_ms": again_tok.get("mean_ms"),
            "again_cached_share": again_cached / max(again_cached + again_tokenized, 1),
            "us_per_new_id": ((first_tok["mean_ms"] - again_tok["mean_ms"]) * first_tok["count"]
                              * 1e3 / max(first_tokenized - again_tokenized, 1)
                              if first_tok.get("count") and again_tok.get("count") else None),
        },
        "added_by_size": added_by_size(chats, a, b),
        "saturation_a_new": saturation, "saturation_a_cached_16": cached_saturation,
        "saturation_b_16": b_saturation,
    }


def added_by_size(chats: Chats, a: Phase, b: Phase) -> list[dict]:
    """The same requests through A and B, by prompt size (words): what A
    added to each, at p50 and p99, per band of sizes."""
    sizes = {i: sum(w for _, w in chats.blocks(i)) for i in a.by_request if i in b.by_request}
    order = sorted(sizes, key=sizes.get)
    bands = [(0.0, 0.5), (0.5, 0.9), (0.9, 0.99), (0.99, 1.0)]
    rows = []
    for lo, hi in bands:
        band = order[int(lo * len(order)):int(hi * len(order))]
        if not band:
            continue
        added = [a.by_request[i] - b.by_request[i] for i in band]
        rows.append({"from": lo, "to": hi, "requests": len(band),
                     "words_min": sizes[band[0]], "words_max": sizes[band[-1]],
                     "added_p50_ms": quantile(added, 0.5) * 1e3,
                     "added_p99_ms": quantile(added, 0.99) * 1e3})
    return rows


def bound(ms: float) -> str:
    return "> 1000" if ms == float("inf") else f"{ms:g}"


def print_report(r: dict, command: str) -> None:
    a, b = r["a"], r["b"]
    added = {k: a[k] - b[k] for k in ("p50_ms", "p99_ms", "mean_ms")}
    parts, cal, ids = r["parts"], r["calibration"], r["prompt_ids"]
    verdict = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    print(f"kvroute endpoint picker bench: Envoy {r['envoy']} + kvroute (release) + "
          f"{r['engines']} engines that answer at once")
    print(f"command: {command}")
    print(f"machine: {r['cores']} cores, shared by the load generator, Envoy ({r['envoy_workers']} "
          "worker thread), kvroute and the engines: these are this machine's figures")
    print(f"requests: {Path(r['trace']).name} ({r['trace_requests']} requests, cycled with new "
          f"text each pass), {r['words_per_block']} words per 512-token block; mean body "
          f"{r['mean_body_kib']:.1f} KiB, {ids['per_request']:,.0f} prompt ids (kvroute's count)")
    print()
    print(f"1. latency at the client, {r['rate']:g} req/s open loop, {r['rounds']} x "
          f"{r['secs']:g} s per path alternated, the same {r['requests_per_path']} requests")
    print(f"   {'path':<42}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'ok':>7}{'failed':>7}")
    for name, f in (("B  Envoy, round robin, no ext_proc", b), ("A  Envoy + kvroute picker", a)):
        print(f"   {name:<42}{f['p50_ms']:>9.2f}{f['p99_ms']:>9.2f}{f['mean_ms']:>9.2f}"
              f"{f['ok']:>7}{f['failed']:>7}")
    print(f"   {'added by kvroute (A - B)':<42}{added['p50_ms']:>9.2f}{added['p99_ms']:>9.2f}"
          f"{added['mean_ms']:>9.2f}")
    print(f"   targets: added p50 <= {ADDED_P50_TARGET_MS:g} ms "
          f"{verdict(added['p50_ms'] <= ADDED_P50_TARGET_MS)}, added p99 <= "
          f"{ADDED_P99_TARGET_MS:g} ms {verdict(added['p99_ms'] <= ADDED_P99_TARGET_MS)}"
          f"   (client's send lag p99 {r['client_send_lag_p99_ms']:.2f} ms)")
    if r["not_routed"]:
        print(f"   kvroute did not route: {r['not_routed']}")
    print("   by prompt size, what A added to each request over the same request through B:")
    for band in r["added_by_size"]:
        print(f"     {band['from']:>4.0%}-{band['to']:<4.0%} of sizes ({band['words_min']:>6,}-"
              f"{band['words_max']:>7,} words, {band['requests']:>4} requests): "
              f"added p50 {band['added_p50_ms']:6.2f} ms, p99 {band['added_p99_ms']:6.2f} ms")
    print()
    print(f"2. where A's added time goes ({r['picks']:.0f} picks; kvroute's histograms, "
          "p50/p99 are the bounds of their buckets)")
    print(f"   {'part':<58}{'mean ms':>9}{'p50 <=':>9}{'p99 <=':>9}")

    def row(label: str, mean_ms, p50="", p99="") -> None:
        print(f"   {label:<58}{mean_ms:>9.3f}{p50:>9}{p99:>9}")

    tok = parts["tokenize"]
    template = cal["again_tokenize_ms"] or 0.0
    for key, label in (("wait", "wait for a core (parsing and tokenizing, 1 per core)"),
                       ("parse", "parse the body (JSON)")):
        f = parts[key]
        if f.get("count"):
            row(label, f["mean_ms"], bound(f["p50_le_ms"]), bound(f["p99_le_ms"]))
    if tok.get("count"):
        row("template + tokenize (kvroute's `tokenize` part)", tok["mean_ms"],
            bound(tok["p50_le_ms"]), bound(tok["p99_le_ms"]))
        row("  of which the template (and prompt cache lookups)*", template)
        row("  of which tokenizing the ids not in the prompt cache", tok["mean_ms"] - template)
    f = parts["select"]
    if f.get("count"):
        row("select (index, scores, booking)", f["mean_ms"], bound(f["p50_le_ms"]),
            bound(f["p99_le_ms"]))
    inside = sum(f.get("mean_ms", 0.0) for f in parts.values())
    row("rest: body to kvroute and back, ext_proc messages, Envoy**", added["mean_ms"] - inside)
    row("added by kvroute, mean (A - B)", added["mean_ms"])
    print(f"   * calibration: {cal['chats']} new chats sent twice in a row, one at a time: "
          f"`tokenize` {cal['first_tokenize_ms']:.2f} ms the first time,")
    print(f"     {cal['again_tokenize_ms']:.3f} ms again with {cal['again_cached_share']:.1%} of "
          f"the ids cached; tokenizing costs {cal['us_per_new_id'] or float('nan'):.2f} us a new id")
    print("   ** the added mean less kvroute's parts (it also holds the machine's contention)")
    print()
    reusable = ids["trace_prefix_reuse"]
    print(f"3. prompt cache: {ids['cached_share']:.1%} of A's {ids['cached'] + ids['tokenized']:,.0f} "
          f"prompt ids were served from it, not tokenized again; the requests'")
    print(f"   own prefix reuse (the most any cache can serve) is {reusable:.1%}, so "
          f"{ids['cached_share'] / reusable if reusable else float('nan'):.0%} of what later "
          "turns repeat was not tokenized again")
    print(f"   prefix routing: per pick, on average {r['overlap_on_chosen_engine']:.1%} of the "
          "prompt's blocks were already on the engine kvroute chose")
    print(f"   (its predicted index; the requests' own prefix reuse per request: "
          f"{ids['trace_prefix_reuse_per_request']:.1%})")
    print()
    print(f"4. saturation, closed loop, {r['saturation_secs']:g} s a level:")
    for clients, f in r["saturation_a_new"].items():
        print(f"   A, new trace requests, {clients:>2} clients: {f['rps']:>7.1f} req/s  "
              f"(p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms, {f['failed']} failed)")
    for label, f in (("A, chats already cached, 16 clients", r["saturation_a_cached_16"]),
                     ("B, round robin, 16 clients", r["saturation_b_16"])):
        print(f"   {label}: {f['rps']:>7.1f} req/s  (p50 {f['p50_ms']:.1f} ms, "
              f"p99 {f['p99_ms']:.1f} ms, {f['failed']} failed)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=REPO / "tests/data/conversation_sample.jsonl",
                    help="Mooncake-style JSONL (hash_ids, input_length)")
    ap.add_argument("--rate", type=float, default=100.0, help="open-loop requests/s")
    ap.add_argument("--secs", type=float, default=15.0, help="seconds per open-loop phase")
    ap.add_argument("--rounds", type=int, default=2, help="B-then-A rounds")
    ap.add_argument("--tokens-per-block", type=int, default=512,
                    help="words (about Qwen3 tokens) per 512-token trace block")
    ap.add_argument("--saturation-secs", type=float, default=4.0, help="per saturation level")
    ap.add_argument("--kvroute", default=str(REPO / "target/release/kvroute"))
    ap.add_argument("--tokenizer", default=os.path.expanduser("~/.cache/kvroute/tokenizers/qwen3"))
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    ap.add_argument("--serve-engines", metavar="PORTS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_engines:
        asyncio.run(serve_engines([int(p) for p in args.serve_engines.split(",")]))
        return

    if not Path(args.tokenizer, "tokenizer.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts/tokenizer_cases.py"), "--fetch",
                        "qwen3", "--into", str(Path(args.tokenizer).parent)], check=True)
    if not os.access(args.kvroute, os.X_OK):
        sys.exit(f"no kvroute binary at {args.kvroute}: cargo build --release --bin kvroute")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the stack is stopped
    chats = Chats(args.trace, args.tokens_per_block)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    with tempfile.TemporaryDirectory(prefix="kvroute-epp-bench-") as tmp:
        with Stack(args, Path(tmp)) as stack:
            report = asyncio.run(measure(args, stack, chats))
    report["command"] = command
    if args.json:
        # A bucket bound past the last is infinite: null in JSON.
        print(json.dumps(json.loads(json.dumps(report), parse_constant=lambda _: None), indent=1))
    else:
        print_report(report, command)


if __name__ == "__main__":
    main()
