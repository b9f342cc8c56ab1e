"""Regenerate the Python stubs in specmesh/v1/ from protos/.

    python -m tools.protogen            # rewrite the committed stubs
    python -m tools.protogen --check    # exit 1 if they are stale

The stubs are committed so that installing the package needs no code
generation; tests/test_protos.py fails when they drift from protos/.
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("specmesh") / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) over every .proto; return the files written."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    # grpc_tools ships the well-known types (google/protobuf/*.proto) beside itself.
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_root / PACKAGE_DIR).glob("*_pb2*.py*"))


def stale_files() -> list[str]:
    """Names of generated files that differ from (or are missing in) the committed ones."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = ROOT / PACKAGE_DIR
        stale = [f.name for f in fresh if not (committed / f.name).exists()
                 or not filecmp.cmp(f, committed / f.name, shallow=False)]
        extra = {f.name for f in committed.glob("*_pb2*.py*")} - {f.name for f in fresh}
        return sorted(stale + list(extra))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated stubs: " + ", ".join(stale) + "\nrun: python -m tools.protogen", file=sys.stderr)
            return 1
        print("stubs are up to date")
        return 0
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
