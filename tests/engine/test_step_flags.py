"""`--cuda-graphs/--no-cuda-graphs` and `--compile/--no-compile` reach EngineConfig; the
defaults follow the device."""

from __future__ import annotations

import click
import pytest
import torch
from click.testing import CliRunner
from dspark.commands.options import engine_options
from dspark.engine.config import EngineConfig


@click.command()
@engine_options
def show(engine_config: EngineConfig) -> None:
    click.echo(f"{engine_config.cuda_graphs} {engine_config.compile}")


@pytest.mark.parametrize(
    "args,expected",
    [
        ([], "None None"),
        (["--no-cuda-graphs"], "False None"),
        (["--cuda-graphs"], "True None"),
        (["--compile"], "None True"),
        (["--no-compile", "--cuda-graphs"], "True False"),
    ],
)
def test_flags_set_the_fields(args, expected):
    result = CliRunner().invoke(show, args)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == expected


def test_default_is_on_for_cuda_only():
    config = EngineConfig()
    assert config.static_steps(torch.device("cuda")) and not config.static_steps(torch.device("cpu"))
    assert not EngineConfig(cuda_graphs=False).static_steps(torch.device("cuda"))
    assert EngineConfig(cuda_graphs=True).static_steps(torch.device("cpu"))


def test_bucket_sizes_are_validated():
    assert EngineConfig(cuda_graph_batch_sizes=(8, 1, 8)).cuda_graph_batch_sizes == (1, 8)
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(cuda_graph_batch_sizes=(0, 4))
    with pytest.raises(ValueError):
        EngineConfig(cuda_graph_batch_sizes=())
