//! Running helper commands (`ip`, `iptables`, the prober) with a bound on how long they may take.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{Result, TestbedError};

/// How often a running command is checked for exit: short enough not to slow the suite,
/// long enough not to spin a shared core.
const POLL_INTERVAL: Duration = Duration::from_millis(5);

/// The bound for setup and teardown commands (`ip`, `sysctl`, `iptables`): they take
/// milliseconds, so only a wedged system reaches it.
pub(crate) const COMMAND_DEADLINE: Duration = Duration::from_secs(30);

/// What a finished command left behind.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) status: ExitStatus,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

/// The command line as text, for error messages.
pub(crate) fn describe(command: &Command) -> String {
    let mut text = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}

/// Reads a whole pipe on a thread so a chatty child never blocks on a full pipe.
fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            // A read error only truncates diagnostics; the exit status still decides.
            let _ = pipe.read_to_end(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// Kills a child this crate started and reaps it; errors mean it already exited.
pub(crate) fn kill_child(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs `command` (feeding `input` on standard input), waiting at most `deadline`.
///
/// A non-zero exit is *not* an error here; see [`run_checked`].
pub(crate) fn run(
    command: &mut Command,
    input: Option<&str>,
    deadline: Duration,
) -> Result<Finished> {
    let line = describe(command);
    tracing::debug!(command = %line, "running");
    command
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().map_err(|source| TestbedError::Spawn {
        command: line.clone(),
        source,
    })?;
    let feeder = match (input, child.stdin.take()) {
        (Some(text), Some(mut stdin)) => {
            let text = text.to_owned();
            // The child may exit without reading everything; that shows in its status.
            Some(thread::spawn(move || {
                let _ = stdin.write_all(text.as_bytes());
            }))
        }
        _ => None,
    };
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() >= deadline {
            kill_child(&mut child);
            return Err(TestbedError::CommandTimedOut {
                command: line,
                after: deadline,
            });
        }
        thread::sleep(POLL_INTERVAL);
    };
    if let Some(feeder) = feeder {
        let _ = feeder.join();
    }
    Ok(Finished {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

/// Runs `command` and fails unless it exits successfully; returns its standard output.
pub(crate) fn run_checked(
    command: &mut Command,
    input: Option<&str>,
    deadline: Duration,
) -> Result<String> {
    let finished = run(command, input, deadline)?;
    if finished.status.success() {
        Ok(finished.stdout)
    } else {
        Err(TestbedError::CommandFailed {
            command: describe(command),
            status: finished.status.to_string(),
            stderr: finished.stderr.trim().to_owned(),
        })
    }
}

/// `ip <args>` in the current (caller's) namespace; only used for `ip netns ...` management.
pub(crate) fn ip<I, S>(args: I) -> Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    run_checked(Command::new("ip").args(args), None, COMMAND_DEADLINE)
}

/// `ip -n <ns> -batch -` with one `ip` command per line, run inside `ns`.
pub(crate) fn ip_batch(ns: &str, lines: &[String]) -> Result<()> {
    let mut script = lines.join("\n");
    script.push('\n');
    run_checked(
        Command::new("ip").args(["-n", ns, "-batch", "-"]),
        Some(&script),
        COMMAND_DEADLINE,
    )
    .map(drop)
}

/// A command prefixed with `ip netns exec <ns>`, so it runs inside that namespace.
pub(crate) fn in_namespace<S: AsRef<OsStr>>(ns: &str, program: S) -> Command {
    let mut command = Command::new("ip");
    command.args(["netns", "exec", ns]).arg(program);
    command
}

/// Fails with a clear reason unless this process can build namespaces: it must be root and
/// have iproute2's `ip`.
pub(crate) fn check_prerequisites() -> Result<()> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    if let Some(euid) = effective_uid(&status)
        && euid != 0
    {
        return Err(TestbedError::NotRoot { euid });
    }
    let mut probe = Command::new("ip");
    probe.arg("-V");
    match run(&mut probe, None, COMMAND_DEADLINE) {
        Ok(done) if done.status.success() => Ok(()),
        Ok(done) => Err(TestbedError::ToolMissing {
            tool: "ip".to_owned(),
            source: std::io::Error::other(done.stderr.trim().to_owned()),
        }),
        Err(TestbedError::Spawn { source, .. }) => Err(TestbedError::ToolMissing {
            tool: "ip".to_owned(),
            source,
        }),
        Err(other) => Err(other),
    }
}

/// The effective uid from `/proc/self/status` (`Uid: real effective saved fs`).
fn effective_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|euid| euid.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_uid_is_the_second_field() {
        let status = "Name:\tx\nUid:\t1000\t0\t1000\t1000\nGid:\t1\t1\t1\t1\n";
        assert_eq!(effective_uid(status), Some(0));
        assert_eq!(effective_uid("Name:\tx\n"), None);
    }

    #[test]
    fn slow_commands_are_killed_at_the_deadline() {
        let mut sleeper = Command::new("sleep");
        sleeper.arg("30");
        let result = run(&mut sleeper, None, Duration::from_millis(50));
        assert!(
            matches!(result, Err(TestbedError::CommandTimedOut { .. })),
            "{result:?}"
        );
    }

    #[test]
    fn input_reaches_the_command_and_failures_carry_stderr() {
        let mut cat = Command::new("cat");
        let out = run_checked(&mut cat, Some("hello"), COMMAND_DEADLINE).expect("cat runs");
        assert_eq!(out, "hello");
        let mut failing = Command::new("sh");
        failing.args(["-c", "echo oops >&2; exit 3"]);
        match run_checked(&mut failing, None, COMMAND_DEADLINE) {
            Err(TestbedError::CommandFailed { stderr, .. }) => assert_eq!(stderr, "oops"),
            other => panic!("expected CommandFailed, got {other:?}"),
        }
    }
}
