"""The engine's own decoder against transformers' reference implementations."""

from __future__ import annotations

import pytest
import torch
from dspark.models.config import head_dim
from dspark.models.forward_batch import ForwardBatch
from dspark.models.kv_cache import KVCache
from dspark.models.loader import load_target_model
from transformers import AutoModelForCausalLM

CPU = torch.device("cpu")


def new_cache(model, slots: int = 4, max_len: int = 128) -> KVCache:
    c = model.config
    return KVCache(
        c.num_hidden_layers, slots, max_len, c.num_key_value_heads, head_dim(c), torch.float32, CPU
    )


def forward(model, cache, chunks: list[tuple[int, int, list[int]]], all_logits: bool = True):
    """chunks: (slot, start, token ids) per request; returns per-request logits."""
    tokens = [t for _, _, ids in chunks for t in ids]
    lengths = [len(ids) for _, _, ids in chunks]
    batch = ForwardBatch.build(
        [s for s, _, _ in chunks], [st for _, st, _ in chunks], lengths, list(range(len(tokens))), CPU
    )
    out = model(torch.tensor(tokens), batch, cache).logits
    return list(out.split(lengths))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_prefill_and_decode_match_hf_on_random_configs(tiny_dirs, family):
    path = tiny_dirs[family]
    model = load_target_model(path, torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)
    cache = new_cache(model)
    # prefill 20, then a verify-shaped chunk of 6, then 4 single-token decodes
    got = forward(model, cache, [(1, 0, ids[:20])])[0]
    got = torch.cat([got, forward(model, cache, [(1, 20, ids[20:26])])[0]])
    for i in range(26, 30):
        got = torch.cat([got, forward(model, cache, [(1, i, [ids[i]])])[0]])
    err = (got - ref).abs().max().item()
    assert err <= 1e-4, f"{family}: max abs logit error {err}"


def test_ragged_batch_equals_per_request_forward(tiny_dirs):
    model = load_target_model(tiny_dirs["qwen3"], torch.float32, CPU)
    g = torch.Generator().manual_seed(2)
    # the last request's chunks are longer than SHORT_ROW_TOKENS, so they attend on their own
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 17, 5, 45)]
    follow = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (1, 4, 8, 40)]

    alone = []
    for p, f in zip(prompts, follow, strict=True):
        cache = new_cache(model)
        forward(model, cache, [(0, 0, p)])
        alone.append(forward(model, cache, [(0, len(p), f)])[0])

    cache = new_cache(model)
    forward(model, cache, [(s, 0, p) for s, p in zip((2, 0, 3, 1), prompts, strict=True)])
    # decode (1), verification (4, 8) and prompt-chunk (40) rows in one ragged batch
    mixed = forward(
        model, cache, [(s, len(p), f) for s, p, f in zip((2, 0, 3, 1), prompts, follow, strict=True)]
    )
    for a, m in zip(alone, mixed, strict=True):
        assert (a - m).abs().max().item() <= 1e-4


@pytest.mark.parametrize("new_tokens", [1, 4])
@pytest.mark.parametrize(
    ("slots", "read"),
    [((0, 1, 2), "view, in order"), ((2, 0, 3), "view, permuted"), ((0, 5, 11), "gathered")],
)
def test_batched_rows_equal_per_request_forward(tiny_dirs, new_tokens, slots, read):
    """Decode and uniform verification rows over slots read in place (in order: no padding at
    all; permuted, with a slot outside the group: padding rows) or gathered (slots spread out)."""
    model = load_target_model(tiny_dirs["qwen3"], torch.float32, CPU)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 17, 5)]
    follow = [torch.randint(0, 64, (new_tokens,), generator=g).tolist() for _ in prompts]
    alone = []
    for p, f in zip(prompts, follow, strict=True):
        cache = new_cache(model)
        forward(model, cache, [(0, 0, p)])
        alone.append(forward(model, cache, [(0, len(p), f)])[0])
    cache = new_cache(model, slots=12)
    forward(model, cache, [(s, 0, p) for s, p in zip(slots, prompts, strict=True)])
    chunks = [(s, len(p), f) for s, p, f in zip(slots, prompts, follow, strict=True)]
    group = ForwardBatch.build(list(slots), [len(p) for p in prompts], [new_tokens] * 3, [0], CPU).short
    assert isinstance(group.slots, slice) == read.startswith("view")
    assert group.dense == (read != "view, permuted")  # gathered rows are in request order
    for a, m in zip(alone, forward(model, cache, chunks), strict=True):
        assert (a - m).abs().max().item() <= 1e-4


def test_rollback_overwrites_rejected_positions(tiny_dirs):
    """After rejected tokens, rewriting from an earlier position gives fresh-context logits."""
    model = load_target_model(tiny_dirs["llama"], torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    cache = new_cache(model)
    prompt, rejected, accepted = [3, 9, 27, 4, 11], [50, 51, 52], [7, 8]
    forward(model, cache, [(0, 0, prompt)])
    forward(model, cache, [(0, 5, rejected)])  # verification whose drafts are all rejected
    got = forward(model, cache, [(0, 5, accepted)])[0]  # cache length rolled back to 5
    ref = hf_logits(hf, prompt + accepted)[5:]
    assert (got - ref).abs().max().item() <= 1e-4


def test_smollm2_logits_match_hf(smollm_dir):
    """The decoder's math on F.linear to 1e-4; the oneDNN-packed matmuls the CPU serves with
    reassociate sums, which a wider bound and the same greedy tokens cover."""
    from tests.models.test_packed_linear import unpack

    packed = load_target_model(smollm_dir, torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_logits(hf, ids)
    errors = {}
    plain = unpack(load_target_model(smollm_dir, torch.float32, CPU))
    for name, model in (("packed", packed), ("F.linear", plain)):
        cache = new_cache(model, slots=1)
        got = torch.cat(
            [forward(model, cache, [(0, 0, ids[:16])])[0], forward(model, cache, [(0, 16, ids[16:])])[0]]
        )
        errors[name] = (got - ref).abs().max().item()
        print(f"SmolLM2-135M fp32 ({name}) max abs logit error vs transformers: {errors[name]:.2e}")
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert errors["F.linear"] <= 1e-4
    assert errors["packed"] <= 5e-4
