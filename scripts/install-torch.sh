#!/usr/bin/env bash
# Install torch into the given interpreter's environment without ever pulling a CUDA build onto a
# machine that has no GPU: with a GPU, the normal (CUDA) build; without one, the CPU build (the
# 2.13.0 wheel on this machine's disk when pip can find it, else PyTorch's CPU index).
set -euo pipefail
py="$1"
if "$py" -c "import torch" 2>/dev/null; then
  echo "torch already installed: $("$py" -c 'import torch; print(torch.__version__)')"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$py" -m pip install -q torch
elif "$py" -m pip download -q --no-deps --no-index -d /tmp/megascope-torch-probe torch==2.13.0 >/dev/null 2>&1; then
  "$py" -m pip install -q torch==2.13.0      # the CPU wheel that lies on this machine's disk
else
  "$py" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
"$py" -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
