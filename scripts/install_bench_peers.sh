#!/usr/bin/env bash
# Benchmark-only peers for tools/bench_dispatch.py: DeepSpeed-MoE (deepspeed.moe.layer.MoE)
# on CPU + gloo. Never a runtime or test dependency (scripts/env.sh does not run this);
# without it the benchmark's peer row says "skipped".
# Usage: bash scripts/install_bench_peers.sh   (after scripts/env.sh made .venv)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
if [ ! -x "$PY" ]; then
  echo "install_bench_peers.sh: $PY not found: run 'source scripts/env.sh' first" >&2
  exit 1
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
TORCH_BEFORE="$("$PY" -c 'import torch; print(torch.__version__)')"
# DS_BUILD_OPS=0: no C++/CUDA op is compiled at install. --no-deps: pip must never swap
# the CPU torch for a CUDA build; the pure-Python packages deepspeed's import needs are
# listed below instead (numpy, packaging, pydantic and tqdm come with megamoe's own deps).
DS_BUILD_OPS=0 "$PY" -m pip install -q --no-build-isolation --no-deps deepspeed==0.19.8
"$PY" -m pip install -q --no-deps einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 \
  psutil==7.2.2 py-cpuinfo==9.0.0
if ! "$PY" -c 'import pydantic' >/dev/null 2>&1; then
  "$PY" -m pip install -q "pydantic>=2,<3"
fi
TORCH_AFTER="$("$PY" -c 'import torch; print(torch.__version__)')"
if [ "$TORCH_BEFORE" != "$TORCH_AFTER" ]; then
  echo "install_bench_peers.sh: torch changed ($TORCH_BEFORE -> $TORCH_AFTER)" >&2
  exit 1
fi
DS_ACCELERATOR=cpu "$PY" -c 'import deepspeed; from deepspeed.moe.layer import MoE; print(f"deepspeed {deepspeed.__version__}: tools/bench_dispatch.py runs its MoE layer as a peer")'
