"""The benchmarks are laid out like the package: folders by kind, run from the root as modules, importing trtserve
as a user does (no sys.path edits, nothing from tests/) and sharing code only through benchmarks/common/; every
benchmark the docs name exists where they say."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.module or ""


def _module_exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_benchmarks_import_trtserve_as_a_user_does_and_share_code_only_through_common():
    problems = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        where = path.relative_to(ROOT)
        source = path.read_text()
        if "sys.path" in source:
            problems.append(f"{where}: edits sys.path")
        for name in _imports(ast.parse(source, str(path))):
            top = name.split(".")[0]
            if top == "tests":
                problems.append(f"{where}: imports {name} from tests/")
            elif top == "benchmarks" and not (name == "benchmarks.common" or name.startswith("benchmarks.common.")):
                problems.append(f"{where}: imports another benchmark ({name}); shared code goes in benchmarks/common/")
            elif top == "benchmarks" and not _module_exists(name):
                problems.append(f"{where}: imports {name}, which does not exist")
            elif top.startswith(("bench_", "probe_")):
                problems.append(f"{where}: imports the script {name} by its file name")
    assert not problems, "\n".join(problems)


def test_benchmarks_sit_in_folders_by_kind():
    loose = [p.name for p in BENCHMARKS.iterdir() if p.is_file() and p.name != "__init__.py"]
    assert not loose, f"benchmarks/ holds folders by kind, not scripts: {loose}"
    for folder in (p for p in BENCHMARKS.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if any(folder.glob("*.py")):
            assert (folder / "__init__.py").is_file(), f"{folder.name}/ has scripts but no __init__.py"


def test_every_benchmark_the_repository_names_exists():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missing = []
    for name in tracked:
        if not name.endswith((".md", ".py", ".sh", ".toml", ".yml", ".yaml")) or not (ROOT / name).is_file():
            continue
        text = (ROOT / name).read_text(errors="replace")
        for path in re.findall(r"(?<![\w/.])benchmarks/[\w/]+\.(?:py|sh)\b", text):
            if not (ROOT / path).is_file():
                missing.append(f"{name}: {path}")
        for module in re.findall(r"-m (benchmarks(?:\.\w+)+)", text):
            if not _module_exists(module):
                missing.append(f"{name}: python -m {module}")
    assert not missing, "\n".join(sorted(set(missing)))


def test_the_shell_scripts_start_from_the_root_and_run_benchmarks_as_modules():
    for script in sorted(BENCHMARKS.rglob("*.sh")):
        text = script.read_text()
        for up in re.findall(r'cd "\$\(dirname "\$0"\)/([./]*)"', text):
            assert (script.parent / up).resolve() == ROOT, f"{script.relative_to(ROOT)} changes to {up}, not the root"
        assert not re.search(r"python3?\"? benchmarks/", text), (
            f"{script.relative_to(ROOT)} runs a benchmark by its path")


def test_a_benchmark_runs_as_a_module_from_the_root():
    done = subprocess.run([sys.executable, "-m", "benchmarks.scale.bench_scale", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--checkpoint" in done.stdout
