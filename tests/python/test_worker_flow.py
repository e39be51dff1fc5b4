"""A worker and a frontend written with Python grpcio, end to end.

Two workers register, heartbeat with load and stream KV events (stored,
removed, cleared) over the bidirectional PublishEvents stream, including a
gap the server holds the later event behind and asks to have resent, and a
duplicate it skips; then a frontend
asks Router.SelectWorker (QUERY_ONLY) and Admin.ExplainSelection, which must
agree and follow the resulting overlap. A malformed batch ends its stream with
INVALID_ARGUMENT. A worker whose numbering jumps is told to resynchronise and
answers with a cleared and stores of everything it holds.
"""
import queue

import grpc
import pytest

MODEL = "py-model"
BLOCK = 16
W1, W2 = 11, 12
TIMEOUT = 10


def block_tokens(base, i):
    """Token ids of block i of a prompt family starting at `base`."""
    return list(range(base + BLOCK * i, base + BLOCK * (i + 1)))


def prompt_tokens(base, blocks):
    return [t for i in range(blocks) for t in block_tokens(base, i)]


P = 1000  # the prompt family both workers cache some of
S = 5000  # a family only worker 2 caches
Q = 9000  # a block worker 1 stores and later evicts


class EventStream:
    """One PublishEvents stream: `send` yields a batch to the server from the
    request generator and reads the reply that acknowledges it."""

    _END = object()

    def __init__(self, stub):
        self._outbox = queue.Queue()
        self._replies = stub.PublishEvents(self._requests(), timeout=60)

    def _requests(self):
        while True:
            batch = self._outbox.get()
            if batch is self._END:
                return
            yield batch

    def send(self, batch):
        self._outbox.put(batch)
        return next(self._replies)

    def close(self):
        """Ends our side; the server then ends its side with no more replies."""
        self._outbox.put(self._END)
        assert list(self._replies) == []

    def abandon(self):
        """Stops the request generator of a stream the server already ended."""
        self._outbox.put(self._END)


@pytest.fixture
def stubs(server, kvroute_pb):
    pb = kvroute_pb
    with grpc.insecure_channel(server) as channel:
        yield (
            pb.workers_grpc.WorkersStub(channel),
            pb.router_grpc.RouterStub(channel),
            pb.admin_grpc.AdminStub(channel),
        )


def test_worker_events_route_the_frontend(stubs, kvroute_pb):
    pb = kvroute_pb
    workers, router, admin = stubs
    w, c = pb.workers_pb2, pb.common_pb2

    def stored(event_id, base, first, count, engine, parent=None):
        blocks = [
            w.StoredBlock(engine_hash=engine + i, token_ids=c.TokenIds(ids=block_tokens(base, first + i)))
            for i in range(count)
        ]
        kwargs = {} if parent is None else {"parent_engine_hash": parent}
        return w.KvEvent(event_id=event_id, stored=w.BlocksStored(blocks=blocks, **kwargs))

    def removed(event_id, *engine_hashes):
        return w.KvEvent(event_id=event_id, removed=w.BlocksRemoved(engine_hashes=list(engine_hashes)))

    def cleared(event_id):
        return w.KvEvent(event_id=event_id, cleared=w.CacheCleared())

    def batch(worker_id, *events):
        return w.KvEventBatch(worker_id=worker_id, dp_rank=0, events=list(events))

    def cached_blocks(worker_id):
        info = admin.GetWorker(pb.admin_pb2.GetWorkerRequest(worker_id=worker_id), timeout=TIMEOUT)
        return info.ranks[0].cached_blocks

    # Register two workers of the model and heartbeat with load.
    for worker_id in (W1, W2):
        reply = workers.RegisterWorker(
            w.RegisterWorkerRequest(
                worker_id=worker_id, model=MODEL, block_size=BLOCK, dp_size=1,
                total_kv_blocks=10_000, max_num_batched_tokens=8192,
            ),
            timeout=TIMEOUT,
        )
        assert reply.created and reply.lease_ttl_secs > 0
    for worker_id, running in ((W1, 2), (W2, 1)):
        beat = workers.Heartbeat(
            w.HeartbeatRequest(
                worker_id=worker_id,
                load=[c.RankLoad(dp_rank=0, running_requests=running, waiting_requests=0, kv_blocks_used=8)],
            ),
            timeout=TIMEOUT,
        )
        assert beat.lease_ttl_secs > 0
    info = admin.GetWorker(pb.admin_pb2.GetWorkerRequest(worker_id=W1), timeout=TIMEOUT)
    assert info.ranks[0].reported_load.running_requests == 2
    assert info.ranks[0].reported_load.kv_blocks_used == 8

    # Worker 1: P0 P1 (event 0), then event 2 arrives before event 1: a gap.
    # Event 2 is held until event 1 arrives.
    s1 = EventStream(workers)
    reply = s1.send(batch(W1, stored(0, P, 0, 2, engine=100)))
    assert reply.last_applied_event_id == 0 and not reply.HasField("resend_from_event_id")
    reply = s1.send(batch(W1, stored(2, Q, 0, 1, engine=900)))
    assert reply.HasField("resend_from_event_id"), reply
    assert reply.resend_from_event_id == 1
    assert (reply.last_applied_event_id, reply.held_events) == (0, 1)
    assert not reply.resync_required
    assert cached_blocks(W1) == 2
    # The resend of event 1 (P2 P3 after P1) fills the gap: 1, then 2 apply.
    reply = s1.send(batch(W1, stored(1, P, 2, 2, engine=102, parent=101)))
    assert not reply.HasField("resend_from_event_id"), reply
    assert (reply.last_applied_event_id, reply.held_events) == (2, 0)
    assert (reply.skipped, reply.rejected) == (0, 0)
    assert cached_blocks(W1) == 5
    # Event 3 evicts Q0.
    reply = s1.send(batch(W1, removed(3, 900)))
    assert reply.last_applied_event_id == 3
    assert cached_blocks(W1) == 4
    # A duplicate of event 1 is skipped and changes nothing.
    reply = s1.send(batch(W1, stored(1, P, 2, 2, engine=102, parent=101)))
    assert reply.skipped == 1 and reply.last_applied_event_id == 3
    assert cached_blocks(W1) == 4
    s1.close()

    # Worker 2: P0..P5, then a clear drops them all; then P0 and S0 S1 S2.
    s2 = EventStream(workers)
    reply = s2.send(batch(W2, stored(0, P, 0, 6, engine=200), cleared(1)))
    assert reply.last_applied_event_id == 1
    assert cached_blocks(W2) == 0
    reply = s2.send(batch(W2, stored(2, P, 0, 1, engine=300), stored(3, S, 0, 3, engine=400)))
    assert (reply.last_applied_event_id, reply.skipped, reply.rejected) == (3, 0, 0)
    assert cached_blocks(W2) == 4
    s2.close()

    # A malformed batch (a stored event with no blocks) ends its stream with
    # INVALID_ARGUMENT; nothing of it applies.
    bad = EventStream(workers)
    with pytest.raises(grpc.RpcError) as failure:
        bad.send(batch(W1, w.KvEvent(event_id=4, stored=w.BlocksStored())))
    bad.abandon()
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value
    assert "no blocks" in failure.value.details()
    assert cached_blocks(W1) == 4

    # The frontend: each prompt goes to the worker with the longer overlap,
    # and ExplainSelection agrees with SelectWorker.
    r = pb.router_pb2
    for base, blocks, winner, overlap in ((P, 6, W1, 4), (S, 4, W2, 3)):
        request = r.SelectWorkerRequest(
            request_id=f"py-{base}",
            model=MODEL,
            prompt=r.Prompt(token_ids=c.TokenIds(ids=prompt_tokens(base, blocks))),
            mode=r.SELECTION_MODE_QUERY_ONLY,
        )
        chosen = router.SelectWorker(request, timeout=TIMEOUT)
        assert (chosen.worker_id, chosen.overlap_blocks) == (winner, overlap), chosen
        assert chosen.total_blocks == blocks
        assert chosen.cached_tokens == overlap * BLOCK
        assert chosen.admission == r.ADMISSION_RESULT_UNTRACKED

        explained = admin.ExplainSelection(request, timeout=TIMEOUT)
        assert (explained.winner.worker_id, explained.winner.dp_rank) == (chosen.worker_id, chosen.dp_rank)
        assert {cand.worker_id for cand in explained.candidates} == {W1, W2}
        best = max(explained.candidates, key=lambda cand: cand.probability)
        assert best.worker_id == winner and best.eligible
        assert best.overlap_blocks == overlap
        loser = next(cand for cand in explained.candidates if cand.worker_id != winner)
        assert loser.probability <= best.probability
        assert loser.prefill_cost > best.prefill_cost

    # QUERY_ONLY booked nothing.
    info = admin.GetWorker(pb.admin_pb2.GetWorkerRequest(worker_id=W1), timeout=TIMEOUT)
    assert info.ranks[0].booked_load.active_requests == 0


def test_a_worker_told_to_resync_sends_its_cache(stubs, kvroute_pb):
    """An id jump no worker could fill gets resync_required; the worker
    answers with a cleared and stores of everything it holds (re-storing the
    evicted block its held ones hang below, and removing it again), and the
    index then holds exactly that."""
    pb = kvroute_pb
    workers, router, admin = stubs
    w, c = pb.workers_pb2, pb.common_pb2
    W = 21

    def stored(event_id, first, count, engine, parent=None):
        blocks = [
            w.StoredBlock(engine_hash=engine + i, token_ids=c.TokenIds(ids=block_tokens(P, first + i)))
            for i in range(count)
        ]
        kwargs = {} if parent is None else {"parent_engine_hash": parent}
        return w.KvEvent(event_id=event_id, stored=w.BlocksStored(blocks=blocks, **kwargs))

    def batch(*events):
        return w.KvEventBatch(worker_id=W, dp_rank=0, events=list(events))

    def overlap(blocks):
        request = pb.router_pb2.SelectWorkerRequest(
            request_id=f"resync-{blocks}", model=MODEL,
            prompt=pb.router_pb2.Prompt(token_ids=c.TokenIds(ids=prompt_tokens(P, blocks))),
            mode=pb.router_pb2.SELECTION_MODE_QUERY_ONLY,
        )
        return router.SelectWorker(request, timeout=TIMEOUT).overlap_blocks

    workers.RegisterWorker(
        w.RegisterWorkerRequest(
            worker_id=W, model=MODEL, block_size=BLOCK, dp_size=1,
            total_kv_blocks=10_000, max_num_batched_tokens=8192,
        ),
        timeout=TIMEOUT,
    )
    s = EventStream(workers)
    # It numbers from 1: P0..P3 (engine 500..503), then evicts P1.
    reply = s.send(batch(stored(1, 0, 4, engine=500),
                         w.KvEvent(event_id=2, removed=w.BlocksRemoved(engine_hashes=[501]))))
    assert reply.last_applied_event_id == 2 and not reply.HasField("resend_from_event_id"), reply
    # Its numbering jumps far past anything kvroute would hold.
    reply = s.send(batch(stored(1_000_000, 4, 1, engine=504, parent=503)))
    assert reply.resync_required and not reply.HasField("resend_from_event_id"), reply
    assert reply.skipped == 1
    # Until it resyncs, its events are skipped.
    reply = s.send(batch(stored(3, 4, 1, engine=504, parent=503)))
    assert reply.resync_required and reply.skipped == 1, reply
    # The answer starts at the floor the reply names (one past the highest
    # id kvroute received): an answer numbered below it is taken for a late
    # copy of an old batch and skipped.
    floor = reply.resync_from_event_id
    assert floor == 1_000_001, reply
    reply = s.send(batch(w.KvEvent(event_id=0, cleared=w.CacheCleared())))
    assert reply.resync_required and reply.skipped == 1, reply
    # Cleared, then what it holds (P2 P3 P4 below the evicted P1, so P0 P1
    # are stored and P1 removed again).
    reply = s.send(batch(
        w.KvEvent(event_id=floor, cleared=w.CacheCleared()),
        stored(floor + 1, 0, 2, engine=500),
        stored(floor + 2, 2, 3, engine=502, parent=501),
        w.KvEvent(event_id=floor + 3, removed=w.BlocksRemoved(engine_hashes=[501])),
    ))
    assert not reply.resync_required, reply
    assert (reply.last_applied_event_id, reply.skipped, reply.rejected) == (floor + 3, 0, 0), reply
    assert reply.first_rejection == ""
    info = admin.GetWorker(pb.admin_pb2.GetWorkerRequest(worker_id=W), timeout=TIMEOUT)
    assert info.ranks[0].cached_blocks == 4
    stats = admin.GetIndexStats(pb.admin_pb2.GetIndexStatsRequest(), timeout=TIMEOUT)
    assert stats.blocks == 4
    assert overlap(5) == 1, "P1 is evicted: the prefix ends after P0"
    s.close()
