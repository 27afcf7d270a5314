//! A coverage-free byte mutator: the classic stacked mutations (bit flips, interesting integers, block deletes,
//! inserts, copies and splices from another corpus entry), plus two that reach further into text formats:
//! decimal numbers rewritten to boundary values, and tokens from a target's dictionary.

use rand::rngs::SmallRng;
use rand::{Rng, RngCore};

/// Integers at the edges of the sizes a parser checks: 0, 1, powers of two and their neighbours, the widths'
/// extremes.
pub const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    15,
    16,
    17,
    31,
    32,
    64,
    127,
    128,
    255,
    256,
    1023,
    1024,
    1025,
    4096,
    65535,
    65536,
    i32::MAX as u64,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    (1 << 32) + 1,
    1 << 40,
    i64::MAX as u64,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

/// Decimal spellings of boundary values (and a few that overflow u64), for text such as JSON headers and
/// command lines.
pub const DECIMALS: &[&str] = &[
    "0",
    "1",
    "2",
    "15",
    "16",
    "17",
    "32",
    "64",
    "255",
    "256",
    "1023",
    "1024",
    "1025",
    "4096",
    "65536",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999",
    "-1",
    "-0",
    "1e9",
    "0.5",
];

/// Applies 1 to 4 random mutations to `buf` in place; `other` is another corpus entry to splice from, `dict`
/// tokens to insert, `max_len` the longest input produced.
pub fn mutate(rng: &mut SmallRng, buf: &mut Vec<u8>, other: &[u8], dict: &[&[u8]], max_len: usize) {
    let n = rng.random_range(1..=4);
    for _ in 0..n {
        mutate_once(rng, buf, other, dict);
    }
    buf.truncate(max_len);
}

fn mutate_once(rng: &mut SmallRng, buf: &mut Vec<u8>, other: &[u8], dict: &[&[u8]]) {
    let len = buf.len();
    let pos = |rng: &mut SmallRng, len: usize| {
        if len == 0 {
            0
        } else {
            rng.random_range(0..len)
        }
    };
    match rng.random_range(0..13) {
        0 if len > 0 => {
            let i = pos(rng, len);
            buf[i] ^= 1 << rng.random_range(0..8);
        }
        1 if len > 0 => {
            let i = pos(rng, len);
            buf[i] = *[
                0u8, 1, 0x7f, 0x80, 0xff, b'"', b',', b'[', b']', b'{', b'}', b'-',
            ]
            .get(rng.random_range(0..12))
            .unwrap_or(&0);
        }
        2 if len > 0 => {
            let i = pos(rng, len);
            buf[i] = rng.random();
        }
        3 if len > 0 => {
            // an interesting integer, little-endian, 1, 2, 4 or 8 bytes wide
            let w = [1usize, 2, 4, 8][rng.random_range(0..4)];
            let v = INTERESTING[rng.random_range(0..INTERESTING.len())];
            let v = if rng.random_bool(0.2) {
                v.wrapping_neg()
            } else {
                v
            };
            let i = pos(rng, len);
            let end = (i + w).min(len);
            buf[i..end].copy_from_slice(&v.to_le_bytes()[..end - i]);
        }
        4 if len > 0 => {
            let i = pos(rng, len);
            let n = rng.random_range(1..=(len - i).min(64));
            buf.drain(i..i + n);
        }
        5 => {
            let i = pos(rng, len + 1).min(len);
            let n = rng.random_range(1..=16);
            let mut bytes = vec![0u8; n];
            rng.fill_bytes(&mut bytes);
            buf.splice(i..i, bytes);
        }
        6 if len > 0 => {
            // duplicate a block
            let i = pos(rng, len);
            let n = rng.random_range(1..=(len - i).min(256));
            let block = buf[i..i + n].to_vec();
            let at = pos(rng, len + 1).min(len);
            buf.splice(at..at, block);
        }
        7 if !other.is_empty() => {
            // overwrite with a block of another entry, at the same offset half the time
            let j = pos(rng, other.len());
            let n = rng.random_range(1..=(other.len() - j).min(256));
            let at = if rng.random_bool(0.5) {
                j.min(len)
            } else {
                pos(rng, len + 1).min(len)
            };
            let end = (at + n).min(len);
            buf.splice(at..end, other[j..j + n].iter().copied());
        }
        8 if len > 0 => {
            let i = pos(rng, len);
            buf.truncate(i);
        }
        9 => {
            if let Some((s, e)) = find_number(rng, buf) {
                let d = DECIMALS[rng.random_range(0..DECIMALS.len())];
                buf.splice(s..e, d.bytes());
            }
        }
        10 => {
            if let Some((s, e)) = find_number(rng, buf) {
                // a neighbour of the number that is there
                let text = std::str::from_utf8(&buf[s..e]).unwrap_or("0");
                let v: u128 = text.parse().unwrap_or(0);
                let v = match rng.random_range(0..4) {
                    0 => v.saturating_add(1),
                    1 => v.saturating_sub(1),
                    2 => v.saturating_mul(2),
                    _ => v / 2,
                };
                buf.splice(s..e, v.to_string().into_bytes());
            }
        }
        11 | 12 if !dict.is_empty() => {
            let tok = dict[rng.random_range(0..dict.len())];
            let i = pos(rng, len + 1).min(len);
            if rng.random_bool(0.5) || len == 0 {
                buf.splice(i..i, tok.iter().copied());
            } else {
                let end = (i + tok.len()).min(len);
                buf.splice(i..end, tok.iter().copied());
            }
        }
        _ => {
            let i = pos(rng, len + 1).min(len);
            buf.insert(i, rng.random());
        }
    }
}

/// A run of ASCII digits starting at a random one, as (start, end).
fn find_number(rng: &mut SmallRng, buf: &[u8]) -> Option<(usize, usize)> {
    let digits: Vec<usize> = (0..buf.len())
        .filter(|&i| buf[i].is_ascii_digit() && (i == 0 || !buf[i - 1].is_ascii_digit()))
        .collect();
    if digits.is_empty() {
        return None;
    }
    let s = digits[rng.random_range(0..digits.len())];
    let e = (s..buf.len())
        .find(|&i| !buf[i].is_ascii_digit())
        .unwrap_or(buf.len());
    Some((s, e))
}

/// Choices read from an input's bytes (zeros once they run out), so that a byte mutator explores a structured
/// space: each byte picks one branch of the generator.
pub struct Choices<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Choices<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Choices { data, pos: 0 }
    }
    pub fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    pub fn u64(&mut self) -> u64 {
        let mut v = [0u8; 8];
        for b in &mut v {
            *b = self.byte();
        }
        u64::from_le_bytes(v)
    }
    /// A value in `0..n` (0 when n is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        if n <= 256 {
            self.byte() as usize % n
        } else {
            (self.u64() % n as u64) as usize
        }
    }
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    pub fn chance(&mut self, percent: u8) -> bool {
        self.byte() % 100 < percent
    }
}
