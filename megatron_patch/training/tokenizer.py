"""Tokenizers for preprocessing and SFT: an HF tokenizer folder (tokenizer.json) or a tiktoken BPE file.

Both load from local files only (no model hub) and expose the same small interface: ``encode``,
``decode``, ``vocab_size`` and ``eod`` (the end-of-document id appended after each document).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_patch.errors import UserError

# Tried in order when a folder's files do not name the end-of-document token.
EOD_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
# The GPT-4 / cl100k split pattern, used for tiktoken BPE files (which carry only the ranks).
TIKTOKEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
TIKTOKEN_EOD = "<|endoftext|>"


def check_tokenizer_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise UserError(f"{p} has no tokenizer.json: give an HF tokenizer folder (with tokenizer.json) "
                            "or a tiktoken BPE file")
        return p
    if not p.is_file():
        raise UserError(f"tokenizer {p} not found: give an HF tokenizer folder (tokenizer.json) or a tiktoken BPE file")
    return p


class HFTokenizer:
    """``tokenizers.Tokenizer`` from a folder's tokenizer.json; EOD from its config files."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.path = folder
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eod(folder)

    def _find_eod(self, folder: Path) -> int:
        names = []
        cfg = folder / "tokenizer_config.json"
        if cfg.is_file():
            eos = json.loads(cfg.read_text()).get("eos_token")
            names.append(eos.get("content") if isinstance(eos, dict) else eos)
        for name in [n for n in names if n] + list(EOD_CANDIDATES):
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        model_cfg = folder / "config.json"
        if model_cfg.is_file():
            eos_id = json.loads(model_cfg.read_text()).get("eos_token_id")
            if isinstance(eos_id, list):
                eos_id = eos_id[0]
            if isinstance(eos_id, int):
                return eos_id
        raise UserError(f"{folder}: cannot tell the end-of-document token (no eos_token in tokenizer_config.json, "
                        f"none of {', '.join(EOD_CANDIDATES)} in the vocabulary)")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)


class TiktokenTokenizer:
    """A tiktoken BPE ranks file (base64 token, rank per line); EOD is ``<|endoftext|>`` after the ranks."""

    def __init__(self, path: Path):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            raise UserError("a tiktoken BPE file needs the tiktoken package: pip install tiktoken")
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as exc:  # noqa: BLE001 - any parse failure means "not a BPE file"
            raise UserError(f"{path} is not a tiktoken BPE file ({exc}): give a tokenizer folder or a .tiktoken file")
        self.path = path
        self.eod = max(ranks.values()) + 1
        self._enc = tiktoken.Encoding(name=path.name, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={TIKTOKEN_EOD: self.eod})
        self.vocab_size = self.eod + 1

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())

    def decode(self, ids) -> str:
        return self._enc.decode(list(map(int, ids)))


def load_tokenizer(path: str | Path):
    p = check_tokenizer_path(path)
    return HFTokenizer(p) if p.is_dir() else TiktokenTokenizer(p)
