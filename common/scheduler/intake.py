"""What a new request goes through before the scheduler takes it: a `Req` built from the front end's
`TokenizedRequest`, the checks that refuse it (HTTP status and message), and the decoder that stop
strings are matched with."""

from __future__ import annotations

import logging
import os
from typing import Any

from common.layers.sampling import make_generator
from common.protocol import BadRequest, TokenizedRequest
from common.scheduler.req import Req

logger = logging.getLogger("scheduler")


class _TailDecoder:
    """`decode(ids)` of a `tokenizers.Tokenizer`, special tokens kept (they can be stop strings)."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def load_stop_decoder(path: str):
    """A decoder for stop strings: `tokenizer.json` through the `tokenizers` library (fast to load;
    transformers is not imported in the scheduler process), else transformers'; None without one."""
    try:
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            from tokenizers import Tokenizer

            return _TailDecoder(Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a model dir without a tokenizer still serves token ids
        logger.warning("no tokenizer at %s (%s): stop strings will be refused", path, e)
        return None


def make_req(msg: TokenizedRequest, eos_token_ids: list[int], tokenizer: Any) -> Req:
    seed = msg.sampling.seed
    return Req(msg.rid, msg.input_ids, msg.sampling, stream=msg.stream,
               return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
               top_logprobs_num=msg.top_logprobs_num,
               generator=make_generator(seed) if seed is not None else None,
               eos_token_ids=eos_token_ids, tokenizer=tokenizer,
               bootstrap_host=msg.bootstrap_host, bootstrap_port=msg.bootstrap_port,
               bootstrap_room=msg.bootstrap_room, arrival_time=msg.arrival_time or None)


def check_request(req: Req, vocab_size: int, context_length: int, kv_capacity: int,
                  tokenizer: Any) -> tuple[int, str] | None:
    """(HTTP status, message) when the request cannot be served, else None."""
    n = len(req.origin_input_ids)
    if n == 0:
        return 400, "the prompt is empty (input_ids has no tokens)"
    bad = [t for t in req.origin_input_ids if not 0 <= t < vocab_size]
    if bad:
        return 400, f"input_ids contains token id {bad[0]} outside the vocabulary (0..{vocab_size - 1})"
    try:
        req.sampling.verify()
    except BadRequest as e:
        return 400, str(e)
    total = n + req.max_new_tokens
    if total > context_length:
        return 400, (f"the prompt has {n} tokens and max_new_tokens is {req.max_new_tokens}: "
                     f"{total} tokens exceed the context length of {context_length}")
    if total > kv_capacity:
        return 400, (f"the prompt has {n} tokens and max_new_tokens is {req.max_new_tokens}: "
                     f"{total} tokens exceed the KV cache size of {kv_capacity} tokens")
    if req.top_logprobs_num < 0:
        return 400, f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}"
    if req.stop_strs and tokenizer is None:
        return 400, "stop strings need a tokenizer, and this model directory has none"
    return None
