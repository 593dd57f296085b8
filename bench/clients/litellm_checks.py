"""LiteLLM against a server as an OpenAI-compatible provider (`openai/<model>`): plain and streaming.

    python litellm_checks.py --base-url http://127.0.0.1:30000/v1 --model default

Standalone (imports litellm and the standard library). One JSON line per check,
{"check": name, "ok": bool, "detail": str}; exit 0 iff every check passed.
"""

from __future__ import annotations

import functools
import os
import sys

# LiteLLM fetches its model price list from the network at import unless told to read its own copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
from check_lines import arguments, expect, run_checks  # noqa: E402

MESSAGES = [{"role": "user", "content": "Name three animals that live in the sea."}]



def call(ns, **kw):
    return litellm.completion(model=f"openai/{ns.model}", api_base=ns.base_url,
                              api_key="x", messages=MESSAGES,
                              max_tokens=32, temperature=0, timeout=ns.timeout, num_retries=0, **kw)


def plain(ns) -> str:
    r = call(ns)
    text = r.choices[0].message.content
    expect(isinstance(text, str) and text, f"empty content: {text!r}")
    u = r.usage
    expect(u.prompt_tokens > 0 and u.completion_tokens > 0, f"usage {u}")
    expect(r.choices[0].finish_reason in ("stop", "length"), f"finish_reason {r.choices[0].finish_reason!r}")
    return f"{u.completion_tokens} tokens, finish_reason {r.choices[0].finish_reason}"


def streaming(ns) -> str:
    whole = call(ns).choices[0].message.content
    chunks = list(call(ns, stream=True, stream_options={"include_usage": True}))
    expect(len(chunks) > 2, f"{len(chunks)} chunks")
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    expect(text == whole, f"streamed {text!r} but the plain call gave {whole!r} (temperature 0)")
    built = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    expect(built.usage is not None and built.usage.completion_tokens > 0,
           f"usage of the stream: {built.usage}")
    return f"{len(chunks)} chunks spell the plain answer; {built.usage.completion_tokens} completion tokens"


CHECKS = {"completion": plain, "completion_stream": streaming}


def main(argv: list[str] | None = None) -> int:
    ns = arguments(__doc__).parse_args(argv)
    return run_checks({name: functools.partial(check, ns) for name, check in CHECKS.items()})


if __name__ == "__main__":
    sys.exit(main())
