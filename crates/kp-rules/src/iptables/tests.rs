//! Unit tests of the renderer's building blocks.

use super::*;

#[test]
fn probabilities_match_upstream_formatting() {
    assert_eq!(probability(2), "0.5000000000");
    assert_eq!(probability(3), "0.3333333333");
    assert_eq!(probability(4), "0.2500000000");
    assert_eq!(probability(100_001), "0.0000099999");
}

#[test]
fn probabilities_strictly_decrease_up_to_100000() {
    // Upstream's TestComputeProbability: as strings compared as numbers.
    let mut previous: f64 = 1.0;
    let mut previous_text = probability(1);
    for n in 2..=100_000 {
        let text = probability(n);
        let value: f64 = text.parse().expect("formatted float");
        assert!(value < previous, "{n}: {text} !< {previous_text}");
        previous = value;
        previous_text = text;
    }
}
