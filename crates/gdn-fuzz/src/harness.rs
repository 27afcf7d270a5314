//! The fuzzing loop: mutate an entry of the corpus, run it, and keep it when its outcome is one not seen before
//! (the outcome's text with numbers removed: a cheap signal that stands in for coverage). Each run is watched
//! for a panic (`catch_unwind`), a hang (a watchdog thread and a per-input time limit) and an allocation larger
//! than a cap (the global allocator below); any of them writes the input to the findings folder.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// What one input did: `Ok(outcome)` (its kind, for the corpus's feedback) or `Err(why)`, a broken invariant.
pub type Outcome = Result<String, String>;

pub trait Target {
    fn name(&self) -> &'static str;
    /// The starting corpus.
    fn seeds(&self) -> Vec<Vec<u8>>;
    /// Tokens the mutator inserts.
    fn dict(&self) -> Vec<Vec<u8>> {
        Vec::new()
    }
    /// Mutates `buf` (a copy of a corpus entry); `other` is another entry.
    fn mutate(&self, rng: &mut SmallRng, buf: &mut Vec<u8>, other: &[u8], dict: &[&[u8]]) {
        crate::mutate::mutate(rng, buf, other, dict, self.max_len());
    }
    fn max_len(&self) -> usize {
        1 << 16
    }
    fn exec(&mut self, input: &[u8]) -> Outcome;
}

pub struct Options {
    pub seconds: f64,
    pub seed: u64,
    pub timeout: Duration,
    pub findings: PathBuf,
    /// The largest single allocation an input may cause before it counts as a finding.
    pub alloc_cap: usize,
}

/// The input being run, for the watchdog and the allocator to save.
static CURRENT: Mutex<Vec<u8>> = Mutex::new(Vec::new());
/// Milliseconds since `EPOCH` at which the current input started, plus one; 0 between inputs.
static STARTED: AtomicU64 = AtomicU64::new(0);
static EPOCH: OnceLock<Instant> = OnceLock::new();
static FINDINGS: OnceLock<(PathBuf, &'static str)> = OnceLock::new();
static LAST_PANIC: Mutex<String> = Mutex::new(String::new());

/// Largest single allocation since the last reset, the cap, and the first request over the cap (0: none).
static PEAK: AtomicUsize = AtomicUsize::new(0);
static CAP: AtomicUsize = AtomicUsize::new(usize::MAX);
static OVER: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, with the largest request recorded and requests over the cap refused (after saving the
/// input that made them: a refused infallible allocation aborts the process).
pub struct Tracking;

fn admit(size: usize) -> bool {
    PEAK.fetch_max(size, Ordering::Relaxed);
    if size <= CAP.load(Ordering::Relaxed) {
        return true;
    }
    if OVER
        .compare_exchange(0, size, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok()
    {
        // small allocations from here on are served as usual: the cap is far above what saving needs
        let input = CURRENT.try_lock().map(|g| g.clone()).unwrap_or_default();
        save("alloc", &input, &format!("an allocation of {size} bytes"));
    }
    false
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, or returns null (allowed:
// it reports an allocation failure); `admit` only touches atomics and, once, allocates small blocks through
// this same allocator, which is reentrant.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded from our caller, who upholds `alloc`'s contract
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as for `alloc`
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator, with this layout
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !admit(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: as for `dealloc`, and our caller upholds `realloc`'s contract on `new_size`
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Writes a finding: the input as `<target>-<kind>-<hash>.bin`, and what happened beside it as `.txt`.
fn save(kind: &str, input: &[u8], what: &str) {
    let Some((dir, target)) = FINDINGS.get() else {
        return;
    };
    let _ = std::fs::create_dir_all(dir);
    let stem = dir.join(format!("{target}-{kind}-{:016x}", fnv(input)));
    let _ = std::fs::write(stem.with_extension("bin"), input);
    let _ = std::fs::write(stem.with_extension("txt"), format!("{what}\n"));
    eprintln!(
        "FINDING ({kind}): {what}\n  input ({} bytes) saved as {}.bin",
        input.len(),
        stem.display()
    );
}

/// The outcome's kind: its text without digits and quoted parts (so that the same error about other numbers
/// or names is one kind), cut to 120 characters.
fn kind_of(outcome: &str) -> String {
    let mut quote = None;
    let mut kind = String::new();
    for c in outcome.chars() {
        match (quote, c) {
            (None, '\'' | '"' | '`') => {
                quote = Some(c);
                kind.push(c);
            }
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, c) if !c.is_ascii_digit() => kind.push(c),
            _ => {}
        }
        if kind.len() >= 120 {
            break;
        }
    }
    kind
}

fn now_ms() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// Fuzzes `target` for `opts.seconds`; returns the number of findings.
pub fn run(target: &mut dyn Target, opts: &Options) -> usize {
    let name = target.name();
    let _ = FINDINGS.set((opts.findings.clone(), name));
    now_ms();
    std::panic::set_hook(Box::new(|info| {
        if let Ok(mut p) = LAST_PANIC.lock() {
            *p = info.to_string();
        }
    }));
    let timeout_ms = opts.timeout.as_millis() as u64;
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(20));
        let s = STARTED.load(Ordering::SeqCst);
        if s != 0 && now_ms() + 1 > s + timeout_ms {
            let input = CURRENT.lock().map(|g| g.clone()).unwrap_or_default();
            save(
                "hang",
                &input,
                &format!("one input ran over {timeout_ms} ms"),
            );
            std::process::exit(1);
        }
    });

    let mut rng = SmallRng::seed_from_u64(opts.seed);
    let dict_owned = target.dict();
    let dict: Vec<&[u8]> = dict_owned.iter().map(|t| t.as_slice()).collect();
    let mut corpus = target.seeds();
    assert!(!corpus.is_empty(), "{name}: no seeds");
    let seeds = corpus.len();
    let mut kinds: HashSet<String> = HashSet::new();
    // corpus entries that ran to the end
    let mut good: Vec<usize> = Vec::new();
    let mut found = 0usize;
    let mut execs = 0u64;
    let mut ok_count = 0u64;
    let (mut peak, mut peak_input) = (0usize, 0usize);
    CAP.store(opts.alloc_cap, Ordering::SeqCst);
    let start = Instant::now();
    let deadline = Duration::from_secs_f64(opts.seconds);
    let mut i = 0usize;
    let mut buf = Vec::new();
    while found < 10 {
        // the seeds once each, unmutated, then mutants until the time is up
        if i < seeds {
            buf = corpus[i].clone();
        } else {
            if start.elapsed() >= deadline {
                break;
            }
            // half the time a parent that ran to the end, so that mutants reach past the checks
            let a = if !good.is_empty() && rng.random_bool(0.5) {
                good[rng.random_range(0..good.len())]
            } else {
                rng.random_range(0..corpus.len())
            };
            let b = rng.random_range(0..corpus.len());
            buf.clear();
            buf.extend_from_slice(&corpus[a]);
            target.mutate(&mut rng, &mut buf, &corpus[b], &dict);
        }
        i += 1;
        {
            let mut g = CURRENT.lock().expect("current input");
            g.clear();
            g.extend_from_slice(&buf);
        }
        PEAK.store(0, Ordering::SeqCst);
        STARTED.store(now_ms() + 1, Ordering::SeqCst);
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| target.exec(&buf)));
        STARTED.store(0, Ordering::SeqCst);
        execs += 1;
        let p = PEAK.load(Ordering::SeqCst);
        if p > peak {
            (peak, peak_input) = (p, buf.len());
        }
        if OVER.swap(0, Ordering::SeqCst) != 0 {
            // saved by the allocator already; the input got an error instead of memory
            found += 1;
            continue;
        }
        match r {
            Ok(Ok(outcome)) => {
                if outcome.starts_with("ok") {
                    ok_count += 1;
                }
                let ok = outcome.starts_with("ok");
                if kinds.insert(kind_of(&outcome)) && i > seeds && corpus.len() < 1024 {
                    corpus.push(buf.clone());
                    if ok {
                        good.push(corpus.len() - 1);
                    }
                } else if ok && i <= seeds {
                    good.push(i - 1);
                }
            }
            Ok(Err(why)) => {
                found += 1;
                save("invariant", &buf, &why);
            }
            Err(_) => {
                found += 1;
                let msg = LAST_PANIC.lock().map(|p| p.clone()).unwrap_or_default();
                save("panic", &buf, &msg);
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{name}: {execs} executions in {secs:.1} s ({:.0}/s), {ok_count} ran to the end, {} outcome kinds, corpus {} ({seeds} seeds), {found} findings",
        execs as f64 / secs,
        kinds.len(),
        corpus.len()
    );
    if std::env::var_os("GDN_FUZZ_KINDS").is_some() {
        let mut k: Vec<_> = kinds.iter().collect();
        k.sort();
        for k in k {
            println!("  {k}");
        }
    }
    println!(
        "{name}: largest single allocation {peak} bytes (from an input of {peak_input} bytes; cap {})",
        opts.alloc_cap
    );
    found
}
