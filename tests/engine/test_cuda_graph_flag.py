"""`--cuda-graphs/--no-cuda-graphs` reaches EngineConfig; the field's default follows the device."""

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
    click.echo(repr(engine_config.cuda_graphs))


@pytest.mark.parametrize(
    "args,expected", [([], "None"), (["--no-cuda-graphs"], "False"), (["--cuda-graphs"], "True")]
)
def test_flag_sets_the_field(args, expected):
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
