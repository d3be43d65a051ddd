"""A GPU with CUDA present and transformer-engine absent (issue 20), checked on CPU.

The fake-CUDA tests patch ``torch.cuda.is_available`` and hide transformer-engine and Apex's softmax
kernels, as the lent GPU machine lacks them; they check configuration and model build, not a forward
pass (the forward of the same local-spec settings runs on CPU in test_models and test_align). The
placement tests stand the meta device in for the rank's GPU: megatron-core builds some tensors on the
host, so a parity or alignment run must move the whole model, and inference its inputs, to the device.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from megatron_patch.align import ablations
from megatron_patch.models.blocks import builder
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.runtime import ParallelLayout
from megatron_patch.runtime.launch import run_local

# What the lent GPU machine does not have: transformer-engine, and Apex's fused softmax kernels.
ABSENT = ("transformer_engine", "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
META = torch.device("meta")


def _fake_gpu_without_te() -> None:
    """This process now sees CUDA and no transformer-engine (as the issue's reproduction does)."""
    torch.cuda.is_available = lambda: True
    for name in ABSENT:
        sys.modules[name] = None  # import raises ImportError
    builder.te_available.cache_clear()


def fake_gpu_build_worker() -> dict:
    """Every family's model in bf16 and the converter's skeleton, built as a GPU without TE builds them."""
    from megatron_patch.models.blocks.core_attention import core_attention_of
    from megatron_patch.models.shape.skeleton import describe_model_here
    from megatron_patch.runtime import init_model_parallel

    init_model_parallel(ParallelLayout())  # gloo and megatron's CPU layer, before CUDA "appears"
    _fake_gpu_without_te()
    out = {"cuda": torch.cuda.is_available(), "te": builder.te_available(),
           "fused_softmax": builder.fused_softmax_available(), "models": {}, "skeletons": {}}
    for name, family in families().items():
        arch = parse_arch(family.tiny_config)
        try:
            model = builder.build_model(arch, ParallelLayout(), torch.bfloat16)
            out["models"][name] = {k: getattr(model.config, k) for k in (
                "persist_layer_norm", "masked_softmax_fusion", "moe_grouped_gemm", "apply_rope_fusion")}
            out["models"][name]["core_attention"] = core_attention_of(model)
        except Exception as exc:  # reported per family, asserted in the test
            out["models"][name] = f"{type(exc).__name__}: {exc}"[:300]
        archs = [arch] + ([dataclasses.replace(arch, mtp_layers=1)] if family.builds_mtp else [])
        for a in archs:
            key = f"{name}+mtp" if a.mtp_layers else name
            try:
                out["skeletons"][key] = len(describe_model_here(a).chunks)
            except Exception as exc:
                out["skeletons"][key] = f"{type(exc).__name__}: {exc}"[:300]
    return out


@pytest.fixture(scope="module")
def fake_gpu_builds():
    return run_local(fake_gpu_build_worker, 1, timeout=600)[0]


@pytest.mark.slow
def test_every_family_builds_on_a_gpu_without_te(fake_gpu_builds):
    """megatron-core's local-spec RMSNorm (WrappedTorchNorm) asserts against persist_layer_norm, which
    had been set whenever CUDA was present: no model of any family could be built there."""
    r = fake_gpu_builds
    assert (r["cuda"], r["te"], r["fused_softmax"]) == (True, False, False)
    assert set(r["models"]) == set(families())
    for name, flags in r["models"].items():
        assert isinstance(flags, dict), (name, flags)
        # no fused softmax without Apex's kernel; no TE grouped GEMM or fused RoPE on the local spec; torch SDPA
        # is the core attention there (MLA's included)
        # (DeepSeek sparse attention is its own core attention: megatron's arithmetic, masked to its keys)
        # (DeepSeek-V4's attention computes its own scores: no core attention module)
        arch = parse_arch(families()[name].tiny_config)
        own = arch.family_config is not None and not arch.family_config.core_attention
        kernel = None if own else "unfused" if arch.sparse_attention is not None else "sdpa"
        assert flags == {"persist_layer_norm": False, "masked_softmax_fusion": False, "moe_grouped_gemm": False,
                         "apply_rope_fusion": False, "core_attention": kernel}, name


def test_converter_skeleton_builds_on_a_gpu_without_te(fake_gpu_builds):
    """The skeleton helper forces the local spec, so it broke on every GPU machine, TE or not."""
    skeletons = fake_gpu_builds["skeletons"]
    assert set(skeletons) == set(families()) | {f"{n}+mtp" for n, f in families().items() if f.builds_mtp}
    for name, chunks in skeletons.items():
        assert isinstance(chunks, int) and chunks > 10, (name, chunks)


@pytest.mark.parametrize("te,use_te,kernel", [(False, None, False), (True, False, False), (True, None, True),
                                              (True, False, True)])
def test_fusion_flags_follow_the_spec_built(monkeypatch, te, use_te, kernel):
    """On a GPU: persist_layer_norm and TE's grouped GEMM only for the TE spec (a TE machine still builds
    the local spec for the converter), the fused softmax only where Apex's kernel imports."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(builder, "te_available", lambda: te)
    monkeypatch.setattr(builder, "fused_softmax_available", lambda: kernel)
    arch = parse_arch(families()["qwen2_moe"].tiny_config)
    # RoPE fusion would insist on transformer-engine being installed here.
    config = builder.transformer_config(arch, ParallelLayout(), torch.bfloat16, use_te=use_te, apply_rope_fusion=False)
    te_spec = te if use_te is None else use_te
    assert config.persist_layer_norm is te_spec and config.moe_grouped_gemm is te_spec
    assert config.masked_softmax_fusion is kernel
    assert config.bias_activation_fusion and config.bias_dropout_fusion  # jit-fused in megatron-core: no kernel needed


def test_fused_softmax_ablation_is_skipped_without_apex_kernel(monkeypatch):
    """The align ablation turns masked_softmax_fusion on: without Apex's kernel it is skipped, with the reason."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(builder, "fused_softmax_available", lambda: False)
    reason = ablations.skip_reason(ablations.get("softmax_fused"))
    assert reason is not None and "scaled_masked_softmax_cuda" in reason
    monkeypatch.setattr(builder, "fused_softmax_available", lambda: True)
    # with the kernel but no transformer-engine the baseline runs SDPA, which has no softmax of its own to fuse
    monkeypatch.setattr(builder, "te_available", lambda: False)
    assert "no separate softmax" in ablations.skip_reason(ablations.get("softmax_fused"))
    monkeypatch.setattr(builder, "te_available", lambda: True)
    assert ablations.skip_reason(ablations.get("softmax_fused")) is None


# --- parity and alignment put the model and its inputs on the rank's device ---------------------------------

class _Recorder(torch.nn.Module):
    """Stands in for GPTModel on a device: records where its inputs are."""

    def __init__(self, config, vocab: int):
        from megatron.core.enums import ModelType

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.vocab = vocab
        self.weight = torch.nn.Parameter(torch.zeros(1, device=META))
        self.inputs = []

    def set_input_tensor(self, tensor):
        pass

    def forward(self, tokens, position_ids, attention_mask=None):
        self.inputs.append({"tokens": tokens.device.type, "positions": position_ids.device.type})
        return torch.zeros(*tokens.shape, self.vocab)


def placement_worker(hf_dir: str) -> dict:
    """Where the parity and alignment workers' models are when inference starts, with the meta device as this
    rank's device; and where forward_logits puts the tokens and positions."""
    from megatron_patch.align import capture, parity, runner
    from megatron_patch.models.blocks import inference
    from megatron_patch.runtime import distributed, init_model_parallel

    init_model_parallel(ParallelLayout())
    arch = parse_arch(hf_dir)
    tokens = parity.random_tokens(arch.vocab_size, seq=8)
    recorder = _Recorder(builder.transformer_config(arch, ParallelLayout()), arch.vocab_size)
    logits = inference.forward_logits(recorder, tokens, arch.vocab_size)
    out = {"inputs": recorder.inputs, "logits": logits.device.type}

    distributed.device = lambda: META  # stands for this rank's GPU
    real_forward = inference.forward_logits

    def record(model, toks, vocab_size):
        out.setdefault("models", []).append(sorted({t.device.type for t in [*model.parameters(), *model.buffers()]}))
        return torch.zeros(*toks.shape, vocab_size)

    users = (parity, capture)  # the modules that call forward_logits
    for module in users:
        module.forward_logits = record
    # align's embedding of every id calls the module itself: nothing a meta device could compute
    real_every_id, capture._embed_every_id = capture._embed_every_id, lambda *args, **kwargs: None
    try:
        parity.mcore_logits_worker([hf_dir], ParallelLayout(), [tokens])
        runner.mcore_capture_worker(ParallelLayout(), tokens, [runner.McoreRun("fp32", hf_dir=hf_dir)])
    finally:
        for module in users:
            module.forward_logits = real_forward
        capture._embed_every_id = real_every_id
    return out


@pytest.mark.slow
def test_parity_and_alignment_run_with_the_model_and_inputs_on_its_device(tmp_path):
    hf_dir = make_tiny_hf_checkpoint("llama3_1", tmp_path / "llama", seed=1)
    r = run_local(placement_worker, 1, str(hf_dir), timeout=600)[0]
    assert r["inputs"] == [{"tokens": "meta", "positions": "meta"}]  # moved to next(model.parameters()).device
    assert r["logits"] == "cpu"  # handed back to the host through the rank's queue
    # parity, then alignment: every parameter and buffer on the rank's device, the local spec's norms included
    assert r["models"] == [["meta"], ["meta"]]
