"""The package's import rules (docs/architecture.md): imports at the top of a module unless the module says
why not; nothing imports upward into the CLI; no test module imports another (shared code lives in
tests/*_helpers.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_patch"
# How a module says why some of its imports are inside functions (a measured start-up cost, an optional
# package, the order megatron-core must load in).
REASONS = ("imported inside", "imported here", "imported by the", "imported where", "imported only", "optional")


def _imports(tree: ast.AST):
    """(node, imported module names, whether it runs when the module is imported) for every import; one
    inside a ``try`` that catches ImportError (an optional package, a name that moved between releases)
    counts as the module's own."""
    def visit(node, in_function: bool, optional: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = [child.module or ""] if isinstance(child, ast.ImportFrom) else [a.name for a in child.names]
                yield child, names, not in_function or optional
            else:
                catches = isinstance(child, ast.Try) and any(
                    "ImportError" in ast.dump(h.type) for h in child.handlers if h.type is not None)
                yield from visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)),
                                 optional or catches)

    yield from visit(tree, False, False)


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_function_level_imports_say_why():
    unexplained = []
    for path in _modules():
        source = path.read_text()
        inner = [n for n, _, at_top in _imports(ast.parse(source)) if not at_top]
        if inner and not any(reason in source for reason in REASONS):
            unexplained.append(f"{path.relative_to(ROOT)}:{inner[0].lineno}")
    assert not unexplained, f"imports inside functions without a reason given in the module: {unexplained}"


def test_nothing_imports_the_cli_from_below():
    upward = []
    for path in _modules():
        if path.parent.name == "cli" or path.name == "__main__.py":
            continue
        for node, names, _ in _imports(ast.parse(path.read_text())):
            if any(n == "megatron_patch.cli" or n.startswith("megatron_patch.cli.") for n in names):
                upward.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not upward, f"library modules importing the CLI: {upward}"


def test_no_test_module_imports_another():
    tests = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    crossing = []
    for path in (ROOT / "tests").glob("*.py"):
        for node, names, _ in _imports(ast.parse(path.read_text())):
            for name in names:
                if name.split(".")[-1] in tests or (isinstance(node, ast.ImportFrom) and node.level
                                                     and any(a.name in tests for a in node.names)):
                    crossing.append(f"{path.name}:{node.lineno}")
    assert not crossing, f"test modules importing other test modules: {crossing}"


def test_every_folder_of_modules_is_an_installed_package():
    """setup.py installs what ``find_packages`` lists, which skips a folder without ``__init__.py``: a wheel
    would ship without its modules."""
    from setuptools import find_packages

    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in _modules()}
    missing = folders - set(find_packages(str(ROOT), include=["megatron_patch", "megatron_patch.*"]))
    assert not missing, f"folders of modules without an __init__.py, left out of the installed package: {sorted(missing)}"


def test_models_sub_packages_are_families_or_shared_kinds():
    """Every sub-package of models/ is a family folder (it registers at least one family) or one of the shared
    kinds the registry skips, which registers none: a shared package mistaken for a family would be imported as
    one, and a family folder in the skipped set would vanish from every list."""
    from megatron_patch.models.description.registry import NOT_FAMILIES, families

    folders = {p.parent.name for p in (PACKAGE / "models").glob("*/__init__.py")}
    registering = {f.parse_config.__module__.split(".")[2] for f in families().values()}
    assert NOT_FAMILIES <= folders, f"skipped names that are no folder: {sorted(NOT_FAMILIES - folders)}"
    assert not registering & NOT_FAMILIES, f"shared packages that register a family: {sorted(registering & NOT_FAMILIES)}"
    assert folders - NOT_FAMILIES == registering, f"family folders that register nothing: {sorted(folders - NOT_FAMILIES - registering)}"
