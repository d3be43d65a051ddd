"""Pai-Megatron-Patch's fp8_cast_bf16.py, with the flags its DeepSeek-V3 README gives, over `mpatch convert`:
    python fp8_cast_bf16.py --input-fp8-hf-path FP8_DIR --output-bf16-hf-path BF16_DIR
`mpatch convert pai fp8_cast_bf16.py --help` and docs/coming-from-pai.md say what it does here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from megatron_patch.cli import main  # noqa: E402 - after this repository is put first on the path

if __name__ == "__main__":
    sys.exit(main(["convert", "pai", "toolkits/model_checkpoints_convertor/deepseek/fp8_cast_bf16.py", *sys.argv[1:]]))
