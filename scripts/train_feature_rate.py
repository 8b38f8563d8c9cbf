"""Block positions/s of `features: cached` and `features: online`, back to back on one config.

Usage: python scripts/train_feature_rate.py CONFIG [--steps 20] [--out runs/feature-rate]
Each mode trains `--steps` steps from scratch into its own out_dir; cached also reports the time
its feature extraction took (paid once per data directory, before the first step).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dspark.training.config import TrainConfig
from dspark.training.run import build_trainer


def measure(cfg: TrainConfig, steps: int) -> dict:
    start = time.perf_counter()
    trainer = build_trainer(cfg, progress=False)
    ready = time.perf_counter()
    metrics = trainer.train(progress=False, stop_after=steps)  # one checkpoint, at the end
    return {
        "features": cfg.features,
        "setup_s": round(ready - start, 1),
        "steps": steps,
        "train_s": round(time.perf_counter() - ready, 1),
        "block_positions_per_s": metrics["pos_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/feature-rate"))
    args = parser.parse_args()
    base = TrainConfig.load(args.config)
    results = []
    for mode in ("cached", "online"):
        cfg = base.model_validate(
            {
                **base.model_dump(),
                "features": mode,
                "warm_start": "none",
                "out_dir": args.out / mode,
                "optim": {**base.optim.model_dump(), "checkpoint_every": args.steps},
            }
        )
        results.append(measure(cfg, args.steps))
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
