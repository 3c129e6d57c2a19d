"""Submit the compiled Vertex pipeline as an ``aiplatform.PipelineJob``.

    python -m pipelines.submit --project P --region R --pipeline-root gs://BUCKET/pipeline-root \\
        --image REGION-docker.pkg.dev/P/REPO/logit-distill:TAG [--dry-run] [param=value ...]

Builds the job from ``compiled/logit_distill_pipeline_vertex.yaml`` (or
``--template``), with the component image replaced by ``--image`` (pinned: a
tag other than latest, or a digest) and the given parameters, typed from the
template's parameter definitions. Caching is left to the compiled task settings
(``enable_caching`` is never passed: it would rewrite every task's caching
options). ``--dry-run`` builds the job without network access (anonymous
credentials) and prints its parameters and pipeline root.
"""

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TEMPLATE = os.path.join(REPO, "compiled", "logit_distill_pipeline_vertex.yaml")


def _convert(name: str, text: str, kind: str):
    try:
        if kind == "NUMBER_INTEGER":
            return int(text)
        if kind == "NUMBER_DOUBLE":
            return float(text)
        if kind == "BOOLEAN":
            low = text.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return low in ("true", "1", "yes")
        if kind in ("LIST", "STRUCT"):
            return json.loads(text)
    except ValueError:
        raise SystemExit(f"submit: error: parameter {name}={text!r} is not a valid {kind}") from None
    return text


def parse_params(pairs: list[str], spec: dict) -> dict:
    """``["name=value", ...]`` -> typed values, checked against the pipeline's root parameters."""
    defs = spec["root"].get("inputDefinitions", {}).get("parameters", {})
    values = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"submit: error: expected name=value, got {pair!r}")
        if name not in defs:
            raise SystemExit(f"submit: error: unknown parameter {name!r}; the pipeline has: {', '.join(sorted(defs))}")
        values[name] = _convert(name, text, defs[name]["parameterType"])
    missing = sorted(n for n, d in defs.items() if not d.get("isOptional") and n not in values)
    if missing:
        raise SystemExit(f"submit: error: missing required parameter(s): {', '.join(missing)} (give name=value)")
    return values


def with_image(template_text: str, image: str) -> str:
    """The template with the compiled-in component image replaced by ``image``."""
    from components.image import DEFAULT_IMAGE, check_image

    check_image(image)
    if DEFAULT_IMAGE not in template_text:
        raise SystemExit(f"submit: error: the template does not use the default image {DEFAULT_IMAGE}; "
                         "it was compiled with another --image: submit it without --image or recompile")
    return template_text.replace(DEFAULT_IMAGE, image)


def build_job(*, project: str, region: str, pipeline_root: str, image: str | None, params: list[str],
              template: str = DEFAULT_TEMPLATE, display_name: str | None = None, labels: dict | None = None,
              credentials=None, work_dir: str | None = None):
    """(``aiplatform.PipelineJob``, parameter values, the template file used)."""
    import yaml
    from google.cloud import aiplatform

    with open(template, encoding="utf-8") as f:
        text = f.read()
    if image:
        text = with_image(text, image)
    spec = yaml.safe_load(text)
    values = parse_params(params, spec)
    fd, path = tempfile.mkstemp(prefix="logit-distill-", suffix=".yaml", dir=work_dir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    job = aiplatform.PipelineJob(
        display_name=display_name or spec["pipelineInfo"]["name"],
        template_path=path,
        pipeline_root=pipeline_root,
        parameter_values=values,
        project=project,
        location=region,
        credentials=credentials,
        labels=labels,
    )
    return job, values, path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.submit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", required=True)
    ap.add_argument("--region", required=True)
    ap.add_argument("--pipeline-root", required=True, help="gs:// prefix for the run's artifacts")
    ap.add_argument("--image", default=None, help="the component image you pushed (pinned tag or digest)")
    ap.add_argument("--template", default=DEFAULT_TEMPLATE)
    ap.add_argument("--display-name", default=None)
    ap.add_argument("--service-account", default=None, help="service account the run uses")
    ap.add_argument("--network", default=None, help="VPC network to peer with")
    ap.add_argument("--dry-run", action="store_true", help="build the job, print it, submit nothing")
    ap.add_argument("params", nargs="*", metavar="param=value")
    args = ap.parse_args(argv)
    if not args.pipeline_root.startswith("gs://"):
        ap.error("--pipeline-root must be a gs:// URI")
    credentials = None
    if args.dry_run:
        from google.auth.credentials import AnonymousCredentials

        credentials = AnonymousCredentials()
    try:
        job, values, path = build_job(project=args.project, region=args.region, pipeline_root=args.pipeline_root,
                                      image=args.image, params=args.params, template=args.template,
                                      display_name=args.display_name, credentials=credentials)
    except ValueError as e:
        print(f"submit: error: {e}", file=sys.stderr)
        return 2
    runtime = job._gca_resource.runtime_config  # noqa: SLF001 - the request body as it will be sent
    print(f"pipeline {job._gca_resource.display_name!r} from {args.template}")
    print(f"pipeline root {runtime.gcs_output_directory}")
    print("parameters " + json.dumps(values, sort_keys=True))
    if args.dry_run:
        print("dry run: nothing submitted")
        os.remove(path)
        return 0
    job.submit(service_account=args.service_account, network=args.network)
    os.remove(path)
    print(f"submitted {job.resource_name}")
    print(f"console: {job._dashboard_uri()}")  # noqa: SLF001
    return 0


if __name__ == "__main__":
    sys.exit(main())
