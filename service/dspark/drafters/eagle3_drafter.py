"""Engine adapter for the EAGLE-3 style autoregressive drafter (gamma sequential steps)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.drafters.context_drafter import ContextDrafter
from dspark.drafters.context_store import ContextStore
from dspark.drafters.draft_vocab import DraftVocab
from dspark.drafters.eagle3_model import Eagle3Model
from dspark.drafters.feature_batch import CommittedChunk
from dspark.engine.drafter import DraftBlock
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors, draw


class Eagle3Drafter(ContextDrafter):
    """Context entry i pairs token i+1's embedding with the target's fused feature of token i, so an
    entry is complete only once token i+1 is known. `propose` fuses and stores the features
    committed since the last draft, runs the not-yet-processed entries (always including the last
    committed one, whose next token is the anchor) in one batched causal pass, caching their K/V,
    then takes gamma single-token steps whose K/V stay local to the call."""

    def __init__(self, model: Eagle3Model) -> None:
        super().__init__()
        self.model = model
        config = model.config
        self.name = "eagle3"
        self.gamma = config.gamma
        self.target_layers = tuple(config.target_layer_ids)
        self.feature_size = len(self.target_layers) * config.target_hidden_size
        weight = model.fc.weight
        self.device = weight.device
        self.store = ContextStore(
            {"kv": model.kv_shape[1:], "hidden": (config.hidden_size,)}, weight.device, weight.dtype
        )
        self._processed: dict[str, int] = {}  # entries whose K/V in the store are final
        # The head's own rows (a reduced vocabulary when the checkpoint has one).
        self.vocab = DraftVocab(model.draft_token_ids(), model.lm_head, None, config.vocab_size)

    def admit(self, request: Request) -> None:
        super().admit(request)
        self._processed[request.request_id] = 0

    def release(self, request: Request) -> None:
        super().release(request)
        self._processed.pop(request.request_id, None)

    def fresh_copy(self) -> Eagle3Drafter:
        return Eagle3Drafter(self.model)

    def _write(self, chunk: CommittedChunk) -> None:
        self.store.write("hidden", chunk.rows, chunk.positions, self.model.fuse(chunk.features))

    @torch.inference_mode()
    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        lengths = self.context_lengths(requests)
        ids = [r.request_id for r in requests]
        rows = torch.tensor(self.store.rows(ids), device=self.device)
        hidden, ctx_k, ctx_v = self._process_pending(requests, rows, lengths)
        ctx_mask = (
            torch.arange(max(lengths), device=self.device)[None, :]
            < torch.tensor(lengths, device=self.device)[:, None]
        )
        step_k: list[torch.Tensor] = []
        step_v: list[torch.Tensor] = []
        tokens, probs = [], []
        pos = torch.tensor(lengths, device=self.device) - 1  # query position of the hidden just produced
        for step in range(self.gamma if horizon is None else min(horizon, self.gamma)):
            if step > 0:
                pos = pos + 1
                q, k, v = self.model.entry_qkv(tokens[-1][:, None], hidden[:, None], pos[:, None])
                step_k.append(k)
                step_v.append(v)
                keys = torch.cat([ctx_k, *step_k], dim=1)
                values = torch.cat([ctx_v, *step_v], dim=1)
                own = torch.ones(len(requests), step, dtype=torch.bool, device=self.device)
                mask = torch.cat([ctx_mask, own], dim=1)[:, None, :]
                hidden = self.model.entry_output(hidden[:, None], q, keys, values, mask)[:, 0]
            # Sampled over the head's own rows, widened to the target vocabulary once at the end.
            index, p = draw(self.model.draft_logits(hidden), sampling)
            tokens.append(self.vocab.to_target(index))
            probs.append(p)
        stacked = torch.stack(probs, 1) if probs[0] is not None else None  # None: every row greedy
        return DraftBlock(torch.stack(tokens, 1), self.vocab.widen(stacked), None)

    def _process_pending(
        self, requests: Sequence[Request], rows: torch.Tensor, lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Compute and cache the K/V of entries [processed, length) of every request in one causal pass.

        Returns the layer output at each request's last committed position [R, d] and the context
        keys / values [R, max_len, KVH, hd].
        """
        # At least the last entry is run: its output seeds the first draft step.
        starts = [min(self._processed[r.request_id], n - 1) for r, n in zip(requests, lengths, strict=True)]
        span = max(n - s for s, n in zip(starts, lengths, strict=True))
        # Padding repeats each request's last entry: identical values, so duplicate writes are harmless.
        pos_lists = [[min(s + j, n - 1) for j in range(span)] for s, n in zip(starts, lengths, strict=True)]
        next_ids = []
        for request, ps in zip(requests, pos_lists, strict=True):
            tokens = request.all_token_ids  # a fresh concatenation: take it once per request
            next_ids.append([tokens[p + 1] for p in ps])
        pos = torch.tensor(pos_lists, device=self.device)
        fused = self.store.read_at("hidden", rows, pos)
        q, k, v = self.model.entry_qkv(torch.tensor(next_ids, device=self.device), fused, pos)
        self.store.write("kv", rows[:, None], pos, torch.stack([k, v], dim=2))
        ctx = self.store.read("kv", rows, max(lengths))
        ctx_k, ctx_v = ctx[:, :, 0], ctx[:, :, 1]
        mask = torch.arange(max(lengths), device=self.device)[None, None, :] <= pos[:, :, None]
        out = self.model.entry_output(fused, q, ctx_k, ctx_v, mask)
        last = torch.tensor([n - 1 - s for s, n in zip(starts, lengths, strict=True)], device=self.device)
        for request, n in zip(requests, lengths, strict=True):
            self._processed[request.request_id] = n
        return out[torch.arange(len(requests), device=self.device), last], ctx_k, ctx_v
