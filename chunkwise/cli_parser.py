"""The command line's argument parser: a bad argument is one line on stderr and exit status 1, as every other error
of `python -m chunkwise` and `python -m chunkwise serve` is (README, Command line), where argparse's own prints the
usage block and exits 2. `--help` still prints the whole usage."""
from __future__ import annotations

import argparse
from typing import NoReturn

USAGE_ERROR_STATUS = 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are `<prog>: error: <message>` on one line, exit status 1."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR_STATUS, f"{self.prog}: error: {' '.join(message.split())}\n")
