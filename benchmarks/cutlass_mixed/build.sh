#!/bin/bash
# Builds the CUTLASS grouped GEMM variants of benchmarks/cutlass_mixed.py into one shared
# library: bash benchmarks/cutlass_mixed/build.sh OUT.so
# Needs nvcc >= 12.8 (the H200 machine has 13.0; on a machine without CUDA, the wheels
# nvidia-cuda-nvcc, nvidia-cuda-runtime, nvidia-cuda-cccl, nvidia-cuda-crt and nvidia-nvvm
# 13.0 unpacked give one) and CUTLASS 4.2's headers: CUTLASS_DIR (default
# /tmp/cutlass/cutlass_library/source, where `pip download --no-deps nvidia-cutlass==4.2.0`
# unzipped into /tmp/cutlass puts them); LDFLAGS e.g. -L<dir of libcudart_static.a> where
# nvcc does not find it (the CUDA wheels). Each variant is its own translation unit (~1 min
# of one core and 1-2 GB of memory each, ~2 min for the 320-token tiles); JOBS of them
# compile at once (default: nproc); VARIANTS="<lines>" builds a subset (the session-14 runs
# name theirs in benchmarks/results/h200_design_g/README.md).
set -euo pipefail
if [ $# -ne 1 ]; then echo "usage: bash benchmarks/cutlass_mixed/build.sh OUT.so" >&2; exit 2; fi
OUT=$1
CUTLASS_DIR=${CUTLASS_DIR:-/tmp/cutlass/cutlass_library/source}
if [ ! -f "$CUTLASS_DIR/include/cutlass/cutlass.h" ]; then
  echo "CUTLASS 4.2 headers not found under CUTLASS_DIR=$CUTLASS_DIR (include/cutlass/cutlass.h):" >&2
  echo "  pip download --no-deps nvidia-cutlass==4.2.0 -d /tmp/w && unzip -q /tmp/w/nvidia_cutlass-4.2.0*.whl -d /tmp/cutlass" >&2
  exit 2
fi
command -v nvcc > /dev/null || { echo "nvcc not found on the PATH (CUDA >= 12.8 needed)" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$HERE/../../src/mxmoe/kernels/cutlass_wq.cu  # the kernels (the library builds its design (g) from it too)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# name variant TM TN TK CM [STAGES of variant 3] [QDQ] [PINGPONG] [EARLY] [FMT] [MODE] [LOOP] (see src/mxmoe/kernels/cutlass_wq.cu;
# FMT 0 E4M3 / 1 E5M2, MODE 0 rceil / 1 floor: benchmarks/cutlass_mixed.py FORMAT_VARIANTS)
VARIANTS=${VARIANTS:-"v0a 0 128 256 64 2
m1a 1 128 256 64 2
m2b 2 128 256 64 2
q3c 3 128 256 64 1 4 1 0 0
q4a 3 128 256 64 2 4 2 0 0
q4c 3 128 256 64 1 4 2 0 0
q4t 3 128 160 64 1 5 2 0 0
q4p 3 64 256 64 1 5 2 1 0
q0c 3 128 256 64 1 4 0 0 0
q5c 3 128 256 64 1 4 3 0 0
q6c 3 128 256 64 1 4 4 0 0
q7c 3 128 256 64 1 4 2 0 1
q8c 3 128 256 64 1 4 4 0 1
q4e 3 128 256 64 1 4 2 0 0 1 0
q4f 3 128 256 64 1 4 2 0 0 0 1
q4g 3 128 256 64 1 4 2 0 0 1 1
q4l 3 128 256 64 1 4 2 0 0 0 0 2
q4k 3 128 256 64 1 4 2 0 0 0 0 4
q3k 3 128 256 64 1 4 1 0 0 0 0 4
q4m 3 128 256 64 2 4 2 0 0 0 0 4
q0k 3 128 256 64 1 4 0 0 0 0 0 4
q9c 3 128 256 64 1 4 5 0 0
q9k 3 128 256 64 1 4 5 0 0 0 0 4
q9e 3 128 256 64 1 4 5 0 0 1 0
q9g 3 128 256 64 1 4 5 0 0 1 1 4
q0w 3 128 320 64 1 3 0 0 0
q4w 3 128 320 64 1 3 2 0 0
q9w 3 128 320 64 1 3 5 0 0
q3w 3 128 320 64 1 3 1 0 0
q0x 3 128 320 64 1 3 0 0 0 0 0 4
q9x 3 128 320 64 1 3 5 0 0 0 0 4
q4x 3 128 320 64 1 3 2 0 0 0 0 4
q3x 3 128 320 64 1 3 1 0 0 0 0 4
q9y 3 128 320 64 1 3 5 0 0 0 0 2
q9xe 3 128 320 64 1 3 5 0 0 1 0 4
q9xf 3 128 320 64 1 3 5 0 0 0 1 4
q9xg 3 128 320 64 1 3 5 0 0 1 1 4"}
JOBS=${JOBS:-$(nproc)}  # nvcc processes at once (each takes 1-2 GB of memory)
objs=()
while read -r name v tm tn tk cm st qdq pp early fmt mode loop; do
  [ -z "$name" ] && continue
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done  # a failed job is reported below
  nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a -Xcompiler -fPIC --expt-relaxed-constexpr \
    -I"$CUTLASS_DIR/include" -I"$CUTLASS_DIR/tools/util/include" \
    -DNAME="$name" -DVARIANT="$v" -DTM="$tm" -DTN="$tn" -DTK="$tk" -DCM="$cm" -DSTAGES="${st:-4}" -DQDQ="${qdq:-2}" -DPINGPONG="${pp:-0}" -DEARLY="${early:-1}" -DFMT="${fmt:-0}" -DMODE="${mode:-0}" -DLOOP="${loop:-0}" \
    -Xptxas -v -c "$SRC" -o "$TMP/$name.o" 2> "$TMP/$name.log" &
  objs+=("$TMP/$name.o")
done <<< "$VARIANTS"
wait || true
for o in "${objs[@]}"; do [ -f "$o" ] || { echo "build failed: $(basename "${o%.o}")" >&2; tail -5 "${o%.o}.log" >&2; exit 1; }; done
grep -h -E "registers|C75|[1-9][0-9]* bytes spill" "$TMP"/*.log | sort | uniq -c
nvcc -shared -cudart static -arch=sm_90a ${LDFLAGS:-} -o "$OUT" "${objs[@]}"
echo "built $OUT"
