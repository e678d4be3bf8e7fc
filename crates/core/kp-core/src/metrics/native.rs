//! Prometheus native (sparse, exponential) histogram buckets beside the classic ones, for the
//! `NativeHistograms` feature gate (upstream 1.36 alpha, KEP-5808). With it upstream's
//! component-base gives every histogram client_golang's native options: bucket factor 1.1
//! (schema 3: eight buckets per power of two), at most 160 buckets, zero threshold 2^-128,
//! no reset. Over 160 buckets the resolution halves (schema - 1, neighbouring buckets
//! merged), as client_golang does without a reset duration. Only the protobuf exposition
//! carries these buckets; the text one stays classic.
//!
//! Bucket `i` of schema `s` holds `(base^(i-1), base^i]` with `base = 2^(2^-s)`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The schema upstream's bucket factor 1.1 gives (the largest with `base <= 1.1`).
pub const SCHEMA: i32 = 3;
/// Upstream's bucket limit.
pub const MAX_BUCKETS: usize = 160;
/// client_golang's default zero threshold, 2^-128: observations at most this far from zero
/// are counted in the zero bucket.
pub const ZERO_THRESHOLD: f64 = 2.938_735_877_055_719e-39;
/// The coarsest schema client_golang goes down to.
const MIN_SCHEMA: i32 = -4;

/// One histogram's native buckets. Clones share them.
#[derive(Clone, Debug, Default)]
pub struct NativeBuckets {
    inner: Arc<Mutex<Sparse>>,
}

/// The sparse buckets, keyed by index.
#[derive(Clone, Debug, PartialEq)]
pub struct Sparse {
    /// The current schema.
    pub schema: i32,
    /// Observations within [`ZERO_THRESHOLD`] of zero.
    pub zero_count: u64,
    /// Positive buckets by index.
    pub positive: BTreeMap<i32, u64>,
    /// Negative buckets by index (of the absolute value).
    pub negative: BTreeMap<i32, u64>,
}

impl Default for Sparse {
    fn default() -> Self {
        Self {
            schema: SCHEMA,
            zero_count: 0,
            positive: BTreeMap::new(),
            negative: BTreeMap::new(),
        }
    }
}

/// A run of consecutive buckets: `offset` from the end of the previous span (from index 0
/// for the first), `length` buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Gap to the previous span, or the first index.
    pub offset: i32,
    /// Buckets in the span.
    pub length: u32,
}

impl NativeBuckets {
    /// Count `value` (NaN and infinities are left out, as they have no bucket here).
    pub fn observe(&self, value: f64) {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .observe(value);
    }

    /// A copy of the buckets now.
    pub fn snapshot(&self) -> Sparse {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Sparse {
    /// Count `value`, then halve the resolution while there are too many buckets.
    pub fn observe(&mut self, value: f64) {
        if !value.is_finite() {
            return;
        }
        if value.abs() <= ZERO_THRESHOLD {
            self.zero_count += 1;
            return;
        }
        let key = bucket_index(value.abs(), self.schema);
        let side = if value > 0.0 {
            &mut self.positive
        } else {
            &mut self.negative
        };
        *side.entry(key).or_default() += 1;
        while self.positive.len() + self.negative.len() > MAX_BUCKETS && self.schema > MIN_SCHEMA {
            self.schema -= 1;
            self.positive = coarser(&self.positive);
            self.negative = coarser(&self.negative);
        }
    }
}

/// The histograms that keep native buckets, by the name the exposition gives them: what the
/// protobuf exposition adds to their classic buckets. Empty with the gate off. Clones share.
#[derive(Clone, Debug, Default)]
pub struct NativeHistograms {
    by_name: Arc<Mutex<BTreeMap<String, NativeBuckets>>>,
}

impl NativeHistograms {
    /// Native buckets for the histogram `name` (an unlabelled family), registered here.
    pub fn add(&self, name: &str) -> NativeBuckets {
        let buckets = NativeBuckets::default();
        self.by_name
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_owned(), buckets.clone());
        buckets
    }

    /// The buckets of `name` now, if it keeps native ones.
    pub fn snapshot(&self, name: &str) -> Option<Sparse> {
        let by_name = self.by_name.lock().unwrap_or_else(PoisonError::into_inner);
        by_name.get(name).map(NativeBuckets::snapshot)
    }
}

/// The index of the bucket holding `value` (positive, above the zero threshold) in `schema`.
pub fn bucket_index(value: f64, schema: i32) -> i32 {
    let (frac, exp) = frexp(value);
    if schema > 0 {
        // Within [2^(exp-1), 2^exp): 2^schema buckets, the j-th bound 2^(j/2^schema - 1)
        // scaled to `frac`'s range [0.5, 1).
        let per_octave = 1i32 << schema;
        let j = (0..per_octave)
            .find(|&j| frac <= (f64::from(j) / f64::from(per_octave)).exp2() / 2.0)
            .unwrap_or(per_octave);
        j + (exp - 1) * per_octave
    } else {
        // A power of two is the top of its bucket.
        let key = if frac == 0.5 { exp - 1 } else { exp };
        let shift = -schema;
        (key + (1 << shift) - 1) >> shift
    }
}

/// `value = frac * 2^exp` with `frac` in [0.5, 1), for normal positive values (all that pass
/// the zero threshold).
fn frexp(value: f64) -> (f64, i32) {
    let bits = value.to_bits();
    let biased = ((bits >> 52) & 0x7ff) as i32;
    let frac = f64::from_bits((bits & !(0x7ff << 52)) | (1022 << 52));
    (frac, biased - 1022)
}

/// The buckets of one schema lower: bucket `i` goes to `ceil(i / 2)`.
fn coarser(buckets: &BTreeMap<i32, u64>) -> BTreeMap<i32, u64> {
    let mut out = BTreeMap::new();
    for (&key, &count) in buckets {
        *out.entry((key + 1).div_euclid(2)).or_default() += count;
    }
    out
}

/// The spans and count deltas of `buckets`, as client_golang writes them: a gap of up to two
/// empty buckets is filled with zero counts instead of starting a new span.
pub fn spans_and_deltas(buckets: &BTreeMap<i32, u64>) -> (Vec<Span>, Vec<i64>) {
    let mut spans: Vec<Span> = Vec::new();
    let mut deltas = Vec::new();
    let mut previous_count = 0i64;
    let mut previous_key: Option<i32> = None;
    let mut push = |count: u64, deltas: &mut Vec<i64>| {
        let count = i64::try_from(count).unwrap_or(i64::MAX);
        deltas.push(count - previous_count);
        previous_count = count;
    };
    for (&key, &count) in buckets {
        match (previous_key, spans.last_mut()) {
            (Some(previous), Some(span)) if key - previous - 1 <= 2 => {
                let gap = key - previous - 1;
                for _ in 0..gap {
                    push(0, &mut deltas);
                }
                span.length += gap.unsigned_abs() + 1;
            }
            (Some(previous), _) => spans.push(Span {
                offset: key - previous - 1,
                length: 1,
            }),
            (None, _) => spans.push(Span {
                offset: key,
                length: 1,
            }),
        }
        push(count, &mut deltas);
        previous_key = Some(key);
    }
    (spans, deltas)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_follow_the_schema_bounds() {
        // Schema 3: base 2^(1/8); a power of two tops its bucket.
        assert_eq!(bucket_index(1.0, 3), 0);
        assert_eq!(bucket_index(2.0, 3), 8);
        assert_eq!(bucket_index(0.5, 3), -8);
        // 1.5 is in (2^(4/8), 2^(5/8)] = (1.414, 1.542].
        assert_eq!(bucket_index(1.5, 3), 5);
        // 1 ms: 2^-10 = 0.000977 < 0.001 <= 2^(-10 + 1/8).
        assert_eq!(bucket_index(0.001, 3), -79);
        // Schema 0: (2^(i-1), 2^i]; schema -1: (4^(i-1), 4^i].
        assert_eq!(bucket_index(3.0, 0), 2);
        assert_eq!(bucket_index(4.0, 0), 2);
        assert_eq!(bucket_index(3.0, -1), 1);
        assert_eq!(bucket_index(5.0, -1), 2);
    }

    #[test]
    fn known_observations_give_known_spans_and_deltas() {
        let mut sparse = Sparse::default();
        for value in [1.0, 1.0, 1.5, 2.0, 0.0, 100.0] {
            sparse.observe(value);
        }
        assert_eq!(sparse.zero_count, 1);
        // Buckets 0 (x2), 5, 8 and 54 (100 is in (2^(53/8), 2^(54/8)] = (98.7, 107.6]).
        assert_eq!(
            sparse.positive,
            BTreeMap::from([(0, 2), (5, 1), (8, 1), (54, 1)])
        );
        let (spans, deltas) = spans_and_deltas(&sparse.positive);
        // 0..=0, then 5 (gap 4: new span), 8 (gap 2: filled), 54 (gap 45).
        assert_eq!(
            spans,
            [
                Span {
                    offset: 0,
                    length: 1
                },
                Span {
                    offset: 4,
                    length: 4
                },
                Span {
                    offset: 45,
                    length: 1
                },
            ]
        );
        // Counts 2 | 1 0 0 1 | 1.
        assert_eq!(deltas, [2, -1, -1, 0, 1, 0]);
        assert!(sparse.negative.is_empty());
    }

    #[test]
    fn too_many_buckets_halve_the_resolution() {
        let mut sparse = Sparse::default();
        // 161 distinct schema-3 buckets: 2^(k/8) for k in 0..=160 each top their bucket
        // (up to rounding, which keeps them distinct).
        for k in 0..=160 {
            sparse.observe((f64::from(k) / 8.0).exp2() * 1.01);
        }
        assert_eq!(sparse.schema, 2);
        assert!(sparse.positive.len() <= MAX_BUCKETS);
        assert_eq!(sparse.positive.values().sum::<u64>(), 161);
        // The negative side and non-finite values.
        sparse.observe(-1.0);
        sparse.observe(f64::NAN);
        assert_eq!(sparse.negative, BTreeMap::from([(0, 1)]));
    }
}
