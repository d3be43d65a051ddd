"""Checkpoints this project did not write: exported to HF, inspected, aligned, refused when wrong.

The fixtures (tests/foreign_checkpoints.py) are written with megatron-core's own dist_checkpointing
and torch.save in the layouts of Megatron-LM (torch_dist with TP=2 and a vocabulary padded to 512
rows, legacy with TE names at PP=2), Pai-Megatron-Patch (legacy release at TP=2, local names) and
Megatron-Bridge (torch_dist without Megatron-LM args or common.pt), each from one tiny random Llama: an
export must give back its HF tensors bit for bit. So must this project's own checkpoints of models whose
layers megatron-core stores one key each (dense first layers, mlp_only_layers, hybrid or gated attention)
with their sidecar deleted.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron_patch.checkpoint.arch_source import check_architecture, open_checkpoint
from megatron_patch.checkpoint.foreign import find_checkpoint
from megatron_patch.convert.checkpoint import hf_to_mcore
from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import parse_arch
from megatron_patch.runtime.distributed import ParallelLayout
from tests import foreign_checkpoints as fc
from tests.convert_helpers import leftovers, run_cli


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("foreign")
    hf = make_tiny_hf_checkpoint("llama3_1", root / "hf", seed=2)
    mlm = fc.megatron_lm_torch_dist(hf, root / "megatron_lm", tp=2, padded=512)
    return {"hf": hf, "want": fc.hf_tensors(hf), "megatron_lm": mlm,
            "legacy": fc.megatron_lm_legacy(hf, root / "megatron_lm_legacy", pp=2, te_names=True),
            "pai": fc.pai_megatron_patch_legacy(hf, root / "pai", tp=2),
            "bridge": fc.megatron_bridge_torch_dist(hf, root / "bridge", tp=2, padded=512)}


def _export(capsys, load, out, *extra) -> tuple[int, str]:
    return run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(load), "--save-dir", str(out), "--quiet", *extra)


def _same_tensors(folder, want) -> list[str]:
    got = fc.hf_tensors(folder)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return [k for k in want if not torch.equal(got[k], want[k])]


# --- export: every layout, every architecture source -----------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,source", [("megatron_lm", "hf_config"), ("legacy", "hf_config"),
                                         ("pai", "config_beside"), ("bridge", "hf_config")])
def test_export_gives_back_the_hf_tensors(ckpts, name, source, tmp_path, capsys):
    hf_config = ckpts["pai"] / "config.json" if source == "config_beside" else ckpts["hf"]
    rc, err = _export(capsys, ckpts[name], tmp_path / "hf", "--hf-config", str(hf_config))
    assert rc == 0, err
    assert _same_tensors(tmp_path / "hf", ckpts["want"]) == []  # padding rows dropped, optimizer skipped
    assert parse_arch(tmp_path / "hf") == parse_arch(ckpts["hf"])  # every number of the model, RoPE included


@pytest.mark.slow
def test_export_from_saved_megatron_lm_arguments(ckpts, tmp_path, capsys):
    """No config at all: the args in megatron's common state (torch_dist) or in the rank files (legacy) as --family llama3_1."""
    for name in ("megatron_lm", "pai"):
        rc, err = _export(capsys, ckpts[name], tmp_path / name, "--family", "llama3_1")
        assert rc == 0, err
        assert _same_tensors(tmp_path / name, ckpts["want"]) == []
        got, original = parse_arch(tmp_path / name), parse_arch(ckpts["hf"])
        # --use-rope-scaling records only the factor: megatron-core's other llama3 values are what it trained with.
        assert got.rope_scaling == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        assert dataclasses.replace(got, rope_scaling=original.rope_scaling) == original


@pytest.mark.slow
def test_without_an_architecture_source_one_line_says_what_to_give(ckpts, tmp_path, capsys):
    for name, wanted in (("megatron_lm", "--family NAME"), ("bridge", "--hf-config PATH"),
                         ("pai", "config.json lies beside the weights")):
        rc, err = _export(capsys, ckpts[name], tmp_path / name)
        assert rc == 2 and err.count("\n") == 1 and wanted in err, err
        assert not (tmp_path / name).exists() and not leftovers(tmp_path / name)


# --- disagreements are named -----------------------------------------------------------------------

def _config(ckpts, **changes) -> dict:
    return {**fc.read_config(ckpts["hf"]), **changes}


@pytest.mark.slow
@pytest.mark.parametrize("changes,named", [
    ({"hidden_size": 128}, "hidden size: config 128, tensors 64"),
    ({"num_attention_heads": 8}, "attention heads: config 8 x head dim 16 = 128, tensors 64 (4 heads)"),
    ({"num_key_value_heads": 4}, "query groups: config 4 (key/value rows 128), tensors 64 rows (2 groups)"),
    ({"num_hidden_layers": 6}, "layers: config 6, tensors 4"),
    ({"intermediate_size": 96}, "MLP size: config 96, tensors 128"),
    ({"vocab_size": 600}, "vocabulary: the model's HF config has 600 tokens, the embedding only 512 rows"),
    ({"tie_word_embeddings": True}, "tied output layer: config yes, tensors no"),
])
def test_each_disagreement_is_named(ckpts, changes, named):
    found = find_checkpoint(ckpts["megatron_lm"])
    with pytest.raises(UserError) as info:
        check_architecture(parse_arch(_config(ckpts, **changes)), found, "the model's HF config")
    assert named in str(info.value), str(info.value)


@pytest.mark.slow
def test_a_config_whose_rope_or_norm_contradicts_the_saved_arguments_is_refused(ckpts):
    """The saved arguments record the RoPE base, llama3 scaling, share of each head and the norm's epsilon; a config
    saying otherwise (the base model's config.json for a run trained without --use-rope-scaling) was used without a
    word, its every logit off by up to 5.7."""
    found = find_checkpoint(ckpts["megatron_lm"])
    theta, eps = found.args["rotary_base"], found.args["norm_epsilon"]
    assert found.args["use_rope_scaling"] is True  # the tiny Llama-3.1's llama3 RoPE
    rope = fc.read_config(ckpts["hf"])["rope_parameters"]  # transformers 5 keeps the base in there
    factor = found.args["rope_scaling_factor"]
    for changes, named in (
            ({"rope_parameters": {**rope, "factor": 2 * factor}},
             f"llama3 RoPE scaling factor: config {2 * factor:g}, saved arguments {factor:g} (--rope-scaling-factor)"),
            ({"rope_parameters": {**rope, "rope_theta": 2.0 * theta}},
             f"RoPE base: config {2.0 * theta:g}, saved arguments {theta:g}"),
            ({"rms_norm_eps": eps * 10}, f"norm epsilon: config {eps * 10:g}, saved arguments {eps:g}"),
            ({"rope_parameters": {"rope_type": "default", "rope_theta": theta}},
             "llama3 RoPE scaling: config no, saved arguments yes (--use-rope-scaling)")):
        with pytest.raises(UserError) as info:
            check_architecture(parse_arch(_config(ckpts, **changes)), found, "the model's HF config")
        assert named in str(info.value), str(info.value)
    check_architecture(parse_arch(_config(ckpts)), found, "the model's HF config")  # its own: nothing to say


def test_rope_variants_the_saved_arguments_record_are_not_dropped_from_a_rebuilt_config():
    """Megatron-LM's --rotary-percent, --rotary-interleaved and --rotary-seq-len-interpolation-factor each change
    every logit; `--family` rebuilt a plain Llama from such arguments, exit 0 (logits off by 5 to 6.7)."""
    from megatron_patch.models.description.megatron_args import hf_config_from_megatron_args
    from megatron_patch.models.description.registry import families
    from megatron_patch.models.description.tiny import tiny_config

    arch = parse_arch(tiny_config("llama3_1"))
    base = vars(fc.megatron_lm_args(arch, 1, 1, 256, "torch_dist"))
    hf_config_from_megatron_args(base, families()["llama3_1"])  # without them: rebuilt
    for extra, named in (({"rotary_interleaved": True}, "interleaved RoPE (rotary_interleaved)"),
                         ({"rotary_seq_len_interpolation_factor": 4},
                          "RoPE position interpolation (rotary_seq_len_interpolation_factor 4)")):
        with pytest.raises(UserError, match=r"the saved arguments describe a model with " + re.escape(named)):
            hf_config_from_megatron_args({**base, **extra}, families()["llama3_1"])
    # --rotary-percent: the share of each head a family's config says (GLM-4.5's partial_rotary_factor, MiniMax-M2's
    # rotary_dim), from the arguments, not the family's template; a family without one is refused by the
    # comparison with the arguments (test_a_config_whose_rope_or_norm_contradicts_the_saved_arguments_is_refused)
    for family in ("glm4_moe", "minimax_m2"):
        arch = parse_arch(tiny_config(family))
        args = vars(fc.megatron_lm_args(arch, 1, 1, 256, "torch_dist"))
        for percent in (0.5, 1.0):
            config, _ = hf_config_from_megatron_args({**args, "rotary_percent": percent}, families()[family])
            assert families()[family].parse_config(config).rotary_percent == percent, (family, percent)
    llama = hf_config_from_megatron_args({**base, "rotary_percent": 0.5}, families()["llama3_1"])[0]
    assert parse_arch(llama).rotary_percent == 1.0  # which the comparison then refuses


def test_saved_arguments_that_change_every_logit_without_a_tensor_are_held_to_both_sources(ckpts):
    """--apply-layernorm-1p (norm weights stored as gamma - 1), --qk-l2-norm, position_embedding_type none and
    --window-size change every logit while every tensor name and shape still fits: exported from `--family` or
    `--hf-config`, a plain Llama came out, exit 0, without a word (the pdoc audit). Each is refused from either
    source; a window the family builds (Mistral's, every layer) is rebuilt from the arguments."""
    from megatron_patch.models.description.megatron_args import hf_config_from_megatron_args
    from megatron_patch.models.description.registry import families
    from megatron_patch.models.description.tiny import tiny_config

    llama = families()["llama3_1"]
    arch = parse_arch(tiny_config("llama3_1"))
    base = vars(fc.megatron_lm_args(arch, 1, 1, 256, "torch_dist"))
    found = find_checkpoint(ckpts["megatron_lm"])
    for extra, named in (({"apply_layernorm_1p": True}, "norm weights stored as gamma - 1 (apply_layernorm_1p)"),
                         ({"qk_l2_norm": True}, "L2-normalised queries and keys (qk_l2_norm)"),
                         ({"position_embedding_type": "none"}, "none position embeddings (position_embedding_type)"),
                         ({"window_size": (16, 4)}, "an attention window of 16 keys back and 4 ahead (window_size)")):
        with pytest.raises(UserError, match=r"the saved arguments describe a model with " + re.escape(named)):
            hf_config_from_megatron_args({**base, **extra}, llama)
        with pytest.raises(UserError, match=re.escape(f"{named} in the saved arguments, which no family here builds")):
            check_architecture(parse_arch(_config(ckpts)), dataclasses.replace(found, args={**found.args, **extra}),
                               "the model's HF config")
    # Mistral's window on every layer: --family rebuilds it, a config without it is refused, one with it fits
    config, _ = hf_config_from_megatron_args({**base, "window_size": (16, 0)}, llama)
    assert (config["model_type"], config["sliding_window"]) == ("mistral", 17), config
    windowed = dataclasses.replace(found, args={**found.args, "window_size": (16, 0)})
    with pytest.raises(UserError, match=re.escape("sliding-window attention: config none, saved arguments 17 keys on "
                                                  f"{arch.num_layers} of {arch.num_layers} layers")):
        check_architecture(parse_arch(_config(ckpts)), windowed, "the model's HF config")
    mistral = {k: v for k, v in _config(ckpts).items() if k not in ("rope_parameters", "rope_scaling")}
    mistral.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=17,
                   rope_theta=found.args["rotary_base"])
    check_architecture(parse_arch(mistral), dataclasses.replace(windowed, args={**windowed.args,
                                                                                "use_rope_scaling": False}),
                       "the model's HF config")
    # every second layer in full (--window-attn-skip-freq 2): no family here builds it from one config value
    with pytest.raises(UserError, match=re.escape("saved arguments 17 keys on 2 of 4 layers")):
        check_architecture(parse_arch(mistral), dataclasses.replace(windowed, args={
            **windowed.args, "use_rope_scaling": False, "window_attn_skip_freq": 2}), "the model's HF config")


@pytest.mark.parametrize("family,beyond", [
    ("deepseek_v3", "multi-latent attention"), ("glm_moe_dsa", "multi-latent attention"),
    ("qwen3_5", "text model nested in a multimodal config"), ("gemma3", "per-layer kinds of attention"),
    ("gemma4", "per-layer kinds of attention"), ("gpt_oss", "per-layer kinds of attention"),
    ("qwen3_next", "per-layer kinds of attention"), ("deepseek_v4", "per-layer kinds of attention")])
def test_a_family_the_saved_arguments_cannot_describe_asks_for_its_config(family, beyond):
    """--family qwen3_5 / gemma3 / gemma4 with saved arguments was refused describing the family's tiny template
    ("layers: config 2" of a 4-layer checkpoint) or a config.json nobody gave; one true line now."""
    from megatron_patch.models.description.megatron_args import hf_config_from_megatron_args
    from megatron_patch.models.description.registry import families
    from megatron_patch.models.description.tiny import tiny_config

    args = vars(fc.megatron_lm_args(parse_arch(tiny_config("llama3_1")), 1, 1, 256, "torch_dist"))
    with pytest.raises(UserError, match=f"^{family}'s {beyond}.* cannot be rebuilt from Megatron-LM's arguments: give "
                                        r"--hf-config \(the model's HF config.json\)$"):
        hf_config_from_megatron_args(args, families()[family])


@pytest.mark.slow
def test_each_command_asks_for_what_it_takes(ckpts, tmp_path, capsys):
    """A Megatron-LM checkpoint without a sidecar: `mpatch eval` asked for `--family NAME`, which it does not take
    (following it: "unrecognized arguments"), and align named `--hf-config`, which is mcore2hf's."""
    rc, err = run_cli(capsys, "eval", "--load-dir", str(ckpts["megatron_lm"]), "--tasks", "mpatch_perplexity")
    assert rc == 2 and "give --hf-config PATH: the HF config.json of the model it holds; or `mpatch convert mcore2hf " \
        "--family NAME` reads its saved Megatron-LM arguments" in err, err
    with pytest.raises(UserError) as info:
        open_checkpoint(ckpts["megatron_lm"], hf_config=tmp_path, config_option="--hf-dir", family_option=None)
    assert "config.json not found: --hf-dir takes the model's HF config.json" in str(info.value), str(info.value)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps(_config(ckpts, num_hidden_layers=6)))
    with pytest.raises(UserError, match=f"does not hold the model --hf-dir {wrong} describes: layers: config 6"):
        open_checkpoint(ckpts["megatron_lm"], hf_config=wrong, config_option="--hf-dir", family_option=None)
    rc, err = _export(capsys, ckpts["megatron_lm"], tmp_path / "out")  # mcore2hf takes both
    assert rc == 2 and "give --family NAME, to read its saved Megatron-LM arguments" in err, err


def _rewritten(folder: Path, edit) -> dict:
    """The torch_dist ``folder`` written again by torch's own checkpointing with ``edit(model tensors)``'s tensors
    (optimizer state and the objects left out, megatron-core 0.19's saved arguments among them): another tool's
    spelling or dtypes of the same model. Returns what was written."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    stored = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored.items()
             if hasattr(m, "size") and not k.startswith("optimizer")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    state = edit(state)
    for old in [*folder.glob("*.distcp"), folder / ".metadata"]:
        old.unlink()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    return state


@pytest.mark.slow
def test_weights_of_two_dtypes_are_exported_in_one_saying_so(ckpts, tmp_path, capsys):
    """bf16 matrices beside fp32 norms (a GPTModel saved without Float16Module's cast): the default export rounded
    the norms to bf16 without a word. It says so, and --dtype fp32 writes every tensor exactly."""
    folder = Path(shutil.copytree(ckpts["megatron_lm"], tmp_path / "mixed")) / "iter_0000020"
    state = _rewritten(folder, lambda state: {k: v if "norm" in k else v.to(torch.bfloat16) for k, v in state.items()})
    norms = sorted(k for k in state if "norm" in k)

    rc, err = _export(capsys, folder.parent, tmp_path / "out", "--hf-config", str(ckpts["hf"]))
    assert rc == 0, err
    assert (f"stores {len(norms)} of its tensors in float32 (such as {norms[0]}) beside its bfloat16 weights: they are "
            "read, and exported, as bfloat16 (mcore2hf --dtype fp32 writes every tensor exactly)") in err, err
    rc, err = _export(capsys, folder.parent, tmp_path / "exact", "--hf-config", str(ckpts["hf"]), "--dtype", "fp32")
    assert rc == 0, err
    exact = fc.hf_tensors(tmp_path / "exact")
    assert torch.equal(exact["model.norm.weight"], state["decoder.final_layernorm.weight"])
    # a weight stored as integers is refused, and not first announced as read and exported as a float (the pdoc
    # audit: the two lines contradicted each other)
    _rewritten(folder, lambda state: {k: v.to(torch.int64) if k == "decoder.final_layernorm.weight" else v
                                      for k, v in state.items()})
    rc, err = _export(capsys, folder.parent, tmp_path / "ints", "--hf-config", str(ckpts["hf"]))
    assert rc == 2 and "is stored as int64, not a floating-point dtype" in err and err.count("int64") == 1, err


def test_an_moe_checkpoint_of_megatron_cores_local_spec_reads_its_pre_mlp_norms(tmp_path, capsys):
    """megatron-core's local spec stores an MoE layer's pre-MLP norm under the dense layer's fused name
    (``mlp.linear_fc1.layer_norm_weight``), where transformer-engine's spec, and this project, keep
    ``pre_mlp_layernorm.weight``: such a checkpoint (Megatron-LM's --transformer-impl local) was refused as lacking
    that norm. It reads, and exports bit-exact."""
    from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME
    from megatron_patch.checkpoint.sidecar import SIDECAR_NAME
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf = make_tiny_hf_checkpoint("mixtral", tmp_path / "hf", seed=4)
    hf_to_mcore(hf, tmp_path / "ours", ParallelLayout(), progress=False)
    for own in [*tmp_path.glob(f"ours/**/{SIDECAR_NAME}"), *tmp_path.glob(f"ours/**/{MANIFEST_NAME}")]:
        own.unlink()  # another tool's, as far as anything can tell
    local = {"decoder.layers.pre_mlp_layernorm.weight": "decoder.layers.mlp.linear_fc1.layer_norm_weight"}
    _rewritten(tmp_path / "ours" / "release", lambda state: {local.get(k, k): v for k, v in state.items()})

    rc, err = _export(capsys, tmp_path / "ours", tmp_path / "back", "--hf-config", str(hf))
    assert rc == 0, err
    want, got = fc.hf_tensors(hf), fc.hf_tensors(tmp_path / "back")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("kind, prefix", [("megatron_lm", "model."), ("megatron_lm", "module."), ("pai", "module.")])
def test_a_wrappers_prefix_on_every_name_is_read_past(ckpts, tmp_path, capsys, prefix, kind):
    """NeMo writes megatron-core's names under ``model.`` (and a wrapped module's state under ``module.``): such a
    checkpoint was refused with a false reason ("tied output layer: config no, tensors yes" of an untied one).
    The prefix is read past, and the export is bit-exact: torch_dist, and legacy rank files (Pai's, TP=2: the
    pdoc audit found them refused still)."""
    folder = Path(shutil.copytree(ckpts[kind], tmp_path / "nemo"))
    if kind == "megatron_lm":
        _rewritten(folder / "iter_0000020", lambda state: {prefix + k: v for k, v in state.items()})
    for rank_file in sorted(folder.glob("release/mp_rank_*/model_optim_rng.pt")):
        saved = torch.load(rank_file, weights_only=False)
        saved["model"] = {prefix + k: v for k, v in saved["model"].items()}
        torch.save(saved, rank_file)

    rc, err = _export(capsys, folder, tmp_path / "out", "--hf-config", str(ckpts["hf"]))
    assert rc == 0, err
    assert _same_tensors(tmp_path / "out", ckpts["want"]) == []


@pytest.mark.slow
def test_qk_norm_and_experts_disagreements_are_named(ckpts):
    from megatron_patch.models.description.tiny import tiny_config

    found = find_checkpoint(ckpts["megatron_lm"])
    qwen3 = {**tiny_config("qwen3"), **{k: fc.read_config(ckpts["hf"])[k] for k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "num_hidden_layers", "vocab_size", "tie_word_embeddings")}}
    with pytest.raises(UserError, match="qk norm: config yes, tensors no"):
        check_architecture(parse_arch(qwen3), found, "x")
    moe = tiny_config("mixtral", hidden_size=64, num_hidden_layers=4)
    with pytest.raises(UserError, match="experts: config 4, tensors 0"):
        check_architecture(parse_arch(moe), found, "x")


# 8 heads of 8 with 4 query groups: the widths of the fixture's 4 heads of 16 with 2 groups, split otherwise.
OTHER_HEAD_SPLIT = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["megatron_lm", "legacy"])
def test_a_config_splitting_the_heads_otherwise_than_the_saved_arguments_is_refused(ckpts, name, tmp_path, capsys):
    """The widths alone let 8 heads of 8 pass for the 4 heads of 16 the saved arguments record: q/k/v were exported
    permuted, exit 0."""
    other = tmp_path / "other" / "config.json"
    other.parent.mkdir()
    other.write_text(json.dumps(_config(ckpts, **OTHER_HEAD_SPLIT)))
    rc, err = _export(capsys, ckpts[name], tmp_path / "out", "--hf-config", str(other))
    assert rc == 2 and err.count("\n") == 1, err
    for named in ("attention heads: config 8, saved arguments 4", "query groups: config 4, saved arguments 2",
                  "head dim: config 8, saved arguments 16"):
        assert named in err, err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path / "out")


@pytest.mark.slow
def test_without_saved_arguments_a_note_says_the_head_split_is_the_configs(ckpts):
    """Megatron-Bridge records no heads: the widths are all that is checked, and one note says so."""
    opened = open_checkpoint(ckpts["bridge"], hf_config=_config(ckpts, **OTHER_HEAD_SPLIT))
    assert len(opened.notes) == 1 and "only the attention widths were checked" in opened.notes[0], opened.notes
    assert "8 heads of 8 with 4 query groups is taken from" in opened.notes[0]
    assert open_checkpoint(ckpts["megatron_lm"], hf_config=ckpts["hf"]).notes == []  # its arguments say them


@pytest.mark.slow
def test_a_config_contradicting_the_sidecar_is_said_to_be_ignored(ckpts, tmp_path):
    """A checkpoint with a sidecar is read as the sidecar says; a config describing another model was ignored
    without a word."""
    ours = tmp_path / "ours"
    hf_to_mcore(ckpts["hf"], ours, ParallelLayout(), progress=False)
    opened = open_checkpoint(ours, hf_config=_config(ckpts, **OTHER_HEAD_SPLIT))
    assert opened.sidecar.hf_config["num_attention_heads"] == 4
    assert len(opened.notes) == 1 and "is ignored" in opened.notes[0], opened.notes
    assert "num_heads: config 8, sidecar 4" in opened.notes[0] and "head_dim: config 8, sidecar 16" in opened.notes[0]
    assert open_checkpoint(ours, hf_config=ckpts["hf"]).notes == []  # the same model: nothing to say


@pytest.mark.slow
def test_padding_rows_are_the_checkpoints_own(ckpts):
    opened = open_checkpoint(ckpts["megatron_lm"], hf_config=ckpts["hf"])
    assert opened.sidecar.padded_vocab_size == 512 and opened.sidecar.arch.padded_vocab_size() == 512
    assert opened.sidecar.arch.vocab_size == 200 and opened.found.has_optimizer


# --- bad input: one line, exit 2, nothing written --------------------------------------------------

def _legacy_without(ckpts, root, rank_dir: str, layer: int):
    """A copy of the Megatron-LM legacy fixture whose ``rank_dir`` file lost its (local) layer ``layer``."""
    shutil.copytree(ckpts["legacy"], root)
    path = root / "iter_0000010" / rank_dir / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"] = {k: v for k, v in state["model"].items() if not k.startswith(f"decoder.layers.{layer}.")}
    torch.save(state, path)
    return root


@pytest.mark.slow
def test_bad_input_is_refused_in_one_line(ckpts, tmp_path, capsys):
    cases = {}
    cases["not a checkpoint"] = (ckpts["hf"], "is not a Megatron checkpoint")
    half = tmp_path / "half"
    shutil.copytree(ckpts["megatron_lm"], half)
    (half / "iter_0000020" / "__0_0.distcp").unlink()  # a save that died before its data was written
    cases["half-written torch_dist"] = (half, "__0_0.distcp is missing")
    half_legacy = tmp_path / "half_legacy"
    shutil.copytree(ckpts["legacy"], half_legacy)
    (half_legacy / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt").unlink()
    cases["half-written legacy"] = (half_legacy, "mp_rank_00_001/model_optim_rng.pt is missing")
    # The last stage lost a layer: 2 + 1 layers where the config has 4.
    cases["layers don't add up"] = (_legacy_without(ckpts, tmp_path / "short", "mp_rank_00_001", 1),
                                    "layers: config 4, tensors 3")
    cases["layer numbering with a gap"] = (_legacy_without(ckpts, tmp_path / "gap", "mp_rank_00_000", 0),
                                           "the layers don't add up")
    wrong = tmp_path / "wrong" / "config.json"  # a folder of its own: the output may not lie inside it
    wrong.parent.mkdir()
    wrong.write_text(json.dumps(_config(ckpts, num_key_value_heads=4)))
    for what, (load, expected) in cases.items():
        out = tmp_path / "out"
        rc, err = _export(capsys, load, out, "--hf-config", str(ckpts["hf"]))
        assert rc == 2 and err.count("\n") == 1 and expected in err, (what, err)
        assert not out.exists() and not leftovers(out), what
    rc, err = _export(capsys, ckpts["megatron_lm"], tmp_path / "out", "--hf-config", str(wrong))
    assert rc == 2 and err.count("\n") == 1 and "query groups: config 4" in err, err
    assert not (tmp_path / "out").exists()
    rc, err = _export(capsys, ckpts["megatron_lm"], tmp_path / "out", "--family", "llama3_1", "--iteration", "7")
    assert rc == 2 and err.count("\n") == 1 and "iter_0000007 not found: the iterations saved in" in err and "are 20" in err
    rc, err = run_cli(capsys, "inspect", str(ckpts["hf"]))
    assert rc == 2 and err.count("\n") == 1 and "is not a Megatron checkpoint" in err


# --- mpatch inspect --------------------------------------------------------------------------------

@pytest.mark.slow
def test_inspect_says_what_each_folder_is(ckpts, capsys):
    expected = {
        "megatron_lm": ("torch_dist", "Megatron-LM", True, 20, "--family NAME"),
        "legacy": ("legacy", "Megatron-LM", True, 10, "--family NAME"),
        "pai": ("legacy", "Pai-Megatron-Patch", False, "release", "config.json lies beside"),
        "bridge": ("torch_dist", "Megatron-Bridge", True, 0, "--hf-config PATH"),
    }
    from megatron_patch.cli import main

    for name, (fmt, writer, optimizer, iteration, needs) in expected.items():
        rc = main(["inspect", str(ckpts[name]), "--json"])
        info = json.loads(capsys.readouterr().out) if rc == 0 else None
        assert rc == 0 and info["format"] == fmt and writer in info["written_by"], (name, info)
        assert info["optimizer_state"] is optimizer and info["iteration"] == iteration and needs in info["mcore2hf_needs"]
        assert info["dtype"] == "fp32" and info["tensors"] > 0 and info["bytes"] > 0
    legacy = find_checkpoint(ckpts["legacy"])
    assert legacy.layers_per_stage == [2, 2] and (legacy.layout.tp, legacy.layout.pp) == (1, 2)
    rc = main(["inspect", str(ckpts["pai"])])
    text = capsys.readouterr().out
    assert rc == 0 and "layout TP=2 PP=1 EP=1" in text and "padded vocabulary 256" in text and len(text.splitlines()) < 20


# --- align: the foreign checkpoint is the model of --hf-dir ----------------------------------------

@pytest.mark.slow
def test_align_reads_a_megatron_lm_checkpoint(ckpts, tmp_path, capsys):
    from megatron_patch.cli import main

    main(["align", "--hf-dir", str(ckpts["hf"]), "--mcore-dir", str(ckpts["megatron_lm"]), "--dtype", "fp32",
          "--seq-len", "16", "--batch", "1", "--quiet", "--report-dir", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert "megatron_lm" in report["compared"]["tested"] and report["config_differences"] == []
    # Loaded at TP=1 in fp32, every point (the embedding of every id and of the inputs, each layer's attention, MLP
    # and output, final norm, logits) is HF's own, bit for bit.
    points = report["verdict"]["points"]
    assert len(points) == 4 * 3 + 4 and all(p["metrics"]["rel_l2"] == 0 for p in points), points



# --- this project's checkpoints without their sidecar: layers megatron-core stores one key each ---------

# megatron-core stores a stack whose layers differ one key per layer (decoder.layers.N.*): DeepSeek-V3's and
# GLM-4.5's dense first layers, Qwen3-MoE's mlp_only_layers, Qwen3-Next's hybrid attention, Gemma 4's two head
# sizes. The facts were read from stacked keys only ("experts: config 8, tensors 0", "qk norm: config yes, tensors
# no"), and Qwen3-Next's gated linear_qkv, which holds a gate row per q row, gave "query groups: config 2 (key/value
# rows 128), tensors 256 rows" in either format.
SIDECARLESS = {
    "deepseek_v3": ("torch_dist", ParallelLayout(tp=2, pp=3, ep=2)),  # MLA, 1 dense layer, then MoE
    "glm4_moe": ("torch_dist", ParallelLayout(tp=2, ep=2)),  # q/k norms and q/k/v biases, 1 dense layer
    "qwen3_moe": ("torch_dist", ParallelLayout(tp=2, pp=2, ep=2)),  # mlp_only_layers [0]
    "qwen3_next": ("torch_dist", ParallelLayout(tp=2, ep=2)),
    "qwen3_next/legacy": ("legacy", ParallelLayout(pp=2, ep=2)),  # stacked on reading: the gate rows alone
    "gemma4": ("torch_dist", ParallelLayout(tp=2)),  # a sliding layer of 64/64 attention rows, a full one of 128/128
    "deepseek_v3/mtp": ("torch_dist", ParallelLayout(tp=2, ep=2)),  # converted with --mtp: mtp.layers.0.* (refused)
}


@pytest.fixture(scope="module")
def sidecarless(tmp_path_factory):
    """case -> (a tiny random HF model, its hf2mcore checkpoint with the sidecar and manifest deleted), made once."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from tests.convert_helpers import with_mtp_layer

    root, made = tmp_path_factory.mktemp("sidecarless"), {}
    (root / "mcore").mkdir()

    def get(case: str):
        if case not in made:
            family, (fmt, layout) = case.split("/")[0], SIDECARLESS[case]
            hf = root / "hf" / family
            if not hf.exists():
                make_tiny_hf_checkpoint(family, hf, seed=3)
            if case.endswith("/mtp"):
                hf = with_mtp_layer(hf, root / "hf" / case.replace("/", "_"))
            ckpt = root / "mcore" / case.replace("/", "_")
            hf_to_mcore(hf, ckpt, layout, fmt=fmt, progress=False, mtp=case.endswith("/mtp"))
            for name in ("mpatch_checkpoint.json", "mpatch_manifest.json"):
                (ckpt / name).unlink()
            made[case] = hf, ckpt
        return made[case]
    return get


def _byte_differences(folder, want) -> list[str]:
    got = fc.hf_tensors(folder)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return [k for k in want if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
            or not torch.equal(got[k].contiguous().view(torch.uint8), want[k].contiguous().view(torch.uint8))]


@pytest.mark.parametrize("case", list(SIDECARLESS))
def test_own_checkpoint_without_its_sidecar_exports_from_hf_config(case, sidecarless, tmp_path, capsys):
    from megatron_patch.checkpoint.arch_source import _arch_facts
    from megatron_patch.checkpoint.foreign import tensor_facts

    hf, ckpt = sidecarless(case)
    capsys.readouterr()  # hf2mcore's progress
    rc, err = _export(capsys, ckpt, tmp_path / "hf", "--hf-config", str(hf))
    assert rc == 0, err
    assert _byte_differences(tmp_path / "hf", fc.hf_tensors(hf)) == []
    # What the tensors say (mpatch inspect's "tensor shapes only") is every fact the config is checked for.
    have = tensor_facts(find_checkpoint(ckpt).shapes)
    assert {k: (v, have.get(k)) for k, v in _arch_facts(parse_arch(hf)).items() if have.get(k) != v} == {}, have


@pytest.mark.parametrize("case,changes,named", [
    ("glm4_moe", {"n_routed_experts": 8}, "experts: config 8, tensors 4"),
    ("qwen3_moe", {"num_hidden_layers": 6, "mlp_only_layers": [0]}, "layers: config 6, tensors 4"),
    ("qwen3_next", {"num_key_value_heads": 1},
     "query groups: config 1 (key/value rows 64), tensors 128 rows (2 groups)"),
    ("qwen3_next/legacy", {"num_key_value_heads": 4}, "query groups: config 4 (key/value rows 256), tensors 128 rows"),
])
def test_per_layer_disagreements_are_named(case, changes, named, sidecarless):
    hf, ckpt = sidecarless(case)
    with pytest.raises(UserError) as info:
        check_architecture(parse_arch({**fc.read_config(hf), **changes}), find_checkpoint(ckpt), "x")
    assert named in str(info.value), str(info.value)


def test_stored_mtp_layers_the_config_does_not_declare_are_refused(sidecarless, tmp_path):
    """Without a sidecar the tensors count the MTP layers (megatron-core's mtp.layers.N.*); a config declaring
    fewer is refused, naming both (a checkpoint converted with --mtp was refused whatever the config said)."""
    import json

    from megatron_patch.checkpoint.arch_source import open_checkpoint

    hf, ckpt = sidecarless("deepseek_v3/mtp")
    assert open_checkpoint(ckpt, hf_config=hf).sidecar.mtp_layers == 1
    config = {**fc.read_config(hf), "num_nextn_predict_layers": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="holds 1 multi-token-prediction layer.s., and --hf-config .* declares 0"):
        open_checkpoint(ckpt, hf_config=tmp_path / "config.json")


def test_a_legacy_checkpoint_missing_a_whole_stage_or_tp_column_is_refused(tmp_path, capsys):
    """Its remaining rank folders look like a smaller layout: `mpatch inspect` described a TP=2 PP=2 conversion that
    lost its second stage as a complete TP=2 PP=1 one (exit 0), which mcore2hf refused (the tools audit). Its
    sidecar's layout, or Megatron-LM's saved arguments, say what the folders must be."""
    from megatron_patch.checkpoint.foreign import _legacy_layout
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf")
    hf_to_mcore(hf, tmp_path / "ck", ParallelLayout(tp=2, pp=2), fmt="legacy", progress=False)
    for lost, left in ((("mp_rank_00_001", "mp_rank_01_001"), "TP=2 PP=1"),
                       (("mp_rank_01_000", "mp_rank_01_001"), "TP=1 PP=2")):
        spoilt = tmp_path / f"spoilt_{left[3]}"
        shutil.copytree(tmp_path / "ck", spoilt)
        for name in lost:
            shutil.rmtree(spoilt / "release" / name)
        rc, err = run_cli(capsys, "inspect", str(spoilt))
        assert rc == 2 and f"holds the rank folders of {left} EP=1, and its sidecar records TP=2 PP=2 EP=1" in err
    # another tool's checkpoint, without a sidecar: by the saved arguments' sizes
    files = {name: {"embedding.word_embeddings.weight": None} for name in ("mp_rank_00_000", "mp_rank_01_000")}
    with pytest.raises(UserError, match="lacks rank folder.s. mp_rank_00_001, mp_rank_01_001 of its TP=2 PP=2 EP=1"):
        _legacy_layout(tmp_path, files, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2})
    assert _legacy_layout(tmp_path, files, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
                          )[0] == ParallelLayout(tp=2)


@pytest.mark.parametrize("tool", ["mpatch eval", "mpatch align", "mpatch demo"])
def test_an_output_of_another_command_is_named_as_such_not_as_a_damaged_checkpoint(tmp_path, capsys, tool):
    """An `mpatch eval --all-iterations` output holds iter_XXXXXXX folders: inspect called it a checkpoint whose
    iterations were all damaged and said to move them away (the tools audit). Its manifest names its command."""
    from megatron_patch.checkpoint_files.manifest import write_manifest

    out = tmp_path / "out"
    (out / "iter_0000002").mkdir(parents=True)
    (out / "iter_0000002" / "results.json").write_text("{}")
    write_manifest(out, tool, sync=False)
    rc, err = run_cli(capsys, "inspect", str(out))
    assert rc == 2 and f"{out} is an output of {tool} (its mpatch_manifest.json says so), not a checkpoint" in err


def test_an_iteration_a_checkpoint_cannot_have_is_said_plainly(tmp_path, capsys):
    """--iteration -1 read "iter_-000001 not found", and --iteration 5 on converted weights said its iterations are
    "none" (the tools audit)."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf_to_mcore(make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf"), tmp_path / "ck", ParallelLayout(),
                progress=False)
    rc, err = run_cli(capsys, "inspect", str(tmp_path / "ck"), "--iteration", "-1")
    assert rc == 2 and "--iteration must be >= 0, got -1" in err
    rc, err = run_cli(capsys, "inspect", str(tmp_path / "ck"), "--iteration", "5")
    assert rc == 2 and f"{tmp_path / 'ck'} holds converted weights (release/), not a training run's iterations" in err
