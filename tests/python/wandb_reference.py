"""W&B's side of tests/wandb.rs: an offline run as W&B's own reader sees it.

REFERENCE_DIR RUN_DIR
    Prints as JSON the offline run under RUN_DIR/wandb, over every file it
    was written in (a run continued by a client started again is one file
    per start, in time order): the run record (id, project, name), the
    config, each history row, the summary's last values, the last exit code
    and the number of files. The files are scanned with wandb's DataStore,
    which wandb 0.2x reads only in its Go core: it comes out of the wandb
    0.19 wheel scripts/setup.sh keeps in REFERENCE_DIR, over the installed
    wandb's own protobuf records.
"""
import argparse
import glob
import json
import types
import zipfile

import serve
import wandb
from wandb.proto import wandb_internal_pb2 as pb

# DataStore checks it runs in wandb's internal process, which 0.2x no longer has.
wandb._assert_is_internal_process = lambda: None


def datastore(reference_dir):
    wheels = glob.glob(reference_dir + "/wandb-0.19.11-*.whl")
    assert len(wheels) == 1, f"no wandb 0.19.11 wheel in {reference_dir} (scripts/setup.sh keeps it there): {wheels}"
    [wheel] = wheels
    module = types.ModuleType("datastore")
    exec(compile(zipfile.ZipFile(wheel).read("wandb/sdk/internal/datastore.py"), "datastore.py", "exec"), module.__dict__)
    return module


def key(item):
    return item.key or "/".join(item.nested_key)


def read(args):
    store_module = datastore(args.reference_dir)
    run = {"history": [], "summary": {}, "config": {}, "files": 0}

    def records():
        for path in sorted(glob.glob(args.run_dir + "/wandb/offline-run-*/run-*.wandb")):
            run["files"] += 1
            store = store_module.DataStore()
            store.open_for_scan(path)
            while (data := store.scan_data()) is not None:
                yield data

    for data in records():
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name)
            run["config"].update({key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run["config"].update({key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run["history"].append({key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            run["summary"].update({key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    print(json.dumps(run))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference_dir", nargs="?")
    parser.add_argument("run_dir", nargs="?")
    serve.main(parser, read)
