"""The self-distilled corpus of one target: its spec, its seeded prompt order, and adding shards.

A corpus directory (e.g. `data/selfdistill/smollm2-135m/`) holds `corpus.yaml` (a `CorpusSpec`)
and the shards (`shards.py`). The spec's sources, filtered (duplicates, evaluation overlap, prompts
longer than `max_prompt_tokens`) and shuffled with its seed, give one fixed prompt order; shard N
answers prompts [N * shard_size, (N + 1) * shard_size) of it. So any machine can add shard N + 1
without redoing 0..N, and the order's hash in every manifest makes sure it was the same order.
The order is cached in the work directory (`prompt_order.py`).

Generation runs the engine's plain decoding (no drafter) at a large batch, feeding requests so the
batch stays full across shard boundaries. Each finished response is appended to a partial file
under `work_dir`; a shard is written (atomically) once all its responses are in, so an interrupted
run resumes from the partial files without losing or repeating a response.
"""

from __future__ import annotations

import ctypes
import json
import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import yaml
from dspark.training.prompt_order import PromptOrder, cached_prompt_order
from dspark.training.prompts import NoUsableData
from dspark.training.shards import (
    Generation,
    PromptSet,
    ResponseRecord,
    Sample,
    ShardError,
    ShardManifest,
    TargetIdentity,
    check_identity,
    read_manifest,
    shard_numbers,
    shard_paths,
    target_identity,
    write_shard,
)
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

log = logging.getLogger(__name__)

SPEC_FILE = "corpus.yaml"
DEFAULT_CORPUS = Path("data/selfdistill/smollm2-135m")
DEFAULT_WORK_DIR = Path("runs/selfdistill")


class CorpusSpec(BaseModel):
    """What a corpus answers and how: one file per corpus directory, fixed once shards exist."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(description="Model name or HF-format directory.")
    sources: list[str] = Field(min_length=1, description="Prompt sources, all prompts of each (sources.py).")
    max_prompt_tokens: int = Field(192, ge=8)
    max_new_tokens: int = Field(384, ge=1)
    greedy_fraction: float = Field(0.3, ge=0.0, le=1.0, description="Share of responses generated at T=0.")
    temperature: float = Field(1.0, gt=0.0, description="Temperature of the sampled responses.")
    shard_size: int = Field(512, ge=1, description="Prompts per shard.")
    decontaminate: bool = True
    require_eval_sets: bool = True
    ngram: int = Field(8, ge=3)
    seed: int = 0

    @classmethod
    def load(cls, corpus_dir: Path) -> CorpusSpec:
        path = corpus_dir / SPEC_FILE
        if not path.is_file():
            raise ShardError(f"{corpus_dir} has no {SPEC_FILE} (the corpus spec)")
        return cls.model_validate(yaml.safe_load(path.read_text()))

    @property
    def prompt_set_name(self) -> str:
        return "+".join(self.sources) + f"/seed{self.seed}/max{self.max_prompt_tokens}"


def sampling_for(index: int, spec: CorpusSpec) -> tuple[float, int]:
    """(temperature, seed) of prompt `index`: deterministic in the corpus seed."""
    seed = spec.seed * 1_000_003 + index
    temperature = 0.0 if random.Random(seed).random() < spec.greedy_fraction else spec.temperature
    return temperature, seed


def target_name(target: str) -> str:
    """The name recorded in manifests: a model name as given, a directory by its last component."""
    path = Path(target).expanduser()
    return path.name if path.is_dir() else target


def pending_shards(corpus_dir: Path, count: int) -> list[int]:
    """The `count` lowest shard numbers not yet in the corpus (gaps first, then after the last)."""
    present = set(shard_numbers(corpus_dir))
    todo, n = [], 0
    while len(todo) < count:
        if n not in present:
            todo.append(n)
        n += 1
    return todo


def check_existing(corpus_dir: Path, identity: TargetIdentity, order: PromptOrder, spec: CorpusSpec) -> None:
    """Refuse to extend a corpus whose shards came from another target or another prompt order."""
    for number in shard_numbers(corpus_dir):
        _, path = shard_paths(corpus_dir, number)
        manifest = read_manifest(path)
        check_identity(path.name, manifest.identity, identity)
        if manifest.prompt_set.order_sha256 != order.sha256:
            raise ShardError(
                f"{path.name} answers another prompt order (sha256 {manifest.prompt_set.order_sha256[:12]}, "
                f"here {order.sha256[:12]}): the installed prompt sources differ from the ones that "
                "wrote it (package versions?)"
            )
        if manifest.generation.max_new_tokens != spec.max_new_tokens:
            raise ShardError(f"{path.name} was generated with another max_new_tokens")


def _fixed_mmap_threshold(threshold: int = 1 << 16) -> None:
    """Serve allocations above 64 KiB from mmap, returned to the system when freed. With glibc's
    default sliding threshold, the engine's per-step tensors of ever-changing shapes fragmented
    the heap: 0.9 GiB more resident memory per 100 steps at batch 128, 0.15 GiB with this."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD


class PartialLog:
    """Finished responses of one shard not written yet: a JSONL file whose first line is the key
    of what it belongs to; a file with another key is discarded, a torn last line ignored."""

    def __init__(self, path: Path, key: dict) -> None:
        self.path = path
        self.done: dict[int, dict] = {}
        if path.is_file():
            lines = path.read_text().splitlines()
            rows = []
            for line in lines:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a write cut off by the interruption; what follows cannot exist
            if rows and rows[0] == {"key": key}:
                self.done = {row["index"]: row for row in rows[1:]}
            else:
                log.warning("%s belongs to another corpus state; starting that shard afresh", path)
            # Rewrite what was kept, so a torn line never stays in front of new ones.
            self._rewrite(key, list(self.done.values()))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._rewrite(key, [])

    def _rewrite(self, key: dict, rows: list[dict]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in [{"key": key}, *rows]))
        tmp.replace(self.path)

    def add(self, row: dict) -> None:
        self.done[row["index"]] = row
        with open(self.path, "a") as f:  # one line per finished response: seconds apart
            f.write(json.dumps(row) + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass
class GenerationReport:
    shards: list[int]
    new_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


def add_shards(
    corpus_dir: Path,
    count: int,
    *,
    device: str = "auto",
    dtype: str = "auto",
    batch: int = 256,
    max_batch_tokens: int | None = None,
    work_dir: Path = DEFAULT_WORK_DIR,
    threads: int | None = None,
    progress: bool = True,
    stop_after_responses: int | None = None,
) -> GenerationReport:
    """Generate the next `count` shards of a corpus. `stop_after_responses` interrupts the run
    after that many finished responses (tests of resuming). `threads` sets torch's CPU threads."""
    import torch
    from dspark.builder import engine_from_config
    from dspark.engine.config import EngineConfig
    from dspark.engine.prompt import encode_prompt
    from dspark.engine.sampling_params import SamplingParams
    from dspark.models.pull import resolve_target
    from transformers import AutoTokenizer

    if threads is not None:
        torch.set_num_threads(threads)
    _fixed_mmap_threshold()
    spec = CorpusSpec.load(corpus_dir)
    model_dir = resolve_target(spec.target)
    identity = target_identity(target_name(spec.target), model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    work = work_dir / corpus_dir.resolve().name
    started = time.perf_counter()
    order = cached_prompt_order(spec, tokenizer, encode_prompt, identity.tokenizer_sha256, work)
    log.info(
        "prompt order: %d prompts %s (%.0f s); dropped for evaluation overlap: %s",
        len(order.prompts),
        order.report["selected"],
        time.perf_counter() - started,
        order.report["dropped"],
    )
    check_existing(corpus_dir, identity, order, spec)
    todo = pending_shards(corpus_dir, count)
    available = -(-len(order.prompts) // spec.shard_size)
    if todo and todo[-1] >= available:
        raise NoUsableData(
            f"the prompt order has {len(order.prompts)} prompts ({available} shards of {spec.shard_size}); "
            f"shard {todo[-1]} is past its end: add sources to a new corpus"
        )

    engine = engine_from_config(
        EngineConfig(
            target=str(model_dir),
            drafter="none",
            policy="none",
            dtype=dtype,
            device=device,
            max_num_seqs=batch,
            max_batch_tokens=max_batch_tokens or max(2 * batch, spec.max_prompt_tokens + 16),
            max_model_len=spec.max_prompt_tokens + spec.max_new_tokens + 8,
        )
    )
    engine.tokenizer = None  # token ids only: no incremental detokenization per step
    generation = Generation(
        max_new_tokens=spec.max_new_tokens,
        greedy_fraction=spec.greedy_fraction,
        temperature=spec.temperature,
        seed=spec.seed,
        dtype=str(engine.dtype).removeprefix("torch."),
        device=engine.device.type,
    )
    prompt_set = PromptSet(name=spec.prompt_set_name, order_sha256=order.sha256, size=len(order.prompts))
    key = {
        "identity": identity.model_dump(),
        "prompt_set": prompt_set.model_dump(),
        "generation": generation.model_dump(),
    }
    logs = {n: PartialLog(work / f"shard-{n:05d}.partial.jsonl", key) for n in todo}

    def indices(n: int) -> range:
        return range(n * spec.shard_size, min((n + 1) * spec.shard_size, len(order.prompts)))

    queue = deque((n, i) for n in todo for i in indices(n) if i not in logs[n].done)
    remaining = {n: len(indices(n)) - len(logs[n].done) for n in todo}
    total_new = sum(len(indices(n)) for n in todo) * spec.max_new_tokens
    bar = tqdm(total=total_new, desc="self-distill", unit="tok", unit_scale=True, disable=not progress)
    bar.update(sum(len(r["response_ids"]) for log_ in logs.values() for r in log_.done.values()))
    written: list[int] = []
    new_tokens, finished_now = 0, 0
    gen_start = time.perf_counter()

    def finish_shard(n: int) -> None:
        rows = [logs[n].done[i] for i in indices(n)]
        samples, records, offset = [], [], 0
        for row in rows:
            prompt = order.prompts[row["index"]]
            temperature, seed = sampling_for(row["index"], spec)
            samples.append(
                Sample(
                    prompt["prompt_ids"],
                    row["response_ids"],
                    prompt["domain"],
                    prompt["source"],
                    temperature,
                    row["finish_reason"],
                    row["index"],
                )
            )
            records.append(
                ResponseRecord(
                    index=row["index"],
                    domain=prompt["domain"],
                    source=prompt["source"],
                    temperature=temperature,
                    seed=seed,
                    finish_reason=row["finish_reason"],
                    offset=offset,
                    prompt_len=len(prompt["prompt_ids"]),
                    response_len=len(row["response_ids"]),
                )
            )
            offset += len(prompt["prompt_ids"]) + len(row["response_ids"])
        manifest = ShardManifest(
            shard=n,
            identity=identity,
            prompt_set=prompt_set,
            prompt_range=(indices(n).start, indices(n).stop),
            generation=generation,
            dtype="",
            num_tokens=0,
            bin_sha256="",
            responses=records,
        )
        write_shard(corpus_dir, manifest, samples)
        logs[n].remove()
        written.append(n)
        bar.write(f"wrote {corpus_dir / f'shard-{n:05d}'}.bin/.json ({offset} tokens)")

    for n in todo:
        if remaining[n] == 0:
            finish_shard(n)

    def on_output(n: int, index: int, tokens: list[int]):
        def callback(output) -> None:
            nonlocal new_tokens, finished_now
            tokens.extend(output.new_token_ids)
            new_tokens += len(output.new_token_ids)
            bar.update(len(output.new_token_ids))
            if output.finished:
                if output.finish_reason not in ("stop", "length"):
                    raise RuntimeError(
                        f"prompt {index}: generation ended with {output.finish_reason}: {output.error}"
                    )
                finished_now += 1
                logs[n].add({"index": index, "finish_reason": output.finish_reason, "response_ids": tokens})
                remaining[n] -= 1
                if remaining[n] == 0:
                    finish_shard(n)

        return callback

    try:
        while queue or engine.has_unfinished_requests():
            # Keep the batch full, and a few requests waiting so a freed slot is refilled at once.
            while queue and engine.num_running + engine.num_waiting < batch + batch // 4:
                n, index = queue.popleft()
                temperature, seed = sampling_for(index, spec)
                engine.add_request(
                    order.prompts[index]["prompt_ids"],
                    SamplingParams(temperature=temperature, seed=seed, max_tokens=spec.max_new_tokens),
                    on_output=on_output(n, index, []),
                )
            engine.step()
            elapsed = time.perf_counter() - gen_start
            bar.set_postfix(tok_s=f"{new_tokens / max(elapsed, 1e-9):.0f}", shards=len(written))
            if stop_after_responses is not None and finished_now >= stop_after_responses:
                break
    finally:
        bar.close()
    return GenerationReport(written, new_tokens, time.perf_counter() - gen_start)
