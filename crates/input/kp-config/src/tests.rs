//! Cross-module tests: config files, flags, and how the two combine.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde_json::json;

use super::*;

const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

/// Shaped like upstream's `--write-config-to` output (keys sorted, every field present),
/// with non-default values so that each one is seen to be read.
const FULL_UPSTREAM_FILE: &str = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 10.0.0.5
bindAddressHardFail: true
clientConnection:
  acceptContentTypes: "application/json"
  burst: 20
  contentType: application/json
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 7.5
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 10m0s
conntrack:
  maxPerCore: 0
  min: 65536
  tcpBeLiberal: true
  tcpCloseWaitTimeout: 30m0s
  tcpEstablishedTimeout: 12h0m0s
  udpStreamTimeout: 2m0s
  udpTimeout: 30s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: veth
detectLocalMode: InterfaceNamePrefix
enableProfiling: true
featureGates:
  NFTablesProxyMode: true
  GangScheduling: false
healthzBindAddress: 0.0.0.0:10266
hostnameOverride: node-a
iptables:
  localhostNodePorts: false
  masqueradeAll: true
  masqueradeBit: 15
  minSyncPeriod: 2s
  syncPeriod: 1m0s
ipvs:
  excludeCIDRs:
  - 10.96.0.0/12
  minSyncPeriod: 1s
  scheduler: wrr
  strictARP: true
  syncPeriod: 45s
  tcpFinTimeout: 5s
  tcpTimeout: 15m0s
  udpTimeout: 1m0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 10s
  format: json
  options:
    json:
      infoBufferSize: "64Ki"
      splitStream: true
    text:
      infoBufferSize: "0"
  verbosity: 2
  vmodule:
  - filePattern: proxier
    verbosity: 6
metricsBindAddress: 0.0.0.0:10249
mode: ipvs
nftables:
  masqueradeAll: false
  masqueradeBit: 14
  minSyncPeriod: 1s
  syncPeriod: 30s
nodePortAddresses:
- 192.168.0.0/16
- fd00::/64
oomScoreAdj: -998
portRange: ""
showHiddenMetricsForVersion: "1.32"
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

/// A document with the type header and `body`; `body` starts on line 3.
fn doc(body: &str) -> String {
    format!("{HEADER}{body}")
}

fn decoded(text: &str) -> KubeProxyConfiguration {
    match KubeProxyConfiguration::from_yaml(text) {
        Ok(c) => c,
        Err(e) => panic!("decode failed: {e}"),
    }
}

/// The configuration and its warnings; panics if refused.
fn decoded_with_warnings(text: &str) -> (KubeProxyConfiguration, Vec<String>) {
    match KubeProxyConfiguration::from_yaml_with_warnings(text) {
        Ok(c) => c,
        Err(e) => panic!("decode failed: {e}"),
    }
}

fn load_err(text: &str) -> LoadError {
    match KubeProxyConfiguration::from_yaml(text) {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => e,
    }
}

fn invalid_fields(error: &LoadError) -> Vec<&str> {
    match error {
        LoadError::Invalid(e) => e.errors.iter().map(|e| e.field.as_str()).collect(),
        other => panic!("not a validation error: {other}"),
    }
}

fn options(args: &[&str]) -> Options {
    match Options::try_parse_from(std::iter::once("kube-proxy").chain(args.iter().copied())) {
        Ok(o) => o,
        Err(e) => panic!("{args:?}: {e}"),
    }
}

/// A temporary directory holding `config.yaml` with `text`; returns `--config=<path>`.
fn config_file(dir: &tempfile::TempDir, text: &str) -> String {
    let path = dir.path().join("config.yaml");
    if let Err(e) = std::fs::write(&path, text) {
        panic!("writing {}: {e}", path.display());
    }
    format!("--config={}", path.display())
}

fn tempdir() -> tempfile::TempDir {
    match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("tempdir: {e}"),
    }
}

fn loaded(opts: &Options) -> Loaded {
    match opts.load() {
        Ok(l) => l,
        Err(e) => panic!("load failed: {e}"),
    }
}

#[test]
fn decodes_a_full_upstream_file() {
    let c = decoded(FULL_UPSTREAM_FILE);
    assert_eq!(c.bind_address, "10.0.0.5");
    assert!(c.bind_address_hard_fail && c.enable_profiling);
    assert_eq!(c.client_connection.accept_content_types, "application/json");
    assert_eq!(c.client_connection.content_type, "application/json");
    assert_eq!(
        c.client_connection.kubeconfig,
        "/var/lib/kube-proxy/kubeconfig.conf"
    );
    assert_eq!(
        (c.client_connection.qps, c.client_connection.burst),
        (7.5, 20)
    );
    assert_eq!(c.cluster_cidrs().len(), 2);
    assert_eq!(c.config_sync_period, Duration::from_secs(600));
    assert_eq!(c.conntrack.max_per_core, 0);
    assert_eq!(c.conntrack.min, 65536);
    assert!(c.conntrack.tcp_be_liberal);
    assert_eq!(
        c.conntrack.tcp_close_wait_timeout,
        Duration::from_secs(1800)
    );
    assert_eq!(
        c.conntrack.tcp_established_timeout,
        Duration::from_secs(12 * 3600)
    );
    assert_eq!(c.conntrack.udp_stream_timeout, Duration::from_secs(120));
    assert_eq!(c.conntrack.udp_timeout, Duration::from_secs(30));
    assert_eq!(c.detect_local_mode, LocalMode::InterfaceNamePrefix);
    assert_eq!(c.detect_local.interface_name_prefix, "veth");
    assert_eq!(c.feature_gate("NFTablesProxyMode"), Some(true));
    assert_eq!(c.feature_gate("GangScheduling"), Some(false));
    assert_eq!(c.healthz_bind_address(), "0.0.0.0:10266".parse().ok());
    assert_eq!(c.metrics_bind_address(), "0.0.0.0:10249".parse().ok());
    assert_eq!(c.hostname_override(), Some("node-a"));
    assert!(!c.iptables.localhost_node_ports && c.iptables.masquerade_all);
    assert_eq!(c.iptables.masquerade_bit, 15);
    assert_eq!(c.iptables.min_sync_period, Duration::from_secs(2));
    assert_eq!(c.iptables.sync_period, Duration::from_secs(60));
    assert_eq!(c.ipvs.exclude_cidrs, Some(vec!["10.96.0.0/12".to_owned()]));
    assert_eq!(c.ipvs_scheduler(), "wrr");
    assert!(c.ipvs.strict_arp);
    assert_eq!(c.ipvs.tcp_fin_timeout, Duration::from_secs(5));
    assert_eq!(c.ipvs.tcp_timeout, Duration::from_secs(900));
    assert_eq!(c.ipvs.udp_timeout, Duration::from_secs(60));
    assert_eq!(c.logging.flush_frequency, Duration::from_secs(10));
    assert_eq!(c.logging.format, "json");
    assert!(c.logging.options.json.split_stream);
    assert_eq!(c.logging.options.json.info_buffer_size, "64Ki");
    assert_eq!(c.logging.verbosity, 2);
    assert_eq!(c.logging.vmodule.len(), 1);
    assert_eq!(c.mode(), ProxyMode::Ipvs);
    // In IPVS mode the ipvs block drives the sync periods.
    assert_eq!(c.sync_period(), Duration::from_secs(45));
    assert_eq!(c.min_sync_period(), Duration::from_secs(1));
    assert!(matches!(c.node_port_addresses(), NodePortAddressesSetting::Listed(v) if v.len() == 2));
    assert_eq!(c.oom_score_adj, -998);
    assert_eq!(c.show_hidden_metrics_for_version, "1.32");
}

#[test]
fn json_files_are_accepted() {
    let json = r#"{
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "nftables",
        "nftables": {"syncPeriod": "20s", "minSyncPeriod": "0s", "masqueradeBit": 3},
        "conntrack": {"maxPerCore": 1024},
        "nodePortAddresses": null,
        "featureGates": {"AllAlpha": true}
    }"#;
    let c = decoded(json);
    assert_eq!(c.mode(), ProxyMode::Nftables);
    assert_eq!(c.sync_period(), Duration::from_secs(20));
    // Zero is "unset" for upstream's defaulting.
    assert_eq!(c.min_sync_period(), DEFAULT_NFTABLES_MIN_SYNC_PERIOD);
    assert_eq!(c.nftables.masquerade_bit, 3);
    assert_eq!(c.conntrack.max_per_core, 1024);
    assert_eq!(c.feature_gate("AllAlpha"), Some(true));
}

#[test]
fn unknown_fields_are_warned_by_path_and_line_and_skipped() {
    // As upstream: strict decoding fails, the lenient decode is used and the strict errors
    // are logged. Every unknown field is named with its full path and line.
    let text = format!(
        "{HEADER}iptables:\n  syncPeriod: 20s\n  masqueradeBitt: 3\nmasqueradeAll: true\n\
         featureGates:\n  GracefulNodeShutdown: true\nlogging:\n  options:\n    json:\n      bogus: 1\n\
         \x20 vmodule:\n  - filePattern: proxier\n    verbosity: 4\n    level: 2\n"
    );
    let (c, warnings) = decoded_with_warnings(&text);
    assert_eq!(c.iptables.sync_period, Duration::from_secs(20));
    assert_eq!(c.iptables.masquerade_bit, DEFAULT_MASQUERADE_BIT);
    assert!(!c.iptables.masquerade_all);
    let strict: Vec<&String> = warnings
        .iter()
        .filter(|w| w.contains("strict decoding"))
        .collect();
    assert_eq!(strict.len(), 4, "{warnings:#?}");
    assert!(strict[3].contains("unknown field \"logging.vmodule[0].level\" (line 16)"));
    assert!(
        strict[0].starts_with("<input>: unknown field \"iptables.masqueradeBitt\" (line 5)"),
        "{}",
        strict[0]
    );
    assert!(strict[1].contains("unknown field \"masqueradeAll\" (line 6)"));
    assert!(strict[2].contains("unknown field \"logging.options.json.bogus\" (line 12)"));
    // featureGates keys are free; a gate upstream knows but kube-proxy does not consult is
    // named in a warning (unknown gates are refused: see the gates module).
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("feature gate GracefulNodeShutdown=true is not one")),
        "{warnings:#?}"
    );
}

#[test]
fn duplicate_fields_warn_and_the_last_wins_but_type_errors_refuse() {
    let dup = format!(
        "{HEADER}mode: ipvs\niptables:\n  syncPeriod: 5s\n  syncPeriod: 7s\nmode: nftables\n"
    );
    let (c, warnings) = decoded_with_warnings(&dup);
    assert_eq!(c.mode(), ProxyMode::Nftables);
    assert_eq!(c.iptables.sync_period, Duration::from_secs(7));
    let strict: Vec<&String> = warnings
        .iter()
        .filter(|w| w.contains("strict decoding"))
        .collect();
    assert_eq!(strict.len(), 2, "{warnings:#?}");
    assert!(strict[0].contains("duplicate field \"iptables.syncPeriod\" (line 6)"));
    assert!(strict[1].contains("duplicate field \"mode\" (line 7)"));

    let wrong_type = format!("{HEADER}iptables:\n  masqueradeBit: high\n");
    assert!(matches!(
        load_err(&wrong_type),
        LoadError::Decode { line: 4, .. }
    ));
    let not_yaml = format!("{HEADER}iptables: [\n");
    assert!(matches!(load_err(&not_yaml), LoadError::Decode { .. }));
    assert!(matches!(load_err(""), LoadError::Decode { .. }));
}

#[test]
fn wrong_type_header_is_rejected() {
    let cases = [
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\naddress: 0.0.0.0\n",
        "apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: KubeProxyConfiguration\n",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
        "kind: KubeProxyConfiguration\n",
        "mode: ipvs\n",
    ];
    for text in cases {
        match load_err(text) {
            LoadError::WrongKind { .. } => {}
            other => panic!("{text:?}: {other}"),
        }
    }
    assert!(
        load_err(cases[0])
            .to_string()
            .contains("kind \"KubeletConfiguration\"")
    );
}

#[test]
fn bad_values_in_a_file_are_all_reported_with_fields() {
    let text = doc("\
mode: turbo
bindAddress: node-1
oomScoreAdj: 5000
iptables:
  syncPeriod: 30
  minSyncPeriod: -1s
  masqueradeBit: 40
conntrack:
  tcpEstablishedTimeout: 1d
logging:
  verbosity: -1
clusterCIDR: 10.0.0.0/8,10.1.0.0/16
nodePortAddresses: [primary, localhost, 10.0.0.0/33]
");
    let error = load_err(&text);
    let mut fields = invalid_fields(&error);
    fields.sort_unstable();
    assert_eq!(
        fields,
        [
            "bindAddress",
            "clusterCIDR",
            "conntrack.tcpEstablishedTimeout",
            "iptables.masqueradeBit",
            "iptables.minSyncPeriod",
            "iptables.syncPeriod",
            "logging.verbosity",
            "mode",
            "nodePortAddresses[2]",
            "oomScoreAdj",
        ]
    );
    let shown = error.to_string();
    assert_eq!(shown.lines().count(), 11, "{shown}");
    let line_of = |field: &str| {
        shown
            .lines()
            .find(|l| l.starts_with(&format!("{field}: ")))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(
        line_of("iptables.syncPeriod").contains("\"30\": missing unit"),
        "{shown}"
    );
    assert!(
        line_of("iptables.syncPeriod").ends_with("(line 7)"),
        "{shown}"
    );
    assert_eq!(
        line_of("iptables.minSyncPeriod"),
        "iptables.minSyncPeriod: invalid value \"-1s\": duration \"-1s\" is negative (line 8)"
    );
    assert!(
        line_of("conntrack.tcpEstablishedTimeout").contains("unknown unit \"d\""),
        "{shown}"
    );
    assert!(
        line_of("logging.verbosity").contains("must not be negative"),
        "{shown}"
    );
    assert!(
        shown.contains("mode: invalid value \"turbo\": unknown proxy mode"),
        "{shown}"
    );
}

#[test]
fn unset_null_and_zero_fields_get_upstreams_defaults() {
    // Upstream's SetDefaults_KubeProxyConfiguration: absent, null, and for non-pointer fields
    // the zero value, all mean "use the default".
    let text = doc("\
hostnameOverride:
clientConnection:
  qps: 0
  burst: 0
  contentType: \"\"
ipvs:
  syncPeriod: ~
  minSyncPeriod: 0s
iptables:
  syncPeriod: 0s
  minSyncPeriod: 0s
  masqueradeBit: null
  localhostNodePorts: null
nftables:
  syncPeriod: 0s
  minSyncPeriod: 0s
  masqueradeBit: null
configSyncPeriod: 0s
udpIdleTimeout: 0s
logging:
  flushFrequency: 0
  format: \"\"
  options:
    json:
      infoBufferSize: 0
bindAddress: \"\"
metricsBindAddress: \"\"
healthzBindAddress: \"\"
nodePortAddresses: null
oomScoreAdj: null
conntrack:
  maxPerCore: null
  min: null
  tcpEstablishedTimeout: null
  tcpCloseWaitTimeout: null
");
    let mut want = KubeProxyConfiguration::default();
    want.complete_defaults();
    assert_eq!(decoded(&text), want);
    // Pointer fields keep an explicit zero: it means "leave the kernel's value".
    let zeros = decoded(&doc("\
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
iptables:
  masqueradeBit: 0
oomScoreAdj: 0
"));
    assert_eq!(zeros.conntrack.max_per_core, 0);
    assert_eq!(zeros.conntrack.min, 0);
    assert_eq!(zeros.conntrack.tcp_established_timeout, Duration::ZERO);
    assert_eq!(zeros.conntrack.tcp_close_wait_timeout, Duration::ZERO);
    assert_eq!(zeros.iptables.masquerade_bit, 0);
    assert_eq!(zeros.oom_score_adj, 0);
    // The flags still disable the servers with an empty address.
    let c = loaded(&options(&["--metrics-bind-address=", "--healthz-port=0"])).config;
    assert_eq!(c.metrics_bind_address(), None);
    assert_eq!(c.healthz_bind_address(), None);
}

#[test]
fn dependent_defaults_follow_mode_and_bind_address() {
    let nft = decoded(&format!("{HEADER}mode: nftables\n"));
    assert_eq!(nft.node_port_addresses, Some(vec!["primary".to_owned()]));
    let ipt = decoded(&format!("{HEADER}mode: iptables\n"));
    assert_eq!(ipt.node_port_addresses, None);
    let empty_mode = decoded(&format!("{HEADER}mode: \"\"\n"));
    assert_eq!(empty_mode.mode(), ProxyMode::platform_default());

    let v6 = decoded(&format!("{HEADER}bindAddress: \"::\"\n"));
    assert_eq!(v6.healthz_bind_address.as_deref(), Some("[::]:10256"));
    assert_eq!(v6.metrics_bind_address.as_deref(), Some("[::1]:10249"));
    let bare = decoded(&format!("{HEADER}healthzBindAddress: 10.0.0.1\n"));
    assert_eq!(bare.healthz_bind_address.as_deref(), Some("10.0.0.1:10256"));

    let opts = options(&["--bind-address=::1"]);
    let c = loaded(&opts).config;
    assert_eq!(c.healthz_bind_address(), "[::]:10256".parse().ok());
    assert_eq!(c.metrics_bind_address(), "[::1]:10249".parse().ok());
}

#[test]
fn flags_override_defaults_without_config() {
    let opts = options(&[
        "--proxy-mode=nftables",
        "--masquerade-all",
        "--iptables-sync-period=10s",
        "--iptables-min-sync-period=0s",
        "--nodeport-addresses=10.0.0.0/8",
        "--cluster-cidr=10.244.0.0/16",
        "--hostname-override= Node-A ",
        "--v=3",
        "--metrics-bind-address=",
    ]);
    let out = loaded(&opts);
    assert!(out.warnings.is_empty(), "{:?}", out.warnings);
    let c = out.config;
    assert_eq!(c.mode(), ProxyMode::Nftables);
    assert_eq!(c.masquerade(), (DEFAULT_MASQUERADE_BIT, true));
    assert_eq!(c.sync_period(), Duration::from_secs(10));
    assert_eq!(c.min_sync_period(), Duration::ZERO);
    assert_eq!(c.node_port_addresses, Some(vec!["10.0.0.0/8".to_owned()]));
    assert_eq!(c.cluster_cidr, "10.244.0.0/16");
    assert_eq!(c.hostname_override(), Some("node-a"));
    assert_eq!(c.logging.verbosity, 3);
    assert_eq!(c.metrics_bind_address(), None);
}

#[test]
fn config_file_wins_except_hostname_and_logging() {
    let dir = tempdir();
    let config = config_file(
        &dir,
        &doc("\
hostnameOverride: from-file
logging:
  verbosity: 1
iptables:
  masqueradeAll: false
  syncPeriod: 20s
"),
    );
    let opts = options(&[
        &config,
        "--masquerade-all",
        "--iptables-sync-period=5s",
        "--hostname-override=FROM-FLAG",
        "-v",
        "5",
        "--manifests=/tmp/cluster",
        "--cleanup=false",
        "--master=https://10.0.0.1:6443",
    ]);
    let out = loaded(&opts);
    let c = &out.config;
    assert!(!c.iptables.masquerade_all);
    assert_eq!(c.iptables.sync_period, Duration::from_secs(20));
    assert_eq!(c.hostname_override(), Some("from-flag"));
    assert_eq!(c.logging.verbosity, 5);
    assert_eq!(out.warnings.len(), 2, "{:?}", out.warnings);
    assert!(
        out.warnings[0].contains("--masquerade-all is ignored"),
        "{:?}",
        out.warnings
    );
    assert!(
        out.warnings[0].contains("iptables.masqueradeAll"),
        "{:?}",
        out.warnings
    );
    assert!(
        out.warnings[1].contains("--iptables-sync-period"),
        "{:?}",
        out.warnings
    );
    assert_eq!(opts.manifests, Some(PathBuf::from("/tmp/cluster")));
    assert_eq!(opts.master.as_deref(), Some("https://10.0.0.1:6443"));

    // Without the flags, the file's values stand and nothing is warned about.
    let plain = loaded(&options(&[&config]));
    assert_eq!(plain.config.hostname_override(), Some("from-file"));
    assert_eq!(plain.config.logging.verbosity, 1);
    assert!(plain.warnings.is_empty());
}

#[test]
fn validation_errors_name_the_flag_that_set_the_value() {
    let opts = options(&[
        "--iptables-min-sync-period=1m",
        "--iptables-masquerade-bit=32",
        "--oom-score-adj=-2000",
        "--healthz-bind-address=0.0.0.0:0",
    ]);
    let error = match opts.load() {
        Ok(l) => panic!("accepted {:?}", l.config),
        Err(e) => e,
    };
    let fields = invalid_fields(&error);
    assert_eq!(
        fields,
        [
            "--healthz-bind-address",
            "--iptables-min-sync-period",
            "--iptables-masquerade-bit",
            "--oom-score-adj",
        ]
    );

    // The same problem coming from a file is named by its config path.
    let dir = tempdir();
    let config = config_file(&dir, &format!("{HEADER}iptables:\n  minSyncPeriod: 1m\n"));
    let error = match options(&[&config]).load() {
        Ok(l) => panic!("accepted {:?}", l.config),
        Err(e) => e,
    };
    assert_eq!(invalid_fields(&error), ["iptables.minSyncPeriod"]);
}

#[test]
fn unreadable_config_file_names_the_path() {
    let dir = tempdir();
    let missing = dir.path().join("nope.yaml");
    let opts = options(&[&format!("--config={}", missing.display())]);
    match opts.load() {
        Err(e @ LoadError::Read { .. }) => {
            assert!(
                e.to_string().contains(&missing.display().to_string()),
                "{e}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn decode_errors_from_files_name_the_path() {
    let dir = tempdir();
    let config = config_file(&dir, &format!("{HEADER}mode: [1]\n"));
    let shown = options(&[&config])
        .load()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(shown.contains("config.yaml: line 3"), "{shown}");
    assert!(shown.contains("expected string"), "{shown}");
}

#[test]
fn a_mode_neither_flag_nor_file_sets_is_defaulted() {
    assert!(loaded(&options(&[])).config.mode_defaulted);
    assert!(
        !loaded(&options(&["--proxy-mode=iptables"]))
            .config
            .mode_defaulted
    );
    assert!(decoded(&format!("{HEADER}mode: \"\"\n")).mode_defaulted);
    assert!(decoded(HEADER).mode_defaulted);
    assert!(!decoded(&format!("{HEADER}mode: iptables\n")).mode_defaulted);
}

#[test]
fn ipvs_mode_with_its_gate_off_is_refused_naming_the_other_modes() {
    let err = options(&["--proxy-mode=ipvs", "--feature-gates=KubeProxyIPVS=false"])
        .load()
        .expect_err("ipvs mode with KubeProxyIPVS=false");
    let text = format!("{err:#}");
    assert!(text.contains("KubeProxyIPVS=false"), "{text}");
    assert!(text.contains("valid modes: iptables, nftables"), "{text}");
    assert!(!text.contains("ipvs, "), "{text}");
    // On (the default) or set on: ipvs mode loads.
    for gates in [&[][..], &["--feature-gates=KubeProxyIPVS=true"]] {
        let args: Vec<&str> = ["--proxy-mode=ipvs"].iter().chain(gates).copied().collect();
        assert!(options(&args).load().is_ok(), "{args:?}");
    }
}

#[test]
fn written_config_round_trips() {
    let dir = tempdir();
    let cases: &[&[&str]] = &[
        &[],
        &[
            "--proxy-mode=ipvs",
            "--ipvs-scheduler=mh",
            "--ipvs-exclude-cidrs=10.0.0.0/8",
            "--ipvs-min-sync-period=1500ms",
            "--feature-gates=GangScheduling=true",
            "--vmodule=proxier=4",
            "--bind-address=fd00::1",
            "--conntrack-tcp-timeout-established=2h45m10.5s",
            "--cluster-cidr=fd00:1::/56,10.1.0.0/16",
            "--detect-local-mode=BridgeInterface",
            "--pod-bridge-interface=cbr0",
        ],
        // (An empty --healthz-bind-address disables the server but is written as "", which
        // a file means as the default: upstream's writer and reader disagree the same way.)
        &["--proxy-mode=nftables", "--kube-api-qps=12.5"],
        &[
            "--proxy-mode=userspace",
            "--proxy-port-range=30000+100",
            "--udp-timeout=2s",
            "--userspace-max-connections-per-service=10",
            "--userspace-max-udp-sessions-per-service=20",
        ],
    ];
    for (i, args) in cases.iter().enumerate() {
        let original = loaded(&options(args)).config;
        let path = dir.path().join(format!("written-{i}.yaml"));
        if let Err(e) = write_config(&path, &original) {
            panic!("{e}");
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(text.starts_with(HEADER), "{text}");
        assert!(text.contains("tcpCloseWaitTimeout: 1h0m0s"), "{text}");
        let reread = loaded(&options(&[&format!("--config={}", path.display())]));
        // The file names the effective mode, as upstream's writer does: read back, it is set.
        assert!(!reread.config.mode_defaulted, "{text}");
        let original = KubeProxyConfiguration {
            mode_defaulted: false,
            ..original
        };
        assert_eq!(reread.config, original, "{args:?}\n{text}");
    }
}

#[test]
fn written_sync_periods_and_masquerade_all_are_the_running_modes_only() {
    // Upstream 1.31+ keeps one of each and writes it into the running mode's block.
    type Expected<'a> = &'a [(&'a str, &'a str, serde_json::Value)];
    let cases: &[(&[&str], Expected<'_>)] = &[
        (
            &[
                "--proxy-mode=nftables",
                "--masquerade-all",
                "--iptables-sync-period=1m",
            ],
            &[
                ("nftables", "syncPeriod", json!("1m0s")),
                ("nftables", "masqueradeAll", json!(true)),
                ("iptables", "syncPeriod", json!("0s")),
                ("iptables", "minSyncPeriod", json!("0s")),
                ("iptables", "masqueradeAll", json!(false)),
                ("ipvs", "syncPeriod", json!("0s")),
            ],
        ),
        (
            &[
                "--proxy-mode=ipvs",
                "--masquerade-all",
                "--ipvs-sync-period=45s",
            ],
            &[
                ("ipvs", "syncPeriod", json!("45s")),
                ("iptables", "masqueradeAll", json!(true)),
                ("nftables", "masqueradeAll", json!(false)),
                ("iptables", "syncPeriod", json!("0s")),
            ],
        ),
    ];
    for (args, fields) in cases {
        let written = loaded(&options(args)).config.versioned();
        let value = serde_json::to_value(&written).unwrap_or_default();
        for (block, field, want) in *fields {
            assert_eq!(
                &value[block][field], want,
                "{args:?} {block}.{field}: {value}"
            );
        }
    }
}

#[test]
fn ipvs_mode_from_flags_alone_rests_a_second_as_upstream() {
    // Upstream's single minSyncPeriod starts as iptables' 1s without a file; a file's
    // absent ipvs.minSyncPeriod stays 0s.
    let flags = loaded(&options(&["--proxy-mode=ipvs"])).config;
    assert_eq!(flags.min_sync_period(), Duration::from_secs(1));
    let given = loaded(&options(&[
        "--proxy-mode=ipvs",
        "--ipvs-min-sync-period=0s",
    ]))
    .config;
    assert_eq!(given.min_sync_period(), Duration::ZERO);
    assert_eq!(
        decoded(&doc("mode: ipvs\n")).min_sync_period(),
        Duration::ZERO
    );
    let iptables = loaded(&options(&[])).config;
    assert_eq!(iptables.ipvs.min_sync_period, Duration::ZERO);
}

#[test]
fn the_versioned_document_names_its_type() {
    // What /configz serves since upstream 1.36 (#136044): the v1alpha1 object with its type.
    let value =
        serde_json::to_value(KubeProxyConfiguration::default().versioned()).unwrap_or_default();
    assert_eq!(value["apiVersion"], API_VERSION, "{value}");
    assert_eq!(value["kind"], KIND, "{value}");
    assert_eq!(value["iptables"]["syncPeriod"], "30s", "{value}");
    assert_eq!(value["ipvs"]["syncPeriod"], "0s", "{value}");
}

#[test]
fn write_config_reports_unwritable_paths() {
    let dir = tempdir();
    let path = dir.path().join("no-such-dir").join("out.yaml");
    let result = write_config(&path, &KubeProxyConfiguration::default());
    assert!(matches!(result, Err(WriteError::Write { .. })));
}

#[test]
fn userspace_settings_from_a_file() {
    let c = decoded(&doc("\
mode: userspace
portRange: 30000-30100
udpIdleTimeout: 1m30s
userspace:
  maxConnectionsPerService: 100
  maxUDPSessionsPerService: 50
"));
    assert_eq!(c.proxy_port_range(), Some(30000..=30100));
    assert_eq!(c.udp_idle_timeout, Duration::from_secs(90));
    assert_eq!(c.userspace.max_connections_per_service, 100);
    assert_eq!(c.userspace.max_udp_sessions_per_service, 50);
    // Unset: upstream's UDP timeout, ephemeral ports, our caps' defaults.
    let d = decoded(&doc("mode: userspace\nportRange: \"\"\n"));
    assert_eq!(d.udp_idle_timeout, Duration::from_millis(250));
    assert_eq!(d.proxy_port_range(), None);
    assert_eq!(d.userspace, UserspaceConfiguration::default());
    assert_eq!(
        d.userspace.max_connections_per_service,
        DEFAULT_USERSPACE_MAX_CONNECTIONS_PER_SERVICE
    );
    // A default file does not mention the extension or the removed upstream field.
    let text = KubeProxyConfiguration::default()
        .to_yaml()
        .unwrap_or_default();
    assert!(text.contains("portRange"), "{text}");
    assert!(!text.contains("udpIdleTimeout"), "{text}");
    assert!(!text.contains("userspace:"), "{text}");
}

#[test]
fn bad_userspace_settings_are_all_reported_at_once() {
    let text = doc("\
portRange: 40000-30000
udpIdleTimeout: 250
userspace:
  maxConnectionsPerService: 0
  maxUDPSessionsPerService: -5
iptables:
  masqueradeBit: 40
");
    let error = load_err(&text);
    let mut fields = invalid_fields(&error);
    fields.sort_unstable();
    assert_eq!(
        fields,
        [
            "iptables.masqueradeBit",
            "portRange",
            "udpIdleTimeout",
            "userspace.maxConnectionsPerService",
            "userspace.maxUDPSessionsPerService",
        ]
    );
    let shown = error.to_string();
    assert!(
        shown.contains("udpIdleTimeout: invalid value \"250\": "),
        "{shown}"
    );
    assert!(shown.contains("(line 4)"), "{shown}");
    assert!(
        shown.contains("end port 30000 is below the start 40000"),
        "{shown}"
    );
    // A zero timeout in a file is unset (upstream's defaulting); from the flag it is invalid.
    assert_eq!(
        decoded(&doc("udpIdleTimeout: 0s\n")).udp_idle_timeout,
        DEFAULT_UDP_IDLE_TIMEOUT
    );
    let zero = options(&["--udp-timeout=0s"]).load().err();
    assert_eq!(
        zero.as_ref().map(|e| invalid_fields(e)),
        Some(vec!["--udp-timeout"])
    );
    // Unknown fields in the extension block are warned about, as elsewhere.
    let (_, warnings) = decoded_with_warnings(&doc("userspace:\n  maxConnections: 5\n"));
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("unknown field \"userspace.maxConnections\" (line 4)")),
        "{warnings:#?}"
    );
}

#[test]
fn userspace_flags_set_the_fields_and_bad_ones_are_named() {
    let c = loaded(&options(&[
        "--proxy-mode=userspace",
        "--proxy-port-range=8080",
        "--udp-timeout=500ms",
        "--userspace-max-connections-per-service=7",
        "--userspace-max-udp-sessions-per-service=9",
    ]))
    .config;
    assert_eq!(c.proxy_port_range(), Some(8080..=8080));
    assert_eq!(c.udp_idle_timeout, Duration::from_millis(500));
    assert_eq!(c.userspace.max_connections_per_service, 7);
    assert_eq!(c.userspace.max_udp_sessions_per_service, 9);

    let error = match options(&[
        "--proxy-port-range=0-10",
        "--udp-timeout=0s",
        "--userspace-max-connections-per-service=-1",
        "--userspace-max-udp-sessions-per-service=0",
    ])
    .load()
    {
        Ok(l) => panic!("accepted {:?}", l.config),
        Err(e) => e,
    };
    let mut fields = invalid_fields(&error);
    fields.sort_unstable();
    assert_eq!(
        fields,
        [
            "--proxy-port-range",
            "--udp-timeout",
            "--userspace-max-connections-per-service",
            "--userspace-max-udp-sessions-per-service",
        ]
    );
    // A timeout that is not a duration is refused by the flag parser itself.
    let bad = Options::try_parse_from(["kube-proxy", "--udp-timeout=250"]);
    assert!(bad.is_err_and(|e| e.to_string().contains("--udp-timeout")));
}

#[test]
fn deprecated_port_flags_work_as_upstreams() {
    // Port 0 disables the server.
    let off = loaded(&options(&["--metrics-port=0", "--healthz-port=0"])).config;
    assert_eq!(off.metrics_bind_address(), None);
    assert_eq!(off.healthz_bind_address(), None);
    // Another port only applies to an address given without one (upstream's
    // addressFromDeprecatedFlags appends a port only if there is none).
    let bare = loaded(&options(&[
        "--metrics-bind-address=0.0.0.0",
        "--metrics-port=9999",
    ]))
    .config;
    assert_eq!(bare.metrics_bind_address(), "0.0.0.0:9999".parse().ok());
    let alone = loaded(&options(&["--metrics-port=9999"])).config;
    assert_eq!(alone.metrics_bind_address(), "127.0.0.1:10249".parse().ok());
    // With a config file they are ignored, with a warning.
    let dir = tempdir();
    let config = config_file(&dir, HEADER);
    let with_file = loaded(&options(&[&config, "--healthz-port=0"]));
    assert_eq!(
        with_file.config.healthz_bind_address(),
        "0.0.0.0:10256".parse().ok()
    );
    assert!(
        with_file
            .warnings
            .iter()
            .any(|w| w.starts_with("flag --healthz-port is ignored")),
        "{:#?}",
        with_file.warnings
    );
}

#[test]
fn logging_flags_apply_over_the_file_and_are_warned_about() {
    let dir = tempdir();
    let config = config_file(&dir, HEADER);
    let l = loaded(&options(&[
        &config,
        "--log-flush-frequency=2s",
        "--log-json-split-stream",
        "--log-text-info-buffer-size=1Mi",
        "--windows-service",
    ]));
    assert_eq!(l.config.logging.flush_frequency, Duration::from_secs(2));
    assert!(l.config.logging.options.json.split_stream);
    assert_eq!(l.config.logging.options.text.info_buffer_size, "1Mi");
    // --windows-service is a configuration flag: ignored with --config, as upstream.
    assert!(!l.config.windows_run_as_service);
    for named in [
        "logging.flushFrequency is set",
        "logging.options.json.splitStream is set",
        "logging.options.text.infoBufferSize is set",
        "flag --windows-service is ignored",
    ] {
        assert!(
            l.warnings.iter().any(|w| w.starts_with(named)),
            "{named}: {:#?}",
            l.warnings
        );
    }
}

#[test]
fn settings_of_another_mode_are_named() {
    let l = loaded(&options(&[
        "--proxy-mode=nftables",
        "--iptables-masquerade-bit=15",
        "--iptables-localhost-nodeports=false",
        "--ipvs-scheduler=wrr",
        "--iptables-sync-period=10s",
    ]));
    // As upstream: the iptables bit is not nftables mode's.
    assert_eq!(l.config.masquerade().0, DEFAULT_MASQUERADE_BIT);
    assert_eq!(l.config.sync_period(), Duration::from_secs(10));
    for flag in [
        "flag --iptables-masquerade-bit has no effect in nftables mode",
        "flag --iptables-localhost-nodeports has no effect in nftables mode",
        "flag --ipvs-* has no effect in nftables mode",
    ] {
        assert!(
            l.warnings.iter().any(|w| w.starts_with(flag)),
            "{flag}: {:#?}",
            l.warnings
        );
    }
    let ipvs = loaded(&options(&[
        "--proxy-mode=ipvs",
        "--iptables-min-sync-period=5s",
    ]));
    assert!(
        ipvs.warnings
            .iter()
            .any(|w| w.starts_with("flag --iptables-sync-period / --iptables-min-sync-period")),
        "{:#?}",
        ipvs.warnings
    );
    // Ignored: ipvs mode keeps upstream's flags-only 1s, not the 5s given.
    assert_eq!(ipvs.config.min_sync_period(), Duration::from_secs(1));

    // In a file, the blocks of other modes.
    let (_, warnings) = decoded_with_warnings(&doc(
        "mode: iptables\nipvs:\n  scheduler: wrr\n  syncPeriod: 0s\nnftables:\n  masqueradeAll: true\n",
    ));
    assert_eq!(
        warnings,
        [
            "ipvs.scheduler is set to \"wrr\" but has no effect in iptables mode: it applies to \
             ipvs mode only",
            "nftables.masqueradeAll is set to true but has no effect in iptables mode: it applies \
             to nftables mode only",
        ]
    );
}

#[test]
fn unknown_and_locked_feature_gates_are_refused_with_upstreams_message() {
    // Every refused gate at once; a known gate beside them is no error.
    let file = format!(
        "{HEADER}featureGates:\n  NoSuchGate: true\n  NFTablesProxyMode: false\n  GangScheduling: true\n"
    );
    let err = load_err(&file).to_string();
    assert!(
        err.contains(
            "featureGates: invalid value \"NoSuchGate=true\": unrecognized feature gate: NoSuchGate"
        ),
        "{err}"
    );
    assert!(
        err.contains(
            "cannot set feature gate NFTablesProxyMode to false, feature is locked to true"
        ),
        "{err}"
    );
    assert!(!err.contains("GangScheduling"), "{err}");
    // The flag is refused the same way, naming the flag.
    let opts = Options::try_parse_from(["kube-proxy", "--feature-gates=TopologyAwareHints=true"])
        .unwrap_or_else(|e| panic!("{e}"));
    let err = opts.load().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        err.contains("unrecognized feature gate: TopologyAwareHints"),
        "{err}"
    );
}

#[test]
fn canary_period_from_the_file_or_the_flag_and_zero_turns_the_short_checks_off() {
    assert_eq!(
        decoded(&doc("mode: iptables\n")).canary_period,
        DEFAULT_CANARY_PERIOD
    );
    assert_eq!(
        decoded(&doc("canaryPeriod: 500ms\n")).canary_period,
        Duration::from_millis(500)
    );
    assert_eq!(
        decoded(&doc("canaryPeriod: 0s\n")).canary_period,
        Duration::ZERO
    );
    let c = loaded(&options(&["--canary-period=10s"])).config;
    assert_eq!(c.canary_period, Duration::from_secs(10));
}

#[test]
fn socket_lb_comes_from_flags_or_the_file_and_is_written_only_when_set() {
    let loaded = options(&[
        "--proxy-mode=nftables",
        "--socket-lb",
        "--socket-lb-cgroup=/x",
    ])
    .load()
    .expect("valid");
    assert!(loaded.config.socket_lb.enabled);
    assert_eq!(loaded.config.socket_lb.cgroup, "/x");
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let written = serde_json::to_string(&loaded.config).expect("serializes");
    assert!(
        written.contains(r#""socketLB":{"enabled":true,"cgroup":"/x"}"#),
        "{written}"
    );
    let head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
    let file = KubeProxyConfiguration::from_yaml(&format!(
        "{head}mode: nftables\nsocketLB:\n  enabled: true\n"
    ))
    .expect("valid");
    assert!(file.socket_lb.enabled && file.socket_lb.cgroup.is_empty());
    let default = KubeProxyConfiguration::from_yaml(head).expect("valid");
    let written = serde_json::to_string(&default).expect("serializes");
    assert!(!written.contains("socketLB"), "{written}");
    // Another mode: named in a warning.
    let other = options(&["--proxy-mode=iptables", "--socket-lb"])
        .load()
        .expect("valid");
    assert!(
        other
            .warnings
            .iter()
            .any(|w| w.contains("socketLB.enabled") && w.contains("nftables mode only")),
        "{:?}",
        other.warnings
    );
}
