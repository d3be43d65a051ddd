"""Equality with lm-eval's own HF backend (docs/evaluation.md): the same tasks run by ``--model hf`` on the HF folder
of the same weights, in fp32 on the CPU, compared request by request.

- every log-likelihood (a choice, a continuation, a rolling document) within ``rel_tol`` (fp32 noise: the two
  models sum their matmuls in different orders, and their batches are padded differently);
- the same ``is_greedy`` for every continuation;
- the same generated text for every greedy generation;
- identical task metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_patch.evaluation import tasks as task_files
from megatron_patch.evaluation.evaluate import EvalResults, EvalSettings, _to_json
from megatron_patch.input_files import check_folder_inputs

# lm-eval, torch and transformers are imported inside the functions that use them, like the rest of the package.

REL_TOL = 1e-5


def evaluate_hf_backend(hf_dir: str, settings: EvalSettings, include_paths: list[str],
                        softmax_dtype: str | None = None) -> EvalResults:
    """lm-eval's HF backend (``--model hf``, pretrained=hf_dir, dtype=float32, CPU) on ``settings``'s tasks, in
    this process. ``softmax_dtype``: the backend's own option for its log-softmax ("float64": the exact
    log-likelihoods of its fp32 logits; its fp32 default where None)."""
    from lm_eval import simple_evaluate

    check_folder_inputs(hf_dir)  # lm-eval's backend opens the folder's files itself, through transformers
    task_files.offline()
    model_args = f"pretrained={hf_dir},dtype=float32,device=cpu"
    if softmax_dtype:
        model_args += f",softmax_dtype={softmax_dtype}"
    results = simple_evaluate(
        model="hf", model_args=model_args, tasks=list(settings.tasks),
        task_manager=task_files.task_manager(include_paths, list(settings.tasks)), limit=settings.limit,
        num_fewshot=settings.num_fewshot, log_samples=True, batch_size=settings.batch_size,
        apply_chat_template=settings.apply_chat_template, fewshot_as_multiturn=settings.fewshot_as_multiturn,
        random_seed=settings.seed, numpy_random_seed=settings.seed, torch_random_seed=settings.seed,
        fewshot_random_seed=settings.seed, verbosity="WARNING", bootstrap_iters=0,
        gen_kwargs=None, **settings.extra)
    return _to_json(results)


@dataclass
class Comparison:
    """How the two backends' answers compare, request by request."""

    requests: int = 0
    worst_rel: float = 0.0          # the largest relative difference of a log-likelihood
    differences: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differences

    def __str__(self) -> str:
        verdict = "equal" if self.equal else f"{len(self.differences)} differences, e.g. {self.differences[:3]}"
        return f"{self.requests} requests, worst relative log-likelihood difference {self.worst_rel:.2e}: {verdict}"


def compare(ours: EvalResults, theirs: EvalResults, rel_tol: float = REL_TOL) -> Comparison:
    """Request-by-request comparison of two evaluations of the same tasks with samples logged."""
    out = Comparison()
    for task in sorted(set(ours.samples) | set(theirs.samples)):
        mine = {s["doc_id"]: s for s in ours.samples.get(task, [])}
        other = {s["doc_id"]: s for s in theirs.samples.get(task, [])}
        if set(mine) != set(other):
            out.differences.append(f"{task}: documents {sorted(set(mine) ^ set(other))[:5]} in one only")
            continue
        for doc_id in sorted(mine):
            for index, (a, b) in enumerate(zip(mine[doc_id]["resps"], other[doc_id]["resps"])):
                out.requests += 1
                _compare_answer(out, f"{task} doc {doc_id} request {index}", a[0], b[0], rel_tol)
    for task, metrics in theirs.results.get("results", {}).items():
        for key, value in metrics.items():
            if "_stderr" in key or key == "alias":
                continue
            got = ours.results.get("results", {}).get(task, {}).get(key)
            if got != value and not (isinstance(got, float) and isinstance(value, float)
                                     and math.isclose(got, value, rel_tol=rel_tol)):
                out.differences.append(f"{task} {key}: {got} vs HF {value}")
    return out


def _compare_answer(out: Comparison, where: str, a, b, rel_tol: float) -> None:
    if isinstance(a, str) or isinstance(b, str):  # a generation
        if a != b:
            out.differences.append(f"{where}: generated {a!r} vs HF {b!r}")
        return
    (ll_a, greedy_a), (ll_b, greedy_b) = (a if isinstance(a, list) else [a, None]), \
        (b if isinstance(b, list) else [b, None])
    rel = abs(float(ll_a) - float(ll_b)) / max(abs(float(ll_b)), 1e-30)
    out.worst_rel = max(out.worst_rel, rel)
    if rel > rel_tol:
        out.differences.append(f"{where}: log-likelihood {ll_a} vs HF {ll_b} (relative {rel:.1e})")
    if greedy_a != greedy_b:
        out.differences.append(f"{where}: is_greedy {greedy_a} vs HF {greedy_b}")
