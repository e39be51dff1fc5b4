"""The Grafana dashboard and the Prometheus alert rules, against a real kvroute.

deploy/grafana/kvroute-dashboard.json and the alert rules
(deploy/prometheus/kvroute-rules.yaml, and the same groups in the
PrometheusRule deploy/k8s/kvroute-prometheusrule.yaml) query kvroute's
Prometheus series by name. A name that kvroute does not export makes a
panel empty and an alert silent forever, and nothing else would say so.
So this module starts real processes and makes every family the files
query appear in a real scrape:

* kvroute alone, with durable state (--state-dir), the endpoint picker
  (--ext-proc-addr, the committed tiny tokenizer), a pool file whose member's
  KV events come from a ZeroMQ publisher here (vLLM's wire format), two
  workers publishing over gRPC (a gap it has to ask a resend for, left open
  until the worker loses trust), bookings made, marked and released with
  engine-reported cached tokens, a request queued past its deadline and one
  refused, an ext_proc stream routed to the pool member and one refused;
* a cluster-mode replica on a real nats-server (Debian's package, as the
  cluster tests), with a registration, a batch of events, a booking and a
  booking refused by a tiny --max-booking-memory.

Every metric name in the dashboard's and the rules' PromQL must then be a
series of one of the two scrapes, and every label value the expressions
match on exactly must be one kvroute uses (in a scrape, or a string
literal in src/). The rules file is checked by promtool (Debian's package
prometheus) and its alerts unit-tested with `promtool test rules
tests/prometheus/kvroute-rules.test.yaml` (every alert seen firing and
seen silent); a missing promtool fails, never skips. The two rule files
must hold the same groups. The dashboard's queries are parsed by promtool
too, and its JSON is checked for shape (a datasource and targets on every
panel, unique ids, no overlapping grid positions) and for the queries'
conventions (rate() over $__rate_interval, quantiles summed by le, the
job and instance variables on every selector).
"""
import json
import queue
import re
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from conftest import REPO, free_port, kvroute_bin

DASHBOARD = REPO / "deploy" / "grafana" / "kvroute-dashboard.json"
RULES = REPO / "deploy" / "prometheus" / "kvroute-rules.yaml"
PROMETHEUS_RULE = REPO / "deploy" / "k8s" / "kvroute-prometheusrule.yaml"
RULE_TESTS = REPO / "tests" / "prometheus" / "kvroute-rules.test.yaml"
TINY_TOKENIZER = REPO / "tests" / "data" / "tokenizer-tiny"

BLOCK = 16
TIMEOUT = 10
MODEL = "obs-model"          # two workers publishing over gRPC
BUSY_MODEL = "obs-busy"      # one worker with a tiny token budget (queueing)
POOL_MODEL = "obs-pool"      # the pool member: engine events over ZeroMQ, HTTP endpoint
W1, W2, W_BUSY = 21, 22, 23
EXT_PROC_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


# --- PromQL and the exposition format ----------------------------------------

# A metric name in PromQL: an identifier not preceded by an identifier
# character, a `$` (Grafana variables) or a `.`; only kvroute's families and
# the process gauge it exports are ours to check.
_NAME = re.compile(r"(?<![A-Za-z0-9_:$.])((?:kvroute|process)_[A-Za-z0-9_:]*)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'" + r"|`[^`]*`")
# An equality or regex matcher inside a selector's braces.
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"')
# A selector: a metric name, then its braces.
_SELECTOR = re.compile(r"(?<![A-Za-z0-9_:$.])((?:kvroute|process)_[A-Za-z0-9_:]*)\s*\{([^}]*)\}")


def metric_names(expr: str) -> set[str]:
    """The kvroute_* and process_* metric names an expression reads (string
    literals removed first, so label values never count as names)."""
    return set(_NAME.findall(_STRING.sub('""', expr)))


def exact_matchers(expr: str) -> list[tuple[str, str, list[str]]]:
    """(metric, label, values) for each matcher of a named selector whose
    value is a plain word (`=`, `!=`) or an alternation of plain words
    (`=~`, `!~`); Grafana variables and real regexes are left out. A
    negative matcher with a misspelt value filters nothing, so it is
    checked too."""
    found = []
    for metric, body in _SELECTOR.findall(expr):
        for label, op, value in _MATCHER.findall(body):
            if "$" in value:
                continue
            values = value.split("|") if op in ("=~", "!~") else [value]
            if all(re.fullmatch(r"[A-Za-z0-9_./-]+", v) for v in values):
                found.append((metric, label, values))
    return found


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+\S+")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Scrape:
    """One /metrics text: the series (name -> label sets) and the families
    announced by # TYPE."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.series: dict[str, list[dict[str, str]]] = {}
        self.types: dict[str, str] = {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(maxsplit=3)
                self.types[name] = kind
            elif line and not line.startswith("#"):
                m = _SAMPLE.match(line)
                assert m, f"not an exposition line: {line!r}"
                labels = dict(_LABEL.findall(m.group(2) or ""))
                self.series.setdefault(m.group(1), []).append(labels)


def scrape(metrics_addr: str) -> Scrape:
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=TIMEOUT) as r:
        return Scrape(r.read().decode())


def wait_until(check, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


# --- the files under test ----------------------------------------------------

def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' collapsed children included."""
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every target and every query variable."""
    exprs = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            exprs.append((f"panel {panel['title']!r} {target.get('refId')}", target["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            text = query["query"] if isinstance(query, dict) else query
            exprs.append((f"variable {var['name']}", text))
    return exprs


def rule_groups(path: Path) -> list[dict]:
    doc = yaml.safe_load(path.read_text())
    if doc.get("kind") == "PrometheusRule":
        return doc["spec"]["groups"]
    return doc["groups"]


def rule_exprs() -> list[tuple[str, str]]:
    return [
        (f"rule {rule.get('alert') or rule.get('record')}", rule["expr"])
        for group in rule_groups(RULES)
        for rule in group["rules"]
    ]


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, (
        "promtool is missing: install Debian's package prometheus "
        "(apt-get install --no-install-recommends prometheus; scripts/test.sh does)"
    )
    return path


# --- the processes -----------------------------------------------------------

class Kvroute:
    """A `kvroute serve` process on free loopback ports."""

    def __init__(self, *args: str, ready_service: str = "") -> None:
        self.grpc_addr = f"127.0.0.1:{free_port()}"
        self.metrics_addr = f"127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [kvroute_bin(), "serve", "--grpc-addr", self.grpc_addr,
             "--metrics-addr", self.metrics_addr, "--log-level", "warn", *args],
            stdout=subprocess.DEVNULL,
        )
        self.channel = grpc.insecure_channel(self.grpc_addr)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=30)
            self.wait_serving(ready_service)
        except BaseException:
            self.stop()
            raise

    def wait_serving(self, service: str) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(self.channel)
        serving = health_pb2.HealthCheckResponse.SERVING

        def check():
            assert self.proc.poll() is None, "kvroute exited"
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            except grpc.RpcError:
                return False
            return reply.status == serving

        wait_until(check, 30, f"kvroute health {service!r} SERVING", interval=0.2)

    def scrape(self) -> Scrape:
        return scrape(self.metrics_addr)

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class NatsServer:
    """nats-server with JetStream on a free port (Debian's package)."""

    def __init__(self, store: Path) -> None:
        binary = shutil.which("nats-server")
        assert binary, "nats-server is missing: install Debian's package nats-server (scripts/test.sh does)"
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(store)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

        def listening():
            assert self.proc.poll() is None, "nats-server exited"
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_until(listening, 20, "nats-server to listen")

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class EventStream:
    """One PublishEvents stream; `send` hands the server a batch and reads
    the reply that acknowledges it."""

    _END = object()

    def __init__(self, stub) -> None:
        self._outbox = queue.Queue()
        self._replies = stub.PublishEvents(self._requests(), timeout=60)

    def _requests(self):
        while (batch := self._outbox.get()) is not self._END:
            yield batch

    def send(self, batch):
        self._outbox.put(batch)
        return next(self._replies)

    def close(self) -> None:
        self._outbox.put(self._END)
        assert list(self._replies) == []


class EnginePublisher:
    """A vLLM-style KV event publisher: a ZeroMQ PUB socket sending
    `[topic, seq (8 bytes big-endian), msgpack [ts, events, dp_rank]]`, events
    in the positional encoding (the wire format src/engine_events/wire.rs
    decodes)."""

    def __init__(self, port: int) -> None:
        import zmq

        self.socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://127.0.0.1:{port}")

    def send(self, seq: int, events: list) -> None:
        import msgspec

        payload = msgspec.msgpack.encode([time.time(), events, 0])
        self.socket.send_multipart([b"kv-events", struct.pack(">Q", seq), payload])

    @staticmethod
    def stored(engine_hash: int, tokens: list[int]) -> list:
        return ["BlockStored", [engine_hash], None, tokens, BLOCK, None, "GPU"]

    def close(self) -> None:
        self.socket.close()


# --- ext_proc, encoded by hand ----------------------------------------------
# Envoy's ext_proc messages (envoy/service/ext_proc/v3/external_processor.proto)
# as protobuf wire bytes: kvroute vendors no Envoy protos for Python, and the
# few fields a request needs are simple to write.

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _bool_field(number: int, value: bool) -> bytes:
    return _varint(number << 3) + _varint(int(value)) if value else b""


def _headers(pairs: list[tuple[str, str]], end_of_stream: bool) -> bytes:
    # HttpHeaders{headers: HeaderMap{headers: [HeaderValue{key, raw_value}]}, end_of_stream}
    header_map = b"".join(
        _bytes_field(1, _bytes_field(1, k.encode()) + _bytes_field(3, v.encode())) for k, v in pairs
    )
    return _bytes_field(1, header_map) + _bool_field(3, end_of_stream)


def _body(data: bytes, end_of_stream: bool) -> bytes:
    # HttpBody{body, end_of_stream}
    return _bytes_field(1, data) + _bool_field(2, end_of_stream)


def ext_proc_request_headers(path: str) -> bytes:
    return _bytes_field(2, _headers([(":method", "POST"), (":path", path),
                                     ("content-type", "application/json")], False))


def ext_proc_request_body(data: bytes) -> bytes:
    return _bytes_field(4, _body(data, True))


def ext_proc_response_headers(status: int) -> bytes:
    return _bytes_field(3, _headers([(":status", str(status))], False))


def ext_proc_response_body(data: bytes) -> bytes:
    return _bytes_field(5, _body(data, True))


def ext_proc_exchange(channel, messages: list[bytes]) -> list[bytes]:
    """Sends `messages` on one Process stream, then ends it; the answers."""
    process = channel.stream_stream(EXT_PROC_PATH)
    return list(process(iter(messages), timeout=TIMEOUT))


# --- driving kvroute until every family has series ---------------------------

def block_tokens(base: int, i: int) -> list[int]:
    return list(range(base + BLOCK * i, base + BLOCK * (i + 1)))


def prompt_tokens(base: int, blocks: int) -> list[int]:
    return [t for i in range(blocks) for t in block_tokens(base, i)]


def register(pb, channel, worker_id: int, model: str, **extra) -> None:
    w = pb.workers_pb2
    workers = pb.workers_grpc.WorkersStub(channel)

    def attempt():
        try:
            return workers.RegisterWorker(
                w.RegisterWorkerRequest(worker_id=worker_id, model=model, block_size=BLOCK,
                                        dp_size=1, total_kv_blocks=10_000, **extra),
                timeout=TIMEOUT,
            )
        except grpc.RpcError as error:
            # A replica still catching up with the shared log says so.
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                return None
            raise

    wait_until(attempt, 30, f"RegisterWorker {worker_id}", interval=0.2)


def stored_event(pb, event_id: int, base: int, first: int, count: int, engine: int, parent=None):
    w, c = pb.workers_pb2, pb.common_pb2
    blocks = [
        w.StoredBlock(engine_hash=engine + i, token_ids=c.TokenIds(ids=block_tokens(base, first + i)))
        for i in range(count)
    ]
    kwargs = {} if parent is None else {"parent_engine_hash": parent}
    return w.KvEvent(event_id=event_id, stored=w.BlocksStored(blocks=blocks, **kwargs))


def select(pb, channel, request_id: str, model: str, tokens: list[int], timeout=TIMEOUT, **extra):
    r, c = pb.router_pb2, pb.common_pb2
    request = r.SelectWorkerRequest(
        request_id=request_id, model=model,
        prompt=r.Prompt(token_ids=c.TokenIds(ids=tokens)), **extra,
    )
    return pb.router_grpc.RouterStub(channel).SelectWorker(request, timeout=timeout)


def drive_standalone(pb, kv: Kvroute, ext_proc_addr: str, publisher: EnginePublisher,
                     pool_http_port: int) -> None:
    channel = kv.channel
    w, r = pb.workers_pb2, pb.router_pb2
    workers = pb.workers_grpc.WorkersStub(channel)
    router = pb.router_grpc.RouterStub(channel)
    admin = pb.admin_grpc.AdminStub(channel)

    for worker_id in (W1, W2):
        register(pb, channel, worker_id, MODEL, max_num_batched_tokens=8192)
    register(pb, channel, W_BUSY, BUSY_MODEL, max_num_batched_tokens=BLOCK)

    # Worker 1 publishes in order; worker 2's stream has a gap (event 2
    # before 1) that stays open until it loses trust (--event-gap-deadline),
    # then the resend closes it (its events count as caught up).
    s1 = EventStream(workers)
    reply = s1.send(w.KvEventBatch(worker_id=W1, dp_rank=0, events=[stored_event(pb, 0, 1000, 0, 4, 100)]))
    assert reply.last_applied_event_id == 0
    s1.close()
    s2 = EventStream(workers)
    s2.send(w.KvEventBatch(worker_id=W2, dp_rank=0, events=[stored_event(pb, 0, 1000, 0, 1, 200)]))
    reply = s2.send(w.KvEventBatch(worker_id=W2, dp_rank=0,
                                   events=[stored_event(pb, 2, 5000, 0, 2, 300)]))
    assert reply.resend_from_event_id == 1, reply
    wait_until(lambda: "kvroute_worker_trust_changes_total{" in kv.scrape().text, 20,
               "worker 2 to lose trust over its open gap")
    reply = s2.send(w.KvEventBatch(worker_id=W2, dp_rank=0,
                                   events=[stored_event(pb, 1, 1000, 1, 1, 201, parent=200)]))
    assert reply.last_applied_event_id == 2, reply
    s2.close()

    # Bookings: RESERVE, marked and released with the engine's cached tokens;
    # a QUERY_ONLY call and an ExplainSelection.
    for n in range(3):
        chosen = select(pb, channel, f"obs-{n}", MODEL, prompt_tokens(1000, 4))
        assert chosen.admission == r.ADMISSION_RESULT_ADMITTED, chosen
        router.MarkPrefillComplete(r.MarkPrefillCompleteRequest(request_id=f"obs-{n}", cached_tokens=32),
                                   timeout=TIMEOUT)
        router.ReleaseRequest(r.ReleaseRequestRequest(request_id=f"obs-{n}", cached_tokens=32),
                              timeout=TIMEOUT)
    select(pb, channel, "obs-query", MODEL, prompt_tokens(5000, 2), mode=r.SELECTION_MODE_QUERY_ONLY)
    admin.ExplainSelection(
        r.SelectWorkerRequest(request_id="obs-explain", model=MODEL,
                              prompt=r.Prompt(token_ids=pb.common_pb2.TokenIds(ids=prompt_tokens(1000, 4)))),
        timeout=TIMEOUT,
    )

    # Admission: the busy worker's one booking (8 blocks against a 16-token
    # budget) makes it busy; a WAIT call then queues past its deadline and a
    # REJECT call is refused.
    select(pb, channel, "busy-0", BUSY_MODEL, prompt_tokens(7000, 8))
    with pytest.raises(grpc.RpcError) as queued:
        select(pb, channel, "busy-1", BUSY_MODEL, prompt_tokens(7000, 8), timeout=0.5)
    assert queued.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, queued.value
    with pytest.raises(grpc.RpcError) as refused:
        select(pb, channel, "busy-2", BUSY_MODEL, prompt_tokens(7000, 8), admission=r.ADMISSION_MODE_REJECT)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    router.ReleaseRequest(r.ReleaseRequestRequest(request_id="busy-0"), timeout=TIMEOUT)

    # The pool member's engine: wait for the member to be registered (its
    # engine-event series appear), then publish until a batch is taken (a
    # PUB socket drops what it sends before the subscription reaches it;
    # repeats are skipped as duplicates).
    def series_of(name):
        return kv.scrape().series.get(name, [])

    subscribed = wait_until(lambda: series_of("kvroute_engine_event_connected_ranks"), 30,
                            "the pool member's subscription")
    pool_worker = subscribed[0]["worker"]

    def batch_taken():
        publisher.send(0, [EnginePublisher.stored(0xABC, list(range(16)))])
        return any(s.get("worker") == pool_worker for s in series_of("kvroute_engine_event_last_age_seconds"))

    wait_until(batch_taken, 30, "a batch from the pool member's engine", interval=0.2)

    # The endpoint picker: a completion for the pool member's model (routed,
    # tokenized with the tiny tokenizer, the response ends the booking); one
    # for the gRPC workers' model (no tokenizer, no HTTP endpoint: 503); an
    # empty message (a protocol oddity).
    ext_proc = grpc.insecure_channel(ext_proc_addr)
    try:
        body = json.dumps({"model": POOL_MODEL, "prompt": " ".join(f"w{i}" for i in range(40)),
                           "max_tokens": 4}).encode()
        answers = ext_proc_exchange(ext_proc, [
            ext_proc_request_headers("/v1/completions"),
            ext_proc_request_body(body),
            ext_proc_response_headers(200),
            ext_proc_response_body(b'{"usage": {"prompt_tokens_details": {"cached_tokens": 0}}}'),
        ])
        assert f"127.0.0.1:{pool_http_port}".encode() in b"".join(answers), answers
        body = json.dumps({"model": MODEL, "prompt": "hello"}).encode()
        ext_proc_exchange(ext_proc, [ext_proc_request_headers("/v1/completions"),
                                     ext_proc_request_body(body)])
        ext_proc_exchange(ext_proc, [b""])
    finally:
        ext_proc.close()

    # Durable state: a snapshot written now.
    admin.Snapshot(pb.admin_pb2.SnapshotRequest(), timeout=TIMEOUT)


def drive_replica(pb, kv: Kvroute) -> None:
    channel = kv.channel
    w, r = pb.workers_pb2, pb.router_pb2
    register(pb, channel, W1, MODEL, max_num_batched_tokens=8192)
    stream = EventStream(pb.workers_grpc.WorkersStub(channel))
    reply = stream.send(w.KvEventBatch(worker_id=W1, dp_rank=0, events=[stored_event(pb, 0, 1000, 0, 2, 100)]))
    assert reply.last_applied_event_id == 0
    stream.close()
    chosen = select(pb, channel, "replica-0", MODEL, prompt_tokens(1000, 2))
    assert chosen.admission == r.ADMISSION_RESULT_ADMITTED, chosen
    pb.router_grpc.RouterStub(channel).ReleaseRequest(r.ReleaseRequestRequest(request_id="replica-0"),
                                                      timeout=TIMEOUT)
    # Past --max-booking-memory: refused.
    with pytest.raises(grpc.RpcError) as refused:
        select(pb, channel, "replica-1", MODEL, prompt_tokens(1000, 64))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value


@pytest.fixture(scope="module")
def scrapes(kvroute_pb, tmp_path_factory):
    """The scrapes of a standalone kvroute and of a cluster replica, each
    driven until the families the dashboard and the rules read have series."""
    tmp = tmp_path_factory.mktemp("observability")
    events_port, http_port = free_port(), free_port()
    pool = tmp / "pool.toml"
    pool.write_text(
        f'model = "{POOL_MODEL}"\nhttp_port = {http_port}\nevents_port = {events_port}\n'
        f'dialect = "vllm"\nblock_size = {BLOCK}\ndp_size = 1\nmembers = ["127.0.0.1"]\n'
    )
    publisher = EnginePublisher(events_port)
    ext_proc_addr = f"127.0.0.1:{free_port()}"
    nats = replica = local = standalone = None
    try:
        standalone = Kvroute(
            "--state-dir", str(tmp / "state"), "--snapshot-interval", "1h",
            "--ext-proc-addr", ext_proc_addr,
            "--epp-tokenizer", f"{POOL_MODEL}={TINY_TOKENIZER}",
            "--pool", str(pool), "--pool-refresh-interval", "1s",
            "--event-gap-deadline", "1s",
            ready_service="readiness",
        )
        drive_standalone(kvroute_pb, standalone, ext_proc_addr, publisher, http_port)
        alone = standalone.scrape()

        nats = NatsServer(tmp / "nats")
        replica = Kvroute("--nats-url", nats.url, "--replica-id", "obs-a",
                          "--cluster-name", "obs", "--max-booking-memory", "1KiB",
                          ready_service="readiness")
        drive_replica(kvroute_pb, replica)
        # A replica deciding locally (not in the log's order): the booking
        # sync's families have series only there.
        local = Kvroute("--nats-url", nats.url, "--replica-id", "obs-l",
                        "--cluster-name", "obsl", "--max-booking-memory", "1KiB",
                        "--decision-order", "local", ready_service="readiness")
        drive_replica(kvroute_pb, local)
        clustered = Scrape(replica.scrape().text + "\n" + local.scrape().text)
        yield {"standalone": alone, "replica": clustered}
    finally:
        for process in (local, replica, standalone, nats):
            if process is not None:
                process.stop()
        publisher.close()


# --- the tests ---------------------------------------------------------------

def test_names_are_read_from_promql():
    expr = ('sum by (method) (rate(kvroute_rpc_requests_total{method="/kvroute.v1.Router/X", '
            'x=~"kvroute_not_a_name"}[$__rate_interval])) / on (job) '
            'process_resident_memory_bytes offset 1h - $kvroute_variable')
    assert metric_names(expr) == {"kvroute_rpc_requests_total", "process_resident_memory_bytes"}
    assert exact_matchers(expr) == [("kvroute_rpc_requests_total", "method", ["/kvroute.v1.Router/X"]),
                                    ("kvroute_rpc_requests_total", "x", ["kvroute_not_a_name"])]
    assert exact_matchers('kvroute_a{code=~"A|B", b!="c", d=~"$v", e=~"x.+"}') == [
        ("kvroute_a", "code", ["A", "B"]), ("kvroute_a", "b", ["c"])]


def test_every_queried_series_is_exported(scrapes):
    """Every kvroute_* / process_* name in the dashboard's and the rules'
    PromQL is a series of a real scrape (histograms by their _bucket,
    _sum or _count series, as queried)."""
    exprs = dashboard_exprs(load_dashboard()) + rule_exprs()
    exported = set(scrapes["standalone"].series) | set(scrapes["replica"].series)
    queried: dict[str, list[str]] = {}
    for where, expr in exprs:
        for name in metric_names(expr):
            queried.setdefault(name, []).append(where)
    # The extraction found the families the files are about (a broken
    # pattern would find nothing and pass).
    assert len(queried) >= 60, sorted(queried)
    missing = {name: where for name, where in queried.items() if name not in exported}
    assert not missing, f"queried but not in kvroute's /metrics: {missing}"


def test_every_matched_label_value_is_kvroutes(scrapes):
    """A label the expressions match on exists on that family, and each
    value they name is one kvroute uses: seen in a scrape, or a string
    literal in src/ (outcomes the drive cannot cause, such as a failed
    snapshot write)."""
    series = {}
    for s in scrapes.values():
        for name, label_sets in s.series.items():
            series.setdefault(name, []).extend(label_sets)
    literals = set()
    for path in (REPO / "src").rglob("*.rs"):
        literals.update(re.findall(r'"([^"\\]*)"', path.read_text()))
    problems = []
    checked = 0
    for where, expr in dashboard_exprs(load_dashboard()) + rule_exprs():
        for metric, label, values in exact_matchers(expr):
            if label in ("le", "job", "instance"):
                continue
            label_sets = series.get(metric, [])
            if not any(label in labels for labels in label_sets):
                problems.append(f"{where}: {metric} has no label {label!r}")
                continue
            seen = {labels.get(label) for labels in label_sets}
            for value in values:
                checked += 1
                if value not in seen and value not in literals:
                    problems.append(f"{where}: {metric}{{{label}={value!r}}} is neither scraped nor in src/")
    assert checked >= 20
    assert not problems, "\n".join(problems)


def test_the_drive_made_the_telling_series(scrapes):
    """The scrapes hold the series that only specific events make: the
    comparisons above are only as good as the drive."""
    alone, replica = scrapes["standalone"].series, scrapes["replica"].series

    def values(series, name, label):
        return {labels.get(label) for labels in series.get(name, [])}

    assert {"admitted", "query_only", "deadline_exceeded"} <= values(alone, "kvroute_routing_decisions_total", "outcome")
    assert {"reserve", "untracked"} <= values(alone, "kvroute_routing_overlap_ratio_count", "mode")
    assert "downgraded" in values(alone, "kvroute_worker_trust_changes_total", "change")
    assert "written" in values(alone, "kvroute_snapshots_total", "outcome")
    assert {"routed", "unavailable"} <= values(alone, "kvroute_epp_requests_total", "outcome")
    assert "finished" in values(alone, "kvroute_epp_streams_ended_total", "end")
    assert values(alone, "kvroute_engine_event_last_age_seconds", "worker") - {None}
    assert "all" in values(replica, "kvroute_bookings_refused_total", "bound")
    assert "sent" in values(replica, "kvroute_cluster_booking_changes_total", "direction")
    assert "appended" in values(replica, "kvroute_cluster_log_appends_total", "outcome")
    assert "ordered" in values(replica, "kvroute_cluster_ordered_decisions_total", "outcome")
    assert alone["kvroute_heap_allocated_bytes"] and alone["process_resident_memory_bytes"]


def test_dashboard_is_well_formed():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "kvroute" and dashboard["title"]
    assert dashboard["schemaVersion"] >= 36  # Grafana 9.3+; written for 10 and later
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"

    panels = dashboard_panels(dashboard)
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == ["Routing", "Bookings and admission", "Workers and events", "Trust",
                    "Endpoint picker", "Durable state", "Cluster", "Process memory"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    titles = [p["title"] for p in panels if p["type"] != "row"]
    assert len(titles) == len(set(titles)), "duplicate panel titles"

    boxes = []
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        assert g["y"] >= 0 and g["h"] > 0, panel["title"]
        for other, (x, y, w, h) in boxes:
            overlap = g["x"] < x + w and x < g["x"] + g["w"] and g["y"] < y + h and y < g["y"] + g["h"]
            assert not overlap, f"{panel['title']!r} overlaps {other!r}"
        boxes.append((panel["title"], (g["x"], g["y"], g["w"], g["h"])))
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel.get("description"), panel["title"]
        targets = panel["targets"]
        assert targets, panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert target["datasource"] == panel["datasource"], panel["title"]
            assert target["expr"].strip(), panel["title"]

    # Every panel sits below its row and above the next one.
    current_row_y = None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            assert current_row_y is None or panel["gridPos"]["y"] > current_row_y
            current_row_y = panel["gridPos"]["y"]
        else:
            assert current_row_y is not None and panel["gridPos"]["y"] > current_row_y, panel["title"]


def test_dashboard_queries_follow_the_conventions():
    """Counters through rate()/increase() over $__rate_interval; quantiles
    of histograms summed by le; every selector filtered by the job and
    instance variables."""
    for where, expr in dashboard_exprs(load_dashboard()):
        if where.startswith("variable"):
            continue
        for name in metric_names(expr):
            counter = name.endswith(("_total", "_bucket", "_sum", "_count"))
            if counter:
                assert re.search(rf"(rate|increase)\({name}\{{[^}}]*\}}\[\$__rate_interval\]\)", expr), \
                    f"{where}: {name} outside rate()/increase() over $__rate_interval"
        for name, body in _SELECTOR.findall(expr):
            assert 'job=~"$job"' in body and 'instance=~"$instance"' in body, f"{where}: {name} unfiltered"
        for match in re.finditer(r"histogram_quantile\(", expr):
            assert re.match(r"histogram_quantile\(0\.\d+, sum by \(le\b", expr[match.start():]), where
        assert len(metric_names(expr)) > 0, where


def test_dashboard_queries_parse(tmp_path):
    """promtool parses every dashboard query (as recording rules, with the
    Grafana variables given values)."""
    rules = []
    for n, (where, expr) in enumerate(dashboard_exprs(load_dashboard())):
        if where.startswith("variable"):
            continue
        concrete = (expr.replace("$__rate_interval", "5m")
                    .replace("$job", ".*").replace("$instance", ".*"))
        assert "$" not in concrete, where
        rules.append({"record": f"dashboard:query_{n}", "expr": concrete})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_prometheus_rule_holds_the_rules_file_groups():
    doc = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["kind"] == "PrometheusRule"
    assert doc["metadata"]["name"] == "kvroute"
    plain = rule_groups(RULES)
    assert plain, "no groups"
    assert doc["spec"]["groups"] == plain


def test_alerts_follow_the_conventions():
    alerts = [rule for group in rule_groups(RULES) for rule in group["rules"]]
    assert {a["alert"] for a in alerts} >= {
        "KvrouteEngineEventsSilent", "KvrouteWorkerUnsynced", "KvrouteWorkersUntrusted",
        "KvrouteSnapshotWriteFailed", "KvrouteClusterLogLag", "KvrouteAdmissionRejections",
        "KvrouteHeapGrowing",
    }
    for alert in alerts:
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], alert["alert"]


def test_every_alert_is_unit_tested_both_ways():
    """Each alert has a promtool case where it fires and one where it does
    not; where it fires with a worker label, the annotations name that
    worker."""
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == ["../../deploy/prometheus/kvroute-rules.yaml"]
    firing, silent = set(), set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else silent).add(check["alertname"])
            for alert in check["exp_alerts"]:
                worker = alert["exp_labels"].get("worker")
                if worker is not None:
                    for text in alert["exp_annotations"].values():
                        assert f"worker {worker}" in text.lower(), (check["alertname"], text)
    alerts = {rule["alert"] for group in rule_groups(RULES) for rule in group["rules"]}
    assert alerts - firing == set(), "never seen firing"
    assert alerts - silent == set(), "never seen silent"


def test_promtool_checks_the_rules():
    run = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_promtool_unit_tests_the_alerts():
    run = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout
