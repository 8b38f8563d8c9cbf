"""oneDNN pre-packed linears: the same outputs as the unpacked model, and only where they pay."""

from __future__ import annotations

import pytest
import torch
from dspark.models.kv_cache import KVCache
from dspark.models.loader import load_target_model
from dspark.models.packed_linear import PackedLinear, can_pack, pack_linears
from torch import nn

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(
    not can_pack(CPU, torch.bfloat16), reason="this CPU has no native bf16 (oneDNN packing is not used)"
)


def test_packing_is_only_chosen_for_bf16_on_the_cpu():
    assert not can_pack(CPU, torch.float32)
    assert not can_pack(torch.device("cuda"), torch.bfloat16)


@needs_bf16
def test_packed_linear_equals_f_linear_at_every_shape():
    torch.manual_seed(0)
    layer = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    x = torch.randn(7, 5, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = [layer(x), layer(x[0]), layer(x[:, :1]), layer(x.transpose(0, 1))]
        assert pack_linears(layer) == 1
        assert isinstance(layer, PackedLinear)
        got = [layer(x), layer(x[0]), layer(x[:, :1]), layer(x.transpose(0, 1))]
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@needs_bf16
def test_packed_linear_trains_through_its_weight():
    layer = nn.Linear(8, 4).to(torch.bfloat16)
    pack_linears(layer)
    layer(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
    assert layer.weight.grad is not None


@needs_bf16
def test_bf16_target_is_packed_and_keeps_its_logits(tiny_dirs):
    from tests.models.test_transformer_matches_hf import forward

    path = tiny_dirs["llama"]
    packed = load_target_model(path, torch.bfloat16, CPU)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    plain = load_target_model(path, torch.bfloat16, CPU)
    for m in plain.modules():
        if isinstance(m, PackedLinear):
            m.__class__ = nn.Linear
    c = packed.config
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = []
    for model in (packed, plain):
        cache = KVCache(
            c.num_hidden_layers,
            2,
            64,
            c.num_key_value_heads,
            c.hidden_size // c.num_attention_heads,
            torch.bfloat16,
            CPU,
        )
        logits.append(forward(model, cache, [(1, 0, ids)])[0])
    torch.testing.assert_close(logits[0], logits[1], atol=5e-2, rtol=5e-2)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
