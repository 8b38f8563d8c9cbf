"""`dspark bench acceptance` and `dspark calibrate` end to end: real eval prompts through SmolLM2's
tokenizer and chat template, a tiny random target with its vocabulary, a random DSpark drafter."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from dspark.bench import serve
from dspark.bench.serve import output_lengths
from dspark.cli import main
from dspark.drafters.checkpoint import build_model, save_draft_model
from dspark.drafters.config import DraftConfig
from dspark.engine.outputs import RequestOutput, StepStats
from dspark.engine.sampling_params import SamplingParams

from tests.conftest import write_tiny_model

VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_pair(smollm_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("accept")
    target = write_tiny_model(root / "target", "llama", vocab_size=VOCAB, max_position_embeddings=2048)
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).is_file():
            shutil.copy(smollm_dir / name, target / name)
    torch.manual_seed(0)
    raw = {
        "architectures": ["Qwen3DSparkModel"],
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "max_position_embeddings": 2048,
        "block_size": 4,
        "target_layer_ids": [0, 1],
        "num_target_layers": 2,
        "mask_token_id": 0,
        "markov_head_type": "rnn",
        "markov_rank": 8,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }
    drafter = root / "dspark"
    save_draft_model(build_model(DraftConfig.from_dict(raw)), drafter)
    return target, drafter


def test_bench_acceptance_cli(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    out = tmp_path / "acc"
    args = [
        "bench",
        "acceptance",
        "--target",
        str(target),
        "--drafters",
        str(drafter),
        "--domains",
        "math,chat",
    ]
    args += ["--num-prompts", "2", "--max-tokens", "12", "--temperatures", "1.0,0", "--device", "cpu"]
    result = CliRunner().invoke(main, [*args, "--dtype", "float32", "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "acceptance.json").read_text())
    assert [(r["temperature"], sorted(r["domains"])) for r in report["runs"]] == [
        (1.0, ["chat", "math"]),
        (0.0, ["chat", "math"]),
    ]
    assert report["meta"]["num_prompts"] == 2
    assert (out / "acceptance.md").read_text().startswith("# Acceptance benchmark")
    assert "macro" in result.output


def test_bench_acceptance_decodes_a_prompt_file(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"domain": "code", "prompt_ids": [5, 6, 7]}, {"domain": "mine", "prompt_ids": [9, 10]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "acc"
    args = [
        "bench",
        "acceptance",
        "--target",
        str(target),
        "--drafters",
        str(drafter),
        "--prompts",
        str(prompts),
    ]
    args += ["--max-tokens", "12", "--temperatures", "0", "--device", "cpu", "--dtype", "float32"]
    result = CliRunner().invoke(main, [*args, "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "acceptance.json").read_text())
    assert sorted(report["runs"][0]["domains"]) == ["code", "mine"]
    assert report["meta"]["num_prompts"] == 2 and report["meta"]["prompts"] == str(prompts)
    assert f"the 2 prompts of `{prompts}`" in (out / "acceptance.md").read_text()


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", ":1: not JSON"),
        ('{"domain": "code"}', ":1: prompt_ids must be"),
        ('{"prompt_ids": [1, 99999999]}', ":1: prompt_ids must be"),
        ('{"prompt_ids": [1], "domain": 3}', ":1: domain must be a string"),
    ],
)
def test_bad_prompt_file_rows_are_named(tiny_pair, tmp_path, line, says):
    target, drafter = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(line + "\n")
    args = [
        "bench",
        "acceptance",
        "--target",
        str(target),
        "--drafters",
        str(drafter),
        "--prompts",
        str(prompts),
    ]
    result = CliRunner().invoke(main, [*args, "--device", "cpu", "--dtype", "float32"])
    assert result.exit_code == 2, result.output
    assert "--prompts" in result.output and f"{prompts}{says}" in result.output


def test_calibrate_cli_records_rounds(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    out = tmp_path / "cal"
    args = ["calibrate", str(drafter), "--target", str(target), "--domains", "code", "--num-prompts", "2"]
    args += ["--max-tokens", "16", "--device", "cpu", "--dtype", "float32", "--folds", "0"]
    result = CliRunner().invoke(main, [*args, "--output-dir", str(out), "--no-write"])
    assert result.exit_code == 0, result.output
    assert (out / "rounds.npz").is_file() and (out / "reliability.png").is_file()
    report = json.loads((out / "calibration-report.json").read_text())
    assert len(report["temperatures"]) == 4 and report["check"] is None
    assert report["meta"]["rounds"] >= 2 * 15 // 5  # two requests, at most 1 + 4 tokens per round
    assert not (drafter / "calibration.json").exists()  # --no-write


def test_unknown_drafter_name_is_refused(tiny_pair):
    target, _ = tiny_pair
    result = CliRunner().invoke(
        main, ["bench", "acceptance", "--target", str(target), "--drafters", "dspark"]
    )
    assert result.exit_code != 0
    assert "neither a checkpoint directory" in result.output


def test_bench_serve_cli_runs_policies_in_rounds(tiny_pair, tmp_path, monkeypatch):
    """`dspark bench serve` end to end: every policy at every level, rounds merged, plots written."""
    target, drafter = tiny_pair
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path / "home"))  # the SPS profile is measured here
    out = tmp_path / "serve"
    args = ["bench", "serve", "--target", str(target), "--drafter", str(drafter), "--device", "cpu"]
    args += ["--dtype", "float32", "--policies", "none,static:1,dspark,oracle,none#2,oracle#2"]
    args += ["--concurrency", "1,2"]
    args += ["--requests", "4", "--rounds", "2", "--max-tokens", "6", "--domains", "code"]
    result = CliRunner().invoke(main, [*args, "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench-serve.json").read_text())
    points = report["points"]
    assert [(p["concurrency"], p["policy"]) for p in points] == [
        (c, n) for c in (1, 2) for n in ("none", "static:1", "dspark", "oracle", "none#2", "oracle#2")
    ]
    lengths = output_lengths(6, 0.5)  # the default spread: 3 to 9 tokens, the same for every policy
    for p in points:
        per_round = max(2, 2 * p["concurrency"])
        assert len(p["extra"]["round_tokens_per_s"]) == 2
        assert p["requests"] == 2 * per_round and p["output_tokens"] == 2 * sum(lengths[:per_round])
        assert p["aggregate_tokens_per_s"] == pytest.approx(p["output_tokens"] / p["seconds"])
    by = {(p["concurrency"], p["policy"]): p for p in points}
    assert by[(1, "none")]["drafted_share"] == 0 and by[(1, "static:1")]["drafted_share"] == 1
    assert by[(1, "none")]["mean_verify_budget"] == 0 and by[(1, "static:1")]["mean_verify_budget"] > 0
    levels = report["summary"]["per_level"]
    assert [row["concurrency"] for row in levels] == [1, 2]
    assert all(row["best_fixed"] in ("none", "static:1") and "dspark_vs_best_fixed" in row for row in levels)
    assert all("oracle_vs_static:1" in row for row in levels)  # the bound is reported, not a fixed policy
    # The twin runs plain decoding in an engine of its own: its ratio to `none` is the noise floor.
    assert all(by[(c, "none#2")]["drafted_share"] == 0 for c in (1, 2))
    assert all(row["none#2_vs_none"] > 0 for row in levels)
    assert all(by[(c, "oracle#2")]["output_tokens"] == by[(c, "oracle")]["output_tokens"] for c in (1, 2))
    assert all(row["oracle#2_vs_oracle"] > 0 for row in levels)
    assert report["meta"]["rounds"] == 2
    assert (out / "frontier.png").stat().st_size > 0 and (out / "verify-budget.png").stat().st_size > 0


def test_bench_serve_refuses_a_policy_named_twice(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    args = ["bench", "serve", "--target", str(target), "--drafter", str(drafter), "--policies", "none,none"]
    result = CliRunner().invoke(main, [*args, "--output-dir", str(tmp_path / "serve")])
    assert result.exit_code != 0 and "none#2" in result.output
    assert not (tmp_path / "serve").exists()


@pytest.mark.parametrize("spec", ["static:x", "bogus#2", "dspark:3"])
def test_bench_serve_refuses_a_malformed_policy_before_loading_the_model(spec, tmp_path):
    # The target does not exist: had the model been loaded first, the error would be about it.
    args = ["bench", "serve", "--target", str(tmp_path / "no-model"), "--policies", f"none,{spec}"]
    result = CliRunner().invoke(main, [*args, "--output-dir", str(tmp_path / "serve")])
    assert result.exit_code == 2 and "--policies" in result.output
    assert ("unknown verify policy" in result.output) or ("integer K >= 0" in result.output)
    assert not (tmp_path / "serve").exists()


def test_output_lengths_spread_evenly_around_the_mean():
    lengths = output_lengths(64, 0.5)
    assert len(lengths) == 64 and min(lengths) == 32 and max(lengths) == 96
    assert sum(lengths) / len(lengths) == pytest.approx(64, abs=0.5)
    assert lengths == output_lengths(64, 0.5) and lengths != sorted(lengths)  # fixed, shuffled order
    assert set(output_lengths(10, 0.0)) == {10}
    with pytest.raises(ValueError, match="spread"):
        output_lengths(64, 1.0)


def test_bench_serve_oracle_needs_greedy_decoding(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    args = ["bench", "serve", "--target", str(target), "--drafter", str(drafter), "--device", "cpu"]
    args += ["--policies", "none,oracle", "--temperature", "0.7", "--output-dir", str(tmp_path / "serve")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "oracle policy needs --temperature 0" in result.output
    assert not (tmp_path / "serve").exists()


def test_bench_serve_refuses_outputs_longer_than_the_context(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    args = ["bench", "serve", "--target", str(target), "--drafter", str(drafter), "--device", "cpu"]
    args += ["--policies", "none", "--concurrency", "1", "--max-tokens", "400", "--max-model-len", "512"]
    result = CliRunner().invoke(main, [*args, "--output-dir", str(tmp_path / "serve")])
    assert (
        result.exit_code == 2 and "plus the longest output (600) exceeds --max-model-len 512" in result.output
    )
    assert not (tmp_path / "serve").exists()


class _ClockedEngine:
    """Takes `step_s` seconds of a fake clock a step (`untimed_s` of them in unclocked probing),
    one token per request per step, 3 tokens each."""

    def __init__(self, now: list[float], name: str, step_s: float, probe_s: float = 0.0) -> None:
        self.now, self.policy, self.step_s, self.probe_s = now, SimpleNamespace(name=name), step_s, probe_s
        self.requests, self.last_step_stats = {}, StepStats()
        if probe_s:
            self.untimed_s = 0.0

    def add_request(self, prompt, params, request_id):
        assert request_id not in self.requests
        self.requests[request_id] = SimpleNamespace(
            request_id=request_id, output_token_ids=[], stats=SimpleNamespace(rounds=0, tau=0.0)
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        self.now[0] += self.step_s
        if self.probe_s:
            self.untimed_s += self.probe_s
        outputs = []
        for rid, r in list(self.requests.items()):
            r.output_token_ids.append(1)
            done = len(r.output_token_ids) == 3
            outputs.append(RequestOutput(rid, [1], "", finished=done))
            if done:
                del self.requests[rid]
        return outputs


def test_bench_serve_steps_the_policies_in_lockstep_on_their_own_clocks(monkeypatch):
    """Loops take engine steps in turn (order rotating), each charged only its own seconds: a slow
    policy's throughput and per-user speed are not diluted by the others' steps, and ids are unique."""
    now = [0.0]
    monkeypatch.setattr(serve.time, "perf_counter", lambda: now[0])
    order = []

    class Engine(_ClockedEngine):
        def __init__(self, name: str, step_s: float) -> None:
            super().__init__(now, name, step_s)

        def step(self):
            order.append(self.policy.name)
            return super().step()

    params = SamplingParams(max_tokens=3)
    engines = [Engine("fast", 0.01), Engine("slow", 0.03)]
    loops = [serve.ClosedLoop(e, [[1]], 2, 4, params, id_prefix=e.policy.name) for e in engines]
    fast, slow = serve.run_lockstep(loops)
    assert order[:4] == ["slow", "fast", "fast", "slow"]  # turn 0 only issues; the order rotates
    assert fast.output_tokens == slow.output_tokens == 12 and fast.requests == slow.requests == 4
    assert fast.seconds == pytest.approx(6 * 0.01) and slow.seconds == pytest.approx(6 * 0.03)
    assert fast.aggregate_tokens_per_s == pytest.approx(3 * slow.aggregate_tokens_per_s)
    assert fast.per_user_p50 == pytest.approx(2 / 0.02) and slow.per_user_p50 == pytest.approx(2 / 0.06)
    assert fast.ttft_p50_s == pytest.approx(0.01) and slow.ttft_p50_s == pytest.approx(0.03)


def test_bench_serve_leaves_the_oracles_probing_off_its_clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(serve.time, "perf_counter", lambda: now[0])
    engines = [_ClockedEngine(now, "none", 0.01), _ClockedEngine(now, "oracle", 0.03, probe_s=0.02)]
    loops = [
        serve.ClosedLoop(e, [[1]], 2, 4, SamplingParams(max_tokens=3), id_prefix=e.policy.name)
        for e in engines
    ]
    plain, oracle = serve.run_lockstep(loops)
    assert oracle.seconds == pytest.approx(plain.seconds) == pytest.approx(6 * 0.01)
    assert oracle.per_user_p50 == pytest.approx(plain.per_user_p50)
    assert engines[1].untimed_s == pytest.approx(6 * 0.02)


def test_bench_serve_runs_plain_decoding_without_the_drafter(tiny_dirs):
    from dspark.policies.factory import build_policy

    from tests.drafters.helpers import PerEngineNgram
    from tests.engine.helpers import engine_on

    base = engine_on(tiny_dirs["llama"], PerEngineNgram(4), "none")
    plain = serve.policy_engine(base, "none", build_policy("none"), 2)
    static = serve.policy_engine(base, "static:1", build_policy("static:1"), 2)
    full = serve.policy_engine(base, "full", build_policy("full"), 2)
    assert plain.drafter.name == "none" and plain.drafter.target_layers == ()
    assert static.config.max_num_seqs == 2
    # Each drafting policy gets its own copy: side by side, one must not do (and be timed for)
    # another's deferred context work.
    assert isinstance(static.drafter, PerEngineNgram) and isinstance(full.drafter, PerEngineNgram)
    assert len({id(base.drafter), id(static.drafter), id(full.drafter)}) == 3
