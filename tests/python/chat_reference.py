"""transformers' side of tests/chat.rs and tests/templates.rs.

make TOKENIZER_JSON TEMPLATE BOS EOS OUT_DIR [--in-config]
    A tokenizer directory as transformers saves one: TOKENIZER_JSON with the
    chat templates' special tokens added, BOS and EOS, and TEMPLATE as its
    chat template (chat_template.jinja, or with --in-config a named
    "default" template in tokenizer_config.json).

check MODEL_DIR ROWS FT_JSONL [--all]
    Checks `ft tokenize`'s lines against the peers' own formatting of each
    row, by its keys:
    - `messages` (and `tools`): input_ids are transformers'
      apply_chat_template(messages, tools=tools, tokenize=True); labels are
      the ids where the assistant mask is 1, else -100 — the mask is
      return_assistant_tokens_mask's for a template with {% generation %},
      else each assistant message's characters between the render of the
      messages before it with the generation prompt and the render ending
      with it, mapped to tokens as transformers maps generation blocks;
      where those renders are not prefixes of the whole one, the message's
      content found around a sentinel and the end of its turn (the leading
      tokens that the render ending with it writes after its content and
      the whole render writes there too).
    - `conversations` (ShareGPT): the turns mapped to messages as axolotl
      maps them (ChatTemplatePrompter's default roles), then as `messages`.
    - `prompt` and `completion` as message lists: TRL's SFTTrainer
      (trl/trainer/sft_trainer.py, tokenize_fn): the ids of prompt +
      completion, the loss after as many tokens as the prompt rendered with
      add_generation_prompt=True has.
    - `instruction`, `input`, `output` (Alpaca): axolotl's AlpacaPrompter
      and InstructionPromptTokenizingStrategy: the Stanford Alpaca prompt
      tokenised with the tokenizer's special tokens, then the output's
      tokens without a BOS and the EOS, the loss on the latter.
    Rows transformers cannot render must be the ones ft skipped; with --all
    there must be none.

loss MODEL_DIR FT_JSONL
    The model's mean next-token loss over ft's examples, on their labels
    (the assistant's tokens) and on every token, as two numbers.

export JSON
    JSON is a list of {"export": EXPORT_DIR, "config": SOURCE_CONFIG} (and
    "conversations": CONVERSATIONS, "tokens": FT_JSONL). For each: loads
    EXPORT_DIR with AutoTokenizer, AutoModelForCausalLM and
    GenerationConfig and checks that: the model's dtype is config.json's;
    generation_config's eos_token_id is SOURCE_CONFIG's (one id or a list, as
    it has it) and so are bos and pad; the tokenizer's eos_token is the token
    of the (first) eos id. With CONVERSATIONS: apply_chat_template on each
    conversation's messages gives FT_JSONL's input_ids (`ft tokenize` of the
    model the run started from, with the template it trained with).
    Prints what it checked.

batch COMMANDS_JSON
    The commands of a JSON list (each a list of the arguments above) in one
    process.

--serve
    Jobs from stdin, one process for a whole test binary (serve.py).
"""

import json
import sys

from transformers import PreTrainedTokenizerFast, AutoTokenizer

import serve

# The special tokens the templates of tests/fixtures/chat and tests/fixtures/templates write.
SPECIAL = [
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
    "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
    "<|tool|>", "<|/tool|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<|start_of_role|>",
    "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
    "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
]
# An assistant message's content while its place in a render is looked for (ft's chat.rs uses the same).
SENTINEL = "\U000F0003"
# axolotl's default ShareGPT speakers (src/axolotl/prompt_strategies/chat_template.py, ChatTemplatePrompter.roles).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system", "tool": "tool"}
# axolotl's AlpacaPrompter (src/axolotl/prompters.py), the Stanford Alpaca prompt.
ALPACA_SYSTEM = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request."
ALPACA_SYSTEM_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
ALPACA_TURN = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_TURN_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


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


def plain(messages):
    """The messages as apply_chat_template renders them: keys whose value is None dropped."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def render(tokenizer, messages, tools, add_generation_prompt=False):
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages, tools, text):
    """Each assistant message's characters in `text` (see `check` above)."""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], tools, True) if i else ""
        through = render(tokenizer, messages[: i + 1], tools)
        if through.startswith(before) and text.startswith(through):
            yield len(before), len(through)
            continue
        marked = messages[:i] + [{**message, "content": SENTINEL}] + messages[i + 1 :]
        whole, own = render(tokenizer, marked, tools), render(tokenizer, marked[: i + 1], tools)
        assert whole.count(SENTINEL) == 1 and own.count(SENTINEL) == 1, (whole, own)
        head, tail = whole.split(SENTINEL)
        own_tail = own.split(SENTINEL)[1]
        assert text.startswith(head) and text.endswith(tail) and len(head) + len(tail) <= len(text), (head, tail, text)
        mine = tokenizer(own_tail, add_special_tokens=False, return_offsets_mapping=True)
        theirs = tokenizer(tail, add_special_tokens=False)["input_ids"]
        shared = 0
        while shared < min(len(mine["input_ids"]), len(theirs)) and mine["input_ids"][shared] == theirs[shared]:
            shared += 1
        yield len(head), len(text) - len(tail) + (mine["offset_mapping"][shared - 1][1] if shared else 0)


def conversation(tokenizer, messages, tools):
    messages = plain(messages)
    template = tokenizer.chat_template
    if "generation" in template and "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}"):
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        mask = out["assistant_masks"]
    else:
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
        text = render(tokenizer, messages, tools)
        encoding = tokenizer(text, add_special_tokens=False)
        assert encoding["input_ids"] == out["input_ids"]
        mask = [0] * len(out["input_ids"])
        for start, end in assistant_spans(tokenizer, messages, tools, text):
            if not mark(encoding, mask, start, end):
                break
    ids = list(out["input_ids"])
    return ids, [t if m else -100 for t, m in zip(ids, mask)]


def prompt_completion(tokenizer, prompt, completion):
    """Tokenised apart: the prompt with the tokenizer's special tokens, the completion without a BOS, then the EOS
    unless it ends with it (TRL's add_eos, axolotl's _tokenize)."""
    p = tokenizer(prompt)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if not c or c[-1] != tokenizer.eos_token_id:
        c.append(tokenizer.eos_token_id)
    return p + c, [-100] * len(p) + c


def expected(tokenizer, row):
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    if "messages" in row:
        return conversation(tokenizer, row["messages"], tools)
    if "conversations" in row:
        messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"], **{k: v for k, v in t.items() if k not in ("from", "value")}} for t in row["conversations"]]
        return conversation(tokenizer, messages, tools)
    if "prompt" in row and isinstance(row["prompt"], list):
        prompt_ids = tokenizer.apply_chat_template(plain(row["prompt"]), tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        ids = tokenizer.apply_chat_template(plain(row["prompt"] + row["completion"]), tools=tools, tokenize=True, return_dict=True)["input_ids"]
        ids = list(ids)
        return ids, [-100] * len(prompt_ids) + ids[len(prompt_ids) :]
    if "prompt" in row:
        return prompt_completion(tokenizer, row["prompt"], row["completion"])
    if row.get("input"):
        prompt = ALPACA_SYSTEM + "\n\n" + ALPACA_TURN.format(instruction=row["instruction"], input=row["input"])
    else:
        prompt = ALPACA_SYSTEM_NO_INPUT + "\n\n" + ALPACA_TURN_NO_INPUT.format(instruction=row["instruction"])
    return prompt_completion(tokenizer, prompt, row["output"])


def check(model_dir, rows, ft_jsonl, every=False):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = []
    for line in open(rows):
        if not line.strip():
            continue
        row = json.loads(line)
        try:
            want.append(expected(tokenizer, row))
        except AssertionError:  # the rule for the assistant's tokens, not the template, failed
            raise
        except Exception as error:  # the template refused it: ft must have skipped it
            assert not every, f"transformers cannot render {row}: {error!r}"
            print(f"transformers cannot render {row}: {error}", file=sys.stderr)
    got = [json.loads(line) for line in open(ft_jsonl)]
    assert len(got) == len(want), f"ft wrote {len(got)} examples, transformers renders {len(want)}"
    for n, (g, (ids, labels)) in enumerate(zip(got, want)):
        assert g["input_ids"] == ids, f"example {n}: input_ids\nft:           {g['input_ids']}\ntransformers: {ids}\n{tokenizer.decode(ids)!r}"
        assert g["labels"] == labels, f"example {n}: labels\nft:           {g['labels']}\ntransformers: {labels}\n{tokenizer.decode(ids)!r}"
        assert any(l != -100 for l in labels), f"example {n}: no trained token"
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


def export(export_dir, source_config, conversations=None, ft_jsonl=None):
    import jinja2
    from transformers import AutoModelForCausalLM, GenerationConfig

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


def run(args):
    if args[0] == "make":
        make(*args[1:6], in_config="--in-config" in args)
    elif args[0] == "loss":
        loss(*args[1:3])
    elif args[0] == "export":
        for case in json.loads(args[1]):
            export(case["export"], case["config"], case.get("conversations"), case.get("tokens"))
    elif args[0] == "batch":  # one command's arguments per line of a JSON list, in one process (transformers loads once)
        for command in json.load(open(args[1])):
            print(" ".join(command[:2]), end=": ")
            run(command)
    else:
        check(*args[1:4], every="--all" in args)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve.serve(run)
    else:
        run(sys.argv[1:])
