"""EAGLE / MTP speculation: the checkpoint's draft layers run around every target forward (one TP rank).

A request carries its next draft `draft_token` (d1) and the head's hidden state `draft_hidden` (g) at
its last position. Two calls per forward, both from `ModelRunner.run`:

* `follow(batch, out)`, after the target forward and sampling: the draft layer runs over the same
  positions and KV slots as the forward (its `ForwardBatch` reused, attention metadata and all), fed
  with each position's *next* token and the target's hidden state there, so the draft layer's KV keeps
  pace with the target's. The row at each request's last kept position gives its new d1 and g
  (greedy over the draft logits; not for a request backing off from drafting, `Drafter`). Extend: the next
  token is the following prompt token, at the end
  the sampled one. Decode: the sampled token. Verify: the target tokens t_0..t_k; only the rows up to
  the accepted run matter (the rest are rolled back with their slots).
* `chain(batch)`, before a verify forward: the scheduler placed [x_L, d1, ?, ...] at positions L.. and
  reserved their slots (`ScheduleBatch.prepare_for_verify`); step j runs the draft layer at position
  L + j - 1 on d_j and the previous g and writes d_(j+1) into the batch and the drafts. Its KV at those
  positions is overwritten by `follow` for the kept ones.

Which tokens are drafted changes only how many the target confirms, never which: greedy output equals
decoding without speculation (common/scheduler/speculative.py keeps the run the target agrees with).
A prefill node runs `follow` on the prompt and sends d1 and g with the first token (`MetadataBuffers`
`topk_index`, `topk_p`, `hidden_states`); the decode node starts its first verify from them.
"""

from __future__ import annotations

import dataclasses

import torch

from common.forward_batch import ForwardBatch, ForwardMode
from common.scheduler.speculative import accepted_run


class DraftLayers:
    def __init__(self, model) -> None:
        self.model = model
        self.head = model.mtp

    @staticmethod
    def prepare(fb: ForwardBatch) -> None:
        fb.extras["keep_hidden"] = True  # final_logits keeps every row's hidden state for `follow`

    def _draft(self, g: torch.Tensor) -> list[int]:
        return self.head.logits(self.model, g).argmax(dim=-1).tolist()

    @torch.inference_mode()
    def chain(self, batch) -> None:
        fb, drafts = batch.forward_batch, batch.drafts
        starts = _starts(fb.extend_seq_lens)
        hidden = {i: r.draft_hidden for i, (r, d) in enumerate(zip(batch.reqs, drafts, strict=True)) if d}
        for j in range(1, max(len(d) for d in drafts)):
            idx = [i for i, d in enumerate(drafts) if len(d) > j]
            if not idx:
                break
            rows = torch.tensor([starts[i] + j - 1 for i in idx], dtype=torch.int64)
            pre = [fb.extend_prefix_lens[i] + j - 1 for i in idx]
            step = ForwardBatch(ForwardMode.DECODE,
                                torch.tensor([drafts[i][j - 1] for i in idx], dtype=torch.int64),
                                fb.positions[rows], fb.out_cache_loc[rows], fb.req_pool_indices[idx],
                                [p + 1 for p in pre], pre, [1] * len(idx), fb.kv_pool, fb.req_to_token)
            g = self.head(self.model, step, torch.stack([hidden[i] for i in idx]))
            for n, (i, tok) in enumerate(zip(idx, self._draft(g), strict=True)):
                drafts[i][j] = tok
                fb.input_ids[starts[i] + j + 1] = tok
                hidden[i] = g[n]

    @torch.inference_mode()
    def follow(self, batch, out) -> None:
        fb = batch.forward_batch
        hidden = fb.extras.pop("hidden", None)
        if hidden is None:
            return
        reqs, starts = batch.reqs, _starts(fb.extend_seq_lens)
        nxt: list[int] = []
        picks: list[tuple[int, int]] = []  # (request, row whose draft it keeps)
        for i, (r, n, p) in enumerate(zip(reqs, fb.extend_seq_lens, fb.extend_prefix_lens, strict=True)):
            tok = out.next_token_ids[i]
            if fb.mode == ForwardMode.VERIFY:
                nxt.extend(tok)
                row = starts[i] + accepted_run(batch.drafts[i], tok)
            else:
                following = [] if fb.mode == ForwardMode.DECODE else r.fill_ids[p + 1:p + n + 1]
                if len(following) < n:  # the last position's next token: the sampled one
                    following.append(tok if tok is not None else r.fill_ids[p + n - 1])
                nxt.extend(following)
                row = None if tok is None else starts[i] + n - 1
            if row is not None and r.draft_skip == 0:  # a request backing off drafts nothing next step
                picks.append((i, row))
            else:
                r.draft_token = None
        g = self.head(self.model, dataclasses.replace(fb, input_ids=torch.tensor(nxt, dtype=torch.int64),
                                                      extras={}), hidden)
        if not picks:
            return
        rows = torch.tensor([row for _, row in picks], dtype=torch.int64)
        kept = g[rows]
        for (i, _), tok, h in zip(picks, self._draft(kept), kept, strict=True):
            reqs[i].draft_token, reqs[i].draft_hidden = tok, h.clone()


def _starts(lens: list[int]) -> list[int]:
    out, s = [], 0
    for n in lens:
        out.append(s)
        s += n
    return out
