//! The socket load balancer's slow work, on a thread of its own so no sync waits for it
//! (docs/socket-lb.md, "Off the sync thread"): the destroy pass over every network namespace
//! (each pass again [`SECOND_PASS`] later, for sockets whose connect straddled the first),
//! the read-back of the maps for the thorough entry check, and restoring pins when a pass
//! holds the programs.

use std::net::SocketAddr;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kp_core::report::ErrorChain as _;
use kp_socklb::table::Epoch;
use kp_socklb::{DestroyError, Held, KernelMaps, ServiceKey, SocketPrograms};

use super::{SocketLbMetrics, repair_programs};

/// How long after a pass the same pairs are walked again: a connect whose program picked a
/// removed endpoint just before the map write, and that set the socket's peer only after the
/// first walk passed it, is caught by the second.
pub(super) const SECOND_PASS: Duration = Duration::from_secs(1);

/// A removed (Service port, endpoint) pair.
type Pair = (ServiceKey, SocketAddr);

/// What the sync thread hands over.
#[derive(Debug)]
pub(super) enum Job {
    /// Destroy the translated sockets connected to these pairs' endpoints.
    Destroy(Vec<Pair>),
    /// Read the maps back; the answer comes on the results channel.
    ReadBack(Epoch),
    /// Restore missing pins (a full sync found the programs busy with a pass).
    Repair,
}

/// The thread and its channels.
#[derive(Debug)]
pub(super) struct Worker {
    jobs: Option<Sender<Job>>,
    results: Receiver<(Epoch, Vec<Held>)>,
    thread: Option<JoinHandle<()>>,
}

/// What the thread owns.
struct Thread {
    programs: Arc<Mutex<SocketPrograms>>,
    reader: KernelMaps,
    metrics: SocketLbMetrics,
    results: Sender<(Epoch, Vec<Held>)>,
    /// Pairs to walk again, each with when (every pass walks them all: a pass costs per
    /// namespace, not per pair).
    again: Vec<(Pair, Instant)>,
}

impl Worker {
    /// Starts the thread; `reader` is a second handle on the maps
    /// ([`SocketPrograms::map_reader`]).
    pub(super) fn start(
        programs: Arc<Mutex<SocketPrograms>>,
        reader: KernelMaps,
        metrics: SocketLbMetrics,
    ) -> std::io::Result<Self> {
        let (jobs, inbox) = mpsc::channel();
        let (results, outbox) = mpsc::channel();
        let thread = Thread {
            programs,
            reader,
            metrics,
            results,
            again: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("socket-lb".into())
            .spawn(move || thread.run(&inbox))?;
        Ok(Self {
            jobs: Some(jobs),
            results: outbox,
            thread: Some(thread),
        })
    }

    /// Hands `job` over (a thread that ended, which only a panic does, drops it).
    pub(super) fn send(&self, job: Job) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
    }

    /// A finished read-back, if one is waiting.
    pub(super) fn read_back(&self) -> Option<(Epoch, Vec<Held>)> {
        self.results.try_recv().ok()
    }
}

impl Drop for Worker {
    /// Lets the thread finish its job, then waits for it (it holds the programs).
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Thread {
    fn run(mut self, inbox: &Receiver<Job>) {
        loop {
            let due = self.again.iter().map(|&(_, due)| due).min();
            let job = match due {
                None => inbox.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(due) => inbox.recv_timeout(due.saturating_duration_since(Instant::now())),
            };
            match job {
                Ok(job) => self.handle(job, inbox),
                Err(RecvTimeoutError::Timeout) => self.destroy_with_again(Vec::new()),
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn handle(&mut self, job: Job, inbox: &Receiver<Job>) {
        match job {
            Job::Destroy(mut pairs) => {
                // Syncs in a burst: one pass for all they removed.
                let mut later = Vec::new();
                while let Ok(next) = inbox.try_recv() {
                    match next {
                        Job::Destroy(more) => pairs.extend(more),
                        other => later.push(other),
                    }
                }
                self.destroy_with_again(pairs);
                for job in later {
                    self.handle(job, inbox);
                }
            }
            Job::ReadBack(epoch) => {
                let (held, _) = self.reader.read_back();
                let _ = self.results.send((epoch, held));
            }
            Job::Repair => repair_programs(&mut lock(&self.programs), &self.metrics),
        }
    }

    /// One pass for `fresh` and every pair waiting for its second; the pairs whose second
    /// pass this was are done, `fresh` waits for its own.
    fn destroy_with_again(&mut self, fresh: Vec<Pair>) {
        let now = Instant::now();
        let mut pairs: Vec<Pair> = self.again.iter().map(|&(pair, _)| pair).collect();
        pairs.extend(&fresh);
        pairs.sort_unstable();
        pairs.dedup();
        self.destroy(&pairs);
        self.again.retain(|&(_, due)| due > now);
        let due = Instant::now() + SECOND_PASS;
        self.again.extend(fresh.into_iter().map(|pair| (pair, due)));
    }

    /// One pass for `pairs`, logged.
    fn destroy(&self, pairs: &[Pair]) {
        if pairs.is_empty() {
            return;
        }
        let report = lock(&self.programs).destroy_sockets(pairs);
        match report {
            // Info when sockets went (the event an operator may look for), debug otherwise.
            Ok(report) if report.destroyed > 0 => tracing::info!(
                pairs = pairs.len(),
                namespaces = report.namespaces,
                skipped = report.skipped,
                destroyed = report.destroyed,
                "Socket load balancer destroyed sockets of removed endpoints"
            ),
            Ok(report) => tracing::debug!(
                pairs = pairs.len(),
                namespaces = report.namespaces,
                skipped = report.skipped,
                "Socket load balancer found no socket of the removed endpoints"
            ),
            // Said once at start; UDP is left to nftables mode there.
            Err(DestroyError::Unavailable) => {}
            Err(error) => tracing::warn!(
                error = %error.chain(),
                "Cannot destroy sockets connected to removed endpoints; they keep their \
                 endpoint until they close"
            ),
        }
    }
}

/// The programs, locked (a panic while they were held leaves them as they were: usable).
fn lock(programs: &Mutex<SocketPrograms>) -> MutexGuard<'_, SocketPrograms> {
    programs.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The programs unless a destroy pass holds them (poisoned: usable, as with [`lock`]).
pub(super) fn try_lock(programs: &Mutex<SocketPrograms>) -> Option<MutexGuard<'_, SocketPrograms>> {
    match programs.try_lock() {
        Ok(programs) => Some(programs),
        Err(TryLockError::Poisoned(programs)) => Some(programs.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}
