//! The `gdn` command as a library: its argument parser and its subcommands. The binary (`main.rs`) is a thin
//! wrapper; the library exists so that the argument parser can be driven without a process (the fuzzer in
//! `crates/gdn-fuzz`).

mod backends;
mod bench;
mod demo;
mod reliability;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use gdn::stepfile::{Overrides, StepInput};
use gdn::{Commit, DType, Gate, HeadMap, StateLayout};

/// The whole command line.
#[derive(Parser)]
#[command(
    name = "gdn",
    version,
    about = "The fused Gated DeltaNet window step (docs/SPEC.md)"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one step on the windows of a safetensors file and write the outputs (docs/SPEC.md's file format).
    Step {
        /// The window file (safetensors; docs/SPEC.md, "The `gdn step` file format").
        #[arg(long)]
        input: PathBuf,
        /// Where the outputs go (written atomically; nothing is written on an error).
        #[arg(long)]
        output: PathBuf,
        /// The backend: cpu, cuda or wgpu (those this build has).
        #[arg(long, default_value = "cpu", value_parser = crate::backends::names())]
        backend: String,
        /// verify, all, or K (commit after the first K tokens), for every sequence; a varlen file's `commit`
        /// tensor takes precedence.
        #[arg(long, default_value = "all")]
        commit: Commit,
        /// tiled (also repeat) or grouped (also repeat_interleave); overrides the file's metadata (default tiled).
        #[arg(long)]
        head_map: Option<HeadMap>,
        /// sigmoid or silu (also swish); overrides the file's metadata (default sigmoid).
        #[arg(long)]
        gate: Option<Gate>,
        /// Norm epsilon; overrides the file's metadata (default 1e-6).
        #[arg(long)]
        eps: Option<f32>,
        /// Also write the prepared-activation planes and the group sums.
        #[arg(long)]
        planes: bool,
        /// The layout of the file's `state` and of the pool: key-major or value-major; overrides the file's
        /// metadata (default key-major).
        #[arg(long)]
        state_layout: Option<StateLayout>,
        /// The outputs' dtype: f32, bf16 or f16 (default: z's dtype in the file).
        #[arg(long)]
        out_dtype: Option<DType>,
    },
    /// Time the step at the seed's shape beside a memory-copy ceiling measured in the same run.
    Bench(bench::Args),
    /// Run a prompt and a speculative-decoding loop on a random layer, checked against the oracle.
    Demo(demo::Args),
    /// Many decode steps against the float64 oracle: the error at checkpoints (f32 or bf16 state).
    Drift(reliability::DriftArgs),
    /// Random steps (lengths, commits, slots, forks, resets, dtypes) against the oracle, memory watched.
    Soak(reliability::SoakArgs),
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> gdn::Result<()> {
    match cli.command {
        Command::Step {
            input,
            output,
            backend,
            commit,
            head_map,
            gate,
            eps,
            planes,
            state_layout,
            out_dtype,
        } => {
            let backend = backends::make(&backend)?;
            let inp = StepInput::read(
                &input,
                Overrides {
                    head_map,
                    gate,
                    eps,
                    state_layout,
                },
            )?;
            let out = inp.run(backend.as_ref(), commit, planes, out_dtype)?;
            out.write(&output)
        }
        Command::Bench(args) => bench::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Drift(args) => reliability::drift(args),
        Command::Soak(args) => reliability::soak(args),
    }
}

/// Parses a command line (the program name first, as `std::env::args_os` gives it) without exiting: help,
/// version and usage errors come back as a `clap::Error`.
pub fn parse_args<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    Cli::try_parse_from(args)
}

/// The one line a usage error prints on stderr: clap's own lines joined, its pointer to --help replaced by
/// ours, the values an option takes included. `None` for --help and --version, which print as clap prints them.
pub fn usage_line(e: &clap::Error) -> Option<String> {
    if !e.use_stderr() {
        return None;
    }
    let msg = e.to_string();
    let line = msg
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("For more information"))
        .collect::<Vec<_>>()
        .join(" ");
    Some(format!(
        "gdn: {} (see gdn --help)",
        line.trim_start_matches("error: ")
    ))
}
