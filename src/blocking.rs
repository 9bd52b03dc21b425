//! Pure CPU work of the async adapters, run on tokio's blocking pool.
//!
//! The NATS roles share a few async workers (two on a two-core machine)
//! with the lease renewals, the NATS client's connection and every other
//! task. Work that does not await and can take long (writing a
//! deterministic summary, cutting a big prompt's sources to excerpts,
//! token count by token count) must not run on them: it once held both
//! workers for 1.6 s while four summarizer jobs ran, the renewals stalled,
//! and a `serve` lost every partition it held in the middle of a burst.
//!
//! A task that has the runtime to itself and waits on each piece of such
//! work anyway (the CLI's `run`: one fold, one draft at a time) runs it
//! where it awaits it instead ([`inline_within`]): the hand-off to the pool
//! and back, and the copy of the work's input it needs, cost more than
//! they free (measured for `run` in `docs/notes/issue-26.md`).

use std::future::Future;

tokio::task_local! {
    /// Set within [`inline_within`]: this task's blocking work runs inline.
    static INLINE: ();
}

/// Runs `task` with the work it hands to [`run`] done in place, on the
/// thread that polls it. Only for a task that is the only one its runtime
/// runs, and waits on that work anyway: tasks it spawns do not inherit
/// the choice (a task-local), so their work goes to the pool as before.
pub async fn inline_within<F: Future>(task: F) -> F::Output {
    INLINE.scope((), task).await
}

/// Whether this task's blocking work runs in place ([`inline_within`]).
fn inline() -> bool {
    INLINE.try_with(|_| ()).is_ok()
}

/// Runs `work` on the blocking pool and waits for it. A panic in it is a
/// bug and is resumed here, as if it had run inline. `None` only when the
/// runtime shut down before the pool started it.
pub async fn run<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    if inline() {
        return Some(work());
    }
    match tokio::task::spawn_blocking(work).await {
        Ok(done) => Some(done),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}

/// `work` over `input` as [`run`] runs it: on the pool over a copy of
/// `input`, or in place over `input` itself, where no copy is needed
/// ([`inline_within`]). A runtime shutting down leaves the work to this
/// thread, so there is always an answer.
pub async fn run_over<I, T>(input: &I, work: fn(&I) -> T) -> T
where
    I: Clone + Send + 'static,
    T: Send + 'static,
{
    if inline() {
        return work(input);
    }
    let owned = input.clone();
    match run(move || work(&owned)).await {
        Some(done) => done,
        None => work(input),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn runs_off_the_calling_thread_even_on_a_current_thread_runtime() {
        let caller = std::thread::current().id();
        let ran_on = run(|| std::thread::current().id()).await;
        assert!(ran_on.is_some_and(|t| t != caller));
    }

    #[tokio::test]
    #[should_panic(expected = "a bug")]
    async fn a_panic_in_the_work_is_resumed() {
        let _ = run(|| -> u8 { panic!("a bug") }).await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn within_an_inline_task_work_runs_on_its_thread_but_not_in_tasks_it_spawns() {
        let caller = std::thread::current().id();
        let (inline, spawned) = inline_within(async {
            let inline = run(|| std::thread::current().id()).await;
            let spawned = tokio::spawn(async { run(|| std::thread::current().id()).await })
                .await
                .unwrap();
            (inline, spawned)
        })
        .await;
        assert_eq!(inline, Some(caller));
        assert!(spawned.is_some_and(|t| t != caller));
        assert!(inline_within(async { super::inline() }).await);
        assert!(!super::inline());
        // And after the scope, off the thread again.
        let after = run(|| std::thread::current().id()).await;
        assert!(after.is_some_and(|t| t != caller));
    }

    /// Counts its copies.
    struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Clone for Counted {
        fn clone(&self) -> Self {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Counted(std::sync::Arc::clone(&self.0))
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn work_over_an_input_copies_it_only_for_the_pool() {
        let input = Counted(Default::default());
        let copies = || input.0.load(std::sync::atomic::Ordering::SeqCst);
        let thread = |_: &Counted| std::thread::current().id();
        let caller = std::thread::current().id();
        assert_eq!(inline_within(run_over(&input, thread)).await, caller);
        assert_eq!(copies(), 0);
        assert_ne!(run_over(&input, thread).await, caller);
        assert_eq!(copies(), 1);
    }

    #[tokio::test]
    #[should_panic(expected = "a bug")]
    async fn a_panic_in_inline_work_is_a_panic() {
        let _ = inline_within(run(|| -> u8 { panic!("a bug") })).await;
    }
}
