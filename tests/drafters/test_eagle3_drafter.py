"""Eagle3Drafter: batched, cached drafting equals a from-scratch autoregressive reference."""

from __future__ import annotations

import json

import pytest
import torch
from dspark.drafters.checkpoint import (
    build_model,
    load_draft_model,
    load_target_shared_weights,
    save_draft_model,
)
from dspark.drafters.config import DraftConfig
from dspark.drafters.eagle3_drafter import Eagle3Drafter
from dspark.drafters.factory import load_drafter

from tests.drafters.helpers import (
    FIXTURE,
    assert_same_distributions,
    make_request,
    sampling_for,
    sequence,
    target_features,
)

GAMMA = 5


def eagle3_config(architecture: str = "Eagle3DraftModel", draft_vocab: int | None = None) -> dict:
    target = json.loads((FIXTURE / "target" / "config.json").read_text())
    raw = {
        k: target[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "rope_parameters",
            "vocab_size",
            "hidden_act",
        )
    }
    raw |= {
        "architectures": [architecture],
        "num_hidden_layers": 1,
        "num_target_layers": 6,
        "target_layer_ids": [0, 2, 4],
        "block_size": GAMMA,
    }
    if architecture != "LlamaForCausalLMEagle3":
        raw["head_dim"] = target["head_dim"]
    if draft_vocab:
        raw["draft_vocab_size"] = draft_vocab
    return raw


def random_checkpoint(path, architecture="Eagle3DraftModel", draft_vocab=None):
    """A random EAGLE-3 drafter (non-default norms too), saved without the shared embedding."""
    torch.manual_seed(0)
    model = build_model(DraftConfig.from_dict(eagle3_config(architecture, draft_vocab)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        if draft_vocab:
            chosen = torch.randperm(model.config.vocab_size)[:draft_vocab].sort().values
            model.d2t.copy_(chosen - torch.arange(draft_vocab))
            model.t2d.zero_()[chosen] = True
    save_draft_model(model, path)
    return path


def reference_greedy(model, features: torch.Tensor, tokens: list[int], gamma: int) -> list[int]:
    """Recompute the whole draft sequence causally at every step (no cache, no batching)."""
    hidden = model.fuse(features)
    ids = torch.tensor(tokens[1:])
    drafted = []
    with torch.no_grad():
        for _ in range(gamma):
            n = ids.shape[0]
            q, k, v = model.entry_qkv(ids[None], hidden[None], torch.arange(n)[None])
            out = model.entry_output(hidden[None], q, k, v, torch.ones(n, n, dtype=torch.bool).tril()[None])[
                0
            ]
            tok = model.logits(out[-1]).argmax(-1)
            drafted.append(int(tok))
            ids = torch.cat([ids, tok[None]])
            hidden = torch.cat([hidden, out[-1:]])
    return drafted


@pytest.fixture(scope="module")
def shared():
    return load_target_shared_weights(FIXTURE / "target")


def admitted(drafter, target, requests):
    for request in requests:
        drafter.admit(request)
        drafter.commit([request], [target_features(target, request.all_token_ids[:-1])])
    return drafter


@pytest.mark.parametrize("architecture", ["Eagle3DraftModel", "LlamaForCausalLMEagle3"])
def test_greedy_equals_reference_and_batch_equals_alone(tmp_path, target, shared, architecture):
    ckpt = random_checkpoint(tmp_path / "eagle", architecture)
    drafter = load_drafter(str(ckpt), target.config, shared=shared)
    assert (
        isinstance(drafter, Eagle3Drafter) and drafter.gamma == GAMMA and drafter.target_layers == (0, 2, 4)
    )
    assert hasattr(drafter.model.midlayer.self_attn.q_norm, "weight") == (
        architecture != "LlamaForCausalLMEagle3"
    )

    requests = [make_request(f"r{i}", sequence(n + 1, seed=i), n) for i, n in enumerate((4, 19, 33))]
    requests.append(make_request("hot", sequence(12, seed=9), 11, temperature=0.9))
    admitted(drafter, target, requests)
    seeds = [None, None, None, 4]
    batch = drafter.propose(requests, sampling_for(requests, seeds))
    assert batch.tokens.shape == (4, GAMMA) and batch.confidences is None
    for i, request in enumerate(requests):
        alone = drafter.propose([request], sampling_for([request], [seeds[i]]))
        assert torch.equal(batch.tokens[i], alone.tokens[0])
        assert_same_distributions(batch.probs[i], alone.probs, alone.tokens[0])
    for i, request in enumerate(requests[:3]):
        feats = target_features(target, request.all_token_ids[:-1])
        assert batch.tokens[i].tolist() == reference_greedy(
            drafter.model, feats, request.all_token_ids, GAMMA
        )
    assert bool(((batch.probs[3] > 0).sum(-1) > 1).all())  # the sampled row has a real distribution
    # A horizon stops the sequential steps early: the same first positions, nothing after.
    short = drafter.propose(requests, sampling_for(requests, seeds), horizon=2)
    assert short.tokens.shape == (4, 2)
    assert torch.equal(short.tokens[:3], batch.tokens[:3, :2])


def test_incremental_commits_equal_scratch(tmp_path, target, shared):
    ckpt = random_checkpoint(tmp_path / "eagle")
    tokens = sequence(40, seed=21)
    stepwise = load_drafter(str(ckpt), target.config, shared=shared)
    request = make_request("r", tokens[:10], 9)
    admitted(stepwise, target, [request])
    stepwise.propose([request], sampling_for([request]))
    for accepted in (2, 1, 5, 3):
        feats = target_features(target, tokens[: request.num_cached + accepted])
        stepwise.commit([request], [feats[request.num_cached :]])
        request.num_cached += accepted
        request.prompt_token_ids = tokens[: request.num_cached + 1]
        if accepted != 1:  # also exercise several commits between two proposals
            stepwise.propose([request], sampling_for([request]))
    got = stepwise.propose([request], sampling_for([request]))
    feats = target_features(target, tokens[: request.num_cached])
    want = reference_greedy(stepwise.model, feats, tokens[: request.num_cached + 1], GAMMA)
    assert got.tokens[0].tolist() == want


def test_reduced_draft_vocabulary(tmp_path, target, shared):
    ckpt = random_checkpoint(tmp_path / "eagle", draft_vocab=128)
    model = load_draft_model(ckpt, target=target.config, shared=shared)
    allowed = model.t2d.clone()
    assert int(allowed.sum()) == 128
    drafter = Eagle3Drafter(model)
    requests = [make_request("a", sequence(15, seed=2), 14), make_request("b", sequence(8, seed=3), 7, 1.0)]
    admitted(drafter, target, requests)
    block = drafter.propose(requests, sampling_for(requests, [None, 1]))
    assert bool(allowed[block.tokens].all())
    assert float(block.probs[..., ~allowed].abs().max()) == 0.0
    feats = target_features(target, requests[0].all_token_ids[:-1])
    assert block.tokens[0].tolist() == reference_greedy(model, feats, requests[0].all_token_ids, GAMMA)


def test_lm_head_is_kept_and_embedding_required(tmp_path, target):
    ckpt = random_checkpoint(tmp_path / "eagle")
    from dspark.drafters.checkpoint import read_state_dict

    keys = read_state_dict(ckpt)
    assert (
        "lm_head.weight" in keys
        and "embed_tokens.weight" not in keys
        and "midlayer.hidden_norm.weight" in keys
    )
    with pytest.raises(ValueError, match=r"lacks weights \['embed_tokens\.weight'\]"):
        load_drafter(str(ckpt), target.config)
