//! Failed logins per source address: after `max_failures` failures within `window` from one
//! IP address, further logins from it are refused without a password check until the window
//! that started with its first failure has passed. This bounds online password guessing and
//! the CPU an attacker can burn on PBKDF2 checks. The table holds at most `max_sources`
//! addresses; when full, expired windows go first, then the oldest.
//!
//! Pure: the caller passes the time, so tests need no clock.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Most addresses tracked at once (a few hundred KiB at most).
pub const MAX_SOURCES: usize = 10_000;

#[derive(Debug, Clone, Copy)]
struct Window {
    started: Instant,
    failures: u32,
}

/// Failed-login counters per source address.
#[derive(Debug)]
pub struct LoginLimiter {
    max_failures: u32,
    window: Duration,
    max_sources: usize,
    table: Mutex<HashMap<IpAddr, Window>>,
}

impl LoginLimiter {
    /// A limiter allowing `max_failures` failures per `window` per address (0 = no limit),
    /// tracking at most `max_sources` addresses.
    pub fn new(max_failures: u32, window: Duration, max_sources: usize) -> Self {
        Self {
            max_failures,
            window,
            max_sources: max_sources.max(1),
            table: Mutex::new(HashMap::new()),
        }
    }

    /// How long `ip` must still wait, if it used up its failures; None when it may try.
    pub fn blocked_for(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        if self.max_failures == 0 {
            return None;
        }
        let table = self.table.lock();
        let w = table.get(&ip)?;
        let ends = w.started + self.window;
        (w.failures >= self.max_failures && now < ends).then(|| ends - now)
    }

    /// Counts one failed login from `ip`.
    pub fn record_failure(&self, ip: IpAddr, now: Instant) {
        if self.max_failures == 0 {
            return;
        }
        let mut table = self.table.lock();
        if !table.contains_key(&ip) && table.len() >= self.max_sources {
            let window = self.window;
            table.retain(|_, w| now < w.started + window);
            if table.len() >= self.max_sources
                && let Some(oldest) = table.iter().min_by_key(|(_, w)| w.started).map(|(k, _)| *k)
            {
                table.remove(&oldest);
            }
        }
        let w = table.entry(ip).or_insert(Window {
            started: now,
            failures: 0,
        });
        if now >= w.started + self.window {
            *w = Window {
                started: now,
                failures: 0,
            };
        }
        w.failures = w.failures.saturating_add(1);
    }

    /// Addresses tracked now (for tests and metrics).
    pub fn tracked(&self) -> usize {
        self.table.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(n: u32) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(n))
    }

    #[test]
    fn an_address_is_blocked_after_max_failures_until_its_window_ends() {
        let l = LoginLimiter::new(3, Duration::from_secs(10), 100);
        let t0 = Instant::now();
        for i in 0..3 {
            assert_eq!(l.blocked_for(ip(1), t0), None, "attempt {i}");
            l.record_failure(ip(1), t0 + Duration::from_secs(i));
        }
        assert_eq!(
            l.blocked_for(ip(1), t0 + Duration::from_secs(4)),
            Some(Duration::from_secs(6))
        );
        assert_eq!(
            l.blocked_for(ip(2), t0),
            None,
            "other addresses are not affected"
        );
        assert_eq!(l.blocked_for(ip(1), t0 + Duration::from_secs(10)), None);
        // A failure after the window starts a new one.
        l.record_failure(ip(1), t0 + Duration::from_secs(11));
        assert_eq!(l.blocked_for(ip(1), t0 + Duration::from_secs(12)), None);
    }

    #[test]
    fn zero_means_no_limit() {
        let l = LoginLimiter::new(0, Duration::from_secs(10), 100);
        let t0 = Instant::now();
        for _ in 0..100 {
            l.record_failure(ip(1), t0);
        }
        assert_eq!(l.blocked_for(ip(1), t0), None);
        assert_eq!(l.tracked(), 0);
    }

    #[test]
    fn the_table_never_exceeds_its_bound() {
        let l = LoginLimiter::new(2, Duration::from_secs(10), 50);
        let t0 = Instant::now();
        for n in 0..10_000u32 {
            l.record_failure(ip(n), t0 + Duration::from_millis(u64::from(n)));
            assert!(l.tracked() <= 50);
        }
        // The newest addresses are the ones kept.
        l.record_failure(ip(9_999), t0 + Duration::from_millis(9_999));
        assert!(
            l.blocked_for(ip(9_999), t0 + Duration::from_millis(10_000))
                .is_some()
        );
    }
}
