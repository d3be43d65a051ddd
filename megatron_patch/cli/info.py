"""`mpatch info`: versions, device, and which attention / transformer-engine features this machine has."""

from __future__ import annotations

import json
import platform

from megatron_patch import __version__
from megatron_patch.models.description.registry import families
from megatron_patch.runtime.machine import features, gpu_info, installed_version

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.


def collect() -> dict:
    import torch

    # runtime.cpu_compat imports torch
    from megatron_patch.runtime import cpu_compat, versions

    gpu = gpu_info()
    tested = versions.tested_combination()
    return {
        "megatron_patch": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": installed_version("megatron-core", "megatron_core"),
        "transformers": installed_version("transformers"),
        "safetensors": installed_version("safetensors"),
        "tested_combination": (f"yes ({tested.how})" if tested else
                               "no: see the README's supported versions for the combinations that are tested"),
        "device": "cuda" if gpu else "cpu",
        "gpu": gpu,
        "distributed_backend": "nccl" if gpu else "gloo",
        "cpu_compat_layer": "needed (no CUDA)" if cpu_compat.is_needed() else "off (CUDA present)",
        "features": features(gpu),
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
