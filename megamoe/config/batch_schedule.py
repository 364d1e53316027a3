"""Megatron's --step-batch-size-schedule, and --rampup-batch-size as one.

Megatron-LM (megatron/core/num_microbatches_calculator.py, StepBatchsizeNumMicroBatches-
Calculator) takes "THRESHOLD:BATCH THRESHOLD:BATCH ..." (spaces or commas; K, M, B, T
suffixes; thresholds sorted, the first 0, strictly increasing, sizes > 0). pretrain_gpt.py
passes --seq-length, so the thresholds count *tokens*, floor-divided into samples. The
step whose consumed samples reach a threshold uses its size.

Megatron ignores --rampup-batch-size since April 2026 (deprecated for the step schedule);
megamoe keeps its linear ramp by translating it into the step schedule that gives every
step the size the old RampupBatchsizeNumMicroBatchesCalculator gave: size start + k x
increment from sample ceil(k x ramp samples / increments).
"""

from __future__ import annotations

from megamoe.config.fields import ConfigError

FLAG = "--step-batch-size-schedule"
_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _number(text: str, entry: str) -> int:
    """Megatron's _parse_numeric_value: int(float(value) x suffix)."""
    t = text.strip().upper()
    scale = _SUFFIX.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t)
    except ValueError:
        raise ConfigError(f"{FLAG}: cannot read {entry!r} (expected THRESHOLD:BATCH_SIZE, "
                          f"e.g. 0:768 250B:1536)") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{FLAG}: {entry!r} is not a finite number")
    return int(value * scale)


def parse_step_schedule(text: str, seq_length: int | None) -> list[list[int]]:
    """The schedule as [[threshold in samples, global batch size], ...], sorted and
    checked as Megatron's _parse_schedule / _validate_schedule; thresholds are tokens
    when `seq_length` is given (the command line), samples otherwise."""
    entries = text.strip().replace(",", " ").split()
    if not entries:
        raise ConfigError(f"{FLAG}: needs at least one THRESHOLD:BATCH_SIZE entry")
    schedule = []
    for entry in entries:
        if ":" not in entry:
            raise ConfigError(f"{FLAG}: invalid entry {entry!r}, expected THRESHOLD:BATCH_SIZE")
        threshold, size = (_number(part, entry) for part in entry.split(":", 1))
        if threshold < 0:
            raise ConfigError(f"{FLAG}: threshold must be >= 0, got {entry!r}")
        if size <= 0:
            raise ConfigError(f"{FLAG}: batch size must be positive, got {entry!r}")
        schedule.append([threshold // seq_length if seq_length else threshold, size])
    schedule.sort(key=lambda e: e[0])
    if schedule[0][0] != 0:
        raise ConfigError(f"{FLAG}: the first threshold must be 0, got {schedule[0][0]} "
                          f"samples")
    for (a, _), (b, _) in zip(schedule, schedule[1:]):
        if b <= a:
            raise ConfigError(f"{FLAG}: thresholds must be strictly increasing (in samples), "
                              f"got {a} then {b}")
    return schedule


def rampup_as_step_schedule(start: int, increment: int, ramp_samples: int,
                            global_batch_size: int) -> list[list[int]]:
    """--rampup-batch-size start increment samples (to --global-batch-size) as the step
    schedule with the same size at every consumed-sample count. Thresholds that coincide
    (fewer ramp samples than increments) keep the later, larger size, as the ramp did."""
    steps = (global_batch_size - start) // increment
    schedule: list[list[int]] = []
    for k in range(steps + 1):
        threshold = -(-k * ramp_samples // steps)
        if schedule and schedule[-1][0] == threshold:
            schedule.pop()
        schedule.append([threshold, start + k * increment])
    return schedule


def schedule_text(schedule: list[list[int]], seq_length: int) -> str:
    """The schedule as a --step-batch-size-schedule value (thresholds in tokens)."""
    return " ".join(f"{t * seq_length}:{bs}" for t, bs in schedule)


def batch_size_at(schedule: list[list[int]], consumed_samples: int) -> int:
    """Megatron's _get_batch_size_for_samples: the last entry whose threshold is reached."""
    size = schedule[0][1]
    for threshold, bs in schedule:
        if consumed_samples < threshold:
            break
        size = bs
    return size


def iterations_for_samples(schedule: list[list[int]], train_samples: int) -> int:
    """Megatron's update_train_iters with a step schedule: steps until the consumed samples
    reach --train-samples (the last may pass it). Past the last threshold the count is
    closed-form, so a long run's schedule is not walked step by step."""
    consumed = iterations = 0
    last_threshold, final = schedule[-1]
    while consumed < train_samples and consumed < last_threshold:
        consumed += batch_size_at(schedule, consumed)
        iterations += 1
    if consumed < train_samples:
        iterations += -(-(train_samples - consumed) // final)
    return iterations


def samples_for_iterations(schedule: list[list[int]], iterations: int) -> int:
    """Samples the first `iterations` steps consume."""
    consumed = done = 0
    last_threshold, final = schedule[-1]
    while done < iterations and consumed < last_threshold:
        consumed += batch_size_at(schedule, consumed)
        done += 1
    return consumed + (iterations - done) * final
