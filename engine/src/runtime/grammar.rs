//! Placeholder until the llguidance constraint lands.

/// What a request constrains its output to.
#[derive(Debug, Clone)]
pub enum Grammar {
    JsonObject,
    JsonSchema(serde_json::Value),
    Lark(String),
    Regex(String),
}

/// Vocabulary side.
pub struct GrammarVocab;

impl GrammarVocab {
    pub fn new(_t: &tokenizers::Tokenizer, _eos: &[u32]) -> Result<GrammarVocab, String> {
        Ok(GrammarVocab)
    }
    pub fn constraint(&self, _g: &Grammar) -> Result<Constraint, String> {
        Ok(Constraint)
    }
}

/// A per-request constraint.
pub struct Constraint;

impl Constraint {
    pub fn mask_logits(&mut self, _logits: &mut [f32]) -> Result<(), String> {
        Ok(())
    }
    pub fn consume(&mut self, _token: u32) -> Result<(), String> {
        Ok(())
    }
    pub fn is_finished(&self) -> bool {
        false
    }
}
