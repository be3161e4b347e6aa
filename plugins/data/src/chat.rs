//! Conversations (`{"messages": [{"role", "content"}, …]}`) rendered with
//! the model's chat template by a real Jinja engine (minijinja, with
//! Python's string methods from minijinja-contrib's pycompat, as Hugging
//! Face's text-generation-inference does), and tokenised as transformers'
//! `apply_chat_template(messages, tokenize=True)` tokenises them.
//!
//! The loss is on the assistant's turns: the `{% generation %}` blocks when
//! the template has them (the mask of transformers'
//! `return_assistant_tokens_mask=True`), else each assistant message's
//! tokens between the render of the messages before it with the generation
//! prompt and the render that ends with it.

use crate::example::{Example, Skipped, IGNORE_INDEX};
use crate::tokenizer;
use anyhow::{bail, Context as _, Result};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize as _;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use tokenizers::Tokenizer;

/// Where `{% generation %}` and `{% endgeneration %}` were: minijinja has
/// no custom tags, so a pre-pass turns each into a block that prints one
/// of these private-use characters (keeping the tag's whitespace control),
/// and rendering removes them and records their positions.
const GENERATION_START: char = '\u{F0001}';
const GENERATION_END: char = '\u{F0002}';

/// A chat template ready to render, with the special tokens it may name.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, … as tokenizer_config.json gives them.
    special_tokens: serde_json::Map<String, Json>,
    /// The template marks the assistant's tokens itself.
    has_generation: bool,
    /// Where the template came from, for errors.
    origin: String,
}

/// A rendered conversation: its text and the character ranges of its
/// `{% generation %}` blocks.
#[derive(Debug)]
struct Rendered {
    text: String,
    generation: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// `override_file` (`--chat-template`), else `chat_template.jinja` in
    /// `dir` (where transformers saves it), else tokenizer_config.json's
    /// `chat_template` (a string, or named templates of which "default").
    pub fn load(dir: &Path, override_file: Option<&Path>) -> Result<ChatTemplate> {
        let config = tokenizer::config(dir)?;
        let jinja = dir.join("chat_template.jinja");
        let (source, origin) = match override_file {
            Some(file) => (std::fs::read_to_string(file).with_context(|| format!("cannot read chat template {}", file.display()))?, file.display().to_string()),
            None if jinja.exists() => (std::fs::read_to_string(&jinja).with_context(|| format!("cannot read {}", jinja.display()))?, jinja.display().to_string()),
            None => (template_in_config(&config, dir)?, dir.join("tokenizer_config.json").display().to_string()),
        };
        ChatTemplate::new(&source, origin, tokenizer::special_tokens(&config))
    }

    fn new(source: &str, origin: String, special_tokens: serde_json::Map<String, Json>) -> Result<ChatTemplate> {
        let (source, has_generation) = mark_generation(source);
        // transformers' environment: blocks trim their newline and leading blanks.
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<Value, Error> { Err(Error::new(ErrorKind::InvalidOperation, message)) });
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // Named by its file, so an error's "(in FILE:LINE)" says where.
        env.add_template_owned(origin.clone(), source).map_err(|e| anyhow::anyhow!("chat template {origin}: {e:#}"))?;
        Ok(ChatTemplate { env, special_tokens, has_generation, origin })
    }

    fn render(&self, messages: &[Value], add_generation_prompt: bool) -> Result<Rendered, String> {
        let mut context: BTreeMap<&str, Value> = self.special_tokens.iter().map(|(key, token)| (key.as_str(), Value::from_serialize(token))).collect();
        context.insert("messages", Value::from(messages.to_vec()));
        context.insert("add_generation_prompt", Value::from(add_generation_prompt));
        // transformers passes these as None when a call gives none.
        context.insert("tools", Value::from(()));
        context.insert("documents", Value::from(()));
        let template = self.env.get_template(&self.origin).map_err(|e| e.to_string())?;
        // The error alone: its debug view (the template and every variable) would flood the log.
        let marked = template.render(&context).map_err(|e| e.to_string())?;
        if !self.has_generation {
            return Ok(Rendered { text: marked, generation: vec![] });
        }
        // A marker in the messages themselves would be taken for a block's edge.
        if serde_json::to_string(messages).is_ok_and(|json| json.contains([GENERATION_START, GENERATION_END])) {
            return Err(format!("a message holds U+{:X} or U+{:X}, which mark {{% generation %}} blocks", GENERATION_START as u32, GENERATION_END as u32));
        }
        let (mut text, mut generation, mut open) = (String::with_capacity(marked.len()), vec![], None);
        let mut chars = 0;
        for c in marked.chars() {
            match c {
                GENERATION_START => open = Some(chars),
                GENERATION_END => generation.extend(open.take().map(|start| start..chars)),
                _ => {
                    text.push(c);
                    chars += 1;
                }
            }
        }
        Ok(Rendered { text, generation })
    }

    /// The conversation's example: the whole render's tokens, labelled on
    /// the assistant's turns (or on every token with `train_on_all`).
    pub fn encode(&self, tokenizer: &Tokenizer, messages: &[Value], max_seq_len: usize, truncate: bool, train_on_all: bool) -> Result<Result<Example, Skipped>> {
        let full = match self.render(messages, false) {
            Ok(full) => full,
            Err(reason) => return Ok(Err(Skipped::Unrenderable(reason))),
        };
        let spans = match self.has_generation {
            true => full.generation,
            false => match self.assistant_spans(messages, &full.text) {
                Ok(spans) => spans,
                Err(reason) => return Ok(Err(Skipped::Unrenderable(reason))),
            },
        };
        // Character offsets, as Python's: transformers maps its spans with them.
        let encoding = tokenizer.encode_char_offsets(full.text.as_str(), false).map_err(anyhow::Error::msg).context("cannot tokenize a rendered conversation")?;
        let input_ids: Vec<i64> = encoding.get_ids().iter().map(|&id| id as i64).collect();
        let mut trained = vec![train_on_all; input_ids.len()];
        for span in &spans {
            // As transformers: from the token holding the span's first
            // character to the one holding its last — or to the end where
            // that is none or token 0 (Python's `if end_token`); a span
            // that starts on no token ends the marking.
            let Some(first) = encoding.char_to_token(span.start, 0) else { break };
            let end = match span.end.checked_sub(1).and_then(|last| encoding.char_to_token(last, 0)) {
                Some(last) if last > 0 => last + 1,
                _ => input_ids.len(),
            };
            trained[first..end.max(first)].iter_mut().for_each(|t| *t = true);
        }
        let labels = input_ids.iter().zip(&trained).map(|(&id, &on)| if on { id } else { IGNORE_INDEX }).collect();
        Ok(Example { input_ids, labels }.fit(max_seq_len, truncate))
    }

    /// Each assistant message's characters in `full`: between the render of
    /// the messages before it with the generation prompt and the render
    /// ending with it, both prefixes of `full`.
    fn assistant_spans(&self, messages: &[Value], full: &str) -> Result<Vec<Range<usize>>, String> {
        let mut spans = vec![];
        for i in (0..messages.len()).filter(|&i| messages[i].get_attr("role").ok().as_ref().and_then(Value::as_str) == Some("assistant")) {
            // Nothing precedes a first message (templates often cannot render no messages).
            let before = match i {
                0 => String::new(),
                _ => self.render(&messages[..i], true)?.text,
            };
            let through = self.render(&messages[..=i], false)?.text;
            if !through.starts_with(&before) || !full.starts_with(&through) {
                return Err(format!(
                    "{} renders the conversation up to message {} as other than the start of the whole one, so its assistant turns cannot be found \
                     (use a template with {{% generation %}} blocks, or data.train_on=all)",
                    self.origin,
                    i + 1
                ));
            }
            spans.push(before.chars().count()..through.chars().count());
        }
        Ok(spans)
    }
}

/// tokenizer_config.json's `chat_template`: a string, or a list of
/// `{name, template}` of which the one named "default".
fn template_in_config(config: &serde_json::Map<String, Json>, dir: &Path) -> Result<String> {
    match config.get("chat_template") {
        Some(Json::String(template)) => Ok(template.clone()),
        Some(Json::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str())
            .map(String::from)
            .with_context(|| format!("{}: chat_template has no template named \"default\"; give one with --chat-template", dir.join("tokenizer_config.json").display())),
        _ => bail!(
            "no chat template for conversations: {} has neither chat_template.jinja nor a chat_template in tokenizer_config.json (give one with --chat-template FILE)",
            dir.display()
        ),
    }
}

/// Replaces `{% generation %}` / `{% endgeneration %}` (with any `-`/`+`
/// whitespace control) by `{% if true %}` blocks printing the markers, so
/// the whitespace around them is trimmed as around the original tags.
fn mark_generation(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else { break };
        let inner = &tag[2..close];
        let left = inner.strip_prefix(['-', '+']).map_or("", |_| &inner[..1]);
        let right = inner.strip_suffix(['-', '+']).map_or("", |_| &inner[inner.len() - 1..]);
        let marker = match inner.trim_matches(['-', '+']).trim() {
            "generation" => Some(GENERATION_START),
            "endgeneration" => Some(GENERATION_END),
            _ => None,
        };
        match marker {
            Some(marker) => {
                found = true;
                out.push_str(&format!("{{%{left} if true {right}%}}{marker}{{%{left} endif {right}%}}"));
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    (out, found)
}

/// `strftime_now(format)`: the local time as Python's `strftime` writes it.
fn strftime_now(format: String) -> Result<String, Error> {
    use std::fmt::Write as _;
    let mut text = String::new();
    // chrono reports a bad format as a formatting error, never a panic, through write!.
    write!(text, "{}", chrono::Local::now().format(&format)).map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: bad format {format:?}")))?;
    Ok(text)
}

/// `tojson` as transformers defines it: Python's `json.dumps` (`", "` and
/// `": "` between items, or `indent`), non-ASCII kept, nothing HTML-escaped
/// (minijinja's own filter escapes `<`, `>`, `&` and `'`).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut bytes = vec![];
    let result = match indent {
        Some(width) => {
            let indent = " ".repeat(width);
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut bytes, serde_json::ser::PrettyFormatter::with_indent(indent.as_bytes())))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(&mut bytes, PythonFormatter)),
    };
    result.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from(String::from_utf8(bytes).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?))
}

/// Python's default JSON separators.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        writer.write_all(if first { b"" } else { b", " })
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        writer.write_all(if first { b"" } else { b", " })
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// A JSONL line's conversation, checked: a non-empty list of messages,
/// each with a string `role` and a `content`. Read as template values
/// straight from the line, so objects keep their keys' order.
pub fn messages(value: &Value, path: &Path, line: usize) -> Result<Vec<Value>> {
    let where_ = || format!("{} line {line}", path.display());
    let list = value.get_attr("messages").unwrap_or_default();
    if list.kind() != ValueKind::Seq {
        bail!("{}: \"messages\" is not a list", where_());
    }
    let messages: Vec<Value> = list.try_iter().map_err(|e| anyhow::anyhow!("{}: {e}", where_()))?.collect();
    if messages.is_empty() {
        bail!("{}: an empty conversation", where_());
    }
    for (i, message) in messages.iter().enumerate() {
        if message.get_attr("role").unwrap_or_default().kind() != ValueKind::String {
            bail!("{}: message {} has no string \"role\"", where_(), i + 1);
        }
        let content = message.get_attr("content").unwrap_or_default();
        if content.is_undefined() || content.is_none() {
            bail!("{}: message {} has no \"content\"", where_(), i + 1);
        }
    }
    Ok(messages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_keep_their_whitespace_control() {
        let (source, found) = mark_generation("a {%- generation %}b{% endgeneration -%} c {% if x %}");
        assert!(found);
        assert_eq!(source, format!("a {{%- if true %}}{GENERATION_START}{{%- endif %}}b{{% if true -%}}{GENERATION_END}{{% endif -%}} c {{% if x %}}"));
        assert_eq!(mark_generation("{{ x }}{% if y %}{% endif %}"), ("{{ x }}{% if y %}{% endif %}".to_string(), false));
    }

    #[test]
    fn renders_python_style_and_refuses_with_the_templates_message() {
        let template = "{{ bos_token }}{% for m in messages %}{{ m.role.upper() }}: {{ m.content.strip() }} {{ m | tojson }}\n{% endfor %}\
                        {% if messages | length > 2 %}{{ raise_exception('too long') }}{% endif %}";
        let tokens = serde_json::json!({"bos_token": "<s>"}).as_object().unwrap().clone();
        let chat = ChatTemplate::new(template, "t".into(), tokens).unwrap();
        let messages = [Value::from_serialize(serde_json::json!({"role": "user", "content": " hé <b> "}))];
        let rendered = chat.render(&messages, false).unwrap();
        assert_eq!(rendered.text, "<s>USER: hé <b> {\"content\": \" hé <b> \", \"role\": \"user\"}\n");
        let three = vec![messages[0].clone(); 3];
        assert!(chat.render(&three, false).unwrap_err().contains("too long"));
    }

    #[test]
    fn generation_blocks_are_character_ranges_and_their_markers_never_come_from_messages() {
        let template = "{% for m in messages %}<{{ m.role }}>{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}";
        let chat = ChatTemplate::new(template, "t".into(), Default::default()).unwrap();
        let message = |content: &str| Value::from_serialize(serde_json::json!({"role": "assistant", "content": content}));
        let rendered = chat.render(&[message("hé"), message("yo")], false).unwrap();
        // trim_blocks takes the newline after the block, as in transformers' environment.
        assert_eq!(rendered.text, "<assistant>hé<assistant>yo");
        assert_eq!(rendered.generation, vec![11..13, 24..26]);
        assert!(chat.render(&[message(&format!("a{GENERATION_END}"))], false).unwrap_err().contains("mark {% generation %} blocks"));
    }
}
