"""Write the component image's locks, one per backend: ``containers/requirements-<backend>.lock``.

    .venv/bin/python containers/lock.py [BACKEND ...]        # (make lock: every backend)

One description, ``containers/image.toml``: what every image holds (the package
with its ``component`` extra) and what each backend (cpu, cuda, tpu) adds (the
JAX plugin). Each backend is resolved with pip's resolver (``pip install
--dry-run --report``, PyPI's metadata only: nothing is downloaded but the
metadata), constrained to the versions installed in this environment (the ones
the tests ran with), and written as one ``name==version --hash=sha256:...``
line per package, for Linux x86_64 / CPython 3.11: the image's platform, where
this runs. The Dockerfile installs the lock of its ``JAX_BACKEND`` with
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DESCRIPTION = os.path.join(HERE, "image.toml")
SELF = "logit-distill"


def description() -> dict:
    with open(DESCRIPTION, "rb") as f:
        return tomllib.load(f)


def lock_path(backend: str) -> str:
    return os.path.join(HERE, f"requirements-{backend}.lock")


def resolved_from(backend: str, desc: dict) -> str:
    """The header line that says what a lock was resolved from (compared by the test)."""
    wanted = desc["image"]["requirements"] + desc["backends"][backend]
    return f"# resolved from containers/image.toml [{backend}]: {' '.join(wanted)}"


def resolve(requirements: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        constraints = os.path.join(tmp, "constraints.txt")
        frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                                capture_output=True, text=True).stdout
        with open(constraints, "w") as f:
            f.write(frozen)
        report = os.path.join(tmp, "report.json")
        wanted = [REPO + r[1:] if r.startswith(".[") else r for r in requirements]  # ".[x]": this package
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", report, "-c", constraints, *wanted], check=True)
        with open(report) as f:
            return json.load(f)["install"]


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


def main(argv: list[str]) -> int:
    desc = description()
    backends = argv or list(desc["backends"])
    unknown = sorted(set(backends) - set(desc["backends"]))
    if unknown:
        print(f"lock: error: no backend {', '.join(unknown)} in {DESCRIPTION}; it has "
              f"{', '.join(desc['backends'])}", file=sys.stderr)
        return 2
    for backend in backends:
        text = lock_text(backend, desc, resolve(desc["image"]["requirements"] + desc["backends"][backend]))
        with open(lock_path(backend), "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(lock_path(backend))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
