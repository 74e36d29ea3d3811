//! `coli`: colibri's command line — the OpenAI-compatible server and the operator commands.
//! The commands themselves live in the `colibri_server` library (`src/lib.rs`); this file is
//! only the argument parser and the dispatch.

use clap::{Parser, Subcommand};
use colibri_server::{
    bench, chat_client, config, convert, doctor, generate_cmd, info, kl, logits, mirror_cmd, plan,
    serve, tune,
};

/// colibri: run huge Mixture-of-Experts models on the hardware you have.
#[derive(Parser)]
#[command(name = "coli", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API (the built-in demo model unless a model is configured).
    Serve(serve::ServeArgs),
    /// Print the effective server configuration and where each value comes from.
    Config(config::ConfigArgs),
    /// Generate text from a prompt, streamed to stdout.
    Run(generate_cmd::RunArgs),
    /// Print the logits of a teacher-forced token sequence as JSON.
    Logits(logits::LogitsArgs),
    /// Measure prefill and decode speed, expert cache behaviour and bandwidth use.
    Bench(bench::BenchArgs),
    /// Describe a model: architecture, experts, parameters, bytes.
    Info(info::InfoArgs),
    /// Write a Hugging Face checkpoint as a GGUF file (q8_0, q6_k, q5_k_m, q4_k_m, bf16).
    Convert(convert::ConvertArgs),
    /// Mean KL divergence and top-1 agreement of a model against a reference on prompts.
    Kl(kl::KlArgs),
    /// Write a random-weight checkpoint in the Hugging Face layout, or straight as its GGUF
    /// (for benchmarks).
    Synth(colibri_synth::SynthArgs),
    /// Chat with a server (or with a model started in-process) from the terminal.
    Chat(chat_client::ChatArgs),
    /// Download a Hugging Face model repository into a directory (resumable, parallel,
    /// verified against the Hub's hashes) for `serve --model DIR`.
    Pull(colibri_pull::PullArgs),
    /// Measure this machine's fastest engine settings for a model and write them as a profile.
    Tune(tune::TuneArgs),
    /// Plan, stage and verify a mirror drive holding the files of the hottest experts.
    Mirror(mirror_cmd::MirrorArgs),
    /// Where a model's bytes would live (VRAM, RAM, disk) with a configuration, and the decode
    /// speed that predicts: seconds per token = resident bytes read per token / memory
    /// bandwidth + active-expert bytes hit / memory bandwidth + active-expert bytes missed /
    /// disk bandwidth. Reads headers only; refuses a RAM budget the resident set does not fit.
    Plan(plan::PlanArgs),
    /// Check, read-only, that a model and a configuration will serve: files complete, dtypes
    /// and shapes supported, memory and disk, state directory, mirrors, O_DIRECT, io-uring
    /// (`--deep`: every tensor's bytes). Exit status 0: passed, 1: warnings, 2: errors.
    Doctor(doctor::DoctorArgs),
}

fn main() {
    let cli = Cli::parse();
    if let Command::Serve(a) = cli.command {
        // The server sets up its own logging from its configuration.
        if let Err(e) = serve::run(a) {
            eprintln!("coli: error: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("COLI_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Serve(_) => unreachable!("handled above"),
        Command::Config(a) => config::run_config_command(a),
        Command::Run(a) => generate_cmd::run(a),
        Command::Logits(a) => logits::run(a),
        Command::Info(a) => info::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Synth(a) => colibri_synth::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Kl(a) => kl::run(a),
        Command::Chat(a) => chat_client::run(a),
        Command::Pull(a) => colibri_pull::run(a),
        Command::Tune(a) => tune::run(a),
        Command::Mirror(a) => mirror_cmd::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Doctor(a) => std::process::exit(doctor::run(a)),
    };
    if let Err(e) = result {
        eprintln!("coli: error: {e:#}");
        std::process::exit(1);
    }
}
