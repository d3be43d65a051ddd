"""Full-vocabulary logits from a (tensor- and pipeline-parallel) MCore GPTModel."""

from __future__ import annotations

import torch

from megatron_patch.runtime import distributed
from megatron_patch.runtime.distributed import move_to_device

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process, the
# launcher's dry run and resume checks) do not pay for it.


def place_on_rank_device(model):
    """``model`` whole on this rank's device (the GPU where there is one), returned.

    megatron-core creates some tensors on the host whatever ``use_cpu_initialization`` says: the local
    spec's norms (torch's RMSNorm), the MoE router. A GPU forward then meets CPU weights.
    """
    move_to_device([model], distributed.device())
    return model


def forward_logits(model, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Logits [batch, seq, vocab_size] on the last pipeline stage, on the host (None on the others).

    Runs megatron-core's own pipeline schedule, gathers the vocabulary shards of TP ranks and drops
    the padding rows. Tokens and positions go to the model's device; the logits come back to the host
    (rank processes hand them on through a queue).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_patch.models.blocks.builder import pipeline_batch_factor  # deferred as megatron-core is

    device = next(model.parameters()).device
    batch, seq = tokens.shape
    tokens = tokens.to(device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    captured: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        output = model(tokens, positions, attention_mask=None)

        def keep(output_tensor, non_loss_data=False):
            captured.append(output_tensor)
            return output_tensor

        return output, keep

    model.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=seq, micro_batch_size=batch * pipeline_batch_factor(model), forward_only=True,
            collect_non_loss_data=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    logits = gather_from_tensor_model_parallel_region(captured[0])
    return logits[..., :vocab_size].float().cpu()
