"""Submit a compiled pipeline to Vertex AI Pipelines as an ``aiplatform.PipelineJob``.

    python -m pipelines.submit --project P --region R --pipeline-root gs://BUCKET/pipeline-root \\
        --image REGION-docker.pkg.dev/P/REPO/logit-distill:TAG-cuda \\
        [--cpu-image REGION-docker.pkg.dev/P/REPO/logit-distill:TAG-cpu] \\
        [--pipeline logit-distill-vertex|logit-distill-from-store-vertex] [--template FILE] \\
        [--service-account SA] [--network NET] [--encryption-key KEY] [--labels k=v,...] \\
        [--experiment NAME] [--no-cache] [--job-id ID] [--display-name NAME] [--dry-run] [param=value ...]

Builds the job from the compiled pipeline (``compiled/logit_distill_pipeline_vertex.yaml``,
``compiled/logit_distill_from_store_vertex.yaml`` with ``--pipeline
logit-distill-from-store-vertex``, or ``--template``) with the placeholder
images replaced by ``--image`` (dump and training) and ``--cpu-image`` (the CPU
steps; default ``--image``), both pinned (a tag other than latest, or a
digest), and the given parameters. Parameters are typed and checked against
the pipeline's parameter table (``pipelines/params.py``: allowed values,
ranges) and against what Vertex would reject (``pipelines/vertex_checks.py``:
paths that are not in Cloud Storage, machine / accelerator / TPU shapes that do
not exist, reservations, labels, aliases) before anything is sent; an old
parameter name is refused naming the new one. ``--labels`` label the pipeline
job and every custom job it starts (the ``job_labels`` parameter).
``--encryption-key`` (a Cloud KMS key) encrypts the pipeline job, every custom
job it starts and the registered model. Caching is left to the compiled task
settings unless ``--no-cache`` turns it off for the run. ``--dry-run`` builds
the job offline (anonymous credentials) and prints every resolved parameter,
defaults included, the images, identity, network and key, and submits nothing.
"""

import argparse
import json
import os
import re
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = {"logit-distill-vertex": os.path.join(REPO, "compiled", "logit_distill_pipeline_vertex.yaml"),
             "logit-distill-from-store-vertex": os.path.join(REPO, "compiled", "logit_distill_from_store_vertex.yaml")}
DEFAULT_TEMPLATE = TEMPLATES["logit-distill-vertex"]
VARIANTS = {"logit-distill": "local", "logit-distill-vertex": "vertex", "logit-distill-from-store": "from_store",
            "logit-distill-from-store-vertex": "from_store_vertex"}
# Cloud KMS key names: projects/P/locations/L/keyRings/R/cryptoKeys/K.
_KMS_KEY = re.compile(r"projects/[^/]+/locations/[^/]+/keyRings/[^/]+/cryptoKeys/[^/]+")


class SubmitError(ValueError):
    """Bad input to submit: one line, exit code 2."""


def parse_labels(text: str | None) -> dict:
    """``k=v,k2=v2`` -> dict, checked against Google Cloud's label rules."""
    from pipelines.vertex_checks import LABEL_KEY, LABEL_VALUE

    labels = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not LABEL_KEY.fullmatch(key) or not LABEL_VALUE.fullmatch(value):
            raise SubmitError(f"--labels: {item!r} is not key=value with lowercase letters, digits, _ or - "
                              "(keys start with a letter, both at most 63 characters)")
        labels[key] = value
    return labels


def parse_params(pairs: list[str], spec: dict) -> dict:
    """``["name=value", ...]`` -> typed values, checked against the pipeline's parameter table."""
    from pipelines import params

    variant = VARIANTS.get(spec["pipelineInfo"]["name"], "vertex")
    defs = spec["root"].get("inputDefinitions", {}).get("parameters", {})
    try:
        values = params.parse_pairs(pairs, variant)
    except ValueError as e:
        raise SubmitError(str(e)) from None
    unknown = sorted(set(values) - set(defs))
    if unknown:
        raise SubmitError(f"the template has no parameter {', '.join(unknown)}; recompile it (make compile)")
    problems = params.check(values, variant)
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
        raise SubmitError(problems[0] + more)
    return values


def resolved_params(values: dict, spec: dict) -> dict:
    """Every parameter of the template with the value the run will use (given or default)."""
    from pipelines import params

    defaults = params.defaults(VARIANTS.get(spec["pipelineInfo"]["name"], "vertex"))
    defs = spec["root"].get("inputDefinitions", {}).get("parameters", {})
    return {name: values.get(name, defaults.get(name, d.get("defaultValue"))) for name, d in sorted(defs.items())}


def with_images(template_text: str, image: str | None, cpu_image: str | None) -> str:
    """The template with the compiled-in placeholder images replaced; refuses to leave a placeholder."""
    from components.image import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE, PLACEHOLDER, check_image

    text = template_text
    for name, given, default in (("--image", image, DEFAULT_IMAGE), ("--cpu-image", cpu_image or image,
                                                                      DEFAULT_CPU_IMAGE)):
        if given:
            try:
                check_image(given)
            except ValueError as e:
                raise SubmitError(f"{name}: {e}") from None
            text = text.replace(default, given)
    if PLACEHOLDER in text:
        raise SubmitError(f"the template still names the placeholder image ({PLACEHOLDER}): give --image (and "
                          "--cpu-image) with the image you pushed (docs/PIPELINE.md, 'Build and push')")
    return text


def with_image(template_text: str, image: str) -> str:
    """The template with both placeholder images replaced by ``image``."""
    return with_images(template_text, image, None)


def images_of(spec: dict) -> list[str]:
    return sorted({ex["container"]["image"] for ex in spec["deploymentSpec"]["executors"].values()
                   if "container" in ex} | set(re.findall(r'"image_uri": "([^"]+)"', json.dumps(spec))))


def build_job(*, project: str, region: str, pipeline_root: str, image: str | None, params: list[str],
              template: str = DEFAULT_TEMPLATE, display_name: str | None = None, labels: dict | None = None,
              credentials=None, work_dir: str | None = None, cpu_image: str | None = None,
              enable_caching: bool | None = None, job_id: str | None = None, encryption_key: str | None = None):
    """(``aiplatform.PipelineJob``, parameter values given, the template file used, the parsed spec)."""
    import yaml
    from google.cloud import aiplatform

    if not project or not project.strip():
        raise SubmitError("--project is empty: give the Google Cloud project id")
    if not region or not region.strip():
        raise SubmitError("--region is empty: give a Vertex AI region, e.g. us-central1")
    if not pipeline_root.startswith("gs://"):
        raise SubmitError(f"--pipeline-root {pipeline_root!r} is not a gs:// URI")
    if encryption_key and not _KMS_KEY.fullmatch(encryption_key):
        raise SubmitError(f"--encryption-key {encryption_key!r} is not a Cloud KMS key name "
                          "(projects/P/locations/L/keyRings/R/cryptoKeys/K)")
    try:
        with open(template, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SubmitError(f"cannot read the template {template}: {e.strerror}") from None
    text = with_images(text, image, cpu_image)
    spec = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # (libyaml: 10x faster)
    values = parse_params(params, spec)
    if labels and "job_labels" in spec["root"].get("inputDefinitions", {}).get("parameters", {}):
        values.setdefault("job_labels", dict(labels))
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
        labels=labels or None,
        enable_caching=enable_caching,  # None keeps the compiled settings (docs/PIPELINE.md)
        job_id=job_id,
        encryption_spec_key_name=encryption_key or None,
    )
    return job, values, path, spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.submit", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", required=True)
    ap.add_argument("--region", required=True)
    ap.add_argument("--pipeline-root", required=True, help="gs:// prefix for the run's artifacts")
    ap.add_argument("--image", default=None, help="the accelerator image you pushed (pinned tag or digest)")
    ap.add_argument("--cpu-image", default=None, help="the CPU image of plan and verify (default: --image)")
    ap.add_argument("--pipeline", choices=sorted(TEMPLATES), default="logit-distill-vertex",
                    help="which compiled pipeline to submit (default logit-distill-vertex; "
                         "logit-distill-from-store-vertex trains from an existing store)")
    ap.add_argument("--template", default=None, help="a compiled pipeline file instead of --pipeline's")
    ap.add_argument("--display-name", default=None)
    ap.add_argument("--job-id", default=None, help="the pipeline job's id (default: generated)")
    ap.add_argument("--service-account", default=None,
                    help="service account of the run and of every custom job it starts")
    ap.add_argument("--network", default=None, help="VPC network of the run and its custom jobs")
    ap.add_argument("--encryption-key", default=None,
                    help="Cloud KMS key (projects/P/locations/L/keyRings/R/cryptoKeys/K) of the pipeline job, "
                         "its custom jobs and the registered model")
    ap.add_argument("--labels", default=None, help="k=v,... on the pipeline job and every custom job")
    ap.add_argument("--experiment", default=None, help="Vertex AI Experiment to record the run in")
    ap.add_argument("--no-cache", action="store_true", help="run every task (enable_caching=False)")
    ap.add_argument("--dry-run", action="store_true", help="build the job, print it, submit nothing")
    ap.add_argument("params", nargs="*", metavar="param=value")
    args = ap.parse_args(argv)
    template = args.template or TEMPLATES[args.pipeline]
    credentials = None
    if args.dry_run:
        from google.auth.credentials import AnonymousCredentials

        credentials = AnonymousCredentials()
    try:
        labels = parse_labels(args.labels)
        if args.experiment is not None:
            from pipelines.vertex_checks import experiment_problem

            why = experiment_problem(args.experiment)
            if why:
                raise SubmitError(why)
        job, values, path, spec = build_job(
            project=args.project, region=args.region, pipeline_root=args.pipeline_root, image=args.image,
            cpu_image=args.cpu_image, params=args.params, template=template, display_name=args.display_name,
            labels=labels, credentials=credentials, enable_caching=False if args.no_cache else None,
            job_id=args.job_id, encryption_key=args.encryption_key)
    except (SubmitError, ValueError) as e:
        print(f"submit: error: {e}", file=sys.stderr)
        return 2
    runtime = job._gca_resource.runtime_config  # noqa: SLF001 - the request body as it will be sent
    print(f"pipeline      {job._gca_resource.display_name!r} from {template}")
    print(f"pipeline root {runtime.gcs_output_directory}")
    print(f"images        {', '.join(images_of(spec))}")
    print(f"identity      {args.service_account or '(the project default: Compute Engine default service account)'}")
    print(f"network       {args.network or '(none)'}")
    print(f"encryption    {args.encryption_key or '(Google-managed)'}")
    print(f"labels        {json.dumps(labels, sort_keys=True)}")
    print(f"experiment    {args.experiment or '(none)'}")
    print(f"caching       {'off for every task' if args.no_cache else 'as compiled'}")
    print("parameters")
    for name, value in resolved_params(values, spec).items():
        print(f"  {name} = {json.dumps(value)}{'' if name in values else '  (default)'}")
    if args.dry_run:
        print("dry run: nothing submitted")
        os.remove(path)
        return 0
    job.submit(service_account=args.service_account, network=args.network, experiment=args.experiment)
    os.remove(path)
    print(f"submitted {job.resource_name}")
    print(f"console: {job._dashboard_uri()}")  # noqa: SLF001
    return 0


if __name__ == "__main__":
    sys.exit(main())
