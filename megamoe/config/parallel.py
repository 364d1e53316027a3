"""The parallel layout: how many ranks each kind of parallelism uses, and the pipeline's
split of the layers. Validated here once; the mesh (megamoe/parallel/mesh.py) builds its
process groups from a valid layout only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.config.fields import ConfigError, check_positive, derived, flag, require

BACKENDS = ("nccl", "gloo")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", 1)
    pipeline_model_parallel_size: int = flag("--pipeline-model-parallel-size", 1)
    context_parallel_size: int = flag("--context-parallel-size", 1)
    # Megatron's --cp-comm-type: one value for every layer or one per layer (checked
    # against the layer count where the model is known: parallelize.py).
    cp_comm_type: list[str] = flag("--cp-comm-type", default_factory=lambda: ["p2p"])
    expert_model_parallel_size: int = flag("--expert-model-parallel-size", 1)
    expert_tensor_parallel_size: Optional[int] = flag("--expert-tensor-parallel-size",
                                                      None)  # None = TP
    sequence_parallel: bool = flag("--sequence-parallel", False)
    use_distributed_optimizer: bool = flag("--use-distributed-optimizer", False)
    # Megatron's DDP options (training/optim/overlap.py): data-parallel gradient reduction
    # in buckets launched from the backward as each fills, the distributed optimizer's
    # parameter all-gather overlapped with the next forward, and the bucket size in
    # elements (None: Megatron's max(40M, 1M x DP) when overlapping, else one bucket).
    overlap_grad_reduce: bool = flag("--overlap-grad-reduce", False)
    overlap_param_gather: bool = flag("--overlap-param-gather", False)
    ddp_bucket_size: Optional[int] = flag("--ddp-bucket-size", None)
    world_size: int = derived("WORLD_SIZE (torchrun's environment)", 1)
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag(
        "--num-layers-per-virtual-pipeline-stage", None)
    decoder_first_pipeline_num_layers: Optional[int] = flag(
        "--decoder-first-pipeline-num-layers", None)
    decoder_last_pipeline_num_layers: Optional[int] = flag(
        "--decoder-last-pipeline-num-layers", None)
    distributed_backend: Optional[str] = flag("--distributed-backend", None)  # None: auto
    distributed_timeout_minutes: float = flag("--distributed-timeout-minutes", 10.0)
    # Megatron's meaning: initialise the weights in host memory, then copy them to the
    # device (the values are the same either way; training/materialize.py).
    use_cpu_initialization: bool = flag("--use-cpu-initialization", False)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def layout(cls, world_size: int, *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
               etp: Optional[int] = None) -> ParallelConfig:
        """Shorthand for a layout of `world_size` ranks (tests, tools)."""
        return cls(tensor_model_parallel_size=tp, context_parallel_size=cp,
                   pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                   expert_tensor_parallel_size=etp, world_size=world_size)

    @property
    def etp(self) -> int:
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size
                                   * self.pipeline_model_parallel_size
                                   * self.context_parallel_size)

    @property
    def expert_data_parallel_size(self) -> int:
        return self.world_size // (self.etp * self.expert_model_parallel_size
                                   * self.pipeline_model_parallel_size)

    @property
    def sp(self) -> bool:
        """Sequence parallelism actually active (meaningless without TP)."""
        return self.sequence_parallel and self.tensor_model_parallel_size > 1

    def sizes(self) -> dict[str, int]:
        """Every dimension's size: tp, cp, pp, ep, etp, dp, edp."""
        return {"tp": self.tensor_model_parallel_size, "cp": self.context_parallel_size,
                "pp": self.pipeline_model_parallel_size,
                "ep": self.expert_model_parallel_size, "etp": self.etp,
                "dp": self.data_parallel_size, "edp": self.expert_data_parallel_size}

    def validate(self) -> None:
        check_positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                       "context_parallel_size", "expert_model_parallel_size",
                       "expert_tensor_parallel_size", "world_size",
                       "distributed_timeout_minutes", "num_layers_per_virtual_pipeline_stage",
                       "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                       "ddp_bucket_size")
        tp, pp, cp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                      self.context_parallel_size)
        ep, etp = self.expert_model_parallel_size, self.etp
        require(self.world_size % (tp * pp * cp) == 0,
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-"
                f"size ({tp}) x --pipeline-model-parallel-size ({pp}) x "
                f"--context-parallel-size ({cp})")
        require(self.world_size % (etp * ep * pp) == 0,
                f"world size {self.world_size} is not divisible by --expert-tensor-parallel-"
                f"size ({etp}) x --expert-model-parallel-size ({ep}) x "
                f"--pipeline-model-parallel-size ({pp})")
        require(etp in (1, tp), f"not supported yet: --expert-tensor-parallel-size {etp} "
                                f"other than 1 or --tensor-model-parallel-size ({tp})")
        # Megatron ignores a bucket size without overlap (one bucket per buffer): refused
        # here rather than accepted and ignored.
        require(self.ddp_bucket_size is None or self.overlap_grad_reduce,
                "--ddp-bucket-size needs --overlap-grad-reduce (without it the gradients "
                "reduce as one bucket per buffer, as in Megatron-LM)")
        if self.overlap_param_gather:  # Megatron's asserts in arguments.py
            require(self.use_distributed_optimizer,
                    "--overlap-param-gather needs --use-distributed-optimizer")
            require(self.overlap_grad_reduce,
                    "--overlap-param-gather needs --overlap-grad-reduce")
        for v in self.cp_comm_type:
            require(v != "a2a+p2p", f"not supported yet: --cp-comm-type {v}")
            require(v in ("p2p", "allgather", "a2a"),
                    f"--cp-comm-type must be p2p, allgather, a2a or a2a+p2p, got {v!r}")
        backend = self.distributed_backend
        require(backend is None or backend in BACKENDS,
                f"--distributed-backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if pp == 1:
            require(self.num_layers_per_virtual_pipeline_stage is None,
                    "--num-layers-per-virtual-pipeline-stage needs "
                    "--pipeline-model-parallel-size > 1")

    def layer_ranges(self, num_layers: int) -> list[list[tuple[int, int]]]:
        """This layout's pipeline split of `num_layers` (see pipeline_layer_ranges)."""
        return pipeline_layer_ranges(num_layers, self.pipeline_model_parallel_size,
                                     self.num_layers_per_virtual_pipeline_stage,
                                     self.decoder_first_pipeline_num_layers,
                                     self.decoder_last_pipeline_num_layers)


def pipeline_layer_ranges(num_layers: int, pp: int, layers_per_virtual_stage: Optional[int] = None,
                          first: Optional[int] = None, last: Optional[int] = None
                          ) -> list[list[tuple[int, int]]]:
    """[rank][chunk] -> (first layer, end layer). Virtual stage v = chunk * pp + rank holds
    consecutive layers; uneven first/last stages take `first` / `last` layers and the middle
    stages share the rest evenly. Raises ConfigError naming the flags on a bad split."""
    if layers_per_virtual_stage is not None:
        if first is not None or last is not None:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage cannot be combined "
                              "with --decoder-first/last-pipeline-num-layers")
        if layers_per_virtual_stage < 1 or num_layers % (pp * layers_per_virtual_stage):
            raise ConfigError(
                f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-"
                f"size ({pp}) x --num-layers-per-virtual-pipeline-stage "
                f"({layers_per_virtual_stage})")
        chunks = num_layers // (pp * layers_per_virtual_stage)
        n = layers_per_virtual_stage
        return [[((c * pp + r) * n, (c * pp + r + 1) * n) for c in range(chunks)]
                for r in range(pp)]
    if pp == 1 and (first is not None or last is not None):
        raise ConfigError("--decoder-first/last-pipeline-num-layers need "
                          "--pipeline-model-parallel-size > 1")
    counts: list[Optional[int]] = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if any(c is not None and c < 1 for c in counts) or rest < 0 or (
            free and (rest % len(free) or rest // len(free) < 1)) or (not free and rest):
        raise ConfigError(
            f"--num-layers ({num_layers}) cannot be split over --pipeline-model-parallel-size "
            f"({pp}) stages (first stage {first}, last stage {last}): every stage needs at "
            "least one layer and the other stages an equal share")
    for i in free:
        counts[i] = rest // len(free)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return [[(bounds[r], bounds[r + 1])] for r in range(pp)]
