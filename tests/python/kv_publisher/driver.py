"""Drive an engine's real ZmqEventPublisher with conversations from the trace.

The token streams come from the committed conversation trace
(tests/data/conversation_sample.jsonl), expanded by kvroute's own
`trace::tokens_for` in the Rust test and handed over in the `--trace` JSON
file ({"streams": [[token ids...], ...]}). Each session takes the next stream;
its first turn carries the trace's shared 512-token system prompt, later
turns the next few blocks of the same stream.

The engine's own kv_events.py (fetched from its wheel by fetch.py) is loaded
unmodified under its real module name; its non-essential imports resolve to
the stubs next to this file, while msgspec and pyzmq are the real packages.

Two scenarios (--scenario):
  main   conversations on the device, a gap healed through the replay
         socket, evictions and a clear; two events on a medium kvroute does
         not know ("DISK", which SGLang defines and never sends).
  tiers  conversations offloaded to the engine's host tier as the engine
         itself announces it (--host-events): vLLM's offloading connector,
         placeholder events (no tokens; 0.23 names them by raw 32-byte
         hashes while its device events use ints) or self-describing ones
         (tokens and parent, no extra keys), or SGLang HiCache's CPU_PINNED
         events; then device evictions that leave the host copies, and a
         host eviction.

Protocol with the Rust test (one line each, on stdout / stdin):
  -> "PHASE1 <batches>"  after the first batches were published (before any
                         subscriber exists: only the replay buffer has them)
  <- "go"
  -> "DONE <json>"       after the rest; json = expected index state
  <- "quit"              shut the publisher down and exit
"""

import argparse
import hashlib
import importlib.util
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = {
    "vllm": "vllm.distributed.kv_events",
    "sglang": "sglang.srt.disaggregation.kv_events",
}
LORA_ID, LORA_NAME = 5, "adapter-a"


def load(engine: str, path: str):
    sys.path.insert(0, os.path.join(HERE, "stubs"))
    try:
        import pydantic  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(HERE, "stubs_pydantic"))
    name = MODULES[engine]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Trace:
    """A deterministic multi-turn conversation trace and the engine's cache."""

    def __init__(self, engine: str, hash_kind: str, block_size: int, streams) -> None:
        self.engine, self.hash_kind, self.bs = engine, hash_kind, block_size
        self.rng = random.Random(20251202)
        self.held = {}  # engine hash -> (session index, block index)
        self.host = {}  # the same, of the host tier
        self.digests = {}  # key -> the 32-byte digest the hash came from
        self.sessions = []
        self.streams = list(streams)

    def engine_hash(self, parent, tokens, extra):
        d = hashlib.sha256(repr((parent, tokens, extra)).encode()).digest()
        if self.hash_kind == "bytes":
            h = d
        elif self.hash_kind == "signed":
            h = int.from_bytes(d[:8], "big", signed=True)
        else:
            h = int.from_bytes(d, "big") & ((1 << 64) - 1)
        self.digests[self.key(h)] = d
        return h

    def key(self, h):
        return h.hex() if isinstance(h, bytes) else str(h)

    def new_session(self, lora=False, salt=None, mm=False):
        stream = len(self.sessions)
        s = {"lora": LORA_NAME if lora else None, "salt": salt, "mm": None,
             "tokens": [], "hashes": [], "stored_tokens": 0,
             "stream": stream, "source": self.streams[stream]}
        if mm and self.engine == "vllm":
            s["mm"] = f"img-{len(self.sessions)}"
        self.sessions.append(s)
        return len(self.sessions) - 1

    def extra_keys(self, s, block_idx):
        keys = []
        if s["lora"]:
            keys.append(s["lora"])
        if s["mm"] and block_idx < 2:  # the image spans tokens [2, bs + 3)
            keys.append((s["mm"], 2 - block_idx * self.bs))
        if s["salt"] and block_idx == 0:
            keys.append(s["salt"])
        return tuple(keys) or None

    def turn(self, mod, si, medium="GPU"):
        """One turn: user tokens + response; returns the BlockStored event."""
        s = self.sessions[si]
        n = self.rng.randint(self.bs, 3 * self.bs)
        if not s["tokens"]:
            n += 512  # the trace's shared system prompt (one trace hash_id)
        have = len(s["tokens"])
        s["tokens"] += s["source"][have:have + n]
        first = s["stored_tokens"] // self.bs
        last = len(s["tokens"]) // self.bs
        hashes, extras = [], []
        parent = s["hashes"][-1] if s["hashes"] else None
        for b in range(first, last):
            toks = s["tokens"][b * self.bs:(b + 1) * self.bs]
            extra = self.extra_keys(s, b) if self.engine == "vllm" else None
            # Engines fold the adapter and salt into their hashes too.
            h = self.engine_hash(parent if not hashes else hashes[-1], toks,
                                 (s["lora"], s["salt"], extra))
            hashes.append(h)
            extras.append(extra)
        s["hashes"] += hashes
        s["stored_tokens"] = last * self.bs
        for i, h in enumerate(hashes):
            self.held[self.key(h)] = (si, first + i)
        return self.stored(mod, s, hashes, parent, first, last, extras, medium)

    def stored(self, mod, s, hashes, parent, first, last, extras, medium):
        toks = s["tokens"][first * self.bs:last * self.bs]
        if self.engine == "vllm":
            return mod.BlockStored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=toks,
                block_size=self.bs, lora_id=LORA_ID if s["lora"] else None,
                medium=medium, lora_name=s["lora"],
                extra_keys=extras if any(extras) else None,
            )
        kw = dict(block_hashes=hashes, parent_block_hash=parent, token_ids=toks,
                  block_size=self.bs, lora_id=LORA_ID if s["lora"] else None,
                  medium=medium)
        if s["salt"]:
            if hasattr(mod, "BlockStoredWithMetadata"):  # <= 0.5.19
                return mod.BlockStoredWithMetadata(
                    **kw, metadata=mod.BlockStoredMetadata(cache_salt=s["salt"]))
            return mod.BlockStored(**kw, cache_salt=s["salt"])
        return mod.BlockStored(**kw)

    def remove(self, mod, si, count, medium="GPU"):
        s = self.sessions[si]
        gone = s["hashes"][-count:]
        if medium == "GPU":
            for h in gone:
                self.held.pop(self.key(h), None)
        return mod.BlockRemoved(block_hashes=gone, medium=medium)

    def offload(self, mod, si, host_events):
        """The host tier's copy of every stored block of a session, as the
        engine announces it."""
        s = self.sessions[si]
        n = len(s["hashes"])
        for i, h in enumerate(s["hashes"]):
            self.host[self.key(h)] = (si, i)
        if host_events == "sglang":
            # HiCache's write-through: the same recorder as the device's
            # events, medium CPU_PINNED, coalesced along the chain.
            return [self.stored(mod, s, s["hashes"], None, 0, n, [None] * n, "CPU_PINNED")]
        events = []
        for i, h in enumerate(s["hashes"]):
            if host_events == "self-describing":
                events.append(mod.BlockStored(
                    block_hashes=[h], parent_block_hash=s["hashes"][i - 1] if i else None,
                    token_ids=s["tokens"][i * self.bs:(i + 1) * self.bs], block_size=self.bs,
                    lora_id=LORA_ID if s["lora"] else None, medium="CPU",
                    lora_name=s["lora"], extra_keys=None, group_idx=0,
                    kv_cache_spec_kind="full_attention"))
            else:
                events.append(mod.BlockStored(
                    block_hashes=[self.host_hash(h, host_events)], parent_block_hash=None,
                    token_ids=[], block_size=0, lora_id=None, medium="CPU", lora_name=None))
        return events

    def host_hash(self, h, host_events):
        """vLLM 0.23's placeholders name blocks by the raw digest."""
        return self.digests[self.key(h)] if host_events == "placeholder-bytes" else h

    def evict_host(self, mod, si, count, host_events):
        s = self.sessions[si]
        gone = s["hashes"][-count:]
        for h in gone:
            self.host.pop(self.key(h), None)
        medium = "CPU_PINNED" if host_events == "sglang" else "CPU"
        return mod.BlockRemoved(
            block_hashes=[self.host_hash(h, host_events) for h in gone], medium=medium)

    def clear(self, mod):
        self.held.clear()
        for s in self.sessions:
            s["cleared"] = True
        return mod.AllBlocksCleared()

    def expected(self):
        seqs = []
        for si, s in enumerate(self.sessions):
            if s.get("cleared"):
                continue
            n = s["stored_tokens"] // self.bs
            held = [self.key(h) in self.held for h in s["hashes"]]
            host = [self.key(h) in self.host for h in s["hashes"]]
            mm = [[s["mm"]] if (s["mm"] and b < 2) else [] for b in range(n)]
            seqs.append({"tokens": s["tokens"][: n * self.bs], "lora": s["lora"],
                         "salt": s["salt"], "mm": mm, "held": held, "host": host,
                         "stream": s["stream"]})
        return {"sequences": seqs, "held_count": len(self.held),
                "host_count": len(self.host)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=sorted(MODULES), required=True)
    ap.add_argument("--kv-events", required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay", required=True)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--hash-kind", choices=["int", "bytes", "signed"], default="int")
    ap.add_argument("--topic", default="kv")
    ap.add_argument("--trace", required=True, help="JSON file of token streams")
    ap.add_argument("--scenario", choices=["main", "tiers"], default="main")
    ap.add_argument("--host-events", default="self-describing",
                    choices=["self-describing", "placeholder", "placeholder-bytes", "sglang"])
    a = ap.parse_args()
    with open(a.trace) as f:
        streams = json.load(f)["streams"]
    mod = load(a.engine, a.kv_events)
    pub = mod.ZmqEventPublisher(0, endpoint=a.endpoint, replay_endpoint=a.replay,
                                topic=a.topic)
    tr = Trace(a.engine, a.hash_kind, a.block_size, streams)
    sent = 0

    live = False

    def publish(events):
        nonlocal sent
        pub.publish(mod.KVEventBatch(ts=time.time(), events=events))
        sent += 1
        if live:  # pace live traffic so most of it arrives after the replay
            time.sleep(0.05)

    if a.scenario == "tiers":
        tiers(mod, tr, publish, a.host_events)
        pub.shutdown()
        return

    # Phase 1: before any subscriber. Warm-up then a full clear, then the
    # first turns of three conversations.
    warm = tr.new_session()
    publish([tr.turn(mod, warm)])
    publish([tr.clear(mod)])
    plain = tr.new_session()
    lora = tr.new_session(lora=True)
    salted = tr.new_session(salt="tenant-x", mm=True)
    publish([tr.turn(mod, plain), tr.turn(mod, lora)])
    publish([tr.turn(mod, salted)])
    while not pub._event_queue.empty():
        time.sleep(0.01)
    time.sleep(0.3)
    print(f"PHASE1 {sent}", flush=True)
    if sys.stdin.readline().strip() != "go":
        pub.shutdown()
        return

    # Phase 2: live traffic.
    live = True
    for _ in range(3):
        for si in (plain, lora, salted):
            publish([tr.turn(mod, si)])
    other = tr.new_session(salt="tenant-y")
    publish([tr.turn(mod, other), tr.turn(mod, other)])
    # a store and a removal on a medium kvroute does not know (SGLang's
    # "DISK", defined and never sent): counted, not routed on
    publish([tr.stored(mod, tr.sessions[plain], [tr.engine_hash(None, [1], "disk")],
                       None, 0, 1, [None], "DISK")])
    # evictions: the leaf blocks of two conversations, and one DISK removal
    publish([tr.remove(mod, plain, 2), tr.remove(mod, lora, 1)])
    publish([tr.remove(mod, salted, 1, medium="DISK")])
    publish([tr.turn(mod, salted)])
    while not pub._event_queue.empty():
        time.sleep(0.01)
    time.sleep(0.2)
    print("DONE " + json.dumps({**tr.expected(), "batches": sent}), flush=True)
    sys.stdin.readline()
    pub.shutdown()


def tiers(mod, tr, publish, host_events):
    """The tiers scenario (see the module docs); all of it live."""
    print("PHASE1 0", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    # Its own salt keeps the first conversation's blocks apart from the
    # plain one's (they share the trace's system prompt).
    on_device = tr.new_session(salt="tenant-z")
    offloaded = tr.new_session()
    lora = tr.new_session(lora=True)
    salted = tr.new_session(salt="tenant-x", mm=True)
    for si in (on_device, offloaded, lora, salted):
        publish([tr.turn(mod, si)])
        publish([tr.turn(mod, si)])
    # Every block of three conversations goes to host memory, then leaves
    # the device; the first conversation's blocks are copied too but stay.
    for si in (offloaded, lora, salted, on_device):
        publish(tr.offload(mod, si, host_events))
    for si in (offloaded, lora, salted):
        publish([tr.remove(mod, si, len(tr.sessions[si]["hashes"]))])
    # Host memory evicts the salted conversation's last block.
    publish([tr.evict_host(mod, salted, 1, host_events)])
    time.sleep(0.2)
    print("DONE " + json.dumps({**tr.expected(), "batches": 0}), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
