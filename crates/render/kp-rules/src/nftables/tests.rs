//! Unit tests of the pieces the integration tests (`tests/nft_*.rs`) do not reach directly.

use std::collections::BTreeSet;

use kp_core::backend::SyncKind;
use kp_core::model::IpFamily;
use kp_core::tracker::ProxyState;

use super::*;

fn scope<'a>(
    kind: SyncKind,
    changed: &'a BTreeSet<ServiceName>,
    existing: &'a NftState,
) -> NftScope<'a> {
    NftScope {
        kind,
        changed,
        existing,
        delete_stale: false,
        service_cidrs: &[],
    }
}

#[test]
fn invalid_configuration_is_an_error() {
    let state = ProxyState::default();
    let none = BTreeSet::new();
    let existing = NftState::default();
    let config = RenderConfig {
        masquerade_bit: 32,
        ..RenderConfig::default()
    };
    assert_eq!(
        render(
            &state,
            IpFamily::V4,
            &config,
            &scope(SyncKind::Full, &none, &existing)
        ),
        Err(RenderError::MasqueradeBit(32))
    );
    let config = RenderConfig {
        local_detector: LocalDetector::BridgeInterface("br0\" accept".into()),
        ..RenderConfig::default()
    };
    assert!(matches!(
        render(
            &state,
            IpFamily::V4,
            &config,
            &scope(SyncKind::Full, &none, &existing)
        ),
        Err(RenderError::InterfaceName(_))
    ));
}

#[test]
fn partial_sync_without_setup_is_promoted_to_full() {
    let state = ProxyState::default();
    let none = BTreeSet::new();
    let existing = NftState::default();
    let config = RenderConfig::default();
    let out = render(
        &state,
        IpFamily::V4,
        &config,
        &scope(SyncKind::Partial, &none, &existing),
    )
    .expect("renders");
    assert_eq!(out.kind, SyncKind::Full);
    let installed = out.state_after(&existing);
    assert!(installed.is_initialized());
    // Same configuration again: an idle partial sync does nothing.
    let again = render(
        &state,
        IpFamily::V4,
        &config,
        &scope(SyncKind::Partial, &none, &installed),
    )
    .expect("renders");
    assert_eq!(again.kind, SyncKind::Partial);
    assert_eq!(again.operations, 0);
    assert!(again.script().is_empty());
    // Another configuration changes the fixed part: full again.
    let other = RenderConfig {
        masquerade_bit: 15,
        ..RenderConfig::default()
    };
    let changed = render(
        &state,
        IpFamily::V4,
        &other,
        &scope(SyncKind::Partial, &none, &installed),
    )
    .expect("renders");
    assert_eq!(changed.kind, SyncKind::Full);
    assert!(changed.script().contains("mark set mark or 0x8000"));
    // The base chains are only re-created on the very first sync.
    assert!(
        out.script()
            .contains("delete chain ip kube-proxy filter-input\n")
    );
    assert!(
        !changed
            .script()
            .contains("delete chain ip kube-proxy filter-input\n")
    );
}

#[test]
fn comments_fit_nft_limit_without_splitting_escapes() {
    let long = "\"".repeat(100);
    let text = render::tests_support::comment_text(&long);
    assert!(text.len() <= MAX_COMMENT_BYTES);
    assert_eq!(text.len() % 3, 0, "{text}");
    let plain = "a".repeat(300);
    assert_eq!(
        render::tests_support::comment_text(&plain).len(),
        MAX_COMMENT_BYTES
    );
    assert_eq!(
        render::tests_support::comment_text("ns/svc:p80"),
        "ns/svc:p80"
    );
}

#[test]
fn adopt_keeps_only_per_service_objects() {
    let state = NftState::adopt(
        [
            "services".to_owned(),
            "endpoint-AAAA-ns/s/tcp/__1.2.3.4/80".to_owned(),
        ],
        [
            ("cluster-ips".to_owned(), None),
            ("affinity-AAAA-ns/s/tcp/__1.2.3.4/80".to_owned(), Some(60)),
        ],
    );
    assert!(!state.is_initialized());
    assert_eq!(
        state.chains().into_iter().collect::<Vec<_>>(),
        ["endpoint-AAAA-ns/s/tcp/__1.2.3.4/80"]
    );
    assert_eq!(
        state.affinity_sets().into_iter().collect::<Vec<_>>(),
        ["affinity-AAAA-ns/s/tcp/__1.2.3.4/80"]
    );
}
