//! Request bodies (`serve::chat::parse_json`) into the typed requests of the endpoints (an
//! Anthropic message request also translated into the chat request,
//! `serve::messages::chat_request_of_message`), then the chat request's checks
//! (`template_messages`, `tool_mode`) and its conversation and tools rendered through a real
//! chat template. A bad body or field must be a 400 (naming the
//! field when it gives one), never a panic; a request that parses, serialized and parsed
//! again, serializes to the same JSON (parse → print → parse).
#![no_main]

use std::cell::RefCell;

use colibri::format::chat_template::ChatTemplate;
use colibri_server::serve::anthropic::MessagesRequest;
use colibri_server::serve::chat::{parse_json, template_messages, tool_mode};
use colibri_server::serve::errors::ApiError;
use colibri_server::serve::messages::chat_request_of_message;
use colibri_server::serve::openai::{ChatCompletionRequest, CompletionRequest};
use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

thread_local! {
    static TEMPLATES: RefCell<Vec<ChatTemplate>> = RefCell::new(
        colibri_fuzz::chat_templates()
            .iter()
            .map(|(name, source)| ChatTemplate::new(source.clone(), name.clone()).unwrap())
            .collect(),
    );
}

fn check_error(e: &ApiError) {
    assert_eq!(e.status.as_u16(), 400, "{}", e.message);
    assert!(!e.message.is_empty());
    if let Some(p) = &e.param {
        assert!(!p.is_empty(), "an empty param: {}", e.message);
    }
}

/// Parse `data` as `T`; when it parses, check the round trip and return it.
fn parse<T: DeserializeOwned + Serialize>(data: &[u8]) -> Option<T> {
    let req: T = match parse_json(data) {
        Ok(r) => r,
        Err(e) => {
            check_error(&e);
            return None;
        }
    };
    let printed = serde_json::to_vec(&req).expect("a parsed request serializes");
    let again: T = parse_json(&printed).unwrap_or_else(|e| {
        panic!(
            "a request printed as {} does not parse again: {}",
            String::from_utf8_lossy(&printed),
            e.message
        )
    });
    assert_eq!(
        serde_json::to_value(&again).unwrap(),
        serde_json::to_value(&req).unwrap(),
        "parse → print → parse changed the request"
    );
    Some(req)
}

fuzz_target!(|data: &[u8]| {
    let _ = parse::<CompletionRequest>(data);
    if let Some(req) = parse::<MessagesRequest>(data) {
        match chat_request_of_message(&req, 4096) {
            Ok(chat) => check_chat(&chat, data),
            Err(e) => check_error(&e),
        }
    }
    if let Some(req) = parse::<ChatCompletionRequest>(data) {
        check_chat(&req, data);
    }
});

/// The checks and the rendering of a chat request.
fn check_chat(req: &ChatCompletionRequest, data: &[u8]) {
    let messages = match template_messages(&req.messages) {
        Ok(m) => m,
        Err(e) => return check_error(&e),
    };
    if let Err(e) = tool_mode(req) {
        return check_error(&e);
    }
    let tools: Option<Vec<Value>> = req
        .tools
        .as_ref()
        .map(|t| t.iter().map(|t| serde_json::to_value(t).unwrap()).collect());
    TEMPLATES.with(|t| {
        let templates = t.borrow();
        let template = &templates[data.len() % templates.len()];
        let _ = template.render(
            &messages,
            true,
            tools.as_deref(),
            req.chat_template_kwargs.as_ref(),
        );
    });
}
