"""A real prefill node and decode node against values that do not fit, hostile peers and a late write.

* bootstrap fields that cannot be carried (a room outside int64, a port outside 1..65535, a host that
  is no host name) are 400s at admission on both nodes;
* a bootstrap server answering garbage fails that request with a reason, never the decode's resolver;
* a metadata row whose first token is outside the vocabulary fails the request on the decode node
  instead of its forward; an exception inside a role hook fails that request only;
* the ordering rule: no page is written before the forward's completion the prefill role handed its
  sender is signalled (held by a hook);
* the late write, end to end (mooncake; tests/transfer/test_late_writes.py has it on mooncake and nixl
  inside one process): a request is aborted on the decode node while the
  prefill node is held inside the engine's write of its KV, another request is run at once into the
  memory the decode node hands out next, then the write is let go; that request's greedy tokens are
  exactly those of an idle colocated node.

After each case the nodes answer a normal request with the colocated node's exact tokens, their
free pages, slots and metadata slots come back, and nothing stays quarantined. The hooks inside the
node processes (a held write, a bad first token, an exception) are `tests/pd/node_hooks`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from pathlib import Path

import pytest

from tests.harness.backends import backend_params
from tests.harness.client import http_get, http_post, stream, wait_until
from tests.harness.pd import assert_restored, colocated_tokens, greedy, make_prompts
from tests.transfer.inproc_pair import Garbage

HOOKS = str(Path(__file__).resolve().parent / "node_hooks")


@pytest.fixture(scope="module", params=backend_params("mooncake"))
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def control_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("node-hooks")


@pytest.fixture(scope="module")
def pair(backend, pd_model_dir, module_launcher, control_dir):
    env = {"PYTHONPATH": HOOKS, "PDSERVE_TEST_HOOKS_DIR": str(control_dir)}
    if os.environ.get("PDSERVE_TEST_NO_QUARANTINE"):
        env["PDSERVE_TEST_NO_QUARANTINE"] = os.environ["PDSERVE_TEST_NO_QUARANTINE"]
    p = module_launcher.pair(pd_model_dir, backend, env=env)
    yield p
    p.stop()


@pytest.fixture
def restored(pair):
    start = pair.start_counts()
    yield
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
    assert pair.decode.stats()["kv_quarantined_pages"] == 0


def serves_normally(pair, colocated, pd_tok, seed: int) -> None:
    prompt = make_prompts(pd_tok, 1, seed=seed, lo=30, hi=50)[0]
    want = colocated_tokens(colocated, [prompt])[0]
    (ps, pb), (ds, db) = pair.generate({"input_ids": prompt, "sampling_params": greedy()})
    assert ps == 200 and ds == 200, (pb, db)
    assert db["output_ids"] == want
    assert http_get(pair.decode.url + "/health")[0] == 200 \
        and http_get(pair.prefill.url + "/health")[0] == 200


def error_of(raw: bytes) -> str:
    return json.loads(raw)["error"]["message"]


# ---------------------------------------------------------------------------------------------- admission
@pytest.mark.parametrize("field,value,word", [
    ("bootstrap_room", 2**64 - 1, "bootstrap_room must be 0.."),
    ("bootstrap_room", 2**63, "bootstrap_room must be 0.."),
    ("bootstrap_room", -1, "bootstrap_room must be 0.."),
    ("bootstrap_port", 70000, "bootstrap_port must be 1..65535"),
    ("bootstrap_port", 0, "bootstrap_port must be 1..65535"),
])
def test_bootstrap_values_that_cannot_be_carried_are_400s(pair, backend, colocated,
                                                          pd_tok, restored, field, value, word):
    body = pair.body({"input_ids": list(range(100, 130)), "sampling_params": greedy()})
    body[field] = value
    for node in (pair.prefill, pair.decode):
        status, raw = http_post(node.url + "/generate", body)
        # the HTTP edge may refuse it before the role's check does (`PDRole.validate`): either names the field
        assert status == 400 and (word in error_of(raw) or field in error_of(raw)), (node.role, status, raw)
    serves_normally(pair, colocated, pd_tok, seed=1)


def test_a_host_that_is_no_host_name_is_a_400_on_the_decode_node(pair, backend, colocated, pd_tok, restored):
    body = pair.body({"input_ids": list(range(100, 130)), "sampling_params": greedy()})
    body["bootstrap_host"] = "a b"
    status, raw = http_post(pair.decode.url + "/generate", body)
    # the HTTP edge may refuse it before the decode role's check does: either names the host
    assert status == 400 and ("is not host:port" in error_of(raw) or "bootstrap_host" in error_of(raw)), raw
    serves_normally(pair, colocated, pd_tok, seed=2)


# ---------------------------------------------------------------------------------------------- bootstrap
@pytest.mark.parametrize("body,ctype", [(b"<html><body>bad gateway</body></html>", "text/html"),
                                        (b'{"page_size": "4"}', "application/json"),
                                        (b"[1, 2, 3]", "application/json")],
                         ids=["html", "wrong-types", "list"])
def test_a_bootstrap_server_answering_garbage_fails_the_request_not_the_resolver(pair,
                                                                                 backend, colocated, pd_tok,
                                                                                 restored, body, ctype):
    server = Garbage(lambda path: (ctype, body))
    try:
        req = {"input_ids": list(range(100, 130)), "sampling_params": greedy(), "bootstrap_host": "127.0.0.1",
               "bootstrap_port": server.port, "bootstrap_room": 777001}
        for i in range(2):  # the resolver thread survived the first one
            status, raw = http_post(pair.decode.url + "/generate",
                                    {**req, "bootstrap_room": 777001 + i}, timeout=60)
            assert status == 500 and "bootstrap server" in error_of(raw), raw
    finally:
        server.close()
    serves_normally(pair, colocated, pd_tok, seed=3)


# ---------------------------------------------------------------------------------------------- the rows
def test_a_first_token_outside_the_vocabulary_fails_the_request_not_the_decode(pair,
                                                                               backend, colocated, pd_tok,
                                                                               restored, control_dir):
    (control_dir / "bad_token").write_text(str(len(pd_tok) + 1000))
    (ps, pb), (ds, db) = pair.generate({"input_ids": list(range(200, 240)), "sampling_params": greedy()})
    assert ds == 500 and "first_token_id" in db["error"]["message"], db
    assert pair.decode.stats()["rejected_peer_values"] >= 1
    serves_normally(pair, colocated, pd_tok, seed=4)


def test_an_exception_in_a_role_hook_fails_that_request_only(pair, backend, colocated, pd_tok, restored,
                                                            control_dir):
    (control_dir / "raise").write_text("")
    (ps, pb), (ds, db) = pair.generate({"input_ids": list(range(300, 340)), "sampling_params": greedy()})
    assert ps == 500 and "on_prefill_done" in pb["error"]["message"], pb
    assert ds == 500, db
    serves_normally(pair, colocated, pd_tok, seed=5)


# ---------------------------------------------------------------------------------------------- ordering
def test_no_page_is_sent_before_the_forward_that_wrote_it_is_signalled_done(pair, colocated, pd_tok, restored,
                                                                            control_dir):
    """The ordering rule with the CPU engine: the prefill role hands each chunk's send the device's
    completion of the work launched so far (`ModelRunner.work_done`; on a GPU an event); here that
    completion is held: no engine write happens until it is signalled, then the answer is exact."""
    prompt = make_prompts(pd_tok, 1, seed=21, lo=40, hi=41)[0]
    want = colocated_tokens(colocated, [prompt])[0]
    for name in ("work_waited", "work_done", "written"):
        (control_dir / name).unlink(missing_ok=True)
    (control_dir / "hold_work").write_text("")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            leg = ex.submit(pair.generate, {"input_ids": prompt, "sampling_params": greedy()})
            wait_until((control_dir / "work_waited").exists, 60,
                       "the sender to wait for the forward's completion")
            time.sleep(1.0)
            assert not (control_dir / "written").exists(), "a page was written before its forward was done"
            (control_dir / "work_done").write_text("")
            (ps, pb), (ds, db) = leg.result(timeout=120)
    finally:
        (control_dir / "work_done").write_text("")
        (control_dir / "hold_work").unlink(missing_ok=True)
    assert ps == 200 and ds == 200, (pb, db)
    assert (control_dir / "written").exists() and db["output_ids"] == want


# ---------------------------------------------------------------------------------------------- late write
def test_a_late_write_never_reaches_the_next_requests_pages(pair, colocated, pd_tok, restored, control_dir):
    n = 96
    first, second = make_prompts(pd_tok, 2, seed=11, lo=40, hi=41)
    want = colocated_tokens(colocated, [second], n=n)[0]
    for name in ("gate_entered", "gate_release"):
        (control_dir / name).unlink(missing_ok=True)
    (control_dir / "gate_armed").write_text("")
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        body1 = pair.body({"input_ids": first, "sampling_params": greedy(n), "rid": "late-1"})
        f1 = [ex.submit(http_post, node.url + "/generate", body1, None, 120)
              for node in (pair.prefill, pair.decode)]
        wait_until((control_dir / "gate_entered").exists, 60, "the prefill to write the first request's KV")
        status, raw = http_post(pair.decode.url + "/abort_request", {"rid": "late-1"})
        assert status == 200, raw
        assert f1[1].result()[0] == 200  # the decode leg ended as aborted
        quarantined = pair.decode.stats()["kv_quarantined_pages"]
        # the second request takes the memory the decode node hands out next, while the first
        # request's write is still held inside the prefill's engine
        body2 = pair.body({"input_ids": second, "sampling_params": greedy(n),
                           "rid": "late-2", "stream": True})
        fp2 = ex.submit(http_post, pair.prefill.url + "/generate", {**body2, "stream": False}, None, 120)
        released = threading.Event()

        def on_event(k, event):
            if not released.is_set():  # its KV is in and it decodes: let the held write land now
                (control_dir / "gate_release").write_text("")
                released.set()
                time.sleep(0.5)  # the late write lands while it goes on decoding

        got = stream(pair.decode.url + "/generate", body2, timeout=120, on_event=on_event)
        assert fp2.result()[0] == 200
        f1[0].result()
    assert released.is_set() and got.ok, got.error
    assert got.events[-1]["output_ids"] == want, \
        "the second request's KV was overwritten by the first request's late write"
    assert quarantined > 0  # the first request's pages waited for the prefill's AbortAck
