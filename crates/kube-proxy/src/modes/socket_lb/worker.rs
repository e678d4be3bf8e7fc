//! The socket load balancer's slow work, on a thread of its own so no sync waits for it
//! (docs/socket-lb.md, "Off the sync thread"): the destroy pass over every network namespace
//! (each pass again [`SECOND_PASS`] later, for sockets whose connect straddled the first),
//! the read-back of the maps for the thorough entry check, and restoring pins when a pass
//! holds the programs.

use std::net::SocketAddr;
use std::panic::{self, AssertUnwindSafe};
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

/// A read-back begun at its epoch: what the maps held, or `None` when reading them failed
/// (a panic, logged; the next thorough check starts another).
pub(super) type ReadBack = (Epoch, Option<Vec<Held>>);

/// What the thread does with the programs: the kernel's in the proxy ([`KernelWork`]), a
/// fake in the tests of the thread's scheduling.
pub(super) trait Work: Send + 'static {
    /// One destroy pass for `pairs` (never empty).
    fn destroy(&mut self, pairs: &[Pair]);
    /// What the maps hold.
    fn read_back(&mut self) -> Vec<Held>;
    /// Restores missing pins.
    fn repair(&mut self);
}

/// The thread and its channels.
#[derive(Debug)]
pub(super) struct Worker {
    jobs: Option<Sender<Job>>,
    results: Receiver<ReadBack>,
    thread: Option<JoinHandle<()>>,
}

/// What the thread owns.
struct Thread<W> {
    work: W,
    results: Sender<ReadBack>,
    /// Pairs to walk again, each with when (every pass walks them all: a pass costs per
    /// namespace, not per pair).
    again: Vec<(Pair, Instant)>,
    /// [`SECOND_PASS`] (longer in tests, which must not depend on a loaded machine's
    /// scheduling within a second).
    again_after: Duration,
}

impl Worker {
    /// Starts the thread doing `work`.
    pub(super) fn start(work: impl Work) -> std::io::Result<Self> {
        Self::start_with(work, SECOND_PASS)
    }

    /// As [`Self::start`], each pass walked again `again_after` later.
    fn start_with(work: impl Work, again_after: Duration) -> std::io::Result<Self> {
        let (jobs, inbox) = mpsc::channel();
        let (results, outbox) = mpsc::channel();
        let thread = Thread {
            work,
            results,
            again: Vec::new(),
            again_after,
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

    /// Hands `job` over.
    pub(super) fn send(&self, job: Job) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
    }

    /// A finished read-back, if one is waiting.
    pub(super) fn read_back(&self) -> Option<ReadBack> {
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

impl<W: Work> Thread<W> {
    fn run(mut self, inbox: &Receiver<Job>) {
        loop {
            let due = self.again.iter().map(|&(_, due)| due).min();
            let job = match due {
                None => inbox.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(due) => inbox.recv_timeout(due.saturating_duration_since(Instant::now())),
            };
            match job {
                Ok(job) => self.guarded(|thread| thread.handle(job, inbox)),
                Err(RecvTimeoutError::Timeout) => {
                    self.guarded(|thread| thread.destroy_with_again(Vec::new()));
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// Runs `job`; a panic in it (a bug) is logged and the thread goes on with the next job,
    /// so one bad pass does not end the entry check and the destroy passes for good.
    fn guarded(&mut self, job: impl FnOnce(&mut Self)) {
        if panic::catch_unwind(AssertUnwindSafe(|| job(self))).is_err() {
            tracing::error!(
                "The socket load balancer's worker failed a job (a bug; its panic is printed \
                 above); it goes on with the next one"
            );
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
                // Answered even when it fails: the sync thread waits for an answer before
                // it asks again.
                let held = panic::catch_unwind(AssertUnwindSafe(|| self.work.read_back()));
                let _ = self.results.send((epoch, held.ok()));
            }
            Job::Repair => self.work.repair(),
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
        self.again.retain(|&(_, due)| due > now);
        let due = Instant::now() + self.again_after;
        self.again.extend(fresh.into_iter().map(|pair| (pair, due)));
        if !pairs.is_empty() {
            self.work.destroy(&pairs);
        }
    }
}

/// The kernel's programs and a second handle on their maps
/// ([`SocketPrograms::map_reader`]).
pub(super) struct KernelWork {
    pub(super) programs: Arc<Mutex<SocketPrograms>>,
    pub(super) reader: KernelMaps,
    pub(super) metrics: SocketLbMetrics,
}

impl Work for KernelWork {
    /// One pass, logged.
    fn destroy(&mut self, pairs: &[Pair]) {
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

    fn read_back(&mut self) -> Vec<Held> {
        self.reader.read_back().0
    }

    fn repair(&mut self) {
        repair_programs(&mut lock(&self.programs), &self.metrics);
    }
}

/// The programs, locked (a panic while they were held leaves them as they were: usable).
fn lock<T>(programs: &Mutex<T>) -> MutexGuard<'_, T> {
    programs.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The programs unless a destroy pass holds them (poisoned: usable, as with [`lock`]).
pub(super) fn try_lock<T>(programs: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match programs.try_lock() {
        Ok(programs) => Some(programs),
        Err(TryLockError::Poisoned(programs)) => Some(programs.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kp_socklb::table::ServiceTable;
    use std::net::{IpAddr, Ipv4Addr};

    /// A pass: when, and the pairs it walked.
    type Pass = (Instant, Vec<Pair>);

    /// Records each pass; its first destroy and first read-back panic when told to.
    #[derive(Clone, Default)]
    struct Fake {
        passes: Arc<Mutex<Vec<Pass>>>,
        panics: Arc<Mutex<u32>>,
    }

    impl Fake {
        fn panicking(times: u32) -> Self {
            let fake = Self::default();
            *lock(&fake.panics) = times;
            fake
        }

        fn should_panic(&self) -> bool {
            let mut panics = lock(&self.panics);
            let panic = *panics > 0;
            *panics = panics.saturating_sub(1);
            panic
        }

        /// The passes so far, once there are `count` (or after ten seconds).
        fn passes(&self, count: usize) -> Vec<Pass> {
            let until = Instant::now() + Duration::from_secs(10);
            while lock(&self.passes).len() < count && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            lock(&self.passes).clone()
        }
    }

    impl Work for Fake {
        fn destroy(&mut self, pairs: &[Pair]) {
            assert!(!self.should_panic(), "a destroy pass failed");
            lock(&self.passes).push((Instant::now(), pairs.to_vec()));
        }

        fn read_back(&mut self) -> Vec<Held> {
            assert!(!self.should_panic(), "a read-back failed");
            Vec::new()
        }

        fn repair(&mut self) {}
    }

    fn pair(last: u8) -> Pair {
        let service = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, last)), 53);
        let endpoint = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)), 53);
        (
            ServiceKey::new(service, kp_core::model::Protocol::Udp),
            endpoint,
        )
    }

    fn answer(worker: &Worker) -> Option<ReadBack> {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Some(answer) = worker.read_back() {
                return Some(answer);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    #[test]
    fn each_pass_is_walked_again_a_second_later_and_then_no_more() {
        let fake = Fake::default();
        let worker = Worker::start(fake.clone()).expect("thread");
        worker.send(Job::Destroy(vec![pair(1)]));
        let passes = fake.passes(2);
        assert_eq!(passes.len(), 2, "{passes:?}");
        assert_eq!(passes[0].1, vec![pair(1)]);
        assert_eq!(
            passes[1].1,
            vec![pair(1)],
            "the second pass walks the same pairs"
        );
        assert!(passes[1].0 - passes[0].0 >= SECOND_PASS);
        std::thread::sleep(SECOND_PASS + Duration::from_millis(300));
        assert_eq!(
            lock(&fake.passes).len(),
            2,
            "a pair is walked twice, not more"
        );
    }

    #[test]
    fn pairs_waiting_for_their_second_pass_join_every_pass_until_it() {
        let fake = Fake::default();
        // Long enough that pair(2) is sent before pair(1)'s second pass however loaded.
        let again_after = Duration::from_secs(3);
        let worker = Worker::start_with(fake.clone(), again_after).expect("thread");
        worker.send(Job::Destroy(vec![pair(1)]));
        fake.passes(1);
        worker.send(Job::Destroy(vec![pair(2)]));
        let walked: Vec<Vec<Pair>> = fake.passes(4).into_iter().map(|(_, p)| p).collect();
        let both = vec![pair(1), pair(2)];
        // pair(2)'s pass, pair(1)'s second (pair(2) still waiting), pair(2)'s second.
        assert_eq!(walked, [vec![pair(1)], both.clone(), both, vec![pair(2)]]);
        std::thread::sleep(again_after + Duration::from_millis(300));
        assert_eq!(lock(&fake.passes).len(), 4);
    }

    #[test]
    fn a_failed_job_is_answered_and_the_worker_goes_on() {
        let fake = Fake::panicking(1);
        let worker = Worker::start(fake.clone()).expect("thread");
        let mut table = ServiceTable::default();
        let first = table.watch();
        worker.send(Job::ReadBack(first));
        assert_eq!(
            answer(&worker),
            Some((first, None)),
            "a failed read-back says so"
        );
        let second = table.watch();
        worker.send(Job::ReadBack(second));
        assert_eq!(answer(&worker), Some((second, Some(Vec::new()))));

        let fake = Fake::panicking(1);
        let worker = Worker::start(fake.clone()).expect("thread");
        worker.send(Job::Destroy(vec![pair(1)]));
        // The failed pass still scheduled its second: the pair is walked then.
        let passes = fake.passes(1);
        assert_eq!(passes.first().map(|p| p.1.clone()), Some(vec![pair(1)]));
    }

    #[test]
    fn try_lock_gives_way_only_to_a_holder() {
        let programs = Arc::new(Mutex::new(0u32));
        let held = lock(&programs);
        std::thread::scope(|scope| {
            let busy = scope.spawn(|| try_lock(&programs).is_none());
            assert!(busy.join().expect("thread"), "busy while a pass holds them");
        });
        drop(held);
        let poisoner = programs.clone();
        let _ = std::thread::spawn(move || {
            let _guard = lock(&poisoner);
            panic!("a pass failed holding the programs");
        })
        .join();
        assert!(programs.is_poisoned());
        assert!(try_lock(&programs).is_some(), "a poisoned lock is usable");
    }
}
