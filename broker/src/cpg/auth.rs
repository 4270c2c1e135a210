//! Mutual challenge–response on the cluster secret, run first on every cluster connection.
//!
//! ```text
//! acceptor  -> dialer   : MAGIC, nonce_a (32 bytes)
//! dialer    -> acceptor : nonce_d (32), HMAC-SHA256(secret, "dial" | nonce_a | nonce_d)
//! acceptor  -> dialer   : HMAC-SHA256(secret, "accept" | nonce_d | nonce_a)
//! ```
//! Fresh nonces on both sides stop replay; the two labels stop reflecting one side's proof back
//! at it. The secret never crosses the wire. The exchange authenticates; it does not encrypt
//! the traffic that follows (TLS is the later step for that).

use hmac::{Hmac, KeyInit, Mac};
use rand08::RngCore;
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::runtime::CpgRng;
use super::transport::TransportError;

const MAGIC: &[u8; 8] = b"RMQCPG01";
const NONCE_BYTES: usize = 32;
const MAC_BYTES: usize = 32;

fn nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    CpgRng.fill_bytes(&mut n);
    n
}

fn mac(secret: &[u8], label: &[u8], first: &[u8], second: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length, so this cannot fail.
    let mut m =
        <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC accepts any key length");
    m.update(label);
    m.update(first);
    m.update(second);
    m
}

/// Runs the acceptor's side; `Err` means the peer does not know the secret (or spoke nonsense).
pub(crate) async fn accept<S>(stream: &mut S, secret: &[u8]) -> Result<(), TransportError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let nonce_a = nonce();
    let mut hello = Vec::with_capacity(MAGIC.len() + NONCE_BYTES);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&nonce_a);
    stream.write_all(&hello).await.map_err(TransportError::io)?;
    let mut reply = [0u8; NONCE_BYTES + MAC_BYTES];
    stream
        .read_exact(&mut reply)
        .await
        .map_err(TransportError::io)?;
    let (nonce_d, proof) = reply.split_at(NONCE_BYTES);
    mac(secret, b"dial", &nonce_a, nonce_d)
        .verify_slice(proof)
        .map_err(|_| TransportError::Auth("peer does not know the cluster secret".into()))?;
    let answer = mac(secret, b"accept", nonce_d, &nonce_a)
        .finalize()
        .into_bytes();
    stream
        .write_all(&answer)
        .await
        .map_err(TransportError::io)?;
    stream.flush().await.map_err(TransportError::io)
}

/// Runs the dialer's side; `Err` means the acceptor is not a member of our cluster.
pub(crate) async fn dial<S>(stream: &mut S, secret: &[u8]) -> Result<(), TransportError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut hello = [0u8; MAGIC.len() + NONCE_BYTES];
    stream
        .read_exact(&mut hello)
        .await
        .map_err(TransportError::io)?;
    let (magic, nonce_a) = hello.split_at(MAGIC.len());
    if magic != MAGIC {
        return Err(TransportError::Auth("not a ringmq cluster port".into()));
    }
    let nonce_d = nonce();
    let proof = mac(secret, b"dial", nonce_a, &nonce_d)
        .finalize()
        .into_bytes();
    let mut reply = Vec::with_capacity(NONCE_BYTES + MAC_BYTES);
    reply.extend_from_slice(&nonce_d);
    reply.extend_from_slice(&proof);
    stream.write_all(&reply).await.map_err(TransportError::io)?;
    stream.flush().await.map_err(TransportError::io)?;
    let mut answer = [0u8; MAC_BYTES];
    stream
        .read_exact(&mut answer)
        .await
        .map_err(TransportError::io)?;
    mac(secret, b"accept", &nonce_d, nonce_a)
        .verify_slice(&answer)
        .map_err(|_| TransportError::Auth("acceptor does not know the cluster secret".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn same_secret_authenticates_both_ways() {
        let (mut a, mut d) = tokio::io::duplex(256);
        let (ra, rd) = tokio::join!(accept(&mut a, b"s3cret"), dial(&mut d, b"s3cret"));
        assert_eq!((ra, rd), (Ok(()), Ok(())));
    }

    #[tokio::test]
    async fn wrong_secret_is_refused_by_the_acceptor() {
        let (mut a, mut d) = tokio::io::duplex(256);
        let (ra, rd) = tokio::join!(
            async move {
                // Dropping the acceptor's end is what a refused peer sees: the connection closes.
                let r = accept(&mut a, b"right").await;
                drop(a);
                r
            },
            dial(&mut d, b"wrong")
        );
        assert!(matches!(ra, Err(TransportError::Auth(_))));
        assert!(rd.is_err());
    }
}
