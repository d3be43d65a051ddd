"""The sidecar every MCore checkpoint written here carries: ``mpatch_checkpoint.json``.

It records everything needed to turn the checkpoint back into an HF model (the HF config.json
itself, family, dtype, layout, vocabulary padding) and the versions that wrote it, so ``mcore2hf``
needs nothing but the checkpoint, and a training launch can take its architecture from here instead
of from flags that could drift from the weights.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from megatron_patch import __version__
from megatron_patch.checkpoint.outputs import is_carried_file
from megatron_patch.checkpoint_files.layout import PARTIAL_TAG, RELEASE, TRACKER_NAME, read_small_json, read_tracker
from megatron_patch.dtypes import PRECISION_DTYPE_NAMES, PRECISION_OF_DTYPE_NAME, dtype_name
from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.registry import get_family, parse_arch
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.runtime.machine import installed_version

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

SIDECAR_NAME = "mpatch_checkpoint.json"
SIDECAR_VERSION = 4  # 2: mtp_layers and notes; 3: lora; 4: tokenizer_model_config



def versions() -> dict[str, str | None]:
    return {"megatron_patch": __version__, "megatron_core": installed_version("megatron-core", "megatron_core"),
            "torch": installed_version("torch"), "transformers": installed_version("transformers"),
            "safetensors": installed_version("safetensors")}


@dataclass
class Sidecar:
    checkpoint_format: str          # "legacy" | "torch_dist"
    family: str
    dtype: str                      # "bf16" | "fp16" | "fp32"
    layout: dict                    # tp, pp, ep, etp
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    hf_config: dict
    carried_files: list[str] = field(default_factory=list)
    num_tensors: int = 0
    num_bytes: int = 0
    versions: dict = field(default_factory=versions)
    source: str = ""
    # Multi-token-prediction layers the checkpoint holds (converted with --mtp).
    mtp_layers: int = 0
    # What the conversion changed on the way (layers dropped, weights dequantized), in words.
    notes: list[str] = field(default_factory=list)
    # LoRA adapters it holds (None: none): {"spec": lora.spec.LoraSpec as a dict, "base": None when the base
    # weights are in the checkpoint too, else {"path", "digest"} of the base checkpoint they need}.
    lora: dict | None = None
    # The model config that picked transformers' tokenizer class when the carried tokenizer was read (a training
    # run's MP_TOKENIZER folder): None where it is hf_config's choice (a converted HF folder's tokenizer), {} where
    # the tokenizer folder had none (its files alone decided). tokenizer.class_picking_config reads it.
    tokenizer_model_config: dict | None = None
    sidecar_version: int = SIDECAR_VERSION

    @property
    def parallel_layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.layout["tp"], pp=self.layout["pp"], ep=self.layout["ep"], etp=self.layout.get("etp"))

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, PRECISION_DTYPE_NAMES[self.dtype])

    @property
    def dtype_name(self) -> str:
        return PRECISION_DTYPE_NAMES[self.dtype]

    @classmethod
    def create(cls, fmt: str, arch: Arch, layout: ParallelLayout, dtype, **extra) -> "Sidecar":
        """``dtype``: a torch dtype or its name."""
        return cls(checkpoint_format=fmt, family=arch.family, dtype=PRECISION_OF_DTYPE_NAME[dtype_name(dtype)],
                   layout={"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "etp": layout.etp},
                   vocab_size=arch.vocab_size, padded_vocab_size=arch.padded_vocab_size(),
                   tie_word_embeddings=arch.tie_word_embeddings, hf_config=arch.hf_config,
                   mtp_layers=arch.mtp_layers, **extra)

    @property
    def arch(self) -> Arch:
        """The model this checkpoint holds (its config, with the MTP layers it was converted with)."""

        arch = parse_arch(self.hf_config)
        # A checkpoint from another tool may pad the vocabulary otherwise than this project does.
        padded = self.padded_vocab_size if self.padded_vocab_size != arch.padded_vocab_size() else None
        return dataclasses.replace(arch, mtp_layers=self.mtp_layers, vocab_padded_to=padded)

    def write(self, folder: str | Path) -> None:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        (Path(folder) / SIDECAR_NAME).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")



def legacy_layout_problem(sidecar: Sidecar, layout) -> str | None:
    """Why a legacy checkpoint cannot load at ``layout`` (a ParallelLayout; None: it can). Its rank files are
    one per rank of the layout it was written at, so it loads at that layout only, without a virtual pipeline."""
    if sidecar.checkpoint_format != "legacy":
        return None
    written = sidecar.parallel_layout
    if (layout.tp, layout.pp, layout.ep, layout.expert_tp) != (written.tp, written.pp, written.ep, written.expert_tp):
        return (f"this legacy checkpoint is for {written}, not {layout}: convert again at that layout or use --format "
                "torch_dist, which loads at any layout")
    if layout.vp:
        return ("this legacy checkpoint loads only at the layout it was written for: convert with --format torch_dist "
                "to train with a virtual pipeline (MP_VP, MP_VP_CHUNKS)")
    return None

def _field_problem(sidecar: Sidecar) -> str | None:
    """The first field of a sidecar read from disk whose type is wrong (it is untrusted input like the rest)."""
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    checks = {
        "sidecar_version": whole(sidecar.sidecar_version), "hf_config": isinstance(sidecar.hf_config, dict),
        "family": isinstance(sidecar.family, str), "vocab_size": whole(sidecar.vocab_size),
        "padded_vocab_size": whole(sidecar.padded_vocab_size), "mtp_layers": whole(sidecar.mtp_layers),
        "tie_word_embeddings": isinstance(sidecar.tie_word_embeddings, bool),
        "layout": isinstance(sidecar.layout, dict) and all(whole(sidecar.layout.get(k)) and sidecar.layout[k] >= 1
                                                            for k in ("tp", "pp", "ep"))
        and (sidecar.layout.get("etp") is None or whole(sidecar.layout["etp"])),
        "carried_files": isinstance(sidecar.carried_files, list) and all(isinstance(n, str) and n
                                                                         for n in sidecar.carried_files),
        "notes": isinstance(sidecar.notes, list), "versions": isinstance(sidecar.versions, dict),
        "tokenizer_model_config": sidecar.tokenizer_model_config is None or isinstance(sidecar.tokenizer_model_config,
                                                                                       dict),
        # a LoRA run's record: its spec (each field checked where it is read, lora.spec.LoraSpec.from_dict) and the
        # base it needs, by path and digest
        "lora": sidecar.lora is None or (isinstance(sidecar.lora, dict) and isinstance(sidecar.lora.get("spec"), dict)
                                         and _base_record_ok(sidecar.lora.get("base"))),
    }
    bad = next((name for name, ok in checks.items() if not ok), None)
    return f"'{bad}' has the wrong type or value" if bad else None


def _base_record_ok(record) -> bool:
    return record is None or (isinstance(record, dict) and all(isinstance(record.get(k), str) and record[k]
                                                               for k in ("path", "digest")))


def _check_mtp_layers(sidecar: Sidecar, path: Path) -> None:
    """Refuse more multi-token-prediction layers than the checkpoint's config declares (what hf2mcore --mtp
    records), before a model of that many is planned: 10**9 made mcore2hf run for minutes through gigabytes. The
    config's own count is bounded by its checks (``config_checks.MAX_LAYERS``)."""
    family = get_family(parse_arch(sidecar.hf_config).family)
    declared = family.hf_mtp_layers(sidecar.hf_config) if family.builds_mtp else 0
    if sidecar.mtp_layers > declared:
        raise UserError(f"{path} is malformed ('mtp_layers' is {sidecar.mtp_layers}, and the model's config declares "
                        f"{declared} multi-token-prediction layer(s)): the checkpoint's sidecar is damaged")


def _read_raw(path: Path):
    try:
        return read_small_json(path)
    except UserError as exc:
        raise UserError(f"{path} is malformed ({str(exc).replace(str(path), 'it', 1)}): the checkpoint's sidecar is "
                        "damaged")


def _check_version(data, path: Path) -> None:
    """Read before the fields: a newer release's sidecar carries fields (and side files) this one does not know,
    which are its version's, not damage."""
    version = data.get("sidecar_version") if isinstance(data, dict) else None
    if type(version) is int and version > SIDECAR_VERSION:
        raise UserError(f"{path} has sidecar version {version}; this megatron_patch reads up to "
                        f"{SIDECAR_VERSION}: upgrade megatron_patch")


def read_sidecar(folder: str | Path, *, release: bool = True) -> Sidecar:
    """The sidecar of a checkpoint folder. ``release``: a converted / exported checkpoint, whose
    tracker file must say 'release'; ``False`` for a training iteration folder (``iter_XXXXXXX``),
    whose tracker is the checkpoint root's."""
    folder = Path(folder)
    path = folder / SIDECAR_NAME
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: point --load-dir at a checkpoint written by 'mpatch convert hf2mcore'")
    if not path.exists():
        partial = any(p.name.startswith(f".{folder.name}{PARTIAL_TAG}") for p in folder.parent.iterdir())
        hint = " (a partial conversion of it exists: rerun hf2mcore)" if partial else ""
        raise UserError(f"{path} not found: {folder} is not a complete checkpoint written by 'mpatch convert hf2mcore'{hint}")
    data = _read_raw(path)
    _check_version(data, path)
    try:
        sidecar = Sidecar(**data)
    except TypeError as exc:
        raise UserError(f"{path} is malformed ({str(exc).replace(str(path), 'it', 1)}): the checkpoint's sidecar is "
                        "damaged")
    why = _field_problem(sidecar)
    if why:
        raise UserError(f"{path} is malformed ({why}): the checkpoint's sidecar is damaged")
    not_side = next((n for n in sidecar.carried_files if not is_carried_file(n)), None)
    if not_side is not None:
        # what mcore2hf copies into the export after its own files: a listed config.json or model.safetensors
        # (planted beside the checkpoint) replaced the converted ones, vouched for by the manifest (the sdoc audit)
        raise UserError(f"{path} lists {not_side!r} among its carried files, which is not a side file a checkpoint "
                        "carries (tokenizer, chat template, generation config, remote code, licence): the "
                        "checkpoint's sidecar is damaged or edited")
    if sidecar.checkpoint_format not in ("legacy", "torch_dist") or sidecar.dtype not in PRECISION_DTYPE_NAMES:
        raise UserError(f"{path} names format {sidecar.checkpoint_format!r} / dtype {sidecar.dtype!r}, which are unknown")
    if sidecar.mtp_layers:
        _check_mtp_layers(sidecar, path)
    if not release:
        return sidecar
    if read_tracker(folder) != RELEASE:
        raise UserError(f"{folder / TRACKER_NAME} is missing or does not say '{RELEASE}': the checkpoint is incomplete")
    return sidecar
