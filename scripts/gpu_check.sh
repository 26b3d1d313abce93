#!/usr/bin/env bash
# The GPU check: on a fresh GPU machine with no network, in one command of under ten minutes,
#   kernels  the kernel tests compiled for the GPU (bf16 included) against their torch twins, and
#            the one-kernel norms, RoPE and SiLU (test_cuda_ops) in a model;
#   engine   the engine on CUDA against transformers, and the compiled Triton backend against
#            the torch one (the tests marked gpu in test_engine_equivalence/test_engine_triton);
#            decode graphs, and steps launched ahead against steps one at a time (those in
#            test_cuda_graphs/test_async_scheduling); deterministic inference on the Triton
#            path (test_deterministic_triton.py);
#   graphs   python -m benchmarks.step.cuda_graphs: decode steps with CUDA graphs against eager
#            ones (first on the tree `make gpu-carry BASE=COMMIT` carried, where it did);
#   realshape python -m benchmarks.step.real_shape: Llama-3.1-8B's shape with random weights made
#            on the device: its decode step at batch 1/8/32/64 beside the weight floor measured in
#            the same run, its prefill TFLOP/s beside the bf16 peak, and where the device's
#            time goes in the decode steps of batch 1 and 8 and a 512-token prefill, by kernel;
#   serving  pdserve up with one prefill and one decode worker sharing the GPU, each given
#            --gpu-memory-utilization 0.4 of it, then W1 of benchmarks.serving.load against it.
# and five more that the default run leaves out (all of them do not fit in one 10-minute
# command):
#   bench    python -m benchmarks.step.triton_kernels: prefill TFLOP/s beside SDPA, decode GB/s
#            beside a copy;
#   quantized  python -m benchmarks.step.quantized_triton: the Triton GEMM over FP8, block-FP8,
#            int8 and 4-bit codes beside bf16's on Llama-3.1-8B's shapes at 1 to 4096 rows;
#            then Llama-3.1-8B's shape drawn and quantized on the device (real_shape
#            --quantization-scheme): its decode step at batch 1 and 8 and a 512-token prefill in
#            FP8_DYNAMIC, FP8_BLOCK and W4A16 beside bf16's, each beside its own weight floor;
#   moe      python -m benchmarks.step.fused_moe: the fused MoE kernels on Qwen3-30B-A3B's and
#            Mixtral-8x7B's expert shapes at 1 to 2048 tokens, beside a dense bf16 GEMM of the
#            same FLOPs and beside their torch twin; then python -m benchmarks.step.moe: the
#            decode step of Qwen3-30B-A3B's shape (random weights) at batch 1/8/32 beside its
#            floor, the weights of the experts its tokens chose;
#   moeserving  W1 as in realserving, on 24 of Qwen3-30B-A3B's 48 layers;
#   realserving  W1 as in serving, on Llama-3.1-8B's layers (SmolLM2's vocabulary, the carried
#            tokenizer's), each worker given 0.45 of the GPU and drawing its weights there;
#   tune     python -m benchmarks.step.triton_kernels --tune: every tile candidate on the bench's
#            shapes, and the choice to record in kernels/triton/tiles.py.
# Each step has its own time limit, and one that fails does not stop the next. Steps joined by
# "+" run side by side: the two test steps, which spend most of their time compiling kernels on
# the host's cores (on an H200 machine's 16, about 270 s together, 500 one after the other).
# Logs go to $OUT where it is set (else /tmp/gpu-check); a summary table ends the output, and the
# exit status is 1 if any step did not pass.
#
#   bash scripts/gpu_check.sh [setup|kernels|engine|graphs|realshape|serving|bench|quantized|moe|moeserving|realserving|tune ...]
#       # default: kernels+engine graphs realshape serving (about 470 s on an H200); then, as a
#       #   second command: bench quantized moe realserving; a third: moeserving, and where
#       #   tiles are to be tuned: tune
#
# It first installs what `make gpu-carry` put in .gpu-carry/ (the wheels the image lacks, and
# SmolLM2's config and tokenizer, served with random weights: the real ones do not fit) into
# /tmp/site, and runs pdserve from this checkout. KV pages move over ZeroMQ: nixl-cu12's wheel
# (65 MiB on its own) does not fit in what a run may carry (64 MiB).
#
# Settings (environment): GPU_CHECK_PYTHON (python3), GPU_CHECK_CARRY (.gpu-carry),
# GPU_CHECK_DEADLINE_S (560: no step runs past this many seconds from the start),
# GPU_CHECK_<STEP>_S (each step's limit), GPU_CHECK_KERNELS_ARGS and GPU_CHECK_ENGINE_ARGS
# (added to those pytest runs, e.g. -k store_kv),
# GPU_CHECK_TEST_THREADS (1: torch's threads in each test worker),
# GPU_CHECK_W1_ARGS (replaces W1's benchmark flags), GPU_CHECK_REALSHAPE_ARGS (replaces
# realshape's, --profile 1,8 --profile-prefill 512), GPU_CHECK_GPU_SHARE (0.4), and
# GPU_CHECK_ALLOW_CPU=1 to run the plumbing without a GPU (interpreted kernels, no bench).
# shellcheck disable=SC2317  # the steps are called by name, "step_$2"
set -uo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.." || exit

export PY=${GPU_CHECK_PYTHON:-python3}
export CARRY=${GPU_CHECK_CARRY:-.gpu-carry}
export LOGS=${OUT:-/tmp/gpu-check}
export WORK=${GPU_CHECK_WORK:-/tmp/gpu-check-work}
export SITE=${GPU_CHECK_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-560}
declare -A LIMIT_S=(
    [kernels]=${GPU_CHECK_KERNELS_S:-300}
    [engine]=${GPU_CHECK_ENGINE_S:-300}
    [bench]=${GPU_CHECK_BENCH_S:-75}
    [serving]=${GPU_CHECK_SERVING_S:-150}
    [tune]=${GPU_CHECK_TUNE_S:-240}
    [graphs]=${GPU_CHECK_GRAPHS_S:-200}
    [realshape]=${GPU_CHECK_REALSHAPE_S:-120}
    [realserving]=${GPU_CHECK_REALSERVING_S:-200}
    [quantized]=${GPU_CHECK_QUANTIZED_S:-360}
    [moe]=${GPU_CHECK_MOE_S:-240}
    [moeserving]=${GPU_CHECK_MOESERVING_S:-200}
)
SERVING_PORT=18000
W1_ARGS=${GPU_CHECK_W1_ARGS:---isl 256 --osl 64 --num-prompts 64 --concurrency 8}

# pytest-xdist where installed (the GPU image has it): compiling the kernels' variants is most
# of the kernel tests' time, and each worker compiles its own share.
xdist_flags() {
    if "$PY" -c "import xdist" 2>/dev/null; then echo "-n $1"; fi
}

# Threads for torch's host-side work in each test worker (the references' forwards): by default
# each of the dozen workers of the two test steps ran as many threads as the host has cores,
# beside the compiles. On an H100 host (16 cores) the engine tests' fixtures, a tiny model's
# transformers forwards, took 60-75 s each, and an int8 engine test 165 s with 12 workers
# against 34 s with 4 on the H200's.
TEST_THREADS=${GPU_CHECK_TEST_THREADS:-1}

# Each pytest run's closing line (the engine step has two), joined by "; ".
pytest_figures() {
    grep -aE '^=*ERROR|[0-9]+ (passed|failed|skipped|error|errors|deselected)' "$1" | tr -d '=' |
        paste -sd ';' | sed 's/;/; /g'
}

# --- the steps, each run as `bash gpu_check.sh --step NAME` under its time limit -----------------

step_kernels() {
    # shellcheck disable=SC2046,SC2086
    OMP_NUM_THREADS=$TEST_THREADS "$PY" -m pytest tests/test_kernels.py tests/test_cuda_ops.py \
        tests/test_quantized_triton.py tests/test_fused_moe.py tests/test_lora_kernels.py -q -rfE \
        -p no:cacheprovider $(xdist_flags 8) ${GPU_CHECK_KERNELS_ARGS:-}
}

step_engine() {
    # The tests marked gpu, and deterministic inference on the Triton path (its tests run
    # wherever Triton does, so they carry no mark): the kernels compiled, bf16 included.
    # shellcheck disable=SC2046,SC2086
    OMP_NUM_THREADS=$TEST_THREADS "$PY" -m pytest tests/test_engine_equivalence.py \
        tests/test_engine_triton.py tests/test_cuda_graphs.py tests/test_async_scheduling.py \
        tests/test_quantized_checkpoints.py \
        -m gpu -q -rfE -p no:cacheprovider $(xdist_flags 4) ${GPU_CHECK_ENGINE_ARGS:-}
    local marked=$?
    # shellcheck disable=SC2046,SC2086
    OMP_NUM_THREADS=$TEST_THREADS "$PY" -m pytest tests/test_deterministic_triton.py -q -rfE \
        -p no:cacheprovider $(xdist_flags 4) ${GPU_CHECK_ENGINE_ARGS:-}
    local deterministic=$?
    # 5: GPU_CHECK_ENGINE_ARGS selected nothing in that run, which is not a failure.
    ((marked == 5)) && marked=0
    ((deterministic == 5)) && deterministic=0
    return $((marked | deterministic))
}

step_bench() {
    "$PY" -m benchmarks.step.triton_kernels
}

step_quantized() {
    local failed=0 scheme
    "$PY" -m benchmarks.step.quantized_triton || failed=1
    # The 8B shape's decode step and a 512-token prefill in each format beside bf16's, each
    # beside its own weight floor, in one run: the drawn layers quantized on the device.
    for scheme in bf16 FP8_DYNAMIC FP8_BLOCK W4A16; do
        echo "== realshape $scheme"
        local flags=()
        [[ $scheme != bf16 ]] && flags=(--quantization-scheme "$scheme")
        "$PY" -m benchmarks.step.real_shape "${flags[@]}" --batch-sizes 1,8 \
            --prefill-chunks 512 --steps 20 || failed=1
    done
    return $failed
}

step_moe() {
    local failed=0
    "$PY" -m benchmarks.step.fused_moe || failed=1
    # The decode step beside the weights of the experts its tokens chose, Qwen3-30B-A3B's shape.
    "$PY" -m benchmarks.step.moe --device cuda --batch-sizes 1,8,32 || failed=1
    return $failed
}

step_moeserving() {
    local model
    # Half of Qwen3-30B-A3B's 48 layers: two workers' weights and pages within the GPU.
    model=$(real_shape_model benchmarks/shapes/Qwen3-30B-A3B/config.json 24) || return 1
    serve_w1 "$model" "${GPU_CHECK_REAL_SHARE:-0.45}" --load-format dummy
}

step_tune() {
    "$PY" -m benchmarks.step.triton_kernels --tune
}

# SmolLM2-135M's shape with random weights, in $WORK; prints the folder.
random_model() {
    local model="$WORK/SmolLM2-135M-Instruct-random-weights"
    rm -rf "$model"
    "$PY" -m benchmarks.harness random-model "$CARRY/SmolLM2-135M-Instruct" "$model" >&2 ||
        return 1
    echo "$model"
}

step_graphs() {
    local model
    model=$(random_model) || return 1
    # A base tree carried (make gpu-carry BASE=COMMIT): its steps first, on the same machine and
    # model, so that a change's before and after come from one run.
    if [[ -d $CARRY/base ]]; then
        echo "== the base tree, $(cat "$CARRY/base/BASE_COMMIT" 2>/dev/null || echo '?')"
        # A tree from before benchmarks/ had groups keeps the benchmark at its top.
        local graphs=benchmarks.step.cuda_graphs
        [[ -f $CARRY/base/benchmarks/step/cuda_graphs.py ]] || graphs=benchmarks.cuda_graphs
        (cd "$CARRY/base" && PYTHONPATH="$SITE:$PWD" "$PY" -m "$graphs" \
            --model "$model" --batch-sizes 1,8,64) || echo "the base tree's run failed"
        echo "== this tree"
    fi
    "$PY" -m benchmarks.step.cuda_graphs --model "$model"
}

step_realshape() {
    # shellcheck disable=SC2086
    "$PY" -m benchmarks.step.real_shape ${GPU_CHECK_REALSHAPE_ARGS:---profile 1,8 --profile-prefill 512}
}

step_serving() {
    local model
    model=$(random_model) || return 1
    serve_w1 "$model" "${GPU_CHECK_GPU_SHARE:-0.4}"
}

# Llama-3.1-8B's layers with the vocabulary of the tokenizer the check carries (SmolLM2's 49152
# tokens: the router must detokenize what the model samples), weights drawn on the device by
# each worker (--load-format dummy): nothing is written or carried. Prints the folder.
real_shape_model() {
    local config=${1:-${GPU_CHECK_REAL_CONFIG:-benchmarks/shapes/Llama-3.1-8B/config.json}}
    local model
    model="$WORK/$(basename "$(dirname "$config")")-layers-SmolLM2-vocabulary"
    rm -rf "$model" && mkdir -p "$model" || return 1
    "$PY" -c 'import json, sys
config = json.load(open(sys.argv[1]))
config.update(vocab_size=49152, bos_token_id=1, eos_token_id=2)
if sys.argv[3]:
    config["num_hidden_layers"] = int(sys.argv[3])
json.dump(config, open(sys.argv[2], "w"), indent=2)' \
        "$config" "$model/config.json" "${2:-}" || return 1
    cp "$CARRY"/SmolLM2-135M-Instruct/{tokenizer.json,tokenizer_config.json} "$model"/ || return 1
    cp "$CARRY"/SmolLM2-135M-Instruct/special_tokens_map.json "$model"/ 2>/dev/null
    echo "$model"
}

step_realserving() {
    local model
    model=$(real_shape_model) || return 1
    serve_w1 "$model" "${GPU_CHECK_REAL_SHARE:-0.45}" --load-format dummy
}

# pdserve up on MODEL with one prefill and one decode worker, each given SHARE of the GPU (and
# any further worker flags), then W1 of benchmarks.serving.load against it.
serve_w1() {
    local model=$1 share=$2
    shift 2
    local url="http://127.0.0.1:$SERVING_PORT"
    "$PY" -m pdserve.cli up --model "$model" --prefill 1 --decode 1 --port "$SERVING_PORT" \
        --gpu-memory-utilization "$share" --log-level WARNING "$@" &
    local up=$!
    # shellcheck disable=SC2064
    trap "kill -TERM $up 2>/dev/null; wait $up" EXIT
    "$PY" - "$url" "$up" <<'EOF' || return 1
import json, os, sys, time, urllib.request

url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("pdserve up exited before its workers registered")
    try:
        with urllib.request.urlopen(f"{url}/v1/workers", timeout=2) as answer:
            listing = json.load(answer)
    except (OSError, ValueError):
        listing = {}
    if all(listing.get(role) for role in ("prefill", "decode")):
        for role in ("prefill", "decode"):
            for worker in listing[role]:
                print(f"{role} worker {worker['id']}: {worker['num_pages']} KV pages of "
                      f"{worker['page_size']} tokens, KV transfer {worker['kv_transfer']}")
        break
    time.sleep(1)
else:
    sys.exit("the workers did not register within 300 s")
EOF
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader |
            sed 's/^/GPU process (pid, name, memory): /'
    fi
    # shellcheck disable=SC2086
    "$PY" -m benchmarks.serving.load --model "$model" --base-url "$url" $W1_ARGS
}

if [[ ${1:-} == --step ]]; then
    "step_$2"
    exit
fi

# --- set-up ----------------------------------------------------------------------------------

mkdir -p "$LOGS" "$WORK"
START=$SECONDS
SUMMARY=()
FAILED=0

record() {  # name, status, seconds, figures
    [[ $2 == ok ]] || FAILED=1
    SUMMARY+=("$(printf '%-8s %-9s %5ss  %s' "$1" "$2" "$3" "$4")")
}

setup() {
    echo "== set-up: wheels from $CARRY into $SITE"
    local wheels=("$CARRY"/wheels/*.whl)
    if [[ ! -f ${wheels[0]} ]]; then
        echo "no wheels in $CARRY/wheels: run \`make gpu-carry\` where pip reaches a registry"
        return 1
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --disable-pip-version-check --root-user-action=ignore --target "$SITE" "${wheels[@]}" ||
        return 1
    echo "== the machine"
    if command -v nvidia-smi >/dev/null; then nvidia-smi; fi
    # What each installed package needs is there (the image's packages included), and every
    # pdserve process imports.
    "$PY" - "$SITE" <<'EOF' || return 1
import importlib.metadata as metadata
import platform
import sys

from packaging.requirements import Requirement

problems = []
for dist in metadata.distributions(path=[sys.argv[1]]):
    for line in dist.requires or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            version = None
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{dist.metadata['Name']} needs {requirement}, found {version}")
print("\n".join(problems) or "every carried package's requirements are met")

import torch, triton, transformers, zmq, fastapi, uvicorn, pydantic, httpx
import router.server, prefill_worker.worker, decode_worker.worker
import kvtransfer.zmq_backend, benchmarks.serving.load, benchmarks.harness

print(f"python {platform.python_version()}, torch {torch.__version__}, triton "
      f"{triton.__version__}, transformers {transformers.__version__}, pyzmq {zmq.__version__}, "
      f"fastapi {fastapi.__version__}, uvicorn {uvicorn.__version__}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"cuda: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
          f"capability {props.major}.{props.minor}, torch built for CUDA {torch.version.cuda}")
else:
    print("cuda: none visible to torch")
sys.exit(1 if problems else 0)
EOF
}

steps=("$@")
if [[ ${#steps[@]} -eq 0 ]]; then steps=(kernels+engine graphs realshape serving); fi
for item in "${steps[@]}"; do
    IFS=+ read -ra group <<<"$item"
    for step in "${group[@]}"; do
        if [[ $step != setup && -z ${LIMIT_S[$step]:-} ]]; then
            echo "unknown step $step; choose from setup kernels engine bench quantized moe moeserving serving tune graphs realshape realserving" >&2
            exit 2
        fi
    done
done

setup 2>&1 | tee "$LOGS/setup.log"
setup_rc=${PIPESTATUS[0]}
record setup "$([[ $setup_rc == 0 ]] && echo ok || echo FAILED)" $((SECONDS - START)) \
    "$(grep -aE '^(cuda|python)[: ]' "$LOGS/setup.log" | paste -sd ';' -)"

if "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    # Compiled, never interpreted: tests/conftest.py sets the interpreter only without CUDA.
    unset TRITON_INTERPRET
elif [[ ${GPU_CHECK_ALLOW_CPU:-0} != 1 ]]; then
    echo "torch sees no CUDA device; GPU_CHECK_ALLOW_CPU=1 runs the plumbing on a CPU" >&2
    steps=()
    record cuda FAILED 0 "torch sees no CUDA device"
fi

# The figures the summary shows for STEP, read from its log.
figures_of() {
    local step=$1 figures="" prefill sdpa decode pages memory
    case $step in
        kernels | engine) figures=$(pytest_figures "$LOGS/$step.log") ;;
        bench)
            prefill=$(grep -aoE 'triton bf16 +[0-9.]+' "$LOGS/bench.log" | awk '{print $3}' |
                sort -g | tail -n 1)
            sdpa=$(grep -aoE 'torch sdpa +[0-9.]+' "$LOGS/bench.log" | awk '{print $3}' |
                sort -g | tail -n 1)
            decode=$(grep -aoE 'bf16 +[0-9]+ GB/s \( *[0-9]+%\)' "$LOGS/bench.log" |
                sort -k2 -g | tail -n 1 | tr -s " ")
            figures="prefill bf16 best ${prefill:-?} TFLOP/s (SDPA ${sdpa:-?}); decode best ${decode:-?}"
            ;;
        serving | realserving | moeserving)
            figures=$(awk '$1 ~ /^(output_tok_s|ttft_p50_ms|tpot_mean_ms|itl_p99_ms|decode_step_ms|tpot_over_step|errors)$/ {
                printf "%s %s, ", $1, $2 }' "$LOGS/$step.log")
            pages=$(grep -aoE '^(prefill|decode) worker [^:]*: [0-9]+' "$LOGS/$step.log" |
                awk '{ printf "%s %s ", $1, $4 }')
            memory=$(grep -aoE '^GPU process .*, [0-9]+ MiB$' "$LOGS/$step.log" |
                awk '{ printf "%s ", $(NF - 1) }')
            figures="${figures}KV pages: ${pages:-?}${memory:+; GPU MiB by process: $memory}"
            ;;
        tune) figures=$(grep -aE '^  best:' "$LOGS/tune.log" | sed 's/^ *//' | paste -sd ';' -) ;;
        quantized)
            # Lines "FORMAT ROWS us RATIO GB/s TFLOP/s" (FORMAT may be two words): the ratio
            # to bf16 of each format at 1 and 4096 rows.
            figures=$(awk 'NF >= 6 && $(NF - 4) ~ /^(1|4096)$/ && $1 != "bf16" {
                name = $1; for (i = 2; i <= NF - 5; i++) name = name " " $i
                printf "%s @%s %s, ", name, $(NF - 4), $(NF - 2) }
                /^== realshape / { scheme = $3 }
                /^decode batch/ { sub(":", "", $3); printf "8B %s b%s %s ms (%s floor), ", scheme, $3, $4, $6 }
                /^prefill / { sub(":", "", $2); printf "8B %s prefill %s %s tok/s, ", scheme, $2, $3 }' \
                "$LOGS/quantized.log")
            figures="${figures%, }"
            ;;
        moe)
            # Lines "MODEL TOKENS HIT us TFLOP/s GB/s dense-us dense-TFLOP/s ...": each model's
            # weight rate at 1 token and its TFLOP/s (and the dense GEMM's) at 2048.
            figures=$(awk '$2 == 1 && NF >= 12 { printf "%s @1 %s GB/s, ", $1, $6 }
                $2 == 2048 && NF >= 12 { printf "%s @2048 %s TFLOP/s (dense %s), ", $1, $5, $8 }
                /^batch +[0-9]+: / { sub(":", "", $2); ratio = $NF; gsub(/[()]/, "", ratio)
                    printf "step b%s %s (%s floor), ", $2, $3, ratio }' \
                "$LOGS/moe.log")
            figures="${figures%, }"
            ;;
        realshape)
            figures=$(awk '/^decode batch/ { sub(":", "", $3); printf "b%s %s ms (%s floor), ", $3, $4, $6 }
                /^prefill / { sub(":", "", $2); sub("[(]", "", $7)
                    printf "prefill %s %s TFLOP/s (%s), ", $2, $5, $7 }' "$LOGS/realshape.log")
            figures="${figures%, }"
            ;;
        graphs)
            # batch, eager, graphs 1 by 1, graphs (launched ahead), speed-up, two tok/s columns
            figures=$(awk '/^== the base tree/ { base = "base " } /^== this tree/ { base = "" }
                $1 ~ /^[0-9]+$/ && NF == 7 { printf "%sb%s %s ms (%s), ", base, $1, $4, $5 }' \
                "$LOGS/graphs.log")
            figures="graph step, launched ahead (speed-up over eager): ${figures%, }"
            ;;
    esac
    echo "$figures"
}

# The status the summary shows for an exit code.
status_of() {
    case $1 in
        0) echo ok ;;
        124 | 130 | 137) echo TIMEOUT ;;
        *) echo "FAILED($1)" ;;
    esac
}

# STEP's time limit: its own, cut to what is left before the deadline.
limit_of() {
    local left=$((DEADLINE_S - (SECONDS - START))) limit=${LIMIT_S[$1]}
    echo $((limit < left ? limit : left))
}

# Runs STEP under its limit: SIGINT first, so pytest still prints what passed and the cluster
# shuts down in order. Writes "exit-code seconds" to $WORK/STEP.rc.
run_step() {
    local step=$1 began=$SECONDS
    rm -f "$WORK/$step.rc"
    timeout -s INT -k 10 "$(limit_of "$step")" bash "$SELF" --step "$step"
    echo "$? $((SECONDS - began))" >"$WORK/$step.rc"
}

# A step named a+b runs its parts side by side (the test steps, which spend most of their time
# compiling kernels on the host's cores); the benchmark steps run alone, so that nothing else
# shares the GPU they time.
for item in "${steps[@]}"; do
    [[ $item == setup ]] && continue
    IFS=+ read -ra group <<<"$item"
    if (($(limit_of "${group[0]}") < 10)); then
        for step in "${group[@]}"; do
            record "$step" skipped 0 "no time left before the ${DEADLINE_S} s deadline"
        done
        continue
    fi
    if ((${#group[@]} == 1)); then
        echo "== $item (at most $(limit_of "$item") s)"
        run_step "$item" 2>&1 | tee "$LOGS/$item.log"
    else
        echo "== ${group[*]}, side by side (logs in $LOGS)"
        for step in "${group[@]}"; do
            echo "   $step at most $(limit_of "$step") s"
            run_step "$step" >"$LOGS/$step.log" 2>&1 &
        done
        wait
        for step in "${group[@]}"; do
            echo "-- the end of $step's log"
            tail -n 15 "$LOGS/$step.log"
        done
    fi
    for step in "${group[@]}"; do
        read -r rc took <"$WORK/$step.rc" || { rc=1 took=0; }
        record "$step" "$(status_of "$rc")" "$took" "$(figures_of "$step")"
    done
done

{
    echo
    echo "== GPU check summary ($((SECONDS - START)) s; logs in $LOGS)"
    printf '%s\n' "${SUMMARY[@]}"
} | tee "$LOGS/summary.txt"
exit $FAILED
