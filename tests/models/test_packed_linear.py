"""oneDNN pre-packed linears: the same outputs as the unpacked model, and only where they pay."""

from __future__ import annotations

import pytest
import torch
from dspark.models.cpu_kind import cpu_has_native_bf16
from dspark.models.kv_cache import KVCache
from dspark.models.loader import load_target_model
from dspark.models.packed_linear import PackedLinear, can_pack, pack_linears, uses_dense
from torch import nn

CPU = torch.device("cpu")
NATIVE_BF16 = (
    torch.backends.mkldnn.is_available()
    and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    and cpu_has_native_bf16()  # False under ATEN_CPU_CAPABILITY=avx2 too
)
needs_bf16 = pytest.mark.skipif(
    not NATIVE_BF16, reason="no native bf16 on this CPU (avx512_bf16 or AMX), so bf16 is not packed"
)
# fp32 packs on every CPU with oneDNN; bf16 only where the CPU computes it natively.
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16", marks=needs_bf16)]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def unpack(model: nn.Module) -> nn.Module:
    """The same model on F.linear: the reference a packed model is compared with."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.__class__ = nn.Linear
    return model


def test_packing_is_chosen_for_fp32_everywhere_and_bf16_where_native():
    assert can_pack(CPU, torch.float32) == torch.backends.mkldnn.is_available()
    assert can_pack(CPU, torch.bfloat16) == NATIVE_BF16
    assert not can_pack(CPU, torch.float16)
    assert not can_pack(torch.device("cuda"), torch.bfloat16)
    assert not can_pack(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_equals_f_linear_at_every_shape(dtype):
    torch.manual_seed(0)
    layer = nn.Linear(96, 160, bias=True).to(dtype)
    x = torch.randn(7, 5, 96, dtype=dtype)
    with torch.inference_mode():
        # Shapes of many rows (the packed kernel), and of one row (the dense copy in fp32).
        inputs = [x, x[0], x[:, :1], x.transpose(0, 1), x[0, :1], x[0, 0], x[:1, :1]]
        expected = [layer(i) for i in inputs]
        assert pack_linears(layer) == 1
        assert isinstance(layer, PackedLinear)
        got = [layer(i) for i in inputs]
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_only_one_fp32_row_reads_the_dense_weight():
    # bf16 through F.linear reorders the weight on every call: one bf16 row stays packed.
    assert uses_dense(torch.ones(1, 8)) and uses_dense(torch.ones(8)) and uses_dense(torch.ones(1, 1, 8))
    assert not uses_dense(torch.ones(2, 8)) and not uses_dense(torch.ones(1, 2, 8))
    assert not uses_dense(torch.ones(1, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_trains_through_its_weight(dtype):
    layer = nn.Linear(8, 4).to(dtype)
    pack_linears(layer)
    layer(torch.ones(2, 8, dtype=dtype)).sum().backward()
    assert layer.weight.grad is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_target_is_packed_and_keeps_its_logits(tiny_dirs, dtype):
    from tests.models.test_transformer_matches_hf import forward

    path = tiny_dirs["llama"]
    packed = load_target_model(path, dtype, CPU)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    plain = unpack(load_target_model(path, dtype, CPU))
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
            dtype,
            CPU,
        )
        logits.append(forward(model, cache, [(1, 0, ids)])[0])
    tolerance = 5 * TOLERANCE[dtype]
    torch.testing.assert_close(logits[0], logits[1], atol=tolerance, rtol=tolerance)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
