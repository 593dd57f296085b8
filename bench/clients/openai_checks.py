"""The OpenAI Python SDK against a server: the request fields real programs send, each checked strictly.

    python openai_checks.py --base-url http://127.0.0.1:30000/v1 --model default \
        --expect-reasoning-effort refused

Standalone (imports only `openai` and the standard library), so any venv with the SDK runs it. It prints
one JSON line per check, {"check": name, "ok": bool, "detail": str}, and exits 0 iff every check passed.
`--model` is the served name; `--expect-reasoning-effort` says what the model's chat template makes of
`reasoning_effort`: `refused` (a template that does not read it: a 400 naming the field) or `accepted`.
`--only` runs some checks (comma list).
"""

from __future__ import annotations

import json
import re
import sys

import openai
from check_lines import Failed, arguments, expect, run_checks

PROMPT = "The three primary colors are red, blue and"
QUESTION = [{"role": "user", "content": "Name three animals that live in the sea."}]
UNKNOWN = "nosuchmodel"


def close_json(prefix: str) -> str:
    """A JSON text cut short, completed: an open string closed (an escape it cut dropped), a key given a
    value,
    a cut literal or number made 0, a trailing comma dropped, the open objects and arrays closed. An invalid
    prefix stays invalid."""
    stack, in_str, esc, is_key, last, literal = [], False, False, False, "", None
    for i, ch in enumerate(prefix):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str, last = False, "key" if is_key else "value"
            continue
        if literal is not None and not (ch.isalnum() or ch in ".+-"):
            literal = None
        if ch.isspace():
            continue
        if ch == '"':
            in_str, is_key = True, bool(stack) and stack[-1] == "{" and last in ("{", ",")
        elif ch in "{[":
            stack.append(ch)
            last = ch
        elif ch in "}]":
            stack = stack[:-1]
            last = "value"
        elif ch in ",:":
            last = ch
        else:
            literal = i if literal is None else literal
            last = "value"
    out = prefix
    if in_str:
        out = re.sub(r"\\(u[0-9a-fA-F]{0,3})?$", "", out) + '"'
        last = "key" if is_key else "value"
    elif literal is not None:
        out = out[:literal] + "0"
    if last == "key":
        out += ":0"
    elif last == ":":
        out += "0"
    elif last == ",":
        out = out.rstrip()[:-1]
    return out + "".join("}" if c == "{" else "]" for c in reversed(stack))


def error_body(e: openai.APIStatusError) -> dict:
    try:
        body = e.response.json()
    except ValueError:
        raise Failed(f"HTTP {e.status_code} with a body that is not JSON: "
                     f"{e.response.text[:120]!r}") from None
    expect(isinstance(body, dict) and isinstance(body.get("error"), dict),
           f"HTTP {e.status_code} body has no error object: {e.response.text[:120]!r}")
    return body["error"]


class Checks:
    def __init__(self, client: openai.OpenAI, model: str, reasoning: str, json_prefix_ok: bool) -> None:
        self.c = client
        self.model = model
        self.reasoning = reasoning
        self.json_prefix_ok = json_prefix_ok

    def chat(self, **kw):
        return self.c.chat.completions.create(model=self.model, messages=QUESTION, **kw)

    def complete(self, **kw):
        return self.c.completions.create(model=self.model, prompt=PROMPT, **kw)

    # ------------------------------------------------------------------------------ streaming usage
    def chat_stream_include_usage(self) -> str:
        chunks = list(self.chat(max_tokens=8, stream=True, stream_options={"include_usage": True}))
        expect(len(chunks) >= 2, f"{len(chunks)} chunks")
        last, rest = chunks[-1], chunks[:-1]
        expect(last.usage is not None, "the last chunk has no usage")
        expect(last.choices == [], f"the usage chunk has {len(last.choices)} choices (expected none)")
        early = [i for i, ch in enumerate(rest) if ch.usage is not None]
        expect(not early, f"chunks {early} before the last carry usage without continuous_usage_stats")
        u = last.usage
        expect(u.prompt_tokens > 0 and u.completion_tokens > 0, f"usage {u}")
        expect(u.total_tokens == u.prompt_tokens + u.completion_tokens, f"total_tokens wrong: {u}")
        return f"usage on the last of {len(chunks)} chunks: {u.prompt_tokens}+{u.completion_tokens}"

    def chat_stream_continuous_usage(self) -> str:
        opts = {"include_usage": True, "continuous_usage_stats": True}
        chunks = list(self.chat(max_tokens=8, stream=True, extra_body={"stream_options": opts}))
        missing = [i for i, ch in enumerate(chunks) if ch.usage is None]
        expect(not missing, f"chunks {missing} of {len(chunks)} have no usage")
        counts = [ch.usage.completion_tokens for ch in chunks]
        expect(counts == sorted(counts), f"completion_tokens goes down: {counts}")
        expect(len({ch.usage.prompt_tokens for ch in chunks}) == 1, "prompt_tokens changes between chunks")
        return f"usage on all {len(chunks)} chunks, completion_tokens {counts}"

    # ------------------------------------------------------------------------------ logprobs
    def completion_logprobs(self) -> str:
        r = self.complete(max_tokens=6, temperature=0, logprobs=3)
        lp = r.choices[0].logprobs
        expect(lp is not None, "no logprobs")
        n = r.usage.completion_tokens
        expect(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n,
               f"{len(lp.tokens)} tokens, {len(lp.token_logprobs)} logprobs, {len(lp.top_logprobs)} top "
               f"for {n} completion tokens")
        expect(all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs),
               f"logprobs {lp.token_logprobs}")
        expect(all(isinstance(t, dict) and 1 <= len(t) <= 3 for t in lp.top_logprobs), "top_logprobs not 1-3")
        for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            best = max(top.values())  # temperature 0: the chosen token is the most likely one
            expect(abs(best - x) < 1e-3, f"greedy token {tok!r} has logprob {x} but the top one {best}")
        return f"{n} tokens with logprobs and top 3"

    def chat_logprobs(self) -> str:
        r = self.chat(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
        lp = r.choices[0].logprobs
        expect(lp is not None and lp.content, "no logprobs.content")
        expect(len(lp.content) == r.usage.completion_tokens,
               f"{len(lp.content)} entries for {r.usage.completion_tokens} completion tokens")
        for item in lp.content:
            expect(len(item.top_logprobs) == 2, f"{len(item.top_logprobs)} top_logprobs for {item.token!r}")
            expect(abs(item.top_logprobs[0].logprob - item.logprob) < 1e-3,
                   f"greedy token {item.token!r} is not the top one")
        return f"{len(lp.content)} tokens with logprobs and top 2"

    def completion_echo_logprobs(self) -> str:
        r = self.complete(max_tokens=1, temperature=0, echo=True, logprobs=1)
        lp, u = r.choices[0].logprobs, r.usage
        expect(lp is not None, "no logprobs")
        expect(r.choices[0].text.startswith(PROMPT),
               f"the text does not start with the prompt: {r.choices[0].text!r}")
        expect(len(lp.tokens) == u.prompt_tokens + u.completion_tokens,
               f"{len(lp.tokens)} tokens for {u.prompt_tokens} prompt + {u.completion_tokens} output tokens")
        expect(lp.token_logprobs[0] is None, f"token_logprobs[0] is {lp.token_logprobs[0]!r}, not None")
        rest = lp.token_logprobs[1:]
        expect(all(isinstance(x, float) for x in rest), f"non-float prompt/output logprobs: {rest}")
        return f"{u.prompt_tokens} prompt + {u.completion_tokens} output tokens scored"

    def completion_echo_max_tokens_0(self) -> str:
        r = self.complete(max_tokens=0, echo=True, logprobs=1)
        one = self.complete(max_tokens=1, temperature=0, echo=True, logprobs=1)
        lp, u = r.choices[0].logprobs, r.usage
        expect(lp is not None, "no logprobs")
        expect(r.choices[0].text == PROMPT, f"text {r.choices[0].text!r} is not the prompt")
        expect(u.completion_tokens == 0, f"{u.completion_tokens} completion tokens")
        expect(len(lp.tokens) == u.prompt_tokens,
               f"{len(lp.tokens)} tokens for {u.prompt_tokens} prompt tokens")
        expect(lp.token_logprobs[0] is None and all(isinstance(x, float) for x in lp.token_logprobs[1:]),
               f"token_logprobs {lp.token_logprobs}")
        ref = one.choices[0].logprobs.token_logprobs[1:u.prompt_tokens]
        diff = max((abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref, strict=True)), default=0.0)
        expect(diff < 1e-3, f"prompt logprobs differ from max_tokens=1's by {diff:.2e}")
        return f"{u.prompt_tokens} prompt tokens scored, no output (max diff to max_tokens=1: {diff:.1e})"

    # ------------------------------------------------------------------------------ sampling
    def seed(self) -> str:
        texts = [self.chat(max_tokens=16, temperature=1.0, seed=1234).choices[0].message.content
                 for _ in range(2)]
        expect(texts[0] == texts[1], f"seed 1234 gave {texts[0]!r} then {texts[1]!r}")
        return f"the same {len(texts[0])} characters twice"

    def stop(self) -> str:
        free = self.complete(max_tokens=16, temperature=0, logprobs=1).choices[0]
        later = [t.strip() for t in free.logprobs.tokens[2:] if t.strip()]
        expect(bool(later), f"no token past the second to stop at: {free.text!r}")
        stop, free = later[0], free.text  # the first non-blank token from the third on
        r = self.complete(max_tokens=16, temperature=0, stop=[stop])
        want = free[:free.index(stop)]
        expect(r.choices[0].text == want, f"stop {stop!r}: {r.choices[0].text!r}, expected {want!r}")
        expect(r.choices[0].finish_reason == "stop", f"finish_reason {r.choices[0].finish_reason!r}")
        return f"stopped before {stop!r}"

    def penalties(self) -> str:
        prompt = "apple " * 24
        kw = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "model": self.model, "logprobs": 1}
        plain = self.c.completions.create(**kw).choices[0]
        expect(len(set(plain.logprobs.tokens)) < len(plain.logprobs.tokens),
               f"the unpenalised answer repeats no token, so a penalty cannot show: {plain.text!r}")
        texts = {}
        for name, extra in (("frequency_penalty", {"frequency_penalty": 2.0}),
                            ("presence_penalty", {"presence_penalty": 2.0})):
            texts[name] = self.c.completions.create(**kw, **extra).choices[0].text
            expect(texts[name] != plain.text, f"{name}=2 changed nothing: {plain.text!r}")
        return "both penalties change a repetitive greedy answer"

    def n_choices(self) -> str:
        r = self.chat(max_tokens=8, temperature=1.0, n=2)
        expect(len(r.choices) == 2, f"{len(r.choices)} choices")
        expect(sorted(ch.index for ch in r.choices) == [0, 1], f"indices {[ch.index for ch in r.choices]}")
        expect(all(ch.message.content for ch in r.choices), "an empty choice")
        return "two choices"

    def json_object(self) -> str:
        msgs = [{"role": "user", "content": 'Answer in JSON: {"animal": "...", "legs": N} for a cat.'}]
        r = self.c.chat.completions.create(model=self.model, messages=msgs, max_tokens=96, temperature=0,
                                           response_format={"type": "json_object"})
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        cut = reason == "length" and self.json_prefix_ok
        try:
            value = json.loads(close_json(text) if cut else text)
        except ValueError as e:
            raise Failed(f"not JSON{' even closed' if cut else ''} ({e}): {text[:80]!r} (finish_reason "
                         f"{reason})") from None
        expect(isinstance(value, dict), f"JSON but not an object: {text[:80]!r}")
        return f"an object{' (cut at max_tokens, closed)' if cut else ''} with keys {sorted(value)[:4]}"

    def logit_bias(self) -> str:
        token_id = 1000
        plain = self.complete(max_tokens=5, temperature=0, logprobs=1).choices[0]
        r = self.complete(max_tokens=5, temperature=0, logprobs=1, logit_bias={str(token_id): 100})
        toks = r.choices[0].logprobs.tokens
        expect(len(toks) == 5 and len(set(toks)) == 1, f"bias +100 on token {token_id}: tokens {toks}")
        expect(toks != plain.logprobs.tokens, "the biased answer is the unbiased one")
        return f"token {token_id} ({toks[0]!r}) five times"

    # ------------------------------------------------------------------------------ accepted fields
    def metadata_store(self) -> str:
        r = self.chat(max_tokens=4, metadata={"run": "client-checks"}, store=True)
        expect(r.choices and r.choices[0].message.content is not None, "no answer")
        return "accepted"

    def reasoning_effort(self) -> str:
        try:
            self.chat(max_tokens=4, reasoning_effort="low")
        except openai.BadRequestError as e:
            msg = error_body(e).get("message", "")
            expect(self.reasoning == "refused", f"refused (expected accepted): {msg[:120]}")
            expect("reasoning_effort" in msg,
                   f"a 400 whose message does not name reasoning_effort: {msg[:120]}")
            return f"400: {msg[:100]}"
        expect(self.reasoning == "accepted",
               "accepted, but this model's template does not read it: expected a 400")
        return "accepted"

    # ------------------------------------------------------------------------------ models
    def models_list(self) -> str:
        ids = [m.id for m in self.c.models.list()]
        expect(self.model in ids, f"{self.model!r} not in {ids}")
        return f"models {ids}"

    def models_retrieve(self) -> str:
        m = self.c.models.retrieve(self.model)
        expect(m.id == self.model, f"retrieved {m.id!r}")
        return f"retrieved {m.id!r}"

    def _not_found(self, call) -> str:
        try:
            call()
        except openai.NotFoundError as e:
            code = error_body(e).get("code")
            expect(code == "model_not_found", f"404 with error.code {code!r}")
            return f"404 model_not_found: {error_body(e).get('message', '')[:80]}"
        except openai.APIStatusError as e:
            raise Failed(f"HTTP {e.status_code} (expected 404): {e.response.text[:120]}") from None
        raise Failed(f"model {UNKNOWN!r} was served")

    def models_retrieve_unknown(self) -> str:
        return self._not_found(lambda: self.c.models.retrieve(UNKNOWN))

    def chat_unknown_model(self) -> str:
        return self._not_found(lambda: self.c.chat.completions.create(model=UNKNOWN,
                                                                      messages=QUESTION, max_tokens=2))

    def embeddings(self) -> str:
        try:
            self.c.embeddings.create(model=self.model, input="hello")
        except openai.APIStatusError as e:
            expect(e.status_code in (404, 501), f"HTTP {e.status_code} (expected 404 or 501)")
            msg = error_body(e).get("message", "")
            expect(re.search(r"not (supported|served)|unsupported", msg, re.I) is not None,
                   f"the message does not say the endpoint is not supported: {msg[:120]!r}")
            return f"{e.status_code}: {msg[:90]}"
        raise Failed("embeddings answered 200")


CHECKS = [name for name in vars(Checks) if not name.startswith("_") and name not in ("chat", "complete")]


def main(argv: list[str] | None = None) -> int:
    p = arguments(__doc__)
    p.add_argument("--expect-reasoning-effort", choices=("accepted", "refused"), default="refused")
    p.add_argument("--json-prefix-ok", action="store_true",
                   help="json_object: accept an object cut short by max_tokens once closed (a random-weight "
                        "model never closes one)")
    p.add_argument("--api-key", default="x")
    p.add_argument("--only", default="", help="comma list of checks: " + ", ".join(CHECKS))
    ns = p.parse_args(argv)
    names = [n for n in ns.only.split(",") if n] or CHECKS
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        p.error(f"no such check: {', '.join(unknown)}")
    client = openai.OpenAI(base_url=ns.base_url, api_key=ns.api_key, timeout=ns.timeout, max_retries=0)
    checks = Checks(client, ns.model, ns.expect_reasoning_effort, ns.json_prefix_ok)

    def http_error(e: Exception) -> str | None:
        return f"HTTP {e.status_code}: {e.response.text[:160]}" \
            if isinstance(e, openai.APIStatusError) else None

    return run_checks({name: getattr(checks, name) for name in names}, http_error)


if __name__ == "__main__":
    sys.exit(main())
