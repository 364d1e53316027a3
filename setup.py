"""megamoe: Megatron-style Mixture-of-Experts GPT pretraining in PyTorch.

torch is pinned by the set-up scripts, not here: on a machine without CUDA they install
the CPU build (torch==2.13.0) before this package, so this requirement is already met and
pip never pulls a multi-GB CUDA build.
"""

from setuptools import find_packages, setup

setup(
    name="megamoe",
    version="0.1.0",
    description="Megatron-style Mixture-of-Experts GPT pretraining framework",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megamoe", "megamoe.*"]),
    # the blending helper is compiled on first use (megamoe/data/blend_native.py)
    package_data={"megamoe.data": ["blend_helper.c"],
                  "megamoe.config": ["megatron_unbuilt.txt"]},  # (config/megatron_unbuilt.py)
    install_requires=[
        "torch>=2.4",
        "numpy",
        "sentencepiece",
        "tokenizers",
        "safetensors",
        "tqdm",
        "pyyaml",
        "zstandard",  # tools/preprocess_data.py: .zst corpora
        "pyarrow",  # tools/preprocess_data.py: Parquet corpora
    ],
    extras_require={
        # pytest-xdist: scripts/test.sh runs the suite on two workers (one per core)
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "ruff", "tensorboard",
                 "matplotlib", "transformers>=4.46"],
        "logging": ["tensorboard", "wandb", "matplotlib"],  # matplotlib: expert-load heatmap
        # CUDA clusters only: never install it on a CPU-only machine (it builds against a
        # CUDA torch). Only what megamoe imports: grouped_gemm (the CUTLASS expert GEMMs);
        # Transformer Engine (--transformer-impl transformer_engine) is used when it imports
        # (NGC containers ship it); not in this extra: its torch extension builds from source.
        # NVIDIA apex is installed from NVIDIA's repository, not PyPI.
        "gpu": ["grouped_gemm"],
        # tools/checkpoint/convert.py megamoe-to-hf writes config.json through transformers
        # (hf-to-megamoe needs only safetensors, which is also a base requirement).
        "hf": ["transformers>=4.46", "safetensors"],
        # tools/preprocess_data.py --split-sentences: nltk's PunktTokenizer (>= 3.9 reads
        # the pickle-free punkt_tab data; get it with `python -m nltk.downloader punkt_tab`)
        "data": ["nltk>=3.9"],
        # the documentation site: mkdocs build --strict over docs/ (mkdocs.yml)
        "docs": ["mkdocs-material", "mkdocstrings[python]"],
        # No "bench" extra on purpose: DeepSpeed, the peer in tools/bench_dispatch.py, must be
        # installed with DS_BUILD_OPS=0, --no-build-isolation and --no-deps (else pip may
        # replace the CPU torch): scripts/install_bench_peers.sh. Never a runtime dependency.
    },
    scripts=[],
)
