//! Placeholder.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}
pub fn parse_tool_calls(text: &str, _p: &str) -> (String, Vec<ToolCall>) {
    (text.to_string(), vec![])
}
pub struct ToolCallStream;
pub enum ToolStreamEvent {
    Content(String),
    Call(ToolCall),
}
impl ToolCallStream {
    pub fn new(_p: &str) -> Self {
        ToolCallStream
    }
    pub fn push(&mut self, p: &str) -> Vec<ToolStreamEvent> {
        vec![ToolStreamEvent::Content(p.to_string())]
    }
    pub fn finish(&mut self) -> Vec<ToolStreamEvent> {
        vec![]
    }
}
pub fn split_reasoning(text: &str, _s: bool) -> (Option<String>, String) {
    (None, text.to_string())
}
pub struct ReasoningStream;
pub enum ReasoningEvent {
    Reasoning(String),
    Content(String),
}
impl ReasoningStream {
    pub fn new(_s: bool) -> Self {
        ReasoningStream
    }
    pub fn push(&mut self, p: &str) -> Vec<ReasoningEvent> {
        vec![ReasoningEvent::Content(p.to_string())]
    }
    pub fn finish(&mut self) -> Vec<ReasoningEvent> {
        vec![]
    }
}
pub fn required_tool_call_grammar(
    _t: &[serde_json::Value],
    _o: Option<&str>,
) -> Result<String, String> {
    Ok(String::new())
}
