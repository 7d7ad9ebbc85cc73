#!/usr/bin/env bash
# Variant trees for bench/device_run.sh's abblock step: ab_<name>/ is this checkout's HEAD (fusednorm, bench, tests)
# with bench/variants/<name>.patch applied, and .kernels_<name>.tar.xz holds its benchmark kernels compiled ahead, to
# be unpacked over main's pack on the device. Both are made here, without a GPU; ab_<name>/ is untracked, so it
# travels with the working tree, and the packs go in run's carry beside .kernels.tar.xz:
#   PYTHON=/tmp/venv130/bin/python bash bench/make_ab_trees.sh ws_no_statistics ...
#   STEPS=abblock AB_FORMS=noproj AB_SHAPES_noproj=seed_lk2048,whisper_pre bash bench/device_run.sh   (on the device)
# PYTHON must load the device's NVRTC version (13.0: see bench/prebuild_kernels.py). AB_MATCH picks the kernels to
# compile (a regular expression on their keys; the default: the warp-specialised kernels of the two block forms'
# bf16 benchmarks). `rm -rf ab_*/` once done: a stale tree would be timed by the next abblock.
set -euo pipefail
PYTHON=${PYTHON:-python3}
MATCH=${AB_MATCH:-'^pnca_bf16_d64_layer_(gb_mnone|noaff_mnone_qf_wo)_t128x(128|96)w8s[34]wgtmaws_sm90$'}
root=$(git rev-parse --show-toplevel)
cd "$root"
for name in "$@"; do
  patch_file=bench/variants/$name.patch
  [ -f "$patch_file" ] || { echo "no $patch_file; variants: $(ls bench/variants)" >&2; exit 1; }
  tree=ab_$name
  rm -rf "$tree" "/tmp/fnk_ab_$name" && mkdir "$tree"
  git archive HEAD fusednorm bench tests pyproject.toml | tar -x -C "$tree"
  (cd "$tree" && patch -s -p1 < "$root/$patch_file")
  echo "== $tree: $(cd "$tree" && diff -rq -x __pycache__ "$root/fusednorm" fusednorm | wc -l) files differ from HEAD"
  (cd "$tree" && PYTHONPATH=. "$PYTHON" bench/prebuild_kernels.py --arch 90 --match "$MATCH" \
    --out "/tmp/fnk_ab_$name" --pack "$root/.kernels_$name.tar.xz" | tail -2)
done
