//! Chat templates: the Jinja template a model's files carry (`tokenizer.chat_template` in a GGUF,
//! `chat_template` in Hugging Face's `tokenizer_config.json`) that lays a conversation out as the
//! text the model was trained on, rendered with [minijinja] the way transformers'
//! `apply_chat_template(..., tokenize=False)` renders it.
//!
//! transformers renders in a Jinja2 sandbox with `trim_blocks` and `lstrip_blocks` on, the
//! `loopcontrols` extension (`{% break %}`, `{% continue %}`), a `raise_exception(message)`
//! function, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables; we
//! set up the same, and add Python's string and dict methods (`.strip()`, `.startswith()`,
//! `.items()`, ...), which Jinja2 inherits from Python and which templates call. A template is
//! read from a downloaded file, so a render's work is bounded ([`FUEL`]) and every failure is an
//! error, never a panic. Not supported: `tools`, `documents` and other arguments beyond the
//! messages, and transformers' `strftime_now`.

use std::collections::BTreeMap;
use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind, context};

use super::tokenizer::TokenizerError;

/// The most instructions one render may run: far more than any conversation needs, so that a
/// template that loops for ever (or nearly) is an error rather than a hang.
pub const FUEL: u64 = 50_000_000;

/// The name minijinja knows the template by, which its messages give with the line
/// (`(in chat_template:3)`); ours start with the template's own name.
const INTERNAL_NAME: &str = "chat_template";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// Who speaks: `system`, `user`, `assistant` (whatever roles the template knows).
    pub role: String,
    /// What they say.
    pub content: String,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template, with the variables every render sees (the special tokens).
#[derive(Clone)]
pub struct ChatTemplate {
    name: String,
    source: Arc<str>,
    env: Arc<Environment<'static>>,
    variables: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("name", &self.name)
            .field("source", &self.source)
            .field("variables", &self.variables)
            .finish()
    }
}

impl ChatTemplate {
    /// Compile `source`; a syntax error names it "chat template".
    pub fn new(source: &str) -> Result<ChatTemplate, TokenizerError> {
        ChatTemplate::named("chat template", source)
    }

    /// Compile `source`; errors (compiling and rendering) start with `name`, e.g. the file and
    /// metadata key it was read from.
    pub fn named(name: impl Into<String>, source: &str) -> Result<ChatTemplate, TokenizerError> {
        let name = name.into();
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&name, &e))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(INTERNAL_NAME, source.to_string())
            .map_err(|e| template_error(&name, &e))?;
        Ok(ChatTemplate {
            name,
            source: source.into(),
            env: Arc::new(env),
            variables: Vec::new(),
        })
    }

    /// The same template with the string variable `name` set to `value` in every render, as
    /// transformers sets `bos_token` and `eos_token` to the tokenizer's special tokens.
    pub fn with_variable(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let name = name.into();
        self.variables.retain(|(n, _)| *n != name);
        self.variables.push((name, value.into()));
        self
    }

    /// The name errors give the template.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The text of `messages` laid out by the template; `add_generation_prompt` asks it to end
    /// with the start of the assistant's reply (for generating one), as in transformers.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        // Each message a map of `role` then `content`, in that order (as a Python dict).
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| context! { role => m.role.as_str(), content => m.content.as_str() })
            .collect();
        let mut context: BTreeMap<String, Value> = self
            .variables
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        context.insert("messages".into(), Value::from(messages));
        let generation = Value::from(add_generation_prompt);
        context.insert("add_generation_prompt".into(), generation);
        let template = self
            .env
            .get_template(INTERNAL_NAME)
            .map_err(|e| template_error(&self.name, &e))?;
        template
            .render(Value::from(context))
            .map_err(|e| template_error(&self.name, &e))
    }
}

/// transformers' `raise_exception(message)`: a template's way to refuse a conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// A [`TokenizerError::Template`]: the template's name, minijinja's message and, for an error
/// raised inside a call, what caused it.
fn template_error(name: &str, error: &Error) -> TokenizerError {
    let mut message = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    TokenizerError::Template {
        template: name.to_string(),
        message,
    }
}
