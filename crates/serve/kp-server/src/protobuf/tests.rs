//! Golden bytes worked out by hand from `metrics.proto`'s field numbers (no protobuf decoder
//! is on this machine: neither `protoc` nor python's `protobuf`). A tag byte is
//! `field << 3 | wire type` (0 varint, 1 64-bit little-endian, 2 length-delimited); sint32 and
//! sint64 are zigzag-encoded (`3 -> 6`, `7 -> 14`, `1 -> 2`); each MetricFamily is preceded by
//! its length as a varint.

use kp_core::metrics::native::NativeHistograms;

use super::*;

#[test]
fn a_counter_is_one_delimited_family() {
    let text = "# HELP c Cs.\n# TYPE c counter\nc_total 2\n# EOF\n";
    let bytes = encode(text, &NativeHistograms::default()).expect("our own text");
    #[rustfmt::skip]
    let golden = [
        0x1d, // 29 bytes of MetricFamily follow
        0x0a, 7, b'c', b'_', b't', b'o', b't', b'a', b'l', // 1 name: counters keep `_total`
        0x12, 3, b'C', b's', b'.', // 2 help
        0x18, 0, // 3 type COUNTER (0)
        0x22, 11, // 4 metric (11 bytes)
        0x1a, 9, // Metric.counter = 3 (9 bytes)
        0x09, 0, 0, 0, 0, 0, 0, 0, 0x40, // Counter.value = 1: 2.0
    ];
    assert_eq!(bytes, golden);
}

#[test]
fn a_native_histogram_carries_classic_buckets_and_native_fields() {
    let text = "# HELP h H.\n# TYPE h histogram\nh_sum 3.0\nh_count 2\n\
                h_bucket{le=\"1.0\"} 1\nh_bucket{le=\"+Inf\"} 2\n# EOF\n";
    let native = NativeHistograms::default();
    let buckets = native.add("h");
    buckets.observe(1.0); // schema 3, bucket 0
    buckets.observe(2.0); // bucket 8: seven empty buckets between, so two spans
    let bytes = encode(text, &native).expect("our own text");
    #[rustfmt::skip]
    let golden = [
        0x42, // 66 bytes of MetricFamily
        0x0a, 1, b'h', // 1 name
        0x12, 2, b'H', b'.', // 2 help
        0x18, 4, // 3 type HISTOGRAM (4)
        0x22, 55, // 4 metric
        0x3a, 53, // Metric.histogram = 7
        0x08, 2, // Histogram.sample_count = 1
        0x11, 0, 0, 0, 0, 0, 0, 0x08, 0x40, // sample_sum = 2: 3.0
        0x1a, 11, // bucket = 3 (no +Inf bucket, as client_golang)
        0x08, 1, // Bucket.cumulative_count = 1
        0x11, 0, 0, 0, 0, 0, 0, 0xf0, 0x3f, // Bucket.upper_bound = 2: 1.0
        0x28, 6, // schema = 5: sint32 3
        0x31, 0, 0, 0, 0, 0, 0, 0xf0, 0x37, // zero_threshold = 6: 2^-128
        0x38, 0, // zero_count = 7
        0x62, 4, 0x08, 0, 0x10, 1, // positive_span = 12: offset 0, length 1
        0x62, 4, 0x08, 14, 0x10, 1, // offset 7 (after bucket 0: 1..=7 empty), length 1
        0x68, 2, // positive_delta = 13: +1
        0x68, 0, // +0 (the second bucket also holds 1)
    ];
    assert_eq!(bytes, golden);
    assert_eq!(ZERO_THRESHOLD, 2f64.powi(-128));
}

#[test]
fn without_native_buckets_a_histogram_is_classic_only() {
    let text = "# HELP h H.\n# TYPE h histogram\nh_sum 0.0\nh_count 0\n\
                h_bucket{le=\"+Inf\"} 0\n# EOF\n";
    let classic = encode(text, &NativeHistograms::default()).expect("our own text");
    // sample_count 0, sample_sum 0.0 and nothing else.
    assert_eq!(
        &classic[classic.len() - 11..],
        [0x08, 0, 0x11, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    // With the gate but no observations: schema, threshold, zero count and the empty span
    // client_golang writes so that the scraper still sees a native histogram.
    let native = NativeHistograms::default();
    native.add("h");
    let empty = encode(text, &native).expect("our own text");
    assert_eq!(&empty[empty.len() - 6..], [0x62, 4, 0x08, 0, 0x10, 0]);
}

#[test]
fn labels_gauges_info_and_unknown_are_read_back() {
    let text = "# HELP g G.\n# TYPE g gauge\ng{a=\"x\\\"y\",b=\"z\"} -1.5\n\
                # HELP b B.\n# TYPE b info\nb_info{version=\"1\"} 1\n\
                # HELP u U.\n# TYPE u unknown\nu 7\n# EOF\n";
    let families = parse(text).expect("our own text");
    let names: Vec<(&str, Kind)> = families.iter().map(|f| (f.name.as_str(), f.kind)).collect();
    assert_eq!(
        names,
        [
            ("g", Kind::Gauge),
            ("b_info", Kind::Gauge),
            ("u", Kind::Untyped)
        ]
    );
    assert_eq!(
        families[0].metrics[0].labels,
        [
            ("a".to_owned(), "x\"y".to_owned()),
            ("b".to_owned(), "z".to_owned())
        ]
    );
    assert_eq!(families[0].metrics[0].value, -1.5);
    assert_eq!(
        parse("# TYPE g gauge\ng{a=\"x} 1\n"),
        Err(ProtobufError::Sample { line: 2 })
    );
}

#[test]
fn only_the_delimited_metric_family_is_protobuf() {
    // What Prometheus sends with native histograms on (its first choice).
    assert!(accepts_protobuf(
        "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;\
         encoding=delimited;q=0.6,application/openmetrics-text;version=1.0.0;q=0.5,*/*;q=0.1"
    ));
    assert!(!accepts_protobuf(
        "application/openmetrics-text;version=1.0.0"
    ));
    assert!(!accepts_protobuf(
        "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=text"
    ));
    assert!(!accepts_protobuf("*/*"));
}
