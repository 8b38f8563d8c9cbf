"""Drafter pipeline diagnostics: memorize-and-replay, and target-feature ablation.

Usage:
  python scripts/drafter_diagnostics.py memorize CONFIG [--out runs/diag/memorize] [--sequences 8]
      [--max-tokens 128] [--max-steps 400] [--eval-every 10] [--lr 1e-3] [--warm-start shipped] [--until 0.9]
  dspark bench acceptance --drafters runs/diag/memorize/final --prompts runs/diag/memorize/prompts.jsonl \\
      --temperatures 0 --gammas 7 --max-tokens 128 --dtype float32
  python scripts/drafter_diagnostics.py ablate CONFIG --drafters dspark,runs/diag/memorize/final
      [--prompts FILE | --num-prompts 16] [--max-tokens 128] [--out runs/diag/ablation]

memorize: the target answers `--sequences` greedy-corpus prompts greedily (plain decoding in fp32,
which an fp32 replay reproduces), and CONFIG's drafter trains on those answers alone, every
response position an anchor each step, until position-1 acceptance (soft and greedy) reaches
`--until` or the steps run out; OUT/final is the drafter at the last evaluated step. ablate:
per-position acceptance of each drafter on the greedy answers of the bench split (or `--prompts`),
with the target features and with them zeroed. Both write JSON under OUT and print one line per evaluation.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from dspark.engine.config import resolve_device, resolve_dtype
from dspark.training.config import TrainConfig
from dspark.training.diagnostics import (
    EVERY_ANCHOR,
    block_acceptance,
    every_anchor_batches,
    greedy_answers,
    greedy_corpus_prompts,
    read_samples,
    write_samples,
)
from dspark.training.online import OnlineFeatures, token_sequences
from dspark.training.run import trainer_for

REPLAY_DTYPE = "float32"  # greedy speculation reproduces plain decoding token for token only in fp32


def answer(cfg: TrainConfig, prompts: list[dict], max_tokens: int, path: Path) -> list[dict]:
    """Greedy fp32 answers of `prompts` (kept in `path`: a rerun reuses them).

    fp32 because a replay must regenerate them: in bf16 the verification forward rounds
    differently from one-token decoding, and a flipped near-tie changes the rest of the answer."""
    if path.is_file():
        return read_samples(path)
    from dspark.builder import engine_from_config
    from dspark.engine.config import EngineConfig

    longest = max(len(p["prompt_ids"]) for p in prompts)
    engine = engine_from_config(
        EngineConfig(
            target=cfg.target,
            drafter="none",
            policy="none",
            device=cfg.device,
            dtype=REPLAY_DTYPE,
            max_num_seqs=min(16, len(prompts)),
            max_model_len=longest + max_tokens + 8,
        )
    )
    samples = greedy_answers(engine, prompts, max_tokens)
    write_samples(path, samples)
    return samples


def with_features(cfg: TrainConfig, samples: list[dict]) -> list:
    """Training sequences of `samples` with the target's features, computed once."""
    from dspark.models.pull import resolve_target
    from dspark.training.pipeline import load_target

    device = resolve_device(cfg.device)
    target = load_target(resolve_target(cfg.target), device, resolve_dtype(cfg.dtype, device))
    return OnlineFeatures(target, cfg.target_layer_ids, cfg.data.feature_batch_tokens).fill(
        token_sequences([samples])
    )


def derived(cfg: TrainConfig, **updates) -> TrainConfig:
    optim = updates.pop("optim", {})
    return TrainConfig.model_validate(
        {**cfg.model_dump(), **updates, "optim": {**cfg.optim.model_dump(), **optim}}
    )


def memorize(args: argparse.Namespace) -> None:
    base = TrainConfig.load(args.config)
    out = args.out
    prompts = greedy_corpus_prompts(base.data.corpus[0], args.sequences)
    samples = answer(base, prompts, args.max_tokens, out / "prompts.jsonl")
    sequences = with_features(base, samples)
    cfg = derived(
        base,
        out_dir=out / "train",
        features="cached",
        warm_start=args.warm_start,
        optim={
            "max_steps": args.max_steps,
            "sequences_per_step": len(sequences),
            "anchors_per_sequence": EVERY_ANCHOR,
            "lr": args.lr,
            "min_lr_ratio": 1.0,
            "warmup_steps": min(10, args.max_steps),
            "checkpoint_every": args.eval_every,
        },
    )
    trainer = trainer_for(cfg, sequences)
    batches = every_anchor_batches(sequences, cfg.drafter.block_size)
    log_path = out / "log.jsonl"
    while True:
        acc = block_acceptance(trainer, batches)
        row = {"step": trainer.step, "elapsed_s": round(trainer.elapsed, 1), **acc.as_dict()}
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        final = trainer.export(out / "final")  # each evaluated point: a run cut short still replays
        done = min(acc.soft[0], acc.greedy[0]) >= args.until
        if done or trainer.step >= trainer.total:
            break
        trainer.train(progress=False, stop_after=args.eval_every)
    ablated = block_acceptance(trainer, batches, zero_features=True)
    summary = {
        "config": str(args.config),
        "warm_start": trainer.warm_start,
        "sequences": len(sequences),
        "response_tokens": sum(len(s["response_ids"]) for s in samples),
        "reached": done,
        "trained": row,
        "features_zeroed": {"step": trainer.step, **ablated.as_dict()},
        "exported": str(final),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"features_zeroed": summary["features_zeroed"]}), flush=True)
    print(
        f"replay: dspark bench acceptance --drafters {final} --prompts {out / 'prompts.jsonl'} "
        f"--temperatures 0 --gammas {cfg.drafter.block_size} --max-tokens {args.max_tokens} --dtype {REPLAY_DTYPE} "
        f"--output-dir {out / 'replay'}"
    )


def ablate(args: argparse.Namespace) -> None:
    from dspark.calibration.collect import encode_eval_prompts, resolve_drafter_dir

    base = TrainConfig.load(args.config)
    out = args.out
    if args.prompts is not None:
        prompts = [{"domain": s["domain"], "prompt_ids": s["prompt_ids"]} for s in read_samples(args.prompts)]
        answers = out / f"answers-{args.prompts.stem}.jsonl"
    else:
        from dspark.models.pull import resolve_target
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_target(base.target))
        split = encode_eval_prompts(tokenizer, ["math", "code", "chat"], args.num_prompts, "bench")
        prompts = [{"domain": d, "prompt_ids": ids} for d, rows in split.items() for ids in rows]
        answers = out / f"answers-bench-{args.num_prompts}.jsonl"
    samples = answer(base, prompts, args.max_tokens, answers)
    sequences = with_features(base, samples)
    results = []
    for spec in [s.strip() for s in args.drafters.split(",") if s.strip()]:
        path = resolve_drafter_dir(spec, base.target)
        with tempfile.TemporaryDirectory() as scratch:
            trainer = trainer_for(derived(base, out_dir=Path(scratch), warm_start=path), sequences)
            # Packed after the trainer has set the sequences' target normalisers.
            batches = every_anchor_batches(sequences, base.drafter.block_size)
            row = {"drafter": spec, "prompts": str(answers)}
            for label, zero in (("features", False), ("zeroed", True)):
                row[label] = block_acceptance(trainer, batches, zero_features=zero).as_dict()
        results.append(row)
        print(json.dumps(row), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{answers.stem}-ablation.json").write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("memorize", help="train on a few greedy answers until they are reproduced")
    mem.add_argument("config", type=Path)
    mem.add_argument("--out", type=Path, default=Path("runs/diag/memorize"))
    mem.add_argument("--sequences", type=int, default=8)
    mem.add_argument("--max-tokens", type=int, default=128)
    mem.add_argument("--max-steps", type=int, default=400)
    mem.add_argument("--eval-every", type=int, default=10)
    mem.add_argument("--lr", type=float, default=1e-3)
    mem.add_argument(
        "--warm-start", default="shipped", help="shipped | none | a drafter checkpoint directory"
    )
    mem.add_argument("--until", type=float, default=0.9, help="position-1 acceptance that ends training")
    abl = sub.add_parser("ablate", help="acceptance with the target features and with them zeroed")
    abl.add_argument("config", type=Path)
    abl.add_argument("--drafters", default="dspark")
    abl.add_argument("--prompts", type=Path, default=None, help="JSONL of domain / prompt_ids")
    abl.add_argument("--num-prompts", type=int, default=16, help="bench-split prompts per domain")
    abl.add_argument("--max-tokens", type=int, default=128)
    abl.add_argument("--out", type=Path, default=Path("runs/diag/ablation"))
    args = parser.parse_args()
    memorize(args) if args.command == "memorize" else ablate(args)


if __name__ == "__main__":
    main()
