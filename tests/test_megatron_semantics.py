"""Flags that megamoe once read differently from current Megatron-LM (or refused), each
checked against Megatron's own formula (NVIDIA/Megatron-LM d98e8a64, August 2026):

- --make-vocab-size-divisible-by m: padded to a multiple of m x TP (vocab_size_with_padding);
- --padded-vocab-size N: N rows as given (TokenizerConfig.padded_vocab_size skips the
  padding), which TP must divide (VocabParallelEmbedding) and which must hold the vocabulary;
- NullTokenizer --vocab-size V: V ids, EOD = V - 1 (--null-tokenizer-eod-id overrides);
- --eval-interval: default None (no evaluation during training);
- --data-path p1 p2 without weights: blended by the datasets' sizes, each used once;
- --step-batch-size-schedule (and --rampup-batch-size, translated into one).
"""

from __future__ import annotations

import math
import shlex

import pytest

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 16 "
        "--max-position-embeddings 16 --mock-data --lr 1e-3 --train-iters 4 "
        "--hidden-dropout 0 --attention-dropout 0")


def _run(flags: str, world: int = 1, vocab: int = 1000, base: str = BASE):
    args = parse_args(shlex.split(f"{base} {flags}"), world_size=world)
    return run_config_from_args(args, vocab_size=vocab)


def megatron_vocab_size_with_padding(vocab: int, m: int, tp: int) -> int:
    """megatron/core/tokenizers/utils/build_tokenizer.py: vocab_size_with_padding."""
    multiple = m * tp
    return int(math.ceil(vocab / multiple) * multiple)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("vocab, m", [(151936, 128), (50257, 128), (32000, 64), (97, 3)])
def test_padded_vocab_is_a_multiple_of_divisor_times_tp(tp, vocab, m):
    sp = "--sequence-parallel" if tp > 1 else ""
    run = _run(f"--tensor-model-parallel-size {tp} {sp} --make-vocab-size-divisible-by {m}",
               world=tp, vocab=vocab)
    assert run.model.padded_vocab_size == megatron_vocab_size_with_padding(vocab, m, tp)
    assert run.model.padded_vocab_size % tp == 0


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_padded_vocab_size_is_taken_as_given(tp):
    """1040 is no multiple of 128 x TP (the computed size is 1024): the flag's value wins."""
    sp = "--sequence-parallel" if tp > 1 else ""
    run = _run(f"--tensor-model-parallel-size {tp} {sp} --padded-vocab-size 1040",
               world=tp, vocab=1000)
    assert run.model.padded_vocab_size == 1040
    assert megatron_vocab_size_with_padding(1000, 128, tp) == 1024


def test_padded_vocab_size_below_the_vocabulary_is_one_line():
    """(Megatron would index past the table; a TP that does not divide the size:
    tests/test_numeric_ranges.py.)"""
    from megamoe.config import ConfigError
    with pytest.raises(ConfigError) as err:
        _run("--padded-vocab-size 999", vocab=1000)
    assert str(err.value) == ("--padded-vocab-size 999 is smaller than the tokenizer's "
                              "vocabulary (1000)")


def test_qwen3_vocab_at_tp4_matches_megatron_checkpoints():
    run = _run("--tensor-model-parallel-size 4 --sequence-parallel", world=4, vocab=151936)
    assert run.model.padded_vocab_size == 152064  # megamoe once padded to 151936


def test_null_tokenizer_ids_are_megatrons():
    """megatron NullTokenizer(vocab_size, eod_id=None): vocab_size ids, eod vocab_size - 1."""
    from megamoe.data.loaders import tokenizer_for
    run = _run("--tokenizer-type NullTokenizer --vocab-size 97")
    tok = tokenizer_for(run.data)
    assert (tok.vocab_size, tok.eod) == (97, 96)
    tok = tokenizer_for(_run("--tokenizer-type NullTokenizer --vocab-size 97 "
                             "--null-tokenizer-eod-id 0").data)
    assert (tok.vocab_size, tok.eod) == (97, 0)
    with pytest.raises(SystemExit):
        _run("--tokenizer-type NullTokenizer --vocab-size 97 --null-tokenizer-pad-id 5")


def megatron_eval_samples(train_iters: int, eval_interval, eval_iters: int, gbs: int) -> int:
    """megatron/training/training.py get_train_valid_test_num_samples (validation), where
    eval_interval None stands for what Megatron documents (validation after training only;
    its code raises TypeError on `train_iters // None`, the deviation README names)."""
    points = (train_iters // eval_interval if eval_interval else 0) + 1
    return points * eval_iters * gbs


@pytest.mark.parametrize("interval", [None, 1, 3, 1000])
def test_eval_schedule_default_is_after_training_only(interval):
    flag = f"--eval-interval {interval}" if interval else ""
    t = _run(f"--train-iters 7 {flag}").train
    assert t.eval_interval == interval  # Megatron's default: None
    runs = t.evaluations_by(t.train_iters) + 1
    assert runs * 5 * 8 == megatron_eval_samples(7, interval, 5, 8)


def test_no_validation_during_training_without_eval_interval():
    from megamoe.cli.main import pretrain
    lines: list[str] = []
    flags = (f"{BASE} --num-experts 2 --micro-batch-size 2 --global-batch-size 2 "
             "--eval-iters 1 --log-interval 1 --tokenizer-type NullTokenizer --vocab-size 64")
    state = pretrain(parse_args(shlex.split(flags.replace("--train-iters 4", "--train-iters 2")),
                                world_size=1), print_fn=lines.append)
    assert [h.get("valid lm loss") for h in state.history] == [None, None]
    said = [ln for ln in "\n".join(lines).splitlines() if "loss at iteration" in ln]
    assert [s.split(" loss at")[0].strip() for s in said] == ["validation", "test"]
    assert all("iteration 2 " in s for s in said)


def test_step_schedule_parses_as_megatron():
    """_parse_schedule: K/M/B/T suffixes, commas or spaces, sorted, tokens // seq_length."""
    from megamoe.config.batch_schedule import parse_step_schedule
    got = parse_step_schedule("250B:1536, 0:768 750B:6144 500B:3072", 4096)
    assert got == [[0, 768], [250 * 10**9 // 4096, 1536], [500 * 10**9 // 4096, 3072],
                   [750 * 10**9 // 4096, 6144]]
    assert parse_step_schedule("0:8 1.5K:16", None) == [[0, 8], [1500, 16]]
    run = _run('--step-batch-size-schedule "0:4 1M:8"')
    assert run.train.global_batch_size == 8 and run.train.global_batch_size_at(62499) == 4
    assert run.train.global_batch_size_at(62500) == 8  # 1M tokens / 16 = 62500 samples


@pytest.mark.parametrize("flags, says", [
    ('"0:4 1M:8" --global-batch-size 8', "cannot specify both --step-batch-size-schedule "
                                         "and --global-batch-size"),
    ('"16:4 1M:8"', "the first threshold must be 0"),
    ('"0:4 8:8"', "thresholds must be strictly increasing"),  # 8 tokens = sample 0 again
    ('"0:0"', "batch size must be positive"),
    ('"0-4"', "expected THRESHOLD:BATCH_SIZE"),
    ('"0:x"', "cannot read"),
    ('"0:2 1M:8"', "global batch size 2 of the ramp-up must be divisible"),
    ('"0:4 1M:6"', "final global batch size (6) must be divisible"),
])
def test_bad_step_schedule_is_one_line(capsys, flags, says):
    from tests.flags import parse_error
    extra = "--micro-batch-size 4" if "1M:" in flags else ""
    err = parse_error(capsys, f"{BASE} {extra} --step-batch-size-schedule {flags}", 1)
    assert "--step-batch-size-schedule" in err and says in err, err


@pytest.mark.parametrize("ramp", [(2, 2, 20), (2, 2, 24), (4, 4, 8), (1, 1, 3), (16, 8, 300)])
def test_rampup_runs_as_the_equivalent_step_schedule(ramp):
    """Every consumed-sample count gets the size Megatron's old RampupBatchsizeNum-
    MicroBatchesCalculator.update gave; the logged schedule parses back to the same."""
    from megamoe.config.batch_schedule import parse_step_schedule
    from megamoe.training.pretrain import rampup_note
    start, inc, samples = ramp
    gbs = 8 if start < 8 else 64
    run = _run(f"--train-samples 400 --global-batch-size {gbs} --micro-batch-size 1 "
               f"--rampup-batch-size {start} {inc} {samples}",
               base=BASE.replace("--train-iters 4", ""))
    per_increment = samples / ((gbs - start) // inc)
    for consumed in range(2 * samples + 2):
        old = gbs if consumed > samples else start + int(consumed / per_increment) * inc
        assert run.train.global_batch_size_at(consumed) == old, consumed
    note = rampup_note(run)
    assert note.count("\n") == 0 and "Megatron-LM ignores" in note
    text = note.split("--step-batch-size-schedule ")[-1].strip('"')
    assert parse_step_schedule(text, 16) == run.train.batch_size_schedule
