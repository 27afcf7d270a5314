//! `gdn-fuzz`: bounded-time mutation fuzzing on stable Rust (see README.md).
//!
//! `gdn-fuzz <stepfile|cli|step> --seconds N` runs one target for N seconds and exits 1 if it found anything
//! (each finding's input is written to the findings folder); `gdn-fuzz gen-corpus` rewrites the generated
//! step-file seeds.

mod cli;
mod harness;
mod mutate;
mod step;
mod stepfile;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};

#[global_allocator]
static ALLOC: harness::Tracking = harness::Tracking;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Which {
    /// The step-file reader, then the CPU step on what it read.
    Stepfile,
    /// The `gdn` command's argument parser.
    Cli,
    /// The step's argument checks and the CPU pool's step and slot operations.
    Step,
    /// Rewrite the generated step-file seeds in corpus/stepfile.
    GenCorpus,
}

#[derive(Parser)]
#[command(
    name = "gdn-fuzz",
    about = "Bounded-time mutation fuzzing of gdn's inputs"
)]
struct Args {
    target: Which,
    /// How long to fuzz, in seconds.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// The mutator's seed (a run is reproducible up to the timing of its end).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The longest one input may run, in milliseconds, before it counts as a hang.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// The largest single allocation one input may cause, in MiB.
    #[arg(long, default_value_t = 1024)]
    alloc_cap_mib: usize,
    /// Where findings are written.
    #[arg(long)]
    findings: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let opts = harness::Options {
        seconds: args.seconds,
        seed: args.seed,
        timeout: Duration::from_millis(args.timeout_ms),
        findings: args.findings.unwrap_or_else(|| here.join("findings")),
        alloc_cap: args.alloc_cap_mib.saturating_mul(1 << 20),
    };
    let corpus = here.join("corpus");
    let found = match args.target {
        Which::GenCorpus => {
            return match stepfile::write_corpus(&corpus.join("stepfile")) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gdn-fuzz: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Which::Stepfile => {
            harness::run(&mut stepfile::StepFile::new(corpus.join("stepfile")), &opts)
        }
        Which::Cli => harness::run(&mut cli::Cli::new(&corpus.join("cli/args.txt")), &opts),
        Which::Step => match step::StepTarget::new() {
            Ok(mut t) => harness::run(&mut t, &opts),
            Err(e) => {
                eprintln!("gdn-fuzz: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    if found > 0 {
        eprintln!("gdn-fuzz: {found} findings");
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
