use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::*;

fn service(yaml: &str) -> Service {
    serde_saphyr::from_str(yaml).expect("test Service parses")
}

fn defaulted(yaml: &str) -> Service {
    let mut svc = service(yaml);
    default_service(&mut svc).expect("defaults apply");
    svc
}

fn error(yaml: &str) -> DefaultsError {
    let mut svc = service(yaml);
    default_service(&mut svc).expect_err("defaults must fail")
}

const HAND_WRITTEN: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  selector: {app: web}
  ports:
    - name: http
      port: 80
      targetPort: 8080
    - name: metrics
      port: 9090
";

/// The same Service as `kubectl get -o yaml` shows it (server-managed metadata left out).
const AS_STORED: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  ipFamilies: [IPv4]
  ipFamilyPolicy: SingleStack
  internalTrafficPolicy: Cluster
  sessionAffinity: None
  selector: {app: web}
  ports:
    - name: http
      port: 80
      protocol: TCP
      targetPort: 8080
    - name: metrics
      port: 9090
      protocol: TCP
      targetPort: 9090
";

#[test]
fn hand_written_service_equals_the_stored_one() {
    let stored = service(AS_STORED);
    assert_eq!(defaulted(HAND_WRITTEN), stored);
    // Defaulting is idempotent: an object read from a cluster is left as it is.
    assert_eq!(defaulted(AS_STORED), stored);
}

#[test]
fn load_balancer_gets_external_policy_node_port_allocation_and_ip_mode() {
    let svc = defaulted(
        "
apiVersion: v1
kind: Service
metadata: {name: shop, namespace: shop}
spec:
  type: LoadBalancer
  clusterIP: 10.96.1.20
  ports: [{port: 443, targetPort: 8443, nodePort: 30443}]
status:
  loadBalancer:
    ingress: [{ip: 198.51.100.20}, {hostname: lb.example.com}, {ip: 198.51.100.21, ipMode: Proxy}]
",
    );
    let spec = svc.spec.as_ref().expect("spec");
    assert_eq!(spec.external_traffic_policy.as_deref(), Some("Cluster"));
    assert_eq!(spec.internal_traffic_policy.as_deref(), Some("Cluster"));
    assert_eq!(spec.allocate_load_balancer_node_ports, Some(true));
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .expect("ingress");
    let modes: Vec<_> = ingress.iter().map(|i| i.ip_mode.as_deref()).collect();
    assert_eq!(modes, [Some("VIP"), None, Some("Proxy")]);
}

#[test]
fn external_traffic_policy_only_for_externally_accessible_services() {
    let policy = |yaml: &str| {
        defaulted(yaml)
            .spec
            .and_then(|spec| spec.external_traffic_policy)
    };
    let base = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec:\n  clusterIP: 10.0.0.1\n";
    assert_eq!(
        policy(&format!("{base}  type: NodePort\n")).as_deref(),
        Some("Cluster")
    );
    assert_eq!(policy(base), None);
    assert_eq!(
        policy(&format!("{base}  externalIPs: [192.0.2.1]\n")).as_deref(),
        Some("Cluster")
    );
    assert_eq!(
        policy(&format!(
            "{base}  type: NodePort\n  externalTrafficPolicy: Local\n"
        ))
        .as_deref(),
        Some("Local")
    );
}

#[test]
fn client_ip_affinity_gets_the_default_timeout_and_keeps_a_given_one() {
    let base = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec:\n  clusterIP: 10.0.0.1\n";
    let timeout = |extra: &str| {
        defaulted(&format!("{base}{extra}"))
            .spec
            .and_then(|spec| spec.session_affinity_config)
            .and_then(|config| config.client_ip)
            .and_then(|client_ip| client_ip.timeout_seconds)
    };
    assert_eq!(
        timeout("  sessionAffinity: ClientIP\n"),
        Some(DEFAULT_CLIENT_IP_TIMEOUT_SECONDS)
    );
    assert_eq!(
        timeout("  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {}}\n"),
        Some(10800)
    );
    assert_eq!(
        timeout(
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n"
        ),
        Some(60)
    );
    // No affinity: any config is dropped, as the API does.
    assert_eq!(
        timeout("  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n"),
        None
    );
}

#[test]
fn the_default_timeout_is_the_one_the_model_assumes() {
    assert_eq!(
        DEFAULT_CLIENT_IP_TIMEOUT_SECONDS,
        kp_core::model::DEFAULT_AFFINITY_TIMEOUT_SECONDS
    );
}

#[test]
fn ports_get_protocol_and_target_port() {
    let svc = defaulted(
        "
apiVersion: v1
kind: Service
metadata: {name: a}
spec:
  clusterIP: 10.0.0.1
  ports:
    - {name: a, port: 53, protocol: UDP}
    - {name: b, port: 80, targetPort: 0}
    - {name: c, port: 81, targetPort: http}
    - {name: d, port: 82, targetPort: ''}
",
    );
    let ports = svc.spec.and_then(|spec| spec.ports).expect("ports");
    let got: Vec<_> = ports
        .iter()
        .map(|p| (p.protocol.as_deref(), p.target_port.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (Some("UDP"), Some(IntOrString::Int(53))),
            (Some("TCP"), Some(IntOrString::Int(80))),
            (Some("TCP"), Some(IntOrString::String("http".into()))),
            (Some("TCP"), Some(IntOrString::Int(82))),
        ]
    );
}

/// (clusterIP, clusterIPs, ipFamilies, ipFamilyPolicy) after defaulting.
fn ip_fields(yaml_spec: &str) -> (String, Vec<String>, Vec<String>, String) {
    let spec = defaulted(&format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: a}}\nspec:\n{yaml_spec}"
    ))
    .spec
    .expect("spec");
    (
        spec.cluster_ip.unwrap_or_default(),
        spec.cluster_ips.unwrap_or_default(),
        spec.ip_families.unwrap_or_default(),
        spec.ip_family_policy.unwrap_or_default(),
    )
}

#[test]
fn cluster_ips_families_and_policy() {
    let strings = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        ip_fields("  clusterIP: 10.0.0.1\n"),
        (
            "10.0.0.1".into(),
            strings(&["10.0.0.1"]),
            strings(&["IPv4"]),
            "SingleStack".into()
        )
    );
    assert_eq!(
        ip_fields("  clusterIPs: [fd00::1]\n"),
        (
            "fd00::1".into(),
            strings(&["fd00::1"]),
            strings(&["IPv6"]),
            "SingleStack".into()
        )
    );
    assert_eq!(
        ip_fields("  clusterIP: fd00::1\n  clusterIPs: [fd00::1, 10.0.0.1]\n"),
        (
            "fd00::1".into(),
            strings(&["fd00::1", "10.0.0.1"]),
            strings(&["IPv6", "IPv4"]),
            "RequireDualStack".into()
        )
    );
    // A given policy that fits is kept.
    assert_eq!(
        ip_fields("  clusterIP: 10.0.0.1\n  ipFamilyPolicy: PreferDualStack\n").3,
        "PreferDualStack"
    );
}

#[test]
fn headless_and_external_name_services_need_no_cluster_ip() {
    let headless = ip_fields("  clusterIP: None\n");
    assert_eq!(headless.1, ["None"]);
    assert!(
        headless.2.is_empty(),
        "no families for headless: {headless:?}"
    );

    let svc = defaulted(
        "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec:\n  type: ExternalName\n  externalName: example.com\n",
    );
    let spec = svc.spec.expect("spec");
    assert_eq!(spec.cluster_ips, None);
    assert_eq!(spec.internal_traffic_policy, None);
    assert_eq!(spec.session_affinity.as_deref(), Some("None"));
}

#[test]
fn a_service_without_cluster_ip_is_an_error_naming_it() {
    let err = error(
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: prod}\nspec:\n  type: NodePort\n  ports: [{port: 80}]\n",
    );
    assert_eq!(
        err,
        DefaultsError::MissingClusterIp {
            object: "Service prod/web".into(),
            service_type: "NodePort".into()
        }
    );
    let text = err.to_string();
    assert!(
        text.contains("Service prod/web") && text.contains("spec.clusterIP"),
        "{text}"
    );
    // No spec at all is a ClusterIP service without a cluster IP.
    assert!(matches!(
        error("apiVersion: v1\nkind: Service\nmetadata: {name: bare}\n"),
        DefaultsError::MissingClusterIp { .. }
    ));
}

#[test]
fn contradictory_cluster_ips_are_errors() {
    let base = "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: n}\nspec:\n";
    let err = |spec: &str| error(&format!("{base}{spec}"));
    assert_eq!(
        err("  clusterIP: 10.0.0.x\n"),
        DefaultsError::InvalidClusterIp {
            object: "Service n/a".into(),
            field: "spec.clusterIPs[0]".into(),
            value: "10.0.0.x".into(),
            error: kp_core::model::AddressError::NotAnIp,
        }
    );
    assert!(matches!(
        err("  clusterIP: 10.0.0.1\n  clusterIPs: [10.0.0.2]\n"),
        DefaultsError::ClusterIpMismatch { .. }
    ));
    assert!(matches!(
        err("  clusterIPs: [10.0.0.1, 10.0.0.2]\n"),
        DefaultsError::InvalidClusterIps { .. }
    ));
    assert!(matches!(
        err("  clusterIPs: [10.0.0.1, fd00::1, 10.0.0.3]\n"),
        DefaultsError::InvalidClusterIps { .. }
    ));
    assert!(matches!(
        err("  clusterIP: 10.0.0.1\n  ipFamilies: [IPv6]\n"),
        DefaultsError::IpFamilies { .. }
    ));
    assert!(matches!(
        err("  clusterIP: 10.0.0.1\n  ipFamilies: [IPv4, IPv6]\n"),
        DefaultsError::IpFamilies { .. }
    ));
    assert!(matches!(
        err("  clusterIPs: [10.0.0.1, fd00::1]\n  ipFamilyPolicy: SingleStack\n"),
        DefaultsError::IpFamilies { .. }
    ));
    assert!(matches!(
        err("  clusterIP: 10.0.0.1\n  ipFamilyPolicy: RequireDualStack\n"),
        DefaultsError::IpFamilies { .. }
    ));
}

#[test]
fn endpoint_slice_ports_get_name_and_protocol_and_conditions_stay_unset() {
    let mut slice: EndpointSlice = serde_saphyr::from_str(
        "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default}
addressType: IPv4
ports: [{port: 8080}, {name: dns, port: 53, protocol: UDP}]
endpoints: [{addresses: [10.244.1.5]}]
",
    )
    .expect("slice parses");
    default_endpoint_slice(&mut slice);
    let ports: Vec<_> = slice
        .ports
        .iter()
        .flatten()
        .map(|p| (p.name.as_deref(), p.protocol.as_deref(), p.port))
        .collect();
    assert_eq!(
        ports,
        [
            (Some(""), Some("TCP"), Some(8080)),
            (Some("dns"), Some("UDP"), Some(53))
        ]
    );
    assert_eq!(slice.endpoints[0].conditions, None);
}
