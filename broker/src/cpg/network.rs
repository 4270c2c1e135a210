//! openraft's network seam, carried over a [`Transport`]: every Raft RPC becomes one
//! request/response exchange addressed to the target's incarnation.

use std::sync::Arc;
use std::time::Duration;

use openraft::BasicNode;
use openraft::error::{InstallSnapshotError, RPCError, RaftError, Unreachable};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};

use super::transport::{Transport, TransportError};
use super::types::{CpgTypes, MemberId};
use super::wire::{Envelope, Request, Response};

/// Makes one [`PeerNetwork`] per target, as openraft asks.
pub(crate) struct NetworkFactory {
    /// The wire.
    pub transport: Arc<dyn Transport>,
    /// Upper bound of one exchange.
    pub rpc_timeout: Duration,
    /// Pause before retrying an unreachable peer.
    pub backoff: Duration,
}

impl RaftNetworkFactory<CpgTypes> for NetworkFactory {
    type Network = PeerNetwork;

    async fn new_client(&mut self, target: MemberId, node: &BasicNode) -> Self::Network {
        PeerNetwork {
            transport: Arc::clone(&self.transport),
            target,
            addr: node.addr.clone(),
            rpc_timeout: self.rpc_timeout,
            backoff: self.backoff,
        }
    }
}

/// Raft RPCs to one peer incarnation.
pub(crate) struct PeerNetwork {
    transport: Arc<dyn Transport>,
    target: MemberId,
    addr: String,
    rpc_timeout: Duration,
    backoff: Duration,
}

type RpcErr<E = openraft::error::Infallible> =
    RPCError<MemberId, BasicNode, RaftError<MemberId, E>>;

fn unreachable<E: std::error::Error>(e: TransportError) -> RPCError<MemberId, BasicNode, E> {
    RPCError::Unreachable(Unreachable::new(&e))
}

impl PeerNetwork {
    async fn call(&self, req: Request, option: &RPCOption) -> Result<Response, TransportError> {
        let timeout = self.rpc_timeout.min(option.hard_ttl());
        let env = Envelope {
            to: Some(self.target),
            req,
        };
        match self.transport.call(&self.addr, env, timeout).await? {
            Response::WrongTarget => Err(TransportError::Unreachable(format!(
                "member {} no longer listens at {}",
                self.target, self.addr
            ))),
            Response::Failed(why) => Err(TransportError::Unreachable(why)),
            other => Ok(other),
        }
    }
}

fn unexpected(resp: &Response) -> TransportError {
    TransportError::Codec(format!("unexpected response {resp:?}"))
}

impl RaftNetwork<CpgTypes> for PeerNetwork {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<CpgTypes>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<MemberId>, RpcErr> {
        match self
            .call(Request::Append(rpc), &option)
            .await
            .map_err(unreachable)?
        {
            Response::Append(r) => Ok(r),
            other => Err(unreachable(unexpected(&other))),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<CpgTypes>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<MemberId>, RpcErr<InstallSnapshotError>> {
        match self
            .call(Request::Snapshot(rpc), &option)
            .await
            .map_err(unreachable)?
        {
            Response::Snapshot(r) => Ok(r),
            other => Err(unreachable(unexpected(&other))),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<MemberId>,
        option: RPCOption,
    ) -> Result<VoteResponse<MemberId>, RpcErr> {
        match self
            .call(Request::Vote(rpc), &option)
            .await
            .map_err(unreachable)?
        {
            Response::Vote(r) => Ok(r),
            other => Err(unreachable(unexpected(&other))),
        }
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(std::iter::repeat(self.backoff))
    }
}
