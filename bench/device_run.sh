#!/usr/bin/env bash
# One call on a GPU machine checks and times everything, in order of importance (each step time-boxed):
#   gpu: GPU tests; bench: the block benchmark (noproj form); benchproj: the same for the proj form (Wq/Wo);
#   cpu: the CPU suite under that machine's torch; models: whole models (Whisper, T5, SD-1.5 UNet, torch decoder;
#   one whose library is missing is skipped); ncu: the seed shape under Nsight Compute, with the per-instruction
#   summary of bench/sass_profile.py. benchproj, sweep, sanitize and ncu run only when STEPS names them.
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
    gpu) timeout 300 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -4 ;;
    sweep) timeout 240 python3 bench/sweep_tiles.py 2>&1 | tee "$OUT/sweep.log" | tail -40 ;;
    sanitize) for tool in memcheck racecheck; do
        timeout 100 compute-sanitizer --tool $tool python3 tests/gpu/sanitize_kernels.py > "$OUT/$tool.log" 2>&1
        echo "$tool: exit $?, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log")"
      done ;;
    bench) timeout 150 python3 bench/bench_block.py --form noproj --out "$OUT" 2>&1 | tee "$OUT/bench_block.log" | tail -12 ;;
    benchproj) timeout 200 python3 bench/bench_block.py --form proj --out "$OUT" 2>&1 | tee "$OUT/bench_proj.log" | tail -12 ;;
    cpu) timeout 100 python3 -m pytest tests -q -m "not gpu" -n 8 -p no:cacheprovider 2>&1 | tee "$OUT/cpu_tests.log" | tail -4 ;;
    ncu) timeout 150 ncu --clock-control none --kernel-name regex:pnca_ --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
          --section SourceCounters -o "$OUT/seed" python3 bench/profile_kernel.py seed > "$OUT/ncu_seed.log" 2>&1
        ncu -i "$OUT/seed.ncu-rep" --page details > "$OUT/ncu_seed.txt" 2>&1
        ncu -i "$OUT/seed.ncu-rep" --page source --csv --print-source sass > "$OUT/seed_sass.csv" 2>&1
        # per unit = warp-heads of the few_keys tile on the seed shape: 32 * (2048 / 16) * 16
        python3 bench/sass_profile.py "$OUT/seed_sass.csv" --per 65536 | tee "$OUT/seed_sass_summary.txt" | head -40 ;;
    models) timeout 330 python3 bench/models.py --out "$OUT" --models whisper,t5,unet,torch 2>&1 | tee "$OUT/models.log" | tail -8 ;;
  esac
done
