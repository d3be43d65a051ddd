"""The model side of an evaluation: token ids in, log-likelihoods and generated tokens out, on every rank.

Every rank of the job runs the same calls with the same requests, in lockstep (as in training, where every
rank runs the step): the pipeline's first stage embeds the tokens, activations pass between stages through
megatron-core's own schedule, and the last stage computes the answers. Those answers are then broadcast from
one rank of the last stage, so every rank returns the same ones and the harness above it sees one model.
Data-parallel replicas split each batch of requests between them (log-likelihoods and generations alike) and
gather the answers.

Under tensor parallelism the output layer's logits stay split over the vocabulary: the log-softmax and the
greedy choice are computed from the shards with three all-reduces of a number per token, never the whole
[batch, sequence, vocabulary] tensor. Vocabulary padding rows (Megatron pads the embedding to a multiple of
128 x TP) are never a candidate: their logits count as -inf.

Generation keeps megatron-core's ``StaticInferenceContext``, where every family's layers keep their state (an
attention layer its KV cache, a Gated DeltaNet layer its convolution inputs and recurrent state, DeepSeek sparse
attention its indexer's keys too, DeepSeek-V4's attention its window and compressed entries): the prompt is run
once, then each new token costs one token's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_patch.errors import UserError

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it, as in
# models/inference.py: `mpatch eval --help` and the harness module's registration start without it.


@dataclass(frozen=True)
class Sampling:
    """How a generation picks its tokens: greedy (``temperature`` 0) or sampled with top-k / top-p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class ModelRunner:
    """Log-likelihoods and generations of a built, loaded megatron-core GPT model (this rank's chunks).

    ``max_positions``: the longest sequence the model takes (its config's ``max_position_embeddings``);
    a longer request is refused in one line. ``kv_cache``: keep a KV cache while generating (False: run the
    whole sequence again for each token)."""

    def __init__(self, chunks: list, vocab_size: int, max_positions: int, *, kv_cache: bool = True,
                 padding_is_neutral: bool = True):
        from megatron.core import parallel_state as ps

        if len(chunks) != 1:
            raise UserError("evaluation runs a model without a virtual pipeline (one chunk per rank): "
                            f"this one has {len(chunks)} chunks per rank")
        from megatron.core.utils import get_attr_wrapped_model

        self.model = chunks[0]
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        # A model trained with sequence parallelism (the live model of MP_EVAL_TASKS) splits each sequence over
        # TP: a forward's length is padded to a multiple of TP (after the tokens: causal attention keeps it out),
        # and generation recomputes whole sequences, as a KV cache's one-token steps cannot be split.
        sequence_parallel = get_attr_wrapped_model(self.model, "config").sequence_parallel
        self.sequence_multiple = ps.get_tensor_model_parallel_world_size() if sequence_parallel else 1
        self.kv_cache = kv_cache and self.sequence_multiple == 1
        # False: a request's log-likelihood depends on the padding after it (DeepSeek sparse attention's indexer
        # here), so a batch holds requests of one length only.
        self.padding_is_neutral = padding_is_neutral
        self.device = next(self.model.parameters()).device
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.last_stage = ps.is_pipeline_last_stage()
        self.answer_rank = _answering_rank(self.last_stage and self.tp_rank == 0 and ps.get_data_parallel_rank() == 0,
                                           self.device)
        self._sample_calls = 0
        # Data-parallel replicas (extra ranks that EP makes in `mpatch eval`; training's DP) share the scoring.
        self.data_parallel_size = ps.get_data_parallel_world_size()
        self.data_parallel_rank = ps.get_data_parallel_rank()
        self.answers_here = self.last_stage and self.tp_rank == 0  # this replica's answers are held here
        self.replica_answer_ranks = _replica_answer_ranks(self.answers_here, self.data_parallel_rank,
                                                          self.data_parallel_size)

    # --- log-likelihoods ------------------------------------------------------------------------------

    def loglikelihoods(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether the continuation is the greedy one) for each pair of token
        lists, computed as one right-padded batch: padding follows every real token, so causal attention keeps
        it out of every log-likelihood (where it does not, one batch per length). Data-parallel replicas each
        score a contiguous share of the pairs, and every rank gets all the answers."""
        for context, continuation in pairs:  # every rank refuses, before replicas go their own ways
            if len(context) + len(continuation) - 1 > self.max_positions:
                raise UserError(f"a request of {len(context)} context + {len(continuation)} continuation tokens is "
                                f"longer than the model's {self.max_positions} positions: lower --num-fewshot or "
                                "evaluate a task with shorter documents")
        if not self.padding_is_neutral and len({len(c) + len(x) for c, x in pairs}) > 1:
            by_length: dict[int, list[int]] = {}
            for i, (context, continuation) in enumerate(pairs):
                by_length.setdefault(len(context) + len(continuation), []).append(i)
            answers: list = [None] * len(pairs)
            for indices in by_length.values():
                for i, answer in zip(indices, self.loglikelihoods([pairs[i] for i in indices])):
                    answers[i] = answer
            return answers
        if self.data_parallel_size > 1:
            return self._shared_over_replicas(pairs)
        return self._share_object(self._loglikelihoods_here(pairs))

    def _shared_over_replicas(self, pairs: list) -> list[tuple[float, bool]]:
        """Replica r scores pairs[len * r // DP : len * (r + 1) // DP]. A replica whose share is empty still runs
        one forward (of the first pair), since expert parallelism's all-to-alls need every rank of a step."""
        bounds = [len(pairs) * r // self.data_parallel_size for r in range(self.data_parallel_size + 1)]
        share = pairs[bounds[self.data_parallel_rank]:bounds[self.data_parallel_rank + 1]]
        answers = self._loglikelihoods_here(share or pairs[:1])
        mine = (self.data_parallel_rank, answers[:len(share)] if self.answers_here else None)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        by_replica = {replica: part for replica, part in gathered if part is not None}
        return [answer for replica in range(self.data_parallel_size) for answer in by_replica[replica]]

    def _loglikelihoods_here(self, pairs: list) -> list[tuple[float, bool]] | None:
        """This replica's answers to ``pairs`` on its last stage (None on the other stages)."""
        inputs, targets = [], []
        for context, continuation in pairs:
            whole = context + continuation
            inputs.append(whole[:-1])
            targets.append(whole[1:])
        # Requests whose inputs are the same tokens (the choices of a multiple-choice question, each one token
        # long, share their context) run once, as the HF backend groups them: their targets differ, not their logits.
        unique: dict[tuple[int, ...], int] = {}
        rows = [unique.setdefault(tuple(x), len(unique)) for x in inputs]
        width = max(len(x) for x in inputs)
        tokens = torch.tensor([list(x) + [0] * (width - len(x)) for x in unique], dtype=torch.long)
        target = torch.tensor([t + [0] * (width - len(t)) for t in targets], dtype=torch.long)
        answers = None
        logits = self._forward(tokens)
        if self.last_stage:
            if len(unique) < len(inputs):
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            logprob, greedy = self._token_logprobs(logits, target.to(logits.device))
            logprob, greedy = logprob.cpu().double(), greedy.cpu()
            answers = []
            for row, (context, continuation) in enumerate(pairs):
                end = len(context) + len(continuation) - 1
                span = slice(end - len(continuation), end)
                answers.append((float(logprob[row, span].sum()), bool(greedy[row, span].all())))
        return answers

    def _token_logprobs(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log_softmax(logits)[target] and whether target is the argmax, per token, from this rank's vocabulary
        shard [batch, seq, vocab / TP] (the first maximum wins a tie, as torch.argmax)."""
        logits = logits.float()
        part = logits.shape[-1]
        start = self.tp_rank * part
        ids = torch.arange(start, start + part, device=logits.device)
        logits = logits.masked_fill(ids >= self.vocab_size, float("-inf"))
        local_max, local_arg = logits.max(dim=-1)
        top = self._tp_reduce(local_max.clone(), dist.ReduceOp.MAX)
        sum_exp = self._tp_reduce(torch.exp(logits - top.unsqueeze(-1)).sum(dim=-1), dist.ReduceOp.SUM)
        mine = (target >= start) & (target < start + part)
        picked = logits.gather(-1, (target - start).clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
        picked = self._tp_reduce(torch.where(mine, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM)
        # the global argmax: the lowest vocabulary id among the shards that hold the maximum
        first = torch.where(local_max == top, local_arg + start, torch.full_like(local_arg, 2 ** 62))
        argmax = self._tp_reduce(first, dist.ReduceOp.MIN)
        return picked - top - torch.log(sum_exp), argmax == target

    # --- generation -----------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_ids: frozenset[int] = frozenset(), finished=None) -> list[list[int]]:
        """The tokens generated after each prompt (all of one length), at most ``max_new_tokens``. A sequence
        ends at a token of ``stop_ids`` (kept) or when ``finished(i, its tokens)`` says so; the batch ends when
        every sequence has. ``finished`` must answer alike on every rank (it sees the same tokens).

        Data-parallel replicas each generate a contiguous share of the prompts and every rank gets all the
        tokens. All replicas step together until the last of them is done (expert parallelism's all-to-alls
        need every rank in each forward). A sampled token is drawn per prompt, from a generator seeded by the
        prompt's place in the batch, so how the prompts are shared changes no draw."""
        lengths = {len(p) for p in prompts}
        if len(lengths) != 1:
            raise ValueError("a generation batch holds prompts of one length")
        length = lengths.pop()
        if length + max_new_tokens > self.max_positions:
            raise UserError(f"a prompt of {length} tokens plus max_gen_toks {max_new_tokens} is longer than the "
                            f"model's {self.max_positions} positions: lower --num-fewshot or the task's max_gen_toks")
        bounds = [len(prompts) * r // self.data_parallel_size for r in range(self.data_parallel_size + 1)]
        first = bounds[self.data_parallel_rank]
        share = prompts[first:bounds[self.data_parallel_rank + 1]]
        # a replica with no prompt runs the first one, unseen, to keep every forward's collectives whole
        mine = self._generate_share(share or prompts[:1], first, max_new_tokens, sampling, stop_ids,
                                    finished if share else None, counted=bool(share),
                                    widest=max(1, *(b - a for a, b in zip(bounds, bounds[1:]))))
        if self.data_parallel_size == 1:
            return mine
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.data_parallel_rank, mine[:len(share)] if self.answers_here else None))
        by_replica = {replica: part for replica, part in gathered if part is not None}
        return [tokens for replica in range(self.data_parallel_size) for tokens in by_replica[replica]]

    def _generate_share(self, prompts: list[list[int]], first_row: int, max_new_tokens: int, sampling: Sampling,
                        stop_ids: frozenset[int], finished, counted: bool, widest: int) -> list[list[int]]:
        """This replica's generations for ``prompts`` (rows ``first_row``.. of the whole batch). ``counted``
        False: a stand-in share, done from the start, that only keeps the replica stepping with the others.
        ``widest``: the most prompts any replica's share holds."""
        batch = len(prompts)
        sequences = torch.tensor(prompts, dtype=torch.long)
        generated: list[list[int]] = [[] for _ in prompts]
        done = [not counted] * batch
        context = self._inference_context(batch, sequences.shape[1] + max_new_tokens)
        step_input, offset = sequences, 0
        for _ in range(max_new_tokens):
            logits = self._last_logits(step_input, offset, context)
            chosen = self._choose(logits, sampling, first_row) if self.last_stage else None
            chosen, everyone_done = self._step_answers(chosen, batch, widest, generated, done, stop_ids, finished,
                                                       first_row)
            if everyone_done:
                break
            sequences = torch.cat([sequences, chosen.view(batch, 1)], dim=1)
            if context is not None:
                offset += step_input.shape[1]
                step_input = chosen.view(batch, 1)
            else:
                step_input = sequences
        return generated

    def _step_answers(self, chosen: torch.Tensor | None, batch: int, widest: int, generated: list, done: list,
                      stop_ids, finished, first_row: int) -> tuple[torch.Tensor, bool]:
        """This replica's chosen tokens on every one of its ranks, each sequence's tokens and ``done`` updated
        with them, and whether every replica is done. One collective a step: each replica's answering rank
        (its last stage's TP rank 0) sends its tokens and whether its replica is done; the others send nothing."""

        def take(tokens: list[int]) -> bool:
            for i, token in enumerate(tokens):
                if not done[i]:
                    generated[i].append(token)
                    done[i] = token in stop_ids or (finished is not None and finished(first_row + i, generated[i]))
            return all(done)

        if dist.get_world_size() == 1:
            return chosen.cpu(), take(chosen.tolist())
        if self.data_parallel_size == 1:  # one replica: the answering rank's tokens to every rank
            chosen = self._share_tensor(chosen, batch)
            return chosen, take(chosen.tolist())
        # [replica done, tokens...] from each answering rank, padded to the widest share; -1 from the others
        row = torch.full((1 + widest,), -1, dtype=torch.long)
        if self.answers_here:
            tokens = chosen.cpu().tolist()
            row[0], row[1:1 + batch] = int(take(tokens)), torch.tensor(tokens)
        rows = [torch.empty_like(row, device=self.device) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row.to(self.device))
        rows = [r.cpu() for r in rows]
        tokens = rows[self.replica_answer_ranks[self.data_parallel_rank]][1:1 + batch]
        if not self.answers_here:
            take(tokens.tolist())
        return tokens, all(int(rows[rank][0]) == 1 for rank in self.replica_answer_ranks)

    def _inference_context(self, batch: int, max_length: int):
        if not self.kv_cache:
            return None
        from megatron.core.inference.contexts import StaticInferenceContext

        return StaticInferenceContext(batch, max_length)

    def _choose(self, logits: torch.Tensor, sampling: Sampling, first_row: int = 0) -> torch.Tensor:
        """The next token of each sequence from its full-vocabulary logits [batch, vocab] (last stage only);
        row i is the batch's row ``first_row + i``."""
        logits = logits.float()
        if sampling.greedy:
            return logits.argmax(dim=-1)
        logits = logits / sampling.temperature
        if sampling.top_k > 0:
            kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if sampling.top_p < 1.0:
            order = torch.sort(logits, descending=True, dim=-1)
            cumulative = torch.softmax(order.values, dim=-1).cumsum(dim=-1)
            drop = cumulative - torch.softmax(order.values, dim=-1) > sampling.top_p  # keep the first token past p
            logits = logits.scatter(-1, order.indices, order.values.masked_fill(drop, float("-inf")))
        # One generator per row and call, seeded from the request's seed, the call count and the row's place in
        # the whole batch: a rerun draws the same, and so does another share of the batch between replicas.
        probs = torch.softmax(logits, dim=-1)
        calls, self._sample_calls = self._sample_calls, self._sample_calls + 1
        return torch.cat([torch.multinomial(probs[i], 1, generator=torch.Generator(device=logits.device).manual_seed(
            hash((sampling.seed, calls, first_row + i)) & (2 ** 63 - 1))) for i in range(probs.shape[0])])

    # --- the forward pass -----------------------------------------------------------------------------

    def _forward(self, tokens: torch.Tensor, offset: int = 0, context=None):
        """The last stage's output for ``tokens`` [batch, seq] at positions offset.. (None on other stages):
        without ``context``, this rank's vocabulary shard of every position's logits [batch, seq, vocab / TP];
        with one, the gathered logits of the last position [batch, 1, padded vocab]."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_patch.models.blocks.builder import pipeline_batch_factor  # deferred as megatron-core is

        batch, seq = tokens.shape
        tokens = tokens.to(self.device)
        if seq % self.sequence_multiple:
            tokens = torch.nn.functional.pad(tokens, (0, self.sequence_multiple - seq % self.sequence_multiple))
        positions = torch.arange(offset, offset + tokens.shape[1], device=self.device).unsqueeze(0).expand_as(tokens)
        captured: list[torch.Tensor] = []
        extra = {} if context is None else {"inference_context": context, "runtime_gather_output": True}

        def forward_step(data_iterator, model):
            output = model(tokens, positions, attention_mask=None, **extra)

            def keep(output_tensor, non_loss_data=False):
                captured.append(output_tensor)
                return output_tensor

            return output, keep

        self.model.eval()
        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([None]), model=[self.model], num_microbatches=1,
                seq_length=tokens.shape[1], micro_batch_size=batch * pipeline_batch_factor(self.model),
                forward_only=True, collect_non_loss_data=True)
        if context is not None:
            context.sequence_len_offset += seq
        return captured[0][:, :seq] if self.last_stage else None

    def _last_logits(self, tokens: torch.Tensor, offset: int, context) -> torch.Tensor | None:
        """Full-vocabulary logits [batch, vocab] of the last position (last stage; None elsewhere)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        out = self._forward(tokens, offset, context)
        if out is None:
            return None
        last = out[:, -1] if context is not None else gather_from_tensor_model_parallel_region(out[:, -1].contiguous())
        return last[..., :self.vocab_size]

    # --- collectives ----------------------------------------------------------------------------------

    def _tp_reduce(self, tensor: torch.Tensor, op) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(tensor, op=op, group=self.tp_group)
        return tensor

    def _share_object(self, obj):
        """``obj`` as the answering rank holds it, on every rank."""
        if dist.get_world_size() == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=self.answer_rank, device=self.device)
        return holder[0]

    def _share_tensor(self, tensor: torch.Tensor | None, batch: int) -> torch.Tensor:
        """The answering rank's token ids [batch], on every rank (on the host)."""
        if dist.get_world_size() == 1:
            return tensor.cpu()
        buffer = tensor.to(self.device) if dist.get_rank() == self.answer_rank else \
            torch.empty(batch, dtype=torch.long, device=self.device)
        dist.broadcast(buffer, src=self.answer_rank)
        return buffer.cpu()


def _replica_answer_ranks(answers_here: bool, replica: int, replicas: int) -> list[int]:
    """The global rank that holds each data-parallel replica's answers (its last stage's TP rank 0)."""
    if replicas == 1:
        return [0]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, replica if answers_here else None)
    return [gathered.index(r) for r in range(replicas)]


def _answering_rank(mine: bool, device: torch.device) -> int:
    """The lowest global rank that says ``mine`` (one of the last stage that holds every answer)."""
    world = dist.get_world_size()
    if world == 1:
        return 0
    rank = torch.tensor([dist.get_rank() if mine else world], device=device)
    dist.all_reduce(rank, op=dist.ReduceOp.MIN)
    return int(rank.item())
