"""TLS, client certificates and roles, checked from Python grpcio against a
real `kvroute serve`.

The certificates are made at test time in a temporary directory with the
openssl CLI (3.0 is enough), so nothing secret is committed: a CA; a server
certificate for 127.0.0.1 and localhost; client certificates whose SAN URIs
name the policy's identities, plus one the policy does not list; one signed
by another CA; and one that expired in 2020. openssl 3.0's `x509` cannot
backdate a certificate, so the expired one is signed with `openssl ca
-startdate ... -enddate ...` and a throwaway CA database. The untrusted and
the expired certificates carry the frontend's SAN: only their signer or
their dates can be why they are refused.
"""
import hashlib
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import free_port, kvroute_bin

if shutil.which("openssl") is None:
    pytest.skip("needs the openssl CLI to make test certificates (scripts/test.sh installs it)",
                allow_module_level=True)

TIMEOUT = 10
MODEL = "tls-model"
CLIENTS = {  # file name -> SAN URI
    "frontend": "spiffe://test/frontend", "worker-a": "spiffe://test/worker-a",
    "oncall": "spiffe://test/oncall", "stranger": "spiffe://test/stranger",
}
OPENSSL_CNF = """\
[req]
distinguished_name = dn
[dn]
[ca]
default_ca = backdating
[backdating]
database = {dir}/index.txt
new_certs_dir = {dir}
serial = {dir}/serial
default_md = sha256
policy = any_name
unique_subject = no
[any_name]
commonName = supplied
[ca_cert]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
[server_cert]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
"""
CLIENT_SECTION = """\
[client_{name}]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectAltName = URI:{uri}
"""
POLICY = """\
[[identity]]
name = "gateway"
roles = ["frontend"]
san = ["spiffe://test/frontend"]

[[identity]]
name = "worker-a"
roles = ["worker"]
san = ["spiffe://test/worker-a"]
worker_ids = ["100-199"]

[[identity]]
name = "oncall"
roles = ["operator-read", "operator-write"]
san = ["spiffe://test/oncall"]

[[identity]]
name = "dashboards"
roles = ["operator-read"]
token_sha256 = "{digest}"
"""


def openssl(d: Path, *args):
    run = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True)
    assert run.returncode == 0, f"openssl {' '.join(args)}:\n{run.stderr}"


def new_key_and_csr(d: Path, name: str):
    openssl(d, "req", "-new", "-config", "openssl.cnf", "-newkey", "ec", "-pkeyopt",
            "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", "-subj", f"/CN={name}")


def new_ca(d: Path, name: str):
    openssl(d, "req", "-x509", "-new", "-config", "openssl.cnf", "-extensions", "ca_cert",
            "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.crt", "-subj", f"/CN={name}", "-days", "2")


def sign(d: Path, name: str, section: str, ca: str = "ca"):
    new_key_and_csr(d, name)
    openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-set_serial", str(secrets.randbits(63) + 1), "-days", "2",
            "-extfile", "openssl.cnf", "-extensions", section, "-out", f"{name}.crt")


def make_pki(d: Path) -> Path:
    """Every certificate the tests use, in `d`."""
    cnf = OPENSSL_CNF.format(dir=d) + "".join(
        CLIENT_SECTION.format(name=n, uri=u) for n, u in CLIENTS.items())
    (d / "openssl.cnf").write_text(cnf)
    new_ca(d, "ca")
    new_ca(d, "other-ca")
    sign(d, "server", "server_cert")
    for name in CLIENTS:
        sign(d, name, f"client_{name}")
    sign(d, "untrusted", "client_frontend", ca="other-ca")
    # Valid for one day in 2020, from the right CA, with the frontend's SAN.
    (d / "index.txt").write_text("")
    (d / "serial").write_text("1000\n")
    new_key_and_csr(d, "expired")
    openssl(d, "ca", "-batch", "-config", "openssl.cnf", "-notext", "-cert", "ca.crt",
            "-keyfile", "ca.key", "-in", "expired.csr", "-out", "expired.crt",
            "-startdate", "20200101000000Z", "-enddate", "20200102000000Z",
            "-extensions", "client_frontend")
    return d


def creds(pki: Path, client: str | None = None):
    """TLS credentials trusting our CA, presenting `client`'s certificate if given."""
    key = cert = None
    if client:
        key, cert = (pki / f"{client}.key").read_bytes(), (pki / f"{client}.crt").read_bytes()
    return grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(), key, cert)


def channel(addr: str, credentials):
    # A subchannel pool of its own: no connection is shared across credentials.
    return grpc.secure_channel(addr, credentials, options=[("grpc.use_local_subchannel_pool", 1)])


def health(addr: str, credentials, service: str = ""):
    with channel(addr, credentials) as ch:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(ch).Check(request, timeout=TIMEOUT).status


def code(call, request, **kwargs):
    """The status code and details of one call (OK and "" when it succeeds)."""
    try:
        call(request, timeout=TIMEOUT, **kwargs)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def serve(tmp: Path, ready_creds, *flags):
    """Starts `kvroute serve` with `flags`; returns (process, address, log path)
    once a health check over `ready_creds` answers."""
    port = free_port()
    addr, log = f"127.0.0.1:{port}", tmp / f"kvroute-{port}.log"
    proc = subprocess.Popen(
        [kvroute_bin(), "serve", "--grpc-addr", addr, "--metrics-addr", f"127.0.0.1:{free_port()}", *flags],
        stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, f"kvroute exited {proc.returncode}:\n{log.read_text()}"
        try:
            if health(addr, ready_creds) == health_pb2.HealthCheckResponse.SERVING:
                return proc, addr, log
        except grpc.RpcError:
            assert time.monotonic() < deadline, f"kvroute did not come up:\n{log.read_text()}"
            time.sleep(0.1)


def stop(proc):
    proc.terminate()
    assert proc.wait(timeout=30) == 0, "kvroute did not exit 0 on SIGTERM"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token():
    return "test-" + secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def policy(pki, token):
    path = pki / "policy.toml"
    path.write_text(POLICY.format(digest=hashlib.sha256(token.encode()).hexdigest()))
    return path


@pytest.fixture(scope="module")
def mtls(pki, policy):
    """A server requiring client certificates from our CA, with the policy."""
    proc, addr, _ = serve(pki, creds(pki, "frontend"), "--log-level", "warn",
                          "--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key"),
                          "--tls-client-ca", str(pki / "ca.crt"), "--auth-policy", str(policy))
    yield addr
    stop(proc)


@pytest.fixture
def stubs(mtls, pki, kvroute_pb):
    """stubs(client) -> (workers, router, admin) over that client's certificate."""
    pb, opened = kvroute_pb, []

    def make(client):
        ch = channel(mtls, creds(pki, client))
        opened.append(ch)
        return pb.workers_grpc.WorkersStub(ch), pb.router_grpc.RouterStub(ch), pb.admin_grpc.AdminStub(ch)

    yield make
    for ch in opened:
        ch.close()


def register(pb, worker_id, **kwargs):
    return pb.workers_pb2.RegisterWorkerRequest(
        worker_id=worker_id, model=MODEL, block_size=16, dp_size=1,
        total_kv_blocks=1000, max_num_batched_tokens=8192, **kwargs)


@pytest.mark.parametrize("client", [None, "untrusted", "expired"])
def test_handshake_refuses_missing_untrusted_and_expired_certificates(mtls, pki, client):
    with pytest.raises(grpc.RpcError) as failure:
        health(mtls, creds(pki, client))
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value


def test_health_is_open_to_any_certificate_the_ca_signed(mtls, pki, stubs, kvroute_pb):
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health(mtls, creds(pki, "stranger")) == serving
    assert health(mtls, creds(pki, "stranger"), "kvroute.v1.Router") == serving
    # The stranger's certificate is valid but names no identity of the policy.
    _, _, admin = stubs("stranger")
    got, _ = code(admin.ListWorkers, kvroute_pb.admin_pb2.ListWorkersRequest())
    assert got in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), got


def test_worker_acts_for_its_own_ids_only(stubs, kvroute_pb):
    pb, w = kvroute_pb, kvroute_pb.workers_pb2
    workers, router, admin = stubs("worker-a")
    assert workers.RegisterWorker(register(pb, 150), timeout=TIMEOUT).created
    assert workers.Heartbeat(w.HeartbeatRequest(worker_id=150), timeout=TIMEOUT).lease_ttl_secs > 0
    for call, request, worker_id in ((workers.RegisterWorker, register(pb, 250), 250),
                                     (workers.Heartbeat, w.HeartbeatRequest(worker_id=250), 250),
                                     (workers.DeregisterWorker, w.DeregisterWorkerRequest(worker_id=200), 200)):
        got, details = code(call, request)
        assert got == grpc.StatusCode.PERMISSION_DENIED, (call, got, details)
        assert "worker-a" in details and str(worker_id) in details, details
    # Nor does the worker role reach the other services.
    got, _ = code(admin.ListWorkers, pb.admin_pb2.ListWorkersRequest())
    assert got == grpc.StatusCode.PERMISSION_DENIED
    # Nothing was registered for 250.
    _, _, oncall = stubs("oncall")
    got, _ = code(oncall.GetWorker, pb.admin_pb2.GetWorkerRequest(worker_id=250))
    assert got == grpc.StatusCode.NOT_FOUND


def test_engine_endpoint_outside_the_allow_list_is_refused(stubs, kvroute_pb):
    workers, _, _ = stubs("worker-a")
    # 192.0.2.0/24 is TEST-NET-1: not this peer's address, nothing listens there.
    request = register(kvroute_pb, 151, events_endpoint="tcp://192.0.2.7:5557", events_dialect="vllm")
    got, details = code(workers.RegisterWorker, request)
    assert got == grpc.StatusCode.PERMISSION_DENIED, details
    assert details.startswith("worker 151: events_endpoint: host is not in --engine-endpoint-allow"), details


def test_frontend_routes_and_operators_cordon(stubs, kvroute_pb):
    pb, r = kvroute_pb, kvroute_pb.router_pb2
    workers, _, _ = stubs("worker-a")
    workers.RegisterWorker(register(pb, 160), timeout=TIMEOUT)
    _, router, admin = stubs("frontend")
    prompt = r.Prompt(token_ids=pb.common_pb2.TokenIds(ids=list(range(64))))
    chosen = router.SelectWorker(r.SelectWorkerRequest(request_id="tls-1", model=MODEL, prompt=prompt),
                                 timeout=TIMEOUT)
    assert 100 <= chosen.worker_id < 200, chosen
    assert router.ReleaseRequest(r.ReleaseRequestRequest(request_id="tls-1"), timeout=TIMEOUT).changed
    got, details = code(admin.CordonWorker, pb.admin_pb2.CordonWorkerRequest(worker_id=160))
    assert got == grpc.StatusCode.PERMISSION_DENIED, details
    assert "gateway" in details and "operator-write" in details, details
    # Operators read and write the Admin service, and route nothing.
    _, oncall_router, oncall = stubs("oncall")
    assert oncall.CordonWorker(pb.admin_pb2.CordonWorkerRequest(worker_id=160), timeout=TIMEOUT).cordoned
    assert not oncall.UncordonWorker(pb.admin_pb2.UncordonWorkerRequest(worker_id=160), timeout=TIMEOUT).cordoned
    got, _ = code(oncall_router.SelectWorker, r.SelectWorkerRequest(request_id="tls-2", model=MODEL, prompt=prompt))
    assert got == grpc.StatusCode.PERMISSION_DENIED


def test_bearer_token_over_tls_without_client_certificates(pki, policy, token, kvroute_pb):
    """A second server: TLS, no --tls-client-ca, so callers prove who they are with a token."""
    pb, tls = kvroute_pb, creds(pki)
    proc, addr, log = serve(pki, tls, "--log-level", "kvroute=debug", "--tls-cert", str(pki / "server.crt"),
                            "--tls-key", str(pki / "server.key"), "--auth-policy", str(policy))
    wrong = "test-" + secrets.token_urlsafe(24)
    try:
        with channel(addr, tls) as ch:
            admin = pb.admin_grpc.AdminStub(ch)
            listing = pb.admin_pb2.ListWorkersRequest()
            assert code(admin.ListWorkers, listing, metadata=[("authorization", f"Bearer {token}")])[0] \
                == grpc.StatusCode.OK
            assert code(admin.ListWorkers, listing)[0] == grpc.StatusCode.UNAUTHENTICATED
            assert code(admin.ListWorkers, listing, metadata=[("authorization", f"Bearer {wrong}")])[0] \
                == grpc.StatusCode.UNAUTHENTICATED
            got, details = code(admin.CordonWorker, pb.admin_pb2.CordonWorkerRequest(worker_id=1),
                                metadata=[("authorization", f"Bearer {token}")])
            assert got == grpc.StatusCode.PERMISSION_DENIED and "dashboards" in details, details
            assert token not in details
        assert health(addr, tls) == health_pb2.HealthCheckResponse.SERVING
    finally:
        stop(proc)
    logged = log.read_text()
    assert token not in logged and wrong not in logged, "a bearer token was logged"


if __name__ == "__main__":
    # Makes the certificates alone (no kvroute needed): python3 test_tls_auth.py DIR
    import sys

    print(make_pki(Path(sys.argv[1]).resolve()))
