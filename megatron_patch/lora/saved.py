"""peft's ``modules_to_save``: HF modules trained whole beside the adapters and saved with them.

Here they are the MCore parameters the weight table maps one to one from those modules' HF tensors (the
output layer from ``lm_head``, a norm, a router): they stay trainable while every other base weight is
frozen. A module fused with others into one MCore parameter (q_proj of ``linear_qkv``) cannot train alone, and
either end of a tied embedding (peft trains it apart from the other end): both are refused in one line.
"""

from __future__ import annotations

import re

from megatron_patch.checkpoint_files.torch_dist import TorchDistReader
from megatron_patch.errors import UserError
from megatron_patch.lora.plan import loaded_name
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.registry import get_family
from megatron_patch.models.mapping import Rule, Scope, plan_transfers
from megatron_patch.models.mapping.naming import te_to_local_name
from megatron_patch.models.shape.skeleton import describe_model
from megatron_patch.runtime.distributed import ParallelLayout

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).
# So are checkpoint.model_io and blocks.builder, which import torch at their top.


def _named(hf_name: str, modules: tuple[str, ...]) -> bool:
    """Whether the module holding ``hf_name`` is one of ``modules`` as peft matches them: by a plain suffix of its
    name ("norm" is every *norm module: input_layernorm too), which a match at a dot missed (the ldoc audit)."""
    module = hf_name.rpartition(".")[0]
    return any(module.endswith(m) for m in modules)


def saved_rules(arch: Arch, modules: tuple[str, ...]) -> dict[str, Rule]:
    """HF tensor name (as stored) -> its rule, for every HF tensor under ``modules`` (decoder layers expanded).
    ``modules`` name them as stored or as transformers loads them (``ModelFamily.hf_loaded_prefixes``: peft's names
    on Gemma 3's multimodal checkpoint, model.language_model.norm for the stored language_model.model.norm)."""
    if not modules:
        return {}
    family = get_family(arch.family)

    def named(hf_name: str, names: tuple[str, ...]) -> bool:
        return _named(hf_name, names) or _named(loaded_name(family.hf_loaded_prefixes, hf_name), names)

    out: dict[str, Rule] = {}
    rules = family.weight_rules(arch)
    # peft trains a copy of the one module it is told, and keeps the other end of a tied pair as it was: a tied
    # megatron-core model, one weight for both, cannot hold that
    tied = {r.tied_to for r in rules if r.tied_to is not None} if arch.tie_word_embeddings else set()
    for rule in rules:
        if rule.mtp:
            continue
        layers = range(arch.num_layers) if rule.scope in (Scope.LAYER, Scope.EXPERT) else [None]
        experts = range(arch.num_experts) if rule.scope is Scope.EXPERT else [None]
        for layer in layers:
            for expert in experts:
                names = [h.replace("{layer}", str(layer)).replace("{expert}", str(expert)) for h in rule.hf]
                hits = [n for n in names if named(n, modules)]
                if not hits:
                    continue
                if len(names) > 1:
                    raise UserError(f"modules_to_save names {hits[0].rpartition('.')[0]}, which megatron-core fuses "
                                    f"with {', '.join(n for n in names if n not in hits) or 'others'} into one weight: it "
                                    "cannot be trained whole alone")
                if (rule.tied_to is not None and arch.tie_word_embeddings) or names[0] in tied:
                    raise UserError(f"modules_to_save names {hits[0].rpartition('.')[0]}, one end of this model's tied "
                                    "embedding and output layer: peft would train it apart from the other end, which "
                                    "a tied model cannot hold; train the pair with LoRA targets instead, or untie "
                                    "them (tie_word_embeddings: false)")
                out[names[0]] = rule
    missing = [m for m in modules if not any(named(n, (m,)) for n in out)]
    if missing:
        raise UserError(f"modules_to_save names {missing[0]}, which is no module of a {arch.family} model")
    return out


def saved_mcore_names(arch: Arch, modules: tuple[str, ...]) -> set[str]:
    """The MCore parameter names (TE naming, global layer numbers) of ``modules``."""
    out = set()
    for hf_name, rule in saved_rules(arch, modules).items():
        m = re.search(r"\.layers\.(\d+)\.", hf_name)
        out.add(rule.mcore.replace("{layer}", m.group(1)) if m else rule.mcore)
    return out


def load_saved(chunks: list, arch: Arch, layout, saved: dict) -> None:
    """Put modules_to_save tensors (HF names, whole) into this rank's model chunk: each cut by its rule's split
    for this rank's place, as the converter cuts it."""
    if not saved:
        return
    import torch

    from megatron_patch.checkpoint.model_io import current_coord
    from megatron_patch.models.blocks.builder import model_spec_name
    if len(chunks) > 1:
        raise UserError("an adapter with modules_to_save cannot start under a virtual pipeline (MP_VP, MP_VP_CHUNKS) "
                        "yet: train it without one")
    chunk = chunks[0]
    spec_name = model_spec_name(chunk)
    rules = list({id(r): r for r in saved_rules(arch, tuple(_modules_of(saved))).values()}.values())
    coord = current_coord()
    params = dict(chunk.named_parameters())
    with torch.no_grad():
        for t in plan_transfers(rules, arch, layout, spec=spec_name):
            if not all(n in saved for n in t.hf_names):
                continue
            shards = t.split.shards([saved[n] for n in t.hf_names], t.num_shards, t.context)
            for p in t.placements:
                if coord.holds(t, p):
                    name = te_to_local_name(p.mcore_name) if spec_name == "local" else p.mcore_name
                    params[name].copy_(shards[p.shard])


def _modules_of(saved: dict) -> set[str]:
    return {n.rpartition(".")[0] for n in saved}


def stored_saved_tensors(folder, arch: Arch, spec) -> dict:
    """The modules_to_save weights a LoRA checkpoint at ``folder`` stores (under megatron-core's keys), as HF
    tensors, whole: what a peft adapter's modules_to_save holds (``load_saved`` takes either)."""
    if not spec.modules_to_save:
        return {}
    rules = list({id(r): r for r in saved_rules(arch, spec.modules_to_save).values()}.values())
    return {name: t for tensors in stored_hf_tensors(folder, arch, rules) for name, t in tensors.items()}


def stored_hf_tensors(folder, arch: Arch, rules: list):
    """For each transfer of ``rules``, its HF tensors read whole from the torch_dist checkpoint at ``folder``, in
    the dtype they are stored in (one transfer's tensors in memory at a time)."""
    import torch

    skeleton = describe_model(arch)
    reader = TorchDistReader(folder)
    for t in plan_transfers(rules, arch, ParallelLayout()):
        name = t.placements[0].mcore_name
        chunks = [c for c in skeleton.chunks if c.name == name]
        absent = next((c.key for c in chunks if c.key not in reader.tensors), None)
        if absent is not None:  # a record naming modules_to_save it never saved: a KeyError (the lora audit)
            raise UserError(f"{folder} holds no {absent}, which its record's modules_to_save names: the checkpoint's "
                            "sidecar is damaged or was edited")
        full = torch.empty(skeleton.shapes[name], dtype=getattr(torch, reader.dtype(chunks[0].key)))
        for c in chunks:
            full[c.region()] = reader.read_block(c.key, c.global_offset, c.local_shape).reshape(full[c.region()].shape)
        yield dict(zip(t.hf_names, t.split.merge([full], t.context)))
