//! Stored passwords. New ones are PBKDF2-HMAC-SHA256 with a random 16-byte salt (ring's
//! implementation, the same library that does TLS), written in a self-describing string
//! `$pbkdf2-sha256$i=ITERATIONS$SALT$DIGEST` (base64 without padding, the PHC layout) so that
//! the iteration count can be raised later without breaking stored hashes. RabbitMQ's
//! `rabbit_password_hashing_sha256` (one salted SHA-256) is still read, so definitions
//! exported from RabbitMQ import unchanged; it is never produced for a new password.

use base64::Engine;
use ring::rand::SecureRandom;
use std::num::NonZeroU32;
use thiserror::Error;

/// RabbitMQ's default algorithm since 3.6: base64(salt[4] ‖ SHA-256(salt ‖ password)).
pub const RABBIT_SHA256: &str = "rabbit_password_hashing_sha256";

/// ringmq's algorithm name in definitions: the self-describing PBKDF2 string.
pub const PBKDF2_SHA256: &str = "ringmq_pbkdf2_sha256";

/// Default PBKDF2 iterations: OWASP's 2023 figure for PBKDF2-HMAC-SHA256. About 170 ms of
/// CPU per cold check on the reference machine (release build); repeat logins hit the
/// verification cache in the user store instead.
pub const DEFAULT_ITERATIONS: u32 = 600_000;

/// Fewest iterations accepted, in config or in a stored hash: below this the hash is not
/// worth the name.
pub const MIN_ITERATIONS: u32 = 1_000;

/// Most iterations accepted in a stored hash: bounds the CPU one login may cost.
pub const MAX_ITERATIONS: u32 = 10_000_000;

const PHC_PREFIX: &str = "$pbkdf2-sha256$";
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD_NO_PAD;

/// Why a stored hash could not be read; the text says what a valid one looks like.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum HashError {
    /// The algorithm name is not one this broker reads.
    #[error(
        "hashing_algorithm '{0}' is not supported: use {PBKDF2_SHA256}, {RABBIT_SHA256} (RabbitMQ's default) or send a plaintext password"
    )]
    UnknownAlgorithm(String),
    /// A RabbitMQ hash that is not base64 of 36 bytes.
    #[error("password_hash must be base64 of a 4-byte salt and a SHA-256 digest")]
    BadRabbitHash,
    /// A PBKDF2 string that does not parse or has an iteration count out of range.
    #[error(
        "password_hash must look like $pbkdf2-sha256$i=N$SALT$DIGEST with {MIN_ITERATIONS} <= N <= {MAX_ITERATIONS} (ringmqctl hash-password prints one)"
    )]
    BadPbkdf2Hash,
}

/// A stored password.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PasswordHash {
    /// PBKDF2-HMAC-SHA256: what every new password gets.
    Pbkdf2 {
        /// Iteration count.
        iterations: u32,
        /// Random salt (16 bytes for new hashes).
        salt: Vec<u8>,
        /// Derived key.
        digest: [u8; 32],
    },
    /// RabbitMQ's salted SHA-256, read from imported definitions or config.
    RabbitSha256 {
        /// 4-byte salt.
        salt: [u8; 4],
        /// SHA-256(salt ‖ password).
        digest: [u8; 32],
    },
    /// No password matches: RabbitMQ's empty `password_hash` (a user that can only log in
    /// with EXTERNAL, or not at all).
    Locked,
}

impl PasswordHash {
    /// Hashes `password` with PBKDF2 and a fresh random salt.
    pub fn new(password: &str, iterations: u32) -> Self {
        let mut salt = vec![0u8; 16];
        ring::rand::SystemRandom::new()
            .fill(&mut salt)
            .expect("the operating system's random source is available");
        let iterations = iterations.clamp(MIN_ITERATIONS, MAX_ITERATIONS);
        let digest = pbkdf2(iterations, &salt, password);
        Self::Pbkdf2 {
            iterations,
            salt,
            digest,
        }
    }

    /// A hash no password matches.
    pub fn locked() -> Self {
        Self::Locked
    }

    /// Reads a stored hash. `algorithm` is the definitions' `hashing_algorithm`; without one
    /// the format is recognised by its shape (a `$pbkdf2-sha256$` string, else RabbitMQ's
    /// base64). An empty hash is [`PasswordHash::Locked`].
    pub fn parse(text: &str, algorithm: Option<&str>) -> Result<Self, HashError> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(Self::Locked);
        }
        let pbkdf2 = match algorithm {
            Some(PBKDF2_SHA256) => true,
            Some(RABBIT_SHA256) => false,
            Some(other) => return Err(HashError::UnknownAlgorithm(other.to_owned())),
            None => text.starts_with(PHC_PREFIX),
        };
        if pbkdf2 {
            Self::parse_phc(text).ok_or(HashError::BadPbkdf2Hash)
        } else {
            Self::parse_rabbit(text).ok_or(HashError::BadRabbitHash)
        }
    }

    fn parse_rabbit(text: &str) -> Option<Self> {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(text)
            .ok()?;
        if raw.len() != 36 {
            return None;
        }
        Some(Self::RabbitSha256 {
            salt: raw[..4].try_into().ok()?,
            digest: raw[4..].try_into().ok()?,
        })
    }

    fn parse_phc(text: &str) -> Option<Self> {
        let mut parts = text.strip_prefix(PHC_PREFIX)?.split('$');
        let iterations: u32 = parts.next()?.strip_prefix("i=")?.parse().ok()?;
        let salt = B64.decode(parts.next()?).ok()?;
        let digest: [u8; 32] = B64.decode(parts.next()?).ok()?.try_into().ok()?;
        if parts.next().is_some()
            || !(MIN_ITERATIONS..=MAX_ITERATIONS).contains(&iterations)
            || salt.len() < 8
            || salt.len() > 64
        {
            return None;
        }
        Some(Self::Pbkdf2 {
            iterations,
            salt,
            digest,
        })
    }

    /// The `hashing_algorithm` of a definitions export.
    pub fn algorithm(&self) -> &'static str {
        match self {
            Self::Pbkdf2 { .. } => PBKDF2_SHA256,
            Self::RabbitSha256 { .. } | Self::Locked => RABBIT_SHA256,
        }
    }

    /// The `password_hash` of a definitions export: what [`PasswordHash::parse`] reads back.
    pub fn encoded(&self) -> String {
        match self {
            Self::Pbkdf2 {
                iterations,
                salt,
                digest,
            } => format!(
                "{PHC_PREFIX}i={iterations}${}${}",
                B64.encode(salt),
                B64.encode(digest)
            ),
            Self::RabbitSha256 { salt, digest } => {
                let mut raw = Vec::with_capacity(36);
                raw.extend_from_slice(salt);
                raw.extend_from_slice(digest);
                base64::engine::general_purpose::STANDARD.encode(raw)
            }
            Self::Locked => String::new(),
        }
    }

    /// Whether checking a password costs real CPU (so a successful check is worth caching).
    pub fn is_slow(&self) -> bool {
        matches!(self, Self::Pbkdf2 { .. })
    }

    /// Whether `password` is the one hashed; constant time in the digest comparison.
    pub fn matches(&self, password: &str) -> bool {
        match self {
            Self::Pbkdf2 {
                iterations,
                salt,
                digest,
            } => ring::pbkdf2::verify(
                ring::pbkdf2::PBKDF2_HMAC_SHA256,
                NonZeroU32::new(*iterations).unwrap_or(NonZeroU32::MIN),
                salt,
                password.as_bytes(),
                digest,
            )
            .is_ok(),
            Self::RabbitSha256 { salt, digest } => {
                constant_time_eq(&rabbit_sha256(salt, password), digest)
            }
            Self::Locked => false,
        }
    }
}

fn pbkdf2(iterations: u32, salt: &[u8], password: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    ring::pbkdf2::derive(
        ring::pbkdf2::PBKDF2_HMAC_SHA256,
        NonZeroU32::new(iterations).unwrap_or(NonZeroU32::MIN),
        salt,
        password.as_bytes(),
        &mut out,
    );
    out
}

/// RabbitMQ's `rabbit_password_hashing_sha256` digest.
pub fn rabbit_sha256(salt: &[u8; 4], password: &str) -> [u8; 32] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    h.finalize().into()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_hashes_are_pbkdf2_with_a_random_salt_and_round_trip() {
        let a = PasswordHash::new("s3cret", MIN_ITERATIONS);
        let b = PasswordHash::new("s3cret", MIN_ITERATIONS);
        assert_ne!(a, b, "two hashes of one password differ by salt");
        assert!(a.matches("s3cret") && !a.matches("s3cres"));
        let text = a.encoded();
        assert!(text.starts_with("$pbkdf2-sha256$i=1000$"), "{text}");
        assert_eq!(PasswordHash::parse(&text, None).unwrap(), a);
        assert_eq!(PasswordHash::parse(&text, Some(PBKDF2_SHA256)).unwrap(), a);
        assert_eq!(a.algorithm(), PBKDF2_SHA256);
    }

    #[test]
    fn rabbitmq_hashes_are_still_accepted() {
        // What `rabbitmqctl hash_password s3cret` writes, for salt 01020304.
        let salt = [1, 2, 3, 4];
        let mut raw = salt.to_vec();
        raw.extend_from_slice(&rabbit_sha256(&salt, "s3cret"));
        let text = base64::engine::general_purpose::STANDARD.encode(raw);
        for algorithm in [None, Some(RABBIT_SHA256)] {
            let h = PasswordHash::parse(&text, algorithm).unwrap();
            assert!(h.matches("s3cret") && !h.matches("guest"));
            assert_eq!(h.encoded(), text);
        }
    }

    #[test]
    fn malformed_hashes_and_unknown_algorithms_are_refused() {
        assert_eq!(PasswordHash::parse("", None).unwrap(), PasswordHash::Locked);
        assert!(!PasswordHash::Locked.matches(""));
        assert_eq!(
            PasswordHash::parse("not base64!", None),
            Err(HashError::BadRabbitHash)
        );
        assert_eq!(
            PasswordHash::parse("AAAA", None),
            Err(HashError::BadRabbitHash)
        );
        assert!(matches!(
            PasswordHash::parse("AAAA", Some("rabbit_password_hashing_md5")),
            Err(HashError::UnknownAlgorithm(_))
        ));
        let good = PasswordHash::new("x", MIN_ITERATIONS).encoded();
        for bad in [
            good.replace("i=1000", "i=1"),
            good.replace("i=1000", "i=99999999999"),
            format!("{good}$extra"),
            "$pbkdf2-sha256$i=1000$AAAA".to_owned(),
        ] {
            assert_eq!(
                PasswordHash::parse(&bad, None),
                Err(HashError::BadPbkdf2Hash),
                "{bad}"
            );
        }
    }
}
