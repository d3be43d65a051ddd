"""`mpatch families`: the registered model families, as a table (the docs' tables are generated from it)."""

from __future__ import annotations

import json

from megatron_patch.cli.common import print_table
from megatron_patch.lora.plan import target_modules
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.models.shape.model_shape import model_shapes
from megatron_patch.training.launcher_args import describe_size, get_launcher, launchers

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.


def family_rows(*, with_params: bool = False) -> list[dict]:
    """One row per family; ``with_params`` adds each preset's parameter counts (megatron-core builds one
    layer of each kind per preset, once: models/shape/model_shape.py caches it)."""
    rows = []
    for name, f in families().items():
        extra = ", ".join(f.launcher_parallel_args)
        rows.append({
            "family": name, "summary": f.summary, "model_types": list(f.hf_model_types),
            "architectures": list(f.hf_architectures), "launcher": f.launcher,
            "arguments": len(get_launcher(name).arg_names()), "after_cp": extra, "sizes": [*f.presets, "auto"],
            # Pai-Megatron-Patch's names for sizes named otherwise here, and Pai's launchers that train the family
            "size_aliases": dict(f.size_aliases), "pai_launchers": [p.script for p in f.pai_launchers],
        })
    if with_params:
        presets = [(row, size, parse_arch(config)) for row, f in zip(rows, families().values())
                   for size, config in f.presets.items()]
        for (row, size, _), shape in zip(presets, model_shapes([arch for *_, arch in presets])):
            row.setdefault("presets", {})[size] = {"params_total": shape.params(),
                                                   "params_active": shape.params(active=True)}
    return rows


def markdown(table: str) -> str:
    """``models``: what each family is and claims; ``launchers``: each launcher's arguments and sizes (Pai-Megatron-
    Patch's names in brackets); ``pai``: Pai's launchers and what each runs here; ``lora``: the HF modules each
    MP_LORA_TARGETS group adapts, per family (its tiny model's)."""
    rows = family_rows()
    if table == "models":
        lines = ["| family | Hugging Face `model_type` | architectures | what |", "| --- | --- | --- | --- |"]
        lines += [f"| `{r['family']}` | {', '.join(f'`{t}`' for t in r['model_types'])} | "
                  f"{', '.join(r['architectures'])} | {r['summary']} |" for r in rows]
    elif table == "launchers":
        lines = ["| launcher | arguments | model sizes (MODEL_SIZE) |", "| --- | --- | --- |"]
        for r in rows:
            launcher = get_launcher(r["family"])
            sizes = ", ".join(f"`{describe_size(launcher, s)}`" for s in launcher.sizes)
            lines.append(f"| `{launcher.script}` | {launcher.counts()} | {sizes}, `auto` |")
    elif table == "pai":
        lines = ["| Pai-Megatron-Patch's launcher (the same path here) | arguments | MODEL_SIZE: what it trains here |",
                 "| --- | --- | --- |"]
        for launcher in sorted((x for x in launchers().values() if x.pai), key=lambda x: x.script):
            sizes = ", ".join(f"`{describe_size(launcher, s)}`" for s in launcher.sizes if s != "tiny")
            lines.append(f"| `{launcher.script}` | {launcher.counts()} | {sizes}, `auto` |")
    elif table == "lora":
        targets = ("qkv", "proj", "fc1", "fc2", "experts", "shared_experts")
        lines = ["| family | " + " | ".join(f"`{t}`" for t in targets) + " |", "| --- |" + " --- |" * len(targets)]
        for name, f in families().items():
            have = target_modules(parse_arch(f.tiny_config))
            lines.append(f"| `{name}` | " + " | ".join(
                "<br>".join(f"`{m.removesuffix(' (parameter)')}`" + (" (parameter)" if m.endswith(" (parameter)") else "")
                            for m in have[t]) if t in have else "-" for t in targets) + " |")
    else:
        raise ValueError(f"unknown table {table!r}")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    if args.markdown:
        print(markdown(args.markdown), end="")
    elif args.json:
        print(json.dumps(family_rows(with_params=True), indent=2))
    else:
        def sizes(r: dict) -> str:  # "30B-A3B/A3B": a preset and Pai's name for it
            return " ".join(s + "".join(f"/{a}" for a, p in r["size_aliases"].items() if p == s) for s in r["sizes"])

        def launcher(r: dict) -> str:  # its script and every argument count it takes (gemma4: 25 or 27)
            found = get_launcher(r["family"])
            return f"{found.script.rpartition('/')[2]}: {found.counts()}"

        rows = [{**r, "model_types": ",".join(r["model_types"]), "sizes": sizes(r), "launcher": launcher(r)}
                for r in family_rows()]
        print_table(rows, ["family", "model_types", "launcher", "sizes", "summary"])
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "families", help="the supported model families, their launchers and preset sizes",
        description="List the registered model families: the Hugging Face model types each claims, its launcher's "
                    "argument count, and the published sizes it has presets for.")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output, with each preset's params_total and params_active (from the "
                        "shapes megatron-core builds; the first call per preset takes seconds, later ones are cached)")
    p.add_argument("--markdown", choices=["models", "launchers", "pai"], help="print one of the docs' tables")
    p.set_defaults(run=run)
