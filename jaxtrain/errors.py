"""User-facing errors: the CLI prints the message as one line and exits with status 2."""

import argparse
import sys


class UserError(Exception):
    """A mistake in the user's command, config, mesh or rule set; the message says how to fix it."""


class OneLineParser(argparse.ArgumentParser):
    """The jaxtrain command's and the benchmark scripts' argument parser: a bad argument is one line and status 2."""

    def error(self, message):  # no usage dump
        print(f"{self.prog.split()[0]}: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)

    def add_argument(self, *names, **kwargs):
        # an option's text value may not be empty: `--init-from "$CKPT"` with CKPT unset read as no --init-from and
        # trained from scratch (a QA report); --mesh, --rules and --run-dir fell back to their defaults the same way
        if names[0].startswith("-") and kwargs.get("action", "store") == "store" and not {"type", "choices"} & set(kwargs):
            kwargs["type"] = non_empty
        return super().add_argument(*names, **kwargs)


def non_empty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a value, got an empty string (an unset shell variable?)")
    return text


def positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:  # int() also reads other scripts' digits
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)
