//! Running one program: with its input written whole (async, [`run_program`]) or fed as it
//! is produced (blocking, [`stream_program`]), and [`ExecError`], why it failed, with its
//! exit code or signal and a bounded part of its standard error.

use std::io::{Read as _, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

/// Keep at most this much of a tool's stderr in an error: `iptables-restore` names the
/// failing line in its first lines, and an unbounded message would bloat logs.
pub(super) const MAX_STDERR_BYTES: usize = 4096;

/// Why running an iptables tool failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The program could not be started: missing binary, wrong path, no permission.
    #[error("cannot run {program}")]
    Spawn {
        /// The program.
        program: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The program ran and exited unsuccessfully.
    #[error("{program} failed (exit code {}): {stderr}", code.map_or("none".to_owned(), |c| c.to_string()))]
    Failed {
        /// The program.
        program: String,
        /// Its exit code (`None` if a signal killed it).
        code: Option<i32>,
        /// Its standard error, trimmed and cut to a few KiB.
        stderr: String,
    },
    /// Feeding the input or collecting the output failed although the program succeeded.
    #[error("talking to {program} failed")]
    Io {
        /// The program.
        program: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl ExecError {
    /// The program that failed.
    pub fn program(&self) -> &str {
        match self {
            ExecError::Spawn { program, .. }
            | ExecError::Failed { program, .. }
            | ExecError::Io { program, .. } => program,
        }
    }

    /// The exit code, if the program ran and failed.
    pub fn exit_code(&self) -> Option<i32> {
        match self {
            ExecError::Failed { code, .. } => *code,
            _ => None,
        }
    }
}

/// Runs `program args`, feeding `input` on stdin, and returns its stdout.
pub(crate) async fn run_program(
    program: &PathBuf,
    args: &[String],
    input: Option<&str>,
) -> Result<String, ExecError> {
    let name = program.display().to_string();
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A cancelled sync must not leave a restore running behind the next one. Killing a
        // restore is safe: it commits atomically or not at all.
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| ExecError::Spawn {
            program: name.clone(),
            source,
        })?;
    let stdin = child.stdin.take();
    // Write and wait concurrently: the tool may fill its stderr pipe before reading all input.
    let write = async {
        match (stdin, input) {
            (Some(mut stdin), Some(input)) => {
                let result = stdin.write_all(input.as_bytes()).await;
                drop(stdin);
                result
            }
            _ => Ok(()),
        }
    };
    let (written, output) = tokio::join!(write, child.wait_with_output());
    let output = output.map_err(|source| ExecError::Io {
        program: name.clone(),
        source,
    })?;
    if !output.status.success() {
        // A failed write (broken pipe) is a consequence of the tool exiting; its stderr says why.
        return Err(failed(name, output.status, &output.stderr));
    }
    written.map_err(|source| ExecError::Io {
        program: name,
        source,
    })?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs `program args` with `feed` writing its standard input as it goes (blocking), and
/// checks its exit status; standard output is discarded. If `feed` fails for another reason
/// than the program closing its input, the program is killed before it sees the end of
/// the input, so a truncated input is never applied.
pub(super) fn stream_program<F>(program: &Path, args: &[String], feed: F) -> Result<(), ExecError>
where
    F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
{
    let name = program.display().to_string();
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ExecError::Spawn {
            program: name.clone(),
            source,
        })?;
    // Drained on a thread of its own: the tool may fill its stderr pipe before it reads all
    // of its input.
    let stderr = child.stderr.take();
    let drain = std::thread::spawn(move || {
        let mut text = Vec::new();
        if let Some(mut stderr) = stderr {
            // Whatever could be read is the message.
            let _ = stderr.read_to_end(&mut text);
        }
        text
    });
    let mut stdin = child.stdin.take();
    let fed = match stdin.as_mut() {
        Some(stdin) => feed(stdin),
        None => Ok(()),
    };
    let killed = match &fed {
        Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => {
            // Already exited if this fails; either way it must not commit what it got.
            let _ = child.kill();
            true
        }
        _ => false,
    };
    // Closing its input only now: a killed tool never sees the end of it.
    drop(stdin);
    let status = child.wait();
    let stderr = drain.join().unwrap_or_default();
    let status = status.map_err(|source| ExecError::Io {
        program: name.clone(),
        source,
    })?;
    if !status.success() && !killed {
        // A failed write (broken pipe) is a consequence of the tool exiting; its stderr says why.
        return Err(failed(name, status, &stderr));
    }
    fed.map_err(|source| ExecError::Io {
        program: name,
        source,
    })
}

/// The failure of `program`, which exited with `status` and wrote `stderr`. A tool killed
/// by a signal (nft 1.0.x segfaulting on another table's set, kubernetes#136786) prints
/// nothing itself, so the signal is named where its message would be.
pub(crate) fn failed(
    program: String,
    status: std::process::ExitStatus,
    stderr: &[u8],
) -> ExecError {
    use std::os::unix::process::ExitStatusExt as _;
    let mut stderr = trimmed(stderr);
    if let Some(signal) = status.signal() {
        let sep = if stderr.is_empty() { "" } else { "; " };
        stderr = format!("{stderr}{sep}killed by signal {signal}");
    }
    ExecError::Failed {
        program,
        code: status.code(),
        stderr,
    }
}

/// Standard error as one readable string of bounded size.
pub(super) fn trimmed(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let text = text.trim();
    if text.len() <= MAX_STDERR_BYTES {
        return text.to_owned();
    }
    let mut end = MAX_STDERR_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}
