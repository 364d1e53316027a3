"""The one object training talks to about checkpoints: save, load, reseed, retention,
background saves, whatever the format.

`--ckpt-format torch_dist` (default): every rank writes its shards (dist.py); `torch`: one
file written by rank 0 (single_file.py). Loading detects the format from the directory.
Retention (--ckpt-keep-last, --save-retain-interval) and the publish protocol are publish.py's.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from megamoe.config import RunConfig, to_dict
from megamoe.model.fp8.params import value
from megamoe.parallel.mesh import Mesh
from megamoe.parallel.rng import PIPELINE_SEED_STRIDE
from megamoe.training.checkpoint.dist import (
    AsyncDistSaver,
    load_dist_checkpoint,
    save_dist_checkpoint,
)
from megamoe.training.checkpoint.publish import (
    TRACKER,
    Retention,
    agree,
    checkpoint_file,
    is_dist_checkpoint,
    iteration_dir,
    list_checkpoints,
)
from megamoe.training.checkpoint.rng_state import reseed
from megamoe.training.checkpoint.safe_load import CheckpointError
from megamoe.training.checkpoint.save_planner import SavePlanners
from megamoe.training.checkpoint.single_file import (
    AsyncCheckpointWriter,
    build_state,
    load_checkpoint,
    write_checkpoint,
)
from megamoe.training.nonfinite import check_params_before_save
from megamoe.training.optim.fp8_shards import fp8_weights_loading


class CheckpointManager:
    """Saves and loads this rank's `model`, `optimizer` and `scheduler` for `run`."""

    def __init__(self, run: RunConfig, mesh: Mesh, model: torch.nn.Module, optimizer,
                 scheduler, log: Callable[[str], None] = print) -> None:
        self.run, self.config = run, run.checkpoint
        self.mesh, self.model = mesh, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.log = log
        self.dist_format = self.config.ckpt_format == "torch_dist"
        self.retention = Retention(self.config.ckpt_keep_last, self.config.save_retain_interval)
        self.planners = SavePlanners(self.config.ckpt_fully_parallel_save,
                                     self.config.ckpt_assume_constant_structure)
        self.writer = None
        if self.config.async_save and self.dist_format:
            self.writer = AsyncDistSaver()  # every rank writes its shards in the background
        elif self.config.async_save and mesh.rank == 0:
            self.writer = AsyncCheckpointWriter()

    def save(self, iteration: int, consumed_samples: int) -> None:
        """Write iteration `iteration` under --save (every rank calls it); NonFiniteError
        instead when a parameter holds NaN/Inf (with the NaN check on)."""
        c = self.config
        if self.run.train.check_for_nan_in_loss_and_grad:
            check_params_before_save(map(value, self.model.parameters()), iteration,
                                     self.mesh.rank,
                                     self.mesh.world_size, self.mesh.device)
        if self.dist_format:
            save_fn = self.writer.save if self.writer is not None else save_dist_checkpoint
            save_fn(c.save, iteration, self.model, self.optimizer, self.scheduler, self.mesh,
                    consumed_samples, self.run.command_line,
                    model_config=to_dict(self.run.model), save_optim=not c.no_save_optim,
                    save_rng=not c.no_save_rng, keep_last=self.retention,
                    planner=self.planners())
            how = "saving (in the background)" if self.writer is not None else "saved"
            self._log(f"> {how} checkpoint at iteration {iteration} to {c.save}")
            return
        def write() -> None:
            state = build_state(iteration, self.model, self.optimizer, self.scheduler,
                                consumed_samples, self.run.command_line,
                                save_optim=not c.no_save_optim, save_rng=not c.no_save_rng,
                                model_config=to_dict(self.run.model))
            if self.writer is not None:  # snapshot now, write in the background
                self.writer.save(c.save, iteration, state, self.retention)
            else:
                write_checkpoint(c.save, iteration, state, self.retention)
            self._log(f"> saved checkpoint at iteration {iteration} to {c.save}")

        self._rank0_agreed(write)  # (also the barrier after the save)

    def finalize(self) -> None:
        """The last background save is complete (and published) when this returns; a
        failed one raises CheckpointError on every rank."""
        if self.dist_format and self.writer is not None:
            self.writer.finalize()  # collective
        elif self.config.async_save:
            self._rank0_agreed(self.writer.finalize if self.writer is not None else None)

    def _rank0_agreed(self, fn) -> None:
        """Single-file format: rank 0 runs `fn` (writing), every rank learns whether it
        failed (CheckpointError: the one line naming --save), so none waits forever."""
        error, bug = None, None
        if self.mesh.rank == 0 and fn is not None:
            try:
                fn()
            except CheckpointError as e:
                error = str(e)
            except Exception as e:  # not a storage failure: rank 0 keeps the traceback
                bug, error = e, f"rank 0 failed to save a checkpoint to {self.config.save}"
        error = agree(error, self.mesh.world_size)
        if bug is not None:
            raise bug
        if error is not None:
            raise CheckpointError(error)

    def load(self) -> tuple[int, int]:
        """--load: (iteration, consumed samples) to resume from; (0, 0) when --load names a
        directory without a checkpoint yet (it is also --save) or with --finetune."""
        c = self.config
        if c.load is None:
            return 0, 0
        found = self._find()
        if found is None:
            if c.exit_on_missing_checkpoint:
                raise CheckpointError(f"--load {c.load}: no checkpoint found "
                                      "(--exit-on-missing-checkpoint)")
            if c.load != c.save:
                raise CheckpointError(f"--load {c.load}: no checkpoint found")
            return 0, 0
        dist_format = is_dist_checkpoint(found)
        if dist_format and c.ckpt_format == "torch" and not c.auto_detect_ckpt_format:
            raise CheckpointError(f"{found}: a torch_dist checkpoint, but --ckpt-format torch "
                                  "(pass --auto-detect-ckpt-format to load it, as Megatron)")
        iteration, consumed = (self._load_dist(found) if dist_format
                               else self._load_single_file(found))
        if iteration:
            self._log(f"> loaded checkpoint from {c.load} at iteration {iteration}")
        return iteration, consumed

    def _find(self) -> Optional[str]:
        """What --load (with --ckpt-step: its iter_N) names; None where it holds no
        checkpoint. A directory with complete `iter_*` checkpoints but no pointer file is
        refused rather than trained from scratch (and then pruned by --ckpt-keep-last):
        Megatron warns and starts from random weights there; README, deviations."""
        c = self.config
        if c.ckpt_step is not None:
            path = iteration_dir(c.load, c.ckpt_step)
            found = checkpoint_file(path) if os.path.isdir(path) else None
            if found is None:
                raise CheckpointError(f"--ckpt-step {c.ckpt_step}: {path} holds no checkpoint")
            return found
        found = checkpoint_file(c.load) if os.path.exists(c.load) else None
        complete = list_checkpoints(c.load) if found is None else []
        if complete:
            raise CheckpointError(
                f"--load {c.load}: no {TRACKER} but complete checkpoints up to "
                f"iter_{complete[-1]:07d}; to resume from it pass --ckpt-step {complete[-1]} "
                "(megamoe does not start from scratch over trained checkpoints)")
        return found

    def _load_single_file(self, found: str) -> tuple[int, int]:
        mesh, c = self.mesh, self.config
        sharded = mesh.tp_size > 1 or mesh.pp_size > 1 or mesh.ep_size > 1 or (
            self.run.parallel.use_distributed_optimizer and mesh.dp_size * mesh.edp_size > 1)
        if sharded or self.run.fp8.param_gather:
            raise CheckpointError(f"{found}: a single-file (--ckpt-format torch) checkpoint "
                                  "loads only without tensor/pipeline/expert parallelism, "
                                  "the distributed optimizer and --fp8-param-gather; save it "
                                  "with torch_dist")
        return load_checkpoint(found, self.model, self.optimizer, self.scheduler,
                               load_optim=not c.no_load_optim, load_rng=not c.no_load_rng,
                               finetune=c.finetune)

    def _load_dist(self, found: str) -> tuple[int, int]:
        """Any layout; RNG states come back only under the layout they were saved from,
        otherwise the streams are reseeded from --seed and the iteration."""
        c, seed = self.config, self.run.train.seed
        with fp8_weights_loading(self.optimizer):  # (--fp8-param-gather)
            common = load_dist_checkpoint(found, self.model, self.optimizer, self.scheduler,
                                          self.mesh, load_optim=not c.no_load_optim,
                                          load_rng=not c.no_load_rng, finetune=c.finetune,
                                          strictness=c.dist_ckpt_strictness)
        if c.finetune:
            return 0, 0
        iteration = int(common["iteration"])
        if common.get("fp8_note"):
            self._log(common["fp8_note"])
        if not c.no_load_rng and common.get("rng") and not common["rng_restored"]:
            self._log(f"> checkpoint saved under another layout ({common.get('layout')}): "
                      f"RNG states reseeded from --seed {seed} and the iteration")
            reseed(seed, iteration, PIPELINE_SEED_STRIDE * self.mesh.pp_rank)
        return iteration, int(common["consumed_train_samples"])

    def _log(self, msg: str) -> None:
        if self.mesh.rank == 0:
            self.log(msg)

