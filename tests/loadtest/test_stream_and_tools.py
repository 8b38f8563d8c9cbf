"""Stream measurement, the server's metrics, target safety, prompts, the Locust command line, the frontier plot."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from dspark.cli import main
from dspark_loadtest import server_metrics
from dspark_loadtest.frontier import FrontierPoint, Series, parse_concurrency, write_frontier
from dspark_loadtest.prompts import PromptSampler
from dspark_loadtest.runner import child_env, locust_command
from dspark_loadtest.safety import check_target, is_loopback
from dspark_loadtest.stream import RequestSample, StreamError, StreamMeter
from dspark_loadtest.tiers import Workload, load_tiers


def sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n".encode()


def chat_chunk(n_tokens: int, text: str = "x") -> dict:
    lps = {"content": [{"token": "x", "logprob": -0.1, "top_logprobs": []}] * n_tokens}
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "logprobs": lps}],
    }


def meter() -> StreamMeter:
    return StreamMeter(RequestSample(api="chat", domain="code", start=0.0), sent_at=10.0)


# Stream measurement -------------------------------------------------------------------------------
def test_multi_token_chunks_are_counted_and_their_gap_split():
    m = meter()
    m.feed(sse(chat_chunk(1)), 10.5)  # first token: TTFT 0.5 s
    m.feed(b"\n", 10.5)
    m.feed(sse(chat_chunk(3)), 10.8)  # a speculative step delivering three tokens
    m.feed(sse(chat_chunk(1)), 10.9)
    m.feed(sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}), 10.9)
    m.feed(sse("[DONE]"), 10.95)
    s = m.finish(11.0)
    assert s.ok and s.ttft_s == pytest.approx(0.5) and s.e2e_s == pytest.approx(1.0)
    assert s.output_tokens == 5 and s.prompt_tokens == 7 and s.chunks == 3
    assert s.itl_s == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert (
        s.decode_s == pytest.approx(0.4)
        and s.tpot_s == pytest.approx(0.1)
        and s.tokens_per_s == pytest.approx(10)
    )
    assert s.tokens_per_chunk == pytest.approx(5 / 3)


def test_completion_chunks_and_chunks_without_logprobs():
    m = StreamMeter(RequestSample(api="completions", domain="math", start=0.0), sent_at=0.0)
    m.feed(
        sse({"choices": [{"text": "a", "logprobs": {"tokens": ["a", "b"], "token_logprobs": [0, 0]}}]}), 0.2
    )
    m.feed(sse({"choices": [{"text": "c", "logprobs": None}]}), 0.3)  # no logprobs: one token per text chunk
    m.feed(sse({"choices": [{"text": "", "logprobs": None, "finish_reason": "length"}]}), 0.3)
    m.feed(sse("[DONE]"), 0.3)
    s = m.finish(0.3)
    assert s.output_tokens == 3 and s.chunks == 2 and s.chunk_gaps == [(pytest.approx(0.1), 1)]


def test_stream_errors_and_truncation_raise():
    m = meter()
    with pytest.raises(StreamError, match="generation failed"):
        m.feed(sse({"error": {"message": "generation failed", "type": "internal_error"}}), 10.1)
    with pytest.raises(StreamError, match="malformed"):
        meter().feed(b"data: {not json\n", 10.1)
    m = meter()
    m.feed(sse(chat_chunk(1)), 10.2)
    with pytest.raises(StreamError, match="without \\[DONE\\]"):
        m.finish(10.3)
    cut = m.cut(10.3)  # the run ended mid-stream: what was seen is kept
    assert cut.cut and not cut.ok and cut.ttft_s == pytest.approx(0.2) and cut.output_tokens == 1


# The server's metrics -----------------------------------------------------------------------------
def _exposition(count: int, total: float, buckets: dict[str, int], accepted: int) -> str:
    lines = ["# TYPE vllm:time_to_first_token_seconds histogram"]
    lines += [
        f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {c}'
        for le, c in buckets.items()
    ]
    lines += [
        f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {count}',
        f'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {total}',
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {4 * count}',
        "# TYPE vllm:spec_decode_num_drafts counter",
        f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {count}',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}',
    ]
    return "\n".join(lines) + "\n"


def test_server_view_is_the_delta_of_two_scrapes():
    before = server_metrics.parse(_exposition(2, 1.0, {"0.1": 0, "0.5": 2, "1.0": 2, "+Inf": 2}, 3))
    after = server_metrics.parse(_exposition(12, 4.0, {"0.1": 0, "0.5": 6, "1.0": 12, "+Inf": 12}, 23))
    v = server_metrics.server_view(before, after)
    assert v.requests == 10 and v.ttft_mean_s == pytest.approx(0.3)
    # 4 of 10 in (0.1, 0.5], 6 in (0.5, 1.0]: the median lies 1/6 into the second bucket
    assert v.ttft_p50_s == pytest.approx(0.5 + 0.5 / 6)
    assert v.acceptance_rate == pytest.approx(20 / 40) and v.mean_accepted_per_draft == pytest.approx(2.0)
    assert server_metrics.scrape("http://127.0.0.1:9", timeout_s=1) is None  # nothing listens: no view


# Targets ------------------------------------------------------------------------------------------
def test_targets_default_to_loopback_and_others_need_the_user():
    assert (
        is_loopback("http://localhost:8000")
        and is_loopback("http://[::1]:8000")
        and is_loopback("http://127.0.0.2")
    )
    assert check_target("http://127.0.0.1:8000/", user_given=False) == "http://127.0.0.1:8000"
    assert check_target("http://dspark.ns.svc:8000", user_given=True) == "http://dspark.ns.svc:8000"
    with pytest.raises(ValueError, match="not given with --host"):
        check_target("http://10.0.0.5:8000", user_given=False)
    for bad in ("ftp://127.0.0.1", "127.0.0.1:8000", "http://u:p@127.0.0.1", "http://127.0.0.1/v1"):
        with pytest.raises(ValueError):
            check_target(bad, user_given=True)


def test_cli_rejects_bad_hosts_tiers_and_labels_before_sending_anything(tmp_path):
    r = CliRunner().invoke(main, ["loadtest", "run", "--host", "ftp://127.0.0.1"])
    assert r.exit_code == 2 and "http(s) URL" in r.output
    r = CliRunner().invoke(main, ["loadtest", "run", "--tier", "gold"])
    assert r.exit_code == 1 and "no tier 'gold'" in r.output
    r = CliRunner().invoke(main, ["loadtest", "frontier", "--label", "a", "--label", "b"])
    assert r.exit_code == 2 and "2 labels for 1 hosts" in r.output
    r = CliRunner().invoke(main, ["loadtest", "frontier", "--concurrency", "0,2"])
    assert r.exit_code == 2 and "positive integers" in r.output
    r = CliRunner().invoke(main, ["loadtest", "tiers"])
    assert r.exit_code == 0 and "interactive" in r.output and "TTFT p95 <= 0.5 s" in r.output


def test_a_run_that_cannot_measure_exits_2_without_a_report(tmp_path):
    """Real Locust process, nothing listening: the model lookup fails, the shape ends the run at once."""
    r = CliRunner().invoke(
        main,
        [
            "loadtest",
            "run",
            "--host",
            "http://127.0.0.1:9",
            "--concurrency",
            "1",
            "--duration",
            "30",
            "--out",
            str(tmp_path),
        ],
    )
    assert r.exit_code == 2
    assert not (tmp_path / "interactive_sla.json").exists() and (tmp_path / "interactive_stats.csv").exists()


# Prompts ------------------------------------------------------------------------------------------
def test_prompt_mix_and_length():
    sampler = PromptSampler(Workload(mix={"math": 3, "code": 0, "chat": 1}, promptWords=120), seed=1)
    drawn = [sampler.sample() for _ in range(200)]
    domains = [d for d, _ in drawn]
    assert "code" not in domains and 0.6 < domains.count("math") / len(domains) < 0.9
    assert all(len(p.split()) >= 120 for _, p in drawn)
    again = PromptSampler(Workload(mix={"math": 3, "code": 0, "chat": 1}, promptWords=120), seed=1)
    assert [again.sample() for _ in range(200)] == drawn
    short = PromptSampler(Workload(mix={"code": 1}), seed=0).sample()
    assert short[0] == "code" and not short[1].startswith("Earlier questions")


# Locust command line ------------------------------------------------------------------------------
def test_locust_command_is_bounded_and_keeps_the_key_off_the_command_line(tmp_path):
    cmd = locust_command(
        "http://127.0.0.1:8000", tmp_path / "x", 20, {"tier": "batch", "concurrency": None, "prompt_words": 0}
    )
    assert "--headless" in cmd and cmd[cmd.index("--stop-timeout") + 1] == "5"
    assert cmd[cmd.index("--tier") + 1] == "batch" and "--concurrency" not in cmd
    assert cmd[cmd.index("--prompt-words") + 1] == "0"
    web = locust_command("http://127.0.0.1:8000", tmp_path / "x", 20, {}, web_port=8089)
    assert web[web.index("--web-host") + 1] == "127.0.0.1" and "--autoquit" in web and "--headless" not in web
    assert child_env("secret")["DSPARK_API_KEY"] == "secret"


# Frontier -----------------------------------------------------------------------------------------
def test_frontier_files_with_two_servers(tmp_path):
    def points(scale: float) -> list[FrontierPoint]:
        return [
            FrontierPoint(c, scale * 30 * c**0.8, scale * 30 / c**0.2, scale * 25 / c**0.2, 0.1 * c, 10, 0, 1)
            for c in (1, 2, 4, 8)
        ]

    series = [
        Series("dspark", "http://127.0.0.1:8000", points(1.3)),
        Series("static:4", "http://127.0.0.1:8001", points(1.0)),
    ]
    json_path, png_path = write_frontier(series, list(load_tiers().tiers), tmp_path, {"duration_s": 15})
    doc = json.loads(json_path.read_text())
    assert [s["label"] for s in doc["series"]] == ["dspark", "static:4"] and len(
        doc["series"][0]["points"]
    ) == 4
    assert doc["tiers"][0] == {
        "name": "interactive",
        "tokensPerSecondPerUser": 60,
        "tokensPerSecondPerUserP10": 40,
        "ttftP95Seconds": 0.5,
    }
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 10_000
    assert parse_concurrency("8, 1,2,2") == [1, 2, 8]
    with pytest.raises(ValueError, match="comma-separated"):
        parse_concurrency("1,two")
