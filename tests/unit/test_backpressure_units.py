"""The pieces of node-side backpressure and input caps, without a server process:

* stop strings are found by scanning only the tail a new match can be in, with the same result as a
  full rescan after every update (hypothesis); the held-back stop prefix is the same as the naive one;
* invalid UTF-8 output is held back for a bounded number of tokens; a multi-token character in a stop
  string still stops the request in the scheduler;
* `SamplingParams.verify` caps stop strings (count, length) and stop token ids, naming the field;
* the scheduler's admission (--max-queued-requests): exact per item, a batch admitted whole or refused
  whole, admitted rids acknowledged at once, refusals 429 naming the flag, counted in the stats.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import ServerArgs
from common.protocol import BadRequest, BatchOut, SamplingParams, TokenizedRequest
from common.scheduler.intake import Admission, load_stop_decoder
from common.scheduler.req import Req
from common.server.detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer, StopScanner, _held_stop_prefix
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)

ALPHABET = "ab c\u00e9"  # few letters: stop strings and their overlaps occur often


# ---------------------------------------------------------------------------------------------- stop scans
@settings(max_examples=150, deadline=None)
@given(chunks=st.lists(st.text(ALPHABET, max_size=6), max_size=12),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4))
def test_tail_scan_finds_what_a_full_rescan_finds(chunks, stops):
    scanner = StopScanner(stops)
    text = ""
    for chunk in chunks:
        text += chunk
        scanner.feed(text)
        full = {s: text.find(s) for s in stops if s in text}
        assert scanner.first == full, (text, stops)


def _held_naive(text: str, stops: list[str]) -> int:
    best = 0
    for s in stops:
        for n in range(min(len(s), len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best


@settings(max_examples=150, deadline=None)
@given(text=st.text(ALPHABET, max_size=12),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), max_size=4))
def test_held_stop_prefix_matches_the_naive_one(text, stops):
    assert _held_stop_prefix(text, stops) == _held_naive(text, stops)


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_stop_trim_uses_the_first_occurrence_found_by_the_scan(tok):
    # a non-streamed answer comes in one update: the text is cut at the first occurrence, as SGLang does
    ids = tok.encode(" one END two END", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop_strings=["END"])
    assert d.step(ids, {"type": "stop", "matched": "END"}) == " one " == d.text
    # streamed: what was released stays released (an earlier occurrence was not a stop, say min_new_tokens)
    d = IncrementalDetokenizer(tok, [], stop_strings=["END"])
    for t in ids[:-1]:
        d.step([t])
    d.step(ids[-1:], {"type": "stop", "matched": "END"})
    assert d.text == " one END two"


def test_invalid_utf8_is_held_for_a_bounded_number_of_tokens(tok):
    lone = tok.convert_tokens_to_ids("\u00e2")  # the byte 0xE2 alone: a 3-byte sequence that never completes
    assert tok.decode([lone]) == "\ufffd"
    d = IncrementalDetokenizer(tok, [])
    for _ in range(200):
        d.step([lone])
        assert len(d.ids) - d.read_offset <= MAX_HELD_TOKENS + 1  # the window decoded per step stays small
    assert d.text.count("\ufffd") > 150


def test_a_stop_string_of_multi_token_characters_stops_the_request(tokenizer_dir, tok):
    stop = "\u65e5\u672c\u8a9e"  # 3 characters, 9 bytes
    ids = tok.encode(" text " + stop, add_special_tokens=False)
    # more tokens than chars
    assert len(ids) - len(tok.encode(" text ", add_special_tokens=False)) > len(stop)
    req = Req("r", [1, 2], SamplingParams(max_new_tokens=100, stop=stop),
              tokenizer=load_stop_decoder(tokenizer_dir))
    finished = []
    for t in ids:
        req.output_ids.append(t)
        finished.append(req.check_finished())
    assert finished == [False] * (len(ids) - 1) + [True]
    assert req.finished_reason == {"type": "stop", "matched": stop}


# ---------------------------------------------------------------------------------------------- caps
@pytest.mark.parametrize("kw,field", [
    ({"stop": [f"s{i}" for i in range(17)]}, "`p.stop`"),
    ({"stop": ["ok", "x" * 257]}, "`p.stop[1]`"),
    ({"stop": "x" * 257}, "`p.stop`"),
    ({"stop": ["a", ""]}, "`p.stop[1]`"),
    ({"stop_token_ids": list(range(257))}, "`p.stop_token_ids`"),
])
def test_stop_caps_name_the_field(kw, field):
    with pytest.raises(BadRequest) as e:
        SamplingParams(**kw).verify("p")
    assert str(e.value).startswith(field)
    # the limits themselves
    SamplingParams(stop=["y" * 256] * 16, stop_token_ids=list(range(256))).verify("p")


# ---------------------------------------------------------------------------------------------- admission
def _msg(rid: str, size: int = 1, index: int = 0) -> TokenizedRequest:
    return TokenizedRequest(rid=rid, input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2),
                            batch_size=size, batch_index=index)


def test_admission_decides_a_batch_at_its_first_item():
    adm = Admission(3)
    queued = [0]
    admitted = []
    for m in [_msg("a"), _msg("b0", 2, 0), _msg("b1", 2, 1), _msg("c0", 2, 0), _msg("c1", 2, 1), _msg("d")]:
        err = adm.check(m, lambda: queued[0])
        if err is None:
            queued[0] += 1
            admitted.append(m.rid)
        else:
            assert err[0] == 429 and "--max-queued-requests=3" in err[1]
    assert admitted == ["a", "b0", "b1"] and adm.refused == 3
    queued[0] = 1
    assert adm.check(_msg("orphan", 4, 2), lambda: queued[0]) is None  # an item without its batch: alone


def test_scheduler_admits_up_to_the_limit_and_acknowledges_at_once(tiny_model_dir):
    from common.scheduler.scheduler import Scheduler

    args = ServerArgs(model=tiny_model_dir, page_size=4, max_total_tokens=1024, max_running_requests=1,
                      max_queued_requests=2)
    sent: list = []
    s = Scheduler(args, tiny_model_dir, send_fn=sent.append)
    s.process_input_requests([_msg(f"r{i}") for i in range(4)])
    acks = [m for m in sent if isinstance(m, BatchOut) and m.admitted]
    assert [m.admitted for m in acks] == [["r0", "r1"]] and not acks[0].updates
    assert s.num_queued_reqs() == 2 and s.get_stats()["num_queued_reqs"] == 2
    s.step()  # r0 runs: one place in the queue
    s.process_input_requests([_msg("b0", 2, 0), _msg("b1", 2, 1), _msg("r4")])
    s.stream_output()
    ends = {u.rid: u for m in sent for u in m.updates if u.finish_reason}
    for rid in ("r2", "r3", "b0", "b1"):
        assert ends[rid].error_status == 429 \
            and "--max-queued-requests=2" in ends[rid].finish_reason["message"]
    assert "r4" not in ends and any(m.admitted == ["r4"] for m in sent)
    stats = s.get_stats()
    assert stats["max_queued_requests"] == 2 and stats["num_queue_full_refused"] == 4
    s.run_until_idle()
    s.stream_output()
    done = {u.rid for m in sent for u in m.updates if u.finish_reason and not u.error_status}
    assert done == {"r0", "r1", "r4"} and s.num_queued_reqs() == 0


def test_admissions_reach_the_front_end_before_the_stats_that_count_them(tiny_model_dir):
    """A stats query in the same input batch as new requests: the admissions go out first, so the
    front end's count of requests still in its pipe already excludes them when it reads the stats."""
    from common.protocol import StatsQuery, StatsReport
    from common.scheduler.scheduler import Scheduler

    args = ServerArgs(model=tiny_model_dir, page_size=4, max_total_tokens=1024, max_running_requests=1,
                      max_queued_requests=2)
    sent: list = []
    s = Scheduler(args, tiny_model_dir, send_fn=sent.append)
    s.process_input_requests([_msg("r0"), _msg("r1"), StatsQuery(qid=7), _msg("r2")])
    kinds = [("admitted", m.admitted) if isinstance(m, BatchOut) else ("stats", m.qid) for m in sent
             if isinstance(m, StatsReport) or m.admitted]
    assert kinds == [("admitted", ["r0", "r1"]), ("stats", 7)]
    assert sent[-1].stats["num_queued_reqs"] == 2
    before = len(sent)
    s.process_input_requests([StatsQuery(qid=8)])  # nothing new admitted: the report alone
    assert [type(m) for m in sent[before:]] == [StatsReport]


def test_default_queue_limit_follows_the_budgets():
    assert ServerArgs().queued_requests_limit == 2 * 64
    assert ServerArgs(max_running_requests=8).queued_requests_limit == 16
    assert ServerArgs(max_total_tokens=64, page_size=16).queued_requests_limit == 8  # 4 pages
    assert ServerArgs(max_queued_requests=5).queued_requests_limit == 5
