//! Why a VM could not run a program. Every variant says what to do about it: the suites that
//! use the VM turn these into test failures, never into skips.

use std::path::PathBuf;

/// Why [`crate::Vm::run`] failed before the program's own exit status was known.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// Host tools the runner needs are not installed.
    #[error(
        "the test VM needs {tools}; install them with `apt-get install -y --no-install-recommends {packages}` (./setup.sh --tests, part of README's test command, does)"
    )]
    Missing {
        /// The missing commands or files.
        tools: String,
        /// The Debian packages that provide them.
        packages: String,
    },
    /// Debian's kernel package could not be found or downloaded.
    #[error("cannot get Debian's kernel package: {0}")]
    Kernel(String),
    /// A host command the runner uses failed.
    #[error("`{command}` failed: {message}")]
    Command {
        /// The command line.
        command: String,
        /// Its stderr or the spawn error.
        message: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },
    /// A program for the guest needs a library that the host lacks.
    #[error("`{program}` needs libraries that are not installed: {ldd}")]
    Libraries {
        /// The program.
        program: PathBuf,
        /// `ldd`'s report.
        ldd: String,
    },
    /// The VM did not report an exit status: it crashed, or init failed. The console log
    /// (the kernel's and init's messages) says why.
    #[error("the VM ended without reporting an exit status ({qemu}); console:\n{console}")]
    NoStatus {
        /// QEMU's exit status and stderr.
        qemu: String,
        /// The guest's serial console.
        console: String,
    },
    /// The VM ran longer than its timeout and was killed.
    #[error("the VM was killed after {seconds} s (KP_VM_TIMEOUT); console:\n{console}")]
    Timeout {
        /// The timeout.
        seconds: u64,
        /// The guest's serial console.
        console: String,
    },
}

impl VmError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}
