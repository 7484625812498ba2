"""The command line's one exception type: a one-line message and an exit code."""

from __future__ import annotations

import argparse
import sys


class CLIError(Exception):
    """Printed by ``main`` as ``fedopt: error: <message>`` (one line, no traceback).

    ``code`` 2: bad usage or settings (unknown names, impossible values, malformed
    config file, unusable output directory); 1: a failure while running.
    """

    def __init__(self, message: str, code: int = 2):
        super().__init__(" ".join(str(message).split()))  # one line
        self.code = code


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error raises :class:`CLIError` (one line) instead of
    printing the usage block and exiting, and no flag may be abbreviated.

    argparse takes any unambiguous prefix of a flag by default (``--roun 1`` for
    ``--rounds 1``): a prefix that works today changes meaning, or stops working, the
    day a new flag shares it (``--mode`` read as ``--model``), so a script or config
    that a user keeps would silently change.  Every parser of the command line is of
    this class (argparse makes the subcommands' parsers of their parent's class), and
    an unknown flag that is the prefix of known ones gets them suggested."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102
        self._argv = list(sys.argv[1:] if args is None else args)  # for error()'s suggestions
        return super().parse_known_args(args, namespace)

    def error(self, message):  # noqa: D102
        hint = self._prefix_hint(message)
        raise CLIError(f"{message}{hint} (see '{self.prog} --help')")

    def _prefix_hint(self, message: str) -> str:
        """``; did you mean --rounds?`` when an unrecognized flag is the prefix of
        flags of this parser or of the subcommand named on the command line."""
        if "unrecognized arguments" not in message:
            return ""
        argv = getattr(self, "_argv", [])
        known = set(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):  # the subcommand named in argv
                for name, parser in action.choices.items():
                    if name in argv:
                        known |= set(parser._option_string_actions)
        hints = []
        for token in argv:
            flag = token.split("=", 1)[0]
            if flag.startswith("--") and flag not in known:
                matches = sorted(k for k in known if k.startswith(flag))
                if matches:
                    hints.append(f"{flag} is not a flag; did you mean {' or '.join(matches)}?")
        return ("; " + "; ".join(hints)) if hints else ""
