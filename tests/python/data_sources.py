"""Data as users get it from the Hugging Face Hub, written by `datasets` (and
pyarrow) for tests/data_sources.rs:

  data_sources.py write ROWS.jsonl OUT
      the rows of ROWS.jsonl as `datasets` writes them: OUT/rows.parquet
      (Dataset.to_parquet), OUT/saved (save_to_disk, two Arrow shards),
      OUT/dict (a DatasetDict of `train` and a two-row `test`, saved),
      OUT/hub/data/{train-0000k-of-00002,test-00000-of-00001}.parquet (the
      Hub's layout) and OUT/rows.json (a JSON array of the rows)
  data_sources.py big OUT.parquet N
      N prompt/completion rows of about 1 kB, to_parquet in row groups of
      10,000; prints the bytes of their text
  data_sources.py peak COMMAND…
      runs COMMAND and prints its peak resident memory in KiB (its
      ru_maxrss: this process has no other child) after its own output
  data_sources.py --serve
      write and big jobs from stdin, one process for a whole test binary
      (serve.py); peak stays a process of its own, whose only child is COMMAND
"""

import json
import os
import resource
import subprocess
import sys
import tempfile

import serve


def write(rows_path, out):
    from datasets import Dataset, DatasetDict

    with open(rows_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    dataset = Dataset.from_list(rows)
    dataset.to_parquet(os.path.join(out, "rows.parquet"))
    dataset.save_to_disk(os.path.join(out, "saved"), num_shards=2)
    test = dataset.select(range(2))
    DatasetDict({"train": dataset, "test": test}).save_to_disk(os.path.join(out, "dict"))
    hub = os.path.join(out, "hub", "data")
    os.makedirs(hub)
    half = len(rows) // 2
    dataset.select(range(half)).to_parquet(os.path.join(hub, "train-00000-of-00002.parquet"))
    dataset.select(range(half, len(rows))).to_parquet(os.path.join(hub, "train-00001-of-00002.parquet"))
    test.to_parquet(os.path.join(hub, "test-00000-of-00001.parquet"))
    with open(os.path.join(out, "rows.json"), "w") as f:
        json.dump(rows, f)


def big(out, n):
    from datasets import Dataset

    prompts = [f"Question {i}: what is {i} plus {i}, written out in words and in digits? " * 12 for i in range(n)]
    completions = [f" It is {2 * i}, twice {i}." for i in range(n)]
    Dataset.from_dict({"prompt": prompts, "completion": completions}).to_parquet(out, batch_size=10_000)
    print(sum(len(p) + len(c) for p, c in zip(prompts, completions)))


def peak(command):
    result = subprocess.run(command)
    sys.stdout.flush()
    print(f"\npeak_kib {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}")
    sys.exit(result.returncode)


def run(args):
    match args:
        case ["write", rows, out]:
            write(rows, out)
        case ["big", out, n]:
            big(out, int(n))
        case _:
            sys.exit(__doc__)


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["peak", *command]:
            peak(command)
        case ["--serve"]:
            # `datasets` reads HF_HOME when first imported: a cache of the process's own (these jobs write none), not the user's.
            with tempfile.TemporaryDirectory() as cache:
                os.environ["HF_HOME"] = cache
                serve.serve(run)
        case args:
            run(args)
