"""Pipeline diagnostics of a drafter: memorize-and-replay and target-feature ablation.

Memorize: train on a few greedy answers, every response position an anchor, until the drafter
reproduces them; replayed through the engine (`dspark bench acceptance --prompts`), whose greedy
decoding regenerates the same answers, whole blocks must then be accepted. A drafter that
training scores high and serving rejects points at a train/serve mismatch. Ablation: the same
per-position acceptance with the target's features zeroed shows how much the drafter uses them.

Acceptance here is measured on packed training blocks (teacher-forced, every anchor), in two
forms: `soft` = 1 - TV/2 against the target's distribution (the trainer's metric, a T = 1
acceptance rate) and `greedy` = the drafter's most likely token equals the sequence's token (a
greedy answer's token is the target's argmax).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from dspark.drafters.dspark_model import DSparkModel
from dspark.training.features import Sequence
from dspark.training.forward import dspark_block_logits, eagle3_block_logits
from dspark.training.packing import PackedBatch, pack
from dspark.training.trainer import Trainer

EVERY_ANCHOR = 1 << 20  # anchors per sequence above any response length: every position is one


def greedy_corpus_prompts(corpus_dir: Path, count: int, max_prompt_tokens: int = 128) -> list[dict]:
    """`count` prompts of the corpus's greedy answers, the domains taken in turn, each in prompt order."""
    from dspark.training.shards import load_corpus

    by_domain: dict[str, list[dict]] = {}
    for shard in load_corpus(corpus_dir, None):
        for s in shard.samples:
            if s.temperature == 0 and len(s.prompt_ids) <= max_prompt_tokens:
                by_domain.setdefault(s.domain, []).append({"domain": s.domain, "prompt_ids": s.prompt_ids})
    queues = [by_domain[d] for d in sorted(by_domain)]
    picked = []
    while len(picked) < count and any(queues):
        for queue in queues:
            if queue and len(picked) < count:
                picked.append(queue.pop(0))
    if len(picked) < count:
        raise ValueError(
            f"{corpus_dir} holds only {len(picked)} greedy answers to prompts of <= {max_prompt_tokens} tokens"
        )
    return picked


def greedy_answers(engine, prompts: list[dict], max_tokens: int) -> list[dict]:
    """The prompts with `response_ids`: the engine's plain greedy decoding, what a T = 0 replay produces."""
    from dspark.engine.sampling_params import SamplingParams

    results = engine.generate(
        [p["prompt_ids"] for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )
    return [{**p, "response_ids": r.token_ids} for p, r in zip(prompts, results, strict=True)]


def write_samples(path: Path, samples: list[dict]) -> None:
    """JSONL of domain / prompt_ids / response_ids, the file `dspark bench acceptance --prompts` reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))


def read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class BlockAcceptance:
    """Per block position k = 1..gamma over every anchor of some sequences."""

    soft: list[float]  # mean 1 - TV/2 against the target's distribution
    greedy: list[float]  # the drafter's argmax is the sequence's token (teacher-forced prefix)
    greedy_tau: float  # 1 + mean leading run of greedy matches, over blocks with all positions present
    blocks: int

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()} | {
            "soft": [round(a, 4) for a in self.soft],
            "greedy": [round(a, 4) for a in self.greedy],
        }


def every_anchor_batches(sequences: list[Sequence], block_size: int, per_batch: int = 2) -> list[PackedBatch]:
    """Every response position of each sequence as an anchor, `per_batch` sequences per batch."""
    generator = torch.Generator().manual_seed(0)  # unused: no sequence has that many positions
    return [
        pack(sequences[i : i + per_batch], EVERY_ANCHOR, block_size, generator)
        for i in range(0, len(sequences), per_batch)
    ]


@torch.no_grad()
def block_acceptance(
    trainer: Trainer, batches: list[PackedBatch], zero_features: bool = False
) -> BlockAcceptance:
    """`trainer`'s drafter on `batches` (teacher-forced, eval mode); with `zero_features` the
    target's features given to it are all zeros."""
    model, was_training = trainer.model, trainer.model.training
    model.eval()
    soft_sum = greedy_sum = count = None
    runs, full_blocks = 0.0, 0
    try:
        for batch in batches:
            batch = batch.to(trainer.device)
            if zero_features:
                batch.ctx_features = torch.zeros_like(batch.ctx_features)
            autocast = torch.autocast(
                trainer.device.type, dtype=trainer.dtype, enabled=trainer.dtype != torch.float32
            )
            with autocast:
                if isinstance(model, DSparkModel):
                    logits, _ = dspark_block_logits(model, batch, draft_rows=True)
                else:
                    logits = eagle3_block_logits(model, batch)
            terms = trainer.block_terms(batch, logits)
            valid = batch.valid.reshape(logits.shape[0], -1)
            labels = batch.labels.reshape(logits.shape[0], -1)
            top = logits.float().argmax(-1)
            ids = trainer.to_target
            drafted = ids[top] if ids is not None else top
            match = (drafted == labels) & valid
            n = valid.sum(0).float()
            soft = terms.accept * n
            soft_sum = soft if soft_sum is None else soft_sum + soft
            greedy_sum = match.sum(0).float() if greedy_sum is None else greedy_sum + match.sum(0).float()
            count = n if count is None else count + n
            full = valid.all(-1)
            runs += float(match[full].long().cumprod(-1).sum())
            full_blocks += int(full.sum())
    finally:
        model.train(was_training)
    assert soft_sum is not None and greedy_sum is not None and count is not None
    count = count.clamp(min=1)
    return BlockAcceptance(
        (soft_sum / count).tolist(),
        (greedy_sum / count).tolist(),
        1.0 + runs / max(full_blocks, 1),
        int(count[0]),
    )
