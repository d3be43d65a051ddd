"""Gemma 4's on-device pieces (E2B, E4B) on a tiny model of five layers,
[sliding, sliding, full, sliding, full]: per-layer input embeddings (8 per layer), the last two layers reusing the keys and values of layers 1 and 2 (KV
sharing; layer 0 neither stores nor reuses), and the reusing layers' double-wide MLP. Config reading in both forms,
logits equal to transformers' (within float32's noise) at TP=1 and TP=2, each piece shown to matter, a bit-exact round trip at TP=2, the
layouts refused in one line, the counts and the memory plan, the presets' sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import validate_layout
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.runtime.distributed import ParallelLayout

GEMMA4 = families()["gemma4"]
_FULL = {"head_dim": 32, "num_key_value_heads": 4}
E_OVERRIDES = {
    "num_hidden_layers": 5, "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                            "sliding_attention", "full_attention"],
    "per_layer_config": {"2": _FULL, "4": _FULL}, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 200, "use_double_wide_mlp": True,
}
E_CONFIG = {**GEMMA4.tiny_config, **E_OVERRIDES}


def assert_within_fp32_noise(hf_dir, tokens, logits) -> None:
    """``logits`` are transformers' as far as float32 tells: no farther from transformers' own float64 logits than
    1.5 times its float32 ones are (this five-layer model's float32 noise, 2e-5 of rel_l2, is twice the two-layer
    one's on which FP32_REL_L2 was set, so the two float32 runs differ by about as much), that noise itself small."""
    import transformers

    from megatron_patch.align.parity import FP32_REL_L2, compare_logits

    def run(dtype):
        model = transformers.Gemma4ForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
        with torch.no_grad():
            # the hidden states asked for: transformers 5.24 otherwise slices the KV-shared layers' inputs to
            # logits_to_keep, and fails (indexes per_layer_inputs) in a model with KV sharing but no per-layer inputs
            return model(tokens, output_hidden_states=True).logits.float()

    exact, want = run(torch.float64), run(torch.float32)
    noise = compare_logits(exact, want)["rel_l2"]
    assert noise <= 5 * FP32_REL_L2 and compare_logits(exact, logits)["rel_l2"] <= 1.5 * noise, \
        (compare_logits(exact, logits), noise)


@pytest.fixture(scope="module")
def e_checkpoint(tmp_path_factory):
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint("gemma4", tmp_path_factory.mktemp("gemma4_e") / "hf", seed=7, **E_OVERRIDES)


def test_both_config_forms_read_the_e_pieces_as_transformers_does():
    """The hub's form and transformers' written-back one (per_layer_config) read the same: per-layer inputs of 8
    packed over 5 layers, transformers' own kv_sharing_modes, the double-wide MLP."""
    from transformers import Gemma4TextConfig

    hub = {k: v for k, v in E_CONFIG.items() if k != "per_layer_config"}
    written = Gemma4TextConfig(**E_CONFIG).to_dict()
    assert "per_layer_config" in written and "global_head_dim" not in written
    read = [dataclasses.replace(parse_arch(c), hf_config={}) for c in (E_CONFIG, hub, written)]
    assert read[0] == read[1] == read[2]
    own = read[0].family_config
    assert own.kv_sharing == (None, "store", "store", "reuse", "reuse")
    # transformers' own, where it has them (5.24; the 5.20 that Python 3.10 resolves does not)
    modes = getattr(Gemma4TextConfig(**E_CONFIG), "kv_sharing_modes", None)
    assert modes is None or tuple(modes) == own.kv_sharing
    assert (own.per_layer_input_size, own.per_layer_input_layers, own.double_wide_mlp) == (8, 5, True)
    assert [own.store_of(read[0], i) for i in (3, 4)] == [1, 2]


@pytest.mark.parametrize("over, fragment", [
    ({"vocab_size_per_layer_input": 100}, "vocab_size_per_layer_input=100 differs from vocab_size=200"),
    ({"num_kv_shared_layers": 4}, "num_kv_shared_layers=4: every attention type of the shared layers needs"),
])
def test_what_the_e_pieces_do_not_build_is_refused_in_one_line(over, fragment):
    with pytest.raises(UserError) as err:
        parse_arch({**E_CONFIG, **over})
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_layouts_it_cannot_run_are_refused_in_one_line():
    """Per-layer inputs run at PP=1 only; KV sharing alone runs where each reusing layer shares its stage with its
    store layer, and is refused in one line where a stage boundary parts them."""
    for arch, layout, first, fragment in (
            (parse_arch(E_CONFIG), ParallelLayout(pp=5), None, "PP=5: gemma4's per-layer input embeddings"),
            (parse_arch({**E_CONFIG, "hidden_size_per_layer_input": 0}), ParallelLayout(pp=2), 2,
             "layer 3 reuses the keys and values of layer 1, which is on another pipeline stage")):
        with pytest.raises(UserError) as err:
            validate_layout(arch, layout, pp_first_stage_layers=first)
        assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)
    validate_layout(parse_arch(E_CONFIG), ParallelLayout(tp=2))
    # layers 0 | 1-4: every reusing layer beside its store layer
    validate_layout(parse_arch({**E_CONFIG, "hidden_size_per_layer_input": 0}), ParallelLayout(pp=2),
                    pp_first_stage_layers=1)


def variants_worker(hf_dir: str, tokens: torch.Tensor) -> dict:
    """The E model's logits as built, and with each of its pieces left out or wrong."""
    from megatron_patch.align.parity import load_hf_weights
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.blocks.inference import forward_logits
    from megatron_patch.runtime import init_model_parallel

    arch = parse_arch(hf_dir)
    layout = ParallelLayout()
    init_model_parallel(layout)

    def no_per_layer_inputs(model):
        for layer in model.decoder.layers:
            layer.per_layer_input = None

    def zeroed(name):
        return lambda model: model.get_parameter(name).data.zero_()

    # layer 0 storing in place of layer 1: the reusing sliding layer takes the wrong layer's keys and values
    wrong_store = dataclasses.replace(arch, family_config=dataclasses.replace(
        arch.family_config, kv_sharing=("store", None, "store", "reuse", "reuse")))
    variants = {"built": (arch, None), "no_per_layer_inputs": (arch, no_per_layer_inputs),
                "no_token_part": (arch, zeroed("per_layer_inputs.embed_tokens.weight")),
                "no_model_projection": (arch, zeroed("per_layer_inputs.model_projection.weight")),
                "kv_of_another_layer": (wrong_store, None)}
    out = {}
    for name, (variant, edit) in variants.items():
        model = build_model(variant, layout, torch.float32)
        load_hf_weights(model, variant, layout, HFCheckpointReader(hf_dir))
        if edit is not None:
            edit(model)
        out[name] = forward_logits(model.eval(), tokens, arch.vocab_size)
    return out


@pytest.mark.slow
def test_the_e_pieces_are_what_transformers_computes(e_checkpoint):
    """With per-layer inputs and KV sharing, the MCore twin's logits are transformers' in fp32; leaving out the
    per-layer inputs, either of their parts, or taking a reusing layer's keys and values from another layer than
    its store layer is far off."""
    from megatron_patch.align.parity import FP32_REL_L2, compare_logits, hf_logits, random_tokens
    from megatron_patch.runtime.launch import run_local

    tokens = random_tokens(200, 2, 16, 1)  # 16 tokens: the window of 8 bites
    logits = run_local(variants_worker, 1, str(e_checkpoint), tokens)[0]
    assert_within_fp32_noise(e_checkpoint, tokens, logits["built"])
    want = hf_logits(e_checkpoint, tokens)
    for name in ("no_per_layer_inputs", "no_token_part", "no_model_projection", "kv_of_another_layer"):
        assert compare_logits(want, logits[name])["rel_l2"] > 100 * FP32_REL_L2, name


@pytest.mark.slow
def test_converted_at_tp2_its_logits_are_transformers_and_it_converts_back_bit_exact(e_checkpoint, tmp_path):
    """At TP=2 (the per-layer embedding split by vocabulary, the reusing layers' linear_qkv by query heads, their
    double-wide MLP by its width), the checkpoint's logits are transformers', and it converts back bit for bit, no
    k_proj, v_proj or k_norm invented on the reusing layers."""
    from megatron_patch.align.parity import random_tokens
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
    from megatron_patch.runtime.launch import run_local
    from tests.convert_helpers import checkpoint_logits_worker

    src = HFCheckpointReader(e_checkpoint)
    assert "model.layers.3.self_attn.k_proj.weight" not in src.keys()
    assert src.get("model.layers.3.mlp.down_proj.weight").shape == (48, 192)
    layout, tokens = ParallelLayout(tp=2), random_tokens(200, batch=2, seq=16)
    for fmt in ("torch_dist", "legacy"):
        ckpt, back = tmp_path / fmt, tmp_path / f"back-{fmt}"
        hf_to_mcore(e_checkpoint, ckpt, layout, fmt=fmt, dtype="fp32", progress=False)
        if fmt == "torch_dist":
            results = run_local(checkpoint_logits_worker, layout.world_size, str(ckpt), layout, tokens)
            assert_within_fp32_noise(e_checkpoint, tokens, next(r for r in results if r is not None))
        mcore_to_hf(ckpt, back, progress=False)
        got = HFCheckpointReader(back)
        assert sorted(got.keys()) == sorted(src.keys()), fmt
        assert all(torch.equal(got.get(n), src.get(n)) for n in src.keys()), fmt


def test_the_counts_and_the_memory_plan_hold_the_e_weights(tmp_path):
    """megatron-core builds the reusing layers without key/value rows or k_norm and with the double-wide MLP, the
    model's parameters are transformers' (with the vocabulary's padding, in both embeddings), and the memory plan's
    weights are those: the per-layer inputs' weights on top of the same model without them."""
    from transformers import AutoConfig, Gemma4ForCausalLM

    from megatron_patch.models.shape.model_shape import model_shape
    from megatron_patch.training import memory_plan
    from megatron_patch.training.validation import resolve
    from tests.training_helpers import launcher_args

    arch = parse_arch(E_CONFIG)
    shape = model_shape(arch)
    shared = shape.layers["sliding_attention+dense+kv-shared"]
    assert shared["self_attention.linear_qkv.weight"] == (4 * 16, 48) and "self_attention.k_layernorm.weight" \
        not in shared
    assert shared["mlp.linear_fc2.weight"] == (48, 192)
    assert shape.layers["full_attention+dense+kv-shared"]["self_attention.linear_qkv.weight"] == (4 * 32, 48)
    hf = Gemma4ForCausalLM(AutoConfig.for_model(**E_CONFIG))
    padding = (arch.padded_vocab_size() - arch.vocab_size) * (48 + 5 * 8)
    assert shape.params() == sum(p.numel() for p in hf.parameters()) + padding

    prefix = tmp_path / "c_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    cfg = resolve("gemma4", launcher_args("gemma4", PR="bf16", DATASET_PATH=str(prefix),
                                          OUTPUT_BASEPATH=str(tmp_path / "out")), env={})
    without = parse_arch({**E_CONFIG, "hidden_size_per_layer_input": 0})
    with_inputs, plain = (memory_plan.stage_memory(a, cfg, 0, "local") for a in (arch, without))
    per_layer = arch.padded_vocab_size() * 5 * 8 + 48 * 5 * 8 + 8 + 5 * (2 * 48 * 8 + 48)
    assert with_inputs.trainable - plain.trainable == per_layer


@pytest.mark.slow
@pytest.mark.parametrize("size, total, without_per_layer_embedding", [
    ("E2B", 4_628_569_344, 2.3), ("E4B", 7_463_013_376, 4.6)])
def test_the_e_presets_have_transformers_size(size, total, without_per_layer_embedding):
    """The E2B and E4B presets' language models, as megatron-core builds them, have transformers' parameter count;
    without the per-layer embedding (which Google leaves out of the "effective" sizes), E2B's is the published
    2.3B (Google gives E4B's as 4.5B: here 4.64B, the text model of transformers' own config)."""
    import transformers

    from megatron_patch.models.shape.model_shape import model_shape

    config = GEMMA4.presets[size]
    arch = parse_arch(config)
    with torch.device("meta"):
        hf = transformers.Gemma4ForCausalLM(transformers.AutoConfig.for_model(**config))
    shape = model_shape(arch)
    assert arch.padded_vocab_size() == arch.vocab_size
    assert shape.params() == sum(p.numel() for p in hf.parameters()) == total
    per_layer_embedding = hf.model.embed_tokens_per_layer.weight.numel()
    assert round((total - per_layer_embedding) / 1e9, 1) == without_per_layer_embedding


def sequence_parallel_worker(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from megatron_patch.align.parity import load_hf_weights
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.blocks.inference import forward_logits
    from megatron_patch.runtime import init_model_parallel

    arch, layout = parse_arch(hf_dir), ParallelLayout(tp=2)
    init_model_parallel(layout)
    model = build_model(arch, layout, torch.float32, sequence_parallel=True)
    assert model.per_layer_inputs.embed_tokens.reduce_scatter_embeddings
    load_hf_weights(model, arch, layout, HFCheckpointReader(hf_dir))
    return forward_logits(model.eval(), tokens, arch.vocab_size)


@pytest.mark.slow
def test_with_sequence_parallelism_the_per_layer_inputs_follow_the_sequence_split(e_checkpoint):
    """Under sequence parallelism each rank's per-layer inputs are its share of the sequence, as its hidden states
    are (the per-layer embedding reduce-scattered like the main one): the logits are still transformers'."""
    from megatron_patch.align.parity import random_tokens
    from megatron_patch.runtime.launch import run_local

    tokens = random_tokens(200, 2, 16, 1)
    assert_within_fp32_noise(e_checkpoint, tokens, run_local(sequence_parallel_worker, 2, str(e_checkpoint), tokens)[0])


def full_recompute_worker(config: dict) -> str:
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.runtime import init_model_parallel

    init_model_parallel(ParallelLayout())
    try:
        build_model(parse_arch(config), ParallelLayout(), torch.float32, recompute_granularity="full",
                    recompute_method="uniform", recompute_num_layers=1)
    except UserError as err:
        return str(err)
    return ""


def test_kv_sharing_refuses_full_activation_recomputation_in_one_line():
    """Full recomputation would recompute a reusing layer from keys and values stored without a graph (its
    gradient lost): refused in one line when the model is built."""
    from megatron_patch.runtime.launch import run_local

    from megatron_patch.models.gemma4.settings import KV_SHARING_FULL_RECOMPUTE

    message = run_local(full_recompute_worker, 1, E_CONFIG)[0]
    assert KV_SHARING_FULL_RECOMPUTE in message and "\n" not in message, message
    # the launcher refuses it before any rank starts (validation.recompute_blocks), selective recompute is fine
    assert GEMMA4.recompute_refused(parse_arch(E_CONFIG), "full", (0, 16)) == KV_SHARING_FULL_RECOMPUTE
    assert GEMMA4.recompute_refused(parse_arch(E_CONFIG), "sel", (0, 16)) is None
    assert GEMMA4.recompute_refused(parse_arch(GEMMA4.tiny_config), "full", (0, 16)) is None


@pytest.mark.slow
def test_a_peft_adapter_of_the_e_model_exports_and_merges_as_peft(e_checkpoint, tmp_path):
    """LoRA on every module the E model adapts, the reusing layers' q_proj alone among their attention's (they have
    no k_proj or v_proj): hf2mcore --peft-dir, then --lora-adapter gives peft's tensors back bit for bit, and
    --merge-lora gives peft's merge_and_unload weights (to float32's rounding) and logits (within 5e-5: this model's
    float32 noise, twice FP32_REL_L2, amplifies that rounding)."""
    from safetensors.torch import load_file

    from megatron_patch.align.parity import hf_logits, random_tokens
    from megatron_patch.cli import main
    from tests.lora_helpers import make_peft_adapter, peft_logits, rel

    src = make_peft_adapter(e_checkpoint, tmp_path / "peft")
    assert "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" in load_file(src / "adapter_model.safetensors")
    ckpt, out, merged = tmp_path / "ckpt", tmp_path / "out", tmp_path / "merged"
    assert main(["convert", "hf2mcore", "--hf-dir", str(e_checkpoint), "--save-dir", str(ckpt), "--peft-dir",
                 str(src), "--tp", "2", "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(out), "--lora-adapter"]) == 0
    a, b = load_file(src / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(merged), "--merge-lora",
                 "--quiet"]) == 0
    from peft import PeftModel

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from tests.lora_helpers import load_hf

    theirs = PeftModel.from_pretrained(load_hf(e_checkpoint), str(src)).merge_and_unload().state_dict()
    got = HFCheckpointReader(merged)
    assert set(got.keys()) <= set(theirs) and all(rel(got.get(n), theirs[n]) <= 1e-6 for n in got.keys())
    tokens = random_tokens(200, batch=2, seq=16, seed=3)
    ours, peft_merged = hf_logits(merged, tokens), peft_logits(e_checkpoint, src, tokens, merged=True)
    assert rel(ours, peft_merged) <= 5e-5 and rel(peft_merged, hf_logits(e_checkpoint, tokens)) > 1e-2


class _Tensors:
    """A reader of HF-named tensors held in memory (``load_hf_weights`` reads ``keys()`` and ``get``)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def keys(self):
        return list(self.tensors)

    def get(self, name):
        return self.tensors[name]


def gradients_worker(hf_dir: str, tokens: torch.Tensor, hf_grads: dict) -> dict:
    """The MCore model's gradients of the next-token loss, and transformers' mapped onto the same parameters."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.model_io import load_hf_weights
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.runtime import init_model_parallel

    arch, layout = parse_arch(hf_dir), ParallelLayout()
    init_model_parallel(layout)
    model, mapped = (build_model(arch, layout, torch.float32) for _ in range(2))
    load_hf_weights(model, arch, layout, HFCheckpointReader(hf_dir))
    load_hf_weights(mapped, arch, layout, _Tensors(hf_grads))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, positions, attention_mask=None)[..., :arch.vocab_size]
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return {name: (p.grad, mapped.get_parameter(name).detach()) for name, p in model.named_parameters()}


@pytest.mark.slow
def test_the_gradients_are_transformers_through_the_shared_keys_and_the_per_layer_inputs(e_checkpoint):
    """Training takes transformers' gradients: those of the store layers' key/value projections (which the reusing
    layers' attention reaches), of the per-layer embedding and projections, of every weight, are transformers'."""
    import transformers

    from megatron_patch.align.parity import random_tokens
    from megatron_patch.runtime.launch import run_local

    tokens = random_tokens(200, 2, 16, 1)
    hf = transformers.Gemma4ForCausalLM.from_pretrained(e_checkpoint, dtype=torch.float32)
    logits = hf(tokens).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    grads = {name: p.grad for name, p in hf.named_parameters()}
    grads.update({name: torch.zeros_like(b) for name, b in hf.named_buffers() if name.endswith("layer_scalar")})
    pairs = run_local(gradients_worker, 1, str(e_checkpoint), tokens, grads)[0]
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in pairs and "per_layer_inputs.embed_tokens.weight" \
        in pairs
    for name, (ours, theirs) in pairs.items():
        assert ours is not None and theirs.norm() > 0, name
        assert float((ours - theirs).norm() / theirs.norm()) <= 1e-4, name


@pytest.mark.slow
def test_kv_sharing_runs_at_pp2_where_each_reusing_layer_is_beside_its_store_layer(tmp_path):
    """Without per-layer inputs, KV sharing runs pipelined where no stage boundary parts a reusing layer from its
    store layer: [sliding, sliding, full, full] with the last layer reusing layer 2's keys and values, at PP=2
    (layers 0-1 | 2-3), converted and run, gives transformers' logits."""
    from megatron_patch.align.parity import random_tokens
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.launch import run_local
    from tests.convert_helpers import checkpoint_logits_worker

    over = {**E_OVERRIDES, "num_hidden_layers": 4, "num_kv_shared_layers": 1, "hidden_size_per_layer_input": 0,
            "layer_types": ["sliding_attention"] * 2 + ["full_attention"] * 2, "per_layer_config": {"2": _FULL,
                                                                                                   "3": _FULL}}
    src = make_tiny_hf_checkpoint("gemma4", tmp_path / "hf", seed=3, **over)
    assert parse_arch(src).family_config.kv_sharing == (None, "store", "store", "reuse")
    layout, tokens = ParallelLayout(pp=2), random_tokens(200, batch=2, seq=16)
    hf_to_mcore(src, tmp_path / "ckpt", layout, fmt="torch_dist", progress=False)
    results = run_local(checkpoint_logits_worker, layout.world_size, str(tmp_path / "ckpt"), layout, tokens)
    assert_within_fp32_noise(src, tokens, next(r for r in results if r is not None))


@pytest.mark.slow
def test_align_says_aligned_in_fp32_and_bf16(e_checkpoint):
    """`mpatch align --dtype bf16` on the E model (per-layer inputs, KV sharing, the double-wide MLP): fp32 certifies
    the mapping, and bf16 stays within transformers' own bf16 rounding at every layer."""
    from megatron_patch.cli import main

    assert main(["align", "--hf-dir", str(e_checkpoint), "--dtype", "bf16", "--quiet"]) == 0


@pytest.mark.slow
def test_the_launcher_trains_the_e_model_from_a_converted_checkpoint(e_checkpoint, corpus, tmp_path):
    """The E model (per-layer inputs, KV sharing, the double-wide MLP), converted, trains through the Gemma 4
    launcher and the loss falls; full activation recomputation, which would lose the KV-shared layers' gradients,
    is refused in one line."""
    from megatron_patch.models.gemma4.settings import KV_SHARING_FULL_RECOMPUTE
    from tests.training_helpers import train_converted

    proc, losses = train_converted("gemma4", e_checkpoint, corpus, tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    proc, _ = train_converted("gemma4", e_checkpoint, corpus, tmp_path / "full", AC="full")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and err.count("\n") == 0, err[-3000:]
    # before any rank starts, without megatron-core's "when instantiating ..." glued on
    assert err == "mpatch train: error: AC=full: " + KV_SHARING_FULL_RECOMPUTE, err
