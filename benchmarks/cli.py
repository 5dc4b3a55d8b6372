"""The benchmark commands' argument parser: bad usage is one line and exit 2, as for mpfa's own CLIs."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported in one line naming it (not argparse's usage block first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def comma_list(self, flag: str, value: str, accepted) -> list[str]:
        """``value`` of ``flag``, comma-separated, as a list whose every item is one of ``accepted``; else the
        one-line error naming the flag and the accepted values."""
        items = [x for x in value.split(",") if x]
        if not items or any(x not in accepted for x in items):
            self.error(f"{flag}: choose from {', '.join(accepted)}, got {value!r}")
        return items
