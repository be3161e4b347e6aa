"""Reference for ft's answer extraction (plugins/data/src/qa/postprocess.rs).

Usage: python qa_postprocess_reference.py FT_POSTPROCESS_JSON LOGITS_F32

FT_POSTPROCESS_JSON (written by plugins/data/tests/qa_reference.rs) holds the
examples, ft's evaluation windows (example id and offset mapping of each) and
ft's predictions for several settings; LOGITS_F32 the windows' start logits then
end logits, little-endian float32, max_seq_length per window. Runs
postprocess_qa_predictions, transcribed below from transformers'
examples/pytorch/question-answering/utils_qa.py (without its progress bar,
logging and files; transformers is Apache-2.0 licensed, as ft is), on the
same inputs and exits 1 unless the predictions, the
null odds and the n-best lists are the same.
"""
import collections
import json
import sys

import numpy as np


def postprocess_qa_predictions(
    examples,
    features,
    predictions,
    version_2_with_negative=False,
    n_best_size=20,
    max_answer_length=30,
    null_score_diff_threshold=0.0,
):
    """utils_qa.py's function; `examples` and `features` are lists of row dicts."""
    assert len(predictions) == 2, "`predictions` should be a tuple with two elements (start_logits, end_logits)."
    all_start_logits, all_end_logits = predictions

    assert len(predictions[0]) == len(features), f"Got {len(predictions[0])} predictions and {len(features)} features."

    example_id_to_index = {k: i for i, k in enumerate(example["id"] for example in examples)}
    features_per_example = collections.defaultdict(list)
    for i, feature in enumerate(features):
        features_per_example[example_id_to_index[feature["example_id"]]].append(i)

    all_predictions = collections.OrderedDict()
    all_nbest_json = collections.OrderedDict()
    if version_2_with_negative:
        scores_diff_json = collections.OrderedDict()

    for example_index, example in enumerate(examples):
        feature_indices = features_per_example[example_index]

        min_null_prediction = None
        prelim_predictions = []

        for feature_index in feature_indices:
            start_logits = all_start_logits[feature_index]
            end_logits = all_end_logits[feature_index]
            offset_mapping = features[feature_index]["offset_mapping"]
            token_is_max_context = features[feature_index].get("token_is_max_context", None)

            feature_null_score = start_logits[0] + end_logits[0]
            if min_null_prediction is None or min_null_prediction["score"] > feature_null_score:
                min_null_prediction = {
                    "offsets": (0, 0),
                    "score": feature_null_score,
                    "start_logit": start_logits[0],
                    "end_logit": end_logits[0],
                }

            start_indexes = np.argsort(start_logits)[-1 : -n_best_size - 1 : -1].tolist()
            end_indexes = np.argsort(end_logits)[-1 : -n_best_size - 1 : -1].tolist()
            for start_index in start_indexes:
                for end_index in end_indexes:
                    if (
                        start_index >= len(offset_mapping)
                        or end_index >= len(offset_mapping)
                        or offset_mapping[start_index] is None
                        or offset_mapping[end_index] is None
                    ):
                        continue
                    if end_index < start_index or end_index - start_index + 1 > max_answer_length:
                        continue
                    if token_is_max_context is not None and not token_is_max_context.get(str(start_index), False):
                        continue
                    prelim_predictions.append(
                        {
                            "offsets": (offset_mapping[start_index][0], offset_mapping[end_index][1]),
                            "score": start_logits[start_index] + end_logits[end_index],
                            "start_logit": start_logits[start_index],
                            "end_logit": end_logits[end_index],
                        }
                    )
        if version_2_with_negative:
            prelim_predictions.append(min_null_prediction)
            null_score = min_null_prediction["score"]

        predictions = sorted(prelim_predictions, key=lambda x: x["score"], reverse=True)[:n_best_size]

        if version_2_with_negative and not any(p["offsets"] == (0, 0) for p in predictions):
            predictions.append(min_null_prediction)

        context = example["context"]
        for pred in predictions:
            offsets = pred.pop("offsets")
            pred["text"] = context[offsets[0] : offsets[1]]

        if len(predictions) == 0 or (len(predictions) == 1 and predictions[0]["text"] == ""):
            predictions.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0})

        scores = np.array([pred.pop("score") for pred in predictions])
        exp_scores = np.exp(scores - np.max(scores))
        probs = exp_scores / exp_scores.sum()

        for prob, pred in zip(probs, predictions):
            pred["probability"] = prob

        if not version_2_with_negative:
            all_predictions[example["id"]] = predictions[0]["text"]
        else:
            i = 0
            while predictions[i]["text"] == "":
                i += 1
            best_non_null_pred = predictions[i]

            score_diff = null_score - best_non_null_pred["start_logit"] - best_non_null_pred["end_logit"]
            scores_diff_json[example["id"]] = float(score_diff)
            if score_diff > null_score_diff_threshold:
                all_predictions[example["id"]] = ""
            else:
                all_predictions[example["id"]] = best_non_null_pred["text"]

        all_nbest_json[example["id"]] = [
            {k: (float(v) if isinstance(v, (np.float16, np.float32, np.float64)) else v) for k, v in pred.items()}
            for pred in predictions
        ]

    return all_predictions, all_nbest_json, (scores_diff_json if version_2_with_negative else None)


def relative_difference(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def compare_run(run, reference):
    """Differences between ft's run and the reference's, the first few printed."""
    predictions, nbest, null_odds = reference
    label = f"v2={run['version_2_with_negative']} threshold={run['null_score_diff_threshold']}"
    problems = []
    ft_predictions = dict(run["predictions"])
    if [id for id, _ in run["predictions"]] != list(predictions):
        problems.append("ft predicts other questions, or in another order")
    problems += [
        f"{id}: ft {ft_predictions.get(id)!r} != utils_qa.py {text!r}"
        for id, text in predictions.items()
        if ft_predictions.get(id) != text
    ]
    if null_odds is None:
        if run["null_odds"]:
            problems.append("ft gives null odds in v1")
    else:
        if [id for id, _ in run["null_odds"]] != list(null_odds):
            problems.append("ft's null odds are for other questions, or in another order")
        problems += [
            f"{id}: null odds ft {diff!r} != utils_qa.py {null_odds[id]!r}"
            for id, diff in run["null_odds"]
            if id in null_odds and relative_difference(diff, null_odds[id]) > 1e-6
        ]
        exact = sum(diff == null_odds.get(id) for id, diff in run["null_odds"])
        print(f"{label}: {exact} of {len(null_odds)} null odds bit for bit equal")
    for id, ft_list in run["nbest"]:
        reference_list = nbest.get(id, [])
        same = len(ft_list) == len(reference_list) and all(
            a["text"] == b["text"]
            and np.float32(a["start_logit"]) == np.float32(b["start_logit"])
            and np.float32(a["end_logit"]) == np.float32(b["end_logit"])
            and relative_difference(a["probability"], b["probability"]) < 1e-5
            for a, b in zip(ft_list, reference_list)
        )
        if not same:
            problems.append(f"{id}: n-best ft {ft_list} != utils_qa.py {reference_list}")
    for problem in problems[:5]:
        print(f"{label}: {problem}")
    empty = sum(text == "" for text in predictions.values())
    fake = sum(text == "empty" for text in predictions.values())
    print(f"{label}: {len(predictions)} predictions ({empty} null, {fake} 'empty'), {len(problems)} differences")
    return len(problems)


def main(ft_path, logits_path):
    with open(ft_path, encoding="utf-8") as f:
        ft = json.load(f)
    windows = len(ft["features"])
    logits = np.fromfile(logits_path, dtype="<f4").reshape(2, windows, ft["max_seq_length"])
    # Offsets as tuples, as the tokenizer gives them (the null answer is compared to (0, 0)).
    features = [
        {"example_id": f["example_id"], "offset_mapping": [None if o is None else tuple(o) for o in f["offset_mapping"]]}
        for f in ft["features"]
    ]
    differences = 0
    for run in ft["runs"]:
        reference = postprocess_qa_predictions(
            ft["examples"],
            features,
            (logits[0], logits[1]),
            version_2_with_negative=run["version_2_with_negative"],
            n_best_size=run["n_best_size"],
            max_answer_length=run["max_answer_length"],
            null_score_diff_threshold=run["null_score_diff_threshold"],
        )
        differences += compare_run(run, reference)
    if differences:
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
