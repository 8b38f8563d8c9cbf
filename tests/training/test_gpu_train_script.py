"""scripts/gpu_train.sh end to end on the CPU at a tiny budget: corpus growth, the three drafters,
acceptance points and the learning curve, so the script works the first time it meets a GPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import write_tiny_model
from tests.training.conftest import write_prompts

pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _target(root: Path, smollm_dir: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer: bench acceptance needs its chat template."""
    target = write_tiny_model(root / "target", "llama", vocab_size=49152, max_position_embeddings=2048)
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).is_file():
            shutil.copy(smollm_dir / name, target / name)
    return target


def _configs(root: Path, target: Path) -> str:
    for kind in ("dspark", "dflash", "eagle3"):
        drafter = {"kind": kind, "num_layers": 1, "block_size": 7, "markov_rank": 8, "draft_vocab_size": 256}
        cfg = {
            "target": str(target),
            "data_dir": "unused",
            "out_dir": "unused",
            "dtype": "float32",
            "data": {"corpus": ["unused"], "feature_layers": [0, 1]},
            "drafter": {**drafter, "init_from_target_layers": [1]},
            "optim": {"sequences_per_step": 4, "anchors_per_sequence": 4, "warmup_steps": 1},
        }
        (root / f"tiny-{kind}.yaml").write_text(yaml.safe_dump(cfg))
    return str(root / "tiny-KIND.yaml")


def test_gpu_train_script_runs_end_to_end_on_the_cpu(tmp_path, smollm_dir):
    target = _target(tmp_path, smollm_dir)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    prompts = write_prompts(tmp_path / "prompts.jsonl", 24)
    spec = {
        "target": str(target),
        "sources": [f"jsonl:{prompts}"],
        "max_prompt_tokens": 64,
        "max_new_tokens": 24,
        "shard_size": 8,
        "decontaminate": False,
        "require_eval_sets": False,
    }
    (corpus / "corpus.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in ("service", "operator", "loadtest")),
        "OMP_NUM_THREADS": "1",
        "DSPARK_SKIP_INSTALL": "1",
        "OUT": str(out),
        "DEVICE": "cpu",
        "CORPUS": str(corpus),
        "ADD_SHARDS": "2",
        "GEN_BATCH": "8",
        "CONFIGS": _configs(tmp_path, target),
        # The time budget: STEPS comes from the first drafter's probe of 2 x CHECKPOINT_EVERY steps.
        "TRAIN_SECONDS": "1",
        "CHECKPOINT_EVERY": "1",
        "POINTS": "2",
        "EVAL_PROMPTS": "1",
        "EVAL_TOKENS": "16",
    }
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_train.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    log = (out / "log.txt").read_text() if (out / "log.txt").is_file() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "== done" in log, log
    steps = int(re.search(r"steps per drafter: (\d+), a point every (\d+)", log).group(1))
    assert steps >= 2 and steps % 2 == 0  # at least the probe, a whole number of points

    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        f"shard-0000{i}.{ext}" for i in (0, 1) for ext in ("bin", "json")
    ]
    for kind in ("dspark", "dflash", "eagle3"):
        train = out / "train" / kind
        assert (train / "final" / "model.safetensors").is_file() and (train / "state.pt").is_file()
        assert sorted(p.name for p in train.glob("step-*")) == [f"step-{s:06d}" for s in (steps // 2, steps)]
        info = json.loads((train / "final" / "training.json").read_text())
        assert info["steps"] == steps and info["features"] == "online" and info["warm_start"] is None

    curves = json.loads((out / "learning_curve.json").read_text())
    points = curves["points"]
    assert {(p["kind"], p["temperature"], p["step"]) for p in points} == {
        (k, t, s) for k in ("dspark", "dflash", "eagle3") for t in (0.0, 1.0) for s in (steps // 2, steps)
    }
    assert all(p["gamma"] == 7 and 1.0 <= p["macro_tau"] <= 8.0 for p in points)
    tokens = {p["step"]: p["tokens"] for p in points}
    assert 0 < tokens[steps // 2] < tokens[steps]  # the same data for the three drafters: one x per step
    assert len({(p["step"], p["tokens"]) for p in points}) == 2
    assert len(curves["last_point_conditional_acceptance"]) == 6
    assert (out / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
