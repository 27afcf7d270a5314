//! `gdn bench` end to end: a short run prints its table, one row per case, beside both ceilings measured in
//! the same run.

use std::process::Command;

/// One test, so that two benchmarks never share the cores: a plain run, then one rotating among three sets of
/// one slot, which says so.
#[test]
fn bench_prints_a_row_per_case_and_both_ceilings_plain_and_rotated() {
    check_bench_table(&[]);
    let text = check_bench_table(&["--rotate-mib", "8"]);
    assert!(
        text.contains("rotation: each call steps the next of several sets")
            && text.contains("(B 1: 3)"),
        "{text}"
    );
}

/// Bad options: one line on stderr and a non-zero exit, before any timing.
#[test]
fn bench_rejects_an_empty_batch_and_too_much_rotation() {
    for args in [
        &["bench", "--batch", "0"][..],
        &["bench", "--rotate-mib", "5000"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_gdn"))
            .args(args)
            .output()
            .expect("runs gdn");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(out.stdout.is_empty(), "{args:?} printed a table");
        assert!(
            err.contains("batch") || err.contains("rotate-mib"),
            "{args:?}: {err}"
        );
    }
}

/// Runs `gdn bench` on two short cases with `extra` arguments, checks its table, and returns its output.
fn check_bench_table(extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gdn"))
        .args([
            "bench",
            "--batch",
            "1",
            "--tokens",
            "1,2",
            "--round-ms",
            "2",
        ])
        .args(extra)
        .output()
        .expect("runs gdn");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let lines: Vec<&str> = text.lines().collect();
    let header = lines
        .iter()
        .position(|l| l.contains("us/call"))
        .expect("a header");
    assert!(lines[header].contains("% copy") && lines[header].contains("% FMA"));
    let rows: Vec<Vec<&str>> = lines[header + 1..]
        .iter()
        .take_while(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    for (row, t) in rows.iter().zip(["1", "2"]) {
        assert_eq!((row[0], row[1]), ("1", t), "{text}");
        let us: f64 = row[2].parse().expect("a time");
        assert!(us > 0.0 && us.is_finite(), "{text}");
        // a share, not a bound: the ceiling and the step are timed at different moments on shared cores
        let fma_share: f64 = row[9].trim_end_matches('%').parse().expect("a % FMA");
        assert!(fma_share > 0.0 && fma_share.is_finite(), "{text}");
    }
    let ceiling: f64 = text
        .split("FMA ceiling measured in this run: ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|g| g.parse().ok())
        .expect("the FMA ceiling's line");
    assert!(ceiling > 0.0 && ceiling.is_finite(), "{text}");
    text
}
