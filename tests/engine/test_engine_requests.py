"""Request lifecycle: admission, chunked prefill, stopping, aborts and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from dspark.drafters.ngram import NgramDrafter, NoDrafter
from dspark.engine.sampling_params import SamplingParams
from dspark.models.config import load_target_config
from dspark.models.pull import ModelError, _verify_sha256, resolve_target
from pydantic import ValidationError

from tests.engine.helpers import engine_on

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompts(n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (length + i,), generator=g).tolist() for i in range(n)]


def test_more_requests_than_slots_wait_and_all_finish(tiny_dirs):
    reference = engine_on(tiny_dirs["llama"], NoDrafter(), "none", max_num_seqs=8)
    expected = [r.token_ids for r in reference.generate(prompts(6), GREEDY)]
    engine = engine_on(tiny_dirs["llama"], NgramDrafter(4), "static:4", max_num_seqs=2)
    ids = [engine.add_request(p, GREEDY) for p in prompts(6)]
    tokens = {i: [] for i in ids}
    first = engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 4
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    for out in first:
        tokens[out.request_id][:0] = out.new_token_ids
    assert [tokens[i] for i in ids] == expected
    assert engine.cache.num_free_slots == 2


def test_chunked_prefill_gives_the_same_output(tiny_dirs):
    long_prompts = prompts(3, length=70)
    whole = engine_on(tiny_dirs["qwen3"], NoDrafter(), "none", max_batch_tokens=512)
    chunked = engine_on(tiny_dirs["qwen3"], NgramDrafter(3), "static:3", max_batch_tokens=24)
    assert [r.token_ids for r in whole.generate(long_prompts, GREEDY)] == [
        r.token_ids for r in chunked.generate(long_prompts, GREEDY)
    ]


def test_stop_conditions(tiny_dirs):
    engine = engine_on(tiny_dirs["llama"], NoDrafter(), "none")
    prompt = prompts(1)[0]
    free = engine.generate([prompt], GREEDY)[0].token_ids
    stop_at = free[4]
    result = engine.generate([prompt], GREEDY.model_copy(update={"stop_token_ids": [stop_at]}))[0]
    assert result.token_ids == free[: free.index(stop_at) + 1] and result.finish_reason == "stop"
    result = engine.generate([prompt], GREEDY.model_copy(update={"max_tokens": 3}))[0]
    assert len(result.token_ids) == 3 and result.finish_reason == "length"
    engine.eos_ids = frozenset({free[2]})
    result = engine.generate([prompt], GREEDY.model_copy(update={"ignore_eos": False}))[0]
    assert result.token_ids == free[: free.index(free[2]) + 1] and result.finish_reason == "stop"


def test_stop_strings_cut_the_text(smollm_engine_fp32):
    engine = smollm_engine_fp32
    prompt = engine.tokenizer.encode("The days of the week are Monday, Tuesday,")
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].text
    stop = free.strip()[2:6]
    result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0]
    assert result.finish_reason == "stop" and stop not in result.text and free.startswith(result.text)


def test_abort_frees_the_slot_and_other_requests_continue(tiny_dirs):
    engine = engine_on(tiny_dirs["llama"], NgramDrafter(4), "static:2", max_num_seqs=2)
    seen = []
    keep = engine.add_request(prompts(1)[0], GREEDY, on_output=seen.append)
    drop = engine.add_request(prompts(1, seed=1)[0], GREEDY.model_copy(update={"max_tokens": 50}))
    engine.step()
    engine.abort_request(drop)
    engine.abort_request(drop)  # idempotent
    assert engine.cache.num_free_slots == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert seen[-1].finished and seen[-1].request_id == keep and sum(len(o.new_token_ids) for o in seen) == 10


def test_bad_requests_are_refused_and_lose_nothing(tiny_dirs):
    engine = engine_on(tiny_dirs["llama"], NoDrafter(), "none", max_model_len=64)
    good = engine.add_request(prompts(1)[0], GREEDY)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        engine.add_request([5] * 60, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        engine.add_request([5, 64], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5], GREEDY, request_id=good)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cache.num_free_slots == engine.config.max_num_seqs


@pytest.mark.parametrize(
    "bad", [{"top_k": 2**31}, {"top_k": 2**63}, {"seed": 2**64}, {"seed": -(2**63) - 1}, {"top_k": -1}]
)
def test_sampling_values_no_step_tensor_holds_are_refused(bad):
    with pytest.raises(ValidationError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_top_k_of_the_vocabulary_is_off_and_logit_bias_outside_it_refused(tiny_dirs):
    engine = engine_on(tiny_dirs["llama"], NoDrafter(), "none", max_model_len=64)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([5], SamplingParams(max_tokens=8, logit_bias={64: 1.0}))
    assert not engine.has_unfinished_requests()
    seeded = dict(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    largest = engine.add_request([5, 6, 7], SamplingParams(top_k=2**31 - 1, **seeded))
    kept = engine.add_request([5, 6, 7], SamplingParams(top_k=63, **seeded))
    assert engine.requests[largest].params.top_k == 0 and engine.requests[kept].params.top_k == 63
    engine.abort_request(largest)
    engine.abort_request(kept)
    off = engine.generate([[5, 6, 7]], SamplingParams(**seeded))
    large = engine.generate([[5, 6, 7]], SamplingParams(top_k=64, **seeded))
    assert large[0].token_ids == off[0].token_ids


def test_kv_cache_larger_than_memory_is_refused():
    from dspark.models.kv_cache import check_kv_budget

    check_kv_budget(1024, 16, 2048, torch.device("cpu"))  # 32 MiB fits
    with pytest.raises(ValueError, match=r"KV cache .* needs 32768.0 GiB"):
        check_kv_budget(2**20, 4096, 8192, torch.device("cpu"))


def test_unknown_model_name_names_the_known_ones():
    with pytest.raises(ModelError, match=r"unknown model 'no-such-model'.*smollm2-135m"):
        resolve_target("no-such-model")


def test_corrupt_model_file_is_refused(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"truncated")
    with pytest.raises(ModelError, match="corrupt or truncated"):
        _verify_sha256(f, "0" * 64, progress=False)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        load_target_config(tmp_path)


def test_checkpoint_missing_weights_is_refused(tiny_dirs, tmp_path):
    from dspark.models.loader import load_target_model
    from safetensors.torch import load_file, save_file

    for f in ("config.json",):
        (tmp_path / f).write_text((tiny_dirs["llama"] / f).read_text())
    state = load_file(tiny_dirs["llama"] / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match=r"missing.*up_proj"):
        load_target_model(tmp_path, torch.float32, torch.device("cpu"))


def test_nan_confidences_fall_back_to_a_fixed_policy_and_stay_lossless(tiny_dirs, caplog):
    from dspark.engine.drafter import DraftBlock
    from dspark.policies.factory import build_policy
    from dspark.profiling.synthetic import synthetic_profile

    class BrokenConfidences(NgramDrafter):
        def propose(self, requests, sampling, horizon=None):
            block = super().propose(requests, sampling, horizon)
            return DraftBlock(
                block.tokens, None, torch.full(block.tokens.shape, float("nan")), block.num_valid
            )

    reference = engine_on(tiny_dirs["llama"], NoDrafter(), "none")
    expected = [r.token_ids for r in reference.generate(prompts(3), GREEDY)]
    engine = engine_on(tiny_dirs["llama"], BrokenConfidences(4), "none")
    engine.policy = build_policy("dspark", sps=synthetic_profile())
    with caplog.at_level("WARNING"):
        results = engine.generate(prompts(3), GREEDY)
    assert [r.token_ids for r in results] == expected
    assert engine.policy.fallbacks > 0 and "confidences" in caplog.text.lower()


def test_the_engine_drafts_only_what_the_policy_can_verify(tiny_dirs):
    """Policy none never runs the drafter; static:K asks for K positions; outputs are unchanged."""

    class Counting(NgramDrafter):
        def __init__(self, gamma):
            super().__init__(gamma)
            self.horizons = []

        def propose(self, requests, sampling, horizon=None):
            self.horizons.append(horizon)
            return super().propose(requests, sampling, horizon)

    reference = engine_on(tiny_dirs["llama"], NoDrafter(), "none")
    expected = [r.token_ids for r in reference.generate(prompts(3), GREEDY)]
    for policy, want in (("none", set()), ("static:2", {2}), ("full", {4})):
        drafter = Counting(4)
        engine = engine_on(tiny_dirs["llama"], drafter, policy)
        assert [r.token_ids for r in engine.generate(prompts(3), GREEDY)] == expected
        assert set(drafter.horizons) == want
        assert bool(drafter.horizons) == (policy != "none")


def test_a_drafter_on_another_device_is_refused(tiny_dirs):
    with pytest.raises(ValueError, match="drafter 'ngram' is on meta but the engine runs on cpu"):
        engine_on(tiny_dirs["llama"], NgramDrafter(4, device="meta"), "static:2")


@pytest.mark.parametrize("policy,chunk", [("none", 24 - 2), ("static:2", 24 - 2 * 3), ("full", 24 - 2 * 8)])
def test_prompt_chunks_get_the_budget_the_steps_drafts_leave(tiny_dirs, policy, chunk):
    """Each decode reserves 1 + the policy's horizon for this step, not a whole block: a policy that
    drafts little leaves the rest of the batch to prompt chunks."""
    engine = engine_on(tiny_dirs["llama"], NgramDrafter(7), policy, max_batch_tokens=24, max_num_seqs=3)
    for prompt in prompts(2, length=5):
        engine.add_request(prompt, GREEDY.model_copy(update={"max_tokens": 20}))
    while engine.scheduler.num_decoding < 2:
        engine.step()
    engine.add_request(prompts(1, length=70)[0], GREEDY)
    engine.step()
    assert engine.last_step_stats.num_prefill_tokens == chunk


def test_a_steps_stats_carry_its_forwards_cpu_time_and_threads(tiny_dirs):
    """What the server holds a step against its start-up timings with (`StepPace`)."""
    engine = engine_on(tiny_dirs["llama"], NoDrafter(), "none")
    engine.add_request(prompts(1)[0], GREEDY.model_copy(update={"max_tokens": 4}))
    threads = torch.get_num_threads()
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.last_step_stats
        assert stats.intra_op_threads == threads
        assert stats.forward_cpu_s > 0
        assert stats.predicted_forward_s is None  # only the serving layer predicts
