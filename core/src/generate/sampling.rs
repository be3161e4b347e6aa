//! Sampling the next token as transformers' `generate` samples it
//! (`do_sample=True`): the same logits processors in the same order, then a
//! draw from the softmax, by inverting its cumulative distribution at a
//! uniform that is a hash of (row seed, index of the token in the
//! completion), computed by tensor ops on the device: no host read, so a
//! CUDA graph can record it, and no global generator, so a row's tokens
//! depend on its seed, its prompt and the model alone — not on the rows
//! beside it, the rank, or whether the run was resumed.

use anyhow::{bail, Result};
use tch::{Kind, Tensor};

/// TRL's and transformers' sampling options; `Default` is TRL's defaults
/// (plain sampling from the model's distribution).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Logits are divided by it.
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: i64,
    /// Keep the most likely tokens whose probabilities add up to `top_p`; 1 keeps all.
    pub top_p: f64,
    /// Drop tokens less likely than `min_p` times the most likely one.
    pub min_p: Option<f64>,
    /// Tokens of the prompt or generated so far: a positive logit divided by
    /// it, a negative one multiplied; 1 leaves them.
    pub repetition_penalty: f64,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: None, repetition_penalty: 1.0 }
    }
}

impl Sampling {
    /// Refuses what transformers refuses. `option` names a field as the user
    /// gave it (`top_p` → `--top-p` on the command line, `task.top_p` in a config).
    pub fn check(&self, option: impl Fn(&str) -> String) -> Result<()> {
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            bail!("{} must be a positive number, not {} (greedy decoding takes no sampling options)", option("temperature"), self.temperature);
        }
        if self.top_k < 0 {
            bail!("{} must be a number of tokens to keep, or 0 to keep all, not {}", option("top_k"), self.top_k);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("{} must be in (0, 1] (1 keeps all tokens), not {}", option("top_p"), self.top_p);
        }
        if let Some(min_p) = self.min_p.filter(|min_p| !(0.0..=1.0).contains(min_p)) {
            bail!("{} must be in [0, 1], not {min_p}", option("min_p"));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            bail!("{} must be a positive number (1 is none), not {}", option("repetition_penalty"), self.repetition_penalty);
        }
        Ok(())
    }
}

/// The logits `[rows, vocab]` as transformers' processors leave them for
/// sampling, in float32 (as `generate` takes them), tokens filtered out at
/// -inf: repetition penalty on the `seen` tokens (`[rows, vocab]` bool),
/// temperature, top-k, top-p, min-p — `_get_logits_processor`'s order, each
/// as `generation/logits_process.py` computes it (ties kept as it keeps them).
pub fn sampling_logits(logits: &Tensor, seen: &Tensor, sampling: &Sampling) -> Tensor {
    let mut scores = logits.to_kind(Kind::Float);
    if sampling.repetition_penalty != 1.0 {
        let penalized = scores.g_mul_scalar(sampling.repetition_penalty).where_self(&scores.lt(0.0), &scores.g_div_scalar(sampling.repetition_penalty));
        scores = penalized.where_self(seen, &scores);
    }
    if sampling.temperature != 1.0 {
        scores = scores.g_div_scalar(sampling.temperature);
    }
    let vocab = scores.size()[1];
    if sampling.top_k != 0 {
        let k = sampling.top_k.min(vocab);
        let kth = scores.topk(k, -1, true, true).0.narrow(1, k - 1, 1);
        scores = scores.masked_fill(&scores.lt_tensor(&kth), f64::NEG_INFINITY);
    }
    if sampling.top_p < 1.0 {
        let (ascending, order) = scores.sort(-1, false);
        let below = ascending.softmax(-1, Kind::Float).cumsum(-1, Kind::Float).le(1.0 - sampling.top_p);
        // The most likely token stays.
        let _ = below.narrow(1, vocab - 1, 1).fill_(0);
        scores = scores.masked_fill(&below.scatter(1, &order, &below), f64::NEG_INFINITY);
    }
    if let Some(min_p) = sampling.min_p {
        let probabilities = scores.softmax(-1, Kind::Float);
        let threshold = probabilities.amax(-1, true).g_mul_scalar(min_p);
        let most_likely = probabilities.topk(1, -1, true, true).1;
        let below = probabilities.lt_tensor(&threshold).scatter_value(1, &most_likely, 0);
        scores = scores.masked_fill(&below, f64::NEG_INFINITY);
    }
    scores
}

/// Each row's token drawn from the softmax of `scores` (`[rows, vocab]`,
/// -inf where filtered out), as `[rows, 1]`, by inverting its cumulative
/// distribution at one uniform a row. The uniform is a function of the
/// row's seed (`row_seeds`, `[rows, 1]` int64) and `index` (the position in
/// the completion of the token drawn, a one-element int64 tensor on the
/// device), nothing else. A few passes over the logits, in floats: the
/// Gumbel-max trick's noise per vocabulary entry cost as much as a step's
/// weights at 64 rows of a 150k vocabulary. The distribution is inverted in
/// two levels — blocks of tokens, then the tokens of the one block — since
/// a scan over a whole row is one thread block's work: on a GPU, at a few
/// dozen rows, longer than the step's head.
pub fn draw(scores: &Tensor, row_seeds: &Tensor, index: &Tensor) -> Tensor {
    let (rows, vocab) = (scores.size()[0], scores.size()[1]);
    let uniform = uniform(&splitmix64(&splitmix64(row_seeds).bitwise_xor_tensor(index)));
    let width = DRAW_BLOCK.min(vocab);
    let blocks = (vocab + width - 1) / width;
    let probabilities = scores.softmax(-1, Kind::Float).constant_pad_nd([0, blocks * width - vocab]).view([rows, blocks, width]);
    let ends = probabilities.sum_dim_intlist(-1, false, Kind::Double).cumsum(-1, Kind::Double);
    let target = uniform * ends.narrow(1, blocks - 1, 1);
    // The token is the first whose cumulative probability reaches the
    // target (a filtered token adds nothing, so it is never the first):
    // in the first block whose end reaches it, after the blocks before it.
    let block = ends.lt_tensor(&target).sum_dim_intlist(-1, true, Kind::Int64).clamp_max(blocks - 1);
    let before = Tensor::cat(&[ends.zeros_like().narrow(1, 0, 1), ends.narrow(1, 0, blocks - 1)], 1).gather(1, &block, false);
    let within = probabilities.gather(1, &block.unsqueeze(2).expand([rows, 1, width], false), false).squeeze_dim(1);
    let cdf = within.cumsum(-1, Kind::Double) + before;
    // Summed in another order than `ends`, a block may end a rounding short
    // of the target: its last token with any probability is then the one.
    let offsets = Tensor::arange(width, (Kind::Int64, scores.device())).unsqueeze(0);
    let last_likely = offsets.where_self(&within.gt(0.0), &offsets.zeros_like()).amax(-1, true);
    let offset = cdf.lt_tensor(&target).sum_dim_intlist(-1, true, Kind::Int64).minimum(&last_likely);
    block * width + offset
}

/// Tokens a block of `draw`'s first level holds: √(150k vocabularies).
const DRAW_BLOCK: i64 = 512;

/// A float64 uniform strictly inside (0, 1) from random int64 bits: the top 52 bits plus ½, over 2^52 (with 53 the largest would round to 1).
fn uniform(bits: &Tensor) -> Tensor {
    (logical_right_shift(bits, 12).to_kind(Kind::Double) + 0.5) / (1u64 << 52) as f64
}

/// SplitMix64's finaliser of `x + golden ratio` on int64 tensors: the
/// products wrap as u64's do, the shifts are made logical by a mask.
fn splitmix64(x: &Tensor) -> Tensor {
    let mix = |z: &Tensor, shift: i64, multiplier: u64| z.bitwise_xor_tensor(&logical_right_shift(z, shift)).g_mul_scalar(multiplier as i64);
    let z = x.g_add_scalar(0x9E37_79B9_7F4A_7C15u64 as i64);
    let z = mix(&z, 30, 0xBF58_476D_1CE4_E5B9);
    let z = mix(&z, 27, 0x94D0_49BB_1331_11EB);
    z.bitwise_xor_tensor(&logical_right_shift(&z, 31))
}

fn logical_right_shift(x: &Tensor, shift: i64) -> Tensor {
    x.bitwise_right_shift_tensor_scalar(shift).bitwise_and((1i64 << (64 - shift)) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splitmix64_of(x: u64) -> u64 {
        let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn the_tensor_hash_is_splitmix64() {
        let inputs = [0u64, 1, 2, 12345, u64::MAX, 1 << 63, (1 << 63) - 1, 0x9E37_79B9_7F4A_7C15];
        let tensor = Tensor::from_slice(&inputs.map(|x| x as i64));
        let hashed = Vec::<i64>::try_from(splitmix64(&tensor)).unwrap();
        assert_eq!(hashed.iter().map(|&h| h as u64).collect::<Vec<_>>(), inputs.map(splitmix64_of), "wrapping products, logical shifts");
    }

    #[test]
    fn the_uniform_is_inside_0_1_at_the_extreme_bits() {
        let uniform = Vec::<f64>::try_from(uniform(&Tensor::from_slice(&[-1i64, 0, i64::MAX, i64::MIN]))).unwrap();
        assert!(uniform.iter().all(|u| *u > 0.0 && *u < 1.0), "{uniform:?}");
    }

    /// `rows` draws from `logits` (one row each, seeds 0..rows) at `index`.
    fn draws(logits: &[f32], seeds: impl Iterator<Item = u64>, index: i64) -> Vec<i64> {
        let seeds: Vec<i64> = seeds.map(|s| s as i64).collect();
        let scores = Tensor::from_slice(logits).unsqueeze(0).expand([seeds.len() as i64, logits.len() as i64], false);
        Vec::<i64>::try_from(draw(&scores, &Tensor::from_slice(&seeds).unsqueeze(1), &Tensor::from_slice(&[index])).reshape([-1])).unwrap()
    }

    #[test]
    fn draws_follow_the_softmax_and_depend_on_seed_and_index_alone() {
        let logits = [1.5f32, 0.2, -1.0, 0.9, f32::NEG_INFINITY, 0.0];
        let probabilities = Vec::<f64>::try_from(Tensor::from_slice(&logits).softmax(0, Kind::Double)).unwrap();
        let rows = 40_000;
        for index in [0, 1, 7] {
            let tokens = draws(&logits, 0..rows, index);
            let mut counts = vec![0usize; logits.len()];
            tokens.iter().for_each(|&t| counts[t as usize] += 1);
            assert_eq!(counts[4], 0, "a token at -inf is never drawn");
            let distance: f64 = counts.iter().zip(&probabilities).map(|(&c, p)| (c as f64 / rows as f64 - p).abs()).sum::<f64>() / 2.0;
            // Twice the bound on the expected total variation distance of
            // `rows` samples over 5 outcomes: ½·Σ√(p(1−p)/n) ≤ ½·√(5/n).
            let bound = (5.0 / rows as f64).sqrt();
            assert!(distance < bound, "index {index}: frequencies {counts:?} are {distance} from {probabilities:?}");
        }
        // Same seed and index, same token; another index draws afresh.
        assert_eq!(draws(&logits, 0..1000, 3), draws(&logits, 0..1000, 3));
        let (first, second) = (draws(&logits, 0..1000, 0), draws(&logits, 0..1000, 1));
        let same = first.iter().zip(&second).filter(|(a, b)| a == b).count() as f64 / 1000.0;
        let by_chance: f64 = probabilities.iter().map(|p| p * p).sum();
        assert!((same - by_chance).abs() < 0.05, "tokens at indices 0 and 1 agree in {same} of rows, independent draws in {by_chance}");
        // A row's draw does not depend on the rows beside it.
        let alone: Vec<i64> = (10..20).flat_map(|seed| draws(&logits, seed..seed + 1, 2)).collect();
        assert_eq!(draws(&logits, 10..20, 2), alone);
    }

    #[test]
    fn the_two_level_draw_is_the_whole_rows_inverse_distribution() {
        // Three and a bit blocks, tokens filtered out at block edges and a whole block of them.
        let vocab = 3 * DRAW_BLOCK + 77;
        let rows = 4096;
        let logits = (Tensor::randn([vocab], (Kind::Float, tch::Device::Cpu)) * 3.0).unsqueeze(0).expand([rows, vocab], false).contiguous();
        for filtered in [0, DRAW_BLOCK - 1, DRAW_BLOCK, vocab - 1] {
            let _ = logits.narrow(1, filtered, 1).fill_(f64::NEG_INFINITY);
        }
        let _ = logits.narrow(1, 2 * DRAW_BLOCK, DRAW_BLOCK).fill_(f64::NEG_INFINITY);
        let seeds = Tensor::arange(rows, (Kind::Int64, tch::Device::Cpu)).unsqueeze(1);
        let index = Tensor::from_slice(&[5i64]);
        // The inversion over each row's whole cumulative distribution.
        let uniform = uniform(&splitmix64(&splitmix64(&seeds).bitwise_xor_tensor(&index)));
        let cdf = logits.softmax(-1, Kind::Float).cumsum(-1, Kind::Double);
        let whole = cdf.lt_tensor(&(uniform * cdf.narrow(1, vocab - 1, 1))).sum_dim_intlist(-1, true, Kind::Int64);
        let drawn = draw(&logits, &seeds, &index);
        assert_eq!(Vec::<i64>::try_from(drawn.reshape([-1])).unwrap(), Vec::<i64>::try_from(whole.reshape([-1])).unwrap());
        let blocks_drawn = Vec::<i64>::try_from(drawn.floor_divide_scalar(DRAW_BLOCK).reshape([-1]).bincount::<Tensor>(None, 4)).unwrap();
        assert!(blocks_drawn[0] > 0 && blocks_drawn[1] > 0 && blocks_drawn[3] > 0 && blocks_drawn[2] == 0, "draws per block {blocks_drawn:?}");
    }

    #[test]
    fn filtering_keeps_what_each_option_keeps() {
        let logits = Tensor::from_slice(&[2.0f32, 1.0, 0.5, -1.0, 3.0, 0.0]).unsqueeze(0);
        let seen = Tensor::from_slice(&[false, false, false, true, true, false]).unsqueeze(0);
        let kept = |sampling: Sampling| Vec::<f32>::try_from(sampling_logits(&logits, &seen, &sampling).reshape([-1])).unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(kept(Sampling::default()), [2.0, 1.0, 0.5, -1.0, 3.0, 0.0], "the defaults change nothing");
        assert_eq!(kept(Sampling { repetition_penalty: 2.0, ..Sampling::default() }), [2.0, 1.0, 0.5, -2.0, 1.5, 0.0]);
        assert_eq!(kept(Sampling { temperature: 0.5, top_k: 2, ..Sampling::default() }), [4.0, inf, inf, inf, 6.0, inf]);
        // Softmax ≈ [.22, .08, .05, .01, .61, .03]: the least likely tokens adding up to ≤ 1 − 0.85 go.
        assert_eq!(kept(Sampling { top_p: 0.85, ..Sampling::default() }), [2.0, 1.0, inf, inf, 3.0, inf]);
        // e^(x − 3) ≥ 0.3 keeps x ≥ 3 + ln 0.3 ≈ 1.8.
        assert_eq!(kept(Sampling { min_p: Some(0.3), ..Sampling::default() }), [2.0, inf, inf, inf, 3.0, inf]);
    }

    #[test]
    fn bad_options_are_named() {
        let error = |sampling: Sampling| sampling.check(|name| format!("--{}", name.replace('_', "-"))).unwrap_err().to_string();
        let base = Sampling::default();
        assert!(base.check(str::to_string).is_ok());
        assert!(error(Sampling { temperature: 0.0, ..base }).starts_with("--temperature must be a positive number, not 0"));
        assert!(error(Sampling { top_k: -1, ..base }).starts_with("--top-k must be a number of tokens to keep, or 0 to keep all, not -1"));
        assert!(error(Sampling { top_p: 1.5, ..base }).starts_with("--top-p must be in (0, 1]"));
        assert!(error(Sampling { top_p: 0.0, ..base }).starts_with("--top-p must be in (0, 1]"));
        assert!(error(Sampling { min_p: Some(-0.1), ..base }).starts_with("--min-p must be in [0, 1], not -0.1"));
        assert!(error(Sampling { repetition_penalty: 0.0, ..base }).starts_with("--repetition-penalty must be a positive number"));
        assert!(error(Sampling { temperature: f64::NAN, ..base }).contains("not NaN"));
    }
}
