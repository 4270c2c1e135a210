//! The admin HTTP API, health and metrics, against a real broker process: every endpoint's
//! happy path and errors, auth by tag, definitions round trips, and metrics that move with a
//! known load.
//! One file per concept.

mod access;
mod connections;
mod definitions;
mod health;
mod metrics;
mod support;
mod wiring;
