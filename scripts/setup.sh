#!/usr/bin/env bash
# Create .venv and install chunkwise with its test, real-checkpoint and benchmark-plot extras.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU wheel of torch first (it lies on these machines): an unpinned torch would pull the newest
# CUDA build, several GB. On a machine with a CUDA torch already in the venv, this step is skipped.
# Bytecode is compiled at install: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines), Python would
# otherwise compile every module it imports again in every process, about 3 s a process for torch and transformers.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
# The rest through uv (the same versions as pip resolves here, in about a quarter of pip's minute); pip where uv
# cannot be installed or fails.
{ python -m pip install -q uv && python -m uv pip install -q --compile-bytecode -e ".[test,real,bench]"; } ||
  python -m pip install -q -e ".[test,real,bench]"
