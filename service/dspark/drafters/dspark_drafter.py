"""Engine adapter for DSpark (and DFlash, the same backbone without a sequential head)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.drafters.block_sampling import sample_block
from dspark.drafters.calibration import Calibration
from dspark.drafters.context_drafter import ContextDrafter
from dspark.drafters.context_store import ContextStore
from dspark.drafters.draft_vocab import DraftVocab
from dspark.drafters.dspark_model import DSparkModel
from dspark.drafters.feature_batch import CommittedChunk
from dspark.drafters.static_draft import StaticBlockHidden
from dspark.engine.drafter import DraftBlock
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors


class DSparkDrafter(ContextDrafter):
    """Keeps each request's context K/V (one entry per committed token and draft layer) and drafts
    every request's block in one batched backbone pass."""

    def __init__(
        self, model: DSparkModel, calibration: Calibration | None = None, vocab: DraftVocab | None = None
    ) -> None:
        super().__init__()
        self.model = model
        config = model.config
        self.name = config.kind
        self.gamma = config.gamma
        self.gives_confidences = model.confidence_head is not None
        self.target_layers = tuple(config.target_layer_ids)
        self.feature_size = len(self.target_layers) * config.target_hidden_size
        weight = model.fc.weight
        self.device = weight.device
        self.vocab = vocab if vocab is not None else DraftVocab.of(model)  # siblings share the packed rows
        self.store = ContextStore({"kv": model.kv_shape}, weight.device, weight.dtype)
        self.calibration = calibration
        self.static: StaticBlockHidden | None = None
        self._temps = self._shift = None  # [2, gamma]: row 0 serves sampled requests, row 1 greedy
        if calibration is not None:
            if len(calibration.temperatures) != self.gamma:
                raise ValueError(
                    f"calibration has {len(calibration.temperatures)} temperatures, gamma is {self.gamma}"
                )
            maps = [calibration.for_temperature(1.0), calibration.for_temperature(0.0)]
            self._temps = torch.tensor([temps for temps, _ in maps], device=self.device)
            self._shift = torch.tensor(
                [offsets or [0.0] * self.gamma for _, offsets in maps], device=self.device
            )

    def fresh_copy(self) -> DSparkDrafter:
        return DSparkDrafter(self.model, self.calibration, self.vocab)

    def use_static_shapes(self, batch_buckets: tuple[int, ...], context_buckets: tuple[int, ...]) -> None:
        if self.static is not None and self.static.shape == (
            tuple(sorted(batch_buckets)),
            tuple(sorted(context_buckets)),
        ):
            return  # engines over one drafter (siblings) share its graphs
        self.static = StaticBlockHidden(self.model, batch_buckets, context_buckets, self._greedy_block)
        self.static.capture()

    def _write(self, chunk: CommittedChunk) -> None:
        kv = self.model.context_kv(chunk.features, chunk.positions)
        self.store.write("kv", chunk.rows, chunk.positions, kv)

    @torch.inference_mode()
    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        lengths = self.context_lengths(requests)
        rows = torch.tensor(self.store.rows([r.request_id for r in requests]), device=self.device)
        ctx_kv = self.store.read("kv", rows, max(lengths))
        anchors = [r.last_token_id for r in requests]
        bucket = self.static.bucket(len(requests), max(lengths)) if self.static is not None else None
        if bucket is not None and sampling.all_greedy:  # sampling replays too; the horizon is cut after
            tokens, confidences = self.static.run_greedy(bucket, anchors, lengths, ctx_kv)
            cut = confidences[:, :horizon] if confidences is not None else None
            return DraftBlock(tokens[:, :horizon], None, cut)
        anchor = torch.tensor(anchors, device=self.device)
        if bucket is not None:  # every position of the block; the horizon is cut after
            hidden = self.static.run(bucket, anchors, lengths, ctx_kv)[:, :horizon]
        else:
            ctx_len = torch.tensor(lengths, device=self.device)
            ctx_mask = torch.arange(max(lengths), device=self.device)[None, :] < ctx_len[:, None]
            hidden = self.model.block_hidden(anchor, ctx_len, ctx_kv, ctx_mask, horizon)
        tokens, probs, conf_logits = sample_block(self.model, hidden, anchor, sampling, self.vocab)
        return DraftBlock(tokens, probs, self._confidences(conf_logits, sampling.temperature))

    def _greedy_block(
        self, hidden: torch.Tensor, anchor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy tokens and confidences of every block position, on device tensors alone (what
        `StaticBlockHidden` replays): `sample_block` and `_confidences` of an all-greedy batch."""
        zeros = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        greedy = SamplingTensors(
            zeros, zeros.long(), zeros + 1, zeros, [None] * hidden.shape[0], all_greedy=True
        )
        tokens, _, conf_logits = sample_block(self.model, hidden, anchor, greedy, self.vocab)
        return tokens, self._confidences(conf_logits, zeros)

    def _confidences(self, logits: torch.Tensor | None, temperature: torch.Tensor) -> torch.Tensor | None:
        """Calibrated c_k [R, n]: each row by the map for its sampling temperature (greedy or not)."""
        if logits is None:
            return None
        logits = logits.float()
        if self._temps is not None:
            n, greedy = logits.shape[1], (temperature == 0).long()
            logits = logits / self._temps[greedy, :n] + self._shift[greedy, :n]
        return torch.sigmoid(logits)
