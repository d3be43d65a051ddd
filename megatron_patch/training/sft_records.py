"""SFT records as Pai-Megatron-Patch's SFT JSON holds them (``sft_data`` says which forms), read and checked
without torch or a tokenizer: the launcher checks every record's shape here before any rank starts, so a bad
record is one line at launch, not a failure of each rank after minutes of imports."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_patch.errors import UserError
from megatron_patch.input_files import json_error
from megatron_patch.training.compressed_files import (COMPRESSED_SUFFIXES, DECOMPRESSION_ERRORS, open_decompressed,
                                                       unnamed_compression)

PROMPT_KEYS = ("instruction", "query", "prompt", "question")
RESPONSE_KEYS = ("output", "content", "response", "completion", "answer")
# The most a compressed SFT file's text may outgrow the file (JSON lines compress some 5-50-fold)
MAX_EXPANSION = 1000


def read_records(path: str | Path) -> list:
    """The SFT records of a JSON array or a JSONL file (objects, or lists of them), as Pai reads them: the file as
    one JSON value if it is one, else a value a line. A bad line names its line number. UTF-8, with or without the
    byte-order mark that editors on Windows write, plain or ``.gz``/``.zst`` compressed (as ``mpatch preprocess``
    reads it); other encodings are refused naming the line."""
    path = Path(path)
    # The text is held whole, as a plain file's is: a compressed one's bounded by what its size on disk can honestly
    # hold, so that a small decompression bomb (untrusted data) is refused instead of filling the memory
    limit = MAX_EXPANSION * path.stat().st_size + (1 << 20) if path.suffix in COMPRESSED_SUFFIXES else -1
    with open_decompressed(path) as f:
        try:
            data = f.read() if limit < 0 else _read_at_most(f, limit + 1)
        except DECOMPRESSION_ERRORS as exc:
            raise UserError(f"{path} cannot be decompressed ({exc}): the file is damaged or cut short; compress it "
                            "again") from None
    if 0 <= limit < len(data):
        raise UserError(f"{path} expands more than {MAX_EXPANSION}-fold when decompressed, which no text data does: "
                        "it is not an SFT file (or decompress it yourself and give the plain file)")
    text = _utf8_text(path, data)
    records = None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except (ValueError, RecursionError) as exc:
            if not _starts_with_a_json_line(text):  # a JSON array with an error, not lines of packed-SFT lists
                raise UserError(f"{path} is not valid JSON ({json_error(exc)})")
    if records is None:
        records = []
        for lineno, line in enumerate(_json_lines(text), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except (ValueError, RecursionError) as exc:
                raise UserError(f"{path} line {lineno} is not valid JSON ({json_error(exc, line=False)})")
    if not records:
        raise UserError(f"{path} holds no SFT records")
    return records


READ_PIECE = 1 << 23  # decompressed bytes read at a time


def _read_at_most(f, most: int) -> bytes:
    """Up to ``most`` bytes of ``f``, read a piece at a time: ``f.read(most)`` of a gzip or zstd stream sets aside
    ``most`` bytes first, and a bound of 1000 times a 31 MiB file failed as a MemoryError, whatever the text."""
    pieces, size = [], 0
    while size < most:
        piece = f.read(min(READ_PIECE, most - size))
        if not piece:
            break
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces)


UTF8_BOM = b"\xef\xbb\xbf"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def _utf8_text(path: Path, data: bytes) -> str:
    """The file's text: UTF-8 less a leading byte-order mark; UserError naming the line (and the byte within it)
    that is not UTF-8, as ``mpatch preprocess`` refuses it."""
    bom = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        lineno = data.count(b"\n", 0, at) + 1
        column = at - (data.rfind(b"\n", 0, at) + 1) + 1
        compressed = unnamed_compression(path, data)
        if compressed is not None:
            raise compressed from None
        utf16 = " (it is UTF-16, by its byte-order mark)" if data.startswith(UTF16_BOMS) else ""
        raise UserError(f"{path} line {lineno} is not UTF-8 ({exc.reason} at byte {column} of the line){utf16}: "
                        "re-encode the file as UTF-8") from None


def _json_lines(text: str) -> list[str]:
    """The file's lines as JSON Lines has them: split at newlines only. str.splitlines also splits at U+2028,
    U+2029 and U+0085, which json.dumps(..., ensure_ascii=False) leaves raw inside strings."""
    return text.split("\n")


def _starts_with_a_json_line(text: str) -> bool:
    try:
        json.loads(next(line for line in _json_lines(text) if line.strip()))
    except (ValueError, RecursionError):
        return False
    return True


def conversation(record, where: str) -> list[dict]:
    """The record as chat messages: its own ``messages``, or system (if any), user and assistant turns."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: an SFT record must be a JSON object, found {type(record).__name__}")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        for m in msgs:
            if not isinstance(m, dict) or "role" not in m or not _has_content(m):
                raise UserError(f"{where}: each message needs a 'role' and a string 'content' (null only beside "
                                "'tool_calls')")
        if not any(m["role"] == "assistant" for m in msgs):
            raise UserError(f"{where}: the conversation has no assistant message to train on")
        return _with_system_field(record, msgs, where)
    prompt = next((record[k] for k in PROMPT_KEYS if k in record), None)
    response = next((record[k] for k in RESPONSE_KEYS if k in record), None)
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise UserError(f"{where}: an SFT record needs string prompt and response fields "
                        f"({'/'.join(PROMPT_KEYS)} and {'/'.join(RESPONSE_KEYS)}) or a 'messages' list")
    for key in ("input", "system"):
        if record.get(key) is not None and not isinstance(record[key], str):
            raise UserError(f"{where}: '{key}' must be a string, found {type(record[key]).__name__}")
    system = record.get("system") or ""
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt + (record.get("input") or "")},
        {"role": "assistant", "content": response}]


def _with_system_field(record: dict, messages: list[dict], where: str) -> list[dict]:
    """``messages`` opened by the record's ``system`` field as a system turn (LLaMA-Factory's system column beside
    its messages), which the template's default system prompt would otherwise stand in for; refused beside a
    system message of the conversation's own."""
    system = record.get("system")
    if system is None or system == "":
        return messages
    if not isinstance(system, str):
        raise UserError(f"{where}: 'system' must be a string, found {type(system).__name__}")
    if messages[0].get("role") == "system":
        raise UserError(f"{where}: both a 'system' field and a system message open the conversation: keep one")
    return [{"role": "system", "content": system}, *messages]


def record_tools(record: dict, where: str) -> list[dict] | None:
    """The record's function definitions (``tools``, transformers' and OpenAI's form), which the chat template
    renders as ``apply_chat_template(messages, tools=...)`` does; None without."""
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserError(f"{where}: 'tools' must be a list of JSON objects (function definitions)")
    return tools


def _has_content(message: dict) -> bool:
    """A string content, or the OpenAI form of a tool call: ``"content": null`` beside ``tool_calls``, which
    templates test with ``{% if message.content %}`` and ``apply_chat_template`` renders as it stands."""
    content = message.get("content")
    return isinstance(content, str) or (content is None and bool(message.get("tool_calls")))


def record_groups(path: str | Path) -> list[tuple[bool, list[tuple[dict, str]]]]:
    """Each line's records with where they are ("PATH record 3 item 2"), and whether the line is a packed-SFT list;
    every record's shape is checked (``conversation``). What only the tokenizer can tell (a template's rendering,
    the lengths) the ranks check as they tokenize."""
    groups = []
    for i, item in enumerate(read_records(path)):
        where = f"{path} record {i + 1}"
        if isinstance(item, list):
            if not item:
                raise UserError(f"{where}: an empty list (a packed-SFT line lists the records of one sample)")
            group = [(record, f"{where} item {j + 1}") for j, record in enumerate(item)]
        else:
            group = [(item, where)]
        for record, place in group:
            conversation(record, place)
            record_tools(record, place)
        groups.append((isinstance(item, list), group))
    return groups
