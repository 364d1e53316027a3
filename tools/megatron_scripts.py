"""Extract the flag lists of Megatron-LM's MoE example scripts into test data.

Megatron-LM's launch scripts are how users meet megamoe: a script written for Megatron's
`pretrain_gpt.py` must run against ours after changing only paths. This tool reads the
scripts from a checkout of NVIDIA/Megatron-LM at a pinned commit and writes, per script,
the flag tokens of every assignment block (bash arrays `NAME=(...)`, `NAME+=(...)`,
quoted strings `NAME="..."`, and the MoE README's ```bash blocks) with the `if` condition
each block sits under, plus the `VAR=${VAR:-default}` defaults. Tokens keep their `${VAR}`
references: the test substitutes defaults and paths, and enumerates every conditional
branch. Nothing is executed; bash is read, not run.

    python tools/megatron_scripts.py --git-dir /work/.mirror/NVIDIA+Megatron-LM/repo \\
        --out tests/fixtures/megatron_scripts
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from typing import Optional

COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # Megatron-LM main, 2026-08-22
# fixture name -> (path in Megatron-LM, the variables whose blocks form the command line)
SCRIPTS = {
    "mixtral_8x7b": ("examples/mixtral/train_mixtral_8x7b_distributed.sh",
                     ["MODEL_ARGS", "MOE_ARGS", "DATA_ARGS", "TRAINING_ARGS",
                      "MODEL_PARALLEL_ARGS", "LOGGING_ARGS"]),
    "deepseek_v3": ("examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh", ["PRETRAIN_ARGS"]),
    "qwen3_30b_a3b_rl": ("examples/rl/model_configs/qwen3_30b_a3b_moe.sh", ["MODEL_OPTIONS"]),
    "qwen3_30b_a3b": ("examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh",
                      ["MODEL_ARGS"]),
    "deepseek_v2_lite": ("examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh",
                         ["MODEL_ARGS"]),
    "kimi_k2": ("examples/post_training/modelopt/conf/moonshotai/Kimi-K2-Instruct.sh",
                ["MODEL_ARGS"]),
    "moe_readme_quick_start": ("megatron/core/transformer/moe/README.md", ["QUICK_START"]),
}

_DEFAULT = re.compile(r'^\s*(?:export\s+)?(\w+)=\$\{\1:-"?([^}"]*)"?\}\s*(?:#.*)?$')
_PLAIN = re.compile(r'^\s*(?:export\s+)?(\w+)=("?)([^"(]*)\2\s*(?:#.*)?$')
_ARRAY = re.compile(r'^\s*(\w+)(\+?)=\((.*)$')
_STRING = re.compile(r'^\s*(\w+)="(.*)$')
_IF = re.compile(r'^\s*if\s+(.*?);\s*then\s*$')


def _tokens(body: str) -> list[str]:
    """Shell words of a block body: comments and line continuations removed."""
    lines = [ln.split(" #")[0] if not ln.strip().startswith("#") else ""
             for ln in body.splitlines()]
    return shlex.split(" ".join(ln.rstrip().rstrip("\\") for ln in lines))


def _close(lines: list[str], i: int, first: str, end: str) -> tuple[str, int]:
    """The text from `first` to the line holding `end` (exclusive), and that line's index."""
    parts = [first]
    while end not in parts[-1]:
        i += 1
        parts.append(lines[i])
    parts[-1] = parts[-1][:parts[-1].rindex(end)]
    return "\n".join(parts), i


def parse_bash(text: str) -> dict:
    """Defaults, plain assignments and flag blocks (with their `if` condition) of a script."""
    lines = text.splitlines()
    defaults: dict[str, str] = {}
    blocks: list[dict] = []
    conditions: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        cond = " && ".join(conditions) or None
        if m := _IF.match(line):
            conditions.append(m.group(1))
        elif line.strip() == "else" and conditions:
            conditions[-1] = f"! {conditions[-1]}"
        elif line.strip() == "fi" and conditions:
            conditions.pop()
        elif m := _DEFAULT.match(line):
            defaults.setdefault(m.group(1), m.group(2))
        elif m := _ARRAY.match(line):
            body, i = _close(lines, i, m.group(3), ")")
            tokens = _tokens(body)
            append = bool(m.group(2))
            own = f'${{{m.group(1)}[@]}}'
            if tokens and tokens[0] == own:  # NAME=("${NAME[@]}" ...) appends too
                tokens, append = tokens[1:], True
            blocks.append({"var": m.group(1), "append": append, "condition": cond,
                           "tokens": tokens})
        elif (m := _STRING.match(line)) and m.group(2).rstrip().endswith("\\"):
            body, i = _close(lines, i, m.group(2), '"')
            blocks.append({"var": m.group(1), "append": False, "condition": cond,
                           "tokens": _tokens(body)})
        elif m := _PLAIN.match(line):
            defaults.setdefault(m.group(1), m.group(3).strip())
        i += 1
    return {"defaults": defaults, "blocks": blocks}


def parse_readme(text: str) -> dict:
    """The ```bash blocks of the MoE README's Quick Start Guide (up to its Best Practices).
    Its performance tips write some flags YAML-style (`--manual-gc: true`): read as the
    command-line form they stand for."""
    start = text.index("## Quick Start Guide")
    end = text.index("## Best Practices", start)
    tokens: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text[start:end], flags=re.S):
        for line in block.splitlines():
            line = line.strip()
            if not line.startswith("--"):
                continue
            flag, _, value = line.partition(" ")
            if flag.endswith(":"):
                flag, value = flag[:-1], "" if value.strip() == "true" else value
            tokens += [flag, *value.split()]
    return {"defaults": {}, "blocks": [{"var": "QUICK_START", "append": False,
                                        "condition": None, "tokens": tokens}]}


def extract(git_dir: str, commit: str = COMMIT) -> dict[str, dict]:
    """name -> the held record of each script at `commit` of a Megatron-LM git dir."""
    out = {}
    for name, (path, variables) in SCRIPTS.items():
        text = subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{path}"],
                              check=True, capture_output=True, text=True).stdout
        parsed = parse_readme(text) if path.endswith(".md") else parse_bash(text)
        parsed["blocks"] = [b for b in parsed["blocks"] if b["var"] in variables]
        out[name] = {"repo": "NVIDIA/Megatron-LM", "commit": commit, "path": path,
                     "variables": variables, **parsed}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--git-dir", required=True, help="a Megatron-LM git directory")
    p.add_argument("--commit", default=COMMIT)
    p.add_argument("--out", required=True, help="folder for one JSON file per script")
    a = p.parse_args(argv)
    try:
        records = extract(a.git_dir, a.commit)
    except subprocess.CalledProcessError as e:
        sys.stderr.write(f"megatron_scripts.py: --git-dir: {e.stderr.strip()}\n")
        return 1
    os.makedirs(a.out, exist_ok=True)
    for name, record in records.items():
        with open(os.path.join(a.out, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
