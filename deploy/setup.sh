#!/usr/bin/env bash
# Set up .venv with comlrl-split, vLLM for CPU (or GPU: EXTRA=gpu), the test tools and
# matplotlib (the demo's training-curve picture).
# Idempotent: a stamp keyed on pyproject.toml makes a second run return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
EXTRA="${EXTRA:-cpu}"
stamp="$VENV/.setup-$EXTRA-$(sha256sum pyproject.toml deploy/setup.sh | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[$EXTRA,test,plot]"
if [ "$EXTRA" = cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds; on CPU they break `import vllm`
  # and transformers' Qwen2 import. Nothing here uses them.
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import comlrl, workers, vllm, ray, wandb" >/dev/null
rm -f "$VENV"/.setup-*
touch "$stamp"
echo "comlrl-split: $VENV ready"
