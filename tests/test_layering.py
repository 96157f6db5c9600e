"""Import direction between the top-level packages (DESIGN.md "Packages", STYLE.md Layout 3).

Static checks parse every .py file with `ast`; a package that does not exist yet is skipped.
"Top level" means executed at import time: anything outside a function body, except under
`if TYPE_CHECKING:`.
"""

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "encoders", "gateway", "sessions", "replay")
GPU_ONLY = ("cupy", "flashinfer", "sglang", "triton", "flash_attn")

Parts = tuple[str, ...]


class Import(NamedTuple):
    path: Path
    lineno: int
    module: str
    is_top_level: bool

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.lineno}: imports {self.module}"


class Rule(NamedTuple):
    packages: Parts
    forbidden: Parts
    top_level_only: bool


def _gateway_outside_routing() -> Parts:
    """Every gateway module but gateway.routing (replay's window into the gateway)."""
    names = sorted(
        p.stem if p.suffix == ".py" else p.name
        for p in (ROOT / "gateway").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__")
        or (p.is_dir() and p.name not in ("routing", "__pycache__"))
    )
    return tuple(f"gateway.{n}" for n in names)


RULES = {
    "engine-encoders-import-nothing-above": Rule(
        ("engine", "encoders"), ("gateway", "sessions", "litestar", "replay"), top_level_only=False
    ),
    "sessions-imports-no-gateway": Rule(
        ("sessions",), ("gateway", "litestar", "replay"), top_level_only=False
    ),
    # NOTE: `agentgate replay` is a gateway CLI command, so gateway/cli.py imports replay.cli
    # inside its command function; nothing in the gateway depends on replay when imported
    "gateway-imports-replay-only-lazily": Rule(("gateway",), ("replay",), top_level_only=True),
    # replay drives the real engine and the real routers; anything else of the gateway (the
    # live replay starts `agentgate serve` as a process) only inside functions
    "replay-imports-engine-and-gateway-routing-only": Rule(
        ("replay",), (*_gateway_outside_routing(), "sessions"), top_level_only=True
    ),
    "only-gateway-imports-litestar": Rule(
        tuple(p for p in PACKAGES if p != "gateway"), ("litestar",), top_level_only=False
    ),
    "no-top-level-torch-in-gateway-sessions": Rule(
        ("gateway", "sessions"), ("torch",), top_level_only=True
    ),
    "no-top-level-gpu-only-libs": Rule(PACKAGES, GPU_ONLY, top_level_only=True),
}


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES.keys())
def test_import_rule(rule: Rule) -> None:
    violations = [
        imp.where() + (" at module top level" if rule.top_level_only else "")
        for package in rule.packages
        for imp in _imports_in_package(package)
        if _is_under(imp.module, rule.forbidden) and (imp.is_top_level or not rule.top_level_only)
    ]
    assert not violations, "forbidden imports:\n" + "\n".join(violations)


def test_import_does_not_load_torch() -> None:
    code = (
        "import importlib, sys\n"
        "for name in ('gateway', 'sessions', 'encoders'):\n"
        "    importlib.import_module(name)\n"
        "    if 'torch' in sys.modules:\n"
        "        sys.exit(f'import {name} loaded torch')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_checker_sees_nested_relative_and_guarded_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch.nn\n"
        "from .. import gateway\n"
        "if TYPE_CHECKING:\n"
        "    import cupy\n"
        "def f():\n"
        "    import triton\n"
        "class C:\n"
        "    lib = importlib.import_module('flash_attn')\n"
    )
    found = {
        (imp.lineno, imp.module, imp.is_top_level)
        for imp in _imports(ROOT / "engine" / "kv" / "x.py", source)
    }
    assert (2, "torch.nn", True) in found, found
    assert (3, "engine.gateway", True) in found, found  # `..` from engine/kv/ is engine
    assert (5, "cupy", False) in found, found
    assert (7, "triton", False) in found, found
    assert (9, "flash_attn", True) in found, found


def _imports_in_package(package: str) -> Iterator[Import]:
    for path in sorted((ROOT / package).rglob("*.py")):
        yield from _imports(path, path.read_text(encoding="utf-8"))


def _imports(path: Path, source: str) -> Iterator[Import]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1]  # the package a relative import starts from, for __init__.py too
    yield from _walk(ast.parse(source, filename=str(path)), path, package, is_top_level=True)


def _walk(node: ast.AST, path: Path, package: Parts, is_top_level: bool) -> Iterator[Import]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield Import(path, child.lineno, alias.name, is_top_level)
        elif isinstance(child, ast.ImportFrom):
            base = _resolve(child, package)
            for alias in child.names:  # `from . import gateway` may name a module
                module = base if alias.name == "*" else f"{base}.{alias.name}".lstrip(".")
                yield Import(path, child.lineno, module, is_top_level)
        elif isinstance(child, ast.Call) and (name := _dynamic_import(child)):
            yield Import(path, child.lineno, name, is_top_level)

        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(_module(stmt), path, package, is_top_level=False)
            for stmt in child.orelse:
                yield from _walk(_module(stmt), path, package, is_top_level)
        else:
            is_function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _walk(child, path, package, is_top_level and not is_function)


def _module(stmt: ast.stmt) -> ast.Module:
    return ast.Module(body=[stmt], type_ignores=[])


def _resolve(node: ast.ImportFrom, package: Parts) -> str:
    if node.level == 0:
        return node.module or ""
    base = package[: len(package) - (node.level - 1)]
    return ".".join((*base, node.module) if node.module else base)


def _dynamic_import(call: ast.Call) -> str | None:
    """`importlib.import_module("x")` / `__import__("x")` with a literal name."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_under(module: str, roots: Parts) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)
