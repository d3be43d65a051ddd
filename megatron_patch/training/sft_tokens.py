"""SFT records as token ids and the loss mask over them (``sft_data`` says which forms and how the loss is placed),
without torch: the dataset tokenizes every record here, and the launcher, before any rank starts, the records it
needs to see that the data trains at all."""

from __future__ import annotations

from pathlib import Path

from megatron_patch.errors import UserError
from megatron_patch.training.sft_records import conversation, record_tools


def _plain_segments(record: dict, messages: list[dict]) -> list[tuple[str, bool]]:
    """(text, trained) pieces of the plain format, for a tokenizer without a chat template."""
    if "messages" in record:
        return [piece for m in messages for piece in
                ((f"<|{m['role']}|>\n", False), ((m["content"] or "") + "\n", m["role"] == "assistant"))]
    *prompt, answer = messages
    return [(m["content"] + "\n", False) for m in prompt] + [(answer["content"], True)]


def tokenize_record(tokenizer, record, where: str) -> tuple[list[int], list[int]]:
    """(token ids, 1 for each token the loss is taken on) of one record.

    With a chat template: the rendered conversation tokenized whole (the ids ``apply_chat_template`` gives),
    a token trained where its characters fall in an assistant span (transformers' own rule for
    ``return_assistant_tokens_mask``). Without: the plain pieces, then the end-of-document token, trained
    (the model learns to stop after the response).
    """
    messages, tools = conversation(record, where), record_tools(record, where)
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        text, spans = template.assistant_spans(messages, where, tools)
        ids, offsets = _named(where, tokenizer.encode_with_offsets, text)
        return ids, [int(any(start < b and max(end, start + 1) > a for a, b in spans)) for start, end in offsets]
    if tools:
        raise UserError(f"{where}: the record defines 'tools', and {tokenizer.path} has no chat template to render "
                        "them: give a tokenizer folder with one (MP_TOKENIZER)")
    ids, trained = [], []
    for text, on in _plain_segments(record, messages):
        piece = _named(where, tokenizer.encode, text)
        ids += piece
        trained += [int(on)] * len(piece)
    return ids + [tokenizer.eod], trained + [1]


def _named(where: str, encode, text: str):
    """``encode(text)``, a refusal of the text (a special token past tokenizer.json's ids) naming the record."""
    try:
        return encode(text)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None


def describe_format(tokenizer) -> str:
    """How records become text, in one line (the dry run's and the training log's)."""
    if getattr(tokenizer, "chat_template", None) is not None:
        return f"records rendered by the chat template of {tokenizer.path}, the loss on the assistant turns"
    return (f"plain format: {tokenizer.path} has no chat template, so records are rendered as 'prompt\\nresponse' "
            "and '<|role|>\\ncontent' turns, the loss on the responses and the closing end-of-document token")


def refuse_untrainable(path: str | Path, groups, tokenizer, length: int, packing: bool) -> None:
    """Refuse ``path`` (its ``record_groups``) when no record keeps a trained token within ``length`` tokens: the
    run would train nothing (its loss and gradient 0, while weight decay moves the weights). Records are
    tokenized until the first that trains, so a sound file costs one record. A sample's loss mask is
    ``trained[1:length + 1]`` (each position predicts the next token: ``sft_data._sample``); packed, a record
    after another has its first token predicted too, and a pack holds whole records (a longer one starts its
    own), so whatever trains in a pack trains here."""
    first = 0 if packing else 1
    for _, group in groups:
        for record, where in group:
            if any(tokenize_record(tokenizer, record, where)[1][first:length + 1]):
                return
    raise untrainable(path, length)


def untrainable(path: str | Path, length: int) -> UserError:
    return UserError(f"no sample of {path} keeps a trained token within its {length} tokens (the responses lie past "
                     "the cut): raise SEQ_LEN/PAD_LEN, or shorten the prompts")
