"""DSpark's block pass over static buffers: batches padded to request buckets, contexts to length buckets.

The context K/V is gathered from the paged store eagerly (its pools grow, so their addresses do
not stay put) into one static buffer; the backbone pass over it is what a CUDA graph replays.
Padding rows have no context and anchor 0; their outputs are dropped. An all-greedy batch also
replays its block sampling (argmax through the sequential head, and the confidences), a few
dozen small kernels a step otherwise; sampled batches sample eagerly: per-request generators do
not replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dspark.drafters.dspark_model import DSparkModel
from dspark.models.cuda_graphs import GraphSet, check_graph_memory, free_device_memory
from dspark.models.static_batch import bucket_for

# hidden [R, G, d], anchor [R] -> greedy tokens [R, G] and confidences [R, G] (or None)
GreedyBlock = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class StaticBlockHidden:
    def __init__(
        self,
        model: DSparkModel,
        batch_buckets: tuple[int, ...],
        context_buckets: tuple[int, ...],
        greedy_block: GreedyBlock | None = None,
    ) -> None:
        weight = model.fc.weight
        self.model, self.device = model, weight.device
        self.greedy_block = greedy_block
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.context_buckets = tuple(sorted(context_buckets))
        self.max_context = self.context_buckets[-1]
        rows = self.batch_buckets[-1]
        with torch.inference_mode():  # the drafter proposes in inference mode
            self.ctx_kv = torch.zeros(
                (rows, self.max_context, *model.kv_shape), dtype=weight.dtype, device=self.device
            )
            self.meta = torch.zeros((2, rows), dtype=torch.int64, device=self.device)  # anchors, lengths
        self.graphs = GraphSet(self.device)

    @property
    def shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.batch_buckets, self.context_buckets

    def estimate_bytes(self) -> int:
        """The context buffer plus the largest bucket's activations (an upper bound)."""
        model, rows = self.model, self.batch_buckets[-1]
        _, _, kv_heads, hd = model.kv_shape
        attn = model.layers[0].self_attn
        block, keys = model.block_len, self.max_context + model.block_len
        itemsize = self.ctx_kv.element_size()
        concat = 2 * rows * keys * kv_heads * hd * itemsize  # one layer's [context ; block] K and V
        scores = rows * attn.num_heads * block * keys * 4
        mlp = 3 * rows * block * model.config.layers.intermediate_size * itemsize
        stream = 8 * rows * block * model.config.hidden_size * itemsize
        sampling = rows * block * model.config.vocab_size * (itemsize + 4) if self.greedy_block else 0
        return self.ctx_kv.numel() * itemsize + concat + scores + mlp + stream + rows * keys + sampling

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.graphs.enabled:
            return
        what = f"{len(self.batch_buckets)} drafter buckets up to {self.batch_buckets[-1]} requests"
        check_graph_memory(self.estimate_bytes(), free_device_memory(self.device), what)
        self.meta.zero_()
        for rows in reversed(self.batch_buckets):
            for context in reversed(self.context_buckets):
                key = (rows, context)
                self.graphs.capture(key, lambda key=key: self._forward(*key))
                if self.greedy_block is not None:
                    self.graphs.capture((*key, "greedy"), lambda key=key: self._greedy(*key))

    def bucket(self, num_requests: int, max_length: int) -> tuple[int, int] | None:
        """The (requests, context length) bucket, or None when the batch or a context does not fit
        (run eagerly)."""
        rows = bucket_for(num_requests, self.batch_buckets)
        context = bucket_for(max_length, self.context_buckets)
        return None if rows is None or context is None else (rows, context)

    @torch.inference_mode()
    def run(
        self, bucket: tuple[int, int], anchors: list[int], lengths: list[int], ctx_kv: torch.Tensor
    ) -> torch.Tensor:
        """ctx_kv [R, C, *kv_shape] of R requests -> hidden states [R, block positions, d] (a copy)."""
        n = self._load(bucket[0], anchors, lengths, ctx_kv)
        return self.graphs.run(bucket, lambda: self._forward(*bucket))[:n].clone()

    @torch.inference_mode()
    def run_greedy(
        self, bucket: tuple[int, int], anchors: list[int], lengths: list[int], ctx_kv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run`, then `greedy_block` over every block position: tokens [R, G] and confidences
        [R, G] (or None). Views of the graph's outputs: the caller reads them before the next replay."""
        n = self._load(bucket[0], anchors, lengths, ctx_kv)
        tokens, confidences = self.graphs.run((*bucket, "greedy"), lambda: self._greedy(*bucket))
        return tokens[:n], confidences[:n] if confidences is not None else None

    def _load(self, rows: int, anchors: list[int], lengths: list[int], ctx_kv: torch.Tensor) -> int:
        n, pad = len(anchors), [0] * (rows - len(anchors))
        self.meta[:, :rows].copy_(torch.tensor([anchors + pad, lengths + pad]), non_blocking=True)
        self.ctx_kv[:n, : ctx_kv.shape[1]].copy_(ctx_kv)
        return n

    def _greedy(self, rows: int, context: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.greedy_block(self._forward(rows, context), self.meta[0, :rows])

    def _forward(self, rows: int, context: int) -> torch.Tensor:
        """The block pass over the first `context` entries of each row's context: entries past a
        row's own length are stale (masked), padding rows have none."""
        anchor, lengths = self.meta[0, :rows], self.meta[1, :rows]
        mask = torch.arange(context, device=self.device)[None, :] < lengths[:, None]
        return self.model.block_hidden(anchor, lengths, self.ctx_kv[:rows, :context], mask)
