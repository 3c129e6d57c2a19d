"""Write the component image's locks, one per backend: ``containers/requirements-<backend>.lock``.

    .venv/bin/python containers/lock.py [BACKEND ...]        # (make lock: every backend)

One description, ``containers/image.toml``: what every image holds (the package
with its ``component`` extra) and what each backend (cpu, cuda, tpu) adds (the
JAX plugin). Each backend is resolved with pip's resolver (``pip install
--dry-run --report``, PyPI's metadata only: nothing is downloaded but the
metadata) and written as one ``name==version --hash=sha256:...`` line per
package, for Linux x86_64 / CPython 3.11: the image's platform, where this
runs. The cpu lock takes the newest versions ``pyproject.toml`` allows; cuda and
tpu are constrained to the cpu lock's versions, so every image holds the same
packages and adds only its plugin. The development environment (``make``'s
venv: ``[development]`` in the description) is resolved held to the cpu lock
too, into ``containers/requirements-dev.lock`` (versions only), which the
Makefile passes to pip as constraints: the tests run what the image ships, a
new release on PyPI changes nothing until ``make lock``, and the ``make test``
after it reinstalls and tests the new versions.
The Dockerfile installs the lock of its ``JAX_BACKEND`` with
``--require-hashes --no-deps``, then the package itself without dependencies.
Each lock's header names what it was resolved from; tests/test_image.py checks
the locks against the description.
"""

import json
import os
import subprocess
import sys
import tempfile
import tomllib

from packaging.utils import canonicalize_name

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DESCRIPTION = os.path.join(HERE, "image.toml")
SELF = "logit-distill"


def description() -> dict:
    with open(DESCRIPTION, "rb") as f:
        return tomllib.load(f)


DEV = "dev"  # the development environment's lock: containers/requirements-dev.lock


def lock_path(backend: str) -> str:
    return os.path.join(HERE, f"requirements-{backend}.lock")


def dev_lock_text(desc: dict, items: list[dict]) -> str:
    dev = desc["development"]
    lines = ["# The development environment's packages, pip constraints for make's venv (containers/lock.py "
             "writes this file; do not edit).",
             dev_resolved_from(desc)]
    unpinned = {canonicalize_name(n) for n in dev["unpinned"]}
    for name, version in sorted(pins_of(items).items(), key=lambda nv: nv[0].lower()):
        if canonicalize_name(name) not in unpinned:
            lines.append(f"{name}=={version}")
    return "\n".join(lines) + "\n"


def dev_resolved_from(desc: dict) -> str:
    dev = desc["development"]
    return (f"# resolved from containers/image.toml [development]: {' '.join(dev['requirements'])}, held to "
            f"requirements-cpu.lock; unpinned: {' '.join(dev['unpinned'])}")


def resolved_from(backend: str, desc: dict) -> str:
    """The header line that says what a lock was resolved from (compared by the test)."""
    wanted = desc["image"]["requirements"] + desc["backends"][backend]
    return f"# resolved from containers/image.toml [{backend}]: {' '.join(wanted)}"


def resolve(requirements: list[str], pins: dict[str, str] | None = None) -> list[dict]:
    """pip's resolution of ``requirements`` for this platform, held to ``pins`` (name -> version) if given."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints = []
        if pins:
            path = os.path.join(tmp, "constraints.txt")
            with open(path, "w") as f:
                f.writelines(f"{name}=={version}\n" for name, version in sorted(pins.items()))
            constraints = ["-c", path]
        report = os.path.join(tmp, "report.json")
        wanted = [REPO + r[1:] if r.startswith(".[") else r for r in requirements]  # ".[x]": this package
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", report, *constraints, *wanted], check=True)
        with open(report) as f:
            return json.load(f)["install"]


def pins_of(items: list[dict]) -> dict[str, str]:
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in items if i["metadata"]["name"] != SELF}


def lock_text(backend: str, desc: dict, items: list[dict]) -> str:
    lines = ["# The component image's Python packages (containers/lock.py writes this file; do not edit).",
             resolved_from(backend, desc),
             f"# pip install --require-hashes --no-deps -r requirements-{backend}.lock  "
             f"({desc['image']['platform']}, CPython {desc['image']['python']})"]
    for item in sorted(items, key=lambda i: i["metadata"]["name"].lower()):
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if name == SELF:
            continue
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            raise SystemExit(f"lock: no sha256 for {name}=={version}")
        lines.append(f"{name}=={version} --hash=sha256:{hashes['sha256']}")
    return "\n".join(lines) + "\n"


def read_pins(path: str) -> dict[str, str]:
    pins = {}
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, version = line.split()[0].split("==")
                pins[name] = version
    return pins


def main(argv: list[str]) -> int:
    desc = description()
    targets = argv or [*desc["backends"], DEV]
    unknown = sorted(set(targets) - set(desc["backends"]) - {DEV})
    if unknown:
        print(f"lock: error: no backend {', '.join(unknown)} in {DESCRIPTION}; it has "
              f"{', '.join(desc['backends'])} (and {DEV}, the development environment)", file=sys.stderr)
        return 2
    # cpu first: the others are held to its versions (resolved now, or read from its lock)
    cpu_pins = None
    for target in sorted(targets, key=lambda t: t != "cpu"):
        if target != "cpu" and cpu_pins is None:
            cpu_pins = read_pins(lock_path("cpu"))
        if target == DEV:
            text = dev_lock_text(desc, resolve(desc["development"]["requirements"], cpu_pins))
        else:
            items = resolve(desc["image"]["requirements"] + desc["backends"][target],
                            None if target == "cpu" else cpu_pins)
            if target == "cpu":
                cpu_pins = pins_of(items)
            text = lock_text(target, desc, items)
        with open(lock_path(target), "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(lock_path(target))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
