//! Chat and prompt/completion data against transformers: `ft tokenize`'s
//! token ids and labels for four real-style chat templates
//! (tests/fixtures/chat: Llama 3's headers and strftime_now, ChatML/Qwen2's
//! namespace, string methods and tojson, Mistral's [INST] with
//! raise_exception, ChatML with {% generation %} blocks) and for a corpus of
//! published ones (tests/fixtures/templates, SOURCES.md says where each came
//! from; plain conversations and tool calls) equal `apply_chat_template`
//! (with `tools`) and its assistant mask; ShareGPT, Alpaca and TRL's
//! conversational prompt/completion rows equal axolotl's and TRL's
//! formatting (tests/python/chat_reference.py), with the GPT-2 tokenizer in
//! ../shared and the templates' special tokens added; bad lines are errors
//! naming the line; a tiny Llama trains on a conversation file with its
//! loss falling, and `ft eval`'s loss over it equals transformers' with the
//! same labels — so masked tokens carry none.

use crate::common;

use common::{ft, shared, text};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat").join(name)
}

/// What chat_reference.py prints for `args`, run in the binary's one process of it.
fn python(args: &[&str]) -> String {
    common::reference_job("chat_reference.py", &args.iter().map(std::ffi::OsStr::new).collect::<Vec<_>>())
}

/// chat_reference.py's `batch` of `commands` (each one's arguments), in one
/// process: transformers loads once. Its standard output.
fn python_batch(dir: &Path, commands: &[Vec<String>]) -> String {
    let file = dir.join("commands.json");
    std::fs::write(&file, serde_json::to_string(commands).unwrap()).unwrap();
    python(&["batch", file.to_str().unwrap()])
}

fn string(path: &Path) -> String {
    path.to_str().unwrap().to_string()
}

/// A tokenizer directory (as transformers saves it) for `template`
/// (tests/fixtures/chat/TEMPLATE.jinja) with its BOS and EOS: GPT-2's from
/// the shared data (the test checks it is there).
fn tokenizer_dir(dir: &Path, template: &str, bos: &str, eos: &str, in_config: bool) {
    tokenizer_dir_for(dir, &fixture(&format!("{template}.jinja")), bos, eos, in_config)
}

/// [`tokenizer_dir`] for the template file `template`.
fn tokenizer_dir_for(dir: &Path, template: &Path, bos: &str, eos: &str, in_config: bool) {
    let gpt2 = shared::path(shared::GPT2_TOKENIZER);
    let mut args = vec!["make", gpt2.to_str().unwrap(), template.to_str().unwrap(), bos, eos, dir.to_str().unwrap()];
    if in_config {
        args.push("--in-config");
    }
    python(&args);
}

fn tokenize(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    ft().args(["tokenize", "--model", model.to_str().unwrap(), "--train-file", data.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn chat_templates_tokenize_as_transformers_applies_them() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let conversations = fixture("conversations.jsonl");
    let cases = [
        ("llama3", "<|begin_of_text|>", "<|eot_id|>", false),
        ("chatml", "<|endoftext|>", "<|im_end|>", true),
        ("mistral", "<s>", "</s>", false),
        ("generation", "<|endoftext|>", "<|im_end|>", false),
    ];
    let dir = tempfile::tempdir().unwrap();
    let model = |template: &str| dir.path().join(template);
    // transformers loads once to make every tokenizer directory, and once to check every output.
    let makes = cases.iter().map(|(template, bos, eos, in_config)| {
        let mut make = ["make", &string(&shared::path(shared::GPT2_TOKENIZER)), &string(&fixture(&format!("{template}.jinja"))), bos, eos, &string(&model(template))].map(String::from).to_vec();
        if *in_config {
            make.push("--in-config".into());
        }
        make
    });
    python_batch(dir.path(), &makes.collect::<Vec<_>>());
    let mut checks = vec![];
    for (template, _, _, in_config) in cases {
        let out = model(template).join("tokens.jsonl");
        let output = tokenize(&model(template), &conversations, &out, &[]);
        assert!(output.status.success(), "{template}: {}", text(&output));
        checks.push(["check", &string(&model(template)), &string(&conversations), &string(&out)].map(String::from).to_vec());
        if in_config {
            // Rows with tools get the template named `tool_use` beside `default`, as transformers picks it (this one refuses every row).
            let tools = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates/tools.jsonl");
            let output = tokenize(&model(template), &tools, &model(template).join("tools-tokens.jsonl"), &[]);
            assert!(!output.status.success() && text(&output).contains("not this one") && text(&output).contains("no example left"), "{}", text(&output));
        }
        if template == "mistral" {
            let log = text(&output);
            assert!(log.contains("Conversation roles must alternate") && log.contains("3 skipped as the chat template cannot render them"), "{log}");
        }
    }
    let checked = python_batch(dir.path(), &checks);
    eprintln!("{checked}");
    assert_eq!(checked.matches("examples equal").count(), checks.len(), "{checked}");
}

#[test]
fn chat_template_flag_overrides_and_long_conversations_are_skipped_or_cut() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokenizer_dir(dir.path(), "generation", "<|endoftext|>", "<|im_end|>", false);
    let conversations = fixture("conversations.jsonl");
    let out = dir.path().join("tokens.jsonl");
    // --chat-template wins over the directory's chat_template.jinja: Mistral's refuses three conversations.
    let output = tokenize(dir.path(), &conversations, &out, &["--chat-template", fixture("mistral.jinja").to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 3);

    let full: Vec<serde_json::Value> = {
        assert!(tokenize(dir.path(), &conversations, &out, &[]).status.success());
        std::fs::read_to_string(&out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let lengths: Vec<usize> = full.iter().map(|e| e["input_ids"].as_array().unwrap().len()).collect();
    let limit = 30;
    let output = tokenize(dir.path(), &conversations, &out, &["--max-seq-len", &limit.to_string()]);
    assert!(output.status.success(), "{}", text(&output));
    let kept = lengths.iter().filter(|&&n| n <= limit).count();
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), kept);
    assert!(text(&output).contains(&format!("{} longer than max_seq_len {limit} skipped", lengths.len() - kept)), "{}", text(&output));

    let output = tokenize(dir.path(), &conversations, &out, &["--max-seq-len", &limit.to_string(), "--set", "data.truncate=true"]);
    assert!(output.status.success(), "{}", text(&output));
    let cut: Vec<serde_json::Value> = std::fs::read_to_string(&out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(cut.len(), full.len());
    for (cut, full) in cut.iter().zip(&full) {
        let n = cut["input_ids"].as_array().unwrap().len();
        assert_eq!(n, full["input_ids"].as_array().unwrap().len().min(limit));
        assert_eq!(cut["labels"].as_array().unwrap()[..], full["labels"].as_array().unwrap()[..n]);
    }

    // train_on=all: every token is a label.
    assert!(tokenize(dir.path(), &conversations, &out, &["--set", "data.train_on=all"]).status.success());
    for (line, full) in std::fs::read_to_string(&out).unwrap().lines().zip(&full) {
        let example: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(example["labels"], full["input_ids"]);
    }
}

#[test]
fn prompt_completion_puts_the_loss_on_the_completion() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokenizer_dir(dir.path(), "generation", "<|endoftext|>", "<|im_end|>", false);
    let data = dir.path().join("pc.jsonl");
    std::fs::write(&data, "{\"prompt\": \"The sky is\", \"completion\": \" blue.\"}\n\n{\"prompt\": \"2 + 2 =\", \"completion\": \" 4\"}\n").unwrap();
    let out = dir.path().join("tokens.jsonl");
    let output = tokenize(dir.path(), &data, &out, &[]);
    assert!(output.status.success(), "{}", text(&output));
    // transformers' tokenizer for the expected ids (chat_reference.py's `check`): the prompt, the completion, its
    // eos_token (here <|im_end|>; GPT-2 adds no BOS), labels on the completion alone.
    let checked = python(&["check", dir.path().to_str().unwrap(), data.to_str().unwrap(), out.to_str().unwrap()]);
    assert!(checked.contains("2 examples equal"), "{checked}");
}

#[test]
fn bad_lines_are_errors_naming_the_file_and_line_and_nothing_is_written() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokenizer_dir(dir.path(), "chatml", "<|endoftext|>", "<|im_end|>", false);
    let good = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"}]}";
    let cases = [
        ("not json", "line 2: not valid JSON"),
        ("{\"messages\": []}", "line 2: an empty conversation"),
        ("{\"messages\": [{\"content\": \"x\"}]}", "line 2: message 1 has no string \"role\""),
        ("{\"messages\": [{\"role\": \"user\"}]}", "line 2: message 1 has no \"content\""),
        ("{\"messages\": \"hi\"}", "line 2: \"messages\" is not a list"),
        // ShareGPT's speaker where a role belongs is refused, not rendered as a role of its own and never trained on.
        ("{\"messages\": [{\"role\": \"gpt\", \"content\": \"x\"}]}", "line 2: message 1 has role \"gpt\", which no chat template knows"),
        ("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [\"get_weather\"]}", "line 2: \"tools\" is not a list of objects"),
    ];
    let out = dir.path().join("tokens.jsonl");
    for (bad, expected) in cases {
        let data = dir.path().join("chat.jsonl");
        std::fs::write(&data, format!("{good}\n{bad}\n")).unwrap();
        let output = tokenize(dir.path(), &data, &out, &[]);
        assert!(!output.status.success());
        assert!(text(&output).contains(&format!("chat.jsonl {expected}")), "{bad}: {}", text(&output));
        assert!(!out.exists() && std::fs::read_dir(dir.path()).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().ends_with(".tmp")));
    }
    let data = dir.path().join("other.jsonl");
    std::fs::write(&data, "{\"question\": \"x\"}\n").unwrap();
    let output = tokenize(dir.path(), &data, &out, &[]);
    assert!(text(&output).contains("other.jsonl line 1: neither"), "{}", text(&output));
    std::fs::write(&data, "{\"prompt\": \"x\", \"completion\": \"y\"}\n{\"prompt\": \"x\"}\n").unwrap();
    let output = tokenize(dir.path(), &data, &out, &[]);
    assert!(text(&output).contains("other.jsonl line 2: no string \"completion\""), "{}", text(&output));
    // A directory with no chat template says where it looked.
    std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
    std::fs::write(dir.path().join("chat.jsonl"), format!("{good}\n")).unwrap();
    let output = tokenize(dir.path(), &dir.path().join("chat.jsonl"), &out, &[]);
    assert!(text(&output).contains("no chat template") && text(&output).contains("--chat-template"), "{}", text(&output));
    let output = ft().args(["tokenize", "--train-file", "chat.jsonl", "--out", out.to_str().unwrap()]).output().unwrap();
    assert!(!output.status.success() && text(&output).contains("--model DIR"), "{}", text(&output));
}

/// A random tiny Llama in `dir`/model with GPT-2's 50,257 tokens and the
/// Llama 3 template (dated: `common::dated_llama3_template`), `positions` long.
fn tiny_llama(dir: &Path, positions: usize) -> PathBuf {
    let model = dir.join("model");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/config.json");
    let output = ft()
        .args(["init-model", "--config", config.to_str().unwrap(), "--out", model.to_str().unwrap()])
        .args(["--set", "vocab_size=50304", "--set", &format!("max_position_embeddings={positions}")])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    tokenizer_dir_for(&model, &common::dated_llama3_template(dir), "<|begin_of_text|>", "<|eot_id|>", false);
    model
}

#[test]
fn a_tiny_llama_trains_on_conversations_with_the_loss_only_on_the_assistant() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_llama(dir.path(), 256);
    let conversations = fixture("conversations.jsonl");

    // The untrained model's evaluation loss equals transformers' mean over the assistant's tokens only.
    let tokens = dir.path().join("tokens.jsonl");
    assert!(tokenize(&model, &conversations, &tokens, &[]).status.success());
    let output = ft()
        .args(["eval", "--model", model.to_str().unwrap(), "--eval-file", conversations.to_str().unwrap(), "--device", "cpu"])
        .args(["--output-dir", dir.path().join("eval").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let log = text(&output);
    let ours: f64 = log.split("eval loss ").nth(1).and_then(|rest| rest.split_whitespace().next()).and_then(|l| l.parse().ok()).unwrap_or_else(|| panic!("{log}"));
    // Every conversation is counted (none is too long).
    let conversations_count = std::fs::read_to_string(&conversations).unwrap().lines().filter(|line| !line.trim().is_empty()).count();
    assert!(log.contains(&format!("eval loss {ours:.4} over {conversations_count} examples")), "{log}");
    let reference = python(&["loss", model.to_str().unwrap(), tokens.to_str().unwrap()]);
    let reference: Vec<f64> = reference.split_whitespace().map(|v| v.parse().unwrap()).collect();
    assert!((ours - reference[0]).abs() < 1e-4 * reference[0], "ft {ours} vs transformers on the assistant's tokens {}", reference[0]);
    assert!((reference[0] - reference[1]).abs() > 1e-3, "the masks must matter to this check: {reference:?}");

    let out = dir.path().join("run");
    let output = ft()
        .args(["train", "--model", model.to_str().unwrap(), "--train-file", conversations.to_str().unwrap(), "--device", "cpu"])
        .args(["--chat-template", dir.path().join("llama3-dated.jinja").to_str().unwrap()])
        .args(["--epochs", "8", "--batch-size", "2", "--lr", "1e-2", "--report-to", "jsonl", "--output-dir", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let losses = common::losses(&out);
    assert!(losses.len() >= 8 && losses[losses.len() - 1] < 0.7 * losses[0], "{losses:?}");
    // The trained model keeps the chat template it was trained with: `ft tokenize` on final/ gives the same examples.
    let again = dir.path().join("again.jsonl");
    assert!(tokenize(&out.join("final"), &conversations, &again, &[]).status.success());
    assert_eq!(std::fs::read_to_string(&again).unwrap(), std::fs::read_to_string(&tokens).unwrap());
}

/// `--packing` puts several conversations in a row and keeps them apart:
/// when every step sees every conversation — all six packed into one row,
/// or six rows of one each — the losses are the same step for step (the
/// seams' labels ignored, the loss normalised by the same tokens).
#[test]
fn packed_conversations_train_as_unpacked_ones_do() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_llama(dir.path(), 1024);
    let conversations = fixture("conversations.jsonl");
    let train = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let output = ft()
            .args(["train", "--model", model.to_str().unwrap(), "--train-file", conversations.to_str().unwrap(), "--device", "cpu"])
            .args(["--max-seq-len", "1024", "--epochs", "3", "--lr", "1e-2", "--set", "train.log_every=1"])
            .args(["--report-to", "jsonl", "--output-dir", out.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output));
        (common::losses(&out), text(&output))
    };
    let (unpacked, _) = train("unpacked", &["--batch-size", "6"]);
    let (packed, log) = train("packed", &["--batch-size", "1", "--packing"]);
    assert!(log.contains("packing: 6 examples in 1 rows"), "{log}");
    assert_eq!((packed.len(), unpacked.len()), (3, 3), "one step an epoch: {packed:?} {unpacked:?}");
    for (step, (a, b)) in packed.iter().zip(&unpacked).enumerate() {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "step {step}: packed {a} vs unpacked {b}");
    }
    assert!(unpacked[2] < unpacked[0], "it trains: {unpacked:?}");
}

/// The published templates of tests/fixtures/templates (SOURCES.md), each
/// with its BOS and EOS, whether its default template renders a
/// conversation without tools (Hermes 3's is its `tool_use` template) and
/// whether it renders every tool-calling row (the others refuse some, as
/// transformers does: ft must skip exactly those).
const CORPUS: [(&str, &str, &str, bool, bool); 12] = [
    ("llama-3.1", "<|begin_of_text|>", "<|eot_id|>", true, true),
    ("llama-3.2", "<|begin_of_text|>", "<|eot_id|>", true, true),
    ("mistral-nemo", "<s>", "</s>", true, true),
    ("qwen2.5", "<|endoftext|>", "<|im_end|>", true, true),
    ("hermes-3", "<|begin_of_text|>", "<|im_end|>", false, true),
    ("deepseek-r1", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", true, false),
    ("granite-3.3", "<|end_of_text|>", "<|end_of_text|>", true, false),
    ("phi-3.5-mini", "<s>", "<|endoftext|>", true, false),
    ("phi-4-mini", "<|endoftext|>", "<|endoftext|>", true, false),
    ("gemma-3", "<bos>", "<eos>", true, false),
    ("chatml", "<|endoftext|>", "<|im_end|>", true, false),
    ("olmo-3", "<|endoftext|>", "<|endoftext|>", true, true),
];

/// Every published template of the corpus gives transformers' ids for every
/// conversation transformers renders with it — plain, multi-turn, with a
/// system message, and with tools (`tools` as JSON schemas or as a JSON
/// string, tool calls with dict or string arguments and `content: null`,
/// tool results) — and skips exactly those it refuses; the assistant's
/// turns, tool calls included, carry the loss.
#[test]
fn published_chat_templates_tokenize_as_transformers_applies_them() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let templates = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
    let gpt2 = shared::path(shared::GPT2_TOKENIZER);
    let dir = tempfile::tempdir().unwrap();
    // transformers loads once for all the tokenizer directories, and once for all the checks.
    let batch = |commands: &[Vec<String>]| python_batch(dir.path(), commands);
    batch(
        &CORPUS
            .iter()
            .map(|(name, bos, eos, ..)| ["make", &string(&gpt2), &string(&templates.join(format!("{name}.jinja"))), bos, eos, &string(&dir.path().join(name))].map(String::from).to_vec())
            .collect::<Vec<_>>(),
    );
    let (mut checks, mut all_tools) = (vec![], 0);
    for (name, _, _, plain, every_tool_row) in CORPUS {
        let model = dir.path().join(name);
        for (file, every) in [("conversations.jsonl", plain), ("tools.jsonl", every_tool_row)] {
            if file == "conversations.jsonl" && !plain {
                continue;
            }
            let (rows, out) = (templates.join(file), model.join(file));
            // Tool definitions make long prompts: room for them.
            let output = tokenize(&model, &rows, &out, &["--max-seq-len", "4096"]);
            assert!(output.status.success(), "{name} {file}: {}", text(&output));
            let mut check = vec!["check".to_string(), string(&model), string(&rows), string(&out)];
            if every {
                check.push("--all".into());
            }
            checks.push(check);
            all_tools += usize::from(file == "tools.jsonl" && every);
        }
    }
    let checked = batch(&checks);
    eprintln!("{checked}");
    assert_eq!(checked.matches("examples equal").count(), checks.len(), "{checked}");
    assert!(all_tools >= 3, "tool calls must render as transformers renders them on at least three published templates");
}

/// ShareGPT (axolotl's roles), Alpaca (axolotl's Stanford Alpaca prompt)
/// and TRL's conversational prompt/completion rows, by their keys or by
/// `data.format`, give the ids and labels the peers' own formatting gives.
#[test]
fn sharegpt_alpaca_and_trl_rows_tokenize_as_the_peers_format_them() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let qwen = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates/qwen2.5.jinja");
    tokenizer_dir_for(dir.path(), &qwen, "<|endoftext|>", "<|im_end|>", false);
    let mut checks = vec![];
    for (file, format) in [("sharegpt.jsonl", "sharegpt"), ("alpaca.jsonl", "alpaca"), ("trl.jsonl", "prompt_completion")] {
        let rows = fixture(file);
        for extra in [vec![], vec!["--set".to_string(), format!("data.format={format}")]] {
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            let out = dir.path().join(format!("{file}-{}.tokens.jsonl", checks.len()));
            let output = tokenize(dir.path(), &rows, &out, &extra);
            assert!(output.status.success(), "{file} {extra:?}: {}", text(&output));
            checks.push(["check", &string(dir.path()), &string(&rows), &string(&out), "--all"].map(String::from).to_vec());
        }
    }
    // transformers loads once for every check.
    let checked = python_batch(dir.path(), &checks);
    eprintln!("{checked}");
    assert_eq!(checked.matches("examples equal").count(), checks.len(), "{checked}");
    let out = dir.path().join("tokens.jsonl");
    // An unknown ShareGPT speaker is an error naming the file and line.
    let rows = dir.path().join("bad.jsonl");
    std::fs::write(&rows, "{\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}]}\n{\"conversations\": [{\"from\": \"bot\", \"value\": \"hi\"}]}\n").unwrap();
    let output = tokenize(dir.path(), &rows, &out, &[]);
    assert!(!output.status.success() && text(&output).contains("bad.jsonl line 2: turn 1 is from \"bot\""), "{}", text(&output));
}

/// chat_reference.py's `export` check of exported directories: each
/// `{"export", "config"[, "conversations", "tokens"]}` in `cases`.
fn check_exports(cases: &serde_json::Value) {
    eprintln!("{}", python(&["export", &cases.to_string()]));
}

/// An export is whole: transformers loads it in the dtype its config.json
/// names, its `apply_chat_template` gives the tokens ft trained on (the
/// template the run was given, not the one beside the source's tokenizer),
/// its generation_config names the model config's eos ids as it has them (a
/// list), and `ft eval` runs it on the conversations; final/ is as whole.
/// A model whose tokenizer.json came alone (the demo) gets a
/// tokenizer_config.json with the special tokens of its config's ids.
#[test]
fn exports_are_whole_for_transformers_and_ft_eval() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_llama(dir.path(), 256);
    // The config's special tokens are the tokenizer's, and its eos ids a list, as Llama 3's are.
    let tokenizer = tokenizers::Tokenizer::from_file(model.join("tokenizer.json")).unwrap();
    let id = |token: &str| tokenizer.token_to_id(token).unwrap_or_else(|| panic!("{token} is a token"));
    let config_path = model.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["bos_token_id"] = id("<|begin_of_text|>").into();
    config["eos_token_id"] = serde_json::json!([id("<|eot_id|>"), id("<|endoftext|>")]);
    std::fs::write(&config_path, config.to_string()).unwrap();

    let (conversations, template) = (fixture("conversations.jsonl"), fixture("chatml.jinja"));
    let tokens = dir.path().join("tokens.jsonl");
    assert!(tokenize(&model, &conversations, &tokens, &["--chat-template", template.to_str().unwrap()]).status.success());
    let out = dir.path().join("run");
    let output = ft()
        .args(["train", "--model", model.to_str().unwrap(), "--train-file", conversations.to_str().unwrap(), "--device", "cpu"])
        .args(["--chat-template", template.to_str().unwrap(), "--epochs", "1", "--batch-size", "2", "--save-every", "100"])
        .args(["--report-to", "jsonl", "--output-dir", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let export = dir.path().join("export");
    let output = ft()
        .args(["export", "--checkpoint", "latest", "--output-dir", out.to_str().unwrap(), "--out", export.to_str().unwrap(), "--dtype", "bf16"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let mut cases = vec![];
    for whole in [&export, &out.join("final")] {
        for file in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"] {
            assert!(whole.join(file).is_file(), "{} has no {file}", whole.display());
        }
        cases.push(serde_json::json!({"export": whole, "config": config_path, "conversations": conversations, "tokens": tokens}));
    }
    let output = ft()
        .args(["eval", "--model", export.to_str().unwrap(), "--eval-file", conversations.to_str().unwrap(), "--device", "cpu"])
        .args(["--output-dir", dir.path().join("eval").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success() && text(&output).contains("eval loss"), "{}", text(&output));

    // The demo's tokenizer.json has no tokenizer_config.json beside it: final/ gets one.
    let demo = dir.path().join("demo");
    let output = ft()
        .args(["train", "--epochs", "1", "--train-samples", "16", "--eval-samples", "4", "--nproc-per-node", "1", "--batch-size", "8"])
        .args(["--output-dir", demo.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    assert!(!demo.join("demo-data/tokenizer_config.json").exists());
    let final_dir = demo.join("final");
    cases.push(serde_json::json!({"export": final_dir, "config": final_dir.join("config.json")}));
    check_exports(&serde_json::Value::from(cases));
}
