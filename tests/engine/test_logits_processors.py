"""Logits processors against a per-token reference: penalties per verification position count the
block's earlier draft tokens; all-default batches are not processed at all."""

from __future__ import annotations

from collections import Counter

import torch
from dspark.engine.logits_processors import LogitsProcessors
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors, logits_to_probs
from dspark.engine.sampling_params import SamplingParams

V = 11


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One position, token by token: logit_bias, then repetition over prompt + output, then
    frequency and presence over the output (vLLM's order)."""
    x = logits.clone().float()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    counts = Counter(output)
    seen = set(prompt) | set(output)
    for t in range(V):
        if t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return x


def request(prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    r = Request("r", prompt, params)
    r.output_token_ids = list(output)
    return r


def test_block_positions_count_earlier_drafts():
    torch.manual_seed(0)
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6),
        SamplingParams(),  # untouched neighbour
        SamplingParams(logit_bias={3: 5.0, 4: -100.0}, frequency_penalty=-1.1),
        SamplingParams(repetition_penalty=0.7, temperature=0.0),
    ]
    prompts = [[1, 2, 2], [3], [5, 6], [7, 7, 0]]
    outputs = [[2, 9, 9], [1], [], [4]]
    reqs = [request(p, o, sp) for p, o, sp in zip(prompts, outputs, params, strict=True)]
    width = 4
    logits = torch.randn(len(reqs), width + 1, V) * 3
    drafts = torch.tensor([[9, 3, 9, 1], [0, 0, 0, 0], [3, 3, 10, 2], [4, 4, 8, 7]])
    proc = LogitsProcessors.build(reqs, V, torch.device("cpu"))
    assert proc is not None and proc.rows.tolist() == [0, 2, 3]
    got = proc.apply(logits, drafts)
    for i, r in enumerate(reqs):
        for k in range(width + 1):
            prefix = r.output_token_ids + drafts[i, :k].tolist()
            want = reference(logits[i, k], r.prompt_token_ids, prefix, r.params)
            torch.testing.assert_close(got[i, k], want, rtol=0, atol=1e-5)
    # 2-D logits (a prompt's first token) count the output only
    first = proc.apply(logits[:, 0])
    torch.testing.assert_close(first, got[:, 0])
    assert torch.equal(got[1], logits[1])


def test_default_requests_are_not_processed():
    reqs = [request([1, 2], [3], SamplingParams()), request([4], [], SamplingParams(temperature=0.0))]
    assert LogitsProcessors.build(reqs, V, torch.device("cpu")) is None


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    st = SamplingTensors.from_params([SamplingParams(min_p=0.2)])
    probs = logits_to_probs(logits[:, None], st)[0, 0]
    kept = torch.tensor([0.5, 0.3, 0.12, 0.0])  # 0.08 < 0.2 * 0.5
    torch.testing.assert_close(probs, kept / kept.sum())
    greedy = SamplingTensors.from_params([SamplingParams(min_p=0.9, temperature=0.0)])
    assert logits_to_probs(logits[:, None], greedy)[0, 0].argmax() == 0


def test_seeded_samples_get_distinct_derived_seeds():
    p = SamplingParams(seed=7)
    assert [s.seed for s in p.for_samples(3)] == [7, 8, 9]
    assert SamplingParams().for_samples(2) == [SamplingParams()] * 2
