"""Serve options come from one place (server/config.py, deploy/options.py through trtserve/settings.py):
a flag wins over its TRTSERVE_* variable, the variable over the default, a bad value is one line
naming the flag or the variable, and the README's defaults are the fields' defaults."""

import argparse
import re
from pathlib import Path

import pytest

from trtserve.deploy.options import RayOptions, ServeTarget
from trtserve.errors import TrtServeError
from trtserve.server.config import ServerConfig
from trtserve.settings import add_flags, load, only

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for cls in (ServerConfig, ServeTarget, RayOptions):
        add_flags(parser, cls, skip=("engine_dir", "model"))
    return parser.parse_args(argv)


def test_a_flag_wins_over_its_variable_and_the_variable_over_the_default(monkeypatch):
    monkeypatch.setenv("TRTSERVE_MAX_NUM_SEQS", "4")
    monkeypatch.setenv("TRTSERVE_PORT", "9001")
    cfg = load(ServerConfig, parse("--port", "9002"), engine_dir="e")
    assert (cfg.port, cfg.max_num_seqs, cfg.max_batch) == (9002, 4, ServerConfig.model_fields["max_batch"].default)
    monkeypatch.setenv("TRTSERVE_RAY", "yes")
    assert load(RayOptions, parse()).ray is True and load(RayOptions, parse("--replicas", "0")).replicas == 0


def test_every_field_is_a_flag_with_its_help_and_default():
    parser = argparse.ArgumentParser()
    add_flags(parser, ServerConfig, skip=("engine_dir",))
    text = parser.format_help()
    for name, field in ServerConfig.model_fields.items():
        if name != "engine_dir":
            assert "--" + name.replace("_", "-") in text and field.description
    assert "engine's --max-batch) (default 32)" in " ".join(text.split())  # --max-num-seqs


@pytest.mark.parametrize("argv, env, message", [
    (("--max-num-seqs", "0"), {}, "--max-num-seqs must be at least 1"),
    (("--workers", "-1"), {}, "--workers must not be negative"),
    (("--worker-timeout", "0"), {}, "--worker-timeout must be positive"),
    (("--port", "70000"), {}, "--port must be at most 65535"),
    ((), {"TRTSERVE_MAX_QUEUE": "0"}, "TRTSERVE_MAX_QUEUE='0' must be at least 1: fix or unset it"),
    ((), {"TRTSERVE_MAX_WAIT_MS": "soon"}, "TRTSERVE_MAX_WAIT_MS='soon' is not a number: fix or unset it"),
])
def test_a_bad_value_is_one_line_naming_the_flag_or_the_variable(monkeypatch, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TrtServeError) as caught:
        load(ServerConfig, parse(*argv), engine_dir="e")
    assert str(caught.value) == message


def test_one_variable_is_read_without_the_others(monkeypatch):
    monkeypatch.setenv("TRTSERVE_MAX_BATCH", "many")  # bad, but not the one asked for
    monkeypatch.setenv("TRTSERVE_PORT", "8123")
    assert load(only(ServerConfig, "port")).port == 8123


def test_the_docs_state_the_defaults_the_fields_have():
    fields = {**ServerConfig.model_fields, **ServeTarget.model_fields, **RayOptions.model_fields}
    readme = " ".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    found = re.findall(r"`--([a-z-]+)`[^`()]{0,80}\(default ([0-9][0-9,.]*)", " ".join(readme.split()))
    assert len(found) >= 3, found
    for name, value in found:
        field = fields[name.replace("-", "_")]
        assert float(value.replace(",", "")) == field.default, (name, value, field.default)
