"""The demo corpus and tokenizer, made locally (the quick start, the GPU suite and the tests; nothing from a model hub).

The corpus is English-like text from a small grammar: it has structure a tiny model learns within a
few dozen steps. The tokenizer is a BPE trained on it with the ``tokenizers`` library, small enough
(<= 200 ids) for the tiny model presets, and it round-trips the text exactly.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "her brother", "the farmer"]
VERBS = ["sees", "likes", "finds", "carries", "watches", "follows", "paints", "remembers"]
OBJECTS = ["the red ball", "a green apple", "the long road", "a quiet river", "the tall tree", "a warm coat",
           "the blue house", "an empty box"]
PLACES = ["in the morning", "near the school", "after the rain", "at the market", "by the sea", "every day"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.6:
        s += " " + rng.choice(PLACES)
    return s[0].upper() + s[1:] + "."


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(rng.randint(2, 6))) for _ in range(n)]


def make_tokenizer(folder: str | Path, texts: list[str], vocab_size: int = 200) -> Path:
    """A BPE tokenizer folder (tokenizer.json + tokenizer_config.json) that round-trips the corpus exactly."""

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    # Every printable ASCII character is in the alphabet, so prompts and chat markup have no <unk>.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=list(string.printable.strip()) + ["\n"], show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return folder
