"""Online target features: the same training batches as the cached feature shards, nothing stored."""

from __future__ import annotations

import pytest
import torch
from dspark.training.config import TrainConfig
from dspark.training.features import load_sequences
from dspark.training.online import OnlineFeatures, token_sequences
from dspark.training.pipeline import collect_samples, load_target, prepare_data
from dspark.training.run import build_trainer
from dspark.training.trainer import batch_for_step

from tests.training.conftest import tiny_config, write_prompts

CPU, BF16 = torch.device("cpu"), torch.bfloat16


@pytest.fixture
def cfg(tmp_path, tiny_target) -> TrainConfig:
    raw = tiny_config(tmp_path, tiny_target, "dspark", write_prompts(tmp_path / "prompts.jsonl", 30))
    raw["data"]["feature_layers"] = [0, 1, 2]
    raw["drafter"]["target_layer_ids"] = [0, 2]  # a subset: online computes only these columns
    return TrainConfig.model_validate(raw)


def test_an_online_batch_equals_the_cached_batch_of_the_same_samples(cfg, tiny_target):
    # bf16 target forwards, as on a device that has bf16: the two paths round differently.
    cached = load_sequences(prepare_data(cfg, CPU, BF16, progress=False), (0, 1, 2), (0, 2))
    groups = collect_samples(cfg, CPU, BF16, progress=False)
    online = token_sequences([samples for _, samples in groups])
    assert [s.tokens.tolist() for s in online] == [s.tokens.tolist() for s in cached]
    assert all(s.features is None for s in online)  # nothing computed, nothing stored up front

    features = OnlineFeatures(load_target(tiny_target, CPU, BF16), (0, 2), max_tokens=96)
    for step in range(3):
        a = batch_for_step(cached, step, cfg)
        b = batch_for_step(online, step, cfg, features.fill)
        for name in ("ctx_tokens", "ctx_len", "anchor_pos", "anchor_tokens", "labels", "valid", "domains"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert b.ctx_features.dtype == a.ctx_features.dtype == BF16
        # Within bf16 rounding: padding and batch composition change the forward's last bits.
        # Within bf16 rounding: padding and batch composition change the forward's last bits, a few
        # ulps of a value (the ulp of 32 is 0.25), so the tolerance follows the tensor's scale.
        for name in ("ctx_features", "target_last"):
            x, y = getattr(a, name).float(), getattr(b, name).float()
            scale = float(x.abs().max())
            torch.testing.assert_close(y, x, rtol=2e-2, atol=2e-2 * scale, msg=name)
            assert float((y - x).abs().mean()) < 1e-3 * scale, name
        assert a.block_positions > 0
    assert all(s.features is None for s in online)  # filled copies, the corpus stays token ids


def test_online_normalisers_equal_the_cached_ones(cfg):
    cached_cfg = cfg.model_copy(update={"features": "cached"})
    cached = build_trainer(cached_cfg, progress=False)
    online = build_trainer(cfg, progress=False)
    assert online.online is not None and cached.online is None
    assert online.to_target is not None  # a drafting vocabulary: p^t needs log Z per position
    for step in (0, 1):
        a = batch_for_step(cached.sequences, step, cfg)
        b = batch_for_step(online.sequences, step, cfg, online.online.fill)
        torch.testing.assert_close(b.target_log_norm, a.target_log_norm, rtol=1e-4, atol=1e-4)
        assert torch.equal(b.valid, a.valid)
