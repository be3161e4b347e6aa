"""MLflow's side of tests/mlflow.rs: ft's runs as MLflow's own client reads
them.

TRACKING_URI
    Prints as JSON every run of the experiment "ft" at TRACKING_URI (a
    tracking server's URL or a file store's file:// URI): status, times,
    params, tags, metric names, artifacts, the summary artifact's contents,
    and the `loss` and `eval_loss` histories as [step, value].
"""
import argparse
import json
import os
import tempfile

import serve

# MLflow 3 reads a file store only when asked to (it prefers a database now).
os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
try:
    from mlflow import MlflowClient
except ModuleNotFoundError as error:
    raise SystemExit(f"{error}: these tests read ft's runs with MLflow's client: run scripts/setup.sh to install mlflow into .venv")


def runs(args):
    client = MlflowClient(tracking_uri=args.tracking_uri)
    experiment = client.get_experiment_by_name("ft")

    def history(run, key):
        return [[m.step, m.value] for m in client.get_metric_history(run.info.run_id, key)]

    def summary(run):
        if not any(a.path == "summary.json" for a in client.list_artifacts(run.info.run_id)):
            return None
        with tempfile.TemporaryDirectory() as out:
            with open(client.download_artifacts(run.info.run_id, "summary.json", out)) as f:
                return json.load(f)

    print(json.dumps([{
        "id": run.info.run_id, "status": run.info.status, "start": run.info.start_time, "end": run.info.end_time,
        "params": run.data.params, "tags": run.data.tags, "metrics": sorted(run.data.metrics),
        "artifacts": [a.path for a in client.list_artifacts(run.info.run_id)], "summary": summary(run),
        "loss": history(run, "loss"), "eval_loss": history(run, "eval_loss"),
    } for run in client.search_runs([experiment.experiment_id])]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tracking_uri", nargs="?")
    serve.main(parser, runs)
