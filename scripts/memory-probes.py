"""Memory probes of issue 38, as a hostile client runs them, against a
running `kvroute serve` (use the release binary: its allocator is the one
that matters). Prints the process's resident memory (from /proc) and heap
(kvroute_heap_allocated_bytes) before, at the peak and after.

    claims   PID GRPC METRICS [store]   ten RegisterWorker claims of 16 ranks
                                        x 4,194,304 blocks under new models
                                        (`store`: one block on every rank),
                                        then DeregisterWorker of each
    bookings PID GRPC METRICS SECONDS   six threads RESERVE one 16,384-block
                                        prompt under new request ids, never
                                        releasing, on an APPROXIMATE worker
                                        that already caches it

Run with the project's virtual environment (scripts/venv.sh makes it):
    .venv/bin/python scripts/memory-probes.py claims $(pgrep -f 'kvroute serve') 127.0.0.1:50051 127.0.0.1:9464
"""
import sys, time, threading, urllib.request, pathlib, tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
OUT = pathlib.Path(tempfile.gettempdir()) / "kvroute-probe-pb"
if not (OUT / "kvroute").exists():
    from grpc_tools import protoc
    OUT.mkdir(exist_ok=True)
    protos = [str(p) for p in (REPO / "proto").rglob("*.proto")]
    assert protoc.main(["protoc", f"-I{REPO/'proto'}", f"--python_out={OUT}", f"--grpc_python_out={OUT}", *protos]) == 0
sys.path.insert(0, str(OUT))
import grpc
from kvroute.v1 import workers_pb2, workers_pb2_grpc, router_pb2, router_pb2_grpc, common_pb2

def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

def heap(metrics):
    body = urllib.request.urlopen(f"http://{metrics}/metrics").read().decode()
    for line in body.splitlines():
        if line.startswith("kvroute_heap_allocated_bytes "):
            return int(float(line.split()[1]))

def metric(metrics, prefix):
    body = urllib.request.urlopen(f"http://{metrics}/metrics").read().decode()
    return [l for l in body.splitlines() if l.startswith(prefix)]

MB = 1 << 20
mode, pid, addr, metrics = sys.argv[1:5]
pid = int(pid)
ch = grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)])
workers = workers_pb2_grpc.WorkersStub(ch)
router = router_pb2_grpc.RouterStub(ch)

if mode == "claims":
    start_rss, start_heap = rss(pid), heap(metrics)
    print(f"start: RSS {start_rss/MB:.1f} MiB, heap {start_heap/MB:.1f} MiB")
    accepted = 0
    for i in range(11):
        try:
            workers.RegisterWorker(workers_pb2.RegisterWorkerRequest(worker_id=1000 + i, model=f"model-{i}", block_size=16, dp_size=16, total_kv_blocks=4194304, lease_ttl_secs=600))
            accepted += 1
        except grpc.RpcError as e:
            print(f"claim {i}: {e.code().name}: {e.details()[:100]}")
    if len(sys.argv) > 5 and sys.argv[5] == "store":
        for i in range(accepted):
            for rank in range(16):
                batch = workers_pb2.KvEventBatch(worker_id=1000 + i, dp_rank=rank, events=[
                    workers_pb2.KvEvent(event_id=0, stored=workers_pb2.BlocksStored(blocks=[workers_pb2.StoredBlock(engine_hash=7, local_hash=9)]))])
                list(workers.PublishEvents(iter([batch])))
        print("stored one block on every rank")
    time.sleep(1)
    print(f"after {accepted} claims: RSS {rss(pid)/MB:.1f} MiB, heap {heap(metrics)/MB:.1f} MiB")
    for i in range(accepted):
        workers.DeregisterWorker(workers_pb2.DeregisterWorkerRequest(worker_id=1000 + i))
    time.sleep(2)
    end_rss = rss(pid)
    print(f"after deregistering: RSS {end_rss/MB:.1f} MiB, heap {heap(metrics)/MB:.1f} MiB; RSS - start = {(end_rss-start_rss)/MB:.1f} MiB")
elif mode == "bookings":
    seconds = float(sys.argv[5])
    workers.RegisterWorker(workers_pb2.RegisterWorkerRequest(worker_id=1, model="m", block_size=16, dp_size=1, total_kv_blocks=4194304, kv_events=common_pb2.KV_EVENTS_MODE_APPROXIMATE, lease_ttl_secs=3600))
    prompt = list(range(1, 16385))
    def req(rid):
        return router_pb2.SelectWorkerRequest(request_id=rid, model="m", prompt=router_pb2.Prompt(block_hashes=router_pb2.BlockHashes(hashes=prompt)))
    router.SelectWorker(req("warm"))
    router.MarkPrefillComplete(router_pb2.MarkPrefillCompleteRequest(request_id="warm"))
    start_rss, start_heap = rss(pid), heap(metrics)
    print(f"start: RSS {start_rss/MB:.1f} MiB, heap {start_heap/MB:.1f} MiB")
    counts = {"ok": 0, "RESOURCE_EXHAUSTED": 0, "other": 0}
    peak = [0]
    lock = threading.Lock()
    deadline = time.time() + seconds
    def flood(t):
        n = 0
        while time.time() < deadline:
            n += 1
            try:
                router.SelectWorker(req(f"t{t}-{n}"))
                k = "ok"
            except grpc.RpcError as e:
                k = e.code().name if e.code().name == "RESOURCE_EXHAUSTED" else "other"
                if k == "other":
                    print(e)
            with lock:
                counts[k] += 1
    threads = [threading.Thread(target=flood, args=(t,)) for t in range(6)]
    for t in threads: t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        peak[0] = max(peak[0], heap(metrics))
    print(f"after {seconds:.0f} s: {counts}; heap peak {peak[0]/MB:.1f} MiB, now {heap(metrics)/MB:.1f} MiB; RSS {rss(pid)/MB:.1f} MiB")
    print("\n".join(metric(metrics, "kvroute_bookings_")))
