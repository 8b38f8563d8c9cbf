"""Pure tensor sampling: temperature, min-p, top-k, top-p and per-request seeded draws.

The same `logits_to_probs` is applied to target and draft logits, so the draft
distribution a token was drawn from is exactly the one verification compares
against (lossless rejection sampling depends on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dspark.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dspark.engine.request import Request


@dataclass
class SamplingTensors:
    """Sampling parameters of R requests as tensors (one row each)."""

    temperature: torch.Tensor  # [R] float32, 0 for greedy rows
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] float32, 1 = off
    min_p: torch.Tensor  # [R] float32, 0 = off
    generators: Sequence[torch.Generator | None]  # per row; None draws from the global RNG
    # Every row greedy, known on the host (asking the device would sync every draft position);
    # False only costs the full sampling path.
    all_greedy: bool = False

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            generators=list(generators) if generators is not None else [None] * len(params),
            all_greedy=all(p.greedy for p in params),
        )

    @classmethod
    def for_requests(
        cls, requests: Sequence[Request], device: torch.device | str, drafting: bool = False
    ) -> SamplingTensors:
        """The requests' parameters and generators. A request that does not speculate keeps its
        generator out of drafting (its drafts are never verified), so its seeded output is its
        plain one.

        The last batch's tensors are reused while the same requests step together (a request's
        parameters and generator never change), saving four host-to-device copies a step."""
        key = (str(device), drafting)
        batch = tuple(requests)
        cached = _RECENT.get(key)
        if cached is not None and cached[0] == batch:  # Request compares by identity
            return cached[1]
        generators = [None if drafting and r.params.max_draft_tokens == 0 else r.generator for r in requests]
        tensors = cls.from_params([r.params for r in requests], generators, device)
        _RECENT[key] = (batch, tensors)
        return tensors

    def __len__(self) -> int:
        return self.temperature.shape[0]

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0

    def select(self, rows: Sequence[int]) -> SamplingTensors:
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.temperature.device)
        return SamplingTensors(
            self.temperature[idx],
            self.top_k[idx],
            self.top_p[idx],
            self.min_p[idx],
            [self.generators[i] for i in rows],
            all_greedy=self.all_greedy,
        )


# (device, drafting) -> the last batch of requests and its tensors; consumers never modify them.
_RECENT: dict[tuple[str, bool], tuple[tuple[Request, ...], SamplingTensors]] = {}


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The argmax over the last axis. `max(-1).indices` is the same first maximal index, and on the
    CPU 3-5x faster (16 x 49,152 bf16 logits: 0.30 against 1.42 ms on an AMX Xeon)."""
    return x.max(-1).indices


def logits_to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Logits [R, ..., V] -> float32 probabilities after temperature, min-p, top-k and top-p (vLLM's order).

    Greedy rows become one-hot at the argmax, so verification of greedy requests reduces to
    "accept while the draft token equals the target argmax".
    """
    shape = logits.shape
    x = logits.float().reshape(shape[0], -1, shape[-1])
    greedy = st.greedy
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    x = x / temp[:, None, None]

    m = torch.where(greedy, 0.0, st.min_p)
    if bool((m > 0).any()):
        x = _apply_min_p(x, m)
    k = torch.where(greedy, 0, st.top_k)
    if bool((k > 0).any()):
        x = _apply_top_k(x, k)
    p = torch.where(greedy, 1.0, st.top_p)
    if bool((p < 1).any()):
        x = _apply_top_p(x, p)
    probs = torch.softmax(x, dim=-1)

    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, row_argmax(x)[..., None], 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs.reshape(shape)


def draw(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens from logits [R, ..., V] and the distributions they were drawn from, [R, ..., V].

    When every row is greedy the distributions are one-hot at the argmax and come back as None
    (the `DraftBlock` convention): the softmax, one-hot and CDF over the vocabulary would cost
    more than the draft head's matmul, and greedy verification never reads them.
    """
    if st.all_greedy:
        return row_argmax(logits), None
    probs = logits_to_probs(logits, st)
    return sample(probs, st.generators), probs


def _apply_min_p(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(x, dim=-1)
    threshold = m[:, None, None] * probs.amax(-1, keepdim=True)
    return x.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    vocab = x.shape[-1]
    k = torch.where(k > 0, k.clamp(max=vocab), vocab)
    top = torch.topk(x, int(k.max()), dim=-1).values  # [R, N, kmax]
    kth = top.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))
    return x.masked_fill(x < kth, float("-inf"))


def _apply_top_p(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= p[:, None, None]
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def random_rows(
    shape: Sequence[int],
    generators: Sequence[torch.Generator | None],
    device: torch.device,
    kind: str,
    used: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Random tensor [R, ...]: rows with a generator draw from it, the rest from the global RNG.

    Rows marked unused (their values are never read) leave their generator untouched, so a seeded
    request consumes the same draws whether or not its neighbours need these."""
    out = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    draw = (
        (lambda t, g=None: t.exponential_(generator=g))
        if kind == "exponential"
        else (lambda t, g=None: t.uniform_(generator=g))
    )
    draw(out)
    for i, g in enumerate(generators):
        if g is not None and (used is None or used[i]):
            draw(out[i], g)
    return out


# The CDF is searched in two levels: sums of blocks of this many tokens (float32 within a block, as
# the probabilities themselves, float64 across blocks), then a float64 cumulative sum inside the one
# block the draw falls in. A float64 cumulative sum over the whole vocabulary was about 15% of a
# batch-128 sampled decode step on the CPU, twenty times these sums.
CDF_BLOCK = 256


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per distribution from probs [R, ..., V] by inverting the CDF (no CPU sync).

    One uniform per distribution instead of V exponentials: with per-request generators the
    exponential race cost a vocabulary-sized draw per row and dominated batched decode steps.
    """
    u = random_rows(probs.shape[:-1], generators, probs.device, "uniform")
    flat = probs.reshape(-1, probs.shape[-1])
    return invert_cdf(flat, u.reshape(-1).double()).reshape(probs.shape[:-1])


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of probs [N, V] (unnormalised mass), the first token whose cumulative mass exceeds
    u [N] (float64 in [0, 1)) times the row's total: zero-mass tokens are never chosen."""
    n, vocab = probs.shape
    blocks = -(-vocab // CDF_BLOCK)
    if blocks * CDF_BLOCK != vocab:
        probs = torch.nn.functional.pad(probs, (0, blocks * CDF_BLOCK - vocab))
    by_block = probs.view(n, blocks, CDF_BLOCK)
    block_cdf = by_block.sum(-1).double().cumsum(-1)  # [N, blocks]
    total = block_cdf[:, -1:]
    target = u[:, None] * total
    # The first block whose cumulative mass exceeds the target, at most the last one with mass.
    block = torch.minimum(
        torch.searchsorted(block_cdf, target, right=True), (block_cdf < total).sum(-1, keepdim=True)
    )
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = by_block.gather(1, block[:, :, None].expand(-1, -1, CDF_BLOCK)).squeeze(1).double().cumsum(-1)
    token = torch.minimum(
        torch.searchsorted(inner, target - before, right=True),
        (inner < inner[:, -1:]).sum(-1, keepdim=True),  # rounding must not step past the block's mass
    )
    return (block * CDF_BLOCK + token).squeeze(1).clamp_(max=vocab - 1)
