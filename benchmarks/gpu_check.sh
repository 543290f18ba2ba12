#!/usr/bin/env bash
# leantune on one CUDA GPU, in under 8 minutes (an H100/H200-class card): every stage below,
# each timed, under its own timeout, independent of the others, its output in <out>/<stage>.log,
# and a summary table at the end (<out>/summary.txt, one JSON line in <out>/summary.json).
#
#   benchmarks/gpu_check.sh [--out DIR] [--only a,b] [--model NAME|PATH] [--budget S] [--dry-run]
#                            [--device cuda|cpu] [--set KEY=VALUE ...]
#
#   env         nvidia-smi, torch / CUDA / transformers / peft / bitsandbytes versions
#   gpu_tests   the `gpu`-marked tests (pytest -m gpu over the files that hold the marker)
#   bf16        `leantune train` on the demo data, train.precision=bf16, checked by run_check.py
#   fp16        the same in fp16: autocast + torch.amp.GradScaler("cuda"), the scaler's state
#               in the final checkpoint
#   qlora       bitsandbytes' CUDA 4-bit kernels (NF4 round trip on the GPU), a QLoRA run, and
#               benchmarks/qlora_speed.py (LoRA against QLoRA step time)
#   varlen      benchmarks/varlen_attention.py: segment attention against
#               torch.nn.attention.varlen (times, output and gradient differences)
#   ddp_nccl    torchrun --nproc-per-node=1, dist.strategy=ddp: the process group must be NCCL
#               (NCCL_DEBUG=INFO lines in the log)
#   vs_hf_135m  benchmarks/vs_hf.py against HF Trainer + PEFT at 135M (LoRA, 1 repetition)
#   vs_hf_0.5b  the same on random weights of Qwen2.5-0.5B's shape (benchmarks/scale.py's
#               build_model; vs_hf.py has no shape option of its own)
#
# PYTHON (default: .venv/bin/python if present, else python3) runs everything, with
# PYTHONPATH=src. Stages run in the order above; each gets the smaller of its own timeout and
# what is left of --budget (default 460 s), so the whole script stays under 8 minutes, and a
# stage with under 10 s left is reported as not run. Exit status: the number of stages that
# failed (0: all passed). --dry-run prints each stage's commands and runs none of them.
# --device cpu rehearses the training stages' commands on a CPU (a tiny --model, --set
# overrides for its data); the CUDA-only parts then fail or skip, each said in the summary.
set -u

cd "$(dirname "$0")/.." || exit 99
REPO=$PWD
OUT_DIR=""
ONLY=""
MODEL="smollm2-135m-instruct"
BUDGET=460
DRY=0
STAGE=""
DEVICE=cuda
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --device) DEVICE=$2; shift 2 ;;
        --set) EXTRA+=("$2"); shift 2 ;;
        --stage) STAGE=$2; shift 2 ;;  # internal: run one stage's body (under its timeout)
        -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 99 ;;
    esac
done
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
# $OUT is the device machine's folder for what comes back; runs/ otherwise.
OUT_DIR=${OUT_DIR:-${OUT:-runs}/gpu_check-$(date -u +%Y%m%dT%H%M%SZ)}
export PYTHON MODEL OUT_DIR DRY REPO
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
DEMO_CFG=src/leantune/configs/demo.yaml
# 30 demo steps of one packed 512-token row: enough to see the loss fall and the scaler act.
TRAIN=("train.device=$DEVICE" train.max_steps=30 train.save_every=0 train.eval_exact_match=false
       data.eval=null run.progress=false run.resume=never "model.path=$MODEL" ${EXTRA[@]+"${EXTRA[@]}"})

# In a dry run, print the command; otherwise run it (its status is the stage's).
run() {
    if [ "$DRY" = 1 ]; then
        printf '  $'; printf ' %q' "$@"; printf '\n'
        return 0
    fi
    printf '+'; printf ' %q' "$@"; printf '\n'
    "$@"
}

# ---------------------------------------------------------------------------------------------
# The stages' bodies: each a function, run in its own process under `timeout`

stage_env() {
    run nvidia-smi
    run "$PYTHON" -c '
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("transformers", "peft", "bitsandbytes", "accelerate"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # a missing optional package is a line, not a failure
        print(name, "not importable:", exc)
assert torch.cuda.is_available(), "no CUDA device: every other stage will fail or skip"
print(torch.cuda.get_device_name(), "bf16", torch.cuda.is_bf16_supported())
import torch.distributed as dist
print("nccl available", dist.is_nccl_available())
'
}

stage_gpu_tests() {
    local files
    mapfile -t files < <(grep -rl --include='*.py' 'pytest.mark.gpu' tests | sort)
    # -m gpu after the project's addopts (-m 'not slow and not gpu'): the last -m wins.
    run "$PYTHON" -m pytest -q -p no:cacheprovider -rs -m gpu "${files[@]}"
}

train_stage() {  # train_stage NAME PRECISION [run_check flags...]
    local name=$1 precision=$2
    shift 2
    run "$PYTHON" -m leantune train "$DEMO_CFG" "${TRAIN[@]}" "train.precision=$precision" \
        "run.dir=$OUT_DIR/runs/$name" \
        && run "$PYTHON" benchmarks/run_check.py "$OUT_DIR/runs/$name" --precision "$precision" "$@"
}

stage_bf16() { train_stage bf16 bf16; }

stage_fp16() { train_stage fp16 fp16 --scaler; }

stage_qlora() {
    local status=0
    run "$PYTHON" -c '
import bitsandbytes as bnb, torch
from bitsandbytes.functional import dequantize_4bit, quantize_4bit
x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
q, state = quantize_4bit(x, quant_type="nf4")
err = (dequantize_4bit(q, state) - x).abs().mean().item()
print("bitsandbytes", bnb.__version__, "nf4 round trip on", q.device, "mean abs error", round(err, 4))
assert q.is_cuda and err < 0.1
' || status=1
    run "$PYTHON" -m leantune train "$DEMO_CFG" "${TRAIN[@]}" method.name=qlora \
        "run.dir=$OUT_DIR/runs/qlora" \
        && run "$PYTHON" benchmarks/run_check.py "$OUT_DIR/runs/qlora" || status=1
    run "$PYTHON" benchmarks/qlora_speed.py --model "$MODEL" --steps 5 || status=1
    return $status
}

stage_varlen() { run "$PYTHON" benchmarks/varlen_attention.py --rows 4 --iters 20; }

stage_ddp_nccl() {
    # NCCL_DEBUG=INFO: NCCL's own lines in the log are the proof that the group is NCCL's.
    run env NCCL_DEBUG=INFO "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=1 \
        -m leantune train "$DEMO_CFG" "${TRAIN[@]}" train.max_steps=10 dist.strategy=ddp \
        "run.dir=$OUT_DIR/runs/ddp_nccl" \
        && run "$PYTHON" benchmarks/run_check.py "$OUT_DIR/runs/ddp_nccl"
}

VS_HF=(--methods lora --reps 1 --conversations 32 --heldout 8 --precision bf16)

stage_vs_hf_135m() {
    run "$PYTHON" benchmarks/vs_hf.py --model "$MODEL" "${VS_HF[@]}" --out "$OUT_DIR/vs_hf_135m"
}

stage_vs_hf_0.5b() {
    local model=$OUT_DIR/models/qwen2.5-0.5b-random
    run "$PYTHON" -c '
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import scale  # benchmarks/scale.py: random bf16 weights of a real shape, with the demo tokenizer
print(scale.build_model("0.5b", Path(sys.argv[1]), scale.ensure_demo_model()))
' "$model" && run "$PYTHON" benchmarks/vs_hf.py --model "$model" "${VS_HF[@]}" \
        --out "$OUT_DIR/vs_hf_0.5b"
}

STAGES=(env:45 gpu_tests:120 bf16:60 fp16:60 qlora:120 varlen:60 ddp_nccl:75 vs_hf_135m:150
        vs_hf_0.5b:180)
# What a stage's log must show, beyond its exit status.
declare -A EXPECT=([ddp_nccl]="NCCL INFO")

if [ -n "$STAGE" ]; then  # one stage's body, in the process `timeout` started
    "stage_$STAGE"
    exit $?
fi

# ---------------------------------------------------------------------------------------------
# The driver: each stage in its own process, timed, logged, summarised

mkdir -p "$OUT_DIR"
PASSED=(--out "$OUT_DIR" --model "$MODEL" --device "$DEVICE")  # what each stage's process gets
for e in ${EXTRA[@]+"${EXTRA[@]}"}; do PASSED+=(--set "$e"); done
echo "gpu_check: out $OUT_DIR, python $PYTHON, model $MODEL, budget ${BUDGET}s$([ "$DRY" = 1 ] && echo ', dry run')"
start=$(date +%s)
names=() results=() seconds=()
failed=0
for entry in "${STAGES[@]}"; do
    name=${entry%%:*}
    limit=${entry##*:}
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
        continue
    fi
    left=$((BUDGET - ($(date +%s) - start)))
    [ "$limit" -gt "$left" ] && limit=$left
    names+=("$name")
    if [ "$DRY" = 1 ]; then
        echo "== $name (timeout ${entry##*:}s)"
        "stage_$name"
        results+=("dry-run") seconds+=(0)
        continue
    fi
    if [ "$limit" -lt 10 ]; then
        echo "== $name: not run, ${left}s of the ${BUDGET}s budget left"
        results+=("not run (budget)") seconds+=(0)
        failed=$((failed + 1))
        continue
    fi
    log=$OUT_DIR/$name.log
    echo "== $name (timeout ${limit}s) -> $log"
    t0=$(date +%s%N)
    # The stage in a fresh process of this script, so that `timeout` can stop all of it.
    timeout --kill-after=10 "$limit" "$0" --stage "$name" "${PASSED[@]}" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    tenths=$((($(date +%s%N) - t0) / 100000000))
    seconds+=("$((tenths / 10)).$((tenths % 10))")
    expect=${EXPECT[$name]:-}
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        results+=("TIMEOUT after ${limit}s")
    elif [ "$status" -ne 0 ]; then
        results+=("FAILED (exit $status)")
    elif [ -n "$expect" ] && ! grep -q "$expect" "$log"; then
        results+=("FAILED (no '$expect' in the log)")
        status=1
    elif grep -q '"skipped"' "$log"; then
        results+=("skipped (see log)")
    else
        results+=("ok")
    fi
    [ "$status" -ne 0 ] && failed=$((failed + 1))
done

{
    echo
    echo "gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - start)) s in all)"
    printf '%-12s %8s  %s\n' stage seconds result
    for i in "${!names[@]}"; do
        printf '%-12s %8s  %s\n' "${names[$i]}" "${seconds[$i]}" "${results[$i]}"
    done
} | tee "$OUT_DIR/summary.txt"
"$PYTHON" - "$OUT_DIR/summary.json" "${#names[@]}" "${names[@]}" "${seconds[@]}" "${results[@]}" <<'EOF'
import json, sys
path, n = sys.argv[1], int(sys.argv[2])
names, secs, results = sys.argv[3:3 + n], sys.argv[3 + n:3 + 2 * n], sys.argv[3 + 2 * n:]
rows = [{"stage": a, "seconds": float(b), "result": c} for a, b, c in zip(names, secs, results)]
line = json.dumps({"benchmark": "gpu_check", "stages": rows})
open(path, "w").write(line + "\n")
print(line)
EOF
exit "$failed"
