//! Data as it comes from the Hugging Face Hub: Parquet and Arrow written by
//! `datasets` (tests/python/data_sources.py: `to_parquet`, `save_to_disk`,
//! a `DatasetDict`, the Hub's `data/train-0000k-of-0000n.parquet`) and a
//! JSON array of rows give `ft tokenize` the same examples as the same rows
//! in JSON lines, in every row format; `data.columns` reads other names; a
//! large Parquet file is read in bounded memory; a file of another kind is
//! named in the error; mixtures of sources take their shares in a seeded
//! order, and a run over one resumes to the uninterrupted run's losses;
//! evaluation counts its examples in every format, the log naming each
//! source's format, and a dataset directory evaluates on its own test split.

use crate::common;

use common::{ft, text};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/data_sources.py");

/// data_sources.py's job `args`, in the binary's one process of it; its standard output.
fn python(args: &[&str]) -> String {
    common::reference_job("data_sources.py", &args.iter().map(std::ffi::OsStr::new).collect::<Vec<_>>())
}

/// The demo's tokenizer (no shared files needed), in `dir`.
fn tokenizer(dir: &Path) -> PathBuf {
    ft_data::demo::write(&dir.join("demo"), 20, 5, 0).unwrap().tokenizer
}

fn tokenize(tokenizer: &Path, data: &Path, out: &Path, extra: &[&str]) -> Output {
    ft().args(["tokenize", "--tokenizer", tokenizer.to_str().unwrap(), "--train-file", data.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap()
}

/// `ft tokenize`'s lines for `data`, which must succeed.
fn examples(tokenizer: &Path, data: &Path, extra: &[&str]) -> Vec<String> {
    let out = data.with_file_name(format!("{}.tokens", data.file_name().unwrap().to_string_lossy()));
    let output = tokenize(tokenizer, data, &out, extra);
    assert!(output.status.success(), "{}: {}", data.display(), text(&output));
    std::fs::read_to_string(&out).unwrap().lines().map(String::from).collect()
}

fn write_rows(path: &Path, rows: &[serde_json::Value]) {
    std::fs::write(path, rows.iter().map(|row| row.to_string() + "\n").collect::<String>()).unwrap();
}

fn chat_template() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/chat/generation.jinja").to_string()
}

#[test]
fn parquet_arrow_and_json_arrays_read_as_the_same_rows_in_json_lines_in_every_format() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer(dir.path());
    let texts: Vec<serde_json::Value> = (0..9).map(|i| serde_json::json!({"text": format!("The capital of country {i} is Kalo{i}; its river is long.")})).collect();
    let pairs: Vec<serde_json::Value> =
        (0..9).map(|i| serde_json::json!({"prompt": format!("Where is river {i}?"), "completion": format!(" In Mira{i}, near the sea.")})).collect();
    let conversations = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/chat/conversations.jsonl")).unwrap();
    let conversations: Vec<serde_json::Value> = conversations.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let template = chat_template();
    let cases: [(&str, &[serde_json::Value], Vec<&str>); 3] = [
        ("text", &texts, vec!["--max-seq-len", "16"]),
        ("pairs", &pairs, vec![]),
        ("chat", &conversations, vec!["--chat-template", &template, "--set", "data.train_on=all"]),
    ];
    for (name, rows, flags) in cases {
        let out = dir.path().join(name);
        std::fs::create_dir(&out).unwrap();
        let jsonl = out.join("rows.jsonl");
        write_rows(&jsonl, rows);
        python(&["write", jsonl.to_str().unwrap(), out.to_str().unwrap()]);
        let expected = examples(&tokenizer, &jsonl, &flags);
        assert!(!expected.is_empty());
        let glob = out.join("hub/data/train-*.parquet");
        for source in [out.join("rows.parquet"), out.join("saved"), out.join("dict"), out.join("hub"), glob, out.join("rows.json")] {
            assert_eq!(examples(&tokenizer, &source, &flags), expected, "{name}: {}", source.display());
        }
        // A split by name; the rows of a range (prompt/completion and chat: rows; text: sequences).
        let two_rows = out.join("two.jsonl");
        write_rows(&two_rows, &rows[..2]);
        let test_split = [flags.as_slice(), &["--set", "data.split=test"]].concat();
        let first_two = examples(&tokenizer, &two_rows, &flags);
        assert_eq!(examples(&tokenizer, &out.join("dict"), &test_split), first_two, "{name}");
        assert_eq!(examples(&tokenizer, &out.join("hub"), &test_split), first_two, "{name}");
        let ranged = [flags.as_slice(), &["--set", "data.range=1:3"]].concat();
        assert_eq!(examples(&tokenizer, &out.join("saved"), &ranged), examples(&tokenizer, &jsonl, &ranged), "{name}");
    }
}

#[test]
fn columns_read_other_names_and_an_unknown_column_lists_the_files_columns() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer(dir.path());
    let rows: Vec<serde_json::Value> = (0..6).map(|i| serde_json::json!({"id": i, "abstract": format!("We study country {i} and its capital.")})).collect();
    let texts: Vec<serde_json::Value> = rows.iter().map(|row| serde_json::json!({"text": row["abstract"]})).collect();
    let (jsonl, plain) = (dir.path().join("rows.jsonl"), dir.path().join("texts.jsonl"));
    write_rows(&jsonl, &rows);
    write_rows(&plain, &texts);
    python(&["write", jsonl.to_str().unwrap(), dir.path().to_str().unwrap()]);
    let expected = examples(&tokenizer, &plain, &["--max-seq-len", "16"]);
    for source in [&jsonl, &dir.path().join("rows.parquet"), &dir.path().join("saved")] {
        assert_eq!(examples(&tokenizer, source, &["--max-seq-len", "16", "--set", "data.columns.text=abstract"]), expected, "{}", source.display());
        let output = tokenize(&tokenizer, source, &dir.path().join("x"), &["--set", "data.columns.text=summary"]);
        let log = text(&output);
        assert!(!output.status.success() && log.contains("no column `summary` (data.columns.text); its columns: `id`, `abstract`"), "{log}");
    }
    // Without the mapping, the error says which columns there are and how to map one.
    let output = tokenize(&tokenizer, &dir.path().join("rows.parquet"), &dir.path().join("x"), &[]);
    let log = text(&output);
    assert!(!output.status.success() && log.contains("rows.parquet row 0: neither") && log.contains("its columns: `id`, `abstract`") && log.contains("data.columns"), "{log}");
}

#[test]
fn a_file_of_another_kind_or_a_missing_split_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer(dir.path());
    let jsonl = dir.path().join("rows.jsonl");
    write_rows(&jsonl, &[serde_json::json!({"text": "one"}), serde_json::json!({"text": "two"})]);
    python(&["write", jsonl.to_str().unwrap(), dir.path().to_str().unwrap()]);
    let fails = |data: &Path, extra: &[&str], expected: &[&str]| {
        let output = tokenize(&tokenizer, data, &dir.path().join("x"), extra);
        let log = text(&output);
        assert!(!output.status.success() && expected.iter().all(|e| log.contains(e)), "{}: {log}", data.display());
        assert!(!log.contains("panicked"), "{log}");
    };
    let renamed = dir.path().join("rows-jsonl.parquet");
    std::fs::copy(&jsonl, &renamed).unwrap();
    fails(&renamed, &[], &["rows-jsonl.parquet is not a Parquet file"]);
    let arrow = dir.path().join("rows.arrow");
    std::fs::copy(&jsonl, &arrow).unwrap();
    fails(&arrow, &[], &["rows.arrow is not an Arrow file"]);
    let gz = dir.path().join("rows.jsonl.gz");
    std::fs::write(&gz, b"\x1f\x8b\x08\x00\x00\x00\x00\x00").unwrap();
    fails(&gz, &[], &["rows.jsonl.gz is a gzip-compressed file"]);
    let binary = dir.path().join("weights.bin");
    std::fs::write(&binary, [0u8, 159, 146, 150, 10, 10, 255]).unwrap();
    fails(&binary, &[], &["weights.bin line 1: not UTF-8 text"]);
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    fails(&empty, &[], &["holds no data files (Parquet, Arrow or JSON lines)"]);
    fails(&dir.path().join("dict"), &["--set", "data.split=validation"], &["data.split=validation", "has no split `validation`; its splits: `train`, `test`"]);
    fails(&dir.path().join("rows.parquet"), &["--set", "data.split=train"], &["data.split=train", "rows.parquet is a file without splits"]);
    fails(&dir.path().join("rows.parquet"), &["--set", "data.format=squad"], &["data.format=squad reads SQuAD JSON files", "rows.parquet is a Parquet file"]);
    fails(&dir.path().join("nothing-*.parquet"), &[], &["no file matches"]);
    // The source is read from the file, the format names what its rows hold.
    fails(&dir.path().join("rows.parquet"), &["--set", "data.format=parquet"], &["data.format", "auto", "prompt_completion", "chat"]);
}

/// A Parquet file of many rows in many row groups (120,000 rows, 12 row
/// groups, 116 MB of text) is read a record batch at a time: the peak
/// memory of `ft tokenize` over a slice at its end exceeds that over a
/// small file's by far less than the large file's text.
#[test]
fn a_large_parquet_file_is_read_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer(dir.path());
    let (large, small) = (dir.path().join("large.parquet"), dir.path().join("small.parquet"));
    let rows = 120_000;
    let text_bytes: u64 = python(&["big", large.to_str().unwrap(), &rows.to_string()]).trim().parse().unwrap();
    python(&["big", small.to_str().unwrap(), "2000"]);
    let peak = |data: &Path, range: &str| -> u64 {
        let out = dir.path().join("tokens.jsonl");
        let args = ["tokenize", "--tokenizer", tokenizer.to_str().unwrap(), "--train-file", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-seq-len", "4096"];
        let mut command = Command::new("python");
        command.arg(SCRIPT).arg("peak").arg(common::FT).args(args).args(["--set", &format!("data.range={range}")]);
        let output = common::without_launcher_env(&mut command).output().unwrap();
        let log = text(&output);
        assert!(output.status.success(), "{log}");
        assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 1000, "{log}");
        let peak = log.split("peak_kib ").nth(1).and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok());
        peak.unwrap_or_else(|| panic!("{log}")) * 1024
    };
    let (at_the_end, baseline) = (peak(&large, &format!("{}:{rows}", rows - 1000)), peak(&small, "1000:2000"));
    eprintln!("peak {at_the_end} B over the large file's last 1000 rows, {baseline} B over the small file's; {text_bytes} B of text");
    assert!(at_the_end < baseline + text_bytes / 4, "peak {at_the_end} B vs {baseline} B for a small file: the {text_bytes} B of text were held");
}

/// Rows `{"prompt", "completion"}` whose completion says which source they are from.
fn labelled_rows(name: &str, count: usize) -> Vec<serde_json::Value> {
    (0..count).map(|i| serde_json::json!({"prompt": format!("Name {i}:"), "completion": format!(" {name} {i}")})).collect()
}

#[test]
fn a_mixture_takes_its_weights_shares_in_a_seeded_order() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = tokenizer(dir.path());
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    write_rows(&a, &labelled_rows("alpha", 200));
    write_rows(&b, &labelled_rows("beta", 200));
    // One source as Parquet: each source is read as what it is.
    python(&["write", b.to_str().unwrap(), dir.path().to_str().unwrap()]);
    let b_parquet = dir.path().join("rows.parquet");
    let (alone_a, alone_b) = (examples(&tokenizer, &a, &[]), examples(&tokenizer, &b, &[]));
    let config = dir.path().join("mixture.toml");
    let toml = format!("[[data.mixture]]\npath = {a:?}\nweight = 3\n\n[[data.mixture]]\npath = {b_parquet:?}\nweight = 1\n");
    std::fs::write(&config, toml).unwrap();
    let mixed = |extra: &[&str]| {
        let out = dir.path().join("mixed.jsonl");
        let output = ft()
            .args(["tokenize", "--config", config.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap(), "--out", out.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output));
        (std::fs::read_to_string(&out).unwrap().lines().map(String::from).collect::<Vec<_>>(), text(&output))
    };
    let (first, log) = mixed(&[]);
    assert!(log.contains("data.mixture: 400 examples in a seeded order") && log.contains("75.0%") && log.contains("25.0%"), "{log}");
    let from_a: Vec<&String> = first.iter().filter(|e| alone_a.contains(e)).collect();
    let from_b: Vec<&String> = first.iter().filter(|e| alone_b.contains(e)).collect();
    assert_eq!(from_a.len() + from_b.len(), first.len());
    let share = from_a.len() as f64 / first.len() as f64;
    let sampling_error = (0.75 * 0.25 / first.len() as f64).sqrt();
    assert!((share - 0.75).abs() <= 3.0 * sampling_error, "{share}");
    // Each source in its own order (a's 200 examples 1.5 times over, b's first 100).
    let a_order: Vec<&String> = alone_a.iter().cycle().take(from_a.len()).collect();
    assert_eq!(from_a, a_order);
    assert_eq!(from_b, alone_b.iter().take(from_b.len()).collect::<Vec<_>>());
    // Interleaved, not one after the other; the same seed the same order, another seed another.
    assert!(first[..100].iter().any(|e| alone_b.contains(e)) && first[300..].iter().any(|e| alone_a.contains(e)));
    assert_eq!(mixed(&[]).0, first);
    let (other, _) = mixed(&["--set", "train.seed=1"]);
    assert_ne!(other, first);
    assert_eq!(other.iter().filter(|e| alone_a.contains(e)).count(), from_a.len());
    // data.range counts the mixture's examples.
    assert_eq!(mixed(&["--set", "data.range=100:150"]).0, first[100..150]);
    // Several --train-file: each source's examples once.
    let out = dir.path().join("both.jsonl");
    let output = ft()
        .args(["tokenize", "--tokenizer", tokenizer.to_str().unwrap(), "--train-file", a.to_str().unwrap(), "--train-file", b_parquet.to_str().unwrap()])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let both: Vec<String> = std::fs::read_to_string(&out).unwrap().lines().map(String::from).collect();
    assert_eq!((both.len(), both.iter().filter(|e| alone_a.contains(e)).count()), (400, 200));
}

/// Each optimizer step's number and loss in `dir`'s metrics.jsonl.
fn step_losses(dir: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter_map(|record| Some((record.get("step")?.as_u64()?, record.get("loss")?.as_f64()?)))
        .collect()
}

/// A run over a mixture killed after step 7 resumes from its checkpoint to
/// the losses of the run that was never stopped (the demo's BLOOM, one CPU
/// rank): the mixture's order is the seed's, so the checkpoint's data
/// cursor finds the same examples.
#[test]
fn a_run_over_a_mixture_resumes_to_the_uninterrupted_runs_losses() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    write_rows(&a, &labelled_rows("alpha", 40));
    write_rows(&b, &labelled_rows("beta", 40));
    let mixture = format!(r#"data.mixture=[{{"path": {a:?}, "weight": 3}}, {{"path": {b:?}, "weight": 1}}]"#);
    let train = |out: &Path| {
        let mut command = ft();
        command
            .args(["train", "--output-dir", out.to_str().unwrap(), "--nproc-per-node", "1", "--epochs", "1", "--batch-size", "4", "--max-seq-len", "32"])
            .args(["--eval-file", a.to_str().unwrap(), "--eval-samples", "4", "--save-every", "3", "--save-total-limit", "0", "--set", &mixture]);
        command
    };
    let whole = dir.path().join("whole");
    let output = train(&whole).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let expected: Vec<f64> = step_losses(&whole).into_iter().map(|(_, loss)| loss).collect();
    // 80 examples (a's 40 1.5 times, b's first 20), 4 a step.
    assert_eq!(expected.len(), 20);
    let killed = dir.path().join("killed");
    let output = train(&killed).env("FT_FAULT_INJECT", "after-step:7").output().unwrap();
    assert!(!output.status.success() && text(&output).contains("FT_FAULT_INJECT: aborting"), "{}", text(&output));
    let output = train(&killed).args(["--resume", "latest"]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    // Every step recorded, before the crash and after the resume (from
    // step 6's checkpoint, or step 3's if 6's files were not all written), has the uninterrupted run's loss.
    let records = step_losses(&killed);
    assert_eq!(records.last().map(|(step, _)| *step), Some(20), "{records:?}");
    assert!(records[7..].iter().all(|(step, _)| *step > 3), "the second run started afresh: {records:?}");
    for (step, loss) in records {
        assert_eq!(loss, expected[step as usize - 1], "step {step}");
    }
}

/// The demo's tiny BLOOM, untrained, with the demo's tokenizer, in
/// `dir`/model (made once for this binary).
fn demo_model(dir: &Path) -> PathBuf {
    static MADE: std::sync::OnceLock<Vec<(PathBuf, Vec<u8>)>> = std::sync::OnceLock::new();
    common::made_once(&MADE, dir, |scratch| {
        let [config, _, tokenizer] = common::demo_files(scratch);
        let output = ft().args(["init-model", "--config", config.to_str().unwrap(), "--out", scratch.join("model").to_str().unwrap()]).output().unwrap();
        assert!(output.status.success(), "{}", text(&output));
        std::fs::copy(tokenizer, scratch.join("model/tokenizer.json")).unwrap();
    });
    dir.join("model")
}

/// `ft eval` of `model` on `file` at `ranks` ranks with `extra` flags: its
/// eval_results.json and its log.
fn eval(model: &Path, file: &Path, ranks: usize, extra: &[&str]) -> (serde_json::Value, String) {
    let out = file.with_extension(format!("eval-{ranks}"));
    let output = ft()
        .args(["eval", "--model", model.to_str().unwrap(), "--eval-file", file.to_str().unwrap(), "--device", "cpu", "--max-seq-len", "128"])
        .args(["--nproc-per-node", &ranks.to_string(), "--output-dir", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    let log = text(&output);
    assert!(output.status.success(), "{}: {log}", file.display());
    (serde_json::from_str(&std::fs::read_to_string(out.join("eval_results.json")).unwrap()).unwrap(), log)
}

/// Evaluation counts the examples it evaluates over all ranks in every
/// format a causal LM reads — the loss's examples (a row's, text's
/// sequences), or SQuAD's questions, whose generated answers are scored —
/// the same on one rank as on two; and the log gives each source one line,
/// rank 0's, naming the format it detected and the source's rows.
#[test]
fn evaluation_counts_its_examples_in_every_format_and_the_log_names_the_format() {
    let dir = tempfile::tempdir().unwrap();
    let model = demo_model(dir.path());
    let five = |row: &dyn Fn(usize) -> serde_json::Value| (0..5).map(row).collect::<Vec<_>>();
    let template = chat_template();
    let chat_flags = ["--chat-template", template.as_str()];
    let cases: [(&str, Vec<serde_json::Value>, &[&str]); 5] = [
        ("text", five(&|i| serde_json::json!({"text": format!("The capital of country {i} is Kalo{i}; its river is long and its hills are green.")})), &[]),
        ("prompt/completion", five(&|i| serde_json::json!({"prompt": format!("Where is river {i}?"), "completion": format!(" In Mira{i}.")})), &[]),
        ("Alpaca", five(&|i| serde_json::json!({"instruction": format!("Name river {i}."), "input": "", "output": format!("Mira{i}")})), &[]),
        (
            "chat",
            five(&|i| serde_json::json!({"messages": [{"role": "user", "content": format!("Where is river {i}?")}, {"role": "assistant", "content": format!("In Mira{i}.")}]})),
            &chat_flags,
        ),
        (
            "ShareGPT",
            five(&|i| serde_json::json!({"conversations": [{"from": "human", "value": format!("Where is river {i}?")}, {"from": "gpt", "value": format!("In Mira{i}.")}]})),
            &chat_flags,
        ),
    ];
    for (format, rows, flags) in cases {
        let file = dir.path().join(format!("{}.jsonl", format.replace('/', "-")));
        write_rows(&file, &rows);
        let (results, log) = eval(&model, &file, 2, flags);
        let said = format!("{}: {format} data (detected), 5 ", file.display());
        let lines: Vec<&str> = log.lines().filter(|line| line.contains(&said)).collect();
        assert_eq!(lines.len(), 1, "{format}: one line, rank 0's: {log}");
        // Text's 5 documents make the sequences the line counts; a row format's rows one example each.
        let expected: u64 = match format {
            "text" => lines[0].split("documents: ").nth(1).and_then(|rest| rest.split_whitespace().next()?.parse().ok()).unwrap_or_else(|| panic!("{log}")),
            _ => 5,
        };
        assert_eq!(results["eval_samples"], expected, "{format}: {results}");
        assert!(results["eval_samples_per_second"].as_f64().is_some_and(|rate| rate > 0.0), "{format}: {results}");
        assert!(log.contains(&format!("eval loss {:.4} over {expected} examples", results["eval_loss"].as_f64().unwrap())), "{format}: {log}");
        if format == "text" {
            assert_eq!(eval(&model, &file, 1, flags).0["eval_samples"], expected, "one rank");
        }
    }
    // SQuAD: the questions answered and scored, on one rank and on two.
    let squad = dir.path().join("demo/demo-eval.json");
    let file: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&squad).unwrap()).unwrap();
    let questions: usize = file["data"].as_array().unwrap().iter().flat_map(|a| a["paragraphs"].as_array().unwrap()).map(|p| p["qas"].as_array().unwrap().len()).sum();
    for ranks in [1, 2] {
        let (results, log) = eval(&model, &squad, ranks, &["--set", "task.max_new_tokens=2"]);
        assert_eq!(results["eval_samples"], questions, "{ranks} rank(s): {results}");
        assert!(results.get("eval_f1").is_some() && log.contains("SQuAD data (detected)"), "{log}");
    }
}

/// Without `--eval-file`, a dataset directory evaluates on its own
/// validation or test split and the log says so; a directory whose other
/// split has another name is refused, naming the flags that choose.
#[test]
fn a_dataset_directory_evaluates_on_its_test_split_when_no_eval_file_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let jsonl = dir.path().join("rows.jsonl");
    write_rows(&jsonl, &labelled_rows("alpha", 8));
    python(&["write", jsonl.to_str().unwrap(), dir.path().to_str().unwrap()]);
    let train = |data: &Path, name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let output = ft()
            .args(["train", "--train-file", data.to_str().unwrap(), "--output-dir", out.to_str().unwrap(), "--nproc-per-node", "1", "--max-steps", "1"])
            .args(["--batch-size", "4", "--max-seq-len", "32", "--report-to", "jsonl"])
            .args(extra)
            .output()
            .unwrap();
        (output.status.success(), out, text(&output))
    };
    let evaluated = |out: &Path| -> Vec<serde_json::Value> {
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        metrics.lines().map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap()).filter(|record| record.get("eval_loss").is_some()).collect()
    };
    // The demo model's runs: the user's data evaluates on its own split, not on the demo's file.
    for layout in ["dict", "hub"] {
        let (ok, out, log) = train(&dir.path().join(layout), layout, &[]);
        assert!(ok, "{log}");
        assert!(log.contains(&format!("no --eval-file: evaluating on the `test` split of {}", dir.path().join(layout).display())), "{log}");
        let records = evaluated(&out);
        assert_eq!(records.len(), 1, "{records:?}");
        assert_eq!(records[0]["eval_samples"], 2.0, "the test split's two rows: {records:?}");
        assert!(common::summary(&out)["eval_samples_per_s"].as_f64().is_some_and(|rate| rate > 0.0));
    }
    let other = dir.path().join("other/data");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::copy(dir.path().join("hub/data/train-00000-of-00002.parquet"), other.join("train-00000-of-00001.parquet")).unwrap();
    std::fs::copy(dir.path().join("hub/data/test-00000-of-00001.parquet"), other.join("heldout-00000-of-00001.parquet")).unwrap();
    let (ok, _, log) = train(&dir.path().join("other"), "other", &[]);
    assert!(!ok && log.contains("has the splits `heldout` besides the one trained on") && log.contains("--set data.eval_split=NAME") && log.contains("--eval-file"), "{log}");
    let (ok, out, log) = train(&dir.path().join("other"), "chosen", &["--set", "data.eval_split=heldout"]);
    assert!(ok && log.contains("evaluating on the `heldout` split"), "{log}");
    assert_eq!(evaluated(&out)[0]["eval_samples"], 2.0);
}
