"""Write the README's settings table and the Helm values schema from specmesh/config.py.

    python -m tools.settings_doc            # rewrite both
    python -m tools.settings_doc --check    # exit 1 if either is stale

The settings dataclasses are the only definition; tests/test_settings.py fails
when README.md or deploy/helm/specmesh/values.schema.json drift from them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specmesh.config import SERVICE_CONFIGS
from specmesh.settings import Setting, settings_of

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SCHEMA = ROOT / "deploy" / "helm" / "specmesh" / "values.schema.json"
BEGIN, END = "<!-- settings:begin (python -m tools.settings_doc) -->", "<!-- settings:end -->"

# Settings the chart wires from its own values (ports, model names, Service
# addresses, the Redis URL and password): not settable through <tier>.settings.
CHART_OWNED = {"port", "metrics_port", "model", "draft_model", "device", "draft_addrs", "verifier_addrs",
               "redis_url", "http_port", "orchestrator_addr", "shutdown_grace_s",
               # mounted from Secrets by the chart's `tls` and `auth` values
               "tls_cert_file", "tls_key_file", "tls_client_ca_file", "tls_ca_file", "auth_tokens_file",
               "internal_token_file"}

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", tuple: "string"}


def _shown(s: Setting) -> str:
    if s.default is None:
        return "unset"
    return ",".join(s.default) if s.type is tuple else str(s.default) if s.default != "" else '""'


def readme_table() -> str:
    rows = ["| tier | flag | environment | default | what, and why the default |", "| --- | --- | --- | --- | --- |"]
    for tier, cls in SERVICE_CONFIGS.items():
        for s in settings_of(cls):
            rows.append(f"| {tier} | `{s.flag}` | `{s.env}` | `{_shown(s)}` | {s.help} |")
    return "\n".join([BEGIN, *rows, END])


def settings_schema(cls) -> dict:
    properties = {}
    for s in settings_of(cls):
        if s.name in CHART_OWNED:
            continue
        json_type = _JSON_TYPES[s.type]
        properties[s.name] = {"type": [json_type, "null"] if s.optional else json_type, "description": s.help}
    return {"type": "object", "additionalProperties": False, "properties": properties}


def updated_readme(text: str) -> str:
    before, _, rest = text.partition(BEGIN)
    _, found, after = rest.partition(END)
    assert found, f"README.md has no {BEGIN} ... {END} block"
    return before + readme_table() + after


def updated_schema(text: str) -> str:
    schema = json.loads(text)
    for tier, cls in SERVICE_CONFIGS.items():
        schema["properties"][tier]["properties"]["settings"] = settings_schema(cls)
    return json.dumps(schema, indent=2) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md or the schema is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, update in ((README, updated_readme), (SCHEMA, updated_schema)):
        text = path.read_text()
        new = update(text)
        if new != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("stale: " + ", ".join(stale) + "\nrun: python -m tools.settings_doc", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
