"""Prompt lookup where the text repeats itself, a model drafter everywhere else: chosen per request
and step by which of the two is expected to get more tokens accepted."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dspark.drafters.ngram import MAX_NGRAM, longest_match
from dspark.engine.drafter import DraftBlock, Drafter, Holder
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors
from dspark.engine.verify_policy import survival_probabilities

MODEL_ROW = 0  # tally row of the model's own drafts; rows 1..max_ngram are lookups by match length


class AcceptanceTally:
    """Conditional acceptance per (row, position), counted from the tokens the target produced after
    each proposal, under a Beta(1, 1) prior.

    For a deterministic draft token x the event "the target's token at this position is x" has
    exactly x's acceptance probability p(x), whether or not the step verified it, so lookups are
    counted every step, used or not. For sampled model drafts that holds only where they were
    verified, so the tally under-counts them at temperature > 0 (models with a confidence head use
    their confidences instead)."""

    def __init__(self, rows: int, gamma: int) -> None:
        self.accepted = np.ones((rows, gamma))
        self.trials = np.full((rows, gamma), 2.0)

    def record(self, row: int, proposal: np.ndarray, produced: np.ndarray) -> None:
        n = min(len(proposal), len(produced))
        matched = int(np.argmin(np.append(proposal[:n] == produced[:n], False)))
        self.accepted[row, :matched] += 1
        self.trials[row, : matched + (matched < n)] += 1

    def rates(self, rows: int | np.ndarray) -> np.ndarray:
        return self.accepted[rows] / self.trials[rows]


def expected_accepted(rates: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Expected accepted tokens of drafts [N] verified to `lengths` under conditional rates [N, G]."""
    survival = survival_probabilities(rates)
    return np.where(np.arange(survival.shape[-1]) < lengths[:, None], survival, 0.0).sum(-1)


class LookupFirstDrafter(Drafter):
    """`ngram+<model>`: each step, a request whose trailing n-gram occurred before drafts its
    continuation when the tally expects that to be accepted further than the model's draft; the
    model drafts (one batched pass) for the rest. The choice depends only on what was produced
    before the step, never on this step's sampled draft, so each row's draft distribution is the
    one verification is given and decoding stays lossless."""

    def __init__(self, model: Drafter, max_ngram: int = MAX_NGRAM, ema: float = 0.05) -> None:
        self.model, self.max_ngram, self.ema = model, max_ngram, ema
        self.name = f"ngram+{model.name}"
        self.gamma = model.gamma
        self.target_layers = model.target_layers
        self.device = model.device
        self.gives_confidences = model.gives_confidences
        self.tally = AcceptanceTally(max_ngram + 1, self.gamma)
        self.model_confidence = np.full(self.gamma, 0.5)  # running mean of the model's c_k
        # request id -> [(tally row, index of the first drafted token, draft)] not yet scored
        self._open: dict[str, list[tuple[int, int, np.ndarray]]] = {}
        self.lookup_rows = self.model_rows = 0  # how often each drafted, for logs and tests

    def fresh_copy(self) -> LookupFirstDrafter:
        return LookupFirstDrafter(self.model.fresh_copy(), self.max_ngram, self.ema)

    def use_static_shapes(self, batch_buckets: tuple[int, ...], context_buckets: tuple[int, ...]) -> None:
        self.model.use_static_shapes(batch_buckets, context_buckets)

    def admit(self, request: Request) -> None:
        self.model.admit(request)

    def context_limit(self, slot: int) -> int | None:
        return self.model.context_limit(slot)

    def release(self, request: Request) -> None:
        self._open.pop(request.request_id, None)
        self.model.release(request)

    def stash(self, slot: int, key: Holder) -> None:
        self.model.stash(slot, key)

    def drop(self, key: Holder) -> None:
        self.model.drop(key)

    def commit(self, requests: Sequence[Request], features: Sequence[torch.Tensor | None]) -> None:
        self.model.commit(requests, features)

    def model_rates(self) -> np.ndarray:
        return self.model_confidence if self.gives_confidences else self.tally.rates(MODEL_ROW)

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        width = min(horizon or self.gamma, self.gamma)
        if not requests:
            return DraftBlock(torch.zeros((0, width), dtype=torch.int64, device=self.device), None)
        histories = [np.asarray(r.all_token_ids) for r in requests]
        self._score(requests, histories)
        matches = [longest_match(h, width, self.max_ngram) for h in histories]
        lookup_lengths = np.array([len(found) for _, found in matches])
        lookup_rates = self.tally.rates(np.array([n for n, _ in matches]))[:, :width]
        model_gain = expected_accepted(self.model_rates()[None, :width], np.array([width]))[0]
        use_lookup = (lookup_lengths > 0) & (expected_accepted(lookup_rates, lookup_lengths) > model_gain)
        for request, (n, found) in zip(requests, matches, strict=True):
            if n:  # scored whether used or not: a lookup's outcome is exact either way
                self._open[request.request_id] = [(n, request.num_tokens, found)]

        tokens = np.zeros((len(requests), width), dtype=np.int64)
        for i in np.flatnonzero(use_lookup):
            tokens[i, : lookup_lengths[i]] = matches[i][1]
        block = DraftBlock(
            tokens=torch.from_numpy(tokens).to(self.device),
            probs=None,
            confidences=self._lookup_confidences(lookup_rates, np.where(use_lookup, lookup_lengths, 0)),
            num_valid=torch.from_numpy(np.where(use_lookup, lookup_lengths, width)).to(self.device),
        )
        rows = np.flatnonzero(~use_lookup).tolist()
        self.lookup_rows += len(requests) - len(rows)
        self.model_rows += len(rows)
        if rows:
            self._merge(block, rows, [requests[i] for i in rows], sampling.select(rows), horizon)
        return block

    def _merge(
        self,
        block: DraftBlock,
        rows: list[int],
        requests: list[Request],
        sampling: SamplingTensors,
        horizon: int | None,
    ) -> None:
        """Draft `rows` with the model and write its block into theirs (one-hot distributions for
        the lookup rows once any model row was sampled)."""
        drafted = self.model.propose(requests, sampling, horizon)
        w = min(drafted.tokens.shape[1], block.tokens.shape[1])
        index = torch.tensor(rows, device=self.device)
        block.tokens[index, :w] = drafted.tokens[:, :w]
        block.num_valid[index] = (
            drafted.num_valid.clamp(max=w) if drafted.num_valid is not None else torch.full_like(index, w)
        )
        if drafted.confidences is not None and block.confidences is not None:
            conf = drafted.confidences[:, :w].float()
            block.confidences[index, :w] = conf
            mean = conf.mean(0).cpu().numpy()
            self.model_confidence[:w] += self.ema * (mean - self.model_confidence[:w])
        if not self.gives_confidences:
            for request, proposal in zip(requests, drafted.tokens[:, :w].cpu().numpy(), strict=True):
                entry = (MODEL_ROW, request.num_tokens, proposal)
                self._open.setdefault(request.request_id, []).append(entry)
        if drafted.probs is not None:
            probs = torch.zeros(
                (*block.tokens.shape, drafted.probs.shape[-1]), dtype=drafted.probs.dtype, device=self.device
            )
            probs.scatter_(-1, block.tokens[..., None], 1.0)
            probs[index, :w] = drafted.probs[:, :w]
            block.probs = probs

    def _lookup_confidences(self, rates: np.ndarray, lengths: np.ndarray) -> torch.Tensor | None:
        """The tally's rates as the lookup rows' confidences (0 past each lookup and on model rows)."""
        if not self.gives_confidences:
            return None
        conf = np.where(np.arange(rates.shape[1]) < lengths[:, None], rates, 0.0)
        return torch.from_numpy(conf).float().to(self.device)

    def _score(self, requests: Sequence[Request], histories: list[np.ndarray]) -> None:
        """Tally the open proposals against what the target produced since."""
        for request, history in zip(requests, histories, strict=True):
            for row, start, proposal in self._open.pop(request.request_id, ()):
                produced = history[start:]
                if len(produced):
                    self.tally.record(row, proposal, produced)
