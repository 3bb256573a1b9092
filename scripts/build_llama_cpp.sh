#!/usr/bin/env bash
# Build the llama.cpp tools drafthead uses to prove its GGUF exports run in llama.cpp.
#
# Source: the llama.cpp tree vendored in the `llama-cpp-python==0.3.36` sdist from PyPI (no other
# network). Built once into ${DRAFTHEAD_CACHE:-~/.cache/drafthead}/llama.cpp/build; later calls only
# print the binary directory. Takes ~15 minutes on 2 cores.
#
#   scripts/build_llama_cpp.sh            # build (or reuse) and print the bin directory on the last line
#   LLAMA_CPP_TARGETS="llama-speculative-simple" scripts/build_llama_cpp.sh   # fewer tools
#   LLAMA_CPP_JOBS=4 scripts/build_llama_cpp.sh
set -euo pipefail

VERSION="0.3.36"
CACHE="${DRAFTHEAD_CACHE:-$HOME/.cache/drafthead}"
ROOT="$CACHE/llama.cpp"
SRC="$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$ROOT/build"
BIN="$BUILD/bin"
# speculative-simple: runs target + EAGLE3 draft; completion: target alone (same sampling);
# bench: verify-cost curve (time to evaluate 1..8 tokens in one batch at a given context depth).
TARGETS="${LLAMA_CPP_TARGETS:-llama-speculative-simple llama-completion llama-bench}"
JOBS="${LLAMA_CPP_JOBS:-$(nproc)}"
# bump when the build settings change: binaries from another recipe are rebuilt, not reused
RECIPE="llama-cpp-python-$VERSION no-amx-1 ${LLAMA_CPP_CMAKE_ARGS:-}"
STAMP="$BUILD/.drafthead-recipe"

have_all() {
  [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]] || return 1
  for t in $TARGETS; do [[ -x "$BIN/$t" ]] || return 1; done
}

if have_all; then
  echo "$BIN"
  exit 0
fi

for tool in cmake c++ tar; do
  command -v "$tool" >/dev/null || { echo "building llama.cpp needs $tool (cmake: pip install cmake)" >&2; exit 1; }
done

mkdir -p "$ROOT"
exec 9>"$ROOT/.build.lock"
flock 9  # one build at a time (tests and users may call this concurrently)
if have_all; then echo "$BIN"; exit 0; fi

if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  SDIST="$(ls "$ROOT"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
  if [[ -z "$SDIST" ]]; then
    echo "fetching llama-cpp-python==$VERSION sdist from PyPI ..." >&2
    python -m pip download --no-deps --no-binary :all: -q -d "$ROOT" "llama-cpp-python==$VERSION" >&2
    SDIST="$ROOT/llama_cpp_python-$VERSION.tar.gz"
  fi
  echo "unpacking $SDIST ..." >&2
  TMP="$(mktemp -d "$ROOT/.unpack.tmp-XXXXXX")"
  tar xzf "$SDIST" -C "$TMP"
  rm -rf "$ROOT/llama_cpp_python-$VERSION"
  mv "$TMP/llama_cpp_python-$VERSION" "$ROOT/"
  rmdir "$TMP"
fi

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)

# CPU features: the host's, except AMX. `-DGGML_NATIVE=ON` (-march=native) compiles ggml's AMX
# matmul kernels wherever the CPU advertises AMX, and they die with SIGILL ("tilezero") in VMs that do
# not hand out the AMX tile state (seen here: Firecracker guest on a Sapphire Rapids host). So we pass
# the x86 feature flags one by one from /proc/cpuinfo and leave AMX off. LLAMA_CPP_CMAKE_ARGS adds to
# (and overrides) these, e.g. LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=ON".
ISA=()
if [[ "$(uname -m)" == "x86_64" && -r /proc/cpuinfo ]]; then
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  has() { [[ "$flags" == *" $1 "* ]] && echo ON || echo OFF; }
  ISA=(-DGGML_NATIVE=OFF -DGGML_SSE42="$(has sse4_2)" -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)"
       -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)"
       -DGGML_AVX_VNNI="$(has avx_vnni)" -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
       -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
       -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
else
  ISA=(-DGGML_NATIVE=ON)
fi
# shellcheck disable=SC2206
EXTRA=(${LLAMA_CPP_CMAKE_ARGS:-})

start=$(date +%s)
echo "configuring llama.cpp in $BUILD ..." >&2
cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  "${ISA[@]}" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON "${EXTRA[@]}" >&2
echo "building $TARGETS with $JOBS jobs ..." >&2
# shellcheck disable=SC2086
cmake --build "$BUILD" --config Release -j "$JOBS" --target $TARGETS >&2
echo "llama.cpp tools built in $(( $(date +%s) - start )) s" >&2
for t in $TARGETS; do
  [[ -x "$BIN/$t" ]] || { echo "build finished but $t is missing in $BIN" >&2; exit 1; }
done
echo "$RECIPE" > "$STAMP"
echo "$BIN"
