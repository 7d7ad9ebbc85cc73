#!/usr/bin/env bash
# One call on a GPU machine checks and times everything, in order of importance (each step time-boxed):
#   gpu: GPU tests; bench: the block benchmark (noproj form); benchproj: the same for the proj form (Wq/Wo);
#   cpu: the CPU suite under that machine's torch; models: whole models (Whisper, T5, SD-1.5 UNet, torch decoder;
#   one whose library is missing is skipped); ncu: the seed shape under Nsight Compute, with the per-instruction
#   summary of bench/sass_profile.py; host: host time per op call (bench/host_profile_plan.py, and
#   bench/host_dispatch.py: the autograd key's share). benchproj, sweep, ab (the sweep against a base tree), ablate,
#   host, abblock, probe (bench/probe_copies.py: the decode K/V stream alone, per copy form), attn
#   (bench/probe_attention.py: FlashAttention-3's main loop alone on the long-key shapes), width (bench/param_width.py:
#   the norm's parameters as x's type or fp32), sanitize, ncu and choice
#   (bench/kernel_choice.py: what the default kernel="auto" picks against kernel and Inductor) run only when STEPS
#   names them.
#   OUT=<dir> [STEPS="gpu bench cpu models"] [SWEEP_SHAPES=t5_dec,...] [SWEEP_CHUNKS=1,2,4,8] [SWEEP_GROUPS=16,4] \
#     [SWEEP_FORM=proj] [NCU_SHAPES="seed sdxl64"] [ABLATE_VARIANTS=stats_keep,...: ablate times variants] \
#     [ABLATE_ROUNDS=5: each kernel timed 5 times round robin] \
#     bash bench/device_run.sh
#   (models: MODELS=t5,torch MODEL_VARIANTS=inductor,fusednorm_plan,inductor_cg,fusednorm_plan_cg MODELS_TIMEOUT=...)
#   (ab: AB_SHAPES=sd15_64 AB_ONLY=<tokens> AB_BASE_ONLY=<tokens> AB_FORMS="noproj proj", against ab_base/ if present)
#   (abblock: bench_block.py on this tree and each ab_<name>/ tree in turn, twice; AB_SHAPES_noproj=t5_dec,...
#   AB_SHAPES_proj=...; each tree's kernels: ab_<name>/.kernels.tar.xz if carried, else .kernels.tar.xz with
#   .kernels_<name>.tar.xz over it; AB_TESTS="<pytest -k expression>" runs those GPU tests in the variant trees
#   first; AB_SWEEP="<args>" runs bench/sweep_tiles.py <args> in every tree too; bench/make_ab_trees.sh makes the
#   trees and packs)
#   (wheels under .whl/ are installed first: carry diffusers there, the GPU machine lacks it; carry .kernels.tar.xz
#   from bench/prebuild_kernels.py to skip cold compiles: every step then loads its kernels from it)
set -u
OUT=${OUT:-bench/out}
STEPS=${STEPS:-gpu bench cpu models}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
if [ -f .kernels.tar.xz ]; then  # kernels compiled ahead by bench/prebuild_kernels.py: every step loads them
  mkdir -p /tmp/fnk && tar xJf .kernels.tar.xz -C /tmp/fnk && export FUSEDNORM_CACHE_DIR=/tmp/fnk
  touch /tmp/fnk.unpacked
  echo "prebuilt kernels: $(ls /tmp/fnk/*.fnk | wc -l), NVRTC here: $(python3 -c 'from fusednorm.codegen import nvrtc; print(nvrtc.nvrtc_version())')"
fi
for step in $STEPS; do
  case $step in
    gpu) timeout ${GPU_TIMEOUT:-300} python3 -m pytest tests/gpu -q -x -p no:cacheprovider ${GPU_TESTS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
      if [ -f /tmp/fnk.unpacked ]; then  # their keys name what bench/prebuild_kernels.py still misses
        find /tmp/fnk -name '*.fnk' -newer /tmp/fnk.unpacked -printf '%f\n' | sort > "$OUT/compiled_on_device.txt"
        echo "kernels compiled on the device: $(wc -l < "$OUT/compiled_on_device.txt") (keys in compiled_on_device.txt)"
      fi ;;
    ablate) timeout ${ABLATE_TIMEOUT:-200} python3 bench/ablate_kernel.py ${ABLATE_CUTS:+--cuts $ABLATE_CUTS} ${ABLATE_SHAPES:+--shapes $ABLATE_SHAPES} ${ABLATE_ALL:+--all-roles} ${ABLATE_VARIANTS:+--variants $ABLATE_VARIANTS} ${ABLATE_ROUNDS:+--rounds $ABLATE_ROUNDS} 2>&1 | tee -a "$OUT/ablate.log" | tail -12 ;;
    ab) for form in ${AB_FORMS:-noproj proj}; do  # the tree's candidates, then a base tree's (ab_base/: git archive
        # main fusednorm bench | tar -x -C ab_base, carried untracked) on the same shapes, in one process each
        echo "== this tree, $form"; timeout 150 python3 bench/sweep_tiles.py --shapes ${AB_SHAPES:-sd15_64} ${AB_ONLY:+--only $AB_ONLY} --form $form 2>&1 | tee "$OUT/ab_$form.log" | tail -8
        [ -d ab_base ] && { echo "== ab_base, $form"; FUSEDNORM_CACHE_DIR=/tmp/fnk_ab_base timeout 150 python3 ab_base/bench/sweep_tiles.py --shapes ${AB_SHAPES:-sd15_64} ${AB_BASE_ONLY:+--only $AB_BASE_ONLY} --form $form 2>&1 | tee "$OUT/ab_base_$form.log" | tail -6; }
      done ;;
    abblock) # the block benchmark on this tree and each ab_<name>/ tree (bench/make_ab_trees.sh, or `git archive
      # <commit> fusednorm bench tests pyproject.toml`), in turn, twice over (a drift shows as a changed pair). A
      # tree's kernels: its own ab_<name>/.kernels.tar.xz if carried, else main's .kernels.tar.xz with
      # .kernels_<name>.tar.xz unpacked over it (the entries its templates change). AB_TESTS="<-k expression>" first
      # runs those GPU tests in each tree but ab_base; AB_SWEEP="--shapes seed --only ..." also runs that tile sweep in
      # each tree (the variants of a kernel no benchmark shape takes by default).
      out=$(cd "$OUT" && pwd); trees=$(ls -d ab_*/ 2>/dev/null | tr -d /)
      for t in $trees; do n=${t#ab_}; mkdir -p /tmp/fnk_$t
        if [ -f $t/.kernels.tar.xz ]; then tar xJf $t/.kernels.tar.xz -C /tmp/fnk_$t
        elif [ -f /tmp/fnk.unpacked ]; then cp -a /tmp/fnk/. /tmp/fnk_$t/  # main's pack, unpacked once above
          if [ -f .kernels_$n.tar.xz ]; then tar xJf .kernels_$n.tar.xz -C /tmp/fnk_$t; fi; fi
        if [ -n "${AB_TESTS:-}" ] && [ $t != ab_base ]; then echo "== $t: GPU tests $AB_TESTS"
          (cd $t && PYTHONPATH=$PWD FUSEDNORM_CACHE_DIR=/tmp/fnk_$t timeout 150 python3 -m pytest tests/gpu -q -x -p no:cacheprovider -k "$AB_TESTS" 2>&1 | tail -2); fi
      done
      ab_bench() {  # this round's benchmarks in the current tree; $1 names it in the logs
        for form in ${AB_FORMS:-noproj proj}; do shapes=AB_SHAPES_$form
          echo "== $1, $form, run $rep"; timeout 150 python3 bench/bench_block.py --form $form --shapes ${!shapes:-t5_dec} --no-inductor --out "$out/ab_$1_$form$rep" 2>&1 | tee "$out/abblock_$1_$form$rep.log" | grep '^| [a-z]'
        done
        if [ -n "${AB_SWEEP:-}" ]; then echo "== $1, sweep, run $rep"
          timeout 200 python3 bench/sweep_tiles.py $AB_SWEEP 2>&1 | tee "$out/absweep_$1$rep.log" | grep -E '^[a-z]|^  t[0-9]'; fi
      }
      for rep in 1 2; do ab_bench new
        for t in $trees; do (cd $t && export PYTHONPATH=$PWD FUSEDNORM_CACHE_DIR=/tmp/fnk_$t && ab_bench ${t#ab_}); done
      done ;;
    sweep) timeout 240 python3 bench/sweep_tiles.py ${SWEEP_SHAPES:+--shapes $SWEEP_SHAPES} ${SWEEP_ONLY:+--only $SWEEP_ONLY} ${SWEEP_CHUNKS:+--chunks $SWEEP_CHUNKS} ${SWEEP_GROUPS:+--groups $SWEEP_GROUPS} ${SWEEP_FORM:+--form $SWEEP_FORM} 2>&1 | tee "$OUT/sweep.log" | tail -40 ;;
    sanitize) for tool in memcheck racecheck; do
        timeout 100 compute-sanitizer --tool $tool python3 tests/gpu/sanitize_kernels.py > "$OUT/$tool.log" 2>&1
        echo "$tool: exit $?, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log")"
      done ;;
    width) timeout 200 python3 bench/param_width.py ${WIDTH_SHAPES:+--shapes $WIDTH_SHAPES} 2>&1 | tee "$OUT/param_width.log" ;;
    probe) timeout 150 python3 bench/probe_copies.py 2>&1 | tee "$OUT/probe_copies.log" | tail -30 ;;
    attn) timeout 330 python3 bench/probe_attention.py 2>&1 | tee "$OUT/probe_attention.log" | tail -50 ;;
    host) timeout 120 python3 bench/host_profile_plan.py > "$OUT/host_profile.log" 2>&1; head -30 "$OUT/host_profile.log"
      timeout 60 python3 bench/host_dispatch.py --device cuda 2>&1 | tee "$OUT/host_dispatch.log" ;;
    bench) timeout 150 python3 bench/bench_block.py --form noproj --out "$OUT" 2>&1 | tee "$OUT/bench_block.log" | tail -12 ;;
    choice) timeout ${CHOICE_TIMEOUT:-420} python3 bench/kernel_choice.py --out "$OUT" ${CHOICE_SHAPES:+--shapes $CHOICE_SHAPES} 2>&1 | tee "$OUT/kernel_choice.log" | tail -20 ;;
    benchproj) timeout 200 python3 bench/bench_block.py --form proj --out "$OUT" 2>&1 | tee "$OUT/bench_proj.log" | tail -12 ;;
    cpu) timeout 100 python3 -m pytest tests -q -m "not gpu" -n 8 -p no:cacheprovider 2>&1 | tee "$OUT/cpu_tests.log" | tail -4 ;;
    ncu) for shape in ${NCU_SHAPES:-seed}; do  # few_keys shapes; per unit = warp-heads, B * (Lq / 16) * H
        per=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from bench_block import NoProjForm; B, Lq, D, H, Lk = NoProjForm.shapes['$shape']; print(B * -(-Lq // 16) * H)")
        python3 bench/profile_kernel.py $shape > "$OUT/ncu_$shape.log" 2>&1  # compiled outside the profiler first
        timeout 150 ncu --clock-control none --kernel-name regex:pnca_ --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
          --section SourceCounters --section ComputeWorkloadAnalysis --section InstructionStats -o "$OUT/$shape" python3 bench/profile_kernel.py $shape >> "$OUT/ncu_$shape.log" 2>&1
        ncu -i "$OUT/$shape.ncu-rep" --page details > "$OUT/ncu_$shape.txt" 2>&1
        ncu -i "$OUT/$shape.ncu-rep" --page source --csv --print-source sass > "$OUT/${shape}_sass.csv" 2>&1
        ncu -i "$OUT/$shape.ncu-rep" --page raw --csv 2>/dev/null | python3 bench/stall_reasons.py | tee "$OUT/${shape}_stalls.txt"
        # (to a file first: a pipe into head closed early and broke the summary's later lines)
        python3 bench/sass_profile.py "$OUT/${shape}_sass.csv" --per $per > "$OUT/${shape}_sass_summary.txt"
        head -30 "$OUT/${shape}_sass_summary.txt"
      done ;;
    models) timeout ${MODELS_TIMEOUT:-330} python3 bench/models.py --out "$OUT" --models ${MODELS:-torch,whisper,t5,unet} ${MODEL_VARIANTS:+--variants $MODEL_VARIANTS} 2>&1 | tee "$OUT/models.log" | tail -8 ;;
  esac
done
