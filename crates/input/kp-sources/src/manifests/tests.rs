use std::path::Path;

use k8s_openapi::api::core::v1::Service;

use super::*;
use crate::defaults::DefaultsError;

fn parse(text: &str, file: &str) -> (Vec<Object>, Vec<ManifestError>) {
    parse_manifests(text, Path::new(file))
}

fn keys(objects: &[Object]) -> Vec<String> {
    objects.iter().map(|o| o.key().to_string()).collect()
}

fn service(object: &Object) -> &Service {
    match object {
        Object::Service(service) => service,
        other => panic!("not a Service: {other:?}"),
    }
}

const SERVICE: &str = "apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  clusterIP: 10.96.0.10
  ports:
    - port: 80
";

const SLICE: &str = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.244.1.5]}]
";

const NODE: &str = "apiVersion: v1
kind: Node
metadata: {name: node-1, namespace: ignored}
";

#[test]
fn multi_document_yaml_gives_every_object_defaulted() {
    let text =
        format!("---\n{SERVICE}---\n# a comment-only document\n---\n{SLICE}...\n---\n{NODE}");
    let (objects, errors) = parse(&text, "all.yaml");
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        keys(&objects),
        [
            "Service default/web",
            "EndpointSlice default/web-1",
            "Node node-1"
        ]
    );
    // Defaults are applied: the namespace as kubectl would, the rest as the API server.
    let spec = service(&objects[0]).spec.as_ref().expect("spec");
    assert_eq!(
        spec.cluster_ips.as_deref(),
        Some(&["10.96.0.10".to_owned()][..])
    );
    let port = &spec.ports.as_ref().expect("ports")[0];
    assert_eq!(port.protocol.as_deref(), Some("TCP"));
    let Object::EndpointSlice(slice) = &objects[1] else {
        panic!("not a slice")
    };
    let slice_port = &slice.ports.as_ref().expect("ports")[0];
    assert_eq!(slice_port.name.as_deref(), Some(""));
    // Nodes are cluster-scoped: a namespace written on one is dropped.
    assert_eq!(objects[2].key().namespace, "");
}

#[test]
fn a_list_contributes_its_items() {
    let text = "apiVersion: v1
kind: List
items:
  - apiVersion: v1
    kind: Service
    metadata: {name: a, namespace: ns}
    spec: {clusterIP: 10.0.0.1, ports: [{port: 53, protocol: UDP}]}
  - apiVersion: apps/v1
    kind: Deployment
    metadata: {name: ignored}
  - apiVersion: discovery.k8s.io/v1
    kind: EndpointSlice
    metadata: {name: a-1, namespace: ns}
    addressType: IPv4
    endpoints: []
";
    let (objects, errors) = parse(text, "list.yaml");
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(keys(&objects), ["Service ns/a", "EndpointSlice ns/a-1"]);
}

#[test]
fn a_broken_list_item_is_reported_at_its_line_and_others_apply() {
    let text = "apiVersion: v1
kind: List
items:
  - apiVersion: v1
    kind: Service
    metadata: {name: good}
    spec: {clusterIP: 10.0.0.1}
  - apiVersion: v1
    kind: Service
    metadata: {name: bad}
    spec: {clusterIP: 10.0.0.2, ports: [{port: eighty}]}
";
    let (objects, errors) = parse(text, "list.yaml");
    assert_eq!(keys(&objects), ["Service default/good"]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    let error = &errors[0];
    assert_eq!(
        (error.document, error.item, error.line),
        (Some(1), Some(1), Some(8))
    );
    assert!(
        error
            .to_string()
            .starts_with("list.yaml:8: document 1, items[1]: "),
        "{error}"
    );
}

#[test]
fn json_single_object_list_and_stream() {
    let one = r#"{"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "a"}, "spec": {"clusterIP": "10.0.0.1"}}"#;
    let (objects, errors) = parse(one, "a.json");
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(keys(&objects), ["Service default/a"]);

    let list = r#"{"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}}]}"#;
    let (objects, errors) = parse(list, "list.json");
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(keys(&objects), ["Node n"]);

    // A stream of values, as `kubectl get -o json` output concatenated.
    let (objects, errors) = parse(&format!("{one}\n{list}\n"), "stream.json");
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(keys(&objects), ["Service default/a", "Node n"]);
}

#[test]
fn json_type_errors_name_the_line() {
    let text = "{\"apiVersion\": \"v1\", \"kind\": \"Node\", \"metadata\": {\"name\": \"n\"}}\n\
                {\"apiVersion\": \"v1\", \"kind\": \"Service\",\n \"metadata\": {\"name\": \"a\"},\n \
                \"spec\": {\"ports\": [{\"port\": \"x\"}]}}\n";
    let (objects, errors) = parse(text, "bad.json");
    assert_eq!(keys(&objects), ["Node n"]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!((errors[0].document, errors[0].line), (Some(2), Some(4)));
    assert!(
        !errors[0].to_string().contains(" at line "),
        "{}",
        errors[0]
    );
}

#[test]
fn unknown_kinds_are_ignored_without_errors() {
    let text = format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: d}}\nspec: {{replicas: nope}}\n---\n\
         apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c}}\n---\n\
         apiVersion: discovery.k8s.io/v1beta1\nkind: EndpointSlice\nmetadata: {{name: old}}\n---\n{SERVICE}"
    );
    let (objects, errors) = parse(&text, "mixed.yaml");
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(keys(&objects), ["Service default/web"]);
}

#[test]
fn a_broken_document_in_the_middle_loses_only_itself() {
    // Document 2 starts on line 9 (its `---`); its syntax error is on line 13.
    let text = format!(
        "{SERVICE}---\napiVersion: v1\nkind: Service\nmetadata:\n  name: [oops\n---\n{SLICE}"
    );
    let (objects, errors) = parse(&text, "dir/broken.yaml");
    assert_eq!(
        keys(&objects),
        ["Service default/web", "EndpointSlice default/web-1"]
    );
    assert_eq!(errors.len(), 1, "{errors:?}");
    let error = &errors[0];
    assert_eq!(error.file, Path::new("dir/broken.yaml"));
    assert_eq!(error.document, Some(2));
    assert!(matches!(error.problem, Problem::Decode(_)), "{error:?}");
    let line = error.line.expect("a line");
    assert!(
        (10..=15).contains(&line),
        "line {line} outside document 2: {error}"
    );
    let text = error.to_string();
    assert!(
        text.starts_with(&format!("dir/broken.yaml:{line}")) && text.contains("document 2"),
        "{text}"
    );
}

#[test]
fn a_wrong_field_type_is_reported_at_its_line() {
    let text = format!("{NODE}---\n{}", SERVICE.replace("port: 80", "port: eighty"));
    let (objects, errors) = parse(&text, "svc.yaml");
    assert_eq!(keys(&objects), ["Node node-1"]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    // `port: eighty` is on line 12 of the file (line 8 of document 2).
    assert_eq!((errors[0].document, errors[0].line), (Some(2), Some(12)));
}

#[test]
fn defaults_missing_kind_and_missing_name_are_errors_at_the_document() {
    let text = "apiVersion: v1\nkind: Service\nmetadata: {name: nocip}\nspec: {ports: [{port: 80}]}\n---\n\
                metadata: {name: what}\n---\n\
                apiVersion: v1\nkind: Service\nmetadata: {generateName: x-}\nspec: {clusterIP: 10.0.0.1}\n";
    let (objects, errors) = parse(text, "x.yml");
    assert!(objects.is_empty(), "{objects:?}");
    let found: Vec<_> = errors
        .iter()
        .map(|e| (e.document, e.line, e.problem.clone()))
        .collect();
    assert!(
        matches!(
            &found[..],
            [
                (
                    Some(1),
                    Some(1),
                    Problem::Defaults(DefaultsError::MissingClusterIp { .. })
                ),
                (Some(2), Some(5), Problem::MissingKind),
                (Some(3), Some(7), Problem::MissingName("Service")),
            ]
        ),
        "{found:?}"
    );
    assert!(
        errors[0].to_string().contains("Service default/nocip"),
        "{}",
        errors[0]
    );
}

#[test]
fn empty_and_comment_only_files_have_nothing() {
    for text in [
        "",
        "\n",
        "# nothing yet\n",
        "---\n",
        "--- \n...\n",
        "null\n",
    ] {
        let (objects, errors) = parse(text, "empty.yaml");
        assert!(
            objects.is_empty() && errors.is_empty(),
            "{text:?}: {objects:?} {errors:?}"
        );
    }
    let (objects, errors) = parse("", "empty.json");
    assert!(
        objects.is_empty() && errors.is_empty(),
        "{objects:?} {errors:?}"
    );
}

#[test]
fn a_non_mapping_document_is_an_error() {
    let (objects, errors) = parse("- just\n- a list\n", "seq.yaml");
    assert!(objects.is_empty());
    assert_eq!(errors.len(), 1, "{errors:?}");
}

#[test]
fn the_example_cluster_parses_cleanly() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../examples/cluster");
    let mut all = Vec::new();
    for name in ["dns.yaml", "node.yaml", "shop.yaml", "web.yaml"] {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path).expect("example file");
        let (objects, errors) = parse_manifests(&text, &path);
        assert!(errors.is_empty(), "{name}: {errors:?}");
        all.extend(keys(&objects));
    }
    assert_eq!(
        all,
        [
            "Service kube-system/kube-dns",
            "EndpointSlice kube-system/kube-dns-x1",
            "Node node-1",
            "Service shop/shop",
            "EndpointSlice shop/shop-1",
            "Service default/web",
            "EndpointSlice default/web-abc12",
        ]
    );
}

#[test]
fn service_cidrs_are_cluster_scoped() {
    let text = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata:\n  name: kubernetes\n  \
                namespace: ignored\nspec:\n  cidrs: [10.96.0.0/16, \"fd00:10:96::/112\"]\n---\n\
                apiVersion: networking.k8s.io/v1beta1\nkind: ServiceCIDR\nmetadata:\n  name: old\n";
    let (objects, errors) = parse(text, "cidrs.yaml");
    assert!(errors.is_empty(), "{errors:?}");
    // Only the v1 object; no namespace, as the API server stores it.
    assert_eq!(keys(&objects), ["ServiceCIDR kubernetes"]);
    let Some(Object::ServiceCidr(cidr)) = objects.first() else {
        panic!("{objects:?}");
    };
    assert_eq!(
        cidr.spec.as_ref().and_then(|s| s.cidrs.clone()),
        Some(vec![
            "10.96.0.0/16".to_owned(),
            "fd00:10:96::/112".to_owned()
        ])
    );
}
