#!/usr/bin/env bash
# The CUDA path proven and measured in one run: the tests on the GPU, decode speed at LLaMA-2 7B's shapes in bf16
# against the memory-bandwidth roofline and transformers, and llama-server under 1, 8 and 32 clients.
#
#   scripts/gpu_check.sh prepare              where pip reaches the package index: the wheels the GPU machine lacks,
#                                             and this project's own, into .whl/
#   scripts/gpu_check.sh [--out DIR]          on the GPU machine (no network needed), with .whl/ beside this script's
#                                             folder: installs the wheels into the work folder, writes a random
#                                             7B-shaped checkpoint there, runs every step
#   scripts/gpu_check.sh --dry-run [--out DIR]  the same steps on the CPU with a tiny model (2 layers, dim 64, GQA),
#                                             with this Python's packages, in a minute or two
#
# Flags: --out DIR (default $OUT if set, else out/): where gpu_check.log, gpu_check.json and checkpoint.log go.
# --wheels DIR (default .whl): where prepare puts the wheels and the GPU run installs them from; with --dry-run, the
# wheels to install as the GPU run does (without it the dry run uses this Python's packages).
# --work DIR (default a new folder under /tmp, removed at the end): the installed wheels and the checkpoint (13.5 GB).
# --budget SECONDS (default 470; 900 with --dry-run): the whole run's time; a step that would start later is skipped,
# and each runs under its own limit within it. --python PY (default $PYTHON, else python3).
#
# The JSON is rewritten after every figure, so a run stopped at any point leaves what it measured. Every step runs
# even when one before it failed; the exit status is 1 when any step failed or was skipped, 2 for bad usage.

set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2

# What a machine with torch, transformers, sentencepiece, safetensors, tokenizers, numpy, pytest, httpx, PyYAML and
# tqdm lacks of what these steps import, pinned to versions the tests pass with: fire (every command; termcolor
# with it), gguf (llama.convert), starlette and uvicorn (llama-server), and the openai client with what it needs
# (tests/server). fairscale, a dependency in pyproject.toml, is imported by no module, and --no-deps leaves it out.
WHEELS=(fire==0.7.1 termcolor==3.3.0 gguf==0.19.0 starlette==1.10.0 uvicorn==0.54.0
        openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 pydantic==2.14.4
        pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 sniffio==1.3.1)
MODULES=(torch numpy sentencepiece safetensors tokenizers transformers pytest httpx yaml fire gguf starlette uvicorn
         llama)

die() { echo "error: $*" >&2; exit "${EXIT:-1}"; }
usage() {
    EXIT=2 die "$1; usage: scripts/gpu_check.sh prepare | [--dry-run] [--out DIR] [--work DIR] [--wheels DIR]" \
        "[--budget SECONDS] [--python PY]"
}

MODE=gpu OUT_DIR=${OUT:-out} WORK= WHEEL_DIR= BUDGET= PY=${PYTHON:-python3}
while (($#)); do
    case $1 in
        prepare) MODE=prepare ;;
        --dry-run) MODE=dry-run ;;
        --out|--work|--wheels|--budget|--python)
            (($# >= 2)) && [[ -n $2 && $2 != -* ]] || usage "$1 needs a value"
            case $1 in
                --out) OUT_DIR=$2 ;; --work) WORK=$2 ;; --wheels) WHEEL_DIR=$2 ;; --budget) BUDGET=$2 ;;
                --python) PY=$2 ;;
            esac
            shift ;;
        -h|--help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) usage "unknown argument '$1'" ;;
    esac
    shift
done
[[ -z $BUDGET || $BUDGET =~ ^[0-9]+$ ]] || usage "--budget takes whole seconds, not '$BUDGET'"
command -v "$PY" >/dev/null || die "no Python at '$PY' (--python PY chooses another)"
# The dry run installs wheels only when --wheels names a folder: then it runs the install of the GPU run too.
INSTALL=${WHEEL_DIR:+yes}
[[ $MODE == gpu ]] && INSTALL=yes
WHEEL_DIR=${WHEEL_DIR:-.whl}

if [[ $MODE == prepare ]]; then
    # Binary wheels for CPython 3.12 on x86-64 Linux, and pure-Python ones (py3-none-any, the "any" platform).
    rm -rf "$WHEEL_DIR" && mkdir -p "$WHEEL_DIR" || die "cannot make $WHEEL_DIR"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$WHEEL_DIR" "${WHEELS[@]}" || die "pip could not download the wheels (above)"
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEEL_DIR" . \
        || die "pip could not build this project's wheel (above)"
    echo "$(ls "$WHEEL_DIR" | wc -l) wheels in $WHEEL_DIR ($(du -sh "$WHEEL_DIR" | cut -f1)); bring it with this" \
        "folder to the GPU machine and run scripts/gpu_check.sh there"
    exit 0
fi

# What can be refused is refused before anything is written.
if [[ $INSTALL ]]; then
    compgen -G "$WHEEL_DIR/llama_kv-*.whl" >/dev/null || die "no llama_kv wheel in $WHEEL_DIR: run" \
        "'scripts/gpu_check.sh prepare' where pip reaches the package index, and bring $WHEEL_DIR along"
fi
if [[ $MODE == gpu ]]; then
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || die "$PY's torch" \
        "sees no CUDA GPU (torch.cuda.is_available() is not True); --dry-run runs the same steps on the CPU"
fi
mkdir -p "$OUT_DIR" || die "cannot make the output folder '$OUT_DIR'"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG=$OUT_DIR/gpu_check.log JSON=$OUT_DIR/gpu_check.json
if [[ -z $WORK ]]; then
    WORK=$(mktemp -d /tmp/gpu-check.XXXXXX) || die "cannot make a work folder under /tmp"
    REMOVE_WORK=1
fi
mkdir -p "$WORK" || die "cannot make the work folder '$WORK'"
CKPT_PID=
trap '[[ -n $CKPT_PID ]] && kill "$CKPT_PID" 2>/dev/null; [[ -n ${REMOVE_WORK:-} ]] && rm -rf "$WORK"' EXIT
rm -f "$JSON"
exec > >(tee -a "$LOG") 2>&1
START=$SECONDS
FAILED=0
echo "scripts/gpu_check.sh ($MODE) at $(date -u '+%Y-%m-%d %H:%M:%S UTC'): figures in $OUT_DIR, work in $WORK"

# The repository first on the path (tests and scripts import its llama), then the wheels, whose console scripts
# go on PATH.
if [[ $INSTALL ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEEL_DIR"/*.whl \
        || die "pip could not install the wheels in $WHEEL_DIR (above)"
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PATH="$WORK/site/bin:$PATH"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [[ $MODE == gpu ]]; then
    DEVICE=cuda BUDGET=${BUDGET:-470}
    CKPT_FLAGS=(--size 7B --vocab_size 32000) # LLaMA-2's 32,000-token vocabulary; the example tokenizer has 4,000
    SPEED=(--new-tokens 64 --prompt-tokens 2000 --copy-gb 4)
    SERVER=(--clients 1,8,32 --requests 2 --threads 8)
else
    DEVICE=cpu BUDGET=${BUDGET:-900}
    CKPT_FLAGS=(--size tiny)
    SPEED=(--new-tokens 16 --prompt-tokens 64 --copy-gb 0.05)
    SERVER=(--clients 1,8,32 --requests 1 --threads 2)
fi
export PYTHONUNBUFFERED=1
"$PY" - "${MODULES[@]}" <<'EOF' || exit 1
import importlib.util, sys
missing = [name for name in sys.argv[1:] if importlib.util.find_spec(name) is None]
if missing:
    print(f"error: {sys.executable} cannot import {', '.join(missing)}: on the GPU machine bring them in the wheel "
          "folder (scripts/gpu_check.sh prepare), elsewhere pip install -e \".[test]\"", file=sys.stderr)
    sys.exit(1)
EOF

driver() { "$PY" scripts/gpu_check.py "$@" --json-file "$JSON"; }
record_step() { driver record --key "steps.$1" --value "{\"status\": \"$2\", \"seconds\": $3}" >/dev/null; }
left() { echo $((BUDGET - (SECONDS - START))); }
# within LIMIT: LIMIT seconds, or 30 fewer than the budget has left if that is less (for a step's own deadline).
within() { local most=$(($(left) - 30)); echo $(($1 < most ? $1 : (most > 0 ? most : 1))); }

# step NAME LIMIT ARGS...: `scripts/gpu_check.py ARGS` under LIMIT seconds (less if the budget has less left), its
# status recorded.
step() {
    local name=$1 limit=$2 left=$(left) started=$SECONDS status=0
    shift 2
    if ((left < 15)); then
        echo "== $name: skipped, the ${BUDGET}s budget is spent"
        record_step "$name" skipped 0
        FAILED=1
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most ${limit}s; $((SECONDS - START))s into the run)"
    timeout --kill-after=20 "$limit" "$PY" scripts/gpu_check.py "$@" --json-file "$JSON" || status=$?
    case $status in
        0) record_step "$name" ok $((SECONDS - started)) ;;
        124|137) echo "== $name: stopped at its ${limit}s limit"; record_step "$name" timeout $((SECONDS - started)) ;;
        *) echo "== $name: failed (exit status $status)"; record_step "$name" failed $((SECONDS - started)) ;;
    esac
    ((status == 0)) || FAILED=1
}

driver record --key mode --value "$MODE" >/dev/null || die "scripts/gpu_check.py could not write $JSON"
step machine 60 machine

# The checkpoint is drawn and written on this machine's disk while the tests run: both take a minute or more.
CKPT=$WORK/checkpoint
echo "== checkpoint: writing $CKPT (scripts/write_random_checkpoint.py ${CKPT_FLAGS[*]}) in the background"
CKPT_START=$SECONDS
"$PY" scripts/write_random_checkpoint.py "$CKPT" "${CKPT_FLAGS[@]}" --dtype bfloat16 >"$OUT_DIR/checkpoint.log" 2>&1 &
CKPT_PID=$!

step tests 240 tests $([[ $MODE == dry-run ]] && echo --dry-run)
step equivalence 60 equivalence --device "$DEVICE"

if wait "$CKPT_PID"; then
    CKPT_PID=
    tail -n 1 "$OUT_DIR/checkpoint.log"
    record_step checkpoint ok $((SECONDS - CKPT_START))
    step speed 200 speed --ckpt-dir "$CKPT" --device "$DEVICE" "${SPEED[@]}" --budget-s "$(within 170)"
    step server 120 server --ckpt-dir "$CKPT" "${SERVER[@]}"
    step compile 200 speed --ckpt-dir "$CKPT" --device "$DEVICE" "${SPEED[@]}" --runs compile --budget-s "$(within 180)"
else
    echo "== checkpoint: failed; its output:"
    tail -n 5 "$OUT_DIR/checkpoint.log"
    record_step checkpoint failed $((SECONDS - CKPT_START))
    FAILED=1
fi

driver record --key wall_s --value $((SECONDS - START)) >/dev/null
driver summary
echo "done in $((SECONDS - START))s; $LOG and $JSON"
exit $FAILED
