"""An evaluation grid is data (TOML): models x backends x precisions x batch x sequence x input
kind. This module reads one (or a named preset) and expands it into configurations."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from trtserve.engine_builder import PRECISIONS  # every policy build-engine takes
from trtserve.errors import TrtServeError
from trtserve.precision.policy import POLICIES

PRESETS = Path(__file__).parent / "presets"
BACKENDS = ("torch", "onnxruntime", "fp16-emulation", "tensorrt")
MIXED = tuple(name for name, p in POLICIES.items() if p.anchors)  # the fp16 ones: what fp16 emulation predicts
INPUTS = ("real", "random")


@dataclass(frozen=True)
class Config:
    model: str
    backend: str
    precision: str
    batch: int
    sequence: int
    input: str

    @property
    def key(self) -> str:
        return f"{self.model}/{self.backend}/{self.precision}/b{self.batch}/s{self.sequence}/{self.input}"

    @property
    def shape(self) -> tuple:
        """What the torch fp32 baseline of this configuration shares with it."""
        return (self.model, self.batch, self.sequence, self.input)


@dataclass(frozen=True)
class Grid:
    name: str
    models: tuple[str, ...]
    backends: tuple[str, ...]
    precisions: tuple[str, ...]
    batch: tuple[int, ...]
    sequence: tuple[int, ...]
    inputs: tuple[str, ...]
    seed: int = 0
    min_runs: int = 5
    min_seconds: float = 0.5
    token_limits: tuple = ()  # (model, largest batch x sequence) pairs: shapes above are left out
    source: str = ""  # the preset's name or the grid file's path (what `--confirm-grid` takes)

    def shapes(self, model: str | None = None) -> tuple:
        """The (model id, input, batch, length) shapes its configurations run (of `model` only, if given): what
        `build-engine --confirm-grid` holds an engine to; ids as the build resolves them."""
        from trtserve.models.sources import model_id

        return tuple(sorted({(model_id(c.model), c.input, c.batch, c.sequence) for c in self.configs()
                             if model is None or c.model == model}))

    def configs(self) -> list[Config]:
        """Every meaningful combination, baselines first within each shape: torch runs fp32 only,
        fp16 emulation only the fp16 policies (quantized weights are computed the same on the CPU)."""
        out = []
        limits = dict(self.token_limits)
        for model in self.models:
            for batch in self.batch:
                for sequence in self.sequence:
                    if batch * sequence > limits.get(model, batch * sequence):
                        continue
                    for kind in self.inputs:
                        for backend in self.backends:
                            for precision in self.precisions:
                                if backend == "torch" and precision != "fp32":
                                    continue
                                if backend == "fp16-emulation" and precision not in MIXED:
                                    continue
                                out.append(Config(model, backend, precision, batch, sequence, kind))
        return out


def load_grid(path: Path | None = None, preset: str | None = None) -> Grid:
    if (path is None) == (preset is None):
        raise TrtServeError("give a grid file (--grid FILE) or a preset (--preset quick|paper|full)")
    if preset is not None:
        path = PRESETS / f"{preset}.toml"
        if not path.is_file():
            names = ", ".join(sorted(p.stem for p in PRESETS.glob("*.toml")))
            raise TrtServeError(f"no preset {preset!r}: choose one of {names}")
    assert path is not None  # a grid file or the preset's
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TrtServeError(f"--grid {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise TrtServeError(f"--grid {path} is not valid TOML: {exc}") from None
    allowed = {"models", "backends", "precisions", "batch", "sequence", "inputs", "seed", "min_runs", "min_seconds",
               "token_limits"}
    unknown = set(data) - allowed
    if unknown:
        raise TrtServeError(f"{path}: unknown keys {sorted(unknown)}; a grid has {sorted(allowed)}")
    missing = {"models", "backends", "precisions", "batch", "sequence", "inputs"} - set(data)
    if missing:
        raise TrtServeError(f"{path}: missing keys {sorted(missing)}")
    for key, choices in (("backends", BACKENDS), ("precisions", PRECISIONS), ("inputs", INPUTS)):
        bad = [v for v in data[key] if v not in choices]
        if bad:
            raise TrtServeError(f"{path}: {key} {bad} are not known; choose from {', '.join(choices)}")
    for key in ("batch", "sequence"):
        if not data[key] or any(not isinstance(v, int) or v < 1 for v in data[key]):
            raise TrtServeError(f"{path}: {key} must be a list of positive integers")
    limits = data.pop("token_limits", {})
    if not isinstance(limits, dict) or any(not isinstance(v, int) or v < 1 for v in limits.values()):
        raise TrtServeError(f"{path}: token_limits maps a model to the largest batch x sequence to run")
    return Grid(name=Path(path).stem, source=preset or str(Path(path).absolute()),
                token_limits=tuple(sorted(limits.items())),
                # the ignore: each key's value is of its field's type (checked above), which mypy cannot know
                **{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})  # type: ignore[arg-type]
