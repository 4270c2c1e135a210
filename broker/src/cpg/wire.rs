//! What members say to each other on the cluster port, and how it is framed: a 4-byte
//! big-endian length, then a postcard-encoded message. One request, then its response.

use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::transport::TransportError;
use super::types::{Command, CpgTypes, MemberId, Outcome};

/// A request and the incarnation it is meant for. `to: None` means "whoever listens at that
/// address" (admission, leader discovery); Raft traffic always names its target so that a
/// restarted member on the same address never takes messages meant for its previous life.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Envelope {
    /// Intended incarnation.
    pub to: Option<MemberId>,
    /// The request.
    pub req: Request,
}

/// Requests between members.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Request {
    /// Raft log replication / heartbeat.
    Append(AppendEntriesRequest<CpgTypes>),
    /// Raft election.
    Vote(VoteRequest<MemberId>),
    /// Raft snapshot chunk.
    Snapshot(InstallSnapshotRequest<CpgTypes>),
    /// Lease renewal and liveness proof from `from` to the leader.
    Ping {
        /// Member renewing its lease.
        from: MemberId,
        /// The pinger's current term (its vote).
        term: u64,
        /// How long ago, on the pinger's clock, it last acknowledged a leader of a term below
        /// `term` (0 while such an append is still being handled). A new leader of `term`
        /// counts silent members' failure clocks from there (`Lease::suspects`).
        since_older_ms: u64,
    },
    /// A member asks to be admitted as a voter (or, already one, to have its address updated).
    Join {
        /// The member.
        id: MemberId,
        /// Its cluster address.
        addr: String,
    },
    /// A follower forwards a command to the leader.
    Write(Command),
    /// A follower asks the leader for the newest committed index, confirmed by a majority
    /// (a read index).
    ReadIndex,
    /// A member leaving for good asks the leader to remove it from the voters (last, so that
    /// the variants before it keep their postcard tags: an older member that cannot read it
    /// breaks only this call).
    Retire {
        /// The member leaving.
        id: MemberId,
    },
}

/// Responses between members.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Response {
    /// Answer to [`Request::Append`].
    Append(AppendEntriesResponse<MemberId>),
    /// Answer to [`Request::Vote`].
    Vote(VoteResponse<MemberId>),
    /// Answer to [`Request::Snapshot`].
    Snapshot(InstallSnapshotResponse<MemberId>),
    /// Answer to [`Request::Ping`] from the leader.
    Pong {
        /// Log index of the leader's membership, so a member ignores a leader whose view of the
        /// membership is older than its own.
        membership_index: u64,
        /// False once the leader's committed membership no longer has the pinger.
        member: bool,
        /// What is left of the leader's quorum lease, granted to the pinger (0: none).
        granted_ms: u64,
        /// The leader's applied (so committed) index when it answered: the lease counts for
        /// the pinger only once it has applied as far, so that a member reporting quorum is
        /// never far behind (a member that reconnects after a cut is not current yet).
        committed: u64,
    },
    /// Answer to [`Request::Join`]: admitted as a voter.
    Joined,
    /// Answer to [`Request::Write`]: committed and applied.
    Written(Outcome),
    /// Answer to [`Request::ReadIndex`].
    ReadIndex(u64),
    /// This member is not the leader; try `leader` if known.
    NotLeader {
        /// Address of the leader as this member knows it.
        leader: Option<String>,
    },
    /// The request named another incarnation than the one listening here.
    WrongTarget,
    /// The request failed here; the text says why.
    Failed(String),
    /// Answer to [`Request::Retire`]: the member is no longer a voter (the removal is
    /// committed, or it was not one).
    Retired,
}

/// Writes one frame.
pub(crate) async fn write_frame<W, T>(w: &mut W, msg: &T) -> Result<(), TransportError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    let body = postcard::to_stdvec(msg).map_err(|e| TransportError::Codec(e.to_string()))?;
    let len =
        u32::try_from(body.len()).map_err(|_| TransportError::Codec("frame too large".into()))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf).await.map_err(TransportError::io)?;
    w.flush().await.map_err(TransportError::io)
}

/// Reads one frame of at most `max_frame_bytes`.
pub(crate) async fn read_frame<R, T>(r: &mut R, max_frame_bytes: usize) -> Result<T, TransportError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await.map_err(TransportError::io)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max_frame_bytes {
        return Err(TransportError::Codec(format!(
            "frame of {len} bytes exceeds max_frame_bytes {max_frame_bytes}"
        )));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(TransportError::io)?;
    postcard::from_bytes(&body).map_err(|e| TransportError::Codec(e.to_string()))
}
