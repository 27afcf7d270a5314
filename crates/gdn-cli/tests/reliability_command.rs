//! `gdn drift` and `gdn soak`, short versions of the long runs (the long ones are programs, run by hand and on
//! the GPU machine; BENCHMARKS.md has their numbers), and `--help` naming every option's values.

use std::process::Command;

fn gdn(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gdn"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn drift_stays_within_its_bounds_for_both_states() {
    for state in ["f32", "bf16"] {
        let (ok, text) = gdn(&[
            "drift", "--steps", "300", "--state", state, "--shape", "32,1,2",
        ]);
        assert!(ok, "{text}");
        assert!(text.contains("step     300:"), "{text}");
    }
}

#[test]
fn soak_checks_every_step_and_memory_stays_flat() {
    let (ok, text) = gdn(&["soak", "--steps", "3000", "--every", "500"]);
    assert!(ok, "{text}");
    assert!(text.contains("resident memory after warm-up"), "{text}");
}

#[test]
fn help_names_every_options_values() {
    let (ok, step) = gdn(&["step", "--help"]);
    assert!(ok);
    for v in [
        "verify, all, or K",
        "tiled",
        "grouped",
        "sigmoid or silu",
        "key-major or value-major",
        "f32, bf16 or f16",
        "cpu, cuda, wgpu",
    ] {
        assert!(step.contains(v), "gdn step --help lacks '{v}':\n{step}");
    }
    let (ok, bench) = gdn(&["bench", "--help"]);
    assert!(ok);
    for v in [
        "sigmoid or silu",
        "tiled",
        "f32 or bf16",
        "key-major or value-major",
        "f32, bf16 or f16",
        "cpu, cuda, wgpu",
        "B:T",
    ] {
        assert!(bench.contains(v), "gdn bench --help lacks '{v}':\n{bench}");
    }
    // a bad value is one line that names the values there are
    let (ok, err) = gdn(&["bench", "--backend", "tpu"]);
    assert!(!ok);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("cpu, cuda, wgpu"), "{err}");
}
