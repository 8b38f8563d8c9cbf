"""The self-distilled corpus: deterministic shards, resuming, refusing foreign and corrupt shards,
and `dspark train` reading shards instead of generating."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from dspark.cli import main
from dspark.training import prompt_order
from dspark.training.corpus import SPEC_FILE, add_shards
from dspark.training.prompt_order import ORDER_FILE
from dspark.training.shards import (
    CorruptShard,
    ForeignShard,
    Generation,
    PromptSet,
    ResponseRecord,
    Sample,
    ShardError,
    ShardManifest,
    TargetIdentity,
    load_corpus,
    read_shard,
    target_identity,
    token_dtype,
    write_shard,
)

from tests.training.conftest import tiny_config, write_prompts

SHARD = 5  # prompts per shard in these tests


def _corpus(root: Path, target: Path, prompts: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    spec = {
        "target": str(target),
        "sources": [f"jsonl:{prompts}"],
        "max_prompt_tokens": 32,
        "max_new_tokens": 12,
        "shard_size": SHARD,
        "decontaminate": False,
        "require_eval_sets": False,
    }
    (root / SPEC_FILE).write_text(yaml.safe_dump(spec))
    return root


def _add(corpus: Path, count: int, tmp: Path, **kw):
    return add_shards(
        corpus, count, device="cpu", dtype="float32", batch=4, work_dir=tmp / "work", progress=False, **kw
    )


@pytest.fixture
def prompts(tmp_path) -> Path:
    return write_prompts(tmp_path / "prompts.jsonl", 24)


def test_shards_cover_fixed_prompt_ranges_and_regenerate_identically(tmp_path, tiny_target, prompts):
    a = _corpus(tmp_path / "a", tiny_target, prompts)
    b = _corpus(tmp_path / "b", tiny_target, prompts)
    report = _add(a, 2, tmp_path / "ra")
    assert report.shards == [0, 1] and report.new_tokens > 0 and report.tokens_per_s > 0
    _add(b, 2, tmp_path / "rb")
    for name in ("shard-00000.bin", "shard-00000.json", "shard-00001.bin", "shard-00001.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name

    identity = target_identity(tiny_target.name, tiny_target)
    manifest, samples = read_shard(a / "shard-00001.json", identity)
    assert manifest.prompt_range == (5, 10) and manifest.dtype == "<u2"
    assert [r.index for r in manifest.responses] == list(range(5, 10))
    assert {r.finish_reason for r in manifest.responses} <= {"stop", "length"}
    assert {r.temperature for r in manifest.responses} <= {0.0, 1.0}
    assert len({r.seed for r in manifest.responses}) == SHARD
    assert all(0 < len(s.response_ids) <= 12 for s in samples)
    assert (
        manifest.responses[1].offset == manifest.responses[0].prompt_len + manifest.responses[0].response_len
    )
    assert (a / "shard-00001.bin").stat().st_size == 2 * manifest.num_tokens

    # A later run adds the next shard only, leaving 0 and 1 untouched.
    before = (a / "shard-00000.bin").read_bytes()
    assert _add(a, 1, tmp_path / "ra").shards == [2]
    assert read_shard(a / "shard-00002.json")[0].prompt_range == (10, 15)
    assert (a / "shard-00000.bin").read_bytes() == before


def test_an_interrupted_run_resumes_without_duplicates_or_losses(tmp_path, tiny_target, prompts):
    corpus = _corpus(tmp_path / "c", tiny_target, prompts)
    stopped = _add(corpus, 2, tmp_path, stop_after_responses=3)
    assert stopped.shards == [] and not list(corpus.glob("shard-*"))
    partials = sorted((tmp_path / "work" / "c").glob("*.partial.jsonl"))
    kept = {
        row["index"]: row["response_ids"]
        for p in partials
        for row in map(json.loads, p.read_text().splitlines()[1:])
    }
    assert len(kept) >= 3
    # The interruption may cut a line in half: it is dropped, not read as a response.
    with open(partials[0], "a") as f:
        f.write('{"index": 1, "finish_rea')

    assert _add(corpus, 2, tmp_path).shards == [0, 1]
    indices = []
    for n in (0, 1):
        manifest, samples = read_shard(corpus / f"shard-{n:05d}.json")
        indices += [r.index for r in manifest.responses]
        for s in samples:
            if s.index in kept:  # responses finished before the interruption are kept as they were
                assert s.response_ids == kept[s.index]
    assert indices == list(range(10))
    assert not list((tmp_path / "work" / "c").glob("*.partial.jsonl"))


def test_the_prompt_order_is_cached_and_travels_with_the_work_dir(
    tmp_path, tiny_target, prompts, monkeypatch, caplog
):
    a = _corpus(tmp_path / "a", tiny_target, prompts)
    _add(a, 1, tmp_path / "ra")
    cached = tmp_path / "ra" / "work" / "a" / ORDER_FILE
    assert cached.is_file()

    def no_sources(spec):
        raise AssertionError(f"source {spec} read although the order is cached")

    monkeypatch.setattr(prompt_order, "load_source", no_sources)
    assert _add(a, 1, tmp_path / "ra").shards == [1]
    # Another machine without the sources: the copied cache gives the same order, so the same shards.
    b = _corpus(tmp_path / "b", tiny_target, prompts)
    (tmp_path / "rb" / "work" / "b").mkdir(parents=True)
    shutil.copy(cached, tmp_path / "rb" / "work" / "b" / ORDER_FILE)
    assert _add(b, 2, tmp_path / "rb").shards == [0, 1]
    for name in ("shard-00000.bin", "shard-00001.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name

    # A damaged cache, or one for another prompt file, is rebuilt from the sources (said in the log).
    cached.write_bytes(cached.read_bytes()[:40])
    with pytest.raises(AssertionError, match="read although the order is cached"):
        _add(a, 1, tmp_path / "ra")
    assert "unreadable" in caplog.text
    monkeypatch.undo()
    assert _add(a, 1, tmp_path / "ra").shards == [2]
    prompts.write_text(prompts.read_text() + json.dumps({"prompt": "one more", "domain": "chat"}) + "\n")
    caplog.clear()
    with pytest.raises(ShardError, match="answers another prompt order"):
        _add(a, 1, tmp_path / "ra")
    assert "another spec, tokenizer or prompt file" in caplog.text


def _synthetic_manifest(shard: int, vocab: int, samples: list[Sample]) -> ShardManifest:
    records, offset = [], 0
    for s in samples:
        records.append(
            ResponseRecord(
                index=s.index,
                domain=s.domain,
                source=s.source,
                temperature=s.temperature,
                seed=s.index,
                finish_reason=s.finish_reason,
                offset=offset,
                prompt_len=len(s.prompt_ids),
                response_len=len(s.response_ids),
            )
        )
        offset += len(s.prompt_ids) + len(s.response_ids)
    return ShardManifest(
        shard=shard,
        identity=TargetIdentity(target="t", weights_sha256="w", tokenizer_sha256="k", vocab_size=vocab),
        prompt_set=PromptSet(name="p", order_sha256="o", size=len(samples)),
        prompt_range=(0, len(samples)),
        generation=Generation(
            max_new_tokens=8, greedy_fraction=0.3, temperature=1.0, seed=0, dtype="float32", device="cpu"
        ),
        dtype="",
        num_tokens=0,
        bin_sha256="",
        responses=records,
    )


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(49_152, "<u2"), (65_535, "<u2"), (65_536, "<u4"), (151_936, "<u4")]
)
def test_token_width_follows_the_vocabulary(tmp_path, vocab, dtype):
    assert token_dtype(vocab) == dtype
    samples = [Sample([1, vocab - 1], [vocab - 2, 0, 7], "code", "s", 1.0, "stop", 0)]
    write_shard(tmp_path, _synthetic_manifest(0, vocab, samples), samples)
    manifest, back = read_shard(tmp_path / "shard-00000.json")
    assert manifest.dtype == dtype and back == samples
    assert (tmp_path / "shard-00000.bin").stat().st_size == 5 * np.dtype(dtype).itemsize
    with pytest.raises(ValueError, match="append-only"):
        write_shard(tmp_path, _synthetic_manifest(0, vocab, samples), samples)


@pytest.mark.parametrize(
    ("field", "value"),
    [("target", "another-model"), ("weights_sha256", "0" * 64), ("tokenizer_sha256", "1" * 64)],
)
def test_a_shard_of_another_target_is_refused_naming_the_mismatch(
    tmp_path, tiny_target, prompts, field, value
):
    corpus = _corpus(tmp_path / "c", tiny_target, prompts)
    _add(corpus, 1, tmp_path)
    path = corpus / "shard-00000.json"
    raw = json.loads(path.read_text())
    raw["identity"][field] = value
    path.write_text(json.dumps(raw))
    identity = target_identity(tiny_target.name, tiny_target)
    with pytest.raises(
        ForeignShard, match=rf"shard-00000.json was written for another target: {field} '{value}'"
    ):
        load_corpus(corpus, identity)
    with pytest.raises(ForeignShard, match=field):  # even with the flag for corrupt shards
        load_corpus(corpus, identity, skip_bad=True)
    with pytest.raises(ForeignShard, match=field):  # and it is not extended either
        _add(corpus, 1, tmp_path)

    result = _train(tmp_path, tiny_target, corpus, "--data-only", "--skip-bad-shards", "--features", "cached")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert f"shard-00000.json was written for another target: {field}" in result.output


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-bin", "bad-json"])
def test_a_corrupt_shard_is_reported_and_skipped_only_with_the_flag(
    tmp_path, tiny_target, prompts, damage, caplog
):
    corpus = _corpus(tmp_path / "c", tiny_target, prompts)
    _add(corpus, 2, tmp_path)
    bin_path, json_path = corpus / "shard-00001.bin", corpus / "shard-00001.json"
    data = bin_path.read_bytes()
    if damage == "truncate":
        bin_path.write_bytes(data[:-3])
    elif damage == "flip":
        bin_path.write_bytes(data[:4] + bytes([data[4] ^ 1]) + data[5:])
    elif damage == "no-bin":
        bin_path.unlink()
    else:
        json_path.write_text(json_path.read_text()[:100])
    name = "shard-00001.json" if damage == "bad-json" else "shard-00001.bin"
    identity = target_identity(tiny_target.name, tiny_target)
    with pytest.raises(CorruptShard, match=rf"{name}.*--skip-bad-shards"):
        load_corpus(corpus, identity)
    with caplog.at_level(logging.WARNING):
        shards = load_corpus(corpus, identity, skip_bad=True)
    assert [s.manifest.shard for s in shards] == [0]
    assert name in caplog.text

    result = _train(tmp_path, tiny_target, corpus, "--data-only")
    assert result.exit_code != 0 and "Traceback" not in result.output and name in result.output
    result = _train(tmp_path, tiny_target, corpus, "--data-only", "--skip-bad-shards", "--features", "cached")
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "data" / "corpus-features").iterdir())) == 1


def _train(tmp: Path, target: Path, corpus: Path, *args: str):
    config = tiny_config(tmp, target, "dspark", tmp / "unused.jsonl")
    config["data"]["sources"] = []
    config["data"]["corpus"] = [str(corpus)]
    path = tmp / "corpus-train.yaml"
    path.write_text(yaml.safe_dump(config))
    return CliRunner().invoke(main, ["train", str(path), "--no-progress", *args])


def test_train_reads_the_shards_and_generates_nothing(tmp_path, tiny_target, prompts):
    corpus = _corpus(tmp_path / "c", tiny_target, prompts)
    result = CliRunner().invoke(
        main,
        ["train", "data", "--add-shards", "2", "--corpus", str(corpus), "--device", "cpu", "--dtype", "float32",
         "--batch", "4", "--work-dir", str(tmp_path / "work"), "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "2 shards written" in result.output and "tokens/s" in result.output

    result = _train(tmp_path, tiny_target, corpus, "--features", "cached")
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert (tmp_path / "out-dspark" / "final" / "model.safetensors").is_file()
    data = tmp_path / "data"
    assert not (data / "samples.jsonl").exists() and not (data / "prompts.jsonl").exists()
    features = sorted((data / "corpus-features").iterdir())
    assert [f.name.split("-")[1:3] for f in features] == [["shard", "00000"], ["shard", "00001"]]

    # A grown corpus adds feature shards for its new shard only.
    stamp = (features[0] / "features-00000.safetensors").stat().st_mtime_ns
    _add(corpus, 1, tmp_path)
    assert _train(tmp_path, tiny_target, corpus, "--data-only", "--features", "cached").exit_code == 0
    assert len(list((data / "corpus-features").iterdir())) == 3
    assert (features[0] / "features-00000.safetensors").stat().st_mtime_ns == stamp


def test_a_corpus_past_its_prompts_is_a_clear_error(tmp_path, tiny_target, prompts):
    corpus = _corpus(tmp_path / "c", tiny_target, prompts)  # 24 prompts: shards 0..4
    result = CliRunner().invoke(
        main,
        ["train", "data", "--add-shards", "6", "--corpus", str(corpus), "--device", "cpu", "--no-progress"],
    )
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "shard 5 is past its end" in result.output
    result = CliRunner().invoke(
        main, ["train", "data", "--add-shards", "1", "--corpus", str(tmp_path / "none")]
    )
    assert result.exit_code != 0 and "has no corpus.yaml" in result.output


def test_the_target_identity_ignores_how_its_files_were_written(tmp_path, tiny_target):
    import shutil

    copy = Path(shutil.copytree(tiny_target, tmp_path / "copy"))
    raw = json.loads((copy / "tokenizer.json").read_text())
    (copy / "tokenizer.json").write_text(
        json.dumps(raw, indent=4, sort_keys=True)
    )  # other bytes, same tokenizer
    base = target_identity("t", tiny_target)
    assert target_identity("t", copy).tokenizer_sha256 == base.tokenizer_sha256

    raw["model"]["vocab"]["w63"], raw["model"]["vocab"]["w62"] = 62, 63  # another tokenizer
    (copy / "tokenizer.json").write_text(json.dumps(raw))
    assert target_identity("t", copy).tokenizer_sha256 != base.tokenizer_sha256

    # A model pulled by name is identified by the verified upstream file it was converted from.
    (copy / "dspark-model.json").write_text(json.dumps({"name": "t", "source": "w==1", "sha256": "ab" * 32}))
    assert target_identity("t", copy).weights_sha256 == "ab" * 32
    assert base.weights_sha256 != "ab" * 32
