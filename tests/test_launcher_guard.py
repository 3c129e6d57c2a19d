"""The retry guard of the Vertex custom jobs (pipelines/launcher_guard.py): a task retry whose launcher finds
the failed attempt's ``gcp_resources`` creates a new job instead of re-attaching to the failed one.

Each test runs the exact code the compiled Vertex YAML embeds (the dump job's container command, with its
arguments, placeholders filled in) in a subprocess, as the launcher container would. Vertex cannot be reached
from here: a loopback HTTP server stands in for its JobService GET (``/v1/projects/.../customJobs/ID``) and for
the OAuth token endpoint of a throwaway service-account key given as Application Default Credentials, so the
guard authenticates with google-auth as it does on Vertex. Only the final delegation to GCPC's launcher is
stubbed (``runpy.run_module``, which would create or poll a real job; a ``sitecustomize`` on the subprocess's
PYTHONPATH replaces it): the stub records the module and the arguments, and the test then asks GCPC 2.22's own
``JobRemoteRunner.check_if_job_exists`` what the launcher would do with the file as the guard left it:
re-attach to a job, or create one. What Vertex itself hands a retried task is not tested here
(docs/PIPELINE.md, "Retries, restarts and re-runs").
"""

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from logit_distill.emulator import free_port  # noqa: E402
from pipelines import launcher_guard  # noqa: E402

VERTEX_YAML = os.path.join(REPO, "compiled", "logit_distill_pipeline_vertex.yaml")
PROJECT, LOCATION = "test-project", "us-central1"
TOKEN = "guard-test-token"
JOB_IDS = {"JOB_STATE_FAILED": "101", "JOB_STATE_CANCELLED": "102", "JOB_STATE_EXPIRED": "103",
           "JOB_STATE_RUNNING": "201", "JOB_STATE_PENDING": "202", "JOB_STATE_QUEUED": "203",
           "JOB_STATE_SUCCEEDED": "204", 500: "301", 404: "302", "down": "303"}

# Stands in for GCPC's launcher: records what the guard delegates, does not create or poll a job.
STUB = """
import json, os, runpy, sys

def run_module(mod_name, init_globals=None, run_name=None, alter_sys=False):
    with open(os.environ["GUARD_TEST_RECORD"], "w") as f:
        json.dump({"module": mod_name, "run_name": run_name, "alter_sys": alter_sys, "argv": sys.argv[1:]}, f)

runpy.run_module = run_module
"""


class FakeVertex(http.server.ThreadingHTTPServer):
    """Loopback JobService GET + OAuth token endpoint. ``jobs``: job id -> a state, or an HTTP status to fail
    with. ``gets``: (path, Authorization header) of every job GET."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.jobs, self.gets = {}, []


class _Handler(http.server.BaseHTTPRequestHandler):
    def _reply(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # the service account's token request (a signed JWT grant)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply(200, {"access_token": TOKEN, "expires_in": 3600, "token_type": "Bearer"})

    def do_GET(self):
        self.server.gets.append((self.path, self.headers.get("Authorization")))
        prefix = f"/v1/projects/{PROJECT}/locations/{LOCATION}/customJobs/"
        job = self.path[len(prefix):] if self.path.startswith(prefix) else None
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._reply(401, {"error": {"code": 401, "status": "UNAUTHENTICATED"}})
        if job not in self.server.jobs:
            return self._reply(404, {"error": {"code": 404, "status": "NOT_FOUND"}})
        state = self.server.jobs[job]
        if isinstance(state, int):
            return self._reply(state, {"error": {"code": state, "message": "injected"}})
        self._reply(200, {"name": self.path[len("/v1/"):], "displayName": "dump-teacher-topk", "state": state})

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def vertex():
    server = FakeVertex()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def credentials(vertex, tmp_path_factory) -> str:
    """A throwaway service-account key whose token endpoint is the loopback server (ADC file)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path = tmp_path_factory.mktemp("adc") / "key.json"
    path.write_text(json.dumps({
        "type": "service_account", "project_id": PROJECT, "private_key_id": "guard-test", "private_key": pem,
        "client_email": f"pipeline@{PROJECT}.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": f"{vertex.url}/token"}))
    return str(path)


def _launcher_container(executor: str = "exec-dump-teacher-topk") -> dict:
    with open(VERTEX_YAML) as f:
        return yaml.safe_load(f)["deploymentSpec"]["executors"][executor]["container"]


def _job_uri(job_id: str) -> str:
    return (f"https://{LOCATION}-aiplatform.googleapis.com/v1/projects/{PROJECT}/locations/{LOCATION}"
            f"/customJobs/{job_id}")


def _write_gcp_resources(path, job_id: str) -> str:
    """The file as GCPC's launcher writes it after creating a job (JobRemoteRunner.create_job)."""
    from google.protobuf import json_format
    from google_cloud_pipeline_components.proto.gcp_resources_pb2 import GcpResources

    resources = GcpResources()
    resource = resources.resources.add()
    resource.resource_type = "CustomJob"
    resource.resource_uri = _job_uri(job_id)
    text = json_format.MessageToJson(resources)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def _run(tmp_path, credentials: str, endpoint: str):
    """Run the compiled launcher command with its arguments, as the launcher container would; return the
    process and the ``gcp_resources`` path. Asserts that it delegated to GCPC's launcher, arguments unchanged."""
    container = _launcher_container()
    gcp_resources = tmp_path / "outputs" / "gcp_resources"
    filled = {"{{$.inputs.parameters['project']}}": PROJECT, "{{$.inputs.parameters['location']}}": LOCATION,
              "{{$.outputs.parameters['gcp_resources'].output_file}}": str(gcp_resources)}
    args = [filled.get(a, a) for a in container["args"]]
    stub = tmp_path / "stub"
    stub.mkdir(exist_ok=True)
    (stub / "sitecustomize.py").write_text(STUB)
    record = tmp_path / "delegated.json"
    env = {**os.environ, "PYTHONPATH": str(stub), "GOOGLE_APPLICATION_CREDENTIALS": credentials,
           launcher_guard.ENDPOINT_ENV: endpoint, "GUARD_TEST_RECORD": str(record),
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    assert container["command"][0] == "python3"
    proc = subprocess.run([sys.executable, *container["command"][1:], *args], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # GCPC's launcher runs as __main__, with the arguments GCPC compiled, unchanged
    assert json.loads(record.read_text()) == {"module": launcher_guard.LAUNCHER, "run_name": "__main__",
                                              "alter_sys": True, "argv": args}
    return proc, gcp_resources


def _gcpc_reattaches_to(gcp_resources, credentials: str, monkeypatch):
    """What GCPC 2.22's launcher does with the file as it is now: the job it re-attaches to, or None when
    it creates a new job (``JobRemoteRunner.check_if_job_exists``)."""
    from google_cloud_pipeline_components.container.v1.gcp_launcher import job_remote_runner

    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", credentials)  # its JobServiceClient wants some
    runner = job_remote_runner.JobRemoteRunner("CustomJob", PROJECT, LOCATION, str(gcp_resources))
    return runner.check_if_job_exists()


def _guard_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("launcher_guard:")]


@pytest.mark.parametrize("content", [None, ""])
def test_no_gcp_resources_creates_a_job_without_asking_vertex(vertex, credentials, tmp_path, monkeypatch, content):
    path = tmp_path / "outputs" / "gcp_resources"
    if content is not None:
        path.parent.mkdir()
        path.write_text(content)
    vertex.gets.clear()
    proc, path = _run(tmp_path, credentials, vertex.url)
    assert (path.read_text() if path.exists() else None) == content  # untouched
    assert _gcpc_reattaches_to(path, credentials, monkeypatch) is None
    assert vertex.gets == [] and _guard_lines(proc) == []


@pytest.mark.parametrize("state", ["JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"])
def test_a_failed_job_is_not_reattached_a_new_one_is_created(vertex, credentials, tmp_path, monkeypatch, state):
    job_id = JOB_IDS[state]
    vertex.jobs[job_id] = state
    vertex.gets.clear()
    text = _write_gcp_resources(tmp_path / "outputs" / "gcp_resources", job_id)
    proc, path = _run(tmp_path, credentials, vertex.url)
    assert not path.exists() and _gcpc_reattaches_to(path, credentials, monkeypatch) is None  # a new job
    aside = path.parent / f"gcp_resources.{job_id}"
    assert aside.read_text() == text  # the old job's file is kept
    name = f"projects/{PROJECT}/locations/{LOCATION}/customJobs/{job_id}"
    assert vertex.gets == [(f"/v1/{name}", f"Bearer {TOKEN}")]  # one GET, with the service account's token
    (line,) = _guard_lines(proc)
    assert name in line and state in line and "creates a new job" in line


@pytest.mark.parametrize("state", ["JOB_STATE_RUNNING", "JOB_STATE_PENDING", "JOB_STATE_QUEUED",
                                   "JOB_STATE_SUCCEEDED"])
def test_a_live_or_succeeded_job_is_reattached(vertex, credentials, tmp_path, monkeypatch, state):
    job_id = JOB_IDS[state]
    vertex.jobs[job_id] = state
    text = _write_gcp_resources(tmp_path / "outputs" / "gcp_resources", job_id)
    proc, path = _run(tmp_path, credentials, vertex.url)
    name = f"projects/{PROJECT}/locations/{LOCATION}/customJobs/{job_id}"
    assert _gcpc_reattaches_to(path, credentials, monkeypatch) == name
    assert path.read_text() == text and sorted(p.name for p in path.parent.iterdir()) == ["gcp_resources"]
    (line,) = _guard_lines(proc)
    assert job_id in line and state in line and "re-attaches" in line


@pytest.mark.parametrize("failure", [500, 404, "down"])
def test_an_unreadable_state_leaves_the_file_with_a_warning(vertex, credentials, tmp_path, monkeypatch, failure):
    job_id = JOB_IDS[failure]
    endpoint = vertex.url
    if failure == "down":
        endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    elif failure != 404:
        vertex.jobs[job_id] = failure
    vertex.gets.clear()
    text = _write_gcp_resources(tmp_path / "outputs" / "gcp_resources", job_id)
    proc, path = _run(tmp_path, credentials, endpoint)
    # GCPC's launcher re-attaches, as it would without the guard
    assert _gcpc_reattaches_to(path, credentials, monkeypatch).endswith(f"/customJobs/{job_id}")
    assert path.read_text() == text and sorted(p.name for p in path.parent.iterdir()) == ["gcp_resources"]
    (line,) = _guard_lines(proc)
    assert "warning: could not read the state of custom job" in line and job_id in line
    # a server error is asked again (ATTEMPTS in all), a 404 is not
    expected = {500: launcher_guard.ATTEMPTS, 404: 1, "down": 0}[failure]
    assert len(vertex.gets) == expected


@pytest.mark.parametrize("content", ["not json", "[]", '{"resources": []}'])
def test_a_file_naming_no_job_is_left_to_gcpc_with_a_warning(vertex, credentials, tmp_path, monkeypatch,
                                                             content):
    """GCPC's launcher then fails on the file itself, as it would without the guard."""
    path = tmp_path / "outputs" / "gcp_resources"
    path.parent.mkdir()
    path.write_text(content)
    vertex.gets.clear()
    proc, path = _run(tmp_path, credentials, vertex.url)
    assert path.read_text() == content and sorted(p.name for p in path.parent.iterdir()) == ["gcp_resources"]
    (line,) = _guard_lines(proc)
    assert line.startswith("launcher_guard: warning:") and vertex.gets == []
    with pytest.raises(Exception):
        _gcpc_reattaches_to(path, credentials, monkeypatch)


def test_a_guard_error_still_runs_gcpcs_launcher(monkeypatch, capsys):
    """Nothing the guard does keeps GCPC's launcher from running (here argparse gives up on an argument)."""
    import runpy

    delegated = []
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() sets it for the launcher
    monkeypatch.setattr(runpy, "run_module", lambda name, **kw: delegated.append((name, kw, list(sys.argv))))
    launcher_guard.main(["--type", "CustomJob", "--gcp_resources"])
    assert delegated == [(launcher_guard.LAUNCHER, {"run_name": "__main__", "alter_sys": True},
                          [launcher_guard.LAUNCHER, "--type", "CustomJob", "--gcp_resources"])]
    assert "launcher_guard: warning: the retry guard failed (SystemExit" in capsys.readouterr().err
