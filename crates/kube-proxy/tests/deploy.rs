//! The deployment files: every manifest in `deploy/` parses as its Kubernetes type, the
//! DaemonSet has the shape of kubeadm's kube-proxy DaemonSet with upstream's current split (a
//! privileged `--init-only` init container, an unprivileged proxy with only the capabilities
//! it needs), the shipped configuration is accepted by the real binary run with the
//! DaemonSet's own command line, both containers' command lines run on a stand-in node (a
//! network namespace) with the proxy confined to its declared capabilities and a read-only
//! `/proc/sys`, and the kustomization and the Dockerfile agree with the manifests.

use crate::node;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, ServiceAccount, Volume};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::serde::de::DeserializeOwned;
use serde_json::Value;

const NAMESPACE: &str = "kube-system";
const NAME: &str = "kube-proxy";
const BINARY_PATH: &str = "/usr/local/bin/kube-proxy";
const CONFIG_KEY: &str = "config.conf";
const CONFIG_DIR: &str = "/var/lib/kube-proxy";
/// What the kubelet substitutes for `$(NODE_NAME)` in the test run.
const TEST_NODE: &str = "node-a";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn deploy_dir() -> PathBuf {
    repo_root().join("deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every `*.yaml` / `*.yml` file name in `deploy/`, sorted.
fn yaml_files() -> Vec<String> {
    let dir = deploy_dir();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").file_name())
        .filter_map(|name| name.into_string().ok())
        .filter(|name| name.ends_with(".yaml") || name.ends_with(".yml"))
        .collect();
    names.sort();
    names
}

fn parse_value(text: &str, origin: &str) -> Value {
    serde_saphyr::from_str::<Value>(text).unwrap_or_else(|e| panic!("{origin}: {e}"))
}

/// A file of `deploy/` as untyped JSON.
fn manifest(name: &str) -> Value {
    parse_value(&read(&deploy_dir().join(name)), name)
}

/// A file of `deploy/` as its k8s-openapi type (unknown fields would be silently dropped by
/// serde, so the typed view is compared against the untyped one in `every_manifest_parses`).
fn typed<T: DeserializeOwned>(name: &str) -> T {
    serde_json::from_value(manifest(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn daemonset() -> DaemonSet {
    typed("daemonset.yaml")
}

fn configmap() -> ConfigMap {
    typed("configmap.yaml")
}

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("DaemonSet has a pod spec")
}

fn container(ds: &DaemonSet) -> &Container {
    let containers = &pod_spec(ds).containers;
    assert_eq!(containers.len(), 1, "one container");
    &containers[0]
}

fn init_container(ds: &DaemonSet) -> &Container {
    let containers = pod_spec(ds).init_containers.as_deref().unwrap_or_default();
    assert_eq!(containers.len(), 1, "one init container");
    &containers[0]
}

/// The capabilities the proxy container adds, sorted; it must drop all others.
fn added_capabilities(c: &Container) -> Vec<String> {
    let caps = c
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
        .expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    let mut added = caps.add.clone().unwrap_or_default();
    added.sort();
    added
}

fn volume<'a>(ds: &'a DaemonSet, name: &str) -> &'a Volume {
    pod_spec(ds)
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// The mount of `path` in the container: (volume name, read-only).
fn mount(ds: &DaemonSet, path: &str) -> (String, bool) {
    let m = container(ds)
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == path)
        .unwrap_or_else(|| panic!("nothing mounted at {path}"));
    (m.name.clone(), m.read_only.unwrap_or(false))
}

fn config_text() -> String {
    configmap()
        .data
        .and_then(|d| d.get(CONFIG_KEY).cloned())
        .unwrap_or_else(|| panic!("ConfigMap has no {CONFIG_KEY}"))
}

#[test]
fn every_manifest_parses() {
    let files = yaml_files();
    for name in &files {
        let value = manifest(name);
        let kind = value["kind"].as_str().unwrap_or_default();
        assert!(
            value["apiVersion"].is_string() && !kind.is_empty(),
            "{name}: apiVersion and kind"
        );
        // Round-trip through the typed form: a misspelt or misplaced field would be dropped.
        let typed: Value = match kind {
            "DaemonSet" => serde_json::to_value(typed::<DaemonSet>(name)),
            "ConfigMap" => serde_json::to_value(typed::<ConfigMap>(name)),
            "ServiceAccount" => serde_json::to_value(typed::<ServiceAccount>(name)),
            "ClusterRoleBinding" => serde_json::to_value(typed::<ClusterRoleBinding>(name)),
            "Kustomization" => continue,
            other => panic!("{name}: unexpected kind {other}"),
        }
        .expect("serialize");
        assert_eq!(typed, value, "{name}: fields lost in the typed round trip");
        if kind != "ClusterRoleBinding" {
            assert_eq!(value["metadata"]["namespace"], NAMESPACE, "{name}");
            assert_eq!(value["metadata"]["name"], NAME, "{name}");
        }
    }
    for expected in [
        "serviceaccount.yaml",
        "clusterrolebinding.yaml",
        "configmap.yaml",
        "daemonset.yaml",
        "kustomization.yaml",
    ] {
        assert!(files.iter().any(|f| f == expected), "missing {expected}");
    }
}

#[test]
fn rbac_binds_the_service_account_to_node_proxier() {
    let sa: ServiceAccount = typed("serviceaccount.yaml");
    let crb: ClusterRoleBinding = typed("clusterrolebinding.yaml");
    assert_eq!(crb.role_ref.kind, "ClusterRole");
    assert_eq!(crb.role_ref.name, "system:node-proxier");
    assert_eq!(crb.role_ref.api_group, "rbac.authorization.k8s.io");
    let subjects = crb.subjects.expect("subjects");
    assert!(
        subjects.iter().any(|s| s.kind == "ServiceAccount"
            && Some(&s.name) == sa.metadata.name.as_ref()
            && s.namespace == sa.metadata.namespace),
        "{subjects:?}"
    );
    assert_eq!(
        pod_spec(&daemonset()).service_account_name,
        sa.metadata.name,
        "the DaemonSet runs as the bound ServiceAccount"
    );
}

#[test]
fn daemonset_has_upstreams_shape() {
    let ds = daemonset();
    let pod = pod_spec(&ds);
    let c = container(&ds);

    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert_eq!(
        pod.node_selector
            .as_ref()
            .and_then(|s| s.get("kubernetes.io/os"))
            .map(String::as_str),
        Some("linux")
    );
    assert!(
        pod.tolerations.iter().flatten().any(|t| {
            t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none()
        }),
        "tolerates every taint"
    );
    // The proxy is unprivileged; the init container does the privileged set-up.
    assert_eq!(
        c.security_context.as_ref().and_then(|s| s.privileged),
        Some(false)
    );
    assert_eq!(added_capabilities(c), ["NET_ADMIN", "NET_RAW"]);
    let init = init_container(&ds);
    assert_eq!(
        init.security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    assert_eq!(init.image, c.image, "the same image");
    let mut init_command = c.command.clone().expect("command");
    init_command.push("--init-only".to_owned());
    assert_eq!(init.command.as_ref(), Some(&init_command));
    assert_eq!(init.env, c.env, "the same NODE_NAME");
    for path in [CONFIG_DIR, kp_dataplane::sysctls::DEFAULT_STATE_DIR] {
        let mounted = init
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.mount_path == path)
            .map(|m| m.name.clone());
        assert_eq!(
            mounted,
            Some(mount(&ds, path).0),
            "{path} in the init container"
        );
    }

    // Selector matches the template, and updates roll node by node.
    let spec = ds.spec.as_ref().expect("spec");
    let labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone());
    assert_eq!(spec.selector.match_labels, labels);
    let strategy = spec.update_strategy.as_ref().expect("updateStrategy");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let max_unavailable = strategy
        .rolling_update
        .as_ref()
        .and_then(|r| r.max_unavailable.clone())
        .expect("rollingUpdate.maxUnavailable");
    assert!(
        matches!(max_unavailable, IntOrString::Int(n) if n >= 1)
            || matches!(&max_unavailable, IntOrString::String(s) if s.ends_with('%')),
        "{max_unavailable:?}"
    );

    // The command, and NODE_NAME behind --hostname-override.
    let command = c.command.clone().expect("command");
    assert_eq!(
        command,
        [
            BINARY_PATH.to_owned(),
            format!("--config={CONFIG_DIR}/{CONFIG_KEY}"),
            "--hostname-override=$(NODE_NAME)".to_owned(),
        ]
    );
    let node_name = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(node_name, Some("spec.nodeName"));
    assert!(
        c.image.as_deref().is_some_and(|i| i.contains(':')),
        "tagged image"
    );

    // The ConfigMap at the config directory, holding the key --config names.
    let (name, _) = mount(&ds, CONFIG_DIR);
    let config_volume = volume(&ds, &name);
    let source = config_volume
        .config_map
        .as_ref()
        .expect("a ConfigMap volume");
    assert_eq!(source.name, configmap().metadata.name.expect("name"));
    assert!(source.items.is_none(), "every key is projected");
    config_text();

    // The xtables lock shared with the host, and the host's kernel modules read-only.
    let (name, read_only) = mount(&ds, "/run/xtables.lock");
    assert!(!read_only, "the lock is written");
    let host = volume(&ds, &name).host_path.as_ref().expect("hostPath");
    assert_eq!(host.path, "/run/xtables.lock");
    assert_eq!(host.type_.as_deref(), Some("FileOrCreate"));
    let (name, read_only) = mount(&ds, "/lib/modules");
    assert!(read_only, "/lib/modules is read-only");
    let host = volume(&ds, &name).host_path.as_ref().expect("hostPath");
    assert_eq!(host.path, "/lib/modules");
    // The record of changed kernel settings outlives the container, for --cleanup.
    let (name, read_only) = mount(&ds, kp_dataplane::sysctls::DEFAULT_STATE_DIR);
    assert!(!read_only, "the record is written");
    let host = volume(&ds, &name).host_path.as_ref().expect("hostPath");
    assert_eq!(host.path, kp_dataplane::sysctls::DEFAULT_STATE_DIR);
    assert_eq!(host.type_.as_deref(), Some("DirectoryOrCreate"));
}

#[test]
fn shipped_config_is_accepted_by_the_binary() {
    let ds = daemonset();
    let data = configmap().data.expect("ConfigMap data");
    let shipped = parse_value(&data[CONFIG_KEY], CONFIG_KEY);
    assert_eq!(shipped["apiVersion"], "kubeproxy.config.k8s.io/v1alpha1");
    assert_eq!(shipped["kind"], "KubeProxyConfiguration");
    assert_eq!(shipped["mode"], "iptables");
    assert!(shipped["clusterCIDR"].is_string());

    // The kubeconfig it names is another key of the same ConfigMap.
    let kubeconfig = shipped["clientConnection"]["kubeconfig"]
        .as_str()
        .expect("clientConnection.kubeconfig");
    let key = kubeconfig
        .strip_prefix(&format!("{CONFIG_DIR}/"))
        .expect("kubeconfig under the ConfigMap mount");
    let kubeconfig = parse_value(&data[key], key);
    assert_eq!(kubeconfig["kind"], "Config");
    assert!(kubeconfig["current-context"].is_string());

    // Lay the ConfigMap out as the kubelet would and run the DaemonSet's command line against
    // it, with --write-config-to so that it exits after loading and validating.
    let dir = tempfile::tempdir().expect("tempdir");
    let mounted = dir.path().join("config");
    std::fs::create_dir(&mounted).expect("mkdir");
    for (key, text) in &data {
        std::fs::write(mounted.join(key), text).expect("write ConfigMap key");
    }
    let written = dir.path().join("written.yaml");
    let command = container(&ds).command.clone().expect("command");
    let args = command[1..].iter().map(|arg| {
        arg.replace(CONFIG_DIR, &mounted.display().to_string())
            .replace("$(NODE_NAME)", TEST_NODE)
    });
    let output = Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args(args)
        .arg(format!("--write-config-to={}", written.display()))
        .output()
        .expect("run kube-proxy");
    assert!(
        output.status.success(),
        "kube-proxy rejected the shipped configuration:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let effective = parse_value(&read(&written), "written config");
    assert_eq!(effective["hostnameOverride"], TEST_NODE);
    assert_same_values(&shipped, &effective, "");
}

/// The ConfigMap laid out as the kubelet mounts it, under a temporary directory.
fn mounted_configmap() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for (key, text) in configmap().data.expect("ConfigMap data") {
        std::fs::write(dir.path().join(key), text).expect("write ConfigMap key");
    }
    dir
}

/// A container's command line as the kubelet would run it here, minus the binary.
fn args_of(c: &Container, config_dir: &Path) -> Vec<String> {
    let command = c.command.clone().expect("command");
    command[1..]
        .iter()
        .map(|arg| {
            arg.replace(CONFIG_DIR, &config_dir.display().to_string())
                .replace("$(NODE_NAME)", TEST_NODE)
        })
        .collect()
}

#[test]
fn init_container_then_unprivileged_proxy_run_on_a_node() {
    use node::{BIN, Globals, NETFILTER, Netns, ROUTE_LOCALNET, stderr};
    if node::skip() {
        return;
    }
    let ds = daemonset();
    let config = mounted_configmap();
    let ns = Netns::new("deploy");
    ns.write(ROUTE_LOCALNET, "0");
    ns.write(
        &format!("{NETFILTER}/nf_conntrack_tcp_timeout_close_wait"),
        "60",
    );
    let globals = Globals::new(1000, 250);

    // The init container: sets what the shipped (iptables-mode) configuration asks for.
    let init_args = args_of(init_container(&ds), config.path());
    let init_args: Vec<&str> = init_args.iter().map(String::as_str).collect();
    let out = globals.run(&ns, &init_args);
    assert!(
        out.status.success(),
        "init container failed: {}",
        stderr(&out)
    );
    assert_eq!(ns.read(ROUTE_LOCALNET), "1");
    assert_eq!(
        ns.read(&format!("{NETFILTER}/nf_conntrack_tcp_timeout_close_wait")),
        "3600"
    );
    assert!(globals.get("max") >= 131_072);

    // The proxy: the DaemonSet's command line, confined to the container's capabilities and
    // a read-only /proc/sys as in an unprivileged container, reading Services from the
    // examples instead of an API server. It must program the node without any kernel
    // setting left to make.
    let caps: Vec<String> = added_capabilities(container(&ds))
        .iter()
        .map(|c| format!("+{}", c.to_lowercase()))
        .collect();
    let caps = caps.join(",");
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/cluster");
    let args = args_of(container(&ds), config.path()).join(" ");
    let script = format!(
        "{}mount --bind -o ro /proc/sys /proc/sys && \
         exec setpriv --bounding-set=-all,{caps} --inh-caps=-all \
         {BIN} {args} --manifests={examples}",
        globals.mounts()
    );
    let mut proxy = ns
        .command(&script)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the proxy");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let synced = loop {
        let save = ns.sh("iptables-save -t nat");
        let text = String::from_utf8_lossy(&save.stdout).into_owned();
        if text.contains(":KUBE-SEP-") || std::time::Instant::now() > deadline {
            break text;
        }
        if let Ok(Some(status)) = proxy.try_wait() {
            panic!("the proxy exited early with {status}");
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    // `ip netns exec` and `unshare` exec into the binary, so this is the proxy itself.
    let _ = proxy.kill();
    let output = proxy.wait_with_output().expect("proxy output");
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(
        synced.contains(":KUBE-SEP-"),
        "no rules programmed:\n{synced}\n{log}"
    );
    assert!(
        !log.contains("read-only"),
        "a kernel setting was still to make:\n{log}"
    );
    assert!(!log.contains("Permission denied"), "{log}");
}

/// Every non-null scalar of `shipped` has the same value at the same place in `effective`.
fn assert_same_values(shipped: &Value, effective: &Value, at: &str) {
    match shipped {
        Value::Object(fields) => {
            for (key, value) in fields {
                let path = format!("{at}.{key}");
                // Set on the command line, so it differs by design.
                if path == ".hostnameOverride" {
                    continue;
                }
                assert_same_values(value, &effective[key], &path);
            }
        }
        Value::Null => {}
        Value::Number(n) => {
            assert_eq!(n.as_f64(), effective.as_f64(), "{at}: {effective}");
        }
        other => assert_eq!(other, effective, "{at}"),
    }
}

#[test]
fn kustomization_lists_every_manifest() {
    let kustomization = manifest("kustomization.yaml");
    assert_eq!(kustomization["kind"], "Kustomization");
    let listed: BTreeSet<&str> = kustomization["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().expect("a file name"))
        .collect();
    let files = yaml_files();
    let expected: BTreeSet<&str> = files
        .iter()
        .map(String::as_str)
        .filter(|f| *f != "kustomization.yaml")
        .collect();
    assert_eq!(listed, expected);
}

#[test]
fn dockerfile_ships_the_binary_where_the_daemonset_runs_it() {
    let dockerfile = read(&repo_root().join("Dockerfile"));
    // Join continuation lines so that each instruction is one line.
    let instructions = dockerfile.replace("\\\n", " ");
    let lines: Vec<&str> = instructions
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();

    let daemonset = daemonset();
    let runs = &container(&daemonset).command.as_ref().expect("command")[0];
    assert_eq!(runs, BINARY_PATH);
    let entrypoint = lines
        .iter()
        .rfind(|l| l.starts_with("ENTRYPOINT"))
        .expect("ENTRYPOINT");
    assert_eq!(*entrypoint, format!("ENTRYPOINT [\"{runs}\"]"));
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("COPY --from=")
                && l.split_whitespace().last() == Some(runs.as_str())),
        "the binary is copied to {runs}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("cargo build --release --locked -p kube-proxy")),
        "release build of the kube-proxy package"
    );
    // The image leaves the demo (and its test bed) out: the default features, demo not named.
    assert!(
        lines
            .iter()
            .all(|l| !l.contains("demo") && !l.contains("--all-features")),
        "the image is built without the demo feature"
    );

    // The packages come from the one list the image test builds its root file system from.
    let list = "deploy/image/packages.txt";
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("COPY") && l.contains(&format!(" {list} "))),
        "the Dockerfile copies {list}"
    );
    // The builder compiles the socket load balancer's BPF programs (kp-socklb's build.rs).
    let builder_install = lines
        .iter()
        .find(|l| l.contains("apt-get install"))
        .expect("the builder's apt-get install");
    for package in ["clang", "libbpf-dev"] {
        assert!(
            builder_install.split_whitespace().any(|w| w == package),
            "the builder installs {package}: {builder_install}"
        );
    }
    // The runtime stage's (the last).
    let install = lines
        .iter()
        .rfind(|l| l.contains("apt-get install"))
        .expect("apt-get install");
    assert!(
        install.contains("$(sed 's/#.*//' /tmp/packages.txt)"),
        "installs the list's packages: {install}"
    );
    let packages: BTreeSet<String> = read(&repo_root().join(list))
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect();
    for package in ["iptables", "nftables", "ipset", "conntrack", "iproute2"] {
        assert!(
            packages.contains(package),
            "{package} is in {list}: {packages:?}"
        );
    }
    let words: BTreeSet<&str> = install.split_whitespace().collect();
    assert!(words.contains("--no-install-recommends"), "{install}");
    assert!(install.contains("rm -rf /var/lib/apt/lists/*"), "{install}");

    let ignore = read(&repo_root().join(".dockerignore"));
    assert!(
        ignore
            .lines()
            .any(|l| matches!(l.trim(), "target" | "target/" | "/target")),
        ".dockerignore excludes target/"
    );
}

/// The image's build (the default features, see the Dockerfile) compiles, and leaves the
/// demo's test bed out. No other test builds the binary that way: this one type-checks it in
/// a target directory of its own (a nested build in the test run's own would wait for the
/// lock `cargo test` holds).
#[test]
fn the_image_build_compiles_without_the_demo() {
    let cargo = env!("CARGO");
    let root = repo_root();
    let tree = Command::new(cargo)
        .args(["tree", "--locked", "--offline", "-p", "kube-proxy"])
        .args(["-e", "normal", "--prefix", "none"])
        .current_dir(&root)
        .output()
        .expect("run cargo tree");
    assert!(
        tree.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&tree.stderr)
    );
    let tree = String::from_utf8_lossy(&tree.stdout);
    assert!(
        tree.contains("kp-dataplane"),
        "the tree lists the product's crates:\n{tree}"
    );
    assert!(
        !tree.contains("kp-testbed"),
        "the image's build pulls in the test bed:\n{tree}"
    );

    let check = Command::new(cargo)
        .args(["check", "--locked", "--offline", "-p", "kube-proxy"])
        .args(["--bin", "kube-proxy", "--target-dir"])
        .arg(root.join("target/image-build-check"))
        .current_dir(&root)
        .output()
        .expect("run cargo check");
    assert!(
        check.status.success(),
        "the image's build does not compile:\n{}",
        String::from_utf8_lossy(&check.stderr)
    );
}
