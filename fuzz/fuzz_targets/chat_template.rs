//! Chat-template rendering with hostile messages and tools: the real templates committed
//! under `server/tests/fixtures/chat_templates/` (the first byte picks one) render whatever
//! JSON the rest of the input is — `{"messages": …, "tools": …, "extra": …}` or a bare
//! messages array — with and without the generation prompt. A template failing on such input
//! (`raise_exception`, a missing key, a wrong type) must be an error naming the template,
//! never a panic; rendering the same input twice gives the same text.
#![no_main]

use std::cell::RefCell;

use colibri::format::chat_template::ChatTemplate;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

thread_local! {
    static TEMPLATES: RefCell<Vec<ChatTemplate>> = RefCell::new(
        colibri_fuzz::chat_templates()
            .iter()
            .map(|(name, source)| {
                ChatTemplate::new(source.clone(), name.clone())
                    .expect("a committed template compiles")
                    .with_special_tokens(Some("<s>".into()), Some("</s>".into()))
            })
            .collect(),
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, json)) = data.split_first() else {
        return;
    };
    let Ok(value) = serde_json::from_slice::<Value>(json) else {
        return;
    };
    let (messages, tools, extra) = match &value {
        Value::Array(m) => (m.clone(), None, None),
        Value::Object(o) => (
            match o.get("messages") {
                Some(Value::Array(m)) => m.clone(),
                Some(other) => vec![other.clone()],
                None => Vec::new(),
            },
            o.get("tools").map(|t| match t {
                Value::Array(t) => t.clone(),
                other => vec![other.clone()],
            }),
            o.get("extra").cloned(),
        ),
        other => (vec![other.clone()], None, None),
    };
    TEMPLATES.with(|t| {
        let templates = t.borrow();
        let template = &templates[pick as usize % templates.len()];
        for generation_prompt in [true, false] {
            let first = template.render(
                &messages,
                generation_prompt,
                tools.as_deref(),
                extra.as_ref(),
            );
            let second = template.render(
                &messages,
                generation_prompt,
                tools.as_deref(),
                extra.as_ref(),
            );
            match (&first, &second) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "rendering is not deterministic"),
                (Err(a), Err(_)) => {
                    let a = a.to_string();
                    assert!(a.contains(".jinja"), "the error names the template: {a}");
                }
                _ => panic!("one render failed, the other did not: {first:?} {second:?}"),
            }
        }
    });
});
