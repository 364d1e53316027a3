# megamoe image.
#   GPU (default):  docker build -t megamoe .
#   CPU:            docker build -t megamoe:cpu --build-arg VARIANT=cpu .
# The GPU variant starts from NVIDIA's PyTorch container (CUDA torch, NCCL and apex are
# already there) and adds the `gpu` extras; the CPU variant installs the CPU torch wheel.
ARG VARIANT=gpu
ARG GPU_BASE=nvcr.io/nvidia/pytorch:25.10-py3
ARG CPU_BASE=python:3.11-slim

FROM ${GPU_BASE} AS base-gpu
ENV MEGAMOE_EXTRAS="gpu,logging"

FROM ${CPU_BASE} AS base-cpu
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
ENV MEGAMOE_EXTRAS="logging"

FROM base-${VARIANT}
WORKDIR /workspace/megamoe
COPY setup.py pyproject.toml README.md ./
COPY megamoe ./megamoe
RUN pip install --no-cache-dir -e ".[${MEGAMOE_EXTRAS}]"
COPY pretrain_gpt.py ./
COPY tools ./tools
COPY scripts ./scripts
COPY configs ./configs
COPY data ./data
ENV OMP_NUM_THREADS=1
CMD ["bash", "scripts/pretrain_tiny_cpu.sh"]
