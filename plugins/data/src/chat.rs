//! Conversations (`{"messages": [{"role", "content"}, …], "tools": […]}`)
//! rendered with the model's chat template by a real Jinja engine
//! (minijinja, with Python's string methods from minijinja-contrib's
//! pycompat, as Hugging Face's text-generation-inference does) in the
//! context transformers gives it (`tools` and `documents`, `none` when a row
//! has none; the tokenizer's special tokens; Jinja2's tests and `tojson`),
//! and tokenised as transformers' `apply_chat_template(messages,
//! tools=tools, tokenize=True)` tokenises them.
//!
//! The loss is on the assistant's turns: the `{% generation %}` blocks when
//! the template has them (the mask of transformers'
//! `return_assistant_tokens_mask=True`), else each assistant message's
//! characters between the render of the messages before it with the
//! generation prompt and the render that ends with it — or, where a
//! template renders those as other than the start of the whole
//! conversation, its content found by rendering it as a sentinel, and the
//! end of its turn (the tokens after the content that rendering the
//! conversation up to it and the whole one share). TRL's conversational
//! prompt/completion puts the loss on the tokens after the prompt's.

use crate::example::{Example, Skipped, IGNORE_INDEX};
use crate::tokenizer;
use anyhow::{bail, Context as _, Result};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize as _;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use tokenizers::Tokenizer;

/// Where `{% generation %}` and `{% endgeneration %}` were: minijinja has
/// no custom tags, so a pre-pass turns each into a block that prints one
/// of these private-use characters (keeping the tag's whitespace control),
/// and rendering removes them and records their positions.
const GENERATION_START: char = '\u{F0001}';
const GENERATION_END: char = '\u{F0002}';

/// An assistant message's content while its place in a render is looked for.
const SENTINEL: &str = "\u{F0003}";

/// The roles chat templates know: OpenAI's (`developer`, and `function` of
/// its older API), Llama 3.1's `ipython` for tool results and OLMo's
/// `environment`. Any other is a mistake in the data (ShareGPT's `gpt`
/// would be rendered as a role of its own and never trained on).
const ROLES: [&str; 8] = ["system", "developer", "user", "assistant", "tool", "ipython", "function", "environment"];

/// A message's reasoning, under each name transformers accepts for it (the first is the one templates read).
const REASONING: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A chat template ready to render, with the special tokens it may name.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, … as tokenizer_config.json gives them.
    special_tokens: serde_json::Map<String, Json>,
    /// The template conversations are rendered with …
    default: Named,
    /// … and the one for conversations with tools, where the tokenizer has
    /// one named `tool_use` (as transformers' `get_chat_template` picks it).
    tool_use: Option<Named>,
    /// A conversational prompt/completion whose prompt's tokens are not
    /// the start of the whole one's was reported (once, as TRL warns).
    prompt_mismatch_reported: AtomicBool,
}

/// One template in the environment.
struct Named {
    /// Where it came from: its name in the environment, and in errors.
    origin: String,
    /// It marks the assistant's tokens itself.
    has_generation: bool,
}

/// A conversation as the template sees it: its messages, normalised as
/// transformers normalises them, and the tools and documents of its row.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub messages: Vec<Json>,
    /// The row's tools (JSON schemas), or none.
    pub tools: Option<Json>,
    /// The row's documents (retrieval-augmented templates), or none.
    pub documents: Option<Json>,
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
    /// `chat_template` (a string, or named templates of which "default");
    /// without an override, a `tool_use` template for conversations with
    /// tools: additional_chat_templates/tool_use.jinja, or the one so named
    /// in tokenizer_config.json.
    pub fn load(dir: &Path, override_file: Option<&Path>) -> Result<ChatTemplate> {
        let config = tokenizer::config(dir)?;
        let read = |file: &Path| -> Result<(String, String)> {
            Ok((std::fs::read_to_string(file).with_context(|| format!("cannot read chat template {}", file.display()))?, file.display().to_string()))
        };
        let (jinja, tool_use_jinja) = (dir.join("chat_template.jinja"), dir.join("additional_chat_templates/tool_use.jinja"));
        let config_path = dir.join("tokenizer_config.json").display().to_string();
        let (default, tool_use) = match override_file {
            Some(file) => (read(file)?, None),
            None if jinja.exists() => (read(&jinja)?, tool_use_jinja.exists().then(|| read(&tool_use_jinja)).transpose()?),
            None => (
                (template_in_config(&config, dir)?, config_path.clone()),
                named_in_config(&config, "tool_use").map(|template| (template.to_string(), format!("{config_path} (tool_use)"))),
            ),
        };
        ChatTemplate::new(default, tool_use, tokenizer::special_tokens(&config))
    }

    /// The `default` template and the `tool_use` one, each as (source, origin).
    fn new(default: (String, String), tool_use: Option<(String, String)>, special_tokens: serde_json::Map<String, Json>) -> Result<ChatTemplate> {
        // transformers' environment: blocks trim their newline and leading blanks.
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // No escaping whatever the template's file is called (minijinja's default escapes by the name's extension).
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        // Printed as Python prints them: True, False, None.
        env.set_formatter(|out, state, value| match value.kind() {
            ValueKind::Bool => out.write_str(if value.is_true() { "True" } else { "False" }).map_err(Error::from),
            ValueKind::None => out.write_str("None").map_err(Error::from),
            _ => minijinja::escape_formatter(out, state, value),
        });
        env.add_function("raise_exception", |message: String| -> Result<Value, Error> { Err(Error::new(ErrorKind::InvalidOperation, message)) });
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // Jinja2's `iterable` is Python's iter(): none is not iterable (minijinja
        // says it is), so `tools is iterable and tools | length > 0` is false
        // without tools instead of failing on none's length. Undefined iterates as empty in both.
        env.add_test("iterable", |value: &Value| !value.is_none() && value.try_iter().is_ok());
        let mut add = |(source, origin): (String, String)| -> Result<Named> {
            let (source, has_generation) = mark_generation(&source);
            // Named by its file, so an error's "(in FILE:LINE)" says where.
            env.add_template_owned(origin.clone(), source).map_err(|e| anyhow::anyhow!("chat template {origin}: {e:#}"))?;
            Ok(Named { origin, has_generation })
        };
        let (default, tool_use) = (add(default)?, tool_use.map(&mut add).transpose()?);
        Ok(ChatTemplate { env, special_tokens, default, tool_use, prompt_mismatch_reported: AtomicBool::new(false) })
    }

    /// The template `conversation` is rendered with: `tool_use` when it has tools and there is one.
    fn named(&self, conversation: &Conversation) -> &Named {
        match (&conversation.tools, &self.tool_use) {
            (Some(_), Some(tool_use)) => tool_use,
            _ => &self.default,
        }
    }

    /// `messages` (of `conversation`, or a part or variant of its messages) rendered with its tools and documents.
    fn render(&self, conversation: &Conversation, messages: &[Json], add_generation_prompt: bool) -> Result<Rendered, String> {
        let mut context: BTreeMap<&str, Value> = self.special_tokens.iter().map(|(key, token)| (key.as_str(), Value::from_serialize(token))).collect();
        context.insert("messages", Value::from_serialize(messages));
        context.insert("add_generation_prompt", Value::from(add_generation_prompt));
        // transformers passes these as None when a call gives none.
        context.insert("tools", Value::from_serialize(&conversation.tools));
        context.insert("documents", Value::from_serialize(&conversation.documents));
        let named = self.named(conversation);
        let template = self.env.get_template(&named.origin).map_err(|e| e.to_string())?;
        // The error alone: its debug view (the template and every variable) would flood the log.
        let marked = template.render(&context).map_err(|e| e.to_string())?;
        if !named.has_generation {
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
    pub fn encode(&self, tokenizer: &Tokenizer, conversation: &Conversation, max_seq_len: usize, truncate: bool, train_on_all: bool) -> Result<Result<Example, Skipped>> {
        let full = match self.render(conversation, &conversation.messages, false) {
            Ok(full) => full,
            Err(reason) => return Ok(Err(Skipped::Unrenderable(reason))),
        };
        let spans = match self.named(conversation).has_generation {
            true => full.generation,
            false => match self.assistant_spans(tokenizer, conversation, &full.text) {
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

    /// TRL's conversational prompt/completion: the tokens of the whole
    /// conversation (`prompt` then `completion`), the loss on those after as
    /// many as the prompt rendered with the generation prompt has (on all
    /// with `train_on_all`).
    pub fn encode_prompt_completion(&self, tokenizer: &Tokenizer, prompt: &Conversation, whole: &Conversation, max_seq_len: usize, truncate: bool, train_on_all: bool) -> Result<Result<Example, Skipped>> {
        let (prompt_text, full) = match (self.render(prompt, &prompt.messages, true), self.render(whole, &whole.messages, false)) {
            (Ok(prompt), Ok(full)) => (prompt.text, full.text),
            (Err(reason), _) | (_, Err(reason)) => return Ok(Err(Skipped::Unrenderable(reason))),
        };
        let tokens = |text: &str| -> Result<Vec<i64>> {
            let encoding = tokenizer.encode(text, false).map_err(anyhow::Error::msg).context("cannot tokenize a rendered conversation")?;
            Ok(encoding.get_ids().iter().map(|&id| id as i64).collect())
        };
        let (prompt_ids, input_ids) = (tokens(&prompt_text)?, tokens(&full)?);
        if !input_ids.starts_with(&prompt_ids) && !self.prompt_mismatch_reported.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "{}: a prompt's tokens are not the start of its prompt and completion's; as TRL, the loss starts after as many tokens as the prompt has",
                self.named(prompt).origin
            );
        }
        let prompt_len = prompt_ids.len().min(input_ids.len());
        let labels = input_ids.iter().enumerate().map(|(i, &id)| if train_on_all || i >= prompt_len { id } else { IGNORE_INDEX }).collect();
        Ok(Example { input_ids, labels }.fit(max_seq_len, truncate))
    }

    /// The token ids of `conversation` rendered (with the generation prompt
    /// when asked) and tokenised as `apply_chat_template(tokenize=True)`
    /// does: without the tokenizer's own special tokens. Err: why the
    /// template cannot render it.
    pub fn render_ids(&self, tokenizer: &Tokenizer, conversation: &Conversation, add_generation_prompt: bool) -> Result<Result<Vec<i64>, String>> {
        let text = match self.render(conversation, &conversation.messages, add_generation_prompt) {
            Ok(rendered) => rendered.text,
            Err(reason) => return Ok(Err(reason)),
        };
        let encoding = tokenizer.encode(text.as_str(), false).map_err(anyhow::Error::msg).context("cannot tokenize a rendered conversation")?;
        Ok(Ok(encoding.get_ids().iter().map(|&id| id as i64).collect()))
    }

    /// Each assistant message's characters in `full`: between the render of
    /// the messages before it with the generation prompt and the render
    /// ending with it where both are prefixes of `full`, else as
    /// [`ChatTemplate::sentinel_span`] finds them.
    fn assistant_spans(&self, tokenizer: &Tokenizer, conversation: &Conversation, full: &str) -> Result<Vec<Range<usize>>, String> {
        let messages = &conversation.messages;
        let mut spans = vec![];
        for i in (0..messages.len()).filter(|&i| messages[i].get("role").and_then(Json::as_str) == Some("assistant")) {
            // Nothing precedes a first message (templates often cannot render no messages).
            let before = match i {
                0 => String::new(),
                _ => self.render(conversation, &messages[..i], true)?.text,
            };
            let through = self.render(conversation, &messages[..=i], false)?.text;
            let span = match through.starts_with(&before) && full.starts_with(&through) {
                true => before.chars().count()..through.chars().count(),
                false => self.sentinel_span(tokenizer, conversation, i, full)?,
            };
            spans.push(span);
        }
        Ok(spans)
    }

    /// Message `i`'s span in `full` for templates whose partial renders are
    /// not prefixes of the whole one (an end token or a generation prompt
    /// only the last turn gets): its content, found as what the whole
    /// render has between the text around a sentinel put in its place; then
    /// its end of turn, the leading tokens that the render ending with it
    /// writes after its content and the whole render writes there too.
    fn sentinel_span(&self, tokenizer: &Tokenizer, conversation: &Conversation, i: usize, full: &str) -> Result<Range<usize>, String> {
        let not_found = || {
            format!(
                "{} renders message {} so that its place in the whole conversation cannot be found (use a template with {{% generation %}} blocks, or data.train_on=all)",
                self.named(conversation).origin,
                i + 1
            )
        };
        let mut marked = conversation.messages.clone();
        marked[i]["content"] = Json::from(SENTINEL);
        let whole = self.render(conversation, &marked, false)?.text;
        let through = self.render(conversation, &marked[..=i], false)?.text;
        let ((before, after), (_, own_end)) = (around_sentinel(&whole).ok_or_else(not_found)?, around_sentinel(&through).ok_or_else(not_found)?);
        if !(full.starts_with(before) && full.ends_with(after) && before.len() + after.len() <= full.len()) {
            return Err(not_found());
        }
        let content = before.chars().count()..full.chars().count() - after.chars().count();
        Ok(content.start..content.end + shared_leading_tokens(tokenizer, own_end, after)?)
    }
}

/// The text before and after the one sentinel in `text`, if it holds exactly one.
fn around_sentinel(text: &str) -> Option<(&str, &str)> {
    let (before, after) = text.split_once(SENTINEL)?;
    (!after.contains(SENTINEL)).then_some((before, after))
}

/// The characters of `text`'s leading tokens that `other`'s tokens start with too.
fn shared_leading_tokens(tokenizer: &Tokenizer, text: &str, other: &str) -> Result<usize, String> {
    let encode = |text: &str| tokenizer.encode_char_offsets(text, false).map_err(|e| format!("cannot tokenize a rendered conversation: {e}"));
    let (mine, theirs) = (encode(text)?, encode(other)?);
    let shared = mine.get_ids().iter().zip(theirs.get_ids()).take_while(|(a, b)| a == b).count();
    Ok(shared.checked_sub(1).map_or(0, |last| mine.get_offsets()[last].1))
}

impl Conversation {
    /// A row's conversation, checked: a non-empty list of messages, each an
    /// object with a known string `role` and a `content` (which a tool-call
    /// turn may leave out or null); the row's `tools` (a list of JSON
    /// schemas, or that list as a JSON string, as TRL and axolotl read it)
    /// and `documents`. `at` names the row in errors ("FILE line N").
    pub fn from_row(messages: &[Json], row: &Json, at: &str) -> Result<Conversation> {
        Ok(Conversation { messages: checked_messages(messages, at)?, tools: list_of_objects(row, "tools", at)?, documents: list_of_objects(row, "documents", at)? })
    }
}

/// `messages` checked and normalised as transformers does before rendering:
/// keys whose value is null dropped (OpenAI's `"content": null` beside
/// `tool_calls`), a message's reasoning under each of its names.
pub fn checked_messages(messages: &[Json], at: &str) -> Result<Vec<Json>> {
    if messages.is_empty() {
        bail!("{at}: an empty conversation");
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, message)| {
            let n = i + 1;
            let Json::Object(fields) = message else { bail!("{at}: message {n} is not an object") };
            let Some(role) = fields.get("role").and_then(Json::as_str) else { bail!("{at}: message {n} has no string \"role\"") };
            if !ROLES.contains(&role) {
                bail!(
                    "{at}: message {n} has role {role:?}, which no chat template knows (roles: {}); ShareGPT's human/gpt turns are read with data.format=sharegpt",
                    ROLES.join(", ")
                );
            }
            let has = |key: &str| fields.get(key).is_some_and(|value| !value.is_null());
            if !has("content") && !has("tool_calls") {
                bail!("{at}: message {n} has no \"content\" (only a turn with \"tool_calls\" may leave it out or null)");
            }
            let mut normalised: serde_json::Map<String, Json> = fields.iter().filter(|(_, value)| !value.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
            if let Some(reasoning) = REASONING.iter().find_map(|key| normalised.get(*key).cloned()) {
                // Python's {"thinking": r, **message, "reasoning_content": r}: `thinking` first unless the message has it.
                let mut aliased = serde_json::Map::from_iter([("thinking".to_string(), reasoning.clone())]);
                aliased.extend(normalised);
                aliased.insert("reasoning_content".into(), reasoning);
                normalised = aliased;
            }
            Ok(Json::Object(normalised))
        })
        .collect()
}

/// A row's `key` (`tools`, `documents`): absent or null (none), a list of
/// objects, or that list written as a JSON string.
fn list_of_objects(row: &Json, key: &str, at: &str) -> Result<Option<Json>> {
    let value = match row.get(key) {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::String(text)) => serde_json::from_str::<Json>(text).with_context(|| format!("{at}: \"{key}\" is a string but not JSON"))?,
        Some(value) => value.clone(),
    };
    match &value {
        Json::Array(items) if items.iter().all(Json::is_object) => Ok(Some(value)),
        _ => bail!("{at}: \"{key}\" is not a list of objects (JSON schemas for tools, as transformers takes them)"),
    }
}

/// tokenizer_config.json's `chat_template`: a string, or a list of
/// `{name, template}` of which the one named "default".
fn template_in_config(config: &serde_json::Map<String, Json>, dir: &Path) -> Result<String> {
    match config.get("chat_template") {
        Some(Json::String(template)) => Ok(template.clone()),
        Some(Json::Array(_)) => named_in_config(config, "default")
            .map(String::from)
            .with_context(|| format!("{}: chat_template has no template named \"default\"; give one with --chat-template", dir.join("tokenizer_config.json").display())),
        _ => bail!(
            "no chat template for conversations: {} has neither chat_template.jinja nor a chat_template in tokenizer_config.json (give one with --chat-template FILE)",
            dir.display()
        ),
    }
}

/// The template tokenizer_config.json's list of named templates has under `name`.
fn named_in_config<'c>(config: &'c serde_json::Map<String, Json>, name: &str) -> Option<&'c str> {
    config.get("chat_template")?.as_array()?.iter().find(|t| t.get("name").and_then(Json::as_str) == Some(name)).and_then(|t| t.get("template")?.as_str())
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
    let mut text = String::new();
    // chrono reports a bad format as a formatting error, never a panic, through write!.
    write!(text, "{}", chrono::Local::now().format(&format)).map_err(|_| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: bad format {format:?}")))?;
    Ok(text)
}

/// `tojson` as transformers defines it: Python's `json.dumps` with its
/// `indent`, `separators` and `sort_keys` (`", "` and `": "` between items
/// by default, `","` before a newline with `indent`), non-ASCII kept,
/// nothing HTML-escaped (minijinja's own filter escapes `<`, `>`, `&` and `'`).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<(String, String)> = kwargs.get::<Option<Vec<String>>>("separators")?.map(|pair| match <[String; 2]>::try_from(pair) {
        Ok([item, key]) => Ok((item, key)),
        Err(_) => Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators is (item separator, key separator)")),
    }).transpose()?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let (item, key) = separators.unwrap_or_else(|| (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string()));
    let mut json = serde_json::to_value(value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    if sort_keys == Some(true) {
        json.sort_all_objects();
    }
    let mut bytes = vec![];
    let formatter = PythonFormatter { item: item.into_bytes(), key: key.into_bytes(), indent: indent.map(|width| vec![b' '; width]), depth: 0, has_value: false };
    json.serialize(&mut serde_json::Serializer::with_formatter(&mut bytes, formatter)).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from(String::from_utf8(bytes).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?))
}

/// Python's `json.dumps` layout: its item and key separators and, with an
/// indent, each item on its own line (an empty list or object stays `[]`, `{}`).
struct PythonFormatter {
    item: Vec<u8>,
    key: Vec<u8>,
    indent: Option<Vec<u8>>,
    depth: usize,
    /// The list or object being written has an item (serde_json's PrettyFormatter keeps the same flag).
    has_value: bool,
}

impl PythonFormatter {
    fn newline<W: ?Sized + std::io::Write>(&self, writer: &mut W) -> std::io::Result<()> {
        if let Some(indent) = &self.indent {
            writer.write_all(b"\n")?;
            (0..self.depth).try_for_each(|_| writer.write_all(indent))?;
        }
        Ok(())
    }

    fn begin<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, open: &[u8]) -> std::io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        writer.write_all(open)
    }

    fn end<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, close: &[u8]) -> std::io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            self.newline(writer)?;
        }
        writer.write_all(close)
    }

    fn item<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            writer.write_all(&self.item)?;
        }
        self.newline(writer)
    }
}

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.begin(writer, b"[")
    }

    fn end_array<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.end(writer, b"]")
    }

    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        self.item(writer, first)
    }

    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _writer: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.begin(writer, b"{")
    }

    fn end_object<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.end(writer, b"}")
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        self.item(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        writer.write_all(&self.key)
    }

    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _writer: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conversation(messages: Json) -> Conversation {
        Conversation { messages: serde_json::from_value(messages).unwrap(), tools: None, documents: None }
    }

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
        let tokens = json!({"bos_token": "<s>"}).as_object().unwrap().clone();
        let chat = ChatTemplate::new((template.into(), "t".into()), None, tokens).unwrap();
        let one = conversation(json!([{"role": "user", "content": " hé <b> "}]));
        let rendered = chat.render(&one, &one.messages, false).unwrap();
        // Keys in the row's order, as Python's dicts keep them.
        assert_eq!(rendered.text, "<s>USER: hé <b> {\"role\": \"user\", \"content\": \" hé <b> \"}\n");
        let three = vec![one.messages[0].clone(); 3];
        assert!(chat.render(&one, &three, false).unwrap_err().contains("too long"));
    }

    #[test]
    fn jinja_semantics_are_jinja2s() {
        let chat = |template: &str| ChatTemplate::new((template.into(), "t".into()), None, Default::default()).unwrap();
        let mut plain = conversation(json!([{"role": "user", "content": "hi"}]));
        // Without tools, `tools` is none: not iterable, as in Jinja2 (minijinja's own test says it is).
        let guard = chat("{% if tools is iterable and tools | length > 0 %}{{ tools | length }} tools{% else %}none{% endif %}");
        assert_eq!(guard.render(&plain, &plain.messages, false).unwrap().text, "none");
        plain.tools = Some(json!([{"name": "f"}]));
        assert_eq!(guard.render(&plain, &plain.messages, false).unwrap().text, "1 tools");
        // Printed as Python prints them.
        let defined = chat("{{ undefined_name is iterable }} {{ 'ab' is iterable }} {{ 3 is iterable }} {{ none }}");
        assert_eq!(defined.render(&plain, &plain.messages, false).unwrap().text, "True True False None");
        // tojson: Python's separators, indent (a comma before each newline, empty containers kept), sort_keys.
        let dumps = chat("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}");
        plain.tools = Some(json!([{"z": [], "a": {"b": [1, 2.5]}, "é": "<&>"}]));
        assert_eq!(
            dumps.render(&plain, &plain.messages, false).unwrap().text,
            "[{\"z\": [], \"a\": {\"b\": [1, 2.5]}, \"é\": \"<&>\"}]|[\n  {\n    \"z\": [],\n    \"a\": {\n      \"b\": [\n        1,\n        2.5\n      ]\n    },\n    \"é\": \"<&>\"\n  }\n]|[{\"a\":{\"b\":[1,2.5]},\"z\":[],\"é\":\"<&>\"}]"
        );
        // loop.previtem / nextitem, macros, |items, dict methods.
        let looped = chat("{% macro r(m) %}[{{ m.role }}]{% endmacro %}{% for m in messages %}{{ r(m) }}{% if loop.previtem %}<{{ loop.previtem.content }}{% endif %}{% if loop.nextitem %}>{{ loop.nextitem.content }}{% endif %};{% endfor %}{% for k, v in messages[0] | items %}{{ k }}={{ v }},{% endfor %}{{ messages[0].get('x', 'none') }}");
        let two = conversation(json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]));
        assert_eq!(looped.render(&two, &two.messages, false).unwrap().text, "[user]>b;[assistant]<a;role=user,content=a,none");
    }

    #[test]
    fn messages_are_checked_and_normalised_as_transformers_does() {
        let messages = |value: Json| checked_messages(value.as_array().unwrap(), "f line 3");
        let normalised = messages(json!([{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}])).unwrap();
        assert_eq!(normalised, vec![json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]})]);
        let reasoning = messages(json!([{"role": "assistant", "content": "x", "reasoning": "r"}])).unwrap();
        assert_eq!(serde_json::to_string(&reasoning[0]).unwrap(), r#"{"thinking":"r","role":"assistant","content":"x","reasoning":"r","reasoning_content":"r"}"#);
        for (bad, expected) in [
            (json!([]), "f line 3: an empty conversation"),
            (json!([{"role": "gpt", "content": "x"}]), "f line 3: message 1 has role \"gpt\", which no chat template knows"),
            (json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": null}]), "f line 3: message 2 has no \"content\""),
            (json!(["hi"]), "f line 3: message 1 is not an object"),
        ] {
            let err = messages(bad).unwrap_err().to_string();
            assert!(err.contains(expected), "{err}");
        }
        let tools = |tools: Json| Conversation::from_row(&[json!({"role": "user", "content": "x"})], &json!({"tools": tools}), "f line 3").map(|c| c.tools);
        assert_eq!(tools(json!("[{\"name\": \"f\"}]")).unwrap(), Some(json!([{"name": "f"}])));
        assert_eq!(tools(Json::Null).unwrap(), None);
        assert!(tools(json!(["f"])).unwrap_err().to_string().contains("f line 3: \"tools\" is not a list of objects"));
    }

    #[test]
    fn generation_blocks_are_character_ranges_and_their_markers_never_come_from_messages() {
        let template = "{% for m in messages %}<{{ m.role }}>{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}";
        let chat = ChatTemplate::new((template.into(), "t".into()), None, Default::default()).unwrap();
        let two = conversation(json!([{"role": "assistant", "content": "hé"}, {"role": "assistant", "content": "yo"}]));
        let rendered = chat.render(&two, &two.messages, false).unwrap();
        // trim_blocks takes the newline after the block, as in transformers' environment.
        assert_eq!(rendered.text, "<assistant>hé<assistant>yo");
        assert_eq!(rendered.generation, vec![11..13, 24..26]);
        let marked = conversation(json!([{"role": "assistant", "content": format!("a{GENERATION_END}")}]));
        assert!(chat.render(&marked, &marked.messages, false).unwrap_err().contains("mark {% generation %} blocks"));
    }
}
