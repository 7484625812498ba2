"""The command line's one exception type: a one-line message and an exit code."""

from __future__ import annotations

import argparse


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
    printing the usage block and exiting."""

    def error(self, message):  # noqa: D102
        raise CLIError(f"{message} (see '{self.prog} --help')")
