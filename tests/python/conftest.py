"""Fixtures: a real kvroute server process on free loopback ports.

The binary is the one `cargo test` just built (debug/kvroute in its target
directory: CARGO_TARGET_DIR or ./target), or the
one named by KVROUTE_BIN.
"""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n ports free now, all different: each is held until all are chosen
    (one at a time, the system may hand out the same port twice)."""
    held = []
    try:
        for _ in range(n):
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def kvroute_bin() -> str:
    target = os.environ.get("CARGO_TARGET_DIR") or str(REPO / "target")
    return os.environ.get("KVROUTE_BIN", str(Path(target) / "debug" / "kvroute"))


@pytest.fixture(scope="session")
def kvroute_pb(tmp_path_factory):
    """kvroute's protobuf modules, generated from proto/ with grpcio-tools."""
    return kvroute_protos(tmp_path_factory.mktemp("pb"))


def kvroute_protos(out: Path):
    """kvroute's protobuf modules, generated into `out` (also for scripts/)."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(REPO / "proto")) for p in (REPO / "proto").rglob("*.proto"))
    rc = protoc.main(["protoc", f"-I{REPO / 'proto'}", f"--python_out={out}", f"--grpc_python_out={out}", *protos])
    assert rc == 0, "protoc failed"
    sys.path.insert(0, str(out))
    import kvroute.v1.admin_pb2 as admin_pb2
    import kvroute.v1.admin_pb2_grpc as admin_grpc
    import kvroute.v1.common_pb2 as common_pb2
    import kvroute.v1.router_pb2 as router_pb2
    import kvroute.v1.router_pb2_grpc as router_grpc
    import kvroute.v1.workers_pb2 as workers_pb2
    import kvroute.v1.workers_pb2_grpc as workers_grpc

    class PB:
        pass

    pb = PB()
    for name, mod in dict(
        admin_pb2=admin_pb2, admin_grpc=admin_grpc, common_pb2=common_pb2,
        router_pb2=router_pb2, router_grpc=router_grpc,
        workers_pb2=workers_pb2, workers_grpc=workers_grpc,
    ).items():
        setattr(pb, name, mod)
    return pb


@pytest.fixture
def server():
    """Starts `kvroute serve`, yields its gRPC address, then SIGTERMs it."""
    grpc_addr = f"127.0.0.1:{free_port()}"
    metrics_addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [kvroute_bin(), "serve", "--grpc-addr", grpc_addr, "--metrics-addr", metrics_addr,
         "--log-level", "warn"],
        stdout=subprocess.DEVNULL,
    )
    try:
        channel = grpc.insecure_channel(grpc_addr)
        grpc.channel_ready_future(channel).result(timeout=20)
        channel.close()
        yield grpc_addr
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, "kvroute did not exit 0 on SIGTERM"
