#!/usr/bin/env bash
# One call on a GPU machine checks and times everything, in order of importance (each step time-boxed):
#   gpu: GPU tests; bench: the block benchmark; cpu: the CPU suite under that machine's torch; models: models.
#   OUT=<dir> [STEPS="gpu bench cpu models"] bash bench/device_run.sh   (wheels under .whl/ are installed first)
set -u
OUT=${OUT:-bench/out}
STEPS=${STEPS:-gpu bench cpu models}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
for step in $STEPS; do
  case $step in
    gpu) timeout 130 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -4 ;;
    bench) timeout 150 python3 bench/bench_block.py --form noproj --out "$OUT" 2>&1 | tee "$OUT/bench_block.log" | tail -12 ;;
    cpu) timeout 100 python3 -m pytest tests -q -m "not gpu" -n 8 -p no:cacheprovider 2>&1 | tee "$OUT/cpu_tests.log" | tail -4 ;;
    models) timeout 100 python3 bench/models.py --out "$OUT" --models whisper,torch 2>&1 | tee "$OUT/models.log" | tail -6 ;;
  esac
done
