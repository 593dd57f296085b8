"""LangChain's ChatOpenAI against a server: invoke, stream and structured output (its default method).

    python langchain_checks.py --base-url http://127.0.0.1:30000/v1 --model default

Standalone (imports langchain-openai, pydantic and the standard library). One JSON line per check,
{"check": name, "ok": bool, "detail": str}; exit 0 iff every check passed.
"""

from __future__ import annotations

import functools
import sys

from check_lines import arguments, expect, run_checks
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

QUESTION = "Name three animals that live in the sea."


class Pet(BaseModel):
    name: str
    legs: int



def invoke(llm: ChatOpenAI) -> str:
    msg = llm.invoke(QUESTION)
    expect(isinstance(msg.content, str) and msg.content, f"empty content: {msg.content!r}")
    usage = msg.usage_metadata or {}
    expect(usage.get("input_tokens", 0) > 0 and usage.get("output_tokens", 0) > 0, f"usage_metadata {usage}")
    reason = msg.response_metadata.get("finish_reason")
    expect(reason in ("stop", "length"), f"finish_reason {reason!r}")
    return f"{usage['output_tokens']} tokens, finish_reason {reason}"


def stream(llm: ChatOpenAI) -> str:
    whole = llm.invoke(QUESTION).content
    chunks = list(llm.stream(QUESTION))
    expect(len(chunks) > 2, f"{len(chunks)} chunks")
    total = chunks[0]
    for ch in chunks[1:]:
        total += ch
    expect(total.content == whole, f"streamed {total.content!r} but invoke gave {whole!r} (temperature 0)")
    usage = total.usage_metadata or {}
    expect(usage.get("output_tokens", 0) > 0, f"no usage in the stream (stream_usage=True): {usage}")
    return f"{len(chunks)} chunks spell invoke's answer; {usage['output_tokens']} output tokens"


def structured(llm: ChatOpenAI) -> str:
    out = llm.with_structured_output(Pet).invoke("Describe a cat as JSON: its name and its number of legs.")
    expect(isinstance(out, Pet), f"got {type(out).__name__}: {out!r}")
    return f"Pet(name={out.name!r}, legs={out.legs})"


CHECKS = {"invoke": invoke, "stream": stream, "structured_output": structured}


def main(argv: list[str] | None = None) -> int:
    ns = arguments(__doc__).parse_args(argv)
    llm = ChatOpenAI(base_url=ns.base_url, api_key="x", model=ns.model, temperature=0, max_tokens=64,
                     timeout=ns.timeout, max_retries=0, stream_usage=True)
    return run_checks({name: functools.partial(check, llm) for name, check in CHECKS.items()})


if __name__ == "__main__":
    sys.exit(main())
