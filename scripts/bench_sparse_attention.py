#!/usr/bin/env python
"""DeepSeek sparse attention against dense attention: time and peak memory of one layer's core attention at
long sequences, forward without a gradient (a prefill, or a frozen model's step), in one run.

Each case runs in a fresh process (one rank), on random inputs shaped as multi-latent attention feeds its
core attention ([s, b, heads, qk dim] queries and keys, [s, b, heads, v dim] values; for the sparse case also
the layer input and the query latent its indexer reads), causal:

- ``sparse``: the family's ``SparseMLACoreAttention`` (models/blocks/sparse_attention.py) as a model builds it:
  the indexer scores 1024 queries at a time and keeps each one's top-k keys, the attention gathers them;
- ``unfused``: megatron-core's local ``DotProductAttention`` (what a CPU run of a dense MLA model uses: a
  [b, heads, s, s] score matrix); a case whose score matrix would not fit ``--max-gib`` is skipped, saying so;
- ``sdpa``: torch's scaled_dot_product_attention (its flash-style kernels, O(s) memory; values padded to the
  query width, as its CPU kernel asks).

Time: the median of --repeat passes after one warm-up. Peak memory: the resident set above what the process
held with its inputs (sampled every millisecond: ``bench_attention.measure``), or torch's peak allocation
on a GPU. Prints the load average before and after (a shared machine: compare within one run).

    python scripts/bench_sparse_attention.py [--device cpu|cuda] [--seq 4096,8192,16384] [--heads 4]
        [--topk 2048] [--index-heads 4] [--repeat 1] [--max-gib 6] [--json FILE]

The defaults keep DeepSeek-V3.2's per-head sizes (queries and keys 128 + 64 RoPE, values 128, an indexer head of
128 with RoPE on 64, top-2048) with fewer heads, so that the dense cases fit a shared CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_patch.runtime.distributed import ParallelLayout  # noqa: E402
from megatron_patch.runtime.launch import run_local  # noqa: E402
from scripts.bench_attention import measure  # noqa: E402

QK_NOPE, QK_ROPE, V_DIM, Q_LORA, INDEX_DIM = 128, 64, 128, 512, 128


def _config(heads: int, index_heads: int, topk: int, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1, hidden_size=heads * V_DIM, num_attention_heads=heads, multi_latent_attention=True,
        q_lora_rank=Q_LORA, kv_lora_rank=512, qk_head_dim=QK_NOPE, qk_pos_emb_head_dim=QK_ROPE, v_head_dim=V_DIM,
        kv_channels=V_DIM, rope_type="rope", rotary_base=10000, attention_dropout=0.0, hidden_dropout=0.0,
        attention_softmax_in_fp32=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, experimental_attention_variant="dsa", dsa_indexer_n_heads=index_heads,
        dsa_indexer_head_dim=INDEX_DIM, dsa_indexer_topk=topk, dsa_indexer_loss_coeff=0.0)


def case_worker(kind: str, seq: int, heads: int, index_heads: int, topk: int, dtype_name: str, repeat: int,
                device_name: str) -> dict:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from megatron_patch.models.blocks.local_attention import LocalMLACoreAttention
    from megatron_patch.models.blocks.sparse_attention import core_attention_spec
    from megatron_patch.runtime import init_model_parallel

    init_model_parallel(ParallelLayout())
    device = torch.device(device_name)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    config = _config(heads, index_heads, topk, dtype)
    qk, scale = QK_NOPE + QK_ROPE, (QK_NOPE + QK_ROPE) ** -0.5
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, k, v = rand(seq, 1, heads, qk), rand(seq, 1, heads, qk), rand(seq, 1, heads, V_DIM)
    x, qr = rand(seq, 1, config.hidden_size), rand(seq, 1, Q_LORA)
    causal = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=scale,
                  k_channels=qk, v_channels=V_DIM)
    if kind == "sparse":
        module = build_module(core_attention_spec(rope_interleaved=False), config=config, **causal).to(device).eval()

        def run():
            return module(q, k, v, None, x=x, qr=qr, attn_mask_type=AttnMaskType.causal)
    elif kind == "unfused":
        module = LocalMLACoreAttention(config, **causal).to(device).eval()

        def run():
            return module(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    else:
        v_padded = torch.nn.functional.pad(v, (0, qk - V_DIM))

        def run():
            out = torch.nn.functional.scaled_dot_product_attention(
                q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v_padded.permute(1, 2, 0, 3), is_causal=True,
                scale=scale)
            return out[..., :V_DIM]

    def step():
        with torch.no_grad():
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    seconds, extra = measure(step, device, repeat)
    return {"attention": kind, "seq": seq, "dtype": dtype_name, "seconds": seconds, "peak_extra_bytes": extra,
            "threads": torch.get_num_threads()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--seq", default="4096,8192,16384")
    ap.add_argument("--dtype", default=None, help="fp32 or bf16 (default: fp32 on CPU, bf16 on a GPU)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default 4 on CPU, 128 on a GPU)")
    ap.add_argument("--index-heads", type=int, default=None, help="indexer heads (default 4 on CPU, 64 on a GPU)")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--max-gib", type=float, default=6.0, help="skip an unfused case whose scores need more")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_sparse_attention.py: --device cuda and this machine has no GPU", file=sys.stderr)
        return 2
    gpu = args.device == "cuda"
    heads = args.heads or (128 if gpu else 4)
    index_heads = args.index_heads or (64 if gpu else 4)
    dtype = args.dtype or ("bf16" if gpu else "fp32")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed blocks returned: the RSS follows what is live
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    where = torch.cuda.get_device_name(0) if gpu else f"CPU ({torch.backends.cpu.get_cpu_capability()})"
    print(f"torch {torch.__version__} on {where}; {heads} heads (q/k {QK_NOPE}+{QK_ROPE}, v {V_DIM}), indexer "
          f"{index_heads} heads of {INDEX_DIM}, top-{args.topk}, batch 1, {dtype}, causal, forward without gradient, "
          f"median of {args.repeat}; load average {os.getloadavg()}", flush=True)
    itemsize = 4 if dtype == "fp32" else 2
    rows = []
    for seq in (int(s) for s in args.seq.split(",")):
        for kind in ("sparse", "sdpa", "unfused"):
            scores = heads * seq * seq * (4 + itemsize)  # the unfused attention's scores and fp32 softmax
            if kind == "unfused" and scores > args.max_gib * 2**30:
                print(f"  {seq:>6} tokens  {kind:<8} skipped: its [b, heads, s, s] scores need {scores / 2**30:.1f} GiB "
                      f"(> --max-gib {args.max_gib:g})", flush=True)
                continue
            r = run_local(case_worker, 1, kind, seq, heads, index_heads, args.topk, dtype, args.repeat, args.device,
                          timeout=3600)[0]
            rows.append(r)
            print(f"  {seq:>6} tokens  {kind:<8} {r['seconds'] * 1e3:10.1f} ms  peak +{r['peak_extra_bytes'] / 2**20:9.1f} "
                  f"MiB  ({r['threads']} threads)", flush=True)
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__, "heads": heads,
                                               "index_heads": index_heads, "topk": args.topk, "dtype": dtype,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
