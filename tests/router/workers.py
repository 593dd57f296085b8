"""A recording stand-in for a prefill or decode node, run as a real process on 127.0.0.1.

It answers the node endpoints the router uses (health, server/model info, /get_load, /abort_request and
the three generation endpoints, streamed or not), records every generation request (body and headers) and
every abort, and its behaviour is set at runtime through `POST /debug/config`:

  status       HTTP status of generation answers (an error body in OpenAI's shape when not 2xx)
  health       HTTP status of /health
  hold         how many upcoming generation requests wait, before answering, for `POST /debug/release`
               or an abort of their rid (-1: all of them)
  delay        seconds to wait before answering
  chunks       number of SSE data events in a streamed answer
  chunk_delay  seconds between streamed events
  break_after  close the connection after this many streamed events (-1: never)
  load         num_tokens reported by /get_load
  retry_after  Retry-After header of error answers (None: none)
  err_type     X-PD-Error-Type header of error answers (None: none), the cause a node names
  error_event  a streamed answer ends with an SSE error event after its chunks (as a node whose request
               failed after its stream began), then [DONE]
  error_first  how many upcoming streamed answers are one error event (as a decode node whose KV transfer
               failed before its first token: type internal_error, code kv_transfer), then [DONE]
  prealloc_free  /get_load's prealloc_slots_free (None: the field is left out, as a prefill node does)
  kv_available   /get_load's kv_available_tokens
  silent       /health does not answer while this is true (a host cut off the network, as the router sees it)
  info         extra fields of /server_info (e.g. a kv_events_endpoint)
  text         the text of answer i, formatted with {i} (default " out{i}")
  eof_delay    seconds between a stream's [DONE] and the end of its body
  refuse_local a request without a bootstrap_room gets a 400 naming `local_prefill_refused` (a decode node
               asked to prefill a prompt longer than it takes)

`GET /debug/received` returns {"requests": [...], "aborts": [...]}; `POST /debug/reset` clears them.
Run: python workers.py --port P --role prefill|decode [--bootstrap-port N] [--no-record] [--host 127.x.y.z]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

DEFAULTS = {"status": 200, "health": 200, "hold": 0, "delay": 0.0, "chunks": 3, "chunk_delay": 0.0,
            "break_after": -1, "load": 0, "retry_after": None, "err_type": None,
            "error_event": False, "error_first": 0, "silent": False, "prealloc_free": None,
            "kv_available": 8192, "info": {}, "text": " out{i}", "eof_delay": 0.0, "refuse_local": False}


class Recorder:
    def __init__(self, role: str, port: int, bootstrap_port: int | None, record: bool):
        self.role, self.port, self.bootstrap_port, self.record = role, port, bootstrap_port, record
        self.cfg = dict(DEFAULTS)
        self.requests: list[dict] = []
        self.aborts: list[str] = []
        self.release = asyncio.Event()
        self.abort_events: dict[str, asyncio.Event] = {}
        self.name = f"{role}:{port}"

    # ------------------------------------------------------------------ info endpoints

    async def health(self, request):
        while self.cfg["silent"]:
            await asyncio.sleep(0.05)
        return web.Response(status=self.cfg["health"], text="ok")

    async def server_info(self, request):
        return web.json_response({"disaggregation_mode": self.role, "model_path": "test-model",
                                  "disaggregation_bootstrap_port": self.bootstrap_port, "page_size": 1,
                                  "tp_size": 1, "worker": self.name, **self.cfg["info"]})

    async def model_info(self, request):
        return web.json_response({"model_path": "test-model", "is_generation": True, "worker": self.name})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "test-model", "object": "model",
                                                              "owned_by": self.name}]})

    async def tokenize(self, request):
        """/tokenize: one id per character; /detokenize: the characters back (a 400 for a body without a
        list)."""
        try:
            body = await request.json()
        except ValueError:
            body = None
        if request.path.endswith("/tokenize") and isinstance(body, dict) \
                and isinstance(body.get("prompt"), str):
            ids = [ord(c) for c in body["prompt"]]
            return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 4096})
        if isinstance(body, dict) and isinstance(body.get("tokens"), list) \
                and all(isinstance(t, int) and 0 <= t < 0x110000 for t in body["tokens"]):
            text = "".join(map(chr, body["tokens"]))
            return web.json_response({"prompt": text, "text": text})
        return web.json_response({"error": {"message": "`tokens` or `prompt` is missing",
                                            "type": "invalid_request_error",
                                            "param": None, "code": None}}, status=400)

    async def get_load(self, request):
        group = {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": self.cfg["load"],
                 "kv_available_tokens": self.cfg["kv_available"]}
        if self.cfg["prealloc_free"] is not None:
            group.update(prealloc_slots_free=self.cfg["prealloc_free"], num_prealloc_reqs=0)
        return web.json_response([group])

    async def abort(self, request):
        rid = (await request.json()).get("rid", "")
        self.aborts.append(rid)
        ev = self.abort_events.get(rid)
        if ev is not None:
            ev.set()
        return web.json_response({"status": "ok"})

    async def metrics(self, request):
        return web.Response(text=f"worker_requests_total {len(self.requests)}\n")

    # ------------------------------------------------------------------ debug endpoints

    async def debug_config(self, request):
        self.cfg.update(await request.json())
        return web.json_response(self.cfg)

    async def debug_release(self, request):
        self.release.set()
        self.release = asyncio.Event()
        return web.json_response({"status": "ok"})

    async def debug_received(self, request):
        return web.json_response({"requests": self.requests, "aborts": self.aborts, "name": self.name})

    async def debug_reset(self, request):
        self.requests.clear()
        self.aborts.clear()
        self.cfg = dict(DEFAULTS)
        self.release.set()
        self.release = asyncio.Event()
        return web.json_response({"status": "ok"})

    # ------------------------------------------------------------------ generation

    def _answer(self, path: str, body: dict, rid, i: int = 0) -> dict:
        text = self.cfg["text"].format(i=i)
        if path == "/generate":
            meta = {"id": rid, "worker": self.name, "finish_reason": {"type": "length", "length": 4},
                    "prompt_tokens": 2, "completion_tokens": 4}
            if body.get("return_logprob"):
                meta["input_token_logprobs"] = ([[-1.0, 11, None], [-1.5, 12, None]] if self.role == "prefill"
                                                else [[-2.0, 13, None]])
                meta["output_token_logprobs"] = [[-0.5, 21, None]]
            return {"text": text, "meta_info": meta}
        if path == "/v1/completions":
            return {"id": rid, "object": "text_completion", "model": "test-model", "worker": self.name,
                    "choices": [{"index": 0, "text": text, "finish_reason": None}]}
        return {"id": rid, "object": "chat.completion.chunk", "model": "test-model", "worker": self.name,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}

    async def generate(self, request: web.Request):
        raw = await request.read()
        body = json.loads(raw)
        rid = body.get("rid")
        entry = {"path": request.path, "body": body, "t": time.time(), "done": False,
                 "headers": {k: v for k, v in request.headers.items()
                             if k.lower() in ("authorization", "x-request-id", "content-type")}}
        if self.record:
            self.requests.append(entry)
        cfg = self.cfg
        if cfg["hold"]:
            if cfg["hold"] > 0:
                cfg["hold"] -= 1
            waits = [asyncio.ensure_future(self.release.wait())]
            for r in (rid if isinstance(rid, list) else [rid]):
                if isinstance(r, str):
                    ev = self.abort_events.setdefault(r, asyncio.Event())
                    if r in self.aborts:
                        ev.set()
                    waits.append(asyncio.ensure_future(ev.wait()))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        if cfg["delay"]:
            await asyncio.sleep(cfg["delay"])
        status, err_type = cfg["status"], cfg["err_type"]
        if cfg["refuse_local"] and "bootstrap_room" not in body:
            status, err_type = 400, "local_prefill_refused"
        if status >= 300:
            entry["done"] = True
            headers = {}
            if cfg["retry_after"] is not None:
                headers["Retry-After"] = str(cfg["retry_after"])
            if err_type is not None:
                headers["X-PD-Error-Type"] = err_type
            return web.json_response({"error": {"message": f"{self.name} says {status}",
                                                "type": "worker_error",
                                                "param": None,
                                                "code": {429: "rate_limit_exceeded"}.get(status)}},
                                     status=status, headers=headers)
        if not body.get("stream"):
            entry["done"] = True
            if isinstance(body.get("text"), list):
                n = len(body["text"])
                return web.json_response([self._answer(request.path, body,
                                                       rid[i] if isinstance(rid, list) else rid,
                                                       i) for i in range(n)])
            return web.json_response(self._answer(request.path, body, rid))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if cfg["error_first"]:
            cfg["error_first"] -= 1
            entry["done"] = True
            if request.path == "/v1/chat/completions":  # a chat stream opens with its role chunk
                await resp.write(b"data: "
                                 + json.dumps({"id": rid, "object": "chat.completion.chunk", "choices": [
                                     {"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]}).encode()
                    + b"\n\n")
            await resp.write(b": keep-alive\n\ndata: " + json.dumps({"error": {
                "message": "KV transfer failed: injected", "type": "internal_error", "param": None,
                "code": "kv_transfer"}}).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        for i in range(cfg["chunks"]):
            if i == cfg["break_after"]:
                request.transport.close()
                return resp
            await resp.write(b"data: "
                             + json.dumps(self._answer(request.path, body, rid, i)).encode() + b"\n\n")
            if cfg["chunk_delay"]:
                await asyncio.sleep(cfg["chunk_delay"])
        if cfg["error_event"]:
            await resp.write(b'data: {"error": {"message": "KV transfer failed", "type": "server_error", '
                             b'"code": 500}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        entry["done"] = True
        if cfg["eof_delay"]:
            await asyncio.sleep(cfg["eof_delay"])
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        for p in ("/server_info", "/get_server_info"):
            r.add_get(p, self.server_info)
        for p in ("/model_info", "/get_model_info"):
            r.add_get(p, self.model_info)
        r.add_get("/v1/models", self.models)
        r.add_get("/get_load", self.get_load)
        for p in ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize"):
            r.add_post(p, self.tokenize)
        r.add_post("/abort_request", self.abort)
        r.add_get("/metrics", self.metrics)
        r.add_post("/flush_cache", self.health)
        for p in ("/generate", "/v1/completions", "/v1/chat/completions"):
            r.add_post(p, self.generate)
        r.add_post("/debug/config", self.debug_config)
        r.add_post("/debug/release", self.debug_release)
        r.add_get("/debug/received", self.debug_received)
        r.add_post("/debug/reset", self.debug_reset)
        return app


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--bootstrap-port", type=int, default=None)
    ap.add_argument("--no-record", action="store_true", help="keep nothing (benchmarks)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="loopback address to listen on (127.x.y.z: a pod's IP)")
    a = ap.parse_args(argv)

    async def make():
        return Recorder(a.role, a.port, a.bootstrap_port, not a.no_record).app()

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(make(), host=a.host, port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
