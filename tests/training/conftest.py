"""A tiny random Llama target with a word-level tokenizer, and a prompt file, for `dspark train`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.conftest import write_tiny_model

WORDS = [
    "the", "a", "cat", "dog", "runs", "jumps", "over", "under", "fast", "slow", "red", "blue",
    "one", "two", "three", "plus", "minus", "equals", "def", "return", "print", "loop", "list", "sum",
]


def write_tiny_tokenizer(path: Path, vocab_size: int = 64) -> None:
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-target")
    write_tiny_model(path, "llama", num_hidden_layers=4, eos_token_id=1, bos_token_id=1, pad_token_id=1)
    write_tiny_tokenizer(path)
    return path


def write_prompts(path: Path, count: int) -> Path:
    rows = []
    for i in range(count):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + i % 5)]
        rows.append({"prompt": " ".join(words), "domain": ("chat", "code", "math")[i % 3]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_config(tmp: Path, target: Path, kind: str, prompts: Path, **optim) -> dict:
    return {
        "target": str(target),
        "data_dir": str(tmp / "data"),
        "out_dir": str(tmp / f"out-{kind}"),
        "device": "cpu",
        "dtype": "float32",
        "data": {
            "sources": [{"source": f"jsonl:{prompts}", "domains": {"chat": 4, "code": 4, "math": 4}}],
            "max_prompt_tokens": 32,
            "max_new_tokens": 24,
            "feature_layers": [0, 2],
            "decontaminate": False,
            "generation_batch": 8,
        },
        "drafter": {"kind": kind, "num_layers": 1, "block_size": 4, "markov_rank": 8, "draft_vocab_size": 48,
                    "init_from_target_layers": [3]},
        "optim": {"max_steps": 6, "sequences_per_step": 4, "anchors_per_sequence": 3, "warmup_steps": 2,
                  "checkpoint_every": 3, **optim},
    }
