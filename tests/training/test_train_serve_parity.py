"""Train/serve parity: what the engine feeds a trained drafter and what that drafter proposes are
what training computed for the same tokens (the memorize-and-replay diagnostic's premise)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from dspark.builder import engine_from_config, sibling_engine
from dspark.drafters.checkpoint import SharedWeights
from dspark.drafters.factory import load_drafter
from dspark.engine.config import EngineConfig
from dspark.engine.drafter import DraftBlock, WrappingDrafter
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.factory import build_policy
from dspark.training.config import TrainConfig
from dspark.training.diagnostics import block_acceptance, every_anchor_batches
from dspark.training.features import target_hidden
from dspark.training.forward import dspark_block_logits
from dspark.training.online import OnlineFeatures, token_sequences
from dspark.training.packing import PackedBatch
from dspark.training.pipeline import load_target
from dspark.training.run import trainer_for

from tests.training.conftest import tiny_config

CPU, F32 = torch.device("cpu"), torch.float32
PROMPT = [5, 9, 2, 17, 30, 11, 4, 23]


class Spy(WrappingDrafter):
    """Records every committed feature row (per request, in order) and every proposed block."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.features: dict[str, list[torch.Tensor]] = {}
        self.blocks: list[tuple[int, int, list[int]]] = []  # (anchor position, anchor token, drafts)

    def commit(self, requests: Sequence[Request], features: Sequence[torch.Tensor | None]) -> None:
        for request, feats in zip(requests, features, strict=True):
            if feats is not None:
                self.features.setdefault(request.request_id, []).append(feats.clone())
        self.inner.commit(requests, features)

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        block = self.inner.propose(requests, sampling, horizon)
        for request, tokens in zip(requests, block.tokens.tolist(), strict=True):
            self.blocks.append((request.num_cached, request.last_token_id, tokens))
        return block


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target):
    """A tiny DSpark drafter trained a few steps on two sequences (every position an anchor), exported."""
    tmp = tmp_path_factory.mktemp("parity")
    raw = tiny_config(tmp, tiny_target, "dspark", tmp / "unused.jsonl", max_steps=8, warmup_steps=1)
    raw.update(warm_start="none", features="cached")
    raw["data"] = {"corpus": [str(tmp)], "feature_layers": [0, 2]}
    raw["optim"].update(lr=3e-2, sequences_per_step=2, anchors_per_sequence=64, checkpoint_every=8)
    cfg = TrainConfig.model_validate(raw)
    samples = [
        {"domain": "chat", "prompt_ids": PROMPT, "response_ids": [3, 8, 12, 3, 8, 12, 6, 7, 20, 21]},
        {"domain": "code", "prompt_ids": PROMPT[:5], "response_ids": [18, 19, 24, 25, 18, 19, 2, 2]},
    ]
    target = load_target(tiny_target, CPU, F32)
    sequences = OnlineFeatures(target, cfg.target_layer_ids).fill(token_sequences([samples]))
    trainer = trainer_for(cfg, sequences)
    trainer.train(progress=False)
    return cfg, trainer, trainer.export(), target, sequences


def test_served_features_and_drafts_equal_the_training_forward(trained, tiny_target):
    cfg, trainer, exported, target, _ = trained
    base = engine_from_config(
        EngineConfig(target=str(tiny_target), drafter="none", policy="none", device="cpu", dtype="float32")
    )
    shared = SharedWeights(base.model.model.embed_tokens.weight, base.model.lm_head.weight)
    spy = Spy(load_drafter(str(exported), base.model.config, CPU, F32, shared=shared, calibrated=False))
    engine = sibling_engine(base, spy, build_policy("full"), max_num_seqs=1, max_model_len=64)
    result = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=20))[0]
    tokens = PROMPT + result.token_ids

    # The features the engine commits are the training features of the same tokens.
    committed = torch.cat(spy.features[result.request_id])
    feats, _ = target_hidden(target, [tokens], cfg.target_layer_ids)[0]
    assert committed.shape[0] >= max(position for position, _, _ in spy.blocks)  # all a block saw
    torch.testing.assert_close(committed, feats[: committed.shape[0]], rtol=1e-4, atol=1e-4)

    # Every served block is the training forward's greedy block at that anchor (teacher-forced on
    # the served drafts, which a greedy drafter conditions on).
    assert len(spy.blocks) >= 3
    model, gamma = trainer.model.eval(), cfg.drafter.block_size
    for position, anchor, drafts in spy.blocks:
        assert tokens[position] == anchor
        batch = PackedBatch(
            ctx_features=feats[None, :position],
            ctx_tokens=torch.tensor([tokens[: position + 1]]),
            ctx_len=torch.tensor([position]),
            anchor_pos=torch.tensor([[position]]),
            anchor_tokens=torch.tensor([[anchor]]),
            labels=torch.tensor([[drafts]]),
            valid=torch.ones(1, 1, gamma, dtype=torch.bool),
            target_last=torch.zeros(1, 1, gamma, feats.shape[-1] // len(cfg.target_layer_ids)),
            domains=torch.tensor([0]),
        )
        with torch.no_grad():
            logits, _ = dspark_block_logits(model, batch, draft_rows=True)
        assert trainer.to_target[logits[0].argmax(-1)].tolist() == drafts, (position, drafts)


def test_zeroed_features_change_what_the_drafter_predicts(trained):
    _, trainer, _, _, sequences = trained
    batches = every_anchor_batches(sequences, trainer.cfg.drafter.block_size)
    with_features = block_acceptance(trainer, batches)
    zeroed = block_acceptance(trainer, batches, zero_features=True)
    assert with_features.blocks == zeroed.blocks == sum(len(s.tokens) - s.prompt_len - 1 for s in sequences)
    assert with_features.soft != zeroed.soft
    assert 1.0 <= with_features.greedy_tau <= 1 + trainer.cfg.drafter.block_size
