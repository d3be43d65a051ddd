"""SFT data in the forms Pai-Megatron-Patch users bring, made here for the tests (nothing from a model hub, no code
of Pai's: its formats were read in its repository, toolkits/sft_data_preprocessing, and are written anew below).

- chat templates in two styles, Qwen's ChatML and Llama 3's headers, each marking the assistant's part with
  ``{% generation %}`` so that transformers' ``return_assistant_tokens_mask`` gives the reference mask;
- a byte-level BPE tokenizer folder (the kind Qwen and Llama 3 ship) with such a template;
- megatron-core's .bin/.idx pair written by hand, and Pai's SFT idxmap samples built as its
  ``build_idxmap_sft_dataset.py`` builds them;
- a worker that trains several configurations in one job (``runtime.launch.run_local``).
"""

from __future__ import annotations

import json
import string
import struct
from pathlib import Path

import numpy

QWEN_STYLE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QWEN_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

LLAMA3_STYLE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
    "Today Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if m['role'] == 'assistant' %}{% generation %}{{- m['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- m['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
LLAMA3_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def make_byte_level_tokenizer(folder: str | Path, texts: list[str], template: str, special_tokens: tuple[str, ...],
                              config: dict, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer folder trained on ``texts`` (Qwen's and Llama 3's kind: a leading space belongs
    to the word, so a rendered conversation tokenizes differently whole than in pieces), with ``template`` and
    ``config`` (its special tokens by name) in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts + list(string.printable), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def chat_ids(hf_tokenizer, messages: list[dict], **kwargs):
    """transformers' ``apply_chat_template(tokenize=True)``: its ids (and, with ``return_assistant_tokens_mask``,
    its mask), whichever shape this transformers returns them in."""
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"]), list(out.get("assistant_masks", []))


# --- megatron-core's mmap pair, and Pai's SFT idxmap ----------------------------------------------------------

DTYPE_CODES = {numpy.int16: 3, numpy.int32: 4, numpy.int64: 5, numpy.uint16: 8}


def write_mmap_pair(prefix: str | Path, sequences: list[list[int]], dtype=numpy.int32) -> str:
    """``PREFIX.bin`` and ``PREFIX.idx`` in megatron-core's indexed format (version 1), one document per sequence."""
    arrays = [numpy.asarray(s, dtype=dtype) for s in sequences]
    lengths = numpy.array([len(a) for a in arrays], dtype=numpy.int32)
    pointers = numpy.concatenate([[0], numpy.cumsum(lengths.astype(numpy.int64))[:-1]]) * numpy.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for a in arrays:
            f.write(a.tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, DTYPE_CODES[dtype], len(arrays), len(arrays) + 1))
        f.write(lengths.tobytes() + pointers.astype(numpy.int64).tobytes())
        f.write(numpy.arange(len(arrays) + 1, dtype=numpy.int64).tobytes())
    return str(prefix)


def pai_sft_sequences(hf_tokenizer, items: list, seq_len: int, pad_id: int, packing: bool = False) -> list[list[int]]:
    """The samples Pai's SFT preprocessing writes for ``items`` (records, or lists of records: its packed-SFT JSON),
    rendered with ``hf_tokenizer``'s chat template: the prompt is the user turn rendered alone, without a
    generation prompt, so Pai's labels take in the assistant header (``pai_sft_samples`` lays them out)."""

    def pair(r):
        user = {"role": "user", "content": r["instruction"] + r["input"]}
        prompt, _ = chat_ids(hf_tokenizer, [user])
        full, _ = chat_ids(hf_tokenizer, [user, {"role": "assistant", "content": r["output"]}])
        return prompt, full

    groups = [[r for item in items for r in (item if isinstance(item, list) else [item])]] if packing else [
        item if isinstance(item, list) else [item] for item in items]
    return [s for group in groups for s in pai_sft_samples([pair(r) for r in group], seq_len, pad_id)]


def pai_sft_samples(pairs: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> list[list[int]]:
    """Pai's SFT idxmap samples of (prompt ids, prompt-and-response ids) pairs, packed in order into as few
    samples as fit: each 2*seq_len ids, the input ids (each record's last one stored as -1 - id) padded with
    ``pad_id``, then the labels (-100 on the prompt and the padding)."""
    out, doc, labels = [], [], []
    for prompt, full in pairs:
        if len(prompt) >= seq_len:
            continue
        full = list(full[:seq_len])
        label = [-100] * (len(prompt) - 1) + full[len(prompt):] + [-100]
        full[-1] = -1 - full[-1]
        if len(doc) + len(full) > seq_len:
            out.append(doc + [pad_id] * (seq_len - len(doc)) + labels + [-100] * (seq_len - len(labels)))
            doc, labels = [], []
        doc, labels = doc + full, labels + label
    if doc:
        out.append(doc + [pad_id] * (seq_len - len(doc)) + labels + [-100] * (seq_len - len(labels)))
    return out


# --- training in this test run's job ----------------------------------------------------------------------------

def train_worker(cfgs: list) -> list[dict]:
    """Each configuration trained to its end in one process (imports paid once); metrics go to its
    OUTPUT_BASEPATH/log/metrics.jsonl, as a launcher's rank writes them."""
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.training.loop import Trainer

    out = []
    for cfg in cfgs:
        init_model_parallel(cfg.layout, seed=cfg.seed)
        trainer = Trainer(cfg)
        trainer.build()
        out.append(trainer.run()["losses"])
    return out
