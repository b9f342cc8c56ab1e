"""`python -m distill`: the same command as `specmesh distill`, without the serving stack.

A training machine (a GPU box, a batch job) needs torch, transformers and the
target's loader, not gRPC, Redis or OpenTelemetry, which `specmesh`'s CLI imports
for its other commands. The arguments, work folder and output are the same.
"""
from __future__ import annotations

import argparse
import logging
import sys

from distill import run


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m distill",
                                     description="train a draft model for a target by self-distillation")
    run.add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run.main(parser.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
