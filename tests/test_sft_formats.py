"""SFT data as Pai-Megatron-Patch users bring it (issue 35), each read as Pai reads it, and what the model trains on
made visible:

- every record kind (instruction/input/output, query/response, query/content, prompt/completion, a system
  field, messages) goes through the tokenizer's chat template: the ids and the loss mask equal transformers'
  own ``apply_chat_template(..., return_assistant_tokens_mask=True)``, for a Qwen-style (ChatML) and a
  Llama-3-style template on a byte-level tokenizer;
- the dry run shows a rendered sample with its trained spans and their count, and says when there is no template;
- Pai's SFT idxmap (ids plus -100 labels), plain and packed, and its packed-SFT JSON are read; every id is
  checked before training, in one line;
- each format trains, and ``log/metrics.jsonl`` records the tokens the loss was taken over (slow).
"""

from __future__ import annotations

import json
import re

import numpy
import pytest

from megatron_patch.cli import main
from megatron_patch.errors import UserError
from megatron_patch.tokenizer import load_tokenizer
from megatron_patch.training.data_files import check_mmap_data, check_sft_idxmap
from megatron_patch.training.sft_data import IdxmapSFTDataset, SFTDataset, read_records, tokenize_record
from megatron_patch.training.validation import resolve
from tests.convert_helpers import run_cli
from tests.sft_helpers import (LLAMA3_STYLE, LLAMA3_TOKENS, QWEN_STYLE, QWEN_TOKENS, chat_ids,
                               make_byte_level_tokenizer, pai_sft_sequences, write_mmap_pair)
from tests.training_helpers import (launcher_args, make_chat_tokenizer, make_texts, make_tokenizer, read_metrics,
                                    write_jsonl)

# The sample length of these tests: each record's rendering fits, and two of PAI_RECORDS fit one packed sample.
SEQ = 192

STYLES = {
    "qwen": (QWEN_STYLE, QWEN_TOKENS, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama3": (LLAMA3_STYLE, LLAMA3_TOKENS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
}

# Each record kind, and the conversation Pai makes of it (its SFT code: the user turn is instruction + input,
# nothing between; ``content`` is a response).
RECORDS = [
    ({"instruction": "Describe the river.", "input": " It is cold.", "output": " A quiet river by the sea."},
     [("user", "Describe the river. It is cold."), ("assistant", " A quiet river by the sea.")]),
    ({"instruction": "Name a fruit.", "input": "", "output": "A green apple."},
     [("user", "Name a fruit."), ("assistant", "A green apple.")]),
    ({"query": "Where does the cat sit?", "response": "The cat sits on the warm mat."},
     [("user", "Where does the cat sit?"), ("assistant", "The cat sits on the warm mat.")]),
    ({"query": "And the dog?", "content": "A dog sees the red ball."},
     [("user", "And the dog?"), ("assistant", "A dog sees the red ball.")]),
    ({"prompt": "Say it again.", "completion": "The farmer paints the blue house."},
     [("user", "Say it again."), ("assistant", "The farmer paints the blue house.")]),
    ({"system": "Be brief.", "instruction": "Name a place.", "output": "By the sea."},
     [("system", "Be brief."), ("user", "Name a place."), ("assistant", "By the sea.")]),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
                   {"role": "user", "content": "Leaving?"}, {"role": "assistant", "content": " Bye now."}]},
     [("user", "Hi"), ("assistant", "Hello there."), ("user", "Leaving?"), ("assistant", " Bye now.")]),
    # LLaMA-Factory's system column beside messages (it was dropped: the template's default system prompt trained)
    ({"system": "Answer in French.", "messages": [{"role": "user", "content": "Name a fruit."},
                                                  {"role": "assistant", "content": "Une pomme."}]},
     [("system", "Answer in French."), ("user", "Name a fruit."), ("assistant", "Une pomme.")]),
]


@pytest.fixture(scope="module")
def texts():
    return make_texts(300, seed=11)


@pytest.fixture(scope="module", params=list(STYLES))
def byte_level(request, texts, tmp_path_factory):
    """(transformers' tokenizer, ours) of a byte-level BPE folder with the style's chat template."""
    from transformers import AutoTokenizer

    template, tokens, config = STYLES[request.param]
    folder = make_byte_level_tokenizer(tmp_path_factory.mktemp(request.param) / "tok", texts, template, tokens, config)
    return AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)


@pytest.fixture(scope="module")
def chat_tok(texts, tmp_path_factory):
    """A ChatML tokenizer small enough for the tiny models (<= 200 ids), with the Qwen-style template."""
    root = tmp_path_factory.mktemp("chat")
    base = make_tokenizer(root / "base", texts, vocab_size=190)
    return make_chat_tokenizer(root / "tok", base, QWEN_STYLE, QWEN_TOKENS)


# --- the chat template -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("record,turns", RECORDS, ids=[next(iter(r)) + "/" + list(r)[-1] for r, _ in RECORDS])
def test_records_render_as_transformers_renders_them(byte_level, record, turns):
    """Before, every record but ``messages`` trained as plain text ('prompt\\nresponse</s>'), and query/content was
    refused: a chat model fine-tuned here never saw its chat format."""
    hf, tok = byte_level
    ids, trained = tokenize_record(tok, record, "record 1")
    reference, mask = chat_ids(hf, [{"role": r, "content": c} for r, c in turns], return_assistant_tokens_mask=True)
    assert ids == reference
    assert trained == mask, (hf.decode([i for i, t in zip(ids, trained) if t]),
                             hf.decode([i for i, t in zip(ids, mask) if t]))
    # The assistant's words and its end of turn carry the loss; nothing of the prompt or the assistant header.
    on = hf.decode([i for i, t in zip(ids, trained) if t])
    answers = [c.strip() for r, c in turns if r == "assistant"]
    assert all(a in on for a in answers) and on.rstrip("\n").endswith(("<|im_end|>", "<|eot_id|>"))
    assert not any(c.strip() in on for r, c in turns if r != "assistant") and "assistant" not in on


def test_a_conversation_the_assistant_opens_trains_only_its_answers(byte_level):
    """The opening assistant message's span started at character 0: the bos, the template's default system
    prompt and the assistant header carried loss (66 tokens against transformers' 24), and a packed sample
    trained the record before it to predict its first token."""
    hf, tok = byte_level
    messages = [{"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "A fruit?"},
                {"role": "assistant", "content": "A green apple."}]
    ids, trained = tokenize_record(tok, {"messages": messages}, "record 1")
    reference, mask = chat_ids(hf, messages, return_assistant_tokens_mask=True)
    assert (ids, trained) == (reference, mask), hf.decode([i for i, t in zip(ids, trained) if t])
    assert not trained[0]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}]
# Qwen2.5's way of showing the tools: in a system turn of their own, before the conversation
TOOLS_STYLE = ("{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson + '\\n' }}"
               "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}" + QWEN_STYLE)


def test_a_records_tools_are_rendered_as_apply_chat_template_renders_them(texts, tmp_path):
    """A function-calling record's ``tools`` were dropped: its tool calls trained on a prompt that never showed the
    functions (229 tokens against transformers' 494 in the audit). Rendered as ``apply_chat_template(messages,
    tools=...)``; without a template to render them they are refused, not dropped."""
    from transformers import AutoTokenizer

    _, tokens, config = STYLES["qwen"]
    folder = make_byte_level_tokenizer(tmp_path / "tok", texts, TOOLS_STYLE, tokens, config)
    hf, tok = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'},
                {"role": "tool", "content": "Sunny, 21 C"}, {"role": "assistant", "content": "Sunny and warm."}]
    ids, trained = tokenize_record(tok, {"messages": messages, "tools": TOOLS}, "record 1")
    assert (ids, trained) == chat_ids(hf, messages, tools=TOOLS, return_assistant_tokens_mask=True)
    assert "get_weather" in hf.decode([i for i, t in zip(ids, trained) if not t]).split("Weather in Paris")[0]
    plain = load_tokenizer(make_tokenizer(tmp_path / "plain", texts))
    with pytest.raises(UserError, match="defines 'tools', and .* has no chat template to render them"):
        tokenize_record(plain, {"messages": messages, "tools": TOOLS}, "record 1")


# Llama-2's / Mistral-v0.1's template, the assistant part marked for transformers' reference mask
LLAMA2_STYLE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{% generation %}{{ m['content'] + eos_token }}"
                "{% endgeneration %}{% endif %}{% endfor %}")


@pytest.mark.parametrize("legacy", [False, None, True])
def test_a_sentencepiece_folder_encodes_as_the_tokenizer_class_transformers_builds(texts, tmp_path, legacy):
    """Llama-2/Mistral-v0.1 folders (tokenizer.json's normalizer Prepend + Replace '▁', tokenizer_class LlamaTokenizer):
    transformers 5 builds that class's own pipeline (no '▁' after a special token unless `legacy`), and the file's
    pipeline gave other ids after every [INST] and other masks than apply_chat_template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import AutoTokenizer

    spm = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    spm.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    spm.train_from_iterator(texts + ["[INST] hello [/INST]"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    folder = tmp_path / "tok"
    folder.mkdir()
    spm.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": True, "chat_template": LLAMA2_STYLE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config if legacy is None else {**config, "legacy": legacy}))
    messages = [{"role": "user", "content": "The cat"}, {"role": "assistant", "content": "sat on the mat"},
                {"role": "user", "content": "And?"}, {"role": "assistant", "content": "the dog ran"}]
    hf = AutoTokenizer.from_pretrained(folder)
    ids, trained = tokenize_record(load_tokenizer(folder), {"messages": messages}, "record 1")
    assert (ids, trained) == chat_ids(hf, messages, return_assistant_tokens_mask=True), hf.convert_ids_to_tokens(ids)


# Qwen2.5's rendering of tool calls (trimmed): an assistant turn tests ``m.content`` and lists its tool_calls.
TOOL_CALLING_STYLE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{%- if m.content %}{{- m.content }}{%- endif %}{%- for tc in m.tool_calls or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + (tc.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_tool_call_with_null_content_renders_as_transformers_renders_it(texts, tmp_path):
    """OpenAI's form of a tool call, ``"content": null`` beside ``tool_calls``, was refused ("needs a string
    'content'") though apply_chat_template renders it: the usual function-calling export could not be trained."""
    from transformers import AutoTokenizer

    folder = make_byte_level_tokenizer(tmp_path / "tok", texts, TOOL_CALLING_STYLE, QWEN_TOKENS,
                                       {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    hf = AutoTokenizer.from_pretrained(folder)
    ids, trained = tokenize_record(load_tokenizer(folder), {"messages": messages}, "record 1")
    assert (ids, trained) == chat_ids(hf, messages, return_assistant_tokens_mask=True)
    assert "get_weather" in hf.decode([i for i, t in zip(ids, trained) if t])
    # Without a template, the null content is an empty turn; a null content that calls no tool is still refused.
    plain = load_tokenizer(make_tokenizer(tmp_path / "plain", texts))
    assert plain.decode(tokenize_record(plain, {"messages": messages}, "r")[0]).count("<|assistant|>") == 2
    with pytest.raises(UserError, match="string 'content' \\(null only beside 'tool_calls'\\)"):
        tokenize_record(plain, {"messages": [{"role": "assistant", "content": None}]}, "r")


def _template_folder(chat_tok, tmp_path, **files):
    """A copy of ``chat_tok`` whose tokenizer_config.json takes ``config`` and beside which ``files`` are written."""
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(chat_tok, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **files.pop("config", {})}))
    for name, text in files.items():
        (folder / ".".join(name.rsplit("_", 1))).write_text(text)  # chat_template_jinja: chat_template.jinja
    return folder


def test_the_chat_template_is_the_one_transformers_picks(chat_tok, tmp_path):
    """chat_template.jinja wins over tokenizer_config.json's chat_template in transformers: records were rendered
    with the other one; named templates without a 'default' trained the plain format, saying there was none."""
    from transformers import AutoTokenizer

    plain = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    folder = _template_folder(chat_tok, tmp_path, chat_template_jinja=plain)
    record = {"prompt": "Hi", "completion": "Hello."}
    ids, _ = tokenize_record(load_tokenizer(folder), record, "record 1")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert ids == chat_ids(AutoTokenizer.from_pretrained(folder), messages)[0]
    assert load_tokenizer(folder).decode(ids) == "<|im_start|>Hi<|im_end|><|im_start|>Hello.<|im_end|>"
    (folder / "chat_template.jinja").unlink()
    named = [{"name": "chatml", "template": plain}, {"name": "tool_use", "template": plain}]
    folder = _template_folder(folder, tmp_path / "named", config={"chat_template": named})
    with pytest.raises(UserError, match="chat templates named chatml, tool_use and none named 'default'"):
        tokenize_record(load_tokenizer(folder), record, "record 1")


def test_a_template_that_raises_names_the_record(chat_tok, tmp_path):
    failing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    folder = _template_folder(chat_tok, tmp_path, config={"chat_template": failing + "{{ messages[0]['content'] }}"})
    with pytest.raises(UserError, match="^data.jsonl record 6: the chat template of .* System role not supported"):
        tokenize_record(load_tokenizer(folder), {"system": "S", "prompt": "P", "completion": "C"},
                        "data.jsonl record 6")


def test_jsonl_records_may_hold_unicode_line_separators(tmp_path):
    """json.dumps(..., ensure_ascii=False) leaves U+2028, U+2029 and U+0085 raw inside strings; str.splitlines cut the
    line there, and the file was refused as not JSON."""
    records = [{"prompt": f"a{c}b", "completion": "c"} for c in ("\u2028", "\u2029", "\x85")]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert read_records(path) == records


def test_records_that_are_not_sft_records_are_one_line(chat_tok):
    tok = load_tokenizer(chat_tok)
    for record, message in (({"query": "x"}, "needs string prompt and response fields"),
                            ({"instruction": "x", "output": "y", "input": 3}, "'input' must be a string"),
                            ({"instruction": "x", "output": "y", "system": ["s"]}, "'system' must be a string"),
                            ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
                            ({"system": "s", "messages": [{"role": "system", "content": "t"},
                                                          {"role": "assistant", "content": "y"}]},
                             "both a 'system' field and a system message"),
                            ({"messages": [{"role": "assistant", "content": "y"}], "tools": {"name": "f"}},
                             "'tools' must be a list of JSON objects"),
                            (["x"], "must be a JSON object")):
        with pytest.raises(UserError, match=message):
            tokenize_record(tok, record, "f.jsonl record 3")


def test_without_a_template_records_keep_the_plain_format(texts, tmp_path):
    tok = load_tokenizer(make_tokenizer(tmp_path / "tok", texts))
    ids, trained = tokenize_record(tok, RECORDS[0][0], "r")
    assert tok.decode(ids) == "Describe the river. It is cold.\n A quiet river by the sea.</s>"
    assert tok.decode([i for i, t in zip(ids, trained) if t]).strip() == "A quiet river by the sea.</s>"
    ids, trained = tokenize_record(tok, RECORDS[5][0], "r")  # the system turn, on a line before the prompt
    assert tok.decode(ids).replace("\n ", "\n") == "Be brief.\nName a place.\nBy the sea.</s>"  # (a word's space)


# --- the dry run -----------------------------------------------------------------------------------------------

def _sft_args(tmp_path, data, **over):
    base = dict(SFT="true", DATASET_PATH=str(data), OUTPUT_BASEPATH=str(tmp_path / "out"), SEQ_LEN=str(SEQ),
                PAD_LEN=str(SEQ))
    return launcher_args("llama3_1", **{**base, **over})


def test_dry_run_shows_a_rendered_sample_with_its_loss_mask(chat_tok, texts, tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    write_jsonl(tmp_path / "sft.jsonl", [RECORDS[2][0], RECORDS[0][0]])
    monkeypatch.setenv("MP_DRY_RUN", "1")
    monkeypatch.setenv("MP_TOKENIZER", str(chat_tok))
    assert main(["train", "llama3_1", *_sft_args(tmp_path, tmp_path / "sft.jsonl")]) == 0
    out = capsys.readouterr().out
    _, mask = chat_ids(AutoTokenizer.from_pretrained(chat_tok), [{"role": "user", "content": "Where does the cat sit?"},
                       {"role": "assistant", "content": "The cat sits on the warm mat."}], return_assistant_tokens_mask=True)
    assert f"SFT data: records rendered by the chat template of {chat_tok}, the loss on the assistant turns" in out
    assert f"record 1: {len(mask)} tokens (samples are {SEQ}), the loss on {sum(mask)} of them, between [[ and ]]" in out
    assert "    <|im_start|>user\n    Where does the cat sit?<|im_end|>\n    <|im_start|>assistant\n" \
           "    [[The cat sits on the warm mat.<|im_end|>\n    ]]\n" in out, out



def test_dry_run_says_when_there_is_no_template(texts, tmp_path, monkeypatch, capsys):
    """Without a template the dry run says the plain format is used, and shows it."""
    write_jsonl(tmp_path / "sft.jsonl", [RECORDS[2][0], RECORDS[0][0]])
    monkeypatch.setenv("MP_TOKENIZER", str(make_tokenizer(tmp_path / "plain", texts)))
    monkeypatch.setenv("MP_DRY_RUN", "json")
    assert main(["train", "llama3_1", *_sft_args(tmp_path, tmp_path / "sft.jsonl")]) == 0
    sample = json.loads(capsys.readouterr().out)["sft_sample"]
    assert sample["format"].startswith(f"plain format: {tmp_path / 'plain'} has no chat template")
    assert sample["text"] == "Where does the cat sit?\n[[The cat sits on the warm mat.</s>]]"
    # A first record training would stop at is said, and the dry run goes on (as with the machine's problems).
    write_jsonl(tmp_path / "sft.jsonl", [{"query": "no answer"}])
    monkeypatch.setenv("MP_DRY_RUN", "1")
    assert main(["train", "llama3_1", *_sft_args(tmp_path, tmp_path / "sft.jsonl")]) == 0
    assert "SFT data: the first sample cannot be rendered, and training would stop there: " \
           f"{tmp_path / 'sft.jsonl'} record 1: an SFT record needs string prompt and response" in capsys.readouterr().out


def test_a_bad_record_anywhere_is_refused_at_launch_before_any_rank(chat_tok, tmp_path, monkeypatch, capsys):
    """Every record's shape is checked by the launcher (sft_records.record_groups): before, only the ranks read the
    records, so a bad one deep in the file stopped every rank after its imports, once per rank."""
    import megatron_patch.cli.train as train_cli

    def no_rank(*_):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(train_cli, "_launch", no_rank)
    monkeypatch.setenv("MP_TOKENIZER", str(chat_tok))
    good = [r for r, _ in RECORDS]
    for name, records, valid, message in (
            ("deep.jsonl", good[:2] + [{"query": "no answer"}] + good[2:], None,
             "deep.jsonl record 3: an SFT record needs string prompt and response fields"),
            ("packed.jsonl", [good[:2], [good[2], {"messages": [{"role": "user", "content": "x"}]}]], None,
             "packed.jsonl record 2 item 2: the conversation has no assistant message to train on"),
            ("empty_pack.jsonl", [good[:2], []], None, "empty_pack.jsonl record 2: an empty list"),
            ("train.jsonl", good, [good[0], {"instruction": "x", "output": "y", "input": 3}],
             "valid.jsonl record 2: 'input' must be a string")):
        write_jsonl(tmp_path / name, records)
        over = {}
        if valid is not None:
            write_jsonl(tmp_path / "valid.jsonl", valid)
            over["VALID_DATASET_PATH"] = str(tmp_path / "valid.jsonl")
        assert main(["train", "llama3_1", *_sft_args(tmp_path / name[:-6], tmp_path / name, **over)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("name, text, said", [
    ("digits.jsonl", '{"instruction": "a", "output": "b", "id": ' + "9" * 5000 + "}\n",
     "digits.jsonl line 1 is not valid JSON (a number of more than 4300 digits"),
    ("digits.json", '[{"instruction": "a", "output": "b", "id": ' + "9" * 5000 + "}]",
     "digits.json is not valid JSON (a number of more than 4300 digits"),
    ("deep.jsonl", "[" * 100_000 + "\n", "deep.jsonl is not valid JSON (nested too deeply)"),
])
def test_sft_records_python_cannot_read_are_one_line(tmp_path, name, text, said):
    """A number of more than 4300 digits (Python's int() limit) or nesting past the recursion limit ended json.loads
    with an error the reader did not catch: an internal error (the hostile audit)."""
    (tmp_path / name).write_text(text)
    with pytest.raises(UserError) as err:
        read_records(tmp_path / name)
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_sft_files_in_another_encoding_are_one_line_and_a_bom_is_taken(chat_tok, tmp_path, monkeypatch, capsys):
    """A byte that is not UTF-8, or a UTF-16 file, is refused naming the file and line, as ``mpatch preprocess``
    refuses it (it was an internal error, exit 1); a UTF-8 file with a byte-order mark (Windows editors) is read,
    as preprocess reads it (it was 'line 1 is not valid JSON (Unexpected UTF-8 BOM)')."""
    import megatron_patch.cli.train as train_cli

    good = [json.dumps(r) for r, _ in RECORDS[:2]]
    text = "\n".join(good) + "\n"
    (tmp_path / "bom.jsonl").write_text(text, encoding="utf-8-sig")
    (tmp_path / "bom.json").write_text(json.dumps([r for r, _ in RECORDS[:2]]), encoding="utf-8-sig")
    for name in ("bom.jsonl", "bom.json"):
        assert read_records(tmp_path / name) == [r for r, _ in RECORDS[:2]], name
    (tmp_path / "latin1.jsonl").write_bytes(
        (good[0] + "\n" + '{"instruction": "caf\u00e9", "output": "x"}\n').encode("latin-1"))
    (tmp_path / "utf16.jsonl").write_text(text, encoding="utf-16")
    cases = (("latin1.jsonl", "latin1.jsonl line 2 is not UTF-8 (invalid continuation byte at byte 21 of the line): "
                              "re-encode the file as UTF-8"),
             ("utf16.jsonl", "utf16.jsonl line 1 is not UTF-8 (invalid start byte at byte 1 of the line) (it is "
                             "UTF-16, by its byte-order mark): re-encode the file as UTF-8"))
    for name, message in cases:
        with pytest.raises(UserError, match=re.escape(message)):
            read_records(tmp_path / name)

    def no_rank(*_):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(train_cli, "_launch", no_rank)
    monkeypatch.setenv("MP_TOKENIZER", str(chat_tok))
    for name, message in cases:
        assert main(["train", "llama3_1", *_sft_args(tmp_path / name[:-6], tmp_path / name)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    # the dry run reads the first record alone: it says the same, and goes on (as for a record it cannot render)
    monkeypatch.setenv("MP_DRY_RUN", "1")
    for name, message in cases:
        assert main(["train", "llama3_1", *_sft_args(tmp_path / name[:-6], tmp_path / name)]) == 0, name
        assert f"SFT data: the first sample cannot be rendered, and training would stop there: {tmp_path}/{message}" \
            in capsys.readouterr().out
    assert main(["train", "llama3_1", *_sft_args(tmp_path / "bom", tmp_path / "bom.jsonl")]) == 0
    assert "SFT data: records rendered by the chat template" in capsys.readouterr().out


def test_compressed_sft_files_are_read_as_preprocess_reads_them(chat_tok, tmp_path, monkeypatch, capsys):
    """A .jsonl.gz (HF datasets ship them so; ``mpatch preprocess`` reads .gz and .zst) was refused as "not UTF-8
    ... re-encode the file as UTF-8", which sent the user the wrong way."""
    import gzip

    import zstandard

    records = [r for r, _ in RECORDS[:2]]
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    (tmp_path / "sft.jsonl.gz").write_bytes(gzip.compress(text))
    (tmp_path / "sft.json.zst").write_bytes(zstandard.ZstdCompressor().compress(json.dumps(records).encode()))
    for name in ("sft.jsonl.gz", "sft.json.zst"):
        assert read_records(tmp_path / name) == records, name
    # a decompression bomb (64 MiB of spaces in a few KiB) is refused, not read whole into memory
    (tmp_path / "bomb.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=19).compress(b" " * (64 << 20)))
    with pytest.raises(UserError, match="bomb.jsonl.zst expands more than 1000-fold when decompressed"):
        read_records(tmp_path / "bomb.jsonl.zst")
    # the bound is counted as the text is read: a read of the whole bound at once set it aside first, and a 31 MiB
    # file's (1000-fold) failed as a MemoryError; a bound of 10**9 times stands for it here
    from megatron_patch.training import sft_records

    monkeypatch.setattr(sft_records, "MAX_EXPANSION", 10**9)
    for name in ("sft.jsonl.gz", "sft.json.zst"):
        assert read_records(tmp_path / name) == records, name
    monkeypatch.undo()
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(text)[:-12])
    (tmp_path / "unnamed.jsonl").write_bytes(gzip.compress(text))
    for name, message in (("cut.jsonl.gz", "cut.jsonl.gz cannot be decompressed (Compressed file ended before"),
                          ("unnamed.jsonl", "unnamed.jsonl is gzip-compressed (by its first bytes), and its name does "
                                            "not end in .gz: rename it so, or decompress it")):
        with pytest.raises(UserError, match=re.escape(message)):
            read_records(tmp_path / name)
    # the dry run reads its first record from a bounded line; a longer one is read through read_records' bound
    from megatron_patch.training import sft_data

    monkeypatch.setattr(sft_data, "FIRST_LINE_CHARS", 10)
    assert sft_data._first_record(tmp_path / "sft.jsonl.gz") == records[0]
    monkeypatch.undo()
    # the launch and the dry run's first record read it too
    monkeypatch.setenv("MP_TOKENIZER", str(chat_tok))
    monkeypatch.setenv("MP_DRY_RUN", "1")
    assert main(["train", "llama3_1", *_sft_args(tmp_path / "gz", tmp_path / "sft.jsonl.gz")]) == 0
    out = capsys.readouterr().out
    assert "SFT data: records rendered by the chat template" in out and "Describe the river" in out, out


# --- Pai's SFT idxmap ------------------------------------------------------------------------------------------

PAI_RECORDS = [r for r, _ in RECORDS[:2]] + [
    {"instruction": "Find the road.", "input": "", "output": "The long road near the school."},
    {"instruction": "What does the bird see?", "input": " In the morning.", "output": "A small bird sees a green apple."},
]


@pytest.fixture(scope="module")
def pai_idxmap(chat_tok, tmp_path_factory):
    """Pai's SFT idxmap of PAI_RECORDS, plain (a sample per record) and packed (--sequence-packing)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(chat_tok)
    pad = hf.convert_tokens_to_ids("<|endoftext|>")
    root = tmp_path_factory.mktemp("pai")
    out = {"hf": hf, "tok": chat_tok}
    for name, packing in (("plain", False), ("packed", True)):
        sequences = pai_sft_sequences(hf, PAI_RECORDS, SEQ, pad, packing=packing)
        out[name] = write_mmap_pair(root / f"{name}_text_document", sequences)
        out[f"{name}_sequences"] = sequences
    assert len(out["plain_sequences"]) == 4 and len(out["packed_sequences"]) == 2
    return out


def _records_of(sequences: list[list[int]]):
    """(input ids, labels) of each record of Pai's samples, cut at its end marks, by the test's own reading."""
    for seq in sequences:
        tokens, labels, start = seq[:SEQ], seq[SEQ:], 0
        for end in [i + 1 for i, t in enumerate(tokens) if t < 0]:
            yield [t if t >= 0 else -1 - t for t in tokens[start:end]], labels[start:end]
            start = end


def test_pai_sft_idxmap_is_read_as_pai_trains_on_it(pai_idxmap):
    """Before, an SFT idxmap was refused three ways (MP_DATASET_TYPE=idxmap unknown, SFT=true with mmap data
    refused, DATASET_PATH not a JSON file)."""
    expected = list(_records_of(pai_idxmap["plain_sequences"]))
    assert len(expected) == 4 and expected == list(_records_of(pai_idxmap["packed_sequences"]))
    for name, packing in (("plain", False), ("packed", False), ("plain", True)):
        data = IdxmapSFTDataset(pai_idxmap[name], SEQ, packing=packing)
        assert len(data) == 4  # a record a sample, whichever way the file was packed
        for sample, (tokens, labels) in zip(data, expected):
            n = len(tokens)
            assert sample["tokens"][:n].tolist() == tokens
            trained = sample["loss_mask"].bool()
            assert trained[:n].tolist() == [label != -100 for label in labels] and not trained[n:].any()
            assert sample["labels"][trained].tolist() == [label for label in labels if label != -100]
            # the labels are the next input ids: Pai's loss starts at the assistant header
            assert sample["labels"][:n - 1][trained[:n - 1]].tolist() == [t for t, on in zip(tokens[1:], trained) if on]
    labels = pai_idxmap["hf"].decode([label for label in expected[0][1] if label != -100])
    assert labels.startswith("<|im_start|>assistant\n")  # the label of the prompt's last token: the header
    # Packed and read packed: two samples, each record a THD segment whose positions restart.
    packed = IdxmapSFTDataset(pai_idxmap["packed"], SEQ, packing=True)
    assert len(packed) == 2
    lengths = [len(t) for t, _ in expected]
    first = packed[0]
    starts = first["doc_start"].nonzero().flatten().tolist()
    records_in_first = len(starts) - 1  # the padding after the last record is a segment of its own
    assert starts[:records_in_first] == [sum(lengths[:i]) for i in range(records_in_first)]
    assert first["position_ids"][starts[1]] == 0 and first["position_ids"][starts[1] - 1] == lengths[0] - 1
    assert sum(int(packed[i]["loss_mask"].sum()) for i in range(2)) == \
        sum(label != -100 for _, labels in expected for label in labels)


def test_the_launcher_takes_pai_sft_idxmap_as_pai_does(pai_idxmap, tmp_path):
    """SFT=true with an idxmap prefix, without MP_DATASET_TYPE (Pai's default is idxmap) or with Pai's value for
    it; SEQ_LEN is its sample length, and no tokenizer is needed."""
    for env in ({}, {"MP_DATASET_TYPE": "idxmap"}, {"MP_DATASET_TYPE": "mmap"}):
        cfg = resolve("llama3_1", _sft_args(tmp_path, pai_idxmap["plain"], PAD_LEN="32"), env=env)
        assert cfg.dataset_type == "mmap" and cfg.sample_length == SEQ and cfg.tokenizer is None
    cfg = resolve("llama3_1", _sft_args(tmp_path, pai_idxmap["plain"], PAD_LEN="32"), env={})
    check_sft_idxmap(cfg.dataset_path[0], cfg.arch.vocab_size, cfg.sample_length)
    # JSON records stay the default for a file, with PAD_LEN as their length.
    write_jsonl(tmp_path / "sft.jsonl", PAI_RECORDS)
    cfg = resolve("llama3_1", _sft_args(tmp_path, tmp_path / "sft.jsonl"), env={"MP_TOKENIZER": str(pai_idxmap["tok"])})
    assert cfg.dataset_type == "raw" and cfg.sample_length == SEQ


def test_every_id_of_an_sft_idxmap_is_checked_before_training(pai_idxmap, tmp_path):
    good = pai_idxmap["plain_sequences"]
    vocab = 200

    def refused(sequences, message, dtype=numpy.int32, length=SEQ):
        prefix = write_mmap_pair(tmp_path / "bad", sequences, dtype)
        with pytest.raises(UserError, match=message) as exc:
            check_sft_idxmap(prefix, vocab, length)
        assert "\n" not in str(exc.value)

    def edited(sample: int, position: int, value: int):
        out = [list(s) for s in good]
        out[sample][position] = value
        return out

    assert check_sft_idxmap(pai_idxmap["plain"], vocab, SEQ) == 4
    refused(edited(1, 3, vocab), r"holds input id 200 \(sample 1, token 3\), outside the model's vocabulary \[0, 200\)")
    refused(edited(1, 3, -vocab - 1), "holds input id -201")  # an end mark of an id outside it
    label = next(i for i, v in enumerate(good[2][SEQ:]) if v != -100) + SEQ
    other = (good[2][label] + 1) % 190
    refused(edited(2, label, other), f"sample 2 labels token {label - SEQ} with {other}, which is not the next input id")
    refused(edited(2, label, -5), "with -5, which is not the next input id")
    refused([s[:SEQ] + [-100] * SEQ for s in good], "labels no token")
    refused(good, f"holds samples of {SEQ} tokens .* longer than SEQ_LEN=32", length=32)
    refused([[abs(v) for v in s] for s in good], "holds unsigned ids", dtype=numpy.uint16)
    refused([good[0], good[1][:100]], f"holds sequences of 100 to {2 * SEQ} tokens")


def test_pai_idxmap_given_as_pretraining_data_is_one_line(pai_idxmap, tmp_path, capsys):
    """Its -100 labels and end marks stopped a rank with IndexError before the ids were checked (issue 34 checks
    them); the line now says what the data is."""
    with pytest.raises(UserError, match="an SFT idxmap of Pai's sft_data_preprocessing holds: train it with SFT=true"):
        check_mmap_data(pai_idxmap["plain"], 200)
    args = launcher_args("llama3_1", DATASET_PATH=pai_idxmap["plain"], OUTPUT_BASEPATH=str(tmp_path / "out"))
    rc, err = run_cli(capsys, "train", "llama3_1", *args)
    assert rc == 2 and err.count("\n") == 1 and "IndexError" not in err and "SFT=true" in err, err


def test_sft_data_of_the_other_kind_or_a_folder_is_named_for_what_it_is(pai_idxmap, tmp_path, monkeypatch, capsys):
    """A JSONL DATASET_PATH with an idxmap prefix as VALID_DATASET_PATH (and the reverse), or a folder of .jsonl
    shards, were refused as "not found", though they exist and the prefix is what the hint asked for."""
    monkeypatch.setenv("MP_TOKENIZER", str(pai_idxmap["tok"]))
    records = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Name a fruit.", "response": "An apple."}])
    (tmp_path / "shards").mkdir()
    write_jsonl(tmp_path / "shards" / "part-0.jsonl", [{"prompt": "Name a fruit.", "response": "An apple."}])
    for data, valid, message in (
            (records, pai_idxmap["plain"], f"SFT data {pai_idxmap['plain']} is the prefix of a .bin/.idx pair, and "
                                           "this run reads JSON/JSONL records: training and validation data must be "
                                           "of one kind"),
            (pai_idxmap["plain"], records, f"SFT data {records} is a file (JSON/JSONL records), and this run reads "
                                           "an SFT idxmap's .bin/.idx: training and validation data must be of one"),
            (str(tmp_path / "shards"), "none", f"SFT data {tmp_path / 'shards'} is a folder: give one JSON or JSONL")):
        rc, err = run_cli(capsys, "train", "llama3_1", *_sft_args(tmp_path, data, VALID_DATASET_PATH=valid))
        assert rc == 2 and message in err and "not found" not in err and err.count("\n") == 1, err


def test_dry_run_of_an_sft_idxmap_shows_its_first_record(pai_idxmap, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MP_DRY_RUN", "json")
    monkeypatch.setenv("MP_TOKENIZER", str(pai_idxmap["tok"]))
    assert main(["train", "llama3_1", *_sft_args(tmp_path, pai_idxmap["packed"])]) == 0
    sample = json.loads(capsys.readouterr().out)["sft_sample"]
    tokens, labels = next(_records_of(pai_idxmap["packed_sequences"]))
    assert sample["format"].startswith("Pai's SFT idxmap") and sample["tokens"] == len(tokens)
    assert sample["loss_tokens"] == sum(label != -100 for label in labels)
    assert sample["text"].endswith("[[<|im_start|>assistant\n A quiet river by the sea.<|im_end|>\n]]"), sample["text"]


# --- Pai's packed-SFT JSON -------------------------------------------------------------------------------------

def test_pai_packed_sft_json_is_read(chat_tok, tmp_path):
    """A line of Pai's packed-SFT JSON lists the records of one sample (its README's format). Before, a list was
    refused ('an SFT record must be a JSON object')."""
    tok = load_tokenizer(chat_tok)
    packs = [PAI_RECORDS[:2], PAI_RECORDS[2:3], PAI_RECORDS[3:]]
    write_jsonl(tmp_path / "packed.jsonl", packs)
    (tmp_path / "packed.json").write_text(json.dumps(packs, indent=1))  # one JSON array of them, on many lines
    assert read_records(tmp_path / "packed.jsonl") == read_records(tmp_path / "packed.json") == packs
    per_record = [sum(tokenize_record(tok, r, "r")[1]) for r in PAI_RECORDS]
    packed = SFTDataset(tmp_path / "packed.jsonl", tok, SEQ, packing=True)
    assert len(packed) == 3  # the lists as they are, not packed further
    assert [int(s["doc_start"].sum()) for s in packed.samples] == [3, 2, 2]  # records, then the padding
    assert [int(s["loss_mask"].sum()) for s in packed.samples] == [sum(per_record[:2]), per_record[2], per_record[3]]
    plain = SFTDataset(tmp_path / "packed.json", tok, SEQ)
    assert [int(s["loss_mask"].sum()) for s in plain.samples] == per_record and "doc_start" not in plain.samples[0]


def test_records_whose_responses_lie_past_the_cut_are_named_and_all_of_them_refused(chat_tok, tmp_path, monkeypatch,
                                                                                     capsys):
    """A record whose prompt fills the sample trains nothing (loss 0, grad 0, exit 0 before): the dry run says so,
    a dataset of only such records is refused, and one with some of them counts them in the line the log prints."""
    long_prompt = {"instruction": " ".join(["word"] * 300), "output": "The cat sits on the warm mat."}
    short = {"instruction": "Where does the cat sit?", "output": "On the mat."}
    write_jsonl(tmp_path / "long.jsonl", [long_prompt, long_prompt])
    write_jsonl(tmp_path / "mixed.jsonl", [short, long_prompt])
    tok = load_tokenizer(chat_tok)
    with pytest.raises(UserError, match=f"no sample of .*long.jsonl keeps a trained token within its {SEQ} tokens"):
        SFTDataset(tmp_path / "long.jsonl", tok, SEQ)
    mixed = SFTDataset(tmp_path / "mixed.jsonl", tok, SEQ)
    assert mixed.untrained == 1 and [bool(s["loss_mask"].any()) for s in mixed.samples] == [True, False]
    # an answer that runs past the sample is cut: counted for the log line (it was cut without a word)
    write_jsonl(tmp_path / "long_answer.jsonl", [short, {"instruction": "Say it.", "output": " ".join(["word"] * 300)}])
    assert (mixed.cut, SFTDataset(tmp_path / "long_answer.jsonl", tok, SEQ).cut) == (1, 1)
    whole = len(tokenize_record(tok, read_records(tmp_path / "long_answer.jsonl")[1], "r")[0])
    assert [SFTDataset(tmp_path / "long_answer.jsonl", tok, n).cut for n in (whole - 2, whole - 1)] == [1, 0]

    monkeypatch.setenv("MP_DRY_RUN", "1")
    monkeypatch.setenv("MP_TOKENIZER", str(chat_tok))
    assert main(["train", "llama3_1", *_sft_args(tmp_path, tmp_path / "long.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "; training cuts the rest), the loss on " in out and (
        " of them; 0 within the sample: it trains nothing, raise SEQ_LEN/PAD_LEN or shorten the prompt") in out, out

    # The launch refuses it in one line before any rank starts (the ranks' dataset refused it, after their imports).
    from megatron_patch.training.sft_records import record_groups
    from megatron_patch.training.sft_tokens import refuse_untrainable

    monkeypatch.delenv("MP_DRY_RUN")
    assert main(["train", "llama3_1", *_sft_args(tmp_path / "run", tmp_path / "long.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "long.jsonl keeps a trained token within its" in err, err
    assert not (tmp_path / "run" / "out" / "log").exists()  # no rank wrote a log
    for packing in (False, True):
        refuse_untrainable(tmp_path / "mixed.jsonl", record_groups(tmp_path / "mixed.jsonl"), tok, SEQ, packing)
        with pytest.raises(UserError, match="long.jsonl keeps a trained token"):
            refuse_untrainable(tmp_path / "long.jsonl", record_groups(tmp_path / "long.jsonl"), tok, SEQ, packing)


# --- each format trains, and the log says what the loss was taken over ----------------------------------------

GBS, ITERS = 4, 3


def _expected(per_sample: list[int]) -> list[int]:
    """loss_tokens of each iteration: the samples it reads ([i*GBS, (i+1)*GBS), epochs repeating)."""
    return [sum(per_sample[(i * GBS + k) % len(per_sample)] for k in range(GBS)) for i in range(ITERS)]


@pytest.mark.slow
def test_each_format_trains_and_logs_the_tokens_its_loss_covers(chat_tok, pai_idxmap, texts, tmp_path):
    import zstandard
    from transformers import AutoTokenizer

    from megatron_patch.runtime.launch import run_local
    from megatron_patch.training.data_files import check_training_data
    from tests.sft_helpers import train_worker

    hf = AutoTokenizer.from_pretrained(chat_tok)

    def assistant_tokens(record) -> int:
        turns = next((t for rec, t in RECORDS if rec == record), None) or \
            [("user", record["instruction"] + record["input"]), ("assistant", record["output"])]
        return sum(chat_ids(hf, [{"role": r, "content": c} for r, c in turns], return_assistant_tokens_mask=True)[1])

    def per_row(sequences):
        return [sum(label != -100 for label in s[SEQ:]) for s in sequences]

    # Pretraining from a folder of .jsonl.zst files, through mpatch preprocess.
    (tmp_path / "zst").mkdir()
    for i in range(2):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[i * 100:(i + 1) * 100]).encode()
        (tmp_path / "zst" / f"0{i}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    assert main(["preprocess", "--input", str(tmp_path / "zst"), "--output-prefix", str(tmp_path / "corpus"),
                 "--load", str(chat_tok), "--json-keys", "text", "--quiet"]) == 0

    formats = {}  # name -> (DATASET_PATH, MP_* environment, loss_tokens per iteration)
    for name, kinds in (("instruction", [0, 1, 5]), ("query_response", [2]), ("query_content", [3]),
                        ("prompt_completion", [4]), ("messages", [6])):
        records = [RECORDS[k][0] for k in kinds]
        records = (records * GBS)[:GBS]
        write_jsonl(tmp_path / f"{name}.jsonl", records)
        formats[name] = (tmp_path / f"{name}.jsonl", {}, _expected([assistant_tokens(r) for r in records]))
    packs = [PAI_RECORDS[:2], PAI_RECORDS[2:3], PAI_RECORDS[3:]]
    write_jsonl(tmp_path / "packed.jsonl", packs)
    formats["pai_packed_json"] = (tmp_path / "packed.jsonl", {"MP_SFT_PACKING": "true"},
                                  _expected([sum(assistant_tokens(r) for r in p) for p in packs]))
    formats["pai_idxmap"] = (pai_idxmap["plain"], {}, _expected(per_row(pai_idxmap["plain_sequences"])))
    formats["pai_idxmap_packed"] = (pai_idxmap["packed"], {"MP_SFT_PACKING": "true"},
                                    _expected(per_row(pai_idxmap["packed_sequences"])))
    cfgs = []
    for name, (path, env, _) in formats.items():
        args = _sft_args(tmp_path / name, path, GLOBAL_BATCH_SIZE=str(GBS), TRAIN_TOKENS_OR_ITERS=str(ITERS),
                         WARMUP_TOKENS_OR_ITERS="1", LR="3e-3")
        cfgs.append(resolve("llama3_1", args, env={"MP_TOKENIZER": str(chat_tok), "MP_SAVE": "false", **env}))
    pretrain = launcher_args("llama3_1", DATASET_PATH=str(tmp_path / "corpus_text_document"), GLOBAL_BATCH_SIZE=str(GBS),
                             OUTPUT_BASEPATH=str(tmp_path / "pretrain" / "out"), TRAIN_TOKENS_OR_ITERS=str(ITERS * GBS * 64),
                             WARMUP_TOKENS_OR_ITERS=str(GBS * 64))
    cfgs.append(resolve("llama3_1", pretrain, env={"MP_SAVE": "false"}))
    formats["pretraining_zst"] = (None, {}, [GBS * 64] * ITERS)
    for cfg in cfgs:
        check_training_data(cfg)  # what the launcher does before any rank starts
    run_local(train_worker, 1, cfgs, timeout=900)
    for (name, (_, _, expected)), cfg in zip(formats.items(), cfgs):
        metrics = read_metrics(cfg.output_basepath)
        assert [m["loss_tokens"] for m in metrics] == expected, name
        assert metrics[-1]["loss"] < metrics[0]["loss"], (name, [m["loss"] for m in metrics])  # it learns


@pytest.mark.slow
def test_a_pai_sft_idxmap_trains_through_the_launcher(pai_idxmap, tmp_path):
    """The launcher as a Pai user runs it: SFT=true, an idxmap prefix, MP_SFT_PACKING=true, no MP_DATASET_TYPE."""
    from tests.training_helpers import launch

    args = _sft_args(tmp_path, pai_idxmap["packed"], GLOBAL_BATCH_SIZE="2", TRAIN_TOKENS_OR_ITERS="3",
                     WARMUP_TOKENS_OR_ITERS="1", LR="3e-3", SAVE_INTERVAL="100")
    proc = launch(args, {"MP_SFT_PACKING": "true"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"SFT data: Pai's SFT idxmap {pai_idxmap['packed']}: 2 samples of {SEQ} tokens" in proc.stdout
    rows = [sum(label != -100 for label in s[SEQ:]) for s in pai_idxmap["packed_sequences"]]
    assert [m["loss_tokens"] for m in read_metrics(tmp_path / "out")] == [sum(rows)] * 3
