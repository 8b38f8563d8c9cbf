"""The command line: help everywhere, clean errors, and a real generation."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner
from dspark.cli import main


def all_commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        yield (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from all_commands(cmd, (*prefix, name))


@pytest.mark.parametrize("path", list(all_commands(main)), ids=" ".join)
def test_every_subcommand_has_help(path):
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_generate_prints_text_and_statistics(smollm_dir):
    """The defaults: the shipped DSpark drafter under the DSpark policy (a small batch budget keeps
    the SPS profile it measures on first use short)."""
    args = ["generate", "--dtype", "float32", "--max-tokens", "6", "--max-batch-tokens", "64"]
    result = CliRunner().invoke(main, [*args, "--max-num-seqs", "4", "What is 2+2?"])
    assert result.exit_code == 0, result.output
    assert "tau" in result.output and "tokens" in result.output
    assert "with drafter dspark, policy dspark" in result.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--target", "no-such-model", "hi"], "unknown model 'no-such-model'"),
        (["--temperature", "-1", "hi"], "temperature"),
        (["--top-p", "1.5", "hi"], "top_p"),
        (["--max-tokens", "0", "hi"], "max_tokens"),
        (["--policy", "static:x", "hi"], "policy: policy 'static:K' needs an integer"),
        (["--gamma", "0", "hi"], "gamma: Input should be greater than or equal to 1"),
        (["--drafter", "no-such-drafter", "hi"], "unknown drafter"),
    ],
)
def test_bad_input_is_a_clean_error(args, message, smollm_dir):
    result = CliRunner().invoke(main, ["generate", *args])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output and "errors.pydantic.dev" not in result.output


def test_prompt_longer_than_the_context_is_refused(smollm_dir):
    result = CliRunner().invoke(
        main, ["generate", "--max-model-len", "64", "--max-tokens", "8", "word " * 80]
    )
    assert result.exit_code != 0 and "maximum context length is 64" in result.output


def test_bench_decode_writes_a_report(smollm_dir, tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "decode",
            "--num-prompts",
            "1",
            "--max-tokens",
            "8",
            "--domains",
            "code",
            "--drafter",
            "dflash",
            "--policy",
            "static:2",
            "--output",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    systems = {row["system"] for row in report["summary"]}
    assert {"engine plain", "engine dflash (static:2)", "HF generate plain"} <= systems
    assert len(report["runs"]) == 10  # five systems, two mirrored repeats
    assert all(r["tokens"] > 0 and r["seconds"] > 0 for r in report["runs"])
