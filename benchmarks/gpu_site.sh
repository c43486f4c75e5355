#!/usr/bin/env bash
# The Python packages the GPU check needs beyond what the GPU machine has (its own torch,
# torchvision, numpy and pillow: Python 3.12, torch 2.11 cu130), built here as one archive that
# travels with the working tree: .gpu/site.tar.xz (.gpu/ is ignored by git). That machine has no
# network, and only 64 MiB travel: Ray, Hydra and the rest of ftjob's needs go as a trimmed
# site-packages of manylinux x86-64 wheels, ftjob itself runs from the checkout.
#
#   bash benchmarks/gpu_site.sh       # .gpu/site.tar.xz for CPython 3.12 (the GPU machine's)
#   GPU_SITE_PYTHON=3.11 GPU_SITE_OUT=.gpu/site311.tar.xz bash benchmarks/gpu_site.sh
#                                     # the same trim for this machine's 3.11, to test it here
#   GPU_SITE_TREE=DIR ...             # also leave the trimmed tree in DIR (to try it here)
#   GPU_SITE_TORCHCODEC=1 ...         # with TorchCodec's wheel (+6 MiB; gpu_decoders.py tries it)
#   GPU_SITE_PANDAS=1 ...             # with pandas (+5 MiB), where the machine has none
#
# There, before the check (benchmarks/README.md):
#   mkdir -p /tmp/site && tar -xJf .gpu/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site
#
# What is in it: ftjob's dependencies (pyproject.toml) at the versions of this checkout's .venv,
# less torch, torchvision, numpy, pillow, nvidia-* and triton (the machine's own), less pandas
# (Ray Data's; the machine's image has it, and it would add 5 MiB), less s3fs, scikit-learn,
# matplotlib and py-spy (S3 storage, the digits dataset, timeline.png and a hung worker's stack:
# the check uses none; a run without matplotlib says "timeline not drawn"). TorchCodec is left
# out unless asked for: a wheel of it is built against one torch release (its newest, 0.17, most
# likely against a newer one than the machine's 2.11) and its core loads FFmpeg's libraries,
# which the machine may lack; gpu_decoders.py says why where it does not import.
# What is trimmed (nothing a run imports: the check's env part imports every package and ftjob
# module first, and its CPU dry run against the same trim for 3.11 -- benchmarks/README.md --
# runs every part): Ray's Java jars, dashboard web
# client, RLlib, Serve and its LLM pieces; pyarrow's C++ headers, Flight, the HDFS,
# Azure, ORC, S3, GCS and Parquet-encryption bindings and its C++ tests; every package's tests/, __pycache__/, *.pyi and Cython
# sources; the symbols of native libraries (strip --strip-unneeded keeps the dynamic ones that
# loading needs); copies of one shared library under its other names become links. xz with its
# x86 filter packs the native code 8 % smaller.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=${GPU_SITE_PYTHON:-3.12}
OUT_TAR=${GPU_SITE_OUT:-.gpu/site.tar.xz}
TORCHCODEC=${GPU_SITE_TORCHCODEC:-0}
PANDAS=${GPU_SITE_PANDAS:-0}
LIMIT_MIB=40 # what the working tree may carry besides itself (64 MiB in all)

case "$OUT_TAR" in
  .gpu/*) ;;
  *) echo "GPU_SITE_OUT=$OUT_TAR: write it under .gpu/ (ignored by git, carried with carry=[\".gpu\"])" >&2; exit 2 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
site=$work/site

# The versions this checkout tests with; antlr4's 4.9.3 (omegaconf's pin) exists as an sdist only:
# built here into a wheel (pure Python) so every package comes as a binary for the other machine.
"$PY" -m pip freeze 2>/dev/null |
  grep -viE '^(torch|torchvision|numpy|pillow|nvidia|triton|ftjob)([=-]|$)' |
  grep '==' >"$work/constraints.txt" || true
"$PY" -m pip wheel -q --no-deps -w "$work/wheels" antlr4-python3-runtime==4.9.3
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
want=("ray[train,data]==2.60.*" "hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4" "tenacity>=8.2"
  "fsspec>=2024.6" "pyarrow>=14" "xxhash>=3.0")
[[ $TORCHCODEC == 1 ]] && want+=(torchcodec)
"$PY" -m pip install -q --target "$site" --only-binary=:all: --find-links "$work/wheels" \
  --python-version "$VERSION" --implementation cp "${PLATFORMS[@]}" --no-compile \
  -c "$work/constraints.txt" "${want[@]}"

# The machine's own: its numpy is the one its torch was built with.
rm -rf "$site"/numpy "$site"/numpy.libs "$site"/numpy-*.dist-info "$site"/bin
[[ $PANDAS == 1 ]] || rm -rf "$site"/pandas "$site"/pandas-*.dist-info "$site"/pandas.libs
for own in torch torchvision pillow PIL nvidia triton; do
  if [[ -e $site/$own ]] || compgen -G "$site/$own-*.dist-info" >/dev/null; then
    echo "gpu_site.sh: $own was pulled in by a dependency; the machine's own is used" >&2
    rm -rf "$site"/"$own" "$site"/"$own"-*.dist-info "$site"/"$own".libs
  fi
done
# Ray: what a training run on one node never loads.
rm -rf "$site"/ray/jars "$site"/ray/dashboard/client "$site"/ray/rllib "$site"/ray/serve \
  "$site"/ray/llm "$site"/ray/setup-dev.py
# pyarrow: headers and the bindings ftjob and Ray Data do not use here.
(
  cd "$site/pyarrow"
  rm -rf include tests src ./*flight* ./_substrait.* ./_hdfs.* ./_azurefs.* ./_orc.* ./*orc.* \
    ./*s3* ./_gcsfs.* ./*parquet_encryption* ./_pyarrow_cpp_tests.* ./*.pyx ./*.pxd ./*.pxi \
    ./*.h ./*.cc ./*.cmake
)
# Everywhere: tests, caches, stubs and sources of compiled modules.
find "$site" -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +
find "$site" -type f \( -name '*.pyi' -o -name '*.pyx' -o -name '*.pxd' -o -name '*.pyc' \) -delete
find "$site" -type f \( -name '*.so' -o -name '*.so.*' -o -perm -u+x \) -print0 |
  while IFS= read -r -d '' f; do
    if file -b "$f" | grep -q '^ELF'; then strip --strip-unneeded "$f" 2>/dev/null || true; fi
  done
# A wheel holds a library's symbolic links as copies (libarrow_python.so, .so.2600, .so.2600.1.0):
# one file, the others links to it.
"$PY" - "$site" <<'EOF'
import hashlib, os, sys

seen = {}
for folder, _, files in os.walk(sys.argv[1]):
    for name in sorted(files, key=len, reverse=True):  # the longest name (the real file) first
        path = os.path.join(folder, name)
        if ".so" not in name or os.path.islink(path):
            continue
        with open(path, "rb") as f:
            key = (folder, hashlib.sha256(f.read()).hexdigest())
        if key in seen:
            os.remove(path)
            os.symlink(os.path.basename(seen[key]), path)
        else:
            seen[key] = path
EOF

if [[ -n ${GPU_SITE_TREE:-} ]]; then
  rm -rf "$GPU_SITE_TREE" && mkdir -p "$GPU_SITE_TREE" && cp -a "$site"/. "$GPU_SITE_TREE"/
fi
mkdir -p "$(dirname "$OUT_TAR")"
echo "gpu_site.sh: $(du -sm "$site" | cut -f1) MiB unpacked; packing (xz -9, minutes)..." >&2
tar -C "$site" -cf - . | xz --x86 --lzma2=preset=9 -T0 >"$OUT_TAR.tmp"
mv "$OUT_TAR.tmp" "$OUT_TAR"
size=$(stat -c %s "$OUT_TAR")
echo "$OUT_TAR: $((size / 1024)) KiB = $(awk "BEGIN {printf \"%.1f\", $size / 1048576}") MiB" \
  "(CPython $VERSION: $(cd "$site" && ls -d ray-*.dist-info hydra_core-*.dist-info pyarrow-*.dist-info \
    torchcodec-*.dist-info 2>/dev/null | sed 's/\.dist-info//' | tr '\n' ' '))"
echo "unpack there: mkdir -p /tmp/site && tar -xJf $OUT_TAR -C /tmp/site && export PYTHONPATH=/tmp/site"
if ((size > LIMIT_MIB * 1048576)); then
  echo "gpu_site.sh: $OUT_TAR is over $LIMIT_MIB MiB: the working tree and it must fit 64 MiB" >&2
  exit 1
fi
