//! The online-RL demo: additions with verifiable answers (`3+4=`, answer
//! `7`) generated from a seed as TRL's prompt-only JSON lines, which the
//! `grpo` task reads (the `answer` column is what the built-in `accuracy`
//! reward compares the completion's last number with); a character-level
//! tokenizer made with the `tokenizers` crate (the digits, `+`, `=` and
//! `<|endoftext|>`), so that a random policy already writes the right
//! answer now and then and a group of completions has a reward spread to
//! learn from; the demo's small BLOOM; and the settings it runs with (the
//! `arithmetic` preset). Nothing is downloaded.

use anyhow::{Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::path::{Path, PathBuf};
use tokenizers::decoders::fuse::Fuse;
use tokenizers::models::bpe::BPE;
use tokenizers::{AddedToken, Tokenizer};

/// The preset's `model.source`.
pub const NAME: &str = "arithmetic";
/// The tokens, by id: the end of text (id 0, the BLOOM's `eos_token_id`),
/// then every character a question or an answer holds.
const TOKENS: [&str; 13] = [crate::demo::END_OF_TEXT, "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "="];
const TRAIN_FILE: &str = "arithmetic-train.jsonl";
const TOKENIZER_FILE: &str = "tokenizer.json";
/// The preset's questions: an epoch of 500 steps of 64 completions, 16 a question.
const QUESTIONS: usize = 2000;

pub struct ArithmeticFiles {
    pub train: PathBuf,
    pub tokenizer: PathBuf,
}

/// `questions` additions of two digits whose sum is one digit too (`a+b=`,
/// answer `a+b`): the answer is one token, which a random policy picks one
/// time in 13.
fn rows(questions: usize, seed: u64) -> String {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..questions)
        .map(|_| {
            let a = rng.gen_range(0..=9);
            let b = rng.gen_range(0..=9 - a);
            json!({"prompt": format!("{a}+{b}="), "answer": (a + b).to_string()}).to_string() + "\n"
        })
        .collect()
}

/// One token per character; decoding joins the characters as they are.
fn tokenizer() -> Result<Tokenizer> {
    let vocab: [(String, u32); TOKENS.len()] = std::array::from_fn(|id| (TOKENS[id].to_string(), id as u32));
    // No merges: each character stays a token of its own.
    let model = BPE::builder().vocab_and_merges(vocab, vec![]).build().map_err(anyhow::Error::msg)?;
    let mut tokenizer = Tokenizer::new(model);
    tokenizer.with_decoder(Some(Fuse::new()));
    tokenizer.add_special_tokens(&[AddedToken::from(crate::demo::END_OF_TEXT, true)]);
    Ok(tokenizer)
}

/// Writes `arithmetic-train.jsonl` (`questions` rows) and `tokenizer.json`
/// into `dir`; the same seed gives the same files.
pub fn write(dir: &Path, questions: usize, seed: u64) -> Result<ArithmeticFiles> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let files = ArithmeticFiles { train: dir.join(TRAIN_FILE), tokenizer: dir.join(TOKENIZER_FILE) };
    std::fs::write(&files.train, rows(questions, seed)).with_context(|| format!("cannot write {}", files.train.display()))?;
    tokenizer()?.save(&files.tokenizer, false).map_err(anyhow::Error::msg)?;
    Ok(files)
}

/// Points `config`'s prompts (where the user gave none) and tokenizer at
/// the files in `dir` and returns the model's config.json: the QA demo's
/// small BLOOM over this tokenizer.
pub fn configure(config: &mut ft_core::Config, dir: &Path) -> Result<serde_json::Value> {
    let data = &mut config.data;
    if data.train.is_none() && data.mixture.is_empty() {
        data.train = Some(dir.join(TRAIN_FILE));
    }
    let tokenizer = data.tokenizer.get_or_insert_with(|| dir.join(TOKENIZER_FILE));
    crate::demo::model_for(tokenizer)
}

/// The demo's settings, between the defaults and the user's layers. A
/// completion is one token, the answer's digit (`max_completion_length` 1:
/// with room for a second, the policy learnt to write `07`, which
/// `accuracy` reads as 7, or, with `format` refusing a leading zero, a
/// digit and the end token, to a lower accuracy: 0.65 against 0.85 after
/// 1,000 steps). `format` (only a number) is learnt in the first few dozen
/// steps, the sums after. The KL term to the random starting policy (β 0.1)
/// keeps a group's completions diverse where, without it, each prompt's
/// answer froze, right or wrong, and accuracy stalled near 0.3; lr 1e-3
/// decaying to 0 keeps what was learnt (constant, accuracy fell back from
/// 0.75 to 0.5); 16 completions a prompt rather than 8 end a little higher.
fn preset() -> serde_json::Value {
    json!({
        "data": {"max_seq_len": 8},
        "train": {"epochs": 2, "batch_size": 32, "lr": 1e-3, "seed": 0},
        "task": {
            "name": "grpo", "rewards": ["accuracy", "format"], "format_pattern": r"\d+$",
            "num_generations": 16, "max_completion_length": 1, "beta": 0.1,
        },
        "launch": {"nproc_per_node": 2},
    })
}

inventory::submit! {
    ft_core::config::PresetRegistration {
        name: NAME,
        summary: "online RL (GRPO): a small BLOOM learning single-digit additions from rewards alone, with its own questions and tokenizer (2 CPU ranks)",
        default: false,
        values: preset,
        write_files: |dir, seed| write(dir, QUESTIONS, seed).map(drop),
        configure,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn questions_are_reproducible_and_tokenized_a_character_each() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let files = write(a.path(), 50, 3).unwrap();
        write(b.path(), 50, 3).unwrap();
        for name in [TRAIN_FILE, TOKENIZER_FILE] {
            assert_eq!(std::fs::read(a.path().join(name)).unwrap(), std::fs::read(b.path().join(name)).unwrap(), "{name}");
        }
        let tokenizer = Tokenizer::from_file(&files.tokenizer).unwrap();
        for line in std::fs::read_to_string(&files.train).unwrap().lines() {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            let (prompt, answer) = (row["prompt"].as_str().unwrap(), row["answer"].as_str().unwrap());
            let (x, y) = prompt.trim_end_matches('=').split_once('+').unwrap();
            assert_eq!(x.parse::<u32>().unwrap() + y.parse::<u32>().unwrap(), answer.parse::<u32>().unwrap(), "{line}");
            let text = format!("{prompt}{answer}");
            let ids = tokenizer.encode(text.as_str(), true).unwrap().get_ids().to_vec();
            assert_eq!(ids.len(), text.len(), "{text}: one token a character");
            assert_eq!(tokenizer.decode(&ids, true).unwrap(), text);
        }
        let eos = crate::example::eos_id(&tokenizer).unwrap();
        assert_eq!(eos, 0);
        assert_eq!(tokenizer.decode(&[8, eos as u32], true).unwrap(), "7", "the end token is skipped");
    }
}
