//! Each target for one second, as part of the workspace's tests (CI runs them longer from `.ci/run`): no
//! findings, and the counts printed.

use std::process::Command;

#[test]
fn every_target_runs_a_second_without_findings() {
    let findings = tempfile::tempdir().unwrap();
    for target in ["stepfile", "cli", "step"] {
        let out = Command::new(env!("CARGO_BIN_EXE_gdn-fuzz"))
            .args([target, "--seconds", "1", "--findings"])
            .arg(findings.path())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{target}: {}\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("executions in"), "{target}: {stdout}");
        eprint!("{stdout}");
    }
    assert_eq!(std::fs::read_dir(findings.path()).unwrap().count(), 0);
}
