//! The proxy under test or benchmark, run inside a network namespace: the one way the tests,
//! the demo and the benchmark binaries start `kube-proxy`, read its log and wait for its
//! first sync.
//!
//! [`ProxyLaunch`] is the command line (`ip netns exec NS PROGRAM ARGS...`); its
//! [`ProxyLaunch::spawn`] gives a [`ProxyProcess`], whose standard error is read on a thread
//! into a log kept in memory (each line stamped with its arrival time, optionally copied to a
//! file or echoed). Waits for a log line are bounded and come in a blocking and an async
//! flavour; a proxy that exits or stays silent past the bound is an error carrying the
//! log's last lines. Dropping the process kills it, and whatever it started, by pid.
//!
//! ```no_run
//! use std::time::Duration;
//! use kp_testbed::proxy::ProxyLaunch;
//! # fn main() -> Result<(), kp_testbed::TestbedError> {
//! # let (ns, binary) = ("kpt-1-0-node", "target/debug/kube-proxy");
//! let mut proxy = ProxyLaunch::new(ns, binary)
//!     .args(["--manifests=examples/cluster", "--proxy-mode=iptables"])
//!     .spawn()?;
//! let first = proxy.wait_first_sync(Duration::from_secs(60))?;
//! println!("up after {:?}: {}", first.at - proxy.started(), first.line);
//! # Ok(())
//! # }
//! ```

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

pub use kp_core::proxier::{FIRST_SYNC_LOG, SYNCED_LOG};

use crate::command::{describe, in_namespace};
use crate::error::{Result, TestbedError};

/// How many of the proxy's last log lines an error shows: enough for the start-up and the
/// last sync, short enough to read.
pub const DEFAULT_LOG_TAIL: usize = 40;

/// How often a blocking wait looks at its interrupt check (a signal handler's flag).
const INTERRUPT_POLL: Duration = Duration::from_millis(100);

/// How long [`ProxyProcess`] waits for the exit status once the proxy closed its log.
const EXIT_STATUS_WAIT: Duration = Duration::from_secs(5);

/// How often a stopping proxy is checked for exit.
const EXIT_POLL: Duration = Duration::from_millis(20);

/// The command line of a proxy to run inside a network namespace, and what to do with its
/// log. Built with [`ProxyLaunch::new`] and the chained methods, started by
/// [`ProxyLaunch::spawn`].
#[derive(Debug)]
pub struct ProxyLaunch {
    command: Command,
    log_file: Option<PathBuf>,
    echo: Option<String>,
    stop_grace: Option<Duration>,
}

impl ProxyLaunch {
    /// `ip netns exec NS PROGRAM`; arguments follow with [`ProxyLaunch::args`].
    /// `ip netns exec` execs the program, so the child's pid is the proxy's.
    pub fn new(ns: &str, program: impl AsRef<OsStr>) -> Self {
        Self::from_command(in_namespace(ns, program))
    }

    /// `ip netns exec NS` and nothing more: the caller adds the program through
    /// [`ProxyLaunch::command_mut`] (e.g. to run it chrooted into an image).
    pub fn in_namespace(ns: &str) -> Self {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", ns]);
        Self::from_command(command)
    }

    fn from_command(command: Command) -> Self {
        Self {
            command,
            log_file: None,
            echo: None,
            stop_grace: None,
        }
    }

    /// One more argument.
    #[must_use]
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.command.arg(arg);
        self
    }

    /// More arguments.
    #[must_use]
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.command.args(args);
        self
    }

    /// An environment variable for the proxy (`ip netns exec` passes it on).
    #[must_use]
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.command.env(key, value);
        self
    }

    /// The command as built so far, for what the chained methods do not cover.
    pub fn command_mut(&mut self) -> &mut Command {
        &mut self.command
    }

    /// Also write every log line to `path` (created or truncated), e.g. to keep a
    /// benchmark's log next to its results.
    #[must_use]
    pub fn log_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.log_file = Some(path.into());
        self
    }

    /// Also print every log line on this process's standard error, after `prefix`.
    #[must_use]
    pub fn echo(mut self, prefix: impl Into<String>) -> Self {
        self.echo = Some(prefix.into());
        self
    }

    /// Stop with SIGTERM and wait up to `grace` before SIGKILL when dropped (the default is
    /// SIGKILL at once: tests and benchmarks do not need the proxy's own shutdown).
    #[must_use]
    pub fn stop_grace(mut self, grace: Duration) -> Self {
        self.stop_grace = Some(grace);
        self
    }

    /// Starts the proxy (standard input and output closed, standard error read into the
    /// log).
    pub fn spawn(mut self) -> Result<ProxyProcess> {
        let line = describe(&self.command);
        let file = match &self.log_file {
            Some(path) => {
                Some(
                    std::fs::File::create(path).map_err(|source| TestbedError::Spawn {
                        command: format!("{line} (log file {})", path.display()),
                        source,
                    })?,
                )
            }
            None => None,
        };
        self.command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let started = Instant::now();
        let mut child = self.command.spawn().map_err(|source| TestbedError::Spawn {
            command: line.clone(),
            source,
        })?;
        let log = Arc::new(Log::default());
        if let Some(stderr) = child.stderr.take() {
            let log = Arc::clone(&log);
            let echo = self.echo.take();
            std::thread::spawn(move || read_log(stderr, &log, file, echo.as_deref()));
        } else {
            log.end();
        }
        tracing::debug!(command = %line, pid = child.id(), "started the proxy");
        Ok(ProxyProcess {
            child,
            log,
            cursor: 0,
            started,
            stop_grace: self.stop_grace,
            exited: None,
        })
    }
}

/// Reads `pipe` line by line into `log` until it closes.
fn read_log(
    pipe: impl std::io::Read,
    log: &Log,
    mut file: Option<std::fs::File>,
    echo: Option<&str>,
) {
    for line in BufReader::new(pipe).lines() {
        let Ok(line) = line else { break };
        if let Some(out) = file.as_mut() {
            // A full disk only loses the copy; the log in memory is complete.
            let _ = writeln!(out, "{line}");
        }
        if let Some(prefix) = echo {
            eprintln!("{prefix}{line}");
        }
        log.push(line);
    }
    if let Some(out) = file.as_mut() {
        let _ = out.flush();
    }
    log.end();
}

/// One line of the proxy's log and when it arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// When the line was read (a benchmark's clock for "how long until").
    pub at: Instant,
    /// The line, without its newline.
    pub line: String,
}

/// What waiting for the next log line produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NextLine {
    /// A line.
    Line(LogEntry),
    /// The proxy closed its log (it exited); every line was read.
    Ended,
    /// No line before the deadline.
    Silent,
}

/// The log as read so far; shared by the reading thread and the waiters.
#[derive(Debug, Default)]
struct Log {
    state: Mutex<LogState>,
    grew: Condvar,
    notify: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct LogState {
    lines: Vec<LogEntry>,
    ended: bool,
}

impl Log {
    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn push(&self, line: String) {
        self.lock().lines.push(LogEntry {
            at: Instant::now(),
            line,
        });
        self.grew.notify_all();
        self.notify.notify_waiters();
    }

    fn end(&self) {
        self.lock().ended = true;
        self.grew.notify_all();
        self.notify.notify_waiters();
    }
}

/// A running proxy and its log; killed (after [`ProxyLaunch::stop_grace`], if set) with
/// every process it started when dropped.
///
/// Waits read the log in order from a cursor: each line is seen once by the waits, however
/// many of them there are, while [`ProxyProcess::logged`] and [`ProxyProcess::tail`] look at
/// the whole log.
#[derive(Debug)]
pub struct ProxyProcess {
    child: Child,
    log: Arc<Log>,
    cursor: usize,
    started: Instant,
    stop_grace: Option<Duration>,
    exited: Option<ExitStatus>,
}

impl ProxyProcess {
    /// The proxy's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// When the proxy was started (just before the spawn).
    pub fn started(&self) -> Instant {
        self.started
    }

    fn take_next(&mut self, state: &LogState) -> Option<NextLine> {
        if let Some(entry) = state.lines.get(self.cursor) {
            self.cursor += 1;
            Some(NextLine::Line(entry.clone()))
        } else if state.ended {
            Some(NextLine::Ended)
        } else {
            None
        }
    }

    /// The next unread log line, waiting until `deadline` at most.
    pub fn next_line(&mut self, deadline: Instant) -> NextLine {
        let log = Arc::clone(&self.log);
        let mut state = log.lock();
        loop {
            if let Some(next) = self.take_next(&state) {
                return next;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return NextLine::Silent;
            }
            state = log
                .grew
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// [`ProxyProcess::next_line`] for async callers (a benchmark that also waits for
    /// signals): the same cursor, without blocking the runtime.
    pub async fn next_line_async(&mut self, deadline: Instant) -> NextLine {
        let log = Arc::clone(&self.log);
        loop {
            let notified = log.notify.notified();
            tokio::pin!(notified);
            // Registered before looking, so a line pushed in between still wakes us.
            notified.as_mut().enable();
            if let Some(next) = self.take_next(&log.lock()) {
                return next;
            }
            let deadline = tokio::time::Instant::from_std(deadline);
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return NextLine::Silent;
            }
        }
    }

    /// Waits (at most `within`) for an unread log line `matches` accepts and returns it;
    /// `what` names it in the error when the proxy exits or the time runs out.
    pub fn wait_for(
        &mut self,
        what: &str,
        within: Duration,
        matches: impl Fn(&str) -> bool,
    ) -> Result<LogEntry> {
        self.wait_for_unless(what, within, matches, || false)
    }

    /// [`ProxyProcess::wait_for`] that also gives up with [`TestbedError::Interrupted`]
    /// once `interrupted` says so (looked at every 100 ms; e.g. a Ctrl-C flag).
    pub fn wait_for_unless(
        &mut self,
        what: &str,
        within: Duration,
        matches: impl Fn(&str) -> bool,
        interrupted: impl Fn() -> bool,
    ) -> Result<LogEntry> {
        let deadline = Instant::now() + within;
        loop {
            if interrupted() {
                return Err(TestbedError::Interrupted);
            }
            let step = deadline.min(Instant::now() + INTERRUPT_POLL);
            match self.next_line(step) {
                NextLine::Line(entry) if matches(&entry.line) => return Ok(entry),
                NextLine::Line(_) => {}
                NextLine::Ended => return Err(self.exited_error(what)),
                NextLine::Silent if Instant::now() >= deadline => {
                    return Err(TestbedError::ProxyTimedOut {
                        what: what.to_owned(),
                        after: within,
                        log: self.tail(DEFAULT_LOG_TAIL),
                    });
                }
                NextLine::Silent => {}
            }
        }
    }

    /// Waits (at most `within`) for the proxier's [`FIRST_SYNC_LOG`] line: the rules are in
    /// place. Returns the line (its fields say how many services and how long it took).
    pub fn wait_first_sync(&mut self, within: Duration) -> Result<LogEntry> {
        self.wait_first_sync_unless(within, || false)
    }

    /// [`ProxyProcess::wait_first_sync`], giving up once `interrupted` says so.
    pub fn wait_first_sync_unless(
        &mut self,
        within: Duration,
        interrupted: impl Fn() -> bool,
    ) -> Result<LogEntry> {
        self.wait_for_unless(
            "its first sync",
            within,
            |line| line.contains(FIRST_SYNC_LOG),
            interrupted,
        )
    }

    /// The error for a proxy that closed its log before what was awaited.
    fn exited_error(&mut self, what: &str) -> TestbedError {
        let status = self
            .wait_exit(EXIT_STATUS_WAIT)
            .map_or_else(|| "still running".to_owned(), |s| s.to_string());
        TestbedError::ProxyExited {
            what: what.to_owned(),
            status,
            log: self.tail(DEFAULT_LOG_TAIL),
        }
    }

    /// Skips the lines logged so far: the next wait sees only what is logged from now on.
    pub fn mark(&mut self) {
        self.cursor = self.log.lock().lines.len();
    }

    /// Every line logged so far (read or not) that `matches` accepts.
    pub fn logged(&self, matches: impl Fn(&str) -> bool) -> Vec<String> {
        let state = self.log.lock();
        state
            .lines
            .iter()
            .filter(|e| matches(&e.line))
            .map(|e| e.line.clone())
            .collect()
    }

    /// The last `lines` lines logged, joined by newlines.
    pub fn tail(&self, lines: usize) -> String {
        let state = self.log.lock();
        let start = state.lines.len().saturating_sub(lines);
        state.lines[start..]
            .iter()
            .map(|e| e.line.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The exit status, if the proxy has exited.
    pub fn try_exit_status(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    /// Waits up to `within` for the exit; `None` if the proxy still runs.
    fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.try_exit_status() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(EXIT_POLL);
        }
    }

    /// SIGTERM, then waits up to `grace` for the exit (and the last lines of its log): the
    /// proxy's own shutdown runs. Fails when the proxy is still running after that (it is
    /// then left to the drop).
    pub fn terminate(&mut self, grace: Duration) -> Result<ExitStatus> {
        if let Some(status) = self.try_exit_status() {
            return Ok(status);
        }
        let deadline = Instant::now() + grace;
        signal(self.pid(), "TERM");
        let status = self
            .wait_exit(grace)
            .ok_or_else(|| TestbedError::ProxyTimedOut {
                what: "its exit after SIGTERM".to_owned(),
                after: grace,
                log: self.tail(DEFAULT_LOG_TAIL),
            })?;
        self.wait_log_end(deadline);
        Ok(status)
    }

    /// Waits (until `deadline` at most) for the reading thread to reach the end of the log
    /// of an exited proxy, so [`ProxyProcess::logged`] holds its last lines.
    fn wait_log_end(&self, deadline: Instant) {
        let mut state = self.log.lock();
        while !state.ended {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            state = self
                .log
                .grew
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// SIGKILL for the proxy and every process it started, and waits for its exit: none of
    /// its own shutdown runs.
    pub fn kill(&mut self) {
        if self.try_exit_status().is_some() {
            return;
        }
        // Its children (a running iptables-restore) would outlive a killed proxy.
        let children = descendants(self.pid());
        let _ = self.child.kill();
        for pid in children {
            signal(pid, "KILL");
        }
        self.exited = self.child.wait().ok();
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        if let Some(grace) = self.stop_grace {
            let _ = self.terminate(grace);
        }
        self.kill();
    }
}

/// Sends `signal` (`TERM`, `KILL`) to one process by id; a process that is gone is fine.
pub fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The parent pid of `pid`, from `/proc/PID/stat`.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name in parentheses may hold spaces: the state and ppid follow its `)`.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Every live descendant of `pid` (children, their children, ...), from `/proc`.
pub fn descendants(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(Path::new("/proc")) else {
        return Vec::new();
    };
    let pairs: Vec<(u32, u32)> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| Some((p, parent_of(p)?)))
        .collect();
    let mut found = vec![pid];
    let mut i = 0;
    while let Some(&parent) = found.get(i) {
        found.extend(
            pairs
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    found.remove(0);
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A "proxy" that is a shell script, run without a namespace (`sh -c`), so the log
    /// handling is tested without root.
    fn script(text: &str) -> ProxyLaunch {
        let mut command = Command::new("sh");
        command.args(["-c", text]);
        ProxyLaunch::from_command(command)
    }

    #[test]
    fn waits_return_the_first_sync_line_and_keep_the_log() {
        let mut proxy = script(&format!(
            "echo starting >&2; echo 'I1 x.rs:1] {FIRST_SYNC_LOG} services=\"3\"' >&2; sleep 30"
        ))
        .spawn()
        .expect("sh runs");
        let first = proxy
            .wait_first_sync(Duration::from_secs(20))
            .expect("first sync line");
        assert!(first.line.ends_with("services=\"3\""), "{first:?}");
        assert!(first.at >= proxy.started());
        assert_eq!(proxy.logged(|l| l.contains("starting")).len(), 1);
        assert!(proxy.tail(1).contains(FIRST_SYNC_LOG));
        // Every line was read: the next wait sees only new ones.
        assert_eq!(
            proxy.next_line(Instant::now() + Duration::from_millis(50)),
            NextLine::Silent
        );
        proxy.kill();
        assert!(proxy.try_exit_status().is_some());
    }

    #[test]
    fn an_exit_before_the_line_is_an_error_with_the_log() {
        let mut proxy = script("echo 'cannot start: bad flag' >&2; exit 3")
            .spawn()
            .expect("sh runs");
        match proxy.wait_first_sync(Duration::from_secs(20)) {
            Err(TestbedError::ProxyExited { status, log, .. }) => {
                assert!(status.contains('3'), "{status}");
                assert!(log.contains("bad flag"), "{log}");
            }
            other => panic!("expected ProxyExited, got {other:?}"),
        }
    }

    #[test]
    fn silence_past_the_deadline_and_interrupts_end_the_wait() {
        let mut proxy = script("echo up >&2; sleep 30").spawn().expect("sh runs");
        match proxy.wait_first_sync(Duration::from_millis(300)) {
            Err(TestbedError::ProxyTimedOut { log, .. }) => assert_eq!(log, "up"),
            other => panic!("expected ProxyTimedOut, got {other:?}"),
        }
        let interrupted = proxy.wait_first_sync_unless(Duration::from_secs(20), || true);
        assert!(
            matches!(interrupted, Err(TestbedError::Interrupted)),
            "{interrupted:?}"
        );
    }

    #[test]
    fn terminate_runs_the_shutdown_and_marks_skip_old_lines() {
        let mut proxy =
            script("trap 'echo bye >&2; exit 0' TERM; echo one >&2; while :; do sleep 0.05; done")
                .spawn()
                .expect("sh runs");
        proxy
            .wait_for("one", Duration::from_secs(20), |l| l == "one")
            .expect("first line");
        proxy.mark();
        let status = proxy.terminate(Duration::from_secs(20)).expect("exits");
        assert!(status.success(), "{status}");
        let bye = proxy
            .wait_for("bye", Duration::from_secs(20), |l| l == "bye")
            .expect("the trap's line");
        assert_eq!(bye.line, "bye");
    }

    #[test]
    fn async_waits_see_the_same_lines_and_the_end() {
        let mut proxy = script("echo a >&2; echo b >&2").spawn().expect("sh runs");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let deadline = Instant::now() + Duration::from_secs(20);
        let lines = runtime.block_on(async {
            let mut lines = Vec::new();
            loop {
                match proxy.next_line_async(deadline).await {
                    NextLine::Line(entry) => lines.push(entry.line),
                    other => return (lines, other),
                }
            }
        });
        assert_eq!(
            lines,
            (vec!["a".to_owned(), "b".to_owned()], NextLine::Ended)
        );
    }

    #[test]
    fn log_file_and_descendants() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("proxy.log");
        let mut proxy = script("echo copied >&2; sleep 30 & wait")
            .log_file(&path)
            .spawn()
            .expect("sh runs");
        proxy
            .wait_for("copied", Duration::from_secs(20), |l| l == "copied")
            .expect("line");
        let deadline = Instant::now() + Duration::from_secs(20);
        while descendants(proxy.pid()).is_empty() {
            assert!(Instant::now() < deadline, "the sleep never started");
            std::thread::sleep(EXIT_POLL);
        }
        let children = descendants(proxy.pid());
        proxy.kill();
        let gone = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |s| s.contains(") Z "))
        };
        for pid in children {
            // SIGKILL is delivered asynchronously: bounded wait for it to land.
            let deadline = Instant::now() + Duration::from_secs(20);
            while !gone(pid) {
                assert!(Instant::now() < deadline, "child {pid} outlived the kill");
                std::thread::sleep(EXIT_POLL);
            }
        }
        let text = std::fs::read_to_string(&path).expect("log file");
        assert_eq!(text, "copied\n");
    }
}
