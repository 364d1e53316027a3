# megamoe image.
#   GPU (default):  docker build -t megamoe .
#   CPU:            docker build -t megamoe:cpu --build-arg VARIANT=cpu .
#   run:            docker run --gpus all --ipc=host megamoe \
#                     bash scripts/pretrain_mixtral_8x7b.sh CKPT TOKENIZER DATA
# The GPU variant starts from NVIDIA's PyTorch container (CUDA torch, NCCL, NVIDIA apex and
# transformer-engine are already there) and adds the `gpu` and `logging` extras; the CPU
# variant installs the CPU torch wheel and the `logging` extras. The default command
# prepares the bundled corpus and trains the tiny model (works in both variants).
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
# Package metadata and code first, so editing scripts or configs does not reinstall.
COPY setup.py pyproject.toml README.md ./
COPY megamoe ./megamoe
RUN pip install --no-cache-dir -e ".[${MEGAMOE_EXTRAS}]"
COPY pretrain_gpt.py ./
COPY tools ./tools
COPY scripts ./scripts
COPY configs ./configs
COPY data/shakespeare ./data/shakespeare
RUN chmod +x scripts/*.sh scripts/*.sbatch
ENV OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 WANDB_MODE=offline
CMD ["bash", "-c", "bash scripts/prepare_corpus.sh && bash scripts/pretrain_tiny_cpu.sh"]
