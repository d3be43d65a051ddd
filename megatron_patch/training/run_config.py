"""What a launch resolves to: one typed ``RunConfig`` (``validation.resolve`` builds it from the launcher's
arguments), and the training precision as one value that knows what it implies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from megatron_patch.dtypes import Precision
from megatron_patch.models.description.registry import parse_arch
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.training.run_folder import CHECKPOINT_DIR

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.


PRECISIONS = tuple(p.value for p in Precision)


def no_gpu_problem(run_env: str) -> str:
    """What a GPU environment (ENV=dsw, or dlc on a GPU node) says on a machine without one."""
    return f"ENV={run_env} trains on GPUs and this machine has none: use ENV=cpu for a CPU run"


@dataclass
class RunConfig:
    """What a launch resolved to. Each field is filled by one launcher option (``launcher_options.OPTIONS``, whose
    entries hold the defaults) or derived from them (``launcher_options.DERIVED``); it has no default of its own
    here, so that no value is written twice."""

    launcher: str  # the name `mpatch train` took (each rank resolves the same arguments through it)
    family: str
    env: str
    model_size: str
    micro_batch_size: int
    global_batch_size: int
    lr: float
    min_lr: float
    seq_len: int
    pad_len: int
    precision: Precision
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int | None
    sequence_parallel: bool
    distributed_optimizer: bool
    flash_attention: bool
    sft: bool
    activation_checkpointing: str
    optimizer_offload_fraction: float  # static: share on the host; 0: off
    optimizer_offload_policy: str  # off | static | auto
    save_interval: int
    dataset_path: list[str]
    dataset_weights: list[float] | None
    valid_dataset_path: list[str] | None
    valid_dataset_weights: list[float] | None
    split: str | None  # MP_SPLIT: train,valid,test shares of DATASET_PATH (validation held out of it)
    pretrain_checkpoint: str | None
    train_iters: int
    warmup_iters: int
    lr_decay_iters: int  # the iteration the learning rate has decayed to MIN_LR by (lr_decay_steps)
    output_basepath: str
    dataset_type: str
    ac_layers: int
    # model chunks per pipeline rank, and the setting that asked for them ("MP_VP=2 (4 model chunks ...)")
    virtual_pipeline: int | None
    virtual_pipeline_setting: str | None
    sft_packing: bool
    sft_loss: str | None  # MP_SFT_LOSS: "record" (Pai's per-record mean) or "token"; None outside SFT
    pp0_layers: int | None
    fp8_recipe: str | None  # MP_FP8_RECIPE; None: the FP8 implementation's default (training/fp8_run.py)
    fp8_filter: str | tuple  # MP_FP8_FILTER: "auto", "all" or a tuple of kinds (torchao)
    tp_comm_overlap: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    world_size: int
    nproc_per_node: int
    nnodes: int
    # "cuda", or "cpu" for ENV=cpu and for ENV=dlc on nodes without a GPU (gloo, CPU limits)
    device: str
    max_restarts: int
    dist_timeout_min: float
    tokenizer: str | None
    moe_aux_loss: float | None  # MP_MOE_AUX_LOSS; None: megatron_settings.moe_aux_loss_coeff's default
    nan_policy: str
    loss_scale_window: int
    offload_numerics: str
    offload_margin_gb: float
    offload_patience: int
    offload_cooldown: int
    offload_chunk_mb: float | None
    offload_probe_script: str | None
    offload_timing: bool
    gpu_memory_gb: float | None
    compile_fusions: bool | None  # MP_COMPILE_FUSIONS; None: megatron-core's defaults
    compile_layers: bool  # MP_COMPILE: each decoder layer compiled, whole or its parts apart
    faults: list
    exit_interval: int | None
    log_interval: int
    eval_interval: int
    eval_iters: int
    # MP_EVAL_TASKS: lm-eval tasks evaluated on the live model every eval_tasks_interval iterations (None: none)
    eval_tasks: list[str] | None
    eval_tasks_interval: int
    eval_tasks_limit: float | int | None
    eval_include_path: str | None
    seed: int
    weight_decay: float
    save: bool
    # MP_NO_VERIFY: read PRETRAIN_CHECKPOINT_PATH and the run's own checkpoints without checking their manifests
    no_verify: bool
    hf_config: dict = field(repr=False)
    # The starting checkpoint's vocabulary padding, when another tool padded it otherwise (Arch).
    vocab_padded_to: int | None
    # The multi-token-prediction layers the starting checkpoint holds (hf2mcore --mtp), which train with the model.
    mtp_layers: int
    notes: list[str]
    # LoRA (MP_LORA_*): the adapters' spec (lora.spec.LoraSpec as a dict; None: full fine-tuning) and the
    # peft folder they start from (MP_LORA_INIT); set by the LoRA part once the model is known.
    lora: dict | None = None
    lora_init: str | None = None
    # DeepSeek sparse attention (MP_DSA_*; training/sparse_attention_run.py): {"loss_scale", "indexer_only"}, None
    # for a model without it.
    dsa: dict | None = None
    # The folder whose tokenizer PRETRAIN_CHECKPOINT_PATH carries: the iteration it loads where it names a run's
    # checkpoint/ folder (None: no checkpoint)
    checkpoint_tokenizer: str | None = None

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp, vp=self.virtual_pipeline)

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def sample_length(self) -> int:
        """PAD_LEN for SFT on JSON records; SEQ_LEN for pretraining and for an SFT idxmap (Pai's meaning)."""
        return self.pad_len if self.sample_length_name == "PAD_LEN" else self.seq_len

    @property
    def sample_length_name(self) -> str:
        """The launcher argument ``sample_length`` comes from, for messages."""
        return "PAD_LEN" if self.sft and self.dataset_type == "raw" else "SEQ_LEN"

    @property
    def tokens_per_gemm(self) -> int:
        """Rows of every linear layer's GEMM: a micro-batch's tokens on one context-parallel rank."""
        return self.micro_batch_size * self.sample_length // self.cp

    @property
    def arch(self):
        return dataclasses.replace(parse_arch(self.hf_config), vocab_padded_to=self.vocab_padded_to,
                                   mtp_layers=self.mtp_layers)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.output_basepath) / CHECKPOINT_DIR

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("hf_config")
        d["precision"] = self.precision.value
        return d
