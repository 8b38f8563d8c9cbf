"""Kernels per decoder layer: a small model's step is launch-bound on a GPU, so this is held."""

from __future__ import annotations

import pytest
import torch
from dspark.models.forward_batch import ForwardBatch
from dspark.models.loader import load_target_model
from dspark.profiling.operators import OperatorCount

from tests.models.test_transformer_matches_hf import CPU, new_cache

# Kernels per Llama layer in fp32 on the CPU: 2 norms (rms_norm, weight), qkv, rotary (2 muls, roll,
# add), 2 cache writes, o_proj, residual, MLP (gate_up, silu, mul, down), residual = 16, plus the
# attention: one SDPA call for a lone request; for a batch over adjacent slots (read in place),
# the mask fold, 2 matmuls, scale, where, softmax and the folded query copy; ragged rows add the
# padding scatter and gather back. Qwen3 adds its q/k norms (2 rms_norm, 2 weights) and their cat.
# (Before session 16's rotary / norm / padding / in-place work these were 38-48 per Llama layer.)
LAYER_BUDGET = {"one": 19, "decode": 24, "verify": 26, "ragged": 29}
QK_NORMS = {"llama": 0, "qwen3": 5}


def layer_operators(model, lengths: list[int]) -> int:
    """Kernels one decoder layer runs for rows of `lengths` new tokens after 8 cached each."""
    cache, slots = new_cache(model), list(range(len(lengths)))
    model(
        torch.arange(8 * len(slots)) % 64,
        ForwardBatch.build(slots, [0] * len(slots), [8] * len(slots), [0], CPU),
        cache,
    )
    batch = ForwardBatch.build(slots, [8] * len(slots), lengths, [0], CPU)
    x = torch.randn(sum(lengths), model.config.hidden_size)
    cos, sin = model.rotary(batch.positions, x.dtype)
    with torch.inference_mode(), OperatorCount() as ops:
        model.model.layers[0](x, cos, sin, batch, cache)
    return ops.computing


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(
    ("case", "lengths"), [("one", [1]), ("decode", [1, 1, 1]), ("verify", [4, 4]), ("ragged", [1, 4, 2])]
)
def test_decoder_layer_stays_within_its_kernel_budget(tiny_dirs, family, case, lengths):
    model = load_target_model(tiny_dirs[family], torch.float32, CPU)
    assert layer_operators(model, lengths) <= LAYER_BUDGET[case] + QK_NORMS[family]
