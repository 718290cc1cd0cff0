#!/usr/bin/env bash
# Runs train_gpt.py on every GPU of this machine (speedrun preset), or the cpu preset when
# there is no GPU. Extra arguments go to train_gpt.py: ./run.sh --seed=1 --num_iterations=100
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l || echo 0)
fi

if [ "$gpus" -gt 0 ]; then
    # A torch wheel that cannot use this driver would otherwise train the cpu preset on one gloo rank per GPU.
    if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
        build=$("$PYTHON" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")' 2>&1 | tail -n 1) || true
        echo "run.sh: nvidia-smi lists ${gpus} GPU(s) but this Python's torch cannot use them (${build}); install a torch wheel built for this driver's CUDA version (docs/supported-torch.md: 2.10 to 2.13)" >&2
        exit 2
    fi
    preset=(--preset=speedrun)  # the user's own --preset wins
    for arg in "$@"; do
        case "$arg" in --preset=*) preset=() ;; esac
    done
    set -- ${preset[@]+"${preset[@]}"} "$@"
    # tools/launch.py is torchrun whose Ctrl-C and SIGTERM end in one line and 128 + N, as the trainer's do
    echo "run.sh: ${gpus} GPU(s) found: python -m tools.launch --standalone --nproc_per_node=${gpus} train_gpt.py $*"
    exec "$PYTHON" -m tools.launch --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
fi
echo "run.sh: no GPU found: running the cpu preset in one process"
exec "$PYTHON" train_gpt.py "$@"
