"""The parallel layout: how many ranks each kind of parallelism uses, and the pipeline's
split of the layers. Validated here once; the mesh (megamoe/parallel/mesh.py) builds its
process groups from a valid layout only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.config.fields import check_positive, derived, flag, require
from megamoe.config.pipeline_split import PipelineSplit
from megamoe.config.tp_comm_overlap import TPCommOverlap

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
    # Megatron's --tp-comm-overlap and the sub-options that map onto megamoe's collective
    # matmul (config/tp_comm_overlap.py); the store_false ones are --disable-*/--no-*.
    tp_comm_overlap: bool = flag("--tp-comm-overlap", False)
    tp_comm_overlap_ag: bool = flag("--disable-tp-comm-overlap-ag", True,
                                    dest="tp_comm_overlap_ag")
    tp_comm_overlap_rs: bool = flag("--disable-tp-comm-overlap-rs", True,
                                    dest="tp_comm_overlap_rs")
    tp_comm_overlap_rs_dgrad: bool = flag("--tp-comm-overlap-rs-dgrad", False)
    tp_comm_bulk_wgrad: bool = flag("--disable-tp-comm-bulk-wgrad", True,
                                    dest="tp_comm_bulk_wgrad")
    tp_comm_bulk_dgrad: bool = flag("--disable-tp-comm-bulk-dgrad", True,
                                    dest="tp_comm_bulk_dgrad")
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
    # Megatron's other split flags (config/pipeline_split.py): the embedding / loss counted
    # as a layer when dividing, or an explicit per-stage layout string.
    account_for_embedding_in_pipeline_split: bool = flag(
        "--account-for-embedding-in-pipeline-split", False)
    account_for_loss_in_pipeline_split: bool = flag(
        "--account-for-loss-in-pipeline-split", False)
    pipeline_model_parallel_layout: Optional[str] = flag(
        "--pipeline-model-parallel-layout", None)
    num_virtual_stages_per_pipeline_rank: Optional[int] = flag(
        "--num-virtual-stages-per-pipeline-rank", None)
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

    @property
    def tp_comm(self) -> Optional[TPCommOverlap]:
        """What the TP layers overlap (None: --tp-comm-overlap not given)."""
        if not self.tp_comm_overlap:
            return None
        return TPCommOverlap(self.tp_comm_overlap_ag, self.tp_comm_overlap_rs,
                             self.tp_comm_overlap_rs_dgrad, self.tp_comm_bulk_wgrad,
                             self.tp_comm_bulk_dgrad)

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
                       "num_virtual_stages_per_pipeline_rank",
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
        self._check_tp_comm_overlap()
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
        self.split.check_flags()

    def _check_tp_comm_overlap(self) -> None:
        """Megatron's assert (SP, which it has already turned off at TP 1), and no
        sub-option accepted where nothing reads it (Megatron ignores them without
        --tp-comm-overlap; megamoe refuses)."""
        if self.tp_comm_overlap:
            require(self.sp, "--tp-comm-overlap needs --sequence-parallel and "
                             "--tensor-model-parallel-size > 1 (tensor-parallel communication "
                             "overlaps GEMMs only under sequence parallelism)")
            return
        subs = {"--disable-tp-comm-overlap-ag": not self.tp_comm_overlap_ag,
                "--disable-tp-comm-overlap-rs": not self.tp_comm_overlap_rs,
                "--tp-comm-overlap-rs-dgrad": self.tp_comm_overlap_rs_dgrad,
                "--disable-tp-comm-bulk-wgrad": not self.tp_comm_bulk_wgrad,
                "--disable-tp-comm-bulk-dgrad": not self.tp_comm_bulk_dgrad}
        for name, given in subs.items():
            require(not given, f"{name} needs --tp-comm-overlap")

    @property
    def split(self) -> PipelineSplit:
        """The flags that divide the layers among the pipeline's stages."""
        return PipelineSplit(self.pipeline_model_parallel_size,
                             self.num_layers_per_virtual_pipeline_stage,
                             self.decoder_first_pipeline_num_layers,
                             self.decoder_last_pipeline_num_layers,
                             self.account_for_embedding_in_pipeline_split,
                             self.account_for_loss_in_pipeline_split,
                             self.pipeline_model_parallel_layout,
                             self.num_virtual_stages_per_pipeline_rank)

    def layer_ranges(self, num_layers: int, mtp_num_layers: int = 0
                     ) -> list[list[tuple[int, int]]]:
        """This layout's (rank, chunk) -> (first layer, end layer) of `num_layers`
        (config/pipeline_split.py; the MTP depth is checked against a layout string)."""
        return self.split.ranges(num_layers, mtp_num_layers)

