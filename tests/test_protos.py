from tools import protogen


def test_committed_stubs_match_protos():
    stale = protogen.stale_files()
    assert not stale, f"regenerate with `python -m tools.protogen`; stale: {stale}"


def test_every_rpc_is_documented():
    """Each rpc line in the protos is preceded by a comment."""
    for proto in sorted((protogen.PROTO_ROOT / protogen.PACKAGE_DIR).glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("rpc "):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}: undocumented {line.strip()}"
