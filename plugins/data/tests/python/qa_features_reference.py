"""Reference for ft's question-answering features (plugins/data/src/qa/features.rs).

Usage: python qa_features_reference.py TOKENIZER_JSON FT_FEATURES_JSON

FT_FEATURES_JSON (written by plugins/data/tests/qa_reference.rs) lists SQuAD
files and ft's features of their questions in several window settings. Builds
the same features the way transformers' examples/pytorch/question-answering/
run_qa.py does (prepare_train_features and prepare_validation_features,
transcribed below with pad_on_right = True, as for BERT; transformers is
Apache-2.0 licensed, as ft is), with transformers' fast tokenizer loaded from
ft's TOKENIZER_JSON, and exits 1 on any difference.
"""
import json
import os
import sys

from transformers import PreTrainedTokenizerFast


def load_squad(path):
    """The SQuAD file flattened into columns, as the datasets "squad_v2" loader does."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)["data"]
    columns = {"id": [], "question": [], "context": [], "answers": []}
    for article in data:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                columns["id"].append(qa["id"])
                columns["question"].append(qa["question"])
                columns["context"].append(paragraph["context"])
                columns["answers"].append(
                    {
                        "text": [answer["text"] for answer in qa["answers"]],
                        "answer_start": [answer["answer_start"] for answer in qa["answers"]],
                    }
                )
    return columns


def tokenize(tokenizer, examples, max_seq_length, doc_stride):
    # run_qa.py: "Some of the questions have lots of whitespace on the left".
    examples["question"] = [q.lstrip() for q in examples["question"]]
    return tokenizer(
        examples["question"],
        examples["context"],
        truncation="only_second",
        max_length=max_seq_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )


def prepare_train_features(tokenizer, examples, max_seq_length, doc_stride):
    """run_qa.py's prepare_train_features; the sample mapping is kept to compare it too."""
    tokenized_examples = tokenize(tokenizer, examples, max_seq_length, doc_stride)
    sample_mapping = tokenized_examples.pop("overflow_to_sample_mapping")
    offset_mapping = tokenized_examples.pop("offset_mapping")
    tokenized_examples["example_index"] = list(sample_mapping)
    tokenized_examples["start_positions"] = []
    tokenized_examples["end_positions"] = []

    for i, offsets in enumerate(offset_mapping):
        input_ids = tokenized_examples["input_ids"][i]
        if tokenizer.cls_token_id in input_ids:
            cls_index = input_ids.index(tokenizer.cls_token_id)
        elif tokenizer.bos_token_id in input_ids:
            cls_index = input_ids.index(tokenizer.bos_token_id)
        else:
            cls_index = 0

        sequence_ids = tokenized_examples.sequence_ids(i)
        sample_index = sample_mapping[i]
        answers = examples["answers"][sample_index]
        if len(answers["answer_start"]) == 0:
            tokenized_examples["start_positions"].append(cls_index)
            tokenized_examples["end_positions"].append(cls_index)
        else:
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])

            token_start_index = 0
            while sequence_ids[token_start_index] != 1:
                token_start_index += 1

            token_end_index = len(input_ids) - 1
            while sequence_ids[token_end_index] != 1:
                token_end_index -= 1

            if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
                tokenized_examples["start_positions"].append(cls_index)
                tokenized_examples["end_positions"].append(cls_index)
            else:
                while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
                    token_start_index += 1
                tokenized_examples["start_positions"].append(token_start_index - 1)
                while offsets[token_end_index][1] >= end_char:
                    token_end_index -= 1
                tokenized_examples["end_positions"].append(token_end_index + 1)

    return tokenized_examples


def prepare_validation_features(tokenizer, examples, max_seq_length, doc_stride):
    """run_qa.py's prepare_validation_features."""
    tokenized_examples = tokenize(tokenizer, examples, max_seq_length, doc_stride)
    sample_mapping = tokenized_examples.pop("overflow_to_sample_mapping")
    tokenized_examples["example_id"] = []

    for i in range(len(tokenized_examples["input_ids"])):
        sequence_ids = tokenized_examples.sequence_ids(i)
        context_index = 1
        sample_index = sample_mapping[i]
        tokenized_examples["example_id"].append(examples["id"][sample_index])
        tokenized_examples["offset_mapping"][i] = [
            (o if sequence_ids[k] == context_index else None)
            for k, o in enumerate(tokenized_examples["offset_mapping"][i])
        ]

    return tokenized_examples


def as_json(value):
    """Tuples as lists, as ft's JSON has them."""
    return json.loads(json.dumps(value))


def compare(label, ours, reference, columns):
    """Number of differences, the first few printed."""
    differences = 0
    for column in columns:
        mine, theirs = ours[column], as_json(list(reference[column]))
        if len(mine) != len(theirs):
            print(f"{label} {column}: ft has {len(mine)} windows, run_qa.py {len(theirs)}")
            differences += 1
            continue
        for window, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                differences += 1
                if differences <= 5:
                    print(f"{label} {column} window {window}: ft {a} != run_qa.py {b}")
    return differences


def compare_dataset(tokenizer, dataset):
    """Differences between ft's features of one SQuAD file and run_qa.py's."""
    squad_path = dataset["squad_file"]
    if dataset["example_ids"] != load_squad(squad_path)["id"]:
        print(f"{squad_path}: ft read other questions than the file's, or in another order")
        return 1
    window_columns = ["input_ids", "token_type_ids", "attention_mask"]
    differences = 0
    for setting in dataset["settings"]:
        max_seq_length, doc_stride = setting["max_seq_length"], setting["doc_stride"]
        label = f"{os.path.basename(squad_path)} {max_seq_length}/{doc_stride}"
        train = prepare_train_features(tokenizer, load_squad(squad_path), max_seq_length, doc_stride)
        differences += compare(
            f"{label} train",
            setting["train"],
            train,
            window_columns + ["example_index", "start_positions", "end_positions"],
        )
        validation = prepare_validation_features(tokenizer, load_squad(squad_path), max_seq_length, doc_stride)
        differences += compare(
            f"{label} validation", setting["validation"], validation, window_columns + ["example_id", "offset_mapping"]
        )
        labels = list(zip(train["start_positions"], train["end_positions"]))
        inside = sum(start != 0 for start, _ in labels)
        past = sum(start > end for start, end in labels)
        print(
            f"{label}: {len(dataset['example_ids'])} questions, {len(labels)} windows, {inside} with the answer "
            f"inside ({past} labelled past the context), {differences} differences"
        )
    return differences


def main(tokenizer_path, ft_path):
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=tokenizer_path,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
        # BertTokenizerFast's inputs: token_type_ids too.
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    assert tokenizer.is_fast, "transformers did not load ft's tokenizer.json as a fast tokenizer"
    assert tokenizer.padding_side == "right"
    with open(ft_path, encoding="utf-8") as f:
        datasets = json.load(f)
    if sum(compare_dataset(tokenizer, dataset) for dataset in datasets):
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
