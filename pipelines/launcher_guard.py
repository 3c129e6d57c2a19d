"""A task retry of a Vertex custom job creates a new job: it never re-attaches to the failed one.

The Vertex variant runs the dump and the training as custom jobs launched by
google-cloud-pipeline-components' launcher (GCPC 2.22,
``container/v1/custom_job/launcher.py``). Before it creates a job, that launcher
reads its ``gcp_resources`` output file (``job_remote_runner.py``,
``check_if_job_exists``): when the file names a job it re-attaches to that job
and polls it, else it creates a new one. Re-attaching is right when the
launcher was restarted while its job still runs; when a task retry starts with
the failed attempt's file, it polls the failed job and fails at once: a wasted
retry.

This module runs first, in GCPC's launcher image, with the launcher's own
arguments (``python3 -u -c <this source> --type CustomJob --payload ...
--project P --location L --gcp_resources PATH``; pipelines/pipeline.py embeds
this file's source into the compiled YAML). When ``gcp_resources`` names a
custom job, it asks Vertex for the job's state: a job that FAILED, was
CANCELLED or EXPIRED has its file moved aside to ``PATH.<job id>`` (one line
names the old job), so GCPC's launcher creates a new job, which resumes from
the store / checkpoint. A pending, running or succeeded job is left alone (the
launcher re-attaches), and so is one whose state cannot be read (with a
warning). Then GCPC's launcher runs, unchanged, with the same arguments.

Only the standard library and what GCPC's image has (google-auth, requests):
the image does not contain this project. Nothing here may keep GCPC's launcher
from running: any error of the guard is a warning.
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
FAILED_STATES = ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED")
# the resource URI GCPC writes: https://{location}-aiplatform.googleapis.com/v1/{job name}
JOB_URI = re.compile(r"/v1/(projects/[^/]+/locations/([^/]+)/customJobs/([^/?#]+))$")
ATTEMPTS = 3  # reads of the job's state; a 429 / 5xx / connection error waits 1 s, 2 s before the next
TIMEOUT_S = 60


def log(message):
    print("launcher_guard: " + message, file=sys.stderr, flush=True)


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
    """Move ``gcp_resources`` aside when it names a custom job that failed, was cancelled or expired."""
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
        guard(argv)
    except (Exception, SystemExit) as err:  # (argparse exits on a malformed argument: GCPC's launcher says why)
        log("warning: the retry guard failed (%s: %s); GCPC's launcher runs as without it" % (type(err).__name__, err))
    sys.argv = [LAUNCHER] + argv
    runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
