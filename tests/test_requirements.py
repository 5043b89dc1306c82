"""requirements.lock pins every package the product and its tests import, direct or transitive,
once: the two lists agree with it, it holds nothing they do not need, and the environment the
suite runs in is the one it pins (so what CI tests is what a user's `make setup` installs).

Offline: the closure is walked over the installed distributions' own metadata (Requires-Dist),
not by asking the package index again (`make lock` does that)."""
from __future__ import annotations

import importlib.metadata
import re

from packaging.markers import default_environment
from packaging.requirements import Requirement

from tests.helpers import ROOT, normalise_name, read_pins

LOCK = ROOT / "requirements.lock"
LISTS = ("requirements.txt", "requirements-dev.txt")
# Left to the environment (an installed CUDA torch is kept): commented out in the lock.
UNPINNED = {"torch", "pip"}


def _requires(name: str, extras: frozenset[str] = frozenset()) -> list[Requirement]:
    """The installed distribution's requirements that apply here (markers evaluated for this
    interpreter, with the extras it was asked for)."""
    found = []
    for text in importlib.metadata.distribution(name).requires or []:
        requirement = Requirement(text)
        if requirement.marker is None:
            found.append(requirement)
            continue
        for extra in {""} | set(extras):
            if requirement.marker.evaluate({**default_environment(), "extra": extra}):
                found.append(requirement)
                break
    return found


def test_the_lock_pins_every_listed_requirement_at_its_listed_version():
    locked = read_pins(LOCK)
    for path in LISTS:
        for name, version in read_pins(ROOT / path).items():
            assert locked.get(name) == version, (
                f"{path} pins {name}=={version}, requirements.lock {locked.get(name)}: run `make lock`")


def test_the_lock_is_compiled_from_both_lists_and_leaves_torch_to_the_environment():
    text = LOCK.read_text()
    command = re.search(r"^#\s+pip-compile (.*)$", text, re.MULTILINE)
    assert command, "requirements.lock has no pip-compile header: generate it with `make lock`"
    arguments = command.group(1).split()
    assert {"requirements-dev.txt", "requirements-torch.txt", "--unsafe-package=torch"} <= set(arguments)
    assert "torch" not in read_pins(LOCK), "a torch pin in the lock would replace a user's CUDA torch"
    assert "/" not in " ".join(a for a in arguments if not a.startswith("--output-file")), (
        "the lock's command names a path: it must be the same on every machine")
    assert read_pins(ROOT / "requirements-torch.txt").keys() == {"torch"}


def test_the_environment_is_the_lock_and_the_lock_is_closed_over_what_it_needs():
    """From the two lists and torch, every requirement of every package reached is pinned in
    the lock at a version it allows and installed at that version; nothing else is in the lock."""
    locked = read_pins(LOCK)
    wanted = [Requirement(f"{name}=={version}") for path in LISTS for name, version in read_pins(ROOT / path).items()]
    wanted.append(Requirement("torch"))
    reached: set[tuple[str, frozenset[str]]] = set()  # (name, extras asked for)
    while wanted:
        requirement = wanted.pop()
        name = normalise_name(requirement.name)
        if name not in UNPINNED:
            assert name in locked, f"{requirement} is needed but not in requirements.lock: run `make lock`"
            assert requirement.specifier.contains(locked[name], prereleases=True), (
                f"requirements.lock pins {name}=={locked[name]}, which {requirement} does not allow: run `make lock`")
            installed = importlib.metadata.version(name)
            assert installed == locked[name], (
                f"this environment has {name} {installed}, requirements.lock pins {locked[name]}: "
                f"run `make setup-dev` (or test in a new virtual environment, as `.ci/run` does)")
        key = (name, frozenset(requirement.extras))
        if key in reached or name == "pip":
            continue
        reached.add(key)
        wanted.extend(_requires(name, frozenset(requirement.extras)))
    stale = set(locked) - {name for name, _ in reached}
    assert not stale, f"requirements.lock pins {sorted(stale)}, which nothing needs: run `make lock`"
