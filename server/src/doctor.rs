//! `coli doctor`: read-only checks that a model and a configuration will serve, each problem
//! one line `error|warning: <file or key>: <what> — <fix>`.
//!
//! What it checks: the configuration (as `coli serve` reads it); the model directory complete
//! (`config.json`, every shard `model.safetensors.index.json` names and every tensor it names in
//! them, each shard's header, `tokenizer.json`, a chat template) or the GGUF file readable; the
//! family's own validation of every tensor's name, shape and dtype (the load `coli plan`
//! describes, [`colibri::model::describe`]); the plan against the memory available and the
//! free disk; the state directory writable (tested with an unnamed temporary file, so nothing is
//! left); the mirror directories against the primary's files (and their receipts); O_DIRECT
//! and io-uring. `--deep` also reads every tensor's bytes: float tensors scanned for NaN and
//! infinity, each file's SHA-256 compared with `coli pull`'s receipt (`coli-pull.json`) when
//! there is one.
//!
//! Exit status: 0 when every check passed, 1 when there were warnings only, 2 when something
//! failed.

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use colibri::format::safetensors::{describe_file, TensorDesc};
use colibri::store::budget::format_size;
use colibri::tensor::DType;

use crate::config::{ServeConfig, ServeFlags};

/// Arguments of `coli doctor`.
#[derive(clap::Args, Debug)]
pub struct DoctorArgs {
    /// The configuration `coli serve` would run with (a file, a profile, `COLI_*` variables and
    /// these flags); `--model` names the model to check.
    #[command(flatten)]
    pub flags: ServeFlags,
    /// Also read every tensor's bytes: NaN/Inf in float tensors, and each file's SHA-256
    /// against `coli pull`'s receipt when there is one.
    #[arg(long)]
    pub deep: bool,
}

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Works, but not as configured or not as well as it could.
    Warning,
    /// Will not serve, or serves wrong results.
    Error,
}

/// One problem found.
#[derive(Debug, Clone)]
pub struct Finding {
    pub level: Level,
    /// The file or configuration key it is about (empty when `what` starts with the file, as
    /// the engine's messages do).
    pub subject: String,
    pub what: String,
    pub fix: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let level = match self.level {
            Level::Error => "error",
            Level::Warning => "warning",
        };
        if self.subject.is_empty() {
            // The message names its file itself (an engine error: `FILE: what`).
            write!(f, "{level}: {} — {}", self.what, self.fix)
        } else {
            write!(f, "{level}: {}: {} — {}", self.subject, self.what, self.fix)
        }
    }
}

/// The findings of a run, and the checks that passed.
#[derive(Default)]
struct Report {
    findings: Vec<Finding>,
    passed: Vec<String>,
}

impl Report {
    fn error(&mut self, subject: impl ToString, what: impl ToString, fix: impl ToString) {
        self.push(Level::Error, subject, what, fix);
    }

    fn warning(&mut self, subject: impl ToString, what: impl ToString, fix: impl ToString) {
        self.push(Level::Warning, subject, what, fix);
    }

    fn push(
        &mut self,
        level: Level,
        subject: impl ToString,
        what: impl ToString,
        fix: impl ToString,
    ) {
        let subject = subject.to_string();
        let what = what.to_string();
        // Engine errors start with the file they are about: say it once.
        let what = match what.strip_prefix(&format!("{subject}: ")) {
            Some(rest) if !subject.is_empty() => rest.to_string(),
            _ => what,
        };
        self.findings.push(Finding {
            level,
            subject,
            what,
            fix: fix.to_string(),
        });
    }

    fn ok(&mut self, what: impl ToString) {
        self.passed.push(what.to_string());
    }

    fn errors(&self) -> usize {
        self.findings
            .iter()
            .filter(|f| f.level == Level::Error)
            .count()
    }
}

/// Run `coli doctor`; returns the exit status (0 passed, 1 warnings, 2 errors).
pub fn run(args: DoctorArgs) -> i32 {
    let findings = check(&args);
    let (errors, warnings) = (
        findings
            .findings
            .iter()
            .filter(|f| f.level == Level::Error)
            .count(),
        findings
            .findings
            .iter()
            .filter(|f| f.level == Level::Warning)
            .count(),
    );
    for p in &findings.passed {
        println!("ok: {p}");
    }
    for f in &findings.findings {
        println!("{f}");
    }
    match (errors, warnings) {
        (0, 0) => {
            println!("doctor: every check passed");
            0
        }
        (0, w) => {
            println!("doctor: {w} warning(s)");
            1
        }
        (e, w) => {
            println!("doctor: {e} error(s), {w} warning(s)");
            2
        }
    }
}

/// Every check of `coli doctor`, in order.
fn check(args: &DoctorArgs) -> Report {
    let mut r = Report::default();
    let config = match crate::config::load(&args.flags) {
        Ok(loaded) => {
            r.ok("the configuration is valid");
            loaded.config
        }
        Err(e) => {
            r.error(
                "configuration",
                format!("{e:#}"),
                "fix the key where it is set (the file, the COLI_* variable or the flag it names; `coli config --show` lists every source)",
            );
            ServeConfig {
                model: args.flags.model.clone(),
                ..ServeConfig::default()
            }
        }
    };
    let model = config.model.clone().unwrap_or_else(|| "demo".into());
    let (dir, default_budget) = if model == "demo" {
        match crate::plan::resolve_model(&config) {
            Ok(x) => x,
            Err(e) => {
                r.error(
                    "model",
                    format!("the demo model: {e:#}"),
                    "check the cache directory (COLI_CACHE_DIR)",
                );
                return r;
            }
        }
    } else {
        (PathBuf::from(&model), None)
    };
    let files = if colibri::format::gguf::is_gguf(&dir) {
        check_gguf(&dir, &mut r)
    } else if dir.is_dir() {
        check_directory(&dir, &mut r)
    } else if dir.exists() {
        r.error(
            dir.display(),
            "is neither a model directory nor a GGUF file (a GGUF file starts with the bytes \"GGUF\")",
            "pass the directory holding config.json and the safetensors, or a .gguf file",
        );
        None
    } else {
        r.error(
            dir.display(),
            "does not exist",
            "give --model (or `model` in the configuration) the model directory or .gguf file",
        );
        None
    };
    // The family's validation, and the plan, once the files themselves are sound.
    if let Some(files) = &files {
        if r.errors() == 0 {
            check_model(&config, &dir, default_budget, &mut r);
        }
        check_io(&config, &files.paths, &mut r);
        check_mirrors(&config, &dir, &files.paths, args.deep, &mut r);
        if args.deep {
            deep(&dir, files, &mut r);
        }
    }
    check_state_dir(&mut r);
    r
}

/// The weight files of a model and what their headers say.
struct Files {
    paths: Vec<PathBuf>,
    /// Each safetensors file's tensors (empty for a GGUF file).
    tensors: Vec<Vec<TensorDesc>>,
}

/// A file name for messages: the path as given.
fn show(p: &Path) -> String {
    p.display().to_string()
}

/// `config.json`, the shards and their headers, the index, the tokenizer and the chat
/// template of a model directory.
fn check_directory(dir: &Path, r: &mut Report) -> Option<Files> {
    let config = dir.join("config.json");
    if !config.is_file() {
        r.error(
            show(&config),
            "missing",
            "copy the model's config.json into the directory (coli pull fetches it)",
        );
    } else {
        match colibri::format::config::ModelConfig::from_model_dir(dir) {
            Ok(cfg) => match colibri::model::registry::family_of(&cfg) {
                Ok(_) => r.ok(format!("{}: a supported model type", show(&config))),
                Err(e) => r.error(
                    show(&config),
                    e,
                    "colibri runs the model types `coli info` lists; use a supported checkpoint",
                ),
            },
            Err(e) => r.error(
                show(&config),
                e,
                "restore the file from the model's repository",
            ),
        }
    }
    // The shards: those the index names, else model.safetensors, else every *.safetensors.
    let index = dir.join("model.safetensors.index.json");
    let mut named: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut shards: Vec<PathBuf> = Vec::new();
    if index.is_file() {
        match colibri::error::read_json(&index) {
            Ok(json) => match json.get("weight_map").and_then(|m| m.as_object()) {
                Some(map) => {
                    for (tensor, file) in map {
                        match file.as_str() {
                            Some(f) if !f.contains('/') && !f.contains("..") => {
                                named.entry(f.to_string()).or_default().push(tensor.clone())
                            }
                            _ => r.error(
                                show(&index),
                                format!("weight_map.{tensor}: {file} is not a plain file name in the model directory"),
                                "restore the index from the model's repository",
                            ),
                        }
                    }
                    shards = named.keys().map(|f| dir.join(f)).collect();
                }
                None => r.error(
                    show(&index),
                    "weight_map: missing or not an object",
                    "restore the index from the model's repository",
                ),
            },
            Err(e) => r.error(
                show(&index),
                e,
                "restore the index from the model's repository",
            ),
        }
    } else if dir.join("model.safetensors").is_file() {
        shards.push(dir.join("model.safetensors"));
    } else {
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|it| {
                it.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .collect()
            })
            .unwrap_or_default();
        found.sort();
        if found.is_empty() {
            r.error(
                show(&dir.join("model.safetensors")),
                "no weights: expected model.safetensors, model.safetensors.index.json or *.safetensors shards",
                "download the weights (coli pull) or point --model at the right directory",
            );
        }
        shards = found;
    }
    let mut tensors = Vec::new();
    let mut readable = Vec::new();
    for shard in &shards {
        let name = shard
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !shard.is_file() {
            r.error(
                show(shard),
                "missing (model.safetensors.index.json names it)",
                "download it again (coli pull resumes and verifies)",
            );
            continue;
        }
        if let Some(oid) = lfs_pointer(shard) {
            r.error(
                show(shard),
                format!("is a Git LFS pointer (sha256 {oid}), not the weights"),
                "fetch the LFS objects (`git lfs pull`) or download with coli pull",
            );
            continue;
        }
        match describe_file(shard) {
            Ok(descs) => {
                let have: HashSet<&str> = descs.iter().map(|d| d.name.as_str()).collect();
                for t in named.get(&name).into_iter().flatten() {
                    if !have.contains(t.as_str()) {
                        r.error(
                            show(&index),
                            format!(
                                "weight_map names tensor `{t}` in {name}, which does not hold it"
                            ),
                            "restore the index and the shards from the same revision of the model",
                        );
                    }
                }
                readable.push(shard.clone());
                tensors.push(descs);
            }
            Err(e) => r.error(
                show(shard),
                e,
                "download it again (coli pull resumes and verifies)",
            ),
        }
    }
    if !shards.is_empty() && readable.len() == shards.len() {
        r.ok(format!(
            "{} weight file(s), {} tensors, headers valid",
            shards.len(),
            tensors.iter().map(Vec::len).sum::<usize>()
        ));
    }
    let tokenizer = dir.join("tokenizer.json");
    if !tokenizer.is_file() {
        r.error(
            show(&tokenizer),
            "missing: serve, run and chat need the tokenizer",
            "copy tokenizer.json from the model's repository",
        );
    } else {
        match colibri::format::tokenizer::Tokenizer::from_file(&tokenizer) {
            Ok(_) => r.ok(format!("{}: loads", show(&tokenizer))),
            Err(e) => r.error(
                show(&tokenizer),
                e,
                "restore tokenizer.json from the model's repository",
            ),
        }
    }
    match colibri::format::chat_template::ChatTemplate::from_model_dir(dir) {
        Ok(Some(t)) => r.ok(format!("chat template: {}", t.source().display())),
        Ok(None) => r.warning(
            show(&dir.join("tokenizer_config.json")),
            "no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template): chat requests cannot be rendered",
            "copy chat_template.jinja or tokenizer_config.json from the model's repository",
        ),
        Err(e) => r.error(show(&dir.join("tokenizer_config.json")), e, "restore the chat template from the model's repository"),
    }
    Some(Files {
        paths: readable,
        tensors,
    })
}

/// The SHA-256 a Git LFS pointer file names, if `path` is one.
fn lfs_pointer(path: &Path) -> Option<String> {
    let len = std::fs::metadata(path).ok()?.len();
    if len > 1024 {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    if !text.starts_with("version https://git-lfs.github.com/spec/") {
        return None;
    }
    text.lines()
        .find_map(|l| l.strip_prefix("oid sha256:"))
        .map(|s| s.trim().to_string())
}

/// A GGUF file: its header, metadata and tensor descriptions.
fn check_gguf(path: &Path, r: &mut Report) -> Option<Files> {
    match colibri::format::gguf::GgufFile::open(path) {
        Ok(_) => {
            r.ok(format!(
                "{}: GGUF header and tensor table readable",
                show(path)
            ));
            Some(Files {
                paths: vec![path.to_path_buf()],
                tensors: Vec::new(),
            })
        }
        Err(e) => {
            r.error(
                show(path),
                e,
                "the file is truncated or corrupt: download or convert it again",
            );
            None
        }
    }
}

/// The family's validation (every tensor's name, shape and dtype, the config's keys), and the
/// plan against the memory and disk there are.
fn check_model(config: &ServeConfig, dir: &Path, default_budget: Option<u64>, r: &mut Report) {
    // The pins do not change what the plan takes; without learning the usage history is not
    // even read (read-only: loading it tidies the state directory).
    let mut config = config.clone();
    config.engine.no_learn = true;
    let config = &config;
    let described = match crate::plan::describe(config, dir) {
        Ok(d) => d,
        Err(e) => {
            // The engine's message names the file and the key or tensor.
            r.error(
                "",
                e.root_cause(),
                "the checkpoint does not match what its family expects: restore the files from one revision of a supported model",
            );
            return;
        }
    };
    r.ok(format!(
        "{}: {} builds ({} layers, {} of dense weights, {} of routed experts)",
        show(dir),
        described.info.model_type,
        described.info.layers,
        format_size(described.info.dense_bytes as u64),
        format_size(described.info.routed_expert_bytes as u64)
    ));
    let plan = match crate::plan::placement_of(config, dir, default_budget, &described) {
        Ok(p) => p,
        Err(e) => {
            r.error(
                "ram",
                format!("{e:#}"),
                "raise `ram` (--ram), or use a smaller quantization of the model",
            );
            return;
        }
    };
    let available = colibri::store::budget::available_memory();
    let limit = colibri::store::budget::cgroup_memory_limit();
    let usable = match (available, limit) {
        (Some(a), Some(l)) => Some(a.min(l)),
        (a, l) => a.or(l),
    };
    match usable {
        Some(free) if plan.ram.total_bytes > free => r.warning(
            "ram",
            format!(
                "the plan takes {} of RAM (dense {} + expert cache {} + KV {} × {} slots) but {} is available",
                format_size(plan.ram.total_bytes),
                format_size(plan.ram.dense_bytes),
                format_size(plan.ram.cache_bytes),
                format_size(plan.ram.kv_bytes_per_slot),
                plan.ram.slots,
                format_size(free)
            ),
            "lower `ram`, `slots` or `context`, or free memory (see `coli plan`)",
        ),
        Some(free) => r.ok(format!(
            "RAM: the plan takes {} of the {} available",
            format_size(plan.ram.total_bytes),
            format_size(free)
        )),
        None => {}
    }
    if let Some(pc) = &config.prefix_cache_dir {
        let need = plan.ram.kv_bytes_per_slot * plan.ram.slots as u64;
        match free_space(pc) {
            Some(free) if free < need => r.warning(
                "prefix_cache_dir",
                format!(
                    "{} has {} free, the slots' caches may take {}",
                    show(pc),
                    format_size(free),
                    format_size(need)
                ),
                "free space there or point prefix_cache_dir at a larger drive",
            ),
            _ => {}
        }
    }
}

/// Free bytes of the file system holding `path` (or its nearest existing ancestor).
fn free_space(path: &Path) -> Option<u64> {
    let existing = path.ancestors().find(|p| p.exists())?;
    let st = rustix::fs::statvfs(existing).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// O_DIRECT and io-uring on the model's files, against what the configuration asks for.
fn check_io(config: &ServeConfig, paths: &[PathBuf], r: &mut Report) {
    use colibri::store::reader::{open_reader, OpenFiles, ReaderKind, ReaderOptions};
    if paths.is_empty() {
        return;
    }
    match OpenFiles::open(paths, true) {
        Ok(files) if files.direct() => r.ok("O_DIRECT: the model's file system allows it"),
        Ok(files) => {
            let why = files.warning().unwrap_or("O_DIRECT refused").to_string();
            if config.engine.direct_io {
                r.warning(
                    "direct_io",
                    format!("is set, but {why}"),
                    "unset direct_io (reads then go through the page cache), or move the model to a file system that allows O_DIRECT",
                );
            } else {
                r.ok(format!("O_DIRECT unavailable ({why}); direct_io is off"));
            }
        }
        Err(e) => r.error(show(&paths[0]), e, "check the file's permissions"),
    }
    let uring = open_reader(
        paths,
        &ReaderOptions {
            kind: ReaderKind::Uring,
            threads: 1,
            direct_io: false,
        },
    );
    match (uring, config.engine.io) {
        (Ok(_), _) => r.ok("io-uring: available"),
        (Err(e), ReaderKind::Uring) => r.error(
            "io",
            format!("is `uring`, but io-uring is unavailable: {e}"),
            "set io = \"auto\" or \"pool\" (the pread pool)",
        ),
        (Err(e), _) => r.ok(format!(
            "io-uring unavailable ({e}); expert reads use the pread pool"
        )),
    }
}

/// Each mirror directory against the primary's files: present, the same size, and (with
/// `deep`) the same SHA-256 as its receipt says.
fn check_mirrors(config: &ServeConfig, dir: &Path, paths: &[PathBuf], deep: bool, r: &mut Report) {
    use colibri::store::staging::{Receipt, RECEIPT_FILE};
    for m in &config.engine.mirrors {
        if !m.is_dir() {
            r.error(
                show(m),
                "mirror directory missing or not a directory",
                "stage it with `coli mirror stage`, or remove it from `mirrors`",
            );
            continue;
        }
        let mut held = 0;
        for p in paths {
            let Some(name) = p.file_name() else { continue };
            let copy = m.join(name);
            let Ok(meta) = std::fs::metadata(&copy) else {
                continue;
            };
            held += 1;
            let want = std::fs::metadata(p).map(|x| x.len()).unwrap_or(0);
            if meta.len() != want {
                r.error(
                    show(&copy),
                    format!("{} bytes, the primary has {want}", meta.len()),
                    "remove it and stage it again (`coli mirror stage`); `coli mirror verify` checks the rest",
                );
            }
        }
        match Receipt::read(&m.join(RECEIPT_FILE)) {
            Ok(Some(receipt)) => {
                for e in &receipt.shards {
                    let copy = m.join(&e.shard);
                    match std::fs::metadata(&copy) {
                        Err(_) => r.error(
                            show(&copy),
                            "listed in the mirror's receipt but missing",
                            "stage the mirror again (`coli mirror stage`)",
                        ),
                        Ok(meta) if meta.len() != e.size => r.error(
                            show(&copy),
                            format!("{} bytes, the receipt says {}", meta.len(), e.size),
                            "remove it and stage it again (`coli mirror stage`)",
                        ),
                        Ok(_) if deep => {
                            let noop: colibri::store::staging::Progress = &mut |_, _, _| {};
                            match colibri::store::staging::sha256_file(&copy, false, noop) {
                                Ok((sha, _)) if sha != e.sha256 => r.error(
                                    show(&copy),
                                    format!("SHA-256 {sha}, the receipt says {}", e.sha256),
                                    "remove it and stage it again (`coli mirror stage`)",
                                ),
                                Ok(_) => {}
                                Err(err) => r.error(show(&copy), err, "check the mirror drive"),
                            }
                        }
                        Ok(_) => {}
                    }
                }
            }
            Ok(None) => {}
            Err(e) => r.error(
                show(&m.join(RECEIPT_FILE)),
                e,
                "stage the mirror again (`coli mirror stage`)",
            ),
        }
        if held == 0 {
            r.warning(
                show(m),
                format!("holds none of the files of {}", show(dir)),
                "stage it (`coli mirror stage`) or remove it from `mirrors`",
            );
        } else {
            r.ok(format!(
                "mirror {}: {held} file(s), sizes match the primary",
                show(m)
            ));
        }
    }
}

/// The state directory (usage history): writable, or creatable, leaving no file behind.
fn check_state_dir(r: &mut Report) {
    let Some(dir) = colibri::store::history::state_dir() else {
        r.warning(
            "COLI_STATE_DIR",
            "no state directory (neither COLI_STATE_DIR, XDG_STATE_HOME nor HOME is set): the usage history is not kept",
            "set COLI_STATE_DIR to a writable directory",
        );
        return;
    };
    // The directory, or the nearest ancestor it would be created in.
    let Some(existing) = dir.ancestors().find(|p| p.exists()) else {
        r.error(
            show(&dir),
            "no part of the path exists",
            "set COLI_STATE_DIR to a writable directory",
        );
        return;
    };
    if !existing.is_dir() {
        r.error(
            show(&dir),
            format!("{} is not a directory", show(existing)),
            "set COLI_STATE_DIR to a writable directory",
        );
        return;
    }
    for d in [existing.to_path_buf(), existing.join("usage")] {
        if !d.is_dir() {
            continue;
        }
        // An unnamed temporary (O_TMPFILE where the file system has it): nothing is left.
        if let Err(e) = tempfile::tempfile_in(&d) {
            r.error(
                show(&dir),
                format!("{} is not writable: {e}", show(&d)),
                "fix its permissions or set COLI_STATE_DIR to a writable directory",
            );
            return;
        }
    }
    if existing == dir {
        r.ok(format!("state directory {}: writable", show(&dir)));
    } else {
        r.ok(format!(
            "state directory {}: will be created in {} (writable)",
            show(&dir),
            show(existing)
        ));
    }
}

/// Every tensor's bytes: float tensors scanned for NaN/Inf; each file hashed against the pull
/// receipt when there is one.
fn deep(dir: &Path, files: &Files, r: &mut Report) {
    let receipt_dir = if dir.is_file() {
        dir.parent().unwrap_or(Path::new("."))
    } else {
        dir
    };
    let receipt = match colibri_pull::receipt::read_receipt(receipt_dir) {
        Ok(x) => x,
        Err(e) => {
            r.warning(
                show(&receipt_dir.join(colibri_pull::RECEIPT)),
                format!("{e:#}"),
                "remove it (the next pull re-checks every file)",
            );
            None
        }
    };
    let mut scanned = 0usize;
    for (i, path) in files.paths.iter().enumerate() {
        if let Some(descs) = files.tensors.get(i) {
            for d in descs {
                scanned += 1;
                match non_finite(path, d) {
                    Ok(0) => {}
                    Ok(n) => r.error(
                        show(path),
                        format!("tensor `{}` holds {n} NaN or infinite value(s)", d.name),
                        "the file is corrupt: download it again (coli pull verifies)",
                    ),
                    Err(e) => r.error(
                        show(path),
                        format!("reading tensor `{}`: {e}", d.name),
                        "check the drive; download the file again",
                    ),
                }
            }
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Some(entry) = receipt.as_ref().and_then(|rc| rc.file(&name)) {
            let noop: colibri::store::staging::Progress = &mut |_, _, _| {};
            match colibri::store::staging::sha256_file(path, false, noop) {
                Ok((sha, _)) if sha != entry.sha256 => r.error(
                    show(path),
                    format!("SHA-256 {sha}, coli-pull.json says {}", entry.sha256),
                    "the file changed since it was pulled: download it again (coli pull)",
                ),
                Ok(_) => r.ok(format!("{}: SHA-256 matches coli-pull.json", show(path))),
                Err(e) => r.error(show(path), e, "check the drive; download the file again"),
            }
        } else if files.tensors.is_empty() {
            // A GGUF file without a receipt: read every byte once (bounds, readable).
            let noop: colibri::store::staging::Progress = &mut |_, _, _| {};
            if let Err(e) = colibri::store::staging::sha256_file(path, false, noop) {
                r.error(show(path), e, "check the drive; download the file again");
            }
        }
    }
    r.ok(format!("--deep: {scanned} tensor(s) read"));
}

/// How many values of a float tensor are NaN or infinite (0 for other dtypes).
fn non_finite(path: &Path, d: &TensorDesc) -> std::io::Result<usize> {
    let width = match d.dtype {
        DType::F32 => 4,
        DType::F16 | DType::BF16 => 2,
        _ => return Ok(0),
    };
    let file = std::fs::File::open(path)?;
    let chunk = (4 << 20) / width * width;
    let mut buf = vec![0u8; chunk];
    let mut bad = 0;
    let mut at = 0;
    while at < d.len {
        let n = chunk.min(d.len - at);
        file.read_exact_at(&mut buf[..n], (d.offset + at) as u64)?;
        bad += buf[..n]
            .chunks_exact(width)
            .filter(|v| match d.dtype {
                DType::F32 => !f32::from_le_bytes([v[0], v[1], v[2], v[3]]).is_finite(),
                // Exponent bits all ones: infinity or NaN.
                DType::F16 => u16::from_le_bytes([v[0], v[1]]) & 0x7c00 == 0x7c00,
                _ => u16::from_le_bytes([v[0], v[1]]) & 0x7f80 == 0x7f80,
            })
            .count();
        at += n;
    }
    Ok(bad)
}
