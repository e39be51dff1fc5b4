"""A stand-in inference engine for the gateway end-to-end test.

What kvroute's endpoint picker must get right is what a real vLLM engine
sees and says, so the stub does exactly those parts for real and nothing
else: it serves the OpenAI routes vLLM serves (/v1/chat/completions,
/v1/completions, streamed or not), turns each prompt into token ids the
way the engine does (transformers' AutoTokenizer and chat template from a
local tokenizer directory), keeps a prefix cache of full 16-token blocks per
data-parallel rank (the rank is the X-data-parallel-rank header, as in vLLM),
publishes what it stores with vLLM's own ZmqEventPublisher (its kv_events.py
taken from the pinned wheel) and reports the prompt tokens its cache already
held in usage.prompt_tokens_details.cached_tokens. It generates nothing: the
answer is a few fixed tokens at once.

For the test it records every request (GET /stub/requests, DELETE to clear)
and misbehaves on demand, per request, through the x-stub-mode header:
  fail   answer 500 before any token
  drop   stream one chunk, then close the connection without ending
  slow   stream a chunk every 0.2 s for 20 s (for clients that give up)
  hold   wait x-stub-hold-seconds (default 2) before answering (a long
         prefill: the load kvroute booked stays booked meanwhile)

    python stub_engine.py --port P --zmq-port Z --replay-port R --dp-size N \
        --tokenizer DIR --kv-events PATH/kv_events.py

prints "READY" on stdout once it serves.
"""

import argparse
import hashlib
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK_SIZE = 16
REPLY_WORDS = ["Routed", " by", " the", " cache", "."]


def load_vllm_kv_events(path: str):
    """vLLM's kv_events.py, loaded unmodified with the publisher test's stubs."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "kv_publisher"))
    import driver  # tests/python/kv_publisher/driver.py

    return driver.load("vllm", path)


class RankCache:
    """One dp rank's prefix cache: engine block hash -> held, chained by parent."""

    def __init__(self, kv, rank: int, endpoint: str, replay: str | None) -> None:
        self.kv = kv
        self.held: set[bytes] = set()
        self.lock = threading.Lock()
        self.publisher = kv.ZmqEventPublisher(rank, endpoint=endpoint, replay_endpoint=replay)

    @staticmethod
    def block_hashes(ids: list[int]) -> list[bytes]:
        """Chained hashes of the prompt's full blocks (bytes, as vLLM 0.24's)."""
        hashes, parent = [], b""
        for start in range(0, len(ids) - len(ids) % BLOCK_SIZE, BLOCK_SIZE):
            block = ids[start:start + BLOCK_SIZE]
            parent = hashlib.sha256(parent + json.dumps(block).encode()).digest()
            hashes.append(parent)
        return hashes

    def admit(self, ids: list[int]) -> int:
        """Prompt tokens already cached; then caches (and publishes) the rest.

        As in vLLM, a hit never covers the whole prompt: the last token is
        always computed, so a prompt of exactly k blocks counts k - 1 at most.
        """
        hashes = self.block_hashes(ids)
        with self.lock:
            hit = 0
            for h in hashes:
                if h not in self.held:
                    break
                hit += 1
            hit = min(hit, (len(ids) - 1) // BLOCK_SIZE)
            first_new = next((i for i, h in enumerate(hashes) if h not in self.held), len(hashes))
            new = hashes[first_new:]
            if new:
                parent = hashes[first_new - 1] if first_new else None
                event = self.kv.BlockStored(
                    block_hashes=new, parent_block_hash=parent,
                    token_ids=ids[first_new * BLOCK_SIZE:len(hashes) * BLOCK_SIZE],
                    block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None)
                self.publisher.publish(self.kv.KVEventBatch(ts=time.time(), events=[event]))
                self.held.update(new)
        return hit * BLOCK_SIZE


class Engine:
    def __init__(self, args) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        kv = load_vllm_kv_events(args.kv_events)
        self.ranks = [
            RankCache(kv, r, f"tcp://*:{args.zmq_port}",
                      f"tcp://*:{args.replay_port}" if args.replay_port else None)
            for r in range(args.dp_size)
        ]
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    def prompt_ids(self, path: str, body: dict) -> list[int]:
        if path.endswith("/chat/completions"):
            ids = self.tokenizer.apply_chat_template(
                body["messages"], tools=body.get("tools"), add_generation_prompt=True,
                tokenize=True, **(body.get("chat_template_kwargs") or {}))
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        prompt = body["prompt"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return list(self.tokenizer(prompt)["input_ids"])

    def record(self, entry: dict) -> None:
        with self.lock:
            self.requests.append(entry)


def completion_objects(path: str, model: str, usage: dict, stream: bool, include_usage: bool):
    """The answer as vLLM shapes it: one object, or the SSE chunks."""
    chat = path.endswith("/chat/completions")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{time.time_ns()}"
    base = {"id": rid, "created": int(time.time()), "model": model}
    text = "".join(REPLY_WORDS)
    if not stream:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": "stop"} if chat else
                  {"index": 0, "text": text, "finish_reason": "stop"})
        return {**base, "object": "chat.completion" if chat else "text_completion",
                "choices": [choice], "usage": usage}
    kind = "chat.completion.chunk" if chat else "text_completion"
    chunks = []
    for i, word in enumerate(REPLY_WORDS):
        last = i == len(REPLY_WORDS) - 1
        choice = ({"index": 0, "delta": ({"role": "assistant", "content": word} if i == 0 else
                                         {"content": word}),
                   "finish_reason": "stop" if last else None} if chat else
                  {"index": 0, "text": word, "finish_reason": "stop" if last else None})
        chunks.append({**base, "object": kind, "choices": [choice]})
    if include_usage:
        chunks.append({**base, "object": kind, "choices": [], "usage": usage})
    return chunks


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def send_json(self, status: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/stub/requests":
                with engine.lock:
                    self.send_json(200, engine.requests)
            elif self.path == "/health":
                self.send_json(200, {})
            else:
                self.send_json(404, {"error": "not found"})

        def do_DELETE(self) -> None:
            if self.path == "/stub/requests":
                with engine.lock:
                    engine.requests.clear()
                self.send_json(200, {})
            else:
                self.send_json(404, {"error": "not found"})

        def read_body(self) -> bytes:
            # Envoy's ext_proc in FULL_DUPLEX_STREAMED mode drops
            # content-length and forwards the body chunked.
            if "chunked" not in (self.headers.get("transfer-encoding") or "").lower():
                return self.rfile.read(int(self.headers.get("content-length") or 0))
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()

        def do_POST(self) -> None:
            raw = self.read_body()
            headers = {k.lower(): v for k, v in self.headers.items()}
            entry = {"path": self.path, "headers": headers, "time": time.time()}
            try:
                body = json.loads(raw)
            except ValueError:
                entry["raw"] = raw.decode(errors="replace")
                engine.record(entry)
                return self.send_json(400, {"error": {"message": "invalid JSON"}})
            entry["body"] = body
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                engine.record(entry)
                return self.send_json(404, {"error": {"message": "no such route"}})
            try:
                rank = int(headers.get("x-data-parallel-rank", "0"))
                cache = engine.ranks[rank]
            except (ValueError, IndexError):
                engine.record(entry)
                return self.send_json(400, {"error": {"message": "bad dp rank"}})
            mode = headers.get("x-stub-mode", "ok")
            entry.update(rank=rank, mode=mode)
            if mode == "fail":
                engine.record(entry)
                return self.send_json(500, {"error": {"message": "stub engine told to fail"}})
            if mode == "hold":
                time.sleep(float(headers.get("x-stub-hold-seconds", "2")))
            ids = engine.prompt_ids(self.path, body)
            cached = cache.admit(ids)
            entry.update(prompt_tokens=len(ids), cached_tokens=cached)
            engine.record(entry)
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(REPLY_WORDS),
                     "total_tokens": len(ids) + len(REPLY_WORDS),
                     "prompt_tokens_details": {"cached_tokens": cached}}
            stream = bool(body.get("stream"))
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            out = completion_objects(self.path, body.get("model", ""), usage, stream, include_usage)
            if not stream:
                return self.send_json(200, out)
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()

            def chunk(data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            if mode == "drop":
                chunk(b"data: " + json.dumps(out[0]).encode() + b"\n\n")
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if mode == "slow":
                deadline = time.time() + 20
                try:
                    while time.time() < deadline:
                        chunk(b"data: " + json.dumps(out[0]).encode() + b"\n\n")
                        time.sleep(0.2)
                except OSError:  # the client (Envoy) went away
                    self.close_connection = True
                    return
            for obj in out:
                chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")
            # [DONE] and the end of the body in one write, as a server that
            # finishes at once does: a client that hangs up on [DONE] then
            # rarely beats the end of the stream through Envoy.
            self.wfile.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            self.wfile.flush()

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--zmq-port", type=int, required=True, help="rank r publishes on this + r")
    ap.add_argument("--replay-port", type=int, help="rank r's replay socket on this + r")
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--tokenizer", required=True, help="dir with tokenizer.json")
    ap.add_argument("--kv-events", required=True, help="vLLM's kv_events.py")
    args = ap.parse_args()
    engine = Engine(args)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(engine))
    server.daemon_threads = True
    print("READY", flush=True)
    try:
        server.serve_forever()
    finally:
        for r in engine.ranks:
            r.publisher.shutdown()


if __name__ == "__main__":
    main()
