//! A long-lived TCP connection from inside a namespace (`kp-echo session`), to check that
//! established flows survive proxy restarts and rule resyncs.

use std::io::Write;
use std::process::{Child, ChildStdin};
use std::time::Duration;

use crate::command::kill_child;
use crate::error::{Result, TestbedError};
use crate::lines::{Lines, Next};
use crate::outcome::Outcome;

/// An open TCP connection held by a helper process inside the client's namespace.
///
/// Each [`Session::send`] writes one line on the *same* connection and returns how the
/// echo server's reply came back. Dropping it closes the connection and ends the helper.
#[derive(Debug)]
pub struct Session {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines,
    greeting: Outcome,
    wait: Duration,
}

/// Parses one line of prober output.
pub(crate) fn parse_outcome(line: &str) -> Result<Outcome> {
    serde_json::from_str(line).map_err(|e| TestbedError::ProbeOutput {
        output: line.to_owned(),
        detail: e.to_string(),
    })
}

impl Session {
    /// Takes over a started `kp-echo session` process and waits (at most `wait`) for the
    /// outcome of its connection attempt.
    pub(crate) fn open(mut child: Child, wait: Duration) -> Result<Self> {
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            kill_child(&mut child);
            return Err(TestbedError::SessionEnded {
                detail: "helper started without pipes".to_owned(),
            });
        };
        let mut session = Self {
            child,
            stdin: Some(stdin),
            lines: Lines::spawn(stdout),
            greeting: Outcome::TimedOut,
            wait,
        };
        session.greeting = session.read_outcome()?;
        Ok(session)
    }

    /// How the connection attempt ended: `Answered` by the pod's greeting when it is open,
    /// otherwise why not (then [`Session::send`] fails with [`TestbedError::SessionEnded`]).
    pub fn greeting(&self) -> &Outcome {
        &self.greeting
    }

    /// Sends `line` on the connection and returns how the reply came back (`Answered` with
    /// the same pod when the connection survived, `Closed` or `TimedOut` when it did not).
    pub fn send(&mut self, line: &str) -> Result<Outcome> {
        if line.is_empty() || line.contains(['\n', '\r']) {
            return Err(TestbedError::InvalidLine {
                line: line.to_owned(),
            });
        }
        let Some(stdin) = self.stdin.as_mut() else {
            return Err(TestbedError::SessionEnded {
                detail: "an earlier write failed".to_owned(),
            });
        };
        if let Err(error) = writeln!(stdin, "{line}").and_then(|()| stdin.flush()) {
            self.stdin = None;
            return Err(TestbedError::SessionEnded {
                detail: format!("{error} (greeting was {:?})", self.greeting),
            });
        }
        self.read_outcome()
    }

    fn read_outcome(&mut self) -> Result<Outcome> {
        match self.lines.next(self.wait) {
            Next::Line(line) => parse_outcome(&line),
            Next::Ended => Err(TestbedError::SessionEnded {
                detail: format!("helper exited (greeting was {:?})", self.greeting),
            }),
            Next::Silent => Err(TestbedError::SessionEnded {
                detail: format!("helper silent for {:?}", self.wait),
            }),
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}
