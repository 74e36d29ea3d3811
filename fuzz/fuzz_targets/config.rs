//! `config.json` and every family's validation, through the registry: the configuration is
//! read as `ModelConfig::from_model_dir` reads it, its family found by `registry::family_of`,
//! normalized (`Family::config`) and loaded by the family's own loader against the oracle
//! fixture checkpoint of that family (opened once). A bad field must be an error — never a
//! panic, a huge allocation or a long loop — whatever the configuration claims about sizes
//! the checkpoint does not have.
#![no_main]

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use colibri::format::config::ModelConfig;
use colibri::format::safetensors::Checkpoint;
use colibri::model::registry;
use colibri::model::LoadOptions;
use libfuzzer_sys::fuzz_target;

thread_local! {
    /// The fixture checkpoint of each model type, split as its family loads it.
    static CHECKPOINTS: RefCell<HashMap<String, Option<Rc<Checkpoint>>>> =
        RefCell::new(HashMap::new());
}

/// The fixture directory whose `config.json` has `model_type`, opened for its family.
fn fixture(model_type: &str, family: &registry::Family) -> Option<Rc<Checkpoint>> {
    CHECKPOINTS.with(|c| {
        c.borrow_mut()
            .entry(model_type.to_string())
            .or_insert_with(|| {
                let root = colibri_fuzz::fixtures();
                let dir = std::fs::read_dir(&root).ok()?.find_map(|e| {
                    let dir = e.ok()?.path();
                    let cfg = ModelConfig::from_model_dir(&dir).ok()?;
                    (cfg.model_type().ok()? == model_type).then_some(dir)
                })?;
                let mut ckpt = Checkpoint::open(&dir).ok()?;
                ckpt.split_fused(family.fused_experts).ok()?;
                Some(Rc::new(ckpt))
            })
            .clone()
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = colibri_fuzz::scratch("config");
    std::fs::write(dir.join("config.json"), data).unwrap();
    let Ok(cfg) = ModelConfig::from_model_dir(&dir) else {
        return;
    };
    assert!(cfg.json().is_object());
    let Ok(family) = registry::family_of(&cfg) else {
        return;
    };
    let model_type = cfg.model_type().expect("family_of read it");
    assert!(family.model_types.contains(&model_type.as_str()));
    let Ok(normal) = family.config(&cfg) else {
        return;
    };
    let Some(ckpt) = fixture(&model_type, family) else {
        return;
    };
    if let Ok(model) = (family.load)(&ckpt, &normal, &LoadOptions::default()) {
        // What loaded is usable: a cache can be made for it.
        let _ = model.new_cache(4);
    }
});
