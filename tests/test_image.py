"""The component image's install step, checked without a registry: the Dockerfile installs
containers/requirements-<backend>.lock with --require-hashes --no-deps, so each lock must hold every
package its image needs (the package's dependencies and the `component` extra, closed under their own
requirements, plus its backend's JAX plugin) at versions that satisfy them, and nothing the image does
not need; the locks are made from one description, containers/image.toml (`make lock`)."""

import os
import re
import tomllib
from importlib import metadata

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(REPO, "containers", "requirements-cpu.lock")
DESCRIPTION = os.path.join(REPO, "containers", "image.toml")
DOCKERFILE = os.path.join(REPO, "containers", "Dockerfile")
# The image's platform: the markers of Linux x86_64, CPython 3.11.
ENV = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "python_version": "3.11", "python_full_version": "3.11.0", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix"}


def _lock(path: str = LOCK) -> dict:
    pinned = {}
    with open(path) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+) --hash=sha256:[0-9a-f]{64}\n?", line)
            assert m, f"not a pinned, hashed line: {line!r}"
            pinned[canonicalize_name(m.group(1))] = m.group(2)
    return pinned


def _lock_module():
    """containers/lock.py, which writes the locks (a script, not a module of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lock", os.path.join(REPO, "containers", "lock.py"))
    lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lock)
    return lock


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**ENV, "extra": e}) for e in (extras or {""}))


def test_lock_holds_the_image_packages_and_their_requirements_closed():
    pinned = _lock()
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    roots = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["component"]]
    todo = [(r, set()) for r in roots]
    seen = set()
    while todo:  # the closure of the image's requirements, read from the installed distributions' metadata
        req, _ = todo.pop()
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req} is needed in the image but missing from the lock"
        assert req.specifier.contains(pinned[name], prereleases=True), f"the lock's {name}=={pinned[name]} misses {req}"
        key = (name, tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(name)
        assert canonicalize_name(dist.metadata["Name"]) == name
        assert dist.version == pinned[name], f"{name}: lock {pinned[name]}, tested with {dist.version}: make lock"
        for text in dist.requires or []:
            sub = Requirement(text)
            if _applies(sub, set(req.extras)):
                todo.append((sub, set()))
    needed = {n for n, _ in seen}
    assert set(pinned) == needed, f"in the lock but not needed by the image: {sorted(set(pinned) - needed)}"
    for absent in ("google-tunix", "google-cloud-aiplatform", "google-cloud-pipeline-components", "torch",
                   "transformers", "pytest"):
        assert absent not in pinned


def test_the_venv_is_the_development_lock_held_to_the_image_lock():
    """make installs the venv with containers/requirements-dev.lock as constraints: the lock says what it
    was resolved from (an edit of image.toml's [development] without `make lock` fails here), holds the cpu
    image's packages at the same versions, and every package installed here is at its pinned version."""
    lock = _lock_module()
    desc = _description()
    path = lock.lock_path(lock.DEV)
    with open(path) as f:
        text = f.read()
    assert text.splitlines()[1] == lock.dev_resolved_from(desc), f"{path} is stale: make lock"
    dev = {canonicalize_name(n): v for n, v in lock.read_pins(path).items()}
    for name, version in _lock().items():
        assert dev.get(name) == version, name
    assert not {canonicalize_name(n) for n in desc["development"]["unpinned"]} & set(dev)
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    for name in ("logit-distill", "pytest", "transformers", "google-cloud-aiplatform", "pip"):
        assert name in installed, name
    wrong = {n: (v, installed[n]) for n, v in dev.items() if n in installed and installed[n] != v}
    assert not wrong, f"installed at other versions than the lock's (lock, installed): {wrong}: make venv"


def _description() -> dict:
    with open(DESCRIPTION, "rb") as f:
        return tomllib.load(f)


def test_each_backend_has_a_hashed_lock_made_from_the_one_description():
    """cpu, cuda and tpu: each lock says what it was resolved from (the description as it is now: an edit of
    image.toml without `make lock` fails here), pins every package with a hash, holds the CPU image's packages
    at the same versions and hashes, and adds only its backend's JAX plugin and what that plugin needs, at
    jax's version."""
    lock = _lock_module()
    desc = _description()
    assert set(desc["backends"]) == {"cpu", "cuda", "tpu"}
    cpu = _lock()
    # the pins the cuda and tpu locks are held to when they are resolved
    assert {canonicalize_name(n): v for n, v in lock.read_pins(lock.lock_path("cpu")).items()} == cpu
    plugins = {"cuda": {"jax-cuda12-plugin", "jax-cuda12-pjrt"}, "tpu": {"libtpu"}}
    for backend in desc["backends"]:
        path = lock.lock_path(backend)
        with open(path) as f:
            assert f.read().splitlines()[1] == lock.resolved_from(backend, desc), f"{path} is stale: make lock"
        pinned = _lock(path)
        for name, version in cpu.items():
            assert pinned.get(name) == version, (backend, name)
        if backend == "cpu":
            continue
        assert plugins[backend] <= set(pinned), backend
        for plugin in plugins[backend] - {"libtpu"}:
            assert pinned[plugin] == cpu["jax"], (backend, plugin)  # the plugin of the image's jax
        added = set(pinned) - set(cpu)
        assert added <= plugins[backend] | {n for n in added if n.startswith("nvidia-")}, (backend, added)
    with open(LOCK) as a, open(lock.lock_path("cuda")) as b:
        cpu_lines = {line for line in a if not line.startswith("#")}
        assert cpu_lines <= set(b)  # the same wheels, by the same hashes


def test_dockerfile_installs_the_backends_lock_on_a_base_pinned_by_digest(tmp_path):
    """No digest of the base image is baked in (none could be resolved where this was written: no registry):
    the build refuses a base that is not pinned by digest, at its first step."""
    import subprocess

    with open(DOCKERFILE) as f:
        text = f.read()
    assert "ARG BASE_IMAGE=python:3.11-slim\n" in text and not re.search(r"@sha256:[0-9a-f]{64}", text)
    steps = _instructions(text)
    runs = [rest for word, rest in steps if word == "RUN"]
    assert tuple(runs) == RUN_STEPS  # the install step is containers/install.sh, which the test below runs
    assert ("COPY", "containers/requirements-${JAX_BACKEND}.lock containers/install.sh ./") in steps
    with open(INSTALL_SH) as f:
        script = f.read()
    assert 'pip install --require-hashes --no-deps -r "$here/requirements-$backend.lock"' in script
    assert "pip install --no-deps ." in script and "pip check" in script
    for base, code in (("python:3.11-slim", 1), ("python:3.11-slim@sha256:abc", 1), (PINNED_BASE, 0)):
        out = subprocess.run(["sh", INSTALL_SH, "base"], env={**os.environ, "BASE_IMAGE": base},
                             capture_output=True, text=True)
        assert out.returncode == code, (base, out.stderr)
        if code:
            assert out.stderr.count("\n") == 1 and "not pinned by digest" in out.stderr


# ---------------------------------------------------------------- the install step, run for real

INSTALL_SH = os.path.join(REPO, "containers", "install.sh")
# The only RUN commands the test repeats on this machine: the image's install step is containers/install.sh.
RUN_STEPS = ("sh install.sh base", "sh install.sh lock", "sh install.sh package")
# A build argument of the shape the base check wants (the test pulls no image; no real digest is claimed).
PINNED_BASE = "python:3.11-slim@sha256:" + "0" * 64
BUILD_ARGS = {"JAX_BACKEND": "cpu", "BASE_IMAGE": PINNED_BASE}  # the build arguments of the CPU image


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, argument) of each instruction of a Dockerfile: continuation lines joined, comments dropped."""
    found, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        word, _, rest = (current + line).strip().partition(" ")
        found.append((word.upper(), rest.strip()))
        current = ""
    return found


def _dockerignored(rel: str) -> bool:
    """Whether .dockerignore keeps ``rel`` (a path in the build context) out of the image's COPY."""
    import fnmatch

    with open(os.path.join(REPO, ".dockerignore")) as f:
        patterns = [p.strip() for p in f if p.strip() and not p.startswith("#")]
    parts = rel.split("/")
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            return True
    return False


def _python311() -> str:
    """A CPython 3.11 (the lock's interpreter) to make the venv with: this one, or python3.11 on PATH."""
    import shutil
    import subprocess
    import sys

    for candidate in (sys.executable, shutil.which("python3.11"), shutil.which("python3")):
        if candidate and subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 11)"],
                                        capture_output=True).returncode == 0:
            return candidate
    raise AssertionError("the lock is for CPython 3.11 (the image's python:3.11-slim); no python3.11 here")


def _run(cmd: list[str], **kwargs) -> str:
    import subprocess

    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert out.returncode == 0, f"{cmd[:4]} exited {out.returncode}:\n{(out.stdout + out.stderr)[-6000:]}"
    return out.stdout


def _build_in_venv(root: str, venv: str, fs: str) -> tuple[dict, list[str]]:
    """Follow containers/Dockerfile's instructions with ``venv`` for the image's Python: COPY into ``root``
    (the WORKDIR) as the build context and .dockerignore give it, ENV as the environment, ARG defaults
    (JAX_BACKEND=cpu; BASE_IMAGE given as a pinned reference) as build arguments, ``${...}`` in COPY
    expanded, and RUN, which must be a step of containers/install.sh.
    Absolute paths of ENV outside the WORKDIR move under ``fs``. Returns the environment and the CMD."""
    import json
    import shlex
    import shutil

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=venv, PATH=os.path.join(venv, "bin") + os.pathsep + env["PATH"])
    # pip's byte-compilation of every installed module is a third of the install's CPU here; the image compiles
    # them (the Dockerfile does not set this), the test imports what it runs from source. pip reads a
    # "--no-..." option's variable as the value of the option's destination: PIP_NO_COMPILE=0 is --no-compile
    # (=1 would byte-compile)
    env["PIP_NO_COMPILE"] = "0"
    args, workdir, cmd, ran = {}, None, None, []
    with open(DOCKERFILE) as f:
        steps = _instructions(f.read())
    for word, rest in steps:
        if word == "ARG":
            name, eq, default = rest.partition("=")
            if eq or name not in args:  # (a redeclared ARG without a default keeps its value)
                args[name] = default
            args.update(BUILD_ARGS)
        elif word == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                if name == "PIP_NO_CACHE_DIR":
                    continue  # the test uses pip's cache (the lock's hashes still check every file)
                if workdir and (value == workdir or value.startswith(workdir + "/")):
                    value = root + value[len(workdir):]
                elif value.startswith("/"):
                    value = fs + value
                env[name] = value
        elif word == "WORKDIR":
            workdir = rest
        elif word == "COPY":
            *sources, dest = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest).split()
            assert not any(s.startswith("--") for s in sources), f"COPY options are not followed here: {rest}"
            target = os.path.normpath(os.path.join(root, dest))
            for source in sources:
                to = os.path.join(target, os.path.basename(source)) if dest.endswith("/") else target
                if os.path.isdir(os.path.join(REPO, source)):
                    shutil.copytree(os.path.join(REPO, source), to, ignore=lambda d, names: [
                        n for n in names if _dockerignored(os.path.relpath(os.path.join(d, n), REPO))])
                else:
                    os.makedirs(os.path.dirname(to), exist_ok=True)
                    shutil.copy2(os.path.join(REPO, source), to)
        elif word == "RUN":
            assert rest in RUN_STEPS, (f"the Dockerfile runs {rest!r}: the image's install step belongs in "
                                       "containers/install.sh (this test runs only its steps here)")
            _run(["sh", "-c", rest], cwd=root, env={**env, **args})
            ran.append(rest)
        elif word == "CMD":
            cmd = json.loads(rest)
        else:
            assert word in ("FROM", "LABEL"), f"the test does not follow the Dockerfile's {word}: teach it"
    assert tuple(ran) == RUN_STEPS and workdir and cmd
    return env, cmd


@pytest.mark.slow
def test_image_install_step_runs_in_a_fresh_venv(tmp_path):
    """The Dockerfile's install step for the CPU image, for real: a fresh venv gets the lock (hashes
    required, no dependencies resolved), the package, `pip check` and the import check, all from
    containers/install.sh as the Dockerfile runs it; then, in that venv, the image's CMD, the imports of
    every component's function body, and one component (plan_dump) run the way Vertex runs it: its
    compiled command, `python3 -m kfp.dsl.executor_main`, with an executor input."""
    import ast
    import json

    import numpy as np
    import yaml

    from logit_distill.data import write_pretokenized
    from logit_distill.dump import DumpConfig, plan_dump
    from logit_distill.store import dump_key

    venv, root, fs = str(tmp_path / "venv"), str(tmp_path / "opt"), str(tmp_path / "fs")
    os.makedirs(root)
    _run([_python311(), "-m", "venv", venv])
    # the pip of this test's own environment (a current one, as the base image's): the pip bundled with this
    # interpreter (23.2) spends three quarters of the lock's install matching the index's links to the platform
    # (84 CPU-s against 18)
    _run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--quiet", "--no-compile",
          f"pip=={metadata.version('pip')}"])
    env, cmd = _build_in_venv(root, venv, fs)
    py = os.path.join(venv, "bin", "python")

    # pip check and the import check, again from outside the script; the package comes from the venv
    _run([py, "-m", "pip", "check"], cwd=root, env=env)
    where = _run([py, "-c", "import kfp, logit_distill, jax; print(logit_distill.__file__)"], cwd=root, env=env)
    assert where.strip().startswith(os.path.join(venv, "lib")), where
    # the image's CMD: the CLI's help
    assert "dump" in _run(cmd, cwd=root, env=env)

    # every module a component's function body imports is in the image (the bodies import inside)
    modules = set()
    compiled = os.path.join(REPO, "compiled", "components")
    specs = {}
    for name in sorted(os.listdir(compiled)):
        with open(os.path.join(compiled, name)) as f:
            specs[name] = yaml.safe_load(f)
        (executor,) = specs[name]["deploymentSpec"]["executors"].values()
        for node in ast.walk(ast.parse(executor["container"]["command"][3])):
            if isinstance(node, ast.Import):
                modules.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module)
    assert {"logit_distill.dump", "logit_distill.train.report", "kfp.dsl"} <= modules
    modules.add("matplotlib.pyplot")  # the training report draws its figure inside the image
    _run([py, "-c", "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)", *sorted(modules)],
         cwd=root, env=env)

    # plan_dump through KFP's executor, with its compiled command and an executor input as Vertex gives it
    data = str(tmp_path / "train.array_record")
    rng = np.random.default_rng(0)
    write_pretokenized(data, [rng.integers(0, 256, 32, dtype=np.int32) for _ in range(16)])
    settings = dict(num_steps=2, selection="topk", top_k=8, seq_len=32, batch_size=4, steps_per_file=1)
    task = tmp_path / "task"
    spec = specs["plan_dump.yaml"]
    (executor,) = spec["deploymentSpec"]["executors"].values()
    (component,) = spec["components"].values()
    outputs = component["outputDefinitions"]
    executor_input = {
        "inputs": {"parameterValues": {"teacher": "preset:tiny-qwen3", "data": data,
                                       "output_root": str(tmp_path / "out"), "run_name": "run-7", **settings}},
        "outputs": {
            "parameters": {n: {"outputFile": str(task / n)} for n in outputs["parameters"]},
            "artifacts": {n: {"artifacts": [{"name": n, "type": a["artifactType"], "uri": str(task / n),
                                             "metadata": {}}]} for n, a in outputs.get("artifacts", {}).items()},
            "outputFile": str(task / "executor_output.json"),
        },
    }
    argv = executor["container"]["command"] + [
        json.dumps(executor_input) if a == "{{$}}" else a for a in executor["container"]["args"]]
    _run(argv, cwd=root, env=env)
    with open(task / "executor_output.json") as f:
        out = json.load(f)
    key = dump_key(plan_dump(DumpConfig(teacher="preset:tiny-qwen3", data=data, output="", **settings)).manifest)
    values = out["parameterValues"]
    assert values["dump_key"] == key  # the image names the store as this environment does
    assert values["store_uri"] == str(tmp_path / "out") + "/teacher_topk/" + key and values["complete"] is False
    assert values["job_display_name"] == f"run-7-dump-{key}"  # the dump's custom job, named after the run
