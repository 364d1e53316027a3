"""The flag audit's stub (tools/audit_flags.py): with MEGAMOE_AUDIT_STUB=--some-flag and this
directory first on PYTHONPATH, every Python process (pytest, pretrain_gpt.py subprocesses,
torchrun workers) parses command lines as usual but then forgets that one flag: its value
goes back to the parser default, as if megamoe never read it. The flag's named test must
then fail. Without the variable this file does nothing.
"""

import os

_FLAG = os.environ.get("MEGAMOE_AUDIT_STUB")

if _FLAG:
    from megamoe.cli import arguments as _arguments

    _expand = _arguments.expand_config_file
    _defaults = {s: (a.dest, a.default) for a in _arguments.build_parser()._actions
                 for s in a.option_strings}

    def _without_config(argv):
        out, skip = [], False
        for a in argv:
            if skip:
                skip = False
            elif a == "--config":
                skip = True
            elif not a.startswith("--config="):
                out.append(a)
        return out

    _parser_parse = _arguments.OneLineArgumentParser.parse_args

    def parse_args(self, *args, **kwargs):
        """argparse's result with the flag forgotten, before any megamoe rule sees it."""
        ns = _parser_parse(self, *args, **kwargs)
        if _FLAG in _defaults and _FLAG != "--config":
            dest, default = _defaults[_FLAG]
            setattr(ns, dest, default)
        return ns

    _arguments.OneLineArgumentParser.parse_args = parse_args
    if _FLAG == "--config":
        _arguments.expand_config_file = lambda argv: _expand(_without_config(argv))
