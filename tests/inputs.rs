//! What a user gives is used or refused, never ignored or replaced in
//! silence: a model directory must hold its weights (random weights only
//! when asked for, and said), options that need another are errors, `--set`
//! keys are checked by every command and bad values name where they came
//! from, the epoch's short last batch is logged or trained, and
//! `--max-steps`, `train.eval_every` and `--report-to none` do what they
//! say; `ft tokenize` writes its task's rows, and `--fp8` where it cannot
//! run is refused before any rank starts.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common;
use common::{ft, text};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// `ft` with `args`: whether it succeeded, and its output.
fn run(args: &[&str]) -> (bool, String) {
    let output = ft().args(args).output().unwrap();
    (output.status.success(), text(&output))
}

/// A copy of fixture `name`'s config.json alone in `dir`: a model directory without weights.
fn weightless_copy(name: &str, dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(fixture(name).join("config.json"), dir.join("config.json")).unwrap();
    dir.to_path_buf()
}

/// `ft train` on the demo (its model and data) into `dir`, 32 examples on one rank, with `extra` flags.
fn demo_run(dir: &Path, extra: &[&str]) -> Command {
    let mut command = ft();
    command
        .args(["train", "--output-dir", dir.to_str().unwrap(), "--train-samples", "32", "--eval-samples", "8"])
        .args(["--nproc-per-node", "1", "--batch-size", "8"])
        .args(extra);
    command
}

fn succeeded(output: Output) -> String {
    assert!(output.status.success(), "{}", text(&output));
    text(&output)
}

/// metrics.jsonl's records: `(step, record)`.
fn records(dir: &Path) -> Vec<(u64, Value)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .map(|record| (record["step"].as_u64().unwrap(), record))
        .collect()
}

fn steps_with(dir: &Path, key: &str) -> Vec<u64> {
    records(dir).into_iter().filter(|(_, record)| record.get(key).is_some()).map(|(step, _)| step).collect()
}

#[test]
fn a_model_directory_without_weights_is_refused_by_every_command_that_reads_weights() {
    let scratch = tempfile::tempdir().unwrap();
    let model = weightless_copy("bloom", &scratch.path().join("bloom"));
    let model = model.to_str().unwrap();
    let out = scratch.path().join("run");
    let ids = scratch.path().join("ids.json");
    std::fs::write(&ids, "[[1, 2, 3]]").unwrap();
    let expected = "has no model.safetensors or model.safetensors.index.json: it holds no weights";
    // `ft train`, with LoRA too, before any rank starts: nothing is written, no random base-model/.
    let train = ["train", "--model", model, "--train-file", "train.json", "--output-dir", out.to_str().unwrap()];
    for extra in [&[][..], &["--lora-r", "4"]] {
        let (ok, message) = run(&[&train[..], extra].concat());
        assert!(!ok && message.contains(expected) && message.contains("--init random"), "{message}");
        assert!(!out.exists(), "a refused run writes nothing");
    }
    let (ok, message) = run(&["forward", "--model", model, "--ids", ids.to_str().unwrap(), "--out", scratch.path().join("o.safetensors").to_str().unwrap()]);
    assert!(!ok && message.contains(expected), "{message}");
    let (ok, message) = run(&["generate", "--model", model, "--ids", "1,2"]);
    assert!(!ok && message.contains(expected), "{message}");
    let (ok, message) = run(&["eval", "--model", model, "--eval-file", "eval.json", "--tokenizer", "tokenizer.json"]);
    assert!(!ok && message.contains(expected), "{message}");
    // An index whose shards are not all there.
    let index = serde_json::json!({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}});
    std::fs::write(Path::new(model).join("model.safetensors.index.json"), index.to_string()).unwrap();
    let (ok, message) = run(&train);
    assert!(!ok && message.contains("names weight files that are not in") && message.contains("model-00001-of-00002.safetensors, model-00002-of-00002.safetensors"), "{message}");
}

/// A hub-style directory with PyTorch's pickle weights alone is refused with
/// a command that converts them, and after that command it loads.
#[test]
fn pytorch_bin_weights_are_refused_with_the_command_that_converts_them() {
    let scratch = tempfile::tempdir().unwrap();
    let model = weightless_copy("bloom", &scratch.path().join("hub-style"));
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let script = "import sys, torch; from safetensors.torch import load_file; torch.save(load_file(sys.argv[1]), sys.argv[2])";
    let output = Command::new(&python)
        .args(["-c", script, fixture("bloom").join("model.safetensors").to_str().unwrap(), model.join("pytorch_model.bin").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let ids = scratch.path().join("ids.json");
    std::fs::write(&ids, "[[1, 2, 3]]").unwrap();
    let logits = scratch.path().join("o.safetensors");
    let forward = ["forward", "--model", model.to_str().unwrap(), "--ids", ids.to_str().unwrap(), "--out", logits.to_str().unwrap()];
    let (ok, message) = run(&forward);
    assert!(!ok && message.contains("holds PyTorch weights (pytorch_model.bin), which ft does not read"), "{message}");
    let command = message.lines().map(str::trim).find(|line| line.starts_with("python -c ")).unwrap_or_else(|| panic!("no command in: {message}"));
    assert!(command.contains("from transformers import BloomForCausalLM"), "the architecture's own class keeps its head: {command}");
    let (ok, message) = run(&["train", "--model", model.to_str().unwrap(), "--train-file", "train.json"]);
    assert!(!ok && message.contains(command), "ft train refuses it the same way: {message}");
    // The command as printed, with the venv's python.
    let output = Command::new("sh").args(["-c", &command.replacen("python", python.to_str().unwrap(), 1)]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let (ok, message) = run(&forward);
    assert!(ok && message.contains("loss "), "{message}");
}

#[test]
fn random_weights_come_from_a_config_json_or_init_random_and_the_log_says_so() {
    let scratch = tempfile::tempdir().unwrap();
    let [config, train_file, tokenizer] = common::demo_files(scratch.path());
    // The config.json's directory holds the tokenizer.json the runs read.
    std::fs::copy(&tokenizer, config.with_file_name("tokenizer.json")).unwrap();
    let data = ["--train-file", train_file.to_str().unwrap(), "--train-samples", "16"];
    let train = |model: &Path, out: &str, extra: &[&str]| {
        let mut command = ft();
        command
            .args(["train", "--model", model.to_str().unwrap(), "--output-dir", scratch.path().join(out).to_str().unwrap()])
            .args(["--epochs", "1", "--nproc-per-node", "1", "--batch-size", "8"])
            .args(data)
            .args(extra);
        command.output().unwrap()
    };
    let log = succeeded(train(&config, "from-config", &[]));
    assert!(log.contains(&format!("random initialisation (train.seed 42): --model {} is a config.json alone, without weights", config.display())), "{log}");
    // A weightless directory with --init random (and LoRA: its random base is written for the adapter to name).
    let dir = scratch.path().join("weightless");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(&config, dir.join("config.json")).unwrap();
    std::fs::copy(&tokenizer, dir.join("tokenizer.json")).unwrap();
    let log = succeeded(train(&dir, "init-random", &["--init", "random", "--lora-r", "4"]));
    assert!(log.contains(&format!("random initialisation (train.seed 42): model.init is random (--init random): the weights in {} are not read", dir.display())), "{log}");
    assert!(scratch.path().join("init-random/base-model/model.safetensors").is_file());
    // Pretrained weights asked of a config.json alone, and of one with weights beside it (a run's final/).
    let output = train(&config, "pretrained", &["--init", "pretrained"]);
    assert!(!output.status.success() && text(&output).contains("model.init is pretrained (--init pretrained), but"), "{}", text(&output));
    let trained = scratch.path().join("from-config/final/config.json");
    let log = succeeded(train(&trained, "pretrained-beside", &["--init", "pretrained"]));
    assert!(!log.contains("random initialisation"), "{log}");
}

#[test]
fn options_that_need_another_are_errors_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let refused = |args: &[&str]| {
        let (ok, message) = run(&[&["train", "--dry-run", "--output-dir", dir.path().to_str().unwrap()][..], args].concat());
        assert!(!ok, "{args:?} must be refused: {message}");
        message
    };
    for args in [&["--lora-alpha", "32"][..], &["--lora-targets", "q,k"], &["--lora-dropout", "0.1"], &["--set", "train.lora.alpha=16"]] {
        let message = refused(args);
        assert!(message.contains("is given, but LoRA is off: set train.lora.r (--lora-r) to train adapters"), "{args:?}: {message}");
    }
    assert!(refused(&["--lora-r", "0"]).contains("train.lora.r (--lora-r) is 0: LoRA's rank must be at least 1"));
    assert!(refused(&["--nproc-per-node", "0"]).contains("launch.nproc_per_node (--nproc-per-node) must be at least 1"));
    let (ok, message) = run(&["eval", "--model", "x", "--eval-file", "e.json", "--nproc-per-node", "0"]);
    assert!(!ok && message.contains("launch.nproc_per_node (--nproc-per-node) must be at least 1"), "{message}");
    assert!(refused(&["--set", "train.monitor_mode=max"]).contains("train.monitor_mode is given, but there is no train.monitor"));
    assert!(refused(&["--set", "train.warmup_ratio=0.1", "--set", "train.warmup_steps=5"]).contains("train.warmup_ratio is given, but train.warmup_steps is set too"));
    assert!(refused(&["--max-steps", "10", "--epochs", "2"]).contains("train.max_steps (--max-steps) and train.epochs (--epochs) both set how long the run trains"));
    assert!(refused(&["--max-steps", "0"]).contains("train.max_steps (--max-steps) must be at least 1"));
    assert!(refused(&["--set", "train.checkpoint_layers=4"]).contains("train.checkpoint_layers (--checkpoint-layers) needs train.activation_checkpointing"));
    assert!(refused(&["--activation-checkpointing", "--checkpoint-layers", "0"]).contains("train.checkpoint_layers (--checkpoint-layers) must be at least 1"));
    // With its partner each is taken.
    let (ok, message) = run(&["train", "--dry-run", "--output-dir", dir.path().to_str().unwrap(), "--lora-r", "8", "--lora-alpha", "32"]);
    assert!(ok && message.contains("\"alpha\": 32.0"), "{message}");
}

#[test]
fn ft_plan_refuses_set_keys_it_would_not_use() {
    let config = fixture("llama").join("config.json");
    let plan = |set: &str| run(&["plan", "--model", config.to_str().unwrap(), "--gpu", "h100", "--set", set]);
    let (ok, message) = plan("num_hidden_layer=2");
    assert!(!ok && message.contains("--set num_hidden_layer=2: ") && message.contains("has no key `num_hidden_layer`; did you mean `num_hidden_layers`?"), "{message}");
    let (ok, message) = plan("train.lora.r=16");
    assert!(!ok && message.contains("`train.lora.r` is a key of `ft train`'s configuration, which this command does not read"), "{message}");
    let (ok, message) = plan("num_hidden_layers=3");
    assert!(ok, "a key config.json holds is set: {message}");
}

#[test]
fn a_bad_value_names_the_set_flag_the_file_or_the_variable_it_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let output_dir = dir.path().join("out");
    let dry_run = || {
        let mut command = ft();
        command.args(["train", "--dry-run", "--output-dir", output_dir.to_str().unwrap()]);
        command
    };
    let check = |output: Output, expected: &str| {
        let message = text(&output);
        assert!(!output.status.success() && message.contains(expected), "expected {expected:?} in: {message}");
        assert!(!message.contains("figment") && !message.contains("config.rs"), "{message}");
    };
    check(dry_run().args(["--set", "train.batch_size=abc"]).output().unwrap(), "--set train.batch_size=abc: config key `train.batch_size`: expected a whole number");
    let file = dir.path().join("ft.toml");
    std::fs::write(&file, "[train]\nbatch_size = \"abc\"\n").unwrap();
    check(dry_run().args(["--config", file.to_str().unwrap()]).output().unwrap(), &format!("config file {}: config key `train.batch_size`", file.display()));
    check(dry_run().env("FT_TRAIN__BATCH_SIZE", "abc").output().unwrap(), "environment variable FT_TRAIN__BATCH_SIZE: config key `train.batch_size`");
    check(dry_run().args(["--set", "train.lora.alhpa=4"]).output().unwrap(), "unknown config key `train.lora.alhpa` (--set train.lora.alhpa=4); did you mean `alpha`?");
}

/// The examples after an epoch's last whole global batch are left out with
/// a line saying how many, or trained as a short last batch with
/// `data.drop_last=false`, which one rank and two ranks train alike.
#[test]
fn the_short_last_batch_is_logged_or_kept_with_drop_last_false() {
    let (dropped, kept, kept_one_rank) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let two_ranks = ["--epochs", "1", "--train-samples", "44", "--nproc-per-node", "2", "--batch-size", "4"];
    let log = succeeded(demo_run(dropped.path(), &two_ranks).output().unwrap());
    let line = log.lines().find(|line| line.contains("each epoch leaves out")).unwrap_or_else(|| panic!("no drop-last line in: {log}"));
    let said = &line[line.find("leaves out ").unwrap()..];
    let numbers: Vec<usize> = said.split_whitespace().filter_map(|word| word.parse().ok()).collect();
    let (left_out, examples) = (numbers[0], numbers[1]);
    assert!(line.contains("after its last global batch of 8") && left_out == examples % 8 && left_out > 0, "{line}");
    assert_eq!(steps_with(dropped.path(), "loss").len(), examples / 8);

    let keep = ["--set", "data.drop_last=false"];
    let log = succeeded(demo_run(kept.path(), &[&two_ranks[..], &keep].concat()).output().unwrap());
    assert!(!log.contains("each epoch leaves out"), "{log}");
    let two = common::losses(kept.path());
    assert_eq!(two.len(), examples / 8 + 1, "the short batch is one more step");
    succeeded(demo_run(kept_one_rank.path(), &[&["--epochs", "1", "--train-samples", "44", "--batch-size", "8"][..], &keep].concat()).output().unwrap());
    let one = common::losses(kept_one_rank.path());
    assert_eq!(one.len(), two.len());
    for (step, (a, b)) in one.iter().zip(&two).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "step {}: one rank {a}, two ranks {b}", step + 1);
    }
}

/// `--max-steps` ends the run inside its second epoch, the schedule decays
/// over those steps, and `train.eval_every` adds evaluations at its steps
/// besides the epoch's end (and the run's, which it does not repeat); a
/// resume with more steps continues inside that epoch.
#[test]
fn max_steps_ends_the_run_and_eval_every_adds_evaluations_keyed_by_step() {
    let dir = tempfile::tempdir().unwrap();
    // 32 examples in global batches of 8: 4 steps an epoch.
    let flags = ["--set", "train.eval_every=3", "--set", "train.warmup_ratio=0", "--set", "train.log_every=1", "--save-every", "100"];
    succeeded(demo_run(dir.path(), &[&["--max-steps", "6"][..], &flags].concat()).output().unwrap());
    assert_eq!(steps_with(dir.path(), "loss"), (1..=6).collect::<Vec<_>>());
    assert_eq!(steps_with(dir.path(), "eval_loss"), vec![3, 4, 6]);
    let records = records(dir.path());
    let lr: Vec<f64> = records.iter().filter_map(|(_, r)| r.get("lr").and_then(Value::as_f64)).collect();
    assert!(lr.windows(2).all(|pair| pair[1] < pair[0]) && lr[5] > 0.0, "a linear decay over the 6 steps: {lr:?}");
    let last_eval = &records.iter().rev().find(|(_, r)| r.get("eval_loss").is_some()).unwrap().1;
    assert_eq!(last_eval["epoch"].as_f64(), Some(1.5), "the run ended half way through its second epoch");
    assert_eq!(common::summary(dir.path())["optimizer_steps"].as_u64(), Some(6));
    // The run's last step was saved; two more steps finish the second epoch.
    succeeded(demo_run(dir.path(), &[&["--max-steps", "8", "--resume", "latest"][..], &flags].concat()).output().unwrap());
    assert_eq!(steps_with(dir.path(), "loss"), (1..=8).collect::<Vec<_>>());
    let log = succeeded(demo_run(dir.path(), &[&["--max-steps", "8", "--resume", "latest"][..], &flags].concat()).output().unwrap());
    assert!(log.contains("nothing left to train: checkpoint step-00000008 already completed 8 step(s) and train.max_steps is 8"), "{log}");
}

/// OMP_NUM_THREADS, where set, is each rank's count of ATen threads (as
/// torch takes it), and the log says it; unset, the host's cores are
/// shared among its ranks; a value that is no count is refused, naming the
/// variable.
#[test]
fn omp_num_threads_sets_each_ranks_threads_and_a_bad_value_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let one_step = |name: &str, threads: Option<&str>| {
        let mut command = demo_run(&dir.path().join(name), &["--max-steps", "1", "--report-to", "none"]);
        match threads {
            Some(threads) => command.env("OMP_NUM_THREADS", threads),
            None => command.env_remove("OMP_NUM_THREADS"),
        };
        command.output().unwrap()
    };
    let log = succeeded(one_step("three", Some("3")));
    assert!(log.contains("Cpu (3 thread(s) a rank)"), "{log}");
    let cores = std::thread::available_parallelism().unwrap().get();
    let log = succeeded(one_step("shared", None));
    assert!(log.contains(&format!("Cpu ({cores} thread(s) a rank)")), "{log}");
    let output = one_step("bad", Some("many"));
    let log = text(&output);
    assert!(!output.status.success() && log.contains("environment variable OMP_NUM_THREADS=\"many\" is not a number of threads"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn report_to_none_writes_no_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let log = succeeded(demo_run(dir.path(), &["--epochs", "1", "--report-to", "none"]).output().unwrap());
    for sink_output in ["metrics.jsonl", "metrics.csv", "tensorboard"] {
        assert!(!dir.path().join(sink_output).exists(), "{sink_output} written with --report-to none");
    }
    assert!(dir.path().join("summary.json").is_file() && dir.path().join("final").is_dir());
    assert!(!log.contains("metrics ("), "{log}");
    let (ok, message) = run(&["train", "--dry-run", "--report-to", "none,jsonl"]);
    assert!(!ok && message.contains("`none` means no sink and stands alone"), "{message}");
}

/// Every subcommand refuses malformed input — token ids out of the
/// vocabulary, negative, ragged or empty, bad or missing configs and files,
/// flag values out of range — with an error naming it and an exit code in
/// 1–100: no Rust panic, no libtorch stack.
#[test]
fn malformed_input_to_every_subcommand_is_an_error_not_a_panic() {
    let scratch = tempfile::tempdir().unwrap();
    let file = |name: &str, contents: &str| {
        let path = scratch.path().join(name);
        std::fs::write(&path, contents).unwrap();
        path.to_str().unwrap().to_string()
    };
    let out = |name: &str| scratch.path().join(name).to_str().unwrap().to_string();
    let (bloom, opt) = (fixture("bloom"), fixture("opt"));
    let (bloom, opt) = (bloom.to_str().unwrap(), opt.to_str().unwrap());
    let llama_config = fixture("llama").join("config.json");
    let llama_config = llama_config.to_str().unwrap();
    let [_, demo_train, demo_tokenizer] = common::demo_files(scratch.path());
    let (demo_train, demo_tokenizer) = (demo_train.to_str().unwrap(), demo_tokenizer.to_str().unwrap());
    let not_json = file("not.json", "nonsense");
    let missing = out("missing.json");
    let ids_files = std::cell::Cell::new(0);
    let forward = |ids: &str| {
        ids_files.set(ids_files.get() + 1);
        let ids = file(&format!("ids-{}.json", ids_files.get()), ids);
        vec!["forward".to_string(), "--model".into(), bloom.into(), "--ids".into(), ids, "--out".into(), out("o.safetensors")]
    };
    let words = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
    let bloom_vocab = "is not in this bloom model's vocabulary: ids run from 0 to 127 (vocab_size 128 in its config.json)";
    let long_row = format!("[{:?}]", vec![1; 65]);
    let cases: Vec<(Vec<String>, String)> = vec![
        (words(&["launch", "--nproc-per-node", "0", "--", "list"]), "--nproc-per-node and --nnodes must be at least 1".into()),
        (words(&["train", "--dry-run", "--output-dir", &out("run"), "--batch-size", "0"]), "train.batch_size, train.eval_batch_size and train.grad_accum must be at least 1".into()),
        (words(&["train", "--output-dir", &out("run"), "--train-file", &missing]), format!("cannot read {missing}")),
        (words(&["eval", "--model", bloom, "--eval-file", &missing, "--tokenizer", &missing]), format!("cannot load tokenizer {missing}")),
        (words(&["export", "--checkpoint", &missing, "--out", &out("export")]), "is neither a checkpoint (manifest.json) nor a trained model directory".into()),
        (words(&["export", "--checkpoint", bloom, "--out", &out("export"), "--max-shard-size", "0"]), "invalid value '0' for '--max-shard-size".into()),
        (words(&["comm-test", "--factor", "1", "--min-bytes", "1K", "--max-bytes", "4K"]), "size sweep needs 0 < min (1024) <= max (4096) and factor (1) >= 2".into()),
        (words(&["list", "--config", &not_json]), format!("config file {not_json}")),
        (words(&["tokenize", "--train-file", &not_json, "--tokenizer", &not_json, "--out", &out("t.jsonl")]), format!("cannot load tokenizer {not_json}")),
        (words(&["tokenize", "--train-file", demo_train, "--tokenizer", demo_tokenizer, "--max-seq-len", "1", "--out", &out("t.jsonl")]), "data.max_seq_len (--max-seq-len) must be at least 8 (got 1)".into()),
        (words(&["init-model", "--config", bloom, "--out", &out("init"), "--set", "vocab_size=-1"]), "vocab_size must be at least 1, not -1".into()),
        (words(&["generate", "--model", bloom, "--ids", "1,128"]), format!("token id 128 (row 0, position 1) {bloom_vocab}")),
        (words(&["generate", "--model", bloom, "--ids", "1,-1"]), format!("token id -1 (row 0, position 1) {bloom_vocab}")),
        (words(&["generate", "--model", bloom]), "row 0 of the token ids is empty".into()),
        (words(&["generate", "--model", bloom, "--ids", "1,x"]), "invalid value 'x' for '--ids".into()),
        (words(&["generate", "--model", bloom, "--ids", "1", "--max-new-tokens", &usize::MAX.to_string()]), "take more positions than a model can have".into()),
        (words(&["generate", "--model", opt, "--ids", "1,2,3", "--max-new-tokens", "100"]), "row 0's 3 token ids and 100 tokens generated after them take 102 positions, more than this opt model's max_position_embeddings (64".into()),
        (forward("[[1, 2, 128]]"), format!("token id 128 (row 0, position 2) {bloom_vocab}")),
        (forward("[[1, 2], [3, -5]]"), format!("token id -5 (row 1, position 1) {bloom_vocab}")),
        (forward("[[1, 2, 3], [4, 5]]"), "row 1 has 2 token ids and row 0 has 3: the rows of a batch must all be of one length".into()),
        (forward("[]"), "no rows of token ids".into()),
        (forward("[[]]"), "row 0 of the token ids is empty".into()),
        (forward("{\"ids\": [1]}"), "must hold [[id, ...], ...]".into()),
        ([forward("[[1]]"), words(&["--device", "cuda:99"])].concat(), "device cuda:99 is CUDA GPU 99, but ".into()),
        ([words(&["forward", "--model", opt, "--ids"]), vec![file("long.json", &long_row)], words(&["--out", &out("o.safetensors")])].concat(), "row 0's 65 token ids take 65 positions, more than this opt model's max_position_embeddings (64".into()),
        (words(&["bench", "--config", bloom, "--device", "cpu", "--dtype", "f32", "--warmup", "0", "--steps", "1", "--batch", "0", "--seq", "8"]), "--batch 0: it must be at least 1".into()),
        (words(&["bench", "--from-json", &not_json]), "is not `ft bench --json` output".into()),
        (words(&["plan", "--model", llama_config, "--gpu", "h100", "--seq", "1000000000000"]), "tokens (grad_accum 1) is beyond what ft plan counts".into()),
        (words(&["plan", "--model", llama_config, "--gpu", "nonsense"]), "unknown --gpu \"nonsense\"".into()),
        (words(&["calibrate", "--config", bloom, "--device", "cpu", "--batch", "100000000000", "--seq", "100000000", "--out", &out("c.json")]), "too many tokens to count".into()),
        (words(&["plugin", "check", &out("libmissing.so")]), "does not exist".into()),
    ];
    // The subcommands `ft --help` lists, each of which a case must cover.
    let help = text(&ft().arg("--help").output().unwrap());
    let listed: std::collections::BTreeSet<String> = help
        .lines()
        .skip_while(|line| !line.starts_with("Commands:"))
        .skip(1)
        .take_while(|line| line.starts_with("  "))
        .filter_map(|line| line.split_whitespace().next().map(str::to_string))
        .filter(|name| name != "help")
        .collect();
    let covered: std::collections::BTreeSet<String> = cases.iter().map(|(args, _)| args[0].clone()).collect();
    assert!(listed.len() >= 14 && listed == covered, "subcommands listed: {listed:?}, covered: {covered:?}");
    // All at once: most fail in argument or config checks, within a second.
    let children: Vec<_> = cases
        .iter()
        .map(|(args, _)| ft().args(args).env_remove("RUST_BACKTRACE").stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap())
        .collect();
    for ((args, expected), child) in cases.iter().zip(children) {
        let output = child.wait_with_output().unwrap();
        let message = text(&output);
        let code = output.status.code();
        assert!(code.is_some_and(|code| (1..=100).contains(&code)), "ft {}: exit code {code:?}: {message}", args.join(" "));
        for sign in ["panicked", "stack backtrace", "internal error", "frame #"] {
            assert!(!message.contains(sign), "ft {}: {sign:?} in: {message}", args.join(" "));
        }
        assert!(message.contains(expected.as_str()), "ft {}: expected {expected:?} in: {message}", args.join(" "));
    }
}

/// A panic (a bug in ft) reaches the user as one line naming the command
/// and asking for a report, exit code 70; `RUST_BACKTRACE=1` adds the
/// backtrace.
#[test]
fn a_panic_is_one_line_naming_the_command_and_exit_code_70() {
    let panicking = |backtrace: &str| {
        let dir = tempfile::tempdir().unwrap();
        demo_run(dir.path(), &["--max-steps", "2"]).env("FT_FAULT_INJECT", "panic:after-step:1").env("RUST_BACKTRACE", backtrace).output().unwrap()
    };
    let output = panicking("0");
    let message = text(&output);
    assert_eq!(output.status.code(), Some(70), "{message}");
    let reported: Vec<&str> = message.lines().filter(|line| line.contains("internal error")).collect();
    assert_eq!(reported.len(), 1, "{message}");
    assert!(reported[0].starts_with("ft train: internal error (a bug in ft): FT_FAULT_INJECT: a panic at after-step of step 1 at core/src/checkpoint.rs:"), "{message}");
    assert!(reported[0].ends_with("Please report it with the command you ran; RUST_BACKTRACE=1 shows the backtrace."), "{message}");
    assert!(!message.contains("panicked") && !message.contains("fault_point"), "no Rust panic message, no backtrace: {message}");
    let output = panicking("1");
    assert_eq!(output.status.code(), Some(70));
    assert!(text(&output).contains("ft_core::checkpoint::fault_point"), "the backtrace names where: {}", text(&output));
}

/// `--set` keys `ft eval` and `ft tokenize` do not read are refused naming
/// the key and the command, before anything is read; keys they read are taken.
#[test]
fn set_keys_a_command_does_not_read_are_errors_naming_the_key_and_the_command() {
    let (ok, message) = run(&["eval", "--model", "no-such-model", "--eval-file", "e.json", "--set", "train.lr=1"]);
    assert!(!ok && message.contains("--set train.lr=1: `ft eval` does not read `train.lr`"), "{message}");
    let (ok, message) = run(&["tokenize", "--train-file", "t.txt", "--out", "o.jsonl", "--set", "train.lora.r=4"]);
    assert!(!ok && message.contains("--set train.lora.r=4: `ft tokenize` does not read `train.lora.r`"), "{message}");
    let (ok, message) = run(&["eval", "--model", "no-such-model", "--eval-file", "e.json", "--set", "task.beta=0.2"]);
    assert!(!ok && message.contains("model \"no-such-model\" not found locally"), "a key ft eval reads passes: {message}");
}

/// `ft tokenize` writes the rows its task trains on: causal_lm's by
/// default, from a model given as its config.json (the tokenizer beside
/// it); the dpo task's chosen and rejected rows with `--task dpo`, which
/// preference data without it is refused naming; a task with no rows to
/// write is refused naming those with.
#[test]
fn ft_tokenize_writes_the_rows_of_the_task_it_is_given() {
    let scratch = tempfile::tempdir().unwrap();
    let [config, train_file, tokenizer] = common::demo_files(scratch.path());
    let path = |p: &Path| p.to_str().unwrap().to_string();
    let tokenize = |extra: &[&str], out: &str| {
        let out = scratch.path().join(out);
        let (ok, message) = run(&[&["tokenize", "--out", &path(&out)][..], extra].concat());
        (ok, message, std::fs::read_to_string(&out).unwrap_or_default())
    };
    // A config.json finds the tokenizer.json in its directory, as the directory itself does.
    let beside = tokenizer.with_file_name("config.json");
    std::fs::copy(&config, &beside).unwrap();
    let text = ["--train-file", &path(&train_file), "--set", "data.max_seq_len=64"];
    let (ok, message, by_config) = tokenize(&[&["--model", &path(&beside)][..], &text].concat(), "by-config.jsonl");
    assert!(ok && message.contains("examples") && !by_config.is_empty(), "{message}");
    let (ok, message, by_directory) = tokenize(&[&["--model", &path(beside.parent().unwrap())][..], &text].concat(), "by-directory.jsonl");
    assert!(ok && by_config == by_directory, "{message}");

    let rows = [("The capital of Ruritania is", " Strelsau.", " Zenda, by the lake."), ("Two plus two is", " four.", " five")];
    let pairs = scratch.path().join("pairs.jsonl");
    let lines: String = rows.iter().map(|(p, c, r)| serde_json::json!({"prompt": p, "chosen": c, "rejected": r}).to_string() + "\n").collect();
    std::fs::write(&pairs, lines).unwrap();
    let preference = ["--model", &path(beside.parent().unwrap()), "--train-file", &path(&pairs)];
    let (ok, message, _) = tokenize(&preference, "refused.jsonl");
    assert!(!ok && message.contains("holds preference pairs") && message.contains("(--task dpo)"), "{message}");
    let (ok, message, _) = tokenize(&[&preference[..], &["--task", "extractive_qa"]].concat(), "refused.jsonl");
    assert!(!ok && message.contains("task `extractive_qa` has no rows `ft tokenize` writes (--task causal_lm or --task dpo)"), "{message}");
    let (ok, message, written) = tokenize(&[&preference[..], &["--task", "dpo"]].concat(), "pairs.tokens.jsonl");
    assert!(ok && message.contains("2 preference pairs"), "{message}");
    let decoder = tokenizers::Tokenizer::from_file(&tokenizer).unwrap();
    let ids = |row: &Value, key: &str| -> Vec<i64> { row[key].as_array().unwrap_or_else(|| panic!("no {key} in {row}")).iter().map(|v| v.as_i64().unwrap()).collect() };
    let written: Vec<Value> = written.lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    assert_eq!(written.len(), rows.len());
    for (row, (prompt, chosen, rejected)) in written.iter().zip(rows) {
        let mut prompts = vec![];
        for (side, completion) in [("chosen", chosen), ("rejected", rejected)] {
            let (input_ids, labels) = (ids(row, &format!("{side}_input_ids")), ids(row, &format!("{side}_labels")));
            let prompt_tokens = labels.iter().take_while(|&&label| label == -100).count();
            assert!(prompt_tokens > 0 && prompt_tokens < input_ids.len(), "{row}");
            assert_eq!(labels[prompt_tokens..], input_ids[prompt_tokens..], "the completion's tokens carry the loss: {row}");
            let decoded = decoder.decode(&input_ids.iter().map(|&id| id as u32).collect::<Vec<_>>(), false).unwrap();
            assert!(decoded.starts_with(&format!("{prompt}{completion}")), "{decoded:?}");
            prompts.push(input_ids[..prompt_tokens].to_vec());
        }
        assert_eq!(prompts[0], prompts[1], "both sequences start with the same prompt: {row}");
    }
}

/// `--fp8` on a CPU is refused by `ft train` itself, before it starts its
/// local ranks (none prints a line) or writes anything.
#[test]
fn fp8_where_it_cannot_run_is_refused_before_any_rank_starts() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let (ok, message) = run(&["train", "--fp8", "tensorwise", "--device", "cpu", "--nproc-per-node", "2", "--output-dir", out.to_str().unwrap()]);
    assert!(!ok && message.contains("train.fp8 (--fp8) needs a CUDA GPU of compute capability 8.9 or newer"), "{message}");
    assert!(!message.contains("[rank "), "no rank started: {message}");
    assert!(!out.exists(), "a refused run writes nothing");
}
