//! The project's shared test data: `../shared` beside the repository (CI
//! has it), or the directory `FT_SHARED_DIR` names. A fresh clone may not
//! have it, so a test that reads it asks first,
//!
//! ```ignore
//! if shared::skipped_without(&[shared::SQUAD]) {
//!     return;
//! }
//! ```
//!
//! and without the files is recorded as skipped rather than failing:
//! `make test` (scripts/test.sh) says which files are missing before the
//! tests and lists the skipped tests after them. With `FT_REQUIRE_SHARED=1`
//! (CI) a missing file fails the test instead.
//!
//! Other crates' tests include this file by path, so it uses std alone.
// Each test crate compiles this module and uses part of it.
#![allow(dead_code)]

use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Every shared file a test reads (tests/shared-files.txt), which
/// scripts/test.sh checks before the tests run.
const LISTED: &str = include_str!("../shared-files.txt");

/// Real SQuAD v2.0 dev data: 5 articles, 1,407 questions.
pub const SQUAD: &str = "data/squad/squad-v2.0-dev-5-articles.json";
/// GPT-2's byte-level BPE (50,257 tokens), the tokenizer OPT uses.
pub const GPT2_TOKENIZER: &str = "data/tokenizers/gpt2/tokenizer.json";

/// The Hugging Face config.json of `model`: bloom-560m, opt-1.3b, codellama-7b or bert-base-uncased.
pub fn config(model: &str) -> String {
    format!("data/configs/{model}/config.json")
}

/// Where the shared data is: `FT_SHARED_DIR`, else `shared/` beside the repository.
pub fn dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FT_SHARED_DIR") {
        return PathBuf::from(dir);
    }
    // The crate including this module may be any of the workspace's; the repository holds Cargo.lock.
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let repository = manifest.ancestors().find(|dir| dir.join("Cargo.lock").is_file()).unwrap_or(manifest);
    repository.join("../shared")
}

/// The path of shared file `file`, which the running test made sure is
/// there with [`skipped_without`]; a test that did not fails here, saying so.
pub fn path(file: &str) -> PathBuf {
    let path = location(file);
    assert!(
        path.is_file(),
        "{} reads the shared test data {} without asking first: start it with `if shared::skipped_without(&[...]) {{ return; }}`",
        running_test(),
        path.display()
    );
    path
}

/// Where shared file `file` is, or would be; tests/shared-files.txt must list it.
fn location(file: &str) -> PathBuf {
    let listed = LISTED.lines().any(|line| line.trim() == file);
    assert!(listed, "{file} is not in tests/shared-files.txt: list every shared file a test reads there, so that `make test` says when it is missing");
    dir().join(file)
}

/// Whether the running test must be skipped because shared `files` it reads
/// are missing; if so, records it as skipped: a line in the file
/// `FT_TEST_SKIPS` names (scripts/test.sh lists them at the end), else on
/// stderr. With `FT_REQUIRE_SHARED=1` a missing file fails the test instead.
pub fn skipped_without<File: AsRef<str>>(files: &[File]) -> bool {
    let missing: Vec<String> = files.iter().map(|file| location(file.as_ref())).filter(|path| !path.is_file()).map(|path| path.display().to_string()).collect();
    if missing.is_empty() {
        return false;
    }
    let needs = format!("needs {}", missing.join(", "));
    if std::env::var_os("FT_REQUIRE_SHARED").is_some_and(|value| value == "1") {
        panic!("FT_REQUIRE_SHARED=1 and the shared test data is missing: {} ({needs})", running_test());
    }
    skipped_because(&needs)
}

/// Records the running test as skipped for `reason` (a reference it
/// compares with cannot run on this machine) and returns true: a line in
/// the file `FT_TEST_SKIPS` names (scripts/test.sh lists them at the end),
/// else on stderr.
pub fn skipped_because(reason: &str) -> bool {
    let line = format!("{} ({reason})", running_test());
    match std::env::var_os("FT_TEST_SKIPS") {
        Some(log) => {
            let mut file = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap_or_else(|e| panic!("cannot open FT_TEST_SKIPS {log:?}: {e}"));
            // One write per line: tests skip in parallel, and each appends whole lines.
            file.write_all(format!("{line}\n").as_bytes()).unwrap_or_else(|e| panic!("cannot write FT_TEST_SKIPS {log:?}: {e}"));
        }
        None => eprintln!("skipped {line}"),
    }
    true
}

/// The running test as `binary::name`: the test binary without cargo's
/// hash (`train`, `ft_data`) and the thread libtest runs it on, named after it.
fn running_test() -> String {
    let exe = std::env::current_exe().ok();
    let stem = exe.as_deref().and_then(Path::file_stem).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let binary = match stem.rsplit_once('-') {
        Some((name, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => name.to_string(),
        _ => stem,
    };
    format!("{binary}::{}", std::thread::current().name().unwrap_or("?"))
}
