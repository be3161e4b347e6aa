//! Sampling (`ft generate --temperature …`, `ft_core::generate::sample_batch`):
//! what it draws follows the distribution transformers' `generate` samples
//! from with the same options (tests/python/sampling_reference.py), a row's
//! tokens depend on its seed and prompt alone, and bad options are named.

use crate::common;
use common::{ft, reference_job, text};

use ft_core::generate::{greedy_batch, sample_batch, Decoding, Sampling};
use ft_models::hf;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use tch::{Device, Kind};

/// Two tokens sampled 20000 times after one prompt by `ft generate`, with
/// each set of options: the continuations are those transformers'
/// processors leave (none they filter out appears) at its probabilities.
#[test]
fn sampled_continuations_follow_transformers_processors() {
    let scratch = tempfile::tempdir().unwrap();
    let model = scratch.path().join("model");
    reference_job("sampling_reference.py", &["--make".as_ref(), model.as_os_str()]);
    let prompt = "5,17,3,40,22,9,31,12";
    let samples = 20_000;
    // Each cuts where the others would not: top-k then top-p of what it left, min-p, and a penalty on the prompt's likeliest token.
    let option_sets = [
        serde_json::json!({"temperature": 1.2, "top_k": 4, "top_p": 0.8}),
        serde_json::json!({"temperature": 1.5, "min_p": 0.3}),
        serde_json::json!({"repetition_penalty": 2.0, "top_k": 6}),
    ];
    for options in option_sets {
        let flags: Vec<String> = options.as_object().unwrap().iter().flat_map(|(name, value)| [format!("--{}", name.replace('_', "-")), value.to_string()]).collect();
        let output = ft()
            .args(["generate", "--model", model.to_str().unwrap(), "--ids", prompt, "--max-new-tokens", "2", "--num-samples", &samples.to_string()])
            .args(&flags)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output));
        let mut counts: HashMap<String, usize> = HashMap::new();
        for line in String::from_utf8(output.stdout).unwrap().lines() {
            let tokens: Vec<i64> = serde_json::from_str(line).unwrap();
            *counts.entry(tokens.iter().map(i64::to_string).collect::<Vec<_>>().join(",")).or_default() += 1;
        }
        assert_eq!(counts.values().sum::<usize>(), samples);
        let job = ["--distribution", model.to_str().unwrap(), prompt, &options.to_string(), "2"];
        let expected: HashMap<String, f64> = serde_json::from_str(&reference_job("sampling_reference.py", &job.map(OsStr::new))).unwrap();
        let filtered_out: Vec<&String> = counts.keys().filter(|continuation| !expected.contains_key(*continuation)).collect();
        assert!(filtered_out.is_empty(), "{options}: sampled {filtered_out:?}, which transformers filters out of {expected:?}");
        let distance = expected.iter().map(|(continuation, p)| (counts.get(continuation).map_or(0.0, |&c| c as f64) / samples as f64 - p).abs()).sum::<f64>() / 2.0;
        // Twice the bound on the expected total variation distance of n
        // samples over K outcomes: ½·Σ√(p(1−p)/n) ≤ ½·√(K/n).
        let bound = (expected.len() as f64 / samples as f64).sqrt();
        assert!(distance < bound, "{options}: frequencies {counts:?} are {distance:.4} (≥ {bound:.4}) from transformers' {expected:?}");
    }
}

/// In a batch of prompts of different lengths (left-padded), each row
/// draws what it draws alone with its seed, whichever rows are beside it
/// and in whichever order; another seed draws otherwise; top-k 1 is greedy.
#[test]
fn a_rows_tokens_depend_on_its_seed_and_prompt_alone() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama");
    let model = hf::load_model(&dir).unwrap();
    let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
    let rows: Vec<Vec<i64>> = serde_json::from_str(&std::fs::read_to_string(dir.join("ids.json")).unwrap()).unwrap();
    let prompts: Vec<Vec<i64>> = (0..5).map(|i| rows[i % rows.len()][..3 + 2 * i].to_vec()).collect();
    let seeds: Vec<u64> = (0..5).map(|i| 1000 + 7 * i).collect();
    let sampling = Sampling { temperature: 0.9, top_p: 0.95, repetition_penalty: 1.3, ..Sampling::default() };
    let decoding = Decoding::greedy(8, None, Kind::Float);
    let sample = |prompts: &[Vec<i64>], seeds: &[u64], sampling: &Sampling| sample_batch(model.as_ref(), &params, prompts, seeds, sampling, &decoding).unwrap();
    let batched = sample(&prompts, &seeds, &sampling);
    for ((prompt, seed), row) in prompts.iter().zip(&seeds).zip(&batched) {
        assert_eq!(&sample(std::slice::from_ref(prompt), &[*seed], &sampling)[0], row, "a row alone (seed {seed})");
    }
    let reversed: Vec<Vec<i64>> = sample(&prompts.iter().rev().cloned().collect::<Vec<_>>(), &seeds.iter().rev().copied().collect::<Vec<_>>(), &sampling);
    assert_eq!(reversed.into_iter().rev().collect::<Vec<_>>(), batched, "the rows in reverse order");
    let reseeded = sample(&prompts, &seeds.iter().map(|s| s + 1).collect::<Vec<_>>(), &sampling);
    assert!(reseeded.iter().zip(&batched).all(|(a, b)| a != b), "other seeds draw other tokens: {reseeded:?} and {batched:?}");
    let top_1 = Sampling { top_k: 1, repetition_penalty: 1.0, ..sampling };
    assert_eq!(sample(&prompts, &seeds, &top_1), greedy_batch(model.as_ref(), &params, &prompts, &decoding).unwrap(), "top-k 1 draws the most likely token");
    let error = sample_batch(model.as_ref(), &params, &prompts, &seeds[1..], &sampling, &decoding).unwrap_err();
    assert_eq!(error.to_string(), "sampling takes one seed per prompt: 4 seeds for 5 prompts");
}

/// `ft generate`'s sampling flags out of range, and those that only mean
/// something when sampling given without a sampling option, are refused
/// naming the flag.
#[test]
fn bad_sampling_flags_are_named() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama");
    let cases: [(&[&str], &str); 9] = [
        (&["--top-p", "1.5"], "--top-p must be in (0, 1] (1 keeps all tokens), not 1.5"),
        (&["--top-p", "0"], "--top-p must be in (0, 1] (1 keeps all tokens), not 0"),
        (&["--top-k", "-1"], "--top-k must be a number of tokens to keep, or 0 to keep all, not -1"),
        (&["--temperature", "0"], "--temperature must be a positive number, not 0"),
        (&["--repetition-penalty", "0"], "--repetition-penalty must be a positive number (1 is none), not 0"),
        (&["--min-p", "1.5"], "--min-p must be in [0, 1], not 1.5"),
        (&["--seed", "3"], "--seed is for sampling, and decoding is greedy without a sampling option: add --temperature 1.0"),
        (&["--num-samples", "2"], "--num-samples is for sampling"),
        (&["--temperature", "1", "--num-samples", "0"], "--num-samples must be at least 1"),
    ];
    for (flags, expected) in cases {
        let output = ft().args(["generate", "--model", model.to_str().unwrap(), "--ids", "1,2"]).args(flags).output().unwrap();
        assert!(!output.status.success() && text(&output).contains(expected), "{flags:?}: {}", text(&output));
    }
}
