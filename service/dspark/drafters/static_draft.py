"""DSpark's block pass over static buffers: batches padded to request buckets, contexts to a bound.

The context K/V is gathered from the paged store eagerly (its pools grow, so their addresses do
not stay put) into one static buffer; the backbone pass over it is what a CUDA graph replays.
Padding rows have no context and anchor 0; their outputs are dropped. Sampling stays eager:
per-request generators do not replay.
"""

from __future__ import annotations

import torch

from dspark.drafters.dspark_model import DSparkModel
from dspark.models.cuda_graphs import GraphSet, check_graph_memory, free_device_memory
from dspark.models.static_batch import bucket_for


class StaticBlockHidden:
    def __init__(self, model: DSparkModel, batch_buckets: tuple[int, ...], max_context: int) -> None:
        weight = model.fc.weight
        self.model, self.device = model, weight.device
        self.batch_buckets, self.max_context = tuple(sorted(batch_buckets)), max_context
        rows = self.batch_buckets[-1]
        with torch.inference_mode():  # the drafter proposes in inference mode
            self.ctx_kv = torch.zeros(
                (rows, max_context, *model.kv_shape), dtype=weight.dtype, device=self.device
            )
            self.meta = torch.zeros((2, rows), dtype=torch.int64, device=self.device)  # anchors, lengths
        self.graphs = GraphSet(self.device)

    @property
    def shape(self) -> tuple[tuple[int, ...], int]:
        return self.batch_buckets, self.max_context

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
        return self.ctx_kv.numel() * itemsize + concat + scores + mlp + stream + rows * keys

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.graphs.enabled:
            return
        what = f"{len(self.batch_buckets)} drafter buckets up to {self.batch_buckets[-1]} requests"
        check_graph_memory(self.estimate_bytes(), free_device_memory(self.device), what)
        self.meta.zero_()
        for rows in reversed(self.batch_buckets):
            self.graphs.capture(rows, lambda rows=rows: self._forward(rows))

    def bucket(self, num_requests: int, max_length: int) -> int | None:
        """The batch bucket, or None when the batch or a context does not fit (run eagerly)."""
        return bucket_for(num_requests, self.batch_buckets) if max_length <= self.max_context else None

    @torch.inference_mode()
    def run(self, rows: int, anchors: list[int], lengths: list[int], ctx_kv: torch.Tensor) -> torch.Tensor:
        """ctx_kv [R, C, *kv_shape] of R requests -> hidden states [R, block positions, d] (a copy)."""
        n, pad = len(anchors), [0] * (rows - len(anchors))
        self.meta[:, :rows].copy_(torch.tensor([anchors + pad, lengths + pad]), non_blocking=True)
        self.ctx_kv[:n, : ctx_kv.shape[1]].copy_(ctx_kv)
        return self.graphs.run(rows, lambda: self._forward(rows))[:n].clone()

    def _forward(self, rows: int) -> torch.Tensor:
        anchor, lengths = self.meta[0, :rows], self.meta[1, :rows]
        mask = torch.arange(self.max_context, device=self.device)[None, :] < lengths[:, None]
        return self.model.block_hidden(anchor, lengths, self.ctx_kv[:rows], mask)
