"""Decode and verification steps padded to (requests, tokens, keys) buckets and replayed as CUDA graphs.

A step whose rows are all decodes (no prompt chunk) and fit a bucket is padded to it and runs
through `GraphSet`; any other step returns None and runs eagerly (`ModelRunner`).
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.engine.model_runner import StepForward
from dspark.engine.scheduler import StepPlan
from dspark.models.config import head_dim
from dspark.models.cuda_graphs import GraphSet, check_graph_memory, free_device_memory
from dspark.models.kv_cache import KVCache
from dspark.models.static_batch import PaddedBatch, bucket_for
from dspark.models.transformer import DecoderModel, ForwardOutput

# Rows of the one metadata buffer copied to the device per step.
_IDS, _POS, _SLOTS, _ROW_SLOTS, _REAL = range(5)


class StaticStepRunner:
    """Target steps over static buffers sized for the largest bucket; each bucket uses a prefix.

    `scratch_slot` is a KV slot no request owns: padding tokens write their K/V there. A bucket
    attends over its key length (`key_lens`, the last the cache's max_len), so a graph depends on
    the step's context lengths only through the bucket they fall in.
    """

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        scratch_slot: int,
        batch_buckets: tuple[int, ...],
        widths: tuple[int, ...],
        key_lens: tuple[int, ...],
        hidden_layers: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.model, self.cache, self.scratch_slot = model, cache, scratch_slot
        self.batch_buckets, self.widths = tuple(sorted(batch_buckets)), tuple(sorted(widths))
        self.key_lens = tuple(sorted(key_lens))
        if self.key_lens[-1] > cache.max_len:
            raise ValueError(f"key-length bucket {self.key_lens[-1]} exceeds the cache's {cache.max_len}")
        self.hidden_layers = hidden_layers
        self.device = device
        size = self.batch_buckets[-1] * self.widths[-1]
        with torch.inference_mode():  # the model reads them in inference mode
            self.meta = torch.full((5, size), scratch_slot, dtype=torch.int64, device=device)
        # The host side of `meta`, filled with NumPy: pinned on CUDA, so the one copy per step is
        # asynchronous; the event tells when the buffer may be refilled.
        self._host = torch.empty((5, size), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.graphs = GraphSet(device)
        self.num_static_steps = 0  # steps this runner took (the rest ran eagerly)

    @property
    def keys(self) -> list[tuple[int, int, int]]:
        return [(r, w, k) for r in self.batch_buckets for w in self.widths for k in self.key_lens]

    def estimate_bytes(self) -> int:
        """Static buffers plus the memory pool: the largest bucket's activations bound what graphs
        share, but every graph keeps its own outputs (logits and captured layers) allocated."""
        config, itemsize = self.model.config, self.cache.k.element_size()
        per_token = config.vocab_size * 4 + config.hidden_size * len(self.hidden_layers) * itemsize
        outputs = sum(rows * width for rows, width, _ in self.keys) * per_token
        return (
            self.meta.numel() * 8
            + outputs
            + step_activation_bytes(
                config,
                self.batch_buckets[-1],
                self.widths[-1],
                self.cache.max_len,
                itemsize,
                len(self.hidden_layers),
            )
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """On CUDA: refuse a bucket set that does not fit, then capture every bucket, largest first."""
        if not self.graphs.enabled:
            return
        rows, width, _ = self.keys[-1]
        what = f"{len(self.keys)} step buckets up to {rows} requests x {width} tokens"
        check_graph_memory(self.estimate_bytes(), free_device_memory(self.device), what)
        self.meta[[_POS, _IDS]] = 0
        self.meta[[_SLOTS, _ROW_SLOTS]] = self.scratch_slot  # capture writes to the scratch slot only
        for key in sorted(self.keys, reverse=True):
            self.graphs.capture(key, lambda key=key: self._forward(*key))

    def bucket(self, plan: StepPlan, draft_tokens: list[list[int]]) -> tuple[int, int, int] | None:
        """The (requests, tokens per request, keys) bucket of an all-decode step, or None (eager)."""
        if plan.prefills or not plan.decodes:
            return None
        rows = bucket_for(len(plan.decodes), self.batch_buckets)
        width = bucket_for(1 + max(len(d) for d in draft_tokens), self.widths)
        longest = max(r.num_cached + 1 + len(d) for r, d in zip(plan.decodes, draft_tokens, strict=True))
        keys = bucket_for(longest, self.key_lens)
        return None if rows is None or width is None or keys is None else (rows, width, keys)

    @torch.inference_mode()
    def run(self, plan: StepPlan, draft_tokens: list[list[int]]) -> StepForward | None:
        """Decodes feed [anchor] + their draft tokens, each getting logits, as `ModelRunner.run`."""
        key = self.bucket(plan, draft_tokens)
        if key is None:
            return None
        rows, width, _ = key
        counts = self._fill_meta(plan, draft_tokens, rows, width)
        out = self.graphs.run(key, lambda: self._forward(*key))
        self.num_static_steps += 1
        offsets = [0, *np.cumsum(counts).tolist()]
        logits, hidden = out.logits, out.layer_hidden
        if (counts == width).all():  # no padding inside the rows: the real tokens lead, in order
            logits, hidden = logits[: offsets[-1]], hidden[: offsets[-1]] if hidden is not None else None
        else:
            index = self.meta[_REAL, : offsets[-1]]
            logits, hidden = logits[index], hidden[index] if hidden is not None else None
        # Views of the graph's outputs, read before the next replay: verification, the drafter's
        # commit (which copies the features) and logprobs all run within this step.
        return StepForward(ForwardOutput(logits, hidden), offsets, offsets[:-1])

    def _fill_meta(self, plan: StepPlan, draft_tokens: list[list[int]], rows: int, width: int) -> np.ndarray:
        """Write the step's padded metadata into `meta` with one host-to-device copy; return each
        decode's token count (1 + its drafts)."""
        decodes, size = plan.decodes, rows * width
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffer
        # Contiguous [5, size] at the buffer's start, so the reshapes below are views.
        staged = self._host.view(-1)[: 5 * size].view(5, size)
        host = staged.numpy()
        host[[_IDS, _POS, _REAL]] = 0
        host[[_SLOTS, _ROW_SLOTS]] = self.scratch_slot
        n = len(decodes)
        counts = np.fromiter((1 + len(d) for d in draft_tokens), np.int64, n)
        starts = np.fromiter((r.num_cached for r in decodes), np.int64, n)
        slots = np.fromiter((r.slot for r in decodes), np.int64, n)
        grid = host[:, : n * width].reshape(5, n, width)
        valid = np.arange(width) < counts[:, None]
        grid[_IDS] = [
            [r.last_token_id, *d, *[0] * (width - 1 - len(d))]
            for r, d in zip(decodes, draft_tokens, strict=True)
        ]
        grid[_POS] = np.where(valid, starts[:, None] + np.arange(width), 0)
        grid[_SLOTS] = np.where(valid, slots[:, None], self.scratch_slot)
        host[_ROW_SLOTS, :n] = slots
        real = np.flatnonzero(valid)
        host[_REAL, : real.size] = real
        self.meta[:, :size].copy_(staged, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return counts

    def _forward(self, rows: int, width: int, key_len: int) -> ForwardOutput:
        size = rows * width
        batch = PaddedBatch(
            rows,
            width,
            positions=self.meta[_POS, :size],
            token_slots=self.meta[_SLOTS, :size],
            row_slots=self.meta[_ROW_SLOTS, :rows],
            scratch_slot=self.scratch_slot,
            key_len=key_len,
        ).with_mask()
        return self.model(self.meta[_IDS, :size], batch, self.cache, hidden_layers=self.hidden_layers)


def step_activation_bytes(
    config, rows: int, width: int, key_len: int, itemsize: int, num_hidden_layers: int
) -> int:
    """An upper bound of one padded step's live activations: logits (model dtype and float32), one
    layer's gathered K/V, its masks, attention scores (the math backend's, the worst case), the MLP
    and the residual stream, and the captured layer outputs."""
    tokens, d = rows * width, config.hidden_size
    heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, head_dim(config)
    logits = tokens * config.vocab_size * (itemsize + 4)
    keys = 2 * rows * kv_heads * key_len * hd * itemsize
    masks = tokens * key_len * (1 + heads // kv_heads)
    scores = rows * heads * width * key_len * 4
    mlp = 3 * tokens * config.intermediate_size * itemsize
    stream = tokens * (4 * d + 2 * (heads + 2 * kv_heads) * hd) * itemsize
    captured = tokens * d * num_hidden_layers * itemsize
    return logits + keys + masks + scores + mlp + stream + captured
