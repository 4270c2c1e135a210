//! Pure ring planner for ringmq.
//!
//! The operator and (later) the brokers must agree on who owns what without talking to each
//! other about it, so every function here is deterministic: the same members and resources
//! always give the same ring, the same placement and the same plans. Nothing here does I/O,
//! spawns tasks or reads a clock, which is what lets it be property-tested exhaustively and
//! embedded in the broker unchanged.
//!
//! * [`ring`]: the ring order, zone-interleaved so neighbours sit in different zones.
//! * [`placement`]: a resource's primary and its `k` backups (the next members on the ring).
//! * [`insert`]: where a new member enters the ring so that the fewest backups move.
//! * [`rebalance`]: a bounded list of ownership moves (with the backup ships they imply) that
//!   evens primaries per member.

pub mod insert;
pub mod placement;
pub mod rebalance;
pub mod ring;

pub use insert::{InsertionPoint, insertion_cost, insertion_point};
pub use placement::{Assignment, MAX_BACKUPS, Placement, PlanError, Resource};
pub use rebalance::{BackupShip, OwnershipMove, RebalanceBounds, RebalancePlan, rebalance_plan};
pub use ring::{Member, min_same_zone_neighbours, ring_order, same_zone_neighbours};
