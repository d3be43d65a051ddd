"""lm-evaluation-harness's model API over this project's megatron-core model: ``MpatchLM``, registered as "mpatch".

Tokenization, the empty-context rule, the rolling windows of ``loglikelihood_rolling``, the stop sequences and
the post-processing of generations are lm-eval's own (``TemplateLM`` and ``lm_eval.utils`` /
``lm_eval.models.utils``), called as its HF backend calls them, so that both score the same tokens; the model
side is ``runner.ModelRunner``. Every rank of a model-parallel job runs the harness with the same requests
(``rank`` 0, ``world_size`` 1 on each, lm-eval's convention under tensor-parallel launchers).

Importing this module needs lm-eval (the ``[eval]`` extra); nothing imports it but ``evaluation.evaluate``
and the CLI, so ``mpatch`` and the converter start without it.
"""

from __future__ import annotations

import os
import sys

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator, _add_special_kwargs, handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs,
    postprocess_generated_text)

from megatron_patch.errors import UserError
from megatron_patch.evaluation.loading import (
    end_of_text_id, generation_stop_ids, load_model, open_for_evaluation, padding_is_neutral, template_failure)
from megatron_patch.evaluation.runner import ModelRunner, Sampling
from megatron_patch.evaluation.tasks import unsupported_generation_settings

# megatron-core and the checkpoint loaders are imported inside the function that loads a checkpoint for lm-eval's
# `--model_args`: a harness over a live model (training, `mpatch eval`'s ranks) has them already.

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF backend's


@register_model("mpatch")
class MpatchLM(TemplateLM):
    """The harness's view of a megatron-core model: over a live ``ModelRunner`` and its HF tokenizer (training,
    ``mpatch eval``), or, built by lm-eval from ``--model_args``, over a checkpoint (``load_dir=...``) loaded in
    this process (``create_from_arg_string``)."""

    def __init__(self, runner: ModelRunner | None = None, tokenizer=None, batch_size: int | str = 1,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, model_stop_ids: frozenset[int] = frozenset(),
                 seed: int | None = None, progress_bars: bool = True, **model_args):
        super().__init__()
        if runner is None:
            runner, tokenizer, model_stop_ids = _runner_from_model_args(**model_args)
        elif model_args:
            raise TypeError(f"unexpected arguments beside a runner: {sorted(model_args)}")
        self.runner, self.tokenizer = runner, tokenizer
        self.progress_bars = progress_bars  # False: lm-eval's "Tokenizing inputs" bar is not drawn
        self._batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self._max_gen_toks = int(max_gen_toks)
        # sampled generation's seed: `mpatch eval --seed`; built by lm-eval from --model_args, the seed lm-eval gave
        # torch before building the model (its --seed), as the HF backend's sampling draws from torch's generator
        self._seed = int(seed) if seed is not None else torch.initial_seed() % 2 ** 63
        self._end_of_text = end_of_text_id(tokenizer)
        # model_stop_ids: the model's own (``loading.generation_stop_ids``), what the HF backend stops at
        self.stop_ids = frozenset(_eos_ids(tokenizer) | {self._end_of_text} | set(model_stop_ids))
        self._system_dropped_said = False

    # --- what the harness asks of a model ---------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._end_of_text

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self._end_of_text

    @property
    def max_length(self) -> int:
        return self.runner.max_positions

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kwargs):
        kwargs = _add_special_kwargs(add_special_tokens, None)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kwargs["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **kwargs)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template over ``chat_history``; where it refuses a system message (Mistral-Instruct's,
        Gemma 2's), without it, as the HF backend does (it was an internal error in every rank: the eval audit)."""
        def render(history):
            return self.tokenizer.apply_chat_template(history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)

        # a template's own failure is any exception its expressions raise in jinja's sandbox ({{ 1 / 0 }}), not only
        # a TemplateError: each was an internal error in every rank (the hostile audit)
        try:
            return render(chat_history)
        except Exception as exc:  # noqa: BLE001
            refused = exc
        without = [message for message in chat_history if message["role"] != "system"]
        try:
            text = render(without) if len(without) < len(chat_history) else None
        except Exception as exc:  # noqa: BLE001
            refused, text = exc, None
        if text is None:
            raise UserError(f"the tokenizer's chat template fails on this task's prompts ({template_failure(refused)}): "
                            "evaluate without --apply-chat-template or fix the template") from None
        first_rank = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if not self._system_dropped_said and first_rank:
            print(f"warning: the tokenizer's chat template refuses a system message ({refused}): the task's "
                  "description is left out of its prompts, as lm-eval's HF backend does", file=sys.stderr, flush=True)
        self._system_dropped_said = True
        return text

    # --- scoring ----------------------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress_bars)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(log-likelihood, is_greedy) per (key, context ids, continuation ids), in batches of similar length
        (longest first, as the HF backend orders them)."""
        ordered = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        answers = []
        # A batch per data-parallel replica: the runner gives each its share of the chunk.
        size = (override_bs or self.batch_size) * self.runner.data_parallel_size
        for chunk in _batches_of_distinct_inputs(next(ordered.get_batched(n=0), []), size):
            scored = self.runner.loglikelihoods([(context, continuation) for _, context, continuation in chunk])
            for (key, _, _), answer in zip(chunk, scored):
                answers.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return ordered.get_original(answers)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over the harness's disjoint windows of the model's length (the first
        window after the prefix token)."""
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=True)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation -------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation up to its first stop sequence. Requests are grouped by their gen_kwargs
        and batched by prompt length (longest first); a batch holds prompts of one length, so no padding
        enters a generation."""
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        encoded = [(self.tok_encode(context), context, kwargs) for context, kwargs in (r.args for r in requests)]
        ordered = Collator(encoded, sort_fn=lambda r: (-len(r[0]), r[1]), group_by="gen_kwargs",
                           group_fn=lambda r: r[2])
        answers = []
        # a batch per data-parallel replica, as for log-likelihoods: the runner gives each its share
        for chunk in ordered.get_batched(n=self.batch_size * self.runner.data_parallel_size):
            for batch in _same_length_runs(chunk):
                answers.extend(self._generate_batch(batch, eos))
        return ordered.get_original(answers)

    def _generate_batch(self, batch, eos: str) -> list[str]:
        unsupported = unsupported_generation_settings(batch[0][2])
        if unsupported:  # refused before the ranks start (tasks.check_generation_settings); never dropped silently
            raise UserError(f"generation settings {', '.join(unsupported)} are not supported by mpatch eval")
        kwargs = normalize_gen_kwargs(batch[0][2], self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_new = int(kwargs.pop("max_gen_toks"))
        sampling = Sampling(temperature=float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0,
                            top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0),
                            seed=int(kwargs.get("seed", self._seed)))
        stops = [s for s in until if s]

        def finished(_, tokens) -> bool:
            text = self.tokenizer.decode(tokens)
            return any(s in text for s in stops)

        generated = self.runner.generate([ids for ids, _, _ in batch], max_new, sampling, self.stop_ids, finished)
        texts = []
        for (_, context, gen_kwargs), tokens in zip(batch, generated):
            text = postprocess_generated_text(self.tok_decode(tokens), stop=until, think_end_token=None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            texts.append(text)
        return texts

    # --- lm-eval's ``--model_args`` ----------------------------------------------------------------------

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        args = lm_utils.simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k in ("batch_size",)}
        return cls(**args, **extra)


def _batches_of_distinct_inputs(ordered: list, size: int):
    """``ordered`` (key, context, continuation) requests cut into batches of ``size`` distinct model inputs: the
    runner runs requests that share their input once, so a batch holds up to ``size`` of them each (the HF backend
    batches a multiple-choice question's one-token choices as one row too)."""
    batch: list = []
    inputs: set = set()
    for request in ordered:
        given = tuple(request[1] + request[2])[:-1]
        if given not in inputs and len(inputs) == size:
            yield batch
            batch, inputs = [], set()
        batch.append(request)
        inputs.add(given)
    if batch:
        yield batch


def _same_length_runs(chunk):
    """The chunk (sorted by length) cut where the prompt length changes."""
    runs: list[list] = []
    for item in chunk:
        if runs and len(runs[-1][0][0]) == len(item[0]):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _eos_ids(tokenizer) -> set[int]:
    """The ids that end a generation: the tokenizer's end of sequence, and those the generation_config.json of its
    folder names (what transformers' generate stops at for the HF backend), read as the model's are."""
    return ({tokenizer.eos_token_id} - {None}) | generation_stop_ids(None, tokenizer.name_or_path)


def _runner_from_model_args(load_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                            dtype: str = "fp32", tokenizer: str | None = None, hf_config: str | None = None,
                            kv_cache: bool = True, verify: bool = True):
    """The runner, tokenizer and model's stop ids lm-eval's ``--model mpatch --model_args load_dir=...`` asks for, in
    this process:
    it must be one rank of a job of the layout's size (torchrun), or alone for a layout of one process."""
    # megatron-core: imported only when lm-eval builds the model
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.runtime.distributed import ParallelLayout

    layout = ParallelLayout(tp=int(tp), pp=int(pp), ep=int(ep), etp=None if etp is None else int(etp))
    checkpoint = open_for_evaluation(load_dir, layout, tokenizer, hf_config, verify=_flag(verify))
    layout = checkpoint.layout  # hf2mcore's default ETP where none was given
    if os.environ.get("RANK", "0") == "0":  # one rank says it, as `mpatch eval` does
        for note in checkpoint.notes:
            print(f"warning: {note}", file=sys.stderr, flush=True)
    init_model_parallel(layout)
    chunks = load_model(checkpoint, layout, dtype)
    runner = ModelRunner(chunks, checkpoint.arch.vocab_size, checkpoint.arch.max_position_embeddings,
                         kv_cache=_flag(kv_cache),
                         padding_is_neutral=padding_is_neutral(checkpoint.arch))
    return (runner, checkpoint.load_tokenizer(),
            generation_stop_ids(checkpoint.model_config, checkpoint.model_dir))


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
