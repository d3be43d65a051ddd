"""Helpers of the conversion tests."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.checkpoint.loading import load_checkpoint_into_model
from megatron_patch.checkpoint_files.torch_dist import plan_torch_dist
from megatron_patch.cli import main
from megatron_patch.models.blocks.builder import build_model
from megatron_patch.models.blocks.inference import forward_logits, place_on_rank_device
from megatron_patch.runtime import init_model_parallel


def edit_weights(ckpt: Path, edit) -> None:
    """Plant a fault: ``edit`` the state dict of a legacy TP=1 checkpoint written by ``hf_to_mcore`` in place (then
    write its manifest again, or it is refused as a damaged file before anything judges it)."""
    path = ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    edit(state["model"])
    torch.save(state, path)


def leftovers(target: Path) -> list[str]:
    """Temporary siblings a conversion into ``target`` left behind."""
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


def run_cli(capsys, *argv) -> tuple[int, str]:
    """``mpatch argv`` in this process: its exit code and what it wrote to stderr."""
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def checkpoint_logits_worker(ckpt_dir: str, layout, tokens: torch.Tensor, dtype=torch.float32, hf_config=None):
    """Runs on every rank: build the model at ``layout``, load the checkpoint, return logits (last stage)."""
    arch = open_checkpoint(ckpt_dir, hf_config=hf_config).model_arch
    init_model_parallel(layout)
    model = build_model(arch, layout, dtype)
    load_checkpoint_into_model(model, ckpt_dir, layout, hf_config)
    return forward_logits(place_on_rank_device(model), tokens, arch.vocab_size)


MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def with_mtp_layer(src: Path, out: Path, seed: int = 9) -> Path:
    """A copy of the HF folder ``src`` with one multi-token-prediction layer, laid out as its family's hub
    checkpoints lay them out: the tensors the family's table reads for it drawn at random (shapes from the
    model megatron-core builds), and the copies it declares (embedding, head) equal to what they copy."""
    import dataclasses
    import json
    import shutil

    from safetensors.torch import save_file

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.models.description.registry import get_family, parse_arch
    from megatron_patch.models.mapping import plan_transfers
    from megatron_patch.models.shape.skeleton import describe_model
    from megatron_patch.runtime import ParallelLayout

    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    family = get_family(parse_arch(config).family)
    # the key its family reads, at the top of config.json or in its text_config (Qwen3.5's)
    where, key = next((c, k) for c in (config, config.get("text_config")) if isinstance(c, dict)
                      for k in MTP_CONFIG_KEYS if family.hf_mtp_layers({**config, **({k: 1} if c is config else
                                                                                    {"text_config": {**c, k: 1}})}) == 1)
    where[key] = 1
    arch = dataclasses.replace(parse_arch(config), mtp_layers=1)
    reader = HFCheckpointReader(src)
    tensors = {n: reader.get(n) for n in reader.keys()}
    shapes = describe_model(arch).hf_shapes
    g = torch.Generator().manual_seed(seed)
    for t in plan_transfers(family.weight_rules(arch), arch, ParallelLayout()):
        for name in t.hf_names:
            if name not in tensors:
                base = torch.randn(shapes[name], generator=g)
                tensors[name] = 1 + 0.1 * base if name.endswith("norm.weight") else 0.08 * base
    tensors.update({copy: tensors[source].clone() for copy, source in family.hf_copies(arch).items()})
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def quantize_fp8_blocks(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled float8_e4m3fn as DeepSeek's and MiniMax's hub checkpoints store it: per block,
    scale = amax / 448."""
    import math

    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = w[r, c].abs().max().clamp(min=1e-12) / 448.0
            q[r, c] = (w[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def write_fp8_checkpoint(src: Path, out: Path, linear: tuple[str, ...], block) -> Path:
    """``src`` written as the hub writes its FP8 models: the weights of the ``linear`` modules (leaf names) in FP8
    with block scales (``X.weight_scale_inv``), everything else bf16 (the router bias fp32), quantization_config
    in config.json."""
    import json
    import shutil

    from safetensors.torch import save_file

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    shutil.copytree(src, out)
    reader = HFCheckpointReader(src)
    tensors = {}
    for name in reader.keys():
        t = reader.get(name)
        if name.endswith(".weight") and name.split(".")[-2] in linear:
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(t, block)
        else:
            tensors[name] = t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_torch_dist_chunks(folder, items, objects, values) -> None:
    """A torch_dist checkpoint in ``folder`` holding ``items`` (ChunkItems) and ``objects``, each chunk's bytes
    taken from ``values[(key, offset)]``, written with the project's own writer."""
    plan = plan_torch_dist(folder, items, objects)
    plan.create_files()
    for (key, offset), v in values.items():
        stored = plan.stored[(key, offset)]
        with open(stored.path, "r+b") as f:
            f.seek(stored.offset)
            f.write(v.contiguous().view(torch.uint8).numpy().tobytes())
    plan.finish()


def read_torch_dist_release(release: Path):
    """(reader, every tensor whole, the stored objects' (key, bytes)) of a torch_dist folder: what a test rewrites
    as another tool would (``write_torch_dist_chunks``)."""
    import torch.distributed.checkpoint as dcp

    from megatron_patch.checkpoint_files.torch_dist import TorchDistReader

    reader = TorchDistReader(release)
    full = {k: torch.empty(reader.global_shape(k), dtype=getattr(torch, reader.dtype(k))) for k in reader.tensor_keys()}
    dcp.load(full, storage_reader=dcp.FileSystemReader(str(release)), no_dist=True)
    objects = []
    for key in sorted(reader.objects):
        where, offset, length, _ = reader.storage[(key, None)]
        with open(release / where, "rb") as f:
            f.seek(offset)
            objects.append((key, f.read(length)))
    return reader, full, objects
