//! A TCP relay in front of a broker whose connections a test can cut, or mute one way: the
//! faults a failover client must ride through, at the moment a test chooses.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The relay: every relayed connection ends at once, without a close, when it is cut — as
/// when a member dies or the network drops it.
pub(crate) struct Cutter {
    pub(crate) addr: std::net::SocketAddr,
    cuts: watch::Sender<u64>,
    pub(crate) relayed: Arc<AtomicU64>,
    /// Bytes from the broker are dropped (its answers are lost on the way).
    mute_down: Arc<AtomicBool>,
    /// Bytes from the client are dropped (its requests are lost on the way).
    mute_up: Arc<AtomicBool>,
}

/// Copies `from` to `to`, dropping what arrives while `muted`.
async fn copy_unless_muted(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    muted: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) if muted.load(Ordering::Acquire) => {}
            Ok(n) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

impl Cutter {
    pub(crate) async fn start(upstream: std::net::SocketAddr) -> Cutter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cuts, _) = watch::channel(0u64);
        let relayed = Arc::new(AtomicU64::new(0));
        let mute_down = Arc::new(AtomicBool::new(false));
        let mute_up = Arc::new(AtomicBool::new(false));
        let (cut_rx, count) = (cuts.subscribe(), relayed.clone());
        let (down, up) = (mute_down.clone(), mute_up.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                count.fetch_add(1, Ordering::Relaxed);
                let mut cut = cut_rx.clone();
                cut.borrow_and_update();
                let (down, up) = (down.clone(), up.clone());
                tokio::spawn(async move {
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    // Dropped without a shutdown: both peers see the connection end abruptly.
                    tokio::select! {
                        () = copy_unless_muted(cr, sw, up) => {}
                        () = copy_unless_muted(sr, cw, down) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Cutter {
            addr,
            cuts,
            relayed,
            mute_down,
            mute_up,
        }
    }

    /// Ends every connection relayed so far.
    pub(crate) fn cut(&self) {
        self.cuts.send_modify(|n| *n += 1);
    }

    /// From now on the broker's bytes are dropped (`true`) or relayed again.
    pub(crate) fn mute_down(&self, muted: bool) {
        self.mute_down.store(muted, Ordering::Release);
    }

    /// From now on the client's bytes are dropped (`true`) or relayed again.
    pub(crate) fn mute_up(&self, muted: bool) {
        self.mute_up.store(muted, Ordering::Release);
    }
}
