"""The Vertex custom jobs' launcher: pipelines/launcher_guard.py, then GCPC's own launcher.

Job creation: the compiled dump and training tasks (``logit-distill-vertex`` and
``logit-distill-from-store-vertex``), their placeholders filled in as Vertex may fill them (the machine
parameters inside the worker pool as their text, the worst case, or as values; tests/vertex_standin.py), run
through the compiled command chain, the guard then GCPC 2.22's launcher unchanged, up to and including
GCPC's ``create_custom_job_with_client`` and its poll, against a loopback gRPC JobService reached by GCPC's
own ``JobServiceClient`` (an HTTP CONNECT proxy and a certificate for us-central1-aiplatform.googleapis.com).
The test reads the created ``CustomJob``: machine, accelerators, disk, reservation, scheduling, identity,
network, key, labels, display name. GCPC's launcher alone, without the guard, fails on the text form.

The retry guard: a task retry whose launcher finds the failed attempt's ``gcp_resources`` creates a new job
instead of re-attaching to the failed one. These tests run the exact code the compiled Vertex YAML embeds
(the dump job's container command, with its arguments, placeholders filled in) in a subprocess, as the
launcher container would. A loopback HTTP server stands in for Vertex's JobService GET
(``/v1/projects/.../customJobs/ID``) and for the OAuth token endpoint of a throwaway service-account key
given as Application Default Credentials, so the guard authenticates with google-auth as it does on Vertex.
Only the final delegation to GCPC's launcher is stubbed there (``runpy.run_module``; a ``sitecustomize`` on
the subprocess's PYTHONPATH replaces it): the stub records the module and the arguments, and the test then
asks GCPC 2.22's own ``JobRemoteRunner.check_if_job_exists`` what the launcher would do with the file as the
guard left it: re-attach to a job, or create one. What Vertex itself hands a retried task is not tested here
(docs/PIPELINE.md, "Retries, restarts and re-runs").
"""

import functools
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
import vertex_standin  # noqa: E402

VERTEX_YAML = os.path.join(REPO, "compiled", "logit_distill_pipeline_vertex.yaml")
FROM_STORE_VERTEX_YAML = os.path.join(REPO, "compiled", "logit_distill_from_store_vertex.yaml")
PROJECT, LOCATION = "test-project", "us-central1"
TOKEN = "guard-test-token"
JOB_IDS = {"JOB_STATE_FAILED": "101", "JOB_STATE_CANCELLED": "102", "JOB_STATE_EXPIRED": "103", "JOB_STATE_PAUSED": "104",
           "JOB_STATE_RUNNING": "201", "JOB_STATE_PENDING": "202", "JOB_STATE_QUEUED": "203",
           "JOB_STATE_SUCCEEDED": "204", 500: "301", 404: "302", "down": "303"}

# The run's parameters (the rest at their compiled defaults) and the outputs of the tasks before the jobs.
RESERVATION = {"reservation_affinity_type": "SPECIFIC_RESERVATION", "key": "compute.googleapis.com/reservation-name",
               "values": ["projects/test-project/zones/us-central1-a/reservations/h100"]}
JOB_VALUES = {
    "teacher": "gs://b/teacher", "data": "gs://b/data/*.array_record", "student": "gs://b/student",
    "store": "gs://b/out/teacher_topk/0123456789abcdef", "output_root": "gs://b/out", "dump_num_steps": 1000,
    "dump_machine_type": "a3-highgpu-8g", "dump_accelerator_type": "NVIDIA_H100_80GB", "dump_accelerator_count": 8,
    "dump_boot_disk_type": "pd-ssd", "dump_boot_disk_size_gb": 500, "dump_reservation_affinity": RESERVATION,
    "dump_strategy": "FLEX_START", "dump_max_wait_duration": "7200s", "dump_timeout": "172800s",
    "train_machine_type": "ct5lp-hightpu-4t", "train_accelerator_type": "TPU_V5_LITEPOD",
    "train_accelerator_count": 4, "train_tpu_topology": "4x4", "train_boot_disk_size_gb": 200,
    "train_strategy": "SPOT", "job_labels": {"team": "distill"},
    "tensorboard": "projects/test-project/locations/us-central1/tensorboards/7",
    "base_output_directory": "gs://b/vertex-out",
}
UPSTREAM = {"plan-dump-store_uri": "gs://b/out/teacher_topk/0123456789abcdef", "plan-dump-dump_key": "0123456789abcdef",
            "plan-dump-job_display_name": "logit-distill-vertex-20261201120000-dump-0123456789abcdef",
            "plan-training-output": "gs://b/out/students/fedcba9876543210",
            "plan-training-job_display_name": "logit-distill-vertex-20261201120000-kd-fedcba9876543210",
            "plan-training-2-output": "gs://b/out/students/00112233445566aa",
            "plan-training-2-job_display_name": "logit-distill-vertex-20261201120000-ce-baseline-00112233445566aa"}

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


@functools.lru_cache(maxsize=None)
def _spec(path: str = VERTEX_YAML) -> dict:
    with open(path) as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


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
    gcp_resources = tmp_path / "outputs" / "gcp_resources"
    command, args = vertex_standin.launcher_command(_spec(), "dump-teacher-topk", JOB_VALUES, UPSTREAM, "typed",
                                                    str(gcp_resources))
    container = {"command": command}
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


@pytest.mark.parametrize("state", ["JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED",
                                   "JOB_STATE_PAUSED"])
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


# ----------------------------------------------------------------- job creation, through GCPC's own code

@pytest.fixture(scope="module")
def job_service(tmp_path_factory):
    service = vertex_standin.JobService(tmp_path_factory.mktemp("jobservice"))
    yield service
    service.close()


def _create_job(spec_path, task, mode, tmp_path, credentials, job_service, guard=True):
    """Run ``task``'s launcher chain (placeholders filled in by ``mode``) against the loopback JobService;
    return the process and the CreateCustomJobRequest it sent (None if none)."""
    gcp_resources = tmp_path / "outputs" / "gcp_resources"
    command, args = vertex_standin.launcher_command(_spec(spec_path), task, JOB_VALUES, UPSTREAM, mode,
                                                    str(gcp_resources))
    if not guard:
        command = ["python3", "-u", "-m", launcher_guard.LAUNCHER]
    env = {**os.environ, **job_service.env(), "GOOGLE_APPLICATION_CREDENTIALS": credentials,
           "VERTEX_AI_PIPELINES_RUN_LABELS": json.dumps({"vertex-ai-pipelines-run-billing-id": "42"}),
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    env.pop("PYTHONPATH", None)  # GCPC's image: no logit_distill, no repository on the path
    before = len(job_service.created)
    proc = subprocess.run([sys.executable, *command[1:], *args], env=env, capture_output=True, text=True,
                          timeout=180)
    created = job_service.created[before:]
    assert len(created) <= 1
    return proc, gcp_resources, (created[0] if created else None)


def _bearer_identity(authorization: str) -> str:
    """Who a gRPC call authenticated as: google-auth signs a JWT with the service account's key for the
    JobService (its issuer is the account), or sends the token the token endpoint gave for it."""
    import base64

    token = authorization.removeprefix("Bearer ")
    if token == TOKEN:
        return f"pipeline@{PROJECT}.iam.gserviceaccount.com"
    claims = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))["iss"]


JOBS = [  # (compiled pipeline, task, which job's parameters)
    (VERTEX_YAML, "dump-teacher-topk", "dump"),
    (VERTEX_YAML, "train-offline-student", "train"),
    (FROM_STORE_VERTEX_YAML, "train-offline-student", "train"),
    (VERTEX_YAML, "train-ce-baseline", "train"),
]
IDS = [f"{os.path.basename(j[0])[:-5]}-{j[1]}" for j in JOBS]


def _check_created(job, task: str, which: str) -> None:
    """The CustomJob Vertex was asked to create is the one the parameters describe."""
    from google.cloud.aiplatform_v1.types import AcceleratorType, ReservationAffinity, Scheduling

    (pool,) = job.job_spec.worker_pool_specs
    machine, v = pool.machine_spec, JOB_VALUES
    assert machine.machine_type == v[f"{which}_machine_type"]
    assert machine.accelerator_type == AcceleratorType[v[f"{which}_accelerator_type"]]
    assert machine.accelerator_count == v[f"{which}_accelerator_count"]
    assert pool.replica_count == 1
    assert pool.disk_spec.boot_disk_size_gb == v[f"{which}_boot_disk_size_gb"]
    assert pool.disk_spec.boot_disk_type == "pd-ssd"
    assert "kfp.dsl.executor_main" in " ".join(pool.container_spec.command)
    assert pool.container_spec.image_uri.endswith("-cuda")  # the accelerator image (submit --image replaces it)
    scheduling = job.job_spec.scheduling
    if which == "dump":
        affinity = ReservationAffinity.to_dict(machine.reservation_affinity, use_integers_for_enums=False)
        assert affinity == RESERVATION
        assert scheduling.strategy == Scheduling.Strategy.FLEX_START
        assert scheduling.max_wait_duration.total_seconds() == 7200  # kept with FLEX_START
        assert scheduling.timeout.total_seconds() == 172800
        assert job.display_name == UPSTREAM["plan-dump-job_display_name"]
    else:
        assert machine.tpu_topology == "4x4"
        assert not machine.reservation_affinity.reservation_affinity_type  # {}: none
        assert scheduling.strategy == Scheduling.Strategy.SPOT and not scheduling.max_wait_duration
        assert job.job_spec.tensorboard == v["tensorboard"]
        assert job.job_spec.base_output_directory.output_uri_prefix == v["base_output_directory"]
        plan = "plan-training-2" if task == "train-ce-baseline" else "plan-training"
        assert job.display_name == UPSTREAM[f"{plan}-job_display_name"]
    assert job.job_spec.service_account == "pipeline-sa@test-project.iam.gserviceaccount.com"
    assert job.job_spec.network == "projects/123/global/networks/distill-vpc"
    assert job.encryption_spec.kms_key_name == "projects/test-project/locations/us-central1/keyRings/r/cryptoKeys/k"
    assert dict(job.labels) == {"team": "distill", "vertex-ai-pipelines-run-billing-id": "42"}


@pytest.mark.parametrize("spec_path, task, which", JOBS[:3], ids=IDS[:3])
def test_the_compiled_launcher_creates_the_job_from_the_text_form(spec_path, task, which, tmp_path, credentials,
                                                                  job_service, vertex):
    """The worst case, every parameter in the worker pool substituted as its text, through the compiled
    command chain (guard, then GCPC's launcher, create and poll) in a subprocess."""
    proc, gcp_resources, created = _create_job(spec_path, task, "text", tmp_path, credentials, job_service)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (request, metadata) = created
    assert job_service.tunnels[-1] == "CONNECT us-central1-aiplatform.googleapis.com:443 HTTP/1.1"
    assert _bearer_identity(metadata["authorization"]) == f"pipeline@{PROJECT}.iam.gserviceaccount.com"
    assert request.parent == f"projects/{PROJECT}/locations/{LOCATION}"
    _check_created(request.custom_job, task, which)
    # GCPC's launcher wrote the job it created into gcp_resources, and polled it to its end
    uri = json.loads(gcp_resources.read_text())["resources"][0]["resourceUri"]
    assert uri.endswith(f"/customJobs/{700 + len(job_service.created)}")
    (line,) = [line for line in _guard_lines(proc) if "typed" in line]
    assert "accelerator_count" in line and "boot_disk_size_gb" in line


@pytest.mark.parametrize("mode", ["typed", "typed-double"])
@pytest.mark.parametrize("spec_path, task, which", [JOBS[0], JOBS[3]], ids=[IDS[0], IDS[3]])
def test_the_typed_forms_create_the_same_job(spec_path, task, which, mode, tmp_path, job_service, monkeypatch,
                                             credentials):
    """The typed forms (values, or KFP's doubles: 8.0): the guard's typing, then GCPC's own create_job and
    create_custom_job_with_client in this process (its JobServiceClient on a channel that trusts the
    loopback certificate: gRPC reads GRPC_DEFAULT_SSL_ROOTS_FILE_PATH once per process); the values form
    goes through the guard unchanged."""
    from google_cloud_pipeline_components.container.v1.custom_job import remote_runner

    monkeypatch.setenv("VERTEX_AI_PIPELINES_RUN_LABELS", json.dumps({"vertex-ai-pipelines-run-billing-id": "42"}))
    _, args = vertex_standin.launcher_command(_spec(spec_path), task, JOB_VALUES, UPSTREAM, mode,
                                              str(tmp_path / "gcp_resources"))
    payload = args[args.index("--payload") + 1]
    typed, changed = launcher_guard.typed_payload(payload)
    assert (typed is payload) == (mode == "typed") and bool(changed) == (mode == "typed-double")
    before = len(job_service.created)
    _runner(tmp_path, job_service, monkeypatch, credentials).create_job(remote_runner.create_custom_job_with_client,
                                                           remote_runner.insert_system_labels_into_payload(typed))
    ((request, _),) = job_service.created[before:]
    _check_created(request.custom_job, task, which)


def _runner(tmp_path, job_service, monkeypatch, credentials):
    """GCPC's JobRemoteRunner, its JobServiceClient talking to the loopback JobService."""
    import grpc
    from google.auth.credentials import AnonymousCredentials
    from google.cloud.aiplatform_v1.services.job_service import JobServiceClient
    from google.cloud.aiplatform_v1.services.job_service.transports import JobServiceGrpcTransport
    from google_cloud_pipeline_components.container.v1.gcp_launcher import job_remote_runner

    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", credentials)  # (its own client wants some)
    monkeypatch.setenv("grpc_proxy", job_service.proxy_url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    with open(job_service.ca_path, "rb") as f:
        trust = grpc.ssl_channel_credentials(root_certificates=f.read())
    runner = job_remote_runner.JobRemoteRunner("CustomJob", PROJECT, LOCATION, str(tmp_path / "gcp_resources"))
    channel = grpc.secure_channel(f"{vertex_standin.HOST}:443", trust)
    runner.job_client = JobServiceClient(transport=JobServiceGrpcTransport(channel=channel,
                                                                           credentials=AnonymousCredentials()))
    return runner


def test_gcpcs_launcher_alone_cannot_create_the_job_from_the_text_form(tmp_path, job_service, monkeypatch,
                                                                       credentials):
    """Without the guard (the compiled launcher before it typed the payload), the text form of the machine
    fails in GCPC's create_custom_job_with_client, before any request is sent: the reason for the guard."""
    from google_cloud_pipeline_components.container.v1.custom_job import remote_runner

    _, args = vertex_standin.launcher_command(_spec(), "dump-teacher-topk", JOB_VALUES, UPSTREAM, "text",
                                              str(tmp_path / "gcp_resources"))
    payload = args[args.index("--payload") + 1]
    before = len(job_service.created)
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        _runner(tmp_path, job_service, monkeypatch, credentials).create_job(
            remote_runner.create_custom_job_with_client, remote_runner.insert_system_labels_into_payload(payload))
    assert len(job_service.created) == before


def test_the_typed_fields_have_the_types_of_aiplatforms_customjob():
    """Every path of the guard's TYPED_FIELDS is a field of aiplatform_v1.CustomJob of that JSON type."""
    from google.cloud.aiplatform_v1.types import CustomJob

    for path, kind in launcher_guard.TYPED_FIELDS.items():
        descriptor, field = CustomJob.pb().DESCRIPTOR, None
        for name in path:
            if name == "*":
                assert field.is_repeated, path
                continue
            field = descriptor.fields_by_name[name]
            descriptor = field.message_type
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        if kind is list:
            assert field.is_repeated and not is_map, path
        elif kind is dict:
            assert field.message_type is not None and (is_map or not field.is_repeated), path
        elif kind is int:
            assert field.cpp_type in (field.CPPTYPE_INT32, field.CPPTYPE_INT64), path
        else:
            assert kind is bool and field.cpp_type == field.CPPTYPE_BOOL, path


def test_the_guard_treats_every_error_state_of_gcpc_as_failed():
    """GCPC's launcher fails a task on these states; a retry that re-attached to such a job would fail too."""
    from google_cloud_pipeline_components.container.v1.gcp_launcher import job_remote_runner
    from google.cloud.aiplatform_v1.types import JobState

    gcpc = {state.name for state in job_remote_runner._JOB_ERROR_STATES}
    assert gcpc <= set(launcher_guard.FAILED_STATES) and "JOB_STATE_PAUSED" in gcpc
    assert set(launcher_guard.FAILED_STATES) <= {state.name for state in JobState}
