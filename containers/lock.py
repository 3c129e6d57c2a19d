"""Write ``containers/requirements.lock``: every Python package of the component image, pinned with hashes.

    .venv/bin/python containers/lock.py        # (make lock)

Resolves ``.[component]`` (the package, the KFP executor, matplotlib: what the
components import) with pip's resolver (``pip install --dry-run --report``),
constrained to the versions installed in this environment (the ones the tests
ran with), and writes one ``name==version --hash=sha256:...`` line per package
for Linux x86_64 / CPython 3.11 (the image's platform; run it there). The
Dockerfile installs the lock with ``--require-hashes --no-deps``, then the
package itself without dependencies.
"""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LOCK = os.path.join(HERE, "requirements.lock")
SELF = "logit-distill"


def resolve() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        constraints = os.path.join(tmp, "constraints.txt")
        frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                                capture_output=True, text=True).stdout
        with open(constraints, "w") as f:
            f.write(frozen)
        report = os.path.join(tmp, "report.json")
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", report, "-c", constraints, f"{REPO}[component]"], check=True)
        with open(report) as f:
            return json.load(f)["install"]


def lock_text(items: list[dict]) -> str:
    lines = ["# The component image's Python packages (containers/lock.py writes this file; do not edit).",
             "# pip install --require-hashes --no-deps -r requirements.lock  (Linux x86_64, CPython 3.11)"]
    for item in sorted(items, key=lambda i: i["metadata"]["name"].lower()):
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if name == SELF:
            continue
        hashes = item["download_info"].get("archive_info", {}).get("hashes", {})
        if "sha256" not in hashes:
            raise SystemExit(f"lock: no sha256 for {name}=={version}")
        lines.append(f"{name}=={version} --hash=sha256:{hashes['sha256']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(LOCK, "w") as f:
        f.write(lock_text(resolve()))
    print(f"wrote {os.path.relpath(LOCK)}")
