"""Models and drafters by Hugging Face hub id (`org/name[@revision]`), through `huggingface_hub`.

The hub's own environment variables apply as the library documents them: `HF_ENDPOINT`, `HF_HOME`,
`HF_HUB_CACHE`, `HF_HUB_OFFLINE`, `HF_TOKEN`. They are read at every call (the library reads some only
when it is imported), so a process that sets them before resolving a model gets what it asked for.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dspark.models.errors import ModelError

# Only what the engine reads: safetensors weights, configs, tokenizer files and chat templates.
TARGET_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
DRAFTER_FILES = ["*.json", "*.safetensors", "*.bin"]
TOKENIZER_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_](@[\w./-]+)?$")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubId:
    """A hub repository and the revision (branch, tag or commit) to take; None is the default branch."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_hub_id(spec: str) -> HubId | None:
    """`org/name` or `org/name@revision` as a HubId; None for anything else (paths, short names)."""
    if spec.startswith((".", "/", "~")) or not _HUB_ID.match(spec):
        return None
    repo_id, _, revision = spec.partition("@")
    return HubId(repo_id, revision or None)


def with_revision(spec: str, revision: str | None) -> str:
    """`spec` pinned to `revision` (a `--revision` flag); a hub id that names another one is refused."""
    if revision is None:
        return spec
    hub = parse_hub_id(spec)
    if hub is None or Path(spec).expanduser().is_dir():
        raise ValueError(f"revision {revision!r} applies to a hub id (org/name), not {spec!r}")
    if hub.revision not in (None, revision):
        raise ValueError(f"{spec!r} names revision {hub.revision!r} but revision is {revision!r}")
    return str(HubId(hub.repo_id, revision))


def served_name(spec: str) -> str:
    """The model id clients see for a target spelling: a hub id without its revision, else as given."""
    hub = parse_hub_id(spec)
    return hub.repo_id if hub is not None and not Path(spec).expanduser().is_dir() else spec


def tokenizer_dir(spec: str) -> Path:
    """A tokenizer given as a directory or a hub id (downloaded without any weights)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if (hub := parse_hub_id(spec)) is None:
        raise ModelError(f"tokenizer {spec!r} is neither a directory nor a hub id (org/name[@revision])")
    return download(hub, "tokenizer", TOKENIZER_FILES)


def hub_cache_dir() -> Path:
    """Where snapshots are stored: `HF_HUB_CACHE`, else `HF_HOME`/hub, else ~/.cache/huggingface/hub."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(cache)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper() in _TRUE


def download(hub: HubId, what: str, allow_patterns: list[str]) -> Path:
    """The local snapshot of `hub` (downloaded on first use, from the cache after), or a ModelError
    that names the id and the cause."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        path = snapshot_download(
            hub.repo_id,
            revision=hub.revision,
            cache_dir=hub_cache_dir(),
            endpoint=endpoint.rstrip("/") if endpoint else None,
            local_files_only=offline(),
            allow_patterns=allow_patterns,
        )
    except GatedRepoError:
        cause = "the repository is gated: accept its terms on the hub and set HF_TOKEN"
    except RevisionNotFoundError:
        cause = f"it has no revision {hub.revision!r}"
    except RepositoryNotFoundError:
        cause = "no such repository (or it is private: set HF_TOKEN)"
    except LocalEntryNotFoundError as e:
        cause = (
            f"HF_HUB_OFFLINE is set and it is not in the cache {hub_cache_dir()}"
            if offline()
            else f"the hub cannot be reached and it is not in the cache {hub_cache_dir()} ({_root_cause(e)})"
        )
    except (HFValidationError, OSError) as e:
        cause = _root_cause(e)
    else:
        return Path(path)
    where = endpoint or "https://huggingface.co"
    raise ModelError(f"cannot get {what} {str(hub)!r} from the hub ({where}): {cause}") from None


def _root_cause(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
