//! What the integration tests share: the `ft` binary, started with an
//! environment that does not look like a launcher's worker, and its output.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub mod shared;

pub const FT: &str = env!("CARGO_BIN_EXE_ft");

/// Removes what would make a process think a launcher started it (a test
/// may itself run under one), and any fault injection.
pub fn without_launcher_env(command: &mut Command) -> &mut Command {
    for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "FT_FAULT_INJECT", "FT_LAUNCHER_DRAWS_PROGRESS"] {
        command.env_remove(var);
    }
    command
}

/// `ft`, not a launcher's worker.
pub fn ft() -> Command {
    let mut command = Command::new(FT);
    without_launcher_env(&mut command);
    command
}

/// A finished command's stdout and stderr together.
pub fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// `ft train` into `dir` on the embedded demo: one epoch of 96 examples, 8 evaluated, with `extra` flags.
pub fn train_command(dir: &Path, extra: &[&str]) -> Command {
    let mut command = ft();
    command
        .args(["train", "--output-dir", dir.to_str().unwrap(), "--epochs", "1", "--train-samples", "96", "--eval-samples", "8"])
        .args(extra);
    command
}

/// The demo's data and tokenizer, and its model's config.json (a tiny BLOOM), in `dir`: `[config.json, train file, tokenizer]`.
pub fn demo_files(dir: &Path) -> [PathBuf; 3] {
    let files = ft_data::demo::write(&dir.join("demo"), 8, 1, 0).unwrap();
    let mut config = ft_core::Config::default();
    let model_config = ft_data::demo::configure(&mut config, &dir.join("demo")).unwrap();
    let path = dir.join("config.json");
    std::fs::write(&path, model_config.to_string()).unwrap();
    [path, files.train, files.tokenizer]
}

/// A small BERT (no dropout when `deterministic`) with a WordPiece
/// vocabulary trained on the shared SQuAD file (the test checks it is there),
/// in `dir`/bert.
pub fn small_bert(dir: &Path, deterministic: bool) -> PathBuf {
    // Made once per binary for each dropout (the tokenizer's training and an init-model), copied into each test's `dir`.
    static MADE: [std::sync::OnceLock<Vec<(PathBuf, Vec<u8>)>>; 2] = [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    made_once(&MADE[usize::from(deterministic)], dir, |dir| {
        let config = dir.join("bert-config.json");
        let dropout = if deterministic { 0.0 } else { 0.1 };
        let json = serde_json::json!({
            "model_type": "bert", "architectures": ["BertForQuestionAnswering"], "vocab_size": 30522,
            "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256,
            "max_position_embeddings": 256, "type_vocab_size": 2, "hidden_dropout_prob": dropout,
            "attention_probs_dropout_prob": dropout, "layer_norm_eps": 1e-12, "initializer_range": 0.02, "pad_token_id": 0
        });
        std::fs::write(&config, json.to_string()).unwrap();
        let output = ft()
            .args(["init-model", "--config", config.to_str().unwrap(), "--out", dir.join("bert").to_str().unwrap()])
            .args(["--train-tokenizer", shared::path(shared::SQUAD).to_str().unwrap(), "--vocab-size", "3000"])
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output));
    });
    dir.join("bert")
}

/// Each optimizer step's loss in a run's metrics.jsonl.
pub fn losses(dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap().get("loss").and_then(serde_json::Value::as_f64))
        .collect()
}

/// A finished run's summary.json.
pub fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// Copies into `dir` the files `make` writes into a directory it is given,
/// made once per test binary however many of its tests ask: what several
/// tests build alike (a tiny model, a baseline run) costs one build. `made`
/// is the caller's own cell: one per thing made.
pub fn made_once(made: &'static std::sync::OnceLock<Vec<(PathBuf, Vec<u8>)>>, dir: &Path, make: impl FnOnce(&Path)) {
    let files = made.get_or_init(|| {
        let scratch = tempfile::tempdir().unwrap();
        make(scratch.path());
        let mut files = vec![];
        let mut pending = vec![scratch.path().to_path_buf()];
        while let Some(folder) = pending.pop() {
            for entry in std::fs::read_dir(&folder).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    pending.push(path);
                } else {
                    files.push((path.strip_prefix(scratch.path()).unwrap().to_path_buf(), std::fs::read(&path).unwrap()));
                }
            }
        }
        files
    });
    for (name, contents) in files {
        std::fs::create_dir_all(dir.join(name).parent().unwrap()).unwrap();
        std::fs::write(dir.join(name), contents).unwrap();
    }
}

/// A reference script of tests/python kept running for the whole test
/// binary (its `--serve` mode): one import of torch and the libraries it
/// compares with, however many tests ask. Each job is one line on its
/// stdin, the job's command-line arguments as a JSON list; it answers each
/// with a line `ft-reference ok ` and what the job printed, or
/// `ft-reference error: ` and the traceback, each as a JSON string.
struct ServedScript {
    // Held so that the process lives as long as the binary (it ends when its stdin closes, at exit).
    _process: std::process::Child,
    jobs: std::process::ChildStdin,
    answers: std::io::BufReader<std::process::ChildStdout>,
    // Its stderr: an unlinked file, gone with the binary.
    log: std::fs::File,
}

impl ServedScript {
    /// Starts tests/python/`script` in its `--serve` mode under the `python` on PATH.
    fn start(script: &str) -> ServedScript {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python").join(script);
        let log = tempfile::tempfile().unwrap();
        let mut process = Command::new("python")
            .arg(&path)
            .arg("--serve")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(log.try_clone().unwrap())
            .spawn()
            .unwrap_or_else(|error| panic!("cannot run `python` ({error}): `source scripts/env.sh` first, which puts the venv's python on PATH"));
        let jobs = process.stdin.take().unwrap();
        let answers = std::io::BufReader::new(process.stdout.take().unwrap());
        ServedScript { _process: process, jobs, answers, log }
    }

    /// What the script wrote to stderr so far.
    fn log(&mut self) -> String {
        use std::io::{Read, Seek};
        let mut text = String::new();
        self.log.seek(std::io::SeekFrom::Start(0)).unwrap();
        self.log.read_to_string(&mut text).unwrap();
        text
    }
}

/// Runs a job of tests/python/`script` with `args` (as its command line
/// takes them) in the binary's one process of that script, started by the
/// first job under the `python` on PATH; returns what the job printed, and
/// panics with the script's error. A script's process takes one job at a
/// time; tests asking different scripts do not wait for one another.
pub fn reference_job(script: &str, args: &[&std::ffi::OsStr]) -> String {
    use std::io::{BufRead, Write};
    use std::sync::{Arc, Mutex};
    static SERVED: Mutex<Vec<(String, Arc<Mutex<ServedScript>>)>> = Mutex::new(Vec::new());
    // A test that failed while holding a lock leaves the processes as they were.
    let served = {
        let mut all = SERVED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match all.iter().find(|(name, _)| name == script) {
            Some((_, served)) => served.clone(),
            None => {
                let served = Arc::new(Mutex::new(ServedScript::start(script)));
                all.push((script.to_string(), served.clone()));
                served
            }
        }
    };
    let mut served = served.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let job: Vec<String> = args.iter().map(|arg| arg.to_str().unwrap().to_string()).collect();
    if writeln!(served.jobs, "{}", serde_json::to_string(&job).unwrap()).is_err() {
        panic!("{script} ended: {}", served.log());
    }
    let mut line = String::new();
    // Lines the libraries print are passed over: the answer is the line that starts with the marker.
    while !line.starts_with("ft-reference ") {
        line.clear();
        if served.answers.read_line(&mut line).unwrap() == 0 {
            panic!("{script} ended: {}", served.log());
        }
    }
    let answer = line.trim_end().trim_start_matches("ft-reference ");
    if let Some(error) = answer.strip_prefix("error: ") {
        let traceback: String = serde_json::from_str(error).unwrap_or_else(|_| error.to_string());
        panic!("{script} {job:?}:\n{traceback}\n{}", served.log());
    }
    let printed = answer.strip_prefix("ok ").unwrap_or_else(|| panic!("{script} {job:?}: answered {answer}"));
    serde_json::from_str(printed).unwrap()
}

/// Whether bitsandbytes runs 4-bit CPU kernels of its own here (0.50.2:
/// `dequantize_4bit` on a processor PyTorch runs at AVX512, the 4-bit
/// layers' forward with AVX512-BF16), which differ from its generic path
/// that ft's `nf4.rs` follows: the dequantization of a tensor whose last
/// dimension is no multiple of the block (errors of up to a whole step) and
/// FP4's signed zeros; and transformers' and peft's 4-bit models fail or
/// differ inside bitsandbytes (their forward repacks each weight for that
/// kernel, which fails on layers narrower than a block). `quantize_4bit`
/// packs there what ft packs, bit for bit. The comparisons with them are
/// skipped, and listed as such. Found on 2026-11-27 on a Sapphire
/// Rapids-class machine; CI's processor runs bitsandbytes' generic path.
pub fn bitsandbytes_runs_kernels_of_its_own() -> bool {
    // Asked once for the binary's tests, of the process that answers their bitsandbytes jobs; each skip is still listed.
    static NATIVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let native = *NATIVE.get_or_init(|| reference_job("bnb_reference.py", &["kernels".as_ref()]).trim() == "True");
    native && shared::skipped_because("bitsandbytes 0.50.2 runs 4-bit kernels of its own on this AVX512 processor")
}

/// Llama 3's chat template (tests/fixtures/chat/llama3.jinja) with a fixed
/// date in place of today's (`strftime_now`), written into `dir`: what it
/// tokenizes is the same on every day the tests run, and on both sides of
/// a midnight one of them runs across.
pub fn dated_llama3_template(dir: &Path) -> PathBuf {
    let fixture = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/llama3.jinja")).unwrap();
    let dated = fixture.replace(r#"strftime_now("%d %b %Y")"#, r#""26 Nov 2026""#);
    assert_ne!(dated, fixture, "the fixture's template reads today's date with strftime_now");
    let template = dir.join("llama3-dated.jinja");
    std::fs::write(&template, dated).unwrap();
    template
}

/// A random tiny Llama in `dir`/model with GPT-2's tokens and Llama 3's
/// chat template (dated, so its tokens are the same every day) and special tokens.
pub fn tiny_chat_llama(dir: &Path) -> PathBuf {
    // Made once for every test here (an init-model and transformers' load of the tokenizer), copied into each one's `dir`.
    static MADE: std::sync::OnceLock<Vec<(PathBuf, Vec<u8>)>> = std::sync::OnceLock::new();
    made_once(&MADE, dir, |dir| {
        let model = dir.join("model");
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/config.json");
        let output = ft()
            .args(["init-model", "--config", config.to_str().unwrap(), "--out", model.to_str().unwrap()])
            .args(["--set", "vocab_size=50304", "--set", "max_position_embeddings=256"])
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output));
        // The pairs' tokens, and so the losses compared to 1e-5 after a step at lr 1e-2, are the same on every day.
        let template = dated_llama3_template(dir);
        let gpt2 = shared::path(shared::GPT2_TOKENIZER);
        let make = ["make", gpt2.to_str().unwrap(), template.to_str().unwrap(), "<|begin_of_text|>", "<|eot_id|>", model.to_str().unwrap()];
        reference_job("chat_reference.py", &make.map(std::ffi::OsStr::new));
    });
    dir.join("model")
}
