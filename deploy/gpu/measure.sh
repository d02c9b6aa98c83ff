#!/usr/bin/env bash
# One prepared run on a GPU machine: install, build the 7B-shaped checkpoints, check, measure, profile.
#
#   OUT=/some/dir bash deploy/gpu/measure.sh [budget_s] [stage,...]
#
# Python packages the machine lacks travel as wheels in .whl/ (docs/contributing.md, "On a GPU machine").
# Stages run in order of importance, each under its own time limit and the whole under budget_s (default 480);
# a stage that would not fit is skipped and said so. Every stage's log and JSON lands in $OUT/results.tar.gz,
# re-packed after each stage, so what finished comes back even if the run is cut short; $OUT/stages.txt lists
# each stage's exit status and seconds.
set -u
OUT=${OUT:-results/gpu}
BUDGET=${1:-480}
ONLY=${2:-}
W=/tmp/gpu-run
mkdir -p "$OUT" "$W"
START=$(date +%s)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor EPD_CACHE_DIR=/tmp/epd-cache
M=/tmp/models

left() { echo $((BUDGET - ($(date +%s) - START))); }
pack() { tar -C "$W" -czf "$OUT/results.tar.gz" . 2>/dev/null; }
wanted() { [[ -z $ONLY || ",$ONLY," == *",$1,"* ]]; }
stage() {  # stage NAME LIMIT_S COMMAND...: runs COMMAND into $W/NAME.log under min(LIMIT_S, budget left - 15 s)
    local name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    local budget=$(($(left) - 15))
    if ((budget < 20)); then
        echo "$name skipped: $(left)s of the budget left" | tee -a "$OUT/stages.txt"
        return 0
    fi
    ((limit > budget)) && limit=$budget
    local t0=$(date +%s)
    echo "== $name (limit ${limit}s) $(date +%T)"
    timeout -k 5 "$limit" "$@" >"$W/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $(($(date +%s) - t0))s" | tee -a "$OUT/stages.txt"
    tail -n 4 "$W/$name.log"
    pack
}

# --- install: the repository (editable, no dependencies) over the machine's torch ---
if [[ -d .whl ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
# The repository runs from its root (every child is started as `python -m services.cli`).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
EPD=(python3 -m services.cli)
{
    nvidia-smi
    python3 -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__, torch.cuda.get_device_name())"
    nproc
} >"$W/machine.txt" 2>&1
cp "$W/machine.txt" "$OUT/"
echo "install done after $(($(date +%s) - START))s"

# --- checkpoints, built on the GPU in parallel; the CUDA token-exactness check runs beside them ---
build() { "${EPD[@]}" make-model --preset "$1" --out "$M/$1" >"$W/build-$1.log" 2>&1; echo "build $1 rc=$?" >>"$OUT/stages.txt"; }
wanted build && { build llava-1.5-7b-random & build qwen2.5-vl-7b-random & }
# float32 with TF32 off on CUDA: the engine (flex kernel, CUDA graphs) must equal generate() token for token.
stage exact-llava 100 "${EPD[@]}" bench engine --model tiny --device cuda --dtype float32 --quick \
    --skip generate_batch --skip static --skip engine_torch_linear --skip ttft --json "$W/exact-llava.json"
stage exact-qwen 100 "${EPD[@]}" bench engine --model qwen2.5-vl-tiny --device cuda --dtype float32 --quick \
    --skip generate_batch --skip static --skip engine_torch_linear --skip ttft --json "$W/exact-qwen.json"
wait
pack

# --- the 7B shapes: decode steps by batch size, a mixed step, profiles, the encoder ---
profile() {  # profile NAME MODEL
    stage "profile-$1" 170 python3 -m services.bench.step_profile --model "$2" --batches 1,16,64 --steps 24 \
        --out "$W/profile-$1"
}
offline() {  # offline NAME MODEL: 64 requests x 128 tokens, the engine alone
    stage "engine64-$1" 90 "${EPD[@]}" bench engine --model "$2" --num-requests 64 --output-len 128 --skip generate_batch \
        --skip generate --skip static --skip engine_torch_linear --skip ttft --json "$W/engine64-$1.json"
}
profile llava "$M/llava-1.5-7b-random"
if grep -q "rc=[1-9]" <(grep "^profile-llava " "$OUT/stages.txt"); then  # what eager costs, if the default refused
    stage profile-llava-eager 120 python3 -m services.bench.step_profile --model "$M/llava-1.5-7b-random" \
        --batches 1,64 --steps 16 --enforce-eager --no-encoder --out "$W/profile-llava-eager"
fi
offline llava "$M/llava-1.5-7b-random"
# Through epd up (encoder + PD on the one GPU): 16 and 64 streams, text only and 1 in 4 with an image.
stage serve-llava 170 "${EPD[@]}" bench compare --model "$M/llava-1.5-7b-random" --configs up --runs 1 \
    --workloads burst-16,burst-16-images,burst-64,burst-64-images --ready-timeout 150 --out "$W/serve-llava"
profile qwen "$M/qwen2.5-vl-7b-random"
offline qwen "$M/qwen2.5-vl-7b-random"
# The flex kernel's KV tile is the KV block: larger blocks, larger tiles (decode steps only).
for bs in 64 128; do
    stage "blocks$bs-llava" 80 python3 -m services.bench.step_profile --model "$M/llava-1.5-7b-random" \
        --batches 1,64 --steps 16 --block-size $bs --no-profile --no-mixed --no-encoder --out "$W/blocks$bs-llava"
done
stage serve-qwen 170 "${EPD[@]}" bench compare --model "$M/qwen2.5-vl-7b-random" --configs up --runs 1 \
    --workloads burst-16,burst-16-images,burst-64,burst-64-images --ready-timeout 150 --out "$W/serve-qwen"
for f in "$W"/profile-*/summary.json; do [[ -f $f ]] && cp "$f" "$OUT/$(basename "$(dirname "$f")").json"; done
pack
echo "done after $(($(date +%s) - START))s"
