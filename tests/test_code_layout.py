"""The package's import rules (docs/architecture.md): imports at the top of a module unless the module says
why not; packages import only the packages below them (``PACKAGE_ORDER``) and no modules import each other; no
test module imports another (shared code lives in tests/*_helpers.py)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_patch"
# How a module's top-level comment says why some of its imports are inside functions (a measured start-up cost,
# an optional package, the order megatron-core must load in); it names the imports it covers.
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


def _comments(source: str) -> dict[int, str]:
    return {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT}


def _names_in(text: str, module: str, imported: list[str]) -> bool:
    """Whether ``text`` names what an import brings in: a distribution by its name (torch, megatron-core,
    transformers, ...), a module of this project by its last two parts (``checkpoint.loading``)."""
    text = text.replace("-", "_")
    for name in [module, *(f"{module}.{n}" for n in imported)]:
        parts = name.split(".")
        if parts[0] != "megatron_patch" and parts[0] in text:
            return True
        if parts[0] == "megatron_patch" and len(parts) > 2 and ".".join(parts[-2:]) in text:
            return True
    return False


def test_deferred_imports_say_why_where_they_are():
    """An import inside a function gives its reason next to it: in a comment on it or just above it (above the
    imports it stands with), or in a comment at the module's top level that gives the reason and names it."""
    unexplained = []
    for path in _modules():
        source = path.read_text()
        tree, comments, lines = ast.parse(source), _comments(source), source.splitlines()
        in_functions = {line for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for line in range(node.lineno, node.end_lineno + 1)}
        blocks, block = [], []  # the module's top-level comments, a run of comment lines each
        for line in sorted(set(comments) - in_functions):
            if block and line != block[-1][0] + 1:
                blocks.append(" ".join(text for _, text in block))
                block = []
            block.append((line, comments[line]))
        blocks.append(" ".join(text for _, text in block))
        reasons = [b for b in blocks if any(reason in b for reason in REASONS)]
        import_lines = {line for node, _, _ in _imports(tree) for line in range(node.lineno, node.end_lineno + 1)}
        for node, names, at_top in _imports(tree):
            if at_top:
                continue
            line = node.lineno - 1  # up past the imports it stands with (all their lines), to the comment above
            while line >= 1 and line in import_lines:
                line -= 1
            beside = any(n in comments for n in range(node.lineno, node.end_lineno + 1))
            if beside or (line >= 1 and lines[line - 1].lstrip().startswith("#")):
                continue
            imported = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if not all(any(_names_in(b, name, imported) for b in reasons) for name in names):
                unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno} ({names[0]})")
    assert not unexplained, f"imports inside functions whose reason is not beside them: {unexplained}"


# The packages of megatron_patch (and its top-level modules), from the top down: each imports only those below it,
# never one beside it or above (docs/architecture.md draws this). The root package itself (``__version__``) is
# below them all.
PACKAGE_ORDER = (
    ("__main__",),
    ("cli",),  # one entry point, one module per subcommand
    ("training", "align"),  # the two things a user runs on a model: neither needs the other
    ("evaluation",),  # lm-eval over a model, loaded from a checkpoint or live in training
    ("convert",),  # the converter alone
    ("lora",),  # adapters: planned from the weight tables, read and written through checkpoint/
    ("checkpoint",),  # checkpoint identity and model I/O, which convert, lora, training and align share
    ("models",),  # the families and what they share; no checkpoint files beyond the formats below
    ("checkpoint_files",),  # the formats, model-free
    ("runtime",),  # process groups, devices, megatron-core's CPU compatibility layer
    ("outputs",),  # one writer per output, folders published whole
    ("tokenizer",),  # tokenizer folders and files, read as untrusted input
    ("input_files", "dtypes", "units", "lazy", "demo_data"),
    ("errors",),
)


def _package_of(module: str) -> str | None:
    """The top-level package (or module) of megatron_patch that ``module`` names; None for the root itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "megatron_patch" and len(parts) > 1 else None


def test_imports_are_absolute():
    """The rules below read an import by its absolute name: a relative one (``from ..training import loop``) would
    pass them unread, an upward import or a cycle included."""
    relative = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in _modules()
                for node, _, _ in _imports(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, f"relative imports: {relative}"


def test_only_a_family_names_itself():
    """Everything that differs between families lives in the family's folder (docs/architecture.md): the converter,
    the aligner, the trainer, LoRA, the checkpoint readers and evaluation read the registry's fields, and no module
    outside models/ holds a family's name (the aligner listed DeepSeek-V4 as having no fp8 floor). Pai's converter
    scripts are named by Pai's folders, some of which share a family's name: cli/ is left out."""
    from megatron_patch.models.description.registry import families

    names = set(families())
    named = [f"{path.relative_to(ROOT)}:{node.lineno} ({node.value})" for path in _modules()
             if path.relative_to(PACKAGE).parts[0] not in ("models", "cli")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]
    assert not named, f"family names outside models/: {named}"


def test_package_order_names_every_package():
    top_level = {p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0] for p in _modules()} - {"__init__"}
    named = {name for layer in PACKAGE_ORDER for name in layer}
    assert top_level == named, f"packages missing from PACKAGE_ORDER, or named there but gone: {sorted(top_level ^ named)}"


def test_packages_import_only_downward():
    rank = {name: i for i, layer in enumerate(PACKAGE_ORDER) for name in layer}
    upward = []
    for path in _modules():
        parts = path.relative_to(PACKAGE).parts
        own = parts[0] if len(parts) > 1 else path.stem
        if own == "__init__":
            continue
        for node, names, _ in _imports(ast.parse(path.read_text())):
            for name in names:
                if isinstance(node, ast.ImportFrom) and name == "megatron_patch":
                    names_imported = [a.name for a in node.names]
                    targets = [n for n in names_imported if n in rank]  # from megatron_patch import cli
                else:
                    targets = [_package_of(name)]
                for target in targets:
                    if target in rank and own in rank and target != own and rank[target] <= rank[own]:
                        upward.append(f"{path.relative_to(ROOT)}:{node.lineno} ({own} -> {target})")
    assert not upward, f"imports that go up or sideways in PACKAGE_ORDER: {upward}"


def _module_graph() -> dict[str, set[str]]:
    """Every module of megatron_patch and the modules of it that it imports (at the top or inside functions)."""
    modules = {}
    for path in _modules():
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in modules.items():
        graph[module] = set()
        for node, names, _ in _imports(ast.parse(path.read_text())):
            for name in names:
                targets = ([f"{name}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []) + [name]
                target = next((t for t in targets if t in modules), None)
                while target is None and "." in name:  # import megatron_patch.x.y.z as far as it is a module
                    name = name.rsplit(".", 1)[0]
                    target = name if name in modules else None
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def test_no_modules_import_each_other():
    """Not even through others, and not even inside functions (training's checkpointing and lora_run did):
    a module that needs another's job and is needed by it holds a piece of that job."""
    graph = _module_graph()
    cycles, done = [], set()

    def visit(module: str, path: list[str]):
        for target in sorted(graph[module]):
            if target in path:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, f"modules that import each other: {cycles}"


# A family folder imports another family only where it extends that one on purpose (docs/architecture.md, "What
# families share"); everything else several families use is a building block in models/blocks/.
EXTENDS = {
    "deepseek_v32": "deepseek_v3",  # DeepSeek-V3.2 and GLM-5 are DeepSeek-V3 plus sparse attention
    "qwen3_5": "qwen3_next",  # Qwen3.5 is Qwen3-Next's hybrid layers under other tensor names
}


def test_families_import_only_the_family_they_extend():
    from megatron_patch.models.description.registry import NOT_FAMILIES

    folders = {p.parent.name for p in (PACKAGE / "models").glob("*/__init__.py")} - NOT_FAMILIES
    crossing = []
    for path in (PACKAGE / "models").rglob("*.py"):
        own = path.relative_to(PACKAGE / "models").parts[0]
        if own not in folders:
            continue
        for node, names, _ in _imports(ast.parse(path.read_text())):
            for name in names:
                parts = name.split(".")
                other = parts[2] if parts[:2] == ["megatron_patch", "models"] and len(parts) > 2 else None
                if other in folders and other != own and EXTENDS.get(own) != other:
                    crossing.append(f"{path.relative_to(ROOT)}:{node.lineno} ({own} -> {other})")
    assert not crossing, f"families importing another family (move what they share to models/blocks/): {crossing}"


def test_installed_versions_are_read_in_one_place():
    """A distribution's installed version (its name spelled two ways, or not installed) is read by
    ``runtime.machine.installed_version`` alone: four private copies of it had grown."""
    readers = sorted({str(path.relative_to(ROOT)) for path in _modules()
                      for _, names, _ in _imports(ast.parse(path.read_text())) if "importlib.metadata" in names})
    assert readers == ["megatron_patch/runtime/machine.py"], f"modules reading installed versions themselves: {readers}"


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


# Family folders whose modules are being built, which register no family until their layer, weight table and launcher
# join them (the registry imports them and finds nothing to register).
BEING_BUILT: set[str] = set()


def test_models_sub_packages_are_families_or_shared_kinds():
    """Every sub-package of models/ is a family folder (it registers at least one family) or one of the shared
    kinds the registry skips, which registers none: a shared package mistaken for a family would be imported as
    one, and a family folder in the skipped set would vanish from every list."""
    from megatron_patch.models.description.registry import NOT_FAMILIES, families

    folders = {p.parent.name for p in (PACKAGE / "models").glob("*/__init__.py")}
    registering = {f.parse_config.__module__.split(".")[2] for f in families().values()}
    assert NOT_FAMILIES <= folders, f"skipped names that are no folder: {sorted(NOT_FAMILIES - folders)}"
    assert not registering & NOT_FAMILIES, f"shared packages that register a family: {sorted(registering & NOT_FAMILIES)}"
    assert folders - NOT_FAMILIES - BEING_BUILT == registering, \
        f"family folders that register nothing: {sorted(folders - NOT_FAMILIES - BEING_BUILT - registering)}"
    assert not BEING_BUILT & registering, f"families still marked as being built: {sorted(BEING_BUILT & registering)}"
