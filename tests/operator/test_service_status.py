"""The status a reconcile pass writes, built without a cluster."""

from __future__ import annotations

from dspark_operator.serving import WorkloadOutcome
from dspark_operator.spec import ServiceSpec
from dspark_operator.status import METRICS_CONDITION, service_status

from tests.operator.operator_fixtures import service

SPEC = ServiceSpec.model_validate(service()["spec"])
READY = {"state": "Ready", "fingerprint": "f1"}
DEPLOYED = {"state": "Deployed", "nodeType": "NVIDIA-H200", "kind": "Deployment", "workload": "w"}


def status(profiles, placements, old=None, kserve_missing=False, metrics=None, present=("NVIDIA-H200",)):
    workloads = WorkloadOutcome(tiers=placements, kserve_missing=kserve_missing)
    return service_status(SPEC, old or {}, "node-type", list(present), profiles, workloads, metrics, 3, 100.0)


def conditions(result) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in result["conditions"]}


def test_every_tier_deployed_on_a_ready_profile_is_ready() -> None:
    placements = {"interactive": {**DEPLOYED, "created": True}, "batch": dict(DEPLOYED)}
    result = status({"NVIDIA-H200": READY}, placements, old={"tiers": {"gone": {"state": "Deployed"}}})
    assert (
        result["phase"] == "Ready" and result["profilesReady"] == "1/1" and result["observedGeneration"] == 3
    )
    assert conditions(result) == {
        "SpecValid": ("True", "Valid"),
        "ProfilesReady": ("True", "Ready"),
        "TiersDeployed": ("True", "Deployed"),
    }
    tiers = result["tiers"]
    assert tiers["interactive"]["lastScaleTime"] == 100.0 and "created" not in tiers["interactive"]
    assert "lastScaleTime" not in tiers["batch"] and tiers["gone"] is None
    assert "created" in placements["interactive"]  # the pass's own record is left as it was


def test_a_failed_profile_degrades_and_a_missing_node_type_is_named() -> None:
    failed = status({"NVIDIA-H200": READY, "NVIDIA-L40S": {"state": "Failed"}}, {"batch": dict(DEPLOYED)})
    assert failed["phase"] == "Degraded"
    assert conditions(failed)["ProfilesReady"] == ("False", "Failed")
    assert conditions(failed)["TiersDeployed"] == ("False", "WaitingForProfile")
    nothing = status({}, {}, present=())
    assert nothing["phase"] == "Profiling"
    message = next(c["message"] for c in nothing["conditions"] if c["type"] == "ProfilesReady")
    assert message.startswith("no node carries node-type")


def test_kserve_and_metrics_conditions_are_carried() -> None:
    old_metrics = {"type": METRICS_CONDITION, "status": "False", "reason": "Unavailable"}
    result = status({"NVIDIA-H200": READY}, {}, old={"conditions": [old_metrics]}, kserve_missing=True)
    assert conditions(result)["KServeAvailable"] == ("False", "CRDMissing")
    assert result["conditions"][-1] == old_metrics
    newer = {**old_metrics, "status": "True", "reason": "Readable"}
    assert status({}, {}, old={"conditions": [old_metrics]}, metrics=newer)["conditions"][-1] == newer
