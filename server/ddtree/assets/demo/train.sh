#!/usr/bin/env bash
# Rebuilds the demo pair (see README.md beside this file) on one GPU in about 8 minutes: the corpus is the
# Python standard library of the interpreter that runs it plus a few installed packages; 1 file in 50 is
# held out. Usage: train.sh OUT_DIR. TARGET_ARGS / DRAFT_ARGS are appended (later flags win), e.g. for a
# CPU smoke run: TARGET_ARGS="--steps 2 --batch-size 2 --seq-len 64" DRAFT_ARGS="$TARGET_ARGS" train.sh /tmp/x
# TARGET=DIR trains only a drafter, for that target (e.g. a DFlash2 one for the shipped demo target:
# TARGET=server/ddtree/assets/demo/target DRAFT_ARGS="--arch dflash2 --selector-rank 128" train.sh /tmp/x).
set -euo pipefail
out=${1:?usage: train.sh OUT_DIR}
py=${PYTHON:-python3}
stdlib=$($py -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
site=$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pkgs=()
for p in numpy scipy sympy torch sklearn pandas; do
  if [ -d "$site/$p" ]; then pkgs+=("$site/$p"); fi
done
echo "corpus: $stdlib ${pkgs[*]}"
target=${TARGET:-$out/target}
if [ -z "${TARGET:-}" ]; then
  # shellcheck disable=SC2086
  $py -m ddtree.cli train-target --corpus "$stdlib" "${pkgs[@]}" --glob '*.py' --out "$target" \
    --vocab-size 8192 --layers 10 --hidden 256 --heads 4 --kv-heads 2 --head-dim 64 --intermediate 768 \
    --seq-len 1024 --batch-size 64 --lr 2e-3 --minutes 4 --eval-every 200 ${TARGET_ARGS:-}
fi
# shellcheck disable=SC2086
$py -m ddtree.cli train-draft --target "$target" --corpus "$stdlib" "${pkgs[@]:0:2}" --glob '*.py' \
  --out "$out/draft" --layers 4 --block-size 16 --taps auto --seq-len 1024 --blocks 32 --batch-size 64 \
  --lr 1.5e-3 --gamma 7 --minutes 3 --eval-every 200 --save-every 500 ${DRAFT_ARGS:-}
