#!/usr/bin/env bash
# One llama.cpp build for both the Python binding and llama-server, from the source llama-cpp-python's sdist vendors.
#
#   .ci/llamacpp.sh            builds (once per machine and flags) and prints the folder that holds the build
#
# The folder holds libllama.so and the ggml libraries (what llama-cpp-python loads: point LLAMA_CPP_LIB_PATH at it
# and install the binding with -DLLAMA_BUILD=OFF), llama-server and llama-quantize (which find the same libraries by
# their $ORIGIN run path) and build.txt: the version, the flags and the compiler. The folder's name carries the hash of the flags,
# so a build with other flags is never taken for this one. The flags are the portable ones (docs/how-to/llamacpp.md):
# AVX2/FMA/F16C kernels, the same on any x86-64 CPU with AVX2; no -march=native, no AVX-512, no AMX.
set -euo pipefail

version=0.3.36
flags="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
-DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_BLAS=OFF -DGGML_CCACHE=OFF \
-DLLAVA_BUILD=OFF"
# The server and the quantizer, and nothing else of llama.cpp's tools; its web UI is neither built nor fetched, and
# it serves plain HTTP.
server="-DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
hash=$(printf '%s %s' "$flags" "$server" | sha256sum | cut -c1-12)
root="${STAGEREPLAY_BUILDS:-$HOME/.cache/stagereplay/builds}"
dest="$root/llama.cpp-$version-$hash"

if [ ! -x "$dest/llama-server" ] || [ ! -x "$dest/llama-quantize" ] || [ ! -f "$dest/build.txt" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  python3 -m pip download -q --no-deps --no-binary :all: -d "$work" \
    "llama-cpp-python==$version" >&2
  tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
  # shellcheck disable=SC2086  # the flags are words
  cmake -S "$work/llama_cpp_python-$version" -B "$work/build" -DCMAKE_BUILD_TYPE=Release $flags $server \
    '-DCMAKE_BUILD_RPATH=$ORIGIN' >"$work/configure.log" 2>&1 || { cat "$work/configure.log" >&2; exit 1; }
  cmake --build "$work/build" --target llama-server llama-quantize -j "$(nproc)" >"$work/build.log" 2>&1 \
    || { tail -50 "$work/build.log" >&2; exit 1; }
  mkdir -p "$root"
  rm -rf "$dest.partial"
  cp -a "$work/build/bin" "$dest.partial"
  {
    echo "llama-cpp-python $version (its vendored llama.cpp)"
    echo "flags: $flags $server"
    echo "compiler: $(c++ --version | head -1)"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  } >"$dest.partial/build.txt"
  rm -rf "$dest"
  mv "$dest.partial" "$dest"  # whole or absent: a build that stopped halfway is never taken
fi
echo "$dest"
