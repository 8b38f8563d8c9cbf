"""The self-distilled corpus on disk: numbered, append-only shards of token ids with a JSON manifest.

A shard is two files in the corpus directory:

- `shard-NNNNN.bin`: the token ids of its responses, each stored as prompt ids then response ids,
  concatenated, little-endian `uint16` (`uint32` for a vocabulary above 65,535 ids);
- `shard-NNNNN.json`: a `ShardManifest`: which target (name, weights and tokenizer hashes) wrote
  it, which prompts (prompt set, index range) it answers, how, and per response its prompt index,
  domain, source, temperature, seed, finish reason and token offsets; plus the .bin's sha256 and
  length, so a truncated or altered shard is recognised.

Both are written to a temporary name and renamed, the .bin first, so a shard exists only complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

FORMAT = "dspark-selfdistill-v1"
SHARD_NAME = re.compile(r"^shard-(\d{5})\.json$")
UINT16_MAX_VOCAB = 65_535  # ids 0..65,534 are stored as uint16; a larger vocabulary takes uint32


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetIdentity(_Strict):
    """What a shard's tokens depend on: another target, weights or tokenizer makes them foreign."""

    target: str = Field(description="Model name (or the directory name of a path target).")
    weights_sha256: str = Field(
        description="sha256 of the upstream weights file of a pulled model, else over its *.safetensors."
    )
    tokenizer_sha256: str = Field(
        description="sha256 of the tokenizer's vocabulary, merges, special tokens and chat template."
    )
    vocab_size: int = Field(ge=1)


class PromptSet(_Strict):
    name: str = Field(description="The corpus spec's prompt set: its sources and filters.")
    order_sha256: str = Field(
        description="sha256 of the whole seeded prompt order (texts, domains, sources)."
    )
    size: int = Field(ge=0, description="Prompts in the order.")


class Generation(_Strict):
    max_new_tokens: int
    greedy_fraction: float
    temperature: float
    seed: int
    dtype: str
    device: str


class ResponseRecord(_Strict):
    index: int = Field(description="Position in the prompt order.")
    domain: str
    source: str
    temperature: float
    seed: int
    finish_reason: str
    offset: int = Field(description="First token (the prompt's first) in the .bin, in tokens.")
    prompt_len: int
    response_len: int


class ShardManifest(_Strict):
    format: str = FORMAT
    shard: int
    identity: TargetIdentity
    prompt_set: PromptSet
    prompt_range: tuple[int, int] = Field(description="[first, last + 1) prompt indices answered.")
    generation: Generation
    dtype: str = Field(description="numpy dtype of the .bin: <u2 or <u4.")
    num_tokens: int
    bin_sha256: str
    responses: list[ResponseRecord]


class ShardError(ValueError):
    """A shard cannot be used: unreadable, truncated, corrupt, or written for another target."""


class CorruptShard(ShardError):
    """Truncated or altered files (skippable with --skip-bad-shards)."""


class ForeignShard(ShardError):
    """A well-formed shard of another target, tokenizer or weights (never skipped silently)."""


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    domain: str
    source: str
    temperature: float
    finish_reason: str
    index: int


def token_dtype(vocab_size: int) -> str:
    return "<u2" if vocab_size <= UINT16_MAX_VOCAB else "<u4"


def shard_paths(corpus_dir: Path, shard: int) -> tuple[Path, Path]:
    stem = f"shard-{shard:05d}"
    return corpus_dir / f"{stem}.bin", corpus_dir / f"{stem}.json"


def shard_numbers(corpus_dir: Path) -> list[int]:
    """Shards present (by their manifest), ascending."""
    if not corpus_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in corpus_dir.iterdir() if (m := SHARD_NAME.match(p.name)))


def _sha256_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def target_identity(name: str, model_dir: Path) -> TargetIdentity:
    """Fingerprints of a target's weights and tokenizer that do not depend on how its directory
    was written, so a fresh clone's conversion of the same model matches the committed shards.

    Weights: a model pulled by name records the sha256 of the upstream file it was converted
    from (verified on download); another directory is hashed over its *.safetensors files.
    Tokenizer: the vocabulary, merges, special tokens and chat template, not the file bytes.
    """
    from dspark.models.pull import READY_MARKER

    marker = model_dir / READY_MARKER
    if marker.is_file():
        weights_sha = json.loads(marker.read_text())["sha256"]
    else:
        weights = sorted(model_dir.glob("*.safetensors"))
        if not weights:
            raise ShardError(f"{model_dir}: no *.safetensors weights to hash")
        weights_sha = _sha256_files(weights)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return TargetIdentity(
        target=name,
        weights_sha256=weights_sha,
        tokenizer_sha256=tokenizer_fingerprint(model_dir),
        vocab_size=int(vocab),
    )


def tokenizer_fingerprint(model_dir: Path) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    # tokenizers writes merges as "a b" strings in older versions and as pairs in newer ones.
    merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model.get("merges", [])]
    payload = {
        "type": model.get("type"),
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
        "merges": merges,
        "special": sorted(map(str, tokenizer.all_special_tokens)),
        "chat_template": tokenizer.chat_template,
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def write_shard(corpus_dir: Path, manifest: ShardManifest, samples: list[Sample]) -> tuple[Path, Path]:
    """Write shard `manifest.shard` atomically; the manifest's token fields are filled in here."""
    bin_path, json_path = shard_paths(corpus_dir, manifest.shard)
    if json_path.exists():
        raise ShardError(f"{json_path} already exists; shards are append-only")
    dtype = token_dtype(manifest.identity.vocab_size)
    tokens = np.asarray(
        [t for s in samples for t in (*s.prompt_ids, *s.response_ids)], dtype=np.int64
    ).astype(dtype)
    data = tokens.tobytes()
    corpus_dir.mkdir(parents=True, exist_ok=True)
    manifest = manifest.model_copy(
        update={"dtype": dtype, "num_tokens": len(tokens), "bin_sha256": hashlib.sha256(data).hexdigest()}
    )
    atomic_write(bin_path, data)
    atomic_write(json_path, (json.dumps(manifest.model_dump(mode="json"), indent=1) + "\n").encode())
    return bin_path, json_path


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temp file, synced, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_manifest(json_path: Path) -> ShardManifest:
    try:
        raw = json.loads(json_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptShard(f"{json_path.name}: manifest unreadable ({exc})") from None
    try:
        manifest = ShardManifest.model_validate(raw)
    except ValidationError as exc:
        raise CorruptShard(f"{json_path.name}: manifest malformed ({exc.errors()[0]['msg']})") from None
    if manifest.format != FORMAT:
        raise CorruptShard(f"{json_path.name}: format {manifest.format!r}, expected {FORMAT!r}")
    return manifest


def check_identity(name: str, found: TargetIdentity, expected: TargetIdentity) -> None:
    """Refuse a shard of another target, tokenizer or weights, naming what differs."""
    diffs = [
        f"{field} {getattr(found, field)!r} (expected {getattr(expected, field)!r})"
        for field in ("target", "weights_sha256", "tokenizer_sha256", "vocab_size")
        if getattr(found, field) != getattr(expected, field)
    ]
    if diffs:
        raise ForeignShard(f"{name} was written for another target: " + "; ".join(diffs))


def read_shard(json_path: Path, expected: TargetIdentity | None = None) -> tuple[ShardManifest, list[Sample]]:
    """A shard's manifest and samples, checked against the target identity and its .bin hash."""
    manifest = read_manifest(json_path)
    if expected is not None:
        check_identity(json_path.name, manifest.identity, expected)
    bin_path = json_path.with_suffix(".bin")
    if not bin_path.is_file():
        raise CorruptShard(f"{bin_path.name}: missing (its manifest {json_path.name} is there)")
    data = bin_path.read_bytes()
    width = np.dtype(manifest.dtype).itemsize
    if len(data) != manifest.num_tokens * width:
        raise CorruptShard(
            f"{bin_path.name}: {len(data)} bytes, the manifest says {manifest.num_tokens} tokens of "
            f"{width} bytes (truncated?)"
        )
    if hashlib.sha256(data).hexdigest() != manifest.bin_sha256:
        raise CorruptShard(f"{bin_path.name}: sha256 differs from its manifest (corrupt)")
    tokens = np.frombuffer(data, dtype=manifest.dtype).astype(np.int64)
    samples = []
    for r in manifest.responses:
        end = r.offset + r.prompt_len + r.response_len
        if r.offset < 0 or end > len(tokens):
            raise CorruptShard(f"{json_path.name}: response {r.index} lies outside the .bin")
        split = r.offset + r.prompt_len
        samples.append(
            Sample(
                tokens[r.offset : split].tolist(),
                tokens[split:end].tolist(),
                r.domain,
                r.source,
                r.temperature,
                r.finish_reason,
                r.index,
            )
        )
    return manifest, samples


@dataclass
class LoadedShard:
    path: Path  # the manifest
    manifest: ShardManifest
    samples: list[Sample]


def load_corpus(
    corpus_dir: Path, expected: TargetIdentity | None, skip_bad: bool = False
) -> list[LoadedShard]:
    """Every shard of a corpus directory. A foreign shard is always an error; a corrupt one is an
    error unless `skip_bad`, and then it is logged by file name and left out."""
    loaded = []
    for number in shard_numbers(corpus_dir):
        _, json_path = shard_paths(corpus_dir, number)
        try:
            manifest, samples = read_shard(json_path, expected)
        except CorruptShard as exc:
            if not skip_bad:
                raise CorruptShard(f"{corpus_dir}: {exc} (--skip-bad-shards leaves it out)") from None
            log.warning("skipping bad shard %s: %s", json_path, exc)
            continue
        except ForeignShard as exc:
            raise ForeignShard(f"{corpus_dir}: {exc}") from None
        loaded.append(LoadedShard(json_path, manifest, samples))
    return loaded
