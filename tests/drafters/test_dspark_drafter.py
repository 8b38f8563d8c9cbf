"""DSparkDrafter (and DFlash) through the engine interface, against the HF-computed target features."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from dspark.drafters.calibration import Calibration, drafter_id
from dspark.drafters.checkpoint import load_draft_model
from dspark.drafters.factory import load_drafter
from dspark.models.packed_linear import PackedLinear, can_pack
from safetensors.torch import load_file, save_file

from tests.drafters.helpers import (
    FIXTURE,
    VARIANTS,
    assert_same_distributions,
    make_request,
    sampling_for,
    sequence,
    target_features,
)


def drafter_with_context(drafter, target, requests, chunks=None):
    """Admit requests and commit their cached tokens' features (optionally in chunks of given sizes)."""
    for request in requests:
        drafter.admit(request)
        feats = target_features(target, request.all_token_ids[:-1])
        sizes = chunks or [feats.shape[0]]
        start = 0
        for size in sizes:
            drafter.commit([request], [feats[start : start + size]])
            start += size
        assert start == feats.shape[0]
    return drafter


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_block_matches_reference(variant, target):
    exp = load_file(FIXTURE / f"draft_{variant}" / "expected.safetensors")
    prompt = exp["prompt_ids"][0].tolist()
    request = make_request("r", [*prompt, int(exp["anchor_id"])], num_cached=len(prompt))
    drafter = drafter_with_context(
        load_drafter(str(FIXTURE / f"draft_{variant}"), target.config), target, [request]
    )
    assert drafter.name == "dspark" and drafter.gamma == 7 and drafter.target_layers == (0, 2, 4)

    block = drafter.propose([request], sampling_for([request]))
    assert torch.equal(block.tokens, exp["greedy_draft_tokens"])
    assert block.probs is None  # an all-greedy block is one-hot: DraftBlock's None
    torch.testing.assert_close(
        block.confidences, torch.sigmoid(exp["confidence_logits"]), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_equals_each_alone(variant, target):
    drafter = load_drafter(str(FIXTURE / f"draft_{variant}"), target.config)
    lengths, temps, seeds = (6, 23, 41), (0.0, 0.8, 1.3), (None, 11, 12)
    requests = [
        make_request(f"r{i}", sequence(n + 1, seed=i), num_cached=n, temperature=t)
        for i, (n, t) in enumerate(zip(lengths, temps, strict=True))
    ]
    drafter_with_context(drafter, target, requests)

    batch = drafter.propose(requests, sampling_for(requests, list(seeds)))
    assert batch.tokens.shape == (3, 7) and batch.probs.shape == (3, 7, 1024)
    for i, request in enumerate(requests):
        alone = drafter.propose([request], sampling_for([request], [seeds[i]]))
        assert torch.equal(batch.tokens[i], alone.tokens[0])
        assert_same_distributions(batch.probs[i], alone.probs, alone.tokens[0])
        torch.testing.assert_close(batch.confidences[i], alone.confidences[0], atol=1e-5, rtol=1e-4)
    # Sampled rows are real distributions and each token was drawn from support of its own row.
    torch.testing.assert_close(batch.probs.sum(-1), torch.ones(3, 7))
    assert bool((batch.probs.gather(-1, batch.tokens[..., None]) > 0).all())
    assert bool(((batch.probs[1:] > 0).sum(-1) > 1).all())


def test_incremental_commits_equal_scratch(target):
    path = str(FIXTURE / "draft_rnn")
    tokens = sequence(40, seed=7)
    stepwise = load_drafter(path, target.config)
    request = make_request("r", tokens[:13], num_cached=12)
    drafter_with_context(stepwise, target, [request], chunks=[7, 5])  # chunked prefill
    stepwise.propose([request], sampling_for([request]))
    for accepted in (3, 1, 6, 2):  # verification steps: cache the anchor and the accepted tokens
        features = target_features(target, tokens[: request.num_cached + accepted])
        stepwise.commit([request], [features[request.num_cached :]])
        request.num_cached += accepted
        request.prompt_token_ids = tokens[: request.num_cached + 1]
        stepwise.propose([request], sampling_for([request]))

    scratch_request = make_request("s", tokens[: request.num_cached + 1], num_cached=request.num_cached)
    scratch = drafter_with_context(load_drafter(path, target.config), target, [scratch_request])
    a = stepwise.propose([request], sampling_for([request]))
    b = scratch.propose([scratch_request], sampling_for([scratch_request]))
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.confidences, b.confidences, atol=1e-5, rtol=1e-4)

    # ...and both equal the one-shot reference pass of the network on the full context.
    model = stepwise.model
    with torch.no_grad():
        feats = target_features(target, tokens[: request.num_cached])[None]
        anchor = torch.tensor([tokens[request.num_cached]])
        hidden = model(feats, anchor)
        logits, conf = model.teacher_forced(hidden, anchor, a.tokens)
    assert torch.equal(logits.argmax(-1), a.tokens)
    torch.testing.assert_close(torch.sigmoid(conf), a.confidences, atol=1e-5, rtol=1e-4)


def test_many_requests_long_contexts_and_row_reuse(target):
    """More requests than the initial rows and contexts past the initial capacity; released rows are reused."""
    path = str(FIXTURE / "draft_vanilla")
    drafter = load_drafter(path, target.config)
    requests = [
        make_request(f"r{i}", sequence(30 + 9 * i, seed=100 + i), num_cached=29 + 9 * i) for i in range(11)
    ]
    drafter_with_context(drafter, target, requests)
    batch = drafter.propose(requests, sampling_for(requests))
    for i in (0, 10):
        alone = drafter.propose([requests[i]], sampling_for([requests[i]]))
        assert torch.equal(batch.tokens[i], alone.tokens[0])

    for request in requests[:5]:
        drafter.release(request)
    newcomer = make_request("new", sequence(4, seed=999), num_cached=3)
    drafter_with_context(drafter, target, [newcomer])  # takes a released row holding stale context
    fresh_request = make_request("fresh", newcomer.all_token_ids, num_cached=3)
    fresh = drafter_with_context(load_drafter(path, target.config), target, [fresh_request])
    got = drafter.propose([newcomer], sampling_for([newcomer]))
    want = fresh.propose([fresh_request], sampling_for([fresh_request]))
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.confidences, want.confidences, atol=1e-5, rtol=1e-4)


def test_calibration_temperatures_scale_confidences(tmp_path, target):
    ckpt = tmp_path / "draft"
    shutil.copytree(FIXTURE / "draft_gated", ckpt)
    temps = [0.5, 1.0, 2.0, 3.0, 1.5, 4.0, 0.8]
    Calibration(drafter_id=drafter_id(ckpt), temperatures=temps).save(ckpt)
    exp = load_file(ckpt / "expected.safetensors")
    prompt = exp["prompt_ids"][0].tolist()
    request = make_request("r", [*prompt, int(exp["anchor_id"])], num_cached=len(prompt))
    drafter = drafter_with_context(load_drafter(str(ckpt), target.config), target, [request])
    block = drafter.propose([request], sampling_for([request]))
    want = torch.sigmoid(exp["confidence_logits"] / torch.tensor(temps))
    torch.testing.assert_close(block.confidences, want, atol=1e-5, rtol=1e-5)

    offsets = [-0.5, 0.25, 0.0, 1.0, -1.0, 0.0, 0.5]
    Calibration(drafter_id=drafter_id(ckpt), temperatures=temps, offsets=offsets).save(ckpt)
    drafter = drafter_with_context(load_drafter(str(ckpt), target.config), target, [request])
    block = drafter.propose([request], sampling_for([request]))
    want = torch.sigmoid(exp["confidence_logits"] / torch.tensor(temps) + torch.tensor(offsets))
    torch.testing.assert_close(block.confidences, want, atol=1e-5, rtol=1e-5)
    for bad in ([0.0] * 3, [float("nan")] * 7):
        with pytest.raises(ValueError, match="offsets must be finite, one per temperature"):
            Calibration(drafter_id=drafter_id(ckpt), temperatures=temps, offsets=bad)

    Calibration(drafter_id=drafter_id(ckpt), temperatures=temps[:3]).save(ckpt)
    with pytest.raises(ValueError, match="3 temperatures but the drafter drafts 7"):
        load_drafter(str(ckpt), target.config)


def test_greedy_requests_get_the_greedy_calibration(tmp_path, target):
    """One batch, two maps: temperature-0 rows by the greedy map, sampled rows by the other."""
    ckpt = tmp_path / "draft"
    shutil.copytree(FIXTURE / "draft_gated", ckpt)
    sampled, greedy = [0.5, 1.0, 2.0, 3.0, 1.5, 4.0, 0.8], [2.0, 0.7, 1.0, 1.0, 2.5, 1.0, 1.2]
    shift = [0.0, 0.5, 0.0, -0.5, 0.0, 0.0, 0.0]
    Calibration(
        drafter_id=drafter_id(ckpt), temperatures=sampled, greedy_temperatures=greedy, greedy_offsets=shift
    ).save(ckpt)
    drafter = load_drafter(str(ckpt), target.config)
    logits = torch.randn(3, 7)
    got = drafter._confidences(logits, torch.tensor([0.0, 1.0, 0.7]))
    torch.testing.assert_close(got[0], torch.sigmoid(logits[0] / torch.tensor(greedy) + torch.tensor(shift)))
    torch.testing.assert_close(got[1:], torch.sigmoid(logits[1:] / torch.tensor(sampled)))
    with pytest.raises(ValueError, match="greedy temperatures must be positive and finite, one per position"):
        Calibration(drafter_id="x", temperatures=sampled, greedy_temperatures=greedy[:3])
    with pytest.raises(ValueError, match="greedy offsets need greedy temperatures"):
        Calibration(drafter_id="x", temperatures=sampled, greedy_offsets=shift)


def dflash_checkpoint(tmp_path, zlab_layout: bool):
    """The vanilla fixture's backbone saved as a DFlash checkpoint (no sequential / confidence head)."""
    ckpt = tmp_path / ("zlab" if zlab_layout else "dflash")
    ckpt.mkdir()
    config = json.loads((FIXTURE / "draft_vanilla" / "config.json").read_text())
    for key in ("markov_head_type", "markov_rank", "enable_confidence_head", "confidence_head_with_markov"):
        config.pop(key)
    if zlab_layout:
        config["architectures"] = ["DFlashDraftModel"]
        config["dflash_config"] = {
            "target_layer_ids": config.pop("target_layer_ids"),
            "mask_token_id": config.pop("mask_token_id"),
        }
    (ckpt / "config.json").write_text(json.dumps(config))
    state = load_file(FIXTURE / "draft_vanilla" / "model.safetensors")
    skip = (
        ("markov_head.", "confidence_head.", "embed_tokens.", "lm_head.")
        if zlab_layout
        else ("markov_head.", "confidence_head.")
    )
    save_file({k: v for k, v in state.items() if not k.startswith(skip)}, ckpt / "model.safetensors")
    return ckpt


@pytest.mark.parametrize("zlab_layout", [False, True])
def test_dflash_drafts_base_argmax(tmp_path, target, zlab_layout):
    from dspark.drafters.checkpoint import load_target_shared_weights

    ckpt = dflash_checkpoint(tmp_path, zlab_layout)
    shared = load_target_shared_weights(FIXTURE / "target") if zlab_layout else None
    drafter = load_drafter(str(ckpt), target.config, shared=shared)
    assert drafter.name == "dflash"
    assert drafter.gamma == (6 if zlab_layout else 7)  # z-lab's anchor only conditions: block 7 -> 6 drafts
    tokens = sequence(26, seed=3)
    requests = [make_request("a", tokens, 25), make_request("b", tokens[:9], 8, temperature=1.0)]
    drafter_with_context(drafter, target, requests)
    block = drafter.propose(requests, sampling_for(requests, [None, 5]))
    assert block.confidences is None and block.tokens.shape == (2, drafter.gamma)

    model = load_draft_model(ckpt, shared=shared)
    with torch.no_grad():
        hidden = model(target_features(target, tokens[:25])[None], torch.tensor([tokens[25]]))
    assert hidden.shape == (1, drafter.gamma, 64)
    assert torch.equal(block.tokens[0], model.lm_head(hidden)[0].argmax(-1))


def test_interface_misuse_is_reported(target):
    drafter = load_drafter(str(FIXTURE / "draft_vanilla"), target.config)
    request = make_request("r", sequence(6, seed=1), num_cached=5)
    with pytest.raises(KeyError, match="not admitted"):
        drafter.commit([request], [torch.zeros(5, 192)])
    drafter.admit(request)
    with pytest.raises(ValueError, match=r"features must be \[n_tokens, 192\]"):
        drafter.commit([request], [torch.zeros(5, 64)])
    with pytest.raises(RuntimeError, match="saw 0 committed tokens"):
        drafter.propose([request], sampling_for([request]))
    with pytest.raises(ValueError, match="already admitted"):
        drafter.admit(request)


@pytest.mark.parametrize("variant", VARIANTS)
def test_reduced_drafting_vocabulary_is_the_masked_full_distribution(variant, target, tmp_path):
    """Restricting drafting to a vocabulary subset = the full head with every other logit at -inf,
    and the restriction survives save / load."""
    from dspark.drafters.checkpoint import save_draft_model
    from dspark.drafters.dspark_model import restrict_draft_vocabulary

    path = FIXTURE / f"draft_{variant}"
    subset = torch.randperm(1024, generator=torch.Generator().manual_seed(3))[:300]
    restricted = restrict_draft_vocabulary(load_draft_model(path), subset)
    save_draft_model(restricted, tmp_path / "restricted", include_shared=True)
    drafter = load_drafter(str(tmp_path / "restricted"), target.config)
    assert torch.equal(drafter.model.draft_token_ids(), subset.sort().values)
    # Its rows are packed once like the model's linears, not reordered for oneDNN every draft.
    packed = isinstance(drafter.model.fc, PackedLinear)
    assert packed == can_pack(drafter.device, drafter.model.fc.weight.dtype)
    assert isinstance(drafter.vocab.head, PackedLinear) == packed
    assert isinstance(drafter.vocab.markov, PackedLinear) == packed

    full = load_draft_model(path)
    allowed = torch.zeros(1024, dtype=torch.bool)
    allowed[subset] = True
    for temperature, seed in ((0.0, None), (0.8, 5)):
        tokens = sequence(20, seed=9)
        request = make_request("r", tokens, num_cached=19, temperature=temperature)
        drafter_with_context(drafter, target, [request])
        block = drafter.propose([request], sampling_for([request], [seed]))
        drafter.release(request)
        assert bool(allowed[block.tokens].all())
        assert temperature == 0 or float(block.probs[..., ~allowed].abs().max()) == 0.0
        with torch.no_grad():
            hidden = full(target_features(target, tokens[:-1])[None], torch.tensor([tokens[-1]]))
            logits, _ = full.teacher_forced(hidden, torch.tensor([tokens[-1]]), block.tokens)
            rows, _ = restricted.teacher_forced(
                hidden, torch.tensor([tokens[-1]]), block.tokens, draft_rows=True
            )
        torch.testing.assert_close(rows, logits[..., subset.sort().values])  # what training fits
        masked = logits.masked_fill(~allowed, float("-inf"))
        if temperature == 0:
            assert torch.equal(block.tokens, masked.argmax(-1))
        else:
            torch.testing.assert_close(
                block.probs, torch.softmax(masked / temperature, -1), atol=1e-5, rtol=1e-4
            )


def test_horizon_drafts_the_same_first_positions(target):
    drafter = load_drafter(str(FIXTURE / "draft_vanilla"), target.config)
    requests = [make_request(f"r{i}", sequence(n + 1, seed=i), num_cached=n) for i, n in enumerate((9, 30))]
    drafter_with_context(drafter, target, requests)
    whole = drafter.propose(requests, sampling_for(requests))
    short = drafter.propose(requests, sampling_for(requests), horizon=3)
    assert short.tokens.shape == (2, 3) and short.probs is None
    assert torch.equal(short.tokens, whole.tokens[:, :3])
    torch.testing.assert_close(short.confidences, whole.confidences[:, :3])


@pytest.mark.parametrize("zlab_layout", [None, False, True])  # None: DSpark; else DFlash layouts
def test_horizon_runs_the_last_layer_for_its_own_rows_only(tmp_path, target, zlab_layout):
    """Every block position feeds the last layer's keys and values, but its queries, attention
    output and MLP run only for the positions the horizon returns (DFlash's anchor row included)."""
    from dspark.drafters.checkpoint import load_target_shared_weights

    if zlab_layout is None:
        drafter, conditioning_rows = load_drafter(str(FIXTURE / "draft_vanilla"), target.config), 0
    else:
        shared = load_target_shared_weights(FIXTURE / "target") if zlab_layout else None
        ckpt = dflash_checkpoint(tmp_path, zlab_layout)
        drafter, conditioning_rows = load_drafter(str(ckpt), target.config, shared=shared), int(zlab_layout)
    requests = [make_request(f"r{i}", sequence(n + 1, seed=i), num_cached=n) for i, n in enumerate((9, 30))]
    drafter_with_context(drafter, target, requests)
    whole = drafter.propose(requests, sampling_for(requests))
    rows = []
    hook = drafter.model.layers[-1].mlp.register_forward_hook(
        lambda m, args, out: rows.append(args[0].shape[1])
    )
    short = drafter.propose(requests, sampling_for(requests), horizon=2)
    hook.remove()
    assert rows == [2 + conditioning_rows]
    assert torch.equal(short.tokens, whole.tokens[:, :2])


@pytest.mark.parametrize("rows", [1, 2])
def test_horizon_cut_heads_are_plain_matmuls(target, rows):
    """A width-1 (or one-request) cut of the block is a view .contiguous() leaves alone; F.linear
    on it went through a bmm over a broadcast copy of the whole head (5 ms a draft on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    drafter = load_drafter(str(FIXTURE / "draft_vanilla"), target.config)
    requests = [
        make_request(f"r{i}", sequence(n + 1, seed=i), num_cached=n) for i, n in enumerate((9, 30)[:rows])
    ]
    drafter_with_context(drafter, target, requests)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        block = drafter.propose(requests, sampling_for(requests), horizon=1)
    assert block.tokens.shape == (rows, 1)
    ops = {event.key for event in prof.key_averages()}
    assert ops & {"aten::mm", "mkldnn::_linear_pointwise"} and "aten::bmm" not in ops


@pytest.mark.parametrize("variant", VARIANTS)
def test_markov_head_over_the_drafting_vocabulary(variant, target, tmp_path):
    """A Markov head whose W1 / W2 cover only the drafting vocabulary (`markov_over_draft_vocab`)
    drafts exactly what the full-vocabulary head with those rows does (masked to the vocabulary),
    gives anchors outside it the zero embedding, survives save / load, and refuses another one."""
    from dspark.drafters.checkpoint import save_draft_model
    from dspark.drafters.config import DraftConfig
    from dspark.drafters.dspark_model import DSparkModel, restrict_draft_vocabulary

    path = FIXTURE / f"draft_{variant}"
    full = load_draft_model(path)
    subset = torch.randperm(1000, generator=torch.Generator().manual_seed(4))[:300].sort().values
    raw = {**json.loads((path / "config.json").read_text()), "draft_vocab_size": 300}
    raw["markov_over_draft_vocab"] = True
    for bad in (None, 1024):
        with pytest.raises(ValueError, match="needs a draft_vocab_size below vocab_size"):
            DraftConfig.from_dict({**raw, "draft_vocab_size": bad})
    small = DSparkModel(DraftConfig.from_dict(raw))
    state = dict(full.state_dict())
    w1 = state["markov_head.markov_w1.weight"]
    state["markov_head.markov_w1.weight"] = torch.cat([w1[subset], w1.new_zeros(1, w1.shape[1])])
    state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][subset]
    state["d2t"] = subset - torch.arange(300)
    state["markov_head.t2d"] = small.markov_head.t2d
    small.load_state_dict(state)
    small.markov_head.set_rows(subset)
    save_draft_model(small, tmp_path / "small", include_shared=True)
    drafter = load_drafter(str(tmp_path / "small"), target.config)
    assert tuple(drafter.model.markov_head.markov_w2.weight.shape) == (300, 16)
    assert torch.equal(drafter.model.draft_token_ids(), subset)

    allowed = torch.zeros(1024, dtype=torch.bool)
    allowed[subset] = True
    tokens = sequence(20, seed=9)
    tokens[-1] = int(subset[7])  # an anchor inside the vocabulary: W1 rows agree with the full head
    for temperature, seed in ((0.0, None), (0.8, 5)):
        request = make_request("r", tokens, num_cached=19, temperature=temperature)
        drafter_with_context(drafter, target, [request])
        block = drafter.propose([request], sampling_for([request], [seed]))
        drafter.release(request)
        assert bool(allowed[block.tokens].all())
        with torch.no_grad():
            hidden = full(target_features(target, tokens[:-1])[None], torch.tensor([tokens[-1]]))
            logits, conf = full.teacher_forced(hidden, torch.tensor([tokens[-1]]), block.tokens)
        masked = logits.masked_fill(~allowed, float("-inf"))
        torch.testing.assert_close(block.confidences, torch.sigmoid(conf), atol=1e-5, rtol=1e-4)
        if temperature == 0:
            assert torch.equal(block.tokens, masked.argmax(-1))
        else:
            torch.testing.assert_close(
                block.probs, torch.softmax(masked / temperature, -1), atol=1e-5, rtol=1e-4
            )

    # Training's teacher-forced logits: the bias lands on the vocabulary's ids only, and an anchor
    # outside it (id 1001 here) conditions position 1 on nothing.
    outside = torch.tensor([1001])
    assert not bool(allowed[outside])
    with torch.no_grad():
        hidden = small(target_features(target, tokens[:-1])[None], outside)
        logits, _ = small.teacher_forced(hidden, outside, subset[None, :7])
        plain = small.lm_head(hidden)
    torch.testing.assert_close(logits[..., ~allowed], plain[..., ~allowed])
    with torch.no_grad():  # training's objective: the same logits, over the drafting vocabulary only
        rows, rows_conf = small.teacher_forced(hidden, outside, subset[None, :7], draft_rows=True)
        _, full_conf = small.teacher_forced(hidden, outside, subset[None, :7])
    torch.testing.assert_close(rows, logits[..., subset])
    torch.testing.assert_close(rows_conf, full_conf)
    if variant != "rnn":  # the RNN's bias at k = 1 also depends on h_1
        torch.testing.assert_close(logits[:, 0], plain[:, 0])
    with pytest.raises(ValueError, match="its own drafting vocabulary"):
        restrict_draft_vocabulary(small, subset[:100])


def test_deferred_context_equals_eager_across_release_and_reuse(target):
    """Context K/V computed when drafting (after several commits, releases and a reused row) equals
    the K/V computed at every commit."""
    path = str(FIXTURE / "draft_vanilla")
    deferred, eager = load_drafter(path, target.config), load_drafter(path, target.config)
    eager.pending.max_tokens = 0  # every commit is written at once
    tokens = {f"r{i}": sequence(40, seed=300 + i) for i in range(4)}
    tokens["new"] = sequence(40, seed=399)
    blocks = []
    for drafter in (deferred, eager):
        requests = {rid: make_request(rid, t[:9], num_cached=8) for rid, t in tokens.items()}
        drafter_with_context(drafter, target, [requests[f"r{i}"] for i in range(4)])
        for step, accepted in enumerate((2, 3, 1)):
            if step == 1:  # two requests end before their last commits were drafted from
                drafter.release(requests.pop("r0"))
                drafter.release(requests.pop("r1"))
                drafter_with_context(drafter, target, [requests["new"]])  # takes r1's row and pages
            live = [r for rid, r in requests.items() if rid != "new" or step > 1]
            for request in live:
                features = target_features(
                    target, tokens[request.request_id][: request.num_cached + accepted]
                )
                drafter.commit([request], [features[request.num_cached :]])
                request.num_cached += accepted
                request.prompt_token_ids = tokens[request.request_id][: request.num_cached + 1]
        assert drafter.pending.num_tokens == (0 if drafter is eager else 4 * 8 + 4 * 2 + 8 + 2 * 3 + 3 * 1)
        live = list(requests.values())
        blocks.append(drafter.propose(live, sampling_for(live)))
    assert deferred.pending.num_tokens == 0
    assert torch.equal(blocks[0].tokens, blocks[1].tokens)
    torch.testing.assert_close(blocks[0].confidences, blocks[1].confidences, atol=1e-5, rtol=1e-4)


def test_fresh_copy_shares_the_weights_not_the_requests(target):
    drafter = load_drafter(str(FIXTURE / "draft_vanilla"), target.config)
    request = make_request("r", sequence(12, seed=5), num_cached=11)
    drafter_with_context(drafter, target, [request])
    copy = drafter.fresh_copy()
    assert copy.model is drafter.model and copy.calibration is drafter.calibration
    assert copy.store is not drafter.store and copy.pending is not drafter.pending
    with pytest.raises(KeyError):  # the copy never saw the request
        copy.propose([request], sampling_for([request]))
    drafter_with_context(copy, target, [request])
    a = drafter.propose([request], sampling_for([request]))
    b = copy.propose([request], sampling_for([request]))
    assert torch.equal(a.tokens, b.tokens)
