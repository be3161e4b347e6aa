//! The embedded demo, all in one place: a question-answering set about
//! invented countries, generated from a seed (so the answers must be read
//! from the context, not remembered: evaluation countries never occur in
//! training), written as SQuAD v2.0 JSON; a byte-level BPE tokenizer trained
//! on it with the `tokenizers` crate; the small BLOOM it fine-tunes; and the
//! settings it runs with (a preset, the default model of `ft train`).
//! Nothing is downloaded.

use anyhow::{Context, Result};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::path::{Path, PathBuf};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerBuilder};

/// The demo's `model.source`.
pub const NAME: &str = "demo";
pub const END_OF_TEXT: &str = "<|endoftext|>";
/// Small enough that the invented names split into their syllables, tokens
/// the training set holds hundreds of times: an evaluation name is then made
/// of well-trained tokens, as a real tokenizer's rare word is of sub-words.
const TOKENIZER_VOCAB: usize = 500;

pub struct DemoFiles {
    pub train: PathBuf,
    pub eval: PathBuf,
    pub tokenizer: PathBuf,
}

const SYLLABLES: &[&str] = &[
    "ka", "lo", "mi", "ra", "ve", "dun", "tor", "sel", "bri", "an", "ostr", "ul", "quen", "zar", "pel", "mor", "ith",
    "gal", "den", "sha", "vo", "rin", "tek", "bal", "cor", "fen", "hal", "jor", "nim", "pra",
];
const ANIMALS: &[&str] =
    &["lynx", "heron", "otter", "ibex", "falcon", "tortoise", "badger", "crane", "marten", "stag", "owl", "seal"];
const GIVEN: &[&str] = &["Ada", "Boris", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Luca"];

fn name(rng: &mut ChaCha8Rng, parts: usize) -> String {
    let mut word: String = (0..parts).map(|_| *SYLLABLES.choose(rng).expect("syllables")).collect();
    word[..1].make_ascii_uppercase();
    word
}

/// One paragraph about an invented country and the questions it answers.
fn paragraph(rng: &mut ChaCha8Rng, id: usize) -> serde_json::Value {
    let country = name(rng, 3);
    let capital = name(rng, 2);
    let river = name(rng, 2);
    let founder = format!("{} {}", GIVEN.choose(rng).expect("names"), name(rng, 2));
    let year = rng.gen_range(1100..2000).to_string();
    let animal = ANIMALS.choose(rng).expect("animals").to_string();
    let mut facts = vec![
        (format!("The capital of {country} is {capital}."), format!("What is the capital of {country}?"), capital.clone()),
        (format!("The river {river} flows through {capital}."), format!("Which river flows through {capital}?"), river),
        (format!("{country} was founded in {year}."), format!("When was {country} founded?"), year),
        (format!("It was founded by {founder}."), format!("Who founded {country}?"), founder),
        (format!("Its national animal is the {animal}."), format!("What is the national animal of {country}?"), animal),
    ];
    facts.shuffle(rng);
    facts.truncate(rng.gen_range(3..=5));
    let context = facts.iter().map(|(sentence, _, _)| sentence.as_str()).collect::<Vec<_>>().join(" ");
    let qas: Vec<serde_json::Value> = facts
        .iter()
        .enumerate()
        .map(|(n, (_, question, answer))| {
            let start = context.find(answer.as_str()).expect("the answer is in the context");
            json!({"id": format!("demo-{id}-{n}"), "question": question, "is_impossible": false,
                   "answers": [{"text": answer, "answer_start": context[..start].chars().count()}]})
        })
        .collect();
    // Moved in, not through `json!`, which copies a value by serializing it (unoptimised here: Cargo.toml says why).
    let mut paragraph = json!({"context": context});
    paragraph["qas"] = qas.into();
    paragraph
}

fn squad_file(rng: &mut ChaCha8Rng, paragraphs: usize, first_id: usize) -> serde_json::Value {
    let paragraphs: Vec<serde_json::Value> = (0..paragraphs).map(|i| paragraph(rng, first_id + i)).collect();
    let mut article = json!({"title": "Invented countries"});
    article["paragraphs"] = paragraphs.into();
    let mut file = json!({"version": "v2.0"});
    file["data"] = vec![article].into();
    file
}

/// Writes `demo-train.json`, `demo-eval.json` (SQuAD v2.0 layout) and
/// `tokenizer.json` into `dir`; the same seed gives the same files.
pub fn write(dir: &Path, train_paragraphs: usize, eval_paragraphs: usize, seed: u64) -> Result<DemoFiles> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let train = squad_file(&mut rng, train_paragraphs, 0);
    let eval = squad_file(&mut rng, eval_paragraphs, train_paragraphs);
    let files = DemoFiles {
        train: dir.join("demo-train.json"),
        eval: dir.join("demo-eval.json"),
        tokenizer: dir.join("tokenizer.json"),
    };
    // `Display`, not `serde_json::to_string`: written by serde_json's own, optimised code (Cargo.toml says why).
    std::fs::write(&files.train, train.to_string())?;
    std::fs::write(&files.eval, eval.to_string())?;

    // The tokenizer learns from the training texts only (evaluation is
    // unseen text for it too), with the prompt's words as often as prompts.
    let mut corpus = vec![];
    for p in train["data"][0]["paragraphs"].as_array().expect("paragraphs") {
        corpus.push(p["context"].as_str().expect("context").to_string());
        for qa in p["qas"].as_array().expect("qas") {
            corpus.push(format!("Question: {} Context: Answer:", qa["question"].as_str().expect("question")));
        }
    }
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(TOKENIZER_VOCAB)
        .min_frequency(2)
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tokenizer = TokenizerBuilder::<BPE, tokenizers::NormalizerWrapper, ByteLevel, tokenizers::PostProcessorWrapper, ByteLevel>::new()
        .with_model(BPE::default())
        // As GPT-2's: no space is added before the text.
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
        .with_decoder(Some(ByteLevel::default().add_prefix_space(false)))
        .build()
        .map_err(anyhow::Error::msg)?;
    tokenizer.train(&mut trainer, corpus.iter()).map_err(anyhow::Error::msg)?;
    tokenizer.save(&files.tokenizer, false).map_err(anyhow::Error::msg)?;
    Ok(files)
}

/// The demo's files as `ft train` uses them: 400 training and 40
/// evaluation paragraphs (about 1,600 and 160 questions).
pub fn prepare(dir: &Path, seed: u64) -> Result<DemoFiles> {
    write(dir, 400, 40, seed)
}

/// Points `config`'s data and tokenizer at the demo files in `dir` (where
/// the user set none: no training file, nor a mixture; the demo's
/// evaluation file comes with its training file, so the user's own data
/// evaluates on what it brings) and returns the demo model's config.json.
pub fn configure(config: &mut ft_core::Config, dir: &Path) -> Result<serde_json::Value> {
    let data = &mut config.data;
    if data.train.is_none() && data.mixture.is_empty() {
        data.train = Some(dir.join("demo-train.json"));
        data.eval.get_or_insert_with(|| dir.join("demo-eval.json"));
    }
    let tokenizer = data.tokenizer.get_or_insert_with(|| dir.join("tokenizer.json"));
    model_for(tokenizer)
}

/// The demo model's config.json over the tokenizer at `path`.
pub fn model_for(path: &Path) -> Result<serde_json::Value> {
    let vocab = tokenizers::Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("cannot load the demo tokenizer {}: {e}", path.display()))?.get_vocab_size(true);
    Ok(model_config(vocab))
}

/// The demo's model: a small BLOOM sized to the demo tokenizer's `vocab`.
pub fn model_config(vocab: usize) -> serde_json::Value {
    json!({
        "architectures": ["BloomForCausalLM"], "model_type": "bloom",
        "hidden_size": 128, "n_layer": 4, "n_head": 4, "vocab_size": vocab,
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
        "apply_residual_connection_post_layernorm": false, "hidden_dropout": 0.0, "attention_dropout": 0.0
    })
}

/// The demo's settings, between the defaults and the user's layers: the
/// small BLOOM learning to answer questions about invented countries on two
/// CPU ranks in about a minute. Reading the answer from the context takes
/// the model copying names it has never seen: the loss on the prompt's tokens
/// too (the country names repeat within each context) and many small steps
/// bring that ability within seven epochs, where the answers' loss alone at
/// batch 8 left it guessing (EM ~2; chosen by a sweep over batch, learning
/// rate, model size and seeds: EM 74-94 over three seeds on a GPU).
fn preset() -> serde_json::Value {
    json!({
        "data": {"max_seq_len": 96},
        "train": {"epochs": 7, "batch_size": 2, "lr": 1e-3, "warmup_ratio": 0.05, "weight_decay": 0.01, "seed": 0},
        "task": {"max_new_tokens": 8, "train_on_prompt": true},
        "launch": {"nproc_per_node": 2},
    })
}

inventory::submit! {
    ft_core::config::PresetRegistration {
        name: NAME,
        summary: "a small BLOOM answering questions about invented countries, with its own data and tokenizer (2 CPU ranks)",
        default: true,
        values: preset,
        write_files: |dir, seed| prepare(dir, seed).map(drop),
        configure,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_files_are_valid_squad_and_reproducible() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let files = write(a.path(), 30, 10, 7).unwrap();
        write(b.path(), 30, 10, 7).unwrap();
        for name in ["demo-train.json", "demo-eval.json", "tokenizer.json"] {
            assert_eq!(std::fs::read(a.path().join(name)).unwrap(), std::fs::read(b.path().join(name)).unwrap(), "{name}");
        }
        let (train, stats) = crate::squad::read(&files.train, false, None).unwrap();
        assert_eq!(stats.bad_offsets_skipped, 0);
        assert!(train.len() >= 90 && train.iter().all(|e| e.context.contains(&e.answers[0])));
        let tokenizer = tokenizers::Tokenizer::from_file(&files.tokenizer).unwrap();
        let ids = tokenizer.encode(train[0].context.as_str(), false).unwrap();
        assert_eq!(tokenizer.decode(ids.get_ids(), false).unwrap(), train[0].context);
        assert!(tokenizer.token_to_id(END_OF_TEXT).is_some());
    }
}
