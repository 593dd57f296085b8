"""SmolLM2-135M-Instruct disaggregated over mooncake gives transformers' greedy tokens, for chat prompts
of several lengths (some span several prefill chunks), concurrently."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.harness.pd import BASE, assert_restored, greedy, hf_greedy, hf_model

pytestmark = [pytest.mark.slow, pytest.mark.backend("mooncake")]

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in two sentences why the sky is blue, and then say what colour a clear sky is at noon. "
    "Keep the answer short, simple and friendly, as if talking to a curious child who asked you twice.",
]
SETTINGS = {**BASE, "context_length": 512}


@pytest.fixture(scope="module")
def chats(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_smollm2_disaggregated_matches_colocated(smollm2_dir, chats, launcher):
    assert max(len(c) for c in chats) > SETTINGS["chunked_prefill_size"]  # several chunks for one prompt
    hf = hf_model(smollm2_dir)
    want = [hf_greedy(hf, c, 16) for c in chats]
    del hf
    pair = launcher.pair(smollm2_dir, "mooncake", prefill_settings=SETTINGS, decode_settings=SETTINGS)
    start = pair.start_counts()
    with concurrent.futures.ThreadPoolExecutor(len(chats)) as ex:
        got = list(ex.map(lambda c: pair.generate({"input_ids": c, "sampling_params": greedy(16)}), chats))
    for (ps, pb), (ds, db) in got:
        assert ps == 200 and ds == 200, (pb, db)
    assert [db["output_ids"] for _, (_, db) in got] == want
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
