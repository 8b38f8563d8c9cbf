"""DSpark's sequential heads (the prefix-dependent bias B_k) and the confidence head.

All heads share the Markov embedding W1 (`markov_w1`, V x r) of the previous block token
x_{k-1} (the anchor for k = 1) and the projection W2 (`markov_w2`, r -> V); a step returns the
rank-r vector z_k with B_k = W2 z_k, so drafting can project onto a reduced vocabulary (rows of W2).
With `rows` (the project's own drafters) W1 and W2 cover only the Vd tokens of the drafting
vocabulary: W1 gets one more, zero row for anchors outside it (`t2d` maps target ids to rows), so a
rank-r head costs 2 Vd r weights instead of 2 V r.
- vanilla: B_k = W2 W1[x_{k-1}]
- gated:   B_k = W2 (sigmoid(W_gate [h_k ; W1[x_{k-1}]]) * W1[x_{k-1}])
- rnn:     z = [s_{k-1} ; W1[x_{k-1}] ; h_k]; g, c, o = W_joint z;
           s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c); B_k = W2 tanh(o); s_0 = 0
The confidence head is c_k = sigmoid(w^T [h_k ; W1[x_{k-1}]]) (or w^T h_k without the Markov input).
"""

from __future__ import annotations

import torch
from torch import nn

HEAD_TYPES = ("vanilla", "gated", "rnn")


class SequentialHead(nn.Module):
    """Step interface: `step(h_k, prev_token, state) -> (z_k, markov_embedding, state)`, B_k = W2 z_k."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, rows: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size if rows is None else rows + 1, rank, padding_idx=rows)
        self.markov_w2 = nn.Linear(rank, vocab_size if rows is None else rows, bias=False)
        if rows is None:
            self.t2d = None
        else:
            self.register_buffer("t2d", torch.full((vocab_size,), rows, dtype=torch.long))

    def set_rows(self, token_ids: torch.Tensor) -> None:
        """Map the sorted target ids `token_ids` to rows 0..Vd-1, every other id to the zero row."""
        self.t2d.fill_(self.markov_w2.out_features)
        self.t2d[token_ids.to(self.t2d.device)] = torch.arange(token_ids.numel(), device=self.t2d.device)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}] for target ids `prev`."""
        return self.markov_w1(prev if self.t2d is None else self.t2d[prev])

    def initial_state(self, h: torch.Tensor) -> torch.Tensor | None:
        return None

    def step(
        self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def teacher_forced(self, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Biases [B, G, V] and Markov embeddings [B, G, r] for a whole block given its previous tokens
        prev [B, G] (anchor, x_1, ..., x_{G-1}); used for training and reference checks."""
        state = self.initial_state(h[:, 0])
        zs, embs = [], []
        for k in range(h.shape[1]):
            z, emb, state = self.step(h[:, k], prev[:, k], state)
            zs.append(z)
            embs.append(emb)
        return self.markov_w2(torch.stack(zs, 1)), torch.stack(embs, 1)


class MarkovHead(SequentialHead):
    def step(self, h, prev, state):
        emb = self.embed(prev)
        return emb, emb, None

    def teacher_forced(self, h, prev):
        emb = self.embed(prev)  # no recurrence: the whole block at once
        return self.markov_w2(emb), emb


class GatedMarkovHead(SequentialHead):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, rows: int | None = None) -> None:
        super().__init__(hidden_size, vocab_size, rank, rows)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, h, prev, state):
        emb = self.embed(prev)
        gate = torch.sigmoid(self.gate_proj(torch.cat([h, emb], dim=-1)))
        return gate * emb, emb, None

    def teacher_forced(self, h, prev):
        emb = self.embed(prev)
        gate = torch.sigmoid(self.gate_proj(torch.cat([h, emb], dim=-1)))
        return self.markov_w2(gate * emb), emb


class RNNHead(SequentialHead):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, rows: int | None = None) -> None:
        super().__init__(hidden_size, vocab_size, rank, rows)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, h):
        return h.new_zeros(*h.shape[:-1], self.rank)

    def step(self, h, prev, state):
        emb = self.embed(prev)
        gate, cand, out = self.joint_proj(torch.cat([state, emb, h], dim=-1)).chunk(3, dim=-1)
        keep = torch.sigmoid(gate)
        state = keep * state + (1 - keep) * torch.tanh(cand)
        return torch.tanh(out), emb, state


def make_sequential_head(
    kind: str, hidden_size: int, vocab_size: int, rank: int, rows: int | None = None
) -> SequentialHead:
    heads = {"vanilla": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}
    if kind not in heads:
        raise ValueError(f"unknown markov_head_type {kind!r}; expected one of {HEAD_TYPES}")
    return heads[kind](hidden_size, vocab_size, rank, rows)


class ConfidenceHead(nn.Module):
    """Pre-sigmoid confidence logit of position k from [h_k ; W1[x_{k-1}]] (or h_k alone)."""

    def __init__(self, hidden_size: int, markov_rank: int = 0) -> None:
        super().__init__()
        self.with_markov = markov_rank > 0
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, h: torch.Tensor, markov_emb: torch.Tensor | None) -> torch.Tensor:
        x = torch.cat([h, markov_emb], dim=-1) if self.with_markov else h
        return self.proj(x).squeeze(-1)
