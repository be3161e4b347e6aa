"""transformers' side of tests/export.rs: an exported directory as transformers uses it.

check JSON
    JSON is a list of {"export": EXPORT_DIR, "config": SOURCE_CONFIG} (and
    "conversations": CONVERSATIONS, "tokens": FT_JSONL), checked in one
    process (transformers takes long to import). For each: loads EXPORT_DIR with AutoTokenizer, AutoModelForCausalLM and
    GenerationConfig and checks that: the model's dtype is config.json's;
    generation_config's eos_token_id is SOURCE_CONFIG's (one id or a list, as
    it has it) and so are bos and pad; the tokenizer's eos_token is the token
    of the (first) eos id. With CONVERSATIONS: apply_chat_template on each
    conversation's messages gives FT_JSONL's input_ids (`ft tokenize` of the
    model the run started from, with the template it trained with).
    Prints what it checked.
"""

import json
import sys

import jinja2
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig


def check(export_dir, source_config, conversations=None, ft_jsonl=None):
    with open(source_config) as f:
        source = json.load(f)
    with open(f"{export_dir}/config.json") as f:
        written = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype="auto")
    assert str(model.dtype) == f"torch.{written['dtype']}", (model.dtype, written["dtype"])
    generation = GenerationConfig.from_pretrained(export_dir)
    for key in ["eos_token_id", "bos_token_id", "pad_token_id"]:
        assert getattr(generation, key) == source.get(key), f"{key}: generation_config {getattr(generation, key)}, the model's config {source.get(key)}"
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    eos = source["eos_token_id"]
    first_eos = eos[0] if isinstance(eos, list) else eos
    assert tokenizer.eos_token_id == first_eos, f"the tokenizer's eos_token {tokenizer.eos_token!r} is id {tokenizer.eos_token_id}, the config's {eos}"
    checked = f"eos {eos}, tokenizer eos_token {tokenizer.eos_token!r}, dtype {model.dtype}"
    if conversations:
        expected = [json.loads(line)["input_ids"] for line in open(ft_jsonl)]
        rendered = []
        for line in open(conversations):
            if line.strip():
                try:
                    rendered.append(tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True)["input_ids"])
                except jinja2.TemplateError:  # the template refuses it (raise_exception): ft skipped it too
                    pass
        assert [list(ids) for ids in rendered] == expected, f"apply_chat_template on the export:\n{rendered}\nft tokenize on the source:\n{expected}"
        checked += f", {len(rendered)} conversations through apply_chat_template"
    print(checked)


if __name__ == "__main__":
    for case in json.loads(sys.argv[2]):
        check(case["export"], case["config"], case.get("conversations"), case.get("tokens"))
