//! Running host commands with their failure turned into [`VmError::Command`].

use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::error::VmError;

/// Runs `program args` (in `cwd` if given) and returns its stdout, failing on a non-zero exit.
pub fn run(program: &str, args: &[&str], cwd: Option<&Path>) -> Result<Vec<u8>, VmError> {
    let output = output(program, args, cwd)?;
    if output.status.success() {
        Ok(output.stdout)
    } else {
        Err(VmError::Command {
            command: command_line(program, args),
            message: format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        })
    }
}

/// Runs `program args` and returns its full output whatever the exit status.
pub fn output(program: &str, args: &[&str], cwd: Option<&Path>) -> Result<Output, VmError> {
    let mut command = Command::new(program);
    command.args(args).stdin(Stdio::null());
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    command.output().map_err(|e| VmError::Command {
        command: command_line(program, args),
        message: e.to_string(),
    })
}

fn command_line(program: &str, args: &[&str]) -> String {
    std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ")
}
