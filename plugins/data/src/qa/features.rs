//! Question-answering features exactly as transformers'
//! examples/pytorch/question-answering/run_qa.py prepares them for BERT
//! (question first, context second, padding on the right): the question is
//! `lstrip`ped, the pair is tokenized with `truncation="only_second"`,
//! `max_length=max_seq_length`, `stride=doc_stride`,
//! `return_overflowing_tokens=True`, `padding="max_length"`, so a long
//! context gives several overlapping windows. Training windows carry the
//! answer's start/end token positions (`prepare_train_features`),
//! evaluation windows their example and the character offsets of their
//! context tokens (`prepare_validation_features`).
//!
//! An example that cannot be windowed (its question is so long that no
//! context window of more than `doc_stride` tokens fits) is skipped,
//! counted and logged: the `prepare_*` functions return it in `skipped`.

use crate::metrics::is_python_space;
use crate::squad::QaExample;
use anyhow::{bail, Context, Result};
use std::path::Path;
use tokenizers::utils::padding::{PaddingDirection, PaddingParams, PaddingStrategy};
use tokenizers::utils::parallelism::MaybeParallelRefIterator;
use tokenizers::utils::truncation::{TruncationDirection, TruncationParams, TruncationStrategy};
use tokenizers::{Encoding, PostProcessor, Tokenizer};

const CLS: &str = "[CLS]";
const PAD: &str = "[PAD]";
/// `sequence_ids` of the context: it is the pair's second sequence.
const CONTEXT_SEQUENCE: Option<usize> = Some(1);

/// run_qa.py's `max_seq_length` and `doc_stride` (defaults 384 and 128).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowConfig {
    /// Tokens a window holds: special tokens, question, context, padding.
    pub max_seq_length: usize,
    /// Context tokens two consecutive windows share.
    pub doc_stride: usize,
}

impl Default for WindowConfig {
    fn default() -> Self {
        WindowConfig { max_seq_length: 384, doc_stride: 128 }
    }
}

/// The model inputs of one window, each `max_seq_length` long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub input_ids: Vec<i64>,
    pub token_type_ids: Vec<i64>,
    pub attention_mask: Vec<i64>,
}

/// A training window and its labels: the answer's first and last token,
/// or both the [CLS] index when the question is unanswerable or the answer
/// is not wholly inside this window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainFeature {
    pub window: Window,
    /// Index of the example in the slice the features were made from
    /// (run_qa.py's `overflow_to_sample_mapping`).
    pub example_index: usize,
    pub start_position: i64,
    pub end_position: i64,
}

/// An evaluation window: its example and, for each token, its character
/// span in the example's context, or None for question, special and
/// padding tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationFeature {
    pub window: Window,
    /// Index of the example in the slice the features were made from
    /// (run_qa.py stores the example's id as `example_id`).
    pub example_index: usize,
    pub offset_mapping: Vec<Option<(usize, usize)>>,
}

/// An example that gave no features, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedExample {
    pub example_index: usize,
    pub id: String,
    pub reason: String,
}

/// The features of a list of examples and the examples skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Features<F> {
    pub features: Vec<F>,
    pub skipped: Vec<SkippedExample>,
}

/// A tokenizer set up to window question-context pairs.
pub struct QaFeaturizer {
    /// As loaded, without truncation or padding: it measures the question.
    plain: Tokenizer,
    /// Truncating only the context, with the stride, padded to max length.
    windowed: Tokenizer,
    cls_id: u32,
    /// Special tokens the pair template adds ([CLS] and two [SEP] for BERT).
    pair_special_tokens: usize,
    config: WindowConfig,
}

/// One window's encoding, in the shapes run_qa.py reads.
struct EncodedWindow {
    window: Window,
    offsets: Vec<(usize, usize)>,
    sequence_ids: Vec<Option<usize>>,
}

impl QaFeaturizer {
    /// Loads a tokenizer.json; see `new`.
    pub fn from_file(path: &Path, config: WindowConfig) -> Result<QaFeaturizer> {
        let tokenizer =
            Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
        QaFeaturizer::new(tokenizer, &path.display().to_string(), config)
    }

    /// Checks once, on a probe pair, that the tokenizer (named `source` in
    /// errors) can make run_qa.py's features: it needs [CLS] and [PAD]
    /// tokens, a post-processor for pairs that puts [CLS] in and marks the
    /// context as the second sequence, and character offsets that cover the
    /// context.
    pub fn new(tokenizer: Tokenizer, source: &str, config: WindowConfig) -> Result<QaFeaturizer> {
        let mut plain = tokenizer;
        plain.with_truncation(None).map_err(anyhow::Error::msg)?;
        plain.with_padding(None);
        let cls_id = plain.token_to_id(CLS);
        let pad_id = plain.token_to_id(PAD);
        let (pair_special_tokens, single_special_tokens) =
            plain.get_post_processor().map_or((0, 0), |p| (p.added_tokens(true), p.added_tokens(false)));
        let mut missing = vec![];
        if cls_id.is_none() {
            missing.push(format!("no {CLS} token"));
        }
        if pad_id.is_none() {
            missing.push(format!("no {PAD} token"));
        }
        if plain.get_post_processor().is_none() {
            missing.push("no post-processor for question-context pairs".to_string());
        }
        if missing.is_empty() {
            missing.extend(
                probe_problems(&plain).with_context(|| format!("{source} cannot make question-answering features"))?,
            );
        }
        let (Some(cls_id), Some(pad_id), true) = (cls_id, pad_id, missing.is_empty()) else {
            bail!("{source} cannot make question-answering features: {}", missing.join("; "));
        };
        // The tokenizers crate subtracts both counts from max_length.
        if config.max_seq_length <= pair_special_tokens.max(single_special_tokens) {
            bail!(
                "max_seq_length {} leaves no room for question and context after the {pair_special_tokens} special tokens",
                config.max_seq_length
            );
        }

        let mut windowed = plain.clone();
        windowed
            .with_truncation(Some(TruncationParams {
                max_length: config.max_seq_length,
                stride: config.doc_stride,
                strategy: TruncationStrategy::OnlySecond,
                direction: TruncationDirection::Right,
            }))
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("max_seq_length {}, doc_stride {}", config.max_seq_length, config.doc_stride))?;
        windowed.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::Fixed(config.max_seq_length),
            direction: PaddingDirection::Right,
            pad_to_multiple_of: None,
            pad_id,
            pad_type_id: 0,
            pad_token: PAD.to_string(),
        }));
        Ok(QaFeaturizer { plain, windowed, cls_id, pair_special_tokens, config })
    }

    /// run_qa.py's `prepare_train_features` for one example.
    pub fn train_features(&self, example_index: usize, example: &QaExample) -> Result<Vec<TrainFeature>> {
        self.encode_windows(example)?
            .into_iter()
            .map(|encoded| {
                let (start_position, end_position) = self.answer_positions(example, &encoded)?;
                Ok(TrainFeature { window: encoded.window, example_index, start_position, end_position })
            })
            .collect()
    }

    /// run_qa.py's `prepare_validation_features` for one example: offsets
    /// outside the context set to None.
    pub fn validation_features(&self, example_index: usize, example: &QaExample) -> Result<Vec<ValidationFeature>> {
        let windows = self.encode_windows(example)?;
        Ok(windows
            .into_iter()
            .map(|encoded| {
                let offset_mapping = encoded
                    .offsets
                    .iter()
                    .zip(&encoded.sequence_ids)
                    .map(|(&offsets, &sequence)| (sequence == CONTEXT_SEQUENCE).then_some(offsets))
                    .collect();
                ValidationFeature { window: encoded.window, example_index, offset_mapping }
            })
            .collect())
    }

    /// Training features of all examples; examples that cannot be windowed
    /// are skipped, counted and logged.
    pub fn prepare_train_features(&self, examples: &[QaExample]) -> Features<TrainFeature> {
        prepare_all(examples, |index, example| self.train_features(index, example))
    }

    /// Evaluation features of all examples; examples that cannot be windowed
    /// are skipped, counted and logged.
    pub fn prepare_validation_features(&self, examples: &[QaExample]) -> Features<ValidationFeature> {
        prepare_all(examples, |index, example| self.validation_features(index, example))
    }

    /// The example's windows: the main encoding, then its overflowing ones,
    /// the order transformers returns them in.
    fn encode_windows(&self, example: &QaExample) -> Result<Vec<EncodedWindow>> {
        // run_qa.py: "Some of the questions have lots of whitespace on the left".
        let question = example.question.trim_start_matches(is_python_space);
        self.check_question_fits(question, &example.context)?;
        let mut encoding = self
            .windowed
            .encode_char_offsets((question, example.context.as_str()), true)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("cannot tokenize question {}", example.id))?;
        let overflowing = encoding.take_overflowing();
        Ok(std::iter::once(encoding).chain(overflowing).map(|e| encoded_window(&e)).collect())
    }

    /// When the context has to be cut into windows, each must hold more than
    /// `doc_stride` context tokens next to the question (the tokenizers crate
    /// would fail, or panic, on such a pair).
    fn check_question_fits(&self, question: &str, context: &str) -> Result<()> {
        let count =
            |text: &str| -> Result<usize> { Ok(self.plain.encode(text, false).map_err(anyhow::Error::msg)?.len()) };
        let question_tokens = count(question)?;
        let budget = self.config.max_seq_length - self.pair_special_tokens;
        let context_room = budget.saturating_sub(question_tokens);
        if context_room > self.config.doc_stride {
            return Ok(());
        }
        let context_tokens = count(context)?;
        if question_tokens + context_tokens <= budget {
            return Ok(());
        }
        let (max_seq_length, special, stride) =
            (self.config.max_seq_length, self.pair_special_tokens, self.config.doc_stride);
        if context_room == 0 {
            bail!(
                "the question is too long: its {question_tokens} tokens and the {special} special tokens \
                 leave no room for its context in max_seq_length {max_seq_length}"
            );
        }
        bail!(
            "the question is too long: its {question_tokens} tokens and the {special} special tokens leave \
             {context_room} of max_seq_length {max_seq_length} to its {context_tokens} context tokens, \
             and windowing them needs more than doc_stride {stride} tokens a window"
        )
    }

    /// run_qa.py's labels for one training window: the [CLS] index for an
    /// unanswerable question (`answers["answer_start"]` empty) or an answer
    /// not wholly inside the window's context; else the tokens holding the
    /// answer's first and last character, found by run_qa.py's two walks.
    fn answer_positions(&self, example: &QaExample, encoded: &EncodedWindow) -> Result<(i64, i64)> {
        let input_ids = &encoded.window.input_ids;
        let cls_index = input_ids.iter().position(|&id| id == self.cls_id as i64).unwrap_or(0) as i64;
        let (Some(start_char), Some(answer)) = (example.answer_start, example.answers.first()) else {
            return Ok((cls_index, cls_index));
        };
        let end_char = start_char + answer.chars().count();
        let offsets = &encoded.offsets;
        let is_context = |&sequence: &Option<usize>| sequence == CONTEXT_SEQUENCE;
        let (Some(first_context), Some(last_context)) =
            (encoded.sequence_ids.iter().position(is_context), encoded.sequence_ids.iter().rposition(is_context))
        else {
            bail!("question {}: a window holds no context token to label", example.id);
        };
        if !(offsets[first_context].0 <= start_char && offsets[last_context].1 >= end_char) {
            return Ok((cls_index, cls_index));
        }
        // run_qa.py walks forward while tokens start at or before the answer;
        // like it, the walk goes on through [SEP] and padding (offsets (0, 0))
        // when the answer starts in the window's last context token.
        let mut start = first_context;
        while start < offsets.len() && offsets[start].0 <= start_char {
            start += 1;
        }
        // And backward while tokens end at or after the answer's end; only an
        // empty answer at character 0 walks off the window (Python fails there).
        let mut end = last_context;
        while offsets[end].1 >= end_char {
            end = end.checked_sub(1).with_context(|| {
                format!("question {}: run_qa.py cannot place an empty answer at character 0", example.id)
            })?;
        }
        Ok((start as i64 - 1, end as i64 + 1))
    }
}

fn encoded_window(encoding: &Encoding) -> EncodedWindow {
    let widen = |values: &[u32]| values.iter().map(|&v| v as i64).collect();
    EncodedWindow {
        window: Window {
            input_ids: widen(encoding.get_ids()),
            token_type_ids: widen(encoding.get_type_ids()),
            attention_mask: widen(encoding.get_attention_mask()),
        },
        offsets: encoding.get_offsets().to_vec(),
        sequence_ids: encoding.get_sequence_ids(),
    }
}

/// What keeps the tokenizer from windowing a probe pair the way run_qa.py
/// needs, if anything.
fn probe_problems(tokenizer: &Tokenizer) -> Result<Vec<String>> {
    let (question, context) = ("Where is the probe?", "The probe is in Zürich.");
    let encoding = tokenizer
        .encode_char_offsets((question, context), true)
        .map_err(anyhow::Error::msg)
        .context("cannot tokenize a probe question-context pair")?;
    let mut problems = vec![];
    let cls_id = tokenizer.token_to_id(CLS);
    if !encoding.get_ids().iter().any(|&id| Some(id) == cls_id) {
        problems.push(format!("its pair post-processor does not add {CLS}"));
    }
    let context_offsets: Vec<(usize, usize)> = encoding
        .get_offsets()
        .iter()
        .zip(encoding.get_sequence_ids())
        .filter(|(_, sequence)| *sequence == CONTEXT_SEQUENCE)
        .map(|(&offsets, _)| offsets)
        .collect();
    let context_chars = context.chars().count();
    let covers_context = context_offsets.first().is_some_and(|first| first.0 == 0)
        && context_offsets.last().is_some_and(|last| last.1 == context_chars)
        && context_offsets.iter().all(|&(start, end)| start < end)
        && context_offsets.windows(2).all(|pair| pair[0].1 <= pair[1].0);
    if context_offsets.is_empty() {
        problems.push("its pair post-processor does not mark the context as the second sequence".to_string());
    } else if !covers_context {
        problems.push(format!("no usable character offsets (the probe context {context:?} gives {context_offsets:?})"));
    }
    Ok(problems)
}

/// Features of every example, on several threads as the tokenizers crate
/// encodes batches (TOKENIZERS_PARALLELISM=false keeps it on one); the
/// examples that fail are skipped, counted and logged, in example order.
fn prepare_all<F: Send>(
    examples: &[QaExample],
    features_of: impl Fn(usize, &QaExample) -> Result<Vec<F>> + Send + Sync,
) -> Features<F> {
    let results: Vec<Result<Vec<F>>> =
        examples.maybe_par_iter().enumerate().map(|(index, example)| features_of(index, example)).collect();
    let mut all = Features { features: vec![], skipped: vec![] };
    for ((index, example), result) in examples.iter().enumerate().zip(results) {
        match result {
            Ok(features) => all.features.extend(features),
            Err(e) => {
                let reason = format!("{e:#}");
                tracing::warn!("skipping question {}: {reason}", example.id);
                all.skipped.push(SkippedExample { example_index: index, id: example.id.clone(), reason });
            }
        }
    }
    all
}

/// The project's shared test data (tests/common/shared.rs), for the GPT-2 tokenizer.
#[cfg(test)]
#[path = "../../../../tests/common/shared.rs"]
mod shared_data;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qa::wordpiece::train_bert_tokenizer;

    const CONTEXT: &str = "alpha bravo charlie delta echo foxtrot golf hotel india juliet";
    /// A vocabulary big enough that every word below is one token.
    const TEXTS: [&str; 3] = [CONTEXT, "which one is it , the long question", "Café Zürich 北京 alpha"];

    /// Windows of 10 tokens: [CLS] which one [SEP], 5 context tokens, [SEP];
    /// with a stride of 2 the context tokens 0-4, 3-7 and 6-9 (padded).
    fn featurizer() -> QaFeaturizer {
        let tokenizer = train_bert_tokenizer(TEXTS.into_iter(), 2000).unwrap();
        QaFeaturizer::new(tokenizer, "test", WindowConfig { max_seq_length: 10, doc_stride: 2 }).unwrap()
    }

    fn example(question: &str, context: &str, answer: Option<(&str, usize)>) -> QaExample {
        QaExample {
            id: "q".into(),
            title: "T".into(),
            question: question.into(),
            context: context.into(),
            answers: answer.map(|(text, _)| vec![text.to_string()]).unwrap_or_default(),
            answer_start: answer.map(|(_, start)| start),
        }
    }

    fn positions(featurizer: &QaFeaturizer, answer: Option<(&str, usize)>) -> Vec<(i64, i64)> {
        let features = featurizer.train_features(7, &example("which one", CONTEXT, answer)).unwrap();
        assert!(features.iter().all(|f| f.example_index == 7));
        features.iter().map(|f| (f.start_position, f.end_position)).collect()
    }

    #[test]
    fn windows_overlap_by_the_stride_and_are_padded() {
        let featurizer = featurizer();
        let features = featurizer.validation_features(0, &example("which one", CONTEXT, None)).unwrap();
        let word = |text: &str| featurizer.plain.token_to_id(text).unwrap() as i64;
        let words = |text: &str| text.split(' ').map(word).collect::<Vec<_>>();
        let (cls, sep, pad) = (word("[CLS]"), word("[SEP]"), word("[PAD]"));
        let expected_ids = [
            [vec![cls], words("which one"), vec![sep], words("alpha bravo charlie delta echo"), vec![sep]].concat(),
            [vec![cls], words("which one"), vec![sep], words("delta echo foxtrot golf hotel"), vec![sep]].concat(),
            [vec![cls], words("which one"), vec![sep], words("golf hotel india juliet"), vec![sep, pad]].concat(),
        ];
        let ids: Vec<Vec<i64>> = features.iter().map(|f| f.window.input_ids.clone()).collect();
        assert_eq!(ids, expected_ids);
        assert_eq!(features[2].window.token_type_ids, [0, 0, 0, 0, 1, 1, 1, 1, 1, 0]);
        assert_eq!(features[2].window.attention_mask, [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]);
        // Character spans of the context tokens only: "golf" is characters 39..43.
        let none = None;
        assert_eq!(
            features[2].offset_mapping,
            [none, none, none, none, Some((39, 43)), Some((44, 49)), Some((50, 55)), Some((56, 62)), none, none]
        );
    }

    #[test]
    fn answers_are_labelled_in_the_windows_that_hold_them_whole() {
        let featurizer = featurizer();
        // Context token k sits at position 4 + k - 3w in window w.
        // "echo foxtrot" (tokens 4-5) straddles windows 0 and 1: only window 1 holds it whole.
        assert_eq!(positions(&featurizer, Some(("echo foxtrot", 26))), [(0, 0), (5, 6), (0, 0)]);
        // "alpha" is in window 0 only.
        assert_eq!(positions(&featurizer, Some(("alpha", 0))), [(4, 4), (0, 0), (0, 0)]);
        // "golf" (token 6) is in windows 1 and 2.
        assert_eq!(positions(&featurizer, Some(("golf", 39))), [(0, 0), (7, 7), (4, 4)]);
        // run_qa.py's forward walk passes an answer in the window's last context
        // token and runs through [SEP] to the end: "hotel" gives (9, 8) in window 1.
        assert_eq!(positions(&featurizer, Some(("hotel", 44))), [(0, 0), (9, 8), (5, 5)]);
        // Unanswerable: [CLS] everywhere.
        assert_eq!(positions(&featurizer, None), [(0, 0), (0, 0), (0, 0)]);
        // An answer starting inside a token labels that token ("lpha" -> "alpha").
        assert_eq!(positions(&featurizer, Some(("lpha bravo", 1))), [(4, 5), (0, 0), (0, 0)]);
    }

    #[test]
    fn offsets_count_characters_not_bytes() {
        let featurizer = featurizer();
        // "é" and "ü" are two bytes, "北" and "京" three: "zürich" is characters 5..11 (bytes 6..13).
        let context = "Café Zürich 北京 alpha";
        let features = featurizer.validation_features(0, &example("which one", context, None)).unwrap();
        let spans: Vec<(usize, usize)> = features[0].offset_mapping.iter().flatten().copied().collect();
        assert_eq!(spans, [(0, 4), (5, 11), (12, 13), (13, 14), (15, 20)]);
        let train = featurizer.train_features(0, &example("which one", context, Some(("北京", 12)))).unwrap();
        assert_eq!((train[0].start_position, train[0].end_position), (6, 7));
    }

    #[test]
    fn the_question_is_lstripped_as_python_does() {
        let featurizer = featurizer();
        let stripped = featurizer.validation_features(0, &example("which one", CONTEXT, None)).unwrap();
        let padded = featurizer.validation_features(0, &example(" \u{1f}\t which one", CONTEXT, None)).unwrap();
        assert_eq!(stripped, padded);
    }

    #[test]
    fn a_question_too_long_for_any_window_is_skipped_and_counted() {
        let featurizer = featurizer();
        // 6 question tokens leave 1 context token a window, not more than the stride 2.
        let long = "which one is it , the";
        let examples = [
            example("which one", CONTEXT, None),
            example(long, CONTEXT, Some(("alpha", 0))),
            example(long, "alpha", Some(("alpha", 0))),
            example("the long question is the long question", "alpha", None),
        ];
        let features = featurizer.prepare_train_features(&examples);
        // The second example needs windows and cannot have them; the third fits
        // whole; the fourth's 7 question tokens leave no room at all.
        let indices: Vec<usize> = features.features.iter().map(|f| f.example_index).collect();
        assert_eq!(indices, [0, 0, 0, 2]);
        let skipped: Vec<usize> = features.skipped.iter().map(|s| s.example_index).collect();
        assert_eq!(skipped, [1, 3]);
        assert!(
            features.skipped[0]
                .reason
                .contains("the question is too long: its 6 tokens and the 3 special tokens leave 1 of"),
            "{:?}",
            features.skipped
        );
        assert!(
            features.skipped[1].reason.contains("its 7 tokens and the 3 special tokens leave no room"),
            "{:?}",
            features.skipped
        );
        assert_eq!(featurizer.prepare_validation_features(&examples).skipped, features.skipped);
    }

    #[test]
    fn a_gpt2_tokenizer_is_refused_naming_what_it_lacks() {
        if shared_data::skipped_without(&[shared_data::GPT2_TOKENIZER]) {
            return;
        }
        let gpt2 = shared_data::path(shared_data::GPT2_TOKENIZER);
        let err = QaFeaturizer::from_file(&gpt2, WindowConfig::default()).err().unwrap().to_string();
        assert!(err.contains("gpt2/tokenizer.json cannot make question-answering features"), "{err}");
        assert!(err.contains("no [CLS] token; no [PAD] token"), "{err}");
    }

    #[test]
    fn tokenizers_that_cannot_window_are_refused_naming_what_is_missing() {
        let mut no_pairs = train_bert_tokenizer(TEXTS.into_iter(), 2000).unwrap();
        no_pairs.with_post_processor(None::<tokenizers::PostProcessorWrapper>);
        let err = QaFeaturizer::new(no_pairs, "bert.json", WindowConfig::default()).err().unwrap().to_string();
        assert_eq!(
            err,
            "bert.json cannot make question-answering features: no post-processor for question-context pairs"
        );

        let tokenizer = train_bert_tokenizer(TEXTS.into_iter(), 2000).unwrap();
        let err =
            QaFeaturizer::new(tokenizer, "bert.json", WindowConfig { max_seq_length: 3, doc_stride: 1 }).err().unwrap();
        assert!(err.to_string().contains("max_seq_length 3 leaves no room"), "{err}");
    }
}
