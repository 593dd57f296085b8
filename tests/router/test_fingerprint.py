"""Compatible pairs only (common/fingerprint.py, router/registry.py): real nodes on two tiny random-weight
models of one shape, with different weights, in directories both named `model`. A worker that cannot pair
with the pool (other weights under the same name, another page size, another dtype) is refused at
registration with a 409 naming the difference, at start-up too (listed under `refused` on /workers, never
routed to); a matching pair registers and serves; two mismatched nodes paired by hand refuse each other
at the transfer handshake, naming the fingerprint."""

from __future__ import annotations

import concurrent.futures
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.models.loader import safetensors_files
from tests.harness.client import free_port, get_json, http, wait_until
from tests.harness.nodes import NodeGroup, PDPair, RoleNode
from tests.harness.pd import BASE, FAST_ENV

BODY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def _other_weights(src: str, dst) -> str:
    """A copy of model `src` at `dst` whose every tensor is drawn again from another seed (same shapes)."""
    shutil.copytree(src, dst)
    (path,) = safetensors_files(str(dst))
    g = torch.Generator().manual_seed(1)
    tensors = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def nodes(tiny_model_dir, module_launcher, tmp_path_factory):
    """prefill and decode on model a, decode_b on model b (other weights, same name), decode_page8 on a
    with another page size."""
    root = tmp_path_factory.mktemp("fingerprint")
    a = shutil.copytree(tiny_model_dir, root / "a" / "model")
    b = _other_weights(tiny_model_dir, root / "b" / "model")

    def node(role, model, name, **extra):
        settings = {**BASE, "transfer_backend": "fake", **extra}
        if role == "prefill":
            settings["disaggregation_bootstrap_port"] = free_port()
        return RoleNode(role, str(model), name=name, env=FAST_ENV,
                        log_path=module_launcher.log_path(name), **settings)

    ns = {"prefill": node("prefill", a, "prefill"), "decode": node("decode", a, "decode"),
          "decode_b": node("decode", b, "decode-b"),
          "decode_page8": node("decode", a, "decode-page8", page_size=8)}
    module_launcher.start(NodeGroup(list(ns.values())))
    return ns


def _info(node) -> dict:
    return get_json(node.url + "/server_info")


def _add(router, url: str, kind: str):
    status, _, body = router.post("/workers", {"url": url, "worker_type": kind})
    return status, json.loads(body)


def _message(body: dict) -> str:
    return body["error"]["message"]


def test_a_matching_pair_registers_and_serves(nodes, make_router):
    p, d = nodes["prefill"], nodes["decode"]
    info = _info(p)
    assert info["compatibility"]["model"] == "model" and info["compatibility"]["page_size"] == 4
    assert info["fingerprint"] == _info(d)["fingerprint"]
    assert _info(nodes["decode_b"])["fingerprint"] != info["fingerprint"]  # same name, other weights
    r = make_router([p], [d])
    ws = get_json(r.url + "/workers")
    assert {w["fingerprint"] for w in ws["workers"]} == {info["fingerprint"]} and ws["refused"] == []
    status, _, body = r.post("/generate", BODY)
    assert status == 200, body


def test_other_weights_under_the_same_name_are_refused(nodes, make_router):
    p, d, other = nodes["prefill"], nodes["decode"], nodes["decode_b"]
    r = make_router([p], [d])
    status, body = _add(r, other.url, "decode")
    msg = _message(body)
    assert status == 409, body
    assert f"decode worker {other.url} cannot pair with prefill worker {p.url}: weights differ: prefill " \
        in msg
    assert "(same model name 'model')" in msg
    weights = _info(p)["compatibility"]["weights"], _info(other)["compatibility"]["weights"]
    assert f"prefill {weights[0][:12]}…, decode {weights[1][:12]}…" in msg
    ws = get_json(r.url + "/workers")
    assert other.url not in {w["url"] for w in ws["workers"]}
    assert [(x["url"], x["reason"]) for x in ws["refused"]] == [(other.url, msg)]
    assert r.post("/generate", BODY)[0] == 200  # the pool serves on
    assert r.log_text().count(f"refused decode worker {other.url}") == 1
    # nor does it join as a prefill's peer of its own kind: the pool's decode workers differ from it
    status, body = _add(r, other.url, "prefill")
    assert status == 409 and "weights differ" in _message(body)


def test_another_page_size_is_refused(nodes, make_router):
    p, d, other = nodes["prefill"], nodes["decode"], nodes["decode_page8"]
    r = make_router([p], [d])
    status, body = _add(r, other.url, "decode")
    assert status == 409 and _message(body).endswith("page_size differs: prefill 4, decode 8"), body


def test_another_dtype_is_refused(nodes, make_router, make_worker):
    # a CPU node computes in float32 only: a stand-in advertises what a bfloat16 node would
    p, d = nodes["prefill"], nodes["decode"]
    stand_in = make_worker("decode")
    stand_in.config(info={"compatibility": {**_info(d)["compatibility"], "dtype": "bfloat16"}})
    r = make_router([p], [d])
    status, body = _add(r, stand_in.url, "decode")
    assert status == 409 \
        and _message(body).endswith("dtype differs: prefill 'float32', decode 'bfloat16'"), body
    stand_in.config(info={"compatibility": {**_info(d)["compatibility"], "page_size": "four"}})
    status, body = _add(r, stand_in.url, "decode")
    assert status == 502 and "page_size" in _message(body), body


def test_a_worker_without_a_fingerprint_is_accepted(nodes, make_router, make_worker):
    p, d = nodes["prefill"], nodes["decode"]
    older = make_worker("decode")  # advertises no compatibility, as an older node
    r = make_router([p], [d])
    status, body = _add(r, older.url, "decode")
    assert status == 200, body
    assert "advertises no compatibility fingerprint" in r.log_text()


def test_a_mismatched_worker_at_start_up_is_refused_and_not_routed_to(nodes, make_router):
    p, other = nodes["prefill"], nodes["decode_b"]
    r = make_router([p], [other], wait=False)  # never ready: its one pair cannot pair
    wait_until(lambda: _up(r) and get_json(r.url + "/workers")["refused"], timeout=60, what="a refusal")
    ws = get_json(r.url + "/workers")
    assert ws["total"] == 1 and len(ws["refused"]) == 1
    assert "weights differ" in ws["refused"][0]["reason"] \
        and "(same model name 'model')" in ws["refused"][0]["reason"]
    assert http("GET", r.url + "/readiness")[0] == 503
    assert r.post("/generate", BODY)[0] == 503
    refused = ws["refused"][0]
    assert r.log_text().count(f"refused {refused['worker_type']} worker {refused['url']}") == 1


def _up(router) -> bool:
    try:
        return http("GET", router.url + "/health", timeout=1)[0] == 200
    except OSError:
        return False


def test_mismatched_nodes_paired_by_hand_refuse_each_other(nodes):
    # no router: the rendezvous straight to both nodes, as a router that paired them would send it. The decode
    # refuses the prefill's layout before it sends a TransferInfo, so the prefill leg would wait for one until
    # its bootstrap timeout: as a router does when a decode leg fails, the test aborts it
    pair = PDPair(nodes["prefill"], nodes["decode_b"])
    body = pair.body({**BODY, "rid": "mismatched-by-hand"})
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        prefill_leg = ex.submit(http, "POST", nodes["prefill"].url + "/generate", body, None, 60)
        ds, _, dbody = http("POST", nodes["decode_b"].url + "/generate", body, timeout=60)
        assert ds != 200, dbody
        assert b"compatibility fingerprint mismatch" in dbody, dbody
        assert http("POST", nodes["prefill"].url + "/abort_request", {"rid": "mismatched-by-hand"})[0] == 200
        ps, _, pbody = prefill_leg.result(timeout=60)
    # ended unserved: an error, or the abort (SGLang's 200 with finish_reason abort)
    assert ps != 200 or json.loads(pbody)["meta_info"]["finish_reason"]["type"] == "abort", pbody
