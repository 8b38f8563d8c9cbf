"""Recorded speculative rounds: raw confidence logits and how much of each block the target accepted."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class RoundLog:
    """N verification rounds of one drafter (block size gamma).

    `conf_logits[n, k]` is the drafter's raw (uncalibrated) confidence logit of position k + 1, NaN
    when the drafter has no confidence head; `verified[n]` draft tokens were sent to the target and
    the first `accepted[n]` of them were accepted. `domain` / `request` label each round.
    """

    conf_logits: np.ndarray  # [N, gamma] float64
    accepted: np.ndarray  # [N] int
    verified: np.ndarray  # [N] int
    domain: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=str))  # [N] str
    request: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=str))  # [N] str

    def __post_init__(self) -> None:
        self.conf_logits = np.asarray(self.conf_logits, dtype=np.float64)
        if self.conf_logits.ndim != 2:
            raise ValueError(f"conf_logits must be [rounds, gamma], got shape {self.conf_logits.shape}")
        self.accepted = np.asarray(self.accepted, dtype=np.int64)
        self.verified = np.asarray(self.verified, dtype=np.int64)
        n = len(self.accepted)
        self.domain = np.asarray(self.domain if len(self.domain) else [""] * n, dtype=str)
        self.request = np.asarray(self.request if len(self.request) else [""] * n, dtype=str)
        if not (len(self.conf_logits) == len(self.verified) == len(self.domain) == len(self.request) == n):
            raise ValueError("round arrays differ in length")
        if np.any(self.accepted < 0) or np.any(self.accepted > self.verified):
            raise ValueError("accepted counts must lie in [0, verified]")
        if np.any(self.verified > self.gamma):
            raise ValueError(f"a round verified more than gamma = {self.gamma} tokens")

    @property
    def gamma(self) -> int:
        return self.conf_logits.shape[1]

    def __len__(self) -> int:
        return len(self.accepted)

    @property
    def has_confidences(self) -> bool:
        return len(self) > 0 and bool(np.all(np.isfinite(self.conf_logits)))

    def select(self, mask: np.ndarray) -> RoundLog:
        return RoundLog(
            self.conf_logits[mask],
            self.accepted[mask],
            self.verified[mask],
            self.domain[mask],
            self.request[mask],
        )

    def full_blocks(self) -> RoundLog:
        """Rounds that verified the whole block (the last round of a request may be cut by max_tokens)."""
        return self.select(self.verified == self.gamma)

    def survival(self) -> tuple[np.ndarray, np.ndarray]:
        """[N, gamma] prefix survival (positions 1..k all accepted) and whether it was observed: position
        k is known when it was verified, or when an earlier verified position was rejected."""
        k = np.arange(1, self.gamma + 1)[None, :]
        survived = self.accepted[:, None] >= k
        observed = (k <= self.verified[:, None]) | (self.accepted < self.verified)[:, None]
        return survived, observed

    @staticmethod
    def concat(logs: list[RoundLog]) -> RoundLog:
        if not logs:
            raise ValueError("no rounds to concatenate")
        if len({log.gamma for log in logs}) > 1:
            raise ValueError("cannot concatenate rounds of different block sizes")
        return RoundLog(
            np.concatenate([log.conf_logits for log in logs]),
            np.concatenate([log.accepted for log in logs]),
            np.concatenate([log.verified for log in logs]),
            np.concatenate([log.domain for log in logs]),
            np.concatenate([log.request for log in logs]),
        )

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            np.savez_compressed(
                f,
                conf_logits=self.conf_logits,
                accepted=self.accepted,
                verified=self.verified,
                domain=self.domain,
                request=self.request,
            )

    @classmethod
    def load(cls, path: str | Path) -> RoundLog:
        with np.load(path, allow_pickle=False) as data:
            return cls(*(data[k] for k in ("conf_logits", "accepted", "verified", "domain", "request")))


def cumulative_confidence(
    conf_logits: np.ndarray,
    temperatures: np.ndarray | list[float] | None = None,
    offsets: np.ndarray | list[float] | None = None,
) -> np.ndarray:
    """a_k = prod_{i<=k} c_i: the predicted probability that positions 1..k all survive."""
    return np.cumprod(confidences(conf_logits, temperatures, offsets), axis=1)


def confidences(
    conf_logits: np.ndarray,
    temperatures: np.ndarray | list[float] | None = None,
    offsets: np.ndarray | list[float] | None = None,
) -> np.ndarray:
    """Per-position c_k = sigmoid(logit_k / T_k + b_k); positions past the calibrated ones keep
    T = 1, b = 0."""
    logits = np.asarray(conf_logits, dtype=np.float64).copy()
    if temperatures is not None:
        temps = np.asarray(temperatures, dtype=np.float64)[: logits.shape[1]]
        logits[:, : len(temps)] /= temps[None, :]
    if offsets is not None:
        bias = np.asarray(offsets, dtype=np.float64)[: logits.shape[1]]
        logits[:, : len(bias)] += bias[None, :]
    return _sigmoid(logits)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free
