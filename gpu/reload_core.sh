#!/usr/bin/env bash
# GPU checks for the reload core: the invariant tests on CUDA, the demo on CUDA,
# and a probe of where reload time goes on a v2-lite slice.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python3 -m pytest -q -p no:cacheprovider tests/test_reload.py -k cuda 2>&1 | tail -5
python3 -m fp8_reload demo --preset small --device cuda 2>&1 | tee "$OUT/demo_cuda.txt" | tail -20
python3 gpu/probe_reload.py --layers 4 2>&1 | tee "$OUT/probe_reload.txt"
