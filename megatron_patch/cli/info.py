"""`mpatch info`: versions, device, and which attention / transformer-engine features this machine has."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def collect() -> dict:
    import torch

    from megatron_patch import __version__
    from megatron_patch.models.registry import families
    from megatron_patch.runtime import cpu_compat, versions

    cuda = torch.cuda.is_available()
    gpu = None
    if cuda:
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "count": torch.cuda.device_count(), "capability": f"{props.major}.{props.minor}",
               "memory_gib": round(props.total_memory / 2**30, 1)}
    te = _version("transformer-engine") or _version("transformer_engine")
    fa2 = _version("flash-attn") or _version("flash_attn")
    fa3 = _version("flash-attn-3") or _version("flash_attn_3")
    hopper = bool(gpu) and gpu["capability"].startswith("9.")
    tested = versions.tested_combination()
    return {
        "megatron_patch": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": _version("megatron-core") or _version("megatron_core"),
        "transformers": _version("transformers"),
        "safetensors": _version("safetensors"),
        "tested_combination": (f"yes ({tested.how})" if tested else
                               "no: see the README's supported versions for the combinations that are tested"),
        "device": "cuda" if cuda else "cpu",
        "gpu": gpu,
        "distributed_backend": "nccl" if cuda else "gloo",
        "cpu_compat_layer": "needed (no CUDA)" if cpu_compat.is_needed() else "off (CUDA present)",
        "features": {
            "transformer_engine": bool(te and cuda),
            "transformer_engine_version": te,
            "fp8": bool(te and cuda and gpu and float(gpu["capability"]) >= 8.9),
            "flash_attention_2": bool(fa2 and cuda),
            "flash_attention_3": bool(fa3 and hopper),
            "layer_spec": "transformer_engine" if te and cuda else "local",
            "attention": "flash/fused (TE)" if te and cuda else "local (unfused softmax)",
        },
        "families": {name: list(f.hf_model_types) for name, f in families().items()},
    }


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(map(len, info)) + 1
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:<{width}} {v}")
        else:
            print(f"{key:<{width}} {value}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("info", help="versions, device and available features",
                              description="Print versions, the device, and which attention/TE/FP8 features are usable here.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)
