"""Every policy makes the decisions recorded in `data/policy_decisions.json` on the same random step
sequences, byte for byte (see `decision_sequences.py`): a refactoring changes no decision."""

from __future__ import annotations

import json

import pytest
from dspark.engine import verify_policy

from tests.policies import decision_sequences as sequences

RECORDED = json.loads(sequences.FIXTURE.read_text())


def test_the_recording_covers_every_sequence_of_every_policy() -> None:
    assert (RECORDED["sequences"], RECORDED["steps"], RECORDED["block"]) == (
        sequences.SEQUENCES,
        sequences.STEPS,
        sequences.BLOCK,
    )
    blocks = sequences.SEQUENCES // sequences.BLOCK
    assert {spec: len(d) for spec, d in RECORDED["digests"].items()} == dict.fromkeys(
        sequences.POLICIES, blocks
    )


@pytest.mark.parametrize("spec", sequences.POLICIES)
def test_decisions_match_the_recording(spec: str) -> None:
    """The first block; `python -m tests.policies.decision_sequences --check` runs them all."""
    changed = sequences.changed_blocks(RECORDED, spec, range(1))
    assert not changed, f"{spec}: decisions differ in the first {sequences.BLOCK} sequences"


def test_a_changed_decision_changes_the_digest(monkeypatch) -> None:
    """The sequences reach the fallback, and the digests see it: a fallback one token shorter differs."""
    monkeypatch.setattr(verify_policy, "FALLBACK_LENGTH", verify_policy.FALLBACK_LENGTH - 1)
    assert sequences.block_digests("threshold:0.6", range(1)) != RECORDED["digests"]["threshold:0.6"][:1]
