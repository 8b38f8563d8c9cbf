"""Metadata of one ragged forward: which slot and positions each request's new tokens occupy."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Requests contribute `lengths[i]` new tokens at positions `starts[i]..` of KV slot `slots[i]`.

    Tokens are flattened request after request; `logit_rows` selects the flattened tokens whose
    logits are needed (the last token of a prefill chunk, every token of a verification).
    """

    slots: list[int]
    starts: list[int]
    lengths: list[int]
    offsets: list[int]  # start of each request in the flattened token axis (len = R + 1)
    positions: torch.Tensor  # [T] int64
    token_slots: torch.Tensor  # [T] int64
    logit_rows: torch.Tensor  # [N] int64
    masks: list[torch.Tensor | None]  # per request: bool [n, start + n] or None when not needed

    @classmethod
    def build(
        cls,
        slots: list[int],
        starts: list[int],
        lengths: list[int],
        logit_rows: list[int],
        device: torch.device,
    ) -> ForwardBatch:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
        token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lengths))
        masks: list[torch.Tensor | None] = []
        for s, n in zip(starts, lengths, strict=True):
            if n == 1:
                masks.append(None)  # a single query sees the whole cache
            else:
                keys = torch.arange(s + n, device=device)
                queries = torch.arange(s, s + n, device=device)
                masks.append(keys[None, :] <= queries[:, None])
        return cls(
            slots=slots,
            starts=starts,
            lengths=lengths,
            offsets=offsets,
            positions=positions.to(device),
            token_slots=token_slots.to(device),
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=device),
            masks=masks,
        )

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]
