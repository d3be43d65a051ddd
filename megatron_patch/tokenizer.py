"""Tokenizers for preprocessing, SFT and ``align --text-file``: an HF tokenizer folder (tokenizer.json) or a
tiktoken BPE file.

Both load from local files only (no model hub, no code from the folder) and expose the same small interface:
``encode``, ``decode``, ``vocab_size``, ``eod`` (the end-of-document id appended after each document) and
``chat_template`` (a ``ChatTemplate`` when an HF folder carries one, else None). Every file is read through
``input_files`` (a regular file inside the folder, of a sane size) and parsed here, so a garbage file is one
line. A tiktoken file is parsed from its bytes each time: tiktoken's own loader caches a file under its path
string in ``/tmp/data-gym-cache``, so an edited file, or another folder's file given by the same relative
path, would tokenize with the old vocabulary.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
from pathlib import Path

from tokenizers import Tokenizer

from megatron_patch.errors import UserError
from megatron_patch.input_files import (check_folder_inputs, checked_input, locale_names_it_otherwise, read_input,
                                        read_input_text, read_json_object)

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.

# Tried in order when a folder's files do not name the end-of-document token.
EOD_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
# The GPT-4 / cl100k split pattern, used for tiktoken BPE files (which carry only the ranks).
TIKTOKEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
TIKTOKEN_EOD = "<|endoftext|>"


def check_tokenizer_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir() and not (p / "tokenizer.json").exists():
        # Kimi-K2's folder holds a tiktoken file and no tokenizer.json
        tiktoken_files = sorted(f for f in p.iterdir() if f.name == "tiktoken.model" or f.suffix == ".tiktoken")
        if len(tiktoken_files) == 1:
            return check_tokenizer_path(tiktoken_files[0])
    if p.is_dir():
        checked_input(p / "tokenizer.json", inside=p,
                      hint="give an HF tokenizer folder (with tokenizer.json) or a tiktoken BPE file")
        return p
    checked_input(p, hint="give an HF tokenizer folder (tokenizer.json) or a tiktoken BPE file")
    return p


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplate:
    """A tokenizer folder's jinja chat template, rendered by transformers' own renderer.

    ``assistant_spans`` renders a conversation exactly as ``apply_chat_template`` does and finds the
    characters each assistant message adds: the text between the conversation so far rendered with the
    generation prompt (which ends with the assistant header) and the conversation including that message
    (its content and end-of-turn markup). That needs a template under which a conversation's rendering
    starts with the rendering of any earlier part of it; one that does not is refused, naming the message.
    """

    def __init__(self, source: str | None, special_tokens: dict[str, str], where: str, names: tuple[str, ...] = ()):
        # source None: named templates (``names``) without a default, refused when a record is rendered
        self.source, self.special_tokens, self.where, self.names = source, special_tokens, where, names

    def render(self, messages: list[dict], add_generation_prompt: bool = False, record: str = "",
               tools: list[dict] | None = None) -> str:
        """``messages`` (with the function definitions ``tools``) as ``apply_chat_template`` renders them;
        ``record``: where they come from, for errors."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if self.source is None:
            # transformers' apply_chat_template refuses to pick among named templates without a default
            raise UserError(f"{self.where} has chat templates named {', '.join(self.names)} and none named "
                            "'default', so the one records are rendered with is not known: name one 'default'")
        try:
            rendered, _ = render_jinja_template([messages], tools=tools, chat_template=self.source,
                                                add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except Exception as exc:  # noqa: BLE001 - jinja syntax errors, raise_exception(...) in the template
            raise UserError(f"{record + ': ' if record else ''}the chat template of {self.where} failed: "
                            f"{type(exc).__name__}: {exc}") from None
        return rendered[0]

    def assistant_spans(self, messages: list[dict], where: str, tools: list[dict] | None = None
                        ) -> tuple[str, list[tuple[int, int]]]:
        """(the whole conversation rendered with ``tools``, the [start, end) character spans of its assistant
        turns)."""
        full = self.render(messages, record=where, tools=tools)
        spans, done = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self.render(messages[:i], add_generation_prompt=True, record=where, tools=tools) if i else \
                self._before_opening_answer(messages[0], full, where, tools)
            end = self.render(messages[:i + 1], record=where, tools=tools)
            if not (full.startswith(start) and full.startswith(end) and len(start) <= len(end)):
                raise UserError(f"{where}: the chat template of {self.where} does not render message {i + 1} as an "
                                "extension of the conversation before it, so its assistant span cannot be found; "
                                "use a template that renders turns incrementally")
            if len(end) > max(len(start), done):
                spans.append((max(len(start), done), len(end)))
            done = max(done, len(end))
        return full, spans


    def _before_opening_answer(self, message: dict, full: str, where: str, tools: list[dict] | None) -> str:
        """What the template renders before an assistant message that opens the conversation (a default system
        prompt, the assistant header), which transformers' assistant mask leaves untrained: the empty
        conversation with the generation prompt, or, for a template that cannot render that, the message
        rendered alone up to its content."""
        try:
            before = self.render([], add_generation_prompt=True, record=where, tools=tools)
            if full.startswith(before):
                return before
        except UserError:
            pass
        alone, content = self.render([message], record=where, tools=tools), message.get("content")
        at = alone.rfind(content) if isinstance(content, str) and content else -1
        if at < 0 or not full.startswith(alone[:at]):
            raise UserError(f"{where}: the conversation opens with an assistant message, and the chat template of "
                            f"{self.where} renders it so that its start cannot be found; open it with a user or "
                            "system message")
        return alone[:at]


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _folder_json(folder: Path, name: str) -> dict:
    """A JSON object file of the tokenizer folder, {} when there is none."""
    path = folder / name
    return read_json_object(path, inside=folder) if path.exists() or path.is_symlink() else {}


def load_chat_template(folder: Path) -> ChatTemplate | None:
    """The template ``apply_chat_template`` renders with, chosen as transformers chooses it: chat_template.jinja
    over tokenizer_config.json's ``chat_template`` (a string, or named templates, of which 'default')."""
    cfg_file = folder / "tokenizer_config.json"
    cfg = _folder_json(folder, cfg_file.name)
    special = {k: _token_text(cfg[k]) for k in SPECIAL_TOKEN_KEYS if _token_text(cfg.get(k))}
    jinja = folder / "chat_template.jinja"
    if jinja.exists() or jinja.is_symlink():
        return ChatTemplate(read_input_text(jinja, inside=folder), special, str(folder))
    source = cfg.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if named and "default" not in named:
            return ChatTemplate(None, special, str(folder), names=tuple(sorted(map(str, named))))
        source = named.get("default")
    if not source:
        return None
    if not isinstance(source, str):
        raise UserError(f"{cfg_file}: chat_template must be a jinja string (or a list of named templates with 'default')")
    return ChatTemplate(source, special, str(folder))


# A converted checkpoint's folder carries the tokenizer files but no config.json: its record (checkpoint/sidecar.py's
# SIDECAR_NAME, not imported: that package sits above this one) keeps the model's config.json as "hf_config", and
# "tokenizer_model_config" where the tokenizer came from a folder with another config, or none ({}).
CHECKPOINT_RECORD = "mpatch_checkpoint.json"


def class_picking_config(folder: str | Path) -> dict:
    """The model config that picks transformers' tokenizer class for the folder's tokenizer files where
    tokenizer_config.json names none: its config.json, else a converted checkpoint's record of the config its
    tokenizer was read with; {} for a tokenizer folder of its own (its files alone decide, wherever it is used)."""
    folder = Path(folder)
    if (folder / "config.json").is_file():
        return _folder_json(folder, "config.json")
    record = _folder_json(folder, CHECKPOINT_RECORD) if (folder / CHECKPOINT_RECORD).is_file() else {}
    config = record.get("tokenizer_model_config")
    config = record.get("hf_config") if config is None else config
    return config if isinstance(config, dict) else {}


def folder_model_config(folder: str | Path) -> dict | None:
    """The model config to hand transformers with a tokenizer folder where it would not find it itself (a
    converted checkpoint's record, ``class_picking_config``). None for a folder with a config.json (transformers
    reads it) or with no config at all."""
    if (Path(folder) / "config.json").is_file():
        return None
    return class_picking_config(folder) or None


def load_hf_tokenizer(folder: str | Path):
    """transformers' tokenizer of ``folder``, from local files only and without code from the folder, as lm-eval's
    HF backend loads it from the model's folder, so both tokenize alike. The model's config picks the tokenizer
    class where tokenizer_config.json names none (a Qwen2 model's folder gets Qwen2's tokenizer class, with its own
    special tokens): the folder's config.json, or a converted checkpoint's record of it (``folder_model_config``),
    so preprocessing, training and evaluation of one folder build one pipeline."""
    # transformers (0.6 s): imported only where a tokenizer is loaded
    from transformers import AutoConfig, AutoTokenizer

    # transformers opens the folder's files itself: each must stay inside the folder (a tokenizer.json that links
    # to /etc/... is refused), be a regular file and bounded, as --hf-dir's are, before it reads one
    check_folder_inputs(folder)
    model_config, config = folder_model_config(folder), None
    if model_config is not None:
        try:
            # a copy: transformers writes into the nested tables it is given (rope_theta into rope_scaling)
            config = AutoConfig.for_model(**copy.deepcopy(model_config))
        except (ValueError, KeyError, TypeError):  # a model type this transformers does not know: by the files alone
            config = None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False,
                                             **({"config": config} if config is not None else {}))
    except Exception as exc:  # noqa: BLE001 - a garbage tokenizer file fails in transformers in any way at all
        why = locale_names_it_otherwise(Path(folder).absolute())
        if why is not None:  # "No such file or directory" of a file that is there: the tokenizers library's
            raise UserError(f"cannot read the tokenizer in {folder}: the tokenizers library {why}") from None
        raise UserError(f"cannot read the tokenizer in {folder}: {type(exc).__name__}: {exc}")


class HFTokenizer:
    """``tokenizers.Tokenizer`` from a folder's tokenizer.json; EOD and chat template from its config files."""

    def __init__(self, folder: Path):
        self.path = folder
        text = read_input_text(folder / "tokenizer.json", inside=folder)
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception for any bad file
            raise UserError(f"{folder / 'tokenizer.json'} is not a tokenizer the tokenizers library reads "
                            f"({str(exc)[:200]}): fix or re-download it")
        # The pipeline transformers builds for the folder's tokenizer class, which apply_chat_template and lm-eval
        # encode with: some classes rebuild tokenizer.json's (transformers 5's LlamaTokenizer sets its Metaspace
        # from `legacy`: no '▁' after a special token), so the file's own pipeline gave other ids after each
        # special token of a Llama-2/Mistral chat. A folder transformers reads only with its own code keeps the file's.
        # The vocabulary and the end-of-document token are the file's (transformers adds a special token the
        # config names and the file lacks, an id no model has a row for: a text holding it is refused, ``_encoded``).
        self._file, self._built_by = self._tok, "tokenizers' own"
        # a file that leads out of the folder is refused, not passed over for the file's own pipeline below
        check_folder_inputs(folder)
        try:
            built = load_hf_tokenizer(folder)
            self._tok, self._built_by = built.backend_tokenizer, f"the {type(built).__name__} transformers builds"
        except (UserError, AttributeError):  # no code of the folder's runs; a slow tokenizer has no backend
            pass
        # a tokenizer.json saved after a call with truncation or padding keeps them; transformers' tokenizer
        # applies neither unless asked, and a document is written whole
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._file.get_vocab_size(with_added_tokens=True)
        # past the file's highest id (not its count: a file's added tokens may leave a gap below them)
        self._file_ids_end = max(self._file.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eod = self._find_eod(folder)
        self.chat_template = load_chat_template(folder)

    def _encoded(self, text: str):
        """The encoding of ``text``, refused in one line where the pipeline fails on it or gives an id past the
        file's vocabulary: transformers adds a special token that tokenizer_config.json (or the class) names and
        tokenizer.json lacks, at an id no model has a row for, and a text that holds it would carry that id."""
        try:
            encoding = self._tok.encode(text, add_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception from its pipeline
            raise UserError(f"{self.path}: {self._built_by} cannot encode this text ({str(exc)[:200]}): the folder's "
                            "tokenizer.json does not suit the tokenizer class its config names") from None
        if encoding.ids and max(encoding.ids) >= self._file_ids_end:  # max in C: preprocessing's every document
            past = sorted({self._tok.id_to_token(i) for i in encoding.ids if i >= self._file_ids_end})
            raise UserError(f"{self.path}: a text holds {', '.join(map(repr, past[:3]))}, which {self._built_by} "
                            f"adds past tokenizer.json's {self._file_ids_end} ids (tokenizer.json lacks it; "
                            "tokenizer_config.json or the class names it), where no model has a row: add it to "
                            "tokenizer.json's added_tokens, or take it out of tokenizer_config.json")
        return encoding

    def _find_eod(self, folder: Path) -> int:
        eos = _token_text(_folder_json(folder, "tokenizer_config.json").get("eos_token"))
        for name in [eos] if isinstance(eos, str) and eos else []:
            tid = self._file.token_to_id(name)
            if tid is not None:
                return tid
        for name in EOD_CANDIDATES:
            tid = self._file.token_to_id(name)
            if tid is not None:
                return tid
        eos_id = _folder_json(folder, "config.json").get("eos_token_id")
        if isinstance(eos_id, list) and eos_id:
            eos_id = eos_id[0]
        if isinstance(eos_id, int) and not isinstance(eos_id, bool):
            # a folder is untrusted input: an id outside the vocabulary would end every document with a token
            # the model has no row for (or not fit the data's dtype)
            if not 0 <= eos_id < self.vocab_size:
                raise UserError(f"{folder / 'config.json'}: eos_token_id {eos_id} is outside the tokenizer's "
                                f"{self.vocab_size} ids: fix it, or name the end-of-document token in "
                                "tokenizer_config.json's eos_token")
            return eos_id
        named = (f"tokenizer_config.json's eos_token {eos!r} is not in tokenizer.json" if isinstance(eos, str) and eos
                 else "no eos_token in tokenizer_config.json")
        raise UserError(f"{folder}: cannot tell the end-of-document token ({named}, none of "
                        f"{', '.join(EOD_CANDIDATES)} in the vocabulary)")

    @property
    def eod_token(self) -> str:
        """The end-of-document token's text."""
        return self._file.id_to_token(self.eod)

    def encode(self, text: str) -> list[int]:
        return self._encoded(text).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` and each one's [start, end) characters in it."""
        encoding = self._encoded(text)
        return encoding.ids, encoding.offsets

    def decode(self, ids) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)

    def id_tokens(self) -> dict[int, str]:
        """Every id of tokenizer.json's vocabulary (added tokens too) and its token."""
        return {i: token for token, i in self._file.get_vocab(with_added_tokens=True).items()}


class TiktokenTokenizer:
    """A tiktoken BPE ranks file (base64 token, rank per line). Its special tokens and EOD are those the
    tokenizer_config.json beside it names (``added_tokens_decoder``, ``eos_token``; Kimi-K2's folder puts [BOS]
    right after the ranks and [EOS] after it), else ``<|endoftext|>`` after the ranks."""

    def __init__(self, path: Path):
        try:
            import tiktoken
        except ImportError:
            raise UserError("a tiktoken BPE file needs the tiktoken package: pip install tiktoken")
        ranks = read_tiktoken_ranks(path)
        self.path = path
        self.chat_template = None
        special, self.eod = _tiktoken_specials(path, len(ranks), max(ranks.values()) + 1)
        self._ranks, self._special = ranks, special
        try:
            self._enc = tiktoken.Encoding(name=path.name, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=special)
        except Exception as exc:  # noqa: BLE001 - tiktoken's core refuses ranks it cannot build, in its own words
            raise UserError(f"{path} is not a usable tiktoken BPE file ({str(exc)[:200]})")
        self.vocab_size = max(special.values()) + 1

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())

    def decode(self, ids) -> str:
        return self._enc.decode(list(map(int, ids)))

    def id_tokens(self) -> dict[int, bytes | str]:
        """Every rank's id and its bytes, and the special tokens' ids and texts."""
        return {**{i: token for token, i in self._ranks.items()}, **{i: name for name, i in self._special.items()}}


def vocabulary_digest(tokenizer, below: int | None = None) -> str:
    """sha256 over ``tokenizer``'s ids (those ``below`` a bound, where given) and the token each stands for: equal
    exactly where every such id means the same token, whatever else of the folder differs (its chat template,
    config.json), which is what ids already tokenized need of the tokenizer a run reads them with. With the bound,
    a tokenizer extended past it (a pad or chat token added) digests as the one it extends."""
    digest = hashlib.sha256()
    for i, token in sorted(tokenizer.id_tokens().items()):
        if below is None or i < below:
            digest.update(f"{i}\t{token!r}\n".encode())
    return digest.hexdigest()


def ids_end(tokenizer) -> int:
    """One past ``tokenizer``'s highest id: every id it gives is below it."""
    return max(tokenizer.id_tokens(), default=-1) + 1


def _tiktoken_specials(path: Path, ranks: int, after: int) -> tuple[dict[str, int], int]:
    """({special token: id}, the end-of-document id) of a tiktoken file: the added tokens and eos_token of the
    tokenizer_config.json beside it (the eos_token_id of config.json where it names none), else
    ``<|endoftext|>`` at ``after``, the first id past the ranks."""
    folder = path.parent
    cfg = _folder_json(folder, "tokenizer_config.json")
    added = cfg.get("added_tokens_decoder") if isinstance(cfg.get("added_tokens_decoder"), dict) else {}
    special = {}
    for key, token in added.items():
        name = _token_text(token)
        if not (isinstance(name, str) and str(key).isdigit()):
            raise UserError(f"{folder / 'tokenizer_config.json'}: added_tokens_decoder entry {str(key)[:40]!r} is not "
                            "an id with a token's content")
        if int(key) < ranks:
            raise UserError(f"{folder / 'tokenizer_config.json'}: added token {name!r} takes id {key}, which "
                            f"{path.name}'s {ranks} ranks use: it is not this file's configuration")
        special[name] = int(key)
    if not special:
        return {TIKTOKEN_EOD: after}, after
    eos = _token_text(cfg.get("eos_token"))
    if isinstance(eos, str) and eos in special:
        return special, special[eos]
    eos_id = _folder_json(folder, "config.json").get("eos_token_id")
    if isinstance(eos_id, int) and not isinstance(eos_id, bool) and eos_id in special.values():
        return special, eos_id
    raise UserError(f"{folder}: cannot tell the end-of-document token of {path.name} (tokenizer_config.json names "
                    "added tokens but no eos_token among them, nor config.json's eos_token_id)")


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file's ``{token: rank}``: one ``base64-token rank`` pair a line, as tiktoken's
    ``load_tiktoken_bpe`` reads it, but from this file's bytes, never from tiktoken's cache."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(read_input(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            token, rank = base64.b64decode(token, validate=True), int(rank)
            if not 0 <= rank < 2**31:
                raise ValueError
        except (ValueError, binascii.Error):
            raise UserError(f"{path} is not a tiktoken BPE file (line {lineno} is not 'base64-token rank'): give a "
                            "tokenizer folder or a .tiktoken file")
        ranks[token] = rank
    if not ranks:
        raise UserError(f"{path} is not a tiktoken BPE file (it holds no tokens): give a tokenizer folder or a "
                        ".tiktoken file")
    if len(set(ranks.values())) != len(ranks):
        raise UserError(f"{path} gives two tokens the same rank: it is not a tiktoken BPE file")
    return ranks


def load_tokenizer(path: str | Path):
    p = check_tokenizer_path(path)
    return HFTokenizer(p) if p.is_dir() else TiktokenTokenizer(p)
