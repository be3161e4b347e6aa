"""transformers' side of tests/chat.rs.

make TOKENIZER_JSON TEMPLATE BOS EOS OUT_DIR [--in-config]
    A tokenizer directory as transformers saves one: TOKENIZER_JSON with the
    chat templates' special tokens added, BOS and EOS, and TEMPLATE as its
    chat template (chat_template.jinja, or with --in-config a named
    "default" template in tokenizer_config.json).

check MODEL_DIR CONVERSATIONS FT_JSONL
    Checks `ft tokenize`'s lines against transformers: input_ids are
    apply_chat_template(messages, tokenize=True); labels are the ids where
    the assistant mask is 1, else -100 — the mask is
    return_assistant_tokens_mask's for a template with {% generation %},
    else each assistant message's characters between the render of the
    messages before it with the generation prompt and the render ending
    with it, mapped to tokens as transformers maps generation blocks.
    Conversations transformers cannot render must be the ones ft skipped.

loss MODEL_DIR FT_JSONL
    The model's mean next-token loss over ft's examples, on their labels
    (the assistant's tokens) and on every token, as two numbers.
"""

import json
import sys

from transformers import PreTrainedTokenizerFast, AutoTokenizer

SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]"]


def make(tokenizer_json, template, bos, eos, out, in_config=False):
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, bos_token=bos, eos_token=eos)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL if t not in (bos, eos)]})
    with open(template) as f:
        tokenizer.chat_template = f.read()
    tokenizer.save_pretrained(out)
    if in_config:
        import os
        os.remove(os.path.join(out, "chat_template.jinja"))
        path = os.path.join(out, "tokenizer_config.json")
        with open(path) as f:
            config = json.load(f)
        with open(template) as f:
            config["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"}, {"name": "default", "template": f.read()}]
        with open(path, "w") as f:
            json.dump(config, f)


def mark(encoding, mask, start, end):
    """transformers' generation-block rule: the token of the first character to that of the last."""
    first = encoding.char_to_token(start)
    last = encoding.char_to_token(end - 1)
    if first is None:
        return False
    for i in range(first, last + 1 if last else len(mask)):
        mask[i] = 1
    return True


def expected(tokenizer, messages):
    template = tokenizer.chat_template
    if "generation" in template and "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}"):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        mask = out["assistant_masks"]
    else:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        encoding = tokenizer(text, add_special_tokens=False)
        assert encoding["input_ids"] == out["input_ids"]
        mask = [0] * len(out["input_ids"])
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            assert text.startswith(through) and through.startswith(before), (before, through, text)
            if not mark(encoding, mask, len(before), len(through)):
                break
    ids = list(out["input_ids"])
    return ids, [t if m else -100 for t, m in zip(ids, mask)]


def check(model_dir, conversations, ft_jsonl):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = []
    for line in open(conversations):
        if not line.strip():
            continue
        messages = json.loads(line)["messages"]
        try:
            want.append(expected(tokenizer, messages))
        except Exception as error:  # the template refused it: ft must have skipped it
            print(f"transformers cannot render {messages}: {error}", file=sys.stderr)
    got = [json.loads(line) for line in open(ft_jsonl)]
    assert len(got) == len(want), f"ft wrote {len(got)} examples, transformers renders {len(want)}"
    for n, (g, (ids, labels)) in enumerate(zip(got, want)):
        assert g["input_ids"] == ids, f"example {n}: input_ids\nft:           {g['input_ids']}\ntransformers: {ids}\n{tokenizer.decode(ids)!r}"
        assert g["labels"] == labels, f"example {n}: labels\nft:           {g['labels']}\ntransformers: {labels}\n{tokenizer.decode(ids)!r}"
        assert any(l != -100 for l in labels), f"example {n}: no assistant token"
    print(f"{len(want)} examples equal")


def loss(model_dir, ft_jsonl):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sums, counts = {"labels": 0.0, "all": 0.0}, {"labels": 0, "all": 0}
    with torch.no_grad():
        for line in open(ft_jsonl):
            example = json.loads(line)
            ids = torch.tensor([example["input_ids"]])
            logits = model(ids).logits[0, :-1]
            for key, targets in [("labels", torch.tensor(example["labels"][1:])), ("all", ids[0, 1:])]:
                sums[key] += torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
                counts[key] += int((targets != -100).sum())
    print(sums["labels"] / counts["labels"], sums["all"] / counts["all"])


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(*sys.argv[2:7], in_config="--in-config" in sys.argv)
    elif sys.argv[1] == "loss":
        loss(*sys.argv[2:4])
    else:
        check(*sys.argv[2:5])
