//! A model directory opened for use: the model plus whatever text-side files it has
//! (tokenizer, chat template, generation defaults). Only `config.json` and the weights are
//! required; a missing tokenizer is an error only when text is needed.

use std::path::{Path, PathBuf};

use crate::format::chat_template::ChatTemplate;
use crate::format::config::ModelConfig;
use crate::format::generation_config::GenerationConfig;
use crate::format::tokenizer::Tokenizer;
use crate::model::LoadOptions;
use crate::model::{self, CausalLm};
use crate::{Error, Result};

/// A loaded model directory.
pub struct LoadedModel {
    pub dir: PathBuf,
    pub model: Box<dyn CausalLm>,
    pub tokenizer: Option<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationConfig,
    /// End-of-sequence ids: generation_config.json's, else config.json's.
    pub eos_token_ids: Vec<u32>,
}

impl LoadedModel {
    /// Open `dir` with every weight resident. With `needs_text`, a missing or broken
    /// `tokenizer.json` is an error.
    pub fn open(dir: &Path, needs_text: bool) -> Result<LoadedModel> {
        Self::open_with(dir, needs_text, &LoadOptions::default())
    }

    /// Open `dir`, loading the model as `opts` says.
    pub fn open_with(dir: &Path, needs_text: bool, opts: &LoadOptions) -> Result<LoadedModel> {
        if crate::format::gguf::is_gguf(dir) {
            return Self::open_gguf(dir, needs_text, opts);
        }
        if dir.is_file() {
            return Err(Error::corrupt(
                dir,
                "is neither a model directory nor a GGUF file (a GGUF file starts with the bytes \"GGUF\"); pass the directory holding config.json and the safetensors, or a .gguf file",
            ));
        }
        if !dir.is_dir() {
            return Err(Error::io(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "model directory not found"),
            ));
        }
        let model = model::load_with(dir, opts)?;
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.is_file() || needs_text {
            Some(Tokenizer::from_file(&tok_path)?)
        } else {
            None
        };
        let chat_template = ChatTemplate::from_model_dir(dir)?;
        let generation = GenerationConfig::from_model_dir(dir)?;
        let mut eos_token_ids = generation.eos_token_ids.clone();
        if eos_token_ids.is_empty() {
            eos_token_ids = ModelConfig::from_model_dir(dir)?.eos_token_ids()?;
        }
        Ok(LoadedModel {
            dir: dir.to_path_buf(),
            model,
            tokenizer,
            chat_template,
            generation,
            eos_token_ids,
        })
    }

    /// Open a GGUF file: weights, tokenizer and chat template all come from the one file.
    fn open_gguf(path: &Path, needs_text: bool, opts: &LoadOptions) -> Result<LoadedModel> {
        use crate::format::gguf::GgufFile;
        use crate::format::gguf_vocab;
        let model = model::load_with(path, opts)?;
        let gguf = GgufFile::open(path)?;
        // A vocabulary we cannot build is an error only when text is needed.
        let tokenizer = match gguf_vocab::tokenizer_from_gguf(&gguf) {
            Ok(t) => Some(t),
            Err(e) if needs_text => return Err(e),
            Err(e) => {
                tracing::warn!("{}: no tokenizer: {e}", path.display());
                None
            }
        };
        let special = gguf_vocab::special_tokens(&gguf)?;
        let name =
            |id: Option<u32>| id.and_then(|i| tokenizer.as_ref().and_then(|t| t.id_to_token(i)));
        let chat_template = match gguf.get_str("tokenizer.chat_template")? {
            Some(t) => Some(
                ChatTemplate::new(t, path.to_path_buf())?
                    .with_special_tokens(name(special.bos), name(special.eos)),
            ),
            None => None,
        };
        let mut eos_token_ids: Vec<u32> = special.eos.into_iter().collect();
        if let Some(eot) = special.eot {
            if !eos_token_ids.contains(&eot) {
                eos_token_ids.push(eot);
            }
        }
        Ok(LoadedModel {
            dir: path.to_path_buf(),
            model,
            tokenizer,
            chat_template,
            generation: GenerationConfig::default(),
            eos_token_ids,
        })
    }

    /// The tokenizer, or an error saying which file is missing.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| {
            let (path, why) = if self.dir.is_file() {
                (
                    self.dir.clone(),
                    "this command needs a tokenizer, and this GGUF's vocabulary is not supported",
                )
            } else {
                (
                    self.dir.join("tokenizer.json"),
                    "this command needs a tokenizer",
                )
            };
            Error::io(path, std::io::Error::new(std::io::ErrorKind::NotFound, why))
        })
    }
}
