//! `gdn`: run the fused GDN window step on a file, benchmark it, or watch the demo.

use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = match gdn_cli::parse_args(std::env::args_os()) {
        Ok(cli) => cli,
        // usage errors in one line too; --help and --version print as clap prints them
        Err(e) => match gdn_cli::usage_line(&e) {
            Some(line) => {
                eprintln!("{line}");
                return ExitCode::from(2);
            }
            None => e.exit(),
        },
    };
    match gdn_cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gdn: error: {e}");
            ExitCode::FAILURE
        }
    }
}
