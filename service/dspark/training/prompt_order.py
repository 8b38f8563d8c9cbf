"""A corpus's prompt order, and its cache in the generation work directory.

Building the order reads every prompt source, filters it against the evaluation sets and
tokenizes each prompt: about a minute for the SmolLM2 corpus, at every start of `dspark train
data`. The cache (`prompt-order.jsonl.gz`: a header line, then one prompt per line) is reused
while the spec's order fields, the tokenizer and any `jsonl:` source files are unchanged. It
also lets a machine without the source packages (a GPU box) extend a corpus: copy the file
into its work directory. The order's sha256, recomputed on load and checked against every
existing shard's manifest, keeps a stale or foreign file from writing a shard.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.training.prompts import NoUsableData, PromptFilter
from dspark.training.shards import atomic_write
from dspark.training.sources import DOMAINS, load_source

if TYPE_CHECKING:
    from dspark.training.corpus import CorpusSpec

log = logging.getLogger(__name__)

ORDER_FILE = "prompt-order.jsonl.gz"
# The spec fields the order depends on (not the target's name, nor how responses are generated).
_ORDER_FIELDS = ("sources", "max_prompt_tokens", "decontaminate", "require_eval_sets", "ngram", "seed")


@dataclass
class PromptOrder:
    prompts: list[dict]  # text, domain, source, prompt_ids; position = prompt index
    report: dict
    sha256: str


def order_sha256(rows: list[dict]) -> str:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([row["source"], row["domain"], row["text"]]).encode() + b"\n")
    return digest.hexdigest()


def prompt_order(spec: CorpusSpec, tokenizer, encode) -> PromptOrder:
    """Every usable prompt of the spec's sources, in the corpus's seeded order."""
    admitted = PromptFilter(spec.decontaminate, spec.require_eval_sets, spec.ngram)
    rows = []
    for source in spec.sources:
        for prompt in load_source(source):
            if not admitted.admit(prompt.text):
                continue
            ids = encode(tokenizer, prompt.text)
            if len(ids) > spec.max_prompt_tokens:
                admitted.report["too_long"] += 1
                continue
            rows.append(
                {"text": prompt.text, "domain": prompt.domain, "source": prompt.source, "prompt_ids": ids}
            )
    if not rows:
        raise NoUsableData(f"corpus sources {spec.sources} yield no usable prompt")
    random.Random(spec.seed).shuffle(rows)
    report = admitted.report
    report["selected"] = {d: sum(1 for r in rows if r["domain"] == d) for d in DOMAINS}
    return PromptOrder(rows, report, order_sha256(rows))


def order_key(spec: CorpusSpec, tokenizer_sha256: str) -> dict:
    """What a cached order must match: the order's spec fields, the tokenizer, and the content
    of `jsonl:` sources (local files a user may edit)."""
    files = {
        source: hashlib.sha256(Path(source.removeprefix("jsonl:")).read_bytes()).hexdigest()
        for source in spec.sources
        if source.startswith("jsonl:")
    }
    fields = {name: getattr(spec, name) for name in _ORDER_FIELDS}
    return {**fields, "tokenizer_sha256": tokenizer_sha256, "jsonl_sha256": files}


def cached_prompt_order(
    spec: CorpusSpec, tokenizer, encode, tokenizer_sha256: str, work_dir: Path
) -> PromptOrder:
    """The order from `work_dir`'s cache when it matches, else built and cached there."""
    path, key = work_dir / ORDER_FILE, order_key(spec, tokenizer_sha256)
    if path.is_file():
        order = _read(path, key)
        if order is not None:
            return order
    order = prompt_order(spec, tokenizer, encode)
    work_dir.mkdir(parents=True, exist_ok=True)
    header = {"key": key, "sha256": order.sha256, "report": order.report}
    lines = [json.dumps(header), *(json.dumps(row) for row in order.prompts)]
    atomic_write(path, gzip.compress(("\n".join(lines) + "\n").encode()))
    return order


def _read(path: Path, key: dict) -> PromptOrder | None:
    """The cached order, or None (with a warning saying why) when it is stale or unreadable."""
    try:
        with gzip.open(path, "rt") as f:
            header = json.loads(f.readline())
            if header.get("key") != key:
                log.warning("%s was built for another spec, tokenizer or prompt file: rebuilding", path)
                return None
            rows = [json.loads(line) for line in f]
    except (OSError, EOFError, ValueError) as exc:  # truncated gzip, torn JSON
        log.warning("%s is unreadable (%s): rebuilding the prompt order", path, exc)
        return None
    if order_sha256(rows) != header["sha256"]:
        log.warning("%s does not hash to its recorded order: rebuilding", path)
        return None
    return PromptOrder(rows, header["report"], header["sha256"])
