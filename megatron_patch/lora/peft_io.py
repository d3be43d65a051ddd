"""Adapters in peft's folder format, both ways: adapter_config.json and adapter_model.safetensors with
peft's key names (``base_model.model.<module>.lora_A.weight``).

Inside this project an adapter is a set of whole tensors under its checkpoint names (``Adapter.key_a`` /
``key_b``: A [rank, in], B [rows, rank], one routed expert each), and ``modules_to_save`` tensors under their
HF names. Reading a peft folder checks every tensor against the model's plan; what does not fit (a module the
model lacks, a shape of another base) is refused in one line. peft's layouts that differ from that are
converted exactly as peft itself converts them:

- routed experts stacked by transformers 5 (``mlp.experts.gate_up_proj`` [E, 2I, H], reached through
  ``target_parameters``): A [r*E, in] holds expert e's rows e*r..(e+1)*r, B [out, r*E] its columns j*E + e
  (peft's ParamWrapper); two targeted parameters of one module nest, the later one outermost, so the
  earlier one's keys carry ``base_layer.``;
- per-expert adapters of transformers 4 (``mlp.experts.3.gate_proj``, Mixtral's ``w1``): gate and up join
  into one adapter of rank 2r (A = [A_gate; A_up], B block-diagonal), as peft's weight conversion does.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path

from megatron_patch.errors import UserError
from megatron_patch.input_files import checked_input
from megatron_patch.lora.plan import PEFT_PREFIX, Site, loaded_name, plan_sites, stacked_depth, stored_name
from megatron_patch.lora.saved import saved_rules
from megatron_patch.lora.spec import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraSpec,
    read_adapter_config,
    spec_from_peft_config,
)
from megatron_patch.models.description.registry import get_family
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.mapping import LORA_TARGETS

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

_LORA_KEY = re.compile(r"^(?P<module>.+?)\.(?P<base>(?:base_layer\.)*)(?P<which>lora_[AB])\.weight$")


def _everything(spec: LoraSpec) -> LoraSpec:
    """The plan of every module the model can adapt, with ``spec``'s ranks (to name and place what a file holds)."""
    return dataclasses.replace(spec, targets=LORA_TARGETS, modules=None, layers=None, modules_to_save=())


def read_peft_adapter(folder: str | Path, arch: Arch, shape=None) -> tuple[LoraSpec, dict, dict]:
    """(the spec, adapter tensors by checkpoint key, modules_to_save tensors by HF name) of a peft folder,
    checked against ``arch``'s model. Tensors are float32 or as stored."""
    # safetensors.torch imports torch
    from safetensors.torch import load_file

    folder = Path(folder)
    where = str(folder / ADAPTER_CONFIG)
    spec = spec_from_peft_config(read_adapter_config(folder), where)
    weights = folder / ADAPTER_WEIGHTS
    # the same checks as adapter_config.json's: inside the folder (not a link to elsewhere) and a regular file
    real = checked_input(weights, inside=folder, limit=None, hint="the peft adapter folder is incomplete")
    try:
        stored = load_file(str(real))
    except Exception as exc:  # noqa: BLE001 - any unreadable file is bad input
        raise UserError(f"{weights} is not a readable safetensors file ({type(exc).__name__}: {exc})")
    stored = {k.removeprefix(PEFT_PREFIX): v for k, v in stored.items()}
    every = plan_sites(arch, _everything(spec), shape)
    lora, saved = {}, {}
    for key, tensor in stored.items():
        m = _LORA_KEY.match(key)
        if m:
            lora[(m.group("module"), len(m.group("base")) // len("base_layer."), m.group("which"))] = tensor
        elif ".lora_" in key:
            raise UserError(f"{weights}: {key} is not a LoRA A/B weight this project reads (embedding LoRA and "
                            "LoRA variants are not supported)")
        else:
            saved[key] = tensor
    lora, saved = _language_model_names(lora, every), _language_model_names(saved, every)
    # modules_to_save tensors go on under the names they are stored by (peft has the loaded model's)
    prefixes = get_family(arch.family).hf_loaded_prefixes
    saved = {stored_name(prefixes, k): v for k, v in saved.items()}
    adapters, modules = _match_adapters(lora, every, arch, str(weights), spec, read_adapter_config(folder))
    targets = tuple(t for t in LORA_TARGETS
                    if any(s.target == t and any(a.name in modules for a in s.adapters) for s in every))
    spec = _final_spec(spec, modules, targets)
    _check_saved(spec, saved, arch, str(weights))
    return spec, adapters, saved


LANGUAGE_MODEL = "model.language_model."


def _language_model_names(found: dict, every: list[Site]) -> dict:
    """peft names modules as the class it wrapped has them. A multimodal hub checkpoint's language model
    (Qwen3.5) sits at ``model.language_model.`` in the hub's class, the names the weight table and exports
    use, and at ``model.`` in the text-only class AutoModelForCausalLM builds: an adapter of either is read."""
    names = {n for s in every for n in s.hf_names} | {a.name for s in every for a in s.adapters}
    if not names or not all(n.startswith(LANGUAGE_MODEL) for n in names):
        return found

    def moved(name: str) -> str:
        text_class = name.startswith("model.") and not name.startswith((LANGUAGE_MODEL, "model.visual."))
        return LANGUAGE_MODEL + name[len("model."):] if text_class else name

    return {((moved(k[0]),) + k[1:] if isinstance(k, tuple) else moved(k)): v for k, v in found.items()}


def _final_spec(spec: LoraSpec, modules: dict, targets: tuple[str, ...]) -> LoraSpec:
    """The file's modules (with the rank and alpha each was read with, where peft's patterns would not
    give them: transformers-4 experts joined into rank-2r adapters)."""
    rank_pattern, alpha_pattern = dict(spec.rank_pattern), dict(spec.alpha_pattern)
    for name, (rank, alpha) in modules.items():
        if spec.rank_alpha(name) != (rank, alpha):
            rank_pattern[re.escape(name)] = rank
            alpha_pattern[re.escape(name)] = alpha
    # explicit names first: peft takes the first pattern that matches
    rank_pattern = {**{k: v for k, v in rank_pattern.items() if k not in spec.rank_pattern}, **spec.rank_pattern}
    alpha_pattern = {**{k: v for k, v in alpha_pattern.items() if k not in spec.alpha_pattern}, **spec.alpha_pattern}
    return dataclasses.replace(spec, modules=tuple(sorted(modules)), targets=targets, rank_pattern=rank_pattern,
                               alpha_pattern=alpha_pattern)


def _match_adapters(lora: dict, every: list[Site], arch: Arch, where: str, spec: LoraSpec, config: dict):
    """Place each (module, depth, A/B) tensor of the file on the model's plan; returns (tensors by checkpoint
    key, {adapter name: (rank, alpha)}). An adapter on a module its config does not target, or of another rank
    than its config gives, is refused: peft would not load it (``_as_configured``)."""
    import torch

    config_params = config.get("target_parameters") or []
    as_configured = _as_configured(config, spec, where)

    plain: dict[str, tuple] = {}      # HF module -> (site, adapter)
    stacked: dict[tuple, list] = {}   # (module of a stacked parameter, parameter) -> [(site, adapter)] by expert
    per_expert: dict[str, tuple] = {} # transformers-4 per-expert module -> (site, part)
    for s in every:
        for a in s.adapters:
            if a.expert is None:
                plain[a.name] = (s, a)
            else:
                stacked.setdefault(a.name, []).append((s, a))
                for part, hf_name in enumerate(s.hf_names):
                    per_expert[hf_name.removesuffix(".weight")] = (s, part)
    depth_of = {}  # (module, depth) -> the stacked parameter whose adapter the file nests that deep
    on_module: dict[str, list[str]] = {}
    for name in stacked:  # the weight table's order, which is the HF parameters' order
        module = name.rpartition(".")[0]
        if any(k[0] == module for k in lora):
            on_module.setdefault(module, []).append(name)
    for module, names in on_module.items():
        depths = {k[1] for k in lora if k[0] == module}
        if len(depths) == len(names):
            depth = stacked_depth([stacked[n][0][0] for n in names])
            depth_of.update({(module, depth[n]): n for n in names})
        elif len(depths) == 1:  # one of the module's parameters: the config names it, or A's input width tells
            a = lora.get((module, next(iter(depths)), "lora_A"))
            fits = [n for n in names if any(n == t or n.endswith("." + t) for t in config_params)]
            if len(fits) != 1:
                fits = [n for n in names if a is not None and a.shape[1] == stacked[n][0][1].in_features]
            if len(fits) != 1:
                raise UserError(f"{where}: cannot tell which parameter of {module} its adapter is on: name it in "
                                "the config's target_parameters")
            depth_of[(module, next(iter(depths)))] = fits[0]
        else:
            raise UserError(f"{where}: {module} has {len(depths)} nested adapters, the model {len(names)} parameters")

    out, ranks = {}, {}
    used = set()

    def pair(module, depth=0):
        a, b = lora.get((module, depth, "lora_A")), lora.get((module, depth, "lora_B"))
        if a is None or b is None:
            raise UserError(f"{where}: {module} has lora_{'A' if a is None else 'B'} missing: the adapter is incomplete")
        used.update({(module, depth, "lora_A"), (module, depth, "lora_B")})
        return a, b

    def check(name, a, b, rank_in, rows, what):
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != rank_in or b.shape[0] != rows or a.shape[0] != b.shape[1]:
            raise UserError(f"{where}: {what} has A {tuple(a.shape)} and B {tuple(b.shape)}, but this "
                            f"{arch.family} model's {name} takes A (r, {rank_in}) and B ({rows}, r): the adapter "
                            "was made for another base model")

    modules = set(k[0] for k in lora)
    for module in sorted(modules):
        if module in plain:
            s, ad = plain[module]
            a, b = pair(module)
            check(module, a, b, ad.in_features, sum(ad.rows), module)
            as_configured(module, a.shape[0])
            out[ad.key_a], out[ad.key_b] = a, b
            ranks[module] = (a.shape[0], spec.rank_alpha(module)[1])
    for (module, depth), name in depth_of.items():
        a, b = pair(module, depth)
        group = stacked[name]
        n = len(group)
        ad0 = group[0][1]
        rank = a.shape[0] // n if a.shape[0] % n == 0 else -1
        if rank < 1 or b.shape[1] != rank * n:
            raise UserError(f"{where}: {module}'s adapter on {name.rpartition('.')[2]} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}, which do not stack {n} experts: the adapter was made for another base model")
        check(name, a[:rank], b[:, :rank], ad0.in_features, sum(ad0.rows), f"{name} (expert 0)")
        # as _as_configured for modules: peft builds the experts' adapters from target_parameters and the rank the
        # config gives, then loads the file; these were taken as the file had them (the lora audit: logits 0.15 off
        # peft's where target_parameters left the experts out)
        if not any(name == t or name.endswith("." + t) for t in config_params):
            raise UserError(f"{where}: holds an adapter on {name}, which its adapter_config.json's target_parameters "
                            f"({config_params!r}) do not name: peft would not load it; fix the config or the file")
        if rank != spec.rank_alpha(name)[0]:
            raise UserError(f"{where}: {name}'s adapter has rank {rank}, but its adapter_config.json gives it rank "
                            f"{spec.rank_alpha(name)[0]} (r, rank_pattern): peft refuses it (a size mismatch); fix "
                            "the config or the file")
        b3 = b.reshape(b.shape[0], rank, n)
        for e, (s, ad) in enumerate(sorted(group, key=lambda g: g[1].expert)):
            out[ad.key_a] = a[e * rank:(e + 1) * rank].contiguous()
            out[ad.key_b] = b3[:, :, e].contiguous()
        ranks[name] = (rank, spec.rank_alpha(name)[1])
    # transformers-4 per-expert adapters, joined per expert as peft's conversion joins them
    joined: dict[tuple, dict] = {}
    for module in sorted(modules):
        if module in plain or module in {m for m, _ in depth_of}:
            continue
        refused = next((why for leaf, why in get_family(arch.family).lora_refused.items()
                        if module == leaf or module.endswith("." + leaf)), None)
        if refused is not None:
            raise UserError(f"{where}: has an adapter on {module}: {refused}")
        if module.rpartition(".")[2] in ("lm_head", "embed_tokens"):  # not another model's: not built here yet
            raise UserError(f"{where}: has an adapter on {module}: LoRA on the output layer or the embedding is not "
                            "supported yet (docs/lora.md); train it whole with modules_to_save instead")
        if module not in per_expert:
            raise UserError(f"{where}: has an adapter on {module}, which this {arch.family} model does not have as a "
                            f"LoRA target: the adapter was made for another base model (targets here: "
                            f"{', '.join(sorted({s.target for s in every}))})")
        s, part = per_expert[module]
        joined.setdefault((s.mcore_name, id(s)), {"site": s})[part] = pair(module)
    for entry in joined.values():
        s = entry.pop("site")
        ad = next(a for a in s.adapters)
        missing = [s.hf_names[p].removesuffix(".weight") for p in range(len(s.hf_names)) if p not in entry]
        if missing:
            raise UserError(f"{where}: {missing[0]} has no adapter while the other modules fused with it into "
                            f"{ad.name} do: transformers 5 stacks them, and peft converts only both together")
        blocks_a, blocks_b, rank = [], [], 0
        scalings = set()
        for p in range(len(s.hf_names)):
            a, b = entry[p]
            check(s.hf_names[p].removesuffix(".weight"), a, b, ad.in_features, ad.rows[p], s.hf_names[p])
            as_configured(s.hf_names[p].removesuffix(".weight"), a.shape[0])
            blocks_a.append(a)
            blocks_b.append(b)
            rank += a.shape[0]
            scalings.add(spec.scaling(a.shape[0], spec.rank_alpha(s.hf_names[p].removesuffix(".weight"))[1]))
        if len(scalings) != 1:
            raise UserError(f"{where}: the modules joined into {ad.name} have different scalings {sorted(scalings)}")
        scale = scalings.pop()
        big_b = torch.zeros(sum(ad.rows), rank, dtype=blocks_b[0].dtype)
        row = col = 0
        for b in blocks_b:
            big_b[row:row + b.shape[0], col:col + b.shape[1]] = b
            row, col = row + b.shape[0], col + b.shape[1]
        out[ad.key_a], out[ad.key_b] = torch.cat(blocks_a, 0), big_b
        alpha = scale * (rank ** 0.5 if spec.use_rslora else rank)
        previous = ranks.setdefault(ad.name, (rank, alpha))
        if previous[0] != rank:
            raise UserError(f"{where}: the experts of {ad.name} have adapters of different ranks: peft keeps one")
    left = set(lora) - used
    if left:
        raise UserError(f"{where}: {len(left)} tensor(s) fit no adapter of this {arch.family} model, e.g. "
                        f"{sorted(left)[0][0]}: the adapter was made for another base model")
    if not out:
        raise UserError(f"{where} holds no LoRA weights")
    return out, ranks


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _as_configured(config: dict, spec: LoraSpec, where: str):
    """A check that an adapter found on the module ``name`` (not a stacked parameter: target_parameters reach
    those) is one its config makes, with the rank it gives: peft builds the adapters from the config and then
    loads the file, so it ignores tensors of modules the config does not target (target_modules,
    layers_to_transform) and refuses another rank (a size mismatch). Merging them would not be peft's model."""
    targets = config.get("target_modules")

    def names_of(name: str) -> set[str]:
        # under either class's names (_language_model_names): the config names modules as the file does
        return {name, "model." + name[len(LANGUAGE_MODEL):] if name.startswith(LANGUAGE_MODEL) else name}

    def targeted(name: str) -> bool:
        if isinstance(targets, str):  # a regular expression over the whole name, or peft's shorthand
            return targets == "all-linear" or any(re.fullmatch(targets, n) for n in names_of(name))
        return any(n == t or n.endswith("." + t) for n in names_of(name) for t in targets or ())

    def by_last_parts(name: str) -> bool:
        """peft applies layers_to_transform only to a module a list names by its last parts, not to one it names
        in full or a regular expression matches (``check_target_module_exists``)."""
        return not isinstance(targets, str) and not names_of(name) & set(targets or ())

    def check(name: str, rank: int) -> None:
        if not targeted(name):
            raise UserError(f"{where}: holds an adapter on {name}, which its adapter_config.json does not target "
                            f"(target_modules {targets!r}): peft would not load it; fix the config or the file")
        layer = _LAYER.search(name)
        if (spec.layers is not None and layer is not None and int(layer.group(1)) not in spec.layers
                and by_last_parts(name)):
            raise UserError(f"{where}: holds an adapter on {name}, outside its adapter_config.json's "
                            f"layers_to_transform {list(spec.layers)}: peft would not load it; fix the config or the file")
        configured = spec.rank_alpha(name)[0]
        if rank != configured:
            raise UserError(f"{where}: {name}'s adapter has rank {rank}, but its adapter_config.json gives it rank "
                            f"{configured} (r, rank_pattern): peft refuses it (a size mismatch); fix the config or "
                            "the file")
    return check


def _check_saved(spec: LoraSpec, saved: dict, arch: Arch, where: str) -> None:
    """modules_to_save tensors: HF tensors the weight table maps one to one (lm_head, norms, ...)."""
    if saved and not spec.modules_to_save:
        raise UserError(f"{where} holds {sorted(saved)[0]}, which is neither a LoRA weight nor in modules_to_save")
    rules = saved_rules(arch, spec.modules_to_save)
    for name, tensor in saved.items():
        if name not in rules:
            raise UserError(f"{where}: {name} is saved whole, but this {arch.family} model's modules_to_save "
                            f"{list(spec.modules_to_save)} map to {sorted(rules) or 'no tensor'}")


# --- writing ---------------------------------------------------------------------------------------------------

def peft_tensors(sites: list[Site], tensors: dict) -> dict:
    """peft's adapter_model.safetensors content from whole adapter tensors (by checkpoint key)."""
    import torch

    out = {}
    depth = stacked_depth(sites)
    by_param: dict[str, list] = {}
    for s in sites:
        for a in s.adapters:
            if a.expert is None:
                out[f"{PEFT_PREFIX}{a.name}.lora_A.weight"] = tensors[a.key_a]
                out[f"{PEFT_PREFIX}{a.name}.lora_B.weight"] = tensors[a.key_b]
            else:
                by_param.setdefault(a.name, []).append(a)
    for name, adapters in by_param.items():
        adapters.sort(key=lambda a: a.expert)
        module = name.rpartition(".")[0]
        prefix = f"{PEFT_PREFIX}{module}." + "base_layer." * depth[name]
        out[f"{prefix}lora_A.weight"] = torch.cat([tensors[a.key_a] for a in adapters], 0)
        # peft's B: column j*E + e is column j of expert e's B
        out[f"{prefix}lora_B.weight"] = torch.stack([tensors[a.key_b] for a in adapters], -1).reshape(
            adapters[0].shape_b[0], -1)
    return {k: v.contiguous() for k, v in out.items()}


def peft_config(sites: list[Site], spec: LoraSpec, arch: Arch, base: str | None) -> dict:
    """adapter_config.json for ``sites``: the most common rank and alpha, every other one named exactly, and
    the modules named as briefly as names relative to a layer allow without reaching another module."""
    adapters = {a.name: a for s in sites for a in s.adapters}
    rank = Counter(a.rank for a in adapters.values()).most_common(1)[0][0]
    alpha = Counter(a.alpha for a in adapters.values()).most_common(1)[0][0]
    universe = {a.name for s in plan_sites(arch, _everything(spec)) for a in s.adapters}
    plain = sorted(n for n, a in adapters.items() if a.expert is None)
    # A checkpoint that carries modules the model here does not build (a vision tower) may hold some of the same
    # names relative to a layer (Gemma 3's SigLIP has self_attn.q_proj): peft would adapt those too.
    whole_names = bool(get_family(arch.family).hf_carried)
    stacked = sorted(n for n, a in adapters.items() if a.expert is not None)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": alpha, "lora_dropout": spec.dropout, "bias": "none", "use_rslora": spec.use_rslora,
        "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "target_modules": (plain if whole_names else
                           _names(plain, {n for n in universe if adapters.get(n) is None or adapters[n].expert is None})),
        "target_parameters": _names(stacked, {n for n in universe if n in stacked or "." in n}) or None,
        "rank_pattern": {re.escape(n): a.rank for n, a in adapters.items() if a.rank != rank},
        "alpha_pattern": {re.escape(n): a.alpha for n, a in adapters.items() if a.alpha != alpha},
        "modules_to_save": list(spec.modules_to_save) or None,
        "layers_to_transform": None, "layers_pattern": None,
    }
    if not config["target_parameters"]:
        config.pop("target_parameters")
    return config


def _names(chosen: list[str], universe: set[str]) -> list[str]:
    """Layer-relative names (``self_attn.q_proj``) when they pick exactly ``chosen`` out of ``universe``, else
    the full names (peft matches a full name exactly, and a relative one at the end of any module's name)."""
    relative = sorted({re.sub(r"^.*?\.layers\.\d+\.", "", n) for n in chosen})
    picked = {n for n in universe for r in relative if n == r or n.endswith("." + r)}
    return relative if picked == set(chosen) else list(chosen)


def peft_reinterpreted(model_type: str | None) -> set[str]:
    """Module names peft reads, on a model of ``model_type``, as the routed experts' stacked parameters (its
    conversion of transformers-4 MoE adapters: on Mixtral, DeepSeek, Qwen3-MoE and their kin, ``gate_proj``,
    ``up_proj`` and ``down_proj`` anywhere mean the experts). peft's own table when peft is installed."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:
        return set()
    return set(_MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type), {}))


def check_peft_loads(sites: list[Site], arch: Arch) -> None:
    """An adapter peft would load otherwise than it was trained is refused: peft reinterprets a dense or
    shared-expert MLP's gate/up/down names on some MoE model types, so such adapters export merged only."""
    leaves = peft_reinterpreted(arch.hf_config.get("model_type"))
    bad = sorted({a.name for s in sites for a in s.adapters if a.expert is None and a.name.rsplit(".", 1)[1] in leaves})
    if bad:
        groups = ",".join(sorted({s.target for s in sites for a in s.adapters if a.name in bad}))
        raise UserError(f"peft reads {bad[0].rsplit('.', 1)[1]} on {arch.hf_config.get('model_type')} models as the routed "
                        f"experts, so it cannot load the adapter on {bad[0]} (targets {groups}): export it merged with "
                        "--merge-lora, which is exact, or train those targets out (MP_LORA_TARGETS)")


def write_peft_adapter(folder: str | Path, sites: list[Site], spec: LoraSpec, arch: Arch, tensors: dict,
                       saved: dict, base: str | None = None, dtype=None) -> None:
    """Write a peft adapter folder (``folder`` exists and is empty); ``dtype``: the tensors' dtype on disk."""
    # safetensors.torch imports torch
    from safetensors.torch import save_file

    check_peft_loads(sites, arch)
    out = peft_tensors(sites, tensors)
    prefixes = get_family(arch.family).hf_loaded_prefixes
    out.update({f"{PEFT_PREFIX}{loaded_name(prefixes, name)}": t.contiguous() for name, t in saved.items()})
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
    save_file(out, str(Path(folder) / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (Path(folder) / ADAPTER_CONFIG).write_text(json.dumps(peft_config(sites, spec, arch, base), indent=2) + "\n")
