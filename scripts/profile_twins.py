"""How far two SPS profiles taken in a row differ, per `min_seconds` of forwards per batch size.

Each setting is profiled twice, alternating; the twins' ratio per point is divided by its median
(the machine's common speed, which the policy's online drift absorbs) and the rest, the curve's
shape error, is reported at B <= 8 (where the one-user verify lengths are decided) and over all B.

    python scripts/profile_twins.py --min-seconds 0.05 0.25
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from dspark.builder import engine_from_config
from dspark.engine.config import EngineConfig
from dspark.profiling.profiler import profile_engine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--min-seconds", type=float, nargs="+", default=[0.05, 0.25])
    args = parser.parse_args()
    # Policy `none`, as `dspark profile`: a profiled policy would acquire (maybe measure) one first.
    engine = engine_from_config(EngineConfig(target=args.target, drafter="dspark", policy="none"))
    engine.wait_for_background_build()
    rates: dict[float, list[np.ndarray]] = {}
    grid = np.array([])
    for _ in range(2):
        for min_seconds in args.min_seconds:
            start = time.perf_counter()
            profile = profile_engine(engine, min_seconds=min_seconds)
            ms = [round(1000 / s, 1) for s in profile.steps_per_second()]
            print(
                f"min_seconds {min_seconds}: {time.perf_counter() - start:.1f} s, step ms by B "
                f"{list(zip(profile.batch_tokens(), ms, strict=True))[:12]}",
                flush=True,
            )
            rates.setdefault(min_seconds, []).append(np.array(profile.steps_per_second()))
            grid = np.array(profile.batch_tokens())
    small = grid <= 8
    print("| min_seconds | shape difference, B <= 8: median / max | all B: median / max |")
    print("|---|---|---|")
    for min_seconds, (a, b) in rates.items():
        ratio = a / b
        shape = np.abs(ratio / np.median(ratio) - 1)
        print(
            f"| {min_seconds} | {np.median(shape[small]):.3f} / {shape[small].max():.3f} "
            f"| {np.median(shape):.3f} / {shape.max():.3f} |"
        )


if __name__ == "__main__":
    main()
