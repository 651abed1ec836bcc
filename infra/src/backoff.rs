//! The one retry backoff of the workspace: exponential, capped, with jitter, so that the
//! tasks of a fleet that failed together (a database outage) do not retry together.
//!
//! The bound of attempt `n` (0 for the first retry) is `initial × 2ⁿ`, capped at `max`; the
//! wait is drawn uniformly between half the bound and the bound ("equal jitter"). Half the
//! bound is a floor: a retry never comes sooner than half the configured first wait, and a
//! task that keeps failing still slows down. The randomness is `rand`'s thread generator
//! (already in the tree under sqlx); [`Backoff::delay_at`] takes the draw as an argument, for
//! tests. See docs/DECISIONS.md, "Jittered backoff".

use std::time::Duration;

use rand::Rng as _;

/// An exponential backoff with equal jitter: see the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Backoff {
    /// A backoff starting at `initial`, doubling per attempt, never above `max` (nor below
    /// half of `initial`).
    pub const fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff { initial, max }
    }

    /// The bound of attempt `attempt` (0: the first retry): `initial × 2^attempt`, at most
    /// `max` (and at least `initial` when `max` is below it).
    pub fn bound(&self, attempt: u32) -> Duration {
        let shift = attempt.min(31);
        self.initial.saturating_mul(1u32 << shift).min(self.max.max(self.initial))
    }

    /// The wait before attempt `attempt`, jittered by the thread's random generator.
    pub fn delay(&self, attempt: u32) -> Duration {
        self.delay_at(attempt, rand::thread_rng().gen::<f64>())
    }

    /// The wait before attempt `attempt` for the draw `unit` (in `[0, 1)`): the bound's
    /// half plus `unit` times the other half.
    pub fn delay_at(&self, attempt: u32, unit: f64) -> Duration {
        debug_assert!((0.0..=1.0).contains(&unit), "a draw in [0, 1): {unit}");
        let bound = self.bound(attempt);
        let half = bound / 2;
        let delay = half + (bound - half).mul_f64(unit.clamp(0.0, 1.0));
        debug_assert!(delay <= bound && delay >= half);
        delay
    }
}

/// Successive waits of one retry loop: [`Backoff::delay`] of attempt 0, 1, 2, … until
/// [`Attempts::reset`].
#[derive(Clone, Debug)]
pub struct Attempts {
    backoff: Backoff,
    attempt: u32,
}

impl Attempts {
    pub fn new(backoff: Backoff) -> Attempts {
        Attempts { backoff, attempt: 0 }
    }

    /// The next wait (and counts the attempt).
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.backoff.delay(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        delay
    }

    /// After a success: the next failure waits as the first did.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn the_bound_doubles_to_the_cap() {
        let b = Backoff::new(MS(100), MS(1_000));
        let bounds: Vec<u64> = (0..6).map(|n| b.bound(n).as_millis() as u64).collect();
        assert_eq!(bounds, [100, 200, 400, 800, 1_000, 1_000]);
        assert_eq!(b.bound(u32::MAX), MS(1_000), "no overflow");
        assert_eq!(Backoff::new(MS(500), MS(100)).bound(3), MS(500), "a cap below the first wait");
    }

    #[test]
    fn the_wait_lies_between_half_the_bound_and_the_bound() {
        let b = Backoff::new(MS(100), MS(30_000));
        for (attempt, unit, expected) in
            [(0, 0.0, 50), (0, 0.5, 75), (0, 0.999_999, 99), (3, 0.0, 400), (20, 0.5, 22_500)]
        {
            assert_eq!(b.delay_at(attempt, unit).as_millis() as u64, expected, "attempt {attempt}, draw {unit}");
        }
    }

    /// What jitter is for: tasks failing together spread their retries over the window.
    #[test]
    fn retries_of_many_tasks_spread_over_the_window() {
        let b = Backoff::new(MS(1_000), MS(30_000));
        let waits: Vec<Duration> = (0..200).map(|_| b.delay(2)).collect();
        assert!(waits.iter().all(|w| *w >= MS(2_000) && *w <= MS(4_000)), "{waits:?}");
        let distinct: std::collections::BTreeSet<Duration> = waits.iter().copied().collect();
        assert!(distinct.len() > 150, "{} distinct waits of 200", distinct.len());
        let (min, max) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
        assert!(*max - *min > MS(1_500), "spread over {min:?}..{max:?}");
    }

    #[test]
    fn attempts_grow_and_reset() {
        let mut a = Attempts::new(Backoff::new(MS(100), MS(10_000)));
        let first = a.next_delay();
        assert!(first >= MS(50) && first <= MS(100));
        for _ in 0..5 {
            a.next_delay();
        }
        let sixth = a.next_delay();
        assert!(sixth >= MS(3_200) && sixth <= MS(6_400), "{sixth:?}");
        a.reset();
        assert!(a.next_delay() <= MS(100));
    }
}
