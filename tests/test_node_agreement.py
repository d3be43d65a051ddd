"""Every node of a job runs the same launcher line (training/node_agreement.py; docs/training.md, "Multi-node and
failures"): the multi-node audit found a node given another LR or PR trained silently (each data-parallel replica
with its own), another TP waited out MP_DIST_TIMEOUT_MIN blaming the network, and the same data reached through a
link, or a node whose OUTPUT_BASEPATH is not the shared one, died in an internal error. Two ranks of one machine stand
for two nodes here (each resolves its own line)."""

from __future__ import annotations

import os

import pytest

from megatron_patch.errors import UserError
from megatron_patch.runtime.launch import run_local
from tests.training_helpers import (launcher_args, node_complete_worker, node_data_worker, node_refusing_worker,
                                    node_settings_worker, node_sizes_worker)

pytestmark = pytest.mark.slow  # two rank processes each


def _line(corpus, out, **over) -> list[str]:
    return launcher_args("llama3_1", **{"DATASET_PATH": corpus["prefix"], "OUTPUT_BASEPATH": str(out), **over})


@pytest.mark.parametrize("option, given, said", [
    ("LR", "1e-3", "LR is 0.003 on rank 0"),
    ("TP", "2", "TP is 1 on rank 0"),
    ("PR", "bf16", "PR is 'fp32' on rank 0"),
])
def test_nodes_given_different_lines_are_refused_naming_the_option(corpus, tmp_path, option, given, said):
    line = _line(corpus, tmp_path / "out", LR="3e-3")
    other = _line(corpus, tmp_path / "out", **{"LR": "3e-3", option: given})
    with pytest.raises(UserError) as refused:
        run_local(node_settings_worker, 2, [(line, {}, tmp_path), (other, {}, tmp_path)])
    assert str(refused.value).startswith(f"the nodes were not given the same launcher line: {said}"), refused.value
    assert str(refused.value).endswith("on rank 1 (" + os.uname().nodename + "): run the same line, with the same "
                                       "environment options, on every node")


def test_the_same_data_through_a_link_or_a_relative_path_is_taken_as_rank_0_spells_it(corpus, tmp_path):
    """megatron-core names its data cache after the path's spelling: a node reaching the data through a link looked for
    a cache rank 0 never built. A relative spelling is rank 0's folder's, so every rank takes it made absolute (the
    audit of this change: rank 1 took rank 0's relative path in its own folder)."""
    data = os.path.dirname(corpus["prefix"])
    link = tmp_path / "linked"
    link.symlink_to(data)
    linked = str(link / os.path.basename(corpus["prefix"]))
    spelled = run_local(node_settings_worker, 2, [(_line(corpus, tmp_path / "out"), {}, tmp_path),
                                                 (_line(corpus, tmp_path / "out", DATASET_PATH=linked), {}, tmp_path)])
    assert [s["dataset_path"] for s in spelled] == [[str(corpus["prefix"])]] * 2
    relative = _line(corpus, "out", DATASET_PATH=os.path.basename(corpus["prefix"]))
    spelled = run_local(node_settings_worker, 2, [(relative, {}, data),
                                                 (_line(corpus, os.path.join(data, "out")), {}, tmp_path)])
    assert [(s["dataset_path"], s["output_basepath"]) for s in spelled] == \
        [([str(corpus["prefix"])], os.path.join(data, "out"))] * 2


def test_a_lora_start_through_a_link_agrees(corpus, tmp_path):
    """MP_LORA_INIT (a peft folder) was compared as text, and named by its field."""
    from megatron_patch.cli import main
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from tests.lora_helpers import make_peft_adapter

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf", seed=1)
    make_peft_adapter(hf, tmp_path / "peft")
    (tmp_path / "link").symlink_to(tmp_path / "peft")
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "ckpt"), "--quiet"]) == 0
    line = _line(corpus, tmp_path / "out", PRETRAIN_CHECKPOINT_PATH=str(tmp_path / "ckpt"), MODEL_SIZE="auto")
    spelled = run_local(node_settings_worker, 2, [(line, {"MP_LORA_INIT": str(tmp_path / "peft")}, tmp_path),
                                                 (line, {"MP_LORA_INIT": str(tmp_path / "link")}, tmp_path)])
    assert [s["lora_init"] for s in spelled] == [str(tmp_path / "peft")] * 2


def test_a_node_that_does_not_see_the_shared_output_folder_is_told_so(corpus, tmp_path):
    """A node whose OUTPUT_BASEPATH is another folder (its own disk) does not find the data cache rank 0 built."""
    with pytest.raises(UserError) as refused:
        run_local(node_data_worker, 2, [_line(corpus, tmp_path / "shared"), _line(corpus, tmp_path / "own")])
    assert str(refused.value).startswith(f"rank 1 does not find the data cache rank 0 built in {tmp_path / 'own'}")
    assert str(refused.value).endswith("every node must see OUTPUT_BASEPATH on one shared filesystem")


def test_a_node_that_refuses_its_line_makes_every_node_refuse(corpus, tmp_path):
    """A node refusing its own line before the job forms (another GPUS_PER_NODE: WORLD_SIZE=3 does not fill its nodes
    of 2) left the others waiting until MP_DIST_TIMEOUT_MIN, then blaming the network (the audit on Python 3.12): it
    joins for the comparison and says why, and every rank refuses with its line."""
    refusal = "WORLD_SIZE=3 processes do not fill nodes of 2: check GPUS_PER_NODE"
    with pytest.raises(UserError) as refused:
        run_local(node_refusing_worker, 2, _line(corpus, tmp_path / "out"), refusal)
    assert str(refused.value) == f"rank 1 ({os.uname().nodename}) refused its node's launcher line: {refusal}"


def test_a_node_whose_run_is_complete_compares_its_line_with_the_others(corpus, tmp_path):
    """A node that found its run complete (its line the old one, another node's extended) exited 0 at once; the other
    waited for it until MP_DIST_TIMEOUT_MIN and blamed the rendezvous (the fail audit). It joins for the comparison:
    a difference is refused on every node naming the option; the same line ends with the job."""
    longer = _line(corpus, tmp_path / "out", TRAIN_TOKENS_OR_ITERS=str(6 * 8 * 64))
    shorter = _line(corpus, tmp_path / "out", TRAIN_TOKENS_OR_ITERS=str(4 * 8 * 64))
    with pytest.raises(UserError, match=r"^the nodes were not given the same launcher line: TRAIN_TOKENS_OR_ITERS is "
                                        r"6 on rank 0 .* and 4 on rank 1"):
        run_local(node_complete_worker, 2, [longer, shorter])
    assert run_local(node_complete_worker, 2, [shorter, shorter]) == [4, 0]


def test_a_rank_refusal_is_read_from_the_agents_error_files(tmp_path):
    """What the joining launcher of a complete node says: its rank's one line, from torchrun's error file."""
    import json

    from megatron_patch.runtime.launch import refusal_reported

    assert refusal_reported(tmp_path) is None
    folder = tmp_path / "run" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    (folder / "error.json").write_text(json.dumps({"message": {"message": "TRAIN_TOKENS_OR_ITERS differs",
                                                               "extraInfo": {"mpatch_kind": "user"}}}))
    assert refusal_reported(tmp_path) == "TRAIN_TOKENS_OR_ITERS differs"


def test_nodes_of_other_sizes_are_told_so_on_every_node():
    """Node 1 started with GPUS_PER_NODE=2 beside node 0's 1: node 1 said its world did not fill nodes of 2, and
    node 0 refused GLOBAL_BATCH_SIZE for a data-parallel size of 3, an option both nodes share (the mn audit)."""
    said = run_local(node_sizes_worker, 2, [1, 2])
    host = os.uname().nodename
    assert said == [f"the nodes were not given the same launcher line: GPUS_PER_NODE is 1 on rank 0 ({host}) and 2 on "
                    f"rank 1 ({host}): run the same line, with the same environment options, on every node"] * 2
    assert run_local(node_sizes_worker, 2, [2, 2]) == [None, None]  # each then says its own line


def test_a_model_that_differs_names_the_keys_it_differs_in(corpus, tmp_path):
    """MP_NUM_LAYERS on one node only was refused as "the model's config.json (of MODEL_SIZE or
    PRETRAIN_CHECKPOINT_PATH) differs", naming neither the option nor the key (the mn audit)."""
    line = _line(corpus, tmp_path / "out")
    with pytest.raises(UserError) as refused:
        run_local(node_settings_worker, 2, [(line, {}, tmp_path), (line, {"MP_NUM_LAYERS": "1"}, tmp_path)])
    assert "MP_NUM_LAYERS) differs between rank 0" in str(refused.value), refused.value
    assert ": num_hidden_layers 4 and 1: run the same line" in str(refused.value), refused.value
