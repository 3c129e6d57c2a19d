"""Stand-ins for what Vertex AI does around a custom-job task, for tests that cannot reach Vertex.

- ``launcher_command``: a compiled custom-job task's launcher command line with every placeholder filled in
  as Vertex's backend may fill it: the pipeline parameters inside the compiled worker pool either as their
  value (``typed``) or as their text (``text``: ``"8"``, the reservation's JSON as a string), the rest as
  values (KFP's command-line rules). Numbers are JSON numbers as protobuf's JSON printers write them (an
  integral double as ``1``), or, ``typed-double``, as the doubles the compiled spec holds them as (``1.0``,
  ``8.0``).
- ``JobService``: a loopback gRPC ``google.cloud.aiplatform.v1.JobService`` (CreateCustomJob, GetCustomJob)
  behind TLS, reached by the unmodified ``aiplatform_v1.JobServiceClient`` of GCPC's launcher through an
  HTTP CONNECT proxy (gRPC's ``grpc_proxy``), its certificate trusted through
  ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``: every byte GCPC sends is what it would send to
  ``{location}-aiplatform.googleapis.com``.
"""

from __future__ import annotations

import datetime
import json
import re
import select
import socket
import threading

PLACEHOLDER = re.compile(r"\{\{\$\.inputs\.parameters\['([^']+)'\]\}\}")
PIPELINE_PLACEHOLDERS = {
    "{{$.pipeline_service_account}}": "pipeline-sa@test-project.iam.gserviceaccount.com",
    "{{$.pipeline_network}}": "projects/123/global/networks/distill-vpc",
    "{{$.pipeline_encryption_key_name}}": "projects/test-project/locations/us-central1/keyRings/r/cryptoKeys/k",
    "{{$.pipeline_google_cloud_project_id}}": "test-project",
    "{{$.pipeline_google_cloud_location}}": "us-central1",
    "{{$.pipeline_persistent_resource_id}}": "",
    "{{$.pipeline_job_name}}": "logit-distill-vertex-20261201120000",
}
EXECUTOR_INPUT = json.dumps({"inputs": {"parameterValues": {}}, "outputs": {"outputFile": "/gcs/out.json"}})


def tasks_by_name(spec: dict) -> dict:
    """Every task of a compiled pipeline, in the root DAG or a sub-DAG, by display name."""
    found = {}
    for dag in [spec["root"]["dag"]] + [c["dag"] for c in spec["components"].values() if "dag" in c]:
        for key, task in dag["tasks"].items():
            found[task.get("taskInfo", {}).get("name", key)] = task
    return found


def launcher_command(spec: dict, task_name: str, values: dict, upstream: dict, mode: str,
                     gcp_resources: str) -> tuple[list[str], list[str]]:
    """(command, args) of ``task_name``'s launcher container with every placeholder filled in. ``values``:
    pipeline parameters (the rest at their compiled defaults); ``upstream``: the outputs of earlier tasks by
    channel name (``plan-dump-store_uri``, ...); ``mode``: text | typed | typed-double."""
    task = tasks_by_name(spec)[task_name]
    component = spec["components"][task["componentRef"]["name"]]
    container = spec["deploymentSpec"]["executors"][component["executorLabel"]]["container"]
    pipeline = {n: d.get("defaultValue") for n, d in spec["root"]["inputDefinitions"]["parameters"].items()}
    pipeline.update(values)
    types = {n: d["parameterType"] for n, d in spec["root"]["inputDefinitions"]["parameters"].items()}

    def channel(name: str):
        name = name.removeprefix("pipelinechannel--")
        value = pipeline[name] if name in pipeline else upstream[name]
        if mode == "typed-double" and types.get(name) == "NUMBER_INTEGER":
            value = float(value)  # KFP keeps an integer parameter as a JSON number: 8.0
        return value

    inputs = {n: d.get("defaultValue") for n, d in component["inputDefinitions"]["parameters"].items()}
    constants = {}
    for name, given in task["inputs"]["parameters"].items():
        if "componentInputParameter" in given:
            inputs[name] = channel(given["componentInputParameter"])
        elif "taskOutputParameter" in given:
            out = given["taskOutputParameter"]
            inputs[name] = upstream[f"{out['producerTask']}-{out['outputParameterKey']}"]
        else:
            constants[name] = given["runtimeValue"]["constant"]

    def fill(value):
        """A compiled constant with its placeholders filled in."""
        if isinstance(value, list):
            return [fill(v) for v in value]
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, float) and value.is_integer() and mode != "typed-double":
            return int(value)  # a compiled constant (replica_count: 1.0), printed as protobuf prints it
        if not isinstance(value, str):
            return value
        whole = PLACEHOLDER.fullmatch(value)
        if whole and mode != "text":
            return inputs[whole.group(1)]
        value = PLACEHOLDER.sub(lambda m: _text(inputs[m.group(1)]), value)
        for placeholder, text in PIPELINE_PLACEHOLDERS.items():
            value = value.replace(placeholder, text)
        return value.replace("{{$.json_escape[1]}}", json.dumps(EXECUTOR_INPUT)[1:-1])

    inputs.update({name: fill(value) for name, value in constants.items()})
    inputs = {name: fill(value) if isinstance(value, str) else value for name, value in inputs.items()}

    def arg(text: str) -> str:
        """A command-line argument: string parameters as their text (inside the payload's quotes, escaped as
        JSON text), every other type as its JSON."""
        text = text.replace("{{$.outputs.parameters['gcp_resources'].output_file}}", gcp_resources)

        def value(m):
            v = inputs[m.group(1)]
            return json.dumps(v)[1:-1] if isinstance(v, str) else json.dumps(v)
        return PLACEHOLDER.sub(value, text)

    return list(container["command"]), [arg(a) for a in container["args"]]


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# ----------------------------------------------------------------- the loopback JobService

HOST = "us-central1-aiplatform.googleapis.com"


def _certificate(tmp_dir) -> tuple[bytes, bytes, str]:
    """A self-signed certificate for HOST: (key PEM, certificate PEM, path of the certificate file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(HOST)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    path = str(tmp_dir / "jobservice-ca.pem")
    with open(path, "wb") as f:
        f.write(pem)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()), pem, path


class JobService:
    """CreateCustomJob records the request and names the job; GetCustomJob says it succeeded. ``created``:
    (request, call metadata) of every creation; ``tunnels``: the CONNECT lines the proxy was asked for."""

    def __init__(self, tmp_dir):
        from concurrent import futures

        import grpc
        from google.cloud.aiplatform_v1.types import custom_job, job_service

        self.created, self.tunnels, self._jobs = [], [], {}
        key, cert, self.ca_path = _certificate(tmp_dir)
        handlers = grpc.method_handlers_generic_handler("google.cloud.aiplatform.v1.JobService", {
            "CreateCustomJob": grpc.unary_unary_rpc_method_handler(
                self._create, request_deserializer=job_service.CreateCustomJobRequest.deserialize,
                response_serializer=custom_job.CustomJob.serialize),
            "GetCustomJob": grpc.unary_unary_rpc_method_handler(
                self._get, request_deserializer=job_service.GetCustomJobRequest.deserialize,
                response_serializer=custom_job.CustomJob.serialize),
        })
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers((handlers,))
        self._port = self._server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
        self._server.start()
        self._proxy = socket.socket()
        self._proxy.bind(("127.0.0.1", 0))
        self._proxy.listen(16)
        self.proxy_url = f"http://127.0.0.1:{self._proxy.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def env(self) -> dict:
        """The environment that sends a JobServiceClient of ``HOST`` here."""
        return {"grpc_proxy": self.proxy_url, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": self.ca_path}

    def _create(self, request, context):
        from google.cloud.aiplatform_v1.types import custom_job

        self.created.append((request, dict(context.invocation_metadata())))
        job = custom_job.CustomJob(request.custom_job)
        job.name = f"{request.parent}/customJobs/{700 + len(self.created)}"
        self._jobs[job.name] = job
        return job

    def _get(self, request, context):
        from google.cloud.aiplatform_v1.types import custom_job, job_state

        job = custom_job.CustomJob(self._jobs[request.name])
        job.state = job_state.JobState.JOB_STATE_SUCCEEDED
        return job

    def _accept(self):
        while True:
            try:
                client, _ = self._proxy.accept()
            except OSError:
                return
            threading.Thread(target=self._tunnel, args=(client,), daemon=True).start()

    def _tunnel(self, client):
        head = b""
        while b"\r\n\r\n" not in head:
            data = client.recv(4096)
            if not data:
                client.close()
                return
            head += data
        self.tunnels.append(head.split(b"\r\n", 1)[0].decode())
        upstream = socket.create_connection(("127.0.0.1", self._port))
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        rest = head.split(b"\r\n\r\n", 1)[1]
        if rest:
            upstream.sendall(rest)
        try:
            while True:
                ready, _, _ = select.select([client, upstream], [], [], 60)
                if not ready:
                    return
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    (upstream if sock is client else client).sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def close(self):
        self._server.stop(0)
        self._proxy.close()
