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

if command -v torchrun >/dev/null 2>&1; then
    launcher=(torchrun)
else
    launcher=("$PYTHON" -m torch.distributed.run)
fi

if [ "$gpus" -gt 0 ]; then
    echo "run.sh: ${gpus} GPU(s) found: torchrun --standalone --nproc_per_node=${gpus} train_gpt.py $*"
    exec "${launcher[@]}" --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
fi
echo "run.sh: no GPU found: running the cpu preset in one process"
exec "$PYTHON" train_gpt.py "$@"
