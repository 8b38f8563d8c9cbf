"""DSpark's sequential heads (the prefix-dependent bias B_k) and the confidence head.

All heads share the Markov embedding W1 (`markov_w1`, V x r) of the previous block token
x_{k-1} (the anchor for k = 1) and the projection W2 (`markov_w2`, r -> V); a step returns the
rank-r vector z_k with B_k = W2 z_k, so drafting can project onto a reduced vocabulary (rows of W2):
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

    def __init__(self, hidden_size: int, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

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
        emb = self.markov_w1(prev)
        return emb, emb, None

    def teacher_forced(self, h, prev):
        emb = self.markov_w1(prev)  # no recurrence: the whole block at once
        return self.markov_w2(emb), emb


class GatedMarkovHead(SequentialHead):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int) -> None:
        super().__init__(hidden_size, vocab_size, rank)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, h, prev, state):
        emb = self.markov_w1(prev)
        gate = torch.sigmoid(self.gate_proj(torch.cat([h, emb], dim=-1)))
        return gate * emb, emb, None

    def teacher_forced(self, h, prev):
        emb = self.markov_w1(prev)
        gate = torch.sigmoid(self.gate_proj(torch.cat([h, emb], dim=-1)))
        return self.markov_w2(gate * emb), emb


class RNNHead(SequentialHead):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int) -> None:
        super().__init__(hidden_size, vocab_size, rank)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, h):
        return h.new_zeros(*h.shape[:-1], self.rank)

    def step(self, h, prev, state):
        emb = self.markov_w1(prev)
        gate, cand, out = self.joint_proj(torch.cat([state, emb, h], dim=-1)).chunk(3, dim=-1)
        keep = torch.sigmoid(gate)
        state = keep * state + (1 - keep) * torch.tanh(cand)
        return torch.tanh(out), emb, state


def make_sequential_head(kind: str, hidden_size: int, vocab_size: int, rank: int) -> SequentialHead:
    heads = {"vanilla": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}
    if kind not in heads:
        raise ValueError(f"unknown markov_head_type {kind!r}; expected one of {HEAD_TYPES}")
    return heads[kind](hidden_size, vocab_size, rank)


class ConfidenceHead(nn.Module):
    """Pre-sigmoid confidence logit of position k from [h_k ; W1[x_{k-1}]] (or h_k alone)."""

    def __init__(self, hidden_size: int, markov_rank: int = 0) -> None:
        super().__init__()
        self.with_markov = markov_rank > 0
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, h: torch.Tensor, markov_emb: torch.Tensor | None) -> torch.Tensor:
        x = torch.cat([h, markov_emb], dim=-1) if self.with_markov else h
        return self.proj(x).squeeze(-1)
