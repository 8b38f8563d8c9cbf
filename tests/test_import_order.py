"""Imports run one way: a package imports only from packages in lower layers (or from itself).

Every `import` and `from ... import` counts, including those inside functions and under
`TYPE_CHECKING`: a lazy import still ties the two packages together.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "service", ROOT / "operator", ROOT / "loadtest"]

# Lowest first. A package is a subpackage of dspark (or a top-level module of it), or a top-level
# package. Packages in one layer do not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("dspark", "dspark.validation", "dspark.prompts"),  # shared helpers and prompt sets
    ("dspark.models", "dspark.sps_format", "dspark.tier_format", "dspark.node_resources"),
    ("dspark.engine",),  # the Drafter and VerifyPolicy interfaces, survival probabilities, prompts
    ("dspark.drafters", "dspark.policies"),
    ("dspark.profiling",),  # measures an engine
    ("dspark.builder",),  # wires an engine from a config
    ("dspark.serving", "dspark.training", "dspark.calibration"),
    ("dspark.bench", "dspark_loadtest"),  # measure the layers below
    ("dspark.commands",),
    ("dspark.cli", "locustfile", "multiturn_locustfile"),
]
# The operator image has no torch: the operator reads the SPS profile and tier formats, and the Ray
# resources of node types, and nothing else.
OPERATOR_MAY_IMPORT = {
    "dspark",
    "dspark.sps_format",
    "dspark.tier_format",
    "dspark.node_resources",
    "dspark.validation",
}

LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def package_of(module: str) -> str:
    """`dspark.engine.llm_engine` -> `dspark.engine`; `dspark_operator.kube` -> `dspark_operator`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "dspark" and len(parts) > 1 else parts[0]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the tree, relative ones resolved."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                found.append((node.lineno, ".".join([*base, *([node.module] if node.module else [])])))
            elif node.module:
                found.append((node.lineno, node.module))
    return found


def violations() -> list[str]:
    found = []
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            module = module_name(path, root)
            source = package_of(module)
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, target in imported_modules(tree, module, path.name == "__init__.py"):
                target_package = package_of(target)
                if target_package == source or not target_package.startswith("dspark"):
                    continue
                where = f"{path.relative_to(ROOT)}:{line}: {source} imports {target}"
                if source == "dspark_operator":
                    if target_package not in OPERATOR_MAY_IMPORT:
                        found.append(f"{where} (the operator may import only {sorted(OPERATOR_MAY_IMPORT)})")
                elif source not in LAYER or target_package not in LAYER:
                    unknown = source if source not in LAYER else target_package
                    found.append(f"{where} ({unknown} has no layer in LAYERS)")
                elif LAYER[target_package] >= LAYER[source]:
                    found.append(
                        f"{where} (layer {LAYER[source]} may import only from layers below it; "
                        f"{target_package} is layer {LAYER[target_package]})"
                    )
    return found


def test_imports_run_one_way() -> None:
    found = violations()
    assert not found, "imports against the layer order:\n" + "\n".join(found)


def test_every_package_has_a_layer() -> None:
    packages = {
        package_of(module_name(path, root))
        for root in SOURCES[:1]
        for path in (root / "dspark").rglob("*.py")
        if path.parent == root / "dspark" or path.parent.parent == root / "dspark"
    }
    assert packages <= set(LAYER), f"packages without a layer: {sorted(packages - set(LAYER))}"


def test_relative_imports_resolve_to_their_package() -> None:
    tree = ast.parse("from . import a\nfrom .b import c\nfrom ..models import d\n")
    found = [t for _, t in imported_modules(tree, "dspark.engine.x", is_package=False)]
    assert found == ["dspark.engine", "dspark.engine.b", "dspark.models"]


@pytest.mark.parametrize("module", ["dspark_operator.handlers", "dspark.sps_format", "dspark.node_resources"])
def test_operator_side_imports_without_torch(module: str) -> None:
    """The operator image installs no torch (nor NumPy): what it imports must not need them."""
    code = (
        "import sys\n"
        "for name in ('torch', 'numpy', 'transformers'):\n"
        "    sys.modules[name] = None\n"
        f"import {module}\n"
    )
    paths = [str(p) for p in SOURCES]
    env_path = ":".join(paths)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
