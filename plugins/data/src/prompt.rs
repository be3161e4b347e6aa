//! Question answering as causal language modelling: the prompt
//! `Question: {q} Context: {c} Answer:` followed by the answer and the end
//! token, with the loss on the answer tokens (or on every token, to train on
//! the prompt as well). When the example is too long, the context is cut,
//! never the question or the answer.

use crate::example::{eos_id, ids, Example, IGNORE_INDEX};
use crate::squad::QaExample;
use anyhow::Result;
use tokenizers::Tokenizer;

/// The prompt's token ids with the context cut to fit `budget` tokens in all.
/// None when even an empty context does not fit.
pub fn prompt_ids(tokenizer: &Tokenizer, example: &QaExample, budget: usize) -> Result<Option<Vec<i64>>> {
    let head = ids(tokenizer, &format!("Question: {} Context:", example.question), false)?;
    let mut context = ids(tokenizer, &format!(" {}", example.context), false)?;
    let tail = ids(tokenizer, " Answer:", false)?;
    let fixed = head.len() + tail.len();
    if fixed > budget {
        return Ok(None);
    }
    context.truncate(budget - fixed);
    Ok(Some([head, context, tail].concat()))
}

/// A training example (prompt, first gold answer, end token), or None when
/// the question and answer alone exceed `max_seq_len`. The loss is on the
/// answer and end token, or on every token with `train_on_prompt`.
pub fn encode(tokenizer: &Tokenizer, example: &QaExample, max_seq_len: usize, train_on_prompt: bool) -> Result<Option<Example>> {
    let answer = example.answers.first().map(String::as_str).unwrap_or("");
    let mut target = ids(tokenizer, &format!(" {answer}"), false)?;
    target.extend(eos_id(tokenizer));
    let Some(budget) = max_seq_len.checked_sub(target.len()) else { return Ok(None) };
    let Some(prompt) = prompt_ids(tokenizer, example, budget)? else { return Ok(None) };
    let input_ids = [prompt.as_slice(), &target].concat();
    let labels = match train_on_prompt {
        true => input_ids.clone(),
        false => std::iter::repeat_n(IGNORE_INDEX, prompt.len()).chain(target.iter().copied()).collect(),
    };
    Ok(Some(Example { input_ids, labels }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo;

    #[test]
    fn loss_is_on_the_answer_and_the_context_is_cut_first() {
        let dir = tempfile::tempdir().unwrap();
        let files = demo::write(dir.path(), 20, 5, 0).unwrap();
        let tokenizer = Tokenizer::from_file(&files.tokenizer).unwrap();
        let (examples, _) = crate::squad::read(&files.train, false, None).unwrap();
        let example = &examples[0];
        let full = encode(&tokenizer, example, 10_000, false).unwrap().unwrap();
        let answer_len = full.labels.iter().filter(|l| **l != IGNORE_INDEX).count();
        let answer = ids(&tokenizer, &format!(" {}", example.answers[0]), false).unwrap();
        assert_eq!(answer_len, answer.len() + 1, "answer and end token");
        assert_eq!(&full.labels[full.labels.len() - answer_len..], &full.input_ids[full.input_ids.len() - answer_len..]);
        let text = tokenizer.decode(&full.input_ids.iter().map(|&i| i as u32).collect::<Vec<_>>(), false).unwrap();
        assert!(text.starts_with(&format!("Question: {} Context: ", example.question)), "{text}");

        let short = encode(&tokenizer, example, full.input_ids.len() - 5, false).unwrap().unwrap();
        assert_eq!(short.input_ids.len(), full.input_ids.len() - 5);
        assert_eq!(&short.input_ids[short.input_ids.len() - answer_len..], &full.input_ids[full.input_ids.len() - answer_len..]);
        assert!(encode(&tokenizer, example, answer_len + 3, false).unwrap().is_none(), "no room for the question");
        let everything = encode(&tokenizer, example, 10_000, true).unwrap().unwrap();
        assert_eq!((&everything.input_ids, &everything.labels), (&full.input_ids, &full.input_ids), "the loss on every token");
    }
}
