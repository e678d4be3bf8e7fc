//! Blocking sections inside async backends: a restore fed while it renders, a netlink
//! transaction sent and acknowledged, a table read back. They borrow what they work on (a
//! render, a transaction of up to a few hundred MB), so they run on the calling thread
//! instead of being copied into a `spawn_blocking` task.

/// Runs `f`, a blocking section (up to seconds on a large table), without stalling the
/// runtime's other tasks: on a multi-threaded runtime the worker hands them away first
/// (`block_in_place`); elsewhere (a current-thread runtime in tests, no runtime) it just
/// blocks.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|handle| handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi_thread {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::blocking;

    #[test]
    fn a_current_thread_runtime_just_blocks() {
        assert_eq!(blocking(|| 1), 1);
        let current = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        // `block_in_place` would panic here.
        assert_eq!(current.block_on(async { blocking(|| 2) }), 2);
    }

    #[test]
    fn a_multi_thread_worker_hands_its_other_tasks_away() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .expect("runtime");
        // The one worker blocks until a task it spawned from the section has run: only when
        // the worker's tasks were handed away first.
        let ran = runtime.block_on(async {
            tokio::spawn(async {
                blocking(|| {
                    let (tx, rx) = std::sync::mpsc::channel();
                    tokio::spawn(async move { tx.send(()) });
                    rx.recv_timeout(Duration::from_secs(10)).is_ok()
                })
            })
            .await
            .expect("the task")
        });
        assert!(ran, "the spawned task never ran while the section blocked");
    }
}
