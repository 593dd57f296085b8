"""The default model behind a real node answers a real question (through the official openai client)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_dir, launcher):
    node = launcher.colocated(smollm2_dir, max_total_tokens=4096, served_model_name="smollm2")
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=30, temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    assert r.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=30, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer
    assert node.stop() == 0
