"""pyproject.toml declares what each part imports; requirements*.txt pin it (the locks the Makefile installs)."""

import os
import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pins(name: str) -> dict[str, str]:
    """Package -> pinned version of a requirements file (``name==version`` lines)."""
    out = {}
    with open(os.path.join(ROOT, name)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==(\S+)", line)
                assert m, f"{name}: not an exact pin: {line!r}"
                out[canonicalize_name(m.group(1))] = m.group(3)
    return out


def _declared() -> dict[str, list[Requirement]]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    return {g: [Requirement(r) for r in reqs if not r.startswith("persia-kfp[")] for g, reqs in groups.items()}


def test_every_declared_dependency_is_pinned_in_its_lock_at_a_version_it_allows():
    declared = _declared()
    locks = {
        "requirements.txt": ["core", "train", "preprocess", "pipelines", "serve", "dev"],
        "requirements-tfrecord.txt": ["core", "tfrecord"],
    }
    for lock, groups in locks.items():
        pins = _pins(lock)
        for group in groups:
            for req in declared[group]:
                name = canonicalize_name(req.name)
                assert name in pins, f"{lock} pins no {req.name} (pyproject.toml [{group}])"
                assert req.specifier.contains(pins[name], prereleases=True), (lock, req, pins[name])


def test_every_pin_of_the_main_lock_is_declared_or_a_tool_of_the_declared_ones():
    declared = {canonicalize_name(r.name) for reqs in _declared().values() for r in reqs}
    assert sorted(set(_pins("requirements.txt")) - declared) == []
