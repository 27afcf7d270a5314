//! `gdn demo` end to end: prompts and speculative rounds over several sequences in varlen calls, each checked
//! against the oracle by the demo itself (it fails on any disagreement).

#[test]
fn demo_runs_and_agrees_with_the_oracle() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gdn"))
        .args([
            "demo", "--seqs", "3", "--prompt", "9", "--rounds", "3", "--window", "3",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("agreement OK"), "{text}");
    assert!(text.contains("in one call"), "{text}");
}
