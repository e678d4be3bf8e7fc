//! Reading a helper process's standard output line by line with a bound on each wait.

use std::io::{BufRead, BufReader, Read};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::Duration;

/// What waiting for the next line produced.
#[derive(Debug)]
pub(crate) enum Next {
    /// A line, without its newline.
    Line(String),
    /// The process closed its output (it exited).
    Ended,
    /// Nothing within the bound.
    Silent,
}

/// Lines of a pipe, read on a background thread so waits can be bounded.
#[derive(Debug)]
pub(crate) struct Lines {
    receiver: Receiver<String>,
}

impl Lines {
    /// Starts reading `pipe`; the thread ends when the pipe closes.
    pub(crate) fn spawn<R: Read + Send + 'static>(pipe: R) -> Self {
        let (sender, receiver) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Self { receiver }
    }

    /// The next line, waiting at most `wait`.
    pub(crate) fn next(&self, wait: Duration) -> Next {
        match self.receiver.recv_timeout(wait) {
            Ok(line) => Next::Line(line),
            Err(RecvTimeoutError::Disconnected) => Next::Ended,
            Err(RecvTimeoutError::Timeout) => Next::Silent,
        }
    }
}
