"""Runs before GCPC's custom-job launcher: the job's typed fields typed, and a task retry creates a new job.

The Vertex variants run the dump and the training as custom jobs launched by
google-cloud-pipeline-components' launcher (GCPC 2.22,
``container/v1/custom_job/launcher.py``). This module runs first, in GCPC's
launcher image, with the launcher's own arguments (``python3 -u -c <this
source> --type CustomJob --payload ... --project P --location L
--gcp_resources PATH``; pipelines/pipeline.py embeds this file's source into
the compiled YAML), does two things, then runs GCPC's launcher, unchanged, with
the same arguments.

**Typed fields.** The machine of a job is a pipeline parameter placed inside
the compiled worker pool (``"accelerator_count":
"{{$.inputs.parameters['pipelinechannel--dump_accelerator_count']}}"``), and
Vertex does not document whether it substitutes such a placeholder with the
value (``8``) or with its text (``"8"``, ``"{...}"`` for the reservation).
GCPC's launcher hands the parsed payload to
``JobServiceClient.create_custom_job``, whose ``aiplatform_v1.CustomJob``
refuses a string, or a float like ``8.0`` (KFP's JSON numbers), where the
field is an integer, and a string where it is a message. So every value of the
payload that can arrive as text is first given the type its field has in
``aiplatform_v1.CustomJob`` (``TYPED_FIELDS``: integers from their text or an
integral float, booleans from their text, messages, maps and lists from their
JSON text), with one line naming the fields it changed; a payload with every
field already typed is passed on byte for byte.

**A retry creates a new job.** Before it creates a job, GCPC's launcher reads
its ``gcp_resources`` output file (``job_remote_runner.py``,
``check_if_job_exists``): when the file names a job it re-attaches to that job
and polls it, else it creates a new one. Re-attaching is right when the
launcher was restarted while its job still runs; when a task retry starts with
the failed attempt's file, it polls the failed job and fails at once: a wasted
retry. So when ``gcp_resources`` names a custom job, this module asks Vertex
for the job's state: a job in a terminal error state (FAILED, CANCELLED,
PAUSED, EXPIRED, and any other state GCPC's launcher treats as an error) has
its file moved aside to ``PATH.<job id>`` (one line names the old job), so
GCPC's launcher creates a new job, which resumes from the store / checkpoint.
A pending, running or succeeded job is left alone (the launcher re-attaches),
and so is one whose state cannot be read (with a warning).

Only the standard library and what GCPC's image has (google-auth, requests):
the image does not contain this project. Nothing
here may keep GCPC's launcher from running: any error of the guard is a
warning.
"""

import argparse
import json
import os
import re
import runpy
import sys
import time

LAUNCHER = "google_cloud_pipeline_components.container.v1.custom_job.launcher"
# Vertex's REST endpoint, default https://{location}-aiplatform.googleapis.com (the tests point it at loopback).
ENDPOINT_ENV = "LOGIT_DISTILL_VERTEX_ENDPOINT"
# The terminal error states of a custom job (aiplatform_v1.JobState): every state GCPC's launcher fails a task
# on (job_remote_runner._JOB_ERROR_STATES; tests/test_launcher_guard.py compares), and EXPIRED.
FAILED_STATES = ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_PAUSED", "JOB_STATE_EXPIRED")
# the resource URI GCPC writes: https://{location}-aiplatform.googleapis.com/v1/{job name}
JOB_URI = re.compile(r"/v1/(projects/[^/]+/locations/([^/]+)/customJobs/([^/?#]+))$")
ATTEMPTS = 3  # reads of the job's state; a 429 / 5xx / connection error waits 1 s, 2 s before the next
TIMEOUT_S = 60


def log(message):
    print("launcher_guard: " + message, file=sys.stderr, flush=True)


# The fields of a custom job's payload whose JSON type aiplatform_v1.CustomJob checks and that can arrive as
# text: those of GCPC's payload template and the machine and disk of the compiled worker pools. Each path
# (``*``: every item of a list) -> the type its value must have (tests/test_launcher_guard.py checks them
# against aiplatform_v1.CustomJob's own field types).
TYPED_FIELDS = {
    ("job_spec", "worker_pool_specs", "*", "replica_count"): int,
    ("job_spec", "worker_pool_specs", "*", "machine_spec", "accelerator_count"): int,
    ("job_spec", "worker_pool_specs", "*", "machine_spec", "reservation_affinity"): dict,
    ("job_spec", "worker_pool_specs", "*", "disk_spec", "boot_disk_size_gb"): int,
    ("job_spec", "scheduling", "restart_job_on_worker_restart"): bool,
    ("job_spec", "enable_web_access"): bool,
    ("job_spec", "reserved_ip_ranges"): list,
    ("job_spec", "psc_interface_config"): dict,
    ("labels",): dict,
}


def as_type(value, kind):
    """``value`` as ``kind`` when it is that value's text (``"8"``, ``"true"``, ``"{...}"``; empty text: an empty
    dict or list) or an integral float for an int (``8.0``); anything else as it is, for GCPC to refuse."""
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, str):
        return value
    text = value.strip()
    if kind is int and re.fullmatch(r"-?\d+(\.0*)?", text):
        return int(float(text))
    if kind is bool and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind in (dict, list):
        try:
            parsed = json.loads(text) if text else kind()
        except ValueError:
            return value
        return parsed if isinstance(parsed, kind) else value
    return value


def _retyped(node, path, kind, changed, where):
    if not path:
        new = as_type(node, kind)
        if new is not node:
            changed.append(where)
        return new
    head, rest = path[0], path[1:]
    if head == "*":
        if isinstance(node, list):
            return [_retyped(item, rest, kind, changed, "%s[%d]" % (where, i)) for i, item in enumerate(node)]
        return node
    if isinstance(node, dict) and head in node:
        node = dict(node)
        node[head] = _retyped(node[head], rest, kind, changed, where + "." + head if where else head)
    return node


def typed_payload(text):
    """``(payload, changed field names)``: the payload JSON with every field of TYPED_FIELDS of its type; the
    text itself when nothing needed it."""
    payload = json.loads(text, strict=False)  # (GCPC parses it with strict=False too)
    changed = []
    for path, kind in TYPED_FIELDS.items():
        payload = _retyped(payload, path, kind, changed, "")
    return (json.dumps(payload) if changed else text), changed


def with_typed_payload(argv):
    """``argv`` with its ``--payload`` typed (see ``typed_payload``)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--payload" and i + 1 < len(argv):
            index, text, prefix = i + 1, argv[i + 1], ""
        elif arg.startswith("--payload="):
            index, text, prefix = i, arg[len("--payload="):], "--payload="
        else:
            continue
        new, changed = typed_payload(text)
        if changed:
            argv[index] = prefix + new
            log("typed %d field(s) of the job given as text or as integral floats: %s"
                % (len(changed), ", ".join(sorted(set(changed)))))
        break
    return argv


def gcp_resources_path(argv):
    """The ``--gcp_resources`` argument, parsed as GCPC's launcher parses it (``parse_known_args``)."""
    parser = argparse.ArgumentParser(add_help=False)
    for name in ("--type", "--project", "--location", "--payload", "--gcp_resources"):
        parser.add_argument(name)
    known, _ = parser.parse_known_args(argv)
    return known.gcp_resources


def named_job(text):
    """``(job name, location, job id)`` of the one custom job a ``gcp_resources`` file names."""
    data = json.loads(text)
    resources = (data.get("resources") if isinstance(data, dict) else None) or []
    if len(resources) != 1:
        raise ValueError("it names %d resources, not one" % len(resources))
    uri = resources[0].get("resourceUri") or resources[0].get("resource_uri") or ""
    match = JOB_URI.search(uri)
    if not match:
        raise ValueError("its resource %r is not a custom job" % uri)
    return match.groups()


def job_state(name, location):
    """The job's ``state`` (GET .../v1/{name}, as the pipeline's service account); raises when unreadable."""
    import google.auth
    import google.auth.transport.requests
    import requests

    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    session = google.auth.transport.requests.AuthorizedSession(credentials)
    endpoint = os.environ.get(ENDPOINT_ENV) or "https://%s-aiplatform.googleapis.com" % location
    url = "%s/v1/%s" % (endpoint.rstrip("/"), name)
    for attempt in range(1, ATTEMPTS + 1):
        try:
            response = session.get(url, timeout=TIMEOUT_S)
        except requests.exceptions.RequestException as err:
            problem = "%s: %s" % (type(err).__name__, err)
        else:
            if response.status_code == 200:
                return response.json().get("state", "JOB_STATE_UNSPECIFIED")
            problem = "HTTP %d from %s: %s" % (response.status_code, url, " ".join(response.text.split())[:200])
            if response.status_code != 429 and response.status_code < 500:
                break
        if attempt < ATTEMPTS:
            time.sleep(2 ** (attempt - 1))
    raise RuntimeError(problem)


def guard(argv):
    """Move ``gcp_resources`` aside when it names a custom job in a terminal error state."""
    path = gcp_resources_path(argv)
    if not path or not os.path.isfile(path) or os.path.getsize(path) == 0:
        return  # GCPC's launcher creates a job
    with open(path) as f:
        text = f.read()
    try:
        name, location, job_id = named_job(text)
    except ValueError as err:
        log("warning: %s does not name one custom job (%s); left as it is for GCPC's launcher" % (path, err))
        return
    try:
        state = job_state(name, location)
    except Exception as err:
        log("warning: could not read the state of custom job %s (%s); %s left as it is: GCPC's launcher "
            "re-attaches to that job" % (name, err, path))
        return
    if state in FAILED_STATES:
        aside = "%s.%s" % (path, job_id)
        os.replace(path, aside)
        log("custom job %s is %s: its gcp_resources moved to %s, GCPC's launcher creates a new job"
            % (name, state, aside))
    else:
        log("custom job %s is %s: GCPC's launcher re-attaches to it" % (name, state))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv = with_typed_payload(argv)
    except Exception as err:
        log("warning: the payload could not be typed (%s: %s); GCPC's launcher gets it as it is"
            % (type(err).__name__, err))
    try:
        guard(argv)
    except (Exception, SystemExit) as err:  # (argparse exits on a malformed argument: GCPC's launcher says why)
        log("warning: the retry guard failed (%s: %s); GCPC's launcher runs as without it" % (type(err).__name__, err))
    sys.argv = [LAUNCHER] + argv
    runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
