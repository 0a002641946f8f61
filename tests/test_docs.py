"""The documentation: the site builds with `mkdocs build --strict` (a broken link fails), the README stays
short, and the commands page lists every option the CLI has."""

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_cli


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="needs mkdocs: pip install -e .[docs]")
    pytest.importorskip("material", reason="needs mkdocs-material: pip install -e .[docs]")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "index.html").is_file() and (tmp_path / "api-fields" / "index.html").is_file()


def test_the_readme_is_read_in_two_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.parametrize("command", ["serve", "build-engine", "eval", "info", "fidelity", "run", "healthcheck",
                                     "probe", "doctor", "train-pt"])
def test_the_commands_page_lists_every_option_of_the_cli(command):
    helped = run_cli(command, "--help", timeout=60)
    assert helped.returncode == 0, helped.stderr
    options = set(re.findall(r"(--[a-z][a-z0-9-]+)", helped.stdout)) - {"--help"}
    page = (ROOT / "docs" / "getting-started.md").read_text()
    missing = sorted(o for o in options if o not in page)
    assert not missing, f"`trtserve {command} --help` has {missing}, which docs/getting-started.md does not list"
