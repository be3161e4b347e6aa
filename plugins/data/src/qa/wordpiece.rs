//! A small BERT vocabulary made here: nothing can be downloaded, so the
//! WordPiece vocabulary is trained with the `tokenizers` crate on the
//! project's own text, and the tokenizer around it is shaped exactly like
//! bert-base-uncased's tokenizer.json, so that transformers loads the saved
//! file as a fast tokenizer and encodes identically.

use anyhow::{bail, Context, Result};
use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
use tokenizers::models::wordpiece::{WordPiece, WordPieceTrainer};
use tokenizers::models::TrainerWrapper;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

/// BERT's special tokens; the trainer gives them the ids 0..4 in this order.
pub const SPECIAL_TOKENS: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];
const UNK: &str = "[UNK]";
const CLS: &str = "[CLS]";
const SEP: &str = "[SEP]";
const CONTINUING_SUBWORD_PREFIX: &str = "##";
/// bert-base-uncased's `max_input_chars_per_word`: longer words become [UNK].
const MAX_INPUT_CHARS_PER_WORD: usize = 100;

/// Trains a WordPiece vocabulary of at most `vocab_size` tokens (special
/// tokens and the alphabet included) on `texts` and returns an uncased BERT
/// tokenizer around it: BertNormalizer (clean text, Chinese characters
/// split, lower case, accents stripped as lower case implies), BertPreTokenizer,
/// WordPiece (`[UNK]`, `##`, 100 characters a word), the `[CLS] $A [SEP]` /
/// `[CLS] $A [SEP] $B:1 [SEP]:1` post-processor and the WordPiece decoder.
/// Save it with `tokenizer.save(path, true)`, and keep the file: the
/// trainer numbers `##` pieces in hash-map order, which also breaks ties
/// between merges, so two trainings on the same text can give slightly
/// different vocabularies (huggingface/tokenizers#1794).
pub fn train_bert_tokenizer<'a>(texts: impl Iterator<Item = &'a str>, vocab_size: usize) -> Result<Tokenizer> {
    let model = WordPiece::builder()
        .unk_token(UNK.into())
        .continuing_subword_prefix(CONTINUING_SUBWORD_PREFIX.into())
        .max_input_chars_per_word(MAX_INPUT_CHARS_PER_WORD)
        .build()
        .map_err(anyhow::Error::msg)?;
    let mut tokenizer = Tokenizer::new(model);
    // strip_accents None: follow `lowercase`, as bert-base-uncased's file says (null).
    tokenizer.with_normalizer(Some(BertNormalizer::new(true, true, None, true)));
    tokenizer.with_pre_tokenizer(Some(BertPreTokenizer));
    tokenizer.with_decoder(Some(WordPieceDecoder::new(CONTINUING_SUBWORD_PREFIX.into(), true)));

    let special_tokens = SPECIAL_TOKENS.iter().map(|token| AddedToken::from(*token, true)).collect();
    let mut trainer: TrainerWrapper = WordPieceTrainer::builder()
        .vocab_size(vocab_size)
        .special_tokens(special_tokens)
        .continuing_subword_prefix(CONTINUING_SUBWORD_PREFIX.into())
        .show_progress(false)
        .build()
        .into();
    // The trainer reads its input from several threads: hand it a Vec's items.
    let texts: Vec<&str> = texts.collect();
    if texts.is_empty() {
        bail!("cannot train a WordPiece vocabulary on no text");
    }
    tokenizer
        .train(&mut trainer, texts.into_iter())
        .map_err(anyhow::Error::msg)
        .context("WordPiece training failed")?;

    for (expected_id, token) in SPECIAL_TOKENS.iter().enumerate() {
        let id = tokenizer.token_to_id(token);
        if id != Some(expected_id as u32) {
            bail!("the trained vocabulary gives {token} the id {id:?}, not {expected_id}");
        }
    }
    let special_id =
        |token: &str| tokenizer.token_to_id(token).with_context(|| format!("the trained vocabulary has no {token}"));
    let post_processor = TemplateProcessing::builder()
        .try_single(format!("{CLS} $A {SEP}"))
        .map_err(anyhow::Error::msg)?
        .try_pair(format!("{CLS}:0 $A:0 {SEP}:0 $B:1 {SEP}:1"))
        .map_err(anyhow::Error::msg)?
        .special_tokens(vec![(CLS, special_id(CLS)?), (SEP, special_id(SEP)?)])
        .build()
        .map_err(anyhow::Error::msg)?;
    tokenizer.with_post_processor(Some(post_processor));
    Ok(tokenizer)
}

/// A BERT tokenizer trained on a file's text: a SQuAD file's contexts and
/// questions (.json), or a text/JSONL file's documents.
pub fn train_on_file(path: &std::path::Path, vocab_size: usize) -> Result<Tokenizer> {
    let source = crate::source::Source::open(path, crate::source::Split::train(None))?;
    let texts: Vec<String> = if source.kind == crate::source::Kind::Squad {
        let (examples, _) = crate::squad::read(path, true, None)?;
        let mut texts: Vec<String> = examples.iter().map(|e| e.question.clone()).collect();
        let mut contexts: Vec<&String> = examples.iter().map(|e| &e.context).collect();
        contexts.dedup();
        texts.extend(contexts.into_iter().cloned());
        texts
    } else {
        crate::text::read_documents(&source, &Default::default())?.collect::<Result<_>>()?
    };
    train_bert_tokenizer(texts.iter().map(String::as_str), vocab_size).with_context(|| format!("training a WordPiece vocabulary on {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXTS: [&str; 3] = [
        "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy.",
        "Normandy is a region in France. The Normans came from Norse raiders.",
        "Café society in Zürich; 北京 is Beijing.",
    ];

    #[test]
    fn special_tokens_come_first_and_the_pipeline_is_berts() {
        let tokenizer = train_bert_tokenizer(TEXTS.into_iter(), 200).unwrap();
        for (id, token) in SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(tokenizer.id_to_token(id as u32).as_deref(), Some(*token));
        }
        assert!(tokenizer.get_vocab_size(true) <= 200);
        let json: serde_json::Value = serde_json::from_str(&tokenizer.to_string(false).unwrap()).unwrap();
        assert_eq!(json["normalizer"]["type"], "BertNormalizer");
        assert_eq!(json["normalizer"]["lowercase"], true);
        assert_eq!(json["normalizer"]["strip_accents"], serde_json::Value::Null);
        assert_eq!(json["pre_tokenizer"]["type"], "BertPreTokenizer");
        assert_eq!(json["model"]["type"], "WordPiece");
        assert_eq!(json["model"]["unk_token"], "[UNK]");
        assert_eq!(json["model"]["max_input_chars_per_word"], 100);
        assert_eq!(json["decoder"]["type"], "WordPiece");
        assert_eq!(json["post_processor"]["type"], "TemplateProcessing");
        let added: Vec<(u64, &str, bool)> = json["added_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| (t["id"].as_u64().unwrap(), t["content"].as_str().unwrap(), t["special"].as_bool().unwrap()))
            .collect();
        assert_eq!(added, SPECIAL_TOKENS.iter().enumerate().map(|(i, t)| (i as u64, *t, true)).collect::<Vec<_>>());
    }

    #[test]
    fn pairs_are_cls_question_sep_context_sep() {
        let tokenizer = train_bert_tokenizer(TEXTS.into_iter(), 300).unwrap();
        let encoding = tokenizer.encode_char_offsets(("Who.", "CAFÉ  北京"), true).unwrap();
        // Lower case, accents stripped, CJK characters split one by one.
        let tokens: Vec<&str> = encoding.get_tokens().iter().map(String::as_str).collect();
        assert_eq!(tokens[..3], ["[CLS]", "who", "."]);
        assert_eq!(tokens[3], "[SEP]");
        assert_eq!(tokens[tokens.len() - 3..], ["北", "京", "[SEP]"]);
        assert_eq!(tokenizer.decode(&encoding.get_ids()[4..encoding.len() - 3], true).unwrap(), "cafe");
        let (question_types, context_types) = encoding.get_type_ids().split_at(4);
        assert!(question_types.iter().all(|&t| t == 0) && context_types.iter().all(|&t| t == 1));
        // Character offsets in each sequence: "北" is at character 6 of the context, byte 7.
        assert_eq!(encoding.get_offsets()[encoding.len() - 3], (6, 7));
    }

    #[test]
    fn no_text_is_an_error() {
        let err = train_bert_tokenizer(std::iter::empty(), 100).unwrap_err();
        assert!(err.to_string().contains("no text"), "{err}");
    }
}
