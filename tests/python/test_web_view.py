"""The operators' web view (#37) in a real browser, Debian's headless
Chromium, against a kvroute fed by workers, KV events and SelectWorker
traffic: the test reads the page Chromium rendered (its DOM after the
script ran), not the HTML sent, and finds the fleet, an index share, a
decision with its candidates and a cordon made during the test. Each page's
screenshot is written to $KVROUTE_ARTIFACTS/web-view (target/artifacts by
default). Also here: the view's bounds against a hostile client, and the
auth policy's operator-read check."""
import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO
from test_observability import (MODEL, EventStream, Kvroute, prompt_tokens, register, scrape,
                                select, stored_event, wait_until)

ARTIFACTS = Path(os.environ.get("KVROUTE_ARTIFACTS", REPO / "target" / "artifacts")) / "web-view"
PAGES = ["fleet", "index", "events", "decisions", "cluster"]
WORKERS = (11, 12, 13)
CORDONED = 12


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail("chromium is missing: scripts/chromium.sh installs it")
    return found


def browse(url: str, *extra: str) -> subprocess.CompletedProcess:
    """Chromium headless on `url`, with the flags that keep it off the
    network this machine closes, in a fresh profile."""
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
             "--virtual-time-budget=6000", *extra, url],
            capture_output=True, text=True, timeout=120)


def rendered(url: str) -> str:
    done = browse(url, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def fed(kvroute_pb):
    """A kvroute with three workers, events for worker 11, decisions, and
    worker 12 cordoned."""
    pb = kvroute_pb
    kv = Kvroute()
    try:
        channel = kv.channel
        for worker_id in WORKERS:
            register(pb, channel, worker_id, MODEL, max_num_batched_tokens=8192, lease_ttl_secs=3600)
        stream = EventStream(pb.workers_grpc.WorkersStub(channel))
        stream.send(pb.workers_pb2.KvEventBatch(
            worker_id=11, dp_rank=0, events=[stored_event(pb, 0, 1000, 0, 4, 100)]))
        stream.close()
        for n in range(3):
            select(pb, channel, f"web-{n}", MODEL, prompt_tokens(1000, 4))
        pb.admin_grpc.AdminStub(channel).CordonWorker(
            pb.admin_pb2.CordonWorkerRequest(worker_id=CORDONED), timeout=10)
        yield kv
    finally:
        kv.stop()


def test_the_browser_renders_every_page_with_the_routers_state(fed):
    base = f"http://{fed.metrics_addr}/ui/"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    doms = {page: rendered(f"{base}#{page}") for page in PAGES}
    for page, dom in doms.items():
        assert f'data-loaded="{page}"' in dom, f"{page}: the script did not draw it\n{dom[:1500]}"

    # The fleet: every worker, the cordon made during the test.
    fleet = doms["fleet"]
    for worker_id in WORKERS:
        assert f'data-worker="{worker_id}"' in fleet
    row = fleet.split(f'data-worker="{CORDONED}"', 1)[1].split("</tr>", 1)[0]
    assert "cordoned" in row, row
    assert "cordoned" not in fleet.split('data-worker="11"', 1)[1].split("</tr>", 1)[0]

    # The index: worker 11 holds the model's cached blocks.
    index = doms["index"]
    assert f">{MODEL}<" in index
    share = index.split('data-share-worker="11"', 1)[1].split("</tr>", 1)[0]
    assert "100.0 %" in share, share

    # A decision with its candidates, the chosen one marked.
    decisions = doms["decisions"]
    assert 'data-request="web-2"' in decisions
    decision = decisions.split('data-request="web-2"', 1)[1].split('class="decision"', 1)[0]
    assert 'class="chosen"' in decision and "overlap 4/4 blocks" in decision, decision[:2000]

    # Event health names worker 11's last event; the cluster page says
    # this is a single router.
    assert "PublishEvents" in doms["events"]
    assert "single router" in doms["cluster"]

    for page in PAGES:
        shot = ARTIFACTS / f"{page}.png"
        done = browse(f"{base}#{page}", f"--screenshot={shot}", "--window-size=1400,1000")
        assert done.returncode == 0, done.stderr[-2000:]
        assert shot.stat().st_size > 10_000, f"{shot}: {shot.stat().st_size} bytes"


def fetch(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def raw_get(addr: str, target: str) -> int:
    """A GET of `target` exactly as written (no client normalizes it)."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n".encode())
        head = s.recv(4096).decode(errors="replace")
    return int(head.split(" ", 2)[1])


def test_a_hostile_client_gets_errors_and_counts(fed):
    addr = fed.metrics_addr
    status, body = fetch(f"http://{addr}/ui/api/fleet?filter=" + "x" * 5000)
    assert status == 414, body
    for target in ["/ui/../../etc/passwd", "/ui/%2e%2e/%2e%2e/etc/passwd", "/ui/..%2f..%2fCargo.toml",
                   "/ui/assets/index.html", "/ui/api/nothing"]:
        assert raw_get(addr, target) in (400, 404), target
    status, _ = fetch(f"http://{addr}/ui/api/fleet?offset=minus")
    assert status == 400
    # A page is bounded whatever it asks for.
    status, body = fetch(f"http://{addr}/ui/api/fleet?limit=1000000")
    assert status == 200 and len(json.loads(body)["workers"]) == len(WORKERS)
    text = scrape(addr).text
    assert 'kvroute_web_requests_total{outcome="too_long"} 1' in text
    assert 'kvroute_web_requests_total{outcome="not_found"}' in text


def test_with_a_policy_only_operator_read_sees_the_data(tmp_path):
    read, front = "web-reader-token", "web-frontend-token"
    sha = lambda t: hashlib.sha256(t.encode()).hexdigest()  # noqa: E731
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[[identity]]\nname = "reader"\nroles = ["operator-read"]\ntoken_sha256 = "{sha(read)}"\n'
        f'[[identity]]\nname = "front"\nroles = ["frontend"]\ntoken_sha256 = "{sha(front)}"\n')
    kv = Kvroute("--auth-policy", str(policy))
    try:
        api = f"http://{kv.metrics_addr}/ui/api/fleet"
        status, body = fetch(api)
        assert status == 401 and b"workers" not in body
        status, body = fetch(api, {"Authorization": f"Bearer {front}"})
        assert status == 403 and b"workers" not in body
        status, body = fetch(api, {"Authorization": f"Bearer {read}"})
        assert status == 200 and json.loads(body)["total"] == 0
        # The page itself holds no data; it asks for a token.
        status, body = fetch(f"http://{kv.metrics_addr}/ui/")
        assert status == 200 and b'id="login"' in body
        text = kv.scrape().text
        assert 'kvroute_web_requests_total{outcome="unauthenticated"} 1' in text
        assert 'kvroute_web_requests_total{outcome="forbidden"} 1' in text
    finally:
        kv.stop()
