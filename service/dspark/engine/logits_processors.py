"""Logits processors that change the target distribution: logit_bias, the repetition, frequency
and presence penalties (OpenAI / vLLM semantics) and min_tokens' mask of EOS and stop tokens,
batched over verification blocks.

Verification samples from the processed target distribution, so speculation stays lossless with
respect to it. Position k of a verification block follows the anchor and draft tokens 0..k-1; if
the block is accepted up to k those drafts are output tokens, so the penalties at position k count
them too, and min_tokens masks position k while fewer than min_tokens - k tokens exist. Draft proposals are not processed: rejection sampling corrects any draft distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.engine.request import Request


@dataclass
class LogitsProcessors:
    """The processing of the rows (of a batch) whose requests ask for any; None fields are off."""

    rows: torch.Tensor  # [P] indices of the processed rows in the batch
    all_rows: bool  # rows == arange(batch): no gather / scatter needed
    bias: torch.Tensor | None  # [P, V] added to the logits
    output_counts: torch.Tensor | None  # [P, V] how often each token was generated so far
    prompt_seen: torch.Tensor | None  # [P, V] bool, token occurs in the prompt
    repetition: torch.Tensor  # [P, 1, 1]
    frequency: torch.Tensor  # [P, 1, 1]
    presence: torch.Tensor  # [P, 1, 1]
    stops: torch.Tensor | None = None  # [P, V] bool, EOS and stop tokens that min_tokens holds back
    stops_left: torch.Tensor | None = None  # [P, 1] block positions they stay masked for (0 = none)

    @classmethod
    def build(cls, requests: Sequence[Request], vocab: int, device: torch.device) -> LogitsProcessors | None:
        """None when no request needs processing: all-default batches pay for this loop only."""
        rows = [i for i, r in enumerate(requests) if r.params.processes_logits or r.holds_stops]
        if not rows:
            return None
        params = [requests[i].params for i in rows]
        reqs = [requests[i] for i in rows]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None, None]

        bias = None
        if any(p.logit_bias for p in params):
            bias = torch.zeros((len(rows), vocab), dtype=torch.float32, device=device)
            for i, p in enumerate(params):
                for token, value in p.logit_bias.items():
                    if token < vocab:
                        bias[i, token] = value
        counts = seen = None
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
            counts = _token_counts([r.output_token_ids for r in reqs], vocab, device)
            if any(p.repetition_penalty != 1.0 for p in params):
                seen = _token_counts([r.prompt_token_ids for r in reqs], vocab, device) > 0
        stops = stops_left = None
        if any(r.holds_stops for r in reqs):
            stops = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)
            for i, r in enumerate(reqs):
                ids = [t for t in r.min_tokens_stops if t < vocab] if r.holds_stops else []
                stops[i, ids] = True
            left = [max(r.params.min_tokens - len(r.output_token_ids), 0) for r in reqs]
            stops_left = torch.tensor(left, dtype=torch.long, device=device)[:, None]
        return cls(
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            all_rows=len(rows) == len(requests),
            bias=bias,
            output_counts=counts,
            prompt_seen=seen,
            repetition=column([p.repetition_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
            stops=stops,
            stops_left=stops_left,
        )

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """Processed float32 logits [R, W + 1, V] (or [R, V]); position k counts drafts[:, :k] [R, W]
        as generated. Rows that ask for nothing come back unchanged."""
        squeeze = logits.dim() == 2
        x = logits.float()[:, None] if squeeze else logits.float()
        out = x if self.all_rows else x.clone()
        sub = x if self.all_rows else x[self.rows]
        if self.bias is not None:
            sub = sub + self.bias[:, None, :]
        if self.output_counts is not None:
            counts = self._counts_per_position(sub.shape[1], drafts)
            generated = counts > 0
            if self.prompt_seen is not None:
                seen = generated | self.prompt_seen[:, None, :]
                penalised = torch.where(sub > 0, sub / self.repetition, sub * self.repetition)
                sub = torch.where(seen, penalised, sub)
            sub = sub - self.frequency * counts - self.presence * generated.float()
        if self.stops is not None:  # position k follows k more tokens
            held = torch.arange(sub.shape[1], device=sub.device)[None, :] < self.stops_left  # [P, W + 1]
            sub = sub.masked_fill(held[:, :, None] & self.stops[:, None, :], float("-inf"))
        if self.all_rows:
            out = sub
        else:
            out[self.rows] = sub
        return out[:, 0] if squeeze else out

    def _counts_per_position(self, width: int, drafts: torch.Tensor | None) -> torch.Tensor:
        """[P, width, V]: output counts before each block position, the block's earlier drafts included."""
        base = self.output_counts[:, None, :]
        if width == 1 or drafts is None:
            return base.expand(-1, width, -1)
        d = drafts if self.all_rows else drafts[self.rows]
        d = d[:, : width - 1].clamp(0, base.shape[-1] - 1)  # past a row's verify length: never read
        w = d.shape[1]
        pos = torch.arange(width, device=d.device)
        precedes = (torch.arange(w, device=d.device)[None, :] < pos[:, None]).float()  # [width, w]
        counts = base.repeat(1, width, 1)
        counts.scatter_add_(-1, d[:, None, :].expand(-1, width, -1), precedes.expand(d.shape[0], -1, -1))
        return counts


def _token_counts(sequences: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(sequences), vocab] float32 occurrence counts (ids outside the vocabulary ignored)."""
    width = max((len(s) for s in sequences), default=0)
    counts = torch.zeros((len(sequences), vocab + 1), dtype=torch.float32, device=device)
    if width:
        # Padding lands in the extra column, cut off below.
        padded = torch.full((len(sequences), width), vocab, dtype=torch.long)
        for i, s in enumerate(sequences):
            if s:
                padded[i, : len(s)] = torch.tensor(s, dtype=torch.long).clamp(0, vocab)
        counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]
