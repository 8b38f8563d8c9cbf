"""What every pod the operator creates runs with: Pod Security "restricted", a read-only root
filesystem with the server's writable directories on emptyDirs, and the API key from a Secret."""

from __future__ import annotations

from typing import Any

from dspark_operator.spec import ServiceSpec

API_KEY_ENV = "DSPARK_API_KEY"
CACHE_DIR = "/var/cache/dspark"
TMP_DIR = "/tmp"

# Where `dspark serve` and `dspark profile` write, each pointed into an emptyDir: the model pulled
# by name and the SPS profile measured at start-up (DSPARK_HOME), transformers' caches, inductor's
# compiled graphs, the CPU attention kernel's build, Triton's and CUDA's JIT caches, Ray's
# session directory with its sockets and logs (under TMPDIR), and HOME, where ray.init writes its
# auth token (~/.ray/auth_token; it fails on a read-only home).
WRITABLE_ENV = {
    "HOME": f"{CACHE_DIR}/home",
    "DSPARK_HOME": f"{CACHE_DIR}/dspark",
    "HF_HOME": f"{CACHE_DIR}/huggingface",
    "XDG_CACHE_HOME": CACHE_DIR,
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/torchinductor",
    "TORCH_EXTENSIONS_DIR": f"{CACHE_DIR}/torch_extensions",
    "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton",
    "CUDA_CACHE_PATH": f"{CACHE_DIR}/nv",
    "TMPDIR": TMP_DIR,
    "RAY_TMPDIR": TMP_DIR,
}


def writable_volumes() -> list[dict[str, Any]]:
    return [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]


def writable_mounts() -> list[dict[str, Any]]:
    return [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": TMP_DIR}]


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security_context(spec: ServiceSpec) -> dict[str, Any]:
    """Non-root by number (the kubelet can check a numeric user without the image's passwd)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": spec.run_as_user,
        "runAsGroup": spec.run_as_user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def writable_env() -> list[dict[str, str]]:
    return [{"name": name, "value": value} for name, value in WRITABLE_ENV.items()]


def user_env(spec: ServiceSpec, with_api_key: bool) -> list[dict[str, Any]]:
    """The service's own `env`, then the API key from its Secret when wanted and given.

    Profiling Jobs never get the key: `dspark profile` serves nothing. A `DSPARK_API_KEY` in the
    free-form `env` is dropped from Jobs too, and yields to `apiKeySecretRef` in serving pods.
    """
    ref = spec.api_key_secret_ref
    env = [e for e in spec.env if e.get("name") != API_KEY_ENV or (with_api_key and ref is None)]
    if with_api_key and ref is not None:
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env
