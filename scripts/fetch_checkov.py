"""Install checkov into a venv of its own, tools/checkov (git-ignored), for the chart tests.

checkov pins packaging<24 and networkx<2.7; in the project's environment pip would resolve ray
down to an older release to fit them, so it lives apart, like tools/bin/helm.
Idempotent: returns the installed executable when it is already there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REQUIREMENT = "checkov==3.3.30"
ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "tools" / "checkov"


def fetch_checkov(venv: Path = VENV) -> Path:
    executable = venv / "bin" / "checkov"
    marker = venv / "installed.txt"
    if executable.is_file() and marker.is_file() and marker.read_text().strip() == REQUIREMENT:
        return executable
    # In place (a venv's scripts name its path); the marker, written last, says it is complete.
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, REQUIREMENT], check=True)
    marker.write_text(REQUIREMENT + "\n")
    return executable


if __name__ == "__main__":
    print(fetch_checkov())
