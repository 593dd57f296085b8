"""`pdserve bench serve` against a real colocated node serving the tiny random model on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from bench import serve


@pytest.fixture(scope="module")
def node(tiny_model_dir, module_launcher):
    return module_launcher.colocated(tiny_model_dir, max_total_tokens=4096, max_running_requests=8,
                                     served_model_name="tiny")


def test_bench_serve_random_dataset_report(node, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = serve.main(["--base-url", node.url, "--num-prompts", "8", "--random-input-len", "40",
                     "--random-output-len", "6", "--random-range-ratio", "1.0", "--request-rate", "50",
                     "--arrival", "fixed", "--max-concurrency", "4", "--warmup-requests", "1",
                     "--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000",
                     "--disable-tqdm", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["bench"] == "serve"
    assert report["ratios"] == {}  # one run compares nothing
    s = report["figures"]["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    assert s["total_output_tokens"] == 8 * 6  # ignore_eos: every request runs to max_tokens
    rows = report["figures"]["requests"]
    assert len(rows) == 8
    for row in rows:
        assert row["ok"] and row["output_len"] == 6
        assert 40 <= row["prompt_len"] <= 41  # the server's count of our 40-token prompt (+ BOS at most)
        assert 0 < row["ttft"] <= row["latency"]
        assert row["tpot"] is not None and row["tpot"] >= 0
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        p = s[key]
        assert p["n"] > 0 and p["p50"] <= p["p90"] <= p["p99"]
    # at most one gap between each pair of the 6 streamed tokens: fewer when a token's text is held back
    # (a random model's byte-level token that ends inside a UTF-8 character streams no text; its text
    # comes with the next token's chunk), or when the tiny model's tokens reach the front end faster
    # than it writes them and a stream sends them together (on a busy host, every stream once did so:
    # no gap at all)
    assert s["itl_ms"]["n"] <= 8 * 5
    if s["itl_ms"]["n"]:
        assert s["itl_ms"]["p50"] <= s["itl_ms"]["p90"] <= s["itl_ms"]["p99"]
    # generous SLOs: every request is good
    assert s["good_requests"] == 8 and s["goodput"] == pytest.approx(s["request_throughput"], rel=1e-3)
    assert s["output_throughput"] > 0 and s["input_throughput"] > 0
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["figures"]["config"]["request_rate"] == 50.0
    printed = capsys.readouterr().out
    assert "TTFT (ms)" in printed and "goodput" in printed


def test_bench_serve_chat_dataset_without_tokenizer(node, tmp_path):
    out = tmp_path / "chat.json"
    rc = serve.main(["--base-url", node.url, "--dataset", "chat", "--tokenizer", "none", "--num-prompts", "4",
                     "--random-input-len", "30", "--random-output-len", "4", "--random-range-ratio", "1.0",
                     "--warmup-requests", "0", "--disable-tqdm", "--json", str(out),
                     "--plot", str(tmp_path / "cdf.png")])
    assert rc == 0
    report = json.loads(out.read_text())
    s = report["figures"]["summary"]
    assert s["completed"] == 4 and s["total_output_tokens"] == 16
    assert s["goodput"] is None  # no SLO given
    # the chat template wraps the messages: the server counts more tokens than the 30 words of content
    assert all(r["prompt_len"] > 30 for r in report["figures"]["requests"])
    assert (tmp_path / "cdf.png").stat().st_size > 1000


def test_failed_requests_are_counted_not_fatal(node, tmp_path):
    out = tmp_path / "bad.json"
    # max_tokens far beyond the context length: the node refuses each request with a 400
    rc = serve.main(["--base-url", node.url, "--num-prompts", "3", "--random-input-len", "8",
                     "--random-output-len", "1000000", "--random-range-ratio", "1.0",
                     "--warmup-requests", "0", "--disable-tqdm", "--json", str(out)])
    assert rc == 1
    s = json.loads(out.read_text())["figures"]["summary"]
    assert s["completed"] == 0 and s["failed"] == 3
    assert all("HTTP 400" in e for e in s["first_errors"])


def test_prompt_maker_exact_lengths_and_chat_split(tiny_model_dir):
    maker = serve.PromptMaker(tiny_model_dir, seed=3)
    for n in (1, 7, 64, 300):
        assert maker.count(maker.text(n)) == n
    chats = serve.chat_dataset(maker, 6, 50, 5, 1.0, max_turns=3)
    for c in chats:
        roles = [m["role"] for m in c.prompt]
        assert roles[0] == "system" and roles[-1] == "user" and len(roles) % 2 == 0
        assert c.prompt_len == 50 and c.api == "chat" and c.output_len == 5


def test_arrivals_and_percentiles():
    rng = random.Random(0)
    assert serve.arrival_offsets(4, 2.0, "fixed", rng) == [0.0, 0.5, 1.0, 1.5]
    assert serve.arrival_offsets(3, float("inf"), "poisson", rng) == [0.0, 0.0, 0.0]
    gaps = serve.arrival_offsets(2000, 10.0, "poisson", rng)
    assert gaps == sorted(gaps) and 150 < gaps[-1] < 250  # mean gap 0.1 s
    p = serve.percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01) and p["n"] == 100
    assert serve.percentiles([])["p50"] is None


async def _one_answer_per_connection(reader, writer):
    """A server that answers the first request of each connection and closes the connection when a
    second one arrives on it, without a reply (llama.cpp's server ends a kept-alive connection so)."""
    served = 0
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if served:
                break  # the body left unread: a large one cannot be written
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n")
                          if h.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            events = [{"choices": [{"text": "x"}]}, {"choices": [{"text": "y"}]},
                      {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 3}}]
            body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) \
                + b"data: [DONE]\n\n"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
            served += 1
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


@pytest.mark.parametrize(("prompt_bytes", "warmup"), [(5, 0), (8 << 20, 0), (5, 4)])
def test_request_on_a_connection_the_server_closed_is_sent_again(prompt_bytes, warmup):
    async def run():
        server = await asyncio.start_server(_one_answer_per_connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reqs = [serve.BenchRequest("h" * prompt_bytes, 3, 2) for _ in range(4)]
        async with server:
            return await serve.run_benchmark(f"http://127.0.0.1:{port}", reqs, model="m", max_concurrency=1,
                                             warmup=warmup, progress=False)

    results, duration = asyncio.run(run())
    # a request on a kept-alive connection the server has closed is sent again on a connection of its own,
    # not on another kept-alive one: 4 warmup requests at once leave 4 such connections, one for each
    # request. Without warmup, each second request reuses the connection the one before it opened.
    assert [r.ok for r in results] == [True] * 4
    resent = [False, True, False, True] if warmup == 0 else [True] * 4
    assert [r.resent for r in results] == resent
    s = serve.summarize(results, duration)
    assert s["failed"] == 0 and s["resent"] == sum(resent) and s["total_output_tokens"] == 8
    assert f"sent twice (connection closed)  {sum(resent)}" in serve.format_summary("t", s)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_warmup_requests_share_no_prompt_prefix_with_the_measured_ones(api):
    """The warm-up copies of the first requests start with another word, so after them a server's prefix
    cache holds none of the measured prompts (sending a measured prompt as the warm-up made that request's
    TTFT a cache hit); the measured requests go out unchanged, in full."""
    from aiohttp import web

    seen: list[str] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body["prompt"] if api == "completions" else body["messages"][0]["content"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        delta = {"text": "x"} if api == "completions" else {"delta": {"content": "x"}}
        usage = {"completion_tokens": 1, "prompt_tokens": 3}
        for event in ({"choices": [delta]}, {"choices": [], "usage": usage}):
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        texts = ["alpha beta gamma", "delta epsilon", "zeta eta theta"]
        reqs = [serve.BenchRequest(t if api == "completions" else [{"role": "user", "content": t}], 3, 1, api)
                for t in texts]
        try:
            results, _ = await serve.run_benchmark(f"http://127.0.0.1:{port}", reqs, model="m", warmup=2,
                                                   max_concurrency=1, progress=False)
        finally:
            await runner.cleanup()
        return texts, results

    texts, results = asyncio.run(run())
    assert [r.ok for r in results] == [True] * 3
    warm, measured = seen[:2], seen[2:]
    assert warm == [serve.WARMUP_PREFIX + t for t in texts[:2]]
    assert measured == texts
    assert not any(m.startswith(w.split()[0]) for w in warm for m in measured)  # no shared first word
