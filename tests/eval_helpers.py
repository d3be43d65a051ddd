"""Helpers of the evaluation tests: the rank workers (run_local needs importable functions) and the settings the
equality tests share."""

from __future__ import annotations

from megatron_patch.errors import UserError
from megatron_patch.evaluation.evaluate import EvalSettings, run_harness
from megatron_patch.evaluation.loading import load_model, padding_is_neutral
from megatron_patch.evaluation.runner import ModelRunner
from megatron_patch.evaluation.tasks import PROJECT_TASKS, offline
from megatron_patch.runtime import init_model_parallel
from megatron_patch.runtime.distributed import ParallelLayout

# Every shipped task (rolling perplexity, multiple choice, greedy generation), a few documents each.
SETTINGS = EvalSettings(tasks=PROJECT_TASKS, limit=4, batch_size=3, log_samples=True)
# Prompts of one length for the KV cache check: a batch of two, and one alone.
CACHE_PROMPTS = ([[5, 17, 33, 8, 90, 61, 12, 4], [44, 3, 150, 27, 9, 71, 18, 100]], [[7, 7, 120, 3, 66]])


def evaluate_worker(checkpoints: list, layout, include_paths: list[str], settings: EvalSettings = SETTINGS) -> list:
    """Runs on every rank: for each checkpoint, the harness's results (rank 0; None elsewhere), the greedy tokens
    generated with and without the KV cache, and the refusal of a request
    longer than the model's positions."""
    offline()
    init_model_parallel(layout)
    out = []
    for checkpoint in checkpoints:
        chunks = load_model(checkpoint, layout)
        arch = checkpoint.arch
        runner = ModelRunner(chunks, arch.vocab_size, arch.max_position_embeddings,
                             padding_is_neutral=padding_is_neutral(arch))
        tokenizer = checkpoint.load_tokenizer()
        results = run_harness(runner, tokenizer, settings, include_paths)
        without = ModelRunner(chunks, arch.vocab_size, arch.max_position_embeddings, kv_cache=False,
                              padding_is_neutral=padding_is_neutral(arch))
        tokens = [(runner.generate(p, 12), without.generate(p, 12)) for p in CACHE_PROMPTS]
        try:
            runner.loglikelihoods([([1] * arch.max_position_embeddings, [2, 3])])
            too_long = None
        except UserError as exc:
            too_long = str(exc)
        out.append({"results": results, "cache": tokens, "too_long": too_long})
        del chunks, runner
    return out


def _counting_replica(checkpoint) -> tuple[ModelRunner, list[int]]:
    """A runner of ``checkpoint`` on this rank of a world of TP=1 PP=1 (its ranks are data-parallel replicas), and
    the batch sizes its model forwards, appended as it runs."""
    init_model_parallel(ParallelLayout())
    arch = checkpoint.arch
    runner = ModelRunner(load_model(checkpoint, ParallelLayout()), arch.vocab_size, arch.max_position_embeddings)
    rows, forward = [], runner._forward

    def counting_forward(tokens, *args, **kwargs):
        rows.append(int(tokens.shape[0]))
        return forward(tokens, *args, **kwargs)

    runner._forward = counting_forward
    return runner, rows


def shared_scoring_worker(checkpoint, pairs: list) -> dict:
    """Runs on every rank of a world of data-parallel replicas: the answers to ``pairs``, and the rows this rank's
    model forwarded."""
    runner, rows = _counting_replica(checkpoint)
    answers = runner.loglikelihoods(pairs)
    try:
        runner.loglikelihoods([pairs[0], ([1] * checkpoint.arch.max_position_embeddings, [2, 3])])
        too_long = None
    except UserError as exc:
        too_long = str(exc)
    return {"answers": answers, "rows": rows, "too_long": too_long}


def shared_generation_worker(checkpoint, prompts: list, max_new: int) -> dict:
    """Runs on every rank of a world of data-parallel replicas: greedy and sampled generations of ``prompts``, the
    first prompt's stopped after two tokens by ``finished``, and the batch sizes this rank's model forwarded."""
    from megatron_patch.evaluation.runner import Sampling

    runner, rows = _counting_replica(checkpoint)
    greedy = runner.generate(prompts, max_new, finished=lambda i, tokens: i == 0 and len(tokens) == 2)
    sampled = [runner.generate(prompts, max_new, Sampling(temperature=1.5, top_k=50, seed=seed)) for seed in (1, 2)]
    return {"greedy": greedy, "sampled": sampled, "rows": rows}


def generation_state_worker(arch, layout, tokens: list[list[int]], prompt: int, max_new: int) -> dict:
    """Runs on every rank: ``arch``'s model, initialised at random, at ``layout``. Returns the logits of every
    position of ``tokens`` from one whole forward ("whole"), and the last position's logits of each forward of a
    generation that keeps the runner's inference context ("cached"): the first ``prompt`` tokens, then one at a
    time (megatron-core's attention continues one token at a time only). Then the tokens each layer's attention saw in each forward of the runner's
    generation of ``max_new`` tokens after the first prompt ("seen": layer number -> lengths)."""
    import torch

    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.blocks.inference import forward_logits, place_on_rank_device

    init_model_parallel(layout)
    model = place_on_rank_device(build_model(arch, layout, torch.float32))
    runner = ModelRunner([model], arch.vocab_size, arch.max_position_embeddings)
    ids = torch.tensor(tokens)
    whole = forward_logits(model, ids, arch.vocab_size)
    context = runner._inference_context(ids.shape[0], ids.shape[1])
    ends = range(prompt, ids.shape[1] + 1)
    cached = []
    for start, end in zip([0, *ends], ends):
        last = runner._last_logits(ids[:, start:end], start, context)
        cached.append((end, None if last is None else last.cpu()))
    seen: dict[int, list[int]] = {}
    for layer in model.decoder.layers:
        def record(module, args, kwargs, number=layer.layer_number):
            hidden = args[0] if args else kwargs["hidden_states"]
            seen.setdefault(number, []).append(int(hidden.shape[0]))
        layer.self_attention.register_forward_pre_hook(record, with_kwargs=True)
    runner.generate([tokens[0][:prompt]], max_new)
    return {"whole": whole, "cached": cached, "seen": seen}


def check_generation_continues(arch, tp: int, tokens: list[list[int]], prompt: int, max_new: int = 5) -> None:
    """``generation_state_worker`` at TP=``tp``: each forward of a cached generation gives the last position's logits
    of one whole forward within float32 noise, and every layer sees the prompt once, then one token per step."""
    from megatron_patch.runtime.distributed import ParallelLayout
    from megatron_patch.runtime.launch import run_local

    for rank in run_local(generation_state_worker, tp, arch, ParallelLayout(tp=tp), tokens, prompt, max_new):
        whole = rank["whole"]
        assert [end for end, _ in rank["cached"]] == list(range(prompt, len(tokens[0]) + 1))
        for end, last in rank["cached"]:
            expected = whole[:, end - 1]
            assert (last - expected).abs().max() <= 1e-5 * expected.abs().max(), end
        assert rank["seen"] == {n: [prompt] + [1] * (max_new - 1) for n in range(1, arch.num_layers + 1)}
