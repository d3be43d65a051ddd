"""Small input files read whole (config.json, tokenizer files, the safetensors index, manifests): each is checked
for where it leads, what it is and how large it is before a byte of it is read.

- A file found inside a folder the user names (``--hf-dir``, a tokenizer folder, a checkpoint) must stay inside
  it: ``config.json -> /dev/zero`` or ``tokenizer.json -> /etc/...`` is refused (``contained``). The one
  exception is the Hugging Face hub cache, whose snapshot files link into the model's ``blobs/``. A file the
  user names directly (``--hf-config FILE``, a ``.tiktoken`` file) is read wherever it leads.
- Either way it must be a regular file: a FIFO would block its reader forever, a device (``/dev/zero``) never
  ends. It is opened without blocking and without following a last symlink (``O_NONBLOCK``, ``O_NOFOLLOW``),
  checked with ``fstat`` on the descriptor that is read, and read with a bound: ``MAX_INPUT_BYTES``, far above
  any published model's file (the largest tokenizer.json on the hub is about 35 MB, the largest index about 10).
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from megatron_patch.errors import UserError

MAX_INPUT_BYTES = 256 * 2**20


def locale_names_it_otherwise(path: str | Path) -> str | None:
    """Why a library that names files in UTF-8 whatever the locale (TensorBoard's writer, the tokenizers library)
    cannot reach ``path``, or None: under a non-UTF-8 locale (LC_ALL=en_US.ISO-8859-1) a non-ASCII name is, to it,
    another file's (the env and s64 audits)."""
    name = str(path)
    try:
        if name.encode("utf-8") == os.fsencode(name):
            return None
    except UnicodeEncodeError:  # a name this locale could not decode either
        pass
    return (f"names files in UTF-8 and this locale names them in {sys.getfilesystemencoding()}, so {name} is "
            "another file to it (a UTF-8 locale, LC_ALL=C.UTF-8, or an ASCII path brings it back)")

# The side files of an HF model folder that a tokenizer, transformers, a processor or a chat template read: what
# the converters carry along with the weights, and what is checked before transformers reads a folder. The
# folder's remote code (the *.py its auto_map names: Kimi-K2's model and tokenizer) travels as bytes, so that an
# export loads as the original did with trust_remote_code; nothing here imports it.
HF_SIDE_FILES = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "*.tiktoken", "tiktoken.model", "tokenizer.model", "spiece.model", "sentencepiece*.model",
    "generation_config.json", "chat_template.*", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json", "*.py", "tekken.json",
)
# transformers 5 saves a tokenizer's named chat templates (tool_use, rag, ...) one folder down, as .jinja files.
CHAT_TEMPLATES_FOLDER = "additional_chat_templates"
NAMED_CHAT_TEMPLATES = f"{CHAT_TEMPLATES_FOLDER}/*.jinja"
# Those of them that make up the tokenizer (vocabulary, special tokens, chat template, its remote code): one
# tokenizer's files are taken together from one folder, never mixed with another's. The rest are the model's.
TOKENIZER_SIDE_FILES = tuple(p for p in HF_SIDE_FILES if p not in (
    "generation_config.json", "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "*.py")) + ("tokenization*.py", NAMED_CHAT_TEMPLATES)


def is_tokenizer_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in TOKENIZER_SIDE_FILES)


def contained(folder: str | Path, name: str | Path, how: str = "found") -> Path:
    """``folder / name``, refused in one line if it leaves ``folder`` (``..``, an absolute path, a symlink to
    elsewhere). The one exception is the Hugging Face hub cache, whose snapshot folders hold symlinks into
    the model's ``blobs/`` (``models--X/snapshots/REV/f -> ../../blobs/HASH``): those stay in the model."""
    folder = Path(folder)
    if "\0" in str(name):  # no file has one: the OS refuses it, and resolve() raises ValueError on it
        raise UserError(f"{folder} {how} {str(name)!r}, which no file can be named (a NUL byte): refused")
    path = folder / name
    try:
        real, home = path.resolve(), folder.resolve()
        # a link to itself: Python 3.11 and 3.12 raise RuntimeError, 3.13 returns the link as it is
        looped = "a symlink loop" if real.is_symlink() or home.is_symlink() else None
    except (RuntimeError, OSError) as exc:
        looped = "a symlink loop" if isinstance(exc, RuntimeError) else exc.strerror or str(exc)
    if looped:
        raise UserError(f"{folder} {how} {str(name)!r}, which cannot be followed ({looped}): refused")
    allowed = [home]
    if home.parent.name == "snapshots":
        allowed.append(home.parent.parent / "blobs")
    if not any(real == a or a in real.parents for a in allowed):
        raise UserError(f"{folder} {how} {str(name)!r}, which leads outside the folder (to {real}): refused; copy "
                        "the file into the folder if it belongs to the model")
    return path


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of stat mode ``mode`` is ("a FIFO"), for a message about a path that should be another kind."""
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _not_regular(mode: int) -> str:
    kind = kind_of(mode)
    return kind if kind == "not a regular file" else f"{kind}, not a regular file"


def what_is_at(path: str | Path) -> str | None:
    """What is at ``path`` where a file to read should be, as said after its name ("is a FIFO, not a regular file",
    "is a dangling link", "cannot be read (Permission denied)"), or None: a regular file (through links: the reader
    checks where they lead), or nothing at all."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a dangling link" if os.path.lexists(path) else None
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    return None if stat.S_ISREG(mode) else f"is {_not_regular(mode)}"


def file_problem(path: str | Path) -> str | None:
    """Why ``path`` is no file to read, named by its last part ("common.pt is missing", "common.pt is a FIFO, not a
    regular file"), or None for a regular file."""
    path = Path(path)
    what = what_is_at(path)
    if what is None:
        return None if os.path.lexists(path) else f"{path.name} is missing"
    return f"{path.name} {what}"


def _check_regular(shown: Path, st: os.stat_result, limit: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        what = _not_regular(st.st_mode)
        raise UserError(f"{shown} is {what}: refused (a FIFO would block its reader, a device never ends); give "
                        "the file itself")
    if limit is not None and st.st_size > limit:
        raise UserError(f"{shown} holds {st.st_size:,} bytes, more than the {limit:,} any such file needs: refused; "
                        "check that it is the file you meant")


def checked_input(path: str | Path, *, inside: str | Path | None = None, how: str = "found",
                  limit: int | None = MAX_INPUT_BYTES, hint: str = "") -> Path:
    """The real path of an input file that passed the checks (inside ``inside`` when given, a regular file, at
    most ``limit`` bytes): for readers that open it themselves (a copy, transformers). UserError otherwise."""
    path = Path(path)
    if inside is not None:
        path = contained(inside, os.path.relpath(path, inside), how)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UserError(f"{path} not found" + (f": {hint}" if hint else ""))
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror})")
    _check_regular(path, st, limit)
    return path.resolve()


def read_input(path: str | Path, *, inside: str | Path | None = None, how: str = "found",
               limit: int | None = MAX_INPUT_BYTES, hint: str = "") -> bytes:
    """The bytes of an input file, checked first (``checked_input``) and again on the descriptor that is read,
    so a file swapped for a FIFO or a link in between is refused too."""
    shown = Path(path)
    real = checked_input(shown, inside=inside, how=how, limit=limit, hint=hint)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UserError(f"cannot read {shown} ({exc.strerror})")
    try:
        _check_regular(shown, os.fstat(fd), limit)
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:  # it grew while being read
                raise UserError(f"{shown} grew past {limit:,} bytes while it was read: refused")
        return b"".join(chunks)
    except OSError as exc:
        raise UserError(f"cannot read {shown} ({exc.strerror})")
    finally:
        os.close(fd)


def read_input_text(path: str | Path, **checks) -> str:
    """``read_input`` as UTF-8 text, with a one-line error for bytes that are not."""
    data = read_input(path, **checks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text (byte {exc.start}): fix or re-download it")


# Deeper than any real config, sidecar or manifest nests (a few levels): what reads such a value recursively (copy's
# deepcopy, transformers' configs) runs out of stack at a few hundred, as an internal error
MAX_JSON_NESTING = 64


def json_nesting(value: Any) -> int:
    """How deep ``value``'s lists and objects nest (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def json_error(exc: ValueError | RecursionError, *, line: bool = True) -> str:
    """What ``json.loads`` found wrong, in a few words (``line``: where, for text of several lines): beside
    malformed text, a number of more than 4300 digits (Python's limit on int(), a plain ValueError) and nesting past
    the recursion limit end it."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno}" if line else exc.msg
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text at byte {exc.start}"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if "integer string conversion" in str(exc):  # worded otherwise by each Python
        return f"a number of more than {sys.get_int_max_str_digits()} digits, Python's limit"
    return str(exc).split(":")[0]


def read_input_json(path: str | Path, *, hint: str = "", **checks) -> Any:
    """An input file's JSON value, with one-line errors (``hint``: what to give when the file is missing)."""
    data = read_input(path, hint=hint, **checks)
    try:
        value = json.loads(data)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}): fix or re-download it")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text (byte {exc.start}): fix or re-download it")
    except ValueError as exc:  # a number of more than 4300 digits
        raise UserError(f"{path} is not readable JSON ({json_error(exc)}): fix or re-download it")
    except RecursionError:
        too_deep = True
    else:
        too_deep = json_nesting(value) > MAX_JSON_NESTING
    if too_deep:
        raise UserError(f"{path} nests its JSON too deeply to be a real file of its kind: fix or re-download it")
    return value


def read_json_object(path: str | Path, *, hint: str = "", **checks) -> dict[str, Any]:
    """``read_input_json`` of a file that must hold a JSON object."""
    value = read_input_json(path, hint=hint, **checks)
    if not isinstance(value, dict):
        raise UserError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value


def check_folder_inputs(folder: str | Path, patterns: tuple[str, ...] = ("config.json", "model.safetensors.index.json",
                                                                          *HF_SIDE_FILES)) -> None:
    """Check every file of ``folder`` that matches ``patterns`` before a reader that opens them itself
    (transformers) does: inside the folder, regular, bounded. A link of any other name must stay inside too:
    transformers' tokenizer classes open files by names of their own (ProphetNet's prophetnet.tokenizer, BPE's
    bpe.codes, LUKE's entity_vocab.json, ...), and one linked to a file elsewhere was read as the vocabulary."""
    folder = Path(folder)
    found = {p.name for pattern in patterns for p in folder.glob(pattern) if not p.is_dir()}  # tokenizer/: a folder
    for name in sorted(found):
        checked_input(folder / name, inside=folder)
    for entry in sorted(folder.iterdir()) if folder.is_dir() else ():
        if entry.is_symlink():
            contained(folder, entry.name)
    _check_what_the_tokenizer_config_names(folder)
    # transformers reads every additional_chat_templates/*.jinja as a named chat template
    if os.path.lexists(folder / CHAT_TEMPLATES_FOLDER):
        contained(folder, CHAT_TEMPLATES_FOLDER)
        for template in sorted((folder / CHAT_TEMPLATES_FOLDER).glob("*.jinja")):
            checked_input(template, inside=folder)



def _check_what_the_tokenizer_config_names(folder: Path) -> None:
    """tokenizer_config.json's ``fast_tokenizer_files`` names the tokenizer.json that transformers opens, by version:
    a name like ``tokenizer.1.json/../../x`` leads anywhere."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return
    listed = read_json_object(config, inside=folder).get("fast_tokenizer_files")
    if listed is None:
        return
    if not isinstance(listed, list) or not all(isinstance(name, str) for name in listed):
        raise UserError(f"{config}: 'fast_tokenizer_files' must be a list of file names, found {listed!r:.80}")
    how = "names in tokenizer_config.json's fast_tokenizer_files"
    for name in listed:
        if os.path.lexists(contained(folder, name, how)):
            checked_input(folder / name, inside=folder, how=how)


def walk(folder: str | Path, onerror=None):
    """``os.walk(folder)`` (top-down, links to folders listed among the folders but never entered; ``dirnames``
    pruned in place is honoured), without recursion: on Python 3.11 os.walk and Path.rglob recurse once per level,
    and a folder nested past the interpreter's recursion limit ended ``mpatch verify`` and ``mcore2hf`` in an
    internal error (RecursionError; the sec audit)."""
    stack = [os.fspath(folder)]
    while stack:
        top = stack.pop()
        try:
            entries = sorted(os.scandir(top), key=lambda e: e.name)
        except OSError as exc:
            if onerror is not None:
                onerror(exc)
            continue
        dirnames, filenames, linked = [], [], set()
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            (dirnames if is_dir else filenames).append(entry.name)
            if is_dir and entry.is_symlink():
                linked.add(entry.name)
        yield top, dirnames, filenames
        stack.extend(os.path.join(top, d) for d in reversed(dirnames) if d not in linked)


def folder_bytes(folder: str | Path) -> int:
    """The bytes of the regular files under ``folder`` (``walk``: links to folders not entered)."""
    return sum(os.path.getsize(path) for top, _, files in walk(folder)
               for path in (os.path.join(top, name) for name in files) if os.path.isfile(path))
