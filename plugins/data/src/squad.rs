//! SQuAD v1.1 and v2.0 JSON (`data[].paragraphs[].qas[]`), read into
//! question-answer examples, all of them or a `data.range` of the file's
//! questions. v2's unanswerable questions are skipped unless asked for;
//! answers whose offsets do not match the context are counted and logged,
//! never fatal; a file that is not SQuAD is an error naming where.

use anyhow::{bail, Context, Result};
use ft_core::config::DataRange;
use serde::Deserialize;
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub struct QaExample {
    pub id: String,
    pub title: String,
    pub question: String,
    pub context: String,
    /// Gold answers (several annotators, duplicates removed, file order);
    /// empty for an unanswerable question.
    pub answers: Vec<String>,
    /// Character offset (Python string index, not bytes) of the file's first
    /// gold answer, the one run_qa.py's prepare_train_features trains on;
    /// `answers[0]` is its text. None for an unanswerable question.
    pub answer_start: Option<usize>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SquadStats {
    pub articles: usize,
    /// Every question in the file, in the range or not.
    pub questions: usize,
    pub unanswerable_skipped: usize,
    pub bad_offsets_skipped: usize,
}

#[derive(Deserialize)]
struct Article {
    #[serde(default)]
    title: String,
    paragraphs: Vec<Paragraph>,
}
#[derive(Deserialize)]
struct Paragraph {
    context: String,
    qas: Vec<Qa>,
}
#[derive(Deserialize)]
struct Qa {
    id: String,
    question: String,
    #[serde(default)]
    answers: Vec<Answer>,
    #[serde(default)]
    is_impossible: bool,
}
#[derive(Deserialize)]
struct Answer {
    text: String,
    answer_start: usize,
}

/// `answer_start` counts characters (Python string indices), not bytes.
fn offsets_match(context: &str, answer: &Answer) -> bool {
    let found: String = context.chars().skip(answer.answer_start).take(answer.text.chars().count()).collect();
    found == answer.text
}

/// The questions of `path` — those in `range` of the file's questions in
/// file order (every question counts, whether it is kept or not), or all.
pub fn read(path: &Path, include_unanswerable: bool, range: Option<DataRange>) -> Result<(Vec<QaExample>, SquadStats)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read SQuAD file {}", path.display()))?;
    // `FromStr`, not `serde_json::from_str`: parsed by serde_json's own, optimised code (Cargo.toml says why).
    let value: serde_json::Value = text.parse().with_context(|| format!("{} is not valid JSON", path.display()))?;
    parse(value, &path.display().to_string(), include_unanswerable, range)
}

pub fn parse(value: serde_json::Value, source: &str, include_unanswerable: bool, range: Option<DataRange>) -> Result<(Vec<QaExample>, SquadStats)> {
    if value.get("data").is_none() {
        bail!("{source} is not SQuAD JSON: it has no top-level \"data\" list");
    }
    // Articles are decoded one by one so that an error can name the article.
    let articles = value["data"].as_array().with_context(|| format!("{source}: \"data\" must be a list"))?;
    let mut stats = SquadStats::default();
    let mut examples = vec![];
    for (index, article) in articles.iter().enumerate() {
        let article: Article = serde_json::from_value(article.clone()).map_err(|e| {
            let title = article.get("title").and_then(|t| t.as_str()).unwrap_or("?");
            anyhow::anyhow!("{source}: article {index} ({title:?}) is not in SQuAD layout: {e}")
        })?;
        stats.articles += 1;
        for paragraph in article.paragraphs {
            for qa in paragraph.qas {
                let position = stats.questions;
                stats.questions += 1;
                if range.is_some_and(|range| !range.contains(position)) {
                    continue;
                }
                if qa.is_impossible || qa.answers.is_empty() {
                    if include_unanswerable {
                        examples.push(QaExample {
                            id: qa.id,
                            title: article.title.clone(),
                            question: qa.question,
                            context: paragraph.context.clone(),
                            answers: vec![],
                            answer_start: None,
                        });
                    } else {
                        stats.unanswerable_skipped += 1;
                    }
                    continue;
                }
                if let Some(bad) = qa.answers.iter().find(|a| !offsets_match(&paragraph.context, a)) {
                    tracing::warn!(
                        "{source}: skipping question {} in article {:?}: answer {:?} is not at offset {} of its context",
                        qa.id,
                        article.title,
                        bad.text,
                        bad.answer_start
                    );
                    stats.bad_offsets_skipped += 1;
                    continue;
                }
                let answer_start = Some(qa.answers[0].answer_start);
                let mut answers: Vec<String> = vec![];
                for answer in qa.answers {
                    if !answers.contains(&answer.text) {
                        answers.push(answer.text);
                    }
                }
                examples.push(QaExample {
                    id: qa.id,
                    title: article.title.clone(),
                    question: qa.question,
                    context: paragraph.context.clone(),
                    answers,
                    answer_start,
                });
            }
        }
    }
    if let Some(range) = range {
        range.positions(stats.questions, Path::new(source), "questions")?;
        tracing::info!("{}", range.describe(stats.questions, Path::new(source), "questions"));
    }
    Ok((examples, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn v1_layout_and_character_offsets() {
        let file = json!({"version": "1.1", "data": [{"title": "T", "paragraphs": [{"context": "Café au lait is brown.",
            "qas": [{"id": "q1", "question": "What colour?", "answers": [{"text": "brown", "answer_start": 16}, {"text": "brown", "answer_start": 16}]}]}]}]});
        let (examples, stats) = parse(file, "test", false, None).unwrap();
        assert_eq!(examples.len(), 1);
        assert_eq!(examples[0].answers, vec!["brown"]);
        // "é" is two bytes: the byte offset of "brown" would be 17.
        assert_eq!(examples[0].answer_start, Some(16));
        assert_eq!(stats, SquadStats { articles: 1, questions: 1, ..Default::default() });
    }

    #[test]
    fn answer_start_is_the_first_gold_answers() {
        let file = json!({"data": [{"title": "T", "paragraphs": [{"context": "in 1066 AD",
            "qas": [{"id": "q1", "question": "When?", "answers": [{"text": "1066 AD", "answer_start": 3},
                                                                 {"text": "1066", "answer_start": 3},
                                                                 {"text": "AD", "answer_start": 8}]},
                    {"id": "q2", "question": "Who?", "answers": [], "is_impossible": true}]}]}]});
        let (examples, stats) = parse(file, "test", true, None).unwrap();
        assert_eq!(examples[0].answers, vec!["1066 AD", "1066", "AD"]);
        assert_eq!(examples[0].answer_start, Some(3));
        assert_eq!((examples[1].answers.len(), examples[1].answer_start), (0, None));
        assert_eq!(stats.unanswerable_skipped, 0);
    }

    #[test]
    fn bad_offsets_are_counted_and_skipped() {
        let file = json!({"data": [{"title": "T", "paragraphs": [{"context": "abc def",
            "qas": [{"id": "q1", "question": "?", "answers": [{"text": "def", "answer_start": 1}]},
                    {"id": "q2", "question": "?", "answers": [{"text": "def", "answer_start": 4}]}]}]}]});
        let (examples, stats) = parse(file, "test", false, None).unwrap();
        assert_eq!(examples.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), vec!["q2"]);
        assert_eq!(stats.bad_offsets_skipped, 1);
    }

    #[test]
    fn a_range_counts_every_question_of_the_file() {
        let qa = |id: &str, impossible: bool| match impossible {
            true => json!({"id": id, "question": "?", "answers": [], "is_impossible": true}),
            false => json!({"id": id, "question": "?", "answers": [{"text": "b", "answer_start": 2}]}),
        };
        let file = json!({"data": [
            {"title": "A", "paragraphs": [{"context": "a b", "qas": [qa("q0", false), qa("q1", true)]}]},
            {"title": "B", "paragraphs": [{"context": "a b", "qas": [qa("q2", false)]}, {"context": "a b", "qas": [qa("q3", false), qa("q4", true)]}]}
        ]});
        let ids = |include_unanswerable: bool, range: &str| {
            let (examples, stats) = parse(file.clone(), "f.json", include_unanswerable, Some(range.parse().unwrap())).unwrap();
            assert_eq!(stats.questions, 5);
            examples.into_iter().map(|e| e.id).collect::<Vec<_>>()
        };
        // Across articles and paragraphs; the unanswerable keep their places.
        assert_eq!(ids(true, "1:4"), ["q1", "q2", "q3"]);
        assert_eq!(ids(false, "1:4"), ["q2", "q3"]);
        assert_eq!(ids(false, "3:"), ["q3"]);
        let err = parse(file, "f.json", false, Some("3:6".parse().unwrap())).unwrap_err().to_string();
        assert!(err.contains("data.range 3:6 is not within f.json: it has 5 questions"), "{err}");
    }

    #[test]
    fn wrong_layout_names_the_article() {
        let file = json!({"data": [{"title": "Good", "paragraphs": []}, {"title": "Broken", "paragraphs": [{"qas": []}]}]});
        let err = parse(file, "f.json", false, None).unwrap_err().to_string();
        assert!(err.contains("f.json: article 1 (\"Broken\") is not in SQuAD layout"), "{err}");
        let err = parse(json!({"rows": []}), "f.json", false, None).unwrap_err().to_string();
        assert!(err.contains("has no top-level \"data\" list"), "{err}");
    }
}
