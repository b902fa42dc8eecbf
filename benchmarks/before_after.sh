#!/usr/bin/env bash
# Time this tree against an earlier commit in one device call: the GPU lends are short, and a host's speed drifts
# between calls (benchmarks/README.md), so before and after alternate on one warm machine.
#
#   here:   bash benchmarks/before_after.sh prepare COMMIT      # copies COMMIT's code into .before/ (git-ignored)
#   device: run(command="bash benchmarks/before_after.sh run [gpu_e2e.py arguments]", carry=[".before"])
#
# `run` alternates after, before, after, before (each a `gpu_e2e.py` process, default: the at-birth tracing level),
# all with this tree's gpu_tracing.py, so only the engine differs; logs and JSON go to $OUT/<tag>/.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
prepare)
  [ -n "${2:-}" ] || { echo "usage: $0 prepare COMMIT" >&2; exit 2; }
  cd "$ROOT" && rm -rf .before && mkdir .before || exit 1
  git archive "$2" mamba_debug kernels benchmarks pyproject.toml | tar -x -C .before || exit 1
  cp benchmarks/gpu_tracing.py .before/benchmarks/gpu_tracing.py
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")" && { grep -qx "/.before/" "$exclude" 2>/dev/null || echo "/.before/" >> "$exclude"; }
  echo "prepared .before/ from $(git rev-parse --short "$2"); carry it: carry=[\".before\"]" ;;
run)
  shift
  [ -d "$ROOT/.before" ] || { echo "no .before/: run '$0 prepare COMMIT' here and carry .before" >&2; exit 2; }
  [ $# -gt 0 ] || set -- --parts tracing --only "measured at birth"
  export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
  nvidia-smi --query-gpu=name --format=csv,noheader
  for tag in after1 before1 after2 before2; do
    tree=$ROOT; [ "${tag#before}" != "$tag" ] && tree=$ROOT/.before
    mkdir -p "$OUT/$tag"
    (cd "$tree" && OUT=$OUT/$tag timeout "${STEP_S:-150}" python3 benchmarks/gpu_e2e.py "$@" > "$OUT/$tag.log" 2>&1)
    echo "== $tag"
    grep -oE "x +[0-9.]+ .{0,60}|untraced beside it [^;]*|host time measuring[^;]*|the host queued[^|]*" "$OUT/$tag.log"
    grep -E "Error|Traceback" "$OUT/$tag.log" | head -3
  done ;;
*) sed -n 2,9p "$0"; exit 2 ;;
esac
