"""Where a model's adapters come from, for every consumer alike (training, the aligner, tests): a peft folder,
or a checkpoint written here that carries them (hf2mcore --peft-dir, a LoRA run's iteration or final/).

``open_adapters`` reads one into whole tensors; ``add_adapters`` puts them on a rank's model chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.errors import UserError
from megatron_patch.lora.peft_io import read_peft_adapter
from megatron_patch.lora.plan import plan_sites
from megatron_patch.lora.saved import load_saved, stored_saved_tensors
from megatron_patch.lora.spec import ADAPTER_CONFIG, LoraSpec
from megatron_patch.lora.state import check_adapter_keys, find_base, load_adapters, read_adapter_tensors

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).
# So is lora.layers, which imports torch at its top.


@dataclass
class Adapters:
    spec: LoraSpec
    tensors: dict                                # whole adapter tensors by checkpoint key
    saved: dict = field(default_factory=dict)    # modules_to_save tensors by HF name
    base: Path | None = None                     # the base checkpoint a LoRA checkpoint names (None: its own)
    source: str = ""


def is_peft_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def open_adapters(path: str | Path, arch, verify: bool = True, base_dir: str | Path | None = None,
                  base_flag: str | None = None) -> Adapters:
    """The adapters of a peft folder or of a LoRA checkpoint, checked against ``arch``'s model; ``verify``: the
    iteration of a run's checkpoint folder chosen as ``find_checkpoint`` chooses it (the caller's own choice).
    ``base_dir``: the base a LoRA checkpoint was trained on, where it is no longer where it was recorded, given by
    the caller's option ``base_flag`` (None: it has none)."""
    if is_peft_folder(path):
        spec, tensors, saved = read_peft_adapter(path, arch)
        return Adapters(spec, tensors, saved, None, f"the peft adapter {path}")
    opened = open_checkpoint(path, verify=verify)
    lora = opened.sidecar.lora
    if not lora:
        raise UserError(f"{path} is neither a peft adapter folder (adapter_config.json) nor a checkpoint with LoRA "
                        "adapters")
    spec = LoraSpec.from_dict(lora["spec"])
    tensors = read_adapter_tensors(opened.found.folder)
    check_adapter_keys(plan_sites(arch, spec), tensors, str(opened.found.folder))
    base = find_base(lora["base"], base_dir, str(path), base_flag) if lora.get("base") else None
    # a LoRA run's modules_to_save weights are beside its adapters, not in the base loaded first: laid over it as a
    # peft adapter's are (they were refused, and `mpatch eval` of such a run with them; the ldoc audit)
    saved = stored_saved_tensors(opened.found.folder, arch, spec) if base is not None else {}
    return Adapters(spec, tensors, saved, base, f"the adapters of {path}")


def add_adapters(chunks: list, arch, adapters: Adapters, layout, dtype) -> list:
    """Attach ``adapters`` to this rank's model chunks (base frozen) and fill them; returns the containers."""
    from megatron_patch.lora.layers import attach
    containers = attach(chunks, arch, adapters.spec, plan_sites(arch, adapters.spec), dtype)
    load_adapters(containers, adapters.tensors)
    load_saved(chunks, arch, layout, adapters.saved)
    return containers
