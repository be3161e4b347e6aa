"""Reference for ft's SQuAD scores (plugins/data/src/qa/squad_eval.rs).

Usage: python squad_eval_reference.py SQUAD_JSON WHEEL_DIR FT_EVAL_JSON

The official SQuAD v2.0 evaluation ships in transformers 4.x as
transformers/data/metrics/squad_metrics.py (5.x removed it). scripts/setup.sh
downloads transformers 4.46.3's wheel into .venv/reference (WHEEL_DIR); this
script takes the file from the wheel, drops the two package-relative imports
only its prediction-writing functions need, and scores each case of
FT_EVAL_JSON (written by plugins/data/tests/qa_reference.rs: predictions,
no-answer probabilities and ft's scores) with squad_evaluate. Exits 1 unless
every score equals ft's to 1e-9; also checks ft's v1.1 scores of the answerable
questions against the mean best compute_exact / compute_f1.
"""
import glob
import json
import os
import sys
import types
import zipfile

REFERENCE_VERSION = "4.46.3"
MODULE_PATH = "transformers/data/metrics/squad_metrics.py"
# The imports to drop and what replaces them: BasicTokenizer is only used by
# the prediction writers; logging only for their logger.
REPLACEMENTS = [
    ("from ...models.bert import BasicTokenizer\n", ""),
    ("from ...utils import logging\n", "import logging\n"),
    ("logger = logging.get_logger(__name__)\n", "logger = logging.getLogger(__name__)\n"),
]


def load_squad_metrics(wheel_dir):
    wheels = glob.glob(os.path.join(wheel_dir, f"transformers-{REFERENCE_VERSION}-*.whl"))
    if not wheels:
        sys.exit(
            f"no transformers-{REFERENCE_VERSION} wheel in {wheel_dir}: run scripts/setup.sh "
            "(it downloads the wheel with the official SQuAD v2.0 evaluation into .venv/reference)"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        source = wheel.read(MODULE_PATH).decode("utf-8")
    for old, new in REPLACEMENTS:
        if old not in source:
            sys.exit(f"{MODULE_PATH} in {wheels[0]} has no {old.strip()!r} line to replace")
        source = source.replace(old, new)
    module = types.ModuleType("squad_metrics")
    exec(compile(source, MODULE_PATH, "exec"), module.__dict__)
    return module


class Example:
    """What squad_evaluate reads of transformers' SquadExample."""

    def __init__(self, qa):
        self.qas_id = qa["id"]
        self.answers = [{"text": answer["text"]} for answer in qa["answers"]]


def load_examples(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)["data"]
    return [Example(qa) for article in data for paragraph in article["paragraphs"] for qa in paragraph["qas"]]


def main(squad_path, wheel_dir, ft_path):
    squad_metrics = load_squad_metrics(wheel_dir)
    examples = load_examples(squad_path)
    with open(ft_path, encoding="utf-8") as f:
        cases = json.load(f)
    differences = 0
    for case in cases:
        predictions = dict(case["predictions"])
        # In file order: find_best_thresh's stable sort breaks ties by it.
        na_probs = None if case["na_probs"] is None else dict(case["na_probs"])
        reference = squad_metrics.squad_evaluate(examples, predictions, na_probs, case["na_prob_thresh"])
        if na_probs is None:
            # evaluate-v2.0.py finds the best thresholds only from a na_prob file;
            # squad_evaluate always does (with probabilities 0.0).
            reference = {k: v for k, v in reference.items() if not k.startswith("best_")}
        ft_scores = case["v2"]
        if set(ft_scores) != set(reference):
            print(f"{case['name']}: ft gives {sorted(ft_scores)}, squad_metrics {sorted(reference)}")
            differences += 1
        for key, value in reference.items():
            if key in ft_scores and abs(ft_scores[key] - value) > 1e-9:
                print(f"{case['name']} {key}: ft {ft_scores[key]!r} != squad_metrics {value!r}")
                differences += 1

        answerable = [e for e in examples if e.answers]
        for name, metric in [("exact_match", squad_metrics.compute_exact), ("f1", squad_metrics.compute_f1)]:
            mean = 100.0 * sum(
                max(metric(a["text"], predictions[e.qas_id]) for a in e.answers) for e in answerable
            ) / len(answerable)
            if abs(case["v1"][name] - mean) > 1e-9:
                print(f"{case['name']} v1.1 {name}: ft {case['v1'][name]!r} != mean of squad_metrics' {mean!r}")
                differences += 1
        print(f"{case['name']}: {json.dumps(reference)}")
    if differences:
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
