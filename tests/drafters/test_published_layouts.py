"""Published EAGLE-3 (EAGLE authors', vLLM `speculators`) and DFlash (z-lab) checkpoints, laid out
as their authors' code writes them, served by a loopback hub and loaded by hub id, draft what
their authors' forward passes compute (`published_reference.py`) and what the project-layout
drafter with the same weights drafts."""

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
from dspark.drafters.factory import checkpoint_dir, load_drafter
from safetensors.torch import save_file

from tests.drafters.helpers import FIXTURE, make_request, sampling_for, sequence, target_features
from tests.drafters.published_reference import dflash_block_logits, eagle3_greedy_round
from tests.hub_emulator import HubEmulator, repo_from_dir

TOL = {"atol": 1e-4, "rtol": 1e-4}
TARGET = json.loads((FIXTURE / "target" / "config.json").read_text())
LAYER = {
    k: TARGET[k]
    for k in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "vocab_size",
        "hidden_act",
    )
}
DRAFT_VOCAB = 256
MASK_ID = 1023
TOKENS = sequence(24, seed=5)  # 23 cached tokens, then the anchor


@pytest.fixture(scope="module")
def shared():
    return load_target_shared_weights(FIXTURE / "target")


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights with non-trivial norms, a reduced vocabulary's d2t / t2d where there is one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=g) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=g) * 0.15)
        if getattr(model, "d2t", None) is not None:
            chosen = torch.randperm(model.config.vocab_size, generator=g)[: model.d2t.numel()].sort().values
            model.d2t.copy_(chosen - torch.arange(chosen.numel()))
            if hasattr(model, "t2d"):
                model.t2d.zero_()[chosen] = True
    return model


def project_eagle3(architecture: str, draft_vocab: int | None, norm_before_residual: bool, shared):
    """A random EAGLE-3 drafter built as this project builds it, with the target's embedding."""
    raw = LAYER | {
        "architectures": [architecture],
        "num_hidden_layers": 1,
        "head_dim": TARGET["head_dim"],
        "rope_parameters": TARGET["rope_parameters"],
        "target_layer_ids": [0, 2, 4],
        "norm_before_residual": norm_before_residual,
        "block_size": 3,
    }
    if draft_vocab:
        raw["draft_vocab_size"] = draft_vocab
    with torch.device("meta"):
        model = build_model(DraftConfig.from_dict(raw))
    model = model.to_empty(device="cpu")
    randomized(model, seed=len(architecture) + (draft_vocab or 0))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(shared.embed_tokens)
    return model.eval()


def eagle_authors_layout(model, out):
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: a Llama config with `draft_vocab_size`, no feature
    layers (the target's default 1, N/2-1, N-4 = vLLM's aux 2, N/2, N-3), keys `midlayer.*`, `fc`,
    `norm`, `lm_head`, `d2t`, `t2d`, no embedding, in pytorch_model.bin."""
    out.mkdir(parents=True)
    config = LAYER | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "rope_theta": TARGET["rope_parameters"]["rope_theta"],
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "draft_vocab_size": model.config.draft_vocab_size,
    }
    (out / "config.json").write_text(json.dumps(config))
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    torch.save(state, out / "pytorch_model.bin")
    return config, state


def speculators_layout(model, out, model_type: str, norm_before_residual: bool):
    """vLLM speculators' Eagle3 format: `speculators_model_type: eagle3`, the layer config in
    `transformer_layer_config`, aux layers as HF hidden_states indices, keys `layers.0.*`,
    `embed_tokens` included, d2t / t2d always (the identity over a full vocabulary)."""
    out.mkdir(parents=True)
    vocab = model.config.vocab_size
    draft_vocab = model.config.draft_vocab_size or vocab
    layer = LAYER | {
        "model_type": model_type,
        "num_hidden_layers": 1,
        "head_dim": TARGET["head_dim"],
        "rope_theta": TARGET["rope_parameters"]["rope_theta"],
    }
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": norm_before_residual,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5],  # decoder layers 0, 2, 4
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
            "verifier": {"name_or_path": "org/tiny-target", "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    (out / "config.json").write_text(json.dumps(config))
    state = {k.replace("midlayer.", "layers.0."): v.clone() for k, v in model.state_dict().items()}
    if model.d2t is None:
        state["d2t"], state["t2d"] = torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool)
    save_file(state, out / "model.safetensors")
    return layer, state


def zlab_dflash_layout(out, layer_ids: list[int] | None, seed: int):
    """z-lab/Qwen3-8B-DFlash-b16: `DFlashDraftModel`, a Qwen3 config with `block_size`,
    `num_target_layers` and `dflash_config.{mask_token_id,target_layer_ids}`; keys `fc`,
    `hidden_norm`, `layers.N.*`, `norm` (no embedding or LM head: the target's)."""
    out.mkdir(parents=True)
    dflash_config = {"mask_token_id": MASK_ID} | ({"target_layer_ids": layer_ids} if layer_ids else {})
    config = {k: v for k, v in TARGET.items() if k not in ("architectures", "transformers_version")}
    config |= {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "num_hidden_layers": 2,
        "layer_types": ["full_attention"] * 2,
        "num_target_layers": TARGET["num_hidden_layers"],
        "block_size": 5,
        "dflash_config": dflash_config,
    }
    (out / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        model = build_model(DraftConfig.from_dict(config | {"target_layer_ids": [1, 3]}))
    model = randomized(model.to_empty(device="cpu"), seed)
    state = {k: v.clone() for k, v in model.state_dict().items() if k not in model.shared_keys}
    save_file(state, out / "model.safetensors")
    return config, state


@pytest.fixture
def hub_repos(monkeypatch, tmp_path):
    """Serve the directories put in the returned dict (repo id -> dir) from a loopback hub."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    started: list[HubEmulator] = []

    def serve(repo_id, directory):
        hub = HubEmulator({repo_id: repo_from_dir(directory)})
        hub.__enter__()
        started.append(hub)
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        return repo_id

    yield serve
    for hub in started:
        hub.__exit__(None, None, None)


def eagle3_round(drafter, target, tokens):
    request = make_request("r", tokens, len(tokens) - 1)
    drafter.admit(request)
    drafter.commit([request], [target_features(target, tokens[:-1], drafter.target_layers)])
    return drafter.propose([request], sampling_for([request])).tokens[0].tolist()


@pytest.mark.parametrize(
    ("layout", "model_type", "norm_before_residual", "draft_vocab"),
    [
        ("eagle", "llama", False, DRAFT_VOCAB),
        ("speculators", "llama", True, None),
        ("speculators", "qwen3", False, DRAFT_VOCAB),
    ],
)
def test_published_eagle3_by_hub_id_drafts_what_its_authors_compute(
    hub_repos, tmp_path, target, shared, layout, model_type, norm_before_residual, draft_vocab
):
    architecture = "LlamaForCausalLMEagle3" if model_type == "llama" else "Eagle3DraftModel"
    model = project_eagle3(architecture, draft_vocab, norm_before_residual, shared)
    if layout == "eagle":
        cfg, state = eagle_authors_layout(model, tmp_path / "published")
        prefix, layers, gamma = "midlayer.", (1, 2, 2), 7
    else:
        cfg, state = speculators_layout(model, tmp_path / "published", model_type, norm_before_residual)
        prefix, layers, gamma = "layers.0.", (0, 2, 4), 4
    repo = hub_repos(f"org/{layout}-{model_type}-eagle3", tmp_path / "published")

    drafter = load_drafter(repo, target.config, shared=shared)
    config = drafter.model.config
    assert (config.kind, config.target_layer_ids, drafter.gamma) == ("eagle3", layers, gamma)
    assert (config.qk_norm, config.norm_before_residual) == (model_type == "qwen3", norm_before_residual)

    features = target_features(target, TOKENS[:-1], layers)
    want_tokens, want_logits = eagle3_greedy_round(
        state, prefix, cfg, shared.embed_tokens, features, TOKENS, gamma, norm_before_residual
    )
    assert eagle3_round(drafter, target, TOKENS) == want_tokens
    with torch.no_grad():
        out = drafter.model(features[None], torch.tensor([TOKENS[1:]]))
        got_logits = drafter.model.logits(out[0, -1])
    finite = want_logits.isfinite()
    assert torch.equal(got_logits.isfinite(), finite) and finite.sum() == (draft_vocab or LAYER["vocab_size"])
    torch.testing.assert_close(got_logits[finite], want_logits[finite], **TOL)

    # The project-layout drafter with the same weights drafts the same round.
    save_draft_model(model, tmp_path / "project")
    project = json.loads((tmp_path / "project" / "config.json").read_text())
    (tmp_path / "project" / "config.json").write_text(
        json.dumps(project | {"target_layer_ids": list(layers), "block_size": gamma})
    )
    own = load_drafter(str(tmp_path / "project"), target.config, shared=shared)
    assert eagle3_round(own, target, TOKENS) == want_tokens


@pytest.mark.parametrize("layer_ids", [[1, 3], None])  # None: z-lab's default spread over 1..N-3
def test_zlab_dflash_by_hub_id_drafts_what_its_authors_compute(
    hub_repos, tmp_path, target, shared, layer_ids
):
    cfg, state = zlab_dflash_layout(tmp_path / "published", layer_ids, seed=11)
    repo = hub_repos("z-lab/tiny-DFlash-b5", tmp_path / "published")

    drafter = load_drafter(repo, target.config, shared=shared)
    config = drafter.model.config
    assert (config.kind, config.target_layer_ids, config.gamma, drafter.model.block_len) == (
        "dflash",
        (1, 3),
        4,
        5,
    )
    features = target_features(target, TOKENS[:-1], (1, 3))
    want = dflash_block_logits(state, cfg, shared.embed_tokens, shared.lm_head, features, TOKENS[-1])
    with torch.no_grad():
        hidden = drafter.model(features[None], torch.tensor([TOKENS[-1]]))
    torch.testing.assert_close(drafter.model.lm_head(hidden)[0], want, **TOL)

    request = make_request("r", TOKENS, len(TOKENS) - 1)
    drafter.admit(request)
    drafter.commit([request], [features])
    block = drafter.propose([request], sampling_for([request]))
    assert block.tokens[0].tolist() == want.argmax(-1).tolist()


def test_published_layout_from_a_directory_equals_by_hub_id(hub_repos, tmp_path, target, shared):
    zlab_dflash_layout(tmp_path / "published", [1, 3], seed=3)
    repo = hub_repos("z-lab/tiny-DFlash-b5", tmp_path / "published")
    by_id = load_draft_model(checkpoint_dir(repo), target=target.config, shared=shared)
    local = load_draft_model(tmp_path / "published", target=target.config, shared=shared)
    for key, value in local.state_dict().items():
        assert torch.equal(by_id.state_dict()[key], value)


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("eagle3", r"is a dflash checkpoint \(DFlashDraftModel\), not eagle3; name method 'dflash'"),
        ("dspark", r"is a dflash checkpoint \(DFlashDraftModel\), not dspark"),
    ],
)
def test_a_method_that_is_not_the_checkpoints_kind_is_refused(
    hub_repos, tmp_path, target, shared, method, message
):
    zlab_dflash_layout(tmp_path / "published", [1, 3], seed=3)
    repo = hub_repos("z-lab/tiny-DFlash-b5", tmp_path / "published")
    with pytest.raises(ValueError, match=message):
        load_drafter(f"{method}:{repo}", target.config, shared=shared)
    assert load_drafter(f"dflash:{repo}", target.config, shared=shared).model.config.kind == "dflash"


def write_config(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


SPECULATORS = {
    "speculators_model_type": "eagle3",
    "transformer_layer_config": LAYER | {"model_type": "llama", "num_hidden_layers": 1},
    "eagle_aux_hidden_state_layer_ids": [1, 3, 5],
}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            SPECULATORS | {"speculators_model_type": "eagle"},
            r"speculators_model_type 'eagle' is not supported",
        ),
        (SPECULATORS | {"norm_before_fc": True}, "norm_before_fc"),
        (
            SPECULATORS | {"transformer_layer_config": LAYER | {"model_type": "gpt_oss"}},
            r"model_type 'gpt_oss' is not supported",
        ),
        (
            SPECULATORS | {"transformer_layer_config": LAYER | {"num_hidden_layers": 2}},
            r"num_hidden_layers 2 \(only one decoder layer",
        ),
        (SPECULATORS | {"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}, r"id 0 \(the embedding output\)"),
        (
            LAYER
            | {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"use_aux_hidden_state": False}},
            "use_aux_hidden_state false",
        ),
        (
            LAYER
            | {
                "architectures": ["DFlashDraftModel"],
                "num_hidden_layers": 2,
                "head_dim": 16,
                "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3]},
                "use_sliding_window": True,
                "sliding_window": 2048,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            r"sliding-window attention in layers \[0\]",
        ),
        (
            LAYER | {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 2, "head_dim": 16},
            "names no mask_token_id",
        ),
        (
            LAYER | {"architectures": ["DFlash2DraftModel"]},
            r"unknown drafter architecture 'DFlash2DraftModel'",
        ),
    ],
)
def test_what_cannot_be_mapped_is_refused_by_name(tmp_path, target, config, message):
    with pytest.raises(ValueError, match=message):
        load_draft_model(write_config(tmp_path, config), target=target.config)
