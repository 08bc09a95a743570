#!/usr/bin/env bash
# Pack wheel folders into one xz-compressed site folder, .site/NAME.tar.xz, to travel with
# one device call (64 MiB with the working tree): wheels are deflate zips, and one solid xz
# stream of their unpacked files is smaller. run_h200_gpu_suite.sh unpacks every bundle it
# finds into its site folder, once per machine. The two that fit a call each:
#   bash benchmarks/pack_site_bundle.sh sglang .whl-sg .whl-fm                (SGLang + FlashMLA, 36 MB)
#   bash benchmarks/pack_site_bundle.sh fmtl .whl-fm .whl-indexer .whl-z3     (FlashMLA + TileLang, 43 MB)
# Left out, since nothing on an NVIDIA card uses them: TileLang's AMD headers
# (composable_kernel; its HIP stub libraries stay, as its loader opens them), SGLang's
# multimodal_gen and test packages, z3's command-line binary; and sgl-deep-gemm, whose compiled extension does not load against
# the device image's torch (its backend's check reports it as not installed there).
set -eu
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 NAME WHEEL_FOLDER..." >&2; exit 2; }
name=$1; shift
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
site=$work/site; mkdir -p "$site"
for d in "$@"; do
  for w in "$d"/*.whl; do
    [ -f "$w" ] || continue
    case $(basename "$w") in sgl_deep_gemm-*) continue ;; esac
    python3 -m zipfile -e "$w" "$site"
  done
  [ -d "$d/extra" ] && cp -r "$d/extra/." "$site/"
done
rm -rf "$site"/tilelang/3rdparty/composable_kernel \
  "$site"/sglang/multimodal_gen "$site"/sglang/test "$site"/z3_solver-*.data/data/bin
# The wheel ships libz3.so twice; the loader asks for the versioned name.
if [ -f "$site/z3/lib/libz3.so" ] && ls "$site"/z3/lib/libz3.so.* >/dev/null 2>&1; then
  v=$(cd "$site/z3/lib" && ls libz3.so.* | head -1); rm "$site/z3/lib/libz3.so"; ln -s "$v" "$site/z3/lib/libz3.so"
fi
# zipfile drops the execute bits of shared objects; the loader does not need them.
mkdir -p .site
tar -cf - -C "$site" . | xz -T0 -8 > ".site/$name.tar.xz"
ls -l ".site/$name.tar.xz"
