"""One-request decode forward timings by intra-op thread count, measured once per model, dtype, CPU
and forward kind and stored beside the SPS profiles, so later starts reuse them instead of timing
again (about 1.5 s of every start)."""

from __future__ import annotations

import json
import logging
import os
import statistics
from pathlib import Path

from dspark.profiling.acquire import default_profile_path, engine_identity

log = logging.getLogger(__name__)

# Set to 0 to time at every start (the stored timings are then neither read nor written).
STORE_ENV = "DSPARK_STORE_THREAD_TIMINGS"
# Timings whose interquartile range exceeds this share of their median were taken on a busy
# machine (at a load average of 13, 205 ms +-80): they decide this start only, and are not kept.
MAX_STORED_SPREAD = 0.25


def thread_timings_path(engine, counts: list[int]) -> Path:
    """`$DSPARK_HOME/profiles/<the SPS profile's name>__threads-<counts>.json`."""
    profile = default_profile_path(*engine_identity(engine))
    return profile.with_name(f"{profile.stem}__threads-{'-'.join(map(str, counts))}.json")


def acquire_thread_timings(engine, counts: list[int]) -> tuple[dict[int, list[float]], Path | None]:
    """Seconds of `decode_seconds_by_threads(engine, counts)`: stored ones where this engine's
    identity has them, else measured now and stored. Returns them and the file they came from
    (None when measured now)."""
    store = os.environ.get(STORE_ENV, "1") != "0"
    path = thread_timings_path(engine, counts) if store else None
    if path is not None and path.is_file():
        try:
            stored = {int(n): [float(t) for t in ts] for n, ts in json.loads(path.read_text()).items()}
            if sorted(stored) == sorted(counts) and all(stored.values()):
                return stored, path
            log.warning("%s holds other thread counts than %s; timing again", path, counts)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("cannot read %s (%s); timing again", path, e)
    # Here, not at the top: the profiler imports torch's compiler.
    from dspark.profiling.profiler import decode_seconds_by_threads

    samples = decode_seconds_by_threads(engine, counts)
    if path is not None and not all(_steady(ts) for ts in samples.values()):
        log.info("thread timings spread wide (a busy machine?): not stored, the next start times again")
    elif path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({str(n): ts for n, ts in samples.items()}))
            tmp.replace(path)
        except OSError as e:
            log.warning("cannot store the thread timings in %s (%s)", path, e)
    return samples, None


def _steady(seconds: list[float]) -> bool:
    if len(seconds) < 4:
        return True
    low, median, high = statistics.quantiles(seconds, n=4)
    return high - low <= MAX_STORED_SPREAD * median
