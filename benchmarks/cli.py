"""The benchmark commands' argument parser: bad usage is one line and exit 2, as for mpfa's own CLIs."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported in one line naming it (not argparse's usage block first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
