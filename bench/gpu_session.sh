#!/usr/bin/env bash
# One device run for issues 78 and 79 (a lent GPU's 15 minutes): everything under timeouts, each
# bench's log to $OUT (or bench/gpu_logs/ when run by hand), the commit in every log.
#   run(command="bash bench/gpu_session.sh", timeout_s=540)
set -u
cd "$(dirname "$0")/.."
out="${OUT:-bench/gpu_logs}"
mkdir -p "$out"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# The lent H200's image has python3 with torch, transformers and most of what runs here; xgrammar (the
# grammar mode of gpu_sampling.py) and ray travel as wheels in .whl (device/README.md), carried by the call.
py=python3
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 300 $py bench/gpu_floor.py --shapes llama3-8b-shape,qwen2.5-7b-shape,mistral-7b-shape 2>&1 \
  | tee "$out/issue78_floor_$commit.log" | grep -E "decode floor|graphs vs|runner up|Error" 
timeout 150 $py bench/gpu_sampling.py --shapes smollm2-shape,llama3-8b-shape 2>&1 \
  | tee "$out/issue79_sampling_$commit.log" | grep -E "sampling step|Error"
timeout 90 $py bench/gpu_floor.py --shapes llama3-8b-shape --points 64x1024 --throughput --requests 256 2>&1 \
  | tee "$out/issue78_throughput_$commit.log" | grep -E "throughput|Error"
