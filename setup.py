from setuptools import find_packages, setup

setup(
    name="megatron_patch",
    version="0.1.0",
    description="Llama-3.1, Qwen2 and MoE models on Megatron-Core: HF conversion, alignment, training",
    packages=find_packages(include=["megatron_patch", "megatron_patch.*"]),
    # the console script's entry, outside the package: it names a clash with another megatron_patch (Pai's)
    py_modules=["mpatch"],
    python_requires=">=3.10",
    install_requires=[
        # The releases whose internals the CPU compatibility layer and the converter were audited against:
        # 0.16.x (the newest for Python 3.10/3.11) and 0.19.x (Python >= 3.12). 0.17/0.18 were never
        # audited, and 0.20 is not out: each is refused here rather than half-working.
        "megatron-core>=0.16.1,!=0.17.*,!=0.18.*,<0.20",
        # Kept open downward so the local CPU build (2.13.0) satisfies it without pulling CUDA wheels.
        "torch>=2.4",
        "transformers>=4.56,<6",  # from_pretrained(dtype=...); 6.x unknown
        "safetensors>=0.4",
        "isal>=1.6",  # CRC-32 of checkpoint zip records at ~12 GB/s (zlib's: ~2), written and checked
        "zstandard>=0.22",  # torch_dist chunks saved with torch's stream.zstd transform
        "psutil",  # megatron-core's dist_checkpointing needs it at save time
        "tqdm",
        "tokenizers>=0.15",  # mpatch preprocess / SFT: HF tokenizer folders (tokenizer.json)
        "tiktoken>=0.6",  # mpatch preprocess: tiktoken BPE files
        "tensorboard",  # training logs under OUTPUT_BASEPATH/tensorboard
        "matplotlib",  # mpatch align's error-by-layer plot
        "xxhash>=3",  # the outputs' manifests: XXH3-128 digests (mpatch verify, checked loads)
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]>=2.0", "flash-attn>=2.6"],
        # PR=fp8 without transformer-engine: torchao's float8 training inside megatron-core's linears (docs/fp8.md);
        # imported only where a model is converted, so mpatch starts without it.
        "fp8": ["torchao>=0.18"],
        # accelerate: transformers dequantizes FP8 hub checkpoints with it (the FP8 conversion test compares).
        # hypothesis: the fuzzed bad-input contract (tests/test_bad_input.py) and chunkings of torch_dist blocks.
        # peft: the reference LoRA implementation tests/test_lora.py compares against both ways.
        # zstandard (already required above, for torch_dist chunks): the preprocessing tests' .zst inputs.
        # lm-eval: `mpatch eval` and the tests that compare it with lm-eval's own HF backend; torchao: PR=fp8 without
        # transformer-engine and its reference (tests/test_fp8.py). pytest-xdist: the suite runs one test file per core
        # (`-n auto --dist loadfile`): most tests are one process with one thread, which left the second core idle.
        "test": ["pytest>=7", "pytest-xdist>=3.5", "accelerate", "hypothesis>=6", "peft>=0.21", "zstandard>=0.22", "lm-eval==0.4.13",
                 "torchao>=0.18"],
        # `mpatch eval` (docs/evaluation.md): lm-evaluation-harness, pinned to the release whose model API and
        # request handling megatron_patch/evaluation/ was written against and checked equal to its HF backend.
        "eval": ["lm-eval==0.4.13"],
    },
    entry_points={"console_scripts": ["mpatch=mpatch:main"]},
)
