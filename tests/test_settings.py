"""One definition per setting: the flags, environment names, README table and
chart schema all come from the dataclasses in specmesh/config.py."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from specmesh import settings
from specmesh.config import SERVICE_CONFIGS, OrchestratorConfig
from specmesh_cli import cli
from tools import settings_doc

SAMPLE = {int: ("7", 7), float: ("2.5", 2.5), str: ("x", "x"), bool: ("true", True), tuple: ("a:1, b:2", ("a:1", "b:2"))}
SAMPLE_OF = {"tree_min_confidence": ("0.25", 0.25)}    # settings whose range leaves out the type's sample


def _tier_parser(tier: str) -> argparse.ArgumentParser:
    parser = cli._parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return next(a for a in serve._actions if isinstance(a, argparse._SubParsersAction)).choices[tier]


@pytest.mark.parametrize("tier", sorted(SERVICE_CONFIGS))
def test_every_field_has_a_flag_an_env_name_and_help(tier):
    cls = SERVICE_CONFIGS[tier]
    flags = {opt for a in _tier_parser(tier)._actions for opt in a.option_strings} - {"-h", "--help"}
    fields = settings.settings_of(cls)
    negations = {"--no-" + s.flag[2:] for s in fields if s.type is bool}   # --access-log / --no-access-log
    assert flags - negations == {s.flag for s in fields}
    for s in fields:
        assert s.help, f"{tier}.{s.name} has no help text"
        assert s.env == ("REDIS_URL" if s.name == "redis_url" else f"SPECMESH_{s.name.upper()}")


@pytest.mark.parametrize("tier", sorted(SERVICE_CONFIGS))
def test_every_field_is_read_from_its_environment_variable_and_its_flag(tier):
    cls = SERVICE_CONFIGS[tier]
    for s in settings.settings_of(cls):
        text, value = (s.choices[-1], s.choices[-1]) if s.choices else SAMPLE_OF.get(s.name, SAMPLE[s.type])
        assert getattr(settings.build(cls, {}, environ={s.env: text}), s.name) == value, s.env
        args = _tier_parser(tier).parse_args([s.flag, text] if s.type is not bool else [s.flag])
        assert getattr(settings.build(cls, args, environ={}), s.name) == value, s.flag


def test_a_flag_wins_over_the_environment_which_wins_over_the_default():
    env = {"SPECMESH_PORT": "6000", "SPECMESH_MAX_K": "6"}
    config = settings.build(OrchestratorConfig, {"port": 7000, "default_k": None}, environ=env)
    assert (config.port, config.max_k, config.default_k) == (7000, 6, OrchestratorConfig.default_k)


def test_a_bad_value_names_the_setting():
    with pytest.raises(ValueError, match="SPECMESH_MAX_K.*expected int"):
        settings.build(OrchestratorConfig, {}, environ={"SPECMESH_MAX_K": "many"})


def test_a_bad_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "draft", "--max-k", "many"])
    assert "--max-k" in capsys.readouterr().err


def test_readme_table_and_chart_schema_are_generated_from_the_settings():
    assert settings_doc.main(["--check"]) == 0, "run: python -m tools.settings_doc"
    readme = settings_doc.README.read_text()
    schema = json.loads(settings_doc.SCHEMA.read_text())
    for tier, cls in SERVICE_CONFIGS.items():
        chart_settings = schema["properties"][tier]["properties"]["settings"]["properties"]
        for f in dataclasses.fields(cls):
            env = f.metadata["env"] or f"SPECMESH_{f.name.upper()}"
            assert f"| {tier} | `--{f.name.replace('_', '-')}` | `{env}` |" in readme
            assert (f.name in chart_settings) == (f.name not in settings_doc.CHART_OWNED)


def test_redis_password_goes_into_the_client_unless_the_url_has_one():
    from orchestrator.sessions import SessionStore

    pool = SessionStore.from_url("redis://r:6379/1", 10, "s3cr/t").client.connection_pool
    assert pool.connection_kwargs["password"] == "s3cr/t"
    pool = SessionStore.from_url("redis://:already@r:6379/1", 10, "other").client.connection_pool
    assert pool.connection_kwargs["password"] == "already"
