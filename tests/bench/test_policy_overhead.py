"""The scheduler-overhead script runs every policy's per-step decision and reports a time."""

from __future__ import annotations

from click.testing import CliRunner
from dspark.bench.policy_overhead import POLICIES, main


def test_overhead_script_times_every_policy() -> None:
    result = CliRunner().invoke(main, ["-R", "8", "-g", "4", "--repeats", "5"])
    assert result.exit_code == 0, result.output
    rows = dict(line.rsplit(maxsplit=1) for line in result.output.splitlines()[2:])
    assert set(rows) == set(POLICIES)
    assert all(float(us) > 0 for us in rows.values())
