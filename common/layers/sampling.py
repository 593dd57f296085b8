"""Token sampling for a batch of requests: logits [B, vocab] -> next token ids (+ logprobs).

Processing order (the same as SGLang / vLLM / HF's warpers):

1. penalties on the logits: ``logit_bias`` (OpenAI: a value added to a token's logit), repetition
   penalty, then frequency and presence penalties, then the ``min_new_tokens`` mask (EOS and
   ``stop_token_ids`` set to -inf while a request has produced fewer than ``min_new_tokens`` tokens);
2. temperature (logits / T);
3. top-k, 4. top-p (over the distribution renormalised after top-k), 5. min-p (probability at least
   ``min_p`` times the most likely token's probability);
6. sampling from what is left (inverse CDF: cumsum + searchsorted of one uniform draw per row).

Greedy requests (temperature 0, or top_k 1) take the argmax of the penalised logits, with no
randomness. When the whole batch is greedy, no penalty is active and no logprobs are asked for, the
sampler does one ``argmax`` and nothing else.

Penalty semantics:

* ``frequency_penalty`` / ``presence_penalty`` (OpenAI): over the request's *output* tokens,
  ``logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)``.
* ``repetition_penalty`` (HF ``RepetitionPenaltyLogitsProcessor``, also vLLM): for every token that
  occurs in the *prompt or the output*, ``logits[t] = logits[t] / p`` if ``logits[t] > 0`` else
  ``logits[t] * p``. The prompt is taken from ``SamplingBatchInfo.build(..., prompt_ids=...)``; a
  caller that passes no prompt ids gets output-only repetition penalty.

Seeds: a request with a seed samples with its own ``torch.Generator`` (``make_generator(seed)``,
created once when the request arrives and advanced by every draw), one row at a time, from
probabilities that depend only on that row. So the same seed and the same logits give the same tokens
whether the request runs alone or inside any batch. Unseeded rows are sampled together, vectorised,
with the sampler's own generator (``Sampler(seed=...)``) or torch's global one.

Devices: the logits may be on a GPU. The batch's tensors follow them (``SamplingBatchInfo.to``) and every
step above runs there; only the uniform draws come from the host generators, one number per sampled row,
copied to the device. So a seed draws the same numbers on every device, and the same seed gives the same
tokens on the same device.

Logprobs are ``log_softmax`` of the *raw* logits (before penalties and temperature), at the chosen
token and, per request, for its ``top_logprobs_nums[i]`` most likely tokens (0 = none).

Ties: top-k / top-p / min-p are applied as a probability threshold per row, so tokens whose
probability exactly equals the threshold are all kept (the allowed set may exceed k on exact ties).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from common.layers import native
from common.protocol import SamplingParams

# temperatures below this are treated as greedy (dividing by them would overflow)
_GREEDY_EPS = 1e-6
# first window for top-p: the cut-off of most LLM distributions lies within the top few hundred
# tokens, which a partial topk finds much faster than a full sort of the vocabulary
_TOP_P_WINDOW = 256
_TOP_P_WIDE = 4096  # second try, before a full sort


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator for one request's draws (seeds of any size or sign are folded to 64 bits)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) % (1 << 64))
    return g


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_EPS or params.top_k == 1


def skip_draws(generator: torch.Generator | None, params: SamplingParams, n: int) -> None:
    """Advance a seeded request's generator past `n` tokens sampled elsewhere (a decode node
    continuing from the prefill node's first token), so its later draws are the ones it would
    have made in one engine: the sampler takes exactly one uniform per sampled, non-greedy token."""
    if generator is not None and not is_greedy(params):
        for _ in range(n):
            torch.rand(1, 1, generator=generator)


@dataclass
class SamplingBatchInfo:
    """Per-batch sampling state, rebuilt by the scheduler before each sampling step."""

    vocab_size: int
    temperatures: torch.Tensor  # [B, 1] float32 (1.0 on greedy rows)
    top_ks: torch.Tensor  # [B] int64, vocab_size when disabled
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    generators: list[torch.Generator | None]
    # penalties as sparse (row, token) pairs, None when no request in the batch uses them:
    # frequency/presence: logits[row, token] -= delta (= freq * count in output + presence)
    fp_rows: torch.Tensor | None
    fp_cols: torch.Tensor | None
    fp_delta: torch.Tensor | None
    # repetition: every distinct token of prompt + output, with its request's penalty
    rep_rows: torch.Tensor | None
    rep_cols: torch.Tensor | None
    rep_vals: torch.Tensor | None
    # (row, token) pairs masked to -inf because min_new_tokens is not reached yet
    min_tokens_rows: torch.Tensor | None
    min_tokens_cols: torch.Tensor | None
    # logit_bias: logits[row, token] += value
    bias_rows: torch.Tensor | None = None
    bias_cols: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    def to(self, device: torch.device) -> SamplingBatchInfo:
        """The same batch with its tensors on `device` (the logits' device); the generators stay on the
        host."""
        if device.type == "cpu":
            return self
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return SamplingBatchInfo(**moved)

    @property
    def has_penalties(self) -> bool:
        return (self.fp_rows is not None or self.rep_rows is not None or self.min_tokens_rows is not None
                or self.bias_rows is not None)

    @classmethod
    def build(cls, params: list[SamplingParams], output_ids: list[list[int]], vocab_size: int,
              generators: list[torch.Generator | None], eos_token_ids: list[int],
              prompt_ids: list[list[int]] | None = None) -> SamplingBatchInfo:
        """`params[i]`, `output_ids[i]` (tokens generated so far), `generators[i]` (None: unseeded)
        and, optionally, `prompt_ids[i]` for request i of the batch."""
        b = len(params)
        if not (len(output_ids) == len(generators) == b) or (prompt_ids is not None and len(prompt_ids) != b):
            raise ValueError("params, output_ids, generators (and prompt_ids) must have one entry "
                             "per request")
        temps, top_ks, top_ps, min_ps, greedy = [], [], [], [], []
        for p in params:
            g = is_greedy(p)
            greedy.append(g)
            temps.append(1.0 if g else float(p.temperature))
            top_ks.append(vocab_size if p.top_k < 1 or p.top_k > vocab_size else int(p.top_k))
            top_ps.append(float(p.top_p))
            min_ps.append(float(p.min_p))
        sampled = [not g for g in greedy]

        freq = [float(p.frequency_penalty) for p in params]
        pres = [float(p.presence_penalty) for p in params]
        rep = [float(p.repetition_penalty) for p in params]
        use_fp = any(f != 0.0 or q != 0.0 for f, q in zip(freq, pres, strict=True))
        use_rep = any(r != 1.0 for r in rep)

        # penalties are kept sparse: (row, token) pairs, as outputs touch few distinct tokens
        fp_rows = fp_cols = fp_delta = rep_rows = rep_cols = rep_vals = None
        if use_fp or use_rep:
            rows, cols = _flatten(output_ids, vocab_size)
            if use_fp:
                keys, counts = torch.unique(rows * vocab_size + cols, return_counts=True)
                fp_rows, fp_cols = keys // vocab_size, keys % vocab_size
                f = torch.tensor(freq, dtype=torch.float32)[fp_rows]
                q = torch.tensor(pres, dtype=torch.float32)[fp_rows]
                fp_delta = f * counts.float() + q
            if use_rep:
                if prompt_ids is not None:
                    prow, pcol = _flatten(prompt_ids, vocab_size)
                    rows, cols = torch.cat([rows, prow]), torch.cat([cols, pcol])
                keys = torch.unique(rows * vocab_size + cols)
                rep_rows, rep_cols = keys // vocab_size, keys % vocab_size
                rep_vals = torch.tensor(rep, dtype=torch.float32)[rep_rows]

        # min_new_tokens: EOS and the request's stop ids are forbidden until it has enough tokens
        mt_rows: list[int] = []
        mt_cols: list[int] = []
        for i, p in enumerate(params):
            if p.min_new_tokens > 0 and len(output_ids[i]) < p.min_new_tokens:
                banned = set(eos_token_ids) | set(p.stop_token_ids or ())
                for t in sorted(banned):
                    if 0 <= t < vocab_size:
                        mt_rows.append(i)
                        mt_cols.append(t)

        b_rows: list[int] = []
        b_cols: list[int] = []
        b_vals: list[float] = []
        for i, p in enumerate(params):
            for t, v in p.logit_bias_items() if p.logit_bias else ():
                if 0 <= t < vocab_size:
                    b_rows.append(i)
                    b_cols.append(t)
                    b_vals.append(v)

        def col(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).view(-1, 1)

        return cls(
            vocab_size=vocab_size,
            temperatures=col(temps),
            top_ks=torch.tensor(top_ks, dtype=torch.int64),
            top_ps=torch.tensor(top_ps, dtype=torch.float32),
            min_ps=torch.tensor(min_ps, dtype=torch.float32),
            is_greedy=torch.tensor(greedy, dtype=torch.bool),
            all_greedy=all(greedy),
            need_top_k=any(s and k < vocab_size for s, k in zip(sampled, top_ks, strict=True)),
            need_top_p=any(s and tp < 1.0 for s, tp in zip(sampled, top_ps, strict=True)),
            need_min_p=any(s and mp > 0.0 for s, mp in zip(sampled, min_ps, strict=True)),
            generators=list(generators),
            fp_rows=fp_rows, fp_cols=fp_cols, fp_delta=fp_delta,
            rep_rows=rep_rows, rep_cols=rep_cols, rep_vals=rep_vals,
            min_tokens_rows=torch.tensor(mt_rows, dtype=torch.int64) if mt_rows else None,
            min_tokens_cols=torch.tensor(mt_cols, dtype=torch.int64) if mt_rows else None,
            bias_rows=torch.tensor(b_rows, dtype=torch.int64) if b_rows else None,
            bias_cols=torch.tensor(b_cols, dtype=torch.int64) if b_rows else None,
            bias_vals=torch.tensor(b_vals, dtype=torch.float32) if b_rows else None,
        )


def _flatten(ids: list[list[int]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors for every token of every request (ids outside the vocab dropped)."""
    rows = torch.repeat_interleave(torch.arange(len(ids)),
                                   torch.tensor([len(x) for x in ids], dtype=torch.int64))
    cols = torch.tensor([t for x in ids for t in x], dtype=torch.int64)
    ok = (cols >= 0) & (cols < vocab_size)
    return rows[ok], cols[ok]


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    # [B] float32: log_softmax of the raw logits at the chosen token; None when not asked for
    logprobs: torch.Tensor | None
    # per request, (logprob, token id) best first, len == top_logprobs_nums[i]; None when not asked
    top_logprobs: list[list[tuple[float, int]]] | None


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Logit bias, repetition penalty, then frequency/presence penalties, then the min_new_tokens mask;
    in place."""
    if info.bias_rows is not None:
        logits.index_put_((info.bias_rows, info.bias_cols), info.bias_vals, accumulate=True)
    if info.rep_rows is not None:
        idx = (info.rep_rows, info.rep_cols)
        v = logits[idx]
        logits[idx] = torch.where(v > 0, v / info.rep_vals, v * info.rep_vals)
    if info.fp_rows is not None:
        logits.index_put_((info.fp_rows, info.fp_cols), -info.fp_delta, accumulate=True)
    if info.min_tokens_rows is not None:
        logits[info.min_tokens_rows, info.min_tokens_cols] = float("-inf")
    return logits


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p and min-p exclude (no renormalisation needed).

    `probs` holds the rows `rows` of the batch (all rows when None). Every filter is reduced to a
    per-row probability threshold, so rows without a filter cost one comparison."""
    top_ks = info.top_ks if rows is None else info.top_ks[rows]
    top_ps = info.top_ps if rows is None else info.top_ps[rows]
    min_ps = info.min_ps if rows is None else info.min_ps[rows]
    n, vocab = probs.shape
    thresh = torch.zeros(n, dtype=probs.dtype, device=probs.device)
    need_k = bool((top_ks < vocab).any())
    need_p = bool((top_ps < 1.0).any())
    if need_k or need_p:
        # sorted head of each row: wide enough for every top-k; for top-p, widened to the full
        # vocabulary only when some row's cut-off lies beyond the first window
        k_max = int(top_ks[top_ks < vocab].max()) if need_k else 1
        width = min(vocab, max(k_max, _TOP_P_WINDOW if need_p else 1))
        while True:
            if width >= vocab:  # a full sort costs ~20x a topk of 256 on CPU: the last resort
                head, _ = torch.sort(probs, dim=-1, descending=True)
            else:
                head, _ = torch.topk(probs, width, dim=-1, sorted=True)
            csum = head.cumsum(dim=-1)
            # top-k: keep the first k (threshold = k-th value)
            k_eff = top_ks.clamp(max=width)
            k_thresh = head.gather(1, (k_eff - 1).view(-1, 1)).squeeze(1)
            if not need_p:
                thresh = torch.where(top_ks < vocab, k_thresh, thresh)
                break
            # top-p over the distribution renormalised after top-k: keep sorted position j while the
            # mass strictly before j is below top_p * (mass kept by top-k)
            k_mass = csum.gather(1, (k_eff - 1).view(-1, 1)).squeeze(1)
            has_k = top_ks < vocab
            total = torch.where(has_k, k_mass, torch.ones_like(k_mass))
            limit = top_ps * total
            before = csum - head
            pos = torch.arange(width, device=probs.device).view(1, -1)
            keep = (before < limit.view(-1, 1)) & (pos < k_eff.view(-1, 1))
            # is the window enough? rows with top-p and no top-k need the window to reach the limit
            short = (top_ps < 1.0) & ~has_k & (csum[:, -1] < limit)
            if width < vocab and bool(short.any()):
                width = vocab if width >= _TOP_P_WIDE else min(vocab, _TOP_P_WIDE)
                continue
            n_keep = keep.sum(dim=-1).clamp(min=1)
            p_thresh = head.gather(1, (n_keep - 1).view(-1, 1)).squeeze(1)
            thresh = torch.where(has_k, k_thresh, thresh)
            thresh = torch.where(top_ps < 1.0, torch.maximum(thresh, p_thresh), thresh)
            break
    if bool((min_ps > 0).any()):
        p_max = probs.max(dim=-1).values
        thresh = torch.maximum(thresh, p_max * min_ps)
    if bool((thresh > 0).any()):
        probs = probs.masked_fill(probs < thresh.view(-1, 1), 0.0)
    return probs


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i picks the first token whose cumulative (unnormalised) probability
    exceeds u[i] * total. Zero-probability tokens can never be picked. (torch.multinomial is ~20x
    slower on CPU for one draw over a large vocabulary.)"""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # keep the target strictly below the total, so the last positive token is always reachable
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """`[n, 1]` uniform draws from a host generator, on `device`: a request's draws are the same numbers on
    every device, so its seed gives the same tokens wherever its logits are (and `skip_draws` stays exact)."""
    u = torch.rand(n, 1, generator=generator)
    return u if device.type == "cpu" else u.to(device, non_blocking=True)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise `torch.argmax(logits, dim=-1)` (first maximum; a NaN wins), through the native kernel
    for float32 rows: torch's runs one thread, ~0.5 ms on a batch of 16 x 49152 here."""
    kernel = native.argmax_rows()
    if kernel is None or not native.cpu_tensors(logits) or logits.dtype != torch.float32 \
            or logits.dim() != 2 or logits.stride(1) != 1:
        return torch.argmax(logits, dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


class Sampler:
    """`Sampler()(logits, info, top_logprobs_nums) -> SampleOutput`; see the module docstring."""

    def __init__(self, seed: int | None = None) -> None:
        # generator for unseeded requests; None: torch's global generator
        self.generator = make_generator(seed) if seed is not None else None

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo,
                 top_logprobs_nums: list[int] | None = None,
                 return_logprob: bool | None = None) -> SampleOutput:
        """`logits` [B, vocab] float. Logprobs are computed when `return_logprob` is true (default:
        when `top_logprobs_nums` is given); `top_logprobs` when `top_logprobs_nums` has a non-zero entry."""
        if logits.dim() != 2 or logits.shape[0] != info.batch_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match a batch of {info.batch_size}")
        if return_logprob is None:
            return_logprob = top_logprobs_nums is not None
        want_top = top_logprobs_nums is not None and any(n > 0 for n in top_logprobs_nums)
        raw = logits.float()

        if info.all_greedy and not info.has_penalties and not return_logprob and not want_top:
            return SampleOutput(argmax(raw), None, None)

        x = apply_penalties(raw.clone(), info) if info.has_penalties else raw
        if info.all_greedy:
            next_ids = argmax(x)
        else:
            next_ids = self._sample(x, info)

        logprobs = top = None
        if return_logprob or want_top:
            logp = torch.log_softmax(raw, dim=-1)
            logprobs = logp.gather(1, next_ids.view(-1, 1)).squeeze(1)
            if want_top:
                top = self._top_logprobs(logp, top_logprobs_nums)
        return SampleOutput(next_ids, logprobs, top)

    def _sample(self, x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        greedy = info.is_greedy.tolist()
        seeded = [i for i, g in enumerate(info.generators) if g is not None and not greedy[i]]
        seeded_set = set(seeded)
        free = [i for i in range(info.batch_size) if not greedy[i] and i not in seeded_set]
        filtering = info.need_top_k or info.need_top_p or info.need_min_p
        if any(greedy):
            next_ids = argmax(x)  # final for the greedy rows
        else:
            next_ids = torch.empty(info.batch_size, dtype=torch.int64, device=x.device)
        if free:
            whole = len(free) == info.batch_size
            rows = None if whole else torch.tensor(free, dtype=torch.int64, device=x.device)
            sub = x if whole else x[rows]
            temps = info.temperatures if whole else info.temperatures[rows]
            probs = torch.softmax(sub / temps, dim=-1)
            if filtering:
                probs = filter_probs(probs, info, rows)
            draws = _draw(probs, _uniforms(len(free), self.generator, x.device))
            if whole:
                next_ids = draws
            else:
                next_ids[rows] = draws
        for i in seeded:
            # one row at a time, from this row's data only: batch composition cannot change the draw
            row = torch.tensor([i], dtype=torch.int64, device=x.device)
            probs = torch.softmax(x[row] / info.temperatures[row], dim=-1)
            if filtering:
                probs = filter_probs(probs, info, row)
            next_ids[i] = _draw(probs, _uniforms(1, info.generators[i], x.device))[0]
        return next_ids

    @staticmethod
    def _top_logprobs(logp: torch.Tensor, nums: list[int]) -> list[list[tuple[float, int]]]:
        if len(nums) != logp.shape[0]:
            raise ValueError("top_logprobs_nums needs one entry per request")
        k = min(max(nums), logp.shape[1])
        vals, idx = torch.topk(logp, k, dim=-1, sorted=True)
        vals, idx = vals.tolist(), idx.tolist()
        return [list(zip(vals[i][: min(n, k)], idx[i][: min(n, k)], strict=True)) if n > 0 else []
                for i, n in enumerate(nums)]
