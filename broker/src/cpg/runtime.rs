//! The async runtime openraft runs on: tokio, with one change — the random numbers (election
//! timeouts) come from a per-thread generator that a simulation can seed, so that a failing
//! seed replays the exact same run.

use std::cell::RefCell;
use std::future::Future;
use std::time::Duration;

use openraft::async_runtime::TokioOneShotSender;
use openraft::{AsyncRuntime, OptionalSend, TokioInstant};
use rand08::rngs::StdRng;
use rand08::{RngCore, SeedableRng};

thread_local! {
    static THREAD_RNG: RefCell<Option<StdRng>> = const { RefCell::new(None) };
}

/// Makes every random choice on this thread (openraft's and CPG's) follow `seed`. Only the
/// deterministic simulation calls it; elsewhere the generator is seeded from the OS.
pub fn seed_thread_rng(seed: u64) {
    THREAD_RNG.with(|r| *r.borrow_mut() = Some(StdRng::seed_from_u64(seed)));
}

/// Handle to this thread's generator (see [`seed_thread_rng`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpgRng;

impl CpgRng {
    fn with<T>(f: impl FnOnce(&mut StdRng) -> T) -> T {
        THREAD_RNG.with(|r| {
            let mut slot = r.borrow_mut();
            let rng = slot.get_or_insert_with(StdRng::from_entropy);
            f(rng)
        })
    }
}

impl RngCore for CpgRng {
    fn next_u32(&mut self) -> u32 {
        Self::with(|r| r.next_u32())
    }
    fn next_u64(&mut self) -> u64 {
        Self::with(|r| r.next_u64())
    }
    fn fill_bytes(&mut self, dest: &mut [u8]) {
        Self::with(|r| r.fill_bytes(dest))
    }
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand08::Error> {
        Self::with(|r| r.try_fill_bytes(dest))
    }
}

/// openraft's tokio runtime with [`CpgRng`] as its random source.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CpgRuntime;

impl AsyncRuntime for CpgRuntime {
    type JoinError = tokio::task::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = tokio::task::JoinHandle<T>;
    type Sleep = tokio::time::Sleep;
    type Instant = TokioInstant;
    type TimeoutError = tokio::time::error::Elapsed;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = tokio::time::Timeout<T>;
    type ThreadLocalRng = CpgRng;
    type OneshotSender<T: OptionalSend> = TokioOneShotSender<T>;
    type OneshotReceiver<T: OptionalSend> = tokio::sync::oneshot::Receiver<T>;
    type OneshotReceiverError = tokio::sync::oneshot::error::RecvError;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        tokio::task::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        tokio::time::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        tokio::time::sleep_until(deadline)
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        tokio::time::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        tokio::time::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        join_error.is_panic()
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        CpgRng
    }

    fn oneshot<T>() -> (Self::OneshotSender<T>, Self::OneshotReceiver<T>)
    where
        T: OptionalSend,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (TokioOneShotSender(tx), rx)
    }
}
