//! Reward functions for online RL (GRPO): the user's Python functions,
//! called with TRL's signature, and built-ins that need no Python.
//!
//! A Python function (`FILE.py:FUNCTION`) is called as TRL 1.16's
//! `GRPOTrainer._calculate_rewards` calls it:
//! `func(prompts=…, completions=…, completion_ids=…, **columns,
//! trainer_state=…, log_extra=…, log_metric=…)`, once per batch, and returns
//! one float per completion, or None where it does not apply (NaN is read as
//! None, as TRL reads None as NaN). `trainer_state` has transformers'
//! `TrainerState` fields `global_step`, `max_steps` and `epoch`;
//! `log_metric(name, value)` and `log_extra(column, values)` are collected
//! and returned with the batch's rewards ([`RewardScores`]). Every function
//! runs in one long-lived Python child (`FT_PYTHON`, else `python3`),
//! started only when a Python function is named, which imports them all
//! before training, so a missing function or a syntax error stops the run
//! at once with its traceback. Its protocol (rewards.py) is JSON lines
//! over pipes the user's code cannot reach.
//!
//! Built-ins: `accuracy` (the completion's final answer against the row's
//! `answer` or `solution` column), `format` (TRL's `think_format_reward`, or
//! the regex `task.format_pattern`, matched as Python's `re.match` with
//! DOTALL and MULTILINE), `length` (TRL's `get_soft_overlong_punishment`
//! with `task.max_completion_len` and `task.soft_punish_cache`). A
//! conversational completion's text is its first message's content, as
//! TRL's built-ins read it.

use anyhow::{bail, Context as _, Result};
use fancy_regex::Regex;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

const CHILD_SCRIPT: &str = include_str!("rewards.py");
const BUILT_INS: &str = "accuracy, format, length";
/// TRL's `think_format_reward` pattern (trl/rewards/format_rewards.py), matched with re.DOTALL | re.MULTILINE.
pub const THINK_FORMAT_PATTERN: &str = r"^<think>(?!.*<think>)(.*?)</think>.*$";
/// The keyword arguments TRL passes itself, which no dataset column may take.
const RESERVED_KEYWORDS: [&str; 6] = ["prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"];
/// How long a child whose input is closed gets to end on its own (its atexit handlers) before it is killed.
const CHILD_EXIT_GRACE: Duration = Duration::from_secs(2);

/// One reward function, as `--reward` names it.
#[derive(Debug, Clone, PartialEq)]
pub enum RewardSpec {
    /// `FILE.py:FUNCTION`.
    Python { file: PathBuf, function: String },
    Accuracy,
    Format,
    Length,
}

impl FromStr for RewardSpec {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<RewardSpec> {
        match text {
            "accuracy" => return Ok(RewardSpec::Accuracy),
            "format" => return Ok(RewardSpec::Format),
            "length" => return Ok(RewardSpec::Length),
            _ => {}
        }
        let Some((file, function)) = text.rsplit_once(':') else {
            bail!("reward `{text}`: expected FILE.py:FUNCTION or one of {BUILT_INS}");
        };
        if !file.ends_with(".py") {
            bail!("reward `{text}`: expected FILE.py:FUNCTION or one of {BUILT_INS} (`{file}` is no .py file)");
        }
        let mut characters = function.chars();
        let identifier = characters.next().is_some_and(|first| first == '_' || first.is_alphabetic()) && characters.all(|c| c == '_' || c.is_alphanumeric());
        if !identifier {
            bail!("reward `{text}`: expected FILE.py:FUNCTION or one of {BUILT_INS} (`{function}` is no Python function name)");
        }
        let file = PathBuf::from(file);
        if !file.is_file() {
            bail!("reward `{text}`: no such file {}", file.display());
        }
        Ok(RewardSpec::Python { file, function: function.to_string() })
    }
}

impl fmt::Display for RewardSpec {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            RewardSpec::Python { file, function } => write!(f, "{}:{function}", file.display()),
            RewardSpec::Accuracy => f.write_str("accuracy"),
            RewardSpec::Format => f.write_str("format"),
            RewardSpec::Length => f.write_str("length"),
        }
    }
}

/// The built-ins' settings, from task keys of the same names.
#[derive(Debug, Clone, Default)]
pub struct RewardOptions {
    /// `format`'s regex; TRL's [`THINK_FORMAT_PATTERN`] when unset.
    pub format_pattern: Option<String>,
    /// `length`'s L_max and L_cache (TRL's `get_soft_overlong_punishment` arguments).
    pub max_completion_len: Option<usize>,
    pub soft_punish_cache: Option<usize>,
}

/// What `trainer_state` shows a reward function: the fields of transformers' `TrainerState` a reward shapes by.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct TrainerState {
    pub global_step: u64,
    pub max_steps: u64,
    pub epoch: f64,
}

/// One rank's completions to score, as TRL passes them.
pub struct RewardBatch<'a> {
    /// Text, or a list of `{role, content}` messages (conversational), one per completion.
    pub prompts: &'a [Value],
    /// Text, or `[{"role": "assistant", "content": …}]` for conversational prompts.
    pub completions: &'a [Value],
    pub completion_ids: &'a [Vec<i64>],
    /// The dataset's other columns (not `prompt`), one value per completion.
    pub columns: &'a BTreeMap<String, Vec<Value>>,
    pub trainer_state: TrainerState,
}

/// A batch's rewards and what the functions logged.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RewardScores {
    /// `[function][completion]`; None where the function does not apply (TRL's NaN).
    pub rewards: Vec<Vec<Option<f64>>>,
    /// `log_metric(name, value)` calls, in order: TRL averages them over the logging step.
    pub metrics: BTreeMap<String, Vec<f64>>,
    /// `log_extra(column, values)` calls: columns of the completions' log.
    pub extra_columns: BTreeMap<String, Vec<Value>>,
}

/// How one function is computed.
enum Function {
    /// The child's next function.
    Python,
    Accuracy,
    Format(Regex),
    Length { max_completion_len: usize, soft_punish_cache: usize },
}

/// The run's reward functions, in the order given.
pub struct Rewards {
    specs: Vec<RewardSpec>,
    names: Vec<String>,
    functions: Vec<Function>,
    child: Option<Child>,
}

impl Rewards {
    /// Prepares `specs`: compiles the built-ins' settings and, when a
    /// Python function is named, starts the child (FT_PYTHON, else python3) and imports them all.
    pub fn start(specs: &[RewardSpec], options: &RewardOptions) -> Result<Rewards> {
        let python = std::env::var("FT_PYTHON").ok().filter(|program| !program.is_empty()).unwrap_or_else(|| "python3".to_string());
        Rewards::start_under(&python, specs, options)
    }

    /// `start` with the child run by `python`.
    fn start_under(python: &str, specs: &[RewardSpec], options: &RewardOptions) -> Result<Rewards> {
        if specs.is_empty() {
            bail!("no reward function: name one with --reward FILE.py:FUNCTION or one of {BUILT_INS}");
        }
        let named = |spec: &RewardSpec| specs.contains(spec);
        if options.format_pattern.is_some() && !named(&RewardSpec::Format) {
            bail!("task.format_pattern is set but no `format` reward is named: add --reward format, or unset it (a preset's too) with --set task.format_pattern=null");
        }
        for (key, value) in [("max_completion_len", options.max_completion_len), ("soft_punish_cache", options.soft_punish_cache)] {
            if value.is_some() && !named(&RewardSpec::Length) {
                bail!("task.{key} is set but no `length` reward is named (--reward length)");
            }
        }
        let python_functions = python_specs(specs);
        let (child, python_names) = match python_functions.is_empty() {
            true => (None, vec![]),
            false => {
                let mut child = Child::start(python)?;
                let load: Vec<Value> = specs
                    .iter()
                    .filter_map(|spec| match spec {
                        RewardSpec::Python { file, function } => Some(json!([file, function])),
                        _ => None,
                    })
                    .collect();
                let answer = child.ask(&json!({ "load": load }), "importing the reward functions", &python_functions)?;
                let names: Vec<String> = serde_json::from_value(answer["names"].clone()).context("the reward child's names")?;
                (Some(child), names)
            }
        };
        let mut python_names = python_names.into_iter();
        let (mut names, mut functions) = (vec![], vec![]);
        for spec in specs {
            let function = match spec {
                RewardSpec::Python { .. } => Function::Python,
                RewardSpec::Accuracy => Function::Accuracy,
                RewardSpec::Format => {
                    let pattern = options.format_pattern.as_deref().unwrap_or(THINK_FORMAT_PATTERN);
                    let invalid = || format!("task.format_pattern `{pattern}` is no valid regular expression");
                    // Alone first: wrapped, a stray `)` in it could still compile.
                    Regex::new(pattern).with_context(invalid)?;
                    // re.match(pattern, text, re.DOTALL | re.MULTILINE): anchored at the start only.
                    let regex = Regex::new(&format!(r"(?sm)\A(?:{pattern})")).with_context(invalid)?;
                    Function::Format(regex)
                }
                RewardSpec::Length => {
                    let (Some(max_completion_len), Some(soft_punish_cache)) = (options.max_completion_len, options.soft_punish_cache) else {
                        bail!("the `length` reward needs task.max_completion_len and task.soft_punish_cache (TRL's get_soft_overlong_punishment arguments)");
                    };
                    if soft_punish_cache > max_completion_len {
                        bail!("task.soft_punish_cache ({soft_punish_cache}) is more than task.max_completion_len ({max_completion_len})");
                    }
                    Function::Length { max_completion_len, soft_punish_cache }
                }
            };
            names.push(match function {
                Function::Python => python_names.next().context("the reward child named fewer functions than it imported")?,
                _ => spec.to_string(),
            });
            functions.push(function);
        }
        for (index, name) in names.iter().enumerate() {
            if let Some(earlier) = names[..index].iter().position(|other| other == name) {
                bail!("reward functions {} and {} are both named `{name}`: their logs (rewards/{name}/…) would mix; rename one", specs[earlier], specs[index]);
            }
        }
        Ok(Rewards { specs: specs.to_vec(), names, functions, child })
    }

    /// Each function's name as TRL logs it (`rewards/NAME/mean`): a Python function's `__name__`, a built-in's name.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Scores every completion of `batch` with every function: one call of each Python function for the whole batch.
    pub fn score(&mut self, batch: &RewardBatch) -> Result<RewardScores> {
        let count = batch.completions.len();
        if batch.prompts.len() != count || batch.completion_ids.len() != count {
            bail!("a reward batch has {} prompts, {count} completions and {} completion_ids: one each per completion", batch.prompts.len(), batch.completion_ids.len());
        }
        for (column, values) in batch.columns {
            if RESERVED_KEYWORDS.contains(&column.as_str()) {
                bail!("the dataset's column `{column}` would take the place of TRL's keyword of that name in the reward functions' call; rename it");
            }
            if values.len() != count {
                bail!("the reward batch's column `{column}` has {} values for {count} completions", values.len());
            }
        }
        let mut scores = RewardScores::default();
        let mut python_rewards = vec![].into_iter();
        if let Some(child) = &mut self.child {
            let message = json!({ "score": {
                "prompts": batch.prompts,
                "completions": batch.completions,
                "completion_ids": batch.completion_ids,
                "columns": batch.columns,
                "trainer_state": batch.trainer_state,
            }});
            let answer = child.ask(&message, "scoring", &python_specs(&self.specs))?;
            let rewards: Vec<Vec<Option<f64>>> = serde_json::from_value(answer["rewards"].clone()).context("the reward child's rewards")?;
            python_rewards = rewards.into_iter();
            scores.metrics = serde_json::from_value(answer["metrics"].clone()).context("the reward child's metrics")?;
            scores.extra_columns = serde_json::from_value(answer["extra"].clone()).context("the reward child's extra columns")?;
        }
        for (spec, function) in self.specs.iter().zip(&self.functions) {
            let rewards = match function {
                Function::Python => python_rewards.next().context("the reward child scored fewer functions than it imported")?,
                Function::Accuracy => accuracy(batch).with_context(|| format!("reward `{spec}`"))?,
                Function::Format(regex) => {
                    let texts = batch.completions.iter().map(completion_text).collect::<Result<Vec<_>>>().with_context(|| format!("reward `{spec}`"))?;
                    texts.iter().map(|text| Ok(Some(if regex.is_match(text)? { 1.0 } else { 0.0 }))).collect::<Result<_>>().with_context(|| format!("reward `{spec}`"))?
                }
                Function::Length { max_completion_len, soft_punish_cache } => batch.completion_ids.iter().map(|ids| Some(soft_overlong_punishment(ids.len(), *max_completion_len, *soft_punish_cache))).collect(),
            };
            scores.rewards.push(rewards);
        }
        Ok(scores)
    }
}

/// The Python functions among `specs`, in order: the child's functions.
fn python_specs(specs: &[RewardSpec]) -> Vec<&RewardSpec> {
    specs.iter().filter(|spec| matches!(spec, RewardSpec::Python { .. })).collect()
}

/// TRL's `_SoftOverlongPunishment` for one completion of `length` tokens.
fn soft_overlong_punishment(length: usize, max_completion_len: usize, soft_punish_cache: usize) -> f64 {
    let threshold = max_completion_len - soft_punish_cache;
    if length <= threshold {
        0.0
    } else if length <= max_completion_len {
        (threshold as f64 - length as f64) / soft_punish_cache as f64
    } else {
        -1.0
    }
}

/// The text of a completion: itself, or a conversational completion's first message's content.
fn completion_text(completion: &Value) -> Result<&str> {
    match completion {
        Value::String(text) => Ok(text),
        Value::Array(messages) => messages.first().and_then(|message| message["content"].as_str()).with_context(|| format!("a conversational completion's first message has no text content: {completion}")),
        _ => bail!("a completion is text or a list of messages, not {completion}"),
    }
}

/// `accuracy` over a batch: 1.0 where the completion's final answer is the row's, None where the row has none.
fn accuracy(batch: &RewardBatch) -> Result<Vec<Option<f64>>> {
    let Some(golds) = batch.columns.get("answer").or_else(|| batch.columns.get("solution")) else {
        bail!("needs the dataset's `answer` or `solution` column, and it has neither (its columns: {:?})", batch.columns.keys().collect::<Vec<_>>());
    };
    batch
        .completions
        .iter()
        .zip(golds)
        .map(|(completion, gold)| {
            let gold = match gold {
                Value::Null => return Ok(None),
                Value::String(text) => final_answer(text).unwrap_or(text).trim().to_string(),
                Value::Number(number) => number.to_string(),
                _ => bail!("an answer is text or a number, not {gold}"),
            };
            if gold.is_empty() {
                return Ok(None);
            }
            let text = completion_text(completion)?;
            let answer = final_answer(text).or_else(|| last_number(text));
            Ok(Some(if answer.is_some_and(|answer| same_answer(answer, &gold)) { 1.0 } else { 0.0 }))
        })
        .collect()
}

/// The content of the last balanced `\boxed{…}`, else the line after the last `####`.
fn final_answer(text: &str) -> Option<&str> {
    let boxed = text.match_indices(r"\boxed{").filter_map(|(start, opening)| {
        let content = start + opening.len();
        let mut depth = 1;
        for (offset, character) in text[content..].char_indices() {
            match character {
                '{' => depth += 1,
                '}' if depth == 1 => return Some(&text[content..content + offset]),
                '}' => depth -= 1,
                _ => {}
            }
        }
        None
    });
    boxed.last().or_else(|| text.rsplit_once("####").map(|(_, after)| after.lines().next().unwrap_or("")))
}

/// The last number in `text` (digits with thousands' commas and decimals).
fn last_number(text: &str) -> Option<&str> {
    static NUMBER: std::sync::LazyLock<Regex> = std::sync::LazyLock::new(|| Regex::new(r"-?\d[\d,]*(?:\.\d+)?").expect("a valid pattern"));
    NUMBER.find_iter(text).filter_map(|found| found.ok()).last().map(|found| found.as_str())
}

/// Whether two answers are the same once trimmed and without `$`: as numbers when both are ("7.0" and "7", "1,000" and "1000"), else as text.
fn same_answer(a: &str, b: &str) -> bool {
    let normal = |text: &str| text.replace('$', "").trim().to_string();
    let (a, b) = (normal(a), normal(b));
    let number = |text: &str| {
        let digits = text.replace(',', "");
        let numeric = !digits.is_empty() && digits.trim_start_matches(['-', '+']).chars().all(|c| c.is_ascii_digit() || c == '.') && digits.chars().any(|c| c.is_ascii_digit());
        numeric.then(|| digits.parse::<f64>().ok()).flatten()
    };
    match (number(&a), number(&b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// The long-lived Python child that runs the user's functions (rewards.py).
struct Child {
    process: std::process::Child,
    input: Option<ChildStdin>,
    output: BufReader<ChildStdout>,
    program: String,
}

impl Child {
    fn start(program: &str) -> Result<Child> {
        let mut process = Command::new(program)
            .args(["-c", CHILD_SCRIPT])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // Its own process group: Ctrl-C stops ft's run as ft handles it, without killing the child mid-batch.
            .process_group(0)
            .spawn()
            .with_context(|| format!("cannot start `{program}` to run the reward functions: set FT_PYTHON to a Python 3 that imports them (python3 by default)"))?;
        let (Some(input), Some(output)) = (process.stdin.take(), process.stdout.take()) else { bail!("`{program}` for the reward functions has no pipes") };
        Ok(Child { process, input: Some(input), output: BufReader::new(output), program: program.to_string() })
    }

    /// Sends `message` and returns the answer; the child's error as an error naming the function of `python` it concerns.
    fn ask(&mut self, message: &Value, doing: &str, python: &[&RewardSpec]) -> Result<Value> {
        let mut line = String::new();
        let input = self.input.as_mut().context("the reward child's input is closed")?;
        let sent = writeln!(input, "{message}").and_then(|()| input.flush()).is_ok();
        if !sent || self.output.read_line(&mut line).unwrap_or(0) == 0 {
            let status = self.end();
            bail!("`{}`, which runs the reward functions, ended while {doing} ({status}); what it printed is above", self.program);
        }
        let answer: Value = serde_json::from_str(&line).with_context(|| format!("`{}` answered {:?}, not the reward child's JSON: is FT_PYTHON a Python 3?", self.program, line.trim_end()))?;
        if let Some(error) = answer["error"].as_str() {
            match answer["function"].as_u64().and_then(|index| python.get(index as usize)) {
                Some(spec) => bail!("reward function {spec} {error}"),
                None => bail!("the reward child failed while {doing}:\n{error}"),
            }
        }
        Ok(answer)
    }

    /// Closes its input, which ends it, and returns how it ended: killed if it has not after CHILD_EXIT_GRACE.
    fn end(&mut self) -> String {
        drop(self.input.take());
        let deadline = Instant::now() + CHILD_EXIT_GRACE;
        loop {
            match self.process.try_wait() {
                Ok(Some(status)) => return status.to_string(),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                Ok(None) => {
                    let _ = self.process.kill();
                    return self.process.wait().map_or_else(|error| error.to_string(), |status| format!("killed after {CHILD_EXIT_GRACE:?}: {status}"));
                }
                Err(error) => return error.to_string(),
            }
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `script` under the venv's `python` (on PATH after scripts/env.sh, as the integration tests find it) with `input` as JSON on stdin; returns what it printed, as JSON.
    fn python_json(script: &str, input: &Value) -> Value {
        let mut process = Command::new("python").args(["-c", script]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("`python` on PATH: `source scripts/env.sh` first");
        writeln!(process.stdin.take().unwrap(), "{input}").unwrap();
        let output = process.wait_with_output().unwrap();
        assert!(output.status.success(), "{script}");
        serde_json::from_slice(&output.stdout).unwrap()
    }

    fn text_batch<'a>(completions: &'a [Value], ids: &'a [Vec<i64>], columns: &'a BTreeMap<String, Vec<Value>>, prompts: &'a [Value]) -> RewardBatch<'a> {
        RewardBatch { prompts, completions, completion_ids: ids, columns, trainer_state: TrainerState::default() }
    }

    fn error_of(result: Result<impl std::any::Any>) -> String {
        format!("{:#}", result.err().expect("an error"))
    }

    #[test]
    fn specs_parse_built_ins_and_python_files_and_say_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("my_rewards.py");
        std::fs::write(&file, "").unwrap();
        assert_eq!("length".parse::<RewardSpec>().unwrap(), RewardSpec::Length);
        let spec: RewardSpec = format!("{}:correct_answer", file.display()).parse().unwrap();
        assert_eq!(spec, RewardSpec::Python { file: file.clone(), function: "correct_answer".into() });
        assert!(error_of("lenght".parse::<RewardSpec>()).contains("expected FILE.py:FUNCTION or one of accuracy, format, length"));
        assert!(error_of(format!("{}:", file.display()).parse::<RewardSpec>()).contains("no Python function name"));
        assert!(error_of("elsewhere/missing.py:reward".parse::<RewardSpec>()).contains("no such file elsewhere/missing.py"));
        assert!(error_of("rewards.txt:reward".parse::<RewardSpec>()).contains("is no .py file"));
    }

    #[test]
    fn accuracy_takes_the_boxed_answer_else_after_hashes_else_the_last_number() {
        let completions: Vec<Value> = [
            r"so \boxed{\frac{1}{2}} or rather \boxed{\frac{2}{4}}",
            r"\boxed{7.0} is it",
            "#### $1,000\nand that is all",
            "3 apples and 4 pears make 7.",
            "seven",
            "it is 8",
        ]
        .iter()
        .map(|text| json!(text))
        .collect();
        let mut completions = completions;
        completions.push(json!([{"role": "assistant", "content": "The answer is 12"}]));
        let answers = vec![json!(r"\frac{2}{4}"), json!("Since 3+4=7, #### 7"), json!("1000"), json!(7), json!("seven"), json!(null), json!(r"We get \boxed{12}.")];
        let columns = BTreeMap::from([("solution".to_string(), answers)]);
        let ids = vec![vec![]; completions.len()];
        let prompts = vec![json!("q"); completions.len()];
        let mut rewards = Rewards::start(&[RewardSpec::Accuracy], &RewardOptions::default()).unwrap();
        let scores = rewards.score(&text_batch(&completions, &ids, &columns, &prompts)).unwrap();
        // "seven" has no final answer to compare: no \boxed, no ####, no number.
        assert_eq!(scores.rewards, vec![vec![Some(1.0), Some(1.0), Some(1.0), Some(1.0), Some(0.0), None, Some(1.0)]]);
        let wrong = [json!(r"\boxed{\frac{1}{2}}"), json!("#### 999"), json!("it is 8, not 9"), json!(r"\boxed{8"), json!("no number")];
        let columns = BTreeMap::from([("answer".to_string(), vec![json!("8"); wrong.len()])]);
        let scores = rewards.score(&text_batch(&wrong, &ids[..5], &columns, &prompts[..5])).unwrap();
        // An unclosed \boxed is no answer: its last number is.
        assert_eq!(scores.rewards, vec![vec![Some(0.0), Some(0.0), Some(0.0), Some(1.0), Some(0.0)]]);
        let columns = BTreeMap::from([("label".to_string(), vec![json!("8"); wrong.len()])]);
        assert!(error_of(rewards.score(&text_batch(&wrong, &ids[..5], &columns, &prompts[..5]))).contains("needs the dataset's `answer` or `solution` column, and it has neither"));
        let columns = BTreeMap::from([("completions".to_string(), vec![json!("8"); wrong.len()])]);
        assert!(error_of(rewards.score(&text_batch(&wrong, &ids[..5], &columns, &prompts[..5]))).contains("the dataset's column `completions` would take the place of TRL's keyword"));
    }

    #[test]
    fn format_is_trls_think_format_reward_and_a_pattern_is_matched_as_pythons_re_match() {
        let texts = [
            "<think>\nreasoning\n</think>\nanswer",
            "<think>reasoning</think>",
            "<think>\nreasoning\nanswer",
            "<think>a <think> b</think> c",
            " <think>a</think>",
            "answer\n<think>a</think>",
            "<think>a</think>\n<answer>12</answer>\n",
            "<think>a</think><answer>12</answer> trailing",
        ];
        let custom = r"<think>.*?</think>\s*<answer>(\d+)</answer>$";
        let expected = python_json(
            "import json, re, sys\nfrom trl.rewards import think_format_reward\ninput = json.loads(sys.stdin.read())\n\
             completions = [[{'content': text}] for text in input['texts']]\n\
             custom = [1.0 if re.match(input['custom'], text, re.DOTALL | re.MULTILINE) else 0.0 for text in input['texts']]\n\
             print(json.dumps([think_format_reward(completions), custom]))",
            &json!({ "texts": texts, "custom": custom }),
        );
        let completions: Vec<Value> = texts.iter().map(|text| json!([{"role": "assistant", "content": text}])).collect();
        let ids = vec![vec![]; texts.len()];
        let prompts = vec![json!([{"role": "user", "content": "q"}]); texts.len()];
        let columns = BTreeMap::new();
        let think = Rewards::start(&[RewardSpec::Format], &RewardOptions::default()).unwrap().score(&text_batch(&completions, &ids, &columns, &prompts)).unwrap();
        let options = RewardOptions { format_pattern: Some(custom.to_string()), ..RewardOptions::default() };
        let custom = Rewards::start(&[RewardSpec::Format], &options).unwrap().score(&text_batch(&completions, &ids, &columns, &prompts)).unwrap();
        assert_eq!(json!([think.rewards[0], custom.rewards[0]]), expected);
        assert!(custom.rewards[0].contains(&Some(1.0)) && custom.rewards[0].contains(&Some(0.0)));
        let options = RewardOptions { format_pattern: Some("a)|(b".to_string()), ..RewardOptions::default() };
        assert!(error_of(Rewards::start(&[RewardSpec::Format], &options)).contains("task.format_pattern `a)|(b` is no valid regular expression"));
        assert!(error_of(Rewards::start(&[RewardSpec::Accuracy], &options)).contains("task.format_pattern is set but no `format` reward is named"));
    }

    #[test]
    fn length_is_trls_soft_overlong_punishment() {
        let (max_completion_len, soft_punish_cache) = (20, 6);
        let ids: Vec<Vec<i64>> = [0, 13, 14, 15, 17, 19, 20, 21, 30].iter().map(|&length| vec![1; length]).collect();
        let expected = python_json(
            "import json, sys\nfrom trl.rewards import get_soft_overlong_punishment\ninput = json.loads(sys.stdin.read())\n\
             print(json.dumps(get_soft_overlong_punishment(input['max'], input['cache'])(input['ids'])))",
            &json!({ "max": max_completion_len, "cache": soft_punish_cache, "ids": ids }),
        );
        let options = RewardOptions { max_completion_len: Some(max_completion_len), soft_punish_cache: Some(soft_punish_cache), ..RewardOptions::default() };
        let completions = vec![json!(""); ids.len()];
        let columns = BTreeMap::new();
        let scores = Rewards::start(&[RewardSpec::Length], &options).unwrap().score(&text_batch(&completions, &ids, &columns, &completions)).unwrap();
        assert_eq!(json!(scores.rewards[0]), expected);
        let options = RewardOptions { max_completion_len: Some(20), ..RewardOptions::default() };
        assert!(error_of(Rewards::start(&[RewardSpec::Length], &options)).contains("needs task.max_completion_len and task.soft_punish_cache"));
    }

    #[test]
    fn a_python_function_gets_trls_arguments_and_its_rewards_and_logs_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("my_rewards.py");
        std::fs::write(
            &file,
            r#"
import math

def correct(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **columns):
    assert prompts == ["2+2=", [{"role": "user", "content": "3+3="}]], prompts
    assert completions == ["4", [{"role": "assistant", "content": "7"}]], completions
    assert completion_ids == [[19], [22, 0]], completion_ids
    assert columns == {"answer": ["4", 6], "meta": [{"id": 1}, None]}, columns
    assert (trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch) == (3, 10, 0.5)
    print("a print of the user's goes to stderr, not into the protocol")
    log_metric("checked", len(completions))
    log_extra("seen", [len(ids) for ids in completion_ids])
    return [float(len(ids)) + trainer_state.global_step for ids in completion_ids]

def only_text(completions, **kwargs):
    return [0.5 if isinstance(c, str) else None for c in completions[:-1]] + [math.nan]

async def judged(completion_ids, **kwargs):
    return (-float(len(ids)) for ids in completion_ids)  # any iterable, as TRL takes it

renamed = correct
"#,
        )
        .unwrap();
        let python = |function: &str| RewardSpec::Python { file: file.clone(), function: function.into() };
        let mut rewards = Rewards::start_under("python", &[python("correct"), RewardSpec::Length, python("only_text"), python("judged")], &RewardOptions { max_completion_len: Some(2), soft_punish_cache: Some(1), ..RewardOptions::default() }).unwrap();
        assert_eq!(rewards.names(), ["correct", "length", "only_text", "judged"]);
        let prompts = [json!("2+2="), json!([{"role": "user", "content": "3+3="}])];
        let completions = [json!("4"), json!([{"role": "assistant", "content": "7"}])];
        let ids = [vec![19], vec![22, 0]];
        let columns = BTreeMap::from([("answer".to_string(), vec![json!("4"), json!(6)]), ("meta".to_string(), vec![json!({"id": 1}), Value::Null])]);
        let batch = RewardBatch { prompts: &prompts, completions: &completions, completion_ids: &ids, columns: &columns, trainer_state: TrainerState { global_step: 3, max_steps: 10, epoch: 0.5 } };
        // Twice: the child lives on between batches.
        for _ in 0..2 {
            let scores = rewards.score(&batch).unwrap();
            assert_eq!(scores.rewards, vec![vec![Some(4.0), Some(5.0)], vec![Some(0.0), Some(-1.0)], vec![Some(0.5), None], vec![Some(-1.0), Some(-2.0)]]);
            assert_eq!(scores.metrics, BTreeMap::from([("checked".to_string(), vec![2.0])]));
            assert_eq!(scores.extra_columns, BTreeMap::from([("seen".to_string(), vec![json!(1), json!(2)])]));
        }
        // `renamed` is `correct`: TRL's name is its __name__, which two functions may not share.
        assert!(error_of(Rewards::start_under("python", &[python("correct"), python("renamed")], &RewardOptions::default())).contains("are both named `correct`"));
    }

    #[test]
    fn a_python_functions_failures_name_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("my_rewards.py");
        std::fs::write(
            &file,
            "def raises(completions, **kwargs):\n    return [1 / 0 for c in completions]\n\
             def too_few(completions, **kwargs):\n    return [1.0]\n\
             def text(completions, **kwargs):\n    return ['1.0' for c in completions]\n\
             def dies(completions, **kwargs):\n    import os\n    os._exit(3)\n",
        )
        .unwrap();
        let broken = dir.path().join("broken.py");
        std::fs::write(&broken, "def reward(completions, **kwargs)\n    return []\n").unwrap();
        let python = |file: &PathBuf, function: &str| RewardSpec::Python { file: file.clone(), function: function.into() };
        let completions = [json!("a"), json!("b")];
        let ids = [vec![1], vec![2]];
        let columns = BTreeMap::new();
        let batch = text_batch(&completions, &ids, &columns, &completions);
        let failure = |function: &str| error_of(Rewards::start_under("python", &[python(&file, function)], &RewardOptions::default()).unwrap().score(&batch));
        let raised = failure("raises");
        assert!(raised.contains(&format!("reward function {}:raises raised an exception:\nTraceback", file.display())) && raised.contains("ZeroDivisionError: division by zero"), "{raised}");
        assert!(failure("too_few").contains("too_few returned 1 rewards for 2 completions: [1.0]"));
        assert!(failure("text").contains("text returned '1.0' (str) for completion 0"));
        let died = failure("dies");
        assert!(died.contains("`python`, which runs the reward functions, ended while scoring (exit status: 3)"), "{died}");
        let missing = error_of(Rewards::start_under("python", &[python(&file, "absent")], &RewardOptions::default()));
        assert!(missing.contains(&format!("{} has no function `absent`", file.display())), "{missing}");
        let syntax = error_of(Rewards::start_under("python", &[python(&broken, "reward")], &RewardOptions::default()));
        assert!(syntax.contains("importing") && syntax.contains("SyntaxError"), "{syntax}");
        let nowhere = error_of(Rewards::start_under("/nonexistent/python3", &[python(&file, "raises")], &RewardOptions::default()));
        assert!(nowhere.contains("cannot start `/nonexistent/python3` to run the reward functions: set FT_PYTHON"), "{nowhere}");
        // A program that is no Python: it ends without answering.
        let not_python = error_of(Rewards::start_under("false", &[python(&file, "raises")], &RewardOptions::default()));
        assert!(not_python.contains("`false`, which runs the reward functions, ended while importing the reward functions"), "{not_python}");
    }
}
