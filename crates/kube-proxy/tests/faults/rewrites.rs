//! The manifests source under files being rewritten (issue 34): the proxy runs with
//! `--manifests` and the default removal guard while a client opens new connections to the
//! steady Service, and its file is rewritten again and again by each way tools write files
//! (truncate then write in chunks with pauses, write then rename, a ConfigMap's `..data`
//! symlink swap, an editor's backup-and-write, `sed -i`, remove and re-create) and the
//! directory gains and loses files. No connection may fail, every edit must reach the
//! traffic, no partial read may be parsed (`kube_proxy_rs_manifest_errors_total` stays 0)
//! and the guard must never have been needed (`kube_proxy_rs_manifest_removals_held_total`
//! stays 0: the writer rules alone kept every half-written file out). Last, a document cut
//! in the middle of the file deletes nothing after it.
//!
//! The steady Service is the file's last document, where a cut-short read loses objects
//! first. The normal run uses a 500-Service file (enough for the guard's 100-Service floor
//! to be in play) and 4 rewrites per writer: 28 rewrites, about 25 s here in a debug build.
//! The 10,000 Services and 100 rewrites per writer is the ignored `rewrites_at_10k`.

use std::io::Write as _;
use std::path::PathBuf;

use super::*;

/// Namespace prefix of this module's clusters.
const REWRITE_PREFIX: &str = "kpw-";
/// The Service each rewrite changes (its port).
const MARKER_IP: &str = "10.96.0.60";
/// The manifests file rewritten.
const FILE: &str = "services.yaml";
/// A writer's pause between chunks: far longer than the settle time, well within the
/// writer hold.
const CHUNK_PAUSE: Duration = Duration::from_millis(150);

/// How tools write a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writer {
    /// Truncate, then write in chunks with pauses (the first chunk ends inside a line).
    Chunks,
    /// Write a hidden file, rename it over.
    Rename,
    /// A ConfigMap volume: `services.yaml -> ..data/services.yaml`, `..data` re-pointed.
    SymlinkSwap,
    /// vim's default: move the file to a backup, write a new one, delete the backup.
    EditorBackup,
    /// `sed -i` (a temporary file renamed over).
    SedInPlace,
    /// `rm`, then a new file a moment later.
    RemoveRecreate,
    /// A new file with a new Service added, the previous one removed.
    Directory,
}

const WRITERS: [Writer; 7] = [
    Writer::Chunks,
    Writer::Rename,
    Writer::SymlinkSwap,
    Writer::EditorBackup,
    Writer::SedInPlace,
    Writer::RemoveRecreate,
    Writer::Directory,
];

/// The manifests directory and the file's text but for the marker.
struct Files {
    dir: PathBuf,
    /// The documents before the marker's and after it (the steady Service last).
    head: String,
    tail: String,
}

impl Files {
    fn new(cluster: &Cluster, dir: &Path, services: usize) -> Files {
        let filler = |i: usize| {
            Service::new(
                &format!("filler-{i}"),
                &format!("10.96.{}.{}", 10 + i / 250, i % 250 + 1),
            )
            .tcp(80)
            .endpoints(cluster, &["b"])
            .yaml()
        };
        let fillers = services.saturating_sub(2);
        let half = fillers / 2;
        let head: String = (0..half).map(|i| filler(i) + "---\n").collect();
        let mut tail: String = (half..fillers)
            .map(|i| format!("---\n{}", filler(i)))
            .collect();
        let steady = Service::new("steady", STEADY_IP)
            .tcp(80)
            .endpoints(cluster, &["a", "b"]);
        tail += &format!("---\n{}", steady.yaml());
        let files = Files {
            dir: dir.to_owned(),
            head,
            tail,
        };
        std::fs::write(dir.join("node.yaml"), node_yaml(cluster, 0)).expect("node.yaml");
        std::fs::write(files.path(), files.text(cluster, 2000)).expect("services.yaml");
        files
    }

    fn path(&self) -> PathBuf {
        self.dir.join(FILE)
    }

    /// The file with the marker on `port`.
    fn text(&self, cluster: &Cluster, port: u16) -> String {
        let marker = Service::new("marker", MARKER_IP)
            .tcp(port)
            .endpoints(cluster, &["a"]);
        format!("{}{}{}", self.head, marker.yaml(), self.tail)
    }

    /// Rewrites the file by `writer`, from the marker on `old` to `new` (`round`: which
    /// rewrite of this writer).
    fn rewrite(&self, writer: Writer, text: &str, (old, new): (u16, u16), round: usize) {
        self.rewrite_in(None, writer, text, (old, new), round);
    }

    /// [`Files::rewrite`]; the directory writer's Services need the `cluster`'s pods.
    fn rewrite_in(
        &self,
        cluster: Option<&Cluster>,
        writer: Writer,
        text: &str,
        (old, new): (u16, u16),
        round: usize,
    ) {
        let path = self.path();
        match writer {
            Writer::Chunks => {
                let mut file = std::fs::File::create(&path).expect("truncate");
                let chunk = text.len().div_ceil(4);
                for piece in text.as_bytes().chunks(chunk) {
                    std::thread::sleep(CHUNK_PAUSE);
                    file.write_all(piece).expect("write a chunk");
                }
            }
            Writer::Rename => {
                let tmp = self.dir.join(format!(".{FILE}.tmp"));
                std::fs::write(&tmp, text).expect("write");
                std::fs::rename(&tmp, &path).expect("rename");
            }
            Writer::SymlinkSwap => self.swap(text, round),
            Writer::EditorBackup => {
                let backup = self.dir.join(format!("{FILE}~"));
                std::fs::rename(&path, &backup).expect("move to backup");
                let mut file = std::fs::File::create(&path).expect("create");
                let (first, rest) = text.split_at(text.len() / 2);
                file.write_all(first.as_bytes()).expect("write");
                std::thread::sleep(CHUNK_PAUSE);
                file.write_all(rest.as_bytes()).expect("write");
                drop(file);
                std::fs::remove_file(&backup).expect("remove backup");
            }
            Writer::SedInPlace => {
                let script = format!("s/port: {old}$/port: {new}/");
                let status = std::process::Command::new("sed")
                    .args(["-i", &script])
                    .arg(&path)
                    .status()
                    .expect("run sed");
                assert!(status.success(), "sed -i: {status}");
            }
            Writer::RemoveRecreate => {
                std::fs::remove_file(&path).expect("remove");
                std::thread::sleep(CHUNK_PAUSE);
                std::fs::write(&path, text).expect("re-create");
            }
            Writer::Directory => {
                let extra = |round: usize| self.dir.join(format!("extra-{round}.yaml"));
                let cluster = cluster.expect("the directory writer needs the cluster");
                std::fs::write(extra(round), extra_service(cluster, round)).expect("add a file");
                if round > 0 {
                    std::fs::remove_file(extra(round - 1)).expect("remove a file");
                }
            }
        }
    }

    /// A ConfigMap volume's update: the new data in `..v<round>`, `..data` re-pointed at it
    /// in one rename, the old data removed; the first one turns the file into the volume's
    /// symlink.
    fn swap(&self, text: &str, round: usize) {
        use std::os::unix::fs::symlink;
        let version = |round: usize| self.dir.join(format!("..v{round}"));
        std::fs::create_dir(version(round)).expect("mkdir ..v");
        std::fs::write(version(round).join(FILE), text).expect("write the new data");
        let tmp = self.dir.join("..data_tmp");
        symlink(format!("..v{round}"), &tmp).expect("..data_tmp");
        std::fs::rename(&tmp, self.dir.join("..data")).expect("swap ..data");
        if round == 0 {
            let link = self.dir.join(".link");
            symlink(format!("..data/{FILE}"), &link).expect("link");
            std::fs::rename(&link, self.path()).expect("the file becomes a link");
        } else {
            std::fs::remove_dir_all(version(round - 1)).expect("remove the old data");
        }
    }

    /// Back to a plain file after the symlink swaps (`rounds` of them).
    fn unswap(&self, text: &str, rounds: usize) {
        let tmp = self.dir.join(format!(".{FILE}.tmp"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, self.path()).expect("rename over the link");
        std::fs::remove_file(self.dir.join("..data")).expect("remove ..data");
        std::fs::remove_dir_all(self.dir.join(format!("..v{}", rounds - 1))).expect("rm ..v");
    }
}

/// The Service of the directory writer's `round`th file.
fn extra_service(cluster: &Cluster, round: usize) -> String {
    Service::new(&format!("extra-{round}"), &extra_ip(round))
        .tcp(80)
        .endpoints(cluster, &["a"])
        .yaml()
}

fn extra_ip(round: usize) -> String {
    format!("10.96.2.{}", round % 250 + 1)
}

/// `rounds` rewrites by `writer`, each checked to reach the traffic; the marker's port goes
/// on from `port`, which is returned as it ends. Prints the slowest edit.
fn rewrite_rounds(
    files: &Files,
    cluster: &Cluster,
    proxy: &Proxy,
    writer: Writer,
    (rounds, mut port): (usize, u16),
) -> u16 {
    let mut slowest = Duration::ZERO;
    for round in 0..rounds {
        let new = port + 1;
        let text = files.text(cluster, new);
        files.rewrite_in(Some(cluster), writer, &text, (port, new), round);
        let took = if writer == Writer::Directory {
            let extra = (ip(&extra_ip(round)), 80);
            let took = eventually_on(cluster, extra, "a", true, proxy);
            if round > 0 {
                let gone = (ip(&extra_ip(round - 1)), 80);
                eventually_on(cluster, gone, "a", false, proxy);
            }
            took
        } else {
            port = new;
            eventually_on(cluster, (ip(MARKER_IP), new), "a", true, proxy)
        };
        slowest = slowest.max(took);
    }
    if writer == Writer::SymlinkSwap {
        files.unswap(&files.text(cluster, port), rounds);
    }
    // A probe sent before the rules exist (a new Service) waits for TCP's SYN retransmission
    // (1 s): the directory writer's times are that long whatever the source does.
    println!("{writer:?}: {rounds} rewrites, slowest edit reached the traffic after {slowest:?}");
    port
}

/// Every writer, then a document cut in the middle of the file, under load; `services` in
/// the file and `rounds` rewrites per writer.
fn rewrites(mode: Mode, services: usize, rounds: usize) {
    let cluster = two_pods(REWRITE_PREFIX);
    let dir = tempfile::tempdir().expect("manifests tempdir");
    let state = tempfile::tempdir().expect("state tempdir");
    let files = Files::new(&cluster, dir.path(), services);
    let flags = Flags::cluster_cidr(CLUSTER_CIDR_V4);
    let proxy = Proxy::start(mode, &cluster, dir.path(), state.path(), &flags);
    eventually_on(&cluster, (ip(MARKER_IP), 2000), "a", true, &proxy);
    let ((), outcomes) = under_load(&cluster, || {
        let mut port = 2000;
        for writer in WRITERS {
            port = rewrite_rounds(&files, &cluster, &proxy, writer, (rounds, port));
        }
        // A filler cut off mid-document (a bad merge), the marker changed after it.
        let text = files.text(&cluster, port + 1);
        let cut_at = text.find("name: filler-1\n").expect("filler-1");
        let end = text[cut_at..].find("---\n").expect("its end") + cut_at;
        let cut = format!("{}\n{}", &text[..cut_at + 18], &text[end..]);
        files.rewrite(Writer::Rename, &cut, (port, port + 1), 0);
        eventually_on(&cluster, (ip(MARKER_IP), port + 1), "a", true, &proxy);
    });
    let what = format!(
        "{services} Services, {rounds} rewrites by each of {} writers",
        WRITERS.len()
    );
    assert_none_failed(&outcomes, &what, 10);
    let metrics = http_get_path(
        &cluster,
        cluster.node(),
        proxy.metrics_address(),
        "/metrics",
    );
    let errors = metric_sum(&metrics.body, "kube_proxy_rs_manifest_errors_total");
    assert_eq!(
        errors,
        Some(1.0),
        "only the cut document was broken: {}",
        metrics.body
    );
    let held = metric_sum(&metrics.body, "kube_proxy_rs_manifest_removals_held_total");
    assert_eq!(
        held,
        Some(0.0),
        "the guard was never needed: {}",
        metrics.body
    );
}

#[test]
fn manifests_rewritten_by_every_writer_under_traffic() {
    rewrites(Mode::Nftables, 500, 4);
}

/// The size, run by hand (`nice`; it takes long): 10,000 Services and
/// `$KP_REWRITES_ROUNDS` (default 100) rewrites per writer. A debug build's first sync at
/// this size wants `KP_TEST_PATIENCE_SECS=300`.
#[test]
#[ignore = "10,000 Services, 100 rewrites per writer: run by hand"]
fn rewrites_at_10k() {
    let rounds = std::env::var("KP_REWRITES_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(100);
    rewrites(Mode::Nftables, 10_000, rounds);
}
