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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from dspark.engine.llm_engine import LLMEngine
    from dspark.engine.outputs import RequestOutput

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


@dataclass
class ShardPlan:
    """The shards a run writes and the prompts they answer; built before any engine exists."""

    corpus_dir: Path
    spec: CorpusSpec
    model_dir: Path
    identity: TargetIdentity
    order: PromptOrder
    todo: list[int]
    work: Path

    def indices(self, n: int) -> range:
        """The prompt-order indices of shard `n`."""
        size = self.spec.shard_size
        return range(n * size, min((n + 1) * size, len(self.order.prompts)))

    def total_new_tokens(self) -> int:
        """The most response tokens the planned shards can hold (the progress bar's total)."""
        return sum(len(self.indices(n)) for n in self.todo) * self.spec.max_new_tokens


def plan_shards(corpus_dir: Path, count: int, work_dir: Path = DEFAULT_WORK_DIR) -> ShardPlan:
    """Check the corpus against its target and prompt order, and pick the next `count` shards."""
    from dspark.engine.prompt import encode_prompt
    from dspark.models.pull import resolve_target
    from transformers import AutoTokenizer

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
    return ShardPlan(corpus_dir, spec, model_dir, identity, order, todo, work)


def generation_engine(
    plan: ShardPlan, *, device: str, dtype: str, batch: int, max_batch_tokens: int | None
) -> tuple[LLMEngine, Generation]:
    """A plain-decoding engine sized for the plan's prompts, and the generation settings it implies."""
    from dspark.builder import engine_from_config
    from dspark.engine.config import EngineConfig

    spec = plan.spec
    engine = engine_from_config(
        EngineConfig(
            target=str(plan.model_dir),
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
    return engine, generation


class ShardWriter:
    """Keeps each planned shard's finished responses in its partial log (so an interrupted run
    resumes) and writes the shard once every response of it is in."""

    def __init__(self, plan: ShardPlan, generation: Generation, bar: tqdm) -> None:
        self.plan, self.generation, self.bar = plan, generation, bar
        self.prompt_set = PromptSet(
            name=plan.spec.prompt_set_name, order_sha256=plan.order.sha256, size=len(plan.order.prompts)
        )
        key = {
            "identity": plan.identity.model_dump(),
            "prompt_set": self.prompt_set.model_dump(),
            "generation": generation.model_dump(),
        }
        self.logs = {n: PartialLog(plan.work / f"shard-{n:05d}.partial.jsonl", key) for n in plan.todo}
        self.remaining = {n: len(plan.indices(n)) - len(self.logs[n].done) for n in plan.todo}
        self.written: list[int] = []

    def pending(self) -> deque[tuple[int, int]]:
        """(shard, prompt index) of every response still to generate, in order."""
        plan = self.plan
        return deque((n, i) for n in plan.todo for i in plan.indices(n) if i not in self.logs[n].done)

    def logged_tokens(self) -> int:
        """Response tokens an earlier run already logged."""
        return sum(len(r["response_ids"]) for log_ in self.logs.values() for r in log_.done.values())

    def write_complete(self) -> None:
        """Write the shards whose responses were all logged by an earlier run."""
        for n in self.plan.todo:
            if self.remaining[n] == 0:
                self.write(n)

    def add(self, n: int, index: int, finish_reason: str, response_ids: list[int]) -> None:
        self.logs[n].add({"index": index, "finish_reason": finish_reason, "response_ids": response_ids})
        self.remaining[n] -= 1
        if self.remaining[n] == 0:
            self.write(n)

    def write(self, n: int) -> None:
        plan = self.plan
        samples, records, num_tokens = shard_rows(plan, [self.logs[n].done[i] for i in plan.indices(n)])
        manifest = ShardManifest(
            shard=n,
            identity=plan.identity,
            prompt_set=self.prompt_set,
            prompt_range=(plan.indices(n).start, plan.indices(n).stop),
            generation=self.generation,
            dtype="",
            num_tokens=0,
            bin_sha256="",
            responses=records,
        )
        write_shard(plan.corpus_dir, manifest, samples)
        self.logs[n].remove()
        self.written.append(n)
        self.bar.write(f"wrote {plan.corpus_dir / f'shard-{n:05d}'}.bin/.json ({num_tokens} tokens)")


def shard_rows(plan: ShardPlan, rows: list[dict]) -> tuple[list[Sample], list[ResponseRecord], int]:
    """A shard's samples and manifest records from its logged responses, and its token count."""
    samples, records, offset = [], [], 0
    for row in rows:
        prompt = plan.order.prompts[row["index"]]
        temperature, seed = sampling_for(row["index"], plan.spec)
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
    return samples, records, offset


@dataclass
class GenerationProgress:
    """What the running generation has produced so far."""

    new_tokens: int = 0
    finished: int = 0


def response_collector(
    n: int, index: int, writer: ShardWriter, progress: GenerationProgress
) -> Callable[[RequestOutput], None]:
    """The engine's output callback for one prompt: gathers its tokens and hands the finished
    response to the writer."""
    tokens: list[int] = []

    def on_output(output: RequestOutput) -> None:
        tokens.extend(output.new_token_ids)
        progress.new_tokens += len(output.new_token_ids)
        writer.bar.update(len(output.new_token_ids))
        if output.finished:
            if output.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"prompt {index}: generation ended with {output.finish_reason}: {output.error}"
                )
            progress.finished += 1
            writer.add(n, index, output.finish_reason, tokens)

    return on_output


def generate(
    engine: LLMEngine, writer: ShardWriter, *, batch: int, stop_after_responses: int | None = None
) -> GenerationProgress:
    """Answer every pending prompt of the plan, keeping the engine's batch full."""
    from dspark.engine.sampling_params import SamplingParams

    spec, prompts = writer.plan.spec, writer.plan.order.prompts
    queue = writer.pending()
    progress = GenerationProgress()
    started = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        # Keep the batch full, and a few requests waiting so a freed slot is refilled at once.
        while queue and engine.num_running + engine.num_waiting < batch + batch // 4:
            n, index = queue.popleft()
            temperature, seed = sampling_for(index, spec)
            engine.add_request(
                prompts[index]["prompt_ids"],
                SamplingParams(temperature=temperature, seed=seed, max_tokens=spec.max_new_tokens),
                on_output=response_collector(n, index, writer, progress),
            )
        engine.step()
        elapsed = time.perf_counter() - started
        writer.bar.set_postfix(
            tok_s=f"{progress.new_tokens / max(elapsed, 1e-9):.0f}", shards=len(writer.written)
        )
        if stop_after_responses is not None and progress.finished >= stop_after_responses:
            break
    return progress


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
    """Generate the next `count` shards of a corpus: plan, generate, write. `stop_after_responses`
    interrupts the run after that many finished responses (tests of resuming). `threads` sets
    torch's CPU threads."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    _fixed_mmap_threshold()
    plan = plan_shards(corpus_dir, count, work_dir)
    engine, generation = generation_engine(
        plan, device=device, dtype=dtype, batch=batch, max_batch_tokens=max_batch_tokens
    )
    bar = tqdm(
        total=plan.total_new_tokens(), desc="self-distill", unit="tok", unit_scale=True, disable=not progress
    )
    started = time.perf_counter()
    try:
        writer = ShardWriter(plan, generation, bar)
        bar.update(writer.logged_tokens())
        writer.write_complete()
        done = generate(engine, writer, batch=batch, stop_after_responses=stop_after_responses)
    finally:
        bar.close()
    return GenerationReport(writer.written, done.new_tokens, time.perf_counter() - started)
