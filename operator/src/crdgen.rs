//! Prints the CustomResourceDefinitions as YAML, for `crds/` and the chart.
//!
//! Why a binary: the CRDs are generated from the Rust types so they cannot drift from the
//! code; `cargo run --bin crdgen > crds/ringmq.yaml` regenerates them.

fn main() -> anyhow::Result<()> {
    print!("{}", ringmq_operator::crd::render_yaml()?);
    Ok(())
}
