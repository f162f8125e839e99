"""The ``jaxtrain`` command (also ``python -m jaxtrain``): ``cli.main`` in a process with the malloc
``JAXTRAIN_HOST_MALLOC`` asks for. For jemalloc the command starts itself again with it preloaded, before the CLI's
imports (about 1 s of them), so that happens once; ``cli.main`` alone never replaces the process that calls it."""

import sys

from jaxtrain.errors import UserError
from jaxtrain.memory import host_malloc


def main(argv: list[str] | None = None) -> int:
    """The command with ``argv`` (default: this process's arguments); `python experiments/NAME.py` passes its own."""
    try:
        host_malloc.reexec_with_jemalloc()
    except UserError as e:
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return 2
    try:
        from jaxtrain import cli  # about 1 s of imports
    except KeyboardInterrupt:
        print("jaxtrain: interrupted", file=sys.stderr)
        return 130
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
