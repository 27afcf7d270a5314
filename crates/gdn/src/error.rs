//! One error type for every backend: bad input is reported before any state is touched.

/// Everything that can go wrong in a step, a pool operation or a file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid shape: {0}")]
    Shape(String),
    #[error("{name} has {got} values, expected {expected}")]
    Length {
        name: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("invalid parameter {name}: {why}")]
    Param { name: &'static str, why: String },
    #[error("commit first {k} is outside 1..={t} for a window of {t} tokens")]
    CommitRange { k: usize, t: usize },
    #[error("plane stride {stride} is smaller than the {min} floats of y")]
    PlaneStride { stride: usize, min: usize },
    #[error("slot index {index} is out of range for a pool of {slots} slots")]
    SlotRange { index: i64, slots: usize },
    #[error("slot {0} is named twice in one batch")]
    SlotTwice(usize),
    #[error("{got} slot indices for a batch of {batch} sequences")]
    SlotCount { got: usize, batch: usize },
    #[error("a window needs at least one token")]
    EmptyWindow,
    #[error("sequence {seq} has length 0: a window needs at least one token")]
    EmptySeq { seq: usize },
    #[error("sequence {seq}: rows {start}..{start}+{len} are outside the {rows} rows given")]
    SeqRows {
        seq: usize,
        start: usize,
        len: usize,
        rows: usize,
    },
    #[error("sequences {a} and {b} share rows")]
    SeqOverlap { a: usize, b: usize },
    #[error("sequence {seq}: commit {commit} is outside 1..={len} for its {len} tokens")]
    SeqCommit {
        seq: usize,
        commit: crate::Commit,
        len: usize,
    },
    #[error("not supported by this backend: {0}")]
    Unsupported(String),
    #[error("malformed step file: {0}")]
    File(String),
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    #[error("backend error: {0}")]
    Backend(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
