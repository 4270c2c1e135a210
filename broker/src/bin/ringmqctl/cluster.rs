//! `ringmqctl cluster …`: the cluster as one ring — its members in ring order and what each
//! holds — answered by any member from the cluster map (`GET /api/members`).

use crate::admin::{Conn, cells, client, send, table};
use clap::Subcommand;

/// What `ringmqctl cluster` shows or does.
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// The ring: members in ring order with their zone, state, and the primaries and backups
    /// each holds (the same answer from any member).
    Ring,
}

/// Runs `ringmqctl cluster <command>`.
pub fn run(conn: &Conn, command: &ClusterCommand) -> anyhow::Result<()> {
    match command {
        ClusterCommand::Ring => ring(conn),
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
