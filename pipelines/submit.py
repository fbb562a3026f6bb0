"""Submit the compiled pipeline to Vertex AI Pipelines, manage recurring schedules, register the blessed model.

    python -m pipelines.submit run      --project P --region R --pipeline-root gs://B/root [--param k=v ...]
    python -m pipelines.submit schedule create --cron "0 3 * * *" --time-zone Europe/Berlin --name nightly ...
    python -m pipelines.submit schedule list|pause|resume|delete ...
    python -m pipelines.submit register-model --artifact-uri gs://B/blessed/current --display-name persia-ctr ...
    python -m pipelines.submit upload-template --host https://REGION-kfp.pkg.dev/P/REPO --tag v1
    python -m pipelines.submit dataflow-args --project P --region R --temp-location gs://B/tmp ...

Everything is checked before a request is sent: parameters against the compiled YAML's
``root.inputDefinitions`` (unknown names and ill-typed values are errors naming the parameter), the pipeline
root (gs://), the cron's time zone, and that the template was compiled for the Vertex AI target. A scheduled
run needs no edits: give ``data`` with ``{date-1d}`` tokens (filled from the run's scheduled time, see
``components.data_path``) and point the warm-start parameter at the blessed-model folder (its marker names the
latest blessed model); both are passed through as parameters.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys

from components.endpoint import deploy_to_endpoint, upload_model
from pipelines.jobs import submit, upload_template
from pipelines.parameters import Target, dataflow_beam_args, parse_key_values
from pipelines.schedules import create_schedule, delete_schedule, list_schedules, pause_schedule, resume_schedule

DEFAULT_TEMPLATE = "pipelines/persia_pipeline_vertex.yaml"


def _add_target(p: argparse.ArgumentParser, root: bool = False) -> None:
    p.add_argument("--project", required=True, help="Google Cloud project ID")
    p.add_argument("--region", required=True, help="Vertex AI region, e.g. us-central1")
    if root:
        p.add_argument("--pipeline-root", required=True, help="gs:// folder for the runs' artifacts")


def pipeline_parameter_names() -> list[str]:
    """The pipeline's parameters, in its signature's order (their meaning: ``persia_pipeline``'s docstring and
    docs/google-cloud.md; their defaults: the compiled template's)."""
    from pipelines.persia_pipeline import persia_pipeline

    return list(inspect.signature(persia_pipeline.pipeline_func).parameters)


def _add_run(p: argparse.ArgumentParser) -> None:
    _add_target(p, root=True)
    p.add_argument("--template", default=DEFAULT_TEMPLATE, help="compiled pipeline YAML (Vertex AI target)")
    p.add_argument(
        "--param",
        action="append",
        metavar="NAME=VALUE",
        help="pipeline parameter (repeat): " + ", ".join(pipeline_parameter_names()),
    )
    p.add_argument("--service-account", default="", help="service account the run uses")
    p.add_argument("--network", default="", help="VPC network (projects/NUMBER/global/networks/NAME)")
    p.add_argument("--cache", dest="cache", action="store_true", default=None, help="enable step caching")
    p.add_argument("--no-cache", dest="cache", action="store_false", help="disable step caching")
    p.add_argument("--display-name", default="", help="run (or schedule) display name")
    p.add_argument("--label", action="append", metavar="KEY=VALUE", help="label (repeat)")
    d = p.add_argument_group("Dataflow (fills the beam_args parameter)")
    d.add_argument("--dataflow", action="store_true", help="run preprocess on Dataflow")
    d.add_argument("--dataflow-region", default="", help="Dataflow region (default --region)")
    d.add_argument("--dataflow-temp-location", default="", help="gs:// temp folder (default PIPELINE_ROOT/tmp)")
    d.add_argument("--dataflow-machine-type", default="n2-standard-4")
    d.add_argument("--dataflow-max-workers", type=int, default=10)
    d.add_argument("--dataflow-image", default="", help="SDK container image (the project image)")
    d.add_argument("--dataflow-service-account", default="")
    d.add_argument("--dataflow-subnetwork", default="")


def _run_params(args) -> dict[str, str]:
    params = parse_key_values(args.param, "--param")
    if args.dataflow:
        if "beam_args" in params:
            raise ValueError("give either --dataflow or --param beam_args=..., not both")
        params["beam_args"] = json.dumps(
            dataflow_beam_args(
                args.project,
                args.dataflow_region or args.region,
                args.dataflow_temp_location or args.pipeline_root.rstrip("/") + "/tmp",
                args.dataflow_machine_type,
                args.dataflow_max_workers,
                args.dataflow_image,
                service_account=args.dataflow_service_account,
                subnetwork=args.dataflow_subnetwork,
            )
        )
    return params


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.submit", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    _add_run(sub.add_parser("run", help="submit one run"))
    sched = sub.add_parser("schedule", help="recurring runs").add_subparsers(dest="action", required=True)
    c = sched.add_parser("create", help="create a schedule")
    _add_run(c)
    c.add_argument("--name", required=True, help="schedule display name")
    c.add_argument("--cron", required=True, help='five-field cron, e.g. "0 3 * * *"')
    c.add_argument("--time-zone", default="UTC", help="IANA time zone of the cron, e.g. Europe/Berlin")
    c.add_argument("--max-concurrent-runs", type=int, default=1, help="runs of this schedule at once")
    c.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    c.add_argument("--start-time", default="", help="RFC 3339 start (default: now)")
    c.add_argument("--end-time", default="", help="RFC 3339 end (default: never)")
    c.add_argument("--allow-queueing", action="store_true", help="queue a run when the limit is reached")
    ls = sched.add_parser("list", help="list schedules")
    _add_target(ls)
    ls.add_argument("--filter", default="", help='e.g. display_name="nightly"')
    for action in ("pause", "resume", "delete"):
        a = sched.add_parser(action, help=f"{action} a schedule")
        _add_target(a)
        a.add_argument("schedule", help="schedule ID or projects/P/locations/R/schedules/ID")
    r = sub.add_parser("register-model", help="upload the blessed model to the Vertex AI Model Registry")
    _add_target(r)
    r.add_argument(
        "--artifact-uri",
        required=True,
        help="gs:// (or /gcs/) Model folder, or a blessed-model location (blessed_dir: its latest blessed model)",
    )
    r.add_argument("--display-name", required=True)
    r.add_argument("--serving-image", required=True, help="container image recorded with the model")
    r.add_argument("--parent-model", default="", help="register as a new version of this model")
    r.add_argument("--alias", action="append", help="version alias, e.g. blessed (repeat)")
    r.add_argument("--label", action="append", metavar="KEY=VALUE")
    r.add_argument("--description", default="")
    d = sub.add_parser("deploy", help="deploy a registered model to an endpoint, all traffic moved to it")
    _add_target(d)
    d.add_argument("--model", required=True, help="projects/P/locations/R/models/ID[@VERSION] (register-model's)")
    d.add_argument("--endpoint", default="", help="endpoint resource name or ID (default: create one)")
    d.add_argument("--endpoint-display-name", default="", help="name of the endpoint created (default: the model's)")
    d.add_argument(
        "--machine-type",
        default="n2-standard-4",
        help="serving machine type, with at least twice the model's bytes of memory (default: n2-standard-4)",
    )
    d.add_argument("--min-replicas", type=int, default=1, help="serving replicas at least (default: 1)")
    d.add_argument("--max-replicas", type=int, default=1, help="serving replicas at most, autoscaled (default: 1)")
    d.add_argument("--service-account", default="", help="service account the serving container runs as")
    u = sub.add_parser("upload-template", help="upload the compiled YAML to a KFP / Artifact Registry host")
    u.add_argument("--host", required=True, help="https://REGION-kfp.pkg.dev/PROJECT/REPOSITORY")
    u.add_argument("--template", default=DEFAULT_TEMPLATE)
    u.add_argument("--tag", action="append", help="tag, e.g. v1 or latest (repeat)")
    u.add_argument("--description", default="")
    df = sub.add_parser("dataflow-args", help="print the beam_args JSON for Dataflow")
    _add_target(df)
    df.add_argument("--temp-location", required=True)
    df.add_argument("--machine-type", default="n2-standard-4")
    df.add_argument("--max-workers", type=int, default=10)
    df.add_argument("--sdk-container-image", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if args.command in ("run", "schedule"):
            target = Target(args.project, args.region, getattr(args, "pipeline_root", ""))
        elif args.command in ("register-model", "deploy", "dataflow-args"):
            target = Target(args.project, args.region)
        if args.command == "run":
            job = submit(
                args.template,
                target,
                _run_params(args),
                args.service_account,
                args.network,
                args.cache,
                args.display_name,
                parse_key_values(args.label, "--label"),
                from_text=True,
            )
            print(job.resource_name)
        elif args.command == "schedule" and args.action == "create":
            s = create_schedule(
                args.template,
                target,
                args.cron,
                args.time_zone,
                args.name,
                _run_params(args),
                args.max_concurrent_runs,
                args.max_runs,
                args.start_time,
                args.end_time,
                args.allow_queueing,
                args.service_account,
                args.network,
                args.cache,
                parse_key_values(args.label, "--label"),
                from_text=True,
            )
            print(s.resource_name)
        elif args.command == "schedule" and args.action == "list":
            for s in list_schedules(target, args.filter):
                print(f"{s.resource_name}\t{s.display_name}\t{s.state.name}\t{s.cron}")
        elif args.command == "schedule":
            {"pause": pause_schedule, "resume": resume_schedule, "delete": delete_schedule}[args.action](
                args.schedule, target
            )
            print(f"{args.action}d {args.schedule}")
        elif args.command == "register-model":
            m = upload_model(
                args.artifact_uri,
                args.display_name,
                target.project,
                target.region,
                args.serving_image,
                args.parent_model,
                args.alias,
                parse_key_values(args.label, "--label"),
                args.description,
            )
            print(m.versioned_resource_name)
        elif args.command == "deploy":
            ep = deploy_to_endpoint(
                args.model,
                target.project,
                target.region,
                args.endpoint,
                args.endpoint_display_name,
                args.machine_type,
                args.min_replicas,
                args.max_replicas,
                args.service_account,
            )
            print(ep.resource_name)
        elif args.command == "upload-template":
            name, version = upload_template(args.host, args.template, args.tag, args.description)
            print(f"{args.host.rstrip('/')}/{name}/{version}")
        elif args.command == "dataflow-args":
            print(
                json.dumps(
                    dataflow_beam_args(
                        args.project,
                        args.region,
                        args.temp_location,
                        args.machine_type,
                        args.max_workers,
                        args.sdk_container_image,
                    )
                )
            )
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    except Exception as e:  # no credentials, no permission, API errors: one line, not a traceback
        if type(e).__module__.startswith(("google.auth", "google.api_core")):
            print(
                f"pipelines.submit: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (for "
                "credentials: gcloud auth application-default login, or a service account)",
                file=sys.stderr,
            )
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
