#!/usr/bin/env bash
# The GPU check-up in one command: everything this project does that only a GPU can show, with numbers.
#
#   scripts/gpu_suite.sh [--results DIR] [--wheels DIR] [--skip-install] [--only 'GLOB ...'] [--dry-run]
#
# Steps (each with a time limit; all of them fit in 25 minutes on one H100):
#   install            the GPU extras at the exact versions below (skipped when already installed)
#   info               mpatch info --json: versions, GPU, which TE / FP8 / FlashAttention features are usable
#   gpu-tests          pytest -m gpu: the tests that need a GPU
#   prepare            tiny HF checkpoints of every family, a corpus, the layer count that fits this GPU
#   parity-FAMILY      fp32 logit parity of each family's tiny model with the transformer-engine spec
#   align-FAMILY       bf16 layer-by-layer alignment with the TE/fused ablations (report per family)
#   train-MODE         a Llama-3.1-8B-shaped model (as many layers as fit) trained a few iterations in bf16,
#                      fp8 with each recipe this GPU supports, FL=true (the attention kernel TE picked is
#                      logged), each AC mode and OPTIMIZER_OFFLOAD: tokens/s, TFLOP/s, MFU, peak memory
#   bench-convert      scripts/bench_convert.py, the conversion benchmark
#   bench-offload      (optional: only with --only, it needs its own ~15 minutes) scripts/bench_offload.py:
#                      OPTIMIZER_OFFLOAD static 0..1 against auto on Llama-3.1-8B, exact numerics on CPU+GPU
#                      tiers, megatron-core's own offload step counter after a load (docs/performance.md)
#
# Results go to DIR (default ./gpu-suite-results): summary.md (one table), steps.tsv, logs/STEP.log, info.json,
# train/MODE.json, align/FAMILY/, bench_convert.json; DIR/work holds what the steps make. A rerun
# redoes every step into the same folder. A failing step is marked FAILED, loudly, and the suite goes
# on; it exits 1 if any step failed. A step whose feature this GPU lacks (mxfp8 before Blackwell) is
# SKIPPED with the reason, and does not fail the suite.
#
# --dry-run (CPU, what CI runs): prints the plan and checks every step's command without a GPU:
# launcher arguments validate (MP_DRY_RUN), mpatch arguments parse, files and inputs exist, the gpu
# tests collect. It prepares the small inputs for real (tiny checkpoints, corpus), since the checks
# read them.
#
# --wheels DIR installs from local wheels only (a GPU machine without network). Knobs (environment):
# GPU_SUITE_SEQ_LEN (4096), GPU_SUITE_ITERS (6), GPU_SUITE_GBS (8), GPU_SUITE_LAYERS (default: what fits),
# GPU_SUITE_PINS (the packages to install), PYTHON (python).
set -uo pipefail

# The exact versions this suite was written against. megatron-core 0.19.2 is what pip gives the lent GPU
# machine's Python 3.12 (a 2.4 MB cp312 wheel to carry), and a tested combination (README).
# GPU_SUITE_PINS replaces the list (e.g. transformer-engine[pytorch,core_cu13] for a CUDA 13 torch).
read -r -a PINS <<<"${GPU_SUITE_PINS:-megatron-core==0.19.2 transformer-engine[pytorch]==2.10.0 flash-attn==2.8.3}"
BUDGET_S=1500  # 25 minutes

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
RESULTS="$PWD/gpu-suite-results"
WHEELS=""
DRY=0
SKIP_INSTALL=0
ONLY=""
SEQ="${GPU_SUITE_SEQ_LEN:-4096}"
ITERS="${GPU_SUITE_ITERS:-6}"
GBS="${GPU_SUITE_GBS:-8}"

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --results) RESULTS="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --skip-install) SKIP_INSTALL=1 ;;
    --only) ONLY="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_suite.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

mkdir -p "$RESULTS" || { echo "gpu_suite.sh: cannot create $RESULTS" >&2; exit 2; }
RESULTS="$(cd "$RESULTS" && pwd)"
WORK="$RESULTS/work"
LOGS="$RESULTS/logs"
mkdir -p "$WORK" "$LOGS" "$RESULTS/train"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mpatch() { "$PYTHON" -m megatron_patch "$@"; }
START=$(date +%s)

# --- the steps ---------------------------------------------------------------------------------------------
# Each step is "name|time limit in seconds|function|argument"; the function runs it (or, with
# --dry-run, checks it). Families and their tiny models come from the registry, never listed here.
FAMILIES=$("$PYTHON" -c 'from megatron_patch.models.registry import families; print(" ".join(families()))') \
  || { echo "gpu_suite.sh: cannot import megatron_patch with $PYTHON" >&2; exit 2; }
# mode|PR|FL|AC|OPTIMIZER_OFFLOAD|extra environment
TRAIN_MODES=(
  "bf16|bf16|false|sel|false|"
  "fp8-delayed|fp8|false|sel|false|MP_FP8_RECIPE=delayed"
  "fp8-tensorwise|fp8|false|sel|false|MP_FP8_RECIPE=tensorwise"
  "fp8-blockwise|fp8|false|sel|false|MP_FP8_RECIPE=blockwise"
  "fp8-mxfp8|fp8|false|sel|false|MP_FP8_RECIPE=mxfp8"
  "fl|bf16|true|sel|false|NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2"
  "ac-none|bf16|false|none|false|"
  "ac-full|bf16|false|full|false|MP_AC_LAYERS=1"
  "ac-offload|bf16|false|offload|false|MP_AC_LAYERS=1"
  "optimizer-offload|bf16|false|sel|auto|"
)
# Limits: what each step may take at most on one H100 (they add up to the 25-minute budget).
STEPS=("install|90|step_install|" "info|30|step_info|" "gpu-tests|150|step_gpu_tests|" "prepare|60|step_prepare|")
for f in $FAMILIES; do STEPS+=("parity-$f|25|step_parity|$f"); done
for f in $FAMILIES; do STEPS+=("align-$f|40|step_align|$f"); done
for m in "${TRAIN_MODES[@]}"; do STEPS+=("train-${m%%|*}|55|step_train|$m"); done
STEPS+=("bench-convert|120|step_bench|")
# Optional steps run only when --only names them: they would not fit the budget above.
OPTIONAL_STEPS=("bench-offload|1500|step_bench_offload|")

# The sum of the limits is the worst case, and must stay inside the budget.
PLANNED=0
for s in "${STEPS[@]}"; do IFS='|' read -r _ limit _ _ <<<"$s"; PLANNED=$((PLANNED + limit)); done

step_install() {
  if [ "$DRY" = 1 ]; then
    "$PYTHON" -m pip --version || return 1
    [ -z "$WHEELS" ] || [ -d "$WHEELS" ] || { echo "--wheels $WHEELS is not a folder"; return 1; }
    printf 'would install: %s%s\n' "${PINS[*]}" "${WHEELS:+ from $WHEELS}"
    return 0
  fi
  [ "$SKIP_INSTALL" = 1 ] && { echo "SKIP: --skip-install"; return 3; }
  local missing=()
  for pin in "${PINS[@]}"; do
    local name="${pin%%==*}"; name="${name%%\[*}"
    local have; have=$("$PYTHON" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    if [ "$have" = "${pin##*==}" ]; then echo "present: $name $have"; else missing+=("$pin"); fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local from=()
  [ -n "$WHEELS" ] && from=(--no-index --find-links "$WHEELS")
  # --no-build-isolation: flash-attn and transformer-engine build against the torch already installed.
  "$PYTHON" -m pip install --no-build-isolation "${from[@]}" "${missing[@]}"
}

step_info() {
  mpatch info --json >"$RESULTS/info.json" || return 1
  "$PYTHON" - "$RESULTS/info.json" <<'PY'
import json, sys
info = json.load(open(sys.argv[1]))
f = info["features"]
print(json.dumps(info, indent=1))
print(f"device {info['device']} {info['gpu'] or ''}; transformer-engine {f['transformer_engine_version']}, "
      f"fp8 {f['fp8']}, FlashAttention-2 {f['flash_attention_2']}, FlashAttention-3 {f['flash_attention_3']}")
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
  (cd "$ROOT" && "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$RESULTS/gpu-tests.xml" $files)
}

step_prepare() {
  # Small inputs shared by the later steps, made once per results folder (a marker says they are complete);
  # the layer count is worked out afresh each time, for the GPU at hand.
  if [ ! -f "$WORK/.prepared" ]; then
    rm -rf "$WORK/hf" "$WORK/data"
    "$PYTHON" - "$WORK" "$FAMILIES" <<'PY' || return 1
import json, sys
from pathlib import Path
from megatron_patch.models.tiny import make_tiny_hf_checkpoint
from megatron_patch.training.preprocess import preprocess
from megatron_patch.training.demo_data import make_texts, make_tokenizer

work, families = Path(sys.argv[1]), sys.argv[2].split()
for f in families:
    make_tiny_hf_checkpoint(f, work / "hf" / f, seed=0)
texts = make_texts(1000, seed=0)  # megatron's dataset repeats it for as many samples as training reads
tok = make_tokenizer(work / "data" / "tokenizer", texts, vocab_size=200)
with open(work / "data" / "corpus.jsonl", "w") as out:
    for t in texts:
        out.write(json.dumps({"text": t}) + "\n")
report = preprocess(work / "data" / "corpus.jsonl", str(work / "data" / "corpus"), tok, progress=False)
(work / ".prepared").write_text(f"tiny checkpoints of {', '.join(families)}; corpus {report.output_prefix}\n")
PY
  fi
  cat "$WORK/.prepared"
  "$PYTHON" - "$WORK" "${GPU_SUITE_LAYERS:-}" "$SEQ" <<'PY'
import sys
from pathlib import Path

work, layers, seq = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if layers:
    why = f"{layers} layers (GPU_SUITE_LAYERS)"
else:
    # Llama-3.1-8B's shape with as many layers as fit: per parameter bf16 weight + fp32 grad + fp32 master
    # + Adam's two moments = 18 bytes; activations ~1 GiB per layer per 4096 tokens (selective recompute),
    # logits ~6 GiB; 85% of the GPU's memory usable.
    import torch
    from megatron_patch.models.registry import parse_arch
    from megatron_patch.training.launcher_args import presets

    from megatron_patch.models.shape import model_shape

    arch = parse_arch(presets("llama3_1")["8B"])
    shape = model_shape(arch)  # parameter counts from megatron-core's own layers
    per_layer = shape.layer_params("dense")
    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory
        scale = seq / 4096
        fixed = (shape.params() - arch.num_layers * per_layer) * 18 + 6 * 2**30 * scale
        layers = max(1, min(arch.num_layers, int((0.85 * memory - fixed) // (per_layer * 18 + 2**30 * scale))))
        why = f"{layers} of {arch.num_layers} layers fit in {memory / 2**30:.0f} GiB"
    else:
        layers, why = 2, "no GPU here: 2 layers"
(work / "layers").write_text(f"{layers}\n")
print(f"training model: Llama-3.1-8B shape, {why}")
PY
}

# --dry-run checks each mpatch command line in one Python process (imports once, not once per step):
# COLLECT=1 queues a step's command, the first check after that runs the queue, each step reads its line.
COLLECT=0
dry_check() {
  local step="$1"; shift
  if [ "$COLLECT" = 1 ]; then
    "$PYTHON" -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "env": dict(a.split("=", 1) for a in
      sys.argv[2].split()), "argv": sys.argv[3:]}))' "$step" "${CHECK_ENV:-}" "$@" >>"$WORK/dry/queue.jsonl"
    return 0
  fi
  if [ ! -f "$WORK/dry/results.json" ]; then
    "$PYTHON" - "$WORK/dry" <<'PY' || return 1
import contextlib, io, json, os, sys
from pathlib import Path
from megatron_patch.cli import main

folder = Path(sys.argv[1])
results = {}
for line in (folder / "queue.jsonl").read_text().splitlines():
    check = json.loads(line)
    saved = dict(os.environ)
    os.environ.update(check["env"])
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            argv = check["argv"]
            # mpatch train runs in-process with MP_DRY_RUN=json (what the launcher executes); any other
            # command is only parsed.
            if argv[0] == "train":
                code = main(argv)
            else:
                from megatron_patch.cli import build_parser
                build_parser().parse_args(argv)
                code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if code != 0:
        results[check["step"]] = f"error (exit {code}): " + (err.getvalue().strip().splitlines() or ["?"])[-1]
    elif argv[0] == "train":
        r = json.loads(out.getvalue())
        results[check["step"]] = (f"ok: {r['model']['num_layers']} layers, attention {r['attention_kernel']}, "
                                  f"{r['resolved']['train_iters']} iterations; on this machine: "
                                  + ("; ".join(r["machine_problems"]) or "runnable"))
    else:
        results[check["step"]] = "ok: mpatch " + " ".join(argv)
(folder / "results.json").write_text(json.dumps(results, indent=1))
PY
  fi
  local verdict
  verdict=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1])).get(sys.argv[2], "error: not checked"))' \
    "$WORK/dry/results.json" "$step")
  echo "$verdict"
  [[ "$verdict" == ok:* ]]
}

step_parity() {
  local hf="$WORK/hf/$1"
  if [ "$DRY" = 1 ]; then dry_check "parity-$1" parity --hf-dir "$hf" --json || return 1; fi
  [ -f "$hf/config.json" ] || { echo "missing $hf/config.json (the prepare step makes it)"; return 1; }
  [ "$DRY" = 1 ] && return 0
  mpatch parity --hf-dir "$hf" --json
}

step_align() {
  local hf="$WORK/hf/$1" out="$RESULTS/align/$1"
  local args=(align --hf-dir "$hf" --dtype bf16 --ablate --report-dir "$out")
  if [ "$DRY" = 1 ]; then dry_check "align-$1" "${args[@]}" || return 1; fi
  [ -f "$hf/config.json" ] || { echo "missing $hf/config.json (the prepare step makes it)"; return 1; }
  [ "$DRY" = 1 ] && return 0
  rm -rf "$out"
  mpatch "${args[@]}"
}

step_train() {
  local mode pr fl ac offload extra
  IFS='|' read -r mode pr fl ac offload extra <<<"$1"
  local layers; layers=$(cat "$WORK/layers" 2>/dev/null || echo 2)
  local out="$WORK/train/$mode"
  rm -rf "$out" "$RESULTS/train/$mode.json"
  # 25 positional arguments: ENV=dsw on this one GPU, Llama-3.1-8B's shape, random init, no checkpoints.
  local args=(dsw 8B 1 "$GBS" 1e-4 1e-5 "$SEQ" "$SEQ" "$pr" 1 1 1 false false "$fl" false "$ac" "$offload" 1000
              "$WORK/data/corpus_text_document" none none "$((ITERS * GBS * SEQ))" "$((GBS * SEQ))" "$out")
  local env=(GPUS_PER_NODE=1 MP_NUM_LAYERS="$layers" MP_SAVE=false MP_EVAL_INTERVAL=0 PYTHON="$PYTHON" $extra)
  local launcher="$ROOT/examples/llama3_1/run_mcore_llama3_1.sh"
  if [ "$DRY" = 1 ]; then
    # What the launcher runs (python -m megatron_patch train llama3_1 ARGS), with MP_DRY_RUN=json.
    CHECK_ENV="${env[*]} MP_DRY_RUN=json" dry_check "train-$mode" train llama3_1 "${args[@]}" || return 1
    [ "$COLLECT" = 1 ] || [ -x "$launcher" ] || { echo "$launcher is missing or not executable"; return 1; }
    return 0
  fi
  if [ "$pr" = fp8 ]; then
    local recipe="${extra#MP_FP8_RECIPE=}" why
    why=$("$PYTHON" -c 'import sys
from megatron_patch.runtime.machine import Capabilities
from megatron_patch.training.machine_checks import fp8_recipe_problem
print(fp8_recipe_problem(sys.argv[1], Capabilities.detect()) or "")' "$recipe") || return 1
    [ -n "$why" ] && { echo "SKIP: $why"; return 3; }
  fi
  env "${env[@]}" bash "$launcher" "${args[@]}" || return 1
  [ -f "$out/log/throughput.json" ] || { echo "no $out/log/throughput.json: the run did not report throughput"; return 1; }
  "$PYTHON" - "$out" "$RESULTS/train/$mode.json" "$LOGS/train-$mode.log" "$layers" <<'PY'
import json, re, sys
from pathlib import Path
out, dest, log, layers = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
summary = json.loads((out / "log" / "throughput.json").read_text())
summary["layers"] = layers
# transformer-engine's own word on the attention backend it chose (NVTE_DEBUG, FL run), when logged.
picked = [l.strip() for l in log.read_text(errors="replace").splitlines() if re.search(r"[Ss]elected backend|backend =", l)]
summary["attention_backend_log"] = picked[-1][-160:] if picked else None
dest.write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary))
PY
}

step_bench_offload() {
  if [ "$DRY" = 1 ]; then
    "$PYTHON" "$ROOT/scripts/bench_offload.py" --dry-run --out "$WORK/bench-offload" | tail -n 20
    return "${PIPESTATUS[0]}"
  fi
  "$PYTHON" "$ROOT/scripts/bench_offload.py" --out "$RESULTS/bench-offload"
}

step_bench() {
  if [ "$DRY" = 1 ]; then
    "$PYTHON" "$ROOT/scripts/bench_convert.py" --help >/dev/null && echo "arguments ok: scripts/bench_convert.py"
    return
  fi
  # One pass, warm cache, 1 and 8 workers: what fits the step's limit, and the scaling a node's cores allow.
  "$PYTHON" "$ROOT/scripts/bench_convert.py" --cache warm --workers 1,8 --repeat 1 --json "$RESULTS/bench_convert.json"
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

if [ -n "$ONLY" ]; then
  for s in "${OPTIONAL_STEPS[@]}"; do selected "${s%%|*}" && STEPS+=("$s"); done
fi

echo "GPU suite$([ "$DRY" = 1 ] && echo ' (dry run: checks each command on this machine, runs nothing on a GPU)')"
echo "results: $RESULTS; budget ${BUDGET_S}s, planned worst case ${PLANNED}s"
echo "plan:"
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit fn arg <<<"$s"
  selected "$name" && printf '  %-28s limit %4ss\n' "$name" "$limit"
done
if [ "$PLANNED" -gt "$BUDGET_S" ]; then
  echo "!!! the steps' limits add up to ${PLANNED}s, over the ${BUDGET_S}s budget" >&2
fi

if [ "$DRY" = 1 ]; then
  rm -rf "$WORK/dry" && mkdir -p "$WORK/dry" && : >"$WORK/dry/queue.jsonl"
  COLLECT=1
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit fn arg <<<"$s"
    case "$fn" in step_parity|step_align|step_train) selected "$name" && "$fn" "$arg" >/dev/null ;; esac
  done
  COLLECT=0
fi

printf 'step\tstatus\tseconds\tnote\n' >"$RESULTS/steps.tsv"
FAILED=0
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit fn arg <<<"$s"
  selected "$name" || continue
  log="$LOGS/$name.log"
  left=$((BUDGET_S - ($(date +%s) - START)))
  if [ "$DRY" = 0 ] && [ "$left" -lt 10 ]; then
    status=FAILED; note="not run: the ${BUDGET_S}s budget is spent"; secs=0
  else
    [ "$DRY" = 0 ] && [ "$left" -lt "$limit" ] && limit=$left
    # A dry run checks commands, not GPU timings: its first check runs the whole queue of them (imports,
    # every launcher's plan, the model shapes megatron-core is asked for on a cold cache).
    [ "$DRY" = 1 ] && limit=600
    t0=$(date +%s)
    # Each step in its own process, under its time limit; exit 3 means skipped (feature absent here).
    timeout --kill-after=15 "$limit" bash -c "$(declare -f); $(declare -p DRY PYTHON ROOT RESULTS WORK LOGS WHEELS \
      SKIP_INSTALL FAMILIES SEQ ITERS GBS PINS COLLECT 2>/dev/null); export PYTHONPATH PYTHONUNBUFFERED; $fn \"\$1\"" _ "$arg" \
      >"$log" 2>&1
    rc=$?
    secs=$(($(date +%s) - t0))
    note=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200 | tr '\t' ' ')
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
done

# --- the summary -------------------------------------------------------------------------------------------
"$PYTHON" - "$RESULTS" "$DRY" "$FAILED" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" <<'PY'
import csv, json, subprocess, sys
from pathlib import Path

results, dry, failed, when = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]
rows = list(csv.DictReader(open(results / "steps.tsv"), delimiter="\t"))
info = json.loads((results / "info.json").read_text()) if (results / "info.json").is_file() else {}
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip() or "none"
except (OSError, subprocess.SubprocessError):
    smi = "none (no nvidia-smi)"
lines = [f"# GPU suite {'dry run ' if dry else ''}{when}", ""]
lines.append(f"**{failed} step(s) FAILED**" if failed else "All steps passed (or were skipped with a reason).")
lines += ["", f"- GPU: {smi}",
          f"- versions: " + ", ".join(f"{k} {info.get(k)}" for k in ("python", "torch", "megatron_core", "transformers")),
          f"- transformer-engine {info.get('features', {}).get('transformer_engine_version')}; "
          f"features {json.dumps({k: v for k, v in info.get('features', {}).items() if k != 'transformer_engine_version'})}",
          "", "| step | status | s | result |", "| --- | --- | ---: | --- |"]
for r in rows:
    status = f"**{r['status']}**" if r["status"] == "FAILED" else r["status"]
    result = r["note"].replace("|", "/")
    train = results / "train" / f"{r['step'][len('train-'):]}.json"
    if r["step"].startswith("train-") and train.is_file():
        t = json.loads(train.read_text())
        mfu = f"{t['mfu']:.1%}" if t.get("mfu") is not None else "n/a"
        result = (f"{t['layers']} layers: {t['tokens_per_s']:.0f} tokens/s, {t['tflops_per_gpu']:.1f} TFLOP/s, "
                  f"MFU {mfu}, peak {t['peak_memory_gib']:.1f} GiB (iterations {t['iterations'][0]}-{t['iterations'][1]})")
        if t.get("attention_backend_log"):
            result += f"; TE: {t['attention_backend_log']}"
    lines.append(f"| {r['step']} | {status} | {r['seconds']} | {result} |")
lines += ["", "Logs: logs/STEP.log; training throughput excludes the warm-up iteration (train/MODE.json)."]
(results / "summary.md").write_text("\n".join(lines) + "\n")
print(f"summary: {results / 'summary.md'}")
PY

if [ "$FAILED" -gt 0 ]; then
  echo "!!! $FAILED step(s) FAILED: see $RESULTS/summary.md" >&2
  exit 1
fi
echo "all steps passed (or skipped with a reason): $RESULTS/summary.md"
