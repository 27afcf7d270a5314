//! Target `cli`: the `gdn` command's argument parser (`gdn_cli::parse_args`, clap) on mutated command lines,
//! without running anything. An input is the arguments after the program name, separated by NUL bytes (so an
//! argument may hold any other byte, invalid UTF-8 included). Every error is rendered as clap renders it and as
//! the binary's one line.

use std::ffi::OsString;

use clap::CommandFactory;
use rand::rngs::SmallRng;
use rand::Rng;

use crate::harness::{Outcome, Target};

const MAX_LEN: usize = 4096;

pub struct Cli {
    seeds: Vec<Vec<u8>>,
}

impl Cli {
    /// Seeds: one command line per line of `args.txt`, arguments separated by spaces.
    pub fn new(seed_file: &std::path::Path) -> Self {
        let text = std::fs::read_to_string(seed_file).unwrap_or_default();
        let mut seeds: Vec<Vec<u8>> = text
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .map(|l| {
                l.split_whitespace()
                    .collect::<Vec<_>>()
                    .join("\0")
                    .into_bytes()
            })
            .collect();
        if seeds.is_empty() {
            seeds.push(b"step\0--input\0a\0--output\0b".to_vec());
        }
        Cli { seeds }
    }
}

fn os(bytes: &[u8]) -> OsString {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStringExt;
        OsString::from_vec(bytes.to_vec())
    }
    #[cfg(not(unix))]
    {
        OsString::from(String::from_utf8_lossy(bytes).into_owned())
    }
}

fn split(input: &[u8]) -> Vec<&[u8]> {
    if input.is_empty() {
        Vec::new()
    } else {
        input.split(|&b| b == 0).collect()
    }
}

impl Target for Cli {
    fn name(&self) -> &'static str {
        "cli"
    }

    fn seeds(&self) -> Vec<Vec<u8>> {
        self.seeds.clone()
    }

    /// Every subcommand, flag and listed value the parser itself knows (from clap's description of it), and
    /// values of the kinds the options parse.
    fn dict(&self) -> Vec<Vec<u8>> {
        let mut words: Vec<String> = Vec::new();
        let cmd = gdn_cli::Cli::command();
        let add_args = |c: &clap::Command, words: &mut Vec<String>| {
            for a in c.get_arguments() {
                if let Some(l) = a.get_long() {
                    words.push(format!("--{l}"));
                }
                if let Some(s) = a.get_short() {
                    words.push(format!("-{s}"));
                }
                for v in a.get_possible_values() {
                    words.push(v.get_name().to_string());
                }
            }
        };
        add_args(&cmd, &mut words);
        for sub in cmd.get_subcommands() {
            words.push(sub.get_name().to_string());
            add_args(sub, &mut words);
        }
        for w in [
            "help",
            "--help",
            "-h",
            "--version",
            "-V",
            "--",
            "-",
            "",
            "=",
            "cpu",
            "cuda",
            "wgpu",
            "all",
            "verify",
            "0",
            "1",
            "3",
            "tiled",
            "grouped",
            "repeat",
            "sigmoid",
            "silu",
            "swish",
            "f32",
            "bf16",
            "f16",
            "float16",
            "key-major",
            "value-major",
            "k",
            "1,8",
            "1,,8",
            ",",
            "0:0",
            "8:64",
            "1:1",
            "2:0",
            ":",
            "4096",
            "4097",
            "1e-6",
            "nan",
            "-inf",
            "1e39",
            "-1",
            "+1",
            "0x10",
            "18446744073709551616",
            "\u{e9}",
            "\u{1f600}",
        ] {
            words.push(w.to_string());
        }
        words.sort();
        words.dedup();
        words.into_iter().map(String::into_bytes).collect()
    }

    fn max_len(&self) -> usize {
        MAX_LEN
    }

    fn mutate(&self, rng: &mut SmallRng, buf: &mut Vec<u8>, other: &[u8], dict: &[&[u8]]) {
        let mut args: Vec<Vec<u8>> = split(buf).into_iter().map(|a| a.to_vec()).collect();
        for _ in 0..rng.random_range(1..=3) {
            let n = args.len();
            let at = rng.random_range(0..=n);
            match rng.random_range(0..9) {
                0 | 1 if n > 0 => {
                    let w = dict[rng.random_range(0..dict.len())].to_vec();
                    args[at.min(n - 1)] = w;
                }
                2 | 3 => {
                    let w = dict[rng.random_range(0..dict.len())].to_vec();
                    args.insert(at, w);
                }
                4 if n > 0 => {
                    args.remove(at.min(n - 1));
                }
                5 if n > 0 => {
                    // `--flag value` as `--flag=value`
                    let i = at.min(n - 1);
                    if i + 1 < n {
                        let v = args.remove(i + 1);
                        args[i].push(b'=');
                        args[i].extend(v);
                    }
                }
                6 if n > 1 => {
                    let j = rng.random_range(0..n);
                    args.swap(at.min(n - 1), j);
                }
                7 => {
                    // an argument of the other entry
                    let o = split(other);
                    if !o.is_empty() {
                        args.insert(at, o[rng.random_range(0..o.len())].to_vec());
                    }
                }
                _ if n > 0 => {
                    let i = at.min(n - 1);
                    crate::mutate::mutate(rng, &mut args[i], &[], dict, 256);
                    args[i].retain(|&b| b != 0);
                }
                _ => {}
            }
        }
        *buf = args.join(&0u8);
        buf.truncate(MAX_LEN);
    }

    fn exec(&mut self, input: &[u8]) -> Outcome {
        let args = std::iter::once(OsString::from("gdn")).chain(split(input).into_iter().map(os));
        match gdn_cli::parse_args(args) {
            Ok(_) => Ok("ok".into()),
            Err(e) => {
                let text = e.to_string();
                let _ = e.render();
                match gdn_cli::usage_line(&e) {
                    Some(line) if line.contains('\n') => {
                        Err(format!("a usage error of more than one line: {line:?}"))
                    }
                    Some(_) if text.trim().is_empty() => Err("an empty usage error".into()),
                    _ => Ok(format!("error {:?}", e.kind())),
                }
            }
        }
    }
}
