"""Sigmoid routing with an expert bias, as DeepSeek-V3 (``topk_method: noaux_tc``), GLM-4.5 and MiniMax-M2 route.

Each expert's score is the sigmoid of its router logit. A bias per expert (``e_score_correction_bias``: a
buffer that training moves by the experts' load, never by a gradient; ``decoder.expert_bias_rule`` maps it) is
added only to choose the top-k, optionally among the best ``topk_group`` of ``n_group`` expert groups; the
chosen scores are renormalised and scaled by ``routed_scaling_factor``. megatron-core computes exactly this with
the settings below; what it would compute otherwise is refused in one line.
"""

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import require


def check_renormalised(raw: dict, norm: bool) -> None:
    """megatron-core renormalises the chosen sigmoid scores whatever it is told: a config that does not
    (``norm_topk_prob: false``, more than one expert chosen) is refused."""
    if not norm and require(raw, "num_experts_per_tok") > 1:
        raise UserError("norm_topk_prob=false with sigmoid routing cannot be built: megatron-core renormalises "
                        "the top-k sigmoid scores")


def expert_groups(raw: dict, top_per_group: int) -> tuple[int | None, int | None]:
    """config.json's ``n_group`` and ``topk_group`` as megatron-core's ``moe_router_num_groups`` and
    ``moe_router_group_topk`` (None, None: no groups). transformers scores a group by the sum of its best
    ``top_per_group`` experts, megatron-core by its best ``num_experts_per_tok // topk_group``: where the two
    differ, the config is refused."""
    topk = require(raw, "num_experts_per_tok")
    groups, group_topk = raw.get("n_group") or 1, raw.get("topk_group") or 1
    # transformers fails on either (a reshape into groups, a top-k over them), megatron-core too
    experts = require(raw, "n_routed_experts")
    if experts % groups:
        raise UserError(f"n_group={groups} does not split the {experts} routed experts (n_routed_experts) evenly")
    if group_topk > groups:
        raise UserError(f"topk_group={group_topk} chooses more groups than n_group={groups} makes")
    if groups <= 1:
        return None, None
    if topk > group_topk * (experts // groups):  # transformers' top-k over the groups' experts fails, megatron's too
        raise UserError(f"num_experts_per_tok={topk} experts cannot be chosen from the {group_topk * (experts // groups)} "
                        f"in topk_group={group_topk} of the n_group={groups} groups of {experts // groups} experts")
    if topk // group_topk != top_per_group:
        raise UserError(f"group-limited routing with num_experts_per_tok={topk}, topk_group={group_topk} scores "
                        f"groups differently in megatron-core (top {topk // group_topk}) than in transformers "
                        f"(top {top_per_group}): not supported")
    return groups, group_topk


def sigmoid_routing_kwargs(groups: tuple[int | None, int | None] = (None, None), scale: float = 1.0) -> dict:
    """The TransformerConfig settings of this routing, with ``expert_groups``' answer and the scaling factor."""
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
                moe_router_num_groups=groups[0], moe_router_group_topk=groups[1],
                moe_router_topk_scaling_factor=scale if scale != 1.0 else None)
