//! The runtime image, checked without a container engine: `deploy/image/rootfs.sh` builds
//! (once, then from its cache) the image's root file system from the package list the
//! Dockerfile installs (`deploy/image/packages.txt`), with debootstrap. The binary under test
//! then runs chrooted into it, inside the node namespace of a `kp-testbed` cluster, with what
//! the DaemonSet mounts (`/run/xtables.lock`, the state directory under `/run`; `/proc`,
//! `/sys`, `/dev` as a container runtime gives them) and nothing of the host's `PATH`: the
//! shared traffic suite's scenarios then send real traffic through it in iptables, nftables
//! and userspace modes. A tool missing from the image or a library the binary cannot load
//! there fails here instead of on a user's node.
//!
//! ipvs mode needs a kernel with IPVS, which this machine's lacks (the binary would fall back
//! to iptables mode): the same scenarios run in the test VM (tools/kp-vm, Debian's kernel),
//! which carries the image's root file system at the host's path (unpacked into its RAM)
//! and chroots into it the same way, in one boot bounded by [`ipvs::VM_TIMEOUT`].
//!
//! Needs root, debootstrap (`./setup.sh --tests`) and Debian's package mirror for the first
//! build; it fails, with the reason, when any of them is missing.

use kp_suite::scenarios;
use kp_suite::support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use support::{CLUSTER_CIDR_V4, Env, Mode, Service, kube_proxy};

/// The environment the image's processes get: Debian's default `PATH` (what
/// debian:bookworm-slim sets), nothing from the host.
const IMAGE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Where the Dockerfile puts the binary (and the DaemonSet runs it).
const IMAGE_BINARY: &str = "/usr/local/bin/kube-proxy";

/// Where the test's manifests appear inside the image.
const IMAGE_MANIFESTS: &str = "/run/kp-manifests";

/// Set by the host test for the VM guest: the image's root file system, already built and
/// copied into the guest at this path (the guest has neither debootstrap nor bash to run
/// `rootfs.sh`).
const ROOTFS_ENV: &str = "KP_IMAGE_ROOTFS";

/// Every program the binary runs on a node in the kernel modes, with an argument that makes
/// each print its version and exit (so a missing library fails too).
const TOOLS: &[&[&str]] = &[
    &["iptables-legacy", "--version"],
    &["iptables-legacy-save", "--version"],
    &["iptables-legacy-restore", "--version"],
    &["ip6tables-legacy", "--version"],
    &["ip6tables-legacy-save", "--version"],
    &["ip6tables-legacy-restore", "--version"],
    &["iptables-nft", "--version"],
    &["iptables-nft-save", "--version"],
    &["iptables-nft-restore", "--version"],
    &["ip6tables-nft", "--version"],
    &["ip6tables-nft-save", "--version"],
    &["ip6tables-nft-restore", "--version"],
    &["iptables", "--version"],
    &["nft", "--version"],
    &["ipset", "--version"],
    &["conntrack", "--version"],
    &["ip", "-V"],
    &["unshare", "--version"],
    &["modprobe", "--version"],
];

/// Mounts what the DaemonSet and a container runtime give the container, then runs the
/// binary chrooted into the image. `ip netns exec` already gave this shell a mount namespace
/// of its own whose mounts do not propagate back: nothing here is seen outside it, it all
/// goes when the proxy exits, and the cached root file system is never written.
const CHROOT_SCRIPT: &str = r#"set -e
root=$1 binary=$2 manifests=$3 state=$4
shift 4
mount -t proc proc "$root/proc"
mount -t sysfs sysfs "$root/sys"
mount --rbind /dev "$root/dev"
mount -t tmpfs tmpfs "$root/tmp"
mount -t tmpfs tmpfs "$root/run"
mount -t tmpfs tmpfs "$root/usr/local/bin"
[ -e /run/xtables.lock ] || : >/run/xtables.lock
: >"$root/run/xtables.lock"
mount --bind /run/xtables.lock "$root/run/xtables.lock"
mkdir "$root/run/kube-proxy-rs" "$root/run/kp-manifests"
mount --bind "$state" "$root/run/kube-proxy-rs"
mount --bind -o ro "$manifests" "$root/run/kp-manifests"
: >"$root/usr/local/bin/kube-proxy"
mount --bind -o ro "$binary" "$root/usr/local/bin/kube-proxy"
exec chroot "$root" "$@"
"#;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The image's root file system, built or found in the cache once per test process.
fn rootfs() -> &'static Path {
    static ROOTFS: OnceLock<PathBuf> = OnceLock::new();
    ROOTFS.get_or_init(|| {
        if kp_vm::in_guest()
            && let Some(path) = std::env::var_os(ROOTFS_ENV).filter(|p| !p.is_empty())
        {
            return PathBuf::from(path);
        }
        let script = repo_root().join("deploy/image/rootfs.sh");
        let out = Command::new(&script)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} failed ({}): {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        assert!(
            path.join("usr/bin").is_dir(),
            "not a root file system: {path:?}"
        );
        path
    })
}

/// The traffic suite's launcher for this test: the binary as the image runs it.
fn in_image(command: &mut Command, source: &support::ObjectSource<'_>, state: &Path) {
    let support::ObjectSource::Manifests(manifests) = source else {
        panic!("the image test runs the proxy on manifests only, not {source:?}");
    };
    command
        .env_clear()
        .env("PATH", IMAGE_PATH)
        .args(["sh", "-c", CHROOT_SCRIPT, "sh"])
        .arg(rootfs())
        .arg(kube_proxy())
        .arg(manifests)
        .arg(state)
        .arg(IMAGE_BINARY)
        .arg(source.flag(Path::new(IMAGE_MANIFESTS)));
}

/// Every proxy this process starts runs in the image.
fn use_image() {
    rootfs();
    support::set_launcher(in_image);
}

#[test]
fn the_image_has_every_tool_the_binary_runs() {
    // A private mount namespace of its own (`unshare -m`), for the binary's mount only.
    let mut script = String::from(
        r#"set -e
root=$1 binary=$2
mount -t tmpfs tmpfs "$root/usr/local/bin"
: >"$root/usr/local/bin/kube-proxy"
mount --bind -o ro "$binary" "$root/usr/local/bin/kube-proxy"
chroot "$root" /usr/local/bin/kube-proxy --version
"#,
    );
    for tool in TOOLS {
        script.push_str(&format!(
            "chroot \"$root\" {} || {{ echo \"image lacks: {}\" >&2; exit 1; }}\n",
            tool.join(" "),
            tool[0]
        ));
    }
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c", &script, "sh"])
        .arg(rootfs())
        .arg(kube_proxy())
        .env_clear()
        .env("PATH", IMAGE_PATH)
        .output()
        .expect("run unshare");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("kube-proxy-rs"), "{stdout}");
    // Debian's iptables has both backends (the binary picks one per node).
    assert!(
        stdout.contains("(legacy)") && stdout.contains("(nf_tables)"),
        "{stdout}"
    );
}

#[test]
fn the_proxy_runs_inside_the_image() {
    runs_inside_the_image(Mode::Iptables);
}

/// Starts the proxy in `mode` from the image and checks that it runs there, chose its
/// iptables backend from the image's tools, and serves a ClusterIP.
fn runs_inside_the_image(mode: Mode) {
    use_image();
    let c = kp_testbed::Cluster::builder()
        .pod("a")
        .dual_stack(false)
        .build()
        .expect("test cluster builds (needs root, iproute2 and kp-echo)");
    let web = Service::new("web", "10.96.0.40")
        .tcp(80)
        .endpoints(&c, &["a"]);
    let mut env = Env::start(mode, c, CLUSTER_CIDR_V4, &[web]);
    // Its root directory is the image's, its binary the one mounted there.
    let pids = env.node_exec(&["ip", "netns", "pids", env.cluster.node_ns()]);
    let roots: Vec<PathBuf> = pids
        .split_whitespace()
        .filter_map(|pid| std::fs::read_link(format!("/proc/{pid}/root")).ok())
        .collect();
    assert!(
        roots.iter().any(|r| r == rootfs()),
        "no process in the node namespace runs in {}: {roots:?}",
        rootfs().display()
    );
    // The backend it chose is logged, from the image's tools.
    let chose = env.logged(|l| l.contains("Using iptables backend"));
    assert!(
        chose.iter().any(|l| l.contains("-restore")),
        "{chose:?}{}",
        env.diag()
    );
    let outcome = env
        .cluster
        .tcp(
            env.cluster.client(),
            "10.96.0.40".parse().expect("literal"),
            80,
        )
        .expect("probe");
    assert!(outcome.answered_by("a"), "{outcome:?}{}", env.diag());
    env.stop_proxy();
}

/// The traffic suite's scenarios that cover each kernel mode's main paths (ClusterIP with
/// balancing, affinity, hairpin and UDP; NodePorts, external and load balancer IPs, source
/// ranges and health-check node ports; conntrack cleanup when a UDP endpoint changes), with
/// the proxy running in the image.
macro_rules! image_mode_tests {
    ($module:ident, $mode:expr) => {
        mod $module {
            use crate::support::Mode;
            use crate::{scenarios, use_image};

            const MODE: Mode = $mode;

            #[test]
            fn cluster_ip() {
                use_image();
                scenarios::cluster_ip(MODE);
            }

            #[test]
            fn external() {
                use_image();
                scenarios::external(MODE);
            }

            #[test]
            fn udp_endpoint_replaced() {
                use_image();
                scenarios::udp_endpoint_replaced(MODE);
            }
        }
    };
}

image_mode_tests!(iptables, Mode::Iptables);
image_mode_tests!(nftables, Mode::NftablesChains);
image_mode_tests!(userspace, Mode::Userspace);

/// ipvs mode from the image, in the test VM: one boot runs the ignored tests below inside
/// Debian's kernel, with the image's root file system copied in at the host's path.
mod ipvs {
    use std::time::Duration;

    use crate::support::{self, Mode};
    use crate::{ROOTFS_ENV, rootfs, runs_inside_the_image, scenarios, use_image};

    const MODE: Mode = Mode::Ipvs;
    /// The ignored tests below: every one must pass inside the VM.
    const GUEST_TESTS: usize = 4;
    /// The whole VM run's bound: boot, unpacking the image (~150 MiB) and four tests took
    /// 3.6 and 9 minutes under software emulation on this 2-core machine at load 16-19 (most
    /// of it the image's iptables calls, 1-2 s each there); a hung guest ends here.
    pub const VM_TIMEOUT: Duration = Duration::from_secs(900);

    #[test]
    fn ipvs_from_the_image_in_the_vm() {
        let root = rootfs();
        let out = support::ipvs_vm()
            .tree(root)
            .env(ROOTFS_ENV, &root.to_string_lossy())
            .timeout(VM_TIMEOUT)
            .run_current_exe(&["--ignored", "--test-threads=1", "ipvs::"])
            .unwrap_or_else(|e| panic!("the IPVS VM did not run: {e}"));
        println!("VM run took {:.1} s", out.elapsed.as_secs_f64());
        out.assert_tests_passed(GUEST_TESTS);
    }

    #[test]
    #[ignore = "runs inside the IPVS VM (ipvs_from_the_image_in_the_vm)"]
    fn the_proxy_runs_inside_the_image() {
        runs_inside_the_image(MODE);
    }

    #[test]
    #[ignore = "runs inside the IPVS VM (ipvs_from_the_image_in_the_vm)"]
    fn cluster_ip() {
        use_image();
        scenarios::cluster_ip(MODE);
    }

    #[test]
    #[ignore = "runs inside the IPVS VM (ipvs_from_the_image_in_the_vm)"]
    fn external() {
        use_image();
        scenarios::external(MODE);
    }

    #[test]
    #[ignore = "runs inside the IPVS VM (ipvs_from_the_image_in_the_vm)"]
    fn udp_endpoint_replaced() {
        use_image();
        scenarios::udp_endpoint_replaced(MODE);
    }
}
