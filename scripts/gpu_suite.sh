#!/usr/bin/env bash
# The GPU check-up, in phases that each fit one call on the lent GPU machine (docs/gpu.md gives the commands).
#
#   scripts/gpu_suite.sh [--phase 1|2|3|4|5|6|all] [--out DIR] [--wheels DIR] [--work DIR] [--only 'GLOB ...']
#                        [--budget SECONDS] [--dry-run]
#
# Phases (each installs and prepares what it needs, so each can start on a bare machine; a phase's step limits
# add up to its budget, and no step starts once the budget is spent):
#   1 checks  (330 s)  install, info, prepare, parity (fp32, every family), align (bf16, GPU_SUITE_ALIGN_FAMILIES:
#                      llama3_1 with the ablations and deepseek_v3), gpu-tests (pytest -m gpu; tests that need more
#                      GPUs skip themselves)
#   2 speed   (375 s)  install, info, prepare (corpus, layers), bench-attention (SDPA vs unfused on this GPU),
#                      Llama-3.1-8B-shaped training (as many layers as fit, at most GPU_SUITE_LAYERS_CAP): bf16,
#                      eager and compiled fusions (MP_COMPILE_FUSIONS), AC=full, OPTIMIZER_OFFLOAD: tokens/s,
#                      TFLOP/s, MFU, peak memory
#   3 te      (360 s)  transformer-engine only: fp8 with each recipe, TE's FlashAttention, AC=offload; on a
#                      machine without it every step is SKIPPED with the reason (do not spend a lent GPU on it)
#   4 sparse  (315 s)  install, info, prepare-v4 (a small DeepSeek-V4 with random weights: an HF checkpoint made here,
#                      converted with mpatch convert hf2mcore), train-v4 (trained from it through its launcher: tokens/s,
#                      peak memory; no TFLOP/s or MFU, which the FLOPs formula cannot count for V4's compressed
#                      attention), bench-sparse-attention (DeepSeek sparse attention against SDPA and unfused dense
#                      attention at 4k/8k/16k tokens, DeepSeek-V3.2's head counts, forward: time, peak memory)
#   5 fp8     (450 s)  without transformer-engine (docs/fp8.md): install (torchao's wheel too), info, prepare, then the
#                      Llama-3.1-8B-shaped training of phase 2 (at most 4 layers) for GPU_SUITE_FP8_ITERS (50) iterations
#                      with FL=true: bf16
#                      eager, bf16 compiled (MP_COMPILE), fp8 tensorwise compiled, fp8 rowwise compiled (torchao):
#                      tokens/s, TFLOP/s, MFU against 989 (useful FLOPs), peak memory, the attention kernel, the
#                      losses of every iteration (the summary compares fp8's with bf16's)
#   6 eval    (360 s)  issue 38's evaluation speed on a 1B-class model (scripts/bench_eval_1b.py): install (lm-eval's
#                      wheel too), info, prepare-1b (Llama-3.2-1B's shape with random weights, made on the GPU in bf16,
#                      converted with mpatch convert hf2mcore), eval-loglikelihood (the same hand-built requests
#                      through lm-eval's HF backend and through mpatch's lm-eval model, bf16, batch 8: requests/s
#                      and the ratio of the times), eval-generation (tokens/s, greedy, batch 1, with and without the
#                      KV cache after 128 and 1024 tokens)
#
# Install: each wheel in --wheels on its own (--no-deps) into WORK/site; a pinned package with no wheel there is
# skipped with the reason, and so is every step that needs it. Without --wheels the pins come from the package
# index. Pins: GPU_SUITE_PINS (default megatron-core==0.19.2, the cp312 wheel the lent machine gets, and torchao==0.18.0).
# Phase 6 also installs the wheels in WHEELS/eval and pins GPU_SUITE_EVAL_PINS (default lm-eval==0.4.13): lm-eval's
# wheel alone (9 MB, --no-deps) is enough for its HF backend and mpatch's model to score hand-built requests, since
# what it imports beyond itself (requests, jinja2, transformers, accelerate, ...) is on the lent machine; its declared
# dependencies (datasets, evaluate, scikit-learn, ...) serve tasks, which phase 6 does not read (docs/gpu.md). They
# live in a folder of their own so that the other phases neither install them nor spend time on them.
#
# Results: one tar per phase, OUT/gpu-suite-phaseN.tar.gz (summary.md, steps.tsv, logs/, info.json, train/,
# align/, parity.json, bench_attention.json, gpu-tests.xml, eval_*.json; at most 15 MiB), and
# OUT/gpu-suite-phaseN.md, a copy of its summary: two files per phase. OUT defaults to ./gpu-suite-results (ignored by git); WORK (inputs,
# installs, per-phase results before packing) to ${TMPDIR:-/tmp}/gpu-suite. A failing step is marked FAILED,
# loudly, and the suite goes on; it exits 1 if any step failed. A step whose need this machine lacks is SKIPPED
# with the reason and does not fail the suite.
#
# --budget SECONDS replaces each phase's budget, so that two phases fit one call on the lent machine (its 15
# minutes of device time leave one call of about 8 minutes and a rerun: --phase 1 --budget 200, then --phase 2
# --budget 240). A step still takes at most its own limit; the steps left when the budget is spent are FAILED
# as not run.
#
# --dry-run (CPU, what CI runs): simulates the lent machine (one H100 of 78 GiB, python3, megatron-core's local spec,
# no transformer-engine, only the wheels in --wheels), prints the plan and checks every step's command: launcher
# arguments validate and fit the memory plan (MP_DRY_RUN), mpatch arguments parse, inputs exist, the gpu tests
# collect. It prepares the small inputs for real, since the checks read them.
#
# Knobs (environment): GPU_SUITE_SEQ_LEN (4096), GPU_SUITE_GBS (4), GPU_SUITE_ITERS (6), GPU_SUITE_FP8_ITERS (50), GPU_SUITE_LAYERS (default:
# what fits), GPU_SUITE_LAYERS_CAP (8), GPU_SUITE_PINS, PYTHON (python3, else python).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HELPER="$ROOT/scripts/gpu_suite_steps.py"
PYTHON="${PYTHON:-$(command -v python3 || command -v python || echo python3)}"
PINS="${GPU_SUITE_PINS:-megatron-core==0.19.2 torchao==0.18.0}"
EVAL_PINS="${GPU_SUITE_EVAL_PINS:-lm-eval==0.4.13}"
OUT="$PWD/gpu-suite-results"
WORK="${TMPDIR:-/tmp}/gpu-suite"
WHEELS=""
DRY=0
PHASES="1 2 3 4 5 6"
ONLY=""
BUDGET_OVERRIDE=""
SEQ="${GPU_SUITE_SEQ_LEN:-4096}"
GBS="${GPU_SUITE_GBS:-4}"
ITERS="${GPU_SUITE_ITERS:-6}"
FP8_ITERS="${GPU_SUITE_FP8_ITERS:-50}"
LAYERS_CAP="${GPU_SUITE_LAYERS_CAP:-8}"
# One dense and one MoE (multi-latent attention) family: each alignment is a start of its own ranks.
ALIGN_FAMILIES="${GPU_SUITE_ALIGN_FAMILIES:-llama3_1 deepseek_v3}"
# Seconds each phase may take at most: one call on the lent machine runs at most 10 minutes (docs/gpu.md).
# Sized from the first run on the lent H100 (2026-11-27, docs/performance.md): a Llama-8B-shaped training step
# took 31-42 s (launch, spawned skeleton check, model build, 6 iterations), aligning deepseek_v3 50 s with the
# step's own imports, bench-attention 40 s for its first two cases (each case is a spawned process there).
# Phase 5 is sized from phase 2's measurements (a 6-iteration step: 31-42 s) plus compilation and 50 iterations;
# not yet run on the lent GPU. Phase 4's V4 steps (not yet run on a GPU either) are sized from CPU timings on the
# development machine (2 cores): prepare-v4 75 s: the whole step took 40 s there for the 440M-parameter model (the HF
# checkpoint 17 s: transformers' initialisation and the suite's redraw of the fp32 weights, which torch spreads over
# the lent machine's 16 cores, and writing 1.7 GB; the conversion to bf16 13 s; imports and the corpus the rest);
# train-v4 90 s: a 6-iteration training step of an 8-layer Llama-8B shape took 31-42 s on the H100 with launch and
# model build, and this model has a fifth of its parameters, though unfused attention (16 heads x 4096 x 5120 scores,
# a few TFLOP per iteration) and many small kernels (32 experts one by one without transformer-engine's grouped GEMM,
# the Sinkhorn steps): about 2x headroom. Phase 4 stays one call of under 6 minutes with its start-up and packing,
# so that a rerun fits in a session's 15 minutes of device time.
# Phase 6 is a phase of its own, since no other phase has 3 minutes to spare, and is sized to be one call of under
# 7 minutes with start-up and packing, so that a rerun fits (not yet run on a GPU): install 30 s (lm-eval's wheel
# unpacks 16,000 files: 4.5 s on the development machine's 2 cores); prepare-1b 90 s: the whole step took 103 s on
# the loaded 2-core development machine, 85 of them drawing 1.24B random weights on its CPU and writing 2.3 GB (the
# GPU draws them in under a second), the conversion 5.5 s; eval-loglikelihood 140 s: imports, each side's load of
# 2.3 GB, and about 550 requests a side at batch 8 (some 60 forwards of up to 8 x 1040 tokens, 20 TFLOP each at
# most: seconds on an H100); eval-generation 90 s: a load, then 4 x 66 generated tokens at some 10-30 ms each.
PHASE_BUDGET=([1]=330 [2]=375 [3]=360 [4]=315 [5]=450 [6]=360)

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --phase) case "${2:-}" in 1|2|3|4|5|6) PHASES="$2" ;; all) PHASES="1 2 3 4 5 6" ;;
               *) echo "gpu_suite.sh: --phase takes 1, 2, 3, 4, 5, 6 or all, got '${2:-}'" >&2; exit 2 ;; esac; shift ;;
    --out|--results) OUT="${2:?}"; shift ;;
    --work) WORK="${2:?}"; shift ;;
    --wheels) WHEELS="${2:?}"; shift ;;
    --only) ONLY="${2:?}"; shift ;;
    --budget) [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] && [ "$2" -le 600 ] \
                || { echo "gpu_suite.sh: --budget takes seconds from 1 to 600, got '${2:-}'" >&2; exit 2; }
              BUDGET_OVERRIDE="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_suite.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

command -v "$PYTHON" >/dev/null || { echo "gpu_suite.sh: no python3 (or python) on PATH: set PYTHON" >&2; exit 2; }
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || { echo "gpu_suite.sh: --wheels $WHEELS is not a folder" >&2; exit 2; }
[ -z "$WHEELS" ] || WHEELS="$(cd "$WHEELS" && pwd)"
mkdir -p "$OUT" "$WORK" || { echo "gpu_suite.sh: cannot create $OUT or $WORK" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
WORK="$(cd "$WORK" && pwd)"
SITE="$WORK/site"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
read -r GPUS FAMILIES < <("$PYTHON" -c 'import torch
from megatron_patch.models.description.registry import families
print(torch.cuda.device_count(), " ".join(families()))' 2>/dev/null)
[ -n "${FAMILIES:-}" ] || { echo "gpu_suite.sh: $PYTHON cannot import torch and megatron_patch" >&2; exit 2; }
if [ "$DRY" = 0 ] && [ "$GPUS" = 0 ]; then
  echo "gpu_suite.sh: no CUDA GPU here: run with --dry-run to check the plan on this machine" >&2
  exit 2
fi
# A dry run on a machine without a GPU checks every step as the lent machine would run it.
[ "$DRY" = 1 ] && [ "$GPUS" = 0 ] && export GPU_SUITE_SIMULATE=lent
helper() { "$PYTHON" "$HELPER" "$@"; }
mpatch() { "$PYTHON" -m megatron_patch "$@"; }

# --- the steps ---------------------------------------------------------------------------------------------
# "name|phase|time limit in seconds|function|argument|needs": the function runs the step (or, with --dry-run,
# checks it); needs (comma-separated) are checked first: mcore (megatron-core importable), te (transformer-engine
# usable), local (this machine builds megatron-core's local spec, i.e. no TE), torchao, lmeval (lm-eval importable).
# train modes: mode|PR|FL|AC|OPTIMIZER_OFFLOAD|extra environment
STEPS=()
for p in 1 2 3 4 5; do
  STEPS+=("install|$p|15|step_install||" "info|$p|10|step_info||")
done
STEPS+=("install|6|30|step_install||" "info|6|10|step_info||")  # lm-eval's wheel: 16,000 files to unpack
STEPS+=("prepare|1|30|step_prepare|checks|mcore" "parity|1|60|step_parity||mcore" "align|1|90|step_align||mcore"
        "gpu-tests|1|125|step_gpu_tests||mcore"
        "prepare|2|30|step_prepare|train|mcore" "bench-attention|2|60|step_bench_attention||mcore"
        "train-bf16|2|50|step_train|bf16|bf16|false|sel|false||mcore"
        "train-eager|2|45|step_train|eager|bf16|false|sel|false|MP_COMPILE_FUSIONS=false|mcore"
        "train-compiled|2|55|step_train|compiled|bf16|false|sel|false|MP_COMPILE_FUSIONS=true|mcore,local"
        "train-ac-full|2|50|step_train|ac-full|bf16|false|full|false|MP_AC_LAYERS=1|mcore"
        "train-optimizer-offload|2|60|step_train|optimizer-offload|bf16|false|sel|0.25||mcore"
        "prepare|3|35|step_prepare|train|mcore,te"
        "train-fp8-delayed|3|50|step_train|fp8-delayed|fp8|false|sel|false|MP_FP8_RECIPE=delayed|mcore,te"
        "train-fp8-tensorwise|3|50|step_train|fp8-tensorwise|fp8|false|sel|false|MP_FP8_RECIPE=tensorwise|mcore,te"
        "train-fp8-blockwise|3|50|step_train|fp8-blockwise|fp8|false|sel|false|MP_FP8_RECIPE=blockwise|mcore,te"
        "train-fp8-mxfp8|3|50|step_train|fp8-mxfp8|fp8|false|sel|false|MP_FP8_RECIPE=mxfp8|mcore,te"
        "train-fl-te|3|50|step_train|fl-te|bf16|true|sel|false|NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2|mcore,te"
        "train-ac-offload|3|50|step_train|ac-offload|bf16|false|offload|false|MP_AC_LAYERS=1|mcore,te"
        "prepare-v4|4|75|step_prepare_v4||mcore" "train-v4|4|90|step_train_v4||mcore"
        "bench-sparse-attention|4|125|step_bench_sparse_attention||mcore"
        "prepare|5|30|step_prepare|train|mcore"
        "train-bf16-eager-50|5|80|step_train|bf16-eager-50|bf16|true|sel|false||mcore,local"
        "train-bf16-compiled-50|5|105|step_train|bf16-compiled-50|bf16|true|sel|false|MP_COMPILE=true|mcore,local"
        "train-fp8-tensorwise-compiled|5|105|step_train|fp8-tensorwise-compiled|fp8|true|sel|false|MP_COMPILE=true MP_FP8_RECIPE=tensorwise|mcore,local,torchao"
        "train-fp8-rowwise-compiled|5|105|step_train|fp8-rowwise-compiled|fp8|true|sel|false|MP_COMPILE=true MP_FP8_RECIPE=rowwise|mcore,local,torchao"
        "prepare-1b|6|90|step_prepare_1b||mcore" "eval-loglikelihood|6|140|step_eval_loglikelihood||mcore,lmeval"
        "eval-generation|6|90|step_eval_generation||mcore")

# A step line's fields: name, phase, limit, function, the function's argument (train: the mode's 6 fields), needs.
parse_step() {
  IFS='|' read -r S_NAME S_PHASE S_LIMIT S_FN S_REST <<<"$1"
  S_NEEDS="${S_REST##*|}"
  S_ARG="${S_REST%|*}"
}

step_install() {
  local pins="$PINS" also=()
  if [ "$PHASE" = 6 ]; then  # lm-eval: its own folder of wheels, which the other phases leave alone
    pins="$PINS $EVAL_PINS"
    [ -n "$WHEELS" ] && also=(--also "$WHEELS/eval")
  elif [ "$DRY" = 1 ] && [ "$PHASE" != "${PHASES%% *}" ]; then
    echo "ok: as in phase ${PHASES%% *} (dry run)"
    return
  fi
  helper install --wheels "$WHEELS" ${also[@]+"${also[@]}"} --site "$SITE" --pins "$pins" $([ "$DRY" = 1 ] && echo --dry-run)
}

step_info() {
  local earlier; earlier=$(ls "$WORK"/phase*/info.json 2>/dev/null | head -n 1)
  if [ "$DRY" = 1 ] && [ -n "$earlier" ]; then
    cp "$earlier" "$RESULTS/info.json" && echo "ok: the same machine as ${earlier#$WORK/} (dry run)"
    return
  fi
  mpatch info --json >"$RESULTS/info.json" || return 1
  "$PYTHON" - "$RESULTS/info.json" <<'PY'
import json, sys
info = json.load(open(sys.argv[1]))
f = info["features"]
print(json.dumps(info, indent=1))
print(f"device {info['device']} {info['gpu'] or ''}; megatron-core {info['megatron_core']}; transformer-engine "
      f"{f['transformer_engine_version']}, fp8 {f['fp8']}, attention {f['attention']}")
PY
}

step_gpu_tests() {
  local files; files=$(cd "$ROOT" && grep -l "mark.gpu" tests/test_*.py | tr '\n' ' ')
  [ -n "$files" ] || { echo "no gpu-marked tests found under tests/"; return 1; }
  if [ "$DRY" = 1 ]; then
    (cd "$ROOT" && "$PYTHON" -m pytest -m gpu --collect-only -q -p no:cacheprovider $files) | tee /dev/stderr \
      | grep -Eq '^[1-9][0-9]*(/[0-9]+)? tests? collected' || { echo "no gpu-marked test collected"; return 1; }
    return
  fi
  # -m gpu: every test that needs a GPU; those that need more GPUs than this machine has skip themselves
  (cd "$ROOT" && "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs --junitxml="$RESULTS/gpu-tests.xml" $files)
}

step_prepare() {
  if [ "$1" = checks ]; then
    helper prepare --work "$WORK" --checkpoints
  else
    helper prepare --work "$WORK" --layers --seq "$SEQ" --gbs "$GBS" --cap "$LAYERS_CAP"
  fi
}

step_parity() {
  local f
  for f in $FAMILIES; do [ -f "$WORK/hf/$f/config.json" ] || { echo "missing $WORK/hf/$f (the prepare step makes it)"; return 1; }; done
  if [ "$DRY" = 1 ]; then echo "ok: would check fp32 parity of $(echo $FAMILIES | wc -w) families"; return 0; fi
  helper parity --work "$WORK" --json "$RESULTS/parity.json"
}

step_align() {
  local f
  if [ "$DRY" = 1 ]; then
    for f in $ALIGN_FAMILIES; do
      dry_check "align-$f" align --hf-dir "$WORK/hf/$f" --dtype bf16 --report-dir "$RESULTS/align/$f" \
        $([ "$f" = llama3_1 ] && echo --ablate) || return 1
    done
    return 0
  fi
  rm -rf "$RESULTS/align"
  helper align --work "$WORK" --out "$RESULTS/align" --ablate llama3_1 --families $ALIGN_FAMILIES
}

step_bench_attention() {
  if [ "$DRY" = 1 ]; then
    "$PYTHON" "$ROOT/scripts/bench_attention.py" --help >/dev/null && echo "arguments ok: scripts/bench_attention.py"
    return
  fi
  "$PYTHON" "$ROOT/scripts/bench_attention.py" --device cuda --seq 4096,8192 --dtype bf16 --repeat 5 \
    --json "$RESULTS/bench_attention.json"
}

step_bench_sparse_attention() {
  if [ "$DRY" = 1 ]; then
    "$PYTHON" "$ROOT/scripts/bench_sparse_attention.py" --help >/dev/null && echo "arguments ok: scripts/bench_sparse_attention.py"
    return
  fi
  "$PYTHON" "$ROOT/scripts/bench_sparse_attention.py" --device cuda --seq 4096,8192,16384 --repeat 3 --max-gib 40 \
    --json "$RESULTS/bench_sparse_attention.json"
}

# The small DeepSeek-V4 of issue 39 (gpu_suite_steps.py's V4_CONFIG: Flash's layers at a quarter of its width, 440M
# parameters): an HF checkpoint with random weights made on this machine, converted with mpatch convert hf2mcore, then
# trained from it through its launcher (MODEL_SIZE=auto: the checkpoint's architecture). A dry run makes and converts
# a narrow stand-in of it (V4_REDUCED) for real, and checks the memory plan of the GPU's size.
step_prepare_v4() {
  helper v4-checkpoint --work "$WORK" --seq "$SEQ" $([ "$DRY" = 1 ] && echo --reduced)
}

step_train_v4() {
  local out="$WORK/train/v4" ckpt="$WORK/v4/mcore"
  rm -rf "$out" "$RESULTS/train/v4.json"
  [ -f "$ckpt/mpatch_checkpoint.json" ] || { echo "missing $ckpt (the prepare-v4 step makes it)"; return 1; }
  # ETP and EP after CP (27 arguments); no recompute: V4's attention is its own module, which AC=sel's selective
  # recompute of megatron-core's core attention does not reach, and the memory plan then counts its s x s scores
  local args=(dsw auto 1 "$GBS" 1e-4 1e-5 "$SEQ" "$SEQ" bf16 1 1 1 1 1 false false false false false false 1000
              "$WORK/data/corpus_text_document" none "$ckpt" "$((ITERS * GBS * SEQ))" "$((GBS * SEQ))" "$out")
  local env=(GPUS_PER_NODE=1 MP_SAVE=false MP_EVAL_INTERVAL=0 PYTHON="$PYTHON")
  local launcher="$ROOT/examples/deepseek_v4/run_mcore_deepseek_v4.sh"
  if [ "$DRY" = 1 ]; then
    CHECK_ENV="${env[*]} MP_DRY_RUN=json GPU_SUITE_FULL_CONFIG=$WORK/v4/gpu-config.json" \
      dry_check train-v4 train deepseek_v4 "${args[@]}" || return 1
    [ "$COLLECT" = 1 ] || [ -x "$launcher" ] || { echo "$launcher is missing or not executable"; return 1; }
    return 0
  fi
  env "${env[@]}" bash "$launcher" "${args[@]}" || return 1
  [ -f "$out/log/throughput.json" ] || { echo "no $out/log/throughput.json: the run did not report throughput"; return 1; }
  helper train-summary "$out" "$RESULTS/train/v4.json" "$LOGS/train-v4.log" \
    "$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["num_hidden_layers"])' "$WORK/v4/hf/config.json")" \
    --model-config "$WORK/v4/hf/config.json"
}

# Issue 38's evaluation speed (scripts/bench_eval_1b.py): Llama-3.2-1B's shape with random weights, made on this GPU
# and converted with mpatch convert hf2mcore; lm-eval's HF backend and mpatch's lm-eval model on the same requests;
# generation with and without the KV cache. A dry run runs the same commands for real on a narrow stand-in, on CPU.
bench_eval_1b() { "$PYTHON" "$ROOT/scripts/bench_eval_1b.py" "$@" --work "$WORK/eval" $([ "$DRY" = 1 ] && echo --reduced); }
step_prepare_1b() { bench_eval_1b prepare; }
step_eval_loglikelihood() { bench_eval_1b loglikelihood --json "$RESULTS/eval_loglikelihood.json"; }
step_eval_generation() { bench_eval_1b generation --json "$RESULTS/eval_generation.json"; }

step_train() {
  local mode pr fl ac offload extra
  IFS='|' read -r mode pr fl ac offload extra <<<"$1"
  local layers; layers=$(cat "$WORK/layers" 2>/dev/null || echo 2)
  local out="$WORK/train/$mode"
  rm -rf "$out" "$RESULTS/train/$mode.json"
  # phase 5 compares fp8's losses with bf16's over 50 iterations, on at most 4 layers so that compiling and 50
  # iterations fit a step's limit
  local iters=$ITERS; [ "$PHASE" = 5 ] && iters=$FP8_ITERS && layers=$((layers < 4 ? layers : 4))
  local args=(dsw 8B 1 "$GBS" 1e-4 1e-5 "$SEQ" "$SEQ" "$pr" 1 1 1 false false "$fl" false "$ac" "$offload" 1000
              "$WORK/data/corpus_text_document" none none "$((iters * GBS * SEQ))" "$((GBS * SEQ))" "$out")
  local env=(GPUS_PER_NODE=1 MP_NUM_LAYERS="$layers" MP_SAVE=false MP_EVAL_INTERVAL=0 PYTHON="$PYTHON" $extra)
  local launcher="$ROOT/examples/llama3_1/run_mcore_llama3_1.sh"
  if [ "$DRY" = 1 ]; then
    # What the launcher runs (python -m megatron_patch train llama3_1 ARGS), with MP_DRY_RUN=json.
    CHECK_ENV="${env[*]} MP_DRY_RUN=json" dry_check "train-$mode" train llama3_1 "${args[@]}" || return 1
    [ "$COLLECT" = 1 ] || [ -x "$launcher" ] || { echo "$launcher is missing or not executable"; return 1; }
    return 0
  fi
  if [ "$pr" = fp8 ] && [ "$PHASE" = 3 ]; then  # transformer-engine's recipes (phase 5's are torchao's)
    local recipe="${extra#MP_FP8_RECIPE=}" why
    why=$("$PYTHON" -c 'import sys
from megatron_patch.runtime.machine import Capabilities
from megatron_patch.training.machine_checks import fp8_recipe_problem
print(fp8_recipe_problem(sys.argv[1], Capabilities.detect()) or "")' "$recipe") || return 1
    [ -n "$why" ] && { echo "SKIP: $why"; return 3; }
  fi
  env "${env[@]}" bash "$launcher" "${args[@]}" || return 1
  [ -f "$out/log/throughput.json" ] || { echo "no $out/log/throughput.json: the run did not report throughput"; return 1; }
  helper train-summary "$out" "$RESULTS/train/$mode.json" "$LOGS/train-$mode.log" "$layers"
}

# --dry-run checks each mpatch command line in one Python process (imports once, not once per step): the
# phase's first check queues every checked step's command (COLLECT=1: the step functions only queue), runs the
# queue, and each step reads its own line. The queue is made then, after the prepare step, whose layer count the
# training commands carry.
COLLECT=0
dry_check() {
  local step="$1"; shift
  if [ "$COLLECT" = 1 ]; then  # step, environment, arguments: tab-separated, the arguments by \x1f
    printf '%s\t%s\t%s\n' "$step" "${CHECK_ENV:-}" "$(IFS=$'\x1f'; echo "$*")" >>"$WORK/dry/queue.tsv"
    return 0
  fi
  if [ ! -f "$WORK/dry/results.tsv" ]; then
    mkdir -p "$WORK/dry" && : >"$WORK/dry/queue.tsv"
    COLLECT=1
    local s
    for s in "${STEPS[@]}"; do
      parse_step "$s"
      [ "$S_PHASE" = "$PHASE" ] && selected "$S_NAME" || continue
      case "$S_FN" in step_align|step_train|step_train_v4) missing_need "$S_NEEDS" >/dev/null && "$S_FN" "$S_ARG" >/dev/null ;; esac
    done
    COLLECT=0
    helper dry-check --queue "$WORK/dry/queue.tsv" --results "$WORK/dry/results.tsv" || return 1
  fi
  local verdict
  verdict=$(awk -F'\t' -v s="$step" '$1 == s { print $2 }' "$WORK/dry/results.tsv")
  echo "${verdict:-error: not checked}"
  [[ "$verdict" == ok:* ]]
}

# --- running them ------------------------------------------------------------------------------------------

selected() {
  [ -z "$ONLY" ] && return 0
  local pattern
  for pattern in $ONLY; do
    # shellcheck disable=SC2053
    [[ "$1" == $pattern ]] && return 0
  done
  return 1
}

missing_need() {  # prints the reason (and fails) when this machine lacks one of the step's needs
  local need reason
  [ -n "$1" ] || return 0
  [ -f "$WORK/needs.tsv" ] || helper needs --wheels "$WHEELS" ${WHEELS:+--also "$WHEELS/eval"} >"$WORK/needs.tsv" \
    || return 0
  for need in ${1//,/ }; do
    reason=$(awk -F'\t' -v n="$need" '$1 == n { print $2 }' "$WORK/needs.tsv")
    [ -z "$reason" ] && continue
    echo "$reason"
    return 1
  done
  return 0
}

run_step() {
  local name="$1" limit="$2" fn="$3" arg="$4" needs="$5"
  local log="$LOGS/$name.log" status note secs rc why left
  left=$((BUDGET - ($(date +%s) - PHASE_START)))
  if [ "$DRY" = 0 ] && [ "$left" -lt 10 ]; then
    status=FAILED; note="not run: phase $PHASE's ${BUDGET}s budget is spent"; secs=0
  elif ! why=$(missing_need "$needs"); then
    status=SKIPPED; note="$why"; secs=0
    echo "SKIP: $why" >"$log"
  else
    [ "$DRY" = 0 ] && [ "$left" -lt "$limit" ] && limit=$left
    # A dry run checks commands, not GPU timings: its first check runs the whole queue of them (imports,
    # every launcher's plan, the model shapes megatron-core is asked for on a cold cache).
    [ "$DRY" = 1 ] && limit=600
    local t0; t0=$(date +%s)
    # Each step in its own process, under its time limit; exit 3 means skipped (feature absent here).
    timeout --kill-after=15 "$limit" bash -c "$(declare -f); $(declare -p DRY PYTHON ROOT HELPER RESULTS WORK LOGS \
      WHEELS SITE PINS EVAL_PINS FAMILIES ALIGN_FAMILIES SEQ ITERS FP8_ITERS GBS LAYERS_CAP COLLECT STEPS PHASE PHASES ONLY 2>/dev/null); \
      export PYTHONPATH PYTHONUNBUFFERED; $fn \"\$1\"" _ "$arg" >"$log" 2>&1
    rc=$?
    # what a step installed can change what later steps have
    [ "$fn" = step_install ] && [ "$DRY" = 0 ] && rm -f "$WORK/needs.tsv"
    secs=$(($(date +%s) - t0))
    note=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-320 | tr '\t' ' ')
    if [ $rc -eq 0 ]; then status=$([ "$DRY" = 1 ] && echo "OK (dry run)" || echo PASSED)
    elif [ $rc -eq 3 ]; then status=SKIPPED; note=$(grep '^SKIP: ' "$log" | tail -n 1 | cut -c7-200)
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=FAILED; note="timed out after ${limit}s; $note"
    else status=FAILED; note="exit $rc; $note"
    fi
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "$note" >>"$RESULTS/steps.tsv"
  if [ "$status" = FAILED ]; then
    FAILED=$((FAILED + 1))
    printf '!!! FAILED  %-26s %4ss  %s (log: %s)\n' "$name" "$secs" "$note" "$log"
  else
    printf '    %-8s %-26s %4ss  %s\n' "$status" "$name" "$secs" "$note"
  fi
}

echo "GPU suite$([ "$DRY" = 1 ] && echo ' (dry run: checks each command on this machine, runs nothing on a GPU)')"
echo "python: $PYTHON; GPUs: $GPUS${GPU_SUITE_SIMULATE:+ (simulating the lent machine: one H100 of 78 GiB without transformer-engine)}"
echo "out: $OUT; work: $WORK; wheels: ${WHEELS:-none (pins from the package index)}"
FAILED=0
rm -f "$WORK/needs.tsv" "$WORK"/phase*/info.json
for PHASE in $PHASES; do
  BUDGET=${BUDGET_OVERRIDE:-${PHASE_BUDGET[$PHASE]}}
  PLANNED=0
  for s in "${STEPS[@]}"; do
    parse_step "$s"
    [ "$S_PHASE" = "$PHASE" ] && selected "$S_NAME" && PLANNED=$((PLANNED + S_LIMIT))
  done
  RESULTS="$WORK/phase$PHASE"
  LOGS="$RESULTS/logs"
  rm -rf "$RESULTS" && mkdir -p "$LOGS" "$RESULTS/train"
  echo "phase $PHASE: budget ${BUDGET}s, planned worst case ${PLANNED}s"
  [ "$PLANNED" -gt "$BUDGET" ] && echo "!!! phase $PHASE's step limits add up to ${PLANNED}s, over its ${BUDGET}s budget" >&2
  for s in "${STEPS[@]}"; do
    parse_step "$s"
    [ "$S_PHASE" = "$PHASE" ] && selected "$S_NAME" && printf '  %-28s limit %4ss\n' "$S_NAME" "$S_LIMIT"
  done
  rm -rf "$WORK/dry"
  printf 'step\tstatus\tseconds\tnote\n' >"$RESULTS/steps.tsv"
  PHASE_START=$(date +%s)
  for s in "${STEPS[@]}"; do
    parse_step "$s"
    [ "$S_PHASE" = "$PHASE" ] && selected "$S_NAME" || continue
    run_step "$S_NAME" "$S_LIMIT" "$S_FN" "$S_ARG" "$S_NEEDS"
  done
done
# Each phase's results: one tar and a copy of its summary in OUT.
helper pack --work "$WORK" --out "$OUT" --phases $PHASES $([ "$DRY" = 1 ] && echo --dry-run) || FAILED=$((FAILED + 1))

if [ "$FAILED" -gt 0 ]; then
  echo "!!! $FAILED step(s) FAILED: see the summaries in $OUT" >&2
  exit 1
fi
echo "all steps passed (or skipped with a reason): $OUT"
