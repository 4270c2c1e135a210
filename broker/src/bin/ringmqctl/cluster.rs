//! `ringmqctl cluster …`: the cluster as one ring — its members in ring order and what each
//! holds — answered by any member from the cluster map (`GET /api/members`), and the ring
//! operations that change it (a queue's primary moved).

use crate::admin::{Conn, cells, client, send, table};
use anyhow::bail;
use clap::Subcommand;
use ringmq::admin_client::seg;
use serde_json::json;
use std::time::{Duration, Instant};

/// What `ringmqctl cluster` shows or does.
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// The ring: members in ring order with their zone, state, and the primaries and backups
    /// each holds (the same answer from any member).
    Ring,
    /// Moves a queue's primary to another member: it catches up as a backup, then takes
    /// over (consumers elsewhere get a cancel notification and redeliveries; publishes
    /// during the switch, a few milliseconds, are nacked and sent again).
    MoveQueue {
        /// The queue's vhost.
        vhost: String,
        /// The queue.
        queue: String,
        /// Node id of the member that becomes its primary.
        #[arg(long)]
        to: String,
        /// Waits until the member is the primary; exits non-zero if the move was called
        /// off or did not finish within --timeout.
        #[arg(long)]
        wait: bool,
        /// Seconds --wait waits at most.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Drains a member (its node id): it takes no new roles, its primaries move to other
    /// members and its backups are replaced (catch-up, then switch), its clients are
    /// closed with 320 and go to the others. It stays a member, marked draining, until
    /// it leaves or is undrained.
    Drain {
        /// Node id of the member.
        node: String,
        /// Waits until the member holds no primary and no backup; exits non-zero if that
        /// takes longer than --timeout.
        #[arg(long)]
        wait: bool,
        /// Seconds --wait waits at most.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
    /// Undrains a member: it takes roles again (what moved off stays where it is).
    Undrain {
        /// Node id of the member.
        node: String,
    },
}

/// Runs `ringmqctl cluster <command>`.
pub fn run(conn: &Conn, command: &ClusterCommand) -> anyhow::Result<()> {
    match command {
        ClusterCommand::Ring => ring(conn),
        ClusterCommand::MoveQueue {
            vhost,
            queue,
            to,
            wait,
            timeout,
        } => move_queue(
            conn,
            vhost,
            queue,
            to,
            wait.then(|| Duration::from_secs(*timeout)),
        ),
        ClusterCommand::Drain {
            node,
            wait,
            timeout,
        } => drain(conn, node, wait.then(|| Duration::from_secs(*timeout))),
        ClusterCommand::Undrain { node } => {
            let path = format!("/api/members/{}/undrain", seg(node));
            send(&client(conn), "POST", &path, None)?;
            println!("member {node}: undrained");
            Ok(())
        }
    }
}

/// `cluster drain`: marks the member draining, then with `wait` follows what it holds until
/// it holds nothing.
fn drain(conn: &Conn, node: &str, wait: Option<Duration>) -> anyhow::Result<()> {
    let c = client(conn);
    let path = format!("/api/members/{}", seg(node));
    send(&c, "POST", &format!("{path}/drain"), None)?;
    let Some(patience) = wait else {
        println!("member {node}: draining");
        return Ok(());
    };
    let deadline = Instant::now() + patience;
    loop {
        let m = send(&c, "GET", &path, None)?.body;
        let (primaries, backups) = (m["primaries"].as_u64(), m["backups"].as_u64());
        if primaries == Some(0) && backups == Some(0) {
            println!("member {node}: drained (it holds no queue: it can be removed without loss)");
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "member {node}: still holds {} primaries and {} backups after {} s: see the members' logs",
                m["primaries"],
                m["backups"],
                patience.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `cluster move-queue`: asks for the move, then with `wait` follows the queue until `to`
/// is its primary.
fn move_queue(
    conn: &Conn,
    vhost: &str,
    queue: &str,
    to: &str,
    wait: Option<Duration>,
) -> anyhow::Result<()> {
    let c = client(conn);
    let path = format!("/api/queues/{}/{}", seg(vhost), seg(queue));
    send(
        &c,
        "POST",
        &format!("{path}/move"),
        Some(&json!({"to": to})),
    )?;
    let Some(patience) = wait else {
        println!("queue {queue}: moving to {to}");
        return Ok(());
    };
    let deadline = Instant::now() + patience;
    loop {
        let q = send(&c, "GET", &path, None)?.body;
        if q["node"] == to {
            println!("queue {queue}: its primary is {to}");
            return Ok(());
        }
        if q["moving_to"] != to {
            bail!(
                "queue {queue}: the move to {to} was called off (primary {}, moving to {}): see the members' logs",
                q["node"],
                q["moving_to"]
            );
        }
        if Instant::now() >= deadline {
            bail!(
                "queue {queue}: still moving to {to} after {} s (in-sync backups: {})",
                patience.as_secs(),
                q["in_sync_backup_nodes"]
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn ring(conn: &Conn) -> anyhow::Result<()> {
    let members = send(&client(conn), "GET", "/api/members", None)?.body;
    if conn.json {
        println!("{members}");
        return Ok(());
    }
    let cols = [
        "ring_position",
        "id",
        "zone",
        "state",
        "primaries",
        "backups",
        "in_sync_backups",
        "amqp",
    ];
    let rows: Vec<Vec<String>> = members
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| cells(m, &cols))
        .collect();
    table(
        &[
            "position",
            "member",
            "zone",
            "state",
            "primaries",
            "backups",
            "in-sync",
            "amqp",
        ],
        &rows,
    );
    Ok(())
}
