"""Where the tokens come from: data paths, splits, tokenizer, loader options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.config.fields import check_positive, flag, require

TOKENIZER_TYPES = ("SentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer",
                   "GPT2BPETokenizer", "NullTokenizer")
DATALOADER_TYPES = ("single", "cyclic")
# The files each tokenizer type reads (its flags).
TOKENIZER_FILES = {
    "SentencePieceTokenizer": ("--tokenizer-model",),
    "Llama2Tokenizer": ("--tokenizer-model",),
    "HuggingFaceTokenizer": ("--tokenizer-model",),
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
    "NullTokenizer": ("--vocab-size",),
}


@dataclass
class DataConfig:
    data_path: Optional[list[str]] = flag("--data-path", None)  # [p1, p2] or [w1, p1, ...]
    train_data_path: Optional[list[str]] = flag("--train-data-path", None)
    valid_data_path: Optional[list[str]] = flag("--valid-data-path", None)
    test_data_path: Optional[list[str]] = flag("--test-data-path", None)
    # Megatron's blends read from files (megamoe/data/data_args.py)
    data_args_path: Optional[str] = flag("--data-args-path", None)
    per_split_data_args_path: Optional[str] = flag("--per-split-data-args-path", None)
    split: str = flag("--split", "969,30,1")
    mock_data: bool = flag("--mock-data", False)
    data_cache_path: Optional[str] = flag("--data-cache-path", None)
    tokenizer_type: Optional[str] = flag("--tokenizer-type", None)
    tokenizer_model: Optional[str] = flag("--tokenizer-model", None)
    vocab_file: Optional[str] = flag("--vocab-file", None)
    merge_file: Optional[str] = flag("--merge-file", None)
    vocab_size: Optional[int] = flag("--vocab-size", None)  # NullTokenizer
    # a HuggingFaceTokenizer directory that is Python code runs it (data/remote_tokenizer.py)
    trust_remote_code: bool = flag("--trust-remote-code", False)
    # Megatron's NullTokenizer ids: --vocab-size tokens, EOD = vocab_size - 1 unless set.
    # (--null-tokenizer-pad-id other than -1, no pad token, is refused: config/unsupported.)
    null_tokenizer_eod_id: Optional[int] = flag("--null-tokenizer-eod-id", None)
    num_workers: int = flag("--num-workers", 0)
    reset_position_ids: bool = flag("--reset-position-ids", False)
    reset_attention_mask: bool = flag("--reset-attention-mask", False)
    eod_mask_loss: bool = flag("--eod-mask-loss", False)
    # Megatron's samplers: "single" (in order) or "cyclic" (MegatronPretrainingRandomSampler:
    # a new permutation per epoch, within each rank's bucket unless --no-data-sharding).
    dataloader_type: str = flag("--dataloader-type", "single")
    data_sharding: bool = flag("--no-data-sharding", True, dest="data_sharding")
    # Megatron's --no-mmap-bin-files: read .bin files with positioned reads, not a map.
    mmap_bin_files: bool = flag("--no-mmap-bin-files", True, dest="mmap_bin_files")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_positive(self, "vocab_size")
        check_positive(self, "num_workers", allow_zero=True)
        self._check_null_tokenizer_ids()
        require(self.dataloader_type in DATALOADER_TYPES, f"--dataloader-type must be one of "
                f"{', '.join(DATALOADER_TYPES)}, got {self.dataloader_type!r}")
        has_paths = bool(self.data_path or self.train_data_path or self.data_args_path
                         or self.per_split_data_args_path)
        require(not (has_paths and self.mock_data),
                "--mock-data cannot be combined with --data-path")
        require(not (self.data_path and self.train_data_path),
                "--data-path and --train-data-path are mutually exclusive")
        require(not (self.data_path and self.data_args_path),  # Megatron asserts this
                "--data-args-path and --data-path are mutually exclusive")
        require(not (self.train_data_path and self.per_split_data_args_path),
                "--per-split-data-args-path and --train-data-path are mutually exclusive")
        kind = self.tokenizer_type
        require(not self.trust_remote_code or kind == "HuggingFaceTokenizer",
                "--trust-remote-code needs --tokenizer-type HuggingFaceTokenizer (the only "
                "tokenizer whose code it would trust)")
        if kind is None:  # library use may hand build_gpt_datasets a tokenizer object
            return
        require(kind in TOKENIZER_TYPES, f"--tokenizer-type must be one of "
                                         f"{', '.join(TOKENIZER_TYPES)}, got {kind!r}")
        for needed in TOKENIZER_FILES[kind]:
            require(getattr(self, needed[2:].replace("-", "_")) is not None,
                    f"--tokenizer-type {kind} needs {needed}")

    def _check_null_tokenizer_ids(self) -> None:
        """The EOD id must be a token of the vocabulary."""
        eod, v = self.null_tokenizer_eod_id, self.vocab_size
        if eod is not None:
            require(v is None or 0 <= eod < v, f"--null-tokenizer-eod-id must be in "
                                               f"[0, --vocab-size ({v})), got {eod}")
            require(eod >= 0, f"--null-tokenizer-eod-id must be >= 0, got {eod}")
